//! Data-path limits: a request over `limits.max_in_flight_per_backend` waits
//! up to `timeouts.queue_ms` for room and is then served, or answered 503
//! with Retry-After; a connection over `limits.max_client_connections` gets
//! 503 and is closed, and the next one is served once a slot frees.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::json;
use testkit::engine_proc::SimEngine;
use testkit::http::{Response, post_json};
use testkit::router_proc::Router;

const SETTLE: Duration = Duration::from_secs(10);

fn post_chat(addr: std::net::SocketAddr, user: &str) -> Response {
    let body = json!({"max_tokens": 2, "messages": [{"role": "user", "content": user}]});
    post_json(addr, "/v1/chat/completions", &body).expect("request")
}

#[test]
fn a_request_over_the_in_flight_limit_waits_for_room() {
    let stall = 800u64;
    let e = SimEngine::spawn(&[
        "--time-scale",
        "0",
        "--stall-first-byte-ms",
        &stall.to_string(),
    ]);
    let r = Router::spawn(
        &[e.url()],
        &["--health-interval-ms", "0"],
        "[limits]\nmax_in_flight_per_backend = 1\n[timeouts]\nqueue_ms = 20000\n",
    );
    let (tx, rx) = mpsc::channel();
    let started = Instant::now();
    for i in 0..2 {
        let (addr, tx) = (r.addr, tx.clone());
        std::thread::spawn(move || {
            let resp = post_chat(addr, &format!("q{i}"));
            tx.send((resp, started.elapsed())).unwrap();
        });
    }
    let mut done: Vec<(Response, Duration)> = (0..2)
        .map(|_| rx.recv_timeout(SETTLE * 3).expect("both answered"))
        .collect();
    done.sort_by_key(|(_, t)| *t);
    for (resp, _) in &done {
        assert_eq!(resp.status, 200, "{}", resp.text());
    }
    // One at a time: the second waited for the first's whole stall.
    assert!(
        done[1].1 >= Duration::from_millis(stall * 3 / 2),
        "the queued request ran after the first ({:?})",
        done[1].1
    );
    assert_eq!(r.backend(&e.url())["requests"], 2);
    // The wait is the queue's, not routing's: one queued request, waiting
    // most of the stall; no routing decision took as long.
    let m = r.metrics();
    let value = |name: &str| -> f64 {
        m.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} in {m}"))
    };
    assert_eq!(value("prefix_router_queue_seconds_count"), 1.0, "{m}");
    assert!(
        value("prefix_router_queue_seconds_sum") >= stall as f64 / 2e3,
        "{m}"
    );
    assert!(
        value("prefix_router_routing_seconds_sum") < stall as f64 / 4e3,
        "{m}"
    );
}

#[test]
fn a_queued_request_gets_503_with_retry_after_when_no_room_appears() {
    let e = SimEngine::spawn(&["--time-scale", "0", "--stall-first-byte-ms", "4000"]);
    let r = Router::spawn(
        &[e.url()],
        &["--health-interval-ms", "0"],
        "[limits]\nmax_in_flight_per_backend = 1\n[timeouts]\nqueue_ms = 300\n",
    );
    let (tx, rx) = mpsc::channel();
    let addr = r.addr;
    let first = std::thread::spawn(move || {
        let resp = post_chat(addr, "the slow one");
        tx.send(()).unwrap();
        resp
    });
    assert!(
        r.wait_backend(&e.url(), SETTLE, |b| b["in_flight"] == 1),
        "the first request holds the only slot"
    );
    let t = Instant::now();
    let resp = post_chat(r.addr, "the queued one");
    let waited = t.elapsed();
    assert_eq!(resp.status, 503, "{}", resp.text());
    assert_eq!(resp.header("retry-after"), Some("1"));
    assert_eq!(resp.json()["error"]["code"], 503);
    assert!(
        resp.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("in-flight limit")
    );
    assert!(
        waited >= Duration::from_millis(250),
        "it queued before giving up ({waited:?})"
    );
    assert!(
        rx.try_recv().is_err(),
        "the 503 came while the first request was still running"
    );
    assert_eq!(first.join().unwrap().status, 200);
    // Room again: served at once.
    assert_eq!(post_chat(r.addr, "later").status, 200);
}

/// Reads what the router sends on `s` until it closes (bounded by its timeout).
fn read_to_close(s: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    let mut tmp = [0u8; 4096];
    loop {
        match s.read(&mut tmp) {
            Ok(0) | Err(_) => return out,
            Ok(n) => out.extend_from_slice(&tmp[..n]),
        }
    }
}

