//! Prefix-cache semantics of sim-engine as a client sees them in `usage`.

use serde_json::json;
use std::net::SocketAddr;
use testkit::engine_proc::SimEngine;
use testkit::http::post_json;

/// Completion with token ids; returns (prompt_tokens, cached_tokens).
fn complete_ids(addr: SocketAddr, ids: &[u32], max_tokens: u32) -> (u64, u64) {
    let r = post_json(
        addr,
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": max_tokens}),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let u = &r.json()["usage"];
    (
        u["prompt_tokens"].as_u64().unwrap(),
        u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
    )
}

fn ids(first: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| first * 1000 + i).collect()
}

#[test]
fn repeated_prompt_hits_its_full_blocks_and_recomputes_the_last_token() {
    let e = SimEngine::spawn(&["--time-scale", "0"]);
    assert_eq!(complete_ids(e.addr, &ids(1, 100), 1), (100, 0));
    assert_eq!(
        complete_ids(e.addr, &ids(1, 100), 1),
        (100, 96),
        "6 full blocks of 16"
    );
    // Block-aligned prompt: all 4 blocks are cached but the last one is recomputed.
    complete_ids(e.addr, &ids(2, 64), 1);
    assert_eq!(complete_ids(e.addr, &ids(2, 64), 1), (64, 48));
    // A shared prefix hits up to the first differing block.
    let mut diverged = ids(1, 100);
    diverged[40] = 7;
    assert_eq!(complete_ids(e.addr, &diverged, 1).1, 32);
}

#[test]
fn next_chat_turn_hits_on_the_previous_answer() {
    let e = SimEngine::spawn(&["--time-scale", "0"]);
    let system = "You are a helpful assistant. ".repeat(10);
    let turn1 = json!({"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Tell me a story."}],
        "max_tokens": 40});
    let r1 = post_json(e.addr, "/v1/chat/completions", &turn1)
        .unwrap()
        .json();
    let answer = r1["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let p1 = r1["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(r1["usage"]["completion_tokens"], 40);
    let turn2 = json!({"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Tell me a story."},
        {"role": "assistant", "content": answer}, {"role": "user", "content": "Another one."}], "max_tokens": 5});
    let r2 = post_json(e.addr, "/v1/chat/completions", &turn2)
        .unwrap()
        .json();
    let cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // Prompt and answer were cached, except the answer's last token (never computed).
    assert_eq!(
        cached,
        (p1 + 40 - 1) / 16 * 16,
        "turn 1 had {p1} prompt tokens"
    );
    assert!(cached > p1, "the hit reaches into the previous answer");
    // The same conversation is answered the same way every time.
    let again = post_json(e.addr, "/v1/chat/completions", &turn1)
        .unwrap()
        .json();
    assert_eq!(again["choices"][0]["message"]["content"], answer.as_str());
}

#[test]
fn capacity_is_bounded_and_eviction_is_lru() {
    // 16 blocks; each 49-token prompt caches 3 blocks and holds 4 while running.
    let e = SimEngine::spawn(&["--time-scale", "0", "--kv-blocks", "16"]);
    for p in 1..=3 {
        complete_ids(e.addr, &ids(p, 49), 1); // A, B, C
    }
    assert_eq!(
        complete_ids(e.addr, &ids(1, 49), 1).1,
        48,
        "touch A: it becomes most recent"
    );
    for p in 4..=6 {
        complete_ids(e.addr, &ids(p, 49), 1); // D, E, F evict what is least recent
    }
    assert_eq!(
        complete_ids(e.addr, &ids(1, 49), 1).1,
        48,
        "A was touched, so it survived"
    );
    assert_eq!(
        complete_ids(e.addr, &ids(2, 49), 1).1,
        0,
        "B was least recently used: evicted"
    );
    // A prompt that cannot fit the cache at all is refused like vLLM does.
    let r = post_json(
        e.addr,
        "/v1/completions",
        &json!({"prompt": ids(9, 300), "max_tokens": 1}),
    )
    .unwrap();
    assert_eq!(r.status, 400);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("maximum context length")
    );
}

#[test]
fn reset_cache_forgets_everything_and_metrics_count_tokens() {
    let e = SimEngine::spawn(&["--time-scale", "0"]);
    complete_ids(e.addr, &ids(1, 100), 1);
    complete_ids(e.addr, &ids(1, 100), 1);
    let r = testkit::http::request(e.addr, "POST", "/sim/reset_cache", &[], b"").unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(complete_ids(e.addr, &ids(1, 100), 1).1, 0);
    let m = testkit::http::request(e.addr, "GET", "/metrics", &[], b"")
        .unwrap()
        .text();
    let value = |name: &str| -> f64 {
        m.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing in\n{m}"))
    };
    assert_eq!(value("vllm:prefix_cache_queries_total{"), 300.0);
    assert_eq!(value("vllm:prefix_cache_hits_total{"), 96.0);
    assert_eq!(value("vllm:generation_tokens_total{"), 3.0);
}
