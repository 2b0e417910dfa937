//! Model-aware routing through real processes: sim-engines serving
//! different models (one with a LoRA adapter, listed as vLLM lists it),
//! the router reading their `/v1/models`, every request reaching an engine
//! that serves its model (the engines' own counters prove it), unknown
//! models answered 404 by the router, its own `/v1/models`, requests
//! without a model, pools, and backends whose model lists are missing or
//! malformed.

use std::collections::BTreeMap;
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use testkit::engine_proc::SimEngine;
use testkit::fake_backend::{FakeBackend, FakeRequest, respond};
use testkit::http::{post_json, request};
use testkit::router_proc::Router;

/// Discovery runs with the health probes: fast probes, so the router knows
/// every engine's models within a second.
const FAST_PROBES: &str = "[health]\ninterval_ms = 100\n";
/// Bound of every wait for the router to learn something.
const WAIT: Duration = Duration::from_secs(15);

/// The router's `/v1/models` ids (with parents), sorted.
fn router_models(r: &Router) -> Vec<(String, Value)> {
    let m = request(r.addr, "GET", "/v1/models", &[], b"").expect("GET /v1/models");
    assert_eq!(m.status, 200, "{}", m.text());
    let v = m.json();
    assert_eq!(v["object"], "list");
    let mut ids: Vec<(String, Value)> = v["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|e| {
            assert_eq!(e["object"], "model");
            (
                e["id"].as_str().expect("id").to_owned(),
                e["parent"].clone(),
            )
        })
        .collect();
    ids.sort_by(|a, b| a.0.cmp(&b.0));
    ids
}