/// A connection the router accepted and answered a request on, kept alive.
fn held_connection(addr: std::net::SocketAddr) -> TcpStream {
    let deadline = Instant::now() + SETTLE;
    loop {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        s.write_all(b"GET /v1/models HTTP/1.1\r\nhost: router\r\n\r\n")
            .unwrap();
        let mut got = Vec::new();
        let mut tmp = [0u8; 4096];
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            match s.read(&mut tmp) {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&tmp[..n]),
            }
        }
        if got.starts_with(b"HTTP/1.1 200") {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "a held connection was never served: {:?}",
            String::from_utf8_lossy(&got)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn connections_over_the_limit_get_503_and_are_closed() {
    let e = SimEngine::spawn(&["--time-scale", "0"]);
    let r = Router::spawn(&[e.url()], &[], "[limits]\nmax_client_connections = 4\n");
    // Four kept-alive connections hold every slot. Each is known to be
    // counted once it was answered: a bare connect is accepted later, by
    // whichever worker's queue it landed in, so a probe could take a slot
    // first and a held connection be the one refused.
    let held: Vec<TcpStream> = (0..4).map(|_| held_connection(r.addr)).collect();
    let deadline = Instant::now() + SETTLE;
    let refused = loop {
        let mut s = TcpStream::connect(r.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        // Nothing is sent: the router answers a refused connection at once
        // (and unread request bytes would turn its close into a reset).
        let got = String::from_utf8_lossy(&read_to_close(&mut s)).into_owned();
        if got.starts_with("HTTP/1.1 503") {
            break got;
        }
        assert!(
            Instant::now() < deadline,
            "never refused; last answer {got:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(refused.contains("connection: close"), "{refused}");
    assert!(refused.contains("retry-after: 1"), "{refused}");
    assert!(refused.contains("\"code\":503"), "{refused}");
    // A slot frees: new connections are served again.
    drop(held);
    let deadline = Instant::now() + SETTLE;
    loop {
        let resp = post_chat(r.addr, "back");
        if resp.status == 200 {
            break;
        }
        assert_eq!(resp.status, 503);
        assert!(Instant::now() < deadline, "slots never came back");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sends `head` and then `body` as a client that writes its whole request
/// before it reads does, at about `mb_per_s` (an upload over a real link,
/// or a busy client); returns whether every byte was written, and what the
/// router answered.
fn send_whole_then_read(
    addr: std::net::SocketAddr,
    head: &str,
    body: &[u8],
    mb_per_s: u64,
) -> (Result<(), String>, Vec<u8>) {
    const PIECE: usize = 256 * 1024;
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(SETTLE)).unwrap();
    s.set_write_timeout(Some(SETTLE)).unwrap();
    let started = Instant::now();
    let mut sent = s.write_all(head.as_bytes()).map_err(|e| e.to_string());
    for (i, piece) in body.chunks(PIECE).enumerate() {
        if sent.is_err() {
            break;
        }
        let due = Duration::from_micros((i * PIECE) as u64 / mb_per_s);
        std::thread::sleep(due.saturating_sub(started.elapsed()));
        sent = s.write_all(piece).map_err(|e| e.to_string());
    }
    (sent, read_to_close(&mut s))
}

#[test]
fn a_body_over_the_limit_gets_413_that_the_client_reads() {
    let e = SimEngine::spawn(&["--time-scale", "0"]);
    let r = Router::spawn(&[e.url()], &[], "");
    let len = 51 * 1000 * 1000;
    let body = vec![b'x'; len];
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n\
         content-length: {len}\r\n\r\n"
    );
    let (sent, got) = send_whole_then_read(r.addr, &head, &body, 12);
    let text = String::from_utf8_lossy(&got);
    assert!(
        text.starts_with("HTTP/1.1 413"),
        "sent: {sent:?}; got: {text:?}"
    );
    assert!(sent.is_ok(), "the client's write broke: {sent:?}");
    let json_body = &text[text.find("\r\n\r\n").unwrap() + 4..];
    let v: serde_json::Value = serde_json::from_str(json_body).unwrap();
    assert!(
        v["error"]["message"].as_str().unwrap().contains("limit"),
        "{v}"
    );
    // Chunked: the limit is found after 32 MiB were read.
    let mut chunked = Vec::with_capacity(len + 1024);
    for piece in body.chunks(1 << 20) {
        chunked.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
        chunked.extend_from_slice(piece);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n\
         transfer-encoding: chunked\r\n\r\n";
    let (sent, got) = send_whole_then_read(r.addr, head, &chunked, 12);
    let text = String::from_utf8_lossy(&got);
    assert!(
        text.starts_with("HTTP/1.1 413"),
        "sent: {sent:?}; got: {text:?}"
    );
    assert!(sent.is_ok(), "the client's write broke: {sent:?}");
    // Still serving.
    assert_eq!(post_chat(r.addr, "after").status, 200);
}
