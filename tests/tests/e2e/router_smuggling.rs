//! Request smuggling and malformed input, end to end through the real router:
//! every ambiguous or broken framing is refused with the right status in
//! OpenAI's error shape, the connection is closed when its byte stream can
//! no longer be trusted, nothing reaches the engine, and other clients are
//! served all along. A slow client is cut off without blocking anyone.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;
use testkit::engine_proc::SimEngine;
use testkit::http::{post_json, request};
use testkit::router_proc::Router;

/// Longest wait for any answer; far above what a healthy exchange takes.
const IO_TIMEOUT: Duration = Duration::from_secs(10);
const MAX_BODY: usize = 4096;
const MAX_HEAD: usize = 2048;
/// Small enough that the slow-client test is quick, large enough for a
/// loaded machine to send a whole head in time.
const HEADER_MS: u64 = 700;

fn config() -> String {
    format!(
        "[limits]\nmax_body_bytes = {MAX_BODY}\nmax_header_bytes = {MAX_HEAD}\n\
         [timeouts]\nclient_header_ms = {HEADER_MS}\n"
    )
}

fn chat_body() -> Vec<u8> {
    json!({"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2})
        .to_string()
        .into_bytes()
}

/// One parsed response and whether the router closed the connection after it.
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    closed: bool,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Asserts the body is OpenAI's error shape with this status as its code.
    fn assert_openai_error(&self, what: &str) {
        let v: serde_json::Value = serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "{what}: error body is not JSON ({e}): {}",
                String::from_utf8_lossy(&self.body)
            )
        });
        let err = &v["error"];
        assert_eq!(err["code"], self.status, "{what}: {v}");
        assert!(
            err["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{what}: {v}"
        );
        assert!(err["type"].is_string(), "{what}: {v}");
        assert!(err.get("param").is_some(), "{what}: {v}");
    }
}

/// Parses responses with Content-Length bodies from `buf`, in order.
fn parse_answers(mut buf: &[u8], closed: bool) -> Vec<Answer> {
    let mut out = Vec::new();
    while !buf.is_empty() {
        let mut hs = [httparse::EMPTY_HEADER; 32];
        let mut r = httparse::Response::new(&mut hs);
        let Ok(httparse::Status::Complete(n)) = r.parse(buf) else {
            panic!("bad response bytes: {:?}", String::from_utf8_lossy(buf));
        };
        let headers: Vec<(String, String)> = r
            .headers
            .iter()
            .map(|h| {
                (
                    h.name.to_ascii_lowercase(),
                    String::from_utf8_lossy(h.value).into_owned(),
                )
            })
            .collect();
        let len: usize = headers
            .iter()
            .find(|(k, _)| k == "content-length")
            .and_then(|(_, v)| v.parse().ok())
            .expect("every answer here has a content-length");
        let body = buf[n..n + len].to_vec();
        out.push(Answer {
            status: r.code.unwrap_or(0),
            headers,
            body,
            closed: false,
        });
        buf = &buf[n + len..];
    }
    if let Some(last) = out.last_mut() {
        last.closed = closed;
    }
    out
}

