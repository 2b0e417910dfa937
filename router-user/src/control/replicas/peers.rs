//! Who the peers are: the static list, every address of a DNS name (a
//! headless Service of the router's own Deployment) and files of
//! `host:port` lines, as `ip:port` strings, sorted, without duplicates.
//! This replica's own address may be among them: its follower recognises
//! its own stream and stops.

use std::io::Read;
use std::net::ToSocketAddrs;

use tracing::warn;

use crate::config::replicas::ReplicasConfig;

/// The most a peers file may hold: 64 KiB is thousands of lines.
const MAX_FILE_BYTES: u64 = 64 * 1024;

/// The peers now; a source that fails keeps what it gave in `previous`.
pub fn resolve(cfg: &ReplicasConfig) -> Vec<String> {
    resolve_keeping(cfg, &[])
}

pub fn resolve_keeping(cfg: &ReplicasConfig, previous: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut failed = false;
    for p in &cfg.peers {
        failed |= !add(&mut out, p);
    }
    if let Some(name) = &cfg.dns {
        let port = cfg
            .dns_port
            .or(cfg.listen.map(|l| l.port()))
            .unwrap_or_default();
        failed |= !add(&mut out, &format!("{name}:{port}"));
    }
    for f in &cfg.files {
        match read_bounded(f) {
            Ok(text) => {
                for line in text.lines() {
                    let line = line.split('#').next().unwrap_or("").trim();
                    if !line.is_empty() {
                        failed |= !add(&mut out, line);
                    }
                }
            }
            Err(e) => {
                warn!(file = %f.display(), error = %e, "replica peers file unreadable; keeping the peers it gave");
                failed = true;
            }
        }
    }
    if failed {
        out.extend(previous.iter().cloned());
    }
    out.sort();
    out.dedup();
    out
}

/// Adds every address `host:port` resolves to; false when it does not.
fn add(out: &mut Vec<String>, hostport: &str) -> bool {
    match hostport.to_socket_addrs() {
        Ok(addrs) => {
            out.extend(addrs.map(|a| a.to_string()));
            true
        }
        Err(e) => {
            warn!(peer = hostport, error = %e, "replica peer does not resolve");
            false
        }
    }
}

/// A regular file's text, at most `MAX_FILE_BYTES` of it (a device or a
/// pipe in its place is refused, never read without end).
fn read_bounded(path: &std::path::Path) -> std::io::Result<String> {
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(MAX_FILE_BYTES)
        .read_to_string(&mut text)?;
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_files_and_names_merge_sorted_and_once() {
        let dir = std::env::temp_dir().join(format!("replica-peers-{}", std::process::id()));
        std::fs::write(&dir, "# peers\n127.0.0.1:7102\n127.0.0.1:7100 # me\n\n").unwrap();
        let cfg = ReplicasConfig {
            listen: Some("127.0.0.1:7100".parse().unwrap()),
            peers: vec!["127.0.0.1:7104".into(), "127.0.0.1:7102".into()],
            files: vec![dir.clone()],
            ..Default::default()
        };
        assert_eq!(
            resolve(&cfg),
            ["127.0.0.1:7100", "127.0.0.1:7102", "127.0.0.1:7104"]
        );
        // A file that went missing keeps what the peers were.
        std::fs::remove_file(&dir).unwrap();
        let prev = vec!["127.0.0.1:7102".to_string(), "127.0.0.1:7106".into()];
        assert_eq!(
            resolve_keeping(&cfg, &prev),
            ["127.0.0.1:7102", "127.0.0.1:7104", "127.0.0.1:7106"]
        );
    }

    #[test]
    fn a_device_in_place_of_the_file_is_refused() {
        assert!(read_bounded(std::path::Path::new("/dev/zero")).is_err());
    }
}
