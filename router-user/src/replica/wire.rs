//! The replicas' wire format: one ZMQ frame per message, little-endian.
//!
//! ```text
//! magic "PRR1" | sender u64 | seq u64 | kind u8 | body | mac [16]
//! ```
//!
//! `sender` is the replica's id (random at each start: a new id is a
//! restart), `seq` counts its published messages from 0 (a skip is a gap),
//! `mac` the first 16 bytes of the keyed BLAKE3 hash of everything before
//! it under the shared key. Bodies:
//!
//! - `Sent`: backend (its URL's hash), the request's id, the blocks it was
//!   predicted to hold and to prefill, the prompt's block hashes (count,
//!   then each), precise mode's engine keys (count, each);
//! - `Prefilled`, `Done`: backend, request id: its first body byte came
//!   back; it ended (however);
//! - `Flushed`: backend, the prompt it holds now (count, hashes);
//! - `Load`: count, then (backend, requests in flight, queued prefill
//!   blocks, answer blocks written since the last load message) for each
//!   backend this replica has work on; also the heartbeat;
//! - `Conns`: count, then (backend, connections open to it) for each
//!   backend this replica holds connections to: what this host's XDP
//!   counters see of it, if it shares a host (sent when it changes, and
//!   every second); a reader that predates it drops it as malformed;
//! - `Learned`: backend, what an answer taught of it (1: a block kept at
//!   an age, 2: evicted at an age, 3: blocks prefilled in nanoseconds), its
//!   two values: the peers learn from it as from their own answers;
//! - `Stored`: backend, a response id (length, bytes): the backend stored
//!   that response (`fleet::stored`);
//! - `SnapshotRequest`: empty; `SnapshotBlocks`: backend, the capacity the
//!   sender learned or was told of it (0: neither; older builds sent their
//!   index's capacity, which the receiver ignores unless it is under its
//!   own estimate), then (block, anchor) pairs oldest first; `SnapshotEnd`:
//!   backends sent.
//!
//! A frame is checked whole before anything is read from it: its length,
//! its MAC, then every count against what is left.

use thiserror::Error;

pub const MAGIC: [u8; 4] = *b"PRR1";
/// Magic, sender, seq, kind.
pub const HEADER_BYTES: usize = 4 + 8 + 8 + 1;
pub const MAC_BYTES: usize = 16;
/// The largest frame a replica sends or accepts: a `Sent` of
/// `MAX_SHARED_BLOCKS` hashes and as many keys is 256 KiB; a snapshot is
/// cut into frames of `SNAPSHOT_BLOCKS_PER_FRAME` pairs (128 KiB).
pub const MAX_FRAME_BYTES: usize = 512 * 1024;
/// Blocks of one prompt shared: 16,384 blocks of 64 bytes is a 1 MiB
/// prompt (a quarter of a million tokens), past any model's context. A
/// longer prompt's first blocks are what matching reads.
pub const MAX_SHARED_BLOCKS: usize = 16_384;
/// The longest stored response id a `Stored` message carries (as long as
/// `fleet::stored` keeps).
pub const MAX_STORED_ID_BYTES: usize = 256;
/// (block, anchor) pairs in one snapshot frame.
pub const SNAPSHOT_BLOCKS_PER_FRAME: usize = 8_192;

/// The message kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Sent = 1,
    Flushed = 2,
    Load = 3,
    SnapshotRequest = 4,
    SnapshotBlocks = 5,
    SnapshotEnd = 6,
    Prefilled = 7,
    Done = 8,
    Stored = 9,
    Conns = 10,
    Learned = 11,
}

impl Kind {
    fn of(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Sent,
            2 => Kind::Flushed,
            3 => Kind::Load,
            4 => Kind::SnapshotRequest,
            5 => Kind::SnapshotBlocks,
            6 => Kind::SnapshotEnd,
            7 => Kind::Prefilled,
            8 => Kind::Done,
            9 => Kind::Stored,
            10 => Kind::Conns,
            11 => Kind::Learned,
            _ => return None,
        })
    }
}

/// Why a frame was dropped.
#[derive(Clone, Copy, Debug, Error, PartialEq, Eq)]
pub enum WireError {
    #[error("frame of {0} bytes (allowed {min}..={MAX_FRAME_BYTES})", min = HEADER_BYTES + MAC_BYTES)]
    Size(usize),
    #[error("not signed with the replicas' key")]
    Unauthenticated,
    #[error("malformed message")]
    Malformed,
}

/// The shared key, derived from the configured one.
#[derive(Clone)]
pub struct Key([u8; 32]);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(..)")
    }
}

impl Key {
    pub fn derive(secret: &[u8]) -> Key {
        Key(blake3::derive_key("prefix-router replicas v1", secret))
    }