/// Sends `raw` in one write and reads until the router closes the connection
/// or `IO_TIMEOUT` passes (then `closed` is false).
fn exchange(addr: SocketAddr, raw: &[u8]) -> Vec<Answer> {
    let mut s = TcpStream::connect_timeout(&addr, IO_TIMEOUT).expect("connect");
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    s.write_all(raw).expect("write");
    let mut buf = Vec::new();
    let mut tmp = [0u8; 16 * 1024];
    let closed = loop {
        match s.read(&mut tmp) {
            Ok(0) => break true,
            Ok(n) => buf.extend_from_slice(&tmp[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break true,
            Err(_) => break false,
        }
    };
    parse_answers(&buf, closed)
}

/// Sends valid requests from another thread until dropped; the join result
/// is how many were sent, each of which must have been a 200.
struct Bystander {
    stop: Arc<AtomicBool>,
    handle: std::thread::JoinHandle<usize>,
}

impl Bystander {
    fn start(addr: SocketAddr) -> Bystander {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::spawn(move || {
            let mut n = 0;
            // Bounded: the test stops it, and 2000 requests is far more than it takes.
            while !flag.load(Ordering::Relaxed) && n < 2000 {
                let r = request(addr, "POST", "/v1/chat/completions", &[], &chat_body())
                    .expect("bystander request");
                assert_eq!(
                    r.status,
                    200,
                    "a well-behaved client was hurt: {}",
                    r.text()
                );
                n += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
            n
        });
        Bystander { stop, handle }
    }

    fn finish(self) -> usize {
        self.stop.store(true, Ordering::Relaxed);
        self.handle
            .join()
            .expect("bystander requests all succeeded")
    }
}

#[test]
fn smuggling_shapes_are_refused_and_never_reach_the_engine() {
    let e = SimEngine::spawn(&["--time-scale", "0"]);
    let r = Router::spawn(&[e.url()], &[], &config());
    // Counted before the bystander starts: its first request can be served
    // before the cases below are built.
    let before = SimEngine::requests_served(&e);
    let bystander = Bystander::start(r.addr);
    // A second request hidden in the body: if any framing let it through, the
    // engine would count a generation.
    let hidden = "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\n\r\n{}";
    let long_value = "a".repeat(MAX_HEAD + 500);
    let cases: Vec<(&str, String, u16)> = vec![
        (
            "Content-Length and Transfer-Encoding",
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n{hidden}"
            ),
            400,
        ),
        (
            "Transfer-Encoding then Content-Length",
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\ncontent-length: 4\r\n\r\n0\r\n\r\n{hidden}"
            ),
            400,
        ),
        (
            "conflicting Content-Lengths",
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\ncontent-length: 80\r\n\r\n{{}}{hidden}"
            ),
            400,
        ),
        (
            "Content-Length list",
            "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 2, 2\r\n\r\n{}"
                .into(),
            400,
        ),
        (
            "signed Content-Length",
            "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: +2\r\n\r\n{}".into(),
            400,
        ),
        (
            "malformed chunk size",
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n{{}}\r\n0\r\n\r\n{hidden}"
            ),
            400,
        ),
        (
            "negative chunk size",
            "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n-2\r\n{}\r\n0\r\n\r\n".into(),
            400,
        ),
        (
            "chunk size overflowing 64 bits",
            "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n10000000000000002\r\n{}\r\n0\r\n\r\n".into(),
            400,
        ),
        (
            "chunk data longer than its size",
            "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n1\r\n{}\r\n0\r\n\r\n".into(),
            400,
        ),
        (
            "obsolete line folding",
            "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\nx-a: 1\r\n transfer-encoding: chunked\r\ncontent-length: 2\r\n\r\n{}".into(),
            400,
        ),
        (
            "bare CR in a header",
            "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\nx-a: 1\rtransfer-encoding: chunked\r\ncontent-length: 2\r\n\r\n{}".into(),
            400,
        ),
        (
            "space before the colon",
            "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding : chunked\r\ncontent-length: 2\r\n\r\n{}".into(),
            400,
        ),
        (
            "Transfer-Encoding in HTTP/1.0",
            "POST /v1/chat/completions HTTP/1.0\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n".into(),
            400,
        ),
        (
            "unknown transfer coding",
            "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: gzip\r\n\r\n".into(),
            501,
        ),
        (
            "chunked not last",
            "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked, identity\r\n\r\n0\r\n\r\n".into(),
            501,
        ),
        (
            "oversized head",
            format!("POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\nx-filler: {long_value}\r\ncontent-length: 2\r\n\r\n{{}}"),
            431,
        ),
        (
            "oversized Content-Length body",
            format!("POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: {}\r\n\r\n", MAX_BODY + 1),
            413,
        ),
        (
            "oversized chunked body",
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{}\r\n0\r\n\r\n",
                MAX_BODY + 10,
                "x".repeat(MAX_BODY + 10)
            ),
            413,
        ),
    ];
    for (what, raw, status) in &cases {
        let answers = exchange(r.addr, raw.as_bytes());
        assert_eq!(answers.len(), 1, "{what}: exactly one answer");
        let a = &answers[0];
        assert_eq!(
            a.status,
            *status,
            "{what}: {}",
            String::from_utf8_lossy(&a.body)
        );
        a.assert_openai_error(what);
        assert_eq!(a.header("connection"), Some("close"), "{what}");
        assert!(
            a.closed,
            "{what}: the router closes an untrustworthy stream"
        );
    }
    let served = bystander.finish();
    assert!(served > 0);
    assert_eq!(
        SimEngine::requests_served(&e) - before,
        served as u64,
        "the engine saw the bystander's requests and nothing smuggled"
    );
}

