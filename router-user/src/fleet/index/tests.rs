use super::*;
use crate::fleet::owners::{self, BackendSet};
use proptest::prelude::*;
use std::collections::HashMap;

/// Block hashes as the hasher makes them: uniformly spread, never 0.
fn chain(start: u64, n: usize) -> Vec<u64> {
    (0..n as u64)
        .map(|i| crate::policy::select::mix(start.wrapping_mul(1_000_003).wrapping_add(i)) | 1)
        .collect()
}

#[test]
fn longest_match_per_backend() {
    let idx = PrefixIndex::new(10_000);
    for b in 0..3 {
        idx.set_capacity(b, 1000);
    }
    let req = chain(1, 10);
    idx.insert(0, &req[..4]);
    idx.insert(1, &req[..10]);
    let mut m = Matches::new();
    let any = idx.longest_matches(&req, &BackendSet::first(3), &mut m);
    assert_eq!(&m[..3], &[4, 10, 0]);
    assert_eq!(any, 2, "two backends hold some of it");
}

#[test]
fn capacity_is_held_and_the_oldest_prompt_goes_first() {
    let idx = PrefixIndex::new(10_000);
    idx.set_capacity(0, 100);
    let old = chain(1, 60);
    let new = chain(2, 60);
    idx.insert(0, &old);
    idx.insert(0, &new);
    assert_eq!(idx.len(0), 100);
    let mut m = Matches::new();
    idx.longest_matches(&new, &BackendSet::first(1), &mut m);
    assert_eq!(m[0], 60, "the newest prompt is kept whole");
    idx.longest_matches(&old, &BackendSet::first(1), &mut m);
    assert_eq!(
        m[0], 40,
        "the oldest prompt lost its last 20 blocks, not its head"
    );
}

#[test]
fn touched_blocks_survive_eviction() {
    let idx = PrefixIndex::new(10_000);
    idx.set_capacity(0, 100);
    let hot = chain(1, 40);
    idx.insert(0, &hot);
    idx.insert(0, &chain(2, 40));
    idx.insert(0, &hot); // touch
    idx.insert(0, &chain(3, 40)); // over capacity by 20
    let mut m = Matches::new();
    idx.longest_matches(&hot, &BackendSet::first(1), &mut m);
    assert_eq!(m[0], 40);
}

#[test]
fn clearing_a_backend_forgets_only_it() {
    let idx = PrefixIndex::new(10_000);
    idx.set_capacity(0, 100);
    idx.set_capacity(1, 100);
    let req = chain(5, 20);
    idx.insert(0, &req);
    idx.insert(1, &req);
    idx.clear_backend(0);
    let mut m = Matches::new();
    idx.longest_matches(&req, &BackendSet::first(2), &mut m);
    assert_eq!(&m[..2], &[0, 20]);
    assert_eq!(idx.len(0), 0);
}

#[test]
fn memory_per_tracked_block() {
    let cap = 100_000;
    let idx = PrefixIndex::new(4 * cap);
    for b in 0..4 {
        idx.set_capacity(b, cap);
        idx.insert(b, &chain(b as u64 + 10, cap));
    }
    let per_block = idx.memory_bytes() as f64 / idx.total_tracked() as f64;
    println!("index memory: {per_block:.1} bytes per tracked block");
    assert!(per_block <= 64.0, "{per_block} bytes per tracked block");
}

