//! Following one peer: a thread with a small tokio runtime subscribed to
//! its stream, applying each message this replica can check (the shared
//! key's MAC first) to the index and the load view.
//!
//! - A message signed by anyone else, or malformed, is dropped and counted.
//! - Sequence numbers: a skip counts as a gap (those decisions are lost:
//!   the index is a guess, and the next ones refresh it); a new sender id
//!   at the same address is a restart, and its old work in flight is
//!   forgotten.
//! - A peer silent past `replicas.stale_ms` is stalled: its work in flight
//!   no longer counts, until it speaks again.
//! - A stream under this replica's own id is this replica: not followed.
//! - A peer on this host (its stream's address is one of this host's) has
//!   its open connections counted apart from what XDP sees here: they are
//!   its, and its work comes from its stream.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use tracing::{debug, info, warn};
use zeromq::{Socket, SocketRecv};

use crate::fleet::backend::{Backend, Fleet};
use crate::fleet::feedback::Lesson;
use crate::replica::status::PeerPhase;
use crate::replica::wire::{self, Body, Key, WireError, load_entries};
use crate::shared::Router;

/// How long a connection attempt may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Pause between failed connection attempts.
const RETRY_PAUSE: Duration = Duration::from_millis(200);
/// How often the thread checks whether it should stop or the peer stalled.
const POLL: Duration = Duration::from_millis(100);

/// A running follower; stops when dropped.
pub struct Follower {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// Its cell in each backend's `Remote` load, if it got one.
    pub peer: Option<usize>,
}

impl Follower {
    pub fn spawn(
        router: Arc<Router>,
        key: Key,
        addr: String,
        peer: Option<usize>,
    ) -> std::io::Result<Follower> {
        let stop = Arc::new(AtomicBool::new(false));
        let s = Stream {
            router,
            key,
            addr,
            peer,
            stop: stop.clone(),
            sender: None,
            next: 0,
            by_id: HashMap::new(),
            fleet: None,
            loaded: Vec::new(),
            local: None,
            connected: Vec::new(),
            hashes: Vec::new(),
            keys: Vec::new(),
            ages: Vec::new(),
        };
        let thread = std::thread::Builder::new()
            .name("replica-follow".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        warn!(error = %e, "replicas: no runtime for a follower");
                        return;
                    }
                };
                let mut s = s;
                rt.block_on(s.run());
                s.forget_load();
            })?;
        Ok(Follower {
            stop,
            thread: Some(thread),
            peer,
        })
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        // It ends within POLL, or a connect timeout.
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Stream {
    router: Arc<Router>,
    key: Key,
    addr: String,
    peer: Option<usize>,
    stop: Arc<AtomicBool>,
    /// The id the peer publishes under, once heard.
    sender: Option<u64>,
    /// The next sequence number expected.
    next: u64,
    /// The fleet's backends by their URL's hash, for the fleet `fleet`.
    by_id: HashMap<u64, Arc<Backend>>,
    fleet: Option<Arc<Fleet>>,
    /// Backends this peer's load was last counted on.
    loaded: Vec<Arc<Backend>>,
    /// Whether the peer shares this host, once its address was resolved.
    local: Option<bool>,
    /// Backends this peer's connections were last counted on.
    connected: Vec<Arc<Backend>>,
    hashes: Vec<u64>,
    keys: Vec<u64>,
    ages: Vec<u64>,
}

impl Stream {
    async fn run(&mut self) {
        loop {
            if self.stop.load(Relaxed) {
                return;
            }
            let mut opts = zeromq::SocketOptions::default();
            opts.connect_timeout(CONNECT_TIMEOUT);
            let mut sub = zeromq::SubSocket::with_options(opts);
            let ep = format!("tcp://{}", self.addr);
            let connected = tokio::time::timeout(CONNECT_TIMEOUT * 2, sub.connect(&ep)).await;
            if !matches!(connected, Ok(Ok(()))) || sub.subscribe("").await.is_err() {
                debug!(peer = %self.addr, "replicas: not connected, retrying");
                drop(sub);
                tokio::time::sleep(RETRY_PAUSE).await;
                continue;
            }
            if self.follow(&mut sub).await {
                return;
            }
        }
    }