    fn mac(&self, bytes: &[u8]) -> [u8; MAC_BYTES] {
        let h = blake3::keyed_hash(&self.0, bytes);
        let mut m = [0u8; MAC_BYTES];
        m.copy_from_slice(&h.as_bytes()[..MAC_BYTES]);
        m
    }
}

/// A message's payload as a worker writes it: room for the header, then
/// the kind and the body. [`seal`] fills in the header and appends the MAC.
pub struct Payload(Vec<u8>);

impl Payload {
    pub fn new(kind: Kind, body_bytes: usize) -> Payload {
        let mut v = Vec::with_capacity(HEADER_BYTES + body_bytes + MAC_BYTES);
        v.resize(HEADER_BYTES - 1, 0);
        v.push(kind as u8);
        Payload(v)
    }

    pub fn u32(&mut self, x: u32) -> &mut Self {
        self.0.extend_from_slice(&x.to_le_bytes());
        self
    }

    pub fn u64(&mut self, x: u64) -> &mut Self {
        self.0.extend_from_slice(&x.to_le_bytes());
        self
    }

    /// A length, then the bytes.
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.u32(b.len() as u32);
        self.0.extend_from_slice(b);
        self
    }

    /// A count, then each word.
    pub fn words(&mut self, w: impl ExactSizeIterator<Item = u64>) -> &mut Self {
        self.u32(w.len() as u32);
        for x in w {
            self.u64(x);
        }
        self
    }

    pub fn kind(&self) -> Option<Kind> {
        Kind::of(self.0[HEADER_BYTES - 1])
    }

    pub fn len(&self) -> usize {
        self.0.len() + MAC_BYTES
    }

    pub fn is_empty(&self) -> bool {
        false
    }
}

/// The frame of `payload` as message `seq` of replica `sender`.
pub fn seal(mut payload: Payload, sender: u64, seq: u64, key: &Key) -> Vec<u8> {
    let v = &mut payload.0;
    v[..4].copy_from_slice(&MAGIC);
    v[4..12].copy_from_slice(&sender.to_le_bytes());
    v[12..20].copy_from_slice(&seq.to_le_bytes());
    let mac = key.mac(v);
    v.extend_from_slice(&mac);
    payload.0
}

/// A checked frame.
#[derive(Debug)]
pub struct Message<'a> {
    pub sender: u64,
    pub seq: u64,
    pub body: Body<'a>,
}

/// A run of little-endian u64 words in a checked frame.
#[derive(Clone, Copy, Debug)]
pub struct Words<'a>(&'a [u8]);

impl<'a> Words<'a> {
    pub fn len(&self) -> usize {
        self.0.len() / 8
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = u64> + 'a {
        self.0
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
    }

    pub fn to_vec_into(&self, out: &mut Vec<u64>) {
        out.clear();
        out.extend(self.iter());
    }
}

#[derive(Debug)]
pub enum Body<'a> {
    Sent {
        backend: u64,
        request: u64,
        matched: u32,
        prefill: u32,
        hashes: Words<'a>,
        keys: Words<'a>,
    },
    Prefilled {
        backend: u64,
        request: u64,
    },
    Done {
        backend: u64,
        request: u64,
    },
    Flushed {
        backend: u64,
        hashes: Words<'a>,
    },
    /// (backend, in flight, queued prefill blocks, answer blocks) entries.
    Load(&'a [u8]),
    /// Its entries, read with [`conns_entries`].
    Conns(&'a [u8]),
    Learned {
        backend: u64,
        what: u32,
        a: u64,
        b: u64,
    },
    SnapshotRequest,
    SnapshotBlocks {
        backend: u64,
        capacity: u64,
        /// (block, anchor) pairs, oldest first.
        pairs: Words<'a>,
    },
    SnapshotEnd {
        backends: u32,
    },
    Stored {
        backend: u64,
        id: &'a [u8],
    },
}

/// Bytes of one `Load` entry.
pub const LOAD_ENTRY_BYTES: usize = 20;

/// One backend's entry in a `Load` message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadEntry {
    pub backend: u64,
    pub in_flight: u32,
    pub queued_prefill_blocks: u32,
    /// Blocks its answers wrote since the last load message (its cache
    /// keeps them as it keeps prompts: they count on its clock).
    pub answer_blocks: u32,
}

/// The entries of a `Load` body.
pub fn load_entries(b: &[u8]) -> impl Iterator<Item = LoadEntry> + '_ {
    b.chunks_exact(LOAD_ENTRY_BYTES).map(|c| {
        let w =
            |r: std::ops::Range<usize>| c[r].iter().rev().fold(0u64, |a, &x| a << 8 | u64::from(x));
        LoadEntry {
            backend: w(0..8),
            in_flight: w(8..12) as u32,
            queued_prefill_blocks: w(12..16) as u32,
            answer_blocks: w(16..20) as u32,
        }
    })
}

