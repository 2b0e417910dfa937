//! The model's own tokenizer for precise mode: `tokenizer.json` read with
//! Hugging Face's `tokenizers` crate and the chat template of
//! `tokenizer_config.json` rendered with `minijinja`, so the router's tokens
//! of a request are the engine's (vLLM renders and tokenizes the same way).
//!
//! Tokenizing is the expensive part, and a multi-turn chat repeats its whole
//! history every turn. So the rendered chat is cut before each added token
//! (`<|im_start|>` in ChatML): the tokenizer itself splits its input there
//! before anything else, so the pieces' tokens, concatenated, are the whole
//! text's. Each piece's tokens are kept in a [`TokenPool`] keyed by a hash
//! of the piece: a turn tokenizes only its new message. The pool is shared
//! by every worker (a conversation's turns arrive on any worker) and split
//! into shards, each behind its own lock, held for a lookup and a copy.
//!
//! A turn's new message, last in the prompt, is not tokenized on the
//! request's wait when it is short (`defer_bytes`): no engine can hold a
//! block of text that was never sent to it, so only the blocks before it
//! can match, and those are known (cached). The request routes on them,
//! and the new message is tokenized by the pool's own thread, in time for
//! the next turn, where it is history. (Sent before, it is in the pool and
//! tokens come whole.) A long last message (a document pasted) is
//! tokenized at once: other requests may share its start.
//!
//! A prompt longer than routing needs is cut first (`keys::cut`, the
//! token budget `tokenizer_max_tokens`): what is tokenized ends where the
//! cut is, a few tokens before it dropped, as they may differ from the
//! whole text's. The engine, not the router, rejects a prompt longer than
//! its context.
//!
//! A tokenizer that cannot be loaded is reported once at start and its model
//! routes on the approximate index. A chat template that fails on a
//! request (an error of its own, not a `raise_exception` refusing that
//! request's messages) or costs more than [`TEMPLATE_FUEL_PER_MESSAGE`]
//! per message is remembered until reload ([`TemplateState`]): chats of
//! its models route on the approximate index at once, without rendering
//! (completions, which use no template, keep their tokens). A request the
//! template refuses routes on the approximate index. None stops a request.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex, Weak};

use aho_corasick::{AhoCorasick, MatchKind};
use minijinja::{Environment, Value, context};
use tokenizers::Tokenizer;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use super::offload::Offload;
use crate::prompt::extract::{MESSAGE_START, ROLE_END};

/// Template execution budget (minijinja "fuel", about one unit per
/// instruction): real chat templates spend a few hundred units a message;
/// this stops a template that loops without end after about 1.3 s (a
/// nested loop measured in release). It is the ceiling of one render; the
/// cost that marks a template costly is [`TEMPLATE_FUEL_PER_MESSAGE`].
const TEMPLATE_FUEL: u64 = 50_000_000;

/// Most fuel a render may spend per message rendered, plus
/// [`TEMPLATE_FUEL_BASE`], before its template is marked costly: a
/// template linear in the messages (every real one) spends at most a few
/// hundred units a message, so this is ample headroom; a
/// template that loops over the messages for each message (quadratic or
/// worse) passes it once a chat is long enough, and then costs seconds
/// per request. Counted per message, not per render, so no client can
/// make a linear template costly with a long chat (a chat over 2,500
/// messages that runs out of [`TEMPLATE_FUEL`] is refused for itself).
pub const TEMPLATE_FUEL_PER_MESSAGE: u64 = 20_000;

/// What any render may spend besides its messages (the preamble: tools,
/// a date, a default system prompt).
pub const TEMPLATE_FUEL_BASE: u64 = 100_000;

/// The message of `raise_exception`, so a template's refusal of a
/// request's messages (roles that do not alternate...) is told from the
/// template's own failure.
const RAISED: &str = "the chat template raised: ";

/// Tokens dropped from the end of a cut prompt: the text after the cut
/// could have merged with them (a word split by the cut).
pub const CUT_MARGIN_TOKENS: usize = 4;

/// Default budget of the [`TokenPool`], in tokens (4 bytes each): 8M
/// tokens, 32 MB, the histories of a thousand or so live conversations.
pub const DEFAULT_CACHE_TOKENS: usize = 8 << 20;

