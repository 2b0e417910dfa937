//! vLLM's KV-cache event stream (`vllm/distributed/kv_events.py`), published
//! from what the simulated cache really stores, evicts and clears.
//!
//! - Live stream: a ZMQ PUB socket on 127.0.0.1:`--kv-events-port`; each
//!   message is three frames: the topic, the sequence number (8 bytes big
//!   endian, from 0) and a msgpack batch `[ts, events, data_parallel_rank]`
//!   (or a map with those names, `--kv-events-encoding map`).
//! - Events: `BlockStored` (block hashes, the parent's hash, the blocks'
//!   token ids, block size, ...), `BlockRemoved` (hashes), `AllBlocksCleared`;
//!   arrays tagged first (msgspec `array_like`) or maps with a `type` key
//!   and default fields left out.
//! - Replay: a ZMQ ROUTER socket on `--kv-events-replay-port`; a DEALER sends
//!   `[b"", start_seq]` and gets `[b"", seq, payload]` for every buffered
//!   batch from `start_seq` on, then `[b"", -1, b""]`.
//!
//! Faults (`--kv-events-drop-seq`, and at run time through `POST
//! /sim/faults`): a batch left out of the live stream (kept for replay), a
//! batch lost for good, the stream dying for a while (both sockets closed;
//! batches meanwhile are kept for replay), and an engine restart (the cache
//! emptied without an event, the sequence back at 0, the replay buffer gone).
//!
//! Invariant: one batch per wake-up of the publisher, holding every event the
//! cache recorded since the last, in order; the engine lock is held only to
//! take them.

use super::block_hash::{BLOCK_SIZE, BlockHash};
use super::config::EngineArgs;
use super::core::Engine;
use super::tokenize::Token;
use bytes::Bytes;
use rmpv::Value;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::Notify;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// How the events and batches are encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Encoding {
    /// msgspec `array_like`: `["BlockStored", hashes, parent, ...]`.
    Array,
    /// Maps with a `type` key, default fields left out (vLLM PR 42892).
    Map,
}

/// One change of the cache, recorded in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheEvent {
    /// A block now caches the content keyed by `hash`.
    Stored {
        hash: BlockHash,
        /// The previous block of its sequence (`None` for the first).
        parent: Option<BlockHash>,
        tokens: Vec<Token>,
        /// The extra key folded into its hash (the cache salt of a
        /// sequence's first block), sent in `extra_keys`.
        extra: Option<Vec<u8>>,
    },
    /// A cached block was evicted (reused for other content).
    Removed(BlockHash),
    /// Every cached block was forgotten (`/reset_prefix_cache`).
    Cleared,
}

/// Where the cache records events, and whom it wakes.
#[derive(Debug)]
pub struct EventLog {
    pub events: Vec<CacheEvent>,
    pub wake: Arc<Notify>,
}

/// How often the publisher looks at its faults when no event wakes it.
const FAULT_POLL: Duration = Duration::from_millis(50);

/// The settings of a publisher, from the flags.
#[derive(Clone, Debug)]
pub struct Settings {
    pub port: u16,
    pub replay_port: u16,
    pub encoding: Encoding,
    pub topic: String,
    pub buffer: usize,
    pub bytes_hashes: bool,
    pub dp_rank: Option<u32>,
}

impl Settings {
    /// The publisher's settings, when `--kv-events-port` is given.
    pub fn from_args(args: &EngineArgs) -> Option<Settings> {
        let port = args.kv_events_port?;
        Some(Settings {
            port,
            replay_port: args
                .kv_events_replay_port
                .unwrap_or_else(|| port.wrapping_add(1)),
            encoding: args.kv_events_encoding,
            topic: args.kv_events_topic.clone(),
            buffer: args.kv_events_buffer.max(1),
            bytes_hashes: args.kv_events_bytes_hashes,
            dp_rank: args.kv_events_dp_rank,
        })
    }
}

/// The last batches, for the replay socket.
type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// Binds both sockets, makes `engine`'s cache record events and spawns the
/// publisher and the replay server. Returns once both sockets listen.
pub async fn start(engine: Arc<Mutex<Engine>>, s: Settings) -> anyhow::Result<()> {
    let wake = Arc::new(Notify::new());
    engine
        .lock()
        .expect("engine lock")
        .cache
        .record_events(EventLog {
            events: Vec::new(),
            wake: wake.clone(),
        });
    let buffer: Buffer = Arc::new(Mutex::new(VecDeque::new()));
    let publ = bind_pub(s.port).await?;
    let replay = bind_replay(s.replay_port).await?;
    tracing::info!(port = s.port, replay_port = s.replay_port, encoding = ?s.encoding, "publishing KV events");
    let (pause_tx, pause_rx) = tokio::sync::watch::channel(None::<Instant>);
    tokio::spawn(serve_replay(
        replay,
        buffer.clone(),
        s.replay_port,
        pause_rx,
    ));
    tokio::spawn(publish(engine, s, wake, buffer, publ, pause_tx));
    Ok(())
}

