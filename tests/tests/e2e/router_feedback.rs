//! The closed loop: the router compares what each answer says the engine
//! had cached (`usage.prompt_tokens_details.cached_tokens`) with what its
//! index predicted, exports the error, forgets a flushed engine, and learns
//! a capacity nobody published.

use std::net::SocketAddr;

use serde_json::json;
use testkit::engine_proc::SimEngine;
use testkit::http::{post_json, request};
use testkit::router_proc::Router;

/// A document of `blocks` 64-byte blocks: 16 sim-engine tokens each, so the
/// router's blocks and the engine's line up.
fn doc(id: usize, blocks: usize) -> String {
    let unit = format!("document {id:04} line; ");
    let mut s = String::new();
    while s.len() < blocks * 64 {
        s.push_str(&unit);
    }
    s.truncate(blocks * 64);
    s
}

fn addr(url: &str) -> SocketAddr {
    url.trim_start_matches("http://").parse().expect("address")
}

/// Sends one completion; returns the backend that served it and the cached tokens.
fn complete(router: &Router, prompt: &str) -> (String, u64) {
    let r = post_json(
        addr(&router.url()),
        "/v1/completions",
        &json!({"model": "sim-llama-8b", "prompt": prompt, "max_tokens": 4}),
    )
    .expect("completion");
    assert_eq!(r.status, 200, "{}", r.text());
    let backend = r
        .header("x-prefix-router-backend")
        .expect("debug header")
        .to_owned();
    let cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    (backend, cached)
}

