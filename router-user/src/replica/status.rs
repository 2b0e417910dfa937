//! What a replica knows of its peers and of its own stream, written by
//! `control::replicas`, read by `/admin/replicas`, `/admin/backends`,
//! `/ready` and each metrics scrape.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

/// Where a peer's stream stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PeerPhase {
    /// No message yet.
    #[default]
    Connecting,
    /// Messages arrive.
    Live,
    /// Silent past `replicas.stale_ms`: its load no longer counts.
    Stalled,
    /// The address is this replica's own: not followed.
    Myself,
}

/// One peer's stream.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct PeerState {
    pub phase: PeerPhase,
    /// The id it publishes under (a new one: it restarted).
    pub sender: Option<String>,
    /// Times its id changed.
    pub restarts: u64,
    /// The last sequence number applied.
    pub last_seq: Option<u64>,
    /// Messages missed: sequence numbers skipped.
    pub gaps: u64,
    pub messages: u64,
    pub bytes: u64,
    /// Frames dropped: not under the shared key, or malformed under it.
    pub unauthenticated: u64,
    pub malformed: u64,
    /// Messages naming a backend this replica does not have.
    pub unknown_backend: u64,
    /// When its last message arrived, in seconds since 1970.
    pub last_message_unix: Option<f64>,
}

/// This replica's side: its stream, its peers, whether it is warm.
#[derive(Debug, Default)]
pub struct Status {
    peers: Mutex<BTreeMap<String, PeerState>>,
    pub published_messages: AtomicU64,
    pub published_bytes: AtomicU64,
    pub snapshots_served: AtomicU64,
    /// Caught up from a peer's snapshot (or none could give one within
    /// `replicas.snapshot_timeout_ms`): `/ready` answers 200.
    pub warm: AtomicBool,
    /// Blocks restored from the snapshot it started with.
    pub snapshot_blocks: AtomicU64,
}

impl Status {
    /// Changes the state of peer `addr` (a new one starts at the default).
    pub fn update(&self, addr: &str, f: impl FnOnce(&mut PeerState)) {
        let mut m = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        f(m.entry(addr.to_owned()).or_default());
    }

    /// Drops the peers not in `keep`.
    pub fn retain(&self, keep: &[String]) {
        let mut m = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        m.retain(|k, _| keep.contains(k));
    }

    pub fn peers(&self) -> Vec<(String, PeerState)> {
        let m = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }

    pub fn is_warm(&self) -> bool {
        self.warm.load(Relaxed)
    }
}
