//! Precise mode's costs: decoding an event batch (both encodings), and what
//! precise routing adds to a request beside the approximate path (tokens
//! as the engine makes them, block keys, precise-index walk), for a warm
//! prompt held whole by one backend; and the model tokenizer's costs
//! (`precise_tokenizer`): tokens per second, a chat turn with its history
//! cached and cold, a 400 KB document, next to the approximate path.
//!
//! `cargo bench -p router-benches --bench precise`

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use prefix_router::fleet::index::{Matches, PrefixIndex};
use prefix_router::fleet::owners::BackendSet;
use prefix_router::precise::events::{Groups, decode_batch};
use prefix_router::precise::index::{PreciseIndex, StoredChain};
use prefix_router::precise::keys::{
    PromptText, TokenScratch, chain_seed, engine_tokens, request_keys,
};
use prefix_router::precise::tokenizer::{
    Choice, DEFAULT_CACHE_TOKENS, DEFAULT_DEFER_BYTES, ModelTokenizer, TokenPool,
};
use prefix_router::prompt::extract::{Endpoint, Extractor};
use prefix_router::prompt::hash::{DEFAULT_BLOCK_BYTES, block_hashes, namespace_seed};
use router_benches::body::chat_body;
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};
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
        let (mut text, mut tokens, mut keys) = (TokenScratch::default(), Vec::new(), Vec::new());
        let toy_pool = TokenPool::new(DEFAULT_CACHE_TOKENS, 0);
        let prompt = PromptText {
            endpoint: Endpoint::Chat,
            canonical: &canon,
            token_ids: false,
            cut: false,
        };
        engine_tokens(&Choice::Toy, &toy_pool, &prompt, &mut text, &mut tokens);
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
                let mut m = Matches::new();
                approx.longest_matches(&hashes, &BackendSet::first(4), &mut m);
                black_box(m[0])
            })
        });
        g.bench_function(BenchmarkId::new("precise_added", name), |b| {
            b.iter(|| {
                let prompt = PromptText {
                    endpoint: Endpoint::Chat,
                    canonical: black_box(&canon),
                    token_ids: false,
                    cut: false,
                };
                engine_tokens(&Choice::Toy, &toy_pool, &prompt, &mut text, &mut tokens);
                keys.clear();
                request_keys(chain_seed(None), &tokens, 16, &[], &mut keys);
                let mut m = Matches::new();
                precise.longest_matches(&keys, &BackendSet::first(4), 0, 2000, &mut m);
                assert_eq!(m[0] as usize, keys.len());
                black_box(m[0])
            })
        });
    }
    g.finish();
}

/// The canonical form of a chat (`prompt::extract`'s `RS role US text`).
fn canonical(msgs: &[(&str, String)]) -> Vec<u8> {
    let mut c = Vec::new();
    for (role, text) in msgs {
        c.push(0x1e);
        c.extend_from_slice(role.as_bytes());
        c.push(0x1f);
        c.extend_from_slice(text.as_bytes());
    }
    c
}

/// The approximate path on `canon`: block hashes and an index walk.
fn approximate_cost(canon: &[u8]) -> impl FnMut() -> u32 {
    let seed = namespace_seed(&[b"m"]);
    let mut hashes = Vec::new();
    block_hashes(seed, canon, DEFAULT_BLOCK_BYTES, &mut hashes);
    let approx = PrefixIndex::new(hashes.len() * 2 + 16);
    approx.set_capacity(0, hashes.len() * 2 + 16);
    approx.insert(0, &hashes);
    let canon = canon.to_vec();
    move || {
        hashes.clear();
        block_hashes(seed, black_box(&canon), DEFAULT_BLOCK_BYTES, &mut hashes);
        let mut m = Matches::new();
        approx.longest_matches(&hashes, &BackendSet::first(4), &mut m);
        m[0]
    }
}

/// What precise mode adds with the model tokenizer: engine tokens, keys,
/// a walk of a precise index (holding nothing: the walk stops at once, as
/// for a new message; the walk's cost is in `precise_route`).
fn precise_added(
    choice: &Choice,
    pool: &TokenPool,
    ep: Endpoint,
    canon: &[u8],
    scratch: &mut TokenScratch,
    index: &PreciseIndex,
) -> usize {
    let (mut tokens, mut keys) = (Vec::new(), Vec::new());
    let prompt = PromptText {
        endpoint: ep,
        canonical: black_box(canon),
        token_ids: false,
        cut: false,
    };
    assert!(engine_tokens(choice, pool, &prompt, scratch, &mut tokens));
    request_keys(chain_seed(None), &tokens, 16, &[], &mut keys);
    let mut m = Matches::new();
    index.longest_matches(&keys, &BackendSet::first(4), 0, 2000, &mut m);
    black_box(m[0]);
    tokens.len()
}

