//! Which cache model a backend gets (`fleet::slots`): the config's word
//! (`[[backends]] engine`, `slots`, else `prefix.engine`), or, for `auto`,
//! what the engine answers. llama.cpp's `llama-server` answers `GET /props`
//! with its `total_slots`; vLLM, SGLang and the simulated engine answer it
//! with a 404, and stay block caches.
//!
//! The kind is read until it is known: an answer that says nothing (a
//! timeout, a 5xx from a llama-server still loading its model) leaves the
//! model as it was and the next passing probe asks again. Once known it is
//! read again every [`RECHECK`], and at once after the backend comes back
//! from down, so a slot count that changes, or an engine swapped behind
//! the same address, is followed.

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use super::probe;
use crate::fleet::backend::Backend;
use crate::fleet::slots::{EngineKind, parse_total_slots};
use crate::shared::Router;

/// How often a known engine kind is read again: a llama-server restarted
/// with another `-np` between two probes (so never seen down), or a reload
/// that changed `engine`, is followed within this. One small GET per
/// backend; 200 a second for a fleet of 1,024.
pub const RECHECK: Duration = Duration::from_secs(5);

/// When a backend's engine kind is read next (one per prober thread).
#[derive(Debug, Default)]
pub struct Schedule {
    /// `None`: at the next passing probe.
    next: Option<Instant>,
}

impl Schedule {
    /// Whether the kind is due to be read now.
    pub fn due(&self, now: Instant) -> bool {
        self.next.is_none_or(|t| now >= t)
    }

    /// The backend went down: read its kind as soon as it is back.
    pub fn now(&mut self) {
        self.next = None;
    }

    /// Reads `b`'s kind if it is due, and schedules the next read.
    pub fn check(&mut self, router: &Router, b: &Backend, timeout: Duration) {
        let now = Instant::now();
        if !self.due(now) {
            return;
        }
        self.next = detect(router, b, timeout).then(|| now + RECHECK);
    }
}

/// Sets `b`'s slot model from the config or its `/props` (one GET within
/// `timeout`); whether the kind is now known. An answer that tells nothing
/// (no answer, a 5xx) changes nothing.
pub fn detect(router: &Router, b: &Backend, timeout: Duration) -> bool {
    let cfg = router.config.load();
    let (own_kind, own_slots) = cfg
        .backends
        .iter()
        .find(|c| c.url() == b.url)
        .map_or((None, None), |c| c.engine());
    let kind = own_kind.unwrap_or(cfg.prefix.engine);
    if kind == EngineKind::Blocks {
        b.slots.set_count(0);
        return true;
    }
    if let (EngineKind::Slots, Some(n)) = (kind, own_slots) {
        if b.slots.set_count(n) != b.slots.count() {
            info!(backend = %b.url, slots = n, "slot engine (config)");
        }
        return true;
    }
    let answer = match probe::get(&probe::Target::of(&cfg, b), "/props", timeout) {
        Ok(a) if a.status < 500 => a,
        Ok(a) => {
            debug!(backend = %b.url, status = a.status, "GET /props tells no engine kind yet; asked again at the next probe");
            return false;
        }
        Err(e) => {
            debug!(backend = %b.url, error = %e, "GET /props tells no engine kind yet; asked again at the next probe");
            return false;
        }
    };
    let slots = (answer.status == 200)
        .then(|| parse_total_slots(&answer.body))
        .flatten();
    match slots {
        Some(n) => {
            // llama-server ends every stream by closing the connection.
            b.closes_after_stream.store(true, Relaxed);
            let before = b.slots.set_count(n);
            if before != b.slots.count() {
                info!(backend = %b.url, slots = n, before, "slot engine (llama.cpp): /props reports total_slots");
            }
        }
        None if kind == EngineKind::Slots => {
            if b.slots.set_count(0) != 0 {
                warn!(backend = %b.url, "configured as a slot engine, but /props tells no slot count: set `slots` for it; modelled as a block cache");
            }
        }
        None => {
            if b.slots.set_count(0) != 0 {
                info!(backend = %b.url, "/props reports no total_slots any more: modelled as a block cache");
            }
        }
    }
    true
}
