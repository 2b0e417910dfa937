//! The publisher: a thread that drains the workers' outbox onto the PUB
//! socket, numbering and signing each message, and publishes this
//! replica's load per backend; and a task answering snapshot requests on
//! the next port. ZMQ's PUB drops what a slow subscriber cannot take, so
//! no peer can hold this thread back.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use anyhow::Context;
use tracing::{debug, warn};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::replica::Replica;
use crate::replica::wire::{
    self, Body, CONNS_ENTRY_BYTES, Key, Kind, LOAD_ENTRY_BYTES, Payload, seal,
};
use crate::shared::Router;

/// A load message goes at least this often, unchanged or not: the
/// heartbeat peers judge a stall by (`replicas.stale_ms`).
const HEARTBEAT: Duration = Duration::from_millis(100);
/// The connections message goes at least this often, unchanged or not, so
/// a peer that joins learns them.
const CONNS_REFRESH: Duration = Duration::from_secs(1);

/// The snapshot socket of a replica whose stream is on `addr`.
pub fn snapshot_addr(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip(), addr.port().wrapping_add(1))
}

pub fn spawn(
    router: Arc<Router>,
    replica: Arc<Replica>,
    key: Key,
    listen: SocketAddr,
) -> anyhow::Result<()> {
    // One worker thread drives the sockets' own tasks (accepting peers,
    // writing to them, the snapshot server); the publisher thread hands it
    // messages.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("replica-zmq")
        .enable_all()
        .build()
        .context("a runtime for the replica sockets")?;
    // The sockets spawn their tasks on the runtime they are made in.
    let entered = rt.enter();
    let mut socket = zeromq::PubSocket::new();
    rt.block_on(socket.bind(&format!("tcp://{listen}")))
        .with_context(|| format!("binding the replica stream on {listen}"))?;
    let mut snapshots = zeromq::RouterSocket::new();
    let snap = snapshot_addr(listen);
    rt.block_on(snapshots.bind(&format!("tcp://{snap}")))
        .with_context(|| format!("binding the replica snapshot socket on {snap}"))?;
    drop(entered);
    rt.spawn(serve_snapshots(
        snapshots,
        router.clone(),
        replica.clone(),
        key.clone(),
    ));
    std::thread::Builder::new()
        .name("replica-pub".into())
        .spawn(move || {
            replica.outbox.set_publisher(std::thread::current());
            Publisher {
                router,
                replica,
                key,
                socket,
                seq: 0,
                last_load: Vec::new(),
                last_conns: Vec::new(),
            }
            .run(&rt)
        })
        .context("starting the replica publisher")?;
    Ok(())
}

struct Publisher {
    router: Arc<Router>,
    replica: Arc<Replica>,
    key: Key,
    socket: zeromq::PubSocket,
    seq: u64,
    /// The load last published, as its entries' bytes.
    last_load: Vec<u8>,
    /// The connections last published, likewise.
    last_conns: Vec<u8>,
}

impl Publisher {
    fn run(mut self, rt: &tokio::runtime::Runtime) {
        let mut next_load = Instant::now();
        let mut last_sent_load = Instant::now() - HEARTBEAT;
        let mut last_sent_conns = Instant::now() - CONNS_REFRESH;
        // Decisions sent since the last load message: a peer counts each
        // one at once, and the next load message corrects what it counted
        // twice (a request counted in this load but sent after it).
        let mut decided = false;
        loop {
            while let Some(p) = self.replica.outbox.pop() {
                self.send(rt, p);
                decided = true;
            }
            let now = Instant::now();
            if now >= next_load {
                let interval = self.router.config.load().replicas.load_interval_ms;
                next_load = now + Duration::from_millis(interval.max(1));
                let p = self.load();
                if decided || self.last_load != p.1 || now >= last_sent_load + HEARTBEAT {
                    self.last_load = p.1;
                    self.send(rt, p.0);
                    last_sent_load = now;
                    decided = false;
                }
                let c = self.conns();
                if self.last_conns != c.1 || now >= last_sent_conns + CONNS_REFRESH {
                    self.last_conns = c.1;
                    self.send(rt, c.0);
                    last_sent_conns = now;
                }
            }
            std::thread::park_timeout(next_load.saturating_duration_since(Instant::now()));
        }
    }

    fn send(&mut self, rt: &tokio::runtime::Runtime, p: Payload) {
        let frame = seal(p, self.replica.id, self.seq, &self.key);
        self.seq += 1;
        let status = &self.replica.status;
        status.published_messages.fetch_add(1, Relaxed);
        status
            .published_bytes
            .fetch_add(frame.len() as u64, Relaxed);
        if let Err(e) = rt.block_on(self.socket.send(ZmqMessage::from(frame))) {
            debug!(error = %e, "replica stream: send failed");
        }
    }

