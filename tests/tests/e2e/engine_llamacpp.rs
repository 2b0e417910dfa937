//! The router in front of real llama.cpp servers (`llama-server` built by
//! `cargo xtask setup`, a random-weight GGUF model, 2 slots and 1 thread
//! each): what a user of the OpenAI API would notice. Chat and completions,
//! JSON and SSE, `usage` and `cached_tokens` as the engine wrote them,
//! `/v1/models`, health from llama-server's own `/health`, its slot count
//! read from `/props`, and a server killed in the middle of a stream.
//!
//! Without the build these tests print why and pass, except under
//! `CI=true`, where they fail (`testkit::llama_proc::require`). The tests of
//! this file run one at a time: each starts two single-thread servers, and
//! the machine has two cores.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use testkit::http::{post_json, request};
use testkit::llama_proc::{LlamaPaths, LlamaServer, MODEL_ALIAS, require};
use testkit::router_proc::Router;

/// One test at a time (see the module doc).
static SERIAL: Mutex<()> = Mutex::new(());

/// A shared system prompt long enough to span many router blocks and
/// llama.cpp tokens (about 700 characters, some 350 tokens).
fn system_prompt() -> String {
    "You are the support assistant of a small hosting company. Answer briefly and \
     politely, name the product the customer asks about, and never promise a refund \
     without a ticket number. "
        .repeat(3)
}

struct Fleet {
    servers: Vec<LlamaServer>,
    router: Router,
}

impl Fleet {
    /// `n` servers of 2 slots each behind a router with debug headers on.
    fn start(paths: &LlamaPaths, n: usize) -> Fleet {
        let servers = LlamaServer::fleet(paths, n, 2);
        let urls: Vec<String> = servers.iter().map(LlamaServer::url).collect();
        let router = Router::spawn(&urls, &["--debug-headers"], "");
        // Healthy, known as a slot engine (read from `/props` after the
        // first passed probe): before that, requests are placed as for a
        // block cache and the slot model has not seen them. And its models
        // known (`/v1/models`): while one server's are and the other's are
        // not, the known one takes every request of its model.
        for u in &urls {
            assert!(
                router.wait_backend(u, Duration::from_secs(20), |b| {
                    b["healthy"] == true && b["engine"] == "slots" && b["models"].is_array()
                }),
                "{u} never became a healthy slot engine: {:?}",
                router.backend(u)
            );
        }
        Fleet { servers, router }
    }

    fn post(&self, path: &str, body: &Value) -> testkit::http::Response {
        post_json(self.router.addr, path, body).unwrap_or_else(|e| panic!("POST {path}: {e}"))
    }

    /// The prompt tokens all servers report having processed.
    fn prompt_tokens_processed(&self) -> f64 {
        self.servers
            .iter()
            .filter_map(|s| s.metric("llamacpp:prompt_tokens_total"))
            .sum()
    }
}

fn chat(system: &str, user: &str, max_tokens: u32, stream: bool) -> Value {
    let mut b = json!({
        "model": MODEL_ALIAS,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    });
    if stream {
        b["stream"] = json!(true);
        b["stream_options"] = json!({"include_usage": true});
    }
    b
}

fn cached_tokens(usage: &Value) -> u64 {
    usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no usage.prompt_tokens_details.cached_tokens: {usage}"))
}

/// The JSON events of an SSE body, checking it ends with `[DONE]`.
fn sse_events(r: &testkit::http::Response) -> Vec<Value> {
    let data = r.sse_data();
    assert_eq!(
        data.last().map(String::as_str),
        Some("[DONE]"),
        "the stream must end with [DONE]: {}",
        r.text()
    );
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("bad event {d}: {e}")))
        .collect()
}

