//! What the peer routers read from an engine, as vLLM answers it: the prompt's
//! token ids from `POST /tokenize` and the render endpoints (vllm-router's
//! cache_aware routes on them), `vllm:kv_cache_usage_perc` as the share held
//! by running requests (smg's overload guard), and an engine that does not
//! publish its capacity.

use serde_json::{Value, json};
use std::time::{Duration, Instant};
use testkit::engine_proc::SimEngine;
use testkit::http::{post_json, request};

fn chat(system: &str, user: &str) -> Value {
    json!({"model": "sim-llama-8b", "max_tokens": 2, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]})
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list of ids: {v}"))
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

#[test]
fn tokenize_and_render_give_the_token_ids_the_engine_runs() {
    let e = SimEngine::spawn(&["--time-scale", "0"]);
    let body = chat("You are a support bot. Be brief.", "Where is order 1234?");

    let answer = post_json(e.addr, "/v1/chat/completions", &body).unwrap();
    assert_eq!(answer.status, 200);
    let prompt_tokens = answer.json()["usage"]["prompt_tokens"].as_u64().unwrap();

    let tok = post_json(
        e.addr,
        "/tokenize",
        &json!({"model": "sim-llama-8b", "messages": body["messages"]}),
    )
    .unwrap();
    assert_eq!(tok.status, 200, "{}", tok.text());
    let tok = tok.json();
    let tokens = ids(&tok["tokens"]);
    assert_eq!(tok["count"].as_u64(), Some(prompt_tokens));
    assert_eq!(tokens.len() as u64, prompt_tokens);
    assert!(tok["max_model_len"].as_u64().unwrap() > 0);

    // vllm-router sends the whole chat request to render (with its extras).
    let mut routed = body.clone();
    routed["stream"] = json!(false);
    routed["continue_final_message"] = json!(false);
    let r = post_json(e.addr, "/v1/chat/completions/render", &routed).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let r = r.json();
    assert_eq!(ids(&r["token_ids"]), tokens, "render and tokenize agree");
    assert_eq!(r["model"], "sim-llama-8b");

    // Without the generation prompt the prompt is shorter, and a prefix.
    let bare = post_json(
        e.addr,
        "/tokenize",
        &json!({"messages": body["messages"], "add_generation_prompt": false}),
    )
    .unwrap()
    .json();
    let bare = ids(&bare["tokens"]);
    assert!(bare.len() < tokens.len());
    assert_eq!(&tokens[..bare.len()], &bare[..]);

    // Completions: a list with one rendered prompt, the ids /tokenize gives.
    let text = "The quick brown fox jumps over the lazy dog.";
    let c = post_json(
        e.addr,
        "/v1/completions/render",
        &json!({"model": "sim-llama-8b", "prompt": text, "max_tokens": 3}),
    )
    .unwrap();
    assert_eq!(c.status, 200, "{}", c.text());
    let c = c.json();
    assert_eq!(c.as_array().map(Vec::len), Some(1), "{c}");
    let t = post_json(e.addr, "/tokenize", &json!({"prompt": text}))
        .unwrap()
        .json();
    assert_eq!(ids(&c[0]["token_ids"]), ids(&t["tokens"]));
    assert_eq!(t["count"], 11);

    // A longer conversation starts with the same ids: a router matching
    // prefixes of these ids finds the conversation's engine.
    let mut next = body["messages"].as_array().unwrap().clone();
    next.push(json!({"role": "assistant", "content": "It ships today."}));
    next.push(json!({"role": "user", "content": "Thanks!"}));
    let longer = post_json(e.addr, "/tokenize", &json!({"messages": next}))
        .unwrap()
        .json();
    let longer = ids(&longer["tokens"]);
    assert_eq!(&longer[..bare.len()], &bare[..]);

    // None of this ran a request.
    assert_eq!(e.requests_served(), 1);
}

#[test]
fn tokenize_and_render_errors_are_vllm_shaped() {
    let e = SimEngine::spawn(&["--time-scale", "0"]);
    let cases: [(&str, &str, &[u8], u16); 7] = [
        ("POST", "/tokenize", b"{nope", 400),
        ("POST", "/tokenize", br#"{"model":"sim-llama-8b"}"#, 400),
        (
            "POST",
            "/tokenize",
            br#"{"model":"other","prompt":"x"}"#,
            404,
        ),
        (
            "POST",
            "/v1/chat/completions/render",
            br#"{"prompt":"x"}"#,
            400,
        ),
        (
            "POST",
            "/v1/completions/render",
            br#"{"prompt":["a","b"]}"#,
            400,
        ),
        ("GET", "/tokenize", b"", 405),
        ("GET", "/v1/chat/completions/render", b"", 405),
    ];
    for (method, path, body, status) in cases {
        let r = request(e.addr, method, path, &[], body).unwrap();
        assert_eq!(r.status, status, "{method} {path} {}", r.text());
        if status == 400 || status == 404 {
            assert!(r.json()["error"]["message"].is_string(), "{}", r.text());
        }
    }
}

/// `vllm:kv_cache_usage_perc` from `/metrics`.
fn kv_usage(e: &SimEngine) -> f64 {
    let m = request(e.addr, "GET", "/metrics", &[], b"").unwrap().text();
    m.lines()
        .find(|l| l.starts_with("vllm:kv_cache_usage_perc{"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no kv_cache_usage_perc in\n{m}"))
}

#[test]
fn kv_usage_counts_blocks_held_by_running_requests_not_the_cache() {
    // 100 blocks; one request holds 50 prompt blocks + 7 output blocks
    // for about 100 steps of 20 ms.
    let e = SimEngine::spawn(&[
        "--kv-blocks",
        "100",
        "--decode-step-ms",
        "20",
        "--time-scale",
        "1",
    ]);
    let prompt = "word ".repeat(640); // 800 tokens = 50 blocks
    let body = json!({"prompt": prompt, "max_tokens": 100});
    let addr = e.addr;
    let first = {
        let body = body.clone();
        std::thread::spawn(move || post_json(addr, "/v1/completions", &body).unwrap())
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seen = 0.0;
    while Instant::now() < deadline && !first.is_finished() {
        seen = kv_usage(&e);
        if seen > 0.0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        (0.5..=0.6).contains(&seen),
        "a running request holds its 57 of 100 blocks: usage {seen}"
    );
    let a = first.join().unwrap();
    assert_eq!(a.status, 200);
    assert_eq!(kv_usage(&e), 0.0, "a finished request holds nothing");
    // Its blocks are still cached: the same prompt hits.
    let b = post_json(
        e.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 1}),
    )
    .unwrap();
    let cached = b.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= 784, "cached {cached} of 800");
    assert_eq!(kv_usage(&e), 0.0);
}

#[test]
fn hide_capacity_leaves_cache_config_info_out() {
    let shown = SimEngine::spawn(&["--time-scale", "0", "--kv-blocks", "321"]);
    let hidden = SimEngine::spawn(&["--time-scale", "0", "--kv-blocks", "321", "--hide-capacity"]);
    let page = |e: &SimEngine| request(e.addr, "GET", "/metrics", &[], b"").unwrap().text();
    assert!(page(&shown).contains("num_gpu_blocks=\"321\""));
    let h = page(&hidden);
    assert!(!h.contains("vllm:cache_config_info"), "{h}");
    assert!(!h.contains("321"), "capacity leaks elsewhere:\n{h}");
    assert!(h.contains("vllm:kv_cache_usage_perc"), "{h}");
}
