//! The HTTP API as a vLLM client sees it: shapes, framing, errors, metrics.

use serde_json::{Value, json};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;
use testkit::engine_proc::SimEngine;
use testkit::http::{post_json, request, request_chunks};

#[test]
fn chat_stream_is_sse_with_usage_chunk_and_done() {
    let e = SimEngine::spawn(&["--time-scale", "0.01", "--id", "engine-a"]);
    let body = json!({"model": "sim-llama-8b", "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        "max_tokens": 4, "stream": true, "stream_options": {"include_usage": true}});
    let (r, chunks) = request_chunks(
        e.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        body.to_string().as_bytes(),
    )
    .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-engine-id"), Some("engine-a"));
    assert_eq!(r.header("transfer-encoding"), Some("chunked"));
    assert!(
        r.header("content-type")
            .unwrap()
            .starts_with("text/event-stream")
    );
    assert!(chunks.len() >= 7, "one chunk per event");
    let data = r.sse_data();
    assert_eq!(data.last().unwrap(), "[DONE]");
    let events: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect::<Vec<_>>()
        .concat();
    assert_eq!(content.len(), 16, "4 tokens of 4 bytes: {content:?}");
    assert_eq!(
        events[events.len() - 2]["choices"][0]["finish_reason"],
        "length"
    );
    let usage = &events.last().unwrap()["usage"];
    assert_eq!(events.last().unwrap()["choices"], json!([]));
    assert_eq!(usage["completion_tokens"], 4);
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 0);
    assert!(usage["prompt_tokens_details"]["cached_tokens"].is_u64());
    for ev in &events {
        assert_eq!(ev["object"], "chat.completion.chunk");
        assert_eq!(ev["model"], "sim-llama-8b");
    }
}

#[test]
fn non_stream_shapes_for_chat_completions_and_generate() {
    let e = SimEngine::spawn(&["--time-scale", "0.01", "--default-max-tokens", "7"]);
    let chat = post_json(
        e.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}]}),
    )
    .unwrap();
    assert_eq!(chat.status, 200);
    assert_eq!(chat.header("content-type"), Some("application/json"));
    let c = chat.json();
    assert_eq!(c["object"], "chat.completion");
    assert_eq!(c["choices"][0]["message"]["role"], "assistant");
    assert_eq!(c["choices"][0]["finish_reason"], "length");
    assert_eq!(c["usage"]["completion_tokens"], 7, "--default-max-tokens");
    assert_eq!(
        c["usage"]["total_tokens"],
        c["usage"]["prompt_tokens"].as_u64().unwrap() + 7
    );

    let cmpl = post_json(
        e.addr,
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_completion_tokens": 3}),
    );
    let c = cmpl.unwrap().json();
    assert_eq!(c["object"], "text_completion");
    assert_eq!(c["choices"][0]["text"].as_str().unwrap().len(), 12);
    assert_eq!(c["usage"]["prompt_tokens"], 4);

    let g = post_json(
        e.addr,
        "/generate",
        &json!({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}),
    );
    let g = g.unwrap().json();
    assert_eq!(g["meta_info"]["prompt_tokens"], 3);
    assert_eq!(g["meta_info"]["completion_tokens"], 2);
    assert_eq!(g["meta_info"]["finish_reason"]["type"], "length");
    let gs = post_json(
        e.addr,
        "/generate",
        &json!({"text": "abc", "stream": true, "sampling_params": {"max_new_tokens": 2}}),
    );
    assert_eq!(gs.unwrap().sse_data().last().unwrap(), "[DONE]");
}

#[test]
fn models_errors_and_unknown_routes() {
    let e = SimEngine::spawn(&[
        "--time-scale",
        "0",
        "--model",
        "alpha",
        "--served-model-name",
        "beta",
    ]);
    let m = request(e.addr, "GET", "/v1/models", &[], b"")
        .unwrap()
        .json();
    assert_eq!(m["object"], "list");
    let ids: Vec<_> = m["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids, ["alpha", "beta"]);
    let ok = post_json(
        e.addr,
        "/v1/chat/completions",
        &json!({"model": "beta", "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_eq!(ok.unwrap().json()["model"], "beta");

    let missing = post_json(
        e.addr,
        "/v1/chat/completions",
        &json!({"model": "gpt-9", "messages": []}),
    )
    .unwrap();
    assert_eq!(missing.status, 404);
    assert_eq!(missing.json()["error"]["type"], "NotFoundError");
    assert_eq!(missing.json()["error"]["code"], 404);

    let bad = request(e.addr, "POST", "/v1/chat/completions", &[], b"{not json").unwrap();
    assert_eq!(bad.status, 400);
    assert_eq!(bad.json()["error"]["type"], "BadRequestError");
    assert!(bad.json()["error"]["param"].is_null());

    let batch = post_json(e.addr, "/v1/completions", &json!({"prompt": ["a", "b"]})).unwrap();
    assert_eq!(batch.status, 400);
    assert_eq!(
        request(e.addr, "GET", "/nope", &[], b"").unwrap().status,
        404
    );
    assert_eq!(
        request(e.addr, "GET", "/health", &[], b"").unwrap().status,
        200
    );
}

#[test]
fn keep_alive_and_chunked_request_bodies() {
    let e = SimEngine::spawn(&["--time-scale", "0"]);
    let mut s = TcpStream::connect(e.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let body = br#"{"prompt":"hello world","max_tokens":2}"#;
    let (a, b) = body.split_at(10);
    let mut req =
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
    req.extend_from_slice(format!("{:x}\r\n", a.len()).as_bytes());
    req.extend_from_slice(a);
    req.extend_from_slice(format!("\r\n{:x}\r\n", b.len()).as_bytes());
    req.extend_from_slice(b);
    req.extend_from_slice(b"\r\n0\r\n\r\n");
    // Two requests on one connection: chunked body, then a GET.
    req.extend_from_slice(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    s.write_all(&req).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert_eq!(out.matches("HTTP/1.1 200 OK").count(), 2, "{out}");
    assert!(out.contains("\"completion_tokens\":2"));
}

#[test]
fn metrics_use_vllm_names() {
    let e = SimEngine::spawn(&["--time-scale", "0", "--kv-blocks", "1234"]);
    post_json(
        e.addr,
        "/v1/completions",
        &json!({"prompt": "x".repeat(200), "max_tokens": 3}),
    )
    .unwrap();
    let m = request(e.addr, "GET", "/metrics", &[], b"").unwrap().text();
    for name in [
        "vllm:num_requests_running{model_name=\"sim-llama-8b\"} 0",
        "vllm:num_requests_waiting{model_name=\"sim-llama-8b\"} 0",
        "vllm:kv_cache_usage_perc{model_name=\"sim-llama-8b\"} 0",
        "vllm:prefix_cache_queries_total{model_name=\"sim-llama-8b\"} 50",
        "vllm:prefix_cache_hits_total{model_name=\"sim-llama-8b\"} 0",
        "vllm:prompt_tokens_total{model_name=\"sim-llama-8b\"} 50",
        "vllm:generation_tokens_total{model_name=\"sim-llama-8b\"} 3",
        "vllm:time_to_first_token_seconds_bucket{model_name=\"sim-llama-8b\",le=\"+Inf\"} 1",
        "num_gpu_blocks=\"1234\"",
        "vllm:cache_config_info{block_size=\"16\"",
    ] {
        assert!(m.contains(name), "{name} missing in\n{m}");
    }
}
