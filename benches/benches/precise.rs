//! Precise mode's costs: decoding an event batch (both encodings), and what
//! precise routing adds to a request beside the approximate path (tokens
//! as the engine makes them, block keys, precise-index walk), for a warm
//! prompt held whole by one backend.
//!
//! `cargo bench -p router-benches --bench precise`

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use prefix_router::precise::events::{Groups, decode_batch};
use prefix_router::precise::index::{PreciseIndex, StoredChain};
use prefix_router::precise::keys::{chain_seed, engine_tokens, request_keys};
use prefix_router::route::MAX_BACKENDS;
use prefix_router::route::extract::{Endpoint, Extractor};
use prefix_router::route::hash::{DEFAULT_BLOCK_BYTES, block_hashes, namespace_seed};
use prefix_router::route::index::{Matches, PrefixIndex};
use router_benches::body::chat_body;
use std::hint::black_box;
use testkit::engine::kv_events::{CacheEvent, Encoding, encode_batch};

/// A chat turn, a long chat, a long document.
const SIZES: [(usize, &str); 3] = [(4 << 10, "4KB"), (64 << 10, "64KB"), (400 << 10, "400KB")];

fn decode(c: &mut Criterion) {
    let mut g = c.benchmark_group("precise_decode");
    // One request's prompt: 64 blocks stored in one chain, then 64 evicted.
    let mut events: Vec<CacheEvent> = (0..64u64)
        .map(|i| CacheEvent::Stored {
            hash: u64::MAX - i,
            parent: i.checked_sub(1).map(|p| u64::MAX - p),
            tokens: (0..16)
                .map(|t| (i as u32 * 16 + t) * 37 % 150_000)
                .collect(),
            extra: None,
        })
        .collect();
    events.extend((0..64u64).map(|i| CacheEvent::Removed(i + 1)));
    for (enc, name) in [(Encoding::Array, "array"), (Encoding::Map, "map")] {
        let payload = encode_batch(1.0, &events, enc, false, None);
        g.throughput(Throughput::Elements(128));
        g.bench_function(BenchmarkId::new("64_stored_64_removed", name), |b| {
            let mut groups = Groups::default();
            b.iter(|| decode_batch(black_box(&payload), &mut groups).expect("batch"))
        });
    }
    g.finish();
}

fn route(c: &mut Criterion) {
    let mut g = c.benchmark_group("precise_route");
    for (size, name) in SIZES {
        let body = chat_body(size, 1);
        let mut canon = Vec::new();
        Extractor::default()
            .extract(Endpoint::Chat, &body, &mut canon)
            .expect("valid body");
        // The approximate path: hashes and a walk of the prefix index.
        let seed = namespace_seed(&[b"m"]);
        let mut hashes = Vec::new();
        block_hashes(seed, &canon, DEFAULT_BLOCK_BYTES, &mut hashes);
        let approx = PrefixIndex::new(hashes.len() * 2);
        approx.set_capacity(0, hashes.len() * 2);
        approx.insert(0, &hashes);
        // The precise path: engine tokens, keys, and the precise index
        // holding them on backend 0 (from events).
        let (mut text, mut tokens, mut keys) = (Vec::new(), Vec::new(), Vec::new());
        engine_tokens(Endpoint::Chat, &canon, false, &mut text, &mut tokens);
        let n = tokens.len() / 16;
        let precise = PreciseIndex::new(n * 2);
        let engine_hashes: Vec<u64> = (1..=n as u64).collect();
        precise
            .stored(
                0,
                &StoredChain {
                    seed: chain_seed(None),
                    parent: None,
                    hashes: &engine_hashes,
                    tokens: &tokens[..n * 16],
                    block: 16,
                    extra: &[],
                },
            )
            .expect("stored");
        g.throughput(Throughput::Bytes(canon.len() as u64));
        g.bench_function(BenchmarkId::new("approximate", name), |b| {
            b.iter(|| {
                hashes.clear();
                block_hashes(seed, black_box(&canon), DEFAULT_BLOCK_BYTES, &mut hashes);
                let mut m: Matches = [0; MAX_BACKENDS];
                approx.longest_matches(&hashes, 0b1111, &mut m);
                black_box(m[0])
            })
        });
        g.bench_function(BenchmarkId::new("precise_added", name), |b| {
            b.iter(|| {
                engine_tokens(
                    Endpoint::Chat,
                    black_box(&canon),
                    false,
                    &mut text,
                    &mut tokens,
                );
                keys.clear();
                request_keys(chain_seed(None), &tokens, 16, &[], &mut keys);
                let mut m: Matches = [0; MAX_BACKENDS];
                precise.longest_matches(&keys, 0b1111, 0, 2000, &mut m);
                assert_eq!(m[0] as usize, keys.len());
                black_box(m[0])
            })
        });
    }
    g.finish();
}

criterion_group!(benches, decode, route);
criterion_main!(benches);