    /// Applies the stream until told to stop (true) or the peer is this
    /// replica itself (true).
    async fn follow(&mut self, sub: &mut zeromq::SubSocket) -> bool {
        let mut last = Instant::now();
        let mut stalled = false;
        loop {
            if self.stop.load(Relaxed) {
                return true;
            }
            tokio::select! {
                m = sub.recv() => match m {
                    Ok(m) => {
                        last = Instant::now();
                        if stalled {
                            stalled = false;
                            info!(peer = %self.addr, "replica peer speaks again");
                        }
                        for frame in m.into_vec() {
                            if self.frame(&frame) {
                                return true;
                            }
                        }
                    }
                    Err(e) => {
                        debug!(peer = %self.addr, error = %e, "replicas: receive failed");
                        return false;
                    }
                },
                _ = tokio::time::sleep(POLL) => {}
            }
            let stale = Duration::from_millis(self.router.config.load().replicas.stale_ms);
            if !stalled && last.elapsed() > stale {
                stalled = true;
                warn!(peer = %self.addr, silent_ms = last.elapsed().as_millis() as u64, "replica peer stalled: its work in flight no longer counts");
                self.forget_load();
                self.status(|s| s.phase = PeerPhase::Stalled);
            }
        }
    }

    fn status(&self, f: impl FnOnce(&mut crate::replica::status::PeerState)) {
        if let Some(r) = &self.router.replica {
            r.status.update(&self.addr, f);
        }
    }

    /// One frame; true when the stream is this replica's own.
    fn frame(&mut self, frame: &[u8]) -> bool {
        let Some(me) = self.router.replica.as_ref().map(|r| r.id) else {
            return true;
        };
        let m = match wire::open(frame, &self.key) {
            Ok(m) => m,
            Err(e) => {
                self.status(|s| match e {
                    WireError::Unauthenticated => s.unauthenticated += 1,
                    _ => s.malformed += 1,
                });
                return false;
            }
        };
        if m.sender == me {
            info!(peer = %self.addr, "replicas: this address is this replica; not following it");
            self.status(|s| s.phase = PeerPhase::Myself);
            return true;
        }
        if self.sender != Some(m.sender) {
            if self.sender.is_some() {
                info!(peer = %self.addr, "replica peer restarted (a new id)");
                self.forget_load();
                self.status(|s| s.restarts += 1);
            }
            self.sender = Some(m.sender);
            self.next = m.seq;
        }
        let gap = m.seq.saturating_sub(self.next);
        self.next = m.seq + 1;
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let bytes = frame.len() as u64;
        let sender = m.sender;
        let seq = m.seq;
        let unknown = self.apply(m.body);
        self.status(|s| {
            s.phase = PeerPhase::Live;
            s.sender = Some(format!("{sender:016x}"));
            s.last_seq = Some(seq);
            s.gaps += gap;
            s.messages += 1;
            s.bytes += bytes;
            s.unknown_backend += u64::from(unknown);
            s.last_message_unix = Some(now);
        });
        false
    }

