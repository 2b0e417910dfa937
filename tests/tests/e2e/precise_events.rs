//! Precise mode end to end: sim-engines (and a Python engine stand-in)
//! publish vLLM's KV-cache events over ZMQ, the router follows them, and
//! routing reads what the engines say they hold: both encodings, a dropped
//! message replayed, an engine restart, a flushed cache, a stream that dies
//! and comes back, the burst guard. Real processes, loopback only.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use testkit::engine_proc::SimEngine;
use testkit::http::post_json;
use testkit::proc::free_port;
use testkit::router_proc::{Router, explain, matched_on};

/// How long a state change may take to show on a loaded machine.
const WAIT: Duration = Duration::from_secs(10);

/// A router in precise mode in front of sim-engines that publish events.
struct Setup {
    engines: Vec<SimEngine>,
    /// Each engine's event and replay ports.
    engines_ports: Vec<(u16, u16)>,
    router: Router,
}

impl Setup {
    /// One engine per entry of `engine_args` (each also gets `--time-scale
    /// 0` unless it sets timing, and its event ports), `[precise]` with
    /// `precise` appended.
    fn new(engine_args: &[&[&str]], precise: &str) -> Setup {
        let mut engines = Vec::new();
        let mut engines_ports = Vec::new();
        let mut backends = Vec::new();
        for (i, extra) in engine_args.iter().enumerate() {
            let id = format!("e{i}");
            let mut args = vec!["--id", &id];
            if !extra.contains(&"--time-scale") {
                args.extend(["--time-scale", "0"]);
            }
            args.extend_from_slice(extra);
            let (e, p, r) = SimEngine::spawn_with_event_ports(&args);
            backends.push(format!(
                "{{ url = \"{}\", kv_events = \"tcp://127.0.0.1:{p}\", kv_events_replay = \"tcp://127.0.0.1:{r}\" }}",
                e.url()
            ));
            engines.push(e);
            engines_ports.push((p, r));
        }
        let cfg = format!(
            "backends = [{}]\n[precise]\nenabled = true\n{precise}\n",
            backends.join(", ")
        );
        let router = Router::spawn(&[], &[], &cfg);
        let s = Setup {
            engines,
            engines_ports,
            router,
        };
        for e in &s.engines {
            assert!(
                s.wait_precise(&e.url(), |p| p["state"] == "EXACT"),
                "{} never turned EXACT: {}",
                e.url(),
                s.precise(&e.url())
            );
        }
        // A backend whose models are not listed yet is no candidate for a
        // model's request: routing before that races model discovery.
        s.router.wait_models_known();
        s
    }

    fn precise(&self, url: &str) -> Value {
        self.router.backend(url)["precise"].clone()
    }

    fn wait_precise(&self, url: &str, pred: impl Fn(&Value) -> bool) -> bool {
        self.router.wait_backend(url, WAIT, |b| pred(&b["precise"]))
    }

    fn send(&self, body: &Value) {
        let r = post_json(self.router.addr, "/v1/chat/completions", body).expect("chat");
        assert_eq!(r.status, 200, "{}", r.text());
    }

    fn explain(&self, body: &Value) -> Value {
        explain(self.router.admin, "chat", body)
    }
}

/// A chat of about 90 tokens (5 full blocks after the template).
fn chat(topic: &str) -> Value {
    json!({
        "model": "sim-llama-8b",
        "max_tokens": 2,
        "messages": [
            {"role": "system", "content": format!("You are the {topic} assistant. Answer every question about {topic} with care, cite what you know, and say so when you do not know.")},
            {"role": "user", "content": format!("Tell me one thing about {topic} that most people get wrong.")},
        ]
    })
}

/// Asserts the explain answer routes `body` warm to `url` on the precise
/// index with every block of the prompt matched: the router's tokens and
/// keys equal the engine's, block for block.
fn assert_warm_precise(s: &Setup, body: &Value, url: &str) {
    let ex = s.explain(body);
    assert_eq!(ex["decision"], "warm", "{ex}");
    assert_eq!(ex["chosen"], url, "{ex}");
    assert_eq!(matched_on(&ex, url), "precise", "{ex}");
    assert_eq!(
        ex["matched_blocks"], ex["blocks"],
        "every block matched: {ex}"
    );
}

