//! Micro-benchmarks of the request path's hot structures: prompt extraction
//! and block hashing (bytes per second), prefix-index lookup and insert (time
//! per block), selection (time per decision at 4 to 1,024 backends), the
//! model filter before it, and the whole routing step at 8 to 1,024
//! backends (`fleet_size`).
//!
//! `cargo bench -p router-benches --bench hot_path`; `cargo xtask bench` runs
//! it and folds the figures into its results.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use prefix_router::fleet::MAX_BACKENDS;
use prefix_router::fleet::index::{Matches, PrefixIndex};
use prefix_router::fleet::owners::BackendSet;
use prefix_router::policy::select::{BackendLoad, Policy, RouteInput, select};
use prefix_router::prompt::extract::{Endpoint, Extractor};
use prefix_router::prompt::hash::{
    DEFAULT_BLOCK_BYTES, block_hashes, block_hashes_pieces, namespace_seed,
};
use prefix_router::prompt::scan::{Canonical, scan};
use router_benches::body::chat_body;
use std::hint::black_box;

/// Request bodies of these sizes: a short chat, a long chat, a long document.
const SIZES: [(usize, &str); 3] = [(4 << 10, "4KB"), (64 << 10, "64KB"), (400 << 10, "400KB")];

fn extraction(c: &mut Criterion) {
    let mut g = c.benchmark_group("extract");
    for (size, name) in SIZES {
        let body = chat_body(size, 1);
        let mut ex = Extractor::default();
        let mut canon = Vec::new();
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_function(BenchmarkId::new("chat", name), |b| {
            b.iter(|| {
                ex.extract(Endpoint::Chat, black_box(&body), &mut canon)
                    .expect("valid body");
                black_box(canon.len())
            })
        });
    }
    g.finish();
}

/// What the router does per request: the one-pass scan and the block
/// hashes of its pieces, against the reference extractor plus hashing.
fn scan_and_hash(c: &mut Criterion) {
    let mut g = c.benchmark_group("extract_hash");
    for (size, name) in SIZES {
        let body = chat_body(size, 1);
        let mut canon = Canonical::default();
        let (mut carry, mut out) = (Vec::new(), Vec::new());
        g.throughput(Throughput::Bytes(body.len() as u64));
        // `messages`: the same conversation read as an Anthropic Messages
        // body (serde on the body, `prompt::apis`), for that reader's cost.
        for (id, endpoint) in [("scan", Endpoint::Chat), ("messages", Endpoint::Messages)] {
            g.bench_function(BenchmarkId::new(id, name), |b| {
                b.iter(|| {
                    let p = scan(endpoint, black_box(&body), &mut canon).expect("valid body");
                    out.clear();
                    block_hashes_pieces(
                        p.seed,
                        canon.pieces(&body),
                        DEFAULT_BLOCK_BYTES,
                        &mut carry,
                        &mut out,
                    );
                    black_box(out.len())
                })
            });
        }
        let mut ex = Extractor::default();
        let mut text = Vec::new();
        g.bench_function(BenchmarkId::new("reference", name), |b| {
            b.iter(|| {
                let p = ex
                    .extract(Endpoint::Chat, black_box(&body), &mut text)
                    .expect("valid body");
                out.clear();
                block_hashes(p.seed, &text, DEFAULT_BLOCK_BYTES, &mut out);
                black_box(out.len())
            })
        });
    }
    g.finish();
}

fn hashing(c: &mut Criterion) {
    let mut g = c.benchmark_group("hash");
    for (size, name) in SIZES {
        let text: Vec<u8> = (0..size).map(|i| b'a' + (i % 23) as u8).collect();
        let seed = namespace_seed(&[b"sim-llama-8b"]);
        let mut out = Vec::with_capacity(size / DEFAULT_BLOCK_BYTES);
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_function(BenchmarkId::new("blocks", name), |b| {
            b.iter(|| {
                out.clear();
                block_hashes(seed, black_box(&text), DEFAULT_BLOCK_BYTES, &mut out);
                black_box(out.len())
            })
        });
    }
    g.finish();
}

