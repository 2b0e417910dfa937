//! The control plane under misbehaving peers: health probes
//! against a backend that trickles its answer or keeps the connection open,
//! and the admin listener against idle, slow and endless clients; probers
//! following reloads; and a short `soak --hostile`. Real router and engine
//! processes; the misbehaving peers are small std::net servers and clients
//! on loopback.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

use serde_json::json;
use testkit::engine_proc::SimEngine;
use testkit::http::{post_json, request};
use testkit::router_proc::{Router, rss_kib};

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
    // Two failed probes take a backend out. The timeout is generous (a
    // loaded machine must not fail a prompt answer); a probe that waits for
    // the close fails at it all the same.
    let r = Router::spawn(
        &[empty.url(), chunked.url(), busy.url()],
        &[],
        "[health]\ninterval_ms = 100\ntimeout_ms = 3000\nfall = 2\nrise = 1\n",
    );
    // Until every fake answered 5 probes (well under a second here; a
    // prober that waits for the close takes a timeout per probe).
    let deadline = Instant::now() + Duration::from_secs(30);
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
    assert!(
        r.wait_backend(&busy.url(), SETTLE, |b| b["healthy"] == false),
        "a 503 answer is a failed probe"
    );
    // Operators see it per backend in /metrics. The fakes' counts include
    // the router's `GET /v1/models` too, so the probes' own count may lag
    // them by a probe interval or two: wait for it, bounded.
    let probes = |m: &str, url: &str, result: &str| -> u64 {
        let key =
            format!("prefix_router_health_probes_total{{backend=\"{url}\",result=\"{result}\"}} ");
        m.lines()
            .find_map(|l| l.strip_prefix(&key))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{key} in /metrics:\n{m}"))
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let m = loop {
        let m = r.metrics();
        let enough = probes(&m, &empty.url(), "passed") >= 5
            && probes(&m, &chunked.url(), "passed") >= 5
            && probes(&m, &busy.url(), "failed") >= 5;
        if enough || Instant::now() >= deadline {
            break m;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        probes(&m, &empty.url(), "passed") >= 5 && probes(&m, &empty.url(), "failed") == 0,
        "{m}"
    );
    assert!(
        probes(&m, &chunked.url(), "passed") >= 5 && probes(&m, &chunked.url(), "failed") == 0,
        "{m}"
    );
    assert!(
        probes(&m, &busy.url(), "failed") >= 5 && probes(&m, &busy.url(), "passed") == 0,
        "{m}"
    );
}

#[test]
fn backends_added_by_a_reload_are_probed_and_removed_ones_no_longer() {
    let e = SimEngine::spawn(&["--time-scale", "0"]);
    let fake = FakeBackend::start(empty_200, Arc::new(AtomicU64::new(0)));
    let dead = format!("http://127.0.0.1:{}", testkit::proc::free_port());
    let path = std::env::temp_dir().join(format!(
        "router-hardening-reload-{}.toml",
        std::process::id()
    ));
    let config = |backends: &[&str]| {
        let list: Vec<String> = backends.iter().map(|b| format!("\"{b}\"")).collect();
        format!(
            "backends = [{}]\n[health]\ninterval_ms = 100\ntimeout_ms = 3000\nfall = 2\nrise = 1\n",
            list.join(", ")
        )
    };
    std::fs::write(&path, config(&[&e.url()])).unwrap();
    let r = Router::spawn(&[], &["--config", path.to_str().unwrap()], "");
    let reload = |backends: &[&str]| {
        std::fs::write(&path, config(backends)).unwrap();
        let resp = request(r.admin, "POST", "/admin/reload", &[], b"").unwrap();
        assert_eq!(resp.status, 200, "{}", resp.text());
    };
    reload(&[&e.url(), &fake.url(), &dead]);
    assert!(
        r.wait_backend(&dead, SETTLE, |b| b["healthy"] == false),
        "an added dead backend is probed and taken out"
    );
    let deadline = Instant::now() + SETTLE;
    while fake.accepted.load(Relaxed) < 3 {
        assert!(Instant::now() < deadline, "an added backend is probed");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(r.backend(&fake.url())["healthy"], true);
    reload(&[&e.url()]);
    // A probe under way may still finish; then no more.
    std::thread::sleep(Duration::from_millis(700));
    let probes = fake.accepted.load(Relaxed);
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        fake.accepted.load(Relaxed),
        probes,
        "a removed backend is probed no more"
    );
    assert_eq!(r.backends().len(), 1);
    std::fs::remove_file(&path).ok();
}

#[test]
fn admin_answers_while_idle_connections_are_open_and_caps_them() {
    let e = SimEngine::spawn(&["--time-scale", "0"]);
    let r = Router::spawn(&[e.url()], &["--health-interval-ms", "0"], "");
    let idle: Vec<TcpStream> = (0..3)
        .map(|_| TcpStream::connect(r.admin).unwrap())
        .collect();
    // One more that sent half a head.
    let mut half = TcpStream::connect(r.admin).unwrap();
    half.write_all(b"GET /metr").unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    let m = request(r.admin, "GET", "/metrics", &[], b"").unwrap();
    let took = t.elapsed();
    assert_eq!(m.status, 200);
    assert!(
        took < Duration::from_secs(3),
        "/metrics answered in {took:?} with idle admin connections open"
    );

    // Many idle connections: past the cap, new ones are refused at once
    // (503) instead of queueing; the router's own threads stay bounded.
    let many: Vec<TcpStream> = (0..60)
        .map(|_| TcpStream::connect(r.admin).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    let refused = request(r.admin, "GET", "/metrics", &[], b"");
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "no queueing past the cap"
    );
    if let Ok(resp) = refused {
        assert_eq!(resp.status, 503, "{}", resp.text());
        assert_eq!(resp.header("retry-after"), Some("1"));
    }
    drop(many);
    drop(idle);
    drop(half);
    let refused_total = || {
        request(r.admin, "GET", "/metrics", &[], b"")
            .ok()
            .and_then(|m| {
                m.text()
                    .lines()
                    .find_map(|l| l.strip_prefix("prefix_router_admin_connections_refused_total "))
                    .and_then(|v| v.trim().parse::<u64>().ok())
            })
    };
    // Room again once they close.
    let deadline = Instant::now() + SETTLE;
    loop {
        match request(r.admin, "GET", "/metrics", &[], b"") {
            Ok(resp) if resp.status == 200 => break,
            other => assert!(
                Instant::now() < deadline,
                "admin serves again after the idle connections closed: {other:?}"
            ),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        refused_total().is_some_and(|n| n >= 20),
        "refusals counted: {:?}",
        refused_total()
    );
}

#[test]
fn an_endless_admin_header_line_is_refused_with_memory_bounded() {
    let e = SimEngine::spawn(&["--time-scale", "0"]);
    let r = Router::spawn(&[e.url()], &["--health-interval-ms", "0"], "");
    let pid = r.child.pid();
    let before = rss_kib(pid);
    let mut s = TcpStream::connect(r.admin).unwrap();
    s.set_read_timeout(Some(SETTLE)).unwrap();
    let mut w = s.try_clone().unwrap();
    // 128 MiB of one header line, no newline; stops when the router closes.
    const FLOOD: usize = 128 << 20;
    let writer = std::thread::spawn(move || {
        let chunk = vec![b'a'; 1 << 20];
        let mut sent = 0;
        if w.write_all(b"GET /metrics HTTP/1.1\r\nX-Long: ").is_err() {
            return sent;
        }
        while sent < FLOOD {
            if w.write_all(&chunk).is_err() {
                break;
            }
            sent += chunk.len();
        }
        sent
    });
    // Peak RSS while the flood lasts.
    let peak = Arc::new(AtomicU64::new(before));
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (peak, done) = (peak.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(Relaxed) {
                peak.fetch_max(rss_kib(pid), Relaxed);
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    let mut answer = Vec::new();
    let mut tmp = [0u8; 4096];
    loop {
        match s.read(&mut tmp) {
            Ok(0) | Err(_) => break,
            Ok(n) => answer.extend_from_slice(&tmp[..n]),
        }
    }
    let sent = writer.join().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    done.store(true, Relaxed);
    sampler.join().unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 431"),
        "431 or a closed connection: {answer:?}"
    );
    let grown = peak.load(Relaxed).saturating_sub(before);
    eprintln!("sent {sent} bytes; RSS {before} KiB, peak +{grown} KiB");
    assert!(grown < 32 * 1024, "RSS grew {grown} KiB on one header line");
    assert!(
        sent < FLOOD,
        "the router stopped reading: {sent} bytes went in"
    );
    assert_eq!(
        request(r.admin, "GET", "/metrics", &[], b"")
            .unwrap()
            .status,
        200
    );
}

#[test]
fn a_slowloris_admin_head_is_cut_at_the_header_timeout() {
    let e = SimEngine::spawn(&["--time-scale", "0"]);
    let r = Router::spawn(
        &[e.url()],
        &["--health-interval-ms", "0"],
        "[timeouts]\nclient_header_ms = 1000\n",
    );
    let mut s = TcpStream::connect(r.admin).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\n").unwrap();
    let t = Instant::now();
    let mut answer = Vec::new();
    let mut tmp = [0u8; 4096];
    // A header line every 300 ms, never the blank line, for at most 8 s.
    'trickle: while t.elapsed() < Duration::from_secs(8) {
        if s.write_all(b"X-Slow: 1\r\n").is_err() {
            break;
        }
        let until = Instant::now() + Duration::from_millis(300);
        while Instant::now() < until {
            match s.read(&mut tmp) {
                Ok(0) => break 'trickle,
                Ok(n) => answer.extend_from_slice(&tmp[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
                Err(_) => break 'trickle,
            }
        }
    }
    let took = t.elapsed();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer:?}");
    assert!(took < Duration::from_secs(5), "cut after {took:?}");
}

#[test]
fn admin_query_strings_are_percent_decoded_in_either_case() {
    let e = SimEngine::spawn(&["--time-scale", "0"]);
    let r = Router::spawn(&[e.url()], &["--health-interval-ms", "0"], "");
    let lower = e.url().replace(':', "%3a").replace('/', "%2f");
    let resp = request(
        r.admin,
        "POST",
        &format!("/admin/drain?backend={lower}"),
        &[],
        b"",
    )
    .unwrap();
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(r.backend(&e.url())["draining"], true);
    let resp = request(
        r.admin,
        "POST",
        &format!("/admin/undrain?backend={}", encoded(&e.url())),
        &[],
        b"",
    )
    .unwrap();
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(r.backend(&e.url())["draining"], false);
    let bad = request(r.admin, "POST", "/admin/drain?backend=http%3", &[], b"").unwrap();
    assert_eq!(bad.status, 400, "{}", bad.text());
}

#[test]
fn a_short_hostile_soak_keeps_normal_traffic_whole_and_health_checks_live() {
    let out = std::process::Command::new(testkit::bin_path("soak"))
        .args([
            "--hostile",
            "--seconds",
            "7",
            "--report-every",
            "7",
            "--clients",
            "4",
            "--slow-readers",
            "2",
            "--slowloris",
            "8",
            "--uploaders",
            "1",
            "--upload-mib",
            "2",
        ])
        .output()
        .expect("run soak --hostile");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "soak failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = |prefix: &str| {
        stdout
            .lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("a line starting {prefix:?}"))
            .to_owned()
    };
    let field = |line: &str, name: &str| -> String {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
            .unwrap_or_else(|| panic!("{name} in {line}"))
            .to_owned()
    };
    let clean = line("hostile: phase=clean ");
    let hostile = line("hostile: phase=hostile ");
    assert_eq!(field(&clean, "success"), "100.000%", "{clean}");
    assert!(
        field(&hostile, "ok").parse::<u64>().unwrap() > 10,
        "{hostile}"
    );
    // The health checker kept following the canary beside the trickler.
    assert_eq!(field(&hostile, "canary_flips_missed"), "0", "{hostile}");
    assert!(
        !line("hostile: peers:").ends_with("never"),
        "trickler taken out"
    );
}

#[test]
fn the_engine_kind_is_read_until_known_and_follows_a_changed_slot_count() {
    use testkit::fake_backend::{FakeBackend as Fake, respond};
    // What `/props` answers: 0 a llama-server still loading its model
    // (503), 1 slow (3 s, past the probe timeout), 2 four slots, 3 two.
    let mode = Arc::new(AtomicUsize::new(0));
    let m = mode.clone();
    let fake = Fake::spawn(move |req, s| {
        let json = "content-type: application/json\r\n";
        match (req.target.as_str(), m.load(Relaxed)) {
            ("/props", 0) => respond(
                s,
                503,
                json,
                br#"{"error":{"code":503,"message":"Loading model"}}"#,
            ),
            ("/props", 1) => {
                std::thread::sleep(Duration::from_secs(3));
                respond(s, 200, json, br#"{"total_slots":4}"#)
            }
            ("/props", 2) => respond(s, 200, json, br#"{"total_slots":4}"#),
            ("/props", _) => respond(s, 200, json, br#"{"total_slots":2}"#),
            _ => respond(s, 404, json, b"{}"),
        };
        false
    });
    let props = || fake.log().iter().filter(|r| r.target == "/props").count();
    let r = Router::spawn(
        &[fake.url()],
        &[],
        "[health]\ninterval_ms = 100\ntimeout_ms = 500\n",
    );
    let kind = || {
        let b = r.backend(&fake.url());
        (
            b["engine"].as_str().unwrap().to_owned(),
            b["slots"].as_u64(),
        )
    };
    let wait_kind = |want: (&str, u64)| {
        let deadline = Instant::now() + SETTLE;
        while kind() != (want.0.to_owned(), Some(want.1)) {
            assert!(
                Instant::now() < deadline,
                "the engine is {:?}, not {want:?}; /props asked {} times",
                kind(),
                props()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    // Loading, then slow: not known yet, a block cache meanwhile, asked again.
    let deadline = Instant::now() + SETTLE;
    while props() < 3 {
        assert!(Instant::now() < deadline, "/props asked {} times", props());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(kind(), ("blocks".to_owned(), Some(0)));
    mode.store(1, Relaxed);
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(kind(), ("blocks".to_owned(), Some(0)));
    // Loaded: known at a following probe.
    mode.store(2, Relaxed);
    wait_kind(("slots", 4));
    // Known: asked again every few seconds, not at every probe (10 a second).
    let before = props();
    std::thread::sleep(Duration::from_secs(2));
    assert!(props() - before <= 2, "{} asks in 2 s", props() - before);
    // Restarted with another slot count, never seen down: followed.
    mode.store(3, Relaxed);
    wait_kind(("slots", 2));
    // An answer that tells nothing changes nothing known.
    mode.store(0, Relaxed);
    std::thread::sleep(Duration::from_secs(6));
    assert_eq!(kind(), ("slots".to_owned(), Some(2)));
}
