use super::*;
use crate::engine::api::{ApiKind, parse as parse_openai};
use crate::engine::responses::{self, Store};
use prefix_router::prompt::extract::Endpoint;
use prefix_router::prompt::hash::{DEFAULT_BLOCK_BYTES, block_hashes_pieces};
use prefix_router::prompt::scan::{Canonical, scan};
use serde_json::{Value, json};
use std::sync::Arc;

fn msg(role: &'static str, content: &str) -> Msg {
    Msg {
        role,
        content: Arc::from(content),
    }
}

/// A conversation of two turns and the second question.
fn chat() -> Vec<Msg> {
    vec![
        msg("system", "You are assistant #0. Follow \"these\" rules.\n"),
        msg("user", "first question"),
        msg("assistant", "an answer\twith a tab"),
        msg("user", "second question"),
    ]
}

/// An agent's: a task, an answer, a tool's result.
fn agent() -> Vec<Msg> {
    vec![
        msg("system", "You are an agent with toolset 0. Tools:\n"),
        msg("user", "Task: find it"),
        msg("assistant", "calling the tool"),
        msg("tool", "Tool result:\nfound"),
    ]
}

fn fields(stream: bool) -> Fields<'static> {
    Fields {
        model_json: "\"m\"",
        max_tokens: 8,
        session: 7,
        stream,
        service_tier: None,
        user: None,
    }
}

fn json_of(b: &[u8]) -> Value {
    serde_json::from_slice(b).expect("a body is JSON")
}

fn models() -> Vec<String> {
    vec!["m".to_string()]
}

/// The prompt tokens the simulated engine renders for `body` on `api`.
fn engine_tokens(api: Api, body: &[u8], store: &Store) -> Vec<u32> {
    match api {
        Api::Chat => {
            parse_openai(ApiKind::Chat, body, &models(), 1)
                .unwrap()
                .tokens
        }
        Api::Messages => {
            crate::engine::messages::parse(body, &models())
                .unwrap()
                .tokens
        }
        Api::Responses | Api::ResponsesChained => {
            responses::parse(body, &models(), 1, store)
                .unwrap()
                .0
                .tokens
        }
    }
}

#[test]
fn a_tenant_is_every_request_s_user() {
    let c = chat();
    let f = Fields {
        user: Some("tenant-small"),
        ..fields(true)
    };
    let v = json_of(&Api::Chat.body(&f, &c, None));
    assert_eq!(v["user"], "tenant-small");
    let v = json_of(&Api::Messages.body(&f, &c, None));
    assert_eq!(v["metadata"]["user_id"], "tenant-small");
}

#[test]
fn each_api_s_body_has_its_fields() {
    let c = chat();
    let v = json_of(&Api::Chat.body(&fields(true), &c, Some("ignored")));
    assert_eq!(v["messages"].as_array().unwrap().len(), 4);
    assert_eq!(v["messages"][0]["role"], "system");
    assert_eq!(v["messages"][2]["content"], "an answer\twith a tab");
    assert_eq!(
        (v["max_tokens"].as_u64(), &v["user"]),
        (Some(8), &json!("session-7"))
    );
    assert_eq!(v["stream_options"]["include_usage"], true);

    let v = json_of(&Api::Messages.body(&fields(true), &c, None));
    assert_eq!(
        v["system"],
        "You are assistant #0. Follow \"these\" rules.\n"
    );
    let turns = v["messages"].as_array().unwrap();
    let roles: Vec<&str> = turns.iter().map(|t| t["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["user", "assistant", "user"]);
    assert_eq!(
        (v["max_tokens"].as_u64(), v["stream"].as_bool()),
        (Some(8), Some(true))
    );
    assert_eq!(v["metadata"]["user_id"], "session-7");
    assert!(v.get("stream_options").is_none());

    let v = json_of(&Api::Responses.body(&fields(false), &c, Some("resp_1")));
    assert_eq!(
        v["instructions"],
        "You are assistant #0. Follow \"these\" rules.\n"
    );
    assert_eq!(v["input"].as_array().unwrap().len(), 3);
    assert_eq!(
        v["input"][1],
        json!({"role": "assistant", "content": "an answer\twith a tab"})
    );
    assert_eq!(
        (v["max_output_tokens"].as_u64(), &v["store"]),
        (Some(8), &json!(false))
    );
    assert!(
        v.get("previous_response_id").is_none(),
        "only a chain names the last answer"
    );
    assert!(v.get("stream").is_none() && v.get("max_tokens").is_none());

    // A chain's first turn is the whole conversation, stored; a later one
    // only what follows the last answer, naming it.
    let first = json_of(&Api::ResponsesChained.body(&fields(false), &c[..2], None));
    assert_eq!(
        (first["input"].as_array().unwrap().len(), &first["store"]),
        (1, &json!(true))
    );
    assert!(first.get("previous_response_id").is_none());
    let later = json_of(&Api::ResponsesChained.body(&fields(true), &c, Some("resp_1")));
    assert_eq!(later["previous_response_id"], "resp_1");
    assert_eq!(
        later["input"],
        json!([{"role": "user", "content": "second question"}])
    );
    assert_eq!(
        later["instructions"], first["instructions"],
        "instructions do not carry over"
    );
    assert_eq!(
        (&later["store"], &later["stream"]),
        (&json!(true), &json!(true))
    );

    assert_eq!(
        Api::ALL.map(Api::path),
        [
            "/v1/chat/completions",
            "/v1/messages",
            "/v1/responses",
            "/v1/responses"
        ]
    );
}

#[test]
fn tool_results_go_as_each_api_s_tool_result() {
    let a = agent();
    let v = json_of(&Api::Messages.body(&fields(false), &a, None));
    assert_eq!(
        v["messages"][2],
        json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "call_2", "content": "Tool result:\nfound"}
        ]})
    );
    let v = json_of(&Api::Responses.body(&fields(false), &a, None));
    assert_eq!(
        v["input"][2],
        json!({"type": "function_call_output", "call_id": "call_2", "output": "Tool result:\nfound"})
    );
    let v = json_of(&Api::ResponsesChained.body(&fields(false), &a, Some("resp_1")));
    assert_eq!(v["input"].as_array().unwrap().len(), 1);
    assert_eq!(v["input"][0]["type"], "function_call_output");
}

