//! The prefix index: which backend holds which prefix block.
//!
//! One table shared by every worker thread. Readers take no lock: a slot is
//! atomics (block hash, two words of owner lanes with their referenced bits,
//! see `route::owners`, and who was sent it last). Writers
//! serialise per backend on a small mutex that guards that backend's
//! eviction ring. Each backend tracks at most its KV capacity in blocks and
//! forgets its least recently used blocks first (CLOCK, an approximation of
//! LRU: a block touched since it was queued gets a second chance), so the
//! index forgets roughly what the engine itself evicts.
//!
//! A slot names at most [`OWNERS`] backends. When a ninth is sent the
//! block, it takes the lane of an owner whose referenced bit is clear (not
//! sent the block again since it was first, or since its ring's hand last
//! passed it), else of any owner but the one sent it last: the least
//! recently sent, as far as one bit per owner tells. The owner dropped keeps the hash in its ring, which forgets it
//! when it reaches its front (it finds no lane there).
//!
//! Races between writers can leave a stale owner for a moment: the index
//! is a routing hint, never a source of truth, so a wrong hint costs at most
//! one cache miss.
//!
//! Memory: 32 bytes a slot whatever the fleet size, slots = 4/3 x the sum of
//! capacities, plus 8 bytes a ring entry: 32 * 4/3 + 8 = 50.7 bytes per
//! tracked block when every backend is full, plus 72 bytes per backend slot
//! (72 KB for `MAX_BACKENDS`: 9 bytes a block on 8 backends of 1,024
//! blocks, nothing on real capacities; `memory_per_tracked_block` and
//! `memory_per_tracked_block_at_1024_backends` in the tests measure it).

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

use crate::route::MAX_BACKENDS;
use crate::route::owners::{self, Added, BackendSet, LANES};

/// A block [`PrefixIndex::longest_matches_noting`] found no slot for.
pub const NOT_FOUND: u32 = u32::MAX;

/// A run of up to this many blocks a backend seems to lack (their slots
/// displaced from a full window) does not end its match if it holds a
/// later block. (The lookup keeps one mask per block of the run.)
const MAX_GAP: usize = 2;

/// Slots a key may sit in: two buckets (see `PrefixIndex::window`); past
/// them a key is not found and an insert evicts.
const PROBE: usize = 2 * BUCKET;
/// Slots per bucket: 4 slots of 32 bytes are two cache lines.
const BUCKET: usize = 4;

/// Words of owner lanes a slot keeps: two, so a slot stays 32 bytes (two
/// to a cache line's half) and names up to [`OWNERS`] backends.
const OWNER_WORDS: usize = 2;

/// Backends one block is tracked for at once (see the module's doc).
pub const OWNERS: usize = OWNER_WORDS * LANES;

struct Slot {
    key: AtomicU64,
    /// Who holds the block, with their referenced bits (`route::owners`).
    owners: [AtomicU64; OWNER_WORDS],
    /// When the block was last sent, as `backend << 48 | that backend's
    /// push count then` (see [`PrefixIndex::insert_aging`]); 0 = never.
    last_sent: AtomicU64,
}

impl Slot {
    fn empty() -> Slot {
        Slot {
            key: AtomicU64::new(0),
            owners: [AtomicU64::new(0), AtomicU64::new(0)],
            last_sent: AtomicU64::new(0),
        }
    }

    fn reset(&self) {
        for w in &self.owners {
            w.store(0, Relaxed);
        }
        self.last_sent.store(0, Relaxed);
    }

    /// The words of owner lanes, as one read sees them.
    #[inline]
    fn load(&self) -> [u64; OWNER_WORDS] {
        [self.owners[0].load(Relaxed), self.owners[1].load(Relaxed)]
    }

    /// The word naming `backend`.
    #[inline]
    fn word_of(&self, backend: usize) -> Option<&AtomicU64> {
        self.owners
            .iter()
            .find(|w| owners::position(w.load(Relaxed), backend).is_some())
    }

    fn owner_count(&self) -> u32 {
        self.load().iter().map(|&w| owners::count(w)).sum()
    }