proptest! {
    /// Whatever is inserted, no backend ever tracks more than its capacity,
    /// and every match reported is a prefix of the request made only of
    /// blocks that backend was sent.
    #[test]
    fn capacity_bound_always_holds(ops in proptest::collection::vec((0usize..3, 0u64..20, 1usize..40), 1..60),
                                   caps in proptest::collection::vec(0usize..200, 3)) {
        let idx = PrefixIndex::new(2048);
        for (b, &c) in caps.iter().enumerate() {
            idx.set_capacity(b, c);
        }
        // Every block each backend was ever sent.
        let mut sent = vec![std::collections::HashSet::new(); caps.len()];
        for (b, seed, n) in ops {
            let req = chain(seed, n);
            idx.insert(b, &req);
            sent[b].extend(req.iter().copied());
            prop_assert!(idx.len(b) <= caps[b]);
            let mut m = Matches::new();
            idx.longest_matches(&req, &BackendSet::first(3), &mut m);
            for (x, held) in sent.iter().enumerate() {
                let k = m[x] as usize;
                prop_assert!(k <= n, "backend {} matched {} of {} blocks", x, k, n);
                prop_assert!(
                    req[..k].iter().all(|h| held.contains(h)),
                    "backend {} matched {} blocks it was never sent", x, k
                );
            }
        }
    }
}

#[test]
fn noted_slots_are_used_only_while_they_hold_their_block() {
    let idx = PrefixIndex::new(10_000);
    idx.set_capacity(0, 1000);
    idx.set_capacity(1, 1000);
    let req = chain(9, 12);
    idx.insert(0, &req);
    let mut m = Matches::new();
    let mut found = Vec::new();
    idx.longest_matches_noting(&req, &BackendSet::first(2), &mut m, &mut found);
    assert_eq!(found.len(), 12);
    assert!(found.iter().all(|&f| f != NOT_FOUND));
    // Stale notes (every slot pointing at the wrong place) are re-probed.
    let stale: Vec<u32> = found.iter().map(|&f| (f + 1) % 1000).collect();
    idx.insert_noted(1, &req, &stale);
    idx.longest_matches(&req, &BackendSet::first(2), &mut m);
    assert_eq!(&m[..2], &[12, 12]);
}

#[test]
fn a_long_prompt_is_matched_whole_in_a_roomy_table() {
    // Four backends of 16k blocks each, two of them full of other prompts
    // (the table is about 40% full), then a 6,400-block prompt (a 400 KB
    // document): every block of it is found again. A block lost to a full
    // probe window would cut the match there.
    let cap = 16_384;
    let idx = PrefixIndex::new(4 * cap);
    for b in 0..4 {
        idx.set_capacity(b, cap);
    }
    for b in 1..3 {
        for p in 0..(cap / 512) {
            idx.insert(b, &chain(1_000 + (b * 100 + p) as u64, 512));
        }
    }
    for seed in 0..16u64 {
        let req = chain(seed, 6_400);
        idx.insert(0, &req[..4_000]);
        idx.insert(3, &req);
        let mut m = Matches::new();
        idx.longest_matches(&req, &[0, 3].into_iter().collect(), &mut m);
        assert_eq!(m[3], 6_400, "seed {seed}: the match was cut");
        assert_eq!(m[0], 4_000, "seed {seed}");
        idx.clear_backend(0);
        idx.clear_backend(3);
    }
}

#[test]
fn backends_past_64_are_tracked_and_matched() {
    let idx = PrefixIndex::new(10_000);
    for b in [3, 64, 700, MAX_BACKENDS - 1] {
        idx.set_capacity(b, 1000);
    }
    let req = chain(11, 10);
    idx.insert(64, &req[..3]);
    idx.insert(700, &req[..7]);
    idx.insert(MAX_BACKENDS - 1, &req);
    let mut m = Matches::new();
    let every = BackendSet::first(MAX_BACKENDS);
    assert_eq!(idx.longest_matches(&req, &every, &mut m), 3);
    assert_eq!((m[3], m[64], m[700], m[MAX_BACKENDS - 1]), (0, 3, 7, 10));
    let mut held: Vec<_> = m.holders().collect();
    held.sort();
    assert_eq!(held, [(64, 3), (700, 7), (MAX_BACKENDS - 1, 10)]);
    // Backends not among the candidates are not reported.
    idx.longest_matches(&req, &[700].into_iter().collect(), &mut m);
    assert_eq!((m[64], m[700], m[MAX_BACKENDS - 1]), (0, 7, 0));
    idx.clear_backend(700);
    idx.longest_matches(&req, &every, &mut m);
    assert_eq!(m[700], 0);
    assert_eq!(m[MAX_BACKENDS - 1], 10);
}

