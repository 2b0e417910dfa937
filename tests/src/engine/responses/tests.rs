use super::*;
use crate::engine::api::{Responder, parse as parse_openai};
use std::sync::Arc;

fn models() -> Vec<String> {
    vec!["m".to_string()]
}

fn chat_tokens(body: Value) -> Vec<u32> {
    parse_openai(ApiKind::Chat, body.to_string().as_bytes(), &models(), 8)
        .unwrap()
        .tokens
}

fn request(store: &Store, body: Value) -> Result<(Job, Ctx), ApiError> {
    parse(body.to_string().as_bytes(), &models(), 8, store)
}

/// Runs a parsed request as the server does when it finishes: its answer
/// (the generated text of `max_tokens` tokens) is stored.
fn finish(store: &Store, job: &Job, ctx: Ctx) -> (Arc<Ctx>, Outcome) {
    let digest = 11 + job.tokens.len() as u64;
    let outcome = Outcome::finished(digest, job.tokens.len(), job.max_tokens, "0".into());
    let ctx = Arc::new(ctx);
    store.put(ctx.clone(), outcome.clone());
    (ctx, outcome)
}

fn json_of(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).unwrap()
}

#[test]
fn a_conversation_makes_the_same_tokens_as_chat_and_as_responses() {
    let store = Store::default();
    let chat = chat_tokens(json!({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi there"},
        {"role": "user", "content": "first\nsecond"},
    ]}));
    let (job, _) = request(&store, json!({"instructions": "be brief", "input": [
        {"role": "user", "content": "hello"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi there"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "first"},
            {"type": "input_text", "text": "second"}]},
    ]}))
    .unwrap();
    assert_eq!(job.tokens, chat);
    assert_eq!((job.kind, job.max_tokens), (ApiKind::Responses, 8));
    let one = chat_tokens(json!({"messages": [{"role": "user", "content": "hello"}]}));
    let (job, _) = request(&store, json!({"input": "hello", "max_output_tokens": 3})).unwrap();
    assert_eq!((job.tokens, job.max_tokens), (one, 3));
}