    /// Names `backend` as an owner; returns whether it was new and the
    /// owner it replaced, if every lane was taken (see the module's doc).
    fn add_owner(&self, backend: usize) -> (bool, Option<usize>) {
        for w in &self.owners {
            if owners::position(w.load(Relaxed), backend).is_some() {
                return (false, None);
            }
        }
        for w in &self.owners {
            match owners::add(w, backend) {
                Added::New => return (true, None),
                Added::Held => return (false, None),
                Added::Full => {}
            }
        }
        let last = self.last_sent.load(Relaxed);
        let last = (last != 0).then_some((last >> SENT_SHIFT) as usize);
        // Unreferenced owners first, then any but the last sent. The scan
        // starts at a lane the newcomer picks, so a stream of newcomers
        // does not keep replacing one lane, and the blocks of one prompt
        // (sent to the same backends in the same order) replace the same
        // owner: a backend keeps or loses the prompt whole.
        let start = (backend as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 61;
        for want_unreferenced in [true, false] {
            for i in 0..OWNERS {
                let lane = (start as usize + i) % OWNERS;
                let w = &self.owners[lane / LANES];
                let word = w.load(Relaxed);
                let Some((k, b)) = owners::each(word).find(|&(k, _)| k == lane % LANES) else {
                    continue;
                };
                if Some(b) == last || (want_unreferenced && owners::referenced_at(word, k)) {
                    continue;
                }
                if owners::replace(w, k, b, backend) {
                    return (true, Some(b));
                }
            }
        }
        // Lost every race (writers of other backends took the lanes): the
        // block goes untracked for it, a hint lost.
        (false, None)
    }
}

/// How many blocks ahead the walks ask the CPU for a block's slots. The
/// table (tens of MB) is not in the caches by the time a request's lookup
/// runs (its body passed through them), and each probe's outcome is a
/// branch the CPU cannot predict, so without the hints the misses come one
/// after the other (about 80 ns a block on a 400 KB prompt here); with
/// them, eight are in flight (BENCHMARKS.md, `index/*_cold`).
const AHEAD: usize = 8;

/// Asks the CPU to start loading the cache line of `slot`. A hint: it has
/// no effect on any result.
#[inline(always)]
fn prefetch(slot: &Slot) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch neither faults nor writes; the pointer comes from
    // a live reference.
    unsafe {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        _mm_prefetch::<_MM_HINT_T0>((slot as *const Slot).cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = slot;
}

/// `Slot::last_sent` keeps the backend in its top 16 bits (the push count
/// below: 2^48 blocks are years of traffic).
const SENT_SHIFT: u32 = 48;
const SENT_MASK: u64 = (1 << SENT_SHIFT) - 1;

/// A block whose age is not known (not last sent to this backend).
pub const AGE_UNKNOWN: u64 = u64::MAX;

/// One backend's blocks in the order they were first tracked.
#[derive(Default)]
struct Ring {
    blocks: VecDeque<u64>,
    capacity: usize,
}

pub struct PrefixIndex {
    slots: Box<[Slot]>,
    rings: Box<[Mutex<Ring>]>,
    /// Each ring's length, readable without its lock (selection reads it).
    ring_lens: Box<[AtomicUsize]>,
    /// Blocks each backend had to compute (allocate in its cache), since
    /// start: the clock block ages are measured in. An LRU engine evicts a
    /// block once more blocks than its capacity were allocated after the
    /// block's last use.
    pushed: Box<[AtomicU64]>,
    evictions: AtomicU64,
    tracked: AtomicUsize,
}

/// For each backend, how many leading blocks of a request it holds: a
/// table by slot (0 for most) and the list of slots written, so clearing
/// it and finding the holders cost what the holders number, not the fleet.
/// Reused across requests (a worker's scratch); the default is empty (no
/// allocation) until the first [`Matches::clear`].
#[derive(Default)]
pub struct Matches {
    by_slot: Vec<u32>,
    written: Vec<u16>,
}

impl Matches {
    /// Every backend at 0.
    pub fn new() -> Matches {
        let mut m = Matches::default();
        m.clear();
        m
    }

    /// Sets backend `b`'s match.
    #[inline]
    pub fn set(&mut self, b: usize, blocks: u32) {
        // A slot set back to 0 and then again is listed twice: harmless.
        if self.by_slot[b] == 0 && blocks != 0 {
            self.written.push(b as u16);
        }
        self.by_slot[b] = blocks;
    }

    /// Every match back to 0.
    pub fn clear(&mut self) {
        if self.by_slot.is_empty() {
            self.by_slot = vec![0; MAX_BACKENDS];
        }
        for &b in &self.written {
            self.by_slot[usize::from(b)] = 0;
        }
        self.written.clear();
    }

    /// The backends with a match, and their blocks.
    pub fn holders(&self) -> impl Iterator<Item = (usize, u32)> + '_ {
        self.written
            .iter()
            .map(|&b| (usize::from(b), self.by_slot[usize::from(b)]))
            .filter(|&(_, m)| m > 0)
    }
}

impl std::ops::Deref for Matches {
    type Target = [u32];
    fn deref(&self) -> &[u32] {
        &self.by_slot
    }
}

/// Backends a lookup follows at once: those that hold one of the first
/// `MAX_GAP + 1` blocks (a later one cannot start a match).
const MAX_RUNS: usize = (MAX_GAP + 1) * OWNERS;

impl PrefixIndex {
    /// An index sized for `total_capacity` tracked blocks over all backends.
    pub fn new(total_capacity: usize) -> Self {
        let n = total_capacity.max(1024) * 4 / 3;
        let slots = (0..n).map(|_| Slot::empty()).collect();
        let rings = (0..MAX_BACKENDS)
            .map(|_| Mutex::new(Ring::default()))
            .collect();
        PrefixIndex {
            slots,
            rings,
            ring_lens: (0..MAX_BACKENDS).map(|_| AtomicUsize::new(0)).collect(),
            pushed: (0..MAX_BACKENDS).map(|_| AtomicU64::new(0)).collect(),
            evictions: AtomicU64::new(0),
            tracked: AtomicUsize::new(0),
        }
    }

