//! Precise mode with a real tokenizer: sim-engines tokenize with a
//! `tokenizer.json` and a ChatML chat template (`--tokenizer-dir`, a BPE
//! trained by the test) and publish their KV events; the router, given the
//! same directory (`[precise] tokenizer_dir`), computes the same tokens,
//! block for block, for chat and completions, and routes warm on the engine
//! that holds the prompt. A router whose tokenizer is missing routes on the
//! approximate index and keeps serving. Real processes, loopback only.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use testkit::engine_proc::SimEngine;
use testkit::http::post_json;
use testkit::router_proc::{Router, explain, matched_on};
use testkit::tokenizer_fixture::words;

/// How long a state change may take to show on a loaded machine.
const WAIT: Duration = Duration::from_secs(10);
/// The engines' block size (vLLM's default).
const BLOCK: u64 = 16;

/// The fixture tokenizer in a directory of this test's own.
fn tokenizer_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "prefix-router-precise-tok-{}-{name}",
        std::process::id()
    ));
    testkit::tokenizer_fixture::write(&dir).expect("fixture tokenizer");
    dir
}

/// `n` sim-engines tokenizing with `dir`, publishing events; their
/// `[backends]` entries.
fn engines(n: usize, dir: &str) -> (Vec<SimEngine>, String) {
    let mut engines = Vec::new();
    let mut backends = Vec::new();
    for i in 0..n {
        let id = format!("e{i}");
        let (e, p, r) = SimEngine::spawn_with_event_ports(&[
            "--id",
            &id,
            "--time-scale",
            "0",
            "--tokenizer-dir",
            dir,
        ]);
        backends.push(format!(
            "{{ url = \"{}\", kv_events = \"tcp://127.0.0.1:{p}\", kv_events_replay = \"tcp://127.0.0.1:{r}\" }}",
            e.url()
        ));
        engines.push(e);
    }
    (engines, format!("backends = [{}]\n", backends.join(", ")))
}

/// A router in precise mode over `backends`, `[precise]` plus `extra`;
/// waits for every engine's stream to be EXACT.
fn router(backends: &str, engines: &[SimEngine], extra: &str) -> Router {
    let cfg = format!(
        "{backends}debug_headers = true\n[precise]\nenabled = true\nburst_ms = 0\n{extra}\n"
    );
    let r = Router::spawn(&[], &[], &cfg);
    for e in engines {
        assert!(
            r.wait_backend(&e.url(), WAIT, |b| b["precise"]["state"] == "EXACT"),
            "{} never turned EXACT: {}",
            e.url(),
            r.backend(&e.url())
        );
    }
    r
}

/// The engine's own token count of a `/tokenize` body.
fn engine_tokens(engine: &SimEngine, body: &Value) -> u64 {
    let r = post_json(engine.addr, "/tokenize", body).expect("tokenize");
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["count"].as_u64().expect("count")
}

/// The backend the router sent `r` to (its debug header), one of `urls`.
fn served_by(r: &testkit::http::Response, urls: &[String]) -> String {
    let b = r
        .header("x-prefix-router-backend")
        .expect("debug header")
        .to_owned();
    assert!(urls.contains(&b), "{b} in {urls:?}");
    b
}

fn chat(messages: &[(&str, String)]) -> Value {
    json!({
        "model": "sim-llama-8b",
        "max_tokens": 4,
        "messages": messages.iter().map(|(r, c)| json!({"role": r, "content": c})).collect::<Vec<_>>(),
    })
}

/// Waits until `body` routes warm to `url` on the precise index with every
/// one of its blocks matched (the engine's events may still be in flight),
/// then asserts it.
fn assert_warm_precise(router: &Router, endpoint: &str, body: &Value, url: &str) {
    let all = || {
        let ex = explain(router.admin, endpoint, body);
        ex["matched_blocks"] == ex["blocks"] && ex["chosen"] == url
    };
    assert!(router.wait_backend(url, WAIT, |_| all()));
    let ex = explain(router.admin, endpoint, body);
    assert_eq!(ex["decision"], "warm", "{ex}");
    assert_eq!(ex["chosen"], url, "{ex}");
    assert_eq!(matched_on(&ex, url), "precise", "{ex}");
}