#[test]
fn function_calls_and_their_outputs_render_as_chat_tool_calls_and_tool_messages() {
    let store = Store::default();
    let schema = json!({"type": "object", "properties": {"city": {"type": "string"}}});
    let chat = chat_tokens(json!({
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": schema}}],
    "messages": [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]}));
    let (job, _) = request(&store, json!({
        "tools": [{"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": schema},
                  {"type": "web_search_preview"}],
        "input": [
            {"role": "user", "content": "weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ]}))
    .unwrap();
    assert_eq!(job.tokens, chat);
}

#[test]
fn previous_response_id_goes_on_from_the_stored_chat_and_its_output() {
    let store = Store::default();
    let (job1, ctx1) = request(
        &store,
        json!({"instructions": "be brief", "input": "hello", "max_output_tokens": 4}),
    )
    .unwrap();
    let (ctx1, out1) = finish(&store, &job1, ctx1);
    let text1 = out1.text.clone().unwrap();
    let (job2, ctx2) = request(
        &store,
        json!({"instructions": "be brief", "input": "more",
        "previous_response_id": ctx1.id, "max_output_tokens": 4}),
    )
    .unwrap();
    let want = chat_tokens(json!({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": text1},
        {"role": "user", "content": "more"},
    ]}));
    assert_eq!(job2.tokens, want);
    // The first turn's prompt and answer lead the second's prompt: its
    // blocks are the cache hits the second turn finds.
    let mut seq = job1.tokens.clone();
    seq.extend(crate::engine::tokenize::tokenize(&text1));
    assert_eq!(&job2.tokens[..seq.len()], &seq[..]);
    // A third turn chains through both; instructions do not carry over.
    let (ctx2, out2) = finish(&store, &job2, ctx2);
    let (job3, _) = request(
        &store,
        json!({"input": "last", "previous_response_id": ctx2.id}),
    )
    .unwrap();
    let want = chat_tokens(json!({"messages": [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": text1},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": out2.text.unwrap()},
        {"role": "user", "content": "last"},
    ]}));
    assert_eq!(job3.tokens, want);
}

#[test]
fn prompt_cache_key_salts_the_cache_like_cache_salt() {
    let store = Store::default();
    let (job, _) = request(
        &store,
        json!({"input": "hi", "prompt_cache_key": "tenant-a"}),
    )
    .unwrap();
    assert_eq!(job.cache_salt.as_deref(), Some("tenant-a"));
    let (job, _) = request(
        &store,
        json!({"input": "hi", "prompt_cache_key": "a", "cache_salt": "b"}),
    )
    .unwrap();
    assert_eq!(job.cache_salt.as_deref(), Some("b"));
}

#[test]
fn unknown_ids_are_404_in_openais_shape() {
    let store = Store::default();
    let e = request(
        &store,
        json!({"input": "hi", "previous_response_id": "resp_nope"}),
    )
    .unwrap_err();
    assert_eq!(e.status, 404);
    let want = json!({"error": {"message": "Response with id 'resp_nope' not found.",
        "type": "invalid_request_error", "param": "response_id", "code": 404}});
    assert_eq!(json_of(&e.body()), want);
    for e in [
        store.retrieve("resp_nope").unwrap_err(),
        store.cancel("resp_nope").unwrap_err(),
        store.input_items("resp_nope", "").unwrap_err(),
    ] {
        assert_eq!(json_of(&e.body()), want);
    }
    // Not stored: not found later either.
    let (job, ctx) = request(&store, json!({"input": "hi", "store": false})).unwrap();
    assert!(!ctx.store);
    drop(job);
    assert_eq!(store.retrieve(&ctx.id).unwrap_err().status, 404);
}

#[test]
fn requests_that_vllm_refuses_are_400() {
    let store = Store::default();
    for (body, param) in [
        (
            json!({"input": "hi", "background": true, "store": false}),
            "background",
        ),
        (json!({"input": 5}), "input"),
    ] {
        let e = request(&store, body).unwrap_err();
        assert_eq!((e.status, e.param), (400, Some(param)));
    }
    assert_eq!(
        parse(b"{nope", &models(), 8, &store).unwrap_err().status,
        400
    );
    let e = request(&store, json!({"model": "other", "input": "hi"})).unwrap_err();
    assert_eq!(e.status, 404);
}

#[test]
fn retrieve_cancel_and_input_items_answer_as_vllm_and_openai() {
    let store = Store::default();
    let (job, ctx) = request(&store, json!({"input": "hello", "metadata": {"k": "v"}})).unwrap();
    let (ctx, out) = finish(&store, &job, ctx);
    let got = json_of(&store.retrieve(&ctx.id).unwrap());
    assert_eq!(got["id"], ctx.id.as_str());
    assert_eq!(got["object"], "response");
    assert_eq!(got["status"], "incomplete");
    assert_eq!(got["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(got["metadata"], json!({"k": "v"}));
    assert_eq!(got["store"], true);
    assert_eq!(
        got["output"][0]["content"][0]["text"],
        out.text.unwrap().as_str()
    );
    // A finished response cannot be cancelled.
    let e = store.cancel(&ctx.id).unwrap_err();
    assert_eq!((e.status, e.kind), (400, "invalid_request_error"));
    assert_eq!(e.message, "Cannot cancel a synchronous response.");
    // A queued one can, and stays cancelled when its run ends after.
    let (job, queued) = request(&store, json!({"input": "slow", "background": true})).unwrap();
    let queued = Arc::new(queued);
    store.put(queued.clone(), Outcome::queued());
    assert_eq!(
        json_of(&store.retrieve(&queued.id).unwrap())["status"],
        "queued"
    );
    let cancelled = json_of(&store.cancel(&queued.id).unwrap());
    assert_eq!(
        (&cancelled["status"], &cancelled["background"]),
        (&json!("cancelled"), &json!(true))
    );
    store.put(
        queued.clone(),
        Outcome::finished(1, job.tokens.len(), 8, "0".into()),
    );
    assert_eq!(
        json_of(&store.retrieve(&queued.id).unwrap())["status"],
        "cancelled"
    );
    // Input items: a list, newest first unless asked.
    let (job, ctx) = request(
        &store,
        json!({"input": [
            {"role": "user", "content": "one"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "two"}]},
        ]}),
    )
    .unwrap();
    let (ctx, _) = finish(&store, &job, ctx);
    let page = json_of(&store.input_items(&ctx.id, "").unwrap());
    assert_eq!(page["object"], "list");
    assert_eq!(page["has_more"], false);
    let data = page["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    assert_eq!(data[0]["content"][0]["text"], "two");
    assert_eq!(data[1]["type"], "message");
    assert!(data[1]["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(page["first_id"], data[0]["id"]);
    let asc = json_of(&store.input_items(&ctx.id, "order=asc&limit=1").unwrap());
    assert_eq!(asc["data"][0]["content"], "one");
    assert_eq!(asc["has_more"], true);
}

#[test]
fn the_store_forgets_the_oldest_past_its_capacity() {
    let store = Store::default();
    let mut ids = Vec::new();
    for _ in 0..=STORE_CAPACITY {
        let (job, ctx) = request(&store, json!({"input": "x", "max_output_tokens": 1})).unwrap();
        ids.push(finish(&store, &job, ctx).0.id.clone());
    }
    assert_eq!(store.retrieve(&ids[0]).unwrap_err().status, 404);
    assert!(store.retrieve(&ids[1]).is_ok());
    assert!(store.retrieve(ids.last().unwrap()).is_ok());
}

fn responder(ctx: &Arc<Ctx>) -> Responder<'_> {
    Responder {
        kind: ApiKind::Responses,
        id: 3,
        created: 1,
        model_json: "\"m\"",
        digest: 42,
        prompt_tokens: 100,
        max_tokens: 3,
        bad_cached: None,
        ctx: Some(ctx),
    }
}

#[test]
fn the_body_leads_with_the_id_and_reports_cached_tokens() {
    let store = Store::default();
    let (_, ctx) = request(&store, json!({"input": "hi", "instructions": "be brief"})).unwrap();
    let ctx = Arc::new(ctx);
    let r = responder(&ctx);
    let bytes = r.full_body(48);
    assert!(bytes.starts_with(format!(r#"{{"id":"{}","#, ctx.id).as_bytes()));
    assert!(ctx.id.starts_with("resp_") && ctx.id.len() == 37);
    let body = json_of(&bytes);
    assert_eq!(body["object"], "response");
    assert_eq!(body["model"], "m");
    assert_eq!(body["instructions"], "be brief");
    assert_eq!(body["previous_response_id"], Value::Null);
    assert_eq!(body["max_output_tokens"], 8);
    assert_eq!(
        body["usage"],
        json!({"input_tokens": 100, "input_tokens_details": {"cached_tokens": 48},
            "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 103})
    );
    let item = &body["output"][0];
    assert_eq!(
        (&item["type"], &item["role"], &item["id"]),
        (&json!("message"), &json!("assistant"), &json!(ctx.item_id))
    );
    assert_eq!(item["content"][0]["type"], "output_text");
    assert_eq!(item["content"][0]["text"].as_str().unwrap().len(), 12);
}

#[test]
fn the_stream_names_each_event_and_numbers_them_from_zero() {
    let store = Store::default();
    let (_, ctx) = request(&store, json!({"input": "hi"})).unwrap();
    let ctx = Arc::new(ctx);
    let r = responder(&ctx);
    let mut events = Vec::new();
    r.token_events(&mut events, 0, 1, 48);
    r.token_events(&mut events, 1, 3, 48);
    r.final_events(&mut events, false, 48);
    let mut names = Vec::new();
    let mut text = String::new();
    for (seq, e) in events.iter().enumerate() {
        let e = std::str::from_utf8(e).unwrap();
        let (head, data) = e.split_once('\n').unwrap();
        let name = head.strip_prefix("event: ").unwrap();
        let data = json_of(data.strip_prefix("data: ").unwrap().trim_end().as_bytes());
        assert_eq!(data["type"], name);
        assert_eq!(data["sequence_number"], seq);
        if name == "response.output_text.delta" {
            text.push_str(data["delta"].as_str().unwrap());
        }
        if name == "response.created" {
            assert_eq!(data["response"]["id"], ctx.id.as_str());
            assert_eq!(data["response"]["status"], "in_progress");
        }
        if name == "response.completed" {
            assert_eq!(data["response"], json_of(&r.full_body(48)));
        }
        names.push(name.to_string());
    }
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed"
        ]
    );
    assert_eq!(
        text,
        json_of(&r.full_body(48))["output"][0]["content"][0]["text"]
    );
}
