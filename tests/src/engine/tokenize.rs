//! Tokenizer and chat template of the simulated engine.
//!
//! The tokenizer is deliberately trivial but keeps the two properties of a
//! real BPE tokenizer that prefix caching depends on: about four bytes of text
//! per token, and prefix stability (the same leading text always gives the
//! same leading tokens). Text is cut into lines (each keeping its `\n`), and
//! each line into 4-byte chunks; a chunk is one token. Because a newline always
//! ends a token, `tokenize(a + b) == tokenize(a) + tokenize(b)` whenever `a`
//! ends with `\n`, which is how the chat template's assistant marker ends: the
//! tokens of an answer appended after the marker are exactly the tokens the
//! next turn's prompt contains at that place.
//!
//! With `--tokenizer-dir DIR` the engine tokenizes as vLLM does instead
//! ([`Model`]): `DIR/tokenizer.json` through Hugging Face's `tokenizers`, the
//! chat rendered whole with the `chat_template` of
//! `DIR/tokenizer_config.json` (minijinja), chats without and completions
//! with the post-processor's special tokens. Written independently of the
//! router's `precise::tokenizer` (which tokenizes piece by piece, cached),
//! so tests can compare the two.

use std::path::Path;
use std::sync::OnceLock;

/// A token id. Text tokens are the chunk's bytes read as a little-endian u32
/// (injective for text without NUL bytes); token-id prompts use ids as given.
pub type Token = u32;

/// Bytes per token: a real BPE tokenizer averages about four bytes of English
/// per token, so prompt sizes in tokens match what a user would expect.
pub const BYTES_PER_TOKEN: usize = 4;

/// Start of a message in the (ChatML) chat template; the role follows.
pub const MSG_START: &str = "<|im_start|>";
/// End of a message in the chat template.
pub const MSG_END: &str = "<|im_end|>\n";
/// The generation prompt appended after the last message.
pub const GENERATION_PROMPT: &str = "<|im_start|>assistant\n";

/// The token of one chunk of at most [`BYTES_PER_TOKEN`] bytes.
#[inline]
pub fn token_of(chunk: &[u8]) -> Token {
    let mut b = [0u8; BYTES_PER_TOKEN];
    b[..chunk.len()].copy_from_slice(chunk);
    u32::from_le_bytes(b)
}

/// Appends the tokens of `text` to `out`.
pub fn tokenize_into(text: &[u8], out: &mut Vec<Token>) {
    out.reserve(text.len() / BYTES_PER_TOKEN + 1);
    for line in text.split_inclusive(|&b| b == b'\n') {
        out.extend(line.chunks(BYTES_PER_TOKEN).map(token_of));
    }
}

/// The tokens of `text`.
pub fn tokenize(text: &str) -> Vec<Token> {
    let mut out = Vec::new();
    tokenize_into(text.as_bytes(), &mut out);
    out
}

/// Number of tokens of `text`, without allocating.
pub fn count_tokens(text: &str) -> usize {
    text.as_bytes()
        .split_inclusive(|&b| b == b'\n')
        .map(|l| l.len().div_ceil(BYTES_PER_TOKEN))
        .sum()
}

/// Appends one message rendered with the chat template.
pub fn render_message(out: &mut String, role: &str, content: &str) {
    out.reserve(MSG_START.len() + role.len() + 1 + content.len() + MSG_END.len());
    out.push_str(MSG_START);
    out.push_str(role);
    out.push('\n');
    out.push_str(content);
    out.push_str(MSG_END);
}

/// Renders a conversation `(role, content)` and the generation prompt, as a
/// server does before tokenizing a chat request.
pub fn render_chat<'a>(messages: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut out = String::new();
    for (role, content) in messages {
        render_message(&mut out, role, content);
    }
    out.push_str(GENERATION_PROMPT);
    out
}

/// A model's tokenizer and chat template (`--tokenizer-dir`).
pub struct Model {
    tokenizer: tokenizers::Tokenizer,
    env: minijinja::Environment<'static>,
    bos: String,
    eos: String,
}

