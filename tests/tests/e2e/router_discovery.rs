//! Discovery end to end: a real DNS server on loopback (`testkit::dns`)
//! and a watched file give the router its backends while traffic runs.
//! Engines are sim-engines on loopback addresses (127.0.0.x, one port for an
//! A-record fleet, as a headless service gives). What must hold: no request
//! fails because a backend was added or removed; a new backend gets traffic
//! only once its health probe passed (one that fails its probes gets none);
//! a failing source keeps the last good fleet and logs its error once.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::json;
use testkit::dns::{DnsServer, Mode};
use testkit::engine_proc::SimEngine;
use testkit::http::post_json;
use testkit::proc::free_port;
use testkit::router_proc::Router;

/// Each answer takes a few decode steps, so requests are in flight when a
/// backend leaves.
const ENGINE: &[&str] = &[
    "--decode-step-ms",
    "10",
    "--decode-step-per-seq-ms",
    "0",
    "--prefill-tps",
    "0",
];
/// Generous: the machine is shared and loaded.
const WAIT: Duration = Duration::from_secs(30);
/// `ENGINE`'s decode step.
const DECODE_STEP_MS: u64 = 10;
/// Tokens of the long stream: 3 s of decode steps, far longer than a
/// source's poll (200 ms) and the router's reaction to it.
const STREAM_TOKENS: u64 = 300;
/// The workload's bounds, whatever the test does.
const MAX_REQUESTS: usize = 5_000;
const MAX_RUN: Duration = Duration::from_secs(120);

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn engine_on(id: &str, addr: &str) -> SimEngine {
    let mut args = vec!["--id", id, "--listen", addr];
    args.extend_from_slice(ENGINE);
    SimEngine::spawn(&args)
}

/// Router settings every test shares: probes every 200 ms, and sources
/// polled every 200 ms.
fn router_toml(discovery: &str) -> String {
    format!(
        "[health]\ninterval_ms = 200\ntimeout_ms = 500\n\n[discovery]\ntimeout_ms = 1000\n{discovery}"
    )
}

/// Two clients sending chat requests with fresh prompts until `stop`;
/// every answer's status.
fn workload(addr: SocketAddr, stop: Arc<AtomicBool>) -> Vec<JoinHandle<Vec<u16>>> {
    (0..2)
        .map(|c| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let started = Instant::now();
                let mut statuses = Vec::new();
                for i in 0..MAX_REQUESTS / 2 {
                    if stop.load(Ordering::Relaxed) || started.elapsed() > MAX_RUN {
                        break;
                    }
                    let body = json!({"model": "sim-llama-8b", "max_tokens": 4, "messages": [
                        {"role": "system", "content": format!("client {c} conversation {i}")},
                        {"role": "user", "content": "hi"}]});
                    let status =
                        post_json(addr, "/v1/chat/completions", &body).map_or(0, |r| r.status);
                    statuses.push(status);
                }
                statuses
            })
        })
        .collect()
}

fn finish(stop: &AtomicBool, clients: Vec<JoinHandle<Vec<u16>>>) -> Vec<u16> {
    stop.store(true, Ordering::Relaxed);
    clients
        .into_iter()
        .flat_map(|c| c.join().unwrap())
        .collect()
}

fn assert_all_ok(statuses: &[u16]) {
    let failed: Vec<_> = statuses.iter().filter(|s| **s != 200).collect();
    assert!(
        statuses.len() > 20,
        "too few requests ran: {}",
        statuses.len()
    );
    assert!(
        failed.is_empty(),
        "{} of {} requests failed: {failed:?}",
        failed.len(),
        statuses.len()
    );
}

fn urls(r: &Router) -> Vec<String> {
    let mut u: Vec<String> = r
        .backends()
        .iter()
        .map(|b| b["url"].as_str().unwrap().to_owned())
        .collect();
    u.sort();
    u
}

