//! Precise mode against hostile prompts and templates: a chat of many
//! megabytes costs the router its token budget, off the traffic workers,
//! and stalls no other client; a chat template that costs seconds is paid
//! once, then its model's chats route on the approximate index until a
//! reload. Real processes: the router with a real tokenizer (the fixture
//! BPE), sim-engines publishing KV events; loopback only.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use testkit::engine_proc::SimEngine;
use testkit::http::{post_json, request};
use testkit::router_proc::{Router, rss_kib};
use testkit::tokenizer_fixture::{CHATML, words};

/// How long a state change may take to show on a loaded machine.
const WAIT: Duration = Duration::from_secs(10);

/// The fixture tokenizer in a directory of this test's own, with `template`
/// as its chat template.
fn tokenizer_dir(name: &str, template: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "prefix-router-hard-precise-{}-{name}",
        std::process::id()
    ));
    testkit::tokenizer_fixture::write(&dir).expect("fixture tokenizer");
    let cfg = json!({
        "bos_token": "<|endoftext|>",
        "eos_token": {"content": "<|im_end|>"},
        "chat_template": template,
    });
    std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).expect("config");
    dir
}

/// One sim-engine (its own 4-byte tokenizer) publishing KV events, and a
/// router in precise mode over it with the tokenizer in `dir`, waited for
/// until the engine's stream is EXACT.
fn setup(dir: &str) -> (SimEngine, Router) {
    let (e, p, r) = SimEngine::spawn_with_event_ports(&["--id", "e0", "--time-scale", "0"]);
    let cfg = format!(
        "backends = [{{ url = \"{}\", kv_events = \"tcp://127.0.0.1:{p}\", kv_events_replay = \"tcp://127.0.0.1:{r}\" }}]\n\
         [precise]\nenabled = true\nburst_ms = 0\ntokenizer_dir = {dir:?}\n",
        e.url()
    );
    let router = Router::spawn(&[], &[], &cfg);
    assert!(
        router.wait_backend(&e.url(), WAIT, |b| b["precise"]["state"] == "EXACT"),
        "never EXACT: {}",
        router.backend(&e.url())
    );
    (e, router)
}

fn chat(messages: &[(&str, String)]) -> Value {
    json!({
        "model": "sim-llama-8b",
        "max_tokens": 2,
        "messages": messages.iter().map(|(r, c)| json!({"role": r, "content": c})).collect::<Vec<_>>(),
    })
}

