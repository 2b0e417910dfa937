//! File sources: one backend URL per line (`http://host:port`), `#` starts
//! a comment, blank lines are skipped. The file is read again every poll
//! and parsed only when its text changed, so a malformed line is reported
//! once per change, with its line number, and skipped. Each read runs on a
//! short-lived thread of its own, waited for at most `discovery.timeout_ms`,
//! so a file system that hangs (a dead NFS server) stalls only this source,
//! with at most one reader thread stuck on it.

use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use tracing::warn;
use xxhash_rust::xxh3::xxh3_64;

use super::Answer;
use crate::config::backend_addr;

/// Longest file read: a list of a thousand URLs is 30 KB; anything near
/// this is not a backend list.
const MAX_FILE_BYTES: u64 = 1 << 20;

/// The file's bytes, or why not.
type ReadResult = Result<Vec<u8>, String>;

/// What a file source remembers between polls.
#[derive(Debug, Default)]
pub struct FileState {
    /// Hash of the text last parsed, and what it gave.
    parsed: Option<(u64, Answer)>,
    /// A read that outlived its deadline: waited for again at the next poll
    /// instead of starting another.
    pending: Option<mpsc::Receiver<ReadResult>>,
}

/// Reads `path` (within `timeout`) and gives its backends (sorted); the
/// text is parsed again only when it changed since the last poll (`state`).
pub fn read(path: &Path, state: &mut FileState, timeout: Duration) -> Answer {
    let text = match read_bytes(path, state, timeout) {
        Ok(t) => t,
        Err(e) => return Answer::Failed(e),
    };
    let hash = xxh3_64(&text);
    if let Some((h, answer)) = &state.parsed
        && *h == hash
    {
        return answer.clone();
    }
    let (urls, bad) = parse(&String::from_utf8_lossy(&text));
    for (line, why) in &bad {
        warn!(file = %path.display(), line, error = %why, "skipping a malformed backend line");
    }
    let answer = match (urls.is_empty(), bad.is_empty()) {
        (false, _) => Answer::Found(urls),
        (true, true) => Answer::Empty,
        // Only malformed lines: a broken file, not an empty fleet.
        (true, false) => Answer::Failed(format!(
            "{}: no valid backend line ({} malformed)",
            path.display(),
            bad.len()
        )),
    };
    state.parsed = Some((hash, answer.clone()));
    answer
}

fn read_bytes(path: &Path, state: &mut FileState, timeout: Duration) -> ReadResult {
    let rx = match state.pending.take() {
        Some(rx) => rx,
        None => {
            let (tx, rx) = mpsc::channel();
            let p = path.to_owned();
            std::thread::Builder::new()
                .name("discovery-file".into())
                .spawn(move || {
                    let _ = tx.send(read_whole(&p));
                })
                .map_err(|e| format!("reading {}: no thread: {e}", path.display()))?;
            rx
        }
    };
    match rx.recv_timeout(timeout) {
        Ok(r) => r,
        Err(mpsc::RecvTimeoutError::Timeout) => {
            state.pending = Some(rx);
            Err(format!(
                "reading {}: no answer within {} ms",
                path.display(),
                timeout.as_millis()
            ))
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            Err(format!("reading {}: the reader died", path.display()))
        }
    }
}

fn read_whole(path: &Path) -> ReadResult {
    let failed = |e: std::io::Error| format!("reading {}: {e}", path.display());
    let len = std::fs::metadata(path).map_err(failed)?.len();
    if len > MAX_FILE_BYTES {
        return Err(format!(
            "{}: {len} bytes, more than {MAX_FILE_BYTES}",
            path.display()
        ));
    }
    std::fs::read(path).map_err(failed)
}

/// The URLs of `text` (sorted, without duplicates) and each malformed
/// line's number (from 1) with the reason. Host names are resolved here
/// (the discovery thread, never a worker).
pub fn parse(text: &str) -> (Vec<String>, Vec<(usize, String)>) {
    let mut urls = Vec::new();
    let mut bad = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        match backend_addr(line) {
            Ok(_) => urls.push(line.trim_end_matches('/').to_owned()),
            Err(e) => bad.push((i + 1, format!("{e:#}"))),
        }
    }
    urls.sort();
    urls.dedup();
    (urls, bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(10);

    #[test]
    fn lines_comments_and_malformed_lines() {
        let text = "# fleet\n\nhttp://127.0.0.1:8002\nhttp://127.0.0.1:8001/  # a comment\n\
                    nonsense\nhttps://127.0.0.1:8003\nhttp://127.0.0.1:8001\n";
        let (urls, bad) = parse(text);
        assert_eq!(urls, ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]);
        assert_eq!(bad.iter().map(|b| b.0).collect::<Vec<_>>(), [5, 6]);
        assert!(bad[1].1.contains("https"), "{bad:?}");
    }

    #[test]
    fn files_missing_empty_broken_and_changed() {
        let dir =
            std::env::temp_dir().join(format!("prefix-router-file-src-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("backends.txt");
        let mut state = FileState::default();
        assert!(
            matches!(read(&path, &mut state, T), Answer::Failed(e) if e.contains("backends.txt"))
        );
        std::fs::write(&path, "# nobody yet\n").unwrap();
        assert_eq!(read(&path, &mut state, T), Answer::Empty);
        std::fs::write(&path, "garbage\n").unwrap();
        assert!(
            matches!(read(&path, &mut state, T), Answer::Failed(e) if e.contains("1 malformed"))
        );
        std::fs::write(&path, "http://127.0.0.1:9\ngarbage\n").unwrap();
        let found = Answer::Found(vec!["http://127.0.0.1:9".into()]);
        assert_eq!(read(&path, &mut state, T), found);
        assert_eq!(
            read(&path, &mut state, T),
            found,
            "unchanged text, same answer"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_read_that_hangs_fails_at_the_deadline_and_is_not_started_twice() {
        let dir = std::env::temp_dir().join(format!("prefix-router-fifo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("backends.fifo");
        // Opening a FIFO for reading blocks until a writer comes: a hung file system.
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(made.is_ok_and(|s| s.success()), "mkfifo");
        let mut state = FileState::default();
        let short = Duration::from_millis(100);
        let a = read(&fifo, &mut state, short);
        assert!(
            matches!(&a, Answer::Failed(e) if e.contains("no answer within 100 ms")),
            "{a:?}"
        );
        assert!(state.pending.is_some());
        assert!(matches!(read(&fifo, &mut state, short), Answer::Failed(_)));
        // One reader is waiting on the FIFO: one writer completes it.
        std::fs::write(&fifo, "http://127.0.0.1:9\n").unwrap();
        let found = Answer::Found(vec!["http://127.0.0.1:9".into()]);
        assert_eq!(read(&fifo, &mut state, T), found);
        assert!(state.pending.is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
