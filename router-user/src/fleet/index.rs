//! The prefix index: which backend holds which prefix block.
//!
//! One table shared by every worker thread. Readers take no lock: a slot is
//! atomics (block hash, two words of owner lanes with their referenced bits,
//! see `fleet::owners`, and who was sent it last). Writers
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
//! A long prompt costs what its holders number, not its length: the lookup
//! walks a prompt's first blocks and searches each holder's end from the
//! last block back (`search_matches`), and learning a prompt the backend
//! held touches and stamps one block in [`ANCHOR_STRIDE`] past its head
//! (`is_anchor`); the blocks between take their recency from their anchor.
//!
//! Memory: 32 bytes a slot whatever the fleet size, slots = 4/3 x the sum of
//! capacities, plus 16 bytes a ring entry (the block and its anchor):
//! 32 * 4/3 + 16 = 58.7 bytes per
//! tracked block when every backend is full, plus 72 bytes per backend slot
//! (72 KB for `MAX_BACKENDS`: 9 bytes a block on 8 backends of 1,024
//! blocks, nothing on real capacities; `memory_per_tracked_block` and
//! `memory_per_tracked_block_at_1024_backends` in the tests measure it).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Mutex, OnceLock};

use crate::fleet::MAX_BACKENDS;
use crate::fleet::owners::{self, Added, BackendSet, LANES};
use search::Probes;

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
    /// Who holds the block, with their referenced bits (`fleet::owners`).
    owners: [AtomicU64; OWNER_WORDS],
    /// When the block was last sent, as `backend << 48 | that backend's
    /// clock (blocks sent) then` (see [`PrefixIndex::insert_aging`]); 0 = never.
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
/// them, eight are in flight (decision 0012; the `index/*_cold` benches).
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

/// A table of `n` empty slots, on transparent huge pages where the kernel
/// grants them. Lookups and learning touch slots at random over megabytes
/// (32 bytes a slot, 4/3 slot per block of capacity: 8 MB for three
/// engines of 65,536 blocks), so with 4 KB pages nearly every touch missed
/// the TLB as well as the cache: a 400 KB prompt the backend held, touching
/// 700 anchors, cost 525 us of router CPU where 2 MB pages made it 450
/// (decision 0013, huge pages for the index).
fn slot_table(n: usize) -> Box<[Slot]> {
    let mut table = Box::<[Slot]>::new_uninit_slice(n);
    // Before the first write: the kernel chooses a page's size when the
    // page is first touched.
    advise_huge_pages(&mut table);
    for s in table.iter_mut() {
        s.write(Slot::empty());
    }
    // SAFETY: every element was written by the loop just above.
    unsafe { table.assume_init() }
}

/// Asks the kernel for huge pages under the 2 MB-aligned part of `mem`. A
/// hint: where it is refused (THP off, another OS) the table works as well,
/// only slower.
fn advise_huge_pages<T>(mem: &mut [T]) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = mem.as_mut_ptr() as usize;
        let lo = start.next_multiple_of(HUGE);
        let hi = (start + std::mem::size_of_val(mem)) / HUGE * HUGE;
        if hi > lo {
            // SAFETY: MADV_HUGEPAGE changes neither the mapping nor its
            // contents, and the range lies inside `mem`, which we own.
            let r = unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_HUGEPAGE) };
            if r != 0 {
                tracing::debug!(
                    error = %std::io::Error::last_os_error(),
                    "no huge pages for the prefix index"
                );
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = mem;
}

/// `Slot::last_sent` keeps the backend in its top 16 bits (its clock of
/// blocks sent below: 2^48 blocks are years of traffic).
const SENT_SHIFT: u32 = 48;
const SENT_MASK: u64 = (1 << SENT_SHIFT) - 1;

/// A block whose age is not known (not last sent to this backend).
pub const AGE_UNKNOWN: u64 = u64::MAX;