#[test]
fn both_encodings_and_both_hash_kinds_are_decoded() {
    let s = Setup::new(
        &[
            &["--kv-events-encoding", "array"],
            &["--kv-events-encoding", "map", "--kv-events-bytes-hashes"],
        ],
        "burst_ms = 0",
    );
    let urls: Vec<String> = s.engines.iter().map(|e| e.url()).collect();
    // Distinct prompts land on both engines (cold placement spreads them).
    let mut served: Vec<Option<Value>> = vec![None, None];
    for i in 0..24 {
        if served.iter().all(Option::is_some) {
            break;
        }
        let body = chat(&format!("topic number {i}"));
        let to = s.explain(&body)["chosen"].clone();
        s.send(&body);
        let k = urls.iter().position(|u| to == u.as_str()).expect("chosen");
        assert!(
            s.wait_precise(&urls[k], |p| p["held_blocks"].as_u64() > Some(0)),
            "{}",
            s.precise(&urls[k])
        );
        served[k].get_or_insert(body);
    }
    for (k, url) in urls.iter().enumerate() {
        let body = served[k].as_ref().expect("both engines served a prompt");
        // The events of the last send may still be in flight.
        assert!(s.router.wait_backend(url, WAIT, |_| {
            let ex = s.explain(body);
            ex["matched_blocks"] == ex["blocks"]
        }));
        assert_warm_precise(&s, body, url);
        let p = s.precise(url);
        assert_eq!(p["decode_errors"], 0, "{p}");
        assert_eq!(p["skipped_events"], 0, "{p}");
        assert_eq!(p["skipped_fields"], 0, "{p}");
        assert_eq!(p["unknown_parents"], 0, "{p}");
    }
    let m = s.router.metrics();
    assert!(
        m.contains(&format!(
            "prefix_router_precise_exact{{backend=\"{}\"}} 1",
            urls[1]
        )),
        "{m}"
    );
}

#[test]
fn a_dropped_message_is_replayed_and_a_lost_one_degrades_then_recovers() {
    let s = Setup::new(
        &[&["--kv-events-drop-seq", "1"]],
        "burst_ms = 0\nrecover_ms = 1500",
    );
    let url = s.engines[0].url();
    let (a, b, c) = (chat("apples"), chat("bees"), chat("comets"));
    s.send(&a);
    assert!(s.wait_precise(&url, |p| p["last_seq"] == 0));
    s.send(&b); // seq 1, left out of the live stream
    std::thread::sleep(Duration::from_millis(100));
    s.send(&c); // seq 2 shows the gap
    assert!(
        s.wait_precise(&url, |p| p["last_seq"] == 2),
        "{}",
        s.precise(&url)
    );
    let p = s.precise(&url);
    assert!(p["gaps"].as_u64() >= Some(1), "{p}");
    assert!(p["replayed_batches"].as_u64() >= Some(1), "{p}");
    assert_eq!(p["unfilled_gaps"], 0, "{p}");
    assert_eq!(p["state"], "EXACT", "{p}");
    // b's blocks came only through the replay.
    assert_warm_precise(&s, &b, &url);

    // Now a batch the engine's buffer does not keep either.
    let r = post_json(
        s.engines[0].addr,
        "/sim/faults",
        &json!({"kv_events_lose_seq": 3}),
    )
    .unwrap();
    assert_eq!(r.status, 200);
    s.send(&chat("dunes")); // seq 3, lost
    let e = chat("eels");
    s.send(&e); // seq 4 shows the gap
    assert!(
        s.wait_precise(&url, |p| p["unfilled_gaps"] == 1),
        "{}",
        s.precise(&url)
    );
    let p = s.precise(&url);
    assert_eq!(p["state"], "DEGRADED", "{p}");
    assert_eq!(p["reason"], "gap", "{p}");
    let ex = s.explain(&a);
    assert_eq!(matched_on(&ex, &url), "approximate", "{ex}");
    assert!(
        s.wait_precise(&url, |p| p["state"] == "EXACT"),
        "EXACT again after recover_ms: {}",
        s.precise(&url)
    );
    // What it stored after the gap is known; what it held before was forgotten.
    assert_warm_precise(&s, &e, &url);
    assert_eq!(s.explain(&a)["matched_blocks"], 0);
}

