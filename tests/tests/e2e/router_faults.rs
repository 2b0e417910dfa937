//! Backend faults with real processes: an engine killed mid-stream, engines
//! that answer garbage, 500s, stall or refuse, all backends dead; passive
//! ejection and active health hysteresis as `/admin/backends` shows them;
//! and no request sent twice once the engine has answered bytes.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::json;
use testkit::engine_proc::SimEngine;
use testkit::http::{Response, post_json, request_chunks};
use testkit::proc::free_port;
use testkit::router_proc::Router;

/// Generous bound on anything that should take well under a second.
const SETTLE: Duration = Duration::from_secs(10);
const IO_TIMEOUT: Duration = Duration::from_secs(30);

fn chat(user: &str, max_tokens: u32, stream: bool) -> serde_json::Value {
    json!({"model": "sim-llama-8b", "max_tokens": max_tokens, "stream": stream,
           "messages": [{"role": "user", "content": user}]})
}

fn post_chat(r: &Router, user: &str) -> Response {
    post_json(r.addr, "/v1/chat/completions", &chat(user, 2, false)).expect("request")
}

fn assert_openai_error(r: &Response, status: u16) {
    assert_eq!(r.status, status, "{}", r.text());
    let v = r.json();
    assert_eq!(v["error"]["code"], status, "{v}");
    assert!(v["error"]["message"].is_string(), "{v}");
}

/// How a streamed response ended.
#[derive(Debug, PartialEq)]
enum End {
    /// The terminal chunk arrived.
    Complete,
    /// The connection closed (or reset) before it.
    Truncated,
}