/// What [`PrefixIndex::insert_aging`] tells [`PrefixIndex::distinct_ages`].
#[derive(Clone, Copy, Debug)]
pub struct Sent {
    /// The backend's clock at the send.
    pub now: u64,
    /// Blocks the backend held whose last send was to another backend (the
    /// stamp is per block): each was sent here before, when is not known.
    /// A system prompt every engine holds is one: counted as new at every
    /// send, it would add itself to every age once per request between.
    pub foreign: u64,
}

/// The blocks that block `i`'s age stands for: itself, or past the head
/// an anchor and the blocks after it up to the next.
fn stands_for(i: usize) -> u64 {
    if i < DENSE_BLOCKS {
        1
    } else {
        ANCHOR_STRIDE as u64
    }
}

/// Clock blocks per fine bucket of the retouch counts
/// ([`PrefixIndex::distinct_ages`]). A send stamps all of a prompt's blocks
/// with the clock after it, so a fine bucket holds about one prompt's
/// stamp: an age read against it may subtract the retouched blocks of a
/// prompt of under 16 blocks sent just before.
const RETOUCH_FINE: u64 = 16;

/// Fine buckets per coarse one: a count over a long span reads coarse
/// buckets in its middle and fine ones at its ends.
const RETOUCH_PER_COARSE: u64 = 64;

/// Fine buckets per backend: ages up to 131,072 blocks of its clock are
/// corrected, older ones are unknown (an engine whose cache holds more
/// than that learns no capacity from the answers and keeps its published
/// or configured one). With the coarse ones, 65 KB a backend, made at its
/// first send.
const RETOUCH_BUCKETS: usize = 8192;

/// One backend's retouch counts: blocks sent again, by the clock stamp of
/// their previous send. Each bucket holds its epoch (bucket number, low 32
/// bits) above its count, so a bucket reused by a later epoch starts from
/// zero.
struct Retouches {
    fine: Box<[AtomicU64]>,
    coarse: Box<[AtomicU64]>,
}

impl Retouches {
    fn new() -> Retouches {
        let zeros = |n: usize| (0..n).map(|_| AtomicU64::new(0)).collect();
        Retouches {
            fine: zeros(RETOUCH_BUCKETS),
            coarse: zeros(RETOUCH_BUCKETS / RETOUCH_PER_COARSE as usize),
        }
    }

    /// Counts `n` blocks sent again whose previous send was stamped `stamp`.
    fn add(&self, stamp: u64, n: u64) {
        let fine = stamp / RETOUCH_FINE;
        bump(&self.fine, fine, n);
        bump(&self.coarse, fine / RETOUCH_PER_COARSE, n);
    }

    /// Blocks sent again, up to clock `now`, whose previous send was
    /// stamped at or after `stamp`'s fine bucket: each was counted on the
    /// clock once already since `stamp`. `None` past the buckets' reach.
    fn since(&self, stamp: u64, now: u64) -> Option<u64> {
        let (first, last) = (stamp / RETOUCH_FINE, now / RETOUCH_FINE);
        if last.saturating_sub(first) >= self.fine.len() as u64 {
            return None;
        }
        let coarse_of = |f: u64| f / RETOUCH_PER_COARSE;
        if coarse_of(first) == coarse_of(last) {
            return Some((first..=last).map(|e| read(&self.fine, e)).sum());
        }
        // The rest of the first coarse bucket, the whole ones, then the
        // start of the last one.
        let head_end = (coarse_of(first) + 1) * RETOUCH_PER_COARSE;
        let tail_start = coarse_of(last) * RETOUCH_PER_COARSE;
        Some(
            (first..head_end).map(|e| read(&self.fine, e)).sum::<u64>()
                + (coarse_of(first) + 1..coarse_of(last))
                    .map(|e| read(&self.coarse, e))
                    .sum::<u64>()
                + (tail_start..=last)
                    .map(|e| read(&self.fine, e))
                    .sum::<u64>(),
        )
    }
}

const COUNT_MASK: u64 = u32::MAX as u64;

