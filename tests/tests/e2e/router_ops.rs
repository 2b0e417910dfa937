//! What an operator does to a running router: drain, explain, reload,
//! stop; and what they read: metrics, headers, logs.

use std::time::{Duration, Instant};

use serde_json::json;
use testkit::engine_proc::SimEngine;
use testkit::http::{post_json, request, request_chunks};
use testkit::router_proc::Router;

/// Engines that take 50 ms per token: a 20-token stream lasts about a second.
const SLOW_DECODE: &[&str] = &[
    "--decode-step-ms",
    "50",
    "--decode-step-per-seq-ms",
    "0",
    "--prefill-tps",
    "0",
];

fn chat(system: &str, max_tokens: u32) -> serde_json::Value {
    json!({"model": "sim-llama-8b", "max_tokens": max_tokens, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "hi"}]})
}

fn served_by(r: &Router, system: &str) -> String {
    let resp = post_json(r.addr, "/v1/chat/completions", &chat(system, 1)).unwrap();
    assert_eq!(resp.status, 200, "{}", resp.text());
    resp.header("x-engine-id").unwrap().to_owned()
}

fn admin_post(r: &Router, path: &str, body: &[u8]) -> testkit::http::Response {
    request(r.admin, "POST", path, &[], body).unwrap()
}

/// A streaming request in a thread: 20 tokens at 50 ms a step take about a second.
fn slow_stream(addr: std::net::SocketAddr) -> std::thread::JoinHandle<(u16, String)> {
    std::thread::spawn(move || {
        let mut body = chat("a slow stream", 20);
        body["stream"] = json!(true);
        let (resp, _) = request_chunks(
            addr,
            "POST",
            "/v1/chat/completions",
            &[],
            &serde_json::to_vec(&body).unwrap(),
        )
        .unwrap();
        (resp.status, resp.text())
    })
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) on a child process this test started.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

#[test]
fn a_drained_backend_gets_no_new_requests_until_undrained() {
    let e = SimEngine::fleet(2, &["--time-scale", "0"]);
    let r = Router::spawn(&[e[0].url(), e[1].url()], &["--debug-headers"], "");
    let drain = admin_post(&r, &format!("/admin/drain?backend={}", e[0].url()), b"");
    assert_eq!(drain.status, 200);
    assert_eq!(r.backend(&e[0].url())["draining"], true);
    for i in 0..20 {
        assert_eq!(
            served_by(&r, &format!("drained {i} {}", "q".repeat(300))),
            "e1"
        );
    }
    assert_eq!(
        admin_post(&r, &format!("/admin/undrain?backend={}", e[0].url()), b"").status,
        200
    );
    let ids: Vec<_> = (0..20)
        .map(|i| served_by(&r, &format!("undrained {i} {}", "q".repeat(300))))
        .collect();
    assert!(ids.iter().any(|id| id == "e0"), "{ids:?}");
    assert_eq!(
        admin_post(&r, "/admin/drain?backend=http://127.0.0.1:1", b"").status,
        404
    );
}

#[test]
fn explain_says_where_a_request_would_go_and_why() {
    let e = SimEngine::fleet(3, &["--time-scale", "0"]);
    let r = Router::spawn(
        &e.iter().map(SimEngine::url).collect::<Vec<_>>(),
        &["--debug-headers"],
        "",
    );
    r.wait_models_known();
    let body =
        serde_json::to_vec(&chat(&"You are a support bot for ACME. ".repeat(20), 1)).unwrap();
    let before = admin_post(&r, "/admin/explain", &body).json();
    assert_eq!(before["decision"], "cold", "{before}");
    assert!(before["blocks"].as_u64().unwrap() >= 9, "{before}");
    let resp = request(r.addr, "POST", "/v1/chat/completions", &[], &body).unwrap();
    let served = resp.header("x-engine-id").unwrap();
    let after = admin_post(&r, "/admin/explain", &body).json();
    assert_eq!(after["decision"], "warm", "{after}");
    assert_eq!(after["matched_blocks"], before["blocks"], "{after}");
    let chosen = after["chosen"].as_str().unwrap();
    let served_url = &e[served[1..].parse::<usize>().unwrap()].url();
    assert_eq!(chosen, served_url);
    let bad = admin_post(&r, "/admin/explain", b"{nope");
    assert_eq!(bad.status, 400);
}

