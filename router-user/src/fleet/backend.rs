//! The fleet: backends, their live load counters, and health state.
//! Counters are atomics shared by every worker; the fleet itself is an
//! immutable snapshot swapped whole on reload.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use xxhash_rust::xxh3::xxh3_64;

use crate::fleet::feedback::Feedback;
use crate::fleet::owners::BackendSet;
use crate::fleet::slots::SlotCache;
use crate::policy::select::BackendLoad;

/// One inference server.
#[derive(Debug)]
pub struct Backend {
    /// Dense index: the backend's bit in the prefix index, its eBPF registry
    /// entry, and its pool in every worker. Stable while the backend exists.
    pub slot: usize,
    pub url: String,
    pub addr: SocketAddr,
    /// `https://` backends: the URL's host, the name its certificate must
    /// carry (sent as SNI). `None`: plain HTTP.
    pub tls_name: Option<String>,
    /// Hash of the URL: rendezvous hashing agrees across router instances.
    pub id_hash: u64,
    /// Unique over the process's life: a backend added again after removal,
    /// or another taking a freed slot, is a new generation, so nothing keyed
    /// by it (pooled connections) carries over.
    pub generation: u64,
    pub load: Load,
    pub health: Health,
    pub stats: Stats,
    /// What its answers taught: prediction error, prefill rate.
    pub feedback: Feedback,
    /// What its slots hold, when it is a slot engine (llama.cpp).
    pub slots: SlotCache,
    /// It closes the connection after every streamed (chunked) answer
    /// without saying so (llama.cpp's `llama-server` does): such
    /// connections are not pooled. Set by engine detection, or learned when
    /// a connection pooled after a stream is found closed at once.
    pub closes_after_stream: AtomicBool,
}

/// The host of an `https://` URL (without port or IPv6 brackets).
fn tls_name(url: &str) -> Option<String> {
    let rest = url.strip_prefix("https://")?;
    let authority = rest.split('/').next().unwrap_or(rest);
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(v6),
        None => authority.rsplit_once(':').map_or(authority, |(h, _)| h),
    };
    Some(host.to_owned())
}

/// The next `Backend::generation`.
static GENERATIONS: AtomicU64 = AtomicU64::new(1);

/// What a backend has in flight, as this router counts it, and the
/// connections the XDP counters see. Written by the request path (through
/// [`InFlight`] and [`ConnCount`]) and the load view; read by selection.
#[derive(Debug, Default)]
pub struct Load {
    in_flight: AtomicU32,
    queued_prefill_blocks: AtomicU32,
    /// Prompt blocks of its requests in flight (KV its running requests hold).
    in_flight_blocks: AtomicU32,
    /// This router's open connections to it (pooled and busy).
    open_conns: AtomicU32,
    /// Connections the XDP counters see beyond this router's own.
    external_conns: AtomicU32,
    /// Resets seen by XDP per second, recent.
    rst_per_sec: AtomicU32,
    /// Its requests in flight that were learned by the index, for
    /// [`Load::pinned_before`]: one entry each, removed when the request's
    /// [`InFlight`] guard drops (a scan of them costs what the requests in
    /// flight on one backend number).
    pins: Mutex<Vec<Pin>>,
    /// What the other router replicas have in flight here, as they report it.
    pub remote: Remote,
}

/// The most router replicas whose work a backend counts (peers beyond it
/// share their decisions, not their load).
pub const MAX_PEERS: usize = 32;

/// Work the peer replicas have on one backend (`control::replicas`
/// writes it): each peer's last report in a cell of its own, written by
/// that peer's thread alone, and the sums routing reads, kept exact by
/// adding each cell's change (wrapping).
#[derive(Debug, Default)]
pub struct Remote {
    /// Per peer: requests in flight (high half), queued prefill blocks (low).
    cells: [AtomicU64; MAX_PEERS],
    in_flight: AtomicU32,
    queued_prefill_blocks: AtomicU32,
    /// Per peer on this host: its open connections here, which this host's
    /// XDP program counts among the live ones (idle keep-alive ones too).
    conn_cells: [AtomicU32; MAX_PEERS],
    local_peer_conns: AtomicU32,
    /// Blocks this replica's answers from here wrote that the peers have
    /// not been told yet (the next load message takes them).
    unshared_answer_blocks: AtomicU32,
}

