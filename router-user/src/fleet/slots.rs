//! A model of slot caches, the llama.cpp kind of engine.
//!
//! vLLM and SGLang keep one block cache per engine, shared by every request,
//! evicted block by block (the prefix index models that). llama.cpp's
//! `llama-server` keeps one prompt per slot (`-np N`): a new request takes
//! the idle slot whose prompt shares the largest fraction of it (above
//! `--slot-prompt-similarity`, 0.1), else the least recently used idle slot,
//! and whatever that slot held beyond the common prefix is gone. So on a
//! slot engine the question is not "which blocks are cached" but "which
//! slot will this request take, and whose conversation does it throw out".
//!
//! [`SlotCache`] is the router's picture of one slot engine: for each slot,
//! the block hashes of the last prompt the router sent there and when (on
//! the router's request counter). [`SlotCache::predict`] says what a
//! request would find: the blocks the engine will reuse, and the blocks of
//! a *live* conversation it would evict (a slot used within the last
//! [`LIVE_REQUESTS_PER_SLOT`] requests per slot of the fleet counts as
//! live: its conversation will probably come back). Selection adds those
//! evicted blocks to the cost, so a new conversation goes where a slot is
//! free or holds a finished conversation, and each conversation keeps its
//! slot where it can.
//!
//! Reads and writes take no lock: each slot's prompt is an `ArcSwapOption`
//! swapped whole at dispatch (one allocation per request sent to a slot
//! engine), its stamp an atomic. Racing requests may predict from a stale
//! picture; the answer's `cached_tokens` is what the engine really did.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering::Relaxed};

use arc_swap::ArcSwapOption;

/// Most slots modelled per engine (llama-server's `-np` is rarely above 16).
pub const MAX_SLOTS: usize = 64;

/// llama-server's default `--slot-prompt-similarity`: an idle slot whose
/// prompt shares more than this fraction of the request is reused before
/// the least recently used one.
pub const SLOT_SIMILARITY: f64 = 0.1;

/// A slot whose last request is at most this many router requests per
/// slot of the fleet ago holds a live conversation. With as many
/// conversations in flight as the fleet has slots, a live one sends a turn
/// about every `slots` requests; twice that leaves room for uneven turns.
pub const LIVE_REQUESTS_PER_SLOT: u64 = 2;

/// How the router models a backend's cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum EngineKind {
    /// Detect: a backend whose `/props` reports `total_slots` is a slot
    /// engine (llama.cpp), any other a block cache.
    #[default]
    Auto,
    /// One shared block cache (vLLM, SGLang): the prefix index.
    Blocks,
    /// One prompt per slot (llama.cpp): [`SlotCache`].
    Slots,
}

/// One slot: the last prompt sent there and when.
#[derive(Debug, Default)]
struct Slot {
    prompt: ArcSwapOption<Vec<u64>>,
    /// The router's request counter at that dispatch (0: never used).
    last: AtomicU64,
    /// Its conversation went on elsewhere: nobody will come back for it.
    left: AtomicBool,
    /// Requests sent to it that have not finished (more than one: the
    /// others wait in the engine's queue for it).
    running: AtomicU32,
}

/// What a request would find on a slot engine.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SlotPrediction {
    /// Leading blocks of the request the engine would reuse.
    pub cached_blocks: u32,
    /// Blocks of a live conversation's prompt the request would overwrite.
    pub evicted_blocks: u32,
    /// It would take the slot of a live conversation (one that is not a
    /// prefix of this request): that conversation loses its slot.
    pub evicts_live: bool,
    /// How likely that conversation is still going: 1 for a slot used by
    /// the last request, falling linearly to 0 at the live window's end
    /// (the older of two live-looking slots is the likelier to hold a
    /// conversation that ended). 0 when nothing live is evicted.
    pub live_weight: f32,
    /// The slot it would take.
    pub slot: usize,
    /// Every slot is running a request: it waits for this many to finish
    /// first (0: a slot is idle).
    pub waits: u32,
}

