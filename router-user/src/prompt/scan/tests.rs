use super::*;
use crate::prompt::extract::Extractor;
use crate::prompt::hash::{block_hashes, block_hashes_pieces};
use proptest::prelude::*;
use serde_json::{Value, json};

/// What the reference extractor says of a body.
fn oracle(ep: Endpoint, body: &[u8]) -> Result<(Vec<u8>, Prompt), u16> {
    oracle_full(ep, body).map(|(c, p, ..)| (c, p))
}

/// The reference's reading with its salt and whether it read token ids.
fn oracle_full(ep: Endpoint, body: &[u8]) -> Result<(Vec<u8>, Prompt, Vec<u8>, bool), u16> {
    let mut out = Vec::new();
    let mut ex = Extractor::default();
    let p = ex.extract(ep, body, &mut out).map_err(|e| e.status())?;
    Ok((out, p, ex.salt().to_vec(), ex.token_ids()))
}

/// What the scanner says of it, the canonical form written out.
fn scanned(ep: Endpoint, body: &[u8]) -> Result<(Vec<u8>, Prompt), u16> {
    scanned_full(ep, body).map(|(c, p, ..)| (c, p))
}

fn scanned_full(ep: Endpoint, body: &[u8]) -> Result<(Vec<u8>, Prompt, Vec<u8>, bool), u16> {
    let mut c = Canonical::default();
    let p = scan(ep, body, &mut c).map_err(|e| e.status())?;
    let mut out = Vec::new();
    c.write_to(body, &mut out);
    assert_eq!(out.len(), c.len());
    Ok((out, p, c.salt().to_vec(), c.token_ids()))
}

fn agree(ep: Endpoint, body: &[u8]) -> Result<(), TestCaseError> {
    let (a, b) = (oracle_full(ep, body), scanned_full(ep, body));
    prop_assert_eq!(&a, &b, "{:?} on {:?}", ep, String::from_utf8_lossy(body));
    Ok(())
}

fn endpoints() -> impl Strategy<Value = Endpoint> {
    prop_oneof![
        Just(Endpoint::Chat),
        Just(Endpoint::Completions),
        Just(Endpoint::Generate)
    ]
}

/// Strings with what JSON escapes: quotes, backslashes, controls, non-ASCII
/// (two, three and four bytes), so both escaped and raw forms occur.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z ]{0,80}",
        "[a-zé中😀\"\\\\/\n\t\u{1}\u{7f} ]{0,40}",
        Just(String::new()),
    ]
}

fn opt_text() -> impl Strategy<Value = Value> {
    prop_oneof![
        text().prop_map(Value::String),
        Just(Value::Null),
        Just(json!(7)),
    ]
}

fn part() -> impl Strategy<Value = Value> {
    prop_oneof![
        text().prop_map(|t| json!({"type": "text", "text": t})),
        text().prop_map(|u| json!({"type": "image_url", "image_url": {"url": u, "detail": "low"}})),
        text().prop_map(|u| json!({"text": null, "image_url": {"url": u}})),
        Just(json!({"type": "input_audio"})),
        Just(json!({"image_url": {"detail": "no url"}})),
        Just(json!("a bare string")),
    ]
}

fn content() -> impl Strategy<Value = Option<Value>> {
    prop_oneof![
        text().prop_map(|t| Some(Value::String(t))),
        proptest::collection::vec(part(), 0..4).prop_map(|p| Some(Value::Array(p))),
        Just(Some(Value::Null)),
        Just(None),
        Just(Some(json!(3))),
    ]
}

fn message() -> impl Strategy<Value = Value> {
    (
        prop_oneof![
            "(system|user|assistant|tool)".prop_map(Value::String),
            Just(Value::Null),
        ],
        content(),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(role, content, content_first, extra)| {
            let mut m = serde_json::Map::new();
            let role_entry = (!role.is_null()).then(|| ("role".to_owned(), role));
            let content_entry = content.map(|c| ("content".to_owned(), c));
            let (first, second) = if content_first {
                (content_entry, role_entry)
            } else {
                (role_entry, content_entry)
            };
            for (k, v) in first.into_iter().chain(second) {
                m.insert(k, v);
            }
            if extra {
                m.insert("name".into(), json!({"nested": [1, 2.5, -3e2, true, null]}));
            }
            Value::Object(m)
        })
}

fn tokens() -> impl Strategy<Value = Value> {
    proptest::collection::vec(
        prop_oneof![
            (0u32..100_000).prop_map(Value::from),
            Just(Value::from(u32::MAX)),
            Just(Value::from(u64::from(u32::MAX) + 1)),
            Just(json!(-1)),
            Just(json!(1.5)),
        ],
        1..20,
    )
    .prop_map(Value::Array)
}

