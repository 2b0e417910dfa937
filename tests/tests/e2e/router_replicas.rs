//! Router replicas sharing one mind (`[replicas]`), with real processes:
//! what one replica sends, the others route on; a replica that starts late
//! or restarts catches up from a peer's snapshot before it is ready; a
//! publisher without the key, a garbage one, a silent one or a flood changes
//! nothing and grows nothing.

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};

use prefix_router::replica::wire::{Key, Kind, Payload, seal};
use serde_json::json;
use testkit::engine_proc::SimEngine;
use testkit::http::post_json;
use testkit::proc::free_port;
use testkit::router_proc::{Router, explain};
use zeromq::{Socket, SocketSend, ZmqMessage};

const KEY: &str = "replica-test-shared-key";

/// A stream port whose next port (the snapshot socket) is free too.
pub(crate) fn port_pair() -> u16 {
    for _ in 0..100 {
        let p = free_port();
        if p < u16::MAX && TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            return p;
        }
    }
    panic!("no two free ports in a row");
}

pub(crate) fn replicas_toml(me: u16, peers: &[u16], key: &str) -> String {
    let list: Vec<String> = peers.iter().map(|p| format!("\"127.0.0.1:{p}\"")).collect();
    format!(
        "[replicas]\nlisten = \"127.0.0.1:{me}\"\npeers = [{}]\nkey = \"{key}\"\nsnapshot_timeout_ms = 1500\n",
        list.join(", ")
    )
}

/// A long system prompt, so the prompt spans many blocks.
fn chat(system: &str, user: &str) -> serde_json::Value {
    json!({
        "max_tokens": 4,
        "messages": [
            {"role": "system", "content": system.repeat(40)},
            {"role": "user", "content": user},
        ],
    })
}

fn send(r: &Router, body: &serde_json::Value) {
    let resp = post_json(r.addr, "/v1/chat/completions", body).expect("request");
    assert_eq!(resp.status, 200, "{}", resp.text());
}

/// What `r` would route `body` to, and the blocks it holds there.
fn holder(r: &Router, body: &serde_json::Value) -> (String, u64) {
    let ex = explain(r.admin, "chat", body);
    (
        ex["chosen"].as_str().unwrap_or("").to_owned(),
        ex["matched_blocks"].as_u64().unwrap_or(0),
    )
}

/// The blocks of `body` that `r` believes `url` holds.
fn matched_on(r: &Router, body: &serde_json::Value, url: &str) -> u64 {
    let ex = explain(r.admin, "chat", body);
    let candidates = ex["candidates"].as_array().cloned().unwrap_or_default();
    candidates
        .iter()
        .find(|c| c["url"] == url)
        .and_then(|c| c["matched_blocks"].as_u64())
        .unwrap_or(0)
}

fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("timed out waiting until {what}");
}

fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let r = testkit::http::request(addr, "GET", path, &[], b"").expect("GET");
    (r.status, r.text())
}

fn replicas(r: &Router) -> serde_json::Value {
    let (status, text) = get(r.admin, "/admin/replicas");
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).expect("json")
}

