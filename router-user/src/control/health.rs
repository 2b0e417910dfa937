//! Backend health: active probes with hysteresis (a backend flips only after
//! `rise` or `fall` results in a row, and the flip is logged once), passive
//! ejection on failed requests, the engine's KV capacity read from its
//! `/metrics`, its kind (block cache or slots) from `/props` (read until
//! known, then again every few seconds and after it was down:
//! `engine_kind`), and its models from `/v1/models` (`models`). Every backend is probed by a thread of its
//! own, each probe bounded as a whole by `health.timeout_ms` (see `probe`),
//! so no backend can delay another's checks.

mod engine_kind;
mod models;
mod probe;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use crate::config::ms;
use crate::fleet::backend::{Backend, Flip};
use crate::shared::Router;

/// How often the supervisor looks for backends a reload added.
const SUPERVISE_EVERY: Duration = Duration::from_millis(100);
/// With active checks off (`health.interval_ms = 0`), how often a prober
/// looks whether they were turned on by a reload.
const DISABLED_RECHECK: Duration = Duration::from_secs(1);
/// Stack of a prober thread: blocking socket calls, buffers on the heap.
const PROBER_STACK: usize = 256 * 1024;

/// Starts the health supervisor: it gives every backend of the fleet a
/// prober thread of its own (and each backend a reload adds), so a backend
/// that answers slowly, or not at all, delays only its own probes.
pub fn spawn_checker(router: Arc<Router>) -> std::thread::JoinHandle<()> {
    std::thread::Builder::new()
        .name("health".into())
        .spawn(move || {
            let mut probers: Vec<(Arc<Backend>, std::thread::JoinHandle<()>)> = Vec::new();
            let mut models_seen = models::Seen::default();
            loop {
                models::sync(&router, &mut models_seen);
                probers.retain(|(_, h)| !h.is_finished());
                let fleet = router.fleet.load_full();
                for b in &fleet.backends {
                    if probers.iter().any(|(p, _)| Arc::ptr_eq(p, b)) {
                        continue;
                    }
                    let (r, pb) = (router.clone(), b.clone());
                    match std::thread::Builder::new()
                        .name(format!("health-{}", b.slot))
                        .stack_size(PROBER_STACK)
                        .spawn(move || run_prober(&r, &pb))
                    {
                        Ok(h) => probers.push((b.clone(), h)),
                        // Tried again on the next pass.
                        Err(e) => {
                            warn!(backend = %b.url, error = %e, "cannot start a health prober")
                        }
                    }
                }
                std::thread::sleep(SUPERVISE_EVERY);
            }
        })
        .expect("spawning the health thread")
}

/// Whether `b` is still in the running fleet (a reload may have removed it).
fn in_fleet(router: &Router, b: &Arc<Backend>) -> bool {
    router
        .fleet
        .load()
        .backends
        .iter()
        .any(|f| Arc::ptr_eq(f, b))
}

/// Probes `b` every `health.interval_ms` (start to start; a probe takes at
/// most `health.timeout_ms`) until a reload removes it.
fn run_prober(router: &Router, b: &Arc<Backend>) {
    let mut kind = engine_kind::Schedule::default();
    while in_fleet(router, b) {
        let interval = router.config.load().health.interval_ms;
        if interval == 0 {
            std::thread::sleep(DISABLED_RECHECK);
            continue;
        }
        let started = Instant::now();
        let result = probe(router, b);
        // A backend removed while its probe ran has left the index already,
        // and its slot may be someone else's now.
        if in_fleet(router, b) {
            apply(router, b, result, &mut kind);
        }
        std::thread::sleep(ms(interval).saturating_sub(started.elapsed()));
    }
}

/// `GET health.path`; `Ok` on a 2xx answer within `health.timeout_ms`.
fn probe(router: &Router, b: &Backend) -> Result<(), String> {
    let cfg = router.config.load();
    let h = &cfg.health;
    match probe::get(
        &probe::Target::of(&router.config.load(), b),
        &h.path,
        ms(h.timeout_ms),
    ) {
        Ok(a) if (200..300).contains(&a.status) => Ok(()),
        Ok(a) => Err(format!("status {}", a.status)),
        Err(e) => Err(e.to_string()),
    }
}

fn apply(
    router: &Router,
    b: &Backend,
    result: Result<(), String>,
    kind: &mut engine_kind::Schedule,
) {
    b.stats.probed(result.is_ok());
    let cfg = router.config.load();
    let h = &cfg.health;
    let first = b.health.is_unproven();
    let flip = b.health.observe_probe(result.is_ok(), h.rise, h.fall);
    match (result, flip) {
        (Ok(()), flip) => {
            if flip == Some(Flip::Up) && first {
                info!(backend = %b.url, "new backend passed its first probe; it takes traffic");
            } else if flip == Some(Flip::Up) {
                info!(backend = %b.url, "backend is healthy again");
            }
            if cfg.prefix.read_kv_capacity && b.feedback.first_capacity_lookup() {
                read_capacity(router, b);
            }
            kind.check(router, b, ms(h.timeout_ms));
            models::refresh(router, b, ms(h.timeout_ms));
        }
        (Err(why), flip) => {
            debug!(backend = %b.url, path = %h.path, error = %why, "health probe failed");
            if flip == Some(Flip::Down) {
                router.index.clear_backend(b.slot);
                // It may come back another engine, or with another `-np`.
                b.slots.clear();
                kind.now();
                warn!(backend = %b.url, path = %h.path, failures = h.fall, last = %why, "backend failed health checks; taken out");
            }
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
    let Ok(answer) = probe::get(
        &probe::Target::of(&cfg, b),
        "/metrics",
        ms(cfg.health.timeout_ms),
    ) else {
        return;
    };
    if answer.status != 200 {
        return;
    }
    if let Some((block_size, blocks)) = parse_cache_config(&String::from_utf8_lossy(&answer.body)) {
        // Engine blocks hold `block_size` tokens of ~4 bytes each.
        let cap = (blocks * block_size * 4 / cfg.prefix.block_bytes.max(1)).max(1);
        b.feedback.set_known_capacity(cap);
        // The index keeps remembering where conversations went past what
        // the engine holds: a conversation whose history was evicted loses
        // nothing by going back, and wins when it was not. Shrunk to the
        // published capacity, it forgot held histories and moved 54-69
        // turns a run (pressure-published 68.5% against 74.9% unpublished,
        // decision 0021). It grows for a larger capacity.
        if cap > router.index.capacity(b.slot) {
            router.index.set_capacity(b.slot, cap);
        }
        info!(backend = %b.url, engine_blocks = blocks, block_size, capacity_blocks = cap, index_blocks = router.index.capacity(b.slot), "read the engine's KV capacity");
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
