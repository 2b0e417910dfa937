//! The control plane under misbehaving peers (issue 15): health probes
//! against a backend that trickles its answer or keeps the connection open,
//! and the admin listener against idle, slow and endless clients. Real
//! router and engine processes; the misbehaving peers are small std::net
//! servers and clients on loopback.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

use serde_json::json;
use testkit::engine_proc::SimEngine;
use testkit::http::{post_json, request};
use testkit::router_proc::Router;

/// Generous bound on anything that should take well under a second.
const SETTLE: Duration = Duration::from_secs(10);

/// A fake backend: accepts connections on loopback and hands each to
/// `serve` on a thread of its own; counts the connections. Stops accepting
/// when dropped (threads serving a connection end when their peer closes).
struct FakeBackend {
    addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl FakeBackend {
    fn start(serve: fn(TcpStream, &AtomicU64), answers: Arc<AtomicU64>) -> FakeBackend {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let addr = l.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (count, flag) = (accepted.clone(), stop.clone());
        std::thread::spawn(move || {
            while !flag.load(Relaxed) {
                match l.accept() {
                    Ok((s, _)) => {
                        count.fetch_add(1, Relaxed);
                        s.set_nonblocking(false).unwrap();
                        let answers = answers.clone();
                        std::thread::spawn(move || serve(s, &answers));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        FakeBackend {
            addr,
            accepted,
            stop,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for FakeBackend {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
    }
}

/// Reads until the end of a request head; false if the peer closed first.
fn read_head(s: &mut TcpStream) -> bool {
    let mut head = Vec::new();
    let mut tmp = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut tmp) {
            Ok(0) | Err(_) => return false,
            Ok(n) => head.extend_from_slice(&tmp[..n]),
        }
    }
    true
}

/// Answers every request with a valid 200, one byte every 0.5 s (about a
/// minute for the whole answer); stops when the peer goes away.
fn trickle(mut s: TcpStream, answers: &AtomicU64) {
    let answer = format!(
        "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Pad: {}\r\n\r\nok",
        "x".repeat(80)
    );
    if !read_head(&mut s) {
        return;
    }
    for b in answer.bytes() {
        if s.write_all(&[b]).is_err() {
            return;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    answers.fetch_add(1, Relaxed);
}

fn encoded(url: &str) -> String {
    url.replace(':', "%3A").replace('/', "%2F")
}

fn chat(user: &str) -> serde_json::Value {
    json!({"model": "sim-llama-8b", "max_tokens": 2,
           "messages": [{"role": "user", "content": user}]})
}

#[test]
fn a_trickling_backend_does_not_delay_the_other_backends_health_checks() {
    let trickler = FakeBackend::start(trickle, Arc::new(AtomicU64::new(0)));
    let a = SimEngine::spawn(&["--time-scale", "0", "--id", "a"]);
    let b = SimEngine::spawn(&["--time-scale", "0", "--id", "b"]);
    // interval, timeout, rise: a backend is back `rise` probes after it recovers.
    let (interval_ms, timeout_ms, rise) = (300, 1000, 2);
    let r = Router::spawn(
        &[trickler.url(), a.url(), b.url()],
        &["--policy", "round-robin"],
        &format!(
            "[health]\ninterval_ms = {interval_ms}\ntimeout_ms = {timeout_ms}\nrise = {rise}\nfall = 2\npassive_fall = 2\n"
        ),
    );
    // "Normal rise interval": rise probes, one probe's timeout, plus slack
    // for a loaded machine. The trickler would hold a sequential checker
    // for about a minute per probe.
    let back_within =
        Duration::from_millis(rise * interval_ms + timeout_ms) + Duration::from_secs(3);
    // The trickler gets probes but no traffic.
    let drain = request(
        r.admin,
        "POST",
        &format!("/admin/drain?backend={}", encoded(&trickler.url())),
        &[],
        b"",
    )
    .unwrap();
    assert_eq!(drain.status, 200, "{}", drain.text());

    // An outage of `a`: out, then back within the rise interval of its end.
    post_json(
        a.addr,
        "/sim/faults",
        &json!({"refuse_connections_ms": 2000}),
    )
    .unwrap();
    let outage_ends = Instant::now() + Duration::from_millis(2000);
    assert!(
        r.wait_backend(&a.url(), SETTLE, |b| b["healthy"] == false),
        "a refusing backend is taken out"
    );
    let wait = outage_ends.saturating_duration_since(Instant::now()) + back_within;
    assert!(
        r.wait_backend(&a.url(), wait, |b| b["healthy"] == true),
        "a recovered backend is back within {back_within:?} of its recovery"
    );
    let back_after = outage_ends.elapsed();
    eprintln!("a back {back_after:?} after its outage ended");

    // `b` answers 500s: ejected by failed requests (passive), then back
    // promptly once its probes pass, the trickler notwithstanding.
    post_json(b.addr, "/sim/faults", &json!({"fail_rate": 1.0})).unwrap();
    let mut fails = 0;
    for i in 0..20 {
        let resp = post_json(r.addr, "/v1/chat/completions", &chat(&format!("q{i}"))).unwrap();
        if resp.status == 500 {
            fails += 1;
        }
        if fails == 2 {
            break;
        }
    }
    assert_eq!(fails, 2, "b answered passive_fall 500s");
    assert!(
        r.wait_backend(&b.url(), SETTLE, |b| b["healthy"] == false),
        "b ejected by failed requests"
    );
    let ejected = Instant::now();
    post_json(b.addr, "/sim/faults", &json!({"fail_rate": 0.0})).unwrap();
    assert!(
        r.wait_backend(&b.url(), back_within, |b| b["healthy"] == true),
        "a passively ejected backend whose probes pass is back within {back_within:?}"
    );
    eprintln!("b back {:?} after its ejection", ejected.elapsed());
    let resp = post_json(r.addr, "/v1/chat/completions", &chat("after")).unwrap();
    assert_eq!(resp.status, 200, "{}", resp.text());
    // A probe is bounded as a whole: the trickler's never completes in time,
    // and it was probed again and again, each probe on a new connection.
    assert_eq!(
        r.backend(&trickler.url())["healthy"],
        false,
        "a backend trickling its answer is taken out (probe deadline)"
    );
    assert!(trickler.accepted.load(Relaxed) >= 3);
}

/// Answers every request on the connection with `answer`, keeping it open.
fn keep_open(mut s: TcpStream, answers: &AtomicU64, answer: &[u8]) {
    while read_head(&mut s) {
        if s.write_all(answer).is_err() {
            return;
        }
        answers.fetch_add(1, Relaxed);
    }
}

fn empty_200(s: TcpStream, n: &AtomicU64) {
    keep_open(s, n, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n");
}

fn chunked_200(s: TcpStream, n: &AtomicU64) {
    keep_open(
        s,
        n,
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    );
}

fn empty_503(s: TcpStream, n: &AtomicU64) {
    keep_open(
        s,
        n,
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n",
    );
}

#[test]
fn prompt_framed_probe_answers_on_kept_alive_connections_count_as_answers() {
    let counts: Vec<Arc<AtomicU64>> = (0..3).map(|_| Arc::new(AtomicU64::new(0))).collect();
    let empty = FakeBackend::start(empty_200, counts[0].clone());
    let chunked = FakeBackend::start(chunked_200, counts[1].clone());
    let busy = FakeBackend::start(empty_503, counts[2].clone());
    // One failed probe takes a backend out.
    let r = Router::spawn(
        &[empty.url(), chunked.url(), busy.url()],
        &[],
        "[health]\ninterval_ms = 100\ntimeout_ms = 500\nfall = 1\nrise = 1\n",
    );
    assert!(
        r.wait_backend(&busy.url(), SETTLE, |b| b["healthy"] == false),
        "a 503 answer is a failed probe"
    );
    let deadline = Instant::now() + SETTLE;
    while counts.iter().any(|c| c.load(Relaxed) < 5) && Instant::now() < deadline {
        for fake in [&empty, &chunked] {
            let b = r.backend(&fake.url());
            assert_eq!(
                b["healthy"], true,
                "a complete 200 on a kept-alive connection is a passed probe: {b}"
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let seen: Vec<u64> = counts.iter().map(|c| c.load(Relaxed)).collect();
    assert!(
        seen.iter().all(|&n| n >= 5),
        "every fake answered probes: {seen:?}"
    );
    assert_eq!(r.backend(&busy.url())["healthy"], false);
}