/// Polls until `pred` holds, or panics with `what` after `WAIT`.
fn wait_until(what: &str, mut pred: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !pred() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn healthy(r: &Router, url: &str) -> bool {
    r.backends()
        .iter()
        .any(|b| b["url"] == url && b["healthy"] == true)
}

/// A backend that fails every health probe (503) and counts the requests
/// it is sent besides them.
struct Sick {
    requests: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl Sick {
    fn spawn(addr: &str) -> Sick {
        let l = TcpListener::bind(addr).unwrap();
        l.set_nonblocking(true).unwrap();
        let (requests, stop) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let (n, s) = (requests.clone(), stop.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let Ok((mut c, _)) = l.accept() else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                c.set_nonblocking(false).unwrap();
                c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                let mut head = [0u8; 4096];
                let got = c.read(&mut head).unwrap_or(0);
                if !head[..got].starts_with(b"GET /health ") {
                    n.fetch_add(1, Ordering::Relaxed);
                }
                let _ = c.write_all(
                    b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                );
            }
        });
        Sick { requests, stop }
    }
}

impl Drop for Sick {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// A long streamed chat opened through the router (`debug_headers` on):
/// the connection, the backend the response head names, and what was read.
fn open_stream(addr: SocketAddr) -> (std::net::TcpStream, String, Vec<u8>) {
    let body =
        json!({"model": "sim-llama-8b", "max_tokens": STREAM_TOKENS, "stream": true, "messages": [
        {"role": "user", "content": "a long stream that outlives its backend's record"}]})
        .to_string();
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(WAIT)).unwrap();
    write!(
        c,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = c.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "closed before the head: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&got).into_owned();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    let backend = text
        .lines()
        .find_map(|l| l.strip_prefix("x-prefix-router-backend: "))
        .expect("the backend header")
        .trim()
        .to_owned();
    (c, backend, got)
}

/// Occurrences of `needle` in the router's recent log.
fn logged(r: &Router, needle: &str) -> usize {
    r.child.stderr_tail(256 * 1024).matches(needle).count()
}

#[test]
fn dns_records_added_and_removed_under_traffic() {
    let port = free_port();
    let e: Vec<SimEngine> = (2..=4)
        .map(|i| engine_on(&format!("e{i}"), &format!("127.0.0.{i}:{port}")))
        .collect();
    let url = |i: u8| format!("http://127.0.0.{i}:{port}");
    let sick = Sick::spawn(&format!("127.0.0.5:{port}"));
    let dns = DnsServer::spawn();
    dns.set_a("engines.test", &[ip("127.0.0.2"), ip("127.0.0.3")]);
    let toml = router_toml(&format!(
        "dns_server = \"{}\"\n[[discovery.dns]]\nname = \"engines.test\"\nport = {port}\ninterval_ms = 200\n",
        dns.addr
    ));
    let r = Router::spawn(&[], &["--debug-headers"], &toml);
    wait_until("both first engines are healthy", || {
        healthy(&r, &url(2)) && healthy(&r, &url(3))
    });
    let stop = Arc::new(AtomicBool::new(false));
    let clients = workload(r.addr, stop.clone());
    std::thread::sleep(Duration::from_millis(500));

    // Two records appear: a healthy engine and one that fails its probes.
    dns.set_a(
        "engines.test",
        &[
            ip("127.0.0.2"),
            ip("127.0.0.3"),
            ip("127.0.0.4"),
            ip("127.0.0.5"),
        ],
    );
    wait_until("the new engine is probed and gets traffic", || {
        healthy(&r, &url(4)) && e[2].requests_served() > 0
    });
    let b = r.backend(&url(4));
    assert!(
        b["unproven"] == false && b["requests"].as_u64() > Some(0),
        "{b}"
    );
    let s = r.backend(&url(5));
    assert!(s["healthy"] == false && s["unproven"] == true, "{s}");

    // The record of the engine serving a long stream disappears.
    let opened = Instant::now();
    let (mut stream, gone, mut got) = open_stream(r.addr);
    let gone_ip: u8 = gone
        .trim_start_matches("http://127.0.0.")
        .split(':')
        .next()
        .and_then(|i| i.parse().ok())
        .unwrap_or_else(|| panic!("a stream on {gone}"));
    let left: Vec<IpAddr> = (2..=5u8)
        .filter(|i| *i != gone_ip)
        .map(|i| ip(&format!("127.0.0.{i}")))
        .collect();
    dns.set_a("engines.test", &left);
    wait_until("the removed engine leaves the fleet", || {
        !urls(&r).contains(&gone)
    });
    assert!(
        opened.elapsed() < Duration::from_millis(STREAM_TOKENS * DECODE_STEP_MS * 3 / 4),
        "removal was too slow to overlap the stream"
    );
    // Its stream goes on to the end.
    stream.read_to_end(&mut got).unwrap();
    let text = String::from_utf8_lossy(&got);
    assert!(text.contains("data: [DONE]"), "the stream was cut: {text}");
    let removed = &e[usize::from(gone_ip - 2)];
    std::thread::sleep(Duration::from_millis(300));
    let served = removed.requests_served();
    std::thread::sleep(Duration::from_secs(1));
    let statuses = finish(&stop, clients);
    assert_all_ok(&statuses);
    assert_eq!(
        removed.requests_served(),
        served,
        "a removed backend got new requests"
    );
    assert_eq!(
        sick.requests.load(Ordering::Relaxed),
        0,
        "the backend failing its probes got traffic"
    );
    let mut want: Vec<String> = left.iter().map(|i| format!("http://{i}:{port}")).collect();
    want.sort();
    assert_eq!(urls(&r), want);
    let m = r.metrics();
    let line = format!("prefix_router_discovery_backends{{source=\"dns:engines.test:{port}\"}} 3");
    assert!(m.contains(&line), "{line} not in\n{m}");
    assert!(m.contains(&format!(
        "prefix_router_discovery_up{{source=\"dns:engines.test:{port}\"}} 1"
    )));
}

#[test]
fn dns_failures_keep_the_fleet_and_log_once() {
    let port = free_port();
    let e = engine_on("e2", &format!("127.0.0.2:{port}"));
    let url = format!("http://127.0.0.2:{port}");
    let dns = DnsServer::spawn();
    dns.set_a("engines.test", &[ip("127.0.0.2")]);
    let toml = router_toml(&format!(
        "dns_server = \"{}\"\n[[discovery.dns]]\nname = \"engines.test\"\nport = {port}\ninterval_ms = 200\n",
        dns.addr
    ));
    let r = Router::spawn(&[], &[], &toml);
    wait_until("the engine is healthy", || healthy(&r, &url));
    let source = format!("dns:engines.test:{port}");
    let state = |r: &Router| {
        let resp = testkit::http::request(r.admin, "GET", "/admin/backends", &[], b"").unwrap();
        resp.json()["discovery"][&source].clone()
    };

    dns.set_mode(Mode::ServFail);
    let before = dns.queries();
    wait_until("polls answered SERVFAIL", || dns.queries() >= before + 20);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        urls(&r),
        vec![url.clone()],
        "a failing source keeps its last good fleet"
    );
    assert_eq!(
        logged(&r, "discovery failed"),
        1,
        "one log line per change of error"
    );
    let st = state(&r);
    assert!(st["failing"] == true && st["backends"] == 1, "{st}");
    assert!(
        st["last_error"].is_string() && st["errors"].as_u64() >= Some(5),
        "{st}"
    );

