//! Backend health: active probes with hysteresis (a backend flips only after
//! `rise` or `fall` results in a row, and the flip is logged once), passive
//! ejection on failed requests, and the engine's KV capacity read from its
//! `/metrics`.

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use tracing::{info, warn};

use crate::backend::Backend;
use crate::config::ms;
use crate::router::Router;

/// Largest probe answer read (the `/metrics` page of an engine is a few KB).
const MAX_PROBE_BYTES: usize = 1 << 20;

/// A request to `backend` failed (connect error, reset, 5xx). After
/// `health.passive_fall` in a row the backend is ejected until probes pass.
pub fn request_failed(router: &Router, backend: &Backend, why: &str) {
    let s = &backend.state;
    s.errors.fetch_add(1, Relaxed);
    let n = s.failures_in_row.fetch_add(1, Relaxed) + 1;
    if n >= router.config.load().health.passive_fall && s.healthy.swap(false, Relaxed) {
        s.checks_ok_in_row.store(0, Relaxed);
        router.index.clear_backend(backend.slot);
        warn!(backend = %backend.url, failures = n, last = why, "backend ejected after failed requests");
    }
}

pub fn request_succeeded(backend: &Backend) {
    if backend.state.failures_in_row.load(Relaxed) != 0 {
        backend.state.failures_in_row.store(0, Relaxed);
    }
}

/// Probes every backend forever, every `health.interval_ms` (0 disables).
pub fn spawn_checker(router: Arc<Router>) -> std::thread::JoinHandle<()> {
    std::thread::Builder::new()
        .name("health".into())
        .spawn(move || {
            loop {
                let cfg = router.config.load_full();
                if cfg.health.interval_ms == 0 {
                    std::thread::sleep(Duration::from_secs(1));
                    continue;
                }
                let fleet = router.fleet.load_full();
                for b in &fleet.backends {
                    probe_once(&router, b);
                }
                std::thread::sleep(ms(cfg.health.interval_ms));
            }
        })
        .expect("spawning the health thread")
}

/// One probe of one backend, and the state change it causes.
pub fn probe_once(router: &Router, b: &Backend) {
    let cfg = router.config.load();
    let h = &cfg.health;
    let ok = matches!(get(b, &h.path, ms(h.timeout_ms)), Ok((200..=299, _)));
    let s = &b.state;
    if ok {
        s.checks_failed_in_row.store(0, Relaxed);
        let n = s.checks_ok_in_row.fetch_add(1, Relaxed) + 1;
        if n >= h.rise && !s.healthy.load(Relaxed) {
            s.failures_in_row.store(0, Relaxed);
            s.healthy.store(true, Relaxed);
            info!(backend = %b.url, "backend is healthy again");
        }
        if cfg.prefix.read_kv_capacity && !s.kv_known.swap(true, Relaxed) {
            read_capacity(router, b);
        }
    } else {
        s.checks_ok_in_row.store(0, Relaxed);
        let n = s.checks_failed_in_row.fetch_add(1, Relaxed) + 1;
        if n >= h.fall && s.healthy.swap(false, Relaxed) {
            router.index.clear_backend(b.slot);
            warn!(backend = %b.url, path = %h.path, failures = n, "backend failed health checks; taken out");
        }
    }
}

/// Sets the backend's share of the index from its `vllm:cache_config_info`,
/// unless the config fixes it.
fn read_capacity(router: &Router, b: &Backend) {
    let cfg = router.config.load();
    if cfg
        .backends
        .iter()
        .any(|c| c.url() == b.url && c.kv_blocks().is_some())
    {
        return;
    }
    let Ok((200, page)) = get(b, "/metrics", ms(cfg.health.timeout_ms)) else {
        return;
    };
    if let Some((block_size, blocks)) = parse_cache_config(&page) {
        // Engine blocks hold `block_size` tokens of ~4 bytes each.
        let cap = (blocks * block_size * 4 / cfg.prefix.block_bytes.max(1)).max(1);
        b.state.kv_blocks.store(cap, Relaxed);
        b.feedback.set_known_capacity(cap);
        router.index.set_capacity(b.slot, cap);
        info!(backend = %b.url, engine_blocks = blocks, block_size, index_blocks = cap, "read the engine's KV capacity");
    }
}

/// `(block_size, num_gpu_blocks)` from a vLLM `/metrics` page.
pub fn parse_cache_config(page: &str) -> Option<(usize, usize)> {
    let line = page
        .lines()
        .find(|l| l.starts_with("vllm:cache_config_info{"))?;
    let label = |name: &str| -> Option<usize> {
        let at = line.find(&format!("{name}=\""))? + name.len() + 2;
        line[at..].split('"').next()?.parse().ok()
    };
    Some((label("block_size")?, label("num_gpu_blocks")?))
}

/// A blocking GET with a total timeout; returns the status and body.
fn get(b: &Backend, path: &str, timeout: Duration) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&b.addr, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
        b.addr
    )?;
    let mut buf = Vec::new();
    s.take(MAX_PROBE_BYTES as u64).read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf);
    let status = text.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vllm_cache_config() {
        let page = "# HELP x\nvllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",num_gpu_blocks=\"2048\"} 1.0\n";
        assert_eq!(parse_cache_config(page), Some((16, 2048)));
        assert_eq!(parse_cache_config("nothing"), None);
    }
}