#[test]
fn a_block_sent_to_more_backends_than_lanes_keeps_the_recent_ones() {
    // 12 backends are sent the same prompt in turn, backend 0 again between
    // each of them (a busy conversation); each slot names at most `OWNERS`.
    let idx = PrefixIndex::new(10_000);
    let n = OWNERS + 4;
    let id = |b: usize| b * 80;
    for b in 0..n {
        idx.set_capacity(id(b), 100);
    }
    let req = chain(21, 20);
    for b in 0..n {
        idx.insert(id(b), &req);
        idx.insert(0, &req);
    }
    idx.insert(id(n - 1), &req);
    let mut m = Matches::new();
    let every = BackendSet::first(MAX_BACKENDS);
    assert_eq!(idx.longest_matches(&req, &every, &mut m), OWNERS);
    assert_eq!(m.holders().count(), OWNERS);
    assert_eq!(m[0], 20, "the backend sent it all along keeps it");
    assert_eq!(m[id(n - 1)], 20, "the backend sent it last holds it");
    // Each slot is one block: the replaced owners were counted out.
    assert!(idx.evictions() >= (20 * (n - OWNERS)) as u64);
    // A replaced owner's ring drops its stale entries as it fills up.
    let other = chain(22, 100);
    for b in 0..n {
        idx.insert(id(b), &other);
        assert_eq!(idx.len(id(b)), 100, "backend {}", id(b));
    }
    assert_eq!(idx.total_tracked(), 100 * n);
}

#[test]
fn a_short_run_of_lost_blocks_is_bridged_a_long_one_ends_the_match() {
    let idx = PrefixIndex::new(10_000);
    idx.set_capacity(0, 1000);
    idx.set_capacity(900, 1000);
    let req = chain(31, 20);
    idx.insert(0, &req);
    idx.insert(900, &req);
    // Backend 0 loses blocks 5 and 6 (their slots re-claimed), backend 900
    // blocks 5, 6 and 7.
    for i in [5, 6] {
        owners::remove(&idx.find(req[i]).unwrap().owners[0], 0);
        owners::remove(&idx.find(req[i]).unwrap().owners[1], 0);
    }
    for i in [5, 6, 7] {
        for w in &idx.find(req[i]).unwrap().owners {
            owners::remove(w, 900);
        }
    }
    let mut m = Matches::new();
    idx.longest_matches(&req, &[0, 900].into_iter().collect(), &mut m);
    assert_eq!(m[0], 20, "two blocks lost: bridged");
    assert_eq!(m[900], 5, "three lost: the match ends before them");
    // At the start too: lacking blocks 0 and 1 but holding 2 is a match.
    for i in [0, 1] {
        for w in &idx.find(req[i]).unwrap().owners {
            owners::remove(w, 0);
        }
    }
    idx.longest_matches(&req, &BackendSet::first(1), &mut m);
    assert_eq!(m[0], 20);
}

#[test]
fn memory_per_tracked_block_at_1024_backends() {
    // 1,024 backends of 1,000 blocks each, every one full: the table and the
    // rings cost what they cost at 4 backends, per block.
    let cap = 1_000;
    let idx = PrefixIndex::new(MAX_BACKENDS * cap);
    for b in 0..MAX_BACKENDS {
        idx.set_capacity(b, cap);
        idx.insert(b, &chain(b as u64 + 10_000, cap));
    }
    assert_eq!(idx.total_tracked(), MAX_BACKENDS * cap);
    let per_block = idx.memory_bytes() as f64 / idx.total_tracked() as f64;
    println!("index memory at {MAX_BACKENDS} backends: {per_block:.1} bytes per tracked block");
    assert!(per_block <= 64.0, "{per_block} bytes per tracked block");
}