async fn bind_pub(port: u16) -> anyhow::Result<zeromq::PubSocket> {
    let mut p = zeromq::PubSocket::new();
    p.bind(&format!("tcp://127.0.0.1:{port}")).await?;
    Ok(p)
}

async fn bind_replay(port: u16) -> anyhow::Result<zeromq::RouterSocket> {
    let mut r = zeromq::RouterSocket::new();
    r.bind(&format!("tcp://127.0.0.1:{port}")).await?;
    Ok(r)
}

/// Binds again after a pause, retrying while the port is still held.
async fn rebind_pub(port: u16) -> zeromq::PubSocket {
    loop {
        match bind_pub(port).await {
            Ok(p) => return p,
            Err(e) => {
                tracing::warn!(error = %e, port, "KV events: rebinding the PUB socket");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Takes the cache's events, one batch per wake-up, and publishes them.
async fn publish(
    engine: Arc<Mutex<Engine>>,
    s: Settings,
    wake: Arc<Notify>,
    buffer: Buffer,
    publ: zeromq::PubSocket,
    pause_tx: tokio::sync::watch::Sender<Option<Instant>>,
) {
    let mut publ = Some(publ);
    let mut seq: u64 = 0;
    loop {
        let _ = tokio::time::timeout(FAULT_POLL, wake.notified()).await;
        let now = Instant::now();
        let (events, drop_live, lose, restart, pause_until) = {
            let mut e = engine.lock().expect("engine lock");
            let restart = std::mem::take(&mut e.faults.kv_events_restart);
            if restart {
                // A restarted engine comes back empty and says nothing of it.
                e.cache.reset();
                let _ = e.cache.take_events();
            }
            let pause = e.faults.kv_events_pause_until.filter(|&t| now < t);
            let (drop_live, lose) = (e.faults.kv_events_drop_seq, e.faults.kv_events_lose_seq);
            (e.cache.take_events(), drop_live, lose, restart, pause)
        };
        if restart {
            tracing::info!(
                last_seq = seq.checked_sub(1),
                "KV events: simulated engine restart, sequence back at 0"
            );
            seq = 0;
            buffer.lock().expect("buffer lock").clear();
        }
        // The stream dies while paused: both sockets closed, then bound again.
        if pause_until.is_some() != pause_tx.borrow().is_some() {
            let _ = pause_tx.send(pause_until);
        }
        match (pause_until, publ.is_some()) {
            (Some(_), true) => {
                tracing::info!("KV events: stream paused (sockets closed)");
                publ = None;
            }
            (None, false) => {
                publ = Some(rebind_pub(s.port).await);
                tracing::info!("KV events: stream resumed");
            }
            _ => {}
        }
        if events.is_empty() {
            continue;
        }
        let payload = Bytes::from(encode_batch(
            unix_ts(),
            &events,
            s.encoding,
            s.bytes_hashes,
            s.dp_rank,
        ));
        let this = seq;
        seq += 1;
        if lose != Some(this) {
            let mut b = buffer.lock().expect("buffer lock");
            b.push_back((this, payload.clone()));
            while b.len() > s.buffer {
                b.pop_front();
            }
        }
        if drop_live == Some(this) || lose == Some(this) {
            tracing::info!(seq = this, "KV events: batch left out of the live stream");
            // One-shot: the fault is spent.
            let mut e = engine.lock().expect("engine lock");
            let f = &mut e.faults;
            for f in [&mut f.kv_events_drop_seq, &mut f.kv_events_lose_seq] {
                if *f == Some(this) {
                    *f = None;
                }
            }
            continue;
        }
        let Some(p) = publ.as_mut() else { continue };
        let mut m = ZmqMessage::from(s.topic.clone());
        m.push_back(Bytes::copy_from_slice(&this.to_be_bytes()));
        m.push_back(payload);
        if let Err(e) = p.send(m).await {
            tracing::warn!(error = %e, "KV events: send failed");
        }
    }
}

/// Answers replay requests: every buffered batch from the asked sequence
/// number on, then the end mark. Closed while the stream is paused.
async fn serve_replay(
    socket: zeromq::RouterSocket,
    buffer: Buffer,
    port: u16,
    mut pause: tokio::sync::watch::Receiver<Option<Instant>>,
) {
    let mut socket = Some(socket);
    loop {
        let Some(sock) = socket.as_mut() else {
            // Paused: wait for the pause to end, then bind again.
            if pause.changed().await.is_err() {
                return;
            }
            if pause.borrow().is_none() {
                loop {
                    match bind_replay(port).await {
                        Ok(r) => {
                            socket = Some(r);
                            break;
                        }
                        Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                    }
                }
            }
            continue;
        };
        let req = tokio::select! {
            r = sock.recv() => r,
            c = pause.changed() => {
                if c.is_err() { return; }
                if pause.borrow().is_some() { socket = None; }
                continue;
            }
        };
        let Ok(req) = req else { continue };
        let frames = req.into_vec();
        // [identity, b"", start_seq]
        let (Some(id), Some(start)) = (frames.first(), frames.last()) else {
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(&start[..]) else {
            tracing::warn!(len = start.len(), "KV events: bad replay request");
            continue;
        };
        let start = u64::from_be_bytes(start);
        let batches: Vec<(u64, Bytes)> = buffer
            .lock()
            .expect("buffer lock")
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect();
        tracing::info!(start, batches = batches.len(), "KV events: replay");
        for (seq, payload) in batches
            .into_iter()
            .map(|(s, p)| (s as i64, p))
            .chain([(-1, Bytes::new())])
        {
            let mut m = ZmqMessage::from(id.clone());
            m.push_back(Bytes::new());
            m.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
            m.push_back(payload);
            if sock.send(m).await.is_err() {
                break;
            }
        }
    }
}

fn unix_ts() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// One stored run: blocks chained one after the other, as vLLM reports the
/// blocks of one request computed in one step.
struct StoredRun {
    hashes: Vec<BlockHash>,
    parent: Option<BlockHash>,
    tokens: Vec<Token>,
    /// Per block.
    extra: Vec<Option<Vec<u8>>>,
}

/// Encodes one batch. Consecutive stored blocks of one chain become one
/// `BlockStored`, consecutive removals one `BlockRemoved`.
pub fn encode_batch(
    ts: f64,
    events: &[CacheEvent],
    enc: Encoding,
    bytes_hashes: bool,
    dp_rank: Option<u32>,
) -> Vec<u8> {
    let hash = |h: BlockHash| -> Value {
        if bytes_hashes {
            Value::Binary(hash_bytes(h).to_vec())
        } else {
            Value::from(h)
        }
    };
    let mut out: Vec<Value> = Vec::new();
    let mut run: Option<StoredRun> = None;
    let mut removed: Vec<BlockHash> = Vec::new();
    let flush_run = |run: &mut Option<StoredRun>, out: &mut Vec<Value>| {
        if let Some(r) = run.take() {
            out.push(stored(enc, &r, &hash));
        }
    };
    let flush_removed = |removed: &mut Vec<BlockHash>, out: &mut Vec<Value>| {
        if !removed.is_empty() {
            let hashes = Value::Array(removed.drain(..).map(hash).collect());
            out.push(match enc {
                Encoding::Array => Value::Array(vec![
                    "BlockRemoved".into(),
                    hashes,
                    "GPU".into(),
                    Value::from(0),
                ]),
                Encoding::Map => map(vec![
                    ("type", "BlockRemoved".into()),
                    ("block_hashes", hashes),
                    ("medium", "GPU".into()),
                ]),
            });
        }
    };
    for e in events {
        match e {
            CacheEvent::Stored {
                hash: h,
                parent,
                tokens,
                extra,
            } => {
                flush_removed(&mut removed, &mut out);
                match &mut run {
                    Some(r) if r.hashes.last() == parent.as_ref() => {
                        r.hashes.push(*h);
                        r.tokens.extend_from_slice(tokens);
                        r.extra.push(extra.clone());
                    }
                    _ => {
                        flush_run(&mut run, &mut out);
                        run = Some(StoredRun {
                            hashes: vec![*h],
                            parent: *parent,
                            tokens: tokens.clone(),
                            extra: vec![extra.clone()],
                        });
                    }
                }
            }
            CacheEvent::Removed(h) => {
                flush_run(&mut run, &mut out);
                removed.push(*h);
            }
            CacheEvent::Cleared => {
                flush_run(&mut run, &mut out);
                flush_removed(&mut removed, &mut out);
                out.push(match enc {
                    Encoding::Array => Value::Array(vec!["AllBlocksCleared".into()]),
                    Encoding::Map => map(vec![("type", "AllBlocksCleared".into())]),
                });
            }
        }
    }
    flush_run(&mut run, &mut out);
    flush_removed(&mut removed, &mut out);
    let rank = dp_rank.map_or(Value::Nil, Value::from);
    let batch = match enc {
        Encoding::Array => Value::Array(vec![Value::F64(ts), Value::Array(out), rank]),
        Encoding::Map => {
            let mut fields = vec![("ts", Value::F64(ts)), ("events", Value::Array(out))];
            if dp_rank.is_some() {
                fields.push(("data_parallel_rank", rank));
            }
            map(fields)
        }
    };
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, &batch).expect("writing to a Vec cannot fail");
    buf
}

fn stored(enc: Encoding, r: &StoredRun, hash: &dyn Fn(BlockHash) -> Value) -> Value {
    let hashes = Value::Array(r.hashes.iter().map(|&h| hash(h)).collect());
    let parent = r.parent.map_or(Value::Nil, hash);
    let tokens = Value::Array(r.tokens.iter().map(|&t| Value::from(t)).collect());
    // vLLM's per-block tuples of extra keys (here the cache salt).
    let extra = r.extra.iter().any(Option::is_some).then(|| {
        Value::Array(
            r.extra
                .iter()
                .map(|e| {
                    e.as_ref().map_or(Value::Nil, |b| {
                        Value::Array(vec![Value::from(String::from_utf8_lossy(b).into_owned())])
                    })
                })
                .collect(),
        )
    });
    match enc {
        Encoding::Array => Value::Array(vec![
            "BlockStored".into(),
            hashes,
            parent,
            tokens,
            Value::from(BLOCK_SIZE as u64),
            Value::Nil,                          // lora_id
            "GPU".into(),                        // medium
            Value::Nil,                          // lora_name
            extra.clone().unwrap_or(Value::Nil), // extra_keys
            Value::from(0),                      // group_idx
            "full_attention".into(),             // kv_cache_spec_kind
            Value::Nil,                          // kv_cache_spec_sliding_window
        ]),
        Encoding::Map => {
            let mut f = vec![("type", "BlockStored".into()), ("block_hashes", hashes)];
            if r.parent.is_some() {
                f.push(("parent_block_hash", parent));
            }
            f.push(("token_ids", tokens));
            f.push(("block_size", Value::from(BLOCK_SIZE as u64)));
            f.push(("medium", "GPU".into()));
            if let Some(e) = extra {
                f.push(("extra_keys", e));
            }
            map(f)
        }
    }
}

fn map(fields: Vec<(&str, Value)>) -> Value {
    Value::Map(fields.into_iter().map(|(k, v)| (k.into(), v)).collect())
}

/// A 32-byte block hash standing for `h` (as an engine hashing with sha256
/// would send): distinct for distinct `h`.
pub fn hash_bytes(h: BlockHash) -> [u8; 32] {
    let mut b = [0u8; 32];
    for (i, c) in b.chunks_exact_mut(8).enumerate() {
        c.copy_from_slice(&(h ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_be_bytes());
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(b: &[u8]) -> Value {
        rmpv::decode::read_value(&mut &b[..]).unwrap()
    }

    #[test]
    fn a_chain_is_one_block_stored_and_removals_coalesce() {
        let ev = [
            CacheEvent::Stored {
                hash: 1,
                parent: None,
                tokens: vec![7; 16],
                extra: Some(b"salt".to_vec()),
            },
            CacheEvent::Stored {
                hash: 2,
                parent: Some(1),
                tokens: vec![8; 16],
                extra: None,
            },
            CacheEvent::Removed(9),
            CacheEvent::Removed(u64::MAX),
            CacheEvent::Cleared,
        ];
        let v = decode(&encode_batch(1.5, &ev, Encoding::Array, false, None));
        let events = v[1].as_array().unwrap();
        assert_eq!(events.len(), 3);
        assert_eq!(events[0][0].as_str(), Some("BlockStored"));
        assert_eq!(events[0][1].as_array().unwrap().len(), 2);
        assert!(events[0][2].is_nil());
        assert_eq!(events[0][3].as_array().unwrap().len(), 32);
        assert_eq!(
            events[0][8][0][0].as_str(),
            Some("salt"),
            "extra_keys per block"
        );
        assert!(events[0][8][1].is_nil());
        assert_eq!(events[1][1][1].as_u64(), Some(u64::MAX));
        assert_eq!(events[2][0].as_str(), Some("AllBlocksCleared"));
        assert!(v[2].is_nil());
        let m = decode(&encode_batch(1.5, &ev, Encoding::Map, true, Some(2)));
        let first = &m["events"][0];
        assert_eq!(first["type"].as_str(), Some("BlockStored"));
        assert_eq!(
            first["block_hashes"][0].as_slice().map(<[u8]>::len),
            Some(32)
        );
        assert_eq!(m["data_parallel_rank"].as_u64(), Some(2));
    }
}
