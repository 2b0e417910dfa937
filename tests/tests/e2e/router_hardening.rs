//! Hardening of the data path against hostile clients and misbehaving
//! backends: slow readers, re-sent requests, the route
//! allowlist, response framing, the pool across reloads, HTTP/1.0 streams,
//! the body memory budget and what error answers reveal. Real processes:
//! the router binary, sim-engines, and fake backends on std::net.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;
use testkit::engine_proc::SimEngine;
use testkit::fake_backend::{CHAT_ANSWER, FakeBackend, respond};
use testkit::http::{Response, post_json, request};
use testkit::proc::free_port;
use testkit::router_proc::{Router, raw_exchange};

/// Generous bound on anything that should take well under a second.
const SETTLE: Duration = Duration::from_secs(10);
const IO: Duration = Duration::from_secs(20);
const JSON: &str = "content-type: application/json\r\n";
/// Router flags for tests that do not want active health probes.
const NO_PROBES: &[&str] = &["--health-interval-ms", "0"];

fn chat(user: &str, max_tokens: u32, stream: bool) -> serde_json::Value {
    json!({"model": "sim-llama-8b", "max_tokens": max_tokens, "stream": stream,
           "messages": [{"role": "user", "content": user}]})
}

fn post_chat(addr: SocketAddr, user: &str) -> Response {
    post_json(addr, "/v1/chat/completions", &chat(user, 2, false)).expect("request")
}

/// A fake backend that answers every request with a small chat completion.
fn ok_backend() -> FakeBackend {
    FakeBackend::spawn(|_, s| respond(s, 200, JSON, CHAT_ANSWER))
}

fn assert_openai_error(r: &Response, status: u16) {
    assert_eq!(r.status, status, "{}", r.text());
    let v = r.json();
    assert_eq!(v["error"]["code"], status, "{v}");
    assert!(v["error"]["message"].is_string(), "{v}");
}

/// Splits a raw HTTP/1.x response into status, lower-cased headers and the
/// bytes after the head (not de-chunked).
fn split_raw(raw: &[u8]) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let mut hs = [httparse::EMPTY_HEADER; 64];
    let mut r = httparse::Response::new(&mut hs);
    let n = match r.parse(raw) {
        Ok(httparse::Status::Complete(n)) => n,
        _ => panic!("no response head in {:?}", String::from_utf8_lossy(raw)),
    };
    let headers = r
        .headers
        .iter()
        .map(|h| {
            (
                h.name.to_ascii_lowercase(),
                String::from_utf8_lossy(h.value).to_string(),
            )
        })
        .collect();
    (r.code.unwrap_or(0), headers, raw[n..].to_vec())
}

fn has_header(headers: &[(String, String)], name: &str) -> bool {
    headers.iter().any(|(k, _)| k == name)
}

fn wait_until(timeout: Duration, mut pred: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if pred() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    pred()
}

// ---- 1. slow readers ----

#[test]
fn a_client_that_stops_reading_is_cut_and_gives_its_slot_back() {
    // The backend pushes a 1 GiB answer for "huge" until its write fails.
    let cut = Arc::new(AtomicBool::new(false));
    let written = Arc::new(AtomicUsize::new(0));
    let (c, w) = (cut.clone(), written.clone());
    let b = FakeBackend::spawn(move |req, s| {
        if !req.body.windows(4).any(|x| x == b"huge") {
            return respond(s, 200, JSON, CHAT_ANSWER);
        }
        let _ = s.write_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 1073741824\r\n\r\n",
        );
        let block = vec![b'x'; 64 * 1024];
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(60) {
            if s.write_all(&block).is_err() {
                c.store(true, Ordering::SeqCst);
                return false;
            }
            w.fetch_add(block.len(), Ordering::SeqCst);
        }
        false
    });
    let r = Router::spawn(
        &[b.url()],
        NO_PROBES,
        "[limits]\nmax_in_flight_per_backend = 1\n[timeouts]\nclient_write_ms = 1000\nqueue_ms = 200\n",
    );
    let rss_before = r.rss_kib();
    // A client with a tiny receive window that never reads.
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    sock.connect(&r.addr.into()).unwrap();
    let mut stalled: TcpStream = sock.into();
    let body = chat("huge", 100_000, true).to_string();
    write!(
        stalled,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    assert!(
        wait_until(Duration::from_secs(30), || cut.load(Ordering::SeqCst)),
        "the router kept the backend request of a client that reads nothing for 30 s"
    );
    let pushed = written.load(Ordering::SeqCst);
    assert!(
        pushed < 64 << 20,
        "the router buffered {pushed} bytes for a client that reads nothing"
    );
    assert!(
        r.wait_backend(&b.url(), SETTLE, |b| b["in_flight"] == 0),
        "the in-flight slot was not given back: {:?}",
        r.backends()
    );
    let resp = post_chat(r.addr, "normal");
    assert_eq!(resp.status, 200, "{}", resp.text());
    let grown = r.rss_kib().saturating_sub(rss_before);
    assert!(grown < 64 * 1024, "router RSS grew by {grown} KiB");
    drop(stalled);
}

