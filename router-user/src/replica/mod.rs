//! What a replica tells its peers, as the request path hands it over: the
//! messages' wire format (`wire`), the outbox the workers push them into
//! without waiting (a lock-free bounded queue the publisher thread of
//! `control::replicas` drains), and what is known of each peer (`status`).
//! No sockets, no threads of its own.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::thread::Thread;

use crossbeam_queue::ArrayQueue;

pub mod status;
pub mod wire;

use wire::{Kind, MAX_SHARED_BLOCKS, Payload};

/// Messages the outbox holds before it drops new ones: at 1,000 requests a
/// second, 4 s of a publisher that does not run.
const OUTBOX_MESSAGES: usize = 4_096;
/// Bytes the outbox holds before it drops new ones, whatever their count:
/// 16 MiB bounds what a stalled publisher costs.
const OUTBOX_BYTES: usize = 16 << 20;

/// This router as one of several replicas.
#[derive(Debug)]
pub struct Replica {
    /// Its id: random at each start, so peers see a restart.
    pub id: u64,
    pub outbox: Outbox,
    pub status: status::Status,
}

impl Replica {
    pub fn new(id: u64) -> Replica {
        Replica {
            id,
            outbox: Outbox::new(),
            status: status::Status::default(),
        }
    }
}

/// The queue between the workers and the publisher.
pub struct Outbox {
    queue: ArrayQueue<Payload>,
    bytes: AtomicUsize,
    publisher: OnceLock<Thread>,
    dropped: AtomicU64,
    /// The next request id.
    requests: AtomicU64,
}

/// A prompt as shared: its block hashes and precise mode's engine keys.
#[derive(Clone, Copy, Debug)]
pub struct Prompt<'a> {
    pub hashes: &'a [u64],
    pub keys: &'a [u64],
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox")
            .field("queued", &self.queue.len())
            .finish()
    }
}

impl Default for Outbox {
    fn default() -> Self {
        Outbox::new()
    }
}

impl Outbox {
    pub fn new() -> Outbox {
        Outbox {
            queue: ArrayQueue::new(OUTBOX_MESSAGES),
            bytes: AtomicUsize::new(0),
            publisher: OnceLock::new(),
            dropped: AtomicU64::new(0),
            requests: AtomicU64::new(0),
        }
    }

    /// A new id for a request this replica sends (its `Sent`, `Prefilled`
    /// and `Done` name it).
    pub fn request_id(&self) -> u64 {
        self.requests.fetch_add(1, Relaxed)
    }

    /// `backend` (its URL's hash) was sent request `request`, a prompt of
    /// these blocks predicted to hold `matched` of them and to prefill
    /// `prefill`; precise mode's engine keys when known.
    pub fn sent(&self, backend: u64, request: u64, matched: u32, prefill: u32, prompt: Prompt) {
        let hashes = &prompt.hashes[..prompt.hashes.len().min(MAX_SHARED_BLOCKS)];
        let keys = &prompt.keys[..prompt.keys.len().min(MAX_SHARED_BLOCKS)];
        let mut p = Payload::new(Kind::Sent, 32 + 8 * (hashes.len() + keys.len()));
        p.u64(backend)
            .u64(request)
            .u32(matched)
            .u32(prefill)
            .words(hashes.iter().copied())
            .words(keys.iter().copied());
        self.push(p);
    }

    /// Request `request` to `backend` got its first body byte.
    pub fn prefilled(&self, backend: u64, request: u64) {
        let mut p = Payload::new(Kind::Prefilled, 16);
        p.u64(backend).u64(request);
        self.push(p);
    }

    /// `backend` stored the response `id`.
    pub fn stored(&self, backend: u64, id: &str) {
        let id = id.as_bytes();
        let mut p = Payload::new(Kind::Stored, 12 + id.len());
        p.u64(backend).bytes(id);
        self.push(p);
    }

    /// Request `request` to `backend` ended.
    pub fn done(&self, backend: u64, request: u64) {
        let mut p = Payload::new(Kind::Done, 16);
        p.u64(backend).u64(request);
        self.push(p);
    }

    /// `backend`'s engine held none of what it was predicted to hold: it
    /// holds this prompt now, and nothing else the index believed.
    pub fn flushed(&self, backend: u64, hashes: &[u64]) {
        let hashes = &hashes[..hashes.len().min(MAX_SHARED_BLOCKS)];
        let mut p = Payload::new(Kind::Flushed, 12 + 8 * hashes.len());
        p.u64(backend).words(hashes.iter().copied());
        self.push(p);
    }

    /// An answer from `backend` taught this (`fleet::feedback::Lesson`,
    /// encoded).
    pub fn learned(&self, backend: u64, what: u32, a: u64, b: u64) {
        let mut p = Payload::new(Kind::Learned, 28);
        p.u64(backend).u32(what).u64(a).u64(b);
        self.push(p);
    }

    /// Queues `p` for the publisher and wakes it; drops it (counted) when
    /// the outbox is full. Never waits.
    pub fn push(&self, p: Payload) {
        let n = p.len();
        if self.bytes.fetch_add(n, Relaxed) + n > OUTBOX_BYTES {
            self.bytes.fetch_sub(n, Relaxed);
            self.dropped.fetch_add(1, Relaxed);
            return;
        }
        if self.queue.push(p).is_err() {
            self.bytes.fetch_sub(n, Relaxed);
            self.dropped.fetch_add(1, Relaxed);
            return;
        }
        if let Some(t) = self.publisher.get() {
            t.unpark();
        }
    }

    /// The next message to publish (the publisher's side).
    pub fn pop(&self) -> Option<Payload> {
        let p = self.queue.pop()?;
        self.bytes.fetch_sub(p.len(), Relaxed);
        Some(p)
    }

    /// The thread `push` wakes.
    pub fn set_publisher(&self, t: Thread) {
        let _ = self.publisher.set(t);
    }

    /// Messages dropped because the outbox was full, since start.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_outbox_drops_and_counts_without_waiting() {
        let o = Outbox::new();
        let big = vec![7u64; MAX_SHARED_BLOCKS];
        // Each message is about 128 KiB: the byte bound comes first.
        for _ in 0..200 {
            o.sent(
                1,
                0,
                0,
                0,
                Prompt {
                    hashes: &big,
                    keys: &[],
                },
            );
        }
        assert!(o.dropped() > 0);
        let mut n = 0;
        while o.pop().is_some() {
            n += 1;
        }
        assert!(n * 128 * 1024 <= OUTBOX_BYTES, "{n} messages held");
        assert_eq!(o.bytes.load(Relaxed), 0);
    }
}