/// Default longest last message whose tokenizing waits for the pool's
/// thread: 2 KiB, a message a person types. 0: every message on the wait.
pub const DEFAULT_DEFER_BYTES: usize = 2048;

/// Shards of the pool: enough that workers rarely meet on one lock.
const POOL_SHARDS: usize = 16;

/// Messages waiting for the pool's thread; past this they are dropped
/// (counted): the next turn tokenizes them on its own wait.
const DEFER_QUEUE: usize = 1024;

/// The tokenizer and chat template of one model.
pub struct ModelTokenizer {
    /// Where it was read from (for messages).
    dir: PathBuf,
    tokenizer: Tokenizer,
    env: Environment<'static>,
    bos: String,
    eos: String,
    /// Finds the added tokens the tokenizer splits on before normalizing;
    /// `cut[i]`: the text may be cut before a match of pattern `i`.
    added: Option<AhoCorasick>,
    cut: Vec<bool>,
    /// What the post-processor puts around a completion prompt (vLLM
    /// tokenizes completions with `add_special_tokens`, chats without).
    completion_prefix: Vec<u32>,
    completion_suffix: Vec<u32>,
    /// Seed of this tokenizer's cache keys (its files' hash).
    seed: u64,
    /// A request failed already (warned once).
    warned: AtomicBool,
    /// Whether the chat template is still used (see [`TemplateState`]).
    template: TemplateHealth,
}

/// What a chat template has shown so far, until reload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TemplateState {
    Ok,
    /// Failed on a request with an error of its own.
    Failed,
    /// Spent more than [`TEMPLATE_FUEL_PER_MESSAGE`] per message.
    Costly,
}

impl TemplateState {
    pub fn name(self) -> &'static str {
        match self {
            TemplateState::Ok => "ok",
            TemplateState::Failed => "failed",
            TemplateState::Costly => "costly",
        }
    }
}

/// A template's state, why, and the chats routed around it.
#[derive(Default)]
struct TemplateHealth {
    /// 0 ok, 1 failed, 2 costly.
    state: std::sync::atomic::AtomicU8,
    why: Mutex<String>,
    /// Chats routed on the approximate index because of it.
    skipped: AtomicU64,
    /// Chats the template refused (`raise_exception`).
    refused: AtomicU64,
}

impl fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

/// Why a tokenizer could not be used.
#[derive(Debug, Clone)]
pub struct TokenizeError(pub String);

impl fmt::Display for TokenizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn err(what: impl fmt::Display) -> TokenizeError {
    TokenizeError(what.to_string())
}

/// A special token in `tokenizer_config.json`: a string or `{"content": ..}`.
fn token_string(v: Option<&serde_json::Value>) -> String {
    match v {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Object(o)) => o
            .get("content")
            .and_then(|c| c.as_str())
            .unwrap_or("")
            .to_owned(),
        _ => String::new(),
    }
}