/// The lookup's rule, the slow way: a backend's match ends after the last
/// block it holds before its first run of more than `MAX_GAP` lacking ones.
fn reference_match(held: &[bool]) -> u32 {
    let (mut end, mut lacking) = (0, 0);
    for (i, &h) in held.iter().enumerate() {
        if h {
            end = i + 1;
            lacking = 0;
        } else {
            lacking += 1;
            if lacking > MAX_GAP {
                break;
            }
        }
    }
    end as u32
}

proptest! {
    /// Whatever each backend holds of a prompt (at most `OWNERS` per block,
    /// slots anywhere in 0..1024), the lookup reports the reference rule's
    /// match for every candidate and nothing for the others.
    #[test]
    fn lookup_follows_the_gap_rule(
        ids in proptest::collection::btree_set(0usize..MAX_BACKENDS, 1..8),
        held in proptest::collection::vec(proptest::collection::vec(any::<bool>(), 8), 1..24),
        skip in 0usize..8,
    ) {
        let ids: Vec<usize> = ids.into_iter().collect();
        let idx = PrefixIndex::new(4096);
        let req = chain(41, held.len());
        for (i, row) in held.iter().enumerate() {
            let s = idx.find_or_claim(req[i]);
            for (j, &b) in ids.iter().enumerate() {
                if row[j] {
                    s.add_owner(b);
                }
            }
        }
        let candidates: BackendSet =
            ids.iter().enumerate().filter(|&(j, _)| j != skip).map(|(_, &b)| b).collect();
        let mut m = Matches::new();
        idx.longest_matches(&req, &candidates, &mut m);
        for (j, &b) in ids.iter().enumerate() {
            let want = if j == skip {
                0
            } else {
                reference_match(&held.iter().map(|r| r[j]).collect::<Vec<_>>())
            };
            prop_assert_eq!(m[b], want, "backend {} (column {})", b, j);
        }
    }
}

