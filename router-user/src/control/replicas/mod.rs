//! Replicas sharing one mind (`[replicas]`): each router publishes what it
//! sent where, what the engines' answers corrected and its work in flight
//! per backend, and follows every peer's stream into its own index and load
//! view, so that each routes as if it had seen all the traffic.
//!
//! - `publish`: one thread drains the workers' outbox onto a ZMQ PUB socket
//!   (`replicas.listen`), numbering and signing each message, and publishes
//!   this replica's load every `load_interval_ms` (a heartbeat at least every
//!   100 ms); a ROUTER socket on the next port serves snapshots of the index.
//! - `follow`: a thread per peer subscribes to its stream and applies it;
//!   it never touches the request path but through the index and the
//!   atomics routing reads.
//! - `peers`: who the peers are (the static list, a DNS name, files), read
//!   again every `refresh_ms`.
//! - `snapshot`: a replica that starts asks a peer for its index before it
//!   counts as warm (`/ready`).
//!
//! The request path never waits for a peer: a full outbox drops the newest
//! message (counted), a slow subscriber is dropped by ZMQ's PUB, a stalled
//! or lost peer only stops adding its work to the load.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tracing::{info, warn};

use crate::fleet::backend::MAX_PEERS;
use crate::replica::wire::Key;
use crate::shared::Router;

mod follow;
mod peers;
mod publish;
mod snapshot;

use follow::Follower;

/// Starts publishing, then catches up from a peer and follows them all.
/// Nothing without `[replicas] listen`.
pub fn spawn(router: Arc<Router>) -> anyhow::Result<()> {
    let Some(replica) = router.replica.clone() else {
        return Ok(());
    };
    let cfg = router.config.load().replicas.clone();
    let key = Key::derive(&cfg.key_bytes()?);
    let listen = cfg.listen.context("replicas.listen")?;
    publish::spawn(router.clone(), replica, key.clone(), listen)
        .with_context(|| format!("publishing the replica stream on {listen}"))?;
    std::thread::Builder::new()
        .name("replica-peers".into())
        .spawn(move || supervise(&router, &key))
        .context("starting the replica peers thread")?;
    Ok(())
}

/// Catches up, then keeps one follower per peer as the list changes.
fn supervise(router: &Arc<Router>, key: &Key) {
    let Some(replica) = router.replica.clone() else {
        return;
    };
    let started = Instant::now();
    let first = peers::resolve(&router.config.load().replicas);
    let got = snapshot::catch_up(router, key, &first);
    replica
        .status
        .snapshot_blocks
        .store(got.blocks, std::sync::atomic::Ordering::Relaxed);
    replica
        .status
        .warm
        .store(true, std::sync::atomic::Ordering::Relaxed);
    info!(
        peer = got.from.as_deref().unwrap_or("none"),
        blocks = got.blocks,
        ms = started.elapsed().as_millis() as u64,
        "replica warm"
    );
    let mut followers: BTreeMap<String, Follower> = BTreeMap::new();
    let mut list = first;
    loop {
        // Ids for the peers' load cells, reused as peers come and go.
        let mut free: Vec<usize> = (0..MAX_PEERS)
            .filter(|i| followers.values().all(|f| f.peer != Some(*i)))
            .collect();
        free.reverse();
        followers.retain(|addr, _| list.contains(addr));
        for addr in &list {
            if followers.contains_key(addr) {
                continue;
            }
            let peer = free.pop();
            if peer.is_none() {
                warn!(peer = %addr, max = MAX_PEERS, "more peers than load cells: its decisions are followed, its load is not");
            }
            match Follower::spawn(router.clone(), key.clone(), addr.clone(), peer) {
                Ok(f) => {
                    followers.insert(addr.clone(), f);
                }
                Err(e) => warn!(peer = %addr, error = %e, "no thread to follow a replica"),
            }
        }
        replica.status.retain(&list);
        let refresh = Duration::from_millis(router.config.load().replicas.refresh_ms);
        std::thread::sleep(refresh);
        let next = peers::resolve_keeping(&router.config.load().replicas, &list);
        if next != list {
            info!(peers = ?next, "replica peers changed");
        }
        list = next;
    }
}