impl ModelTokenizer {
    /// Reads `dir/tokenizer.json` and `dir/tokenizer_config.json` (its
    /// `chat_template`: a string, or a list of named ones, "default" taken).
    pub fn load(dir: &Path) -> Result<ModelTokenizer, TokenizeError> {
        let tk_path = dir.join("tokenizer.json");
        let cfg_path = dir.join("tokenizer_config.json");
        let tk_bytes =
            std::fs::read(&tk_path).map_err(|e| err(format!("{}: {e}", tk_path.display())))?;
        let mut tokenizer = Tokenizer::from_bytes(&tk_bytes)
            .map_err(|e| err(format!("{}: {e}", tk_path.display())))?;
        // The engine tokenizes the whole prompt; truncation or padding set
        // in the file would make pieces differ from the whole.
        tokenizer
            .with_truncation(None)
            .map_err(|e| err(format!("{}: {e}", tk_path.display())))?;
        tokenizer.with_padding(None);
        let cfg_bytes =
            std::fs::read(&cfg_path).map_err(|e| err(format!("{}: {e}", cfg_path.display())))?;
        let cfg: serde_json::Value = serde_json::from_slice(&cfg_bytes)
            .map_err(|e| err(format!("{}: {e}", cfg_path.display())))?;
        let template = match cfg.get("chat_template") {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .or_else(|| list.first())
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .unwrap_or("")
                .to_owned(),
            _ => String::new(),
        };
        if template.is_empty() {
            return Err(err(format!("{}: no chat_template", cfg_path.display())));
        }
        let mut env = Environment::new();
        // As transformers compiles chat templates (Jinja2 with these two).
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, _> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                format!("{RAISED}{msg}"),
            ))
        });
        env.add_template_owned("chat", template)
            .map_err(|e| err(format!("{}: chat_template: {e}", cfg_path.display())))?;
        let added_tokens = tokenizer.get_added_tokens_decoder();
        let mut added: Vec<_> = added_tokens
            .values()
            .filter(|t| !t.normalized && !t.content.is_empty())
            .collect();
        added.sort_by(|a, b| a.content.cmp(&b.content));
        let cut = added.iter().map(|t| !t.lstrip && !t.single_word).collect();
        let automaton = if added.is_empty() {
            None
        } else {
            Some(
                AhoCorasick::builder()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build(added.iter().map(|t| t.content.as_str()))
                    .map_err(err)?,
            )
        };
        let mut t = ModelTokenizer {
            dir: dir.to_owned(),
            tokenizer,
            env,
            bos: token_string(cfg.get("bos_token")),
            eos: token_string(cfg.get("eos_token")),
            added: automaton,
            cut,
            completion_prefix: Vec::new(),
            completion_suffix: Vec::new(),
            seed: xxh3_64_with_seed(&cfg_bytes, xxh3_64(&tk_bytes)),
            warned: AtomicBool::new(false),
            template: TemplateHealth::default(),
        };
        // What the post-processor adds, seen on a probe text.
        let probe = "a";
        let bare = t.encode(probe, false)?;
        let full = t.encode(probe, true)?;
        let at = (0..=full.len().saturating_sub(bare.len()))
            .find(|&i| full[i..].starts_with(&bare))
            .ok_or_else(|| err("the post-processor changes the text's own tokens"))?;
        t.completion_prefix = full[..at].to_vec();
        t.completion_suffix = full[at + bare.len()..].to_vec();
        Ok(t)
    }

    /// Where it was read from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The token ids of `text`, whole, with or without the post-processor's
    /// special tokens.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizeError> {
        self.tokenizer
            .encode_fast(text, add_special)
            .map(|e| e.get_ids().to_vec())
            .map_err(err)
    }

    /// Renders the chat of `messages` (role, content) with the generation
    /// prompt, as the engine does before tokenizing. What it costs is
    /// weighed (see [`TemplateState`]): a template that fails or costs too
    /// much is marked so; a render that succeeded is returned even so.
    pub fn render_chat(&self, messages: &[(&str, &str)]) -> Result<String, TokenizeError> {
        if !self.use_template() {
            return Err(err(
                "the chat template is not used (failed or costly earlier)",
            ));
        }
        let msgs: Vec<Value> = messages
            .iter()
            .map(|(role, content)| context! { role => role, content => content })
            .collect();
        let tmpl = self.env.get_template("chat").map_err(err)?;
        let allowed = TEMPLATE_FUEL_BASE + TEMPLATE_FUEL_PER_MESSAGE * messages.len() as u64;
        let rendered = tmpl.render_captured(context! {
            messages => msgs,
            add_generation_prompt => true,
            bos_token => &self.bos,
            eos_token => &self.eos,
        });
        match rendered {
            Ok(captured) => {
                let spent = captured.state().fuel_levels().map_or(0, |(used, _)| used);
                let text = captured.into_output();
                if spent > allowed {
                    self.mark(
                        TemplateState::Costly,
                        format!(
                            "{spent} fuel units for {} messages (at most {TEMPLATE_FUEL_PER_MESSAGE} a message)",
                            messages.len()
                        ),
                    );
                }
                Ok(text)
            }
            Err(e) if e.kind() == minijinja::ErrorKind::OutOfFuel => {
                if TEMPLATE_FUEL > allowed {
                    self.mark(
                        TemplateState::Costly,
                        format!(
                            "ran out of fuel ({TEMPLATE_FUEL} units) on {} messages",
                            messages.len()
                        ),
                    );
                }
                Err(err(format!("chat_template: {e}")))
            }
            Err(e) if format!("{e:#}").contains(RAISED) => {
                self.template.refused.fetch_add(1, Relaxed);
                Err(err(format!("chat_template: {e}")))
            }
            Err(e) => {
                self.mark(TemplateState::Failed, format!("{e:#}"));
                Err(err(format!("chat_template: {e}")))
            }
        }
    }

    /// Whether a chat is to be rendered with the template (not marked);
    /// a chat that is not is counted.
    pub fn use_template(&self) -> bool {
        let usable = self.template.state.load(Relaxed) == 0;
        if !usable {
            self.template.skipped.fetch_add(1, Relaxed);
        }
        usable
    }

    /// The template's state, why it left `Ok`, the chats routed around it
    /// since, and the chats it refused.
    pub fn template_state(&self) -> (TemplateState, String, u64, u64) {
        let t = &self.template;
        let state = match t.state.load(Relaxed) {
            0 => TemplateState::Ok,
            1 => TemplateState::Failed,
            _ => TemplateState::Costly,
        };
        let why = t.why.lock().unwrap_or_else(|p| p.into_inner()).clone();
        (state, why, t.skipped.load(Relaxed), t.refused.load(Relaxed))
    }

    /// Marks the template (the first mark stands until reload), warning once.
    fn mark(&self, state: TemplateState, why: String) {
        let code = if state == TemplateState::Failed { 1 } else { 2 };
        if self
            .template
            .state
            .compare_exchange(0, code, Relaxed, Relaxed)
            .is_err()
        {
            return;
        }
        tracing::warn!(
            tokenizer = %self.dir.display(),
            state = state.name(),
            why = %why,
            "precise mode: the chat template is not used until reload; chats of its models route on the approximate index"
        );
        *self.template.why.lock().unwrap_or_else(|p| p.into_inner()) = why;
    }

    /// Forgets what the template showed (a reload).
    pub fn reset_template(&self) {
        self.template
            .why
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        self.template.state.store(0, Relaxed);
    }

    /// Appends the tokens of `text` (no post-processing) to `out`, piece by
    /// piece through `pool`. A piece that ends after `defer_from` and is not
    /// in the pool stops the walk: its start is returned, and `out` holds
    /// the exact tokens of the text before it.
    fn pieces_into(
        &self,
        text: &str,
        pool: &TokenPool,
        out: &mut Vec<u32>,
        defer_from: usize,
    ) -> Result<Option<usize>, TokenizeError> {
        let mut from = 0;
        if let Some(ac) = &self.added {
            for m in ac.find_iter(text) {
                if self.cut[m.pattern().as_usize()] && m.start() > from {
                    if !self.piece_into(
                        &text[from..m.start()],
                        pool,
                        out,
                        m.start() > defer_from,
                    )? {
                        return Ok(Some(from));
                    }
                    from = m.start();
                }
            }
        }
        if !self.piece_into(&text[from..], pool, out, text.len() > defer_from)? {
            return Ok(Some(from));
        }
        Ok(None)
    }

    /// Appends the tokens of `piece`; false (nothing appended) when it is
    /// not in the pool and `defer` says to leave it.
    fn piece_into(
        &self,
        piece: &str,
        pool: &TokenPool,
        out: &mut Vec<u32>,
        defer: bool,
    ) -> Result<bool, TokenizeError> {
        if piece.is_empty() {
            return Ok(true);
        }
        let key = xxh3_64_with_seed(piece.as_bytes(), self.seed);
        if pool.get_into(key, out) {
            return Ok(true);
        }
        if defer {
            return Ok(false);
        }
        pool.tokenized.fetch_add(1, Relaxed);
        let toks = self.encode(piece, false)?;
        out.extend_from_slice(&toks);
        pool.put(key, toks.into_boxed_slice());
        Ok(true)
    }

    /// The engine's tokens of a chat whose canonical form (`RS role US
    /// text` per message, as `prompt::extract` writes it) is `canonical`.
    /// A short last message not in `pool` is left to the pool's thread
    /// (see the module's text): `out` then holds the tokens before it.
    /// `cut`: `canonical` is the start of a longer prompt (`keys::cut`);
    /// the tokens end where its last message's text ends, less
    /// [`CUT_MARGIN_TOKENS`].
    pub fn chat_tokens(
        self: &Arc<Self>,
        canonical: &[u8],
        cut: bool,
        pool: &TokenPool,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizeError> {
        let canonical = std::str::from_utf8(canonical).map_err(err)?;
        let messages: Vec<(&str, &str)> = canonical
            .split(MESSAGE_START as char)
            .skip(1)
            .map(|m| m.split_once(ROLE_END as char).unwrap_or((m, "")))
            .collect();
        let text = self.render_chat(&messages)?;
        if cut {
            // The rendered text up to the cut message's end (the template
            // copies it whole; if it does not, the tokens after it are
            // not the engine's and simply match nothing).
            let end = messages
                .last()
                .map(|(_, last)| {
                    let mut from = last.len().saturating_sub(64);
                    while !last.is_char_boundary(from) {
                        from += 1;
                    }
                    let tail = &last[from..];
                    memchr::memmem::rfind(text.as_bytes(), tail.as_bytes())
                        .map_or(text.len(), |at| at + tail.len())
                })
                .unwrap_or(text.len());
            self.pieces_into(&text[..end], pool, out, usize::MAX)?;
            out.truncate(out.len().saturating_sub(CUT_MARGIN_TOKENS));
            return Ok(());
        }
        // Where the last message's text starts in the rendered chat (the
        // template copies it whole; if it does not, nothing is left).
        let defer_from = match messages.last() {
            Some((_, last)) if !last.is_empty() && last.len() <= pool.defer_bytes => {
                memchr::memmem::rfind(text.as_bytes(), last.as_bytes()).unwrap_or(usize::MAX)
            }
            _ => usize::MAX,
        };
        if let Some(at) = self.pieces_into(&text, pool, out, defer_from)? {
            pool.defer(self, &text[at..]);
        }
        Ok(())
    }

    /// The engine's tokens of a completion prompt (`cut`: the start of a
    /// longer one, see [`Self::chat_tokens`]).
    pub fn completion_tokens(
        &self,
        text: &[u8],
        cut: bool,
        pool: &TokenPool,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizeError> {
        let text = std::str::from_utf8(text).map_err(err)?;
        out.extend_from_slice(&self.completion_prefix);
        self.pieces_into(text, pool, out, usize::MAX)?;
        if cut {
            out.truncate(out.len().saturating_sub(CUT_MARGIN_TOKENS));
        } else {
            out.extend_from_slice(&self.completion_suffix);
        }
        Ok(())
    }

    /// Reports a failure on a request, once per tokenizer.
    pub fn warn_once(&self, e: &TokenizeError) {
        if !self.warned.swap(true, Relaxed) {
            tracing::warn!(
                tokenizer = %self.dir.display(),
                error = %e,
                "precise mode: tokenizing a request failed; such requests route on the \
                 approximate index (reported once)"
            );
        }
    }
}

/// Tokens of pieces of text already seen, keyed by a hash of the piece (and
/// the tokenizer), least recently used dropped first, bounded in tokens. A
/// 64-bit key collision would give a request wrong tokens: a worse route,
/// never a wrong answer.
pub struct TokenCache {
    map: lru::LruCache<u64, Box<[u32]>>,
    tokens: usize,
    budget: usize,
}

impl Default for TokenCache {
    fn default() -> Self {
        TokenCache::new(DEFAULT_CACHE_TOKENS)
    }
}

impl TokenCache {
    pub fn new(budget: usize) -> TokenCache {
        TokenCache {
            map: lru::LruCache::unbounded(),
            tokens: 0,
            budget,
        }
    }

    /// Tokens held.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    fn get(&mut self, key: u64) -> Option<&[u32]> {
        self.map.get(&key).map(|b| &**b)
    }

    fn put(&mut self, key: u64, toks: Box<[u32]>) {
        // A piece over the whole budget is not kept (a huge one-off document).
        if toks.len() > self.budget {
            return;
        }
        self.tokens += toks.len();
        if let Some(old) = self.map.put(key, toks) {
            self.tokens -= old.len();
        }
        self.trim();
    }

    fn trim(&mut self) {
        while self.tokens > self.budget {
            match self.map.pop_lru() {
                Some((_, old)) => self.tokens -= old.len(),
                None => break,
            }
        }
    }
}