/// Chained-looking block hashes: `n` distinct nonzero values per prompt `p`.
fn prompt_hashes(p: u64, n: usize) -> Vec<u64> {
    (0..n as u64)
        .map(|i| prefix_router::policy::select::mix(p.wrapping_mul(1 << 20) ^ i).max(1))
        .collect()
}

fn index(c: &mut Criterion) {
    let mut g = c.benchmark_group("index");
    // 8 backends of 65536 blocks each, three quarters full: a busy fleet.
    const BACKENDS: usize = 8;
    const CAP: usize = 65_536;
    const BLOCKS: usize = 256; // a 16 KB prompt at 64 B per block
    let idx = PrefixIndex::new(BACKENDS * CAP);
    for b in 0..BACKENDS {
        idx.set_capacity(b, CAP);
    }
    for p in 0..(BACKENDS * CAP * 3 / 4 / BLOCKS) as u64 {
        idx.insert((p as usize) % BACKENDS, &prompt_hashes(p, BLOCKS));
    }
    let hit = prompt_hashes(7, BLOCKS);
    let mut m = Matches::new();
    let all = BackendSet::first(BACKENDS);
    g.throughput(Throughput::Elements(BLOCKS as u64));
    g.bench_function("lookup_hit", |b| {
        b.iter(|| black_box(idx.longest_matches(black_box(&hit), &all, &mut m)))
    });
    // Prompts the index holds but the CPU's caches do not (the router's
    // case: a request's body passes through the caches between two
    // lookups of the index): each lookup takes the next of the 1,536 held
    // prompts, 393K blocks in a 22 MB table.
    let held: Vec<(usize, Vec<u64>)> = (0..(BACKENDS * CAP * 3 / 4 / BLOCKS) as u64)
        .map(|p| ((p as usize) % BACKENDS, prompt_hashes(p, BLOCKS)))
        .collect();
    let mut next = 0usize;
    g.bench_function("lookup_hit_cold", |b| {
        b.iter(|| {
            next = (next + 1) % held.len();
            black_box(idx.longest_matches(black_box(&held[next].1), &all, &mut m))
        })
    });
    let mut found = Vec::new();
    g.bench_function("lookup_then_insert_held_cold", |b| {
        b.iter(|| {
            next = (next + 1) % held.len();
            let (backend, hashes) = &held[next];
            idx.longest_matches_noting(hashes, &all, &mut m, &mut found);
            idx.insert_noted(*backend, hashes, &found);
        })
    });
    let miss = prompt_hashes(u64::MAX / 3, BLOCKS);
    g.throughput(Throughput::Elements(1));
    g.bench_function("lookup_miss", |b| {
        b.iter(|| black_box(idx.longest_matches(black_box(&miss), &all, &mut m)))
    });
    // Insert of blocks the backend already holds (the lock-free common case).
    g.throughput(Throughput::Elements(BLOCKS as u64));
    g.bench_function("insert_held", |b| {
        b.iter(|| idx.insert(7 % BACKENDS, black_box(&hit)))
    });
    // Insert of new blocks: claims slots and, at capacity, evicts.
    let fresh: Vec<Vec<u64>> = (0..512u64)
        .map(|p| prompt_hashes(1_000_000 + p, BLOCKS))
        .collect();
    let mut k = 0usize;
    g.bench_function("insert_new", |b| {
        b.iter(|| {
            k = k.wrapping_add(1);
            idx.insert(k % BACKENDS, &fresh[k % fresh.len()]);
        })
    });
    // A 400 KB document (6,400 blocks) each backend holds two of, on the
    // same busy table: the router's lookup then learning (with ages, as
    // `Router::learn`), a different document each time so its slots are
    // not in the caches from the last request.
    const LONG: usize = 6_400;
    let long: Vec<(usize, Vec<u64>)> = (0..2 * BACKENDS as u64)
        .map(|p| ((p as usize) % BACKENDS, prompt_hashes(2_000_000 + p, LONG)))
        .collect();
    for (backend, hashes) in &long {
        idx.insert(*backend, hashes);
    }
    let mut ages = Vec::new();
    let mut j = 0usize;
    g.throughput(Throughput::Elements(LONG as u64));
    g.bench_function("lookup_then_insert_held_cold_400KB", |b| {
        b.iter(|| {
            j = (j + 1) % long.len();
            let (backend, hashes) = &long[j];
            idx.longest_matches_noting(hashes, &all, &mut m, &mut found);
            let matched = m[*backend];
            let sent = idx.insert_aging(*backend, hashes, &found, &mut ages);
            idx.distinct_ages(*backend, sent, &mut ages);
            black_box(matched)
        })
    });
    g.bench_function("lookup_hit_cold_400KB", |b| {
        b.iter(|| {
            j = (j + 1) % long.len();
            black_box(idx.longest_matches(black_box(&long[j].1), &all, &mut m))
        })
    });
    g.finish();
}

