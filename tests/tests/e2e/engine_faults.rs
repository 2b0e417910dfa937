//! Fault injection, by flag and at run time through `POST /sim/faults`.

use serde_json::json;
use std::process::Command;
use std::time::{Duration, Instant};
use testkit::engine_proc::SimEngine;
use testkit::http::{post_json, request, request_chunks};
use testkit::proc::{Spawned, free_port, wait_http_ready};

fn chat(stream: bool) -> Vec<u8> {
    json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "stream": stream})
        .to_string()
        .into_bytes()
}

#[test]
fn fail_rate_answers_500_and_is_seeded() {
    let e = SimEngine::spawn(&["--time-scale", "0", "--fail-rate", "1"]);
    let r = request(e.addr, "POST", "/v1/chat/completions", &[], &chat(false)).unwrap();
    assert_eq!(r.status, 500);
    assert_eq!(r.json()["error"]["code"], 500);
    assert_eq!(
        request(e.addr, "GET", "/health", &[], b"").unwrap().status,
        200,
        "health is not failed"
    );

    let statuses = |seed: &str| {
        let e = SimEngine::spawn(&["--time-scale", "0", "--fail-rate", "0.5", "--seed", seed]);
        (0..24)
            .map(|_| {
                request(e.addr, "POST", "/v1/chat/completions", &[], &chat(false))
                    .unwrap()
                    .status
            })
            .collect::<Vec<_>>()
    };
    let a = statuses("7");
    assert_eq!(a, statuses("7"), "same seed, same faults");
    assert!(a.contains(&500) && a.contains(&200), "{a:?}");
}

#[test]
fn drop_mid_stream_closes_the_connection_after_some_chunks() {
    let e = SimEngine::spawn(&["--time-scale", "0.01", "--drop-mid-stream-rate", "1"]);
    let err = request_chunks(e.addr, "POST", "/v1/chat/completions", &[], &chat(true)).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof);
    let err = request(e.addr, "POST", "/v1/chat/completions", &[], &chat(false)).unwrap_err();
    assert_eq!(
        err.kind(),
        std::io::ErrorKind::UnexpectedEof,
        "non-stream bodies are cut too"
    );
    // Turned off at run time, streams complete again.
    post_json(e.addr, "/sim/faults", &json!({"drop_mid_stream_rate": 0.0})).unwrap();
    let (r, _) = request_chunks(e.addr, "POST", "/v1/chat/completions", &[], &chat(true)).unwrap();
    assert_eq!(r.sse_data().last().unwrap(), "[DONE]");
}

#[test]
fn stall_first_byte_delays_the_response() {
    let e = SimEngine::spawn(&["--time-scale", "0", "--stall-first-byte-ms", "300"]);
    let t = Instant::now();
    assert_eq!(
        request(e.addr, "POST", "/v1/chat/completions", &[], &chat(false))
            .unwrap()
            .status,
        200
    );
    assert!(t.elapsed() >= Duration::from_millis(300));
    post_json(e.addr, "/sim/faults", &json!({"stall_first_byte_ms": 0})).unwrap();
    let t = Instant::now();
    request(e.addr, "POST", "/v1/chat/completions", &[], &chat(false)).unwrap();
    assert!(t.elapsed() < Duration::from_millis(300));
}

#[test]
fn refuse_connections_at_start_and_at_run_time() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut cmd = Command::new(testkit::bin_path("sim-engine"));
    cmd.args([
        "--listen",
        &addr,
        "--time-scale",
        "0",
        "--refuse-connections-ms",
        "800",
    ]);
    let start = Instant::now();
    let mut child = Spawned::spawn(cmd, "sim-engine").unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(child.is_running());
    assert!(
        std::net::TcpStream::connect(&addr).is_err(),
        "refused while within the first 800 ms"
    );
    assert!(wait_http_ready(
        addr.parse().unwrap(),
        "/health",
        Duration::from_secs(20)
    ));
    assert!(start.elapsed() >= Duration::from_millis(800));

    // At run time: accepted connections are reset for the given time.
    let sock = addr.parse().unwrap();
    let r = post_json(sock, "/sim/faults", &json!({"refuse_connections_ms": 400})).unwrap();
    assert_eq!(
        r.json()["refuse_connections_ms"].as_u64().map(|v| v > 0),
        Some(true)
    );
    assert!(request(sock, "GET", "/health", &[], b"").is_err());
    assert!(wait_http_ready(sock, "/health", Duration::from_secs(10)));
    let bad = post_json(sock, "/sim/faults", &json!({"nonsense": 1})).unwrap();
    assert_eq!(bad.status, 400);
}

#[test]
fn fail_rate_can_be_changed_at_run_time() {
    let e = SimEngine::spawn(&["--time-scale", "0"]);
    post_json(e.addr, "/sim/faults", &json!({"fail_rate": 1.0})).unwrap();
    assert_eq!(
        request(e.addr, "POST", "/v1/completions", &[], br#"{"prompt":"a"}"#)
            .unwrap()
            .status,
        500
    );
    post_json(e.addr, "/sim/faults", &json!({"fail_rate": 0.0})).unwrap();
    assert_eq!(
        request(e.addr, "POST", "/v1/completions", &[], br#"{"prompt":"a"}"#)
            .unwrap()
            .status,
        200
    );
}
