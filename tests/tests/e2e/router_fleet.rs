//! A fleet of 1,024 backends end to end: four `sim-engine` processes serve
//! 256 engines each (`--ports`, one cache per port, zero-cost answers), and
//! one router routes over all of them. What must hold: it starts with the
//! whole fleet healthy; conversations spread over the fleet and each
//! follow-up goes back to the engine holding its history (the engines'
//! own counters agree with the router's headers); a reload that drops
//! backends and one that brings them back apply, and traffic keeps
//! succeeding and keeps its history where its engine stayed.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::json;
use testkit::engine_proc::SimEngine;
use testkit::http::{post_json, request};
use testkit::router_proc::Router;

const PROCESSES: usize = 4;
const PORTS: usize = 256;
const FLEET: usize = PROCESSES * PORTS;
/// Backends dropped by the first reload.
const DROPPED: usize = 24;
const CONVERSATIONS: usize = 24;
/// Generous: the machine is shared and loaded.
const WAIT: Duration = Duration::from_secs(30);
/// Each engine's cache, and what the router sizes its index for (the
/// default, 65,536 blocks a backend, would be a 2.8 GB index at 1,024).
const KV_BLOCKS: usize = 512;

fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) on a child process this test started.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

fn config(addrs: &[SocketAddr]) -> String {
    let list: Vec<String> = addrs.iter().map(|a| format!("\"http://{a}\"")).collect();
    format!(
        "debug_headers = true\nbackends = [{}]\n\n[prefix]\nkv_blocks = {KV_BLOCKS}\n\n[health]\ninterval_ms = 5000\ntimeout_ms = 5000\n",
        list.join(", ")
    )
}

/// A conversation's messages after `turns` user turns (a 3 KB system
/// prompt of its own, so its history spans many blocks).
fn conversation(c: usize, turns: usize) -> serde_json::Value {
    let system = format!("conversation {c}: ") + &"you are a patient assistant. ".repeat(100);
    let mut messages = vec![json!({"role": "system", "content": system})];
    for t in 0..turns {
        if t > 0 {
            messages.push(json!({"role": "assistant", "content": format!("answer {t}")}));
        }
        messages.push(json!({"role": "user", "content": format!("question {t} of {c}")}));
    }
    json!({"model": "sim-llama-8b", "max_tokens": 1, "messages": messages})
}

/// Sends one turn; returns the engine that answered and the blocks the
/// router said it held.
fn send(r: &Router, body: &serde_json::Value) -> (String, u64) {
    let resp = post_json(r.addr, "/v1/chat/completions", body).expect("chat through the router");
    assert_eq!(resp.status, 200, "{}", resp.text());
    let engine = resp.header("x-engine-id").expect("x-engine-id").to_owned();
    let matched = resp
        .header("x-prefix-router-matched-blocks")
        .and_then(|v| v.parse().ok())
        .expect("x-prefix-router-matched-blocks");
    (engine, matched)
}

/// Chat requests an engine says it answered (`sim:model_requests_total`).
fn engine_requests(addr: &str) -> u64 {
    let addr: SocketAddr = addr.parse().expect("engine id is its address");
    let m = request(addr, "GET", "/metrics", &[], b"").expect("engine /metrics");
    m.text()
        .lines()
        .filter(|l| l.starts_with("sim:model_requests_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

fn wait_fleet(r: &Router, n: usize) {
    let deadline = Instant::now() + WAIT;
    loop {
        let b = r.backends();
        if b.len() == n && b.iter().all(|b| b["healthy"] == true) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "fleet not {n} healthy backends: {} listed, {} healthy",
            b.len(),
            b.iter().filter(|b| b["healthy"] == true).count()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_1024_backend_router_starts_routes_and_reloads() {
    let started = Instant::now();
    let engines: Vec<(SimEngine, Vec<SocketAddr>)> = (0..PROCESSES)
        .map(|_| {
            SimEngine::spawn_ports(
                PORTS,
                &["--time-scale", "0", "--kv-blocks", &KV_BLOCKS.to_string()],
            )
        })
        .collect();
    let addrs: Vec<SocketAddr> = engines.iter().flat_map(|(_, a)| a.clone()).collect();
    assert_eq!(addrs.len(), FLEET);
    let path = std::env::temp_dir().join(format!("router-fleet-{}.toml", std::process::id()));
    std::fs::write(&path, config(&addrs)).unwrap();
    let r = Router::spawn(&[], &["--config", path.to_str().unwrap()], "");
    wait_fleet(&r, FLEET);

    // First turns spread over the fleet; follow-ups go back to the engine
    // holding the history, which the router says it holds.
    let mut home = BTreeMap::new();
    for c in 0..CONVERSATIONS {
        let (engine, _) = send(&r, &conversation(c, 1));
        home.insert(c, engine);
    }
    let distinct: BTreeSet<_> = home.values().collect();
    assert!(
        distinct.len() >= CONVERSATIONS / 2,
        "{CONVERSATIONS} new conversations on {} engines only",
        distinct.len()
    );
    for c in 0..CONVERSATIONS {
        let (engine, matched) = send(&r, &conversation(c, 2));
        assert_eq!(
            engine,
            home[&c],
            "conversation {c} moved; router log:\n{}",
            r.child.stderr_tail(4096)
        );
        assert!(matched > 10, "conversation {c}: {matched} blocks matched");
    }
    // The engines' own counters: each home engine answered both turns of
    // its conversations, and nothing else was sent.
    let mut per_engine: BTreeMap<&String, u64> = BTreeMap::new();
    for e in home.values() {
        *per_engine.entry(e).or_default() += 2;
    }
    for (e, n) in &per_engine {
        assert_eq!(engine_requests(e), *n, "engine {e}");
    }
    let rss = r.rss_kib() / 1024;
    println!("router RSS at {FLEET} backends: {rss} MiB");
    let metrics = r.metrics();
    assert!(
        metrics.contains("prefix_router"),
        "metrics answer at 1,024 backends"
    );

    // Reload without the last `DROPPED` backends.
    let kept = &addrs[..FLEET - DROPPED];
    std::fs::write(&path, config(kept)).unwrap();
    signal(r.child.pid(), libc::SIGHUP);
    wait_fleet(&r, FLEET - DROPPED);
    let gone: BTreeSet<String> = addrs[FLEET - DROPPED..]
        .iter()
        .map(|a| a.to_string())
        .collect();
    for c in 0..CONVERSATIONS {
        let (engine, matched) = send(&r, &conversation(c, 3));
        assert!(
            !gone.contains(&engine),
            "conversation {c} sent to removed {engine}"
        );
        if !gone.contains(&home[&c]) {
            assert_eq!(
                engine,
                home[&c],
                "conversation {c} moved after the reload; router log:\n{}",
                r.child.stderr_tail(4096)
            );
            assert!(matched > 10, "conversation {c} lost its history: {matched}");
        }
    }

    // And back to the whole fleet: the new slots take traffic.
    std::fs::write(&path, config(&addrs)).unwrap();
    signal(r.child.pid(), libc::SIGHUP);
    wait_fleet(&r, FLEET);
    let mut seen = BTreeSet::new();
    for c in CONVERSATIONS..CONVERSATIONS + 64 {
        let (engine, _) = send(&r, &conversation(c, 1));
        seen.insert(engine);
    }
    assert!(
        seen.len() >= 32,
        "64 new conversations on {} engines",
        seen.len()
    );
    std::fs::remove_file(&path).ok();
    println!("1,024-backend run took {:?}", started.elapsed());
}