fn prompt() -> impl Strategy<Value = Value> {
    prop_oneof![
        text().prop_map(Value::String),
        tokens(),
        proptest::collection::vec(text().prop_map(Value::String), 0..3).prop_map(Value::Array),
        proptest::collection::vec(tokens(), 1..3).prop_map(Value::Array),
        Just(json!([["nested too deep"]])),
        Just(json!([[]])),
        Just(Value::Null),
        Just(json!({"not": "a prompt"})),
    ]
}

/// Request bodies, valid and not, with fields in any order.
fn body() -> impl Strategy<Value = Vec<u8>> {
    (
        proptest::option::of(opt_text()),
        proptest::option::of(prop_oneof![
            proptest::collection::vec(message(), 0..5).prop_map(Value::Array),
            Just(Value::Null),
            Just(json!("not messages")),
        ]),
        proptest::option::of(prompt()),
        proptest::option::of(prompt()),
        proptest::option::of(prompt()),
        (
            proptest::option::of(opt_text()),
            proptest::option::of(opt_text()),
            proptest::option::of(opt_text()),
        ),
        any::<u64>(),
        any::<bool>(),
    )
        .prop_map(
            |(model, messages, prompt, text_, ids, (user, salt, lora), order, pretty)| {
                let mut fields: Vec<(&str, Value)> = [
                    ("model", model),
                    ("messages", messages),
                    ("prompt", prompt),
                    ("text", text_),
                    ("input_ids", ids),
                    ("user", user),
                    ("cache_salt", salt),
                    ("lora_path", lora),
                    ("stream", Some(json!(true))),
                    ("max_tokens", Some(json!(16))),
                ]
                .into_iter()
                .filter_map(|(k, v)| v.map(|v| (k, v)))
                .collect();
                // A field order from `order`.
                let n = fields.len();
                for i in (1..n).rev() {
                    let j = ((order >> (i % 60)) as usize) % (i + 1);
                    fields.swap(i, j);
                }
                let map: serde_json::Map<String, Value> =
                    fields.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
                let v = Value::Object(map);
                if pretty {
                    serde_json::to_vec_pretty(&v).expect("serializable")
                } else {
                    serde_json::to_vec(&v).expect("serializable")
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// The scanner accepts what the reference accepts, refuses what it
    /// refuses, and writes the same canonical prompt, seed and user.
    #[test]
    fn the_scanner_reads_what_the_reference_reads(ep in endpoints(), b in body()) {
        agree(ep, &b)?;
    }

    /// Broken bodies (a byte changed, a cut) are refused alike, and
    /// whatever both accept reads alike.
    #[test]
    fn broken_bodies_are_judged_alike(ep in endpoints(), b in body(), at in any::<prop::sample::Index>(),
                                      byte in prop_oneof![Just(b'"'), Just(b'\\'), Just(b','), Just(b'}'),
                                                          Just(b']'), Just(b'{'), Just(0x01u8), Just(0xffu8),
                                                          Just(b'1'), Just(b' ')],
                                      cut in any::<bool>()) {
        let mut b = b;
        let i = at.index(b.len());
        if cut {
            b.truncate(i);
        } else {
            b[i] = byte;
        }
        agree(ep, &b)?;
    }

    /// With a limit, the scan reads the body alike (accepted or refused,
    /// the same seed, user, model and whole length) and keeps exactly
    /// the first `limit` bytes of the canonical prompt.
    #[test]
    fn a_limit_keeps_the_canonical_prompts_first_bytes(ep in endpoints(), b in body(),
                                                       limit in prop_oneof![0usize..8, 0usize..400]) {
        let mut whole = Canonical::default();
        let mut cut = Canonical::default();
        cut.set_limit(limit);
        let (a, c) = (scan(ep, &b, &mut whole), scan(ep, &b, &mut cut));
        match (a, c) {
            (Ok(a), Ok(c)) => {
                prop_assert_eq!((a.seed, a.user), (c.seed, c.user));
                prop_assert_eq!(whole.len(), cut.len());
                prop_assert_eq!(whole.model(), cut.model());
                prop_assert_eq!(whole.answered(), cut.answered());
                let (mut w, mut k) = (Vec::new(), Vec::new());
                whole.write_to(&b, &mut w);
                cut.write_to(&b, &mut k);
                prop_assert_eq!(&w[..w.len().min(limit)], &k[..]);
                let mut prefix = Vec::new();
                let more = cut.write_prefix_to(&b, &mut prefix, limit);
                prop_assert_eq!(&prefix, &k);
                prop_assert_eq!(more, whole.len() > prefix.len());
            }
            (Err(a), Err(c)) => prop_assert_eq!(a.status(), c.status()),
            (a, c) => prop_assert!(false, "{:?} / {:?}", a.map(|_| ()), c.map(|_| ())),
        }
    }

    /// The hashes routing takes from the pieces are the reference's.
    #[test]
    fn block_hashes_equal_the_reference(b in body(), block in 1usize..80) {
        if let (Ok((canon, p)), true) = (oracle(Endpoint::Chat, &b), true) {
            let mut c = Canonical::default();
            scan(Endpoint::Chat, &b, &mut c).expect("the reference accepted it");
            let (mut want, mut got, mut carry) = (Vec::new(), Vec::new(), Vec::new());
            block_hashes(p.seed, &canon, block, &mut want);
            block_hashes_pieces(p.seed, c.pieces(&b), block, &mut carry, &mut got);
            prop_assert_eq!(want, got);
        }
    }
}

#[test]
fn errors_say_where() {
    let mut c = Canonical::default();
    let e = scan(
        Endpoint::Chat,
        b"{\"messages\": [\n {\"role\": \"user\", \"content\": \"hi\"\n ]}",
        &mut c,
    )
    .unwrap_err();
    assert_eq!(e.status(), 400);
    assert!(e.message.contains("line 3"), "{}", e.message);
    for bad in [
        &b""[..],
        b"[]",
        b"{\"messages\": []} x",
        b"{\"messages\": [], \"messages\": []}",
        b"{\"model\": \"\\ud800\", \"messages\": []}",
        b"{\"messages\": [{\"content\": \"no role\"}]}",
    ] {
        assert!(scan(Endpoint::Chat, bad, &mut c).is_err(), "{bad:?}");
    }
}

#[test]
fn a_long_prompt_is_pieces_of_the_body() {
    let text = "lorem ipsum ".repeat(40_000);
    let body = serde_json::to_vec(&json!({
        "model": "m",
        "messages": [{"role": "system", "content": text}, {"role": "user", "content": "hi"}],
    }))
    .unwrap();
    let mut c = Canonical::default();
    scan(Endpoint::Chat, &body, &mut c).unwrap();
    // Separators and roles aside, nothing was copied.
    assert!(c.aux.len() < 64, "{} bytes copied", c.aux.len());
    assert_eq!(c.len(), text.len() + "system".len() + "user".len() + 2 + 4);
}

#[test]
fn a_prompt_past_the_limit_is_counted_not_copied() {
    // A message with escapes (a newline every few words) is decoded, and
    // each part's text too; past the limit neither is kept anywhere.
    let text = "lorem ipsum\ndolor \"sit\" amet ".repeat(40_000);
    for content in [json!(text), json!([{"type": "text", "text": text}])] {
        let body = serde_json::to_vec(&json!({
            "model": "m",
            "messages": [{"content": content, "role": "user"}, {"role": "user", "content": "hi"}],
        }))
        .unwrap();
        let (mut whole, mut cut) = (Canonical::default(), Canonical::default());
        cut.set_limit(1000);
        scan(Endpoint::Chat, &body, &mut whole).unwrap();
        scan(Endpoint::Chat, &body, &mut cut).unwrap();
        assert_eq!(cut.len(), whole.len());
        assert_eq!(cut.len(), text.len() + 2 * "user".len() + 2 + 2 + 2);
        // The limit, and the header of a message whose content came first.
        assert!(cut.aux.len() <= 1000 + 8, "{} bytes copied", cut.aux.len());
        let (mut w, mut k) = (Vec::new(), Vec::new());
        whole.write_to(&body, &mut w);
        cut.write_to(&body, &mut k);
        assert_eq!(&w[..1000], &k[..]);
    }
}

#[test]
fn messages_and_bodies_must_be_objects() {
    // serde would read a struct from an array, positionally (the reference
    // accepts these); the scanner wants objects, as the OpenAI API defines
    // them, and says so.
    for body in [
        &br#"{"messages": [["user", "hi"]]}"#[..],
        br#"["m", [{"role": "user", "content": "hi"}]]"#,
    ] {
        assert_eq!(scanned(Endpoint::Chat, body).map(|_| ()), Err(400));
    }
}

#[test]
fn each_adapter_keys_its_own_prefix_chain() {
    // An adapter's KV cache is not its base model's: an adapter named in
    // `model` (vLLM) or in `lora_path` (SGLang) seeds a chain of its own,
    // and the same prompt for the same adapter always hashes alike.
    let seed = |fields: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "the same prompt"}]});
        for (k, v) in fields.as_object().unwrap() {
            body[k] = v.clone();
        }
        let body = serde_json::to_vec(&body).unwrap();
        let mut c = Canonical::default();
        let p = scan(Endpoint::Chat, &body, &mut c).unwrap();
        (p.seed, c.model().to_vec(), c.adapter().to_vec())
    };
    let base = seed(json!({"model": "llama"}));
    let in_model = seed(json!({"model": "sql-lora"}));
    let other_in_model = seed(json!({"model": "chat-lora"}));
    let in_path = seed(json!({"model": "llama", "lora_path": "sql-lora"}));
    assert_eq!(base, seed(json!({"model": "llama"})));
    let seeds = [base.0, in_model.0, other_in_model.0, in_path.0];
    for (i, a) in seeds.iter().enumerate() {
        for b in &seeds[i + 1..] {
            assert_ne!(a, b, "adapters share no chain with each other or the base");
        }
    }
    assert_eq!(in_model.1, b"sql-lora");
    assert_eq!(
        (in_path.1.as_slice(), in_path.2.as_slice()),
        (&b"llama"[..], &b"sql-lora"[..])
    );
}

