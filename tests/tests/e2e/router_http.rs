//! The router's HTTP behaviour end to end: streaming, keep-alive and
//! pipelining, byte-exact bodies, error statuses, dead backends.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use serde_json::json;
use testkit::engine_proc::SimEngine;
use testkit::http::{post_json, request, request_chunks};
use testkit::router_proc::Router;

const IO_TIMEOUT: Duration = Duration::from_secs(20);

fn chat(system: &str, user: &str, max_tokens: u32) -> serde_json::Value {
    json!({"model": "sim-llama-8b", "max_tokens": max_tokens, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]})
}

/// Reads one HTTP/1.1 response with a Content-Length body from `r`.
fn read_response(r: &mut BufReader<TcpStream>) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let mut line = String::new();
    r.read_line(&mut line).expect("status line");
    let status = line.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        r.read_line(&mut h).expect("header");
        if h == "\r\n" || h.is_empty() {
            break;
        }
        let (k, v) = h.split_once(':').expect("header colon");
        headers.push((k.trim().to_ascii_lowercase(), v.trim().to_owned()));
    }
    let len: usize = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .map_or(0, |(_, v)| v.parse().unwrap());
    let mut body = vec![0; len];
    r.read_exact(&mut body).expect("body");
    (status, headers, body)
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

fn connect(addr: SocketAddr) -> (TcpStream, BufReader<TcpStream>) {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    let r = BufReader::new(s.try_clone().unwrap());
    (s, r)
}

fn post(path: &str, body: &[u8]) -> Vec<u8> {
    let mut req = format!("POST {path} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n", body.len()).into_bytes();
    req.extend_from_slice(body);
    req
}

#[test]
fn sse_arrives_chunk_by_chunk_before_the_engine_finishes() {
    // 40 ms per decode step in real time: 8 tokens take about 320 ms.
    let e = SimEngine::spawn(&[
        "--decode-step-ms",
        "40",
        "--decode-step-per-seq-ms",
        "0",
        "--prefill-tps",
        "0",
    ]);
    let r = Router::spawn(&[e.url()], &[], "");
    let mut body = chat("be brief", "stream please", 8);
    body["stream"] = json!(true);
    let (resp, chunks) = request_chunks(
        r.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        &serde_json::to_vec(&body).unwrap(),
    )
    .unwrap();
    assert_eq!(resp.status, 200);
    assert!(resp.text().contains("data: [DONE]"));
    assert!(chunks.len() >= 5, "only {} chunks arrived", chunks.len());
    let spread = chunks.last().unwrap().at - chunks.first().unwrap().at;
    assert!(
        spread >= Duration::from_millis(150),
        "chunks arrived together, within {spread:?}: the router buffered the stream"
    );
}

#[test]
fn requests_on_one_keep_alive_connection_are_routed_one_by_one() {
    let e: Vec<_> = (0..3)
        .map(|i| SimEngine::spawn(&["--time-scale", "0", "--id", &format!("e{i}")]))
        .collect();
    let r = Router::spawn(
        &e.iter().map(SimEngine::url).collect::<Vec<_>>(),
        &["--debug-headers"],
        "",
    );
    let (mut s, mut rd) = connect(r.addr);
    let mut seen = std::collections::HashMap::new();
    for i in 0..24 {
        // Distinct system prompts: distinct cold prefixes spread over engines.
        let b = serde_json::to_vec(&chat(
            &format!(
                "You are assistant number {i} with a long distinct preamble {}",
                "x".repeat(300)
            ),
            "hi",
            2,
        ))
        .unwrap();
        s.write_all(&post("/v1/chat/completions", &b)).unwrap();
        let (status, headers, _) = read_response(&mut rd);
        assert_eq!(status, 200);
        *seen
            .entry(header(&headers, "x-engine-id").unwrap().to_owned())
            .or_insert(0) += 1;
    }
    assert!(
        seen.len() >= 2,
        "one connection, many conversations, yet one engine: {seen:?}"
    );

    // Pipelined: three requests in one write, three answers in order.
    let mut burst = Vec::new();
    for n in [1, 2, 3] {
        burst.extend(post(
            "/v1/chat/completions",
            &serde_json::to_vec(&chat("pipelined", "go", n)).unwrap(),
        ));
    }
    s.write_all(&burst).unwrap();
    for n in [1, 2, 3] {
        let (status, _, body) = read_response(&mut rd);
        assert_eq!(status, 200);
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["usage"]["completion_tokens"], n, "answers out of order");
    }
}