/// Sends a streaming chat request, reports the `x-engine-id` of the answer
/// on `head_tx` once the head is in, then reads to the end.
fn stream_chat(addr: SocketAddr, user: &str, head_tx: mpsc::Sender<String>) -> End {
    let body = chat(user, 400, true).to_string();
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut buf = Vec::new();
    let mut tmp = [0u8; 16 * 1024];
    let mut sent_head = false;
    loop {
        if !sent_head {
            let mut hs = [httparse::EMPTY_HEADER; 32];
            let mut resp = httparse::Response::new(&mut hs);
            if let Ok(httparse::Status::Complete(_)) = resp.parse(&buf) {
                assert_eq!(resp.code, Some(200));
                let id = resp
                    .headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case("x-engine-id"))
                    .map(|h| String::from_utf8_lossy(h.value).into_owned())
                    .unwrap_or_default();
                head_tx.send(id).unwrap();
                sent_head = true;
            }
        }
        // The last chunk of a chunked body.
        if buf.ends_with(b"\r\n0\r\n\r\n") {
            return End::Complete;
        }
        match s.read(&mut tmp) {
            Ok(0) => return End::Truncated,
            Ok(n) => buf.extend_from_slice(&tmp[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return End::Truncated,
            Err(e) => panic!("stream hung for {IO_TIMEOUT:?}: {e}"),
        }
    }
}

#[test]
fn killing_an_engine_mid_stream_ends_its_streams_and_spares_the_others() {
    // Real time: 400 tokens at ~15 ms a step take about 6 s.
    let mut a = SimEngine::spawn(&["--id", "a"]);
    let b = SimEngine::spawn(&["--id", "b"]);
    let r = Router::spawn(
        &[a.url(), b.url()],
        &[
            "--policy",
            "round-robin",
            "--health-interval-ms",
            "0",
            "--debug-headers",
        ],
        "",
    );
    let (tx, rx) = mpsc::channel();
    let streams: Vec<_> = (0..4)
        .map(|i| {
            let (addr, tx) = (r.addr, tx.clone());
            std::thread::spawn(move || stream_chat(addr, &format!("story {i}"), tx))
        })
        .collect();
    let ids: Vec<String> = (0..4)
        .map(|_| rx.recv_timeout(SETTLE).expect("every stream started"))
        .collect();
    assert_eq!(ids.iter().filter(|i| *i == "a").count(), 2, "{ids:?}");
    let killed_at = Instant::now();
    a.child.child.kill().unwrap();
    let ends: Vec<End> = streams.into_iter().map(|h| h.join().unwrap()).collect();
    // Pair the ends with engines: the same count on each side must match.
    let truncated = ends.iter().filter(|e| **e == End::Truncated).count();
    let complete = ends.iter().filter(|e| **e == End::Complete).count();
    assert_eq!(
        (truncated, complete),
        (2, 2),
        "the two streams on the killed engine end early; the two on the other finish ({ends:?})"
    );
    eprintln!("streams ended {:?} after the kill", killed_at.elapsed());
    // New requests are not lost: the dead engine's connect errors are retried.
    for i in 0..6 {
        assert_eq!(post_chat(&r, &format!("after {i}")).status, 200);
    }
}

/// A TCP server that answers every connection with bytes that are not HTTP,
/// counting the connections it accepted.
fn garbage_server() -> (SocketAddr, Arc<AtomicUsize>, Arc<AtomicBool>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.set_nonblocking(true).unwrap();
    let addr = l.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let (count, flag) = (accepted.clone(), stop.clone());
    std::thread::spawn(move || {
        while !flag.load(Ordering::Relaxed) {
            match l.accept() {
                Ok((mut s, _)) => {
                    count.fetch_add(1, Ordering::Relaxed);
                    s.set_nonblocking(false).unwrap();
                    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                    let mut tmp = [0u8; 4096];
                    let _ = s.read(&mut tmp);
                    let _ = s.write_all(b"\x16\x03\x01 SSH-2.0-not-http \xff\xfe\r\n\r\ngarbage");
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    });
    (addr, accepted, stop)
}

#[test]
fn a_garbage_answering_backend_is_a_502_then_ejected() {
    let (garbage, accepted, stop) = garbage_server();
    let good = SimEngine::spawn(&["--time-scale", "0", "--id", "good"]);
    let gurl = format!("http://{garbage}");
    // Active checks off: only failed requests can eject it.
    let r = Router::spawn(
        &[gurl.clone(), good.url()],
        &["--policy", "round-robin", "--health-interval-ms", "0"],
        "[health]\npassive_fall = 2\n",
    );
    let mut statuses = Vec::new();
    for i in 0..8 {
        let resp = post_chat(&r, &format!("q{i}"));
        if resp.status == 502 {
            assert_openai_error(&resp, 502);
        } else {
            assert_eq!(resp.status, 200, "{}", resp.text());
        }
        statuses.push(resp.status);
        if r.backend(&gurl)["healthy"] == false {
            break;
        }
    }
    assert_eq!(
        statuses.iter().filter(|s| **s == 502).count(),
        2,
        "exactly passive_fall garbage answers before ejection: {statuses:?}"
    );
    let b = r.backend(&gurl);
    assert_eq!(b["healthy"], false, "{b}");
    let seen = accepted.load(Ordering::Relaxed);
    for i in 0..10 {
        assert_eq!(post_chat(&r, &format!("after {i}")).status, 200);
    }
    assert_eq!(
        accepted.load(Ordering::Relaxed),
        seen,
        "an ejected backend gets no traffic"
    );
    stop.store(true, Ordering::Relaxed);
}

#[test]
fn engine_500s_reach_the_client_and_eject_the_engine() {
    let bad = SimEngine::spawn(&["--time-scale", "0", "--fail-rate", "1", "--id", "bad"]);
    let good = SimEngine::spawn(&["--time-scale", "0", "--id", "good"]);
    let r = Router::spawn(
        &[bad.url(), good.url()],
        &[
            "--policy",
            "round-robin",
            "--health-interval-ms",
            "0",
            "--debug-headers",
        ],
        "[health]\npassive_fall = 3\n",
    );
    let mut fails = 0;
    for i in 0..20 {
        let resp = post_chat(&r, &format!("q{i}"));
        match resp.status {
            500 => {
                // The engine's own answer, passed through, not retried.
                assert_eq!(resp.header("x-engine-id"), Some("bad"));
                assert!(resp.text().contains("simulated failure"), "{}", resp.text());
                fails += 1;
            }
            200 => assert_eq!(resp.header("x-engine-id"), Some("good")),
            s => panic!("unexpected {s}: {}", resp.text()),
        }
        if fails == 3 {
            break;
        }
    }
    assert_eq!(fails, 3);
    // The failure is counted once the answer has been relayed, a moment
    // after the client has it.
    assert!(
        r.wait_backend(&bad.url(), SETTLE, |b| b["healthy"] == false),
        "ejected after passive_fall 500s"
    );
    let requests = r.backend(&bad.url())["requests"].as_u64().unwrap();
    for i in 0..10 {
        let resp = post_chat(&r, &format!("after {i}"));
        assert_eq!(resp.status, 200);
        assert_eq!(resp.header("x-engine-id"), Some("good"));
    }
    assert_eq!(
        r.backend(&bad.url())["requests"].as_u64().unwrap(),
        requests,
        "no traffic after ejection"
    );
}

#[test]
fn a_stalled_engine_is_a_504_after_the_first_byte_timeout() {
    let stall_ms = 5000;
    let e = SimEngine::spawn(&[
        "--time-scale",
        "0",
        "--stall-first-byte-ms",
        &stall_ms.to_string(),
    ]);
    let r = Router::spawn(
        &[e.url()],
        &["--health-interval-ms", "0"],
        "[timeouts]\nbackend_first_byte_ms = 300\n",
    );
    let t = Instant::now();
    let resp = post_chat(&r, "hello");
    let took = t.elapsed();
    assert_openai_error(&resp, 504);
    assert!(
        took < Duration::from_millis(stall_ms),
        "answered before the engine would have ({took:?})"
    );
    // Not retried elsewhere (the engine may be generating): one request seen.
    assert_eq!(r.backend(&e.url())["requests"], 1);
}

#[test]
fn refused_connections_are_retried_on_another_backend() {
    // A port nobody listens on. (An engine that accepts and then resets is
    // not retried: the request may have been written whole before the reset,
    // and a request written whole is never sent twice; see router_hardening.)
    let closed = format!("http://127.0.0.1:{}", free_port());
    let good = SimEngine::spawn(&["--time-scale", "0", "--id", "good"]);
    let r = Router::spawn(
        &[closed.clone(), good.url()],
        &[
            "--policy",
            "round-robin",
            "--health-interval-ms",
            "0",
            "--debug-headers",
        ],
        // Keep the broken one in rotation so every request meets it, and
        // let every request retry (the default budget allows 20%).
        "[health]\npassive_fall = 1000\n[retry]\nbudget_percent = 200\n",
    );
    for i in 0..12 {
        let resp = post_chat(&r, &format!("q{i}"));
        assert_eq!(resp.status, 200, "request {i}: {}", resp.text());
        assert_eq!(resp.header("x-engine-id"), Some("good"));
    }
    assert!(r.backend(&closed)["errors"].as_u64().unwrap() > 0);
    assert!(
        r.metrics()
            .contains("prefix_router_resends_total{reason=\"connect_failed\"} 6")
    );
}

#[test]
fn all_backends_dead_is_a_prompt_502_then_503_with_retry_after() {
    let urls: Vec<String> = (0..2)
        .map(|_| format!("http://127.0.0.1:{}", free_port()))
        .collect();
    let r = Router::spawn(
        &urls,
        &[],
        "[health]\ninterval_ms = 100\nfall = 1\npassive_fall = 2\n",
    );
    let t = Instant::now();
    let first = post_chat(&r, "anyone?");
    assert!(matches!(first.status, 502 | 503), "{}", first.status);
    assert_openai_error(&first, first.status);
    assert!(t.elapsed() < SETTLE, "no hang");
    for u in &urls {
        assert!(r.wait_backend(u, SETTLE, |b| b["healthy"] == false));
    }
    let resp = post_chat(&r, "anyone now?");
    assert_openai_error(&resp, 503);
    assert_eq!(resp.header("retry-after"), Some("1"));
}

#[test]
fn a_request_is_not_sent_twice_once_the_engine_answered_bytes() {
    let dropping = SimEngine::spawn(&[
        "--time-scale",
        "0",
        "--drop-mid-stream-rate",
        "1",
        "--id",
        "dropping",
    ]);
    let good = SimEngine::spawn(&["--time-scale", "0", "--id", "good"]);
    let r = Router::spawn(
        &[dropping.url(), good.url()],
        &[
            "--policy",
            "round-robin",
            "--health-interval-ms",
            "0",
            "--debug-headers",
        ],
        "[health]\npassive_fall = 1000\n",
    );
    let (mut truncated, mut complete) = (0u64, 0u64);
    for i in 0..8 {
        let stream = i % 2 == 0;
        let body = serde_json::to_vec(&chat(&format!("q{i}"), 16, stream)).unwrap();
        match request_chunks(r.addr, "POST", "/v1/chat/completions", &[], &body) {
            Ok((resp, _)) => {
                assert_eq!(resp.status, 200);
                assert_eq!(resp.header("x-engine-id"), Some("good"));
                complete += 1;
            }
            Err(e) => {
                assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "{e}");
                truncated += 1;
            }
        }
    }
    assert!(truncated > 0 && complete > 0, "{truncated} {complete}");
    assert_eq!(
        SimEngine::requests_served(&dropping),
        truncated,
        "each truncated request reached the dropping engine exactly once"
    );
    assert_eq!(
        SimEngine::requests_served(&good),
        complete,
        "and none was replayed on the good one"
    );
}

#[test]
fn active_health_flips_only_after_fall_results_and_back_after_rise() {
    let e = SimEngine::spawn(&["--time-scale", "0", "--id", "flaky"]);
    let other = SimEngine::spawn(&["--time-scale", "0", "--id", "other"]);
    let r = Router::spawn(
        &[e.url(), other.url()],
        &["--debug-headers"],
        "[health]\ninterval_ms = 200\ntimeout_ms = 500\nfall = 3\nrise = 2\n",
    );
    let healthy = |r: &Router| r.backend(&e.url())["healthy"] == true;
    assert!(healthy(&r));
    // A blip shorter than two probe intervals fails at most two probes: no flip.
    post_json(
        e.addr,
        "/sim/faults",
        &json!({"refuse_connections_ms": 250}),
    )
    .unwrap();
    let watch_until = Instant::now() + Duration::from_millis(1200);
    while Instant::now() < watch_until {
        assert!(healthy(&r), "flipped on fewer than `fall` failed probes");
        std::thread::sleep(Duration::from_millis(20));
    }
    // A real outage: out after `fall` probes, and no traffic while out.
    post_json(
        e.addr,
        "/sim/faults",
        &json!({"refuse_connections_ms": 3000}),
    )
    .unwrap();
    assert!(
        r.wait_backend(&e.url(), SETTLE, |b| b["healthy"] == false),
        "taken out during the outage"
    );
    let requests = r.backend(&e.url())["requests"].as_u64().unwrap();
    for i in 0..6 {
        let resp = post_chat(&r, &format!("during {i}"));
        assert_eq!(resp.status, 200);
        assert_eq!(resp.header("x-engine-id"), Some("other"));
    }
    assert_eq!(r.backend(&e.url())["requests"].as_u64().unwrap(), requests);
    // Back after the outage ends and `rise` probes pass.
    assert!(
        r.wait_backend(&e.url(), SETTLE, |b| b["healthy"] == true),
        "back after recovery"
    );
}
