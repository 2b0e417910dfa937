use super::*;
use crate::engine::api::{ApiKind, Responder};
use crate::engine::responses::{self, Store};
use std::sync::Arc;

const PROMPT: usize = 300;
const CACHED: u32 = 256;
const MAX: u32 = 5;
const DIGEST: u64 = 42;

/// The text the engine generates for these answers.
fn generated() -> String {
    let mut s = String::new();
    crate::engine::output_text::push_text(&mut s, DIGEST, 0, MAX);
    s
}

/// The engine's Responses context of a request, for rendering its answer.
fn responses_ctx() -> Arc<responses::Ctx> {
    let body = br#"{"model":"m","input":"hello","store":true}"#;
    let (_, ctx) = responses::parse(body, &["m".to_string()], 16, &Store::default()).unwrap();
    Arc::new(ctx)
}

/// The engine's answer on `kind`: the whole body, then the stream's events.
fn rendered(kind: ApiKind, ctx: Option<&Arc<responses::Ctx>>) -> (Vec<u8>, Vec<Vec<u8>>) {
    let r = Responder {
        kind,
        id: 7,
        created: 1,
        model_json: "\"m\"",
        digest: DIGEST,
        prompt_tokens: PROMPT,
        max_tokens: MAX,
        bad_cached: None,
        ctx,
    };
    let mut events = Vec::new();
    r.token_events(&mut events, 0, MAX, CACHED);
    r.final_events(&mut events, true, CACHED);
    (r.full_body(CACHED), events)
}

/// Each event's `data:` lines, joined, as the client reads them.
fn data(event: &[u8]) -> Vec<u8> {
    let text = std::str::from_utf8(event).unwrap();
    let lines: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(str::trim)
        .collect();
    lines.join("\n").into_bytes()
}

/// Reads `events` as a stream; returns the answer and how many events
/// carried text.
fn streamed(api: Api, events: &[Vec<u8>]) -> (Answer, usize) {
    let mut a = Answer::new(api);
    let texts = events.iter().filter(|e| a.event(&data(e))).count();
    (a, texts)
}

fn want() -> Usage {
    Usage {
        prompt_tokens: PROMPT as u64,
        cached_tokens: u64::from(CACHED),
        completion_tokens: u64::from(MAX),
    }
}

#[test]
fn every_api_s_answer_reads_into_one_usage_and_its_text() {
    let ctx = responses_ctx();
    for (api, kind, ctx) in [
        (Api::Chat, ApiKind::Chat, None),
        (Api::Messages, ApiKind::Messages, None),
        (Api::Responses, ApiKind::Responses, Some(&ctx)),
        (Api::ResponsesChained, ApiKind::Responses, Some(&ctx)),
    ] {
        let (body, events) = rendered(kind, ctx);
        let mut whole = Answer::new(api);
        assert!(
            whole.body(&body),
            "{api}: {}",
            String::from_utf8_lossy(&body)
        );
        assert_eq!(
            (&whole.text, whole.usage),
            (&generated(), Some(want())),
            "{api}"
        );
        let (s, texts) = streamed(api, &events);
        assert_eq!((&s.text, s.usage), (&generated(), Some(want())), "{api}");
        assert_eq!(texts, MAX as usize, "{api}: one event per token");
        assert_eq!(s.incomplete(), None, "{api}");
        assert_eq!(s.id, whole.id, "{api}");
        // A stream cut before its closing event is not an answer.
        let (cut, _) = streamed(api, &events[..events.len() - 1]);
        assert!(
            cut.incomplete().unwrap().contains("stream ended without"),
            "{api}"
        );
    }
}

#[test]
fn a_response_s_id_is_known_from_its_first_event() {
    let ctx = responses_ctx();
    let (body, events) = rendered(ApiKind::Responses, Some(&ctx));
    let mut whole = Answer::new(Api::ResponsesChained);
    whole.body(&body);
    assert_eq!(whole.id.as_deref(), Some(ctx.id.as_str()));
    let (first, _) = streamed(Api::ResponsesChained, &events[..1]);
    assert_eq!(first.id.as_deref(), Some(ctx.id.as_str()));
    assert_eq!(first.usage, None, "no usage before the response is done");
}

#[test]
fn anthropic_input_tokens_leave_out_what_the_cache_read_and_wrote() {
    // Anthropic's own shape: the start counts the uncached input and the
    // cache; the delta only the output so far.
    let events = [
        br#"{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","content":[],"usage":{"input_tokens":10,"cache_creation_input_tokens":30,"cache_read_input_tokens":200,"output_tokens":1}}}"#.as_slice(),
        br#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
        br#"{"type":"ping"}"#,
        br#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi"}}"#,
        br#"{"type":"content_block_stop","index":0}"#,
        br#"{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":12}}"#,
        br#"{"type":"message_stop"}"#,
    ];
    let mut a = Answer::new(Api::Messages);
    let texts: Vec<bool> = events.iter().map(|e| a.event(e)).collect();
    assert_eq!(texts, [false, false, false, true, false, false, false]);
    assert_eq!(
        a.usage,
        Some(Usage {
            prompt_tokens: 240,
            cached_tokens: 200,
            completion_tokens: 12
        })
    );
    assert_eq!(
        (a.id.as_deref(), a.text.as_str(), a.incomplete()),
        (Some("msg_1"), "Hi", None)
    );
    // An error event mid-stream is the answer's error.
    let mut e = Answer::new(Api::Messages);
    e.event(br#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#);
    assert_eq!(e.incomplete().as_deref(), Some("Overloaded"));
}

#[test]
fn bodies_of_another_shape_are_not_answers() {
    let error = br#"{"type":"error","error":{"type":"not_found_error","message":"no"}}"#;
    assert!(!Answer::new(Api::Messages).body(error));
    assert!(!Answer::new(Api::Responses).body(br#"{"error":{"message":"no"}}"#));
    assert!(!Answer::new(Api::Chat).body(br#"{"data":[{"id":"m"}]}"#));
    let mut failed = Answer::new(Api::ResponsesChained);
    failed.event(br#"{"type":"response.failed","sequence_number":3,"response":{"id":"resp_9","object":"response","status":"failed","error":{"code":"server_error","message":"boom"}}}"#);
    assert_eq!(
        (failed.id.as_deref(), failed.incomplete().as_deref()),
        (Some("resp_9"), Some("boom"))
    );
}