/// A message left to the pool's thread.
struct Deferred {
    tokenizer: Arc<ModelTokenizer>,
    text: String,
}

/// The tokens of pieces already seen, shared by every worker: a
/// [`TokenCache`] per shard, and the thread that tokenizes what requests
/// left (see the module's text). The thread ends when the pool is dropped.
pub struct TokenPool {
    shards: Box<[Mutex<TokenCache>]>,
    /// Longest last message left to the thread (0: none is).
    defer_bytes: usize,
    queue: Option<SyncSender<Deferred>>,
    /// Pieces tokenized on a request's wait.
    pub tokenized: AtomicU64,
    /// Messages left to the thread, and those dropped with its queue full.
    pub deferred: AtomicU64,
    pub dropped: AtomicU64,
}

impl fmt::Debug for TokenPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenPool")
            .field("shards", &self.shards.len())
            .field("defer_bytes", &self.defer_bytes)
            .finish_non_exhaustive()
    }
}

impl TokenPool {
    /// A pool of `budget` tokens leaving last messages up to `defer_bytes`
    /// to its own thread.
    pub fn new(budget: usize, defer_bytes: usize) -> Arc<TokenPool> {
        let per_shard = (budget / POOL_SHARDS).max(1);
        let shards = (0..POOL_SHARDS)
            .map(|_| Mutex::new(TokenCache::new(per_shard)))
            .collect();
        if defer_bytes == 0 {
            return Arc::new(TokenPool::with(shards, 0, None));
        }
        let (tx, rx) = sync_channel(DEFER_QUEUE);
        // The thread upgrades its handle only for a job, and jobs come
        // after the pool is built.
        Arc::new_cyclic(|weak: &Weak<TokenPool>| {
            let weak = weak.clone();
            let spawned = std::thread::Builder::new()
                .name("precise-tokenize".into())
                .spawn(move || tokenize_deferred(&weak, &rx));
            match spawned {
                Ok(_) => TokenPool::with(shards, defer_bytes, Some(tx)),
                Err(e) => {
                    tracing::warn!(error = %e, "precise mode: no tokenizing thread; every message is tokenized on its request's wait");
                    TokenPool::with(shards, 0, None)
                }
            }
        })
    }