#[test]
fn chat_and_completion_tokens_equal_the_engines_block_for_block() {
    let dir = tokenizer_dir("equal");
    let dir_s = dir.to_str().expect("utf-8 path");
    let (engines, backends) = engines(2, dir_s);
    // Every message tokenized on the wait, so each explain shows every
    // block (the next test covers a new message tokenized off the wait).
    let r = router(
        &backends,
        &engines,
        &format!("tokenizer_dir = {dir_s:?}\ntokenizer_defer_bytes = 0"),
    );
    let urls: Vec<String> = engines.iter().map(SimEngine::url).collect();

    // Turn 1 of a chat: the router's blocks are the engine's tokens / 16.
    let mut msgs = vec![("system", words(1, 120)), ("user", words(2, 60))];
    let body = chat(&msgs);
    let ex = explain(r.admin, "chat", &body);
    let n = engine_tokens(
        &engines[0],
        &json!({"model": "sim-llama-8b", "messages": body["messages"]}),
    );
    assert!(n > 5 * BLOCK, "a prompt of several blocks: {n} tokens");
    assert_eq!(ex["precise_blocks"], n / BLOCK, "{ex}");
    let sent = post_json(r.addr, "/v1/chat/completions", &body).expect("chat");
    assert_eq!(sent.status, 200, "{}", sent.text());
    let url = served_by(&sent, &urls);
    // Every block the router computes is one the engine stored.
    assert_warm_precise(&r, "chat", &body, &url);

    // Turn 2: the history is a prefix; it routes warm to the same engine,
    // and the whole new prompt's blocks are the engine's again.
    let answer = sent.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    msgs.push(("assistant", answer));
    msgs.push(("user", words(3, 70)));
    let body2 = chat(&msgs);
    let ex = explain(r.admin, "chat", &body2);
    assert_eq!(ex["decision"], "warm", "{ex}");
    assert_eq!(ex["chosen"], url.as_str(), "{ex}");
    assert_eq!(matched_on(&ex, &url), "precise", "{ex}");
    let n2 = engine_tokens(
        &engines[0],
        &json!({"model": "sim-llama-8b", "messages": body2["messages"]}),
    );
    assert_eq!(ex["precise_blocks"], n2 / BLOCK, "{ex}");
    let sent = post_json(r.addr, "/v1/chat/completions", &body2).expect("chat");
    assert_eq!(sent.status, 200, "{}", sent.text());
    assert_warm_precise(&r, "chat", &body2, &url);

    // Completions: tokenized with the post-processor's BOS, as vLLM does.
    let prompt = words(4, 150);
    let body = json!({"model": "sim-llama-8b", "max_tokens": 2, "prompt": prompt});
    let ex = explain(r.admin, "completions", &body);
    let n = engine_tokens(
        &engines[1],
        &json!({"model": "sim-llama-8b", "prompt": prompt}),
    );
    assert_eq!(ex["precise_blocks"], n / BLOCK, "{ex}");
    let sent = post_json(r.addr, "/v1/completions", &body).expect("completion");
    assert_eq!(sent.status, 200, "{}", sent.text());
    let url = served_by(&sent, &urls);
    assert_warm_precise(&r, "completions", &body, &url);

    // A router with the 4-byte tokenizer (none configured) over the same
    // engines: its blocks are not the engine's, nothing matches.
    let toy = router(&backends, &engines, "");
    let ex = explain(toy.admin, "completions", &body);
    assert_ne!(ex["precise_blocks"], n / BLOCK, "{ex}");
    assert_eq!(ex["matched_blocks"], 0, "{ex}");
    std::fs::remove_dir_all(&dir).ok();
}