// ---- 3. at most one delivery ----

#[test]
fn a_fully_delivered_request_reaches_one_backend_at_most_once() {
    let dropping = Arc::new(AtomicBool::new(false));
    let fleet: Vec<FakeBackend> = (0..2)
        .map(|_| {
            let d = dropping.clone();
            FakeBackend::spawn(move |_, s| {
                // Read the whole request, then close without a byte.
                !d.load(Ordering::SeqCst) && respond(s, 200, JSON, CHAT_ANSWER)
            })
        })
        .collect();
    let urls: Vec<String> = fleet.iter().map(FakeBackend::url).collect();
    let mut flags = vec!["--policy", "round-robin"];
    flags.extend_from_slice(NO_PROBES);
    let r = Router::spawn(
        &urls,
        &flags,
        "[retry]\nmax_attempts = 3\n[health]\npassive_fall = 100\n",
    );
    // Pooled connections to both backends.
    for i in 0..8 {
        assert_eq!(post_chat(r.addr, &format!("warm {i}")).status, 200);
    }
    dropping.store(true, Ordering::SeqCst);
    let total = || fleet.iter().map(FakeBackend::requests).sum::<usize>();
    for i in 0..2 {
        let before = total();
        let resp = post_chat(r.addr, &format!("generate once {i}"));
        assert_openai_error(&resp, 502);
        assert_eq!(
            total() - before,
            1,
            "one client request was delivered {} times",
            total() - before
        );
    }
    let m = r.metrics();
    assert!(m.contains("prefix_router_resends_total"), "{m}");
}

/// `prefix_router_resends_total{reason="stale_pooled"}` (0 before any).
fn stale_pooled_resends(r: &Router) -> u64 {
    r.metrics()
        .lines()
        .find_map(|l| l.strip_prefix("prefix_router_resends_total{reason=\"stale_pooled\"} "))
        .map_or(0, |v| v.trim().parse().expect("a counter"))
}

/// One worker, so every request finds the pool its predecessor left.
const ONE_POOL: &[&str] = &["--health-interval-ms", "0", "--workers", "1"];

/// A backend like uvicorn with a short keep-alive timeout: it closes a
/// connection that carries no new request within 100 ms of an answer.
fn closes_idle_after_100ms() -> FakeBackend {
    FakeBackend::spawn(|_, s| {
        respond(s, 200, JSON, CHAT_ANSWER);
        let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
        let mut one = [0u8; 1];
        // Anything but a new request within 100 ms: close.
        matches!(s.peek(&mut one), Ok(n) if n > 0) && {
            let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
            true
        }
    })
}

/// A one-worker router in front of `b`, after `n` chat turns that each
/// answered 200, `pause` apart.
fn turns(b: &FakeBackend, n: usize, pause: Duration) -> Router {
    let r = Router::spawn(&[b.url()], ONE_POOL, "");
    for i in 0..n {
        let resp = post_chat(r.addr, &format!("turn {i}"));
        assert_eq!(resp.status, 200, "{}", resp.text());
        std::thread::sleep(pause);
    }
    r
}

#[test]
fn a_pooled_connection_the_backend_closed_while_idle_is_not_used() {
    // Idle over a second: the pool checks the connection before use and
    // finds it closed, so nothing is sent on it.
    let b = closes_idle_after_100ms();
    let r = turns(&b, 3, Duration::from_millis(1_300));
    assert_eq!(b.requests(), 3);
    assert_eq!(stale_pooled_resends(&r), 0);
}