impl Remote {
    /// This replica's answer from here wrote `blocks` blocks.
    pub fn answered(&self, blocks: u32) {
        self.unshared_answer_blocks.fetch_add(blocks, Relaxed);
    }

    /// The answer blocks not yet told to the peers, now told.
    pub fn take_answered(&self) -> u32 {
        self.unshared_answer_blocks.swap(0, Relaxed)
    }

    /// Peer `peer` has this much work here now.
    pub fn set(&self, peer: usize, in_flight: u32, queued_prefill_blocks: u32) {
        let Some(cell) = self.cells.get(peer) else {
            return;
        };
        let new = (u64::from(in_flight) << 32) | u64::from(queued_prefill_blocks);
        let old = cell.swap(new, Relaxed);
        let (f, q) = ((old >> 32) as u32, old as u32);
        self.in_flight.fetch_add(in_flight.wrapping_sub(f), Relaxed);
        self.queued_prefill_blocks
            .fetch_add(queued_prefill_blocks.wrapping_sub(q), Relaxed);
    }

    /// Peer `peer`, on this host, has `conns` connections open here now.
    pub fn set_conns(&self, peer: usize, conns: u32) {
        let Some(cell) = self.conn_cells.get(peer) else {
            return;
        };
        let old = cell.swap(conns, Relaxed);
        self.local_peer_conns
            .fetch_add(conns.wrapping_sub(old), Relaxed);
    }

    /// Connections the peers on this host have open here: part of what
    /// XDP counts, and none of it load beyond their reported work.
    pub fn local_peer_conns(&self) -> u32 {
        self.local_peer_conns.load(Relaxed)
    }

    /// Peer `peer` just sent one more request here, `prefill` blocks to
    /// compute: counted at once, until its next report says otherwise.
    pub fn bump(&self, peer: usize, prefill: u32) {
        let (f, q) = self.of(peer);
        self.set(peer, f.saturating_add(1), q.saturating_add(prefill));
    }

    /// Peer `peer`'s last report here.
    pub fn of(&self, peer: usize) -> (u32, u32) {
        let c = self.cells.get(peer).map_or(0, |c| c.load(Relaxed));
        ((c >> 32) as u32, c as u32)
    }

    /// Requests the peers have in flight here.
    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Relaxed)
    }

    /// Uncached prompt blocks of the peers' requests waiting for a first byte.
    pub fn queued_prefill_blocks(&self) -> u32 {
        self.queued_prefill_blocks.load(Relaxed)
    }
}

/// A request in flight as the closed loop sees it: the clock stamp its
/// prompt's blocks took (`PrefixIndex::insert_aging`), its blocks, and
/// whether the engine runs it yet (a first body byte came back).
#[derive(Clone, Copy, Debug)]
struct Pin {
    stamp: u64,
    blocks: u32,
    running: bool,
    /// The first block the engine computes for it (it held the ones
    /// before, as predicted), by position and hash.
    computing: Option<(u32, u64)>,
    /// A peer replica's request: that peer's load cell and its request id
    /// (`control::replicas` adds, marks and removes it).
    remote: Option<(usize, u64)>,
}

/// The most peer requests one backend keeps pinned: past it the oldest
/// goes (a peer that never says its requests ended cannot grow it).
const MAX_REMOTE_PINS: usize = 4_096;