/// Prompts that share prefixes as conversations and documents do: each
/// is a prefix of an earlier one (at a random cut) followed by new blocks,
/// every block's hash unique to its prefix (the hashes are chained).
fn prompt_tree(shape: &[(usize, usize, usize)]) -> Vec<Vec<u64>> {
    let mut prompts: Vec<Vec<u64>> = Vec::new();
    for (k, &(parent, cut, fresh)) in shape.iter().enumerate() {
        let mut p = match prompts.len() {
            0 => Vec::new(),
            n => {
                let parent = &prompts[parent % n];
                parent[..cut % (parent.len() + 1)].to_vec()
            }
        };
        p.extend(chain(7_000 + k as u64, fresh));
        prompts.push(p);
    }
    prompts
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// On an index without displacement (a roomy table, rings within
    /// capacity, at most `OWNERS` backends a block), the search from the
    /// end returns the walk's matches exactly, whatever the prompts, their
    /// shared prefixes, which backends were sent which prefix of them, the
    /// candidates, and the prompt's length (the walk is the oracle, the
    /// one `LINEAR_MAX` keeps for short prompts).
    #[test]
    fn search_matches_the_walk(
        shape in proptest::collection::vec((0usize..8, 0usize..400, 1usize..300), 1..8),
        sends in proptest::collection::vec((0usize..6, 0usize..8, 0usize..600), 0..16),
        queries in proptest::collection::vec((0usize..8, 0usize..600, 0usize..40), 1..6),
        candidates in proptest::collection::btree_set(0usize..6, 0..6),
    ) {
        let prompts = prompt_tree(&shape);
        let ids = [0usize, 1, 63, 64, 700, MAX_BACKENDS - 1];
        let idx = PrefixIndex::new(1 << 16);
        for &b in &ids {
            idx.set_capacity(b, 1 << 14);
        }
        for &(b, p, len) in &sends {
            let p = &prompts[p % prompts.len()];
            idx.insert(ids[b], &p[..len % (p.len() + 1)]);
        }
        prop_assert_eq!(idx.evictions(), 0, "the index displaced nothing");
        let candidates: BackendSet = candidates.into_iter().map(|j| ids[j]).collect();
        let (mut want, mut got) = (Matches::new(), Matches::new());
        let (mut found_want, mut found_got) = (Vec::new(), Vec::new());
        for &(p, len, extra) in &queries {
            // A prefix of a known prompt, then blocks nobody was sent.
            let p = &prompts[p % prompts.len()];
            let mut q = p[..len % (p.len() + 1)].to_vec();
            q.extend(chain(99_000 + len as u64, extra));
            if q.is_empty() {
                continue;
            }
            let n_want = idx.walk_matches(&q, &candidates, &mut want, &mut found_want);
            let n_got = idx.search_matches(&q, &candidates, &mut got, &mut found_got);
            prop_assert_eq!(n_got, n_want);
            for &b in &ids {
                prop_assert_eq!(got[b], want[b], "backend {} on {} blocks", b, q.len());
            }
            prop_assert_eq!(&found_got[..], &found_want[..found_got.len()]);
        }
    }

    /// With holes of any length (blocks displaced, lanes lost), the search
    /// on a long prompt ends one past a block the backend holds, followed
    /// by more than `MAX_GAP` it lacks or the prompt's end, and never
    /// before the walk's end.
    #[test]
    fn search_ends_after_a_held_block_and_not_before_the_walk(
        len in 60..700usize,
        holes in proptest::collection::vec((0usize..700, 1usize..40, 0usize..3), 0..8),
        ends in proptest::collection::vec(0usize..700, 3),
    ) {
        let ids = [5usize, 64, 1000];
        let idx = PrefixIndex::new(4096);
        let req = chain(43, len);
        // Backend j holds a prefix of `ends[j]` blocks, less its holes.
        let mut held = vec![vec![false; len]; ids.len()];
        for (j, row) in held.iter_mut().enumerate() {
            for x in row.iter_mut().take(ends[j] % (len + 1)) {
                *x = true;
            }
        }
        for &(at, n, j) in &holes {
            for x in held[j].iter_mut().skip(at % len).take(n) {
                *x = false;
            }
        }
        for (i, &h) in req.iter().enumerate() {
            let s = idx.find_or_claim(h);
            for (j, &b) in ids.iter().enumerate() {
                if held[j][i] {
                    s.add_owner(b);
                }
            }
        }
        let every = BackendSet::first(MAX_BACKENDS);
        let (mut walk, mut search) = (Matches::new(), Matches::new());
        idx.walk_matches(&req, &every, &mut walk, &mut Vec::new());
        idx.search_matches(&req, &every, &mut search, &mut Vec::new());
        for (j, &b) in ids.iter().enumerate() {
            let e = search[b] as usize;
            prop_assert!(e >= walk[b] as usize, "backend {}: {} before the walk's {}", b, e, walk[b]);
            if walk[b] == 0 {
                prop_assert_eq!(e, 0);
            }
            if e > 0 {
                prop_assert!(held[j][e - 1], "backend {}: ends after block {} it lacks", b, e - 1);
                prop_assert!(held[j][e..len.min(e + MAX_GAP + 1)].iter().all(|&x| !x),
                    "backend {}: ends at {} before a block it holds within the gap", b, e);
            }
        }
    }
}

