use super::*;
use crate::engine::api::parse as parse_openai;

fn models() -> Vec<String> {
    vec!["m".to_string()]
}

fn chat_tokens(body: Value) -> Vec<u32> {
    parse_openai(ApiKind::Chat, body.to_string().as_bytes(), &models(), 8)
        .unwrap()
        .tokens
}

fn messages_job(body: Value) -> Job {
    parse(body.to_string().as_bytes(), &models()).unwrap()
}

fn messages_error(body: &[u8]) -> ApiError {
    parse(body, &models()).unwrap_err()
}

#[test]
fn a_conversation_makes_the_same_tokens_as_chat_and_as_messages() {
    let chat = chat_tokens(json!({"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi there"},
        {"role": "user", "content": "first\nsecond"},
    ]}));
    let plain = messages_job(
        json!({"model": "m", "max_tokens": 5, "system": "be brief", "messages": [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hi there"},
            {"role": "user", "content": "first\nsecond"},
        ]}),
    );
    assert_eq!(plain.tokens, chat);
    assert_eq!((plain.max_tokens, plain.kind), (5, ApiKind::Messages));
    // System blocks join with nothing, text blocks with a newline; the
    // billing header's per-request hash is left out.
    let blocks = messages_job(json!({"model": "m", "max_tokens": 5,
    "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1a2b;"},
               {"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hello"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "hi there"}]},
        {"role": "user", "content": [{"type": "text", "text": "first"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
            {"type": "text", "text": "second"}]},
    ]}));
    assert_eq!(blocks.tokens, chat);
}

#[test]
fn tool_use_and_tool_result_render_as_chat_tool_calls_and_tool_messages() {
    let schema = json!({"type": "object", "properties": {"city": {"type": "string"}}});
    let chat = chat_tokens(json!({"model": "m",
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": schema}}],
    "messages": [
        {"role": "system", "content": "use tools"},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [{"id": "toolu_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21C"},
        {"role": "user", "content": "thanks"},
    ]}));
    let messages = messages_job(json!({"model": "m", "max_tokens": 8, "system": "use tools",
    "tools": [{"name": "get_weather", "description": "Weather of a city", "input_schema": schema}],
    "messages": [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny, 21C"}]},
            {"type": "text", "text": "thanks"}]},
    ]}));
    assert_eq!(messages.tokens, chat);
    // The tools are in the prompt: without them it is shorter.
    let bare = messages_job(json!({"model": "m", "max_tokens": 8, "system": "use tools",
        "messages": [{"role": "user", "content": "weather in Paris?"}]}));
    assert!(bare.tokens.len() + 20 < messages.tokens.len());
}

#[test]
fn requests_that_vllm_refuses_are_refused_in_anthropics_shape() {
    let cases: [(&[u8], u16, &str); 6] = [
        (b"{nope", 400, "Invalid request body"),
        (
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
            400,
            "max_tokens",
        ),
        (
            br#"{"model":"m","max_tokens":0,"messages":[{"role":"user","content":"hi"}]}"#,
            400,
            "max_tokens must be positive",
        ),
        (
            br#"{"model":"m","max_tokens":4,"messages":[]}"#,
            400,
            "at least one item",
        ),
        (
            br#"{"model":"m","max_tokens":4,"messages":[{"role":"user","content":[]}]}"#,
            400,
            "must not be empty",
        ),
        (
            br#"{"model":"other","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}"#,
            404,
            "does not exist",
        ),
    ];
    for (body, status, msg) in cases {
        let e = messages_error(body);
        assert_eq!(e.status, status, "{}", String::from_utf8_lossy(body));
        let shape: Value = serde_json::from_slice(&e.body_for(ApiKind::Messages)).unwrap();
        assert_eq!(shape["type"], "error");
        let want = if status == 404 {
            "not_found_error"
        } else {
            "invalid_request_error"
        };
        assert_eq!(shape["error"]["type"], want);
        assert!(
            shape["error"]["message"].as_str().unwrap().contains(msg),
            "{shape}"
        );
    }
    let overloaded = ApiError {
        status: 503,
        kind: "ServiceUnavailableError",
        message: "KV cache full".into(),
        param: None,
    };
    let shape: Value = serde_json::from_slice(&error_body(&overloaded)).unwrap();
    assert_eq!(shape["error"]["type"], "overloaded_error");
}

fn responder(cached_fault: Option<&str>) -> Responder<'_> {
    Responder {
        kind: ApiKind::Messages,
        id: 7,
        created: 1,
        model_json: "\"m\"",
        digest: 42,
        prompt_tokens: 100,
        max_tokens: 3,
        bad_cached: cached_fault,
        ctx: None,
    }
}

#[test]
fn the_answer_reports_cache_reads_apart_from_the_input() {
    let body: Value = serde_json::from_slice(&responder(None).full_body(48)).unwrap();
    assert_eq!(body["id"], "chatcmpl-0000000000000007");
    assert_eq!(body["type"], "message");
    assert_eq!(body["role"], "assistant");
    assert_eq!(body["model"], "m");
    assert_eq!(body["stop_reason"], "max_tokens");
    assert_eq!(body["stop_sequence"], Value::Null);
    assert_eq!(body["content"][0]["type"], "text");
    assert_eq!(body["content"][0]["text"].as_str().unwrap().len(), 12);
    assert_eq!(
        body["usage"],
        json!({"input_tokens": 52, "output_tokens": 3,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 48})
    );
}

/// `(event name, data)` of each SSE event.
fn sse(events: &[Vec<u8>]) -> Vec<(String, Value)> {
    events
        .iter()
        .map(|e| {
            let text = std::str::from_utf8(e).unwrap();
            let (head, data) = text.split_once('\n').unwrap();
            assert!(text.ends_with("\n\n"));
            let name = head.strip_prefix("event: ").unwrap().to_string();
            let data: Value =
                serde_json::from_str(data.strip_prefix("data: ").unwrap().trim_end()).unwrap();
            assert_eq!(data["type"], name.as_str());
            (name, data)
        })
        .collect()
}

#[test]
fn the_stream_is_anthropics_named_events_in_order() {
    let r = responder(None);
    let mut events = Vec::new();
    r.token_events(&mut events, 0, 2, 48);
    r.token_events(&mut events, 2, 3, 48);
    r.final_events(&mut events, false, 48);
    let ev = sse(&events);
    let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "ping",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    let start = &ev[0].1["message"];
    assert_eq!(start["id"], "chatcmpl-0000000000000007");
    assert_eq!(start["content"], json!([]));
    assert_eq!(
        start["usage"],
        json!({"input_tokens": 100, "output_tokens": 0})
    );
    let text: String = ev[3..6]
        .iter()
        .map(|(_, d)| d["delta"]["text"].as_str().unwrap())
        .collect();
    let full: Value = serde_json::from_slice(&r.full_body(48)).unwrap();
    assert_eq!(text, full["content"][0]["text"].as_str().unwrap());
    assert_eq!(ev[7].1["delta"]["stop_reason"], "max_tokens");
    assert_eq!(ev[7].1["usage"], full["usage"]);
}

#[test]
fn a_fault_writes_its_text_where_the_cache_reads_are() {
    let body = String::from_utf8(responder(Some("-5")).full_body(48)).unwrap();
    assert!(body.contains(r#""cache_read_input_tokens":-5"#), "{body}");
}