fn metric(text: &str, name: &str, backend: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(&format!("backend=\"{backend}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn a_flushed_engine_is_forgotten_and_the_error_is_exported() {
    let engines = SimEngine::fleet(2, &["--time-scale", "0"]);
    let urls: Vec<String> = engines.iter().map(SimEngine::url).collect();
    let router = Router::spawn(&urls, &["--debug-headers"], "");
    router.wait_models_known();
    // Eight documents, each sent twice: the second time is a predicted hit.
    let docs: Vec<String> = (0..8).map(|i| doc(i, 64)).collect();
    let mut placed = Vec::new();
    for d in &docs {
        let (b, _) = complete(&router, d);
        let (again, cached) = complete(&router, d);
        assert_eq!(b, again, "a repeated prompt stays on its engine");
        assert!(cached >= 60 * 16, "the repeat was cached: {cached} tokens");
        placed.push(b);
    }
    // The router reads an answer's usage after the client has it: wait
    // (bounded) for the last one to be counted.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let (m, reports) = loop {
        let m = router.metrics();
        let reports: f64 = urls
            .iter()
            .map(|u| metric(&m, "prefix_router_prediction_reports_total", u))
            .sum();
        if reports >= 16.0 || std::time::Instant::now() > deadline {
            break (m, reports);
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert_eq!(reports, 16.0, "every answer was compared:\n{m}");
    assert!(m.contains("prefix_router_prediction_error_blocks_total"));
    assert!(m.contains("prefix_router_learned_capacity_blocks"));
    // Flush the engine that holds the most documents, behind the router's back.
    let victim = if placed.iter().filter(|b| **b == urls[0]).count() >= 4 {
        &urls[0]
    } else {
        &urls[1]
    };
    let on_victim: Vec<&String> = docs
        .iter()
        .zip(&placed)
        .filter(|(_, b)| *b == victim)
        .map(|(d, _)| d)
        .collect();
    assert!(on_victim.len() >= 4, "{placed:?}");
    let before = router.backend(victim)["index_blocks"].as_u64().unwrap();
    assert!(before >= 4 * 64, "{before}");
    let r = request(addr(victim), "POST", "/reset_prefix_cache", &[], b"").expect("flush");
    assert_eq!(r.status, 200);
    // The router still predicts hits there; the first answers say nothing
    // was cached, and after a few in a row it forgets the engine.
    for d in &on_victim[..3] {
        let (b, cached) = complete(&router, d);
        assert_eq!(&b, victim);
        assert_eq!(cached, 0);
    }
    // The router reads an answer's usage after the client has it, and
    // counts the flush before it clears the index: wait for both (bounded).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let after = loop {
        let b = router.backend(victim);
        let done = b["prediction"]["flushes"] == 1 && b["index_blocks"].as_u64() <= Some(64);
        if done || std::time::Instant::now() > deadline {
            break b;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert_eq!(after["prediction"]["flushes"], 1, "{after}");
    let blocks = after["index_blocks"].as_u64().unwrap();
    assert!(
        blocks <= 64,
        "only the prompt just computed is left: {blocks} of {before}"
    );
    let m = router.metrics();
    let flushes = m
        .lines()
        .find(|l| {
            l.starts_with("prefix_router_mispredictions_total")
                && l.contains(victim.as_str())
                && l.contains("kind=\"flush\"")
        })
        .unwrap_or_default();
    assert!(flushes.ends_with(" 1"), "{flushes}");
    // The other engine's picture is untouched.
    let other = urls.iter().find(|u| *u != victim).unwrap();
    assert_eq!(router.backend(other)["prediction"]["flushes"], 0);
}

#[test]
fn an_unpublished_capacity_is_learned_from_the_answers() {
    // One engine with room for 512 blocks that does not tell the router;
    // the router starts from its default of 65,536.
    let cap = 512.0;
    let engines = SimEngine::fleet(1, &["--time-scale", "0", "--kv-blocks", "512"]);
    let urls: Vec<String> = engines.iter().map(SimEngine::url).collect();
    let router = Router::spawn(
        &urls,
        &["--debug-headers"],
        "[prefix]\nread_kv_capacity = false\n",
    );
    assert_eq!(
        router.backend(&urls[0])["learned_capacity_blocks"],
        65_536,
        "nothing learned yet"
    );
    // 24 documents of 32 blocks in a shuffled cycle: the engine keeps about
    // 15 of them, so some repeats hit and some were evicted.
    let docs: Vec<String> = (0..24).map(|i| doc(i, 32)).collect();
    let mut x = 7u64;
    for _ in 0..300 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        complete(&router, &docs[(x >> 33) as usize % docs.len()]);
    }
    let b = router.backend(&urls[0]);
    let learned = b["learned_capacity_blocks"].as_f64().unwrap();
    assert!(
        (learned - cap).abs() <= 0.25 * cap,
        "learned {learned} blocks, the engine has {cap}: {b}"
    );
}

#[test]
fn a_published_capacity_does_not_shrink_what_the_index_remembers() {
    // An engine that publishes room for 64 blocks. The router takes it as
    // the known capacity, but keeps remembering where prompts went past it:
    // cut to 64, the index forgot histories the engines still held and
    // conversations moved (decision 0021).
    let engines = SimEngine::fleet(1, &["--time-scale", "0", "--kv-blocks", "64"]);
    let url = engines[0].url();
    let router = Router::spawn(std::slice::from_ref(&url), &["--debug-headers"], "");
    assert!(
        router.wait_backend(&url, std::time::Duration::from_secs(10), |b| {
            b["capacity_known"] == true
        }),
        "the published capacity was read: {}",
        router.backend(&url)
    );
    let b = router.backend(&url);
    assert_eq!(b["learned_capacity_blocks"], 64, "{b}");
    for i in 0..8 {
        complete(&router, &doc(i, 16));
    }
    let b = router.backend(&url);
    assert!(
        b["index_blocks"].as_u64() >= Some(8 * 16),
        "all 128 blocks sent are remembered, past the engine's 64: {b}"
    );
    assert!(b["kv_blocks"].as_u64() > Some(64), "{b}");
}

/// Reads from `s` until `pat` has come, or panics after 10 s.
fn read_until(s: &mut std::net::TcpStream, got: &mut Vec<u8>, pat: &[u8]) {
    use std::io::Read as _;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut buf = [0u8; 4096];
    while !got.windows(pat.len()).any(|w| w == pat) {
        assert!(
            std::time::Instant::now() < deadline,
            "no {:?} in {:?}",
            String::from_utf8_lossy(pat),
            String::from_utf8_lossy(got)
        );
        let n = s.read(&mut buf).expect("read");
        assert!(n > 0, "closed early: {:?}", String::from_utf8_lossy(got));
        got.extend_from_slice(&buf[..n]);
    }
}

#[test]
fn a_streamed_prompt_is_queued_prefill_until_its_first_event() {
    // An engine that prefills 2,000 tokens a second: a prompt of 4,096
    // tokens takes 2 s. It sends its response head when it takes the
    // request, as vLLM does, and its first event once it has prefilled.
    // Until then the prompt is prefill queued on that engine, which is
    // what the router's TTFT prediction counts for the next request.
    use std::io::Write as _;
    let engine = SimEngine::spawn(&["--time-scale", "1", "--prefill-tps", "2000"]);
    let url = engine.url();
    let router = Router::spawn(std::slice::from_ref(&url), &[], "");
    router.wait_models_known();
    let body = json!({
        "model": "sim-llama-8b",
        "prompt": doc(1, 256),
        "max_tokens": 2,
        "stream": true,
    })
    .to_string();
    let mut s = std::net::TcpStream::connect(addr(&router.url())).expect("connect");
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut got = Vec::new();
    read_until(&mut s, &mut got, b"\r\n\r\n");
    assert!(
        got.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    assert!(
        !got.windows(5).any(|w| w == b"data:"),
        "the engine answered before it prefilled"
    );
    let queued = router.backend(&url)["queued_prefill_blocks"]
        .as_u64()
        .expect("queued_prefill_blocks");
    assert!(
        queued >= 250,
        "with the head sent and the prompt still prefilling, {queued} blocks were queued"
    );
    read_until(&mut s, &mut got, b"data:");
    assert!(
        router.wait_backend(&url, std::time::Duration::from_secs(5), |b| {
            b["queued_prefill_blocks"] == 0
        }),
        "the first event came, but the prompt still counts as queued: {}",
        router.backend(&url)
    );
}

#[test]
fn a_history_the_engine_lost_lowers_what_it_is_trusted_to_keep() {
    let engines = SimEngine::fleet(2, &["--time-scale", "0"]);
    let urls: Vec<String> = engines.iter().map(SimEngine::url).collect();
    let router = Router::spawn(&urls, &["--debug-headers"], "");
    router.wait_models_known();
    // A system prompt of 16 blocks on both engines: sent once, then again
    // (another turn) while its engine is drained.
    let prompt = doc(1, 16);
    let (first, _) = complete(&router, &format!("{prompt}{}", doc(2, 4)));
    let drain = |path: &str| {
        let q = format!(
            "{path}?backend={}",
            first.replace(':', "%3A").replace('/', "%2F")
        );
        let r = request(router.admin, "POST", &q, &[], b"").expect("admin");
        assert_eq!(r.status, 200, "{}", r.text());
    };
    drain("/admin/drain");
    let (second, _) = complete(&router, &format!("{prompt}{}", doc(3, 4)));
    assert_ne!(first, second);
    drain("/admin/undrain");
    // A conversation over it: repeated on one engine, its history (48
    // blocks past the prompt every engine holds) is that engine's private
    // lead, and it kept it.
    let d = format!("{prompt}{}", doc(7, 48));
    let (holder, _) = complete(&router, &d);
    let (again, cached) = complete(&router, &d);
    assert_eq!(holder, again);
    assert!(cached >= 60 * 16, "{cached}");
    let kept = |b: &str| router.backend(b)["private_lead_kept"].as_f64().unwrap();
    let wait_for = |b: &str, ok: &dyn Fn(f64) -> bool| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let k = kept(b);
            if ok(k) || std::time::Instant::now() > deadline {
                return k;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    };
    assert_eq!(
        wait_for(&holder, &|k| k < 1.0),
        1.0,
        "a kept lead keeps the trust whole"
    );
    // The engine loses it behind the router's back (as a busy engine
    // evicts a history between two turns); the next send finds nothing.
    let r = request(addr(&holder), "POST", "/reset_prefix_cache", &[], b"").expect("flush");
    assert_eq!(r.status, 200);
    let (b, cached) = complete(&router, &d);
    assert_eq!(b, holder);
    assert_eq!(cached, 0);
    let lost = wait_for(&holder, &|k| k < 1.0);
    assert!(
        lost < 1.0 && lost > 0.5,
        "one lost lead of 20-odd answers: {lost}"
    );
    let other = urls.iter().find(|u| **u != holder).unwrap();
    assert_eq!(kept(other), 1.0);
    let m = router.metrics();
    let exported = metric(&m, "prefix_router_private_lead_kept_ratio", &holder);
    assert!(
        (exported - lost).abs() < 1e-9,
        "{exported} against {lost}:\n{m}"
    );
}

/// Sends a completion of `prompt` from a thread; joins to its cached tokens.
fn complete_in_thread(router: &Router, prompt: String) -> std::thread::JoinHandle<u64> {
    let url = router.url();
    std::thread::spawn(move || {
        let r = post_json(
            addr(&url),
            "/v1/completions",
            &json!({"model": "sim-llama-8b", "prompt": prompt, "max_tokens": 2}),
        )
        .expect("completion");
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0)
    })
}

/// Two requests for one new long prompt, the second while the engine still
/// prefills it for the first (in 4 chunks): the second waits for the first
/// one's prefill and finds the whole prompt cached. Sent at once
/// (`prefix.prefill_wait_ms = 0`), the engine takes it at its next step,
/// finds the first chunk cached and computes the rest a second time.
#[test]
fn a_request_on_a_prompt_still_being_prefilled_waits_for_it() {
    let engine_args = [
        "--time-scale",
        "1",
        "--prefill-tps",
        "20000",
        "--max-num-batched-tokens",
        "1024",
        "--decode-step-ms",
        "5",
    ];
    let d = doc(21, 256); // 4,096 tokens: 4 chunks of 1,024, 50 ms each
    let mut cached = Vec::new();
    for wait in [1000, 0] {
        let engine = SimEngine::spawn(&engine_args);
        let router = Router::spawn(
            &[engine.url()],
            &[],
            &format!("[prefix]\nprefill_wait_ms = {wait}\n"),
        );
        router.wait_models_known();
        let first = complete_in_thread(&router, d.clone());
        std::thread::sleep(std::time::Duration::from_millis(60));
        let second = complete_in_thread(&router, d.clone());
        assert_eq!(first.join().unwrap(), 0, "a new prompt");
        cached.push(second.join().unwrap());
        let waits = router
            .metrics()
            .lines()
            .find(|l| l.starts_with("prefix_router_prefill_wait_seconds_count"))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(-1.0);
        assert_eq!(waits, if wait > 0 { 1.0 } else { 0.0 }, "prefill waits");
    }
    let (waited, not) = (cached[0], cached[1]);
    assert!(waited >= 4000, "waited: {waited} of 4,096 tokens cached");
    assert!(
        not < 4000,
        "without the wait the engine computes most of it again: {not} cached"
    );
}

/// An engine whose `cached_tokens` is not a count (3.7, then -5, then more
/// than its prompt) teaches the closed loop nothing: its answers are
/// counted as not believed, warned about once, and its learned state stays
/// where it started, so where the others' requests go does not change.
/// Before, 3.7 was read as 3: the router believed the engine had lost
/// every prompt, shrank its learned capacity and forgot its blocks, and
/// conversations moved onto the honest engines.
#[test]
fn an_engine_whose_cached_tokens_are_not_a_count_teaches_nothing() {
    let mut engines = Vec::new();
    for (i, extra) in [&[][..], &["--bad-cached-tokens", "3.7"][..], &[][..]]
        .iter()
        .enumerate()
    {
        let id = format!("e{i}");
        let mut args = vec!["--id", id.as_str(), "--time-scale", "0"];
        args.extend_from_slice(extra);
        engines.push(SimEngine::spawn(&args));
    }
    let urls: Vec<String> = engines.iter().map(SimEngine::url).collect();
    let liar = urls[1].clone();
    let router = Router::spawn(
        &urls,
        &["--debug-headers"],
        "[prefix]\nread_kv_capacity = false\n",
    );
    router.wait_models_known();
    let start: Vec<serde_json::Value> = urls.iter().map(|u| router.backend(u)).collect();
    // Twelve documents, then three rounds of repeats: every repeat is a
    // predicted hit on the engine the document first went to.
    let docs: Vec<String> = (0..12).map(|i| doc(100 + i, 32)).collect();
    let home: Vec<String> = docs.iter().map(|d| complete(&router, d).0).collect();
    assert!(
        home.contains(&liar),
        "some document went to the liar: {home:?}"
    );
    for round in 0..3 {
        if round == 1 {
            set_bad_cached(&engines[1], "-5");
        }
        if round == 2 {
            set_bad_cached(&engines[1], "99999999");
        }
        for (d, h) in docs.iter().zip(&home) {
            let (b, cached) = complete(&router, d);
            assert_eq!(&b, h, "round {round}: a repeat stays on its engine");
            if b != liar {
                assert!(cached >= 30 * 16, "an honest repeat hits: {cached}");
            }
        }
    }
    let on_liar = home.iter().filter(|h| **h == liar).count() as u64;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while router.backend(&liar)["prediction"]["invalid_reports"].as_u64() < Some(4 * on_liar)
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let b = router.backend(&liar);
    assert_eq!(
        b["prediction"]["invalid_reports"].as_u64(),
        Some(4 * on_liar),
        "every answer of the liar counted: {b}"
    );
    // Nothing it said was learned: no report compared, no flush, the
    // capacity and the kept share where they started.
    assert_eq!(b["prediction"]["reports"], 0, "{b}");
    assert_eq!(b["prediction"]["flushes"], 0, "{b}");
    assert_eq!(
        b["learned_capacity_blocks"], start[1]["learned_capacity_blocks"],
        "{b}"
    );
    assert_eq!(b["private_lead_kept"], 1.0, "{b}");
    assert_eq!(b["index_blocks"].as_u64(), Some(on_liar * 32), "{b}");
    for u in [&urls[0], &urls[2]] {
        let h = router.backend(u);
        assert_eq!(h["prediction"]["invalid_reports"], 0, "{h}");
        assert_eq!(h["prediction"]["flushes"], 0, "{h}");
    }
    let m = router.metrics();
    assert_eq!(
        metric(&m, "prefix_router_usage_invalid_total", &liar),
        (4 * on_liar) as f64,
        "{m}"
    );
    let warnings = router
        .child
        .stderr_tail(1 << 20)
        .matches("usage is not believed")
        .count();
    assert_eq!(warnings, 1, "warned once for the backend");
}

/// Makes `engine` write `literal` for every `cached_tokens` from now on.
fn set_bad_cached(engine: &SimEngine, literal: &str) {
    let r = post_json(
        engine.addr,
        "/sim/faults",
        &json!({ "bad_cached_tokens": literal }),
    )
    .expect("faults");
    assert_eq!(r.status, 200, "{}", r.text());
}