fn selection(c: &mut Criterion) {
    let mut g = c.benchmark_group("select");
    let params = prefix_router::config::PrefixConfig::default().params();
    g.throughput(Throughput::Elements(1));
    for n in [4usize, 16, 64, 256, 1024] {
        let loads: Vec<BackendLoad> = (0..n)
            .map(|i| BackendLoad {
                eligible: true,
                in_flight: (i % 7) as u32,
                queued_prefill_blocks: (i % 5) as u32 * 40,
                id_hash: prefix_router::policy::select::mix(i as u64 + 1),
                cached_blocks: (i % 4) as u32 * 500,
                capacity_blocks: 4096,
                prefill_rate: 600.0 + i as f32,
                ..Default::default()
            })
            .collect();
        let matches: Vec<u32> = (0..n).map(|i| if i % 3 == 0 { 100 } else { 0 }).collect();
        let mut ticket = 0u64;
        for policy in [Policy::Prefix, Policy::RoundRobin, Policy::LeastRequest] {
            g.bench_function(BenchmarkId::new(policy.name(), n), |b| {
                b.iter(|| {
                    ticket = ticket.wrapping_add(1);
                    let input = RouteInput {
                        matches: &matches,
                        blocks: 256,
                        cold_key: ticket,
                        session_key: None,
                        ticket,
                        answered: None,
                    };
                    black_box(select(policy, black_box(&input), &loads, &params))
                })
            });
        }
    }
    g.finish();
}

/// The model filter a request pays before selection: its `model` looked
/// up in the table, each backend ranked, the best rank kept (a fleet of
/// four models, one backend in four listing a LoRA adapter too).
fn model_filter(c: &mut Criterion) {
    use prefix_router::fleet::models::{Member, ModelTable, Served, ServedModel, Spec, keep_best};
    let mut g = c.benchmark_group("model_filter");
    g.throughput(Throughput::Elements(1));
    let urls: Vec<String> = (0..MAX_BACKENDS)
        .map(|i| format!("http://10.0.0.{i}:8000"))
        .collect();
    for n in [4usize, 16, 64, MAX_BACKENDS] {
        let members: Vec<Member> = (0..n)
            .map(|i| {
                let mut served = vec![ServedModel {
                    id: format!("model-{}", i % 4),
                    parent: None,
                }];
                if i % 4 == 0 {
                    served.push(ServedModel {
                        id: "model-0-sql".into(),
                        parent: Some("model-0".into()),
                    });
                }
                Member {
                    slot: i,
                    generation: i as u64 + 1,
                    url: &urls[i],
                    served: Served::Known(served),
                }
            })
            .collect();
        let table = ModelTable::build(
            &members,
            &Spec::default(),
            |_| Default::default(),
            Default::default(),
        );
        let mut loads = vec![BackendLoad::default(); n];
        let mut ranks = Vec::with_capacity(n);
        g.bench_function(BenchmarkId::new("resolve_rank_keep", n), |b| {
            b.iter(|| {
                let want = table
                    .resolve(black_box(b"model-0"), black_box(b"model-0-sql"))
                    .expect("served");
                ranks.clear();
                for (m, l) in members.iter().zip(loads.iter_mut()) {
                    ranks.push(want.rank(&table, m.slot, m.generation));
                    l.eligible = true;
                }
                keep_best(&mut loads, &ranks);
                black_box(&loads);
            })
        });
    }
    g.finish();
}