    /// Applies one checked message; true when it named a backend this
    /// replica does not have.
    fn apply(&mut self, body: Body) -> bool {
        self.refresh_fleet();
        match body {
            Body::Sent {
                backend,
                request,
                matched,
                prefill,
                hashes,
                keys,
            } => {
                let Some(b) = self.by_id.get(&backend).cloned() else {
                    return true;
                };
                hashes.to_vec_into(&mut self.hashes);
                keys.to_vec_into(&mut self.keys);
                let stamp = self
                    .router
                    .learn_remote(&b, &self.hashes, &self.keys, &mut self.ages);
                if let Some(peer) = self.peer {
                    b.load.remote.bump(peer, prefill);
                    // Pinned as this replica's own requests are: its blocks
                    // are not in the engine's cache until it runs.
                    if let Some(stamp) = stamp {
                        let computing = self.hashes.get(matched as usize).map(|&h| (matched, h));
                        let n = self.hashes.len() as u32;
                        b.load.pin_remote(peer, request, stamp, n, computing);
                    }
                    if !self.loaded.iter().any(|l| Arc::ptr_eq(l, &b)) {
                        self.loaded.push(b);
                    }
                }
            }
            Body::Prefilled { backend, request } => {
                if let (Some(b), Some(peer)) = (self.by_id.get(&backend), self.peer) {
                    b.load.remote_prefilled(peer, request);
                }
            }
            Body::Done { backend, request } => {
                if let (Some(b), Some(peer)) = (self.by_id.get(&backend), self.peer) {
                    b.load.unpin_remote(peer, request);
                }
            }
            Body::Flushed { backend, hashes } => {
                let Some(b) = self.by_id.get(&backend).cloned() else {
                    return true;
                };
                hashes.to_vec_into(&mut self.hashes);
                self.router.flushed_remote(&b, &self.hashes);
            }
            Body::Load(entries) => {
                let mut now = Vec::new();
                let mut unknown = false;
                for e in load_entries(entries) {
                    let Some(b) = self.by_id.get(&e.backend) else {
                        unknown = true;
                        continue;
                    };
                    self.router.answered_remote(b, e.answer_blocks);
                    if let Some(peer) = self.peer {
                        b.load
                            .remote
                            .set(peer, e.in_flight, e.queued_prefill_blocks);
                        now.push(b.clone());
                    }
                }
                let Some(peer) = self.peer else {
                    return unknown;
                };
                for b in &self.loaded {
                    if !now.iter().any(|n| Arc::ptr_eq(n, b)) {
                        b.load.remote.set(peer, 0, 0);
                    }
                }
                self.loaded = now;
                return unknown;
            }
            Body::Conns(entries) => {
                let Some(peer) = self.peer else {
                    return false;
                };
                if !*self.local.get_or_insert_with(|| on_this_host(&self.addr)) {
                    return false;
                }
                let mut now = Vec::new();
                let mut unknown = false;
                for (backend, n) in wire::conns_entries(entries) {
                    let Some(b) = self.by_id.get(&backend) else {
                        unknown = true;
                        continue;
                    };
                    b.load.remote.set_conns(peer, n);
                    now.push(b.clone());
                }
                for b in &self.connected {
                    if !now.iter().any(|n| Arc::ptr_eq(n, b)) {
                        b.load.remote.set_conns(peer, 0);
                    }
                }
                self.connected = now;
                return unknown;
            }
            Body::Learned {
                backend,
                what,
                a,
                b,
            } => {
                let Some(be) = self.by_id.get(&backend) else {
                    return true;
                };
                // A lesson of a later build is skipped, not a fault.
                if let Some(l) = Lesson::decode(what, a, b) {
                    be.feedback.learn(l);
                }
            }
            Body::Stored { backend, id } => {
                if !self.by_id.contains_key(&backend) {
                    return true;
                }
                if let Ok(id) = std::str::from_utf8(id) {
                    self.router.stored.store(id, backend);
                }
            }
            // Snapshots go to the snapshot socket, not the stream.
            Body::SnapshotRequest | Body::SnapshotBlocks { .. } | Body::SnapshotEnd { .. } => {}
        }
        false
    }

    /// The backends by URL hash, rebuilt when the fleet changed.
    fn refresh_fleet(&mut self) {
        let fleet = self.router.fleet.load_full();
        if self.fleet.as_ref().is_some_and(|f| Arc::ptr_eq(f, &fleet)) {
            return;
        }
        self.by_id = fleet
            .backends
            .iter()
            .map(|b| (b.id_hash, b.clone()))
            .collect();
        self.fleet = Some(fleet);
    }

    /// This peer's work in flight counts nowhere any more.
    fn forget_load(&mut self) {
        if let Some(peer) = self.peer {
            for b in self.loaded.drain(..) {
                b.load.remote.set(peer, 0, 0);
            }
            for b in self.connected.drain(..) {
                b.load.remote.set_conns(peer, 0);
            }
            for b in self.router.fleet.load().backends.iter() {
                b.load.unpin_peer(peer);
            }
        }
    }
}

/// Whether `addr` (`host:port`) is an address of this host: loopback, or
/// one a socket can bind here. A name that does not resolve is not.
fn on_this_host(addr: &str) -> bool {
    use std::net::{ToSocketAddrs, UdpSocket};
    let Ok(addrs) = addr.to_socket_addrs() else {
        return false;
    };
    addrs
        .map(|a| a.ip())
        .any(|ip| ip.is_loopback() || UdpSocket::bind((ip, 0)).is_ok())
}

#[cfg(test)]
mod tests {
    use super::on_this_host;

    #[test]
    fn loopback_and_this_hosts_addresses_are_this_host_others_are_not() {
        assert!(on_this_host("127.0.0.1:7000"));
        assert!(on_this_host("[::1]:7000") || std::net::UdpSocket::bind("[::1]:0").is_err());
        assert!(on_this_host("localhost:7000"));
        // TEST-NET-3 (RFC 5737): never an address of this host.
        assert!(!on_this_host("203.0.113.9:7000"));
    }
}
