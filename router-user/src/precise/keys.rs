//! Keys of the precise index: one per engine block, chained over the
//! block's tokens and extra keys, seeded by the namespace (LoRA adapter), so
//! the router computes, from a request's tokens, the same key the
//! subscriber computed from the engine's `BlockStored` token ids.
//!
//! The router does not recompute the engine's own hashes (they depend on the
//! engine's hash function, seed and version): it keys blocks by content and
//! maps engine hashes onto those keys (`index`).
//!
//! Tokens of a request: with the model's tokenizer configured
//! (`[precise] tokenizer_dir`, `[precise.tokenizers]`), its own tokens and
//! chat template (`tokenizer`); without one, as `sim-engine` does by
//! default: the chat rendered with the ChatML template, text cut into lines
//! and each line into 4-byte tokens (`tests/src/engine/tokenize.rs`).
//! Against a real vLLM the latter gives other tokens than the engine's, so
//! no request would match (see ARCHITECTURE.md, "Precise mode").

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::tokenizer::{CUT_MARGIN_TOKENS, Choice, TokenPool};
use crate::prompt::extract::Endpoint;
use crate::prompt::hash::namespace_seed;

/// vLLM's default block size on GPUs, in tokens.
pub const DEFAULT_BLOCK_TOKENS: usize = 16;

/// The chain seed of a sequence's first block: the LoRA adapter's name, or
/// none for the base model.
pub fn chain_seed(lora: Option<&str>) -> u64 {
    namespace_seed(&[b"precise", lora.unwrap_or("").as_bytes()])
}

/// The key of one block after `parent` (a key, or [`chain_seed`]). Never 0
/// (the index uses 0 for an empty slot).
#[inline]
pub fn block_key(parent: u64, tokens: &[u32], extra: &[Vec<u8>]) -> u64 {
    let mut bytes = [0u8; 4 * 64];
    let mut h = parent;
    // Blocks of up to 64 tokens hash in one call; larger ones in pieces.
    for piece in tokens.chunks(64) {
        for (dst, t) in bytes.chunks_exact_mut(4).zip(piece) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        h = xxh3_64_with_seed(&bytes[..piece.len() * 4], h);
    }
    for e in extra {
        h = xxh3_64_with_seed(e, h ^ e.len() as u64);
    }
    h.max(1)
}

/// Appends the keys of every full block of `tokens` (`block` tokens each) to
/// `out`, the first block's `first_extra` folded in (the cache salt).
pub fn request_keys(
    seed: u64,
    tokens: &[u32],
    block: usize,
    first_extra: &[Vec<u8>],
    out: &mut Vec<u64>,
) {
    let mut h = seed;
    for (i, b) in tokens.chunks_exact(block.max(1)).enumerate() {
        h = block_key(h, b, if i == 0 { first_extra } else { &[] });
        out.push(h);
    }
}

/// Start of a message in the ChatML template; the role follows.
const MSG_START: &[u8] = b"<|im_start|>";
/// End of a message in the ChatML template.
const MSG_END: &[u8] = b"<|im_end|>\n";
/// The generation prompt after the last message.
const GENERATION_PROMPT: &[u8] = b"<|im_start|>assistant\n";
/// Bytes per token of `sim-engine`'s tokenizer.
const BYTES_PER_TOKEN: usize = 4;
/// `prompt::extract`'s separators of a chat's canonical form.
const MESSAGE_START: u8 = 0x1e;
const ROLE_END: u8 = 0x1f;

/// A request's engine tokens, as far as routing reads them.
#[derive(Debug, Default)]
pub struct EngineTokens {
    pub tokens: Vec<u32>,
    /// Bytes of the canonical prompt they were made from.
    pub covered: usize,
    /// The prompt was cut ([`cut`]): `covered` is less than the whole.
    pub cut: bool,
}

/// How far back from a cut a whitespace is looked for.
const CUT_SEEK_BYTES: usize = 256;

