use super::*;
use crate::precise::keys::{PromptText, TokenScratch, engine_tokens};
use crate::prompt::extract::Endpoint;

use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
    TokenizerBuilder, TokenizerImpl,
};

const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Text of made-up words, deterministic.
fn words(seed: u64, n: usize) -> String {
    const SYL: [&str; 12] = [
        "ka", "lo", "min", "tor", "es", "qua", "ri", "don", "pe", "su", "vel", "xi",
    ];
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = String::new();
    for i in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let len = 1 + (x % 3) as usize;
        for k in 0..len {
            out.push_str(SYL[((x >> (8 * k)) % 12) as usize]);
        }
        out.push(match i % 11 {
            10 => '\n',
            7 => ',',
            _ => ' ',
        });
    }
    out
}

/// A small byte-level BPE trained on made-up text, with ChatML's special
/// tokens and a BOS post-processor, written with a ChatML
/// `tokenizer_config.json` into a new temporary directory.
fn fixture(name: &str, template: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("prefix-router-tok-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(600)
        .min_frequency(2)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(vec![
            AddedToken::from("<|endoftext|>", true),
            AddedToken::from("<|im_start|>", true),
            AddedToken::from("<|im_end|>", true),
        ])
        .build();
    let mut tk: TokenizerImpl<
        BPE,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    > = TokenizerBuilder::new()
        .with_model(BPE::default())
        .with_normalizer(None)
        .with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false).into()))
        .with_post_processor(None)
        .with_decoder(Some(ByteLevel::default().into()))
        .build()
        .unwrap();
    let corpus: Vec<String> = (0..40).map(|i| words(i, 200)).collect();
    tk.train(&mut trainer, corpus.iter()).unwrap();
    let bos = tk.token_to_id("<|endoftext|>").unwrap();
    tk.with_post_processor(Some(
        TemplateProcessing::builder()
            .try_single("<|endoftext|> $A")
            .unwrap()
            .special_tokens(vec![("<|endoftext|>", bos)])
            .build()
            .unwrap(),
    ));
    let tk: Tokenizer = tk.into();
    tk.save(dir.join("tokenizer.json"), false).unwrap();
    let cfg = serde_json::json!({
        "bos_token": "<|endoftext|>",
        "eos_token": {"content": "<|im_end|>"},
        "chat_template": template,
    });
    std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    dir
}

fn canonical(msgs: &[(&str, &str)]) -> Vec<u8> {
    let mut c = Vec::new();
    for (role, text) in msgs {
        c.push(MESSAGE_START);
        c.extend_from_slice(role.as_bytes());
        c.push(ROLE_END);
        c.extend_from_slice(text.as_bytes());
    }
    c
}

/// A pool that tokenizes every message on the request's wait.
fn limits() -> Limits {
    Limits {
        threads: 1,
        queue: 4,
        max_tokens: DEFAULT_MAX_TOKENS,
    }
}

fn pool_now() -> Arc<TokenPool> {
    TokenPool::new(DEFAULT_CACHE_TOKENS, 0)
}

fn tokenized(pool: &TokenPool) -> u64 {
    pool.tokenized.load(Relaxed)
}

fn as_pairs(history: &[(String, String)]) -> Vec<(&str, &str)> {
    history
        .iter()
        .map(|(r, c)| (r.as_str(), c.as_str()))
        .collect()
}

#[test]
fn chat_tokens_by_piece_equal_the_whole_rendered_chat() {
    let dir = fixture("chat", CHATML);
    let t = Arc::new(ModelTokenizer::load(&dir).unwrap());
    let pool = pool_now();
    let mut history: Vec<(String, String)> = vec![("system".into(), words(1, 40))];
    for turn in 0..6u64 {
        history.push(("user".into(), words(100 + turn, 30 + 7 * turn as usize)));
        let msgs = as_pairs(&history);
        let want = t.encode(&t.render_chat(&msgs).unwrap(), false).unwrap();
        assert!(want.len() > 40, "the fixture tokenizes into real tokens");
        let before = tokenized(&pool);
        let mut got = Vec::new();
        t.chat_tokens(&canonical(&msgs), false, &pool, &mut got)
            .unwrap();
        assert_eq!(got, want, "turn {turn}");
        if turn > 0 {
            // The history is cached: only the new user message, the
            // previous answer and the generation prompt are tokenized.
            assert!(tokenized(&pool) - before <= 3, "turn {turn}");
        }
        history.push(("assistant".into(), words(200 + turn, 25)));
    }
    // Warm: the same chat again tokenizes nothing.
    let msgs = as_pairs(&history);
    let mut a = Vec::new();
    t.chat_tokens(&canonical(&msgs), false, &pool, &mut a)
        .unwrap();
    let before = tokenized(&pool);
    let mut b = Vec::new();
    t.chat_tokens(&canonical(&msgs), false, &pool, &mut b)
        .unwrap();
    assert_eq!(a, b);
    assert_eq!(tokenized(&pool), before);
}