#[test]
fn a_held_long_prompt_is_learned_by_its_anchors() {
    // A 400 KB document, sent twice to one backend with 100 blocks of
    // other work between: the second send stamps the anchors only, whose
    // ages say 100, and leaves the ring as it was.
    let idx = PrefixIndex::new(100_000);
    idx.set_capacity(2, 20_000);
    let doc = chain(51, 6_400);
    let mut ages = Vec::new();
    idx.insert_aging(2, &doc, &[], &mut ages);
    assert_eq!(ages.len(), 6_400);
    assert!(ages.iter().all(|&a| a == AGE_UNKNOWN), "never sent before");
    idx.allocated(2, 100);
    let stamp = |i: usize| idx.find(doc[i]).unwrap().last_sent.load(Relaxed) & SENT_MASK;
    let before = stamp(6_399);
    let mut m = Matches::new();
    let mut found = Vec::new();
    idx.longest_matches_noting(&doc, &BackendSet::first(3), &mut m, &mut found);
    assert_eq!(m[2], 6_400);
    assert!(
        found.len() <= MAX_GAP + 1,
        "the lookup walked {} blocks",
        found.len()
    );
    idx.insert_aging(2, &doc, &found, &mut ages);
    assert_eq!(ages.len(), 6_400);
    for (i, &a) in ages.iter().enumerate() {
        if is_anchor(i) {
            assert_eq!(a, 100, "anchor {i}");
        } else {
            assert_eq!(a, AGE_UNKNOWN, "block {i}");
        }
    }
    assert_eq!(
        stamp(6_399),
        before,
        "a block between anchors was not written"
    );
    assert_eq!(
        stamp(6_368),
        before + 100 + 6_400,
        "an anchor was stamped at the clock after this send"
    );
    assert_eq!(idx.len(2), 6_400);
}

#[test]
fn a_long_hot_prompt_outlives_colder_ones_by_its_anchors() {
    // `touched_blocks_survive_eviction` on prompts with blocks past
    // `DENSE_BLOCKS`: the hot one is sent again (its anchors touched),
    // then the ring overflows: the cold prompt loses all but its first 200
    // blocks, the hot one nothing.
    let len = DENSE_BLOCKS + 400;
    let idx = PrefixIndex::new(20_000);
    idx.set_capacity(0, 2 * len + 200);
    let hot = chain(61, len);
    let cold = chain(62, len);
    idx.insert(0, &hot);
    idx.insert(0, &cold);
    idx.insert(0, &hot);
    idx.insert(0, &chain(63, len));
    assert_eq!(idx.len(0), 2 * len + 200);
    let mut m = Matches::new();
    idx.longest_matches(&hot, &BackendSet::first(1), &mut m);
    assert_eq!(m[0] as usize, len, "the hot prompt is kept whole");
    idx.longest_matches(&cold, &BackendSet::first(1), &mut m);
    assert_eq!(m[0], 200, "the cold one lost its tail");
}

#[test]
fn blocks_queued_after_their_anchor_keep_up_with_it() {
    // A conversation's turns end between anchors: each turn queues blocks
    // after the anchor the previous turn queued. Sent again and again
    // while other prompts stream through, it stays whole.
    let d = DENSE_BLOCKS;
    let idx = PrefixIndex::new(20_000);
    idx.set_capacity(0, d + 2_000);
    let conv = chain(71, d + 700);
    for turn in [d + 100, d + 210, d + 330, d + 450, d + 700] {
        idx.insert(0, &conv[..turn]);
    }
    for k in 0..30 {
        idx.insert(0, &conv);
        idx.insert(0, &chain(1_000 + k, 300));
    }
    let mut m = Matches::new();
    idx.longest_matches(&conv, &BackendSet::first(1), &mut m);
    assert_eq!(m[0] as usize, d + 700);
    assert!(idx.len(0) <= d + 2_000);
    // Every block of it is still tracked, not only what the search sees.
    let held = conv
        .iter()
        .filter(|&&h| idx.find(h).and_then(|s| s.word_of(0)).is_some())
        .count();
    assert_eq!(held, d + 700);
}

#[test]
fn a_lost_anchor_is_learned_again() {
    let d = DENSE_BLOCKS;
    let idx = PrefixIndex::new(10_000);
    idx.set_capacity(4, 2_000);
    let doc = chain(81, d + 300);
    idx.insert(4, &doc);
    for w in &idx.find(doc[d + 128]).unwrap().owners {
        owners::remove(w, 4);
    }
    let mut ages = Vec::new();
    idx.insert_aging(4, &doc, &[], &mut ages);
    assert!(idx.find(doc[d + 128]).unwrap().word_of(4).is_some());
    assert!(ages[d + 128] == AGE_UNKNOWN && ages[d + 96] == 0);
    assert!(ages[d + 97] == AGE_UNKNOWN, "not an anchor");
}