#[test]
fn what_one_replica_sends_the_other_routes_on() {
    let engines = SimEngine::fleet(3, &["--time-scale", "0"]);
    let urls: Vec<String> = engines.iter().map(SimEngine::url).collect();
    let (pa, pb) = (port_pair(), port_pair());
    let a = Router::spawn(&urls, &[], &replicas_toml(pa, &[pa, pb], KEY));
    let b = Router::spawn(&urls, &[], &replicas_toml(pb, &[pa, pb], KEY));
    for r in [&a, &b] {
        wait_until("the replica is ready", Duration::from_secs(10), || {
            get(r.admin, "/ready").0 == 200
        });
    }
    wait_until(
        "the replicas follow each other",
        Duration::from_secs(10),
        || {
            let peers = replicas(&b)["peers"].clone();
            peers[format!("127.0.0.1:{pa}")]["phase"] == "live"
        },
    );
    // Each replica recognises its own address and does not follow it.
    assert_eq!(
        replicas(&b)["peers"][format!("127.0.0.1:{pb}")]["phase"],
        "myself"
    );
    // Several new prompts through A only: B learns where each went.
    for i in 0..6 {
        let body = chat(&format!("You are support agent number {i}. "), "Hello");
        assert_eq!(holder(&b, &body).1, 0, "B knows nothing of prompt {i} yet");
        send(&a, &body);
        let (chosen_a, matched_a) = holder(&a, &body);
        assert!(matched_a > 10, "A holds prompt {i}");
        wait_until("B learns what A sent", Duration::from_secs(5), || {
            holder(&b, &body) == (chosen_a.clone(), matched_a)
        });
    }
    // A's connections to the engines (kept alive, idle now) reach B as a
    // peer's on this host: B's XDP counters see them, and they are not load.
    let open = |r: &Router, field: &str| -> u64 {
        let (status, text) = get(r.admin, "/admin/backends");
        assert_eq!(status, 200, "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).expect("json");
        v["backends"]
            .as_array()
            .expect("backends")
            .iter()
            .map(|b| b[field].as_u64().expect(field))
            .sum()
    };
    assert!(open(&a, "open_connections") > 0);
    wait_until(
        "B counts A's connections as a peer's",
        Duration::from_secs(5),
        || open(&b, "peers_connections") == open(&a, "open_connections"),
    );
    let rb = replicas(&b);
    let peer = &rb["peers"][format!("127.0.0.1:{pa}")];
    assert_eq!(peer["gaps"], 0, "{rb}");
    assert_eq!(peer["unauthenticated"], 0, "{rb}");
    assert!(peer["messages"].as_u64().unwrap() >= 6, "{rb}");
    // The same counts on /metrics.
    let m = b.metrics();
    assert!(
        m.contains(&format!("replica_peer_up{{peer=\"127.0.0.1:{pa}\"}} 1")),
        "{m}"
    );
}

#[test]
fn a_replica_that_starts_late_or_restarts_catches_up_before_it_is_ready() {
    let engines = SimEngine::fleet(2, &["--time-scale", "0"]);
    let urls: Vec<String> = engines.iter().map(SimEngine::url).collect();
    let (pa, pb) = (port_pair(), port_pair());
    let a = Router::spawn(&urls, &[], &replicas_toml(pa, &[pa, pb], KEY));
    let prompts: Vec<_> = (0..8)
        .map(|i| chat(&format!("Template {i}: answer as a travel agent. "), "Hi"))
        .collect();
    for p in &prompts {
        send(&a, p);
    }
    for round in 0..2 {
        let b = Router::spawn(&urls, &[], &replicas_toml(pb, &[pa, pb], KEY));
        wait_until("the late replica is ready", Duration::from_secs(10), || {
            get(b.admin, "/ready").0 == 200
        });
        let rb = replicas(&b);
        assert!(
            rb["snapshot_blocks"].as_u64().unwrap() > 0,
            "round {round}: {rb}"
        );
        // Ready means caught up: every prompt A placed is where A has it.
        for p in &prompts {
            assert_eq!(holder(&b, p), holder(&a, p), "round {round}");
        }
        drop(b); // killed; started again in the next round
    }
}

/// Publishes `frames` from a ZMQ PUB socket on `port`, a round every `pace`
/// (as fast as it can when zero), for `for_how_long` or until `stop`.
fn publisher(
    port: u16,
    frames: Vec<Vec<u8>>,
    pace: Duration,
    for_how_long: Duration,
    stop: Arc<AtomicBool>,
) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let mut s = zeromq::PubSocket::new();
        s.bind(&format!("tcp://127.0.0.1:{port}"))
            .await
            .expect("bind");
        let end = Instant::now() + for_how_long;
        let mut sent = 0u64;
        while Instant::now() < end && sent < 2_000_000 && !stop.load(Relaxed) {
            for f in &frames {
                let _ = s.send(ZmqMessage::from(f.clone())).await;
                sent += 1;
            }
            if pace.is_zero() {
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(pace).await;
            }
        }
    });
}