fn tokenizer(c: &mut Criterion) {
    let dir = std::env::temp_dir().join(format!("prefix-router-bench-tok-{}", std::process::id()));
    testkit::tokenizer_fixture::write(&dir).expect("fixture tokenizer");
    let model = Arc::new(ModelTokenizer::load(&dir).expect("load"));
    let choice = Choice::Model(model.clone());
    let words = testkit::tokenizer_fixture::words;
    let index = PreciseIndex::new(1 << 16);
    let mut g = c.benchmark_group("precise_tokenizer");

    // Tokens per second, one text encoded whole (no cache).
    let doc = words(7, 400 * 1024 / 6);
    let doc = &doc[..doc.len().min(400 * 1024)];
    let n = model.encode(doc, false).expect("encode").len();
    eprintln!(
        "400 KB document: {n} tokens ({:.2} bytes/token)",
        doc.len() as f64 / n as f64
    );
    g.sample_size(10);
    g.throughput(Throughput::Elements(n as u64));
    g.bench_function("encode_400KB_tokens", |b| {
        b.iter(|| model.encode(black_box(doc), false).expect("encode").len())
    });

    // A chat turn: a system prompt, 8 earlier turns (user 800 B, assistant
    // 600 B), and a new 800-byte user message (about 16 KB in all).
    let mut history: Vec<(&str, String)> = vec![("system", words(1, 250))];
    for t in 0..8 {
        history.push(("user", words(100 + t, 130)));
        history.push(("assistant", words(200 + t, 100)));
    }
    let turn = |k: u64| {
        let mut h = history.clone();
        h.push(("user", words(1_000_000 + k, 130)));
        canonical(&h)
    };
    let canon0 = turn(0);
    eprintln!("chat turn: {} bytes of canonical prompt", canon0.len());
    let mut approx = approximate_cost(&canon0);
    g.sample_size(30);
    g.throughput(Throughput::Elements(1));
    g.bench_function("chat_turn_approximate", |b| b.iter(&mut approx));
    // The router's pool (new last messages tokenized by its thread), and
    // one that tokenizes every message on the wait, side by side.
    let pool = TokenPool::new(DEFAULT_CACHE_TOKENS, DEFAULT_DEFER_BYTES);
    let on_wait = TokenPool::new(DEFAULT_CACHE_TOKENS, 0);
    let mut warm = TokenScratch::default();
    for p in [&pool, &on_wait] {
        precise_added(&choice, p, Endpoint::Chat, &canon0, &mut warm, &index);
    }
    let mut k = 1;
    for (name, p) in [
        ("chat_turn_warm_precise_added", &pool),
        ("chat_turn_warm_precise_added_on_wait", &on_wait),
    ] {
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                for _ in 0..iters {
                    // Each turn's new message is new; the history is cached.
                    let canon = turn(k);
                    k += 1;
                    let t0 = Instant::now();
                    precise_added(&choice, p, Endpoint::Chat, &canon, &mut warm, &index);
                    spent += t0.elapsed();
                }
                spent
            })
        });
    }
    g.bench_function("chat_turn_cold_precise_added", |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                let cold = TokenPool::new(DEFAULT_CACHE_TOKENS, DEFAULT_DEFER_BYTES);
                let t0 = Instant::now();
                precise_added(&choice, &cold, Endpoint::Chat, &canon0, &mut warm, &index);
                spent += t0.elapsed();
            }
            spent
        })
    });
    // The same turn again: every piece cached (rendering, cutting, hashing
    // and the cache alone).
    g.bench_function("chat_turn_repeated_precise_added", |b| {
        b.iter(|| precise_added(&choice, &pool, Endpoint::Chat, &canon0, &mut warm, &index))
    });
    // A new 800-byte message alone, encoded whole.
    let msg = words(2_000_000, 130);
    g.bench_function("encode_800B_message", |b| {
        b.iter(|| model.encode(black_box(&msg), false).expect("encode").len())
    });
    // The toy tokenizer (no tokenizer configured), for comparison.
    let mut toy = TokenScratch::default();
    g.bench_function("chat_turn_toy_precise_added", |b| {
        b.iter(|| {
            precise_added(
                &Choice::Toy,
                &on_wait,
                Endpoint::Chat,
                &canon0,
                &mut toy,
                &index,
            )
        })
    });

    // A 400 KB document: as a completion prompt, cold and seen before; as
    // one chat message.
    g.sample_size(10);
    let mut approx_doc = approximate_cost(doc.as_bytes());
    g.bench_function("document_400KB_approximate", |b| b.iter(&mut approx_doc));
    g.bench_function("document_400KB_cold_precise_added", |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                let cold = TokenPool::new(DEFAULT_CACHE_TOKENS, 0);
                let t0 = Instant::now();
                precise_added(
                    &choice,
                    &cold,
                    Endpoint::Completions,
                    doc.as_bytes(),
                    &mut warm,
                    &index,
                );
                spent += t0.elapsed();
            }
            spent
        })
    });
    precise_added(
        &choice,
        &pool,
        Endpoint::Completions,
        doc.as_bytes(),
        &mut warm,
        &index,
    );
    g.bench_function("document_400KB_warm_precise_added", |b| {
        b.iter(|| {
            precise_added(
                &choice,
                &pool,
                Endpoint::Completions,
                doc.as_bytes(),
                &mut warm,
                &index,
            )
        })
    });
    g.finish();
    std::fs::remove_dir_all(&dir).ok();
}

criterion_group!(benches, decode, route, tokenizer);
criterion_main!(benches);
