//! A real tokenizer for tests and benchmarks, made here (no hub): a small
//! byte-level BPE trained with the `tokenizers` crate on made-up text, with
//! ChatML's special tokens and a BOS post-processor, and a ChatML
//! `tokenizer_config.json`. [`write`] puts both in a directory that
//! `sim-engine --tokenizer-dir` and the router's `[precise] tokenizer_dir`
//! read.

use std::path::Path;

use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
    Tokenizer, TokenizerBuilder, TokenizerImpl,
};

/// ChatML, as Qwen's and many other models' `chat_template`.
pub const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Vocabulary size of the fixture (a real model's is 32k-256k; the cost per
/// byte depends little on it).
pub const VOCAB: usize = 2000;

/// `n` made-up words, deterministic in `seed`: a vocabulary of 4,096
/// words (one to three syllables) drawn log-uniformly, so a few words are
/// common and most are rare, as in real text; commas, full stops, line
/// breaks.
pub fn words(seed: u64, n: usize) -> String {
    const SYL: [&str; 16] = [
        "ka", "lo", "min", "tor", "es", "qua", "ri", "don", "pe", "su", "vel", "xi", "bra", "nu",
        "ght", "o",
    ];
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = String::with_capacity(n * 7);
    for i in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        // Log-uniform rank in 1..4096: rank r is drawn about 1/r as often.
        let u = (x >> 11) as f64 / (1u64 << 53) as f64;
        let rank = 4096f64.powf(u) as u64;
        let mut w = rank;
        loop {
            out.push_str(SYL[(w % 16) as usize]);
            w /= 16;
            if w == 0 {
                break;
            }
        }
        out.push(match i % 13 {
            12 => '\n',
            7 => ',',
            9 => '.',
            _ => ' ',
        });
        if i % 13 == 7 || i % 13 == 9 {
            out.push(' ');
        }
    }
    out
}

/// Trains the tokenizer and writes `tokenizer.json` and
/// `tokenizer_config.json` (ChatML) into `dir` (created).
pub fn write(dir: &Path) -> anyhow::Result<()> {
    let e = |e: tokenizers::Error| anyhow::anyhow!("tokenizers: {e}");
    std::fs::create_dir_all(dir)?;
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(VOCAB)
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
        .map_err(e)?;
    let corpus: Vec<String> = (0..200).map(|i| words(i, 300)).collect();
    tk.train(&mut trainer, corpus.iter()).map_err(e)?;
    let bos = tk
        .token_to_id("<|endoftext|>")
        .ok_or_else(|| anyhow::anyhow!("no BOS token"))?;
    tk.with_post_processor(Some(
        TemplateProcessing::builder()
            .try_single("<|endoftext|> $A")
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .special_tokens(vec![("<|endoftext|>", bos)])
            .build()?,
    ));
    let tk: Tokenizer = tk.into();
    tk.save(dir.join("tokenizer.json"), false).map_err(e)?;
    let cfg = serde_json::json!({
        "bos_token": "<|endoftext|>",
        "eos_token": {"content": "<|im_end|>"},
        "chat_template": CHATML,
    });
    std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string())?;
    Ok(())
}