    // A server that does not answer at all: a new error, logged once more.
    dns.set_mode(Mode::Silent);
    wait_until("a poll timed out", || logged(&r, "discovery failed") == 2);
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(logged(&r, "discovery failed"), 2);
    assert_eq!(urls(&r), vec![url.clone()]);
    let resp = post_json(
        r.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "still here"}]}),
    )
    .unwrap();
    assert_eq!(resp.status, 200, "{}", resp.text());

    // The name is gone for good (NXDOMAIN): removal once that repeats.
    dns.set_mode(Mode::Normal);
    dns.remove("engines.test");
    wait_until("the fleet is empty", || urls(&r).is_empty());
    assert_eq!(logged(&r, "keeping the last ones until that repeats"), 1);
    let resp = post_json(
        r.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "nobody"}]}),
    )
    .unwrap();
    assert_eq!(resp.status, 503, "{}", resp.text());
    drop(e);
}

#[test]
fn srv_records_give_hosts_and_ports() {
    // Two engines on their own ports, one on IPv6 loopback (an AAAA record).
    let mut args = vec!["--id", "e0"];
    args.extend_from_slice(ENGINE);
    let e0 = SimEngine::spawn(&args);
    let e1 = engine_on("e1", "[::1]:0");
    let dns = DnsServer::spawn();
    dns.set_a("e0.test", &[ip("127.0.0.1")]);
    dns.set_a("e1.test", &[ip("::1")]);
    dns.set_srv(
        "_http._tcp.engines.test",
        &[("e0.test", e0.addr.port()), ("e1.test", e1.addr.port())],
    );
    let toml = router_toml(&format!(
        "dns_server = \"{}\"\n[[discovery.dns]]\nname = \"_http._tcp.engines.test\"\nrecord = \"srv\"\ninterval_ms = 200\n",
        dns.addr
    ));
    let r = Router::spawn(&[], &["--policy", "round-robin"], &toml);
    assert!(e1.url().starts_with("http://[::1]:"), "{}", e1.url());
    wait_until("both engines are healthy", || {
        healthy(&r, &e0.url()) && healthy(&r, &e1.url())
    });
    for i in 0..8 {
        let body = json!({"messages": [{"role": "user", "content": format!("srv {i}")}]});
        assert_eq!(
            post_json(r.addr, "/v1/chat/completions", &body)
                .unwrap()
                .status,
            200
        );
    }
    assert!(e0.requests_served() > 0 && e1.requests_served() > 0);
}