/// Cuts `canonical`, the first bytes of a canonical prompt (written up to
/// a budget; the whole prompt is longer when `cut`), where its tokens can
/// end as the whole's do: token ids at a whole id; text at the start of
/// the last run of whitespace in its last [`CUT_SEEK_BYTES`] (tokenizers
/// split words there first), else at a character; a chat's last message
/// not cut inside its role.
pub fn cut(canonical: &mut Vec<u8>, endpoint: Endpoint, token_ids: bool) {
    if token_ids && !endpoint.is_chat() {
        canonical.truncate(canonical.len() / 4 * 4);
        return;
    }
    // A character whose last bytes were cut off goes whole.
    let mut end = canonical.len();
    let mut lead = end;
    while lead > 0 && end - lead < 4 && canonical[lead - 1] & 0xc0 == 0x80 {
        lead -= 1;
    }
    if lead > 0 {
        let b = canonical[lead - 1];
        let len = match b {
            0xf0.. => 4,
            0xe0.. => 3,
            0xc0.. => 2,
            _ => 1,
        };
        if end - (lead - 1) < len {
            end = lead - 1;
        }
    }
    let from = end.saturating_sub(CUT_SEEK_BYTES);
    let ws = |b: u8| matches!(b, b' ' | b'\n' | b'\t' | b'\r');
    if let Some(at) = canonical[from..end]
        .iter()
        .rposition(|&b| ws(b) || b == MESSAGE_START || b == ROLE_END)
        .map(|i| from + i)
        .filter(|&i| ws(canonical[i]))
    {
        let mut start = at;
        while start > 0 && ws(canonical[start - 1]) {
            start -= 1;
        }
        end = start;
    }
    canonical.truncate(end);
    if endpoint.is_chat() {
        // A last message cut inside its role is left out.
        if let Some(rs) = memchr::memrchr(MESSAGE_START, canonical)
            && memchr::memchr(ROLE_END, &canonical[rs..]).is_none()
        {
            canonical.truncate(rs);
        }
    }
}

/// A canonical prompt as [`engine_tokens`] takes it.
#[derive(Clone, Copy, Debug)]
pub struct PromptText<'a> {
    pub endpoint: Endpoint,
    /// The canonical prompt, or its start when `cut`.
    pub canonical: &'a [u8],
    /// A completion given as token ids (little-endian u32s).
    pub token_ids: bool,
    /// `canonical` is the start of a longer prompt ([`cut`]).
    pub cut: bool,
}

/// A worker's tokenizing scratch: the rendered text of the toy tokenizer.
#[derive(Default)]
pub struct TokenScratch {
    pub text: Vec<u8>,
}

/// The engine's tokens for a request whose canonical prompt (as
/// `prompt::extract` writes it) is `canonical`, written into `out` (cleared
/// first), with the model's tokenizer `choice`. For a chat the canonical
/// form (`RS role US text` per message) is rendered with the chat template,
/// then tokenized (a short new last message may be left out, see
/// `tokenizer`); completion text is tokenized as it is; a prompt given as
/// token ids (`token_ids`) is those ids. `pool` keeps the tokens of pieces
/// seen. A prompt that was [`cut`] gives tokens that end a little before
/// the cut. False when the tokens cannot be had (no tokenizer loaded for
/// the model, or it failed on this request: reported once): the request
/// routes on the approximate index.
pub fn engine_tokens(
    choice: &Choice,
    pool: &TokenPool,
    prompt: &PromptText<'_>,
    scratch: &mut TokenScratch,
    out: &mut Vec<u32>,
) -> bool {
    let PromptText {
        endpoint,
        canonical,
        token_ids,
        cut,
    } = *prompt;
    out.clear();
    if token_ids && !endpoint.is_chat() {
        out.extend(
            canonical
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        );
        return true;
    }
    match choice {
        Choice::Toy => {
            toy_tokens(endpoint, canonical, cut, &mut scratch.text, out);
            if cut {
                out.truncate(out.len().saturating_sub(CUT_MARGIN_TOKENS));
            }
            true
        }
        Choice::Unavailable => false,
        Choice::Model(t) => {
            let done = if endpoint.is_chat() {
                t.chat_tokens(canonical, cut, pool, out)
            } else {
                t.completion_tokens(canonical, cut, pool, out)
            };
            match done {
                Ok(()) => true,
                Err(e) => {
                    t.warn_once(&e);
                    out.clear();
                    false
                }
            }
        }
    }
}

