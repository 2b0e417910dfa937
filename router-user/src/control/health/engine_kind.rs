//! Which cache model a backend gets (`fleet::slots`): the config's word
//! (`[[backends]] engine`, `slots`, else `prefix.engine`), or, for `auto`,
//! what the engine answers. llama.cpp's `llama-server` answers `GET /props`
//! with its `total_slots`; vLLM, SGLang and the simulated engine answer it
//! with a 404, and stay block caches.

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use tracing::{info, warn};

use super::probe;
use crate::fleet::backend::Backend;
use crate::fleet::slots::{EngineKind, parse_total_slots};
use crate::shared::Router;

/// Sets `b`'s slot model from the config or its `/props` (one GET within
/// `timeout`). A failed lookup leaves it a block cache; the next time the
/// backend comes back from down it is asked again.
pub fn detect(router: &Router, b: &Backend, timeout: Duration) {
    let cfg = router.config.load();
    let (own_kind, own_slots) = cfg
        .backends
        .iter()
        .find(|c| c.url() == b.url)
        .map_or((None, None), |c| c.engine());
    let kind = own_kind.unwrap_or(cfg.prefix.engine);
    if kind == EngineKind::Blocks {
        b.slots.set_count(0);
        return;
    }
    if let (EngineKind::Slots, Some(n)) = (kind, own_slots) {
        b.slots.set_count(n);
        info!(backend = %b.url, slots = n, "slot engine (config)");
        return;
    }
    let slots = probe::get(b.addr, "/props", timeout)
        .ok()
        .filter(|a| a.status == 200)
        .and_then(|a| parse_total_slots(&a.body));
    match slots {
        Some(n) => {
            b.slots.set_count(n);
            // llama-server ends every stream by closing the connection.
            b.closes_after_stream.store(true, Relaxed);
            info!(backend = %b.url, slots = n, "slot engine (llama.cpp): /props reports total_slots");
        }
        None if kind == EngineKind::Slots => {
            warn!(backend = %b.url, "configured as a slot engine, but /props tells no slot count: set `slots` for it; modelled as a block cache");
        }
        None => b.slots.set_count(0),
    }
}
