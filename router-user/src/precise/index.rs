//! The precise index: which backend's engine says it holds which block.
//!
//! Keyed like requests are (`keys`): each `BlockStored` block's key is
//! chained from its parent's key over its token ids, so the router finds a
//! request's blocks by computing the same keys from its tokens. Each
//! backend keeps the map from its engine's hashes to those keys (and a
//! count per key, as two engine blocks may share one key), so that
//! `BlockRemoved` clears exactly the owner bit the engine dropped.
//!
//! Reads (request path) take no lock: a table slot is atomics (key, owners,
//! burst-guard owners and their stamp), owners named by id in lanes
//! (`fleet::owners`, [`LANES`] of each per slot whatever the fleet size;
//! when they are taken a new one replaces the lane its id picks: a hint
//! lost, a later removal of the one replaced finds nothing to clear). Writes come from one subscriber
//! thread per backend, each under that backend's own mutex, and from the
//! routing step's burst guard (atomics only).
//!
//! The burst guard: events arrive milliseconds after a request is sent, so
//! the blocks of a request just routed count as held by its backend for
//! `burst_ms`; siblings of a burst then land together. Guard bits live in
//! the slot with one stamp per slot (the newest guard's), so a guard can
//! outlive its time by the newer one's: a hint, never a source of truth.
//!
//! Memory: 32 bytes a slot, 2 slots a block of the fleet's capacity, plus
//! about 40 bytes a tracked block in the per-backend maps.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering::Relaxed};

use super::events::EngineHash;
use super::keys::block_key;
use crate::fleet::MAX_BACKENDS;
use crate::fleet::index::Matches;
use crate::fleet::owners::{self, Added, BackendSet, LANES};

/// Slots probed for a key from its home slot. Past them an insert displaces
/// a block, which cuts every chain through it: with 8 (as `fleet::index`)
/// on a table 37% full, a 1,023-block prompt lost its match at block 438
/// in `benches/precise.rs`; 16 slots on a table at most half full keep
/// displacements rare (none in that bench).
const PROBE: usize = 16;

/// Slots per block of capacity.
const SLOTS_PER_BLOCK: usize = 2;

struct Slot {
    key: AtomicU64,
    /// Backends whose engine reported the block stored (lanes).
    owners: AtomicU64,
    /// Backends recently sent a request with this block (burst guard; lanes).
    guard: AtomicU64,
    /// When the newest guard bit was set, in ms since the index started.
    guard_ms: AtomicU32,
}

/// One backend's engine hashes and how many of its blocks map to each key.
#[derive(Default)]
struct Held {
    by_engine: HashMap<EngineHash, u64>,
    refs: HashMap<u64, u32>,
}

/// Why a stored event's blocks were not indexed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreMiss {
    /// Its parent is a block this index never saw (stored before the
    /// subscription, or in a batch that was lost).
    UnknownParent,
    /// `token_ids` is not `block_size` tokens per hash.
    TokenCount,
}

/// What one `BlockStored` event says: a chain of blocks after `parent`
/// (`None`: from `seed`), `block` tokens each, with their engine hashes and
/// extra keys.
#[derive(Clone, Copy, Debug)]
pub struct StoredChain<'a> {
    pub seed: u64,
    pub parent: Option<EngineHash>,
    pub hashes: &'a [EngineHash],
    pub tokens: &'a [u32],
    pub block: usize,
    pub extra: &'a [Vec<Vec<u8>>],
}

pub struct PreciseIndex {
    slots: Box<[Slot]>,
    held: Box<[Mutex<Held>]>,
    /// Each backend's `Held::by_engine` length, readable without its lock
    /// (selection's cache pressure reads it).
    held_count: Box<[AtomicUsize]>,
}

impl PreciseIndex {
    /// An index sized for `total_capacity` blocks over all backends.
    pub fn new(total_capacity: usize) -> Self {
        let n = total_capacity.max(1024) * SLOTS_PER_BLOCK;
        PreciseIndex {
            slots: (0..n)
                .map(|_| Slot {
                    key: AtomicU64::new(0),
                    owners: AtomicU64::new(0),
                    guard: AtomicU64::new(0),
                    guard_ms: AtomicU32::new(0),
                })
                .collect(),
            held: (0..MAX_BACKENDS).map(|_| Mutex::default()).collect(),
            held_count: (0..MAX_BACKENDS).map(|_| AtomicUsize::new(0)).collect(),
        }
    }

