use super::*;
use proptest::prelude::*;

/// Block hashes as the hasher makes them: uniformly spread, never 0.
fn chain(start: u64, n: usize) -> Vec<u64> {
    (0..n as u64)
        .map(|i| crate::route::select::mix(start.wrapping_mul(1_000_003).wrapping_add(i)) | 1)
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
    let mut m = [0; MAX_BACKENDS];
    let any = idx.longest_matches(&req, 0b111, &mut m);
    assert_eq!(&m[..3], &[4, 10, 0]);
    assert_eq!(any, 0b011);
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
    let mut m = [0; MAX_BACKENDS];
    idx.longest_matches(&new, 1, &mut m);
    assert_eq!(m[0], 60, "the newest prompt is kept whole");
    idx.longest_matches(&old, 1, &mut m);
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
    let mut m = [0; MAX_BACKENDS];
    idx.longest_matches(&hot, 1, &mut m);
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
    let mut m = [0; MAX_BACKENDS];
    idx.longest_matches(&req, 0b11, &mut m);
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
            let mut m = [0; MAX_BACKENDS];
            idx.longest_matches(&req, 0b111, &mut m);
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
    let mut m = [0; MAX_BACKENDS];
    let mut found = Vec::new();
    idx.longest_matches_noting(&req, 0b11, &mut m, &mut found);
    assert_eq!(found.len(), 12);
    assert!(found.iter().all(|&f| f != NOT_FOUND));
    // Stale notes (every slot pointing at the wrong place) are re-probed.
    let stale: Vec<u32> = found.iter().map(|&f| (f + 1) % 1000).collect();
    idx.insert_noted(1, &req, &stale);
    idx.longest_matches(&req, 0b11, &mut m);
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
        let mut m = [0; MAX_BACKENDS];
        idx.longest_matches(&req, 0b1001, &mut m);
        assert_eq!(m[3], 6_400, "seed {seed}: the match was cut");
        assert_eq!(m[0], 4_000, "seed {seed}");
        idx.clear_backend(0);
        idx.clear_backend(3);
    }
}
