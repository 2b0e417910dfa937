//! File sources: one backend URL per line (`http://host:port`), `#` starts
//! a comment, blank lines are skipped. The file is read again every poll
//! and parsed only when its text changed, so a malformed line is reported
//! once per change, with its line number, and skipped.
//!
//! Whatever sits at the path, a read is bounded in bytes and in time: only
//! a regular file is read (a symlink to `/dev/zero`, a named pipe, a device
//! or a directory is refused before a byte is read, and opened without
//! blocking, so a pipe without a writer cannot hold the open), at most
//! [`MAX_FILE_BYTES`] of it whatever size it reports; and each read runs on
//! a short-lived thread of its own, waited for at most
//! `discovery.timeout_ms`, so a file system that hangs (a dead NFS server)
//! stalls only this source. A read that outlives its deadline is left to
//! finish on its own and the next poll starts a fresh one, up to
//! [`MAX_HUNG_READS`] at once: when the path is good again, the source is.

use std::fs::{File, OpenOptions};
use std::io::Read as _;
use std::os::unix::fs::{FileTypeExt as _, OpenOptionsExt as _};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::mpsc;
use std::time::Duration;

use tracing::warn;
use xxhash_rust::xxh3::xxh3_64;

use super::Answer;
use crate::config::backend_addr;

/// Longest file read: a list of a thousand URLs is 30 KB, the fleet's
/// limit of 1,024 backends about 32 KB; anything near this is not a
/// backend list. Counted in bytes read, not the size the file reports (a
/// device reports 0 and never ends).
pub const MAX_FILE_BYTES: u64 = 1 << 20;

/// Reads of one source still running past their deadline (a hung file
/// system) before a poll stops starting new ones and fails at once. Each
/// is a parked thread with a small stack ([`READER_STACK`]); more than one
/// lets a path that was repaired be read while an older read still hangs.
pub const MAX_HUNG_READS: usize = 4;

/// Stack of a reader thread: one `read` call, the bytes on the heap.
const READER_STACK: usize = 64 * 1024;

/// The file's bytes, or why not.
type ReadResult = Result<Vec<u8>, String>;

/// What a file source remembers between polls.
#[derive(Debug, Default)]
pub struct FileState {
    /// Hash of the text last parsed, and what it gave.
    parsed: Option<(u64, Answer)>,
    /// Reader threads of this source still running (the current one, and
    /// any that outlived their deadline).
    readers: Arc<AtomicUsize>,
}

/// Reads `path` (within `timeout`) and gives its backends (in the file's
/// order); the text is parsed again only when it changed since the last
/// poll (`state`).
pub fn read(path: &Path, state: &mut FileState, timeout: Duration) -> Answer {
    read_with(path, state, timeout, read_regular)
}

fn read_with(
    path: &Path,
    state: &mut FileState,
    timeout: Duration,
    reader: fn(&Path) -> ReadResult,
) -> Answer {
    let text = match read_bytes(path, state, timeout, reader) {
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

/// Gives a reader thread's slot back when the thread ends, however it ends.
struct Running(Arc<AtomicUsize>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.fetch_sub(1, SeqCst);
    }
}

/// Runs `reader` on a thread of its own and waits for it up to `timeout`.
fn read_bytes(
    path: &Path,
    state: &mut FileState,
    timeout: Duration,
    reader: fn(&Path) -> ReadResult,
) -> ReadResult {
    let hung = state.readers.load(SeqCst);
    if hung >= MAX_HUNG_READS {
        return Err(format!(
            "reading {}: {hung} earlier reads still hang",
            path.display()
        ));
    }
    state.readers.fetch_add(1, SeqCst);
    let running = Running(state.readers.clone());
    let (tx, rx) = mpsc::sync_channel(1);
    let p = path.to_owned();
    std::thread::Builder::new()
        .name("discovery-file".into())
        .stack_size(READER_STACK)
        .spawn(move || {
            let r = reader(&p);
            drop(running);
            // The poll may have stopped waiting: nobody to tell, fine.
            let _ = tx.send(r);
        })
        .map_err(|e| format!("reading {}: no thread: {e}", path.display()))?;
    match rx.recv_timeout(timeout) {
        Ok(r) => r,
        Err(mpsc::RecvTimeoutError::Timeout) => Err(format!(
            "reading {}: no answer within {} ms",
            path.display(),
            timeout.as_millis()
        )),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            Err(format!("reading {}: the reader died", path.display()))
        }
    }
}

/// What kind of thing `t` is, for an error message.
fn kind(t: std::fs::FileType) -> &'static str {
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a named pipe"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// Reads `path` if it is a regular file (after symlinks), at most
/// [`MAX_FILE_BYTES`] of it. The type is checked before opening (a device
/// is never opened) and again on what was opened (the path may have
/// changed in between); the open does not block (`O_NONBLOCK`: a named
/// pipe put there meanwhile has no writer to wait for).
fn read_regular(path: &Path) -> ReadResult {
    let failed = |e: std::io::Error| format!("reading {}: {e}", path.display());
    let refuse = |t| {
        Err(format!(
            "{}: {}, not a regular file: refused",
            path.display(),
            kind(t)
        ))
    };
    let t = std::fs::metadata(path).map_err(failed)?.file_type();
    if !t.is_file() {
        return refuse(t);
    }
    let f: File = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(failed)?;
    let meta = f.metadata().map_err(failed)?;
    if !meta.file_type().is_file() {
        return refuse(meta.file_type());
    }
    let too_large = || {
        Err(format!(
            "{}: more than {MAX_FILE_BYTES} bytes",
            path.display()
        ))
    };
    if meta.len() > MAX_FILE_BYTES {
        return too_large();
    }
    let mut text = Vec::with_capacity(meta.len() as usize);
    f.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut text)
        .map_err(failed)?;
    if text.len() as u64 > MAX_FILE_BYTES {
        return too_large();
    }
    Ok(text)
}