#[test]
fn file_source_adds_and_removes_lines_under_traffic() {
    let e = SimEngine::fleet(3, ENGINE);
    let path = std::env::temp_dir().join(format!("router-discovery-{}.txt", std::process::id()));
    std::fs::write(&path, format!("# the fleet\n{}\n", e[0].url())).unwrap();
    let toml = router_toml(&format!(
        "[[discovery.file]]\npath = \"{}\"\ninterval_ms = 200\n",
        path.display()
    ));
    // e2 is static: the fleet is the union of the list and the file.
    let r = Router::spawn(&[e[2].url()], &["--log-json"], &toml);
    wait_until("the file's engine is healthy", || healthy(&r, &e[0].url()));
    assert_eq!(urls(&r).len(), 2);
    let stop = Arc::new(AtomicBool::new(false));
    let clients = workload(r.addr, stop.clone());
    std::thread::sleep(Duration::from_millis(500));

    // A line added, with a malformed one after it.
    std::fs::write(
        &path,
        format!("# the fleet\n{}\n{}\nnot a url\n", e[0].url(), e[1].url()),
    )
    .unwrap();
    wait_until("the added engine gets traffic", || {
        e[1].requests_served() > 0
    });
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(
        logged(&r, "skipping a malformed backend line"),
        1,
        "reported once per change"
    );
    assert!(r.child.stderr_tail(256 * 1024).contains("\"line\":4"));

    // The first line removed while requests run on it.
    std::fs::write(&path, format!("{}\nnot a url\n", e[1].url())).unwrap();
    wait_until("the removed engine leaves the fleet", || {
        !urls(&r).contains(&e[0].url())
    });
    std::thread::sleep(Duration::from_millis(500));
    let served = e[0].requests_served();
    std::thread::sleep(Duration::from_secs(1));
    // An unreadable file keeps the last good list.
    std::fs::remove_file(&path).unwrap();
    std::thread::sleep(Duration::from_secs(1));
    let statuses = finish(&stop, clients);
    assert_all_ok(&statuses);
    assert_eq!(
        e[0].requests_served(),
        served,
        "a removed backend got new requests"
    );
    let mut want = vec![e[1].url(), e[2].url()];
    want.sort();
    assert_eq!(urls(&r), want);
    assert_eq!(logged(&r, "discovery failed"), 1);
    let m = r.metrics();
    let source = format!("file:{}", path.display());
    assert!(
        m.contains(&format!(
            "prefix_router_discovery_backends{{source=\"{source}\"}} 1"
        )),
        "{m}"
    );
    assert!(
        m.contains(&format!(
            "prefix_router_discovery_up{{source=\"{source}\"}} 0"
        )),
        "{m}"
    );
}

#[test]
fn a_reload_adds_and_drops_a_source() {
    let e = SimEngine::fleet(2, ENGINE);
    let tmp = std::env::temp_dir();
    let id = std::process::id();
    let list = tmp.join(format!("router-discovery-reload-{id}.txt"));
    let config = tmp.join(format!("router-discovery-reload-{id}.toml"));
    std::fs::write(&list, format!("{}\n", e[1].url())).unwrap();
    let static_only = format!("backends = [\"{}\"]\n{}", e[0].url(), router_toml(""));
    std::fs::write(&config, &static_only).unwrap();
    let r = Router::spawn(&[], &["--config", config.to_str().unwrap()], "");
    wait_until("the static engine is healthy", || healthy(&r, &e[0].url()));
    let reload = || {
        let resp = testkit::http::request(r.admin, "POST", "/admin/reload", &[], b"").unwrap();
        assert_eq!(resp.status, 200, "{}", resp.text());
    };

    let with_file = format!(
        "{static_only}[[discovery.file]]\npath = \"{}\"\ninterval_ms = 200\n",
        list.display()
    );
    std::fs::write(&config, with_file).unwrap();
    reload();
    wait_until("the file's engine joins", || healthy(&r, &e[1].url()));
    let source = format!("file:{}", list.display());
    assert!(r.metrics().contains(&source));

    std::fs::write(&config, &static_only).unwrap();
    reload();
    wait_until("the file's engine leaves", || urls(&r) == [e[0].url()]);
    std::thread::sleep(Duration::from_millis(600));
    assert!(
        !r.metrics().contains(&source),
        "a dropped source leaves /metrics"
    );
    assert_eq!(urls(&r), [e[0].url()], "and does not come back");
    std::fs::remove_file(&list).ok();
    std::fs::remove_file(&config).ok();
}