impl Load {
    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Relaxed)
    }

    /// Uncached prompt blocks of its requests still waiting for a first body byte.
    pub fn queued_prefill_blocks(&self) -> u32 {
        self.queued_prefill_blocks.load(Relaxed)
    }

    pub fn in_flight_blocks(&self) -> u32 {
        self.in_flight_blocks.load(Relaxed)
    }

    pub fn open_conns(&self) -> u32 {
        self.open_conns.load(Relaxed)
    }

    pub fn external_conns(&self) -> u32 {
        self.external_conns.load(Relaxed)
    }

    pub fn resets_per_sec(&self) -> u32 {
        self.rst_per_sec.load(Relaxed)
    }

    /// Whether a request in flight here that the engine does not run yet
    /// is computing some of the first `matched` blocks of `hashes`: a
    /// request sent now would find them not cached yet, and compute them
    /// too. Such a request has queued prefill (it computes a block at
    /// least) until its first body byte, so an engine with none is answered
    /// without the lock.
    pub fn computing_within(&self, hashes: &[u64], matched: u32) -> bool {
        if self.queued_prefill_blocks() == 0 && self.remote.queued_prefill_blocks() == 0 {
            return false;
        }
        self.pins().iter().any(|p| {
            !p.running
                && p.computing
                    .is_some_and(|(i, h)| i < matched && hashes.get(i as usize) == Some(&h))
        })
    }

    /// Blocks the engine's running requests hold that an age measured from
    /// clock `stamp` does not count (`PrefixIndex::distinct_ages`): the
    /// prompts of requests sent before `stamp` (less what was sent again
    /// since, `resent(stamp, blocks)`, which an age counts), and the answer
    /// every running request is writing (`answer_blocks` each, the
    /// backend's mean). An engine cannot evict what its running requests
    /// hold, so the blocks an LRU cache keeps after a block are those the
    /// age counts plus these. A request still waiting for its first body byte
    /// is queued in the engine and holds nothing yet.
    ///
    /// `None` when the request that sent the blocks stamped `stamp` is
    /// still waiting for its first body byte: the engine has not computed them
    /// yet, so not finding them says nothing of its capacity (an engine
    /// caches a block once it has computed it).
    pub fn pinned_before(
        &self,
        stamp: u64,
        answer_blocks: u64,
        resent: impl Fn(u64, u32) -> u64,
    ) -> Option<u64> {
        let pins = self.pins();
        if pins.iter().any(|p| p.stamp == stamp && !p.running) {
            return None;
        }
        Some(
            pins.iter()
                .filter(|p| p.running)
                .map(|p| {
                    let prompt = if p.stamp < stamp {
                        u64::from(p.blocks).saturating_sub(resent(p.stamp, p.blocks))
                    } else {
                        0
                    };
                    prompt + answer_blocks
                })
                .sum(),
        )
    }

    fn pins(&self) -> std::sync::MutexGuard<'_, Vec<Pin>> {
        self.pins.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A peer replica's request `request` took clock `stamp` here for its
    /// `blocks` prompt blocks, to compute from `computing` on: pinned as
    /// this replica's own requests are, until the peer says it ended.
    pub fn pin_remote(
        &self,
        peer: usize,
        request: u64,
        stamp: u64,
        blocks: u32,
        computing: Option<(u32, u64)>,
    ) {
        let mut pins = self.pins();
        if pins.iter().filter(|p| p.remote.is_some()).count() >= MAX_REMOTE_PINS
            && let Some(i) = pins.iter().position(|p| p.remote.is_some())
        {
            pins.remove(i);
        }
        pins.push(Pin {
            stamp,
            blocks,
            running: false,
            computing,
            remote: Some((peer, request)),
        });
    }

    /// The peer's request got its first body byte: the engine runs it.
    pub fn remote_prefilled(&self, peer: usize, request: u64) {
        if let Some(p) = self
            .pins()
            .iter_mut()
            .find(|p| p.remote == Some((peer, request)))
        {
            p.running = true;
        }
    }

    /// The peer's request ended.
    pub fn unpin_remote(&self, peer: usize, request: u64) {
        let mut pins = self.pins();
        if let Some(i) = pins.iter().position(|p| p.remote == Some((peer, request))) {
            pins.swap_remove(i);
        }
    }

    /// Every request of peer `peer` (it stalled, restarted or left).
    pub fn unpin_peer(&self, peer: usize) {
        self.pins()
            .retain(|p| p.remote.is_none_or(|(q, _)| q != peer));
    }

    /// What the XDP counters show now: `live` connections in all (this
    /// router's included) and the recent reset rate.
    pub fn set_observed(&self, live: u64, resets_per_sec: u32) {
        let external = live.saturating_sub(u64::from(self.open_conns()));
        self.external_conns
            .store(u32::try_from(external).unwrap_or(u32::MAX), Relaxed);
        self.rst_per_sec.store(resets_per_sec, Relaxed);
    }
}