    fn with(
        shards: Box<[Mutex<TokenCache>]>,
        defer_bytes: usize,
        queue: Option<SyncSender<Deferred>>,
    ) -> TokenPool {
        TokenPool {
            shards,
            defer_bytes,
            queue,
            tokenized: AtomicU64::new(0),
            deferred: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
        }
    }

    fn shard(&self, key: u64) -> std::sync::MutexGuard<'_, TokenCache> {
        // The key is a hash: its top bits pick the shard. A worker that
        // panicked holding a shard left a whole cache; keep using it.
        let i = (key >> 60) as usize % self.shards.len();
        self.shards[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends the tokens of the piece `key` to `out`; false if not held.
    fn get_into(&self, key: u64, out: &mut Vec<u32>) -> bool {
        match self.shard(key).get(key) {
            Some(toks) => {
                out.extend_from_slice(toks);
                true
            }
            None => false,
        }
    }

    fn put(&self, key: u64, toks: Box<[u32]>) {
        self.shard(key).put(key, toks);
    }

    /// Tokens held.
    pub fn tokens(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).tokens())
            .sum()
    }

    /// Leaves `text` (pieces of `tokenizer`'s) to the thread.
    fn defer(&self, tokenizer: &Arc<ModelTokenizer>, text: &str) {
        let Some(q) = &self.queue else {
            return;
        };
        let job = Deferred {
            tokenizer: tokenizer.clone(),
            text: text.to_owned(),
        };
        match q.try_send(job) {
            Ok(()) => self.deferred.fetch_add(1, Relaxed),
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.dropped.fetch_add(1, Relaxed)
            }
        };
    }
}