/// Waits (bounded) until the router lists exactly `want` (ids).
fn wait_models(r: &Router, want: &[&str]) {
    let deadline = Instant::now() + WAIT;
    loop {
        let ids: Vec<String> = router_models(r).into_iter().map(|(id, _)| id).collect();
        // The router's own answer: until some backend's models are known
        // it forwards `/v1/models` to a backend, whose list routing does
        // not know yet.
        let own = request(r.addr, "GET", "/v1/models", &[], b"")
            .map(|m| m.text().contains("\"owned_by\":\"prefix-router\""))
            .unwrap_or(false);
        if ids == want && own {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the router lists {ids:?}, not {want:?}:\n{}",
            r.child.stderr_tail(4096)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The engine's `sim:model_requests_total` per model, and its
/// `sim:unknown_model_requests_total`.
fn engine_counts(e: &SimEngine) -> (BTreeMap<String, u64>, u64) {
    let text = request(e.addr, "GET", "/metrics", &[], b"")
        .expect("engine /metrics")
        .text();
    let mut per = BTreeMap::new();
    let mut unknown = 0;
    for l in text.lines() {
        if let Some(rest) = l.strip_prefix("sim:model_requests_total{model=\"") {
            let (name, n) = rest.split_once("\"} ").expect("sample");
            per.insert(name.to_owned(), n.parse().expect("count"));
        } else if let Some(n) = l.strip_prefix("sim:unknown_model_requests_total ") {
            unknown = n.parse().expect("count");
        }
    }
    (per, unknown)
}

fn chat(model: Option<&str>, i: usize, stream: bool) -> Value {
    let mut body = json!({
        "messages": [
            {"role": "system", "content": format!("You are assistant number {}.", i % 3)},
            {"role": "user", "content": format!("Question {i}: what is {i} squared?")},
        ],
        "max_tokens": 4,
        "stream": stream,
    });
    if let Some(m) = model {
        body["model"] = json!(m);
    }
    body
}

/// The router's `prefix_router_model_requests_total{model}`.
fn router_model_requests(r: &Router, model: &str) -> u64 {
    let key = format!("prefix_router_model_requests_total{{model=\"{model}\"}} ");
    r.metrics()
        .lines()
        .find_map(|l| l.strip_prefix(&key)?.parse().ok())
        .unwrap_or(0)
}

#[test]
fn every_request_reaches_an_engine_that_serves_its_model() {
    let zero = ["--time-scale", "0"];
    let chat_only = SimEngine::spawn(&[&zero[..], &["--served-model-name", "chat"]].concat());
    let chat_lora = SimEngine::spawn(
        &[
            &zero[..],
            &[
                "--served-model-name",
                "chat",
                "--lora-modules",
                "sql=/adapters/sql",
            ],
        ]
        .concat(),
    );
    let small: Vec<SimEngine> = (0..2)
        .map(|_| SimEngine::spawn(&[&zero[..], &["--served-model-name", "small"]].concat()))
        .collect();
    let engines = [&chat_only, &chat_lora, &small[0], &small[1]];

    // The engine lists its adapter as vLLM does.
    let listed = request(chat_lora.addr, "GET", "/v1/models", &[], b"")
        .unwrap()
        .json();
    let data = listed["data"].as_array().unwrap();
    assert_eq!(data.len(), 2, "{listed}");
    assert_eq!(
        (&data[0]["id"], &data[0]["owned_by"], &data[0]["parent"]),
        (&json!("chat"), &json!("vllm"), &Value::Null)
    );
    assert_eq!(
        (&data[1]["id"], &data[1]["root"], &data[1]["parent"]),
        (&json!("sql"), &json!("/adapters/sql"), &json!("chat"))
    );
    // And answers a model it does not serve with vLLM's 404.
    let e404 = post_json(
        small[0].addr,
        "/v1/chat/completions",
        &chat(Some("chat"), 0, false),
    )
    .unwrap();
    assert_eq!(e404.status, 404);
    assert_eq!(e404.json()["error"]["param"], "model");

    let unknown_before: Vec<u64> = engines.iter().map(|e| engine_counts(e).1).collect();
    assert_eq!(unknown_before, [0, 0, 1, 0]);

    let urls: Vec<String> = engines.iter().map(|e| e.url()).collect();
    let r = Router::spawn(&urls, &[], FAST_PROBES);
    wait_models(&r, &["chat", "small", "sql"]);
    // What each backend serves, on the admin API.
    assert_eq!(
        r.backend(&chat_lora.url())["models"],
        json!(["chat", "sql"])
    );
    // The union, each once, the adapter with its base; no backend named.
    let listed = router_models(&r);
    assert_eq!(listed[2], ("sql".to_owned(), json!("chat")));
    let raw = request(r.addr, "GET", "/v1/models", &[], b"")
        .unwrap()
        .text();
    assert!(
        !raw.contains("127.0.0.1") && !raw.contains("/adapters"),
        "{raw}"
    );

    let mut sent: BTreeMap<&str, u64> = BTreeMap::new();
    for i in 0..60 {
        let model = ["chat", "small", "sql"][i % 3];
        let resp = post_json(
            r.addr,
            "/v1/chat/completions",
            &chat(Some(model), i, i % 2 == 0),
        )
        .expect("request through the router");
        assert_eq!(resp.status, 200, "{model}: {}", resp.text());
        *sent.entry(model).or_default() += 1;
    }
    // The engines saw every request for a model they serve, and no other.
    let counts: Vec<_> = engines.iter().map(|e| engine_counts(e)).collect();
    for (e, (_, unknown)) in counts.iter().enumerate() {
        assert_eq!(
            *unknown, unknown_before[e],
            "engine {e} was sent a model it does not serve"
        );
    }
    let of = |e: usize, m: &str| counts[e].0.get(m).copied().unwrap_or(0);
    assert_eq!(of(0, "chat") + of(1, "chat"), sent["chat"]);
    assert_eq!(
        of(1, "sql"),
        sent["sql"],
        "the adapter only where it is loaded"
    );
    assert_eq!(of(2, "small") + of(3, "small"), sent["small"]);
    assert!(
        of(2, "small") > 0 && of(3, "small") > 0,
        "both small engines share"
    );

    // An unknown model: the router's 404, no engine asked.
    let resp = post_json(
        r.addr,
        "/v1/chat/completions",
        &chat(Some("gpt-9"), 0, false),
    )
    .unwrap();
    assert_eq!(resp.status, 404, "{}", resp.text());
    let err = &resp.json()["error"];
    assert_eq!(err["code"], "model_not_found");
    assert_eq!(err["param"], "model");
    assert_eq!(err["type"], "invalid_request_error");
    assert!(err["message"].as_str().unwrap().contains("gpt-9"));
    assert!(!resp.text().contains("127.0.0.1"), "{}", resp.text());
    let after: Vec<u64> = engines.iter().map(|e| engine_counts(e).1).collect();
    assert_eq!(after, unknown_before, "no engine saw the unknown model");

    // Without a model (the default, "any"): answered by some engine's default model.
    let resp = post_json(r.addr, "/v1/chat/completions", &chat(None, 1, false)).unwrap();
    assert_eq!(resp.status, 200, "{}", resp.text());

    // Per-model metrics, one label per served model.
    assert_eq!(router_model_requests(&r, "chat"), sent["chat"]);
    assert_eq!(router_model_requests(&r, "sql"), sent["sql"]);
    let m = r.metrics();
    assert!(
        m.lines()
            .any(|l| l.starts_with("prefix_router_model_ttft_seconds_count{model=\"small\"}")),
        "{m}"
    );
    let prompt: u64 = m
        .lines()
        .find_map(|l| l.strip_prefix("prefix_router_model_prompt_tokens_total{model=\"chat\"} "))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!(prompt > 0, "usage is counted per model:\n{m}");

    // A router that wants a model says so.
    let strict = Router::spawn(
        &urls,
        &[],
        &format!("{FAST_PROBES}[models]\ndefault_pool = \"reject\"\n"),
    );
    let resp = post_json(strict.addr, "/v1/chat/completions", &chat(None, 1, false)).unwrap();
    assert_eq!(resp.status, 400, "{}", resp.text());
    assert_eq!(resp.json()["error"]["param"], "model");
}

#[test]
fn pools_keep_their_models_on_their_backends_with_their_policy() {
    let engines = SimEngine::fleet(3, &["--time-scale", "0", "--served-model-name", "chat"]);
    let urls: Vec<String> = engines.iter().map(|e| e.url()).collect();
    let config = format!(
        "{FAST_PROBES}[models]\ndefault_pool = \"chat\"\n[[pools]]\nname = \"chat\"\nmodels = [\"chat\"]\nbackends = [\"{}\", \"{}\"]\npolicy = \"round-robin\"\n",
        urls[0], urls[1]
    );
    let r = Router::spawn(&urls, &[], &config);
    wait_models(&r, &["chat"]);
    for i in 0..20 {
        let model = (i % 4 != 0).then_some("chat");
        let resp = post_json(r.addr, "/v1/chat/completions", &chat(model, 0, false)).unwrap();
        assert_eq!(resp.status, 200, "{}", resp.text());
    }
    let served: Vec<u64> = engines
        .iter()
        .map(|e| engine_counts(e).0.get("chat").copied().unwrap_or(0))
        .collect();
    // Round-robin over the pool's two backends (the same prompt every time:
    // the prefix policy would have kept it on one), none to the third.
    assert_eq!(served, [10, 10, 0], "{served:?}");
}

/// A fake engine whose `/v1/models` answer the test changes: 0 lists
/// `fake-model`, 1 is not JSON, 2 lists `other`, 3 is a 404 (an engine
/// without the endpoint).
struct ListingFake {
    fake: FakeBackend,
    mode: Arc<AtomicUsize>,
}

fn listing_fake(mode: usize) -> ListingFake {
    let m = Arc::new(AtomicUsize::new(mode));
    let seen = m.clone();
    let fake = FakeBackend::spawn(move |req: &FakeRequest, s: &mut TcpStream| {
        let json = "content-type: application/json\r\n";
        if req.target == "/v1/models" {
            return match seen.load(Ordering::SeqCst) {
                0 => respond(
                    s,
                    200,
                    json,
                    br#"{"object":"list","data":[{"id":"fake-model","object":"model"}]}"#,
                ),
                1 => respond(s, 200, "content-type: text/html\r\n", b"<html>oops</html>"),
                2 => respond(
                    s,
                    200,
                    json,
                    br#"{"object":"list","data":[{"id":"other","object":"model"}]}"#,
                ),
                _ => respond(s, 404, json, br#"{"detail":"Not Found"}"#),
            };
        }
        if req.target == "/metrics" || req.target == "/props" {
            return respond(s, 404, json, b"{}");
        }
        respond(s, 200, json, br#"{"choices":[{"message":{"content":"ok"}}],"usage":{"prompt_tokens":3,"completion_tokens":1}}"#)
    });
    ListingFake { fake, mode: m }
}

impl ListingFake {
    /// Inference requests it received.
    fn inferences(&self) -> usize {
        self.fake
            .log()
            .iter()
            .filter(|r| r.target == "/v1/chat/completions")
            .count()
    }
}

#[test]
fn missing_and_malformed_model_lists_change_nothing_they_should_not() {
    let listed = listing_fake(0);
    let unlisted = listing_fake(3);
    let r = Router::spawn(&[listed.fake.url(), unlisted.fake.url()], &[], FAST_PROBES);
    wait_models(&r, &["fake-model"]);
    assert_eq!(
        r.backend(&unlisted.fake.url())["models"],
        Value::Null,
        "unknown"
    );
    let send = |model: &str| {
        post_json(r.addr, "/v1/chat/completions", &chat(Some(model), 0, false))
            .unwrap()
            .status
    };
    // A listed model goes where it is listed; a name nobody lists goes to
    // the backend that does not list its models (it may serve anything).
    for _ in 0..5 {
        assert_eq!(send("fake-model"), 200);
        assert_eq!(send("mystery"), 200);
    }
    assert_eq!((listed.inferences(), unlisted.inferences()), (5, 5));

    // A malformed list: what it served before stays, with one warning.
    listed.mode.store(1, Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(800));
    assert_eq!(router_models(&r)[0].0, "fake-model");
    assert_eq!(send("fake-model"), 200);
    assert_eq!(listed.inferences(), 6);
    let log = r.child.stderr_tail(1 << 20);
    assert_eq!(
        log.matches("malformed GET /v1/models answer").count(),
        1,
        "warned once over several probes:\n{log}"
    );

    // A new good list replaces it, logged once.
    listed.mode.store(2, Ordering::SeqCst);
    wait_models(&r, &["other"]);
    let log = r.child.stderr_tail(1 << 20);
    assert_eq!(log.matches("backend models changed").count(), 2, "{log}");
    // fake-model now only fits the unlisted backend.
    let before = unlisted.inferences();
    assert_eq!(send("fake-model"), 200);
    assert_eq!(unlisted.inferences(), before + 1);
    assert_eq!(send("other"), 200);
    assert_eq!(listed.inferences(), 7);
}

#[test]
fn reloads_bring_new_backends_models_and_pins_in() {
    let chat_engine = SimEngine::spawn(&["--time-scale", "0", "--served-model-name", "chat"]);
    let small_engine = SimEngine::spawn(&["--time-scale", "0", "--served-model-name", "small"]);
    let path =
        std::env::temp_dir().join(format!("router-models-reload-{}.toml", std::process::id()));
    let write = |backends: &str| {
        std::fs::write(&path, format!("backends = [{backends}]\n{FAST_PROBES}")).unwrap();
    };
    write(&format!("\"{}\"", chat_engine.url()));
    let r = Router::spawn(&[], &["--config", path.to_str().unwrap()], "");
    let reload = |backends: &str| {
        write(backends);
        let resp = request(r.admin, "POST", "/admin/reload", &[], b"").unwrap();
        assert_eq!(resp.status, 200, "{}", resp.text());
    };
    let send = |model: &str| {
        post_json(r.addr, "/v1/chat/completions", &chat(Some(model), 0, false))
            .unwrap()
            .status
    };
    wait_models(&r, &["chat"]);
    assert_eq!(send("small"), 404);

    // A backend a reload adds: its models once it is probed.
    reload(&format!(
        "\"{}\", \"{}\"",
        chat_engine.url(),
        small_engine.url()
    ));
    wait_models(&r, &["chat", "small"]);
    assert_eq!(send("small"), 200);
    assert_eq!(engine_counts(&small_engine).0["small"], 1);

    // A pin in its table wins over what it lists (its /v1/models is no
    // longer read): `small` is then served by nobody.
    reload(&format!(
        "\"{}\", {{ url = \"{}\", models = [\"chat\"] }}",
        chat_engine.url(),
        small_engine.url()
    ));
    wait_models(&r, &["chat"]);
    assert_eq!(r.backend(&small_engine.url())["models"], json!(["chat"]));
    assert_eq!(send("small"), 404);
    assert_eq!(
        engine_counts(&small_engine).1,
        0,
        "no engine saw a model it lacks"
    );
    let _ = std::fs::remove_file(&path);
}

/// Writes a `/v1/models` answer of `len` bytes announced, then its bytes
/// one per `every`, until the peer leaves or 64 were written.
fn trickle(s: &mut TcpStream, len: usize, every: Duration) -> bool {
    use std::io::Write;
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len}\r\n\r\n"
    );
    if s.write_all(head.as_bytes()).is_err() {
        return false;
    }
    for _ in 0..64 {
        std::thread::sleep(every);
        if s.write_all(b" ").is_err() {
            break;
        }
    }
    false
}

#[test]
fn model_names_are_checked_and_oversized_or_slow_lists_are_warned_about_once() {
    let json = "content-type: application/json\r\n";
    let other = move |req: &FakeRequest, s: &mut TcpStream| {
        if req.target == "/metrics" || req.target == "/props" {
            return respond(s, 404, json, b"{}");
        }
        respond(s, 200, json, br#"{"choices":[{"message":{"content":"ok"}}],"usage":{"prompt_tokens":3,"completion_tokens":1}}"#)
    };
    // A good name beside a 100 KB one and ones with ESC, NUL and CR.
    let hostile = FakeBackend::spawn(move |req, s| {
        if req.target != "/v1/models" {
            return other(req, s);
        }
        let body = json!({"object": "list", "data": [
            {"id": "good-model", "object": "model"},
            {"id": "x".repeat(100_000), "object": "model"},
            {"id": "esc\u{1b}[2J", "object": "model"},
            {"id": "nul\u{0}", "object": "model"},
            {"id": "cr\rprefix_router_fake 1", "object": "model"},
        ]});
        respond(s, 200, json, body.to_string().as_bytes())
    });
    // A 50 MB list, and one that trickles.
    let huge = FakeBackend::spawn(move |req, s| {
        if req.target != "/v1/models" {
            return other(req, s);
        }
        trickle(s, 50_000_000, Duration::ZERO)
    });
    let slow = FakeBackend::spawn(move |req, s| {
        if req.target != "/v1/models" {
            return other(req, s);
        }
        trickle(s, 64, Duration::from_millis(100))
    });
    let r = Router::spawn(
        &[hostile.url(), huge.url(), slow.url()],
        &[],
        "[health]\ninterval_ms = 100\ntimeout_ms = 500\n",
    );
    wait_models(&r, &["good-model"]);
    let listed = request(r.addr, "GET", "/v1/models", &[], b"").unwrap();
    assert!(listed.body.len() < 1024, "{} bytes", listed.body.len());
    let problem = r.backend(&hostile.url())["models_problem"].clone();
    assert!(
        problem
            .as_str()
            .is_some_and(|p| p.starts_with("4 entries skipped")),
        "{problem}"
    );
    // Several probes later: each problem warned about once.
    std::thread::sleep(Duration::from_millis(2000));
    let m = r.metrics();
    for bad in ['\u{1b}', '\u{0}', '\r'] {
        assert!(!m.contains(bad), "{bad:?} in /metrics");
    }
    let longest = m.lines().map(str::len).max().unwrap_or(0);
    assert!(longest < 1024, "a /metrics line of {longest} bytes");
    assert!(m.contains("model=\"good-model\""));
    let log = r.child.stderr_tail(1 << 20);
    // (The log has escape sequences of its own: colours.)
    for raw in ["esc\u{1b}[2J", "nul\u{0}", "cr\rprefix", &"x".repeat(1000)] {
        assert!(!log.contains(raw), "{raw:?} in the log");
    }
    let warned = |url: &str, what: &str| {
        log.lines()
            .filter(|l| l.contains(url) && l.contains(what))
            .count()
    };
    assert_eq!(warned(&hostile.url(), "skipping model names"), 1, "{log}");
    assert_eq!(warned(&huge.url(), "too large or too slow"), 1, "{log}");
    assert_eq!(warned(&slow.url(), "too large or too slow"), 1, "{log}");
    let problem = r.backend(&huge.url())["models_problem"].clone();
    assert!(
        problem.as_str().is_some_and(|p| p.contains("body over")),
        "{problem}"
    );
    let problem = r.backend(&slow.url())["models_problem"].clone();
    assert!(
        problem
            .as_str()
            .is_some_and(|p| p.contains("no whole answer")),
        "{problem}"
    );
    // The good name routes.
    let resp = post_json(
        r.addr,
        "/v1/chat/completions",
        &chat(Some("good-model"), 0, false),
    )
    .unwrap();
    assert_eq!(resp.status, 200, "{}", resp.text());
}

/// A fake engine serving `model` that answers `/v1/embeddings`.
fn embedding_fake(model: &'static str) -> FakeBackend {
    FakeBackend::spawn(move |req: &FakeRequest, s: &mut TcpStream| {
        let json = "content-type: application/json\r\n";
        match req.target.as_str() {
            "/v1/models" => respond(
                s,
                200,
                json,
                format!(r#"{{"object":"list","data":[{{"id":"{model}","object":"model"}}]}}"#)
                    .as_bytes(),
            ),
            "/v1/embeddings" => respond(
                s,
                200,
                json,
                br#"{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.1]}]}"#,
            ),
            _ => respond(s, 404, json, b"{}"),
        }
    })
}

#[test]
fn paths_added_to_the_allowlist_reach_only_engines_that_serve_their_model() {
    let small = embedding_fake("embed-small");
    let large = embedding_fake("embed-large");
    let urls = [small.url(), large.url()];
    let r = Router::spawn(
        &urls,
        &[],
        &format!("{FAST_PROBES}[routes]\nextra_allowed = [\"/v1/embeddings\"]\n"),
    );
    wait_models(&r, &["embed-large", "embed-small"]);
    let embeddings = |f: &FakeBackend| {
        f.log()
            .iter()
            .filter(|q| q.target == "/v1/embeddings")
            .count()
    };
    for i in 0..10 {
        let model = if i % 2 == 0 {
            "embed-small"
        } else {
            "embed-large"
        };
        let resp = post_json(
            r.addr,
            "/v1/embeddings",
            &json!({"model": model, "input": format!("text {i}")}),
        )
        .expect("embeddings");
        assert_eq!(resp.status, 200, "{}", resp.text());
    }
    assert_eq!((embeddings(&small), embeddings(&large)), (5, 5));
    // A model nobody serves: the router's 404, no engine asked.
    let resp = post_json(
        r.addr,
        "/v1/embeddings",
        &json!({"model": "embed-none", "input": "x"}),
    )
    .expect("embeddings");
    assert_eq!(resp.status, 404, "{}", resp.text());
    assert_eq!(resp.json()["error"]["code"], "model_not_found");
    // A body that is not JSON (an upload) goes through to some engine.
    let resp = request(
        r.addr,
        "POST",
        "/v1/embeddings",
        &[("content-type", "application/octet-stream")],
        b"\x00\x01binary",
    )
    .expect("raw body");
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(embeddings(&small) + embeddings(&large), 11);
}