/// A backend flipped up or down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flip {
    Up,
    Down,
}

/// Whether a backend takes traffic: health with hysteresis (a backend flips
/// only after `rise` or `fall` results in a row; each method returns the
/// flip so the caller logs it once), an operator's drain, and removal by a
/// reload.
#[derive(Debug)]
pub struct Health {
    healthy: AtomicBool,
    draining: AtomicBool,
    /// A reload took it out of the fleet; its in-flight requests finish,
    /// its connections are not pooled again.
    removed: AtomicBool,
    /// Failed requests in a row (passive health).
    failures_in_row: AtomicU32,
    /// Health probes passed / failed in a row.
    checks_ok_in_row: AtomicU32,
    checks_failed_in_row: AtomicU32,
    /// Joined the running fleet (a reload or discovery) and has passed no
    /// probe yet: not healthy, and its first passed probe brings it up.
    unproven: AtomicBool,
}

impl Default for Health {
    fn default() -> Self {
        Health {
            healthy: AtomicBool::new(true),
            draining: AtomicBool::new(false),
            removed: AtomicBool::new(false),
            failures_in_row: AtomicU32::new(0),
            checks_ok_in_row: AtomicU32::new(0),
            checks_failed_in_row: AtomicU32::new(0),
            unproven: AtomicBool::new(false),
        }
    }
}

impl Health {
    /// A backend that joins a running fleet: it takes no traffic until a
    /// health probe passes (one is enough: `rise` guards flapping backends).
    pub fn unproven() -> Health {
        Health {
            healthy: AtomicBool::new(false),
            unproven: AtomicBool::new(true),
            ..Health::default()
        }
    }

    /// It has passed no probe since it joined.
    pub fn is_unproven(&self) -> bool {
        self.unproven.load(Relaxed)
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Relaxed)
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Relaxed)
    }

    pub fn is_removed(&self) -> bool {
        self.removed.load(Relaxed)
    }

    /// Healthy and not drained: it may be sent new requests.
    pub fn is_up(&self) -> bool {
        self.is_healthy() && !self.is_draining()
    }

    pub fn set_draining(&self, drain: bool) {
        self.draining.store(drain, Relaxed);
    }

    pub fn mark_removed(&self) {
        self.removed.store(true, Relaxed);
    }

    /// An active probe passed or failed: up after `rise` passes in a row,
    /// down after `fall` failures in a row.
    pub fn observe_probe(&self, passed: bool, rise: u32, fall: u32) -> Option<Flip> {
        if passed {
            self.checks_failed_in_row.store(0, Relaxed);
            let n = self.checks_ok_in_row.fetch_add(1, Relaxed) + 1;
            let first = self.unproven.swap(false, Relaxed);
            if (n >= rise || first) && !self.healthy.swap(true, Relaxed) {
                self.failures_in_row.store(0, Relaxed);
                return Some(Flip::Up);
            }
        } else {
            self.checks_ok_in_row.store(0, Relaxed);
            let n = self.checks_failed_in_row.fetch_add(1, Relaxed) + 1;
            if n >= fall && self.healthy.swap(false, Relaxed) {
                return Some(Flip::Down);
            }
        }
        None
    }

    /// A request to it failed (connect error, reset, 5xx): down after `fall`
    /// in a row, until probes pass again. Returns the failures in a row and
    /// whether this one took it down.
    pub fn request_failed(&self, fall: u32) -> (u32, Option<Flip>) {
        let n = self.failures_in_row.fetch_add(1, Relaxed) + 1;
        if n >= fall && self.healthy.swap(false, Relaxed) {
            self.checks_ok_in_row.store(0, Relaxed);
            return (n, Some(Flip::Down));
        }
        (n, None)
    }

    pub fn request_succeeded(&self) {
        if self.failures_in_row.load(Relaxed) != 0 {
            self.failures_in_row.store(0, Relaxed);
        }
    }
}