    /// Sets how many blocks `backend` may hold; evicts down to it at once.
    pub fn set_capacity(&self, backend: usize, capacity: usize) {
        let mut ring = self.rings[backend]
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        ring.capacity = capacity;
        let want = capacity.min(1 << 24).saturating_sub(ring.blocks.len());
        ring.blocks.reserve_exact(want);
        self.evict_over(backend, &mut ring);
        self.ring_lens[backend].store(ring.blocks.len(), Relaxed);
    }

    /// Writes into `out` (cleared first) how many leading blocks of
    /// `hashes` each backend in `candidates` holds; returns how many
    /// backends hold at least one of them.
    pub fn longest_matches(
        &self,
        hashes: &[u64],
        candidates: &BackendSet,
        out: &mut Matches,
    ) -> usize {
        self.longest_matches_noting(hashes, candidates, out, &mut Vec::new())
    }

    /// [`Self::longest_matches`], also noting in `found` (cleared first)
    /// the slot of each block it looked at (`NOT_FOUND` where none), so that
    /// [`Self::insert_noted`] need not probe for them again.
    ///
    /// Its cost follows the prompt's blocks and the backends holding them,
    /// not the fleet: it follows the owners of the first blocks only.
    pub fn longest_matches_noting(
        &self,
        hashes: &[u64],
        candidates: &BackendSet,
        out: &mut Matches,
        found: &mut Vec<u32>,
    ) -> usize {
        found.clear();
        out.clear();
        // Each followed backend and the end of its match (one past the last
        // block it holds). A backend that holds a later block was sent the
        // blocks before it too (the hashes are chained): a run of up to
        // `MAX_GAP` blocks it lacks (slots displaced from a full window,
        // re-claimed for another backend) is bridged; a longer run ends its
        // match before the run. So only owners of the first `MAX_GAP + 1`
        // blocks can have a match.
        let mut runs = [(0u16, 0u32); MAX_RUNS];
        let mut n_runs = 0;
        for &h in hashes.iter().take(AHEAD) {
            self.prefetch_window(h);
        }
        for (i, &h) in hashes.iter().enumerate() {
            if let Some(&next) = hashes.get(i + AHEAD) {
                self.prefetch_window(next);
            }
            let slot = self.find_index(h);
            found.push(slot.map_or(NOT_FOUND, |j| j as u32));
            let words = slot.map_or([0; OWNER_WORDS], |j| self.slots[j].load());
            for &w in &words {
                for (_, b) in owners::each(w) {
                    if !candidates.contains(b) {
                        continue;
                    }
                    match runs[..n_runs].iter_mut().find(|r| usize::from(r.0) == b) {
                        // Held after a run short enough to bridge.
                        Some(r) if i - r.1 as usize <= MAX_GAP => r.1 = i as u32 + 1,
                        // Its match ended at a longer run.
                        Some(_) => {}
                        None if i <= MAX_GAP && n_runs < MAX_RUNS => {
                            runs[n_runs] = (b as u16, i as u32 + 1);
                            n_runs += 1;
                        }
                        None => {}
                    }
                }
            }
            // Past the first blocks, stop once no followed backend can
            // bridge to the next block.
            if i >= MAX_GAP
                && runs[..n_runs]
                    .iter()
                    .all(|r| i + 1 - r.1 as usize > MAX_GAP)
            {
                break;
            }
        }
        for &(b, end) in &runs[..n_runs] {
            out.set(usize::from(b), end);
        }
        n_runs
    }