#[test]
fn an_unauthenticated_or_garbage_publisher_changes_nothing_and_grows_nothing() {
    let engines = SimEngine::fleet(2, &["--time-scale", "0"]);
    let urls: Vec<String> = engines.iter().map(SimEngine::url).collect();
    let (pa, evil) = (port_pair(), port_pair());
    let a = Router::spawn(&urls, &[], &replicas_toml(pa, &[pa, evil], KEY));
    let body = chat("You are a hostile peer's target. ", "Hi");
    // The prompt's own block hashes, claimed for engine 0 under another key,
    // and the same cut short.
    let hashes = prompt_hashes(&body);
    let engine0 = xxhash_rust::xxh3::xxh3_64(urls[0].as_bytes());
    let sent = |key: &Key| {
        let mut p = Payload::new(Kind::Sent, 16 + 8 * hashes.len());
        p.u64(engine0)
            .u64(1)
            .u32(0)
            .u32(0)
            .words(hashes.iter().copied())
            .words(std::iter::empty());
        seal(p, 99, 0, key)
    };
    let forged = sent(&Key::derive(b"not the shared key at all"));
    let mut garbage = forged.clone();
    garbage.truncate(40);
    let big = vec![0xAB; 400 * 1024];
    let rss_before = a.rss_kib();
    let flood = vec![forged, garbage, big];
    let never = Arc::new(AtomicBool::new(false));
    let t = std::thread::spawn(move || {
        publisher(evil, flood, Duration::ZERO, Duration::from_secs(3), never)
    });
    wait_until(
        "the router counts the forged frames",
        Duration::from_secs(10),
        || {
            let peers = replicas(&a)["peers"].clone();
            let p = &peers[format!("127.0.0.1:{evil}")];
            p["unauthenticated"].as_u64().unwrap_or(0) + p["malformed"].as_u64().unwrap_or(0) > 100
        },
    );
    // Meanwhile the router serves as before.
    for _ in 0..20 {
        send(&a, &chat("An honest request. ", "Hi"));
    }
    t.join().expect("publisher");
    let ra = replicas(&a);
    let peer = &ra["peers"][format!("127.0.0.1:{evil}")];
    assert_eq!(peer["messages"], 0, "nothing applied: {ra}");
    assert_ne!(peer["phase"], "live", "{ra}");
    // Nothing learned from it: the prompt is still unknown everywhere.
    assert_eq!(holder(&a, &body).1, 0);
    let grown_mib = a.rss_kib().saturating_sub(rss_before) / 1024;
    assert!(grown_mib < 64, "RSS grew {grown_mib} MiB under the flood");
    // The control: the same message under the shared key is applied, at a
    // peer's pace (each claim is a request in flight on engine 0 until the
    // peer's next load report, so a flood of them would make it look busy).
    let honest = sent(&Key::derive(KEY.as_bytes()));
    let applied = Arc::new(AtomicBool::new(false));
    let stop = applied.clone();
    let t = std::thread::spawn(move || {
        publisher(
            evil,
            vec![honest],
            Duration::from_millis(20),
            Duration::from_secs(20),
            stop,
        )
    });
    wait_until(
        "the signed claim is applied",
        Duration::from_secs(15),
        || matched_on(&a, &body, &urls[0]) == hashes.len() as u64,
    );
    applied.store(true, Relaxed);
    t.join().expect("publisher");
}

/// The block hashes the router computes for a chat body (default block size).
fn prompt_hashes(body: &serde_json::Value) -> Vec<u64> {
    use prefix_router::prompt::extract::Endpoint;
    use prefix_router::prompt::hash::{DEFAULT_BLOCK_BYTES, block_hashes_pieces};
    use prefix_router::prompt::scan::{Canonical, scan};
    let bytes = serde_json::to_vec(body).expect("json");
    let mut canon = Canonical::default();
    let p = scan(Endpoint::Chat, &bytes, &mut canon).expect("scan");
    let (mut carry, mut out) = (Vec::new(), Vec::new());
    block_hashes_pieces(
        p.seed,
        canon.pieces(&bytes),
        DEFAULT_BLOCK_BYTES,
        &mut carry,
        &mut out,
    );
    out
}

