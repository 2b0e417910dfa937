use super::*;
use proptest::prelude::*;

fn canon(ep: Endpoint, body: &str) -> Result<(Vec<u8>, Prompt), RouterError> {
    let mut ex = Extractor::default();
    let mut out = Vec::new();
    let p = ex.extract(ep, body.as_bytes(), &mut out)?;
    Ok((out, p))
}

#[test]
fn chat_canonical_ignores_whitespace_and_key_order() {
    let a = r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}]}"#;
    let b = r#"{ "messages" : [ { "content" : "be brief", "role" : "system" },
                 {"content": [{"type":"text","text":"hi"}], "role":"user"} ], "stream": true, "model": "m" }"#;
    assert_eq!(
        canon(Endpoint::Chat, a).unwrap(),
        canon(Endpoint::Chat, b).unwrap()
    );
}

#[test]
fn next_turn_extends_the_previous_canonical_prompt() {
    let t1 = r#"{"model":"m","messages":[{"role":"system","content":"S"},{"role":"user","content":"q1"}]}"#;
    let t2 = r#"{"model":"m","messages":[{"role":"system","content":"S"},{"role":"user","content":"q1"},
               {"role":"assistant","content":"a1"},{"role":"user","content":"q2"}]}"#;
    let (c1, _) = canon(Endpoint::Chat, t1).unwrap();
    let (c2, _) = canon(Endpoint::Chat, t2).unwrap();
    assert!(c2.starts_with(&c1));
}

#[test]
fn models_get_different_namespaces() {
    let a = canon(Endpoint::Chat, r#"{"model":"a","messages":[]}"#)
        .unwrap()
        .1;
    let b = canon(Endpoint::Chat, r#"{"model":"b","messages":[]}"#)
        .unwrap()
        .1;
    let salted = canon(
        Endpoint::Chat,
        r#"{"model":"a","cache_salt":"t1","messages":[]}"#,
    )
    .unwrap()
    .1;
    assert_ne!(a.seed, b.seed);
    assert_ne!(a.seed, salted.seed);
}

#[test]
fn escapes_are_decoded_before_hashing() {
    let a = canon(Endpoint::Completions, r#"{"prompt":"line\nnext \u00e9"}"#)
        .unwrap()
        .0;
    assert_eq!(a, "line\nnext é".as_bytes());
}

#[test]
fn completions_prompt_forms() {
    assert_eq!(
        canon(Endpoint::Completions, r#"{"prompt":"abc"}"#)
            .unwrap()
            .0,
        b"abc"
    );
    assert_eq!(
        canon(Endpoint::Completions, r#"{"prompt":["abc","zzz"]}"#)
            .unwrap()
            .0,
        b"abc"
    );
    assert_eq!(
        canon(Endpoint::Completions, r#"{"prompt":[1,2]}"#)
            .unwrap()
            .0,
        [1, 0, 0, 0, 2, 0, 0, 0]
    );
    assert_eq!(
        canon(Endpoint::Completions, r#"{"prompt":[[3],[4]]}"#)
            .unwrap()
            .0,
        [3, 0, 0, 0]
    );
}

#[test]
fn generate_text_and_input_ids() {
    assert_eq!(
        canon(Endpoint::Generate, r#"{"text":"hello"}"#).unwrap().0,
        b"hello"
    );
    assert_eq!(
        canon(Endpoint::Generate, r#"{"input_ids":[7]}"#).unwrap().0,
        [7, 0, 0, 0]
    );
}

#[test]
fn missing_prompt_and_bad_json_are_400s_that_say_why() {
    let e = canon(Endpoint::Chat, r#"{"model":"m"}"#).unwrap_err();
    assert_eq!(e.status(), 400);
    assert!(e.message.contains("messages"), "{}", e.message);
    let e = canon(
        Endpoint::Chat,
        r#"{"model":"m","messages":[{"role":"user","content":"x"}"#,
    )
    .unwrap_err();
    assert_eq!(e.status(), 400);
    assert!(e.message.contains("not valid JSON"), "{}", e.message);
    assert_eq!(canon(Endpoint::Generate, "{}").unwrap_err().status(), 400);
    assert_eq!(
        canon(Endpoint::Completions, r#"{"prompt":[-1]}"#)
            .unwrap_err()
            .status(),
        400
    );
}

#[test]
fn user_field_is_hashed_for_sessions() {
    let a = canon(Endpoint::Chat, r#"{"messages":[],"user":"u1"}"#)
        .unwrap()
        .1;
    let b = canon(Endpoint::Chat, r#"{"messages":[],"user":"u2"}"#)
        .unwrap()
        .1;
    assert!(a.user.is_some() && a.user != b.user);
}

proptest! {
    /// Any text survives the JSON round trip into the canonical form unchanged.
    #[test]
    fn message_text_round_trips(texts in proptest::collection::vec(".{0,80}", 1..6)) {
        let messages: Vec<_> = texts.iter().map(|t| serde_json::json!({"role":"user","content":t})).collect();
        let body = serde_json::json!({"model":"m","messages":messages}).to_string();
        let (c, _) = canon(Endpoint::Chat, &body).unwrap();
        let mut want = Vec::new();
        for t in &texts {
            want.push(0x1e);
            want.extend_from_slice(b"user");
            want.push(0x1f);
            want.extend_from_slice(t.as_bytes());
        }
        prop_assert_eq!(c, want);
    }

    /// Arbitrary bytes never panic the extractor.
    #[test]
    fn garbage_never_panics(body in proptest::collection::vec(any::<u8>(), 0..300)) {
        let mut ex = Extractor::default();
        let mut out = Vec::new();
        let _ = ex.extract(Endpoint::Chat, &body, &mut out);
    }
}
