//! One subscription per backend: a thread with a small tokio runtime (the
//! `zeromq` crate is async; the data path's monoio never sees it) that
//! follows the engine's live stream and fills holes from its replay socket.
//!
//! Sequence numbers, per stream:
//! - the next expected one is applied;
//! - one that skips ahead is a gap: replay from the expected one; what the
//!   replay cannot give (the engine's buffer no longer holds it) is lost,
//!   so the backend is forgotten and DEGRADED for `recover_ms`;
//! - one at or below the last one seen *on the live stream* means the
//!   engine restarted: its entries are dropped and the stream starts over
//!   at 0 (replayed from 0 if the first batches were missed). Batches below
//!   the expected one but above the last live one are replay overlap,
//!   skipped.
//!
//! On every (re)connection the subscriber replays from the expected number
//! first, so what was published while it was away is applied before the
//! backend is EXACT again. A lost connection (the engine closed it) is
//! DEGRADED at once. Limits: an engine that hangs without closing its
//! socket looks like an idle one (vLLM sends no heartbeat; health probes
//! catch it), and an engine that restarted while the router was away and
//! then published past the last number seen is taken for the same stream.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use tracing::{debug, info, warn};
use zeromq::{Socket, SocketEvent, SocketRecv, SocketSend, ZmqMessage};

use super::Precise;
use super::confidence::Reason;
use super::events::{Groups, decode_batch};

/// How long a connection attempt may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Pause between failed connection attempts.
const RETRY_PAUSE: Duration = Duration::from_millis(200);
/// How long the replay socket may take for each message of an answer.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// How often the thread checks whether it should stop.
const STOP_POLL: Duration = Duration::from_millis(200);

/// Where a backend publishes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoints {
    /// The live PUB socket, `tcp://host:port`.
    pub live: String,
    /// The replay ROUTER socket (none: gaps are never filled).
    pub replay: Option<String>,
    /// Topic prefix subscribed to ("" for all).
    pub topic: String,
}

/// A running subscription; stops when dropped.
pub struct Subscriber {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    pub endpoints: Endpoints,
}

impl Subscriber {
    /// Starts following `endpoints` for backend `slot`.
    pub fn spawn(
        precise: Arc<Precise>,
        slot: usize,
        endpoints: Endpoints,
    ) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let s = Stream {
            precise,
            slot,
            ep: endpoints.clone(),
            stop: stop.clone(),
            next: 0,
            live_last: None,
            groups: Groups::default(),
        };
        let thread = std::thread::Builder::new()
            .name(format!("kv-events-{slot}"))
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        warn!(error = %e, "KV events: no runtime for the subscriber");
                        return;
                    }
                };
                rt.block_on(s.run());
            })?;
        Ok(Subscriber {
            stop,
            thread: Some(thread),
            endpoints,
        })
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        // It ends within STOP_POLL, or a connect or replay timeout.
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Stream {
    precise: Arc<Precise>,
    slot: usize,
    ep: Endpoints,
    stop: Arc<AtomicBool>,
    /// The next sequence number to apply.
    next: u64,
    /// The last sequence number seen on the live stream.
    live_last: Option<u64>,
    groups: Groups,
}

/// A socket's event channel (connects, disconnects).
type Monitor = futures::channel::mpsc::Receiver<SocketEvent>;

/// Why a connection ended.
enum End {
    Stop,
    Lost,
}

impl Stream {
    async fn run(mut self) {
        let precise = self.precise.clone();
        let conf = &precise.confidence[self.slot];
        loop {
            if self.stop.load(Relaxed) {
                return;
            }
            let mut opts = zeromq::SocketOptions::default();
            opts.connect_timeout(CONNECT_TIMEOUT);
            let mut sub = zeromq::SubSocket::with_options(opts);
            let mut monitor = sub.monitor();
            let connected =
                tokio::time::timeout(CONNECT_TIMEOUT * 2, sub.connect(&self.ep.live)).await;
            if !matches!(connected, Ok(Ok(()))) {
                debug!(endpoint = %self.ep.live, "KV events: not connected, retrying");
                drop(sub);
                tokio::time::sleep(RETRY_PAUSE).await;
                continue;
            }
            if let Err(e) = sub.subscribe(&self.ep.topic).await {
                warn!(error = %e, "KV events: subscribe failed");
                continue;
            }
            info!(endpoint = %self.ep.live, next = self.next, "KV events: connected");
            // What was published while away (or before the first connect).
            self.catch_up(self.next, None).await;
            conf.whole();
            match self.follow(&mut sub, &mut monitor).await {
                End::Stop => return,
                End::Lost => {
                    info!(endpoint = %self.ep.live, "KV events: connection lost");
                    conf.disconnected();
                }
            }
        }
    }

    /// Applies live batches until the connection ends.
    async fn follow(&mut self, sub: &mut zeromq::SubSocket, monitor: &mut Monitor) -> End {
        loop {
            if self.stop.load(Relaxed) {
                return End::Stop;
            }
            tokio::select! {
                m = sub.recv() => match m {
                    Ok(m) => self.live(m.into_vec()).await,
                    Err(e) => {
                        debug!(error = %e, "KV events: receive failed");
                        return End::Lost;
                    }
                },
                ev = monitor.next() => match ev {
                    Some(SocketEvent::Disconnected(_)) | None => return End::Lost,
                    Some(_) => {}
                },
                _ = tokio::time::sleep(STOP_POLL) => {}
            }
        }
    }