/// Puts `make`'s result at `path` in one rename, as a config manager swaps
/// a file: readers see the old thing or the new, never a half-written one.
fn swap_in(path: &std::path::Path, make: impl FnOnce(&std::path::Path)) {
    let tmp = path.with_extension("new");
    let _ = std::fs::remove_file(&tmp);
    make(&tmp);
    std::fs::rename(&tmp, path).unwrap();
}

fn temp_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("router-discovery-{name}-{}", std::process::id()))
}

#[test]
fn a_device_or_a_pipe_in_place_of_the_file_is_refused_and_the_source_recovers() {
    let e = SimEngine::fleet(2, ENGINE);
    let path = temp_path("special.txt");
    std::fs::write(&path, format!("{}\n", e[0].url())).unwrap();
    let toml = router_toml(&format!(
        "[[discovery.file]]\npath = \"{}\"\ninterval_ms = 100\n",
        path.display()
    ));
    let r = Router::spawn(&[], &[], &toml);
    wait_until("the file's engine is healthy", || healthy(&r, &e[0].url()));
    let chat_ok = || {
        let body = json!({"messages": [{"role": "user", "content": "still served"}]});
        let resp = post_json(r.addr, "/v1/chat/completions", &body).unwrap();
        assert_eq!(resp.status, 200, "{}", resp.text());
    };
    let rss_before = r.rss_kib();

    // A symlink to /dev/zero: it reports 0 bytes and never ends. Refused
    // before a byte is read; the router's memory does not move.
    swap_in(&path, |p| {
        std::os::unix::fs::symlink("/dev/zero", p).unwrap()
    });
    let started = Instant::now();
    let mut peak = 0;
    while logged(&r, "a character device, not a regular file") == 0 {
        peak = peak.max(r.rss_kib());
        assert!(
            peak < rss_before + 64 * 1024,
            "RSS grew from {rss_before} KiB to {peak} KiB reading /dev/zero"
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the device was not refused: {}",
            r.child.stderr_tail(2048)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500));
    peak = peak.max(r.rss_kib());
    assert!(
        peak < rss_before + 64 * 1024,
        "RSS {rss_before} -> {peak} KiB"
    );
    assert_eq!(
        logged(&r, "discovery failed"),
        1,
        "one log line while it repeats"
    );
    assert_eq!(urls(&r), [e[0].url()], "the last good list stays");
    chat_ok();

    // The real file back, naming the other engine: the source recovers.
    swap_in(&path, |p| {
        std::fs::write(p, format!("{}\n", e[1].url())).unwrap()
    });
    wait_until("the source recovers from the device", || {
        urls(&r) == [e[1].url()] && healthy(&r, &e[1].url())
    });

    // A named pipe nobody writes: opening it would block the reader.
    swap_in(&path, |p| {
        let made = std::process::Command::new("mkfifo").arg(p).status();
        assert!(made.is_ok_and(|s| s.success()), "mkfifo");
    });
    wait_until("the pipe is refused", || {
        logged(&r, "a named pipe, not a regular file") >= 1
    });
    chat_ok();
    swap_in(&path, |p| {
        std::fs::write(p, format!("{}\n", e[0].url())).unwrap()
    });
    wait_until("the source recovers from the pipe", || {
        urls(&r) == [e[0].url()] && healthy(&r, &e[0].url())
    });
    chat_ok();
    let m = r.metrics();
    let up = format!(
        "prefix_router_discovery_up{{source=\"file:{}\"}} 1",
        path.display()
    );
    assert!(m.contains(&up), "{up} not in\n{m}");
    std::fs::remove_file(&path).ok();
}

