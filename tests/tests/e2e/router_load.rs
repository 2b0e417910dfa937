//! Load: 10,000 concurrent client connections held open with bounded router
//! memory (the KiB per connection is printed), requests still served; and a
//! short soak (the `soak` binary for ~20 s) with an engine killed and
//! restarted, losing no request that was not on the killed engine.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use testkit::engine_proc::SimEngine;
use testkit::http::post_json;
use testkit::router_proc::Router;

const CONNECTIONS: usize = 10_000;
/// What an idle connection may cost the router, generously: its buffers
/// start at 8 KiB + 2 KiB, most of it never touched while idle.
const MAX_KIB_PER_CONNECTION: f64 = 64.0;

/// Raises this process's soft open-files limit to `want` (bounded by the
/// hard limit); returns the new soft limit.
fn raise_nofile(want: u64) -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to an rlimit we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 0;
        }
        if lim.rlim_cur < want {
            lim.rlim_cur = want.min(lim.rlim_max);
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return 0;
            }
        }
    }
    lim.rlim_cur
}

fn chat(user: &str) -> serde_json::Value {
    serde_json::json!({"max_tokens": 2, "messages": [{"role": "user", "content": user}]})
}

/// One keep-alive request on an open connection; the status.
fn keep_alive_request(s: &mut TcpStream, user: &str) -> u16 {
    let body = chat(user).to_string();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("write on a held connection");
    let mut r = BufReader::new(&mut *s);
    let mut line = String::new();
    r.read_line(&mut line).expect("status line");
    let status = line.get(9..12).and_then(|v| v.parse().ok()).unwrap_or(0);
    let mut len = 0usize;
    loop {
        let mut h = String::new();
        r.read_line(&mut h).expect("header");
        if h == "\r\n" || h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':')
            && k.eq_ignore_ascii_case("content-length")
        {
            len = v.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0; len];
    r.read_exact(&mut body).expect("body");
    status
}

#[test]
fn ten_thousand_idle_connections_with_bounded_memory() {
    let need = CONNECTIONS as u64 + 500;
    let got = raise_nofile(need);
    if got < need {
        eprintln!(
            "SKIP: this process may open only {got} files (hard RLIMIT_NOFILE); {need} are needed"
        );
        return;
    }
    let e = SimEngine::spawn(&["--time-scale", "0"]);
    let r = Router::spawn(&[e.url()], &[], "");
    // Warm up: pools, buffers, the index.
    for i in 0..50 {
        let resp = post_json(r.addr, "/v1/chat/completions", &chat(&format!("w{i}"))).unwrap();
        assert_eq!(resp.status, 200);
    }
    std::thread::sleep(Duration::from_millis(300));
    let before = r.rss_kib();

    let t = Instant::now();
    let mut held: Vec<TcpStream> = Vec::with_capacity(CONNECTIONS);
    for i in 0..CONNECTIONS {
        let s = connect_retrying(r.addr).unwrap_or_else(|e| panic!("connection {i}: {e}"));
        held.push(s);
    }
    let opened = t.elapsed();
    // A request on the last connections opened: each worker's accept queue is
    // FIFO, so once these are served the router holds all of them.
    let tail = CONNECTIONS - 64;
    for (i, s) in held[tail..].iter_mut().enumerate() {
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        assert_eq!(keep_alive_request(s, &format!("tail {i}")), 200);
    }
    std::thread::sleep(Duration::from_millis(500));
    let after = r.rss_kib();
    let per_conn = after.saturating_sub(before) as f64 / CONNECTIONS as f64;
    println!(
        "router RSS {before} KiB -> {after} KiB with {CONNECTIONS} open connections \
         (opened in {opened:?}): {per_conn:.1} KiB per connection"
    );
    assert!(
        per_conn < MAX_KIB_PER_CONNECTION,
        "{per_conn:.1} KiB per idle connection"
    );

    // Still serving: on held connections spread over the set, and fresh ones.
    for (i, s) in held.iter_mut().step_by(CONNECTIONS / 50).enumerate() {
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        assert_eq!(keep_alive_request(s, &format!("held {i}")), 200);
    }
    for i in 0..20 {
        let resp = post_json(r.addr, "/v1/chat/completions", &chat(&format!("f{i}"))).unwrap();
        assert_eq!(resp.status, 200);
    }
    drop(held);
}

/// Connects, retrying briefly when the listen backlog is momentarily full.
fn connect_retrying(addr: SocketAddr) -> std::io::Result<TcpStream> {
    let mut last = None;
    for _ in 0..50 {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(last.expect("tried"))
}

#[test]
fn a_short_soak_loses_only_requests_on_the_killed_engine() {
    let out = Command::new(testkit::bin_path("soak"))
        .args([
            "--seconds",
            "20",
            "--kill-every",
            "5",
            "--down",
            "2",
            "--report-every",
            "5",
            "--clients",
            "8",
        ])
        .output()
        .expect("run soak");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "soak failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let done = stdout
        .lines()
        .find(|l| l.starts_with("soak: done:"))
        .expect("a summary line");
    let field = |name: &str| -> u64 {
        done.split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} in {done}"))
    };
    assert!(field("kills") >= 2, "{done}");
    assert!(field("ok") > 100, "traffic flowed: {done}");
    assert_eq!(field("lost_other"), 0, "{done}");
}