#[test]
fn an_engine_restart_drops_its_entries() {
    let s = Setup::new(&[&[]], "burst_ms = 0");
    let url = s.engines[0].url();
    let (a, b) = (chat("rivers"), chat("glaciers"));
    s.send(&a);
    s.send(&b);
    assert!(s.wait_precise(&url, |p| p["last_seq"] == 1));
    assert_warm_precise(&s, &a, &url);
    let r = post_json(
        s.engines[0].addr,
        "/sim/faults",
        &json!({"kv_events_restart": true}),
    )
    .unwrap();
    assert_eq!(r.status, 200);
    let c = chat("volcanoes");
    // The restarted engine's first batch (seq 0) is c's blocks.
    std::thread::sleep(Duration::from_millis(200));
    s.send(&c);
    assert!(
        s.wait_precise(&url, |p| p["restarts"] == 1 && p["last_seq"] == 0),
        "{}",
        s.precise(&url)
    );
    let ex = s.explain(&a);
    assert_eq!(ex["matched_blocks"], 0, "a is gone with the restart: {ex}");
    assert_eq!(matched_on(&ex, &url), "precise");
    assert_eq!(
        s.router.backend(&url)["index_blocks"],
        0,
        "the approximate index forgot it too (it would route it while DEGRADED)"
    );
    assert_warm_precise(&s, &c, &url);
    assert_eq!(s.precise(&url)["state"], "EXACT");
}