/// Bytes of one `Conns` entry: backend, connections.
pub const CONNS_ENTRY_BYTES: usize = 12;

/// The (backend, open connections) entries of a `Conns` body.
pub fn conns_entries(b: &[u8]) -> impl Iterator<Item = (u64, u32)> + '_ {
    b.chunks_exact(CONNS_ENTRY_BYTES).map(|c| {
        let mut id = [0u8; 8];
        id.copy_from_slice(&c[..8]);
        let mut n = [0u8; 4];
        n.copy_from_slice(&c[8..]);
        (u64::from_le_bytes(id), u32::from_le_bytes(n))
    })
}

/// Reads and checks a frame: size, MAC, magic, then the body's counts.
pub fn open<'a>(frame: &'a [u8], key: &Key) -> Result<Message<'a>, WireError> {
    let n = frame.len();
    if !(HEADER_BYTES + MAC_BYTES..=MAX_FRAME_BYTES).contains(&n) {
        return Err(WireError::Size(n));
    }
    let (signed, mac) = frame.split_at(n - MAC_BYTES);
    let want = key.mac(signed);
    // Constant time: every byte is compared whatever the first difference.
    if want.iter().zip(mac).fold(0u8, |d, (a, b)| d | (a ^ b)) != 0 {
        return Err(WireError::Unauthenticated);
    }
    if signed[..4] != MAGIC {
        return Err(WireError::Malformed);
    }
    let mut r = Reader(&signed[4..]);
    let sender = r.u64()?;
    let seq = r.u64()?;
    let kind = Kind::of(r.u8()?).ok_or(WireError::Malformed)?;
    let body = match kind {
        Kind::Sent => Body::Sent {
            backend: r.u64()?,
            request: r.u64()?,
            matched: r.u32()?,
            prefill: r.u32()?,
            hashes: r.words(MAX_SHARED_BLOCKS)?,
            keys: r.words(MAX_SHARED_BLOCKS)?,
        },
        Kind::Flushed => Body::Flushed {
            backend: r.u64()?,
            hashes: r.words(MAX_SHARED_BLOCKS)?,
        },
        Kind::Load => {
            let count = r.u32()? as usize;
            Body::Load(
                r.take(
                    count
                        .checked_mul(LOAD_ENTRY_BYTES)
                        .ok_or(WireError::Malformed)?,
                )?,
            )
        }
        Kind::Conns => {
            let count = r.u32()? as usize;
            Body::Conns(
                r.take(
                    count
                        .checked_mul(CONNS_ENTRY_BYTES)
                        .ok_or(WireError::Malformed)?,
                )?,
            )
        }
        Kind::Learned => Body::Learned {
            backend: r.u64()?,
            what: r.u32()?,
            a: r.u64()?,
            b: r.u64()?,
        },
        Kind::SnapshotRequest => Body::SnapshotRequest,
        Kind::SnapshotBlocks => {
            let backend = r.u64()?;
            let capacity = r.u64()?;
            let pairs = r.words(2 * SNAPSHOT_BLOCKS_PER_FRAME)?;
            if pairs.len() % 2 != 0 {
                return Err(WireError::Malformed);
            }
            Body::SnapshotBlocks {
                backend,
                capacity,
                pairs,
            }
        }
        Kind::SnapshotEnd => Body::SnapshotEnd { backends: r.u32()? },
        Kind::Prefilled => Body::Prefilled {
            backend: r.u64()?,
            request: r.u64()?,
        },
        Kind::Done => Body::Done {
            backend: r.u64()?,
            request: r.u64()?,
        },
        Kind::Stored => {
            let backend = r.u64()?;
            let len = r.u32()? as usize;
            if len > MAX_STORED_ID_BYTES {
                return Err(WireError::Malformed);
            }
            Body::Stored {
                backend,
                id: r.take(len)?,
            }
        }
    };
    if !r.0.is_empty() {
        return Err(WireError::Malformed);
    }
    Ok(Message { sender, seq, body })
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.0.len() < n {
            return Err(WireError::Malformed);
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }

    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, WireError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    /// A count of at most `max` words, then the words.
    fn words(&mut self, max: usize) -> Result<Words<'a>, WireError> {
        let count = self.u32()? as usize;
        if count > max {
            return Err(WireError::Malformed);
        }
        Ok(Words(self.take(count * 8)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> Key {
        Key::derive(b"0123456789abcdef")
    }

    #[test]
    fn a_sealed_message_opens_as_written() {
        let mut p = Payload::new(Kind::Sent, 64);
        p.u64(7)
            .u64(11)
            .u32(2)
            .u32(3)
            .words([1u64, 2, 3].into_iter())
            .words([9u64].into_iter());
        let f = seal(p, 42, 5, &key());
        let m = open(&f, &key()).unwrap();
        assert_eq!((m.sender, m.seq), (42, 5));
        match m.body {
            Body::Sent {
                backend,
                request,
                matched,
                prefill,
                hashes,
                keys,
            } => {
                assert_eq!((backend, request, matched, prefill), (7, 11, 2, 3));
                assert_eq!(hashes.iter().collect::<Vec<_>>(), [1, 2, 3]);
                assert_eq!(keys.iter().collect::<Vec<_>>(), [9]);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn another_key_or_a_changed_byte_is_refused() {
        let mut p = Payload::new(Kind::Flushed, 32);
        p.u64(1).words([5u64].into_iter());
        let f = seal(p, 1, 0, &key());
        let other = Key::derive(b"another key, long enough");
        assert_eq!(open(&f, &other).unwrap_err(), WireError::Unauthenticated);
        for i in 0..f.len() {
            let mut g = f.clone();
            g[i] ^= 0x40;
            assert_eq!(open(&g, &key()).unwrap_err(), WireError::Unauthenticated);
        }
        assert!(matches!(open(&f[..10], &key()), Err(WireError::Size(10))));
    }

    #[test]
    fn a_stored_response_id_reads_back_and_an_overlong_one_is_refused() {
        let mut p = Payload::new(Kind::Stored, 32);
        p.u64(7).bytes(b"resp_1");
        let f = seal(p, 1, 0, &key());
        match open(&f, &key()).unwrap().body {
            Body::Stored { backend, id } => assert_eq!((backend, id), (7, &b"resp_1"[..])),
            other => panic!("{other:?}"),
        }
        let mut p = Payload::new(Kind::Stored, 512);
        p.u64(7).bytes(&[b'x'; 300]);
        let f = seal(p, 1, 1, &key());
        assert_eq!(open(&f, &key()).unwrap_err(), WireError::Malformed);
    }

    #[test]
    fn load_entries_read_back() {
        let mut p = Payload::new(Kind::Load, 64);
        p.u32(2);
        p.u64(11).u32(3).u32(400).u32(7);
        p.u64(12).u32(0).u32(0).u32(0);
        let f = seal(p, 1, 1, &key());
        let Body::Load(b) = open(&f, &key()).unwrap().body else {
            panic!("not a load")
        };
        let e: Vec<_> = load_entries(b)
            .map(|e| {
                (
                    e.backend,
                    e.in_flight,
                    e.queued_prefill_blocks,
                    e.answer_blocks,
                )
            })
            .collect();
        assert_eq!(e, [(11, 3, 400, 7), (12, 0, 0, 0)]);
    }

    #[test]
    fn conns_entries_read_back_and_a_short_body_is_refused() {
        let mut p = Payload::new(Kind::Conns, 32);
        p.u32(2);
        p.u64(11).u32(4);
        p.u64(12).u32(0);
        let f = seal(p, 1, 1, &key());
        let Body::Conns(b) = open(&f, &key()).unwrap().body else {
            panic!("not conns")
        };
        assert_eq!(conns_entries(b).collect::<Vec<_>>(), [(11, 4), (12, 0)]);
        let mut p = Payload::new(Kind::Conns, 32);
        p.u32(2);
        p.u64(11).u32(4);
        let f = seal(p, 1, 2, &key());
        assert_eq!(open(&f, &key()).unwrap_err(), WireError::Malformed);
    }

    #[test]
    fn a_lesson_reads_back() {
        let mut p = Payload::new(Kind::Learned, 28);
        p.u64(11).u32(3).u64(200).u64(25_000_000);
        let f = seal(p, 1, 1, &key());
        assert!(matches!(
            open(&f, &key()).unwrap().body,
            Body::Learned {
                backend: 11,
                what: 3,
                a: 200,
                b: 25_000_000
            }
        ));
    }

    proptest::proptest! {
        /// A signed frame whose body lies about its counts is refused, never
        /// read past its end.
        #[test]
        fn signed_garbage_is_malformed_not_a_crash(kind in 0u8..13, body in proptest::collection::vec(0u8..=255, 0..200)) {
            let mut p = Payload::new(Kind::Sent, body.len());
            p.0[HEADER_BYTES - 1] = kind;
            p.0.extend_from_slice(&body);
            let f = seal(p, 3, 4, &key());
            let _ = open(&f, &key());
        }
    }
}