#[test]
fn a_request_sent_on_a_connection_closed_before_it_was_read_goes_again() {
    // Idle under a second: the request is written to the closed connection
    // unchecked (no system call per request under load). The backend's
    // close acknowledged none of it, so it cannot have been read: the
    // router sends it again on a fresh connection, and the client sees
    // only its answer.
    let b = closes_idle_after_100ms();
    let r = turns(&b, 3, Duration::from_millis(400));
    assert_eq!(b.requests(), 3, "each request read once");
    // The second closed connection is found by the check before use: after
    // the first, the pool watches this backend's connections.
    assert_eq!(stale_pooled_resends(&r), 1, "{}", r.metrics());
}

#[test]
fn a_backend_that_closes_after_every_answer_costs_one_resend() {
    // It answers and closes, with no `Connection: close` to say so. The
    // first reuse finds that out by a re-send; from then on the pool checks
    // this backend's connections before use, so no request goes twice.
    let b = FakeBackend::spawn(|_, s| {
        respond(s, 200, JSON, CHAT_ANSWER);
        false
    });
    // 50 ms apart: long enough for each close to arrive before the next.
    let r = turns(&b, 8, Duration::from_millis(50));
    assert_eq!(b.requests(), 8, "each request read once");
    assert_eq!(stale_pooled_resends(&r), 1, "{}", r.metrics());
}

#[test]
fn a_backend_that_resets_a_request_it_read_gets_no_second_copy() {
    // An abortive close (RST, SO_LINGER 0) right after reading a request:
    // the backend may not have acknowledged the bytes it read, so only a
    // plain close (FIN) is taken as "closed before reading".
    let aborting = Arc::new(AtomicBool::new(false));
    let a = aborting.clone();
    let b = FakeBackend::spawn(move |_, s| {
        if a.load(Ordering::SeqCst) {
            let _ = socket2::SockRef::from(&*s).set_linger(Some(Duration::ZERO));
            return false;
        }
        respond(s, 200, JSON, CHAT_ANSWER)
    });
    let r = Router::spawn(
        &[b.url()],
        ONE_POOL,
        "[retry]\nmax_attempts = 3\n[health]\npassive_fall = 100\n",
    );
    assert_eq!(post_chat(r.addr, "warm").status, 200);
    aborting.store(true, Ordering::SeqCst);
    for i in 0..2 {
        let before = b.requests();
        let resp = post_chat(r.addr, &format!("generate once {i}"));
        assert_openai_error(&resp, 502);
        assert_eq!(b.requests() - before, 1, "delivered more than once");
    }
    assert_eq!(stale_pooled_resends(&r), 0);
}

// ---- 4. the route allowlist ----