/// A turn's new short message is tokenized off the request's wait: the
/// turn routes at once on its history's blocks (warm, to the engine holding
/// them), and soon after the router knows the new message's tokens too.
#[test]
fn a_new_message_is_tokenized_off_the_wait_and_the_turn_routes_on_its_history() {
    let dir = tokenizer_dir("defer");
    let dir_s = dir.to_str().expect("utf-8 path");
    let (engines, backends) = engines(2, dir_s);
    let r = router(&backends, &engines, &format!("tokenizer_dir = {dir_s:?}"));
    let urls: Vec<String> = engines.iter().map(SimEngine::url).collect();
    let mut msgs = vec![("system", words(11, 120)), ("user", words(12, 60))];
    let body = chat(&msgs);
    let sent = post_json(r.addr, "/v1/chat/completions", &body).expect("chat");
    assert_eq!(sent.status, 200, "{}", sent.text());
    let url = served_by(&sent, &urls);
    assert_warm_precise(&r, "chat", &body, &url);
    let n1 = engine_tokens(
        &engines[0],
        &json!({"model": "sim-llama-8b", "messages": body["messages"]}),
    );

    let answer = sent.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    msgs.push(("assistant", answer));
    msgs.push(("user", words(13, 70)));
    let body2 = chat(&msgs);
    let n2 = engine_tokens(
        &engines[0],
        &json!({"model": "sim-llama-8b", "messages": body2["messages"]}),
    );
    // First sight of the new message: the blocks before it, warm.
    let ex = explain(r.admin, "chat", &body2);
    assert_eq!(ex["decision"], "warm", "{ex}");
    assert_eq!(ex["chosen"], url.as_str(), "{ex}");
    assert_eq!(matched_on(&ex, &url), "precise", "{ex}");
    let first = ex["precise_blocks"].as_u64().expect("precise_blocks");
    assert!(
        first >= n1 / BLOCK && first < n2 / BLOCK,
        "history's blocks only: {first} (turn 1: {}, turn 2: {})",
        n1 / BLOCK,
        n2 / BLOCK
    );
    // The router's thread tokenizes it: every block of the turn, soon.
    let start = Instant::now();
    let whole = loop {
        let ex = explain(r.admin, "chat", &body2);
        if ex["precise_blocks"] == n2 / BLOCK {
            break true;
        }
        if start.elapsed() > WAIT {
            break false;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(whole, "the new message's tokens never came");
    let metrics = r.metrics();
    assert!(
        metrics.lines().any(
            |l| l.starts_with("prefix_router_precise_tokenizer_deferred_total ")
                && !l.ends_with(" 0")
        ),
        "{metrics}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_missing_tokenizer_routes_on_the_approximate_index() {
    let dir = tokenizer_dir("missing");
    let (engines, backends) = engines(1, dir.to_str().expect("utf-8 path"));
    let url = engines[0].url();
    let r = router(
        &backends,
        &engines,
        "tokenizer_dir = \"/nonexistent/prefix-router-tokenizer\"\n\
         [precise.tokenizers]\n\"other-model\" = \"/nonexistent/too\"",
    );
    let body = chat(&[("system", words(5, 120)), ("user", words(6, 40))]);
    for _ in 0..3 {
        let sent = post_json(r.addr, "/v1/chat/completions", &body).expect("chat");
        assert_eq!(sent.status, 200, "{}", sent.text());
    }
    assert!(
        r.wait_backend(&url, WAIT, |b| b["precise"]["held_blocks"].as_u64()
            > Some(0))
    );
    // The stream is whole, but this model has no tokens: the approximate
    // index routes it, warm from what the router sent.
    assert_eq!(r.backend(&url)["precise"]["state"], "EXACT");
    let ex = explain(r.admin, "chat", &body);
    assert_eq!(matched_on(&ex, &url), "approximate", "{ex}");
    assert_eq!(ex["precise_blocks"], 0, "{ex}");
    assert_eq!(ex["decision"], "warm", "{ex}");
    assert_eq!(ex["matched_blocks"], ex["blocks"], "{ex}");
    std::fs::remove_dir_all(&dir).ok();
}