/// What the XDP counters showed for a backend at their last read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct XdpCounts {
    /// Connections accepted (SYN-ACK seen).
    pub opened: u64,
    /// Connections closed (FIN seen).
    pub closed: u64,
    /// Connections reset (RST seen).
    pub reset: u64,
    /// Packets it sent.
    pub packets: u64,
    /// Bytes it sent.
    pub bytes: u64,
}

/// The class of an HTTP status, as responses are counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StatusClass {
    Success,
    Redirect,
    ClientError,
    ServerError,
    Other,
}

impl StatusClass {
    pub const ALL: [StatusClass; 5] = [
        StatusClass::Success,
        StatusClass::Redirect,
        StatusClass::ClientError,
        StatusClass::ServerError,
        StatusClass::Other,
    ];

    pub fn of(status: u16) -> StatusClass {
        match status {
            200..=299 => StatusClass::Success,
            300..=399 => StatusClass::Redirect,
            400..=499 => StatusClass::ClientError,
            500..=599 => StatusClass::ServerError,
            _ => StatusClass::Other,
        }
    }

    /// The `status` label: `2xx` and so on.
    pub fn name(self) -> &'static str {
        match self {
            StatusClass::Success => "2xx",
            StatusClass::Redirect => "3xx",
            StatusClass::ClientError => "4xx",
            StatusClass::ServerError => "5xx",
            StatusClass::Other => "other",
        }
    }
}

/// Totals for the operators: requests, failures, responses by status
/// class, health probes, the XDP counters.
#[derive(Debug, Default)]
pub struct Stats {
    requests: AtomicU64,
    errors: AtomicU64,
    /// Responses relayed, by `StatusClass` (its discriminant).
    responses: [AtomicU64; StatusClass::ALL.len()],
    probes_passed: AtomicU64,
    probes_failed: AtomicU64,
    xdp: std::sync::Mutex<XdpCounts>,
}

impl Stats {
    /// A response with `status` was relayed from it.
    pub fn responded(&self, status: u16) {
        self.responses[StatusClass::of(status) as usize].fetch_add(1, Relaxed);
    }

    pub fn responses(&self, class: StatusClass) -> u64 {
        self.responses[class as usize].load(Relaxed)
    }

    /// An active health probe of it passed or failed.
    pub fn probed(&self, passed: bool) {
        let c = if passed {
            &self.probes_passed
        } else {
            &self.probes_failed
        };
        c.fetch_add(1, Relaxed);
    }

    /// Probes passed and failed since it joined the fleet.
    pub fn probes(&self) -> (u64, u64) {
        (
            self.probes_passed.load(Relaxed),
            self.probes_failed.load(Relaxed),
        )
    }

    pub fn requests(&self) -> u64 {
        self.requests.load(Relaxed)
    }

    pub fn errors(&self) -> u64 {
        self.errors.load(Relaxed)
    }

    pub fn failed(&self) {
        self.errors.fetch_add(1, Relaxed);
    }