#[test]
fn only_the_inference_api_is_forwarded() {
    // A real engine: management routes through the router change nothing.
    let e = SimEngine::spawn(&["--time-scale", "0"]);
    let r = Router::spawn(&[e.url()], NO_PROBES, "");
    for (method, path, body) in [
        ("POST", "/sim/faults", &br#"{"fail_rate": 1.0}"#[..]),
        ("POST", "/reset_prefix_cache", b""),
        ("GET", "/metrics", b""),
        ("POST", "/sim/reset_cache", b""),
    ] {
        let resp = request(r.addr, method, path, &[], body).unwrap();
        assert_openai_error(&resp, 404);
    }
    assert_eq!(
        post_chat(e.addr, "direct").status,
        200,
        "faults were applied"
    );
    assert_eq!(e.requests_served(), 1);

    // A counting fake: what reaches a backend, and in which form.
    let b = ok_backend();
    let r = Router::spawn(
        &[b.url()],
        NO_PROBES,
        "[routes]\nextra_allowed = [\"/v1/embeddings\"]\n",
    );
    let send = |raw: String| {
        let out = raw_exchange(r.addr, raw.as_bytes(), IO).expect("exchange");
        split_raw(&out).0
    };
    let bad = "{not json";
    let post = |method: &str, target: &str, body: &str| {
        format!(
            "{method} {target} HTTP/1.1\r\nhost: t\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    for target in [
        "//v1/chat/completions",
        "/v1/chat/completions/",
        "/v1/./chat/completions",
        "/x/../v1/chat/completions",
        "/v1/chat/completion%73",
        "http://engine.internal/v1/chat/completions",
    ] {
        assert_eq!(send(post("POST", target, bad)), 400, "{target}");
    }
    for (method, target) in [
        ("POST", "/sim/faults"),
        ("POST", "/reset_prefix_cache"),
        ("GET", "/metrics"),
        ("GET", "/health"),
        ("POST", "/v1/chat%2Fcompletions"),
    ] {
        assert_eq!(send(post(method, target, "{}")), 404, "{method} {target}");
    }
    let lower = send(post("post", "/v1/chat/completions", bad));
    assert!(
        [400, 405, 501].contains(&lower),
        "a lowercase method got {lower}"
    );
    assert_eq!(b.requests(), 0, "{:?}", b.log());

    let good = chat("hello", 2, false).to_string();
    for target in [
        "//v1/chat/completions",
        "http://engine.internal/v1/chat/completions?x=1",
    ] {
        assert_eq!(send(post("POST", target, &good)), 200, "{target}");
    }
    assert_eq!(send(post("POST", "/v1/embeddings", "{}")), 200);
    let get = |t: &str| format!("GET {t} HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n");
    assert_eq!(send(get("/v1/models")), 200);
    let targets: Vec<String> = b.log().into_iter().map(|q| q.target).collect();
    assert_eq!(
        targets,
        [
            "/v1/chat/completions",
            "/v1/chat/completions?x=1",
            "/v1/embeddings",
            "/v1/models"
        ]
    );
}

// ---- 6. response framing ----

#[test]
fn unsafe_response_framing_is_refused_or_cleaned() {
    let b = FakeBackend::spawn(|req, s| {
        let body = String::from_utf8_lossy(&req.body);
        let raw: &[u8] = if body.contains("cl-te") {
            b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
        } else if body.contains("chunked-gzip") {
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, gzip\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
        } else if body.contains("conn-listed") {
            b"HTTP/1.1 200 OK\r\nconnection: close, x-secret\r\nx-secret: s3cr3t\r\ncontent-length: 2\r\n\r\nok"
        } else if body.contains("upgrade") {
            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
        } else if body.contains("bad-chunk") {
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhello\r\n"
        } else {
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
        };
        let _ = s.write_all(raw);
        false
    });
    let r = Router::spawn(
        &[b.url()],
        NO_PROBES,
        "[retry]\nmax_attempts = 1\n[health]\npassive_fall = 100\n",
    );
    for case in ["cl-te", "chunked-gzip", "upgrade"] {
        let resp = post_chat(r.addr, case);
        assert_openai_error(&resp, 502);
    }
    let resp = post_chat(r.addr, "conn-listed");
    assert_eq!(resp.status, 200);
    assert_eq!(resp.header("x-secret"), None, "{:?}", resp.headers);
    assert_eq!(resp.body, b"ok");

    let errors = |r: &Router| r.backend(&b.url())["errors"].as_u64().unwrap();
    let before = errors(&r);
    let resp = post_chat(r.addr, "bad-chunk");
    assert_openai_error(&resp, 502);
    assert_eq!(
        errors(&r),
        before + 1,
        "a broken answer counts against the backend"
    );
    assert_eq!(post_chat(r.addr, "fine").status, 200);
}

// ---- 7. the pool across reloads ----

#[test]
fn pooled_connections_do_not_outlive_a_reload() {
    let (a, b, c) = (ok_backend(), ok_backend(), ok_backend());
    let path = std::env::temp_dir().join(format!(
        "router-hardening-reload-{}-{}.toml",
        std::process::id(),
        free_port()
    ));
    let write = |urls: &[&FakeBackend]| {
        let list: Vec<String> = urls.iter().map(|u| format!("{:?}", u.url())).collect();
        std::fs::write(
            &path,
            format!(
                "policy = \"round-robin\"\nbackends = [{}]\n[health]\ninterval_ms = 0\n",
                list.join(", ")
            ),
        )
        .unwrap();
    };
    write(&[&a, &b]);
    let r = Router::spawn(&[], &["--config", path.to_str().unwrap()], "");
    // Pooled connections to A on both workers.
    let warm: Vec<_> = (0..4)
        .map(|t| {
            let addr = r.addr;
            std::thread::spawn(move || {
                for i in 0..10 {
                    assert_eq!(post_chat(addr, &format!("warm {t} {i}")).status, 200);
                }
            })
        })
        .collect();
    for h in warm {
        h.join().unwrap();
    }
    assert!(a.requests() > 0);
    let reload = || {
        let resp = request(r.admin, "POST", "/admin/reload", &[], b"").unwrap();
        assert_eq!(resp.status, 200, "{}", resp.text());
    };
    write(&[&b]);
    reload();
    write(&[&b, &c]);
    reload();
    assert!(
        wait_until(SETTLE, || a.open_connections() == 0),
        "{} pooled connections to the removed backend stayed open",
        a.open_connections()
    );
    let at_a = a.requests();
    for i in 0..40 {
        assert_eq!(post_chat(r.addr, &format!("after {i}")).status, 200);
    }
    assert_eq!(a.requests(), at_a, "requests reached the removed backend");
    assert!(c.requests() > 0, "the new backend got nothing");
    std::fs::remove_file(&path).ok();
}

// ---- 9. HTTP/1.0 clients ----

#[test]
fn http10_clients_get_a_close_delimited_stream() {
    let e = SimEngine::spawn(&["--time-scale", "0"]);
    let r = Router::spawn(&[e.url()], NO_PROBES, "");
    let body = chat("an old client", 8, true).to_string();
    let raw = format!(
        "POST /v1/chat/completions HTTP/1.0\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let out = raw_exchange(r.addr, raw.as_bytes(), IO).unwrap();
    let (status, headers, rest) = split_raw(&out);
    assert_eq!(status, 200);
    assert!(!has_header(&headers, "transfer-encoding"), "{headers:?}");
    let text = String::from_utf8_lossy(&rest);
    assert!(text.starts_with("data: "), "not plain SSE: {text:?}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text:?}");
}

// ---- 10. the body memory budget ----

/// Starts an upload of a `len`-byte chat body; sends all but `hold` bytes.
fn start_upload(addr: SocketAddr, len: usize) -> (TcpStream, Vec<u8>) {
    let prefix = br#"{"model":"m","max_tokens":1,"messages":[{"role":"user","content":""#;
    let suffix = br#""}]}"#;
    let mut body = Vec::with_capacity(len);
    body.extend_from_slice(prefix);
    body.resize(len - suffix.len(), b'a');
    body.extend_from_slice(suffix);
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(IO)).unwrap();
    s.set_write_timeout(Some(IO)).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {len}\r\n\r\n"
    )
    .unwrap();
    (s, body)
}

fn read_all(s: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    let mut tmp = [0u8; 16 * 1024];
    loop {
        match s.read(&mut tmp) {
            Ok(0) | Err(_) => return out,
            Ok(n) => out.extend_from_slice(&tmp[..n]),
        }
    }
}

#[test]
fn buffered_bodies_have_a_global_budget() {
    let b = ok_backend();
    let r = Router::spawn(
        &[b.url()],
        NO_PROBES,
        "[limits]\nmax_body_bytes = 33554432\nmax_buffered_body_bytes = 16777216\n",
    );
    let rss_before = r.rss_kib();
    const BIG: usize = 12 << 20;
    // The first upload holds 11 MiB of the 16 MiB budget.
    let (mut first, body) = start_upload(r.addr, BIG);
    first.write_all(&body[..11 << 20]).unwrap();
    let buffered = |r: &Router| -> u64 {
        r.metrics()
            .lines()
            .find_map(|l| l.strip_prefix("prefix_router_buffered_body_bytes "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    assert!(
        wait_until(SETTLE, || buffered(&r) >= 10 << 20),
        "the first upload is not buffered: {} bytes",
        buffered(&r)
    );
    // The second cannot get its 12 MiB.
    let (mut second, body2) = start_upload(r.addr, BIG);
    let mut reader = second.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        let _ = second.write_all(&body2);
    });
    let out = read_all(&mut reader);
    let (status, headers, _) = split_raw(&out);
    assert_eq!(status, 503, "{}", String::from_utf8_lossy(&out));
    assert!(has_header(&headers, "retry-after"), "{headers:?}");
    writer.join().unwrap();
    // A small request still gets through.
    assert_eq!(post_chat(r.addr, "small").status, 200);
    // The first completes.
    first.write_all(&body[11 << 20..]).unwrap();
    let out = read_all(&mut first);
    assert_eq!(split_raw(&out).0, 200);
    // Big bodies one after another: the memory goes back.
    for _ in 0..3 {
        let (mut s, body) = start_upload(r.addr, BIG);
        s.write_all(&body).unwrap();
        assert_eq!(split_raw(&read_all(&mut s)).0, 200);
    }
    eprintln!(
        "router RSS: {rss_before} KiB at start, {} KiB after the uploads",
        r.rss_kib()
    );
    let settled = wait_until(SETTLE, || {
        r.rss_kib().saturating_sub(rss_before) < 24 * 1024
    });
    assert!(
        settled,
        "router RSS stayed {} KiB above where it started",
        r.rss_kib().saturating_sub(rss_before)
    );
}

// ---- 11. what errors reveal ----

/// A chat of one 28 MiB message with a newline every few words (an
/// escape all through it): the router keeps of the prompt what routing
/// reads, validates the rest in place and forwards the body whole, so it
/// holds about the body itself. Before, its scan decoded the whole
/// message into one buffer and copied it into another: three times the
/// body at once.
#[test]
fn a_huge_chat_costs_the_router_about_its_own_size_in_memory() {
    let b = ok_backend();
    let r = Router::spawn(&[b.url()], NO_PROBES, "");
    assert_eq!(post_chat(r.addr, "a small chat first").status, 200);
    let text = "lorem ipsum dolor sit amet\n".repeat((28 << 20) / 27);
    let body = serde_json::to_vec(&chat(&text, 2, false)).expect("json");
    let before = r.peak_rss_kib();
    let answer = request(
        r.addr,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        &body,
    )
    .expect("an answer");
    assert_eq!(answer.status, 200, "{}", answer.text());
    let sent = b.log().pop().expect("the backend got it").body;
    assert!(sent == body, "forwarded whole and unchanged");
    let grew = r.peak_rss_kib().saturating_sub(before);
    let body_kib = body.len() as u64 / 1024;
    // About the body (the router of before: 72 MiB for this 29 MiB one).
    assert!(
        grew < body_kib * 3 / 2,
        "the router's peak RSS grew {} MiB for a {} MiB body",
        grew / 1024,
        body_kib / 1024
    );
}

#[test]
fn client_errors_name_no_internal_address_and_engine_headers_are_dropped() {
    let dead = format!("http://127.0.0.1:{}", free_port());
    let r = Router::spawn(std::slice::from_ref(&dead), NO_PROBES, "");
    let resp = post_chat(r.addr, "anyone there");
    assert_openai_error(&resp, 502);
    let text = resp.text();
    let port = dead.rsplit(':').next().unwrap();
    for leak in ["127.0.0.1", port, "os error", "refused"] {
        assert!(!text.contains(leak), "the error names {leak:?}: {text}");
    }
    assert!(
        r.child.stderr_tail(8192).contains(&dead),
        "the log keeps the detail"
    );
    let r = Router::spawn(
        std::slice::from_ref(&dead),
        &["--debug-headers", "--health-interval-ms", "0"],
        "",
    );
    let resp = post_chat(r.addr, "anyone there");
    assert!(
        resp.text().contains(&dead),
        "debug mode explains: {}",
        resp.text()
    );

    let e = SimEngine::spawn(&["--time-scale", "0", "--id", "e7"]);
    let r = Router::spawn(&[e.url()], NO_PROBES, "");
    let resp = post_chat(r.addr, "who are you");
    assert_eq!(resp.status, 200);
    assert_eq!(resp.header("x-engine-id"), None, "{:?}", resp.headers);
    assert_eq!(resp.header("server"), None, "{:?}", resp.headers);
    let r = Router::spawn(
        &[e.url()],
        &["--debug-headers", "--health-interval-ms", "0"],
        "",
    );
    assert_eq!(post_chat(r.addr, "who").header("x-engine-id"), Some("e7"));
}
