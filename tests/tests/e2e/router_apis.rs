//! Anthropic's Messages and OpenAI's Responses APIs through the router,
//! with real processes: the official SDKs' every call kind, stored
//! responses pinned to the engine that stored them (chains of
//! `previous_response_id` under load and through a reload, retrieve,
//! cancel), a clean 404 when that engine is gone, each API's error shape,
//! and replicas sharing the stored ids.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use testkit::engine_proc::SimEngine;
use testkit::http::{post_json, request};
use testkit::router_proc::Router;
use testkit::sdk::{self, Script};

const MODEL: &str = "sim-llama-8b";
const FAST_PROBES: &str = "[health]\ninterval_ms = 100\n";

/// Engines whose simulated time runs 20 times faster than real time: a
/// call of a few tokens takes milliseconds, a long background response
/// runs long enough to be cancelled.
fn engines(n: usize) -> Vec<SimEngine> {
    SimEngine::fleet(n, &["--time-scale", "0.05"])
}

fn urls(engines: &[SimEngine]) -> Vec<String> {
    engines.iter().map(SimEngine::url).collect()
}

/// A turn of a Responses chain: its input, and the id it continues.
fn turn(input: &str, previous: Option<&str>) -> Value {
    turn_as("You are a travel agent. Answer briefly.", input, previous)
}

/// A turn with its own `instructions` (they are not carried over: each
/// turn's prompt starts with its own, so its prefix says nothing of where
/// the chain is stored).
fn turn_as(instructions: &str, input: &str, previous: Option<&str>) -> Value {
    let mut b = json!({
        "model": MODEL,
        "instructions": instructions,
        "input": input,
        "max_output_tokens": 6,
    });
    if let Some(p) = previous {
        b["previous_response_id"] = json!(p);
    }
    b
}

/// Which of `engines` hold the stored response `id` (asked directly).
fn holders(engines: &[SimEngine], id: &str) -> Vec<usize> {
    engines
        .iter()
        .enumerate()
        .filter(|(_, e)| {
            request(e.addr, "GET", &format!("/v1/responses/{id}"), &[], b"")
                .is_ok_and(|r| r.status == 200)
        })
        .map(|(i, _)| i)
        .collect()
}