#[test]
fn a_chat_holding_an_answer_is_a_conversation_past_its_first_turn() {
    let answered = |body: &str| {
        let mut c = Canonical::default();
        scan(Endpoint::Chat, body.as_bytes(), &mut c).unwrap();
        c.answered()
    };
    let first = r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"q"}]}"#;
    assert!(!answered(first));
    let later = r#"{"messages":[{"role":"user","content":"q"},{"role":"assistant","content":"a"},{"role":"user","content":"q2"}]}"#;
    assert!(answered(later));
    // Escaped, and after its content.
    let escaped =
        r#"{"messages":[{"content":"a","role":"assist\u0061nt"},{"role":"user","content":"q"}]}"#;
    assert!(answered(escaped));
    // The next body on the same scratch starts over.
    assert!(!answered(first));
}

/// Plain runs of every length up to past two vectors, each ended by one
/// byte of any kind (special or not), so that the vector scan's rounds,
/// its last vector and its byte-by-byte tail each meet every kind of byte.
fn scan_bytes() -> impl Strategy<Value = Vec<u8>> {
    let end = prop_oneof![
        Just(b'"'),
        Just(b'\\'),
        0u8..0x20,
        0x80u8..=0xff,
        Just(0x1f),
        Just(0x20),
        Just(0x7f),
        b'a'..=b'z',
    ];
    proptest::collection::vec((0usize..140, end), 0..6).prop_map(|runs| {
        runs.into_iter()
            .flat_map(|(len, end)| std::iter::repeat_n(b'x', len).chain(std::iter::once(end)))
            .collect()
    })
}