#[test]
fn sighup_reload_adds_and_removes_backends_without_dropping_a_stream() {
    let e = SimEngine::fleet(3, SLOW_DECODE);
    let path = std::env::temp_dir().join(format!("router-ops-reload-{}.toml", std::process::id()));
    std::fs::write(&path, format!("backends = [\"{}\"]\n", e[1].url())).unwrap();
    let r = Router::spawn(
        &[],
        &["--config", path.to_str().unwrap(), "--debug-headers"],
        "",
    );
    let stream = slow_stream(r.addr);
    std::thread::sleep(Duration::from_millis(200));
    // Replace e1 by e0 and e2 while the stream is on e1.
    std::fs::write(
        &path,
        format!("backends = [\"{}\", \"{}\"]\n", e[0].url(), e[2].url()),
    )
    .unwrap();
    signal(r.child.pid(), libc::SIGHUP);
    let deadline = Instant::now() + Duration::from_secs(5);
    while r.backends().len() != 2 {
        assert!(
            Instant::now() < deadline,
            "reload not applied: {:?}",
            r.backends()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (status, text) = stream.join().unwrap();
    assert_eq!(status, 200);
    assert!(
        text.contains("data: [DONE]"),
        "the in-flight stream was cut: {text}"
    );
    for i in 0..10 {
        assert_ne!(served_by(&r, &format!("after reload {i}")), "e1");
    }
    // A broken file keeps the running configuration.
    std::fs::write(&path, "backends = [").unwrap();
    signal(r.child.pid(), libc::SIGHUP);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(r.backends().len(), 2);
    std::fs::remove_file(&path).ok();
}

#[test]
fn sigterm_finishes_in_flight_streams_then_exits() {
    let e = SimEngine::fleet(1, SLOW_DECODE);
    let mut r = Router::spawn(&[e[0].url()], &[], "");
    let stream = slow_stream(r.addr);
    std::thread::sleep(Duration::from_millis(200));
    signal(r.child.pid(), libc::SIGTERM);
    let (status, text) = stream.join().unwrap();
    assert_eq!(status, 200);
    assert!(
        text.contains("data: [DONE]"),
        "the in-flight stream was cut: {text}"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while r.child.is_running() {
        assert!(
            Instant::now() < deadline,
            "router still running after its streams ended"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(r.child.stderr_tail(4096).contains("bye"));
}

#[test]
fn metrics_headers_and_json_logs() {
    let e = SimEngine::fleet(2, &["--time-scale", "0"]);
    let r = Router::spawn(&[e[0].url(), e[1].url()], &["--log-json"], "");
    let resp = post_json(r.addr, "/v1/chat/completions", &chat("metrics", 1)).unwrap();
    assert!(
        resp.header("x-prefix-router-backend").is_none(),
        "debug headers are off by default"
    );
    post_json(
        r.addr,
        "/v1/chat/completions",
        &json!({"messages": "not a list"}),
    )
    .unwrap();
    let names = [
        "prefix_router_responses_total{",
        "prefix_router_routing_decisions_total{decision=\"cold\"} 1",
        // Engines with room: the tight bounds.
        "prefix_router_full_cache_routes_total 0",
        "prefix_router_matched_blocks_bucket",
        "prefix_router_routing_seconds_bucket",
        "prefix_router_backend_in_flight{",
        "prefix_router_backend_healthy{",
        "prefix_router_index_blocks{",
        "prefix_router_index_evictions_total",
    ];
    // A response is counted once relayed whole: the client may read it a
    // moment before the router's bookkeeping after the last write.
    let mut m = r.metrics();
    for _ in 0..40 {
        if names.iter().all(|n| m.contains(n)) {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
        m = r.metrics();
    }
    for name in names {
        assert!(m.contains(name), "no {name} in /metrics:\n{m}");
    }
    let logs = r.child.stderr_tail(8192);
    let refused = logs
        .lines()
        .find(|l| l.contains("refused request"))
        .expect("a log line for the 400");
    let v: serde_json::Value = serde_json::from_str(refused).expect("JSON log line");
    assert_eq!(v["fields"]["status"], 400);

    let r2 = Router::spawn(&[e[0].url()], &["--debug-headers"], "");
    let resp = post_json(r2.addr, "/v1/chat/completions", &chat("metrics", 1)).unwrap();
    assert_eq!(
        resp.header("x-prefix-router-backend"),
        Some(e[0].url().as_str())
    );
    assert!(resp.header("x-prefix-router-matched-blocks").is_some());
}