/// The routing step of `Router::route` for a 4 KB chat turn whose history
/// one backend holds, at 8 to 1,024 backends each holding 1,024 blocks of
/// other conversations: scan and block hashes, the index lookup over the
/// fleet's slots, each backend's load (its tracked blocks read from the
/// index), selection. The per-request cost against the fleet's size (the
/// model filter is `model_filter`). Also prints the index's bytes per
/// tracked block at each size.
fn fleet_size(c: &mut Criterion) {
    let mut g = c.benchmark_group("fleet_size");
    g.throughput(Throughput::Elements(1));
    let params = prefix_router::config::PrefixConfig::default().params();
    const HELD: usize = 1_024;
    let body = chat_body(4 << 10, 77);
    let mut canon = Canonical::default();
    let (mut carry, mut hashes, mut found) = (Vec::new(), Vec::new(), Vec::new());
    let p = scan(Endpoint::Chat, &body, &mut canon).expect("valid body");
    block_hashes_pieces(
        p.seed,
        canon.pieces(&body),
        DEFAULT_BLOCK_BYTES,
        &mut carry,
        &mut hashes,
    );
    for n in [8usize, 64, 256, MAX_BACKENDS] {
        let idx = PrefixIndex::new(n * HELD);
        for b in 0..n {
            idx.set_capacity(b, HELD);
            for p in 0..(HELD / 64) as u64 {
                idx.insert(b, &prompt_hashes((b as u64) << 16 | p, 64));
            }
        }
        let holder = n / 2;
        idx.insert(holder, &hashes);
        println!(
            "fleet_size/{n}: index {:.1} bytes per tracked block ({} blocks)",
            idx.memory_bytes() as f64 / idx.total_tracked() as f64,
            idx.total_tracked()
        );
        // As `Router::route`: every slot a candidate, the fleet's read.
        let slots = BackendSet::ALL;
        let mut m = Matches::new();
        let (mut loads, mut matches) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let mut ticket = 0u64;
        g.bench_function(BenchmarkId::new("route_chat_warm", n), |b| {
            b.iter(|| {
                ticket += 1;
                let p = scan(Endpoint::Chat, black_box(&body), &mut canon).expect("valid body");
                hashes.clear();
                block_hashes_pieces(
                    p.seed,
                    canon.pieces(&body),
                    DEFAULT_BLOCK_BYTES,
                    &mut carry,
                    &mut hashes,
                );
                idx.longest_matches_noting(&hashes, &slots, &mut m, &mut found);
                loads.clear();
                matches.clear();
                for b in 0..n {
                    loads.push(BackendLoad {
                        eligible: true,
                        in_flight: (b % 3) as u32,
                        id_hash: prefix_router::policy::select::mix(b as u64 + 1),
                        cached_blocks: idx.tracked(b) as u32,
                        capacity_blocks: HELD as u32,
                        ..Default::default()
                    });
                    matches.push(m[b]);
                }
                let input = RouteInput {
                    matches: &matches,
                    blocks: hashes.len() as u32,
                    cold_key: hashes[0],
                    session_key: None,
                    ticket,
                    answered: None,
                };
                let choice = select(Policy::Prefix, &input, &loads, &params);
                assert_eq!(choice.first(), Some(holder));
                black_box(choice)
            })
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    extraction,
    scan_and_hash,
    hashing,
    index,
    selection,
    model_filter,
    fleet_size
);
criterion_main!(benches);