    pub fn xdp(&self) -> XdpCounts {
        *self.xdp.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn set_xdp(&self, counts: XdpCounts) {
        *self.xdp.lock().unwrap_or_else(|e| e.into_inner()) = counts;
    }
}

impl Backend {
    pub fn new(slot: usize, url: &str, addr: SocketAddr, kv_blocks: usize) -> Backend {
        Backend {
            slot,
            url: url.to_owned(),
            addr,
            tls_name: tls_name(url),
            id_hash: xxh3_64(url.as_bytes()),
            generation: GENERATIONS.fetch_add(1, Relaxed),
            load: Load::default(),
            health: Health::default(),
            stats: Stats::default(),
            feedback: Feedback::new(kv_blocks),
            slots: SlotCache::default(),
            closes_after_stream: AtomicBool::new(false),
        }
    }

    /// Whether it may take one more request now: up, and under
    /// `max_in_flight` (0: no limit).
    pub fn has_room(&self, max_in_flight: u32) -> bool {
        self.health.is_up() && (max_in_flight == 0 || self.load.in_flight() < max_in_flight)
    }

    /// Admits a request of `prompt_blocks` blocks, `prefill_blocks` of them
    /// uncached, if it is under `max_in_flight` (0: no limit): one
    /// compare-and-swap, so the limit holds exactly while workers admit
    /// concurrently. The guard counts it until dropped.
    pub fn admit(
        self: &Arc<Self>,
        max_in_flight: u32,
        prefill_blocks: u32,
        prompt_blocks: u32,
    ) -> Option<InFlight> {
        let l = &self.load;
        l.in_flight
            .fetch_update(Relaxed, Relaxed, |n| {
                (max_in_flight == 0 || n < max_in_flight).then_some(n + 1)
            })
            .ok()?;
        l.queued_prefill_blocks.fetch_add(prefill_blocks, Relaxed);
        l.in_flight_blocks.fetch_add(prompt_blocks, Relaxed);
        self.stats.requests.fetch_add(1, Relaxed);
        Some(InFlight {
            backend: self.clone(),
            prefill_blocks,
            prompt_blocks,
            slot: None,
            pin: None,
        })
    }

    /// Counts a connection to it while the guard lives.
    pub fn conn_opened(self: &Arc<Self>) -> ConnCount {
        self.load.open_conns.fetch_add(1, Relaxed);
        ConnCount(self.clone())
    }

    /// The view selection gets.
    pub fn view(&self, max_in_flight: u32) -> BackendLoad {
        let l = &self.load;
        BackendLoad {
            eligible: self.has_room(max_in_flight),
            // The peer replicas' work counts as this one's own, from their
            // streams; the connections of those on this host are part of
            // what XDP sees beyond this router, idle ones included, and are
            // not counted again (decision 0056).
            in_flight: l.in_flight() + l.remote.in_flight(),
            queued_prefill_blocks: l.queued_prefill_blocks() + l.remote.queued_prefill_blocks(),
            external_conns: l
                .external_conns()
                .saturating_sub(l.remote.local_peer_conns()),
            id_hash: self.id_hash,
            in_flight_blocks: l.in_flight_blocks(),
            capacity_blocks: u32::try_from(self.feedback.capacity()).unwrap_or(u32::MAX),
            prefill_rate: self.feedback.prefill_rate() as f32,
            private_lost: (1.0 - self.feedback.private_kept()) as f32,
            // Set by the router, which owns the index and the slot model.
            cached_blocks: 0,
            evict_cost_blocks: 0.0,
        }
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

    /// The slots in the fleet.
    pub fn slot_set(&self) -> BackendSet {
        self.backends.iter().map(|b| b.slot).collect()
    }
}

/// Counts a request in flight on a backend until dropped, so every exit path
/// (success, error, cancelled task) gives the load back. Made by
/// [`Backend::admit`].
pub struct InFlight {
    backend: Arc<Backend>,
    prefill_blocks: u32,
    prompt_blocks: u32,
    /// A slot engine's slot the request runs in, freed on drop.
    slot: Option<usize>,
    /// The clock stamp of its prompt's blocks, when the index learned
    /// them, and whether the engine runs it yet ([`Load::pinned_before`]).
    pin: Option<(u64, bool)>,
}

impl InFlight {
    /// The request runs in this slot of a slot engine (`fleet::slots`):
    /// it is freed when the guard drops, however the attempt ends.
    pub fn hold_slot(&mut self, slot: Option<usize>) {
        self.slot = slot;
    }