    fn held(&self, backend: usize) -> std::sync::MutexGuard<'_, Held> {
        self.held[backend].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records blocks `backend`'s engine stored (one `BlockStored` event).
    /// Returns how many were indexed.
    pub fn stored(&self, backend: usize, chain: &StoredChain) -> Result<usize, StoreMiss> {
        let StoredChain {
            seed,
            parent,
            hashes,
            tokens,
            block,
            extra,
        } = *chain;
        if block == 0 || tokens.len() != hashes.len() * block {
            return Err(StoreMiss::TokenCount);
        }
        let mut held = self.held(backend);
        let mut key = match parent {
            None => seed,
            Some(p) => *held.by_engine.get(&p).ok_or(StoreMiss::UnknownParent)?,
        };
        for (i, (&h, toks)) in hashes.iter().zip(tokens.chunks_exact(block)).enumerate() {
            key = block_key(key, toks, extra.get(i).map_or(&[][..], Vec::as_slice));
            if let Some(old) = held.by_engine.insert(h, key) {
                // The engine stored a hash it already held: no new block.
                if old == key {
                    continue;
                }
                Self::unref(&mut held, old, |k| self.drop_owner(k, backend));
            }
            *held.refs.entry(key).or_insert(0) += 1;
            add_or_replace(&self.find_or_claim(key).owners, backend);
        }
        self.held_count[backend].store(held.by_engine.len(), Relaxed);
        Ok(hashes.len())
    }

    fn unref(held: &mut Held, key: u64, on_last: impl FnOnce(u64)) {
        if let Entry::Occupied(mut e) = held.refs.entry(key) {
            *e.get_mut() -= 1;
            if *e.get() == 0 {
                e.remove();
                on_last(key);
            }
        }
    }

    /// Records blocks `backend`'s engine evicted; returns how many it held.
    pub fn removed(&self, backend: usize, hashes: &[EngineHash]) -> usize {
        let mut held = self.held(backend);
        let mut n = 0;
        for h in hashes {
            if let Some(key) = held.by_engine.remove(h) {
                n += 1;
                Self::unref(&mut held, key, |k| self.drop_owner(k, backend));
            }
        }
        self.held_count[backend].store(held.by_engine.len(), Relaxed);
        n
    }

    /// Forgets everything `backend`'s engine held (a flush, a restart, or a
    /// stream that can no longer be trusted).
    pub fn clear_backend(&self, backend: usize) {
        let mut held = self.held(backend);
        for (&key, _) in held.refs.iter() {
            self.drop_owner(key, backend);
        }
        held.refs = HashMap::new();
        held.by_engine = HashMap::new();
        self.held_count[backend].store(0, Relaxed);
        // And its burst guards: a flushed engine holds nothing just sent.
        for s in self.slots.iter() {
            if owners::position(s.guard.load(Relaxed), backend).is_some() {
                owners::remove(&s.guard, backend);
            }
        }
    }

    /// Blocks `backend`'s engine holds, as far as its events said (no
    /// lock; may lag a writer by one event).
    pub fn held_blocks(&self, backend: usize) -> usize {
        self.held_count[backend].load(Relaxed)
    }

    /// Marks `keys` as held by `backend` for the burst guard's time, from
    /// `now_ms` (ms since the index started).
    pub fn guard(&self, backend: usize, keys: &[u64], now_ms: u32, burst_ms: u32) {
        for &k in keys {
            let s = self.find_or_claim(k);
            let fresh = now_ms.wrapping_sub(s.guard_ms.load(Relaxed)) < burst_ms;
            if fresh {
                add_or_replace(&s.guard, backend);
            } else {
                s.guard.store(owners::only(backend), Relaxed);
            }
            s.guard_ms.store(now_ms, Relaxed);
        }
    }

