//! `classes.engine_priority` through real processes: the router gives each
//! request its class's `priority` in the body it forwards, so an engine
//! scheduling by priority (`--scheduling-policy priority`, as vLLM's) runs
//! the people waiting ahead of batch work queued before them; a client's
//! own `priority` stands; the field reaches the engine in every body shape
//! (an engine that does not schedule by priority refuses it by name, as
//! vLLM does, which shows it arrived).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use testkit::engine_proc::SimEngine;
use testkit::http::{Response, post_json, request};
use testkit::router_proc::{Router, raw_exchange};

const ON: &str = "[classes]\nengine_priority = { priority = -1, default = 0, flex = 1 }\n";

fn chat(tier: Option<&str>, tokens: u32, text: &str) -> Value {
    let mut b = json!({"max_tokens": tokens, "messages": [{"role": "user", "content": text}]});
    if let Some(t) = tier {
        b["service_tier"] = json!(t);
    }
    b
}

/// A gauge of the engine's `/metrics`.
fn gauge(e: &SimEngine, name: &str) -> f64 {
    let text = request(e.addr, "GET", "/metrics", &[], b"")
        .map(|r| r.text())
        .unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

fn wait_for(e: &SimEngine, name: &str, at_least: f64) {
    let until = Instant::now() + Duration::from_secs(10);
    while gauge(e, name) < at_least {
        assert!(Instant::now() < until, "{name} never reached {at_least}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// When an answer came, to which request, and the answer.
type Answered = (Instant, &'static str, Response);

/// An engine of one seat busy with a long batch request sent through the
/// router, then `queued` (a label and a body each) sent one after the
/// other, each once the engine counts it waiting. Returns the labels in
/// the order their answers came, and the answers.
fn order_behind_one_seat(config: &str, queued: Vec<(&'static str, Value)>) -> Vec<&'static str> {
    // Steps of 3 ms: the 80-token request holds the seat about 240 ms.
    let engine = SimEngine::spawn(&[
        "--time-scale",
        "0.2",
        "--max-num-seqs",
        "1",
        "--scheduling-policy",
        "priority",
    ]);
    let r = Router::spawn(&[engine.url()], &[], config);
    let addr = r.addr;
    let done: Arc<Mutex<Vec<Answered>>> = Arc::default();
    let send = |label: &'static str, body: Value| {
        let done = done.clone();
        std::thread::spawn(move || {
            let resp = post_json(addr, "/v1/chat/completions", &body).expect("request");
            done.lock().unwrap().push((Instant::now(), label, resp));
        })
    };
    let mut threads = vec![send("holder", chat(Some("flex"), 80, "the seat"))];
    wait_for(&engine, "vllm:num_requests_running", 1.0);
    for (i, (label, body)) in queued.into_iter().enumerate() {
        threads.push(send(label, body));
        wait_for(&engine, "vllm:num_requests_waiting", (i + 1) as f64);
    }
    for t in threads {
        t.join().expect("request thread");
    }
    let mut done = std::mem::take(&mut *done.lock().unwrap());
    done.sort_by_key(|d| d.0);
    for (_, label, resp) in &done {
        assert_eq!(resp.status, 200, "{label}: {}", resp.text());
    }
    done.into_iter().map(|d| d.1).collect()
}

#[test]
fn a_person_overtakes_batch_work_queued_on_the_engine_before_them() {
    // With one seat the engine answers in the order it admits, so the
    // answers' order is the order of first tokens.
    let queued = vec![
        ("flex", chat(Some("flex"), 4, "batch a")),
        ("flex", chat(Some("flex"), 4, "batch b")),
        ("flex", chat(Some("flex"), 4, "batch c")),
        ("chat", chat(None, 4, "a person waits")),
        ("priority", chat(Some("priority"), 4, "an operator waits")),
    ];
    let order = order_behind_one_seat(ON, queued);
    assert_eq!(
        order,
        ["holder", "priority", "chat", "flex", "flex", "flex"],
        "the people waiting went first, the most urgent first"
    );
}

#[test]
fn a_client_s_own_priority_stands() {
    // A flex request that says `priority: -5` itself keeps it (the engine
    // would refuse a second `priority` key), so it runs ahead of a
    // `priority` request given -1 by the router.
    let mut own = chat(Some("flex"), 4, "mine is urgent");
    own["priority"] = json!(-5);
    let queued = vec![
        ("flex", chat(Some("flex"), 4, "batch")),
        ("priority", chat(Some("priority"), 4, "an operator waits")),
        ("own", own),
    ];
    let order = order_behind_one_seat(ON, queued);
    assert_eq!(order, ["holder", "own", "priority", "flex"]);
}

/// The engine's refusal of a priority it does not schedule by: proof the
/// field reached it, in a body it could read.
fn refused_for_priority(resp: &Response) -> bool {
    resp.status == 400
        && resp
            .text()
            .contains("Got priority 1 but Priority scheduling is not enabled")
}

#[test]
fn the_field_reaches_the_engine_in_every_body_shape() {
    let fcfs = SimEngine::spawn(&["--time-scale", "0"]);
    let r = Router::spawn(&[fcfs.url()], &[], ON);
    let big = "tell me more about the weather in spring. ".repeat(1000);
    assert!(big.len() > 32 * 1024);
    let mut completion = json!({"prompt": big, "max_tokens": 2, "service_tier": "flex"});
    let messages = json!({"model": "sim-llama-8b", "max_tokens": 2, "service_tier": "flex",
        "messages": [{"role": "user", "content": "hi"}]});
    let responses = json!({"input": big, "max_output_tokens": 2, "service_tier": "flex"});
    for (path, body) in [
        ("/v1/completions", serde_json::to_vec(&completion).unwrap()),
        ("/v1/messages", serde_json::to_vec(&messages).unwrap()),
        ("/v1/responses", serde_json::to_vec(&responses).unwrap()),
        // Whitespace around the brace, small and large.
        (
            "/v1/chat/completions",
            b" \r\n{\n  \"service_tier\": \"flex\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]\n}\n"
                .to_vec(),
        ),
        (
            "/v1/completions",
            format!("\n\t{{ \"service_tier\":\"flex\",\"prompt\":\"{big}\" }}").into_bytes(),
        ),
    ] {
        let resp = request(r.addr, "POST", path, &[("content-type", "application/json")], &body)
            .expect("request");
        assert!(refused_for_priority(&resp), "{path}: {} {}", resp.status, resp.text());
    }
    // A chunked body (decoded by the router before it is forwarded).
    let body = serde_json::to_vec(&completion).unwrap();
    let mut raw = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
    for part in body.chunks(7000) {
        raw.extend_from_slice(format!("{:x}\r\n", part.len()).as_bytes());
        raw.extend_from_slice(part);
        raw.extend_from_slice(b"\r\n");
    }
    raw.extend_from_slice(b"0\r\n\r\n");
    let answer = raw_exchange(r.addr, &raw, Duration::from_secs(10)).expect("chunked request");
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("HTTP/1.1 400") && answer.contains("Got priority 1"),
        "{answer}"
    );
    // A class whose value is 0 is sent unchanged: the same engine answers.
    completion["service_tier"] = json!("default");
    let resp = post_json(r.addr, "/v1/completions", &completion).expect("request");
    assert_eq!(resp.status, 200, "{}", resp.text());
    // And an engine that schedules by priority takes the large flex body.
    let by_priority = SimEngine::spawn(&["--time-scale", "0", "--scheduling-policy", "priority"]);
    let r = Router::spawn(&[by_priority.url()], &[], ON);
    completion["service_tier"] = json!("flex");
    let resp = post_json(r.addr, "/v1/completions", &completion).expect("request");
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert!(resp.json()["usage"]["prompt_tokens"].as_u64().unwrap() > 8000);
}

#[test]
fn off_by_default_the_body_goes_as_it_came() {
    let fcfs = SimEngine::spawn(&["--time-scale", "0"]);
    let r = Router::spawn(&[fcfs.url()], &[], "");
    let resp = post_json(r.addr, "/v1/chat/completions", &chat(Some("flex"), 2, "hi")).unwrap();
    assert_eq!(resp.status, 200, "{}", resp.text());
}