/// `sim-engine`'s default tokens: ChatML, then 4-byte tokens (`cut`: the
/// text stops where the last message's does).
fn toy_tokens(
    endpoint: Endpoint,
    canonical: &[u8],
    cut: bool,
    text: &mut Vec<u8>,
    out: &mut Vec<u32>,
) {
    match endpoint {
        Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => {
            text.clear();
            let starts = memchr::memchr_iter(MESSAGE_START, canonical).chain([canonical.len()]);
            let mut prev = None;
            for at in starts {
                let Some(from) = prev.replace(at + 1) else {
                    continue;
                };
                let msg = &canonical[from..at.min(canonical.len())];
                let (role, content) = match memchr::memchr(ROLE_END, msg) {
                    Some(i) => (&msg[..i], &msg[i + 1..]),
                    None => (msg, &[][..]),
                };
                text.extend_from_slice(MSG_START);
                text.extend_from_slice(role);
                text.push(b'\n');
                text.extend_from_slice(content);
                if !(cut && at >= canonical.len()) {
                    text.extend_from_slice(MSG_END);
                }
            }
            if !cut {
                text.extend_from_slice(GENERATION_PROMPT);
            }
            tokenize_into(text, out);
        }
        Endpoint::Completions | Endpoint::Generate => tokenize_into(canonical, out),
    }
}

/// `sim-engine`'s tokenizer: lines (each keeping its `\n`) cut into 4-byte
/// chunks, each read as a little-endian u32.
fn tokenize_into(text: &[u8], out: &mut Vec<u32>) {
    out.reserve(text.len() / BYTES_PER_TOKEN + 1);
    let mut rest = text;
    while !rest.is_empty() {
        let end = memchr::memchr(b'\n', rest).map_or(rest.len(), |i| i + 1);
        let (line, tail) = rest.split_at(end);
        let chunks = line.chunks_exact(BYTES_PER_TOKEN);
        let last = chunks.remainder();
        out.extend(chunks.map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])));
        if !last.is_empty() {
            let mut b = [0u8; BYTES_PER_TOKEN];
            b[..last.len()].copy_from_slice(last);
            out.push(u32::from_le_bytes(b));
        }
        rest = tail;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_renders_chatml_then_four_byte_tokens() {
        let mut canon = Vec::new();
        for (role, text) in [("system", "be brief"), ("user", "hi")] {
            canon.push(MESSAGE_START);
            canon.extend_from_slice(role.as_bytes());
            canon.push(ROLE_END);
            canon.extend_from_slice(text.as_bytes());
        }
        let (mut scratch, mut toks) = (TokenScratch::default(), Vec::new());
        let prompt = PromptText {
            endpoint: Endpoint::Chat,
            canonical: &canon,
            token_ids: false,
            cut: false,
        };
        assert!(engine_tokens(
            &Choice::Toy,
            &TokenPool::new(1000, 0),
            &prompt,
            &mut scratch,
            &mut toks
        ));
        assert_eq!(
            scratch.text,
            b"<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(toks[0], u32::from_le_bytes(*b"<|im"));
        // "<|im_start|>system\n" is 19 bytes: 5 tokens, the last "em\n".
        assert_eq!(toks[4], u32::from_le_bytes([b'e', b'm', b'\n', 0]));
    }

    /// The engine's tokenizer, written plainly (`tests/src/engine/tokenize.rs`).
    fn reference(text: &[u8]) -> Vec<u32> {
        let mut out = Vec::new();
        for line in text.split_inclusive(|&b| b == b'\n') {
            out.extend(line.chunks(4).map(|c| {
                let mut b = [0u8; 4];
                b[..c.len()].copy_from_slice(c);
                u32::from_le_bytes(b)
            }));
        }
        out
    }

    #[test]
    fn tokens_equal_the_engines_on_awkward_lines() {
        for text in [
            "",
            "\n",
            "\n\n",
            "abc",
            "abcd",
            "abcde\nfg\n\nhijklmnop",
            "x\nyz",
        ] {
            let mut out = Vec::new();
            tokenize_into(text.as_bytes(), &mut out);
            assert_eq!(out, reference(text.as_bytes()), "{text:?}");
        }
    }

    #[test]
    fn keys_chain_and_namespaces_separate() {
        let toks: Vec<u32> = (0..40).collect();
        let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
        request_keys(chain_seed(None), &toks, 16, &[], &mut a);
        request_keys(chain_seed(Some("adapter")), &toks, 16, &[], &mut b);
        request_keys(chain_seed(None), &toks, 16, &[b"salt".to_vec()], &mut c);
        assert_eq!(a.len(), 2);
        assert_eq!(a[1], block_key(a[0], &toks[16..32], &[]));
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        assert!(a.iter().zip(&c).all(|(x, y)| x != y));
    }
}
