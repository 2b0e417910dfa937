//! Request classes through real processes: `flex` requests (the body's
//! `service_tier`) held in the router while their engine is busy
//! (`classes.flex_max_in_flight_per_backend`), answered 429 with
//! Retry-After past `classes.flex_wait_ms`, while interactive requests go
//! straight through; every batch request ends as an answer or a 429,
//! counted on `/metrics`; a reload changes the limit. Each tenant's queue
//! is bounded (503, 429 for `flex`, with Retry-After), a client that gives
//! up frees its place at once, and tenants of one class share admissions.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use testkit::engine_proc::SimEngine;
use testkit::http::{Response, post_json, request};
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

/// A sample of the router's `/metrics` whose line starts with `name{` and
/// holds `labels` (0 when absent).
fn metric(r: &Router, name: &str, labels: &str) -> f64 {
    r.metrics()
        .lines()
        .find(|l| l.starts_with(&format!("{name}{{")) && l.contains(labels))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

/// `n` requests at once, each with `body(i)`: their answers.
fn at_once(addr: std::net::SocketAddr, n: usize, body: fn(usize) -> Value) -> Vec<Response> {
    let threads: Vec<_> = (0..n)
        .map(|i| {
            std::thread::spawn(move || {
                post_json(addr, "/v1/chat/completions", &body(i)).expect("request")
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

#[test]
fn a_full_queue_answers_at_once_503_or_429_for_flex_with_retry_after() {
    // One request at a time on the engine (100 tokens, 300 ms each); two of
    // a tenant's requests of a class may wait, a batch tenant's one.
    let engine = SimEngine::spawn(&["--time-scale", "0.2"]);
    let config = "[limits]\nmax_in_flight_per_backend = 1\n[timeouts]\nqueue_ms = 20000\n\
        [classes]\nflex_max_in_flight_per_backend = 1\nflex_wait_ms = 20000\nmax_waiting = 2\n\
        [[classes.tenants]]\nname = \"batch\"\nclass = \"flex\"\nusers = [\"batch\"]\nmax_waiting = 1\n";
    let r = Router::spawn(&[engine.url()], &[], config);
    let started = Instant::now();
    let answers = at_once(r.addr, 6, |i| body(None, 100, &format!("chat {i}")));
    let refused: Vec<_> = answers.iter().filter(|a| a.status == 503).collect();
    assert!(
        answers.iter().all(|a| a.status == 200 || a.status == 503),
        "{:?}",
        answers.iter().map(|a| a.status).collect::<Vec<_>>()
    );
    // One runs, two wait: three are refused (at least one, on a slow start).
    assert!(
        !refused.is_empty() && refused.len() <= 3,
        "{} refused",
        refused.len()
    );
    for a in &refused {
        assert!(a.header("retry-after").is_some(), "503 without Retry-After");
        assert!(a.text().contains("classes.max_waiting"), "{}", a.text());
    }
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "the waiting ones were answered"
    );
    assert_eq!(
        metric(
            &r,
            "prefix_router_class_refused_total",
            "class=\"default\",tenant=\"-\""
        ),
        refused.len() as f64
    );
    // The batch tenant's queue holds one: flex past it is 429, not 503.
    let answers = at_once(r.addr, 4, |i| {
        let mut b = body(None, 100, &format!("batch {i}"));
        b["user"] = json!("batch");
        b
    });
    let shed: Vec<_> = answers.iter().filter(|a| a.status == 429).collect();
    assert!(!shed.is_empty(), "no 429");
    assert!(answers.iter().all(|a| a.status == 200 || a.status == 429));
    for a in &shed {
        assert!(a.header("retry-after").is_some(), "429 without Retry-After");
    }
    assert_eq!(
        metric(
            &r,
            "prefix_router_class_refused_total",
            "class=\"flex\",tenant=\"batch\""
        ),
        shed.len() as f64
    );
}

#[test]
fn a_client_that_leaves_while_queued_frees_its_place_at_once() {
    let engine = SimEngine::spawn(&["--time-scale", "0.2"]);
    let config = "[classes]\nflex_max_in_flight_per_backend = 1\nflex_wait_ms = 20000\n";
    let r = Router::spawn(&[engine.url()], &[], config);
    let addr = r.addr;
    let waiting = |r: &Router| {
        metric(
            r,
            "prefix_router_class_waiting",
            "class=\"flex\",tenant=\"-\"",
        )
    };
    // A runs for about 1.2 s (400 tokens).
    let a = std::thread::spawn(move || {
        let resp =
            post_json(addr, "/v1/chat/completions", &body(Some("flex"), 400, "a")).expect("a");
        (resp.status, Instant::now())
    });
    std::thread::sleep(Duration::from_millis(100));
    // B waits behind it, then its client gives up.
    let b_body = serde_json::to_vec(&body(Some("flex"), 50, "b")).unwrap();
    let mut b = std::net::TcpStream::connect(addr).unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        b_body.len()
    );
    std::io::Write::write_all(&mut b, head.as_bytes()).unwrap();
    std::io::Write::write_all(&mut b, &b_body).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    // C waits behind B.
    let c = std::thread::spawn(move || {
        post_json(addr, "/v1/chat/completions", &body(Some("flex"), 10, "c")).expect("c")
    });
    let until = |what: &str, cond: &dyn Fn() -> bool| {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !cond() {
            assert!(Instant::now() < deadline, "{what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    until("B and C wait", &|| waiting(&r) == 2.0);
    drop(b);
    let left_at = {
        until("B's place freed", &|| waiting(&r) == 1.0);
        Instant::now()
    };
    assert_eq!(
        metric(
            &r,
            "prefix_router_class_left_total",
            "class=\"flex\",tenant=\"-\""
        ),
        1.0
    );
    let (a_status, a_done) = a.join().unwrap();
    assert_eq!(a_status, 200);
    assert!(left_at < a_done, "the place was freed only when A finished");
    let c = c.join().unwrap();
    assert_eq!(c.status, 200, "{}", c.text());
    // B never reached the engine: A and C did.
    assert_eq!(engine.requests_served(), 2);
    assert_eq!(waiting(&r), 0.0);
}

/// A request: when it was sent, when its answer came, whose.
type Answered = (Instant, Instant, &'static str);

#[test]
fn two_tenants_of_one_class_share_admissions_fairly_while_saturated() {
    // One flex request at a time (20 tokens, about 60 ms each). The big
    // tenant queues 30 requests, then the small one sends 3 (1:10): in
    // arrival order all 3 would come after the 30.
    let engine = SimEngine::spawn(&["--time-scale", "0.2"]);
    let config = "[classes]\nflex_max_in_flight_per_backend = 1\nflex_wait_ms = 60000\n\
        [[classes.tenants]]\nname = \"big\"\nclass = \"flex\"\nusers = [\"big\"]\n\
        [[classes.tenants]]\nname = \"small\"\nclass = \"flex\"\nusers = [\"small\"]\n";
    let r = Router::spawn(&[engine.url()], &[], config);
    let addr = r.addr;
    let done: Arc<Mutex<Vec<Answered>>> = Arc::default();
    let send = |who: &'static str, i: usize| {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut b = body(None, 20, &format!("{who} {i}"));
            b["user"] = json!(who);
            let sent = Instant::now();
            let resp = post_json(addr, "/v1/chat/completions", &b).expect("request");
            assert_eq!(resp.status, 200, "{}", resp.text());
            done.lock().unwrap().push((sent, Instant::now(), who));
        })
    };
    let mut threads: Vec<_> = (0..30).map(|i| send("big", i)).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(&r, "prefix_router_class_waiting", "tenant=\"big\"") < 20.0 {
        assert!(
            Instant::now() < deadline,
            "the big tenant's backlog never formed"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    threads.extend((0..3).map(|i| send("small", i)));
    for t in threads {
        t.join().unwrap();
    }
    let done = done.lock().unwrap().clone();
    // For each small request: the big ones answered while it waited.
    let overtaken: Vec<usize> = done
        .iter()
        .filter(|e| e.2 == "small")
        .map(|s| {
            done.iter()
                .filter(|b| b.2 == "big" && b.1 > s.0 && b.1 < s.1)
                .count()
        })
        .collect();
    assert_eq!(overtaken.len(), 3);
    // Equal weights: the small tenant's requests alternate with the big
    // one's from their arrival (at most 4 big answers came while one
    // waited, in five runs; with every waiting request polling for room in
    // no order, the most overtaken one saw 12 to 30 in four). A generous
    // bound: the machine is noisy.
    assert!(
        overtaken.iter().all(|&n| n <= 10),
        "big answers while each small request waited: {overtaken:?}"
    );
    let waited = metric(
        &r,
        "prefix_router_class_wait_seconds_count",
        "class=\"flex\",tenant=\"small\"",
    );
    assert_eq!(waited, 3.0, "the small tenant's waits on /metrics");
}