#[test]
fn a_silent_peer_does_not_hold_requests_back() {
    let engines = SimEngine::fleet(2, &["--time-scale", "0"]);
    let urls: Vec<String> = engines.iter().map(SimEngine::url).collect();
    // A peer that accepts connections and never says a word.
    let silent = TcpListener::bind("127.0.0.1:0").expect("bind");
    let sp = silent.local_addr().unwrap().port();
    let _hold = std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in silent.incoming().take(16).flatten() {
            held.push(s);
        }
        std::thread::sleep(Duration::from_secs(30));
    });
    let pa = port_pair();
    let a = Router::spawn(&urls, &[], &replicas_toml(pa, &[pa, sp], KEY));
    wait_until(
        "ready despite the silent peer",
        Duration::from_secs(10),
        || get(a.admin, "/ready").0 == 200,
    );
    let started = Instant::now();
    for i in 0..50 {
        send(&a, &chat(&format!("Prompt {i}. "), "Hi"));
    }
    // Zero-cost engines: 50 requests take well under a second; a request
    // that waited on the peer would take its 1 s connect timeout or more.
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "50 requests took {:?}",
        started.elapsed()
    );
    let ra = replicas(&a);
    assert_ne!(
        ra["peers"][format!("127.0.0.1:{sp}")]["phase"],
        "live",
        "{ra}"
    );
}

#[test]
fn replicas_refuse_to_start_without_a_key_or_with_a_short_one() {
    let p = port_pair();
    for (i, toml) in [
        format!("[replicas]\nlisten = \"127.0.0.1:{p}\"\n"),
        replicas_toml(p, &[], "short"),
    ]
    .into_iter()
    .enumerate()
    {
        let path =
            std::env::temp_dir().join(format!("replicas-refused-{}-{i}.toml", std::process::id()));
        std::fs::write(&path, toml).expect("config");
        let out = std::process::Command::new(testkit::bin_path("prefix-router"))
            .args(["--backend", "http://127.0.0.1:9", "--listen", "127.0.0.1:0"])
            .arg("--config")
            .arg(&path)
            .output()
            .expect("run prefix-router");
        let _ = std::fs::remove_file(&path);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "it must refuse: {err}");
        assert!(err.contains("key"), "{err}");
    }
}

#[test]
fn a_replica_learns_an_engines_capacity_from_its_peers_answers() {
    // One engine with room for 512 blocks that does not tell the routers;
    // each starts from its default of 65,536.
    let cap = 512.0;
    let engines = SimEngine::fleet(1, &["--time-scale", "0", "--kv-blocks", "512"]);
    let urls: Vec<String> = engines.iter().map(SimEngine::url).collect();
    let (pa, pb) = (port_pair(), port_pair());
    let config = |me| {
        format!(
            "[prefix]\nread_kv_capacity = false\n{}",
            replicas_toml(me, &[pa, pb], KEY)
        )
    };
    let a = Router::spawn(&urls, &[], &config(pa));
    let b = Router::spawn(&urls, &[], &config(pb));
    wait_until(
        "the replicas follow each other",
        Duration::from_secs(10),
        || replicas(&b)["peers"][format!("127.0.0.1:{pa}")]["phase"] == "live",
    );
    assert_eq!(b.backend(&urls[0])["learned_capacity_blocks"], 65_536);
    // 24 documents of 32 blocks in a shuffled cycle, all through A: the
    // engine keeps about 15 of them, so some repeats hit and some were
    // evicted, and A's answers say which.
    let doc = |id: u64| format!("document {id:04} line; ").repeat(110)[..32 * 64].to_owned();
    let mut x = 7u64;
    for _ in 0..300 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let body = json!({"prompt": doc((x >> 33) % 24), "max_tokens": 4});
        let r = post_json(a.addr, "/v1/completions", &body).expect("completion");
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // B saw none of the answers; it learned from A's lessons.
    let learned = |r: &Router| {
        r.backend(&urls[0])["learned_capacity_blocks"]
            .as_f64()
            .unwrap()
    };
    wait_until("B learns what A learned", Duration::from_secs(5), || {
        (learned(&b) - learned(&a)).abs() <= 0.05 * learned(&a)
    });
    assert!(
        (learned(&b) - cap).abs() <= 0.25 * cap,
        "B learned {} blocks, the engine has {cap}",
        learned(&b)
    );
}
