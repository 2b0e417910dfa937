//! The lookup of a long prompt: the backends holding its first blocks,
//! and each one's end searched from the last block back, so a 6,400-block
//! prompt costs a few probes per holder, not 6,400 (see the module's doc
//! and decision 0014, long prompts: search and anchors).

use super::{BackendSet, MAX_GAP, Matches, OWNER_WORDS, PrefixIndex, owners};

/// Probes one search made, kept so the searches of several backends over
/// one prompt (which probe the same blocks from the end first) read a
/// block's slot once.
pub(super) struct Probes<'a> {
    hashes: &'a [u64],
    seen: [(u32, [u64; OWNER_WORDS]); PROBES_KEPT],
    n: usize,
}

/// Probes a lookup keeps (24 bytes each, on the stack): a search is at
/// most about 2 log2(6,400) = 26 probes, and the first of every search
/// are the same.
const PROBES_KEPT: usize = 32;

impl<'a> Probes<'a> {
    pub(super) fn new(hashes: &'a [u64]) -> Self {
        Probes {
            hashes,
            seen: [(0, [0; OWNER_WORDS]); PROBES_KEPT],
            n: 0,
        }
    }

    fn has(&self, i: usize) -> bool {
        self.seen[..self.n].iter().any(|p| p.0 as usize == i)
    }

    /// Whether block `i`'s slot names `backend`.
    pub(super) fn holds(&mut self, index: &PrefixIndex, i: usize, backend: usize) -> bool {
        let words = match self.seen[..self.n].iter().find(|p| p.0 as usize == i) {
            Some(p) => p.1,
            None => {
                let w = index
                    .find_index(self.hashes[i])
                    .map_or([0; OWNER_WORDS], |j| index.slots[j].load());
                if self.n < PROBES_KEPT {
                    self.seen[self.n] = (i as u32, w);
                    self.n += 1;
                }
                w
            }
        };
        words
            .iter()
            .any(|&w| owners::position(w, backend).is_some())
    }
}

impl PrefixIndex {
    /// The lookup of a long prompt: the first `MAX_GAP + 1` blocks walked
    /// (they name the backends to follow), then for each of them a search
    /// from the end ([`Self::match_end`]): a prompt a backend holds whole
    /// costs one probe more, one it holds but for a last turn of `k` blocks
    /// about `2 log2 k`. Without displaced blocks the matches are the
    /// walk's exactly (`index::tests::search_matches_the_walk`).
    pub(super) fn search_matches(
        &self,
        hashes: &[u64],
        candidates: &BackendSet,
        out: &mut Matches,
        found: &mut Vec<u32>,
    ) -> usize {
        found.clear();
        out.clear();
        let (runs, n_runs) = self.walk_runs(hashes, MAX_GAP + 1, candidates, found);
        if n_runs == 0 {
            return 0;
        }
        let mut probes = Probes::new(hashes);
        for &(b, end) in &runs[..n_runs] {
            // Every run reaches block MAX_GAP + 1 (it started at most
            // MAX_GAP blocks before): it goes on while bridged.
            let end = self.match_end(&mut probes, usize::from(b), end as usize - 1);
            out.set(usize::from(b), end as u32);
        }
        n_runs
    }

    /// One past the last block of `backend`'s match, given that it holds
    /// block `lo`: a search from the last block back, doubling its step,
    /// then halving the bracket found.
    ///
    /// The rule searched is the walk's for a backend whose blocks are a
    /// prefix of the prompt (the index without displacement): "holds block
    /// `i`" is read as "holds one of blocks `i..=i + MAX_GAP`", so the end
    /// found is one past a block the backend holds, followed by more than
    /// `MAX_GAP` it lacks (or the prompt's end). With longer holes (blocks
    /// displaced, or lanes taken by other backends, in a run) it can end
    /// after a hole the walk stops at: never before the walk's end (there
    /// is no such run before that), never past a block the backend does
    /// not hold. That is the right answer, not only the cheap one: the
    /// hashes are chained, so holding block `k` means it was sent blocks
    /// `0..k`, and the hole is the index forgetting, not the engine.
    pub(super) fn match_end(&self, probes: &mut Probes, backend: usize, lo: usize) -> usize {
        let n = probes.hashes.len();
        // `held(i)`: the backend holds one of blocks i..=i + MAX_GAP.
        // The blocks after `i` and the next probes are prefetched with it:
        // each probe's outcome decides the next, so without the hints the
        // misses come one after the other.
        let mut held = |i: usize, next: &[usize]| {
            let bridge = i + 1..n.min(i + MAX_GAP + 1);
            for j in bridge.clone().chain(next.iter().copied()) {
                if j < n && !probes.has(j) {
                    self.prefetch_window(probes.hashes[j]);
                }
            }
            probes.holds(self, i, backend)
                || bridge.into_iter().any(|j| probes.holds(self, j, backend))
        };
        if lo + 1 >= n || held(n - 1, &[n.saturating_sub(2)]) {
            return n;
        }
        // Invariant: held(good), !held(bad).
        let (mut good, mut bad) = (lo, n - 1);
        let mut step = 1;
        while bad - good > 1 {
            let i = bad.saturating_sub(step).max(good + 1);
            if held(i, &[i.saturating_sub(2 * step)]) {
                good = i;
                break;
            }
            bad = i;
            step *= 2;
        }
        while bad - good > 1 {
            let mid = good + (bad - good) / 2;
            // Prefetch both halves' next middles.
            let next = [good + (mid - good) / 2, mid + (bad - mid) / 2];
            if held(mid, &next) {
                good = mid;
            } else {
                bad = mid;
            }
        }
        good + 1
    }
}