/// Runs of equal ages in one prompt that [`PrefixIndex::distinct_ages`]
/// counts (on the stack: the request path allocates nothing for it).
const MAX_AGE_RUNS: usize = 8;

/// Adds `n` to bucket `epoch` of `table`, restarting it if it held an older epoch.
fn bump(table: &[AtomicU64], epoch: u64, n: u64) {
    let tag = epoch & COUNT_MASK;
    let cell = &table[epoch as usize % table.len()];
    let _ = cell.fetch_update(Relaxed, Relaxed, |v| {
        let count = if v >> 32 == tag { v & COUNT_MASK } else { 0 };
        Some((tag << 32) | (count + n).min(COUNT_MASK))
    });
}

/// Bucket `epoch` of `table`: 0 if it holds another epoch.
fn read(table: &[AtomicU64], epoch: u64) -> u64 {
    let v = table[epoch as usize % table.len()].load(Relaxed);
    if v >> 32 == epoch & COUNT_MASK {
        v & COUNT_MASK
    } else {
        0
    }
}

/// Blocks of a prompt's head that are all anchors: the bookkeeping of a
/// prompt's first 32 KB (the whole of most chats: the quality scenarios'
/// conversations end near 400 blocks) is exact, block by block, as before
/// anchors (`learning_matches_the_walk_below_the_anchors`). The cost: a
/// prompt of up to 512 blocks costs what it did (looked up and learned
/// block by block, [`LINEAR_MAX`]), and a 400 KB one 22 us to look up and
/// learn where 64 dense blocks made it 9 us (criterion `index`).
const DENSE_BLOCKS: usize = 512;

/// Past [`DENSE_BLOCKS`], one block in this many is an anchor (2 KB, about
/// 500 tokens): learning a 400 KB prompt the backend held touches and
/// stamps 700 anchors, not 6,400 blocks. The price: a block between two
/// anchors is kept as long as the first of them is sent (up to 31 blocks
/// kept past where a conversation ends, if one that shared them goes on),
/// and the closed loop reads its age from the nearest anchor.
const ANCHOR_STRIDE: usize = 32;

const _: () = assert!(DENSE_BLOCKS.is_multiple_of(ANCHOR_STRIDE));

/// Whether block `i` of a prompt is an anchor: its referenced bit and its
/// when-last-sent stamp are kept whenever a prompt holding it is sent. A
/// block's position in its prompt is fixed by its hash (the hashes are
/// chained), so every prompt agrees on which blocks are anchors, and every
/// prompt holding a block holds its anchor ([`anchor_of`] is not after it).
#[inline]
pub fn is_anchor(i: usize) -> bool {
    i < DENSE_BLOCKS || i.is_multiple_of(ANCHOR_STRIDE)
}

/// The anchor whose recency block `i` takes: itself, or the last anchor
/// before it.
#[inline]
pub fn anchor_of(i: usize) -> usize {
    if is_anchor(i) {
        i
    } else {
        i - i % ANCHOR_STRIDE
    }
}

/// Block `i` if it is an anchor, else the first anchor after it.
#[inline]
pub fn anchor_after(i: usize) -> usize {
    if is_anchor(i) {
        i
    } else {
        anchor_of(i) + ANCHOR_STRIDE
    }
}

/// One backend's blocks in the order they were first tracked, each with
/// the hash of its anchor ([`anchor_of`]; its own for an anchor). A long
/// prompt sent again touches and stamps its anchors only, so the hand gives
/// a block a second chance when its own referenced bit is set or its
/// anchor was sent since the hand last passed the block
/// (`PrefixIndex::anchor_sent_since`). Blocks queued with their anchor
/// enter before it (tail first), so the hand reads the anchor's bit as the
/// last send left it; for blocks queued after their anchor (a prompt
/// extending one that ended between two anchors) the hand passes the
/// anchor first and clears its bit, and the stamps tell.
#[derive(Default)]
struct Ring {
    blocks: VecDeque<[u64; 2]>,
    capacity: usize,
}