/// The pool's thread: tokenizes what requests left, into the pool, until
/// the pool is gone.
fn tokenize_deferred(pool: &Weak<TokenPool>, rx: &Receiver<Deferred>) {
    let mut sink = Vec::new();
    while let Ok(job) = rx.recv() {
        let Some(pool) = pool.upgrade() else {
            return;
        };
        sink.clear();
        if let Err(e) = job
            .tokenizer
            .pieces_into(&job.text, &pool, &mut sink, usize::MAX)
        {
            job.tokenizer.warn_once(&e);
        }
    }
}

/// The tokenizing pool's bounds (`[precise]`, documented there).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub threads: usize,
    pub queue: usize,
    pub max_tokens: usize,
}

/// Which tokenizer a model's requests use.
#[derive(Clone, Debug)]
pub enum Choice {
    /// None configured: `sim-engine`'s 4-byte tokenizer (`keys`).
    Toy,
    /// The model's own.
    Model(Arc<ModelTokenizer>),
    /// Configured but not loaded (reported at start): the approximate index.
    Unavailable,
}

/// Every configured tokenizer, loaded at start.
#[derive(Debug)]
pub struct Tokenizers {
    default: Choice,
    models: BTreeMap<String, Choice>,
    /// The tokens of pieces seen, every model's (keys are seeded per
    /// tokenizer).
    pub pool: Arc<TokenPool>,
    /// The threads that tokenize for the traffic workers.
    pub offload: Offload,
    /// Most tokens of a prompt routing uses (`tokenizer_max_tokens`).
    pub max_tokens: usize,
}