/// The URLs of `text` (in its order, each once) and each malformed
/// line's number (from 1) with the reason. Host names are resolved here
/// (the discovery thread, never a worker).
pub fn parse(text: &str) -> (Vec<String>, Vec<(usize, String)>) {
    let mut urls = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut bad = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        match backend_addr(line) {
            Ok(_) => {
                let url = line.trim_end_matches('/');
                if seen.insert(url) {
                    urls.push(url.to_owned());
                }
            }
            Err(e) => bad.push((i + 1, format!("{e:#}"))),
        }
    }
    (urls, bad)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    const T: Duration = Duration::from_secs(10);

    #[test]
    fn lines_comments_and_malformed_lines() {
        let text = "# fleet\n\nhttp://127.0.0.1:8002\nhttp://127.0.0.1:8001/  # a comment\n\
                    nonsense\nftp://127.0.0.1:8003\nhttp://127.0.0.1:8001\n";
        let (urls, bad) = parse(text);
        assert_eq!(
            urls,
            ["http://127.0.0.1:8002", "http://127.0.0.1:8001"],
            "the file's order, each once"
        );
        assert_eq!(bad.iter().map(|b| b.0).collect::<Vec<_>>(), [5, 6]);
        assert!(bad[1].1.contains("ftp"), "{bad:?}");
    }

    fn temp_dir(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("prefix-router-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn files_missing_empty_broken_and_changed() {
        let dir = temp_dir("file-src");
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
        std::fs::write(&path, vec![b'#'; MAX_FILE_BYTES as usize + 1]).unwrap();
        assert!(
            matches!(read(&path, &mut state, T), Answer::Failed(e) if e.contains("more than")),
            "an oversized file"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn devices_pipes_and_directories_are_refused_at_once_and_the_path_recovers() {
        let dir = temp_dir("file-special");
        let path = dir.join("backends.txt");
        let mut state = FileState::default();
        let t = Instant::now();
        let refused = |a: Answer, what: &str| {
            assert!(
                matches!(&a, Answer::Failed(e) if e.contains(what) && e.contains("refused")),
                "{a:?}"
            );
        };
        // A device that reports 0 bytes and never ends.
        std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
        refused(read(&path, &mut state, T), "character device");
        std::fs::remove_file(&path).unwrap();
        // A named pipe without a writer: opening it for reading would block.
        let made = std::process::Command::new("mkfifo").arg(&path).status();
        assert!(made.is_ok_and(|s| s.success()), "mkfifo");
        refused(read(&path, &mut state, T), "named pipe");
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        refused(read(&path, &mut state, T), "directory");
        assert!(t.elapsed() < Duration::from_secs(2), "none of them waited");
        assert_eq!(state.readers.load(SeqCst), 0, "no reader left behind");
        // The real file back: read at once.
        std::fs::remove_dir(&path).unwrap();
        std::fs::write(&path, "http://127.0.0.1:9\n").unwrap();
        let found = Answer::Found(vec!["http://127.0.0.1:9".into()]);
        assert_eq!(read(&path, &mut state, T), found);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Set to let the hung readers of the test below finish.
    static RELEASE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

    /// A read on a file system that hangs until [`RELEASE`].
    fn hang(_: &Path) -> ReadResult {
        while !RELEASE.load(SeqCst) {
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(b"http://127.0.0.1:7\n".to_vec())
    }

    #[test]
    fn a_read_that_hangs_fails_at_the_deadline_and_the_next_polls_start_afresh() {
        let path = Path::new("/nonexistent/backends.txt");
        let mut state = FileState::default();
        let short = Duration::from_millis(50);
        for i in 1..=MAX_HUNG_READS {
            let a = read_with(path, &mut state, short, hang);
            assert!(
                matches!(&a, Answer::Failed(e) if e.contains("no answer within 50 ms")),
                "{a:?}"
            );
            assert_eq!(state.readers.load(SeqCst), i);
        }
        // At the bound: no new thread, an error at once.
        let t = Instant::now();
        let a = read_with(path, &mut state, T, hang);
        assert!(
            matches!(&a, Answer::Failed(e) if e.contains("still hang")),
            "{a:?}"
        );
        assert!(t.elapsed() < Duration::from_secs(1));
        assert_eq!(state.readers.load(SeqCst), MAX_HUNG_READS);
        // The file system is back: the hung reads end, the next poll reads.
        RELEASE.store(true, SeqCst);
        let deadline = Instant::now() + T;
        while state.readers.load(SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            read_with(path, &mut state, T, hang),
            Answer::Found(vec!["http://127.0.0.1:7".into()])
        );
    }
}
