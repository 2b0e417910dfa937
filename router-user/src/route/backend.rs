//! The fleet: backends, their live load counters, and health state.
//! Counters are atomics shared by every worker; the fleet itself is an
//! immutable snapshot swapped whole on reload.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering::Relaxed};

use xxhash_rust::xxh3::xxh3_64;

use crate::route::feedback::Feedback;
use crate::route::select::BackendLoad;

/// One inference server.
#[derive(Debug)]
pub struct Backend {
    /// Dense index: the backend's bit in the prefix index, its eBPF registry
    /// entry, and its pool in every worker. Stable while the backend exists.
    pub slot: usize,
    pub url: String,
    pub addr: SocketAddr,
    /// Hash of the URL: rendezvous hashing agrees across router instances.
    pub id_hash: u64,
    /// Unique over the process's life: a backend added again after removal,
    /// or another taking a freed slot, is a new generation, so nothing keyed
    /// by it (pooled connections) carries over.
    pub generation: u64,
    pub state: BackendState,
    /// What its answers taught: prediction error, prefill rate.
    pub feedback: Feedback,
}

/// The next `Backend::generation`.
static GENERATIONS: AtomicU64 = AtomicU64::new(1);

/// Live counters and health of a backend.
#[derive(Debug, Default)]
pub struct BackendState {
    pub in_flight: AtomicU32,
    pub queued_prefill_blocks: AtomicU32,
    /// Prompt blocks of its requests in flight (KV its running requests hold).
    pub in_flight_blocks: AtomicU32,
    /// This router's open connections to it (pooled and busy).
    pub open_conns: AtomicU32,
    /// Connections the XDP counters see beyond this router's own.
    pub external_conns: AtomicU32,
    /// Resets seen by XDP per second, recent.
    pub rst_per_sec: AtomicU32,
    pub healthy: AtomicBool,
    pub draining: AtomicBool,
    /// A reload took it out of the fleet; its in-flight requests finish,
    /// its connections are not pooled again.
    pub removed: AtomicBool,
    /// Failed requests in a row (passive health).
    pub failures_in_row: AtomicU32,
    /// Health probes passed / failed in a row.
    pub checks_ok_in_row: AtomicU32,
    pub checks_failed_in_row: AtomicU32,
    /// The engine's capacity was read (or given in the config).
    pub kv_known: AtomicBool,
    /// Tracked-block capacity in the prefix index.
    pub kv_blocks: AtomicUsize,
    pub requests: AtomicU64,
    pub errors: AtomicU64,
    /// The XDP counters (opened, closed, reset, packets, bytes) as last read.
    pub xdp: [AtomicU64; 5],
}

impl Backend {
    pub fn new(slot: usize, url: &str, addr: SocketAddr, kv_blocks: usize) -> Backend {
        let b = Backend {
            slot,
            url: url.to_owned(),
            addr,
            id_hash: xxh3_64(url.as_bytes()),
            generation: GENERATIONS.fetch_add(1, Relaxed),
            state: BackendState::default(),
            feedback: Feedback::new(kv_blocks),
        };
        b.state.healthy.store(true, Relaxed);
        b.state.kv_blocks.store(kv_blocks, Relaxed);
        b
    }

    /// The view selection gets.
    pub fn load(&self, max_in_flight: u32) -> BackendLoad {
        let s = &self.state;
        let in_flight = s.in_flight.load(Relaxed);
        BackendLoad {
            eligible: s.healthy.load(Relaxed)
                && !s.draining.load(Relaxed)
                && (max_in_flight == 0 || in_flight < max_in_flight),
            in_flight,
            queued_prefill_blocks: s.queued_prefill_blocks.load(Relaxed),
            external_conns: s.external_conns.load(Relaxed),
            id_hash: self.id_hash,
            in_flight_blocks: s.in_flight_blocks.load(Relaxed),
            capacity_blocks: u32::try_from(self.feedback.capacity()).unwrap_or(u32::MAX),
            prefill_rate: self.feedback.prefill_rate() as f32,
            // Set by the router, which owns the index.
            cached_blocks: 0,
        }
    }

    pub fn is_up(&self) -> bool {
        self.state.healthy.load(Relaxed) && !self.state.draining.load(Relaxed)
    }
}

/// The backends as of the last (re)load.
#[derive(Debug, Default)]
pub struct Fleet {
    pub backends: Vec<Arc<Backend>>,
}

impl Fleet {
    pub fn by_slot(&self, slot: usize) -> Option<&Arc<Backend>> {
        self.backends.iter().find(|b| b.slot == slot)
    }

    /// Bitmask of the slots in the fleet.
    pub fn slot_mask(&self) -> u64 {
        self.backends.iter().fold(0, |m, b| m | 1 << b.slot)
    }
}

/// Counts a request in flight on a backend until dropped, so every exit path
/// (success, error, cancelled task) gives the load back.
pub struct InFlight {
    backend: Arc<Backend>,
    prefill_blocks: u32,
    prompt_blocks: u32,
}

impl InFlight {
    /// Counts a request of `prompt_blocks` blocks, `prefill_blocks` of them
    /// uncached, on `backend`.
    pub fn start(backend: Arc<Backend>, prefill_blocks: u32, prompt_blocks: u32) -> InFlight {
        backend.state.in_flight.fetch_add(1, Relaxed);
        backend
            .state
            .queued_prefill_blocks
            .fetch_add(prefill_blocks, Relaxed);
        backend
            .state
            .in_flight_blocks
            .fetch_add(prompt_blocks, Relaxed);
        backend.state.requests.fetch_add(1, Relaxed);
        InFlight {
            backend,
            prefill_blocks,
            prompt_blocks,
        }
    }

    /// The first response byte arrived: the prompt is prefilled.
    pub fn prefilled(&mut self) {
        let n = std::mem::take(&mut self.prefill_blocks);
        self.backend
            .state
            .queued_prefill_blocks
            .fetch_sub(n, Relaxed);
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.prefilled();
        self.backend
            .state
            .in_flight_blocks
            .fetch_sub(self.prompt_blocks, Relaxed);
        self.backend.state.in_flight.fetch_sub(1, Relaxed);
    }
}