#[test]
fn chat_json_and_sse_carry_usage_and_cached_tokens() {
    let Some(paths) = require("chat_json_and_sse_carry_usage_and_cached_tokens") else {
        return;
    };
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let f = Fleet::start(&paths, 2);
    let sys = system_prompt();

    let first = f.post(
        "/v1/chat/completions",
        &chat(&sys, "Is my VPS down?", 8, false),
    );
    assert_eq!(first.status, 200, "{}", first.text());
    let j = first.json();
    assert_eq!(j["object"], "chat.completion", "{j}");
    assert_eq!(j["choices"][0]["message"]["role"], "assistant", "{j}");
    let usage = &j["usage"];
    let prompt = usage["prompt_tokens"].as_u64().expect("prompt_tokens");
    assert!(
        prompt > 200,
        "the system prompt is some 350 tokens: {usage}"
    );
    let completion = usage["completion_tokens"]
        .as_u64()
        .expect("completion_tokens");
    assert!((1..=8).contains(&completion), "max_tokens 8: {usage}");
    let backend = first
        .header("x-prefix-router-backend")
        .expect("debug header")
        .to_string();

    // The same system prompt again: the prefix policy sends it to the slot
    // that holds it, and the engine's own count says so.
    let second = f.post(
        "/v1/chat/completions",
        &chat(&sys, "Is my mail server down?", 8, false),
    );
    assert_eq!(second.status, 200, "{}", second.text());
    assert_eq!(
        second.header("x-prefix-router-backend"),
        Some(backend.as_str()),
        "a shared system prompt goes where it is cached"
    );
    let cached = cached_tokens(&second.json()["usage"]);
    assert!(
        cached * 10 >= prompt * 8,
        "most of the prompt was cached: {cached} of {prompt}"
    );

    // Streamed: chunks, a usage chunk with cached tokens, then [DONE].
    let s = f.post(
        "/v1/chat/completions",
        &chat(&sys, "Is my mail server down?", 8, true),
    );
    assert_eq!(s.status, 200, "{}", s.text());
    assert!(
        s.header("content-type")
            .is_some_and(|c| c.starts_with("text/event-stream")),
        "{:?}",
        s.headers
    );
    let events = sse_events(&s);
    assert!(
        events
            .iter()
            .all(|e| e["object"] == "chat.completion.chunk"),
        "{events:?}"
    );
    let text: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(!text.is_empty(), "the stream carried content: {events:?}");
    let usage = events
        .iter()
        .rev()
        .find(|e| e["usage"].is_object())
        .map(|e| e["usage"].clone())
        .expect("a usage chunk (stream_options.include_usage)");
    let cached = cached_tokens(&usage);
    let prompt = usage["prompt_tokens"].as_u64().unwrap_or(0);
    assert!(
        cached + 4 >= prompt && cached > 0,
        "the identical prompt was cached but for its last tokens: {usage}"
    );
    assert!(
        f.prompt_tokens_processed() > 0.0,
        "llama-server's /metrics count the prompts"
    );
}

#[test]
fn completions_json_and_sse() {
    let Some(paths) = require("completions_json_and_sse") else {
        return;
    };
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let f = Fleet::start(&paths, 2);
    let prompt = format!("{} Question: what is a slot?", system_prompt());
    let body = json!({"model": MODEL_ALIAS, "prompt": prompt, "max_tokens": 6, "temperature": 0.0});
    let r = f.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let j = r.json();
    assert_eq!(j["object"], "text_completion", "{j}");
    assert!(j["choices"][0]["text"].is_string(), "{j}");
    assert!(
        j["usage"]["prompt_tokens"].as_u64().unwrap_or(0) > 200,
        "{j}"
    );

    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});
    let s = f.post("/v1/completions", &sb);
    assert_eq!(s.status, 200, "{}", s.text());
    let events = sse_events(&s);
    assert!(events.len() >= 2, "several chunks: {events:?}");
    assert!(
        events.iter().any(|e| e["choices"][0]["text"].is_string()),
        "{events:?}"
    );
    let usage = events
        .iter()
        .rev()
        .find(|e| e["usage"].is_object())
        .map(|e| e["usage"].clone())
        .expect("a usage chunk");
    assert!(
        cached_tokens(&usage) > 0,
        "the same prompt again is cached: {usage}"
    );
}