#[test]
fn every_api_makes_the_chat_s_tokens_on_the_engine() {
    for conversation in [chat(), agent()] {
        let store = Store::default();
        let want = engine_tokens(
            Api::Chat,
            &Api::Chat.body(&fields(false), &conversation, None),
            &store,
        );
        for api in [Api::Messages, Api::Responses] {
            for stream in [false, true] {
                let body = api.body(&fields(stream), &conversation, None);
                assert_eq!(engine_tokens(api, &body, &store), want, "{api}");
            }
        }
    }
}

#[test]
fn a_chain_makes_the_whole_conversation_s_tokens_on_the_engine_that_stored_it() {
    let store = Store::default();
    let mut c = chat();
    c.truncate(2);
    // Turn 1, stored with the answer the engine generated.
    let body = Api::ResponsesChained.body(&fields(false), &c, None);
    let (job, ctx) = responses::parse(&body, &models(), 1, &store).unwrap();
    let outcome = responses::Outcome::finished(99, job.tokens.len(), job.max_tokens, "0".into());
    let answer = outcome.text.clone().unwrap();
    let id = ctx.id.clone();
    store.put(Arc::new(ctx), outcome);
    // Turn 2: the conversation with that answer and a new question.
    c.push(msg("assistant", &answer));
    c.push(msg("user", "second question"));
    let chained = Api::ResponsesChained.body(&fields(false), &c, Some(&id));
    let whole = Api::Chat.body(&fields(false), &c, None);
    assert_eq!(
        engine_tokens(Api::ResponsesChained, &chained, &store),
        engine_tokens(Api::Chat, &whole, &store)
    );
    // An engine that did not store it has nothing to go on from.
    let err = responses::parse(&chained, &models(), 1, &Store::default()).unwrap_err();
    assert_eq!(err.status, 404);
}

/// The router's block hashes of `body` sent to `path`.
fn router_blocks(path: &str, body: &[u8]) -> Vec<u64> {
    let endpoint = Endpoint::from_path("POST", path).expect("an inference path");
    let mut canon = Canonical::default();
    let p = scan(endpoint, body, &mut canon).expect("the router reads it");
    let (mut carry, mut out) = (Vec::new(), Vec::new());
    block_hashes_pieces(
        p.seed,
        canon.pieces(body),
        DEFAULT_BLOCK_BYTES,
        &mut carry,
        &mut out,
    );
    out
}

#[test]
fn the_router_reads_a_conversation_alike_on_every_api_that_carries_it_whole() {
    let mut c = chat();
    // Long enough for several of the router's blocks.
    c[0] = msg("system", &"Follow these rules. ".repeat(20));
    let chat_blocks = router_blocks(Api::Chat.path(), &Api::Chat.body(&fields(true), &c, None));
    assert!(chat_blocks.len() > 6, "{}", chat_blocks.len());
    for api in [Api::Messages, Api::Responses] {
        let blocks = router_blocks(api.path(), &api.body(&fields(true), &c, None));
        assert_eq!(blocks, chat_blocks, "{api}");
    }
    // A chain's later turn carries the system prompt and the new question
    // only: it shares the leading blocks and is pinned by its id.
    let later = Api::ResponsesChained.body(&fields(true), &c, Some("resp_1"));
    let blocks = router_blocks(Api::ResponsesChained.path(), &later);
    assert_eq!(blocks[0], chat_blocks[0]);
    assert_ne!(blocks, chat_blocks);
}