    /// Records that `backend` now holds every block of `hashes` (it was sent
    /// the prompt) and touches blocks it already held.
    pub fn insert(&self, backend: usize, hashes: &[u64]) {
        self.insert_noted(backend, hashes, &[]);
    }

    /// [`Self::insert`] with the slots a lookup noted for these hashes; a
    /// noted slot is used when it still holds its block, else it is probed.
    pub fn insert_noted(&self, backend: usize, hashes: &[u64], found: &[u32]) {
        self.insert_aging(backend, hashes, found, 0, &mut Vec::new());
    }

    /// `backend` computed `n` blocks more than the index predicted (an
    /// answer said so): they count on its allocation clock.
    pub fn allocated(&self, backend: usize, n: u64) {
        self.pushed[backend].fetch_add(n, Relaxed);
    }

    /// `backend` already held `n` blocks the index counted as new when it
    /// was sent them (an answer said so: the previous answer's tokens, or
    /// another router's traffic): they come off its allocation clock.
    pub fn not_allocated(&self, backend: usize, n: u64) {
        let _ = self.pushed[backend].fetch_update(Relaxed, Relaxed, |v| Some(v.saturating_sub(n)));
    }

    /// [`Self::insert_noted`] for a prompt whose first `matched` blocks the
    /// backend was predicted to hold, also writing into `ages` (cleared
    /// first) each block's age before this send: blocks the backend computed
    /// since it was last sent this one, [`AGE_UNKNOWN`] when another backend
    /// was sent it since or it was never sent. The closed loop (`feedback`)
    /// compares these ages with what the engine says it still held.
    pub fn insert_aging(
        &self,
        backend: usize,
        hashes: &[u64],
        found: &[u32],
        matched: u32,
        ages: &mut Vec<u64>,
    ) {
        ages.clear();
        let tag = (backend as u64) << SENT_SHIFT;
        let alloc = hashes.len().saturating_sub(matched as usize) as u64;
        let end = (self.pushed[backend].fetch_add(alloc, Relaxed) + alloc) & SENT_MASK;
        let now = end - alloc;
        let age_of = |s: &Slot| {
            let sent = s.last_sent.load(Relaxed);
            if sent != 0 && sent & !SENT_MASK == tag {
                now.saturating_sub(sent & SENT_MASK)
            } else {
                AGE_UNKNOWN
            }
        };
        // The common case, a prompt the backend already holds, takes no lock.
        let mut first_new = hashes.len();
        let noted_slot = |i: usize| found.get(i).and_then(|&j| self.slots.get(j as usize));
        for s in (0..AHEAD).filter_map(noted_slot) {
            prefetch(s);
        }
        for (i, &h) in hashes.iter().enumerate() {
            if let Some(s) = noted_slot(i + AHEAD) {
                prefetch(s);
            }
            let noted = found
                .get(i)
                .and_then(|&j| self.slots.get(j as usize))
                .filter(|s| s.key.load(Relaxed) == h);
            match noted
                .or_else(|| self.find(h))
                .and_then(|s| Some((s, s.word_of(backend)?)))
            {
                Some((s, word)) => {
                    owners::touch(word, backend);
                    ages.push(age_of(s));
                    s.last_sent.store(tag | end, Relaxed);
                }
                _ => {
                    first_new = i;
                    break;
                }
            }
        }
        if first_new == hashes.len() {
            return;
        }
        let mut ring = self.rings[backend]
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if ring.capacity == 0 {
            return;
        }
        ages.resize(hashes.len(), AGE_UNKNOWN);
        // Tail first: within one prompt the ring then forgets the tail before
        // the head, as engines evict (a prefix outlives its extensions).
        for (i, &h) in hashes.iter().enumerate().skip(first_new).rev() {
            let slot = self.find_or_claim(h);
            let (new, replaced) = slot.add_owner(backend);
            if new {
                ring.blocks.push_back(h);
                self.tracked.fetch_add(1, Relaxed);
                if replaced.is_some() {
                    self.evictions.fetch_add(1, Relaxed);
                }
            } else if let Some(word) = slot.word_of(backend) {
                ages[i] = age_of(slot);
                owners::touch(word, backend);
            }
            slot.last_sent.store(tag | end, Relaxed);
        }
        self.evict_over(backend, &mut ring);
        self.ring_lens[backend].store(ring.blocks.len(), Relaxed);
    }