    /// This replica's own work per backend (peers' work is theirs to
    /// publish) and the answer blocks its engines wrote since the last
    /// load message, and the entries' bytes to tell a change.
    fn load(&self) -> (Payload, Vec<u8>) {
        let fleet = self.router.fleet.load();
        let busy: Vec<_> = fleet
            .backends
            .iter()
            .map(|b| {
                let l = &b.load;
                let answered = l.remote.take_answered();
                (
                    b.id_hash,
                    l.in_flight(),
                    l.queued_prefill_blocks(),
                    answered,
                )
            })
            .filter(|&(_, f, q, a)| f > 0 || q > 0 || a > 0)
            .collect();
        let mut p = Payload::new(Kind::Load, 4 + LOAD_ENTRY_BYTES * busy.len());
        p.u32(busy.len() as u32);
        let mut entries = Vec::with_capacity(LOAD_ENTRY_BYTES * busy.len());
        for (id, f, q, a) in busy {
            p.u64(id).u32(f).u32(q).u32(a);
            entries.extend_from_slice(&id.to_le_bytes());
            entries.extend_from_slice(&f.to_le_bytes());
            entries.extend_from_slice(&q.to_le_bytes());
            entries.extend_from_slice(&a.to_le_bytes());
        }
        (p, entries)
    }

    /// This replica's open connections per backend, and their bytes.
    fn conns(&self) -> (Payload, Vec<u8>) {
        let fleet = self.router.fleet.load();
        let open: Vec<_> = fleet
            .backends
            .iter()
            .map(|b| (b.id_hash, b.load.open_conns()))
            .filter(|&(_, n)| n > 0)
            .collect();
        let mut p = Payload::new(Kind::Conns, 4 + CONNS_ENTRY_BYTES * open.len());
        p.u32(open.len() as u32);
        let mut entries = Vec::with_capacity(CONNS_ENTRY_BYTES * open.len());
        for (id, n) in open {
            p.u64(id).u32(n);
            entries.extend_from_slice(&id.to_le_bytes());
            entries.extend_from_slice(&n.to_le_bytes());
        }
        (p, entries)
    }
}

/// Answers each signed snapshot request with this replica's index: per
/// backend, its blocks oldest first in frames of at most
/// `SNAPSHOT_BLOCKS_PER_FRAME`, then an end frame.
async fn serve_snapshots(
    mut socket: zeromq::RouterSocket,
    router: Arc<Router>,
    replica: Arc<Replica>,
    key: Key,
) {
    loop {
        let msg = match socket.recv().await {
            Ok(m) => m,
            Err(e) => {
                debug!(error = %e, "replica snapshots: receive failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let frames = msg.into_vec();
        let (Some(identity), Some(request)) = (frames.first(), frames.last()) else {
            continue;
        };
        match wire::open(request, &key) {
            Ok(m) if matches!(m.body, Body::SnapshotRequest) => {}
            Ok(_) => continue,
            Err(e) => {
                warn!(error = %e, "replica snapshots: request refused");
                continue;
            }
        }
        let fleet = router.fleet.load_full();
        let mut seq = 0;
        let mut sent = 0u32;
        for b in &fleet.backends {
            let pairs = router.index.export(b.slot);
            // What this replica learned of the engine's capacity (0: none
            // learned nor published), for a replica catching up.
            let learned = b.feedback.capacity_known() || b.feedback.capacity_learned();
            let capacity = if learned {
                b.feedback.capacity() as u64
            } else {
                0
            };
            for chunk in pairs.chunks(wire::SNAPSHOT_BLOCKS_PER_FRAME) {
                let mut p = Payload::new(Kind::SnapshotBlocks, 24 + 16 * chunk.len());
                p.u64(b.id_hash).u64(capacity).words(
                    chunk
                        .iter()
                        .flat_map(|pair| pair.iter().copied())
                        .collect::<Vec<_>>()
                        .into_iter(),
                );
                let frame = seal(p, replica.id, seq, &key);
                seq += 1;
                if reply(&mut socket, identity, frame).await.is_err() {
                    break;
                }
            }
            sent += 1;
        }
        let mut p = Payload::new(Kind::SnapshotEnd, 4);
        p.u32(sent);
        let _ = reply(&mut socket, identity, seal(p, replica.id, seq, &key)).await;
        replica.status.snapshots_served.fetch_add(1, Relaxed);
    }
}

async fn reply(
    socket: &mut zeromq::RouterSocket,
    identity: &bytes::Bytes,
    frame: Vec<u8>,
) -> zeromq::ZmqResult<()> {
    let mut m = ZmqMessage::from(identity.clone());
    m.push_back(frame.into());
    socket.send(m).await
}