/// Runs a chain of `turns` turns through `addr`; every turn must succeed
/// and find the chain so far cached. Returns the ids, first to last.
fn chain(addrs: &[SocketAddr], turns: usize, tag: &str) -> Vec<String> {
    let mut ids: Vec<String> = Vec::new();
    for t in 0..turns {
        let addr = addrs[t % addrs.len()];
        let body = turn(&format!("{tag}: step {t}"), ids.last().map(String::as_str));
        let r = post_json(addr, "/v1/responses", &body).expect("responses");
        assert_eq!(r.status, 200, "{tag} turn {t}: {}", r.text());
        let v = r.json();
        if t > 0 {
            assert_eq!(v["previous_response_id"], json!(ids[t - 1]), "turn {t}");
            // The engine holds the chain so far: most of the prompt is cached.
            let usage = &v["usage"];
            let cached = usage["input_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap();
            assert!(
                cached * 2 > usage["input_tokens"].as_u64().unwrap(),
                "{tag} turn {t}: {usage}"
            );
        }
        ids.push(v["id"].as_str().expect("id").to_owned());
    }
    ids
}

#[test]
fn both_sdks_make_every_call_through_the_router() {
    let Some(py) = sdk::require("both_sdks_make_every_call_through_the_router") else {
        return;
    };
    let fleet = engines(4);
    let r = Router::spawn(&urls(&fleet), &[], FAST_PROBES);
    r.wait_models_known();
    let messages = sdk::run(&py, Script::Anthropic, &r.url(), MODEL, &[]);
    messages.assert_success();
    let turns = messages.call("messages.multi_turn")["turns"]
        .as_array()
        .unwrap()
        .clone();
    for (i, t) in turns.iter().enumerate().skip(1) {
        let cached = t["usage"]["cache_read_input_tokens"].as_u64().unwrap();
        assert!(cached > 0, "turn {i} found no cache: {t}");
    }
    let responses = sdk::run(&py, Script::OpenAiResponses, &r.url(), MODEL, &[]);
    responses.assert_success();
    let chain = responses.call("responses.chain")["turns"]
        .as_array()
        .unwrap()
        .clone();
    assert!(chain.len() >= 4);
    for (i, t) in chain.iter().enumerate().skip(1) {
        let cached = t["usage"]["cached_tokens"].as_u64().unwrap();
        assert!(cached > 0, "chain turn {i} found no cache: {t}");
    }
    assert_eq!(responses.call("responses.retrieve")["same_text"], true);
    let cancel = responses.call("responses.cancel");
    assert_eq!(cancel["cancelled_status"], "cancelled", "{cancel}");
    assert_eq!(
        responses.call("responses.not_found")["statuses"],
        json!([404, 404])
    );
    // Every continuation went where its response was stored: the router
    // counts them as pinned.
    assert!(
        r.metrics()
            .lines()
            .any(|l| l.contains("decision=\"stored\"") && !l.ends_with(" 0")),
        "no request was pinned"
    );
}

#[test]
fn a_chain_of_twenty_turns_never_fails_under_load_and_through_a_reload() {
    let fleet = engines(4);
    let u = urls(&fleet);
    let config = format!("{FAST_PROBES}[routes]\nresponses_max_ids = 1000\n");
    let r = Router::spawn(&u, &[], &config);
    r.wait_models_known();
    // Other traffic meanwhile: new conversations and chats on every engine.
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let load: Vec<_> = (0..3)
        .map(|w| {
            let (stop, sent, addr) = (stop.clone(), sent.clone(), r.addr);
            std::thread::spawn(move || {
                let mut i = 0;
                while !stop.load(Relaxed) && i < 2_000 {
                    let body = json!({"model": MODEL, "max_tokens": 4, "messages": [
                        {"role": "user", "content": format!("load {w}-{i}")}]});
                    let r = post_json(addr, "/v1/chat/completions", &body).expect("load");
                    assert_eq!(r.status, 200, "{}", r.text());
                    sent.fetch_add(1, Relaxed);
                    i += 1;
                }
            })
        })
        .collect();
    // Each turn with instructions of its own: its prompt would send it
    // anywhere; only the pin keeps it with the chain.
    let mut ids: Vec<String> = Vec::new();
    for t in 0..20 {
        if t == 10 {
            let reload = request(r.admin, "POST", "/admin/reload", &[], b"").expect("reload");
            assert_eq!(reload.status, 200, "{}", reload.text());
        }
        let persona = format!("You are travel agent number {t}, with a style of your own.");
        let body = turn_as(
            &persona,
            &format!("step {t}"),
            ids.last().map(String::as_str),
        );
        let resp = post_json(r.addr, "/v1/responses", &body).expect("responses");
        assert_eq!(resp.status, 200, "turn {t}: {}", resp.text());
        ids.push(resp.json()["id"].as_str().unwrap().to_owned());
    }
    stop.store(true, Relaxed);
    for t in load {
        t.join().expect("load thread");
    }
    assert!(sent.load(Relaxed) > 0);
    // One engine made the whole chain: each id is stored there only.
    let where_: BTreeSet<Vec<usize>> = ids.iter().map(|id| holders(&fleet, id)).collect();
    assert_eq!(where_.len(), 1, "{where_:?}");
    assert_eq!(where_.iter().next().unwrap().len(), 1, "{where_:?}");
    // Retrieve, input items and cancel of a stored response reach it too.
    let last = ids.last().unwrap();
    let got = request(r.addr, "GET", &format!("/v1/responses/{last}"), &[], b"").unwrap();
    assert_eq!(got.status, 200, "{}", got.text());
    assert_eq!(got.json()["id"], json!(last));
    let items = request(
        r.addr,
        "GET",
        &format!("/v1/responses/{last}/input_items"),
        &[],
        b"",
    )
    .unwrap();
    assert_eq!(items.status, 200, "{}", items.text());
    let cancel = request(
        r.addr,
        "POST",
        &format!("/v1/responses/{last}/cancel"),
        &[],
        b"",
    )
    .unwrap();
    // A finished synchronous response: the engine's own refusal, not a 404.
    assert_eq!(cancel.status, 400, "{}", cancel.text());
}

#[test]
fn a_chain_whose_engine_is_gone_gets_a_clean_404() {
    let mut fleet = engines(2);
    let u = urls(&fleet);
    let r = Router::spawn(&u, &[], FAST_PROBES);
    r.wait_models_known();
    let ids = chain(&[r.addr], 2, "doomed");
    let holder = holders(&fleet, &ids[1]);
    assert_eq!(holder.len(), 1);
    // Killed: the next turn is the engine's own answer had it restarted.
    drop(fleet.remove(holder[0]));
    for _ in 0..2 {
        let resp = post_json(r.addr, "/v1/responses", &turn("next", Some(&ids[1]))).unwrap();
        assert_eq!(resp.status, 404, "{}", resp.text());
        let err = &resp.json()["error"];
        assert!(err["message"].as_str().unwrap().contains(&ids[1]), "{err}");
        assert_eq!(err["type"], "invalid_request_error");
        let got = request(
            r.addr,
            "GET",
            &format!("/v1/responses/{}", ids[1]),
            &[],
            b"",
        )
        .unwrap();
        assert_eq!(got.status, 404, "{}", got.text());
        // Once health notices, the same.
        std::thread::sleep(Duration::from_millis(500));
    }
    // New chains go to the engine that is left.
    let fresh = chain(&[r.addr], 2, "fresh");
    assert_eq!(holders(&fleet, &fresh[1]), [0]);
    // An id no engine here stored: a 404, no engine asked to guess.
    let served = fleet[0].requests_served();
    let resp = post_json(r.addr, "/v1/responses", &turn("x", Some("resp_never_made"))).unwrap();
    assert_eq!(resp.status, 404, "{}", resp.text());
    assert_eq!(fleet[0].requests_served(), served);
}

#[test]
fn malformed_bodies_get_each_apis_error_shape_and_harm_nothing() {
    let fleet = engines(2);
    let r = Router::spawn(&urls(&fleet), &[], FAST_PROBES);
    r.wait_models_known();
    let raw = |path: &str, body: &[u8]| {
        request(
            r.addr,
            "POST",
            path,
            &[("content-type", "application/json")],
            body,
        )
        .expect("request")
    };
    for body in [
        &b"{"[..],
        b"[]",
        br#"{"model":"sim-llama-8b","max_tokens":4}"#,
        br#"{"messages":[{"content":"x"}]}"#,
    ] {
        let resp = raw("/v1/messages", body);
        assert_eq!(resp.status, 400, "{}", resp.text());
        let v = resp.json();
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    }
    for body in [
        &b"{"[..],
        br#"{"model":"sim-llama-8b"}"#,
        br#"{"input":{"a":1}}"#,
    ] {
        let resp = raw("/v1/responses", body);
        assert_eq!(resp.status, 400, "{}", resp.text());
        let v = resp.json();
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        assert_eq!(v["error"]["code"], 400, "{v}");
    }
    // An unknown model on the Messages API: Anthropic's not_found_error.
    let resp = post_json(
        r.addr,
        "/v1/messages",
        &json!({"model": "no-such-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .unwrap();
    assert_eq!(resp.status, 404, "{}", resp.text());
    assert_eq!(resp.json()["error"]["type"], "not_found_error");
    assert_eq!(
        request(r.addr, "GET", "/v1/messages", &[], b"")
            .unwrap()
            .status,
        405
    );
    // Nothing was harmed: both APIs still answer.
    let ok = post_json(
        r.addr,
        "/v1/messages",
        &json!({"model": MODEL, "max_tokens": 4, "system": "Be brief.", "messages": [{"role": "user", "content": "hi"}]}),
    )
    .unwrap();
    assert_eq!(ok.status, 200, "{}", ok.text());
    assert_eq!(ok.json()["type"], "message");
    let ok = post_json(r.addr, "/v1/responses", &turn("hi", None)).unwrap();
    assert_eq!(ok.status, 200, "{}", ok.text());
}

#[test]
fn the_same_conversation_finds_the_same_engine_on_every_api() {
    let fleet = engines(4);
    let r = Router::spawn(&urls(&fleet), &[], FAST_PROBES);
    r.wait_models_known();
    let system = "You are the support agent of a bicycle shop. ".repeat(30);
    let chat = json!({"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "My chain squeaks."}]});
    let first = post_json(r.addr, "/v1/chat/completions", &chat).unwrap();
    assert_eq!(first.status, 200);
    // The same prompt as messages and as a response: the engine that holds
    // it answers, with the prompt cached.
    let messages = json!({"model": MODEL, "max_tokens": 4, "system": system,
        "messages": [{"role": "user", "content": "My chain squeaks."}]});
    let m = post_json(r.addr, "/v1/messages", &messages).unwrap();
    assert_eq!(m.status, 200, "{}", m.text());
    let usage = &m.json()["usage"];
    assert!(
        usage["cache_read_input_tokens"].as_u64().unwrap()
            > usage["input_tokens"].as_u64().unwrap(),
        "{usage}"
    );
    let responses = json!({"model": MODEL, "max_output_tokens": 4, "instructions": system,
        "input": "My chain squeaks."});
    let resp = post_json(r.addr, "/v1/responses", &responses).unwrap();
    assert_eq!(resp.status, 200, "{}", resp.text());
    let usage = &resp.json()["usage"];
    let cached = usage["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached * 2 > usage["input_tokens"].as_u64().unwrap(),
        "{usage}"
    );
}

#[test]
fn replicas_share_stored_ids_so_any_replica_continues_a_chain() {
    let fleet = engines(3);
    let u = urls(&fleet);
    let (pa, pb) = (
        crate::router_replicas::port_pair(),
        crate::router_replicas::port_pair(),
    );
    let toml = |me: u16| {
        format!(
            "{FAST_PROBES}{}",
            crate::router_replicas::replicas_toml(me, &[pa, pb], "api-test-shared-key")
        )
    };
    let a = Router::spawn(&u, &[], &toml(pa));
    let b = Router::spawn(&u, &[], &toml(pb));
    for x in [&a, &b] {
        x.wait_models_known();
        let deadline = Instant::now() + Duration::from_secs(15);
        while request(x.admin, "GET", "/ready", &[], b"").map_or(0, |r| r.status) != 200 {
            assert!(Instant::now() < deadline, "a replica never became ready");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    // Turns alternate between the replicas; each id reaches the other
    // replica within a moment, so allow the stream that moment per turn.
    let mut ids: Vec<String> = Vec::new();
    for t in 0..6 {
        let via = if t % 2 == 0 { &a } else { &b };
        let body = turn(&format!("shared: step {t}"), ids.last().map(String::as_str));
        let deadline = Instant::now() + Duration::from_secs(5);
        let resp = loop {
            let resp = post_json(via.addr, "/v1/responses", &body).unwrap();
            if resp.status != 404 || Instant::now() > deadline {
                break resp;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(resp.status, 200, "turn {t}: {}", resp.text());
        ids.push(resp.json()["id"].as_str().unwrap().to_owned());
    }
    let where_: BTreeSet<Vec<usize>> = ids.iter().map(|id| holders(&fleet, id)).collect();
    assert_eq!(where_.len(), 1, "{where_:?}");
}

#[test]
fn a_chains_later_turns_teach_the_closed_loop_nothing() {
    // The engine's prompt for a continued response is the stored
    // conversation too, which the router never saw: its usage would read
    // as evictions of what the router predicted.
    let fleet = engines(1);
    let r = Router::spawn(&urls(&fleet), &[], FAST_PROBES);
    r.wait_models_known();
    chain(&[r.addr], 6, "quiet");
    let b = r.backend(&fleet[0].url());
    assert_eq!(b["requests"], 6, "{b}");
    assert_eq!(b["prediction"]["reports"], 1, "only the first turn: {b}");
}