#[test]
fn invalid_json_is_a_400_and_the_connection_keeps_serving() {
    let e = SimEngine::spawn(&["--time-scale", "0"]);
    let r = Router::spawn(&[e.url()], &[], &config());
    let bad = b"{\"messages\": [oops";
    let good = chat_body();
    let mut raw = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        bad.len()
    )
    .into_bytes();
    raw.extend_from_slice(bad);
    // Pipelined behind it on the same connection: a valid request, the last one.
    raw.extend_from_slice(
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
            good.len()
        )
        .as_bytes(),
    );
    raw.extend_from_slice(&good);
    let answers = exchange(r.addr, &raw);
    assert_eq!(answers.len(), 2, "both requests answered, in order");
    assert_eq!(answers[0].status, 400);
    answers[0].assert_openai_error("invalid JSON");
    let v: serde_json::Value = serde_json::from_slice(&answers[0].body).unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not valid JSON")
    );
    assert_ne!(
        answers[0].header("connection"),
        Some("close"),
        "a whole request with a bad body does not cost the connection"
    );
    assert_eq!(answers[1].status, 200, "the next request on it is served");
    assert!(answers[1].closed);

    // A prompt-less body on a prompt endpoint is refused the same way.
    let r2 = post_json(r.addr, "/v1/chat/completions", &json!({"model": "m"})).unwrap();
    assert_eq!(r2.status, 400);
    assert_eq!(r2.json()["error"]["code"], 400);
}

#[test]
fn a_slow_client_is_cut_off_and_blocks_nobody() {
    let e = SimEngine::spawn(&["--time-scale", "0"]);
    let r = Router::spawn(&[e.url()], &[], &config());
    let mut slow = TcpStream::connect(r.addr).unwrap();
    slow.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    let started = Instant::now();
    slow.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-le")
        .unwrap();
    // While it stalls, other clients are served (on both workers).
    for _ in 0..10 {
        let ok = request(r.addr, "POST", "/v1/chat/completions", &[], &chat_body()).unwrap();
        assert_eq!(ok.status, 200);
    }
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    loop {
        match slow.read(&mut tmp) {
            Ok(0) => break,
            Ok(n) => buf.extend_from_slice(&tmp[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!(
                "the slow client was not cut off within {IO_TIMEOUT:?}: {e} (got {:?})",
                String::from_utf8_lossy(&buf)
            ),
        }
    }
    let waited = started.elapsed();
    let answers = parse_answers(&buf, true);
    assert_eq!(answers.len(), 1);
    assert_eq!(answers[0].status, 408);
    answers[0].assert_openai_error("slow head");
    assert!(
        waited >= Duration::from_millis(HEADER_MS / 2),
        "cut off after client_header_ms, not at once ({waited:?})"
    );
    // The router is still fine afterwards.
    let ok = request(r.addr, "POST", "/v1/chat/completions", &[], &chat_body()).unwrap();
    assert_eq!(ok.status, 200);
}