/// A backend that answers every request with its body, byte for byte.
fn echo_backend() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            std::thread::spawn(move || {
                let _ = s.set_read_timeout(Some(IO_TIMEOUT));
                let mut w = s.try_clone().unwrap();
                let mut r = BufReader::new(s);
                for _ in 0..10_000 {
                    let mut line = String::new();
                    if r.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    let mut len = 0;
                    loop {
                        let mut h = String::new();
                        if r.read_line(&mut h).unwrap_or(0) == 0 {
                            return;
                        }
                        if h == "\r\n" {
                            break;
                        }
                        if let Some((k, v)) = h.split_once(':')
                            && k.eq_ignore_ascii_case("content-length")
                        {
                            len = v.trim().parse().unwrap();
                        }
                    }
                    let mut body = vec![0; len];
                    if r.read_exact(&mut body).is_err() {
                        return;
                    }
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {len}\r\nx-engine-id: echo\r\n\r\n"
                    );
                    if w.write_all(head.as_bytes())
                        .and_then(|_| w.write_all(&body))
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    addr
}

#[test]
fn bodies_arrive_byte_exact() {
    let echo = echo_backend();
    let r = Router::spawn(&[format!("http://{echo}")], &[], "");
    // Odd whitespace, escapes, unicode, key order: forwarded as sent, never re-serialized.
    let odd = "{ \"messages\" :[{\"content\":\"caf\\u00e9 \u{1F600}\\n\",  \"role\":\"user\"}] ,\"model\":\"m\"  }\n".as_bytes().to_vec();
    let resp = request(r.addr, "POST", "/v1/chat/completions", &[], &odd).unwrap();
    assert_eq!(resp.status, 200);
    assert_eq!(resp.body, odd);

    // 400 KB prompt (about 100,000 tokens).
    let big = serde_json::to_vec(&chat("s", &"word ".repeat(80_000), 1)).unwrap();
    let resp = request(r.addr, "POST", "/v1/chat/completions", &[], &big).unwrap();
    assert_eq!(resp.status, 200);
    assert!(resp.body == big, "400 KB body changed on the way");

    // Chunked with Expect: 100-continue, as curl sends large bodies.
    let (mut s, mut rd) = connect(r.addr);
    let payload = serde_json::to_vec(&chat("chunked", "body", 1)).unwrap();
    let mut req = b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\nexpect: 100-continue\r\n\r\n".to_vec();
    s.write_all(&req).unwrap();
    let mut line = String::new();
    rd.read_line(&mut line).unwrap();
    assert!(
        line.starts_with("HTTP/1.1 100"),
        "no 100 Continue: {line:?}"
    );
    rd.read_line(&mut line).unwrap();
    req.clear();
    for part in payload.chunks(7) {
        req.extend(format!("{:x}\r\n", part.len()).as_bytes());
        req.extend(part);
        req.extend(b"\r\n");
    }
    req.extend(b"0\r\n\r\n");
    s.write_all(&req).unwrap();
    let (status, _, body) = read_response(&mut rd);
    assert_eq!(status, 200);
    assert_eq!(body, payload);

    // A long chunked body: decoded, then sent behind the head in one write.
    let payload = serde_json::to_vec(&chat("chunked", &"long ".repeat(40_000), 1)).unwrap();
    let mut req =
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
            .to_vec();
    for part in payload.chunks(4093) {
        req.extend(format!("{:x}\r\n", part.len()).as_bytes());
        req.extend(part);
        req.extend(b"\r\n");
    }
    req.extend(b"0\r\n\r\n");
    s.write_all(&req).unwrap();
    let (status, _, body) = read_response(&mut rd);
    assert_eq!(status, 200);
    assert!(body == payload, "200 KB chunked body changed on the way");
}

#[test]
fn bad_input_gets_a_clear_status_and_the_router_keeps_serving() {
    let e = SimEngine::spawn(&["--time-scale", "0"]);
    let cfg = "[limits]\nmax_body_bytes = 100000\nmax_header_bytes = 4096\n";
    let r = Router::spawn(&[e.url()], &[], cfg);
    let send = |raw: &[u8]| -> (u16, Vec<u8>) {
        let (mut s, mut rd) = connect(r.addr);
        s.write_all(raw).unwrap();
        let (status, _, body) = read_response(&mut rd);
        (status, body)
    };
    let (st, body) = send(&post("/v1/chat/completions", b"{\"messages\": [oops"));
    assert_eq!(st, 400);
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not valid JSON"),
        "{v}"
    );
    assert_eq!(
        send(&post("/v1/chat/completions", b"{\"model\":\"m\"}")).0,
        400
    );
    assert_eq!(send(&post("/v1/completions", b"{\"model\":\"m\"}")).0, 400);
    assert_eq!(send(&post("/generate", b"{}")).0, 400);
    assert_eq!(
        send(b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 200000\r\n\r\n").0,
        413
    );
    let huge_head = format!(
        "GET /v1/models HTTP/1.1\r\nx-filler: {}\r\n\r\n",
        "a".repeat(8000)
    );
    assert_eq!(send(huge_head.as_bytes()).0, 431);
    assert_eq!(
        send(b"POST /v1/chat/completions HTTP/1.1\r\ntransfer-encoding: gzip\r\n\r\n").0,
        501
    );
    // Still serving.
    let ok = post_json(r.addr, "/v1/chat/completions", &chat("s", "u", 1)).unwrap();
    assert_eq!(ok.status, 200);
    let models = request(r.addr, "GET", "/v1/models", &[], b"").unwrap();
    assert_eq!(models.status, 200);
    assert!(models.text().contains("sim-llama-8b"));
}

#[test]
fn a_dead_backend_costs_no_request_that_had_not_reached_it() {
    let e: Vec<_> = (0..3)
        .map(|i| SimEngine::spawn(&["--time-scale", "0", "--id", &format!("e{i}")]))
        .collect();
    // Health probes off: only retries can save the requests.
    let r = Router::spawn(
        &e.iter().map(SimEngine::url).collect::<Vec<_>>(),
        &["--health-interval-ms", "0", "--debug-headers"],
        "",
    );
    let mut e = e;
    drop(e.remove(1));
    let started = Instant::now();
    for i in 0..30 {
        let resp = post_json(
            r.addr,
            "/v1/chat/completions",
            &chat(&format!("conversation {i} {}", "y".repeat(200)), "hi", 1),
        )
        .unwrap();
        assert_eq!(resp.status, 200, "request {i}: {}", resp.text());
        assert_ne!(resp.header("x-engine-id"), Some("e1"));
    }
    assert!(started.elapsed() < Duration::from_secs(20));
    // All dead: a clear 502/503, not a hang.
    drop(e);
    let resp = post_json(r.addr, "/v1/chat/completions", &chat("s", "u", 1)).unwrap();
    assert!(matches!(resp.status, 502 | 503), "{}", resp.status);
    assert!(resp.text().contains("error"));
}