    /// Writes into `out` (cleared first) how many leading `keys` each
    /// backend in `candidates` holds (stored, or guarded within `burst_ms`
    /// of `now_ms`); returns how many hold the first one. Its cost follows
    /// the holders of the first key, not the fleet.
    pub fn longest_matches(
        &self,
        keys: &[u64],
        candidates: &BackendSet,
        now_ms: u32,
        burst_ms: u32,
        out: &mut Matches,
    ) -> usize {
        out.clear();
        // The backends still matching (holders of every key so far).
        let mut alive = [0u16; 2 * LANES];
        let mut n = 0;
        let mut first = 0;
        for (i, &k) in keys.iter().enumerate() {
            let (o, g) = self.find(k).map_or((0, 0), |s| {
                let fresh =
                    burst_ms > 0 && now_ms.wrapping_sub(s.guard_ms.load(Relaxed)) < burst_ms;
                (
                    s.owners.load(Relaxed),
                    if fresh { s.guard.load(Relaxed) } else { 0 },
                )
            });
            let holds =
                |b: usize| owners::position(o, b).is_some() || owners::position(g, b).is_some();
            if i == 0 {
                for (_, b) in owners::each(o).chain(owners::each(g)) {
                    if candidates.contains(b) && !alive[..n].contains(&(b as u16)) {
                        alive[n] = b as u16;
                        n += 1;
                    }
                }
                first = n;
            } else {
                let mut kept = 0;
                for j in 0..n {
                    let b = alive[j];
                    if holds(usize::from(b)) {
                        alive[kept] = b;
                        kept += 1;
                    } else {
                        out.set(usize::from(b), i as u32);
                    }
                }
                n = kept;
            }
            if n == 0 {
                return first;
            }
        }
        for &b in &alive[..n] {
            out.set(usize::from(b), keys.len() as u32);
        }
        first
    }

    fn home(&self, h: u64) -> usize {
        ((u128::from(h) * self.slots.len() as u128) >> 64) as usize
    }

    fn probe(&self, h: u64) -> impl Iterator<Item = &Slot> {
        let home = self.home(h);
        let n = self.slots.len();
        (home..home + PROBE).map(move |j| &self.slots[if j >= n { j - n } else { j }])
    }

    fn find(&self, h: u64) -> Option<&Slot> {
        self.probe(h).find(|s| s.key.load(Relaxed) == h)
    }

    /// The slot of `h`, claiming an empty one, or displacing the probed slot
    /// with the fewest owners when all are taken (its owners' maps keep the
    /// key; a later removal then finds no slot, which is harmless).
    fn find_or_claim(&self, h: u64) -> &Slot {
        if let Some(s) = self.find(h) {
            return s;
        }
        let mut victim: Option<&Slot> = None;
        let mut fewest = u32::MAX;
        for s in self.probe(h) {
            let k = s.key.load(Relaxed);
            if k == 0 {
                if s.key.compare_exchange(0, h, Relaxed, Relaxed).is_ok() {
                    s.owners.store(0, Relaxed);
                    s.guard.store(0, Relaxed);
                    return s;
                }
                continue;
            }
            let o = owners::count(s.owners.load(Relaxed)) + owners::count(s.guard.load(Relaxed));
            if o < fewest {
                fewest = o;
                victim = Some(s);
            }
        }
        let v = victim.unwrap_or_else(|| self.probe(h).next().expect("PROBE > 0"));
        v.key.store(h, Relaxed);
        v.owners.store(0, Relaxed);
        v.guard.store(0, Relaxed);
        v
    }

    fn drop_owner(&self, key: u64, backend: usize) {
        if let Some(s) = self.find(key) {
            let left = owners::remove(&s.owners, backend);
            if owners::count(left) == 0 && owners::count(s.guard.load(Relaxed)) == 0 {
                let _ = s.key.compare_exchange(key, 0, Relaxed, Relaxed);
            }
        }
    }
}