/// A new short last message is left to the pool's thread: the request gets
/// the exact tokens before it at once, and the whole once the thread ran.
/// A long one (a document) is tokenized on the wait.
#[test]
fn a_new_short_last_message_is_tokenized_off_the_wait() {
    let dir = fixture("defer", CHATML);
    let t = Arc::new(ModelTokenizer::load(&dir).unwrap());
    let pool = TokenPool::new(DEFAULT_CACHE_TOKENS, 2048);
    let mut history: Vec<(String, String)> = vec![
        ("system".into(), words(1, 60)),
        ("user".into(), words(2, 40)),
        ("assistant".into(), words(3, 40)),
    ];
    history.push(("user".into(), words(4, 50)));
    let msgs = as_pairs(&history);
    let canon = canonical(&msgs);
    let want = t.encode(&t.render_chat(&msgs).unwrap(), false).unwrap();
    // The history up to the new message, as the engine tokenizes it.
    let head = t
        .encode(&t.render_chat(&msgs[..3]).unwrap(), false)
        .unwrap();
    let head = &head[..head.len() - t.encode("<|im_start|>assistant\n", false).unwrap().len()];
    let mut got = Vec::new();
    t.chat_tokens(&canon, false, &pool, &mut got).unwrap();
    assert_eq!(got, head, "the history's tokens, without the new message");
    assert!(want.starts_with(&got) && got.len() < want.len());
    assert_eq!(pool.deferred.load(Relaxed), 1);
    // The thread tokenizes it: soon the same request gets every token.
    let mut whole = false;
    for _ in 0..500 {
        let mut again = Vec::new();
        let before = tokenized(&pool);
        t.chat_tokens(&canon, false, &pool, &mut again).unwrap();
        if again == want && tokenized(&pool) == before {
            whole = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(whole, "the pool's thread tokenized the new message");
    // A long new last message is tokenized on the wait.
    let deferred = pool.deferred.load(Relaxed);
    history.push(("assistant".into(), words(5, 20)));
    history.push(("user".into(), words(6, 2000)));
    let msgs = as_pairs(&history);
    assert!(msgs.last().unwrap().1.len() > 2048);
    let want = t.encode(&t.render_chat(&msgs).unwrap(), false).unwrap();
    let mut got = Vec::new();
    t.chat_tokens(&canonical(&msgs), false, &pool, &mut got)
        .unwrap();
    assert_eq!(got, want);
    assert_eq!(
        pool.deferred.load(Relaxed),
        deferred,
        "nothing more was left"
    );
}

#[test]
fn completion_tokens_equal_the_whole_with_the_post_processor() {
    let dir = fixture("completion", CHATML);
    let t = Arc::new(ModelTokenizer::load(&dir).unwrap());
    let pool = pool_now();
    let text = format!(
        "{}<|im_start|>user\n{}<|im_end|>\n{}",
        words(7, 50),
        words(8, 20),
        words(9, 30)
    );
    let want = t.encode(&text, true).unwrap();
    let bos = t.tokenizer.token_to_id("<|endoftext|>").unwrap();
    assert_eq!(want[0], bos, "the fixture's post-processor adds a BOS");
    let mut got = Vec::new();
    t.completion_tokens(text.as_bytes(), false, &pool, &mut got)
        .unwrap();
    assert_eq!(got, want);
    // A chat is tokenized without the post-processor, as vLLM does.
    let mut chat = Vec::new();
    t.chat_tokens(&canonical(&[("user", "hi")]), false, &pool, &mut chat)
        .unwrap();
    assert_ne!(chat[0], bos);
}

#[test]
fn the_cache_stays_within_its_budget() {
    let dir = fixture("budget", CHATML);
    let t = Arc::new(ModelTokenizer::load(&dir).unwrap());
    let pool = TokenPool::new(3000, 0);
    for i in 0..200 {
        let mut out = Vec::new();
        t.chat_tokens(
            &canonical(&[("user", &words(i, 30))]),
            false,
            &pool,
            &mut out,
        )
        .unwrap();
        assert!(pool.tokens() <= 3000);
    }
    assert!(pool.tokens() > 0);
}

#[test]
fn a_missing_or_failing_tokenizer_falls_back_to_the_approximate_index() {
    let mut models = BTreeMap::new();
    models.insert("gone".to_owned(), PathBuf::from("/nonexistent/tokenizer"));
    let raising = fixture(
        "raising",
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}",
    );
    models.insert("strict".to_owned(), raising);
    let all = Tokenizers::load(None, &models, pool_now(), limits());
    assert!(matches!(all.for_model(b"gone"), Choice::Unavailable));
    assert!(matches!(all.for_model(b"other"), Choice::Toy));
    let mut scratch = TokenScratch::default();
    let mut out = vec![1];
    let canon = canonical(&[("user", "hello")]);
    assert!(!engine_tokens(
        all.for_model(b"gone"),
        &all.pool,
        &PromptText {
            endpoint: Endpoint::Chat,
            canonical: &canon,
            token_ids: false,
            cut: false,
        },
        &mut scratch,
        &mut out
    ));
    assert!(out.is_empty());
    // The template raises for this chat: no tokens, reported once.
    let strict = all.for_model(b"strict");
    assert!(!engine_tokens(
        strict,
        &all.pool,
        &PromptText {
            endpoint: Endpoint::Chat,
            canonical: &canon,
            token_ids: false,
            cut: false,
        },
        &mut scratch,
        &mut out
    ));
    let Choice::Model(t) = strict else {
        panic!("the strict tokenizer loads")
    };
    assert!(t.warned.load(Relaxed));
    // A chat the template accepts, and token ids, still work.
    let ok = canonical(&[("system", "be brief"), ("user", "hello")]);
    assert!(engine_tokens(
        strict,
        &all.pool,
        &PromptText {
            endpoint: Endpoint::Chat,
            canonical: &ok,
            token_ids: false,
            cut: false,
        },
        &mut scratch,
        &mut out
    ));
    assert!(!out.is_empty());
    let ids: Vec<u8> = [5u32, 6, 7].iter().flat_map(|t| t.to_le_bytes()).collect();
    assert!(engine_tokens(
        all.for_model(b"gone"),
        &all.pool,
        &PromptText {
            endpoint: Endpoint::Completions,
            canonical: &ids,
            token_ids: true,
            cut: false,
        },
        &mut scratch,
        &mut out
    ));
    assert_eq!(out, [5, 6, 7]);
}

#[test]
fn a_broken_directory_is_an_error_naming_the_file() {
    let dir = std::env::temp_dir().join(format!("prefix-router-tok-{}-broken", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), "{not json").unwrap();
    let e = ModelTokenizer::load(&dir).unwrap_err();
    assert!(e.0.contains("tokenizer.json"), "{e}");
    let no_template = fixture("no-template", CHATML);
    std::fs::write(no_template.join("tokenizer_config.json"), "{}").unwrap();
    let e = ModelTokenizer::load(&no_template).unwrap_err();
    assert!(e.0.contains("chat_template"), "{e}");
}

/// A template that costs more than its allowance per message is marked
/// costly on the render that showed it (whose tokens are still used), and
/// every later chat of its models skips it without rendering, until a
/// reload; one that fails with an error of its own is marked failed; one
/// that refuses a chat (`raise_exception`) is not marked.
#[test]
fn a_costly_or_failing_template_is_remembered_until_reload() {
    // Three loops deep over the messages: 27 iterations for 3 messages,
    // a million for 100 (over 20,000 fuel units a message).
    let cubic = fixture(
        "cubic",
        "{% for a in messages %}{% for b in messages %}{% for c in messages %}{% endfor %}{% endfor %}{% endfor %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}",
    );
    let t = Arc::new(ModelTokenizer::load(&cubic).unwrap());
    let pool = pool_now();
    let short: Vec<(String, String)> = (0..3).map(|i| ("user".to_owned(), words(i, 5))).collect();
    let mut out = Vec::new();
    t.chat_tokens(&canonical(&as_pairs(&short)), false, &pool, &mut out)
        .unwrap();
    assert_eq!(
        t.template_state().0,
        TemplateState::Ok,
        "3 messages are cheap"
    );
    let long: Vec<(String, String)> = (0..100).map(|i| ("user".to_owned(), words(i, 3))).collect();
    let started = std::time::Instant::now();
    let first = t.chat_tokens(&canonical(&as_pairs(&long)), false, &pool, &mut out);
    let (state, why, ..) = t.template_state();
    assert_eq!(state, TemplateState::Costly, "{why}");
    assert!(first.is_err() || !out.is_empty());
    // Marked: the next chat (even a cheap one) is not rendered at all.
    let again = std::time::Instant::now();
    assert!(
        t.chat_tokens(&canonical(&as_pairs(&short)), false, &pool, &mut out)
            .is_err()
    );
    assert!(again.elapsed() < started.elapsed() / 10);
    assert_eq!(t.template_state().2, 1, "one chat skipped");
    // Completions use no template: still tokenized.
    out.clear();
    t.completion_tokens(b"plain text", false, &pool, &mut out)
        .unwrap();
    assert!(!out.is_empty());
    t.reset_template();
    assert_eq!(t.template_state().0, TemplateState::Ok);
    t.chat_tokens(&canonical(&as_pairs(&short)), false, &pool, &mut out)
        .unwrap();

    // A linear template is never costly, however long the chat.
    let chatml = Arc::new(ModelTokenizer::load(&fixture("linear", CHATML)).unwrap());
    let very_long: Vec<(String, String)> = (0..2000)
        .map(|i| ("user".to_owned(), words(i, 2)))
        .collect();
    chatml
        .chat_tokens(&canonical(&as_pairs(&very_long)), false, &pool, &mut out)
        .unwrap();
    assert_eq!(chatml.template_state().0, TemplateState::Ok);

    // A template error of its own: failed.
    let broken = fixture("broken", "{{ messages[0]['content'] | no_such_filter }}");
    let b = Arc::new(ModelTokenizer::load(&broken).unwrap());
    assert!(
        b.chat_tokens(&canonical(&as_pairs(&short)), false, &pool, &mut out)
            .is_err()
    );
    assert_eq!(b.template_state().0, TemplateState::Failed);

    // A refusal is the chat's, not the template's.
    let raising = fixture(
        "raising-once",
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}",
    );
    let r = Arc::new(ModelTokenizer::load(&raising).unwrap());
    assert!(
        r.chat_tokens(&canonical(&[("user", "hi")]), false, &pool, &mut out)
            .is_err()
    );
    let (state, _, _, refused) = r.template_state();
    assert_eq!((state, refused), (TemplateState::Ok, 1));
    r.chat_tokens(
        &canonical(&[("system", "be brief"), ("user", "hi")]),
        false,
        &pool,
        &mut out,
    )
    .unwrap();
}