    /// One live message: `[topic, seq, payload]`.
    async fn live(&mut self, frames: Vec<Bytes>) {
        let precise = self.precise.clone();
        let conf = &precise.confidence[self.slot];
        let (Some(seq), Some(payload)) = (frames.get(frames.len().wrapping_sub(2)), frames.last())
        else {
            conf.decode_errors.fetch_add(1, Relaxed);
            return;
        };
        let Ok(seq) = <[u8; 8]>::try_from(&seq[..]).map(u64::from_be_bytes) else {
            conf.decode_errors.fetch_add(1, Relaxed);
            return;
        };
        let restarted = self.live_last.is_some_and(|l| seq <= l);
        self.live_last = Some(seq);
        if restarted {
            info!(
                slot = self.slot,
                seq, "KV events: sequence went back: engine restarted"
            );
            self.precise.flushed(self.slot);
            conf.restarts.fetch_add(1, Relaxed);
            self.groups = Groups::default();
            self.next = 0;
        }
        if seq < self.next {
            return; // replay overlap
        }
        if seq > self.next {
            conf.gaps.fetch_add(1, Relaxed);
            info!(
                slot = self.slot,
                expected = self.next,
                got = seq,
                "KV events: gap, replaying"
            );
            self.catch_up(self.next, Some(seq)).await;
            if seq < self.next {
                return;
            }
        }
        self.apply(seq, payload);
    }

    fn apply(&mut self, seq: u64, payload: &[u8]) {
        match decode_batch(payload, &mut self.groups) {
            Ok(batch) => self.precise.apply(self.slot, seq, &batch),
            Err(e) => {
                warn!(slot = self.slot, seq, error = %e, "KV events: batch did not decode; forgetting the backend");
                // Counted last: whoever sees the count sees the state too.
                self.precise.lost(self.slot, Reason::DecodeError);
                self.precise.confidence[self.slot]
                    .decode_errors
                    .fetch_add(1, Relaxed);
            }
        }
        self.next = seq + 1;
    }

    /// Replays from `from`. What it cannot give (the replay socket is
    /// unreachable, its buffer no longer holds a batch, or its answer ends
    /// before `upto`, the live batch that showed the gap) is lost: the
    /// backend is forgotten and DEGRADED for a while, and the stream goes on
    /// from what comes next.
    async fn catch_up(&mut self, from: u64, upto: Option<u64>) {
        let asked = self.replay(from).await;
        if !asked || upto.is_some_and(|u| self.next < u) {
            self.lose(from);
            if let Some(u) = upto {
                self.next = self.next.max(u);
            }
        }
    }

    /// Batches from `self.next` on are lost for good.
    fn lose(&mut self, from: u64) {
        info!(
            slot = self.slot,
            from,
            next = self.next,
            "KV events: replay could not fill the gap; forgetting the backend"
        );
        self.precise.lost(self.slot, Reason::Gap);
        self.precise.confidence[self.slot]
            .unfilled_gaps
            .fetch_add(1, Relaxed);
    }

    /// Asks the replay socket for every batch from `from` and applies them
    /// in order; a hole in the answer is lost (see [`Self::lose`]) before
    /// what follows it is applied. False when it could not be asked.
    async fn replay(&mut self, from: u64) -> bool {
        let Some(ep) = self.ep.replay.clone() else {
            return false;
        };
        let precise = self.precise.clone();
        let conf = &precise.confidence[self.slot];
        conf.replays.fetch_add(1, Relaxed);
        let mut opts = zeromq::SocketOptions::default();
        opts.connect_timeout(CONNECT_TIMEOUT);
        let mut d = zeromq::DealerSocket::with_options(opts);
        if !matches!(
            tokio::time::timeout(CONNECT_TIMEOUT * 2, d.connect(&ep)).await,
            Ok(Ok(()))
        ) {
            debug!(endpoint = %ep, "KV events: replay socket unreachable");
            return false;
        }
        let mut req = ZmqMessage::from(Bytes::new());
        req.push_back(Bytes::copy_from_slice(&from.to_be_bytes()));
        if d.send(req).await.is_err() {
            return false;
        }
        loop {
            let Ok(Ok(m)) = tokio::time::timeout(REPLAY_TIMEOUT, d.recv()).await else {
                return false;
            };
            let mut frames = m.into_vec();
            if frames.first().is_some_and(|f| f.is_empty()) {
                frames.remove(0);
            }
            // [seq, payload], or [topic, seq, payload] (newer vLLM).
            let n = frames.len();
            if n < 2 {
                return false;
            }
            let Ok(seq) = <[u8; 8]>::try_from(&frames[n - 2][..]) else {
                return false;
            };
            let seq = i64::from_be_bytes(seq);
            if seq == -1 {
                return true;
            }
            let seq = seq as u64;
            if seq < self.next {
                continue;
            }
            if seq > self.next {
                // The buffer no longer holds what was missed.
                self.lose(self.next);
            }
            conf.replayed_batches.fetch_add(1, Relaxed);
            let payload = frames[n - 1].clone();
            self.apply(seq, &payload);
        }
    }
}
