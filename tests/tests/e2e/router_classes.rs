//! Request classes through real processes: `flex` requests (the body's
//! `service_tier`) held in the router while their engine is busy
//! (`classes.flex_max_in_flight_per_backend`), answered 429 with
//! Retry-After past `classes.flex_wait_ms`, while interactive requests go
//! straight through; every batch request ends as an answer or a 429,
//! counted on `/metrics`; a reload changes the limit.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use testkit::engine_proc::SimEngine;
use testkit::http::{post_json, request};
use testkit::router_proc::Router;

fn body(tier: Option<&str>, tokens: u32, text: &str) -> Value {
    let mut b = json!({"max_tokens": tokens, "messages": [{"role": "user", "content": text}]});
    if let Some(t) = tier {
        b["service_tier"] = json!(t);
    }
    b
}

/// The engine's running requests (`vllm:num_requests_running`).
fn running(e: &SimEngine) -> f64 {
    let text = request(e.addr, "GET", "/metrics", &[], b"")
        .map(|r| r.text())
        .unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with("vllm:num_requests_running"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

fn shed_count(r: &Router) -> u64 {
    r.metrics()
        .lines()
        .find(|l| l.contains("class_shed_total") && l.contains("class=\"flex\""))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// When an answer came, to which kind of request, with which status.
type Event = (Instant, &'static str, u16);

#[test]
fn a_batch_surge_waits_in_the_router_and_the_people_waiting_go_first() {
    // Steps of 3 ms: a 50-token answer takes about 150 ms.
    let engine = SimEngine::spawn(&["--time-scale", "0.2"]);
    let config = "[classes]\nflex_max_in_flight_per_backend = 2\nflex_wait_ms = 400\n";
    let r = Router::spawn(&[engine.url()], &[], config);
    let addr = r.addr;
    let events: Arc<Mutex<Vec<Event>>> = Arc::default();
    // Eight batch requests at once: two run, the rest wait in the router.
    let batch: Vec<_> = (0..8)
        .map(|i| {
            let events = events.clone();
            std::thread::spawn(move || {
                let resp = post_json(
                    addr,
                    "/v1/chat/completions",
                    &body(Some("flex"), 50, &format!("batch {i}")),
                )
                .expect("batch request");
                events
                    .lock()
                    .unwrap()
                    .push((Instant::now(), "flex", resp.status));
                resp
            })
        })
        .collect();
    // While they run: never more than two on the engine.
    let started = Instant::now();
    let mut most = 0.0f64;
    while started.elapsed() < Duration::from_millis(120) {
        most = most.max(running(&engine));
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(most <= 2.0, "{most} batch requests ran at once");
    // People chatting meanwhile (no tier, an unknown tier, `priority`): at once.
    for tier in [None, Some("premium-gold"), Some("priority")] {
        let resp = post_json(
            addr,
            "/v1/chat/completions",
            &body(tier, 4, "a person waits"),
        )
        .expect("chat request");
        assert_eq!(resp.status, 200, "{}", resp.text());
        events
            .lock()
            .unwrap()
            .push((Instant::now(), "chat", resp.status));
    }
    let answers: Vec<_> = batch
        .into_iter()
        .map(|t| t.join().expect("batch thread"))
        .collect();
    let mut shed = 0;
    for a in &answers {
        match a.status {
            200 => {}
            429 => {
                shed += 1;
                assert!(a.header("retry-after").is_some(), "429 without Retry-After");
                let v = a.json();
                assert!(
                    v["error"]["message"]
                        .as_str()
                        .unwrap()
                        .contains("flex_wait_ms"),
                    "{v}"
                );
            }
            s => panic!("a batch request ended {s}: {}", a.text()),
        }
    }
    let ok = answers.len() - shed;
    assert!(ok >= 2 && shed >= 1, "{ok} answered, {shed} shed");
    // Every chat was answered before the first batch request was given up.
    let ev = events.lock().unwrap().clone();
    let last_chat = ev
        .iter()
        .filter(|e| e.1 == "chat")
        .map(|e| e.0)
        .max()
        .unwrap();
    let first_shed = ev.iter().filter(|e| e.2 == 429).map(|e| e.0).min().unwrap();
    assert!(last_chat < first_shed, "a chat waited behind the batch");
    assert_eq!(shed_count(&r), shed as u64, "the 429s on /metrics");
}

#[test]
fn without_a_flex_limit_classes_change_nothing_and_a_reload_sets_one() {
    let engine = SimEngine::spawn(&["--time-scale", "0.2"]);
    let dir = std::env::temp_dir().join(format!("classes-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("router.toml");
    std::fs::write(&path, format!("backends = [\"{}\"]\n", engine.url())).unwrap();
    let r = Router::spawn(&[], &["--config", path.to_str().unwrap()], "");
    let burst = |n: usize| -> Vec<u16> {
        let threads: Vec<_> = (0..n)
            .map(|i| {
                let addr = r.addr;
                std::thread::spawn(move || {
                    post_json(
                        addr,
                        "/v1/chat/completions",
                        &body(Some("flex"), 40, &format!("b{i}")),
                    )
                    .expect("request")
                    .status
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    };
    assert!(burst(6).iter().all(|&s| s == 200), "no limit: all answered");
    std::fs::write(
        &path,
        format!(
            "backends = [\"{}\"]\n[classes]\nflex_max_in_flight_per_backend = 1\nflex_wait_ms = 100\n",
            engine.url()
        ),
    )
    .unwrap();
    let resp = request(r.admin, "POST", "/admin/reload", &[], b"").unwrap();
    assert_eq!(resp.status, 200, "{}", resp.text());
    let after = burst(6);
    assert!(after.contains(&429), "{after:?}");
    assert!(after.iter().all(|&s| s == 200 || s == 429), "{after:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