    /// The index learned its prompt's blocks at clock `stamp`
    /// (`Router::learn`): until it ends it pins them ([`Load::pinned_before`]).
    /// `computing`: the first block the engine computes for it, by
    /// position and hash ([`Load::computing_within`]).
    pub fn pin(&mut self, stamp: u64, computing: Option<(u32, u64)>) {
        self.backend.load.pins().push(Pin {
            stamp,
            blocks: self.prompt_blocks,
            running: false,
            computing,
            remote: None,
        });
        self.pin = Some((stamp, false));
    }

    /// Gives back the prompt's blocks to the backend's queued prefill, once.
    fn end_queued_prefill(&mut self) {
        let n = std::mem::take(&mut self.prefill_blocks);
        self.backend
            .load
            .queued_prefill_blocks
            .fetch_sub(n, Relaxed);
    }

    /// The first byte of the response body arrived: the prompt is prefilled.
    pub fn prefilled(&mut self) {
        self.end_queued_prefill();
        if let Some((stamp, running)) = &mut self.pin
            && !*running
        {
            *running = true;
            if let Some(p) = self
                .backend
                .load
                .pins()
                .iter_mut()
                .find(|p| p.stamp == *stamp && p.remote.is_none())
            {
                p.running = true;
            }
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.end_queued_prefill();
        if let Some((stamp, _)) = self.pin.take() {
            let mut pins = self.backend.load.pins();
            if let Some(i) = pins
                .iter()
                .position(|p| p.stamp == stamp && p.remote.is_none())
            {
                pins.swap_remove(i);
            }
        }
        if let Some(s) = self.slot.take() {
            self.backend.slots.finished(s);
        }
        let l = &self.backend.load;
        l.in_flight_blocks.fetch_sub(self.prompt_blocks, Relaxed);
        l.in_flight.fetch_sub(1, Relaxed);
    }
}

/// Counts an open connection to a backend until dropped. Made by
/// [`Backend::conn_opened`].
#[derive(Debug)]
pub struct ConnCount(Arc<Backend>);

impl ConnCount {
    pub fn backend(&self) -> &Arc<Backend> {
        &self.0
    }
}

impl Drop for ConnCount {
    fn drop(&mut self) {
        self.0.load.open_conns.fetch_sub(1, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_s_request_pins_like_one_of_this_router_s_own() {
        let b = backend();
        let l = &b.load;
        let none = |_: u64, _: u32| 0;
        // Sent by peer 3, not running yet: an age from its stamp is unknown.
        l.pin_remote(3, 7, 100, 40, Some((10, 0xabc)));
        assert_eq!(l.pinned_before(100, 5, none), None);
        // Another request's prompt computing those blocks holds this one.
        l.remote.set(3, 1, 30);
        assert!(l.computing_within(
            &[0; 10].iter().chain(&[0xabc]).copied().collect::<Vec<_>>(),
            11
        ));
        // Running: its prompt and answer count after its stamp.
        l.remote_prefilled(3, 7);
        assert_eq!(l.pinned_before(200, 5, none), Some(45));
        assert_eq!(l.pinned_before(50, 5, none), Some(5));
        // Ended, or its peer gone: nothing.
        l.unpin_remote(3, 7);
        assert_eq!(l.pinned_before(200, 5, none), Some(0));
        l.pin_remote(3, 8, 300, 10, None);
        l.remote_prefilled(3, 8);
        l.unpin_peer(3);
        assert_eq!(l.pinned_before(400, 5, none), Some(0));
    }

    #[test]
    fn the_peers_work_sums_exactly_as_each_peer_reports_it() {
        let r = Remote::default();
        r.set(0, 3, 100);
        r.bump(1, 50);
        r.bump(1, 20);
        assert_eq!((r.in_flight(), r.queued_prefill_blocks()), (5, 170));
        r.set(1, 0, 0);
        r.set(0, 1, 10);
        assert_eq!((r.in_flight(), r.queued_prefill_blocks()), (1, 10));
        r.set(99, 5, 5); // no such cell: ignored
        assert_eq!(r.in_flight(), 1);
    }

    fn backend() -> Arc<Backend> {
        Arc::new(Backend::new(
            0,
            "http://e:1",
            "127.0.0.1:1".parse().unwrap(),
            64,
        ))
    }

    #[test]
    fn running_requests_pin_what_an_age_does_not_count() {
        let b = backend();
        // Sent at clock 100 (40 blocks, 10 of them sent again since), 300
        // (50 blocks) and 500 (still queued in the engine).
        let mut early = b.admit(0, 0, 40).unwrap();
        early.pin(100, None);
        let mut mid = b.admit(0, 0, 50).unwrap();
        mid.pin(300, None);
        let mut queued = b.admit(0, 0, 70).unwrap();
        queued.pin(500, None);
        let resent = |stamp: u64, _| if stamp == 100 { 10 } else { 0 };
        // Nothing runs yet: nothing is pinned.
        assert_eq!(b.load.pinned_before(400, 8, resent), Some(0));
        early.prefilled();
        mid.prefilled();
        // A block last sent at 400: both running prompts were sent before
        // it, each running request writes an 8-block answer.
        assert_eq!(b.load.pinned_before(400, 8, resent), Some(30 + 50 + 16));
        // At 200 only the first was; the second's prompt is in the age.
        assert_eq!(b.load.pinned_before(200, 8, resent), Some(30 + 16));
        // The blocks the queued request sent are not computed yet: their
        // age tells nothing.
        assert_eq!(b.load.pinned_before(500, 8, resent), None);
        // An ended request pins nothing.
        drop(early);
        assert_eq!(b.load.pinned_before(400, 8, resent), Some(50 + 8));
        drop(queued);
        assert_eq!(b.load.pinned_before(500, 8, resent), Some(50 + 8));
        drop(mid);
        assert_eq!(b.load.pinned_before(500, 8, resent), Some(0));
        assert!(b.load.pins().is_empty());
    }

    #[test]
    fn blocks_a_queued_request_computes_are_not_cached_yet() {
        let b = backend();
        let prompt: Vec<u64> = (1..=100).collect();
        // The engine held the first 20 blocks; this request computes the rest.
        let mut first = b.admit(0, 80, 100).unwrap();
        first.pin(7, Some((20, prompt[20])));
        // Another request predicted to find 60 of them: 40 are not there yet.
        assert!(b.load.computing_within(&prompt, 60));
        // Predicted to find only what the engine held before: nothing to wait for.
        assert!(!b.load.computing_within(&prompt, 20));
        // Another prompt that shares the first 20 blocks only.
        let other: Vec<u64> = (1..=20).chain(500..580).collect();
        assert!(!b.load.computing_within(&other, 60));
        // Once the engine runs it (its first token), the blocks are cached.
        first.prefilled();
        assert!(!b.load.computing_within(&prompt, 60));
        drop(first);
        let mut gone = b.admit(0, 80, 100).unwrap();
        gone.pin(9, Some((0, prompt[0])));
        assert!(b.load.computing_within(&prompt, 1));
        drop(gone);
        assert!(
            !b.load.computing_within(&prompt, 100),
            "an ended request computes nothing"
        );
    }
}