/// Names `backend` in `word`; when its lanes are taken, in the lane its id
/// picks, so the blocks of one chain (stored by the same engines in the
/// same order) lose the same owner (see the module's doc).
fn add_or_replace(word: &AtomicU64, backend: usize) {
    if owners::add(word, backend) == Added::Full {
        let w = word.load(Relaxed);
        let k = backend % LANES;
        if let Some((_, victim)) = owners::each(w).find(|&(lane, _)| lane == k) {
            owners::replace(word, k, victim, backend);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::precise::keys::{chain_seed, request_keys};

    fn toks(n: u32) -> Vec<u32> {
        (0..n).collect()
    }

    #[test]
    fn stored_blocks_match_request_keys_and_removal_clears_them() {
        let idx = PreciseIndex::new(1024);
        let seed = chain_seed(None);
        let t = toks(48);
        idx.stored(
            2,
            &StoredChain {
                seed,
                parent: None,
                hashes: &[10, 11],
                tokens: &t[..32],
                block: 16,
                extra: &[],
            },
        )
        .unwrap();
        idx.stored(
            2,
            &StoredChain {
                seed,
                parent: Some(11),
                hashes: &[12],
                tokens: &t[32..],
                block: 16,
                extra: &[],
            },
        )
        .unwrap();
        let mut keys = Vec::new();
        request_keys(seed, &t, 16, &[], &mut keys);
        let mut m = Matches::new();
        idx.longest_matches(&keys, &[1, 2].into_iter().collect(), 0, 0, &mut m);
        assert_eq!((m[1], m[2]), (0, 3));
        assert_eq!(idx.removed(2, &[11, 999]), 1);
        let mut m = Matches::new();
        idx.longest_matches(&keys, &[2].into_iter().collect(), 0, 0, &mut m);
        assert_eq!(m[2], 1, "block 1 evicted: the match stops there");
        assert_eq!(
            idx.stored(
                2,
                &StoredChain {
                    seed,
                    parent: Some(777),
                    hashes: &[13],
                    tokens: &t[..16],
                    block: 16,
                    extra: &[]
                }
            ),
            Err(StoreMiss::UnknownParent)
        );
        idx.clear_backend(2);
        assert_eq!(idx.held_blocks(2), 0);
        let mut m = Matches::new();
        assert_eq!(
            idx.longest_matches(&keys, &[2].into_iter().collect(), 0, 0, &mut m),
            0
        );
    }

    #[test]
    fn backends_past_64_and_more_holders_than_lanes() {
        let idx = PreciseIndex::new(1024);
        let seed = chain_seed(None);
        let t = toks(32);
        let store = |b: usize| {
            idx.stored(
                b,
                &StoredChain {
                    seed,
                    parent: None,
                    hashes: &[b as u64 * 10, b as u64 * 10 + 1],
                    tokens: &t,
                    block: 16,
                    extra: &[],
                },
            )
            .unwrap()
        };
        let mut keys = Vec::new();
        request_keys(seed, &t, 16, &[], &mut keys);
        let every = BackendSet::first(MAX_BACKENDS);
        let mut m = Matches::new();
        for b in [70, 500, 1023] {
            store(b);
        }
        assert_eq!(idx.longest_matches(&keys, &every, 0, 0, &mut m), 3);
        assert_eq!((m[70], m[500], m[1023], m[0]), (2, 2, 2, 0));
        // Six engines store the same blocks: four lanes name four of them,
        // the same four for both blocks; the others' removals are harmless.
        for b in [1, 2, 3] {
            store(b);
        }
        idx.longest_matches(&keys, &every, 0, 0, &mut m);
        assert_eq!(m.holders().count(), LANES);
        assert!(m.holders().all(|(_, n)| n == 2));
        for b in [1, 2, 3, 70, 500, 1023] {
            idx.clear_backend(b);
        }
        assert_eq!(idx.longest_matches(&keys, &every, 0, 0, &mut m), 0);
        // The burst guard names backends past 64 too.
        idx.guard(900, &keys, 10, 100);
        idx.longest_matches(&keys, &every, 50, 100, &mut m);
        assert_eq!(m[900], 2);
    }

    #[test]
    fn the_burst_guard_holds_for_its_time_only() {
        let idx = PreciseIndex::new(1024);
        let mut keys = Vec::new();
        request_keys(chain_seed(None), &toks(32), 16, &[], &mut keys);
        idx.guard(0, &keys, 1000, 2000);
        let mut m = Matches::new();
        idx.longest_matches(&keys, &BackendSet::first(1), 2500, 2000, &mut m);
        assert_eq!(m[0], 2);
        let mut m = Matches::new();
        idx.longest_matches(&keys, &BackendSet::first(1), 3001, 2000, &mut m);
        assert_eq!(m[0], 0, "expired");
    }
}
