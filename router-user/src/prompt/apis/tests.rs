use super::*;
use crate::prompt::extract::Endpoint;
use crate::prompt::scan::Canonical;
use crate::prompt::scan::scan;

/// The canonical bytes and the seed of `body` read for `endpoint`.
fn read(endpoint: Endpoint, body: &str) -> Result<(Vec<u8>, Prompt, Canonical), RouterError> {
    let mut c = Canonical::default();
    let p = scan(endpoint, body.as_bytes(), &mut c)?;
    let mut out = Vec::new();
    c.write_to(body.as_bytes(), &mut out);
    Ok((out, p, c))
}

const CHAT: &str = r#"{"model":"m","messages":[
    {"role":"system","content":"You are a travel agent."},
    {"role":"user","content":"Two nights in Lisbon?"},
    {"role":"assistant","content":"Here are three hotels."},
    {"role":"user","content":[{"type":"text","text":"The second, "},{"type":"text","text":"please."}]}]}"#;

#[test]
fn a_conversation_as_messages_or_responses_has_the_chats_blocks() {
    let (chat, chat_p, _) = read(Endpoint::Chat, CHAT).unwrap();
    let messages = r#"{"model":"m","max_tokens":64,
        "system":[{"type":"text","text":"You are a travel agent."}],
        "messages":[
            {"role":"user","content":"Two nights in Lisbon?"},
            {"role":"assistant","content":[{"type":"text","text":"Here are three hotels."}]},
            {"role":"user","content":[{"type":"text","text":"The second, "},{"type":"text","text":"please."}]}]}"#;
    let (m, m_p, mc) = read(Endpoint::Messages, messages).unwrap();
    assert_eq!(m, chat);
    assert_eq!(m_p.seed, chat_p.seed);
    assert!(mc.answered());
    let responses = r#"{"model":"m","instructions":"You are a travel agent.",
        "input":[
            {"role":"user","content":"Two nights in Lisbon?"},
            {"type":"message","role":"assistant","content":[{"type":"output_text","text":"Here are three hotels."}]},
            {"role":"user","content":[{"type":"input_text","text":"The second, "},{"type":"input_text","text":"please."}]}]}"#;
    let (r, r_p, rc) = read(Endpoint::Responses, responses).unwrap();
    assert_eq!(r, chat);
    assert_eq!(r_p.seed, chat_p.seed);
    assert!(rc.stores(), "store defaults to true");
    assert!(rc.previous_response().is_empty());
}

#[test]
fn the_next_turn_extends_the_last_ones_blocks() {
    let turn1 =
        r#"{"model":"m","max_tokens":8,"system":"S","messages":[{"role":"user","content":"hi"}]}"#;
    let turn2 = r#"{"model":"m","max_tokens":8,"system":"S","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"hello"},{"role":"user","content":"more"}]}"#;
    let (a, _, ac) = read(Endpoint::Messages, turn1).unwrap();
    let (b, _, _) = read(Endpoint::Messages, turn2).unwrap();
    assert!(b.starts_with(&a));
    assert!(!ac.answered(), "a first turn has no answer yet");
}

#[test]
fn tools_tool_calls_and_images_take_part_in_the_prefix() {
    let with = |tools: &str| {
        format!(
            r#"{{"model":"m","max_tokens":8,"tools":{tools},"messages":[
            {{"role":"user","content":"weather?"}},
            {{"role":"assistant","content":[{{"type":"tool_use","id":"t1","name":"get_weather","input":{{"city":"Paris"}}}}]}},
            {{"role":"user","content":[{{"type":"tool_result","tool_use_id":"t1","content":[{{"type":"text","text":"sunny"}}]}},
                {{"type":"image","source":{{"type":"base64","media_type":"image/png","data":"iVBOR"}}}}]}}]}}"#
        )
    };
    let tool_a = r#"[{"name":"get_weather","input_schema":{"type":"object"}}]"#;
    let tool_b = r#"[{"name":"get_time","input_schema":{"type":"object"}}]"#;
    let (a, pa, _) = read(Endpoint::Messages, &with(tool_a)).unwrap();
    let (b, pb, _) = read(Endpoint::Messages, &with(tool_b)).unwrap();
    let (n, pn, _) = read(Endpoint::Messages, &with("[]")).unwrap();
    assert_eq!(n, a);
    assert_eq!(a, b, "tools are not in the text");
    assert_ne!(pa.seed, pb.seed, "other tools, another chain");
    assert_ne!(pa.seed, pn.seed);
    let text = String::from_utf8_lossy(&a);
    for part in ["get_weather", "Paris", "t1", "sunny", "iVBOR"] {
        assert!(text.contains(part), "{part} in {text:?}");
    }
}

#[test]
fn responses_items_salt_and_stored_state() {
    let body = r#"{"model":"m","input":[
        {"type":"function_call","call_id":"c1","name":"lookup","arguments":"{\"q\":1}"},
        {"type":"function_call_output","call_id":"c1","output":"42"}],
        "previous_response_id":"resp_abc","store":false,"prompt_cache_key":"tenant-7"}"#;
    let (text, p, c) = read(Endpoint::Responses, body).unwrap();
    let text = String::from_utf8_lossy(&text).into_owned();
    for part in ["lookup", "{\"q\":1}", "c1", "42"] {
        assert!(text.contains(part), "{part} in {text:?}");
    }
    assert_eq!(c.previous_response(), b"resp_abc");
    assert!(!c.stores());
    assert_eq!(c.salt(), b"tenant-7");
    assert!(c.answered(), "a continued response is past its first turn");
    let unsalted = body.replace(r#","prompt_cache_key":"tenant-7""#, "");
    assert_ne!(read(Endpoint::Responses, &unsalted).unwrap().1.seed, p.seed);
    // A string input is one user message.
    let (s, _, _) = read(Endpoint::Responses, r#"{"model":"m","input":"hi"}"#).unwrap();
    let (chat, _, _) = read(
        Endpoint::Chat,
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
    )
    .unwrap();
    assert_eq!(s, chat);
}

#[test]
fn malformed_bodies_are_400s_that_say_why() {
    for (ep, body, why) in [
        (Endpoint::Messages, "{", "not valid"),
        (
            Endpoint::Messages,
            r#"{"model":"m"}"#,
            "'messages' is required",
        ),
        (
            Endpoint::Messages,
            r#"{"messages":[{"content":"x"}]}"#,
            "role",
        ),
        (
            Endpoint::Messages,
            r#"{"messages":[{"role":"user","content":7}]}"#,
            "string or an array",
        ),
        (
            Endpoint::Messages,
            r#"{"messages":[],"messages":[]}"#,
            "duplicate",
        ),
        (Endpoint::Messages, r#"{"messages":[]} x"#, "trailing"),
        (
            Endpoint::Responses,
            r#"{"model":"m"}"#,
            "'input' is required",
        ),
        (
            Endpoint::Responses,
            r#"{"input":{"a":1}}"#,
            "string or an array",
        ),
        (
            Endpoint::Responses,
            r#"{"input":"x","store":"yes"}"#,
            "boolean",
        ),
    ] {
        let e = read(ep, body)
            .err()
            .unwrap_or_else(|| panic!("{body} was read"));
        assert_eq!(e.status(), 400, "{body}");
        assert!(e.message.contains(why), "{body}: {}", e.message);
    }
}

proptest::proptest! {
    #[test]
    fn any_bytes_are_read_or_refused_never_a_panic(body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256)) {
        for ep in [Endpoint::Messages, Endpoint::Responses] {
            let mut c = Canonical::default();
            let _ = scan(ep, &body, &mut c);
        }
    }
}