/// A prompt cut to the budget gives the whole prompt's first tokens: the
/// cut lands before a word, and the last few tokens are dropped.
#[test]
fn a_cut_prompt_gives_the_whole_prompts_first_tokens() {
    let dir = fixture("cut", CHATML);
    let t = Arc::new(ModelTokenizer::load(&dir).unwrap());
    let pool = pool_now();
    let msgs = [("system", words(1, 50)), ("user", words(2, 3000))];
    let whole_canon = canonical(&[(msgs[0].0, &msgs[0].1), (msgs[1].0, &msgs[1].1)]);
    let want = t
        .encode(
            &t.render_chat(&[(msgs[0].0, &msgs[0].1), (msgs[1].0, &msgs[1].1)])
                .unwrap(),
            false,
        )
        .unwrap();
    for max in [700usize, 2000, 5001] {
        let mut canon = whole_canon[..max].to_vec();
        crate::precise::keys::cut(&mut canon, Endpoint::Chat, false);
        assert!(canon.len() <= max && canon.len() + 300 > max, "{max}");
        let mut got = Vec::new();
        t.chat_tokens(&canon, true, &pool, &mut got).unwrap();
        assert!(got.len() > 100, "{max}: {}", got.len());
        assert_eq!(got, want[..got.len()], "cut at {max}");
        // Completions too (with the post-processor's BOS first).
        let text = msgs[1].1.as_bytes();
        let mut c = text[..max].to_vec();
        crate::precise::keys::cut(&mut c, Endpoint::Completions, false);
        let mut got = Vec::new();
        t.completion_tokens(&c, true, &pool, &mut got).unwrap();
        let mut whole = Vec::new();
        t.completion_tokens(text, false, &pool, &mut whole).unwrap();
        assert_eq!(got, whole[..got.len()], "completion cut at {max}");
    }
}