#[test]
fn models_and_health_come_from_llama_server() {
    let Some(paths) = require("models_and_health_come_from_llama_server") else {
        return;
    };
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut f = Fleet::start(&paths, 2);
    let m = request(f.router.addr, "GET", "/v1/models", &[], b"").expect("GET /v1/models");
    assert_eq!(m.status, 200, "{}", m.text());
    let ids: Vec<String> = m.json()["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter_map(|d| d["id"].as_str().map(str::to_string))
        .collect();
    assert!(ids.iter().any(|i| i == MODEL_ALIAS), "{ids:?}");

    // The router read the slot count llama-server publishes (`/props`) and
    // models each server as a slot engine.
    for s in &f.servers {
        let b = f.router.backend(&s.url());
        assert_eq!(b["engine"], "slots", "{b}");
        assert_eq!(b["slots"], 2, "{b}");
    }

    // A server that dies is found out by the router's probes of /health.
    let dead = f.servers[0].url();
    let alive = f.servers[1].url();
    f.servers[0].kill();
    assert!(
        f.router
            .wait_backend(&dead, Duration::from_secs(20), |b| b["healthy"] == false),
        "the dead server stays healthy: {:?}",
        f.router.backend(&dead)
    );
    for i in 0..4 {
        let r = f.post(
            "/v1/chat/completions",
            &chat(&system_prompt(), &format!("question {i}"), 4, false),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-prefix-router-backend"), Some(alive.as_str()));
    }
}

/// A streaming request on a raw socket, read until its first SSE event.
struct OpenStream {
    sock: TcpStream,
    got: Vec<u8>,
}

impl OpenStream {
    fn start(addr: SocketAddr, body: &Value) -> OpenStream {
        let body = serde_json::to_vec(body).expect("json");
        let mut sock = TcpStream::connect(addr).expect("connect to the router");
        sock.set_read_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n",
            body.len()
        );
        sock.write_all(head.as_bytes()).expect("write head");
        sock.write_all(&body).expect("write body");
        let mut s = OpenStream {
            sock,
            got: Vec::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !s.text().contains("data: ") {
            assert!(Instant::now() < deadline, "no event: {}", s.text());
            assert!(s.read_some() > 0, "closed before an event: {}", s.text());
        }
        s
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.got).into_owned()
    }

    /// Reads once; 0 on end of stream or error.
    fn read_some(&mut self) -> usize {
        let mut buf = [0u8; 16 * 1024];
        match self.sock.read(&mut buf) {
            Ok(n) => {
                self.got.extend_from_slice(&buf[..n]);
                n
            }
            Err(_) => 0,
        }
    }

    /// The backend that serves it (debug header).
    fn backend(&self) -> String {
        self.text()
            .lines()
            .find_map(|l| l.strip_prefix("x-prefix-router-backend: "))
            .expect("debug header")
            .trim()
            .to_string()
    }
}

#[test]
fn a_server_killed_mid_stream_cuts_that_stream_only() {
    let Some(paths) = require("a_server_killed_mid_stream_cuts_that_stream_only") else {
        return;
    };
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut f = Fleet::start(&paths, 2);
    // A long answer (no end-of-turn token), so the kill lands mid-stream.
    let mut body = chat(&system_prompt(), "Tell me a long story.", 3000, true);
    body["ignore_eos"] = json!(true);
    let mut s = OpenStream::start(f.router.addr, &body);
    let victim = s.backend();
    let i = f
        .servers
        .iter()
        .position(|x| x.url() == victim)
        .expect("the stream's backend is one of ours");
    let survivor = f.servers[1 - i].url();
    f.servers[i].kill();

    // The client sees its stream end without the chunked terminator or
    // [DONE]: a cut it can tell from a complete answer.
    let deadline = Instant::now() + Duration::from_secs(60);
    while s.read_some() > 0 {
        assert!(
            Instant::now() < deadline,
            "the stream went on after the kill"
        );
    }
    let text = s.text();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(
        !text.contains("data: [DONE]"),
        "a cut stream cannot end cleanly"
    );
    assert!(
        !text.ends_with("0\r\n\r\n"),
        "no chunked terminator after a cut"
    );

    // The router goes on serving from the other server, at once (connect
    // failures are re-sent) and after its probes mark the dead one.
    for i in 0..4 {
        let r = f.post(
            "/v1/chat/completions",
            &chat(&system_prompt(), &format!("after the crash {i}"), 4, false),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-prefix-router-backend"), Some(survivor.as_str()));
    }
    assert!(f.router.child.is_running(), "the router survived the crash");
}

#[test]
fn back_to_back_streams_all_complete() {
    // llama-server closes the connection after every streamed answer
    // without a `Connection: close`; a router that pooled it would race the
    // close with the next request and answer 502.
    let Some(paths) = require("back_to_back_streams_all_complete") else {
        return;
    };
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let f = Fleet::start(&paths, 1);
    for i in 0..12 {
        let s = f.post(
            "/v1/chat/completions",
            &chat(&system_prompt(), &format!("turn {i}"), 2, true),
        );
        assert_eq!(s.status, 200, "request {i}: {}", s.text());
        sse_events(&s);
    }
    let m = f.router.metrics();
    let unanswered: f64 = m
        .lines()
        .filter(|l| l.starts_with("prefix_router_unanswered_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(unanswered, 0.0, "no request went unanswered:\n{m}");
}

#[test]
fn the_anthropic_sdk_makes_every_call_through_the_router_to_llama_server() {
    let test = "the_anthropic_sdk_makes_every_call_through_the_router_to_llama_server";
    let Some(paths) = require(test) else {
        return;
    };
    let Some(py) = testkit::sdk::require(test) else {
        return;
    };
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let f = Fleet::start(&paths, 2);
    let run = testkit::sdk::run(
        &py,
        testkit::sdk::Script::Anthropic,
        &f.router.url(),
        MODEL_ALIAS,
        &[],
    );
    run.assert_success();
    // The conversation's later turns found their history in the slot that
    // holds it: the router kept them on one server.
    let turns = run.call("messages.multi_turn")["turns"]
        .as_array()
        .expect("turns")
        .clone();
    for (i, t) in turns.iter().enumerate().skip(1) {
        let read = t["usage"]["cache_read_input_tokens"].as_u64().unwrap_or(0);
        assert!(read > 0, "turn {i} found no cache on llama-server: {t}");
    }
}