/// The block-by-block learning kept as the oracle of
/// `learning_matches_the_walk_below_the_anchors` (ring entries as now).
fn learn_block_by_block(idx: &PrefixIndex, backend: usize, hashes: &[u64], ages: &mut Vec<u64>) {
    ages.clear();
    let tag = (backend as u64) << SENT_SHIFT;
    let alloc = hashes.len() as u64;
    let end = (idx.pushed[backend].fetch_add(alloc, Relaxed) + alloc) & SENT_MASK;
    let now = end - alloc;
    let age_of = |s: &Slot| {
        let sent = s.last_sent.load(Relaxed);
        if sent != 0 && sent & !SENT_MASK == tag {
            now.saturating_sub(sent & SENT_MASK)
        } else {
            AGE_UNKNOWN
        }
    };
    let mut first_new = hashes.len();
    for (i, &h) in hashes.iter().enumerate() {
        match idx.find(h).and_then(|s| Some((s, s.word_of(backend)?))) {
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
    let mut ring = idx.rings[backend].lock().unwrap();
    ages.resize(hashes.len(), AGE_UNKNOWN);
    for (i, &h) in hashes.iter().enumerate().skip(first_new).rev() {
        let slot = idx.find_or_claim(h);
        let (new, _) = slot.add_owner(backend);
        if new {
            ring.blocks.push_back([h, h]);
            idx.tracked.fetch_add(1, Relaxed);
        } else if let Some(word) = slot.word_of(backend) {
            ages[i] = age_of(slot);
            owners::touch(word, backend);
        }
        slot.last_sent.store(tag | end, Relaxed);
    }
    idx.ring_lens[backend].store(ring.blocks.len(), Relaxed);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Below `DENSE_BLOCKS` (every block an anchor), learning a prompt as
    /// the router does (lookup, then learning what the chosen backend
    /// matched) gives the ages and the matches the block-by-block learning
    /// gave, send after send, on an index without displacement.
    #[test]
    fn learning_matches_the_walk_below_the_anchors(
        shape in proptest::collection::vec((0usize..8, 0usize..400, 1usize..200), 1..8),
        sends in proptest::collection::vec((0usize..3, 0usize..8, 0usize..600, 0u64..50), 1..40),
    ) {
        let prompts = prompt_tree(&shape);
        let (new, old) = (PrefixIndex::new(1 << 16), PrefixIndex::new(1 << 16));
        for b in 0..3 {
            new.set_capacity(b, 1 << 14);
            old.set_capacity(b, 1 << 14);
        }
        let every = BackendSet::first(3);
        let (mut m_new, mut m_old) = (Matches::new(), Matches::new());
        let (mut found, mut ages_new, mut ages_old) = (Vec::new(), Vec::new(), Vec::new());
        for &(b, p, len, extra) in &sends {
            let p = &prompts[p % prompts.len()];
            let q = &p[..(len % (p.len() + 1)).min(DENSE_BLOCKS)];
            if q.is_empty() {
                continue;
            }
            new.longest_matches_noting(q, &every, &mut m_new, &mut found);
            old.walk_matches(q, &every, &mut m_old, &mut Vec::new());
            for x in 0..3 {
                prop_assert_eq!(m_new[x], m_old[x], "backend {} on {} blocks", x, q.len());
            }
            new.insert_aging(b, q, &found, &mut ages_new);
            learn_block_by_block(&old, b, q, &mut ages_old);
            prop_assert_eq!(&ages_new, &ages_old, "backend {} on {} blocks", b, q.len());
            new.allocated(b, extra);
            old.allocated(b, extra);
        }
        prop_assert_eq!(new.evictions(), 0);
    }
}

#[test]
fn distinct_ages_are_lru_stack_distances() {
    // One backend sent a hot system prompt with every request and 40
    // conversations growing turn by turn (the hot-prompt scenario's shape):
    // an age, less what was sent twice since, is the number of distinct
    // blocks used after the block, which decides whether an LRU cache
    // still holds it. Summing the sends instead counts the system prompt
    // once per request.
    stack_distances(false);
}

#[test]
fn distinct_ages_hold_when_other_backends_share_the_hot_prompt() {
    // The same, with the system prompt also sent to a second backend after
    // every send: its stamps name that backend, so here it has no age, and
    // it must still count once, not once per request.
    stack_distances(true);
}

/// Backend 0's ages against a model LRU (see the two tests above); with
/// `shared`, backend 1 is sent the system prompt after each send.
fn stack_distances(shared: bool) {
    // Room for both backends' blocks: none displaced.
    let idx = PrefixIndex::new(1 << 20);
    idx.set_capacity(0, 1 << 15);
    idx.set_capacity(1, 1 << 15);
    let system = chain(91, 20);
    let mut convs: Vec<Vec<u64>> = vec![Vec::new(); 40];
    // The engine's LRU order: each block's last use (a running count of
    // uses), and a Fenwick tree over uses marking the last one of each
    // block, so "distinct blocks used since" is a suffix count.
    const USES: usize = 1 << 20;
    let mut last_use: HashMap<u64, usize> = HashMap::new();
    let mut tree = vec![0i64; USES + 1];
    let add = |tree: &mut Vec<i64>, at: usize, v: i64| {
        let mut i = at + 1;
        while i <= USES {
            tree[i] += v;
            i += i & i.wrapping_neg();
        }
    };
    let upto = |tree: &Vec<i64>, at: usize| {
        let (mut i, mut sum) = (at + 1, 0);
        while i > 0 {
            sum += tree[i];
            i -= i & i.wrapping_neg();
        }
        sum
    };
    let (mut rng, mut ages, mut checked, mut uses) = (7u64, Vec::new(), 0, 0usize);
    for step in 0..3_000u64 {
        rng = crate::policy::select::mix(rng);
        let c = (rng % 40) as usize;
        if convs[c].len() > 200 {
            convs[c].clear();
        }
        let grow = 4 + (rng >> 20) % 9;
        convs[c].extend(chain(1_000 + step, grow as usize));
        let prompt: Vec<u64> = system.iter().chain(&convs[c]).copied().collect();
        let sent = idx.insert_aging(0, &prompt, &[], &mut ages);
        idx.distinct_ages(0, sent, &mut ages);
        if shared {
            let mut other = system.clone();
            other.extend(chain(900_000 + step, 10));
            let sent = idx.insert_aging(1, &other, &[], &mut Vec::new());
            idx.distinct_ages(1, sent, &mut Vec::new());
        }
        let live = last_use.len() as i64;
        for (i, h) in prompt.iter().enumerate() {
            let Some(&at) = last_use.get(h) else {
                assert_eq!(ages[i], AGE_UNKNOWN, "never sent, block {i}");
                continue;
            };
            if shared && i < system.len() {
                assert_eq!(
                    ages[i], AGE_UNKNOWN,
                    "step {step}, block {i}: last sent to backend 1"
                );
                continue;
            }
            let used_since = (live - upto(&tree, at)) as u64;
            assert_ne!(
                ages[i], AGE_UNKNOWN,
                "step {step}, block {i}: {used_since} since"
            );
            // The blocks of one send share a stamp: the prompt's own
            // blocks after it (at most its length) and one fine bucket.
            let slack = prompt.len() as u64 + RETOUCH_FINE;
            assert!(
                ages[i] + slack >= used_since && ages[i] <= used_since + slack,
                "step {step}, block {i}: age {} for {used_since} distinct blocks since",
                ages[i]
            );
            checked += 1;
        }
        // The engine frees a prompt tail first: its head is the most recent.
        for &h in prompt.iter().rev() {
            if let Some(old) = last_use.insert(h, uses) {
                add(&mut tree, old, -1);
            }
            add(&mut tree, uses, 1);
            uses += 1;
        }
    }
    assert!(checked > 50_000, "{checked} ages checked");
}