#[test]
fn a_flushed_cache_stops_warm_routing_to_that_engine_at_once() {
    let s = Setup::new(&[&[], &[]], "burst_ms = 0");
    let a = chat("lighthouses");
    s.send(&a);
    // The engine that got it says so in its events.
    let deadline = Instant::now() + WAIT;
    let holder = loop {
        let held = s
            .router
            .backends()
            .into_iter()
            .find(|b| b["precise"]["held_blocks"].as_u64() > Some(0));
        if let Some(b) = held {
            break b["url"].as_str().unwrap().to_owned();
        }
        assert!(Instant::now() < deadline, "no engine reported a's blocks");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_warm_precise(&s, &a, &holder);
    let engine = s.engines.iter().find(|e| e.url() == holder).unwrap();
    let t0 = Instant::now();
    let r = testkit::http::request(engine.addr, "POST", "/reset_prefix_cache", &[], b"").unwrap();
    assert_eq!(r.status, 200);
    assert!(
        s.wait_precise(&holder, |p| p["clears"].as_u64() >= Some(1)),
        "{}",
        s.precise(&holder)
    );
    let ex = s.explain(&a);
    let took = t0.elapsed();
    println!("flush to cold routing: {:.1} ms", took.as_secs_f64() * 1e3);
    assert_eq!(ex["matched_blocks"], 0, "{ex}");
    assert_eq!(ex["decision"], "cold", "{ex}");
    assert_eq!(s.precise(&holder)["held_blocks"], 0);
}

#[test]
fn a_dead_stream_degrades_to_the_approximate_index_then_turns_exact_again() {
    let s = Setup::new(&[&[]], "burst_ms = 0");
    let url = s.engines[0].url();
    let a = chat("owls");
    s.send(&a);
    assert!(s.wait_precise(&url, |p| p["last_seq"] == 0));
    let r = post_json(
        s.engines[0].addr,
        "/sim/faults",
        &json!({"kv_events_pause_ms": 3000}),
    )
    .unwrap();
    assert_eq!(r.status, 200);
    assert!(
        s.wait_precise(&url, |p| p["state"] == "DEGRADED"),
        "{}",
        s.precise(&url)
    );
    assert_eq!(s.precise(&url)["reason"], "disconnected");
    // Routing reads the approximate index, which still holds what was sent.
    let ex = s.explain(&a);
    assert_eq!(matched_on(&ex, &url), "approximate", "{ex}");
    assert_eq!(ex["decision"], "warm", "{ex}");
    // Published while the stream is down: kept for replay.
    let b = chat("moths");
    s.send(&b);
    let m = s.router.metrics();
    assert!(
        m.contains(&format!(
            "prefix_router_precise_exact{{backend=\"{url}\"}} 0"
        )),
        "{m}"
    );
    assert!(
        s.wait_precise(&url, |p| p["state"] == "EXACT"),
        "{}",
        s.precise(&url)
    );
    let p = s.precise(&url);
    assert!(p["disconnects"].as_u64() >= Some(1), "{p}");
    assert!(p["replayed_batches"].as_u64() >= Some(1), "{p}");
    assert_eq!(p["unfilled_gaps"], 0, "{p}");
    assert_warm_precise(&s, &b, &url);
}

#[test]
fn the_burst_guard_holds_a_just_routed_prompt_before_its_events_arrive() {
    // A slow prefill (about 90 tokens at 40 tokens/s): the engine stores
    // the prompt's blocks, and publishes them, about 2 s after it arrives.
    let slow: &[&str] = &["--time-scale", "1", "--prefill-tps", "40"];
    let s = Setup::new(&[slow, slow], "burst_ms = 5000");
    let a = chat("tides");
    let router = s.router.addr;
    let body = a.clone();
    let t = std::thread::spawn(move || post_json(router, "/v1/chat/completions", &body));
    // Once the router has sent it, explain sees its blocks held by the
    // backend it went to, before the engine stored (and published) them.
    let deadline = Instant::now() + WAIT;
    let (holder, held_then, ex) = loop {
        let ex = s.explain(&a);
        let holder = ex["candidates"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["matched_blocks"].as_u64() > Some(0)))
            .map(|c| c["url"].as_str().unwrap_or("").to_owned());
        if let Some(h) = holder {
            let held = s.precise(&h)["held_blocks"].as_u64();
            break (h, held, ex);
        }
        assert!(Instant::now() < deadline, "never matched: {ex}");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(matched_on(&ex, &holder), "precise", "{ex}");
    let r = t.join().unwrap().expect("chat");
    assert_eq!(r.status, 200);
    assert_eq!(
        held_then,
        Some(0),
        "warm from the guard alone, before the engine stored anything"
    );
}

#[test]
fn a_cache_salt_keys_blocks_apart() {
    let s = Setup::new(&[&[]], "burst_ms = 0");
    let url = s.engines[0].url();
    let salted = |salt: Option<&str>| {
        let mut body = chat("ciphers");
        if let Some(salt) = salt {
            body["cache_salt"] = json!(salt);
        }
        body
    };
    s.send(&salted(Some("tenant-a")));
    assert!(s.wait_precise(&url, |p| p["held_blocks"].as_u64() > Some(0)));
    // The engine folded the salt into the first block (and said so in its
    // event's extra_keys); the router folds the request's salt the same way.
    assert_warm_precise(&s, &salted(Some("tenant-a")), &url);
    for other in [salted(Some("tenant-b")), salted(None)] {
        let ex = s.explain(&other);
        assert_eq!(ex["matched_blocks"], 0, "another salt shares nothing: {ex}");
    }
    // And the engine agrees: the same prompt with another salt is a miss.
    let r = post_json(
        s.engines[0].addr,
        "/v1/chat/completions",
        &salted(Some("tenant-b")),
    )
    .unwrap();
    assert_eq!(
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        0,
        "{}",
        r.text()
    );
}

#[test]
fn completions_text_and_token_ids_match_the_engines_blocks() {
    let s = Setup::new(&[&[]], "burst_ms = 0");
    let url = s.engines[0].url();
    let text = json!({
        "model": "sim-llama-8b", "max_tokens": 2,
        "prompt": "Line one of a long completion prompt.\nLine two, a little longer than the first one.\nAnd a third line to fill a few more blocks of tokens here.\n",
    });
    let ids = json!({
        "model": "sim-llama-8b", "max_tokens": 2,
        // Ids with a 0x0A byte in them: not to be cut like text at newlines.
        "prompt": (0..80u32).map(|i| i * 257 + 10).collect::<Vec<_>>(),
    });
    for (n, body) in [&text, &ids].into_iter().enumerate() {
        let r = post_json(s.router.addr, "/v1/completions", body).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(s.wait_precise(&url, |p| p["last_seq"] == n as u64));
        let r = post_json(s.router.admin, "/admin/explain?endpoint=completions", body).unwrap();
        let ex = r.json();
        assert_eq!(ex["decision"], "warm", "{ex}");
        assert_eq!(matched_on(&ex, &url), "precise");
        assert_eq!(ex["matched_blocks"], ex["blocks"], "every block: {ex}");
    }
}

#[test]
fn traffic_that_bypassed_the_router_routes_warm_where_the_engine_holds_it() {
    let s = Setup::new(&[&[], &[]], "burst_ms = 0");
    let a = chat("sundials");
    // Where the router would place a cold `a`, and the other engine.
    let cold = s.explain(&a)["chosen"].as_str().unwrap().to_owned();
    let other = s.engines.iter().find(|e| e.url() != cold).unwrap();
    // A client talks to that engine directly, behind the router's back.
    let r = post_json(other.addr, "/v1/chat/completions", &a).unwrap();
    assert_eq!(r.status, 200);
    assert!(
        s.wait_precise(&other.url(), |p| p["held_blocks"].as_u64() > Some(0)),
        "{}",
        s.precise(&other.url())
    );
    assert_warm_precise(&s, &a, &other.url());
    assert_eq!(
        s.router.backend(&other.url())["index_blocks"],
        0,
        "the approximate index never saw it"
    );
}

#[test]
fn router_replicas_see_what_the_others_sent() {
    let s = Setup::new(&[&[], &[], &[]], "burst_ms = 0");
    let backends: Vec<String> = s
        .engines
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let (p, r) = s.engines_ports[i];
            format!(
                "{{ url = \"{}\", kv_events = \"tcp://127.0.0.1:{p}\", kv_events_replay = \"tcp://127.0.0.1:{r}\" }}",
                e.url()
            )
        })
        .collect();
    let cfg = format!(
        "backends = [{}]\n[precise]\nenabled = true\nburst_ms = 0\n",
        backends.join(", ")
    );
    let second = Router::spawn(&[], &[], &cfg);
    // Conversations start on the first replica; their next turns arrive at
    // the second, which never sent them anything.
    for i in 0..4 {
        let a = chat(&format!("replica topic {i}"));
        s.send(&a);
        let deadline = Instant::now() + WAIT;
        let ex = loop {
            let ex = explain(second.admin, "chat", &a);
            if ex["matched_blocks"] == ex["blocks"] || Instant::now() > deadline {
                break ex;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(ex["decision"], "warm", "{ex}");
        let chosen = ex["chosen"].as_str().unwrap();
        assert!(
            second.backend(chosen)["precise"]["held_blocks"].as_u64() > Some(0),
            "{ex}"
        );
        assert_eq!(
            second.backend(chosen)["index_blocks"],
            0,
            "known from events only"
        );
    }
}

/// The Python engine stand-in: pyzmq and msgpack, written from vLLM's
/// format. Commands on stdin, one JSON object a line; `published SEQ` on
/// stdout after each.
const PY_PUBLISHER: &str = r#"
import hashlib, json, struct, sys, threading, time
import msgpack, zmq

pub_port, replay_port = int(sys.argv[1]), int(sys.argv[2])
ctx = zmq.Context()
pub = ctx.socket(zmq.PUB); pub.bind(f"tcp://127.0.0.1:{pub_port}")
rep = ctx.socket(zmq.ROUTER); rep.bind(f"tcp://127.0.0.1:{replay_port}")
buf, lock = [], threading.Lock()

def serve_replay():
    while True:
        ident, _, start = rep.recv_multipart()
        start = struct.unpack(">q", start)[0]
        with lock:
            todo = [(s, p) for s, p in buf if s >= start]
        for s, p in todo:
            rep.send_multipart([ident, b"", struct.pack(">q", s), p])
        rep.send_multipart([ident, b"", struct.pack(">q", -1), b""])

threading.Thread(target=serve_replay, daemon=True).start()

def h(kind, i):
    if kind == "bytes":
        return hashlib.sha256(str(i).encode()).digest()
    return 2**64 - 1 - 7 * i  # above i64::MAX

seq = 0
for line in sys.stdin:
    cmd = json.loads(line)
    enc, kind = cmd.get("encoding"), cmd.get("hashes")
    events = []
    if cmd["op"] == "garbage":
        events = None
    elif cmd["op"] == "stored":
        toks, first = cmd["tokens"], cmd["first"]
        n = len(toks) // 16
        hashes = [h(kind, first + i) for i in range(n)]
        toks = toks[: n * 16]
        lora = cmd.get("lora")
        if lora is not None:
            # A LoRA adapter's blocks, as vLLM sends them: its name in the
            # event and in every block's extra keys.
            events.append({"type": "BlockStored", "block_hashes": hashes, "token_ids": toks,
                           "block_size": 16, "lora_id": 1, "lora_name": lora,
                           "extra_keys": [[lora]] * n})
        elif enc == "array":
            # An older vLLM: the event stops after `medium`.
            events.append(["BlockStored", hashes, None, toks, 16, None, "GPU"])
            events.append(["BlockMoved", hashes])
        else:
            events.append({"type": "BlockStored", "block_hashes": hashes, "token_ids": toks,
                           "block_size": 16, "medium": "GPU", "tier": "hbm"})
            events.append({"type": "BlockMoved", "block_hashes": hashes})
    else:
        hashes = [h(kind, i) for i in cmd["ids"]]
        if enc == "array":
            events.append(["BlockRemoved", hashes, "GPU", 0])
        else:
            events.append({"type": "BlockRemoved", "block_hashes": hashes})
    if events is None:
        payload = b"\xc1 not a batch"
    elif enc == "array":
        payload = msgpack.packb([time.time(), events, None], use_bin_type=True)
    else:
        payload = msgpack.packb({"ts": time.time(), "events": events}, use_bin_type=True)
    with lock:
        buf.append((seq, payload))
    pub.send_multipart([b"kv-events", struct.pack(">q", seq), payload])
    print(f"published {seq}", flush=True)
    seq += 1
"#;

/// The Python packages of the publisher test, pinned (pyzmq bundles
/// libzmq 4.3.5).
const PY_PACKAGES: [(&str, &str); 2] = [("pyzmq", "27.3.0"), ("msgpack", "1.2.4")];

/// `target/kv-events-venv` with [`PY_PACKAGES`] from PyPI, made once.
fn python_with_pyzmq() -> PathBuf {
    let target = testkit::bin_path("sim-engine")
        .parent()
        .and_then(|d| d.parent())
        .expect("target dir")
        .to_path_buf();
    let venv = target.join("kv-events-venv");
    let py = venv.join("bin/python");
    let check = format!(
        "import zmq, msgpack; assert zmq.__version__ == {:?}; assert '.'.join(map(str, msgpack.version)) == {:?}",
        PY_PACKAGES[0].1, PY_PACKAGES[1].1
    );
    let ready = || {
        Command::new(&py)
            .args(["-c", &check])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !ready() {
        let ok = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .is_ok_and(|s| s.success())
            && Command::new(venv.join("bin/pip"))
                .args(["install", "--quiet", "--timeout", "60"])
                .args(PY_PACKAGES.map(|(p, v)| format!("{p}=={v}")))
                .status()
                .is_ok_and(|s| s.success());
        assert!(
            ok && ready(),
            "could not make {} with pyzmq and msgpack (python3-venv and PyPI needed; `cargo xtask setup` installs python3-venv)",
            venv.display()
        );
    }
    py
}

#[test]
fn the_router_decodes_what_a_python_engine_publishes_in_both_encodings() {
    let py = python_with_pyzmq();
    let (p, r) = (free_port(), free_port());
    let script = std::env::temp_dir().join(format!("kv-publisher-{}.py", std::process::id()));
    std::fs::write(&script, PY_PUBLISHER).unwrap();
    let mut child = Command::new(&py)
        .arg(&script)
        .arg(p.to_string())
        .arg(r.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python");
    let mut stdin = child.stdin.take().expect("stdin");
    let mut stdout = std::io::BufReader::new(child.stdout.take().expect("stdout"));
    let _kill = KillOnDrop(child);
    // The HTTP side is a sim-engine that publishes nothing; its events
    // come from Python. It also tokenizes for the test, as the engine would.
    // It serves a LoRA adapter too (the router sends only models its
    // backends list).
    let engine = SimEngine::spawn(&[
        "--time-scale",
        "0",
        "--lora-modules",
        "support-adapter=/adapters/support",
    ]);
    let url = engine.url();
    let cfg = format!(
        "backends = [{{ url = \"{url}\", kv_events = \"tcp://127.0.0.1:{p}\", kv_events_replay = \"tcp://127.0.0.1:{r}\" }}]\n[precise]\nenabled = true\nburst_ms = 0\nrecover_ms = 1000\n"
    );
    let router = Router::spawn(&[], &[], &cfg);
    let s = Setup {
        engines: vec![engine],
        engines_ports: vec![(p, r)],
        router,
    };
    assert!(
        s.wait_precise(&url, |p| p["state"] == "EXACT"),
        "{}",
        s.precise(&url)
    );
    let tokens = |body: &Value| -> Vec<u64> {
        let r = post_json(
            s.engines[0].addr,
            "/tokenize",
            &json!({"messages": body["messages"]}),
        )
        .unwrap();
        r.json()["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect()
    };
    let mut publish = |cmd: Value, seq: u64| {
        writeln!(stdin, "{cmd}").unwrap();
        stdin.flush().unwrap();
        // Python answers each line at once, or dies (EOF: the read ends).
        let mut line = String::new();
        std::io::BufRead::read_line(&mut stdout, &mut line).unwrap();
        assert_eq!(line.trim(), format!("published {seq}"));
    };
    let (a, b) = (chat("kites"), chat("harbours"));
    let (ta, tb) = (tokens(&a), tokens(&b));
    let (na, nb) = ((ta.len() / 16) as u64, (tb.len() / 16) as u64);
    publish(
        json!({"op": "stored", "encoding": "array", "hashes": "u64", "tokens": ta, "first": 0}),
        0,
    );
    publish(
        json!({"op": "stored", "encoding": "map", "hashes": "bytes", "tokens": tb, "first": 100}),
        1,
    );
    assert!(
        s.wait_precise(&url, |p| p["last_seq"] == 1),
        "{}",
        s.precise(&url)
    );
    let p = s.precise(&url);
    assert_eq!(p["held_blocks"].as_u64(), Some(na + nb), "{p}");
    assert_eq!(p["decode_errors"], 0, "{p}");
    assert_eq!(p["skipped_events"], 2, "two BlockMoved: {p}");
    assert_eq!(p["skipped_fields"], 1, "one unknown `tier`: {p}");
    assert_warm_precise(&s, &a, &url);
    assert_warm_precise(&s, &b, &url);
    // Removals in both encodings: b wholly, a from its third block.
    publish(
        json!({"op": "removed", "encoding": "map", "hashes": "bytes", "ids": (100..100 + nb).collect::<Vec<_>>()}),
        2,
    );
    publish(
        json!({"op": "removed", "encoding": "array", "hashes": "u64", "ids": [2]}),
        3,
    );
    assert!(
        s.wait_precise(&url, |p| p["last_seq"] == 3),
        "{}",
        s.precise(&url)
    );
    assert_eq!(s.precise(&url)["held_blocks"].as_u64(), Some(na - 1));
    assert_eq!(s.explain(&b)["matched_blocks"], 0);
    let ex = s.explain(&a);
    assert!(
        ex["matched_blocks"].as_u64() < ex["blocks"].as_u64(),
        "a's match stops where its block was removed: {ex}"
    );
    // A payload that is not a batch: counted, the backend forgotten and
    // DEGRADED, then EXACT again after recover_ms; the router stays up.
    publish(json!({"op": "garbage"}), 4);
    assert!(
        s.wait_precise(&url, |p| p["decode_errors"] == 1),
        "{}",
        s.precise(&url)
    );
    let p = s.precise(&url);
    assert_eq!(p["held_blocks"], 0, "{p}");
    assert!(
        p["state"] == "DEGRADED" && p["reason"] == "decode-error",
        "{p}"
    );
    assert!(
        s.wait_precise(&url, |p| p["state"] == "EXACT"),
        "{}",
        s.precise(&url)
    );
    publish(
        json!({"op": "stored", "encoding": "map", "hashes": "u64", "tokens": tokens(&a), "first": 200}),
        5,
    );
    assert!(s.wait_precise(&url, |p| p["last_seq"] == 5));
    assert_warm_precise(&s, &a, &url);
    // A LoRA adapter's blocks match requests for that adapter (its name in
    // `model`) and no others: the same chat for the base model matches
    // nothing, though its tokens are the same.
    let mut lora = chat("lanterns");
    lora["model"] = json!("support-adapter");
    publish(
        json!({"op": "stored", "encoding": "map", "hashes": "u64", "tokens": tokens(&lora), "first": 300, "lora": "support-adapter"}),
        6,
    );
    assert!(s.wait_precise(&url, |p| p["last_seq"] == 6));
    assert_warm_precise(&s, &lora, &url);
    let base = chat("lanterns");
    let ex = s.explain(&base);
    assert_eq!(matched_on(&ex, &url), "precise", "{ex}");
    assert_eq!(ex["matched_blocks"], 0, "the base model holds none: {ex}");
    drop(stdin);
    let _ = std::fs::remove_file(&script);
}

/// Kills the Python publisher however the test ends.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
