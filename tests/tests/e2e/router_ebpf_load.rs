//! The XDP load signal at work: connections that other clients hold to one
//! backend, unseen by the router's own accounting, steer the router's new
//! cold requests to the other backends.

use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::json;
use testkit::engine_proc::SimEngine;
use testkit::http::post_json;
use testkit::router_proc::Router;

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn connections_held_by_others_shift_cold_requests_away() {
    if !is_root() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI is set but this process is not root: CI runs privileged tests as root"
        );
        eprintln!("skipped: attaching XDP needs root (CI runs as root)");
        return;
    }
    let e: Vec<_> = (0..3)
        .map(|i| SimEngine::spawn(&["--time-scale", "0", "--id", &format!("e{i}")]))
        .collect();
    let urls: Vec<_> = e.iter().map(SimEngine::url).collect();
    // `required`: fail loudly rather than pass without the signal.
    let r = Router::spawn(
        &urls,
        &["--debug-headers"],
        "[ebpf]\nmode = \"required\"\ninterfaces = [\"lo\"]\nrefresh_ms = 50\n",
    );
    let cold = |tag: &str, n: usize| -> Vec<String> {
        (0..n)
            .map(|i| {
                let body = json!({"model": "sim-llama-8b", "max_tokens": 1, "messages": [
                    {"role": "system", "content": format!("{tag} distinct system prompt {i} {}", "z".repeat(300))},
                    {"role": "user", "content": "hi"}]});
                let resp = post_json(r.addr, "/v1/chat/completions", &body).unwrap();
                assert_eq!(resp.status, 200);
                resp.header("x-engine-id").unwrap().to_owned()
            })
            .collect()
    };
    let before = cold("before", 30);
    assert!(
        before.iter().any(|id| id == "e0"),
        "e0 takes cold prompts when idle: {before:?}"
    );

    // 40 connections to e0 that do not go through the router.
    let held: Vec<TcpStream> = (0..40)
        .map(|_| TcpStream::connect(e[0].addr).unwrap())
        .collect();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let b = r.backends();
        let ext = b[0]["external_connections"].as_u64().unwrap_or(0);
        if ext >= 40 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "XDP never saw the 40 connections: {b:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let during = cold("during", 30);
    assert!(
        !during.iter().any(|id| id == "e0"),
        "cold requests still went to the loaded e0: {during:?}"
    );

    // Closed again: e0 is back in the rotation.
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(5);
    while r.backends()[0]["external_connections"]
        .as_u64()
        .unwrap_or(99)
        > 0
    {
        assert!(
            Instant::now() < deadline,
            "XDP never saw the connections close"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let after = cold("after", 30);
    assert!(
        after.iter().any(|id| id == "e0"),
        "e0 takes cold prompts again: {after:?}"
    );
}