/// The value of the series `name` whose labels include `labels`.
fn metric(text: &str, name: &str, labels: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name) && l.contains(labels))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// A 10 MB chat message (30 MB is the hostile soak's, in release):
/// before, the traffic worker tokenized all of it (6.5 s of CPU in
/// release, gigabytes of RSS) while another client on it waited. Now it is
/// cut to the token budget and tokenized on the router's tokenizing
/// threads; the engine, not the router, rejects it as longer than its
/// context; a client beside it sees no stall and RSS stays bounded.
#[test]
fn a_huge_chat_is_cut_to_the_budget_off_the_workers_and_the_engine_rejects_it() {
    let dir = tokenizer_dir("huge", CHATML);
    let (_engine, router) = setup(dir.to_str().expect("utf-8 path"));
    let rss_start = router.rss_kib();
    // Ordinary chats first, so their pieces are cached as they would be.
    for i in 0..3 {
        let r = post_json(
            router.addr,
            "/v1/chat/completions",
            &chat(&[("user", words(i, 40))]),
        )
        .expect("chat");
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let huge = words(99, 10 << 20 >> 3);
    let huge = &huge[..huge.len().min(10 << 20)];
    let body = chat(&[("user", huge.to_owned())]);
    let done = AtomicBool::new(false);
    let worst_ms = AtomicU64::new(0);
    let normal = AtomicU64::new(0);
    let rss_peak = AtomicU64::new(rss_start);
    let (addr, pid) = (router.addr, router.child.pid());
    let answer = std::thread::scope(|s| {
        // A steady client beside it: small chats, one at a time.
        s.spawn(|| {
            let mut i = 100;
            while !done.load(Ordering::Relaxed) {
                let t0 = Instant::now();
                let r = post_json(
                    addr,
                    "/v1/chat/completions",
                    &chat(&[("user", words(i, 30))]),
                )
                .expect("a small chat");
                assert_eq!(r.status, 200, "{}", r.text());
                worst_ms.fetch_max(t0.elapsed().as_millis() as u64, Ordering::Relaxed);
                normal.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
        });
        s.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                rss_peak.fetch_max(rss_kib(pid), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        std::thread::sleep(Duration::from_millis(300));
        let answer = post_json(addr, "/v1/chat/completions", &body);
        // A little more of the steady client after it.
        std::thread::sleep(Duration::from_millis(300));
        done.store(true, Ordering::Relaxed);
        answer
    });
    let answer = answer.expect("an answer to the huge chat");
    // The engine's own answer: its context is too short for the prompt.
    assert_eq!(answer.status, 400, "{}", answer.text());
    assert!(
        answer.text().contains("maximum context length"),
        "the engine rejected it, not the router: {}",
        answer.text()
    );
    let worst = worst_ms.load(Ordering::Relaxed);
    assert!(normal.load(Ordering::Relaxed) >= 3, "the steady client ran");
    assert!(
        worst < 5_000,
        "a small chat beside the huge one waited {worst} ms"
    );
    let peak_mib = rss_peak.load(Ordering::Relaxed) / 1024;
    let start_mib = rss_start / 1024;
    // The body (10 MB) is held and forwarded; tokenizing it whole took
    // gigabytes.
    assert!(
        peak_mib < start_mib + 400,
        "RSS rose from {start_mib} MiB to {peak_mib} MiB"
    );
    let m = router.metrics();
    assert!(
        metric(&m, "prefix_router_precise_tokenizer_cut_total", "").unwrap_or(0.0) >= 1.0,
        "{m}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Three loops deep over the messages: 1 ms for a short chat, about a
/// second for 100 messages (more in a debug build).
const CUBIC: &str = "{% for a in messages %}{% for b in messages %}{% for c in messages %}{% endfor %}{% endfor %}{% endfor %}{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// A chat template whose cost grows with the cube of the messages: the
/// first long chat shows it (on a tokenizing thread), and from then on its
/// model's chats route on the approximate index without rendering, as
/// `/admin/backends` and `/metrics` say, until a reload. Before, every
/// chat paid the render on the traffic worker.
#[test]
fn a_costly_chat_template_is_paid_once_then_routed_around_until_reload() {
    let dir = tokenizer_dir("cubic", CUBIC);
    let (_engine, router) = setup(dir.to_str().expect("utf-8 path"));
    let long: Vec<(&str, String)> = (0..100).map(|i| ("user", words(i, 4))).collect();
    let template = |r: &Router| {
        let v = request(r.admin, "GET", "/admin/backends", &[], b"")
            .expect("backends")
            .json();
        v["precise"]["tokenizers"][0].clone()
    };
    // The first long chat: the template shows its cost (on a tokenizing
    // thread; the chat itself waits at most `tokenizer_wait_ms`).
    let r = post_json(router.addr, "/v1/chat/completions", &chat(&long)).expect("chat");
    assert_eq!(r.status, 200, "{}", r.text());
    // Twenty more long chats: none pays the template on its way.
    let started = Instant::now();
    for i in 0..20 {
        let mut msgs = long.clone();
        msgs.push(("user", words(1000 + i, 5)));
        let r = post_json(router.addr, "/v1/chat/completions", &chat(&msgs)).expect("chat");
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(8),
        "20 chats took {took:?}: the template was paid on their way"
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while template(&router)["template"] != "costly" && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let t = template(&router);
    assert_eq!(t["template"], "costly", "{t}");
    assert!(t["why"].as_str().is_some_and(|w| w.contains("fuel")), "{t}");
    // Marked: chats skip it at once, on the approximate index.
    for i in 0..20 {
        let r = post_json(
            router.addr,
            "/v1/chat/completions",
            &chat(&[("user", words(2000 + i, 5))]),
        )
        .expect("chat");
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let t = template(&router);
    assert!(t["skipped_chats"].as_u64() >= Some(20), "{t}");
    let m = router.metrics();
    assert_eq!(
        metric(
            &m,
            "prefix_router_precise_template_usable",
            "state=\"costly\""
        ),
        Some(0.0),
        "{m}"
    );
    assert!(
        metric(
            &m,
            "prefix_router_precise_template_skipped_total",
            "model=\"*\""
        ) >= Some(20.0),
        "{m}"
    );
    // A reload tries the template again.
    let r = request(router.admin, "POST", "/admin/reload", &[], b"").expect("reload");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(template(&router)["template"], "ok");
    std::fs::remove_dir_all(&dir).ok();
}
