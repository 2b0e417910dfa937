//! Catching up: a replica that starts (or restarts in a rolling upgrade)
//! asks its peers, one after another, for their index, and restores the
//! first whole answer before it counts as warm. A peer that does not answer
//! within what is left of `replicas.snapshot_timeout_ms` is skipped; its own
//! address (the answer is signed with this replica's id) too.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, info};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use super::publish::snapshot_addr;
use crate::fleet::backend::Backend;
use crate::replica::wire::{self, Body, Key, Kind, Payload, seal};
use crate::shared::Router;

/// What catching up gave.
pub struct Caught {
    pub from: Option<String>,
    pub blocks: u64,
}

pub fn catch_up(router: &Arc<Router>, key: &Key, peers: &[String]) -> Caught {
    let none = Caught {
        from: None,
        blocks: 0,
    };
    let Some(replica) = router.replica.clone() else {
        return none;
    };
    let timeout = Duration::from_millis(router.config.load().replicas.snapshot_timeout_ms);
    let deadline = Instant::now() + timeout;
    let Ok(rt) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return none;
    };
    for peer in peers {
        let Ok(addr) = peer.parse::<SocketAddr>() else {
            continue;
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        let got = rt.block_on(async {
            tokio::time::timeout(left, fetch(router, key, replica.id, snapshot_addr(addr))).await
        });
        match got {
            Ok(Some(blocks)) => {
                info!(peer, blocks, "replica caught up from a peer's snapshot");
                return Caught {
                    from: Some(peer.clone()),
                    blocks,
                };
            }
            Ok(None) => debug!(peer, "replica snapshot: none from this peer"),
            Err(_) => debug!(peer, "replica snapshot: timed out"),
        }
    }
    none
}

/// One peer's snapshot, restored; `None` when it is this replica, or the
/// answer was not whole.
async fn fetch(router: &Router, key: &Key, me: u64, addr: SocketAddr) -> Option<u64> {
    let mut socket = zeromq::DealerSocket::new();
    socket.connect(&format!("tcp://{addr}")).await.ok()?;
    let request = seal(Payload::new(Kind::SnapshotRequest, 0), me, 0, key);
    socket.send(ZmqMessage::from(request)).await.ok()?;
    let fleet = router.fleet.load_full();
    let by_id: HashMap<u64, &Arc<Backend>> =
        fleet.backends.iter().map(|b| (b.id_hash, b)).collect();
    // Gathered whole first: a snapshot cut short restores nothing.
    let mut got: Vec<(usize, Vec<[u64; 2]>)> = Vec::new();
    let mut next = 0;
    loop {
        let m = socket.recv().await.ok()?;
        let frame = m.into_vec().pop()?;
        let msg = wire::open(&frame, key).ok()?;
        if msg.sender == me || msg.seq != next {
            return None;
        }
        next += 1;
        match msg.body {
            Body::SnapshotBlocks {
                backend,
                capacity,
                pairs,
            } => {
                let Some(b) = by_id.get(&backend) else {
                    continue;
                };
                b.feedback.adopt_capacity(capacity as usize);
                let words: Vec<u64> = pairs.iter().collect();
                let chunk = words.chunks_exact(2).map(|p| [p[0], p[1]]);
                match got.last_mut() {
                    Some((slot, v)) if *slot == b.slot => v.extend(chunk),
                    _ => got.push((b.slot, chunk.collect())),
                }
            }
            Body::SnapshotEnd { .. } => break,
            _ => return None,
        }
    }
    let mut blocks = 0;
    for (slot, pairs) in got {
        blocks += pairs.len() as u64;
        router.index.restore(slot, &pairs);
    }
    Some(blocks)
}