    /// Forgets everything `backend` holds (removed, ejected, or restarted).
    pub fn clear_backend(&self, backend: usize) {
        let mut ring = self.rings[backend]
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        while let Some(h) = ring.blocks.pop_front() {
            self.tracked.fetch_sub(1, Relaxed);
            if let Some(s) = self.find(h) {
                self.drop_owner(s, h, backend);
            }
        }
        self.ring_lens[backend].store(0, Relaxed);
    }

    /// Blocks `backend` may hold (see [`PrefixIndex::set_capacity`]).
    pub fn capacity(&self, backend: usize) -> usize {
        self.rings[backend]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .capacity
    }

    /// Blocks tracked for `backend`, without taking its lock (may lag a
    /// writer by one insert).
    pub fn tracked(&self, backend: usize) -> usize {
        self.ring_lens[backend].load(Relaxed)
    }

    /// Blocks tracked for `backend`.
    pub fn len(&self, backend: usize) -> usize {
        self.rings[backend]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .blocks
            .len()
    }

    /// Blocks tracked over all backends.
    pub fn total_tracked(&self) -> usize {
        self.tracked.load(Relaxed)
    }

    /// Blocks forgotten to stay within capacity, since start.
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Relaxed)
    }

    /// Bytes held by the table, the rings and the per-backend tables.
    pub fn memory_bytes(&self) -> usize {
        let per_backend = std::mem::size_of::<Mutex<Ring>>()
            + std::mem::size_of::<AtomicUsize>()
            + std::mem::size_of::<AtomicU64>();
        let rings: usize = self
            .rings
            .iter()
            .map(|r| {
                r.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .blocks
                    .capacity()
                    * 8
            })
            .sum();
        self.slots.len() * std::mem::size_of::<Slot>() + rings + per_backend * self.rings.len()
    }

    /// The homes of a key's two buckets of `BUCKET` slots, from independent
    /// bits of the key. An insert takes the emptier bucket (two choices keep
    /// buckets evenly filled, so a full window stays rare even past half
    /// load, unlike one linear run).
    #[inline]
    fn homes(&self, h: u64) -> [usize; 2] {
        let n = self.slots.len() as u128;
        // Multiply-shift maps a hash onto any table size without a division.
        let home = |x: u64| ((u128::from(x) * n) >> 64) as usize;
        [home(h), home(h.rotate_left(29) ^ 0x9e37_79b9_7f4a_7c15)]
    }

    /// Slot `k` (of `PROBE`) of the window of a key with `homes`.
    #[inline]
    fn at(&self, homes: [usize; 2], k: usize) -> usize {
        let j = homes[k / BUCKET] + k % BUCKET;
        if j >= self.slots.len() {
            j - self.slots.len()
        } else {
            j
        }
    }

    /// Prefetches the lines of `h`'s two buckets that hold their first and
    /// third slots (a bucket of 4 slots of 32 bytes spans 2 or 3 lines).
    #[inline]
    fn prefetch_window(&self, h: u64) {
        let homes = self.homes(h);
        for k in [0, 2, BUCKET, BUCKET + 2] {
            prefetch(&self.slots[self.at(homes, k)]);
        }
    }

    fn find(&self, h: u64) -> Option<&Slot> {
        self.find_index(h).map(|j| &self.slots[j])
    }

    #[inline]
    fn find_index(&self, h: u64) -> Option<usize> {
        let homes = self.homes(h);
        (0..PROBE)
            .map(|k| self.at(homes, k))
            .find(|&j| self.slots[j].key.load(Relaxed) == h)
    }

    /// The slot holding `h`, claiming an empty one of the emptier bucket or,
    /// when both buckets are full, evicting the one with the fewest owners.
    fn find_or_claim(&self, h: u64) -> &Slot {
        if let Some(s) = self.find(h) {
            return s;
        }
        let homes = self.homes(h);
        let slot = |k: usize| &self.slots[self.at(homes, k)];
        let free = |bucket: usize| {
            (0..BUCKET)
                .filter(|&i| slot(bucket * BUCKET + i).key.load(Relaxed) == 0)
                .count()
        };
        let order = if free(1) > free(0) { [1, 0] } else { [0, 1] };
        for bucket in order {
            for i in 0..BUCKET {
                let s = slot(bucket * BUCKET + i);
                if s.key.load(Relaxed) == 0
                    && s.key.compare_exchange(0, h, Relaxed, Relaxed).is_ok()
                {
                    s.reset();
                    return s;
                }
            }
        }
        let mut victim = slot(0);
        let mut victim_owners = u32::MAX;
        for k in 0..PROBE {
            let owners = slot(k).owner_count();
            if owners < victim_owners {
                victim = slot(k);
                victim_owners = owners;
            }
        }
        // Displace the victim: its owners' rings keep its hash, and drop it
        // when it reaches their front (they find no slot for it).
        self.evictions.fetch_add(u64::from(victim_owners), Relaxed);
        victim.key.store(h, Relaxed);
        victim.reset();
        victim
    }

    fn drop_owner(&self, s: &Slot, h: u64, backend: usize) {
        for w in &s.owners {
            owners::remove(w, backend);
        }
        if s.owner_count() == 0 {
            let _ = s.key.compare_exchange(h, 0, Relaxed, Relaxed);
        }
    }

    fn evict_over(&self, backend: usize, ring: &mut Ring) {
        // Each block gets at most one second chance per sweep; past that
        // budget blocks are dropped whatever their bit says, so the loop ends
        // and the capacity holds even while readers keep touching blocks.
        let mut second_chances = ring.blocks.len();
        while ring.blocks.len() > ring.capacity {
            let Some(h) = ring.blocks.pop_front() else {
                break;
            };
            if let Some((s, word)) = self.find(h).and_then(|s| Some((s, s.word_of(backend)?))) {
                if second_chances > 0 && owners::take_referenced(word, backend) {
                    second_chances -= 1;
                    ring.blocks.push_back(h);
                    continue;
                }
                self.drop_owner(s, h, backend);
                self.evictions.fetch_add(1, Relaxed);
            }
            // Else displaced from the table already: the entry was stale.
            self.tracked.fetch_sub(1, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests;
