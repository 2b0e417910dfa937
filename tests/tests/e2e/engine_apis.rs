//! Anthropic's Messages and OpenAI's Responses APIs on the sim-engine, as
//! their users see them: through the official Python SDKs
//! (`tests/sdk/*.py`, via `testkit::sdk`), and on the wire where a router
//! reads them (ids, named events, usage, error bodies).

use serde_json::{Value, json};
use std::time::{Duration, Instant};
use testkit::engine_proc::SimEngine;
use testkit::http::{post_json, request};
use testkit::sdk::{self, Script};

const MODEL: &str = "sim-llama-8b";
/// The engine's block size: cache hits come in whole blocks.
const BLOCK: u64 = 16;

/// An engine whose simulated time runs 20 times faster: a call of a few
/// tokens takes milliseconds, and a 2,000-token background response still
/// runs for over a second, long enough to be cancelled while it runs.
fn engine() -> SimEngine {
    SimEngine::spawn(&["--time-scale", "0.05"])
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

#[test]
fn every_messages_call_of_the_anthropic_sdk_succeeds() {
    let Some(py) = sdk::require("every_messages_call_of_the_anthropic_sdk_succeeds") else {
        return;
    };
    let e = engine();
    let run = sdk::run(&py, Script::Anthropic, &e.url(), MODEL, &[]);
    run.assert_success();

    let create = run.call("messages.create");
    assert_eq!(
        (&create["type"], &create["role"], &create["model"]),
        (&json!("message"), &json!("assistant"), &json!(MODEL))
    );
    assert_eq!(create["stop_reason"], "max_tokens");
    assert_eq!(create["text"].as_str().unwrap().len(), 32, "8 tokens");
    assert_eq!(create["usage"]["output_tokens"], 8);
    assert_eq!(create["usage"]["cache_creation_input_tokens"], 0);

    let stream = run.call("messages.stream");
    assert_eq!(stream["text"], stream["final_text"]);
    assert_eq!(stream["text"].as_str().unwrap().len(), 32);
    let raw = run.call("messages.create_stream");
    let events: Vec<&str> = raw["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap())
        .collect();
    assert_eq!(events.first(), Some(&"message_start"));
    assert_eq!(events.last(), Some(&"message_stop"));
    assert_eq!(
        events
            .iter()
            .filter(|e| **e == "content_block_delta")
            .count(),
        6
    );
    assert_eq!(raw["text"].as_str().unwrap().len(), 24);

    // The tool's result goes back after the same system prompt and tools:
    // the second call reads them from the cache.
    let tools = run.call("messages.tools");
    assert!(
        u(&tools["usages"][1]["cache_read_input_tokens"]) >= 160,
        "{tools}"
    );

    // Each turn of a chat finds the one before it in the cache.
    let turns = run.call("messages.multi_turn")["turns"].as_array().unwrap();
    for pair in turns.windows(2) {
        let (before, after) = (&pair[0]["usage"], &pair[1]["usage"]);
        let prompt_before = u(&before["input_tokens"]) + u(&before["cache_read_input_tokens"]);
        assert!(
            u(&after["cache_read_input_tokens"]) + BLOCK > prompt_before,
            "a turn re-read less than the turn before it: {turns:?}"
        );
    }
    assert_eq!(
        run.call("messages.unknown_model")["error_type"],
        "not_found_error"
    );
}

#[test]
fn every_responses_call_of_the_openai_sdk_succeeds() {
    let Some(py) = sdk::require("every_responses_call_of_the_openai_sdk_succeeds") else {
        return;
    };
    let e = engine();
    let run = sdk::run(&py, Script::OpenAiResponses, &e.url(), MODEL, &[]);
    run.assert_success();

    let create = run.call("responses.create");
    let id = create["id"].as_str().unwrap();
    assert!(id.starts_with("resp_"), "{create}");
    assert_eq!(
        (&create["object"], &create["store"]),
        (&json!("response"), &json!(true))
    );
    assert_eq!(create["status"], "incomplete", "cut by max_output_tokens");
    assert_eq!(create["text"].as_str().unwrap().len(), 32);
    assert_eq!(
        u(&create["usage"]["total_tokens"]),
        u(&create["usage"]["input_tokens"]) + 8
    );

    // The stream's first event names the response it becomes.
    let stream = run.call("responses.stream");
    assert_eq!(stream["created_id"], stream["id"]);
    assert_eq!(stream["streamed_text"], stream["text"]);
    let seq: Vec<u64> = stream["sequence_numbers"]
        .as_array()
        .unwrap()
        .iter()
        .map(u)
        .collect();
    assert_eq!(seq, (0..seq.len() as u64).collect::<Vec<_>>());
    let raw = run.call("responses.create_stream");
    assert_eq!(raw["created_id"], raw["id"]);
    assert_eq!(raw["events"][0], "response.created");
    assert_eq!(
        raw["events"].as_array().unwrap().last().unwrap(),
        "response.completed"
    );

    // A chain by previous_response_id: each turn finds the whole previous
    // turn (prompt and answer) in the cache.
    let turns = run.call("responses.chain")["turns"].as_array().unwrap();
    assert_eq!(turns.len(), 4);
    for pair in turns.windows(2) {
        let (before, after) = (&pair[0], &pair[1]);
        assert_eq!(after["previous_response_id"], before["id"]);
        let seen = u(&before["usage"]["input_tokens"]) + u(&before["usage"]["output_tokens"]);
        assert!(
            u(&after["usage"]["cached_tokens"]) + BLOCK > seen,
            "a turn re-read less than the turn before it: {turns:?}"
        );
    }

    assert_eq!(run.call("responses.tools")["tools"], json!(["get_weather"]));
    let retrieved = run.call("responses.retrieve");
    assert_eq!(retrieved["id"], id);
    assert_eq!(retrieved["same_text"], true);
    let cancel = run.call("responses.cancel");
    assert_eq!(
        (
            &cancel["created_status"],
            &cancel["cancelled_status"],
            &cancel["retrieved_status"]
        ),
        (&json!("queued"), &json!("cancelled"), &json!("cancelled"))
    );
    assert_eq!(cancel["cancel_finished_status"], 400);
    let items = run.call("responses.input_items")["items"]
        .as_array()
        .unwrap();
    assert_eq!(items.len(), 1);
    assert_eq!(
        (&items[0]["type"], &items[0]["role"]),
        (&json!("message"), &json!("user"))
    );
    assert_eq!(
        run.call("responses.not_found")["statuses"],
        json!([404, 404])
    );
}

/// The same conversation as a chat completion, a Messages request and a
/// Responses request: the same prompt, and each later one finds the
/// first one's blocks in the cache.
#[test]
fn the_same_conversation_is_the_same_prompt_on_every_api() {
    same_prompt_on_every_api(&SimEngine::spawn(&["--time-scale", "0"]));
}

/// [`the_same_conversation_is_the_same_prompt_on_every_api`] on an engine
/// rendering with a model's own tokenizer and chat template.
#[test]
fn with_a_models_own_template_too() {
    let dir = std::env::temp_dir().join(format!("prefix-router-apis-tok-{}", std::process::id()));
    testkit::tokenizer_fixture::write(&dir).expect("fixture tokenizer");
    let dir_arg = dir.to_str().unwrap();
    same_prompt_on_every_api(&SimEngine::spawn(&[
        "--time-scale",
        "0",
        "--tokenizer-dir",
        dir_arg,
    ]));
    let _ = std::fs::remove_dir_all(&dir);
}

fn same_prompt_on_every_api(e: &SimEngine) {
    let system = "You answer questions about trains in Europe, briefly. ".repeat(4);
    let chat = post_json(
        e.addr,
        "/v1/chat/completions",
        &json!({"model": MODEL, "max_tokens": 4, "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Is there a night train to Vienna?"}]}),
    )
    .unwrap()
    .json();
    let prompt = u(&chat["usage"]["prompt_tokens"]);
    assert_eq!(chat["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let whole_blocks = (prompt - 1) / BLOCK * BLOCK;

    let m = post_json(
        e.addr,
        "/v1/messages",
        &json!({"model": MODEL, "max_tokens": 4, "system": [{"type": "text", "text": system}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Is there a night train to Vienna?"}]}]}),
    )
    .unwrap();
    assert_eq!(m.status, 200);
    let m = m.json();
    assert_eq!(
        u(&m["usage"]["input_tokens"]) + u(&m["usage"]["cache_read_input_tokens"]),
        prompt
    );
    assert_eq!(u(&m["usage"]["cache_read_input_tokens"]), whole_blocks);

    let r = post_json(
        e.addr,
        "/v1/responses",
        &json!({"model": MODEL, "max_output_tokens": 4, "instructions": system,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "Is there a night train to Vienna?"}]}]}),
    )
    .unwrap()
    .json();
    assert_eq!(u(&r["usage"]["input_tokens"]), prompt);
    assert_eq!(
        u(&r["usage"]["input_tokens_details"]["cached_tokens"]),
        whole_blocks
    );
    // The same words make the same answer on every API.
    assert_eq!(
        m["content"][0]["text"],
        chat["choices"][0]["message"]["content"]
    );
    assert_eq!(
        r["output"][0]["content"][0]["text"],
        chat["choices"][0]["message"]["content"]
    );
}

/// What a router reads on the wire: the response id first in a Responses
/// body and in the first event of its stream, Anthropic's named events
/// (`ping` included), the error bodies.
#[test]
fn ids_events_and_errors_on_the_wire() {
    let e = SimEngine::spawn(&["--time-scale", "0"]);
    let body = json!({"model": MODEL, "input": "hi", "max_output_tokens": 3});
    let r = post_json(e.addr, "/v1/responses", &body).unwrap();
    assert_eq!(r.header("content-type"), Some("application/json"));
    let text = r.text();
    assert!(text.starts_with(r#"{"id":"resp_"#), "{text}");
    let id = r.json()["id"].as_str().unwrap().to_string();

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["previous_response_id"] = json!(id);
    let s = post_json(e.addr, "/v1/responses", &streamed).unwrap();
    assert!(
        s.header("content-type")
            .unwrap()
            .starts_with("text/event-stream")
    );
    let events = s.sse_events();
    assert_eq!(events[0].0, "response.created");
    let created: Value = serde_json::from_str(&events[0].1).unwrap();
    let completed: Value = serde_json::from_str(&events.last().unwrap().1).unwrap();
    assert_eq!(completed["type"], "response.completed");
    assert_eq!(created["response"]["id"], completed["response"]["id"]);
    assert_eq!(created["response"]["previous_response_id"], id.as_str());
    let second = completed["response"]["id"].as_str().unwrap();
    let got = request(e.addr, "GET", &format!("/v1/responses/{second}"), &[], b"").unwrap();
    assert_eq!((got.status, &got.json()), (200, &completed["response"]));

    // Unknown ids: 404 in OpenAI's shape, on every path that takes one.
    let want = json!({"error": {"message": "Response with id 'resp_gone' not found.",
        "type": "invalid_request_error", "param": "response_id", "code": 404}});
    for (method, path, body) in [
        ("GET", "/v1/responses/resp_gone", Vec::new()),
        ("POST", "/v1/responses/resp_gone/cancel", Vec::new()),
        ("GET", "/v1/responses/resp_gone/input_items", Vec::new()),
        (
            "POST",
            "/v1/responses",
            json!({"input": "hi", "previous_response_id": "resp_gone"})
                .to_string()
                .into_bytes(),
        ),
    ] {
        let r = request(e.addr, method, path, &[], &body).unwrap();
        assert_eq!((r.status, r.json()), (404, want.clone()), "{method} {path}");
    }
    let del = request(e.addr, "DELETE", &format!("/v1/responses/{id}"), &[], b"").unwrap();
    assert_eq!(del.status, 405, "vLLM serves no DELETE");

    // Messages: named events, ping after message_start.
    let m = post_json(
        e.addr,
        "/v1/messages",
        &json!({"model": MODEL, "max_tokens": 2, "stream": true,
            "messages": [{"role": "user", "content": "hi"}]}),
    )
    .unwrap();
    let names: Vec<String> = m.sse_events().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "ping",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    let bad = post_json(
        e.addr,
        "/v1/messages",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .unwrap();
    assert_eq!(bad.status, 400);
    assert_eq!(bad.json()["type"], "error");
    assert_eq!(bad.json()["error"]["type"], "invalid_request_error");
}

#[test]
fn a_background_response_runs_after_its_answer_and_is_retrieved_done() {
    let e = engine();
    let r = post_json(
        e.addr,
        "/v1/responses",
        &json!({"model": MODEL, "input": "hi", "background": true, "max_output_tokens": 40}),
    )
    .unwrap()
    .json();
    assert_eq!(
        (&r["status"], &r["background"]),
        (&json!("queued"), &json!(true))
    );
    assert_eq!(r["output"], json!([]));
    let id = r["id"].as_str().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let done = loop {
        let got = request(e.addr, "GET", &format!("/v1/responses/{id}"), &[], b"")
            .unwrap()
            .json();
        if got["status"] != "queued" {
            break got;
        }
        assert!(Instant::now() < deadline, "still queued: {got}");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(done["status"], "incomplete");
    assert_eq!(done["usage"]["output_tokens"], 40);
    assert_eq!(
        done["output"][0]["content"][0]["text"]
            .as_str()
            .unwrap()
            .len(),
        160
    );
    let cancel = request(
        e.addr,
        "POST",
        &format!("/v1/responses/{id}/cancel"),
        &[],
        b"",
    )
    .unwrap();
    assert_eq!(
        cancel.status, 400,
        "a finished response cannot be cancelled"
    );
    let store_false = post_json(
        e.addr,
        "/v1/responses",
        &json!({"input": "hi", "background": true, "store": false}),
    )
    .unwrap();
    assert_eq!(store_false.status, 400);
}