pub struct PrefixIndex {
    slots: Box<[Slot]>,
    rings: Box<[Mutex<Ring>]>,
    /// Each ring's length, readable without its lock (selection reads it).
    ring_lens: Box<[AtomicUsize]>,
    /// Blocks each backend was sent (every prompt block, held or not, and
    /// the answers' tokens), since start: the clock block ages are measured
    /// in. An LRU engine evicts a block once more distinct blocks than its
    /// capacity were used after it: its age less the blocks counted twice
    /// since (see [`PrefixIndex::distinct_ages`]).
    pushed: Box<[AtomicU64]>,
    /// Per backend, made at its first send: touches of blocks it was sent
    /// before, counted by the stamp of that earlier send (see
    /// [`PrefixIndex::distinct_ages`]).
    retouches: Box<[OnceLock<Retouches>]>,
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

/// Prompts of up to this many blocks (32 KB) are looked up by the walk,
/// longer ones by the search. The search alone wins from about 48 blocks
/// (lookup then learning of a held prompt, cold, walk against search: 16
/// blocks 0.50 against 0.59 us, 32 blocks 0.96 against 1.02, 64 blocks
/// 2.16 against 2.06, 128 blocks 4.37 against 2.25, with anchors from
/// block 64), but below [`DENSE_BLOCKS`] the learning visits every block
/// anyway, and finds them warm and noted after the walk: so a prompt is
/// walked as long as it is learned block by block, and up to 32 KB the
/// request path is the block-by-block one the tests keep as the oracle.
pub const LINEAR_MAX: usize = DENSE_BLOCKS;

impl PrefixIndex {
    /// An index sized for `total_capacity` tracked blocks over all backends.
    pub fn new(total_capacity: usize) -> Self {
        let n = total_capacity.max(1024) * 4 / 3;
        let slots = slot_table(n);
        let rings = (0..MAX_BACKENDS)
            .map(|_| Mutex::new(Ring::default()))
            .collect();
        PrefixIndex {
            slots,
            rings,
            ring_lens: (0..MAX_BACKENDS).map(|_| AtomicUsize::new(0)).collect(),
            pushed: (0..MAX_BACKENDS).map(|_| AtomicU64::new(0)).collect(),
            retouches: (0..MAX_BACKENDS).map(|_| OnceLock::new()).collect(),
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
    /// [`Self::insert_noted`] need not probe for them again: the first
    /// `found.len()` blocks.
    ///
    /// Its cost follows the backends holding the prompt's first blocks, not
    /// the fleet, and on a long prompt not its length either: a prompt of
    /// up to [`LINEAR_MAX`] blocks is walked block by block
    /// ([`Self::walk_matches`]); a longer one walks its first blocks, then
    /// searches each holder's end from the last block back
    /// ([`Self::search_matches`]).
    pub fn longest_matches_noting(
        &self,
        hashes: &[u64],
        candidates: &BackendSet,
        out: &mut Matches,
        found: &mut Vec<u32>,
    ) -> usize {
        if hashes.len() <= LINEAR_MAX {
            self.walk_matches(hashes, candidates, out, found)
        } else {
            self.search_matches(hashes, candidates, out, found)
        }
    }

    /// The lookup block by block: each backend's match is where it drops
    /// out. The rule is the one [`Self::search_matches`] keeps on long
    /// prompts, and its tests' oracle.
    fn walk_matches(
        &self,
        hashes: &[u64],
        candidates: &BackendSet,
        out: &mut Matches,
        found: &mut Vec<u32>,
    ) -> usize {
        found.clear();
        out.clear();
        let (runs, n_runs) = self.walk_runs(hashes, hashes.len(), candidates, found);
        for &(b, end) in &runs[..n_runs] {
            out.set(usize::from(b), end);
        }
        n_runs
    }

    /// Walks the first `limit` blocks of `hashes`, noting their slots in
    /// `found`; returns each backend followed and the end of its match
    /// within them (one past the last block it holds).
    ///
    /// A backend that holds a later block was sent the blocks before it too
    /// (the hashes are chained): a run of up to `MAX_GAP` blocks it lacks
    /// (slots displaced from a full window, re-claimed for another backend)
    /// is bridged; a longer run ends its match before the run. So only
    /// owners of the first `MAX_GAP + 1` blocks can have a match.
    fn walk_runs(
        &self,
        hashes: &[u64],
        limit: usize,
        candidates: &BackendSet,
        found: &mut Vec<u32>,
    ) -> ([(u16, u32); MAX_RUNS], usize) {
        let mut runs = [(0u16, 0u32); MAX_RUNS];
        let mut n_runs = 0;
        let hashes = &hashes[..limit.min(hashes.len())];
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
        (runs, n_runs)
    }

    /// Records that `backend` now holds every block of `hashes` (it was sent
    /// the prompt) and touches blocks it already held.
    pub fn insert(&self, backend: usize, hashes: &[u64]) {
        self.insert_noted(backend, hashes, &[]);
    }

    /// [`Self::insert`] with the slots a lookup noted for these hashes; a
    /// noted slot is used when it still holds its block, else it is probed.
    pub fn insert_noted(&self, backend: usize, hashes: &[u64], found: &[u32]) {
        self.insert_aging(backend, hashes, found, &mut Vec::new());
    }

    /// `backend` used `n` blocks the prompt did not show (an answer's
    /// tokens, which its cache keeps as it keeps the prompt's): they count
    /// on its clock.
    pub fn allocated(&self, backend: usize, n: u64) {
        self.pushed[backend].fetch_add(n, Relaxed);
    }

    /// Turns the ages [`Self::insert_aging`] wrote for a prompt (`sent`)
    /// into LRU stack distances: each age less the blocks
    /// counted twice on the clock since (a block sent again, such as a
    /// system prompt every request repeats, is one block of the engine's
    /// cache however often it is sent), so an age says how many distinct
    /// blocks the backend used after that block, which is what decides
    /// whether an LRU cache of a given capacity still holds it. Then
    /// counts this prompt's own blocks that were sent before, by the stamp
    /// of that send. Ages past [`RETOUCH_BUCKETS`] fine buckets become unknown.
    ///
    /// Costs a read per bucket an age spans (fine ones at its ends, coarse
    /// ones between), once per run of equal ages (a chat's system prompt
    /// and history are a run each).
    pub fn distinct_ages(&self, backend: usize, sent: Sent, ages: &mut [u64]) {
        self.distinct_ages_pinned(backend, sent, ages, |_| Some(0));
    }

    /// [`Self::distinct_ages`], adding to each age `pinned(stamp)`: blocks
    /// the engine keeps after a block last sent at clock `stamp` that the
    /// clock does not count there (what its running requests hold,
    /// `Load::pinned_before`); `None` makes the age unknown.
    pub fn distinct_ages_pinned(
        &self,
        backend: usize,
        sent: Sent,
        ages: &mut [u64],
        pinned: impl Fn(u64) -> Option<u64>,
    ) {
        let Sent { now, foreign } = sent;
        let table = self.retouches[backend].get_or_init(Retouches::new);
        let mut last: Option<(u64, u64)> = None;
        // This prompt's runs of equal ages, counted after every age is
        // read (a block sent again now is not a use before now). A chat
        // has two or three (its system prompt, its history); past
        // `MAX_AGE_RUNS` the rest go uncounted.
        let mut runs = [(0u64, 0u64); MAX_AGE_RUNS];
        let mut n_runs = 0usize;
        // Only anchors have ages (every block of the head, then one in
        // `ANCHOR_STRIDE`): a 400 KB prompt is 700 reads, not 6,400.
        let n = ages.len();
        let anchors = (0..n.min(DENSE_BLOCKS)).chain((DENSE_BLOCKS..n).step_by(ANCHOR_STRIDE));
        for i in anchors {
            let age = &mut ages[i];
            if *age == AGE_UNKNOWN {
                continue;
            }
            let raw = *age;
            // A block past the head stands for the blocks up to the next
            // anchor, which have no age of their own.
            let weight = stands_for(i);
            match n_runs.checked_sub(1).map(|i| &mut runs[i]) {
                Some((r, n)) if *r == raw => *n += weight,
                _ if n_runs < MAX_AGE_RUNS => {
                    runs[n_runs] = (raw, weight);
                    n_runs += 1;
                }
                _ => {}
            }
            *age = match last {
                Some((r, d)) if r == raw => d,
                _ => {
                    let stamp = now.saturating_sub(raw);
                    let d = table
                        .since(stamp, now)
                        .zip(pinned(stamp))
                        .map_or(AGE_UNKNOWN, |(dup, pin)| raw.saturating_sub(dup) + pin);
                    last = Some((raw, d));
                    d
                }
            };
        }
        for &(raw, n) in &runs[..n_runs] {
            table.add(now.saturating_sub(raw), n);
        }
        // Taken as sent here last just now: a block several backends hold
        // is most often a hot one, sent to each of them all the time.
        if foreign > 0 {
            table.add(now, foreign);
        }
    }

    /// Blocks of `backend`'s send stamped `stamp` (of `blocks` blocks) sent
    /// again since: read from the retouch counts, whose fine bucket may
    /// also hold another short prompt's stamp.
    pub fn resent(&self, backend: usize, stamp: u64, blocks: u32) -> u64 {
        self.retouches[backend].get().map_or(0, |t| {
            read(&t.fine, stamp / RETOUCH_FINE).min(u64::from(blocks))
        })
    }

    /// [`Self::insert_noted`], also writing into `ages` (cleared
    /// first, one per block) each block's age before this send: blocks the
    /// backend was sent since it was last sent this one, [`AGE_UNKNOWN`]
    /// when another backend was sent it since, it was never sent, or it is
    /// not an anchor ([`is_anchor`]: every block of a prompt's first 32 KB
    /// is, then one in [`ANCHOR_STRIDE`]). The closed loop (`feedback`)
    /// compares these ages with what the engine says it still held.
    ///
    /// What the backend held costs per anchor, not per block: on a prompt
    /// of more than [`DENSE_BLOCKS`] blocks, its held part is found as the
    /// lookup finds a match ([`Self::match_end`]), and only its anchors are
    /// touched and stamped; the blocks between two anchors take their
    /// recency from the first of them (see [`Ring`]) and have no age. A
    /// shorter prompt is learned block by block, exactly as before anchors.
    ///
    /// Returns the backend's clock at this send and the held blocks of
    /// unknown age, for [`Self::distinct_ages`].
    pub fn insert_aging(
        &self,
        backend: usize,
        hashes: &[u64],
        found: &[u32],
        ages: &mut Vec<u64>,
    ) -> Sent {
        ages.clear();
        let n = hashes.len();
        let tag = (backend as u64) << SENT_SHIFT;
        // Every block sent is a use of the engine's cache, held or not.
        let alloc = n as u64;
        let end = (self.pushed[backend].fetch_add(alloc, Relaxed) + alloc) & SENT_MASK;
        let now = end - alloc;
        // Held blocks whose last send was to another backend (a system
        // prompt several engines hold): sent here before, but when is not
        // known (see [`Sent::foreign`]).
        let foreign = std::cell::Cell::new(0u64);
        let age_of = |i: usize, s: &Slot| {
            let sent = s.last_sent.load(Relaxed);
            if sent != 0 && sent & !SENT_MASK == tag {
                now.saturating_sub(sent & SENT_MASK)
            } else {
                if sent != 0 {
                    foreign.set(foreign.get() + stands_for(i));
                }
                AGE_UNKNOWN
            }
        };
        let noted_slot = |i: usize| found.get(i).and_then(|&j| self.slots.get(j as usize));
        // The slot of block `i` if it names the backend.
        let held_slot = |i: usize| {
            noted_slot(i)
                .filter(|s| s.key.load(Relaxed) == hashes[i])
                .or_else(|| self.find(hashes[i]))
                .and_then(|s| Some((s, s.word_of(backend)?)))
        };
        ages.resize(n, AGE_UNKNOWN);
        // Anchors of the held part that the backend lacks (their slots
        // displaced or their lanes taken): learned again below, so the
        // blocks after them keep a recency.
        let mut lost_anchors = Vec::new();
        let mut held_end = 0;
        if n > DENSE_BLOCKS {
            let mut probes = Probes::new(hashes);
            if let Some(lo) = (0..=MAX_GAP).find(|&i| probes.holds(self, i, backend)) {
                held_end = self.match_end(&mut probes, backend, lo);
            }
            let anchors = (0..held_end.min(DENSE_BLOCKS))
                .chain((DENSE_BLOCKS..held_end).step_by(ANCHOR_STRIDE));
            for i in anchors.clone().take(AHEAD) {
                self.prefetch_window(hashes[i]);
            }
            for (i, ahead) in anchors
                .clone()
                .zip(anchors.skip(AHEAD).map(Some).chain(std::iter::repeat(None)))
            {
                if let Some(j) = ahead {
                    self.prefetch_window(hashes[j]);
                }
                match held_slot(i) {
                    Some((s, word)) => {
                        owners::touch(word, backend);
                        ages[i] = age_of(i, s);
                        s.last_sent.store(tag | end, Relaxed);
                    }
                    None => lost_anchors.push(i),
                }
            }
        }
        // Block by block past it (the whole of a short prompt). The common
        // case, a prompt the backend already holds, takes no lock.
        let mut first_new = n;
        // A block's noted slot is prefetched; past `DENSE_BLOCKS`, where the
        // lookup noted only the first blocks, its window else.
        let ahead = |i: usize| match noted_slot(i) {
            Some(s) => prefetch(s),
            None if n > DENSE_BLOCKS => {
                if let Some(&h) = hashes.get(i) {
                    self.prefetch_window(h);
                }
            }
            None => {}
        };
        (held_end..held_end + AHEAD).for_each(ahead);
        for (i, age) in ages.iter_mut().enumerate().skip(held_end) {
            ahead(i + AHEAD);
            match held_slot(i) {
                Some((s, word)) => {
                    owners::touch(word, backend);
                    if is_anchor(i) {
                        *age = age_of(i, s);
                    }
                    s.last_sent.store(tag | end, Relaxed);
                }
                _ => {
                    first_new = i;
                    break;
                }
            }
        }
        if first_new == n && lost_anchors.is_empty() {
            return Sent {
                now,
                foreign: foreign.get(),
            };
        }
        let mut ring = self.rings[backend]
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if ring.capacity == 0 {
            ages.truncate(first_new);
            return Sent {
                now,
                foreign: foreign.get(),
            };
        }
        // Tail first: within one prompt the ring then forgets the tail before
        // the head, as engines evict (a prefix outlives its extensions).
        let blocks = (first_new..n)
            .rev()
            .chain(lost_anchors.iter().rev().copied());
        for i in blocks {
            let h = hashes[i];
            let slot = self.find_or_claim(h);
            let (new, replaced) = slot.add_owner(backend);
            if new {
                ring.blocks.push_back([h, hashes[anchor_of(i)]]);
                self.tracked.fetch_add(1, Relaxed);
                if replaced.is_some() {
                    self.evictions.fetch_add(1, Relaxed);
                }
            } else if let Some(word) = slot.word_of(backend) {
                if is_anchor(i) {
                    ages[i] = age_of(i, slot);
                }
                owners::touch(word, backend);
            }
            slot.last_sent.store(tag | end, Relaxed);
        }
        self.evict_over(backend, &mut ring);
        self.ring_lens[backend].store(ring.blocks.len(), Relaxed);
        Sent {
            now,
            foreign: foreign.get(),
        }
    }

    /// What `backend` holds, oldest first, as (block, anchor) pairs: a
    /// snapshot another router replica restores with [`Self::restore`].
    pub fn export(&self, backend: usize) -> Vec<[u64; 2]> {
        let ring = self.rings[backend]
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        ring.blocks.iter().copied().collect()
    }

    /// Records that `backend` holds these (block, anchor) pairs, oldest
    /// first, as another replica's [`Self::export`] gave them: each is
    /// newer than what `backend` held here before.
    pub fn restore(&self, backend: usize, pairs: &[[u64; 2]]) {
        if pairs.is_empty() {
            return;
        }
        let tag = (backend as u64) << SENT_SHIFT;
        let alloc = pairs.len() as u64;
        let end = (self.pushed[backend].fetch_add(alloc, Relaxed) + alloc) & SENT_MASK;
        let mut ring = self.rings[backend]
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if ring.capacity == 0 {
            return;
        }
        for &[h, anchor] in pairs {
            let slot = self.find_or_claim(h);
            let (new, replaced) = slot.add_owner(backend);
            if new {
                ring.blocks.push_back([h, anchor]);
                self.tracked.fetch_add(1, Relaxed);
                if replaced.is_some() {
                    self.evictions.fetch_add(1, Relaxed);
                }
            } else if let Some(word) = slot.word_of(backend) {
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
        while let Some([h, _]) = ring.blocks.pop_front() {
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
                    * std::mem::size_of::<[u64; 2]>()
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
        // The last anchor read, its bit and its stamp: the blocks of one
        // anchor are queued together.
        let mut anchor = (0u64, false, 0u64);
        while ring.blocks.len() > ring.capacity {
            let Some([h, a]) = ring.blocks.pop_front() else {
                break;
            };
            if let Some((s, word)) = self.find(h).and_then(|s| Some((s, s.word_of(backend)?))) {
                if second_chances > 0
                    && (owners::take_referenced(word, backend)
                        || (a != h && self.anchor_sent_since(&mut anchor, a, s, backend)))
                {
                    second_chances -= 1;
                    ring.blocks.push_back([h, a]);
                    continue;
                }
                self.drop_owner(s, h, backend);
                self.evictions.fetch_add(1, Relaxed);
            }
            // Else displaced from the table already: the entry was stale.
            self.tracked.fetch_sub(1, Relaxed);
        }
    }

    /// Whether a block of `backend` whose anchor is `a` and whose slot is
    /// `s` was sent again since the hand last passed it (or since it was
    /// queued): its anchor's referenced bit is set (read, not cleared: the
    /// anchor's own pass clears it), or its anchor's stamp is the
    /// backend's and newer than the block's own. The block then takes its
    /// anchor's stamp, so that its next pass asks for a later send. `cache`
    /// keeps the last anchor read (the blocks of one anchor are queued
    /// together).
    fn anchor_sent_since(
        &self,
        cache: &mut (u64, bool, u64),
        a: u64,
        s: &Slot,
        backend: usize,
    ) -> bool {
        if cache.0 != a {
            *cache = match self.find(a) {
                Some(anchor) => {
                    let referenced = anchor.load().iter().any(|&w| {
                        owners::position(w, backend).is_some_and(|k| owners::referenced_at(w, k))
                    });
                    (a, referenced, anchor.last_sent.load(Relaxed))
                }
                None => (a, false, 0),
            };
        }
        let (_, referenced, stamp) = *cache;
        let tag = (backend as u64) << SENT_SHIFT;
        let own = s.last_sent.load(Relaxed);
        let newer = stamp != 0
            && stamp & !SENT_MASK == tag
            && (own & !SENT_MASK != tag || stamp & SENT_MASK > own & SENT_MASK);
        if newer {
            s.last_sent.store(stamp, Relaxed);
        }
        referenced || newer
    }
}

mod search;
#[cfg(test)]
mod tests;