/// The tokenizer given with `--tokenizer-dir`, once set at start.
static MODEL: OnceLock<Model> = OnceLock::new();

/// The model tokenizer in use, if any.
pub fn model() -> Option<&'static Model> {
    MODEL.get()
}

/// Uses `dir`'s tokenizer for every request from now on.
pub fn install(dir: &Path) -> anyhow::Result<()> {
    let m = Model::load(dir)?;
    MODEL
        .set(m)
        .map_err(|_| anyhow::anyhow!("a tokenizer is installed already"))
}

impl Model {
    pub fn load(dir: &Path) -> anyhow::Result<Model> {
        let tokenizer = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json"))
            .map_err(|e| anyhow::anyhow!("{}: {e}", dir.join("tokenizer.json").display()))?;
        let cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("tokenizer_config.json"))?)?;
        let special = |k: &str| match cfg.get(k) {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(v) => v["content"].as_str().unwrap_or("").to_owned(),
            None => String::new(),
        };
        let template = cfg["chat_template"]
            .as_str()
            .ok_or_else(|| anyhow::anyhow!("tokenizer_config.json has no chat_template string"))?
            .to_owned();
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |m: String| -> Result<String, _> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                m,
            ))
        });
        env.add_template_owned("chat", template)?;
        Ok(Model {
            tokenizer,
            env,
            bos: special("bos_token"),
            eos: special("eos_token"),
        })
    }

    /// The tokens of a chat `(role, content)`, rendered whole.
    pub fn chat(
        &self,
        messages: &[(&str, &str)],
        add_generation_prompt: bool,
    ) -> Result<Vec<Token>, String> {
        let msgs: Vec<_> = messages
            .iter()
            .map(|(r, c)| minijinja::context! { role => r, content => c })
            .collect();
        self.render_chat(msgs, None, add_generation_prompt)
    }

    /// The tokens of a chat whose messages are given as template values,
    /// rendered whole; `tools` is in the template's context only when given
    /// (as vLLM leaves it out of chats that declare none).
    pub fn render_chat(
        &self,
        messages: Vec<minijinja::Value>,
        tools: Option<minijinja::Value>,
        add_generation_prompt: bool,
    ) -> Result<Vec<Token>, String> {
        let base = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos,
            eos_token => &self.eos,
        };
        let ctx = match tools {
            Some(tools) => minijinja::context! { tools => tools, ..base },
            None => base,
        };
        let text = self
            .env
            .get_template("chat")
            .and_then(|t| t.render(ctx))
            .map_err(|e| format!("chat template: {e}"))?;
        self.encode(&text, false)
    }

    /// The tokens of `text` (`add_special`: with the post-processor's).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<Token>, String> {
        self.tokenizer
            .encode(text, add_special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn four_bytes_per_token_and_newline_ends_a_token() {
        assert_eq!(tokenize("abcdefgh").len(), 2);
        assert_eq!(tokenize("abcdefghi").len(), 3);
        assert_eq!(tokenize("ab\ncdef").len(), 2);
        assert_eq!(count_tokens("ab\ncdefg\n"), 3);
        assert_eq!(count_tokens("ab\ncdefg\n"), tokenize("ab\ncdefg\n").len());
    }

    #[test]
    fn prefix_stable_across_the_generation_prompt() {
        let prompt = render_chat([("system", "be brief"), ("user", "hello there")]);
        let answer = "bal kor tin ";
        let next = {
            let mut s = String::new();
            render_message(&mut s, "system", "be brief");
            render_message(&mut s, "user", "hello there");
            render_message(&mut s, "assistant", answer);
            render_message(&mut s, "user", "more");
            s.push_str(GENERATION_PROMPT);
            s
        };
        let mut seq = tokenize(&prompt);
        seq.extend(tokenize(answer));
        assert_eq!(&tokenize(&next)[..seq.len()], &seq[..]);
    }

    #[test]
    fn deterministic() {
        assert_eq!(tokenize("same text"), tokenize("same text"));
        assert_ne!(tokenize("same text"), tokenize("other txt"));
    }
}