proptest! {
    /// The vector scan stops where the portable one does, from every start.
    #[test]
    fn the_vector_scan_stops_where_the_portable_scan_stops(b in scan_bytes(), from in any::<usize>()) {
        let from = from % (b.len() + 1);
        let want = next_special_portable(&b, from);
        prop_assert_eq!(next_special(&b, from), want);
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2.
            prop_assert_eq!(unsafe { simd::next_special_avx2(&b, from) }, want);
        }
    }
}

#[test]
fn a_long_plain_run_is_crossed_to_its_quote() {
    // 400 KB of plain text, then each kind of special byte at each offset
    // within the last vectors.
    for special in [b'"', b'\\', 0x00, 0x1f, 0x80, 0xff] {
        for tail in 0..70 {
            let mut b = vec![b'x'; 400 * 1024 + tail];
            let at = b.len() - 1 - tail / 2;
            b[at] = special;
            assert_eq!(next_special(&b, 0), at, "byte {special:#x}, tail {tail}");
            assert_eq!(next_special(&b, at + 1), b.len());
        }
    }
}

#[test]
fn a_body_s_own_priority_is_noticed_on_every_inference_api() {
    let mut canon = Canonical::default();
    let given = |ep, body: &str, canon: &mut Canonical| {
        scan(ep, body.as_bytes(), canon).unwrap();
        canon.priority_given()
    };
    let chat = r#"{"messages":[{"role":"user","content":"hi"}]"#;
    assert!(!given(Endpoint::Chat, &format!("{chat}}}"), &mut canon));
    assert!(given(
        Endpoint::Chat,
        &format!("{chat},\"priority\":-2}}"),
        &mut canon
    ));
    // Whatever its value; and the next scan forgets it.
    assert!(given(
        Endpoint::Chat,
        &format!("{chat},\"priority\":null}}"),
        &mut canon
    ));
    assert!(!given(Endpoint::Chat, &format!("{chat}}}"), &mut canon));
    assert!(given(
        Endpoint::Completions,
        r#"{"priority":1,"prompt":"a"}"#,
        &mut canon
    ));
    // Inside a message it is no top-level field.
    let nested = r#"{"messages":[{"role":"user","content":"hi","priority":1}]}"#;
    assert!(!given(Endpoint::Chat, nested, &mut canon));
    let msgs =
        r#"{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"hi"}],"priority":3}"#;
    assert!(given(Endpoint::Messages, msgs, &mut canon));
    assert!(given(
        Endpoint::Responses,
        r#"{"input":"hi","priority":0}"#,
        &mut canon
    ));
    assert!(!given(Endpoint::Responses, r#"{"input":"hi"}"#, &mut canon));
}