/// The router's picture of one slot engine's slots.
#[derive(Debug)]
pub struct SlotCache {
    /// Slots modelled; 0 while the backend is not known to be a slot engine.
    count: AtomicUsize,
    slots: Box<[Slot]>,
}

impl Default for SlotCache {
    fn default() -> Self {
        SlotCache {
            count: AtomicUsize::new(0),
            slots: (0..MAX_SLOTS).map(|_| Slot::default()).collect(),
        }
    }
}

/// Leading hashes `a` and `b` share. The hashes are chained, so once two
/// differ all later ones do: a binary search finds the boundary.
fn common_prefix(a: &[u64], b: &[u64]) -> usize {
    let n = a.len().min(b.len());
    let (mut lo, mut hi) = (0, n);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if a[mid] == b[mid] {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

impl SlotCache {
    /// Slots modelled (0: not a slot engine).
    pub fn count(&self) -> usize {
        self.count.load(Relaxed)
    }

    /// Whether the backend is modelled as a slot engine.
    pub fn is_slot_engine(&self) -> bool {
        self.count() > 0
    }

    /// Models `n` slots (capped at [`MAX_SLOTS`]); 0 turns the model off.
    /// Forgets what the slots held when the count changes. Returns the
    /// count before.
    pub fn set_count(&self, n: usize) -> usize {
        let n = n.min(MAX_SLOTS);
        let before = self.count.swap(n, Relaxed);
        if before != n {
            self.clear();
        }
        before
    }

    /// Forgets every slot's prompt (the engine restarted or was ejected).
    pub fn clear(&self) {
        for s in self.slots.iter() {
            s.prompt.store(None);
            s.last.store(0, Relaxed);
            s.left.store(false, Relaxed);
            s.running.store(0, Relaxed);
        }
    }

    /// What `hashes` would find here at request number `now`, with
    /// `in_flight` requests on the engine and `fleet_slots` slots over the
    /// fleet (for liveness).
    pub fn predict(
        &self,
        hashes: &[u64],
        now: u64,
        in_flight: u32,
        fleet_slots: usize,
    ) -> SlotPrediction {
        let n = self.count();
        let slots = &self.slots[..n];
        if n == 0 {
            return SlotPrediction::default();
        }
        // Slots running a request are skipped: llama-server never gives a
        // request a slot that is processing. When all are, the request
        // waits and takes the first that frees up, by the same rule: then
        // every slot is a candidate.
        let mut stamps: [u64; MAX_SLOTS] = [0; MAX_SLOTS];
        let mut running: [bool; MAX_SLOTS] = [false; MAX_SLOTS];
        for (i, s) in slots.iter().enumerate() {
            stamps[i] = s.last.load(Relaxed);
            running[i] = s.running.load(Relaxed) > 0;
        }
        let all_running = running[..n].iter().all(|&r| r);
        let waits = if all_running {
            (in_flight + 1).saturating_sub(n as u32).max(1)
        } else {
            0
        };
        let is_busy = |i: usize| !all_running && running[i];
        let live_window = LIVE_REQUESTS_PER_SLOT * fleet_slots.max(n) as u64;

        let mut best: Option<(usize, usize, usize)> = None; // (slot, common, held)
        let mut best_sim = SLOT_SIMILARITY;
        let mut lru: Option<usize> = None;
        for (i, s) in slots.iter().enumerate() {
            if is_busy(i) {
                continue;
            }
            let held = s.prompt.load();
            let (common, len) = held
                .as_deref()
                .map_or((0, 0), |p| (common_prefix(hashes, p), p.len()));
            if len > 0 && !hashes.is_empty() {
                let sim = common as f64 / hashes.len() as f64;
                if sim > best_sim {
                    best_sim = sim;
                    best = Some((i, common, len));
                }
            }
            if lru.is_none_or(|j| stamps[i] < stamps[j]) {
                lru = Some(i);
            }
        }
        let pick = best.or_else(|| {
            lru.map(|i| {
                let held = slots[i].prompt.load();
                let (common, len) = held
                    .as_deref()
                    .map_or((0, 0), |p| (common_prefix(hashes, p), p.len()));
                (i, common, len)
            })
        });
        let Some((slot, common, held)) = pick else {
            return SlotPrediction::default();
        };
        let age = now.saturating_sub(stamps[slot]);
        let live = stamps[slot] > 0 && !slots[slot].left.load(Relaxed) && age <= live_window;
        let evicted = if live { held - common } else { 0 };
        SlotPrediction {
            cached_blocks: common as u32,
            evicted_blocks: evicted as u32,
            evicts_live: evicted > 0,
            live_weight: if evicted > 0 {
                1.0 - age.saturating_sub(1) as f32 / (live_window + 1) as f32
            } else {
                0.0
            },
            slot,
            waits,
        }
    }

    /// Records that the prompt `hashes` was sent at request number `now`:
    /// it takes the slot [`SlotCache::predict`] named, running until
    /// [`SlotCache::finished`]. Returns the slot, if modelled.
    pub fn dispatched(&self, slot: usize, hashes: &[u64], now: u64) -> Option<usize> {
        if slot >= self.count() {
            return None;
        }
        let s = &self.slots[slot];
        s.prompt.store(Some(Arc::new(hashes.to_vec())));
        s.last.store(now.max(1), Relaxed);
        s.left.store(false, Relaxed);
        s.running.fetch_add(1, Relaxed);
        Some(slot)
    }

    /// The request [`SlotCache::dispatched`] into `slot` finished (answered
    /// or failed).
    pub fn finished(&self, slot: usize) {
        if let Some(s) = self.slots.get(slot) {
            let _ = s
                .running
                .fetch_update(Relaxed, Relaxed, |r| Some(r.saturating_sub(1)));
        }
    }

    /// The prompt `hashes` was sent to another engine: a slot here whose
    /// prompt it extends held the same conversation, which has left it (the
    /// slot still holds the prompt, but taking it evicts nobody live).
    pub fn moved_away(&self, hashes: &[u64]) {
        for s in &self.slots[..self.count()] {
            let held = s.prompt.load();
            if let Some(p) = held.as_deref()
                && !p.is_empty()
                && common_prefix(hashes, p) == p.len()
            {
                s.left.store(true, Relaxed);
            }
        }
    }
}

/// `total_slots` from llama-server's `GET /props` answer (JSON), if any.
pub fn parse_total_slots(props: &[u8]) -> Option<usize> {
    let v: serde_json::Value = serde_json::from_slice(props).ok()?;
    v.get("total_slots")?
        .as_u64()
        .and_then(|n| usize::try_from(n).ok())
        .filter(|&n| n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A conversation's prompt: the system prompt's blocks `sys`, then
    /// `turns` blocks of its own history (chained like real hashes: a
    /// different system prompt or conversation changes every later one).
    fn prompt(sys: u64, conv: u64, turns: usize) -> Vec<u64> {
        let mut v: Vec<u64> = (0..20).map(|i| sys * 1000 + i).collect();
        v.extend((0..turns as u64).map(|t| conv * 1_000_000 + t));
        v
    }

    /// A request sent to `slot` and answered.
    fn served(c: &SlotCache, slot: usize, hashes: &[u64], now: u64) {
        c.dispatched(slot, hashes, now);
        c.finished(slot);
    }

    fn cache(n: usize) -> SlotCache {
        let c = SlotCache::default();
        c.set_count(n);
        c
    }

    #[test]
    fn a_conversation_finds_its_own_slot() {
        let c = cache(2);
        served(&c, 0, &prompt(1, 1, 4), 1);
        served(&c, 1, &prompt(1, 2, 4), 2);
        let p = c.predict(&prompt(1, 1, 8), 3, 0, 2);
        assert_eq!(p.slot, 0);
        assert_eq!(p.cached_blocks, 24, "its whole previous turn");
        assert_eq!(p.evicted_blocks, 0, "it only extends its own prompt");
    }

    #[test]
    fn a_new_conversation_on_the_same_system_prompt_evicts_a_live_one() {
        let c = cache(2);
        served(&c, 0, &prompt(1, 1, 10), 1);
        served(&c, 1, &prompt(2, 2, 10), 2);
        // Same system prompt as conversation 1: llama-server reuses its slot.
        let p = c.predict(&prompt(1, 3, 2), 3, 0, 2);
        assert_eq!((p.slot, p.cached_blocks, p.evicted_blocks), (0, 20, 10));
        // Long after: conversation 1 is over, its slot is free to take.
        let p = c.predict(&prompt(1, 3, 2), 100, 0, 2);
        assert_eq!((p.cached_blocks, p.evicted_blocks), (20, 0));
    }

    #[test]
    fn a_slot_whose_conversation_moved_away_is_free() {
        let c = cache(2);
        served(&c, 0, &prompt(1, 1, 10), 1);
        served(&c, 1, &prompt(2, 2, 10), 2);
        // Conversation 1 went on on another engine.
        c.moved_away(&prompt(1, 1, 12));
        let p = c.predict(&prompt(1, 3, 2), 3, 0, 2);
        assert_eq!((p.slot, p.cached_blocks), (0, 20));
        assert!(!p.evicts_live, "{p:?}");
        // Taking the slot makes it live again.
        served(&c, 0, &prompt(1, 3, 2), 3);
        assert!(c.predict(&prompt(1, 4, 2), 4, 0, 2).evicts_live);
    }

    #[test]
    fn busy_slots_are_skipped_and_empty_ones_taken_first() {
        let c = cache(3);
        c.dispatched(0, &prompt(1, 1, 10), 5);
        c.finished(0);
        c.dispatched(1, &prompt(2, 2, 10), 6);
        // Slot 1 is running; slot 0 shares nothing; slot 2 is empty and the
        // least recently used.
        let p = c.predict(&prompt(3, 3, 2), 7, 1, 3);
        assert_eq!((p.slot, p.cached_blocks, p.evicted_blocks), (2, 0, 0));
        // Every slot running: the request waits and takes one as it frees up.
        c.dispatched(0, &prompt(1, 1, 10), 7);
        c.dispatched(2, &prompt(4, 4, 10), 8);
        let p = c.predict(&prompt(1, 3, 2), 9, 3, 3);
        assert_eq!((p.slot, p.cached_blocks, p.evicted_blocks), (0, 20, 10));
        assert_eq!(p.waits, 1);
        c.finished(2);
        assert_eq!(c.predict(&prompt(1, 3, 2), 9, 2, 3).waits, 0);
    }

    #[test]
    fn not_a_slot_engine_until_told() {
        let c = SlotCache::default();
        assert!(!c.is_slot_engine());
        assert_eq!(c.predict(&[1, 2], 1, 0, 0), SlotPrediction::default());
        c.dispatched(0, &[1, 2], 1);
        c.set_count(2);
        assert_eq!(c.predict(&[1, 2], 2, 0, 2).cached_blocks, 0);
    }

    #[test]
    fn common_prefix_of_chained_hashes() {
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4, 5]), 2);
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 3, 4]), 3);
        assert_eq!(common_prefix(&[], &[1]), 0);
        assert_eq!(common_prefix(&[9], &[1]), 0);
    }

    #[test]
    fn reads_total_slots_from_props() {
        assert_eq!(
            parse_total_slots(br#"{"total_slots":2,"model_path":"m.gguf"}"#),
            Some(2)
        );
        assert_eq!(parse_total_slots(br#"{"total_slots":0}"#), None);
        assert_eq!(parse_total_slots(b"not json"), None);
        assert_eq!(parse_total_slots(br#"{"model":"x"}"#), None);
    }
}