#[test]
fn past_the_backend_limit_the_sources_order_decides_and_healthy_backends_stay() {
    const DEAD: usize = 5_000;
    const LIMIT: usize = 1_024;
    let e = engine_on("live", "127.0.0.1:0");
    // Addresses nothing listens on, that sort before the live engine's
    // (`127.0.0.1N:` < `127.0.0.1:`).
    let dead: Vec<String> = (0..DEAD)
        .map(|i| format!("http://127.0.0.{}:{}", 10 + i / 500, 1 + i % 500))
        .collect();
    let path = temp_path("limit.txt");
    std::fs::write(&path, format!("{}\n{}\n", e.url(), dead.join("\n"))).unwrap();
    // Probes once a second: a thousand probers on two cores.
    let toml = format!(
        "[health]\ninterval_ms = 1000\ntimeout_ms = 500\n\n[discovery]\ntimeout_ms = 2000\n\
         [[discovery.file]]\npath = \"{}\"\ninterval_ms = 200\n",
        path.display()
    );
    let r = Router::spawn(&[], &[], &toml);
    wait_until("the file's first line, the live engine, is healthy", || {
        healthy(&r, &e.url())
    });
    assert_eq!(r.backends().len(), LIMIT);
    for i in 0..5 {
        let body = json!({"messages": [{"role": "user", "content": format!("limit {i}")}]});
        let resp = post_json(r.addr, "/v1/chat/completions", &body).unwrap();
        assert_eq!(resp.status, 200, "{}", resp.text());
    }
    let source = format!("file:{}", path.display());
    let state = || {
        let resp = testkit::http::request(r.admin, "GET", "/admin/backends", &[], b"").unwrap();
        resp.json()["discovery"][&source].clone()
    };
    let st = state();
    assert_eq!(st["left_out"], DEAD + 1 - LIMIT, "{st}");
    assert_eq!(st["left_out_first"][0], dead[LIMIT - 1], "{st}");
    let line = format!(
        "prefix_router_discovery_left_out_backends{{source=\"{source}\"}} {}",
        DEAD + 1 - LIMIT
    );
    assert!(r.metrics().contains(&line), "{line}");
    assert_eq!(logged(&r, "discovered backends left out"), 1);

    // The live engine moves to the last line, under one more dead line at
    // the top: healthy, it is not dropped for a dead one.
    let text = format!("http://127.0.0.9:1\n{}\n{}\n", dead.join("\n"), e.url());
    std::fs::write(&path, text).unwrap();
    wait_until("the new order is read", || {
        state()["left_out_first"][0] == dead[LIMIT - 2]
    });
    assert!(healthy(&r, &e.url()));
    let body = json!({"messages": [{"role": "user", "content": "still here"}]});
    let resp = post_json(r.addr, "/v1/chat/completions", &body).unwrap();
    assert_eq!(resp.status, 200, "{}", resp.text());
    std::fs::remove_file(&path).ok();
}

#[test]
fn a_source_replacing_its_whole_list_never_leaves_the_fleet_without_a_backend() {
    const SWAPS: usize = 12;
    let e = SimEngine::fleet(4, ENGINE);
    let path = temp_path("swap.txt");
    std::fs::write(&path, format!("{}\n", e[0].url())).unwrap();
    let toml = router_toml(&format!(
        "[[discovery.file]]\npath = \"{}\"\ninterval_ms = 100\n",
        path.display()
    ));
    let r = Router::spawn(&[], &[], &toml);
    wait_until("the first engine is healthy", || healthy(&r, &e[0].url()));
    let stop = Arc::new(AtomicBool::new(false));
    let clients = workload(r.addr, stop.clone());
    // Each swap names an engine the fleet does not hold: the whole list
    // is replaced at once.
    for i in 1..=SWAPS {
        let next = &e[i % e.len()];
        swap_in(&path, |p| {
            std::fs::write(p, format!("{}\n", next.url())).unwrap()
        });
        wait_until("the swap is handed over", || urls(&r) == [next.url()]);
        std::thread::sleep(Duration::from_millis(200));
    }
    let statuses = finish(&stop, clients);
    assert_all_ok(&statuses);
    assert!(
        logged(&r, "handover done") >= SWAPS,
        "{}",
        r.child.stderr_tail(4096)
    );
    std::fs::remove_file(&path).ok();
}