impl Default for Tokenizers {
    fn default() -> Self {
        Tokenizers {
            default: Choice::Toy,
            models: BTreeMap::new(),
            pool: TokenPool::new(DEFAULT_CACHE_TOKENS, 0),
            offload: Offload::none(),
            max_tokens: DEFAULT_MAX_TOKENS,
        }
    }
}

/// Default most tokens of a prompt routing uses: 16,384 (1,024 blocks of
/// 16), cut from the first 64 KiB of the prompt
/// ([`CUT_BYTES_PER_TOKEN`]). Tokenizing that much cold costs about 30 ms
/// (decision 0047); two prompts alike that far are routed alike, and past
/// it a backend that holds it all is credited with what the approximate
/// index says it holds beyond.
pub const DEFAULT_MAX_TOKENS: usize = 16 << 10;

/// Bytes of prompt cut per token of the budget: about a token of English
/// text (the toy tokenizer's exactly). Denser text gives more tokens,
/// which are dropped past the budget.
pub const CUT_BYTES_PER_TOKEN: usize = 4;

impl Tokenizers {
    /// Loads `default_dir` (for every model without an entry) and each
    /// model's directory. A failure is logged (once, here) and leaves that
    /// model on the approximate index. `pool`: where their tokens are kept.
    pub fn load(
        default_dir: Option<&Path>,
        models: &BTreeMap<String, PathBuf>,
        pool: Arc<TokenPool>,
        limits: Limits,
    ) -> Tokenizers {
        let load = |dir: &Path, model: &str| match ModelTokenizer::load(dir) {
            Ok(t) => {
                tracing::info!(model, tokenizer = %dir.display(), "precise mode: tokenizer loaded");
                Choice::Model(Arc::new(t))
            }
            Err(e) => {
                tracing::warn!(
                    model,
                    tokenizer = %dir.display(),
                    error = %e,
                    "precise mode: tokenizer not loaded; this model routes on the approximate index"
                );
                Choice::Unavailable
            }
        };
        let default = default_dir.map_or(Choice::Toy, |d| load(d, "*"));
        let models: BTreeMap<String, Choice> = models
            .iter()
            .map(|(m, d)| (m.clone(), load(d, m)))
            .collect();
        let any_model = std::iter::once(&default)
            .chain(models.values())
            .any(|c| matches!(c, Choice::Model(_)));
        let offload = if any_model {
            Offload::start(
                limits.threads,
                limits.queue,
                pool.clone(),
                limits.max_tokens,
            )
        } else {
            Offload::none()
        };
        Tokenizers {
            default,
            models,
            pool,
            offload,
            max_tokens: limits.max_tokens.max(1),
        }
    }

    /// Every model tokenizer by the model it serves (`*`: the default).
    pub fn loaded(&self) -> Vec<(&str, &Arc<ModelTokenizer>)> {
        std::iter::once(("*", &self.default))
            .chain(self.models.iter().map(|(m, c)| (m.as_str(), c)))
            .filter_map(|(m, c)| match c {
                Choice::Model(t) => Some((m, t)),
                Choice::Toy | Choice::Unavailable => None,
            })
            .collect()
    }

    /// A reload: every template is used again until it shows otherwise.
    pub fn reset_templates(&self) {
        for (_, t) in self.loaded() {
            t.reset_template();
        }
    }

    /// The tokenizer of `model` (the request's `model` field).
    pub fn for_model(&self, model: &[u8]) -> &Choice {
        std::str::from_utf8(model)
            .ok()
            .and_then(|m| self.models.get(m))
            .unwrap_or(&self.default)
    }
}

#[cfg(test)]
mod tests;
