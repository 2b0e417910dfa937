//! One pass over a prompt-carrying JSON body: the whole body is validated as
//! JSON (a clear 400 otherwise), only the fields routing needs are read, and
//! the canonical prompt is recorded as pieces of the body itself (plus a
//! small side buffer for decoded escapes, separators and token ids). No copy
//! of the body, no document: the block hasher then reads the pieces once.
//!
//! `extract::Extractor` (simd-json and serde on a scratch copy) is the
//! reference: for every body both accept, the seed, the user and the
//! canonical bytes are equal (`scan/tests.rs`, a property test).

use xxhash_rust::xxh3::xxh3_64;

use crate::error::{Kind, RouterError};
use crate::prompt::extract::{Endpoint, MESSAGE_START, Prompt, ROLE_END};
use crate::prompt::hash::namespace_seed;

/// One piece of the canonical prompt.
#[derive(Clone, Copy, Debug)]
enum Piece {
    /// Bytes `start..end` of the body, as they are.
    Body(usize, usize),
    /// Bytes `start..end` of the side buffer.
    Aux(usize, usize),
}

/// The canonical prompt of one body, as pieces: its first
/// [`Canonical::set_limit`] bytes, and the length of all of it.
#[derive(Debug)]
pub struct Canonical {
    pieces: Vec<Piece>,
    aux: Vec<u8>,
    /// Bytes of the whole canonical prompt.
    len: usize,
    /// Bytes the pieces hold: `len` up to `limit`.
    kept: usize,
    /// Most bytes kept; what comes after is counted, never copied or
    /// decoded into a buffer (kept across `clear`).
    limit: usize,
    /// Side-buffer bytes merge only into pieces from this one on (a
    /// message's content is moved behind its header afterwards).
    merge_from: usize,
    /// The prompt was given as token ids.
    token_ids: bool,
    /// The body's `cache_salt` (empty: none).
    salt: Vec<u8>,
    /// The body's `model` (empty: none), for precise mode's tokenizer and
    /// the model filter.
    model: Vec<u8>,
    /// The body's `lora_path` (empty: none), for the model filter.
    adapter: Vec<u8>,
    /// A chat message has the role `assistant`: the conversation is past
    /// its first turn.
    answered: bool,
    /// A Responses body's `previous_response_id` (empty: none).
    previous_response: Vec<u8>,
    /// A Responses body asks the engine to store its answer (`store`,
    /// true unless false).
    store: bool,
    /// The body's `service_tier` (empty: none).
    tier: Vec<u8>,
    /// The body has a top-level `priority` (whatever its value).
    priority: bool,
}

impl Default for Canonical {
    fn default() -> Canonical {
        Canonical {
            pieces: Vec::new(),
            aux: Vec::new(),
            len: 0,
            kept: 0,
            limit: usize::MAX,
            merge_from: 0,
            token_ids: false,
            salt: Vec::new(),
            model: Vec::new(),
            adapter: Vec::new(),
            answered: false,
            previous_response: Vec::new(),
            store: false,
            tier: Vec::new(),
            priority: false,
        }
    }
}

impl Canonical {
    /// Bytes of the whole canonical prompt (kept or not).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Keeps at most the first `limit` bytes of the canonical prompt from
    /// the next scan on (the most any reader reads: the router's is
    /// `Router::canonical_limit`). Past it a scan still validates the
    /// body and counts the prompt's bytes, but copies and decodes none:
    /// a 30 MiB message costs a pass over its bytes, not two copies of
    /// them in fresh memory.
    pub fn set_limit(&mut self, limit: usize) {
        self.limit = limit;
    }

    /// Room left under the limit.
    fn room(&self) -> usize {
        self.limit.saturating_sub(self.kept)
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn clear(&mut self) {
        self.pieces.clear();
        self.aux.clear();
        self.len = 0;
        self.kept = 0;
        self.merge_from = 0;
        self.token_ids = false;
        self.salt.clear();
        self.model.clear();
        self.adapter.clear();
        self.answered = false;
        self.previous_response.clear();
        self.store = false;
        self.tier.clear();
        self.priority = false;
    }

    /// Whether the body has a top-level `priority` (the client's word to
    /// the engine, which `classes.engine_priority` leaves as it is).
    pub fn priority_given(&self) -> bool {
        self.priority
    }

    /// The body's `service_tier` (empty: none); `Class::of_tier` reads it.
    pub fn tier(&self) -> &[u8] {
        &self.tier
    }

    /// A Responses body's `previous_response_id` (empty: none).
    pub fn previous_response(&self) -> &[u8] {
        &self.previous_response
    }

    /// Whether the engine stores the answer under its id (a Responses body
    /// without `store: false`).
    pub fn stores(&self) -> bool {
        self.store
    }

    /// Whether a chat holds an earlier answer (a message of role
    /// `assistant`): a conversation past its first turn, whose history is
    /// at stake where it is cached.
    pub fn answered(&self) -> bool {
        self.answered
    }

    /// Whether the prompt was given as token ids (precise mode tokenizes
    /// nothing then).
    pub fn token_ids(&self) -> bool {
        self.token_ids
    }

    /// The body's `cache_salt` (empty: none).
    pub fn salt(&self) -> &[u8] {
        &self.salt
    }

    /// The body's `model` (empty: none).
    pub fn model(&self) -> &[u8] {
        &self.model
    }

    /// The body's `lora_path` (empty: none).
    pub fn adapter(&self) -> &[u8] {
        &self.adapter
    }

    fn body(&mut self, start: usize, end: usize) {
        let n = end - start;
        self.len += n;
        let k = n.min(self.room());
        if k > 0 {
            self.pieces.push(Piece::Body(start, start + k));
            self.kept += k;
        }
    }

    fn aux(&mut self, bytes: &[u8]) {
        self.aux_of(bytes, bytes.len());
    }

    /// Side-buffer bytes standing for `total` bytes of the prompt (more
    /// when a decoded string was cut at the limit): what fits is kept.
    fn aux_of(&mut self, bytes: &[u8], total: usize) {
        let bytes = &bytes[..bytes.len().min(self.room())];
        self.len += total;
        if bytes.is_empty() {
            return;
        }
        let start = self.aux.len();
        self.aux.extend_from_slice(bytes);
        // Adjacent side-buffer bytes are one piece.
        let n = self.pieces.len();
        match self.pieces.last_mut() {
            Some(Piece::Aux(_, end)) if *end == start && n > self.merge_from => {
                *end = self.aux.len()
            }
            _ => self.pieces.push(Piece::Aux(start, self.aux.len())),
        }
        self.kept += bytes.len();
    }

    /// The pieces' bytes in order; `body` is the body scanned.
    pub fn pieces<'a>(&'a self, body: &'a [u8]) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.pieces.iter().map(move |p| match *p {
            Piece::Body(s, e) => &body[s..e],
            Piece::Aux(s, e) => &self.aux[s..e],
        })
    }

    /// The pieces' bytes in order, cut after the first `max` bytes.
    pub fn pieces_upto<'a>(
        &'a self,
        body: &'a [u8],
        max: usize,
    ) -> impl Iterator<Item = &'a [u8]> + 'a {
        let mut left = max;
        self.pieces(body).map_while(move |p| {
            if left == 0 {
                return None;
            }
            let p = &p[..p.len().min(left)];
            left -= p.len();
            Some(p)
        })
    }

    /// Writes the canonical prompt (what was kept of it) to `out`
    /// (cleared first).
    pub fn write_to(&self, body: &[u8], out: &mut Vec<u8>) {
        out.clear();
        out.reserve(self.kept);
        for p in self.pieces(body) {
            out.extend_from_slice(p);
        }
    }

    /// Writes at most the first `max` bytes of the canonical prompt to
    /// `out` (cleared first); true when that is not all of it.
    pub fn write_prefix_to(&self, body: &[u8], out: &mut Vec<u8>, max: usize) -> bool {
        out.clear();
        out.reserve(self.kept.min(max));
        for p in self.pieces(body) {
            let room = max - out.len();
            if p.len() >= room {
                out.extend_from_slice(&p[..room]);
                return self.len > max;
            }
            out.extend_from_slice(p);
        }
        self.len > out.len()
    }

    /// Gives back a side buffer over `keep` bytes.
    pub fn shrink(&mut self, keep: usize) {
        if self.aux.capacity() > keep {
            self.aux = Vec::new();
        }
        if self.pieces.capacity() > keep / 16 {
            self.pieces = Vec::new();
        }
    }
}

/// The Messages and Responses readers write here (`prompt::apis`).
impl crate::prompt::apis::Sink for Canonical {
    fn push_message(&mut self, role: &[u8]) {
        self.aux(&[MESSAGE_START]);
        self.aux(role);
        self.aux(&[ROLE_END]);
        self.answered |= role == b"assistant";
    }

    fn push_text(&mut self, text: &[u8]) {
        self.aux(text);
    }

    fn set_tier(&mut self, tier: &[u8]) {
        self.tier.clear();
        self.tier.extend_from_slice(&tier[..tier.len().min(32)]);
    }

    fn set_priority_given(&mut self) {
        self.priority = true;
    }

    fn set_fields(&mut self, model: &[u8], salt: &[u8], previous: &[u8], store: bool) {
        self.model.extend_from_slice(model);
        self.salt.extend_from_slice(salt);
        self.previous_response.extend_from_slice(previous);
        self.store = store;
        self.answered |= !previous.is_empty();
    }
}

/// Reads `body` for `endpoint` into `canon` (cleared first). Errors are 400s
/// naming the problem.
pub fn scan(endpoint: Endpoint, body: &[u8], canon: &mut Canonical) -> Result<Prompt, RouterError> {
    canon.clear();
    match endpoint {
        Endpoint::Messages => return crate::prompt::apis::messages(body, canon),
        Endpoint::Responses => return crate::prompt::apis::responses(body, canon),
        Endpoint::Chat | Endpoint::Completions | Endpoint::Generate => {}
    }
    let mut s = Scanner {
        b: body,
        i: 0,
        canon,
        key: Vec::new(),
        decoded_len: 0,
    };
    let fields = s.top(endpoint).map_err(|e| e.into_error(body))?;
    let field = |r: Option<Str>| r.map(|s| s.bytes(body, &fields.decoded));
    let model = field(fields.model).unwrap_or(&[]);
    let adapter = field(fields.lora_path).unwrap_or(&[]);
    let salt = field(fields.cache_salt).unwrap_or(&[]);
    let seed = namespace_seed(&[model, adapter, salt]);
    canon.salt.extend_from_slice(salt);
    canon.model.extend_from_slice(model);
    canon.adapter.extend_from_slice(adapter);
    if let Some(t) = field(fields.service_tier) {
        crate::prompt::apis::Sink::set_tier(canon, t);
    }
    canon.priority = fields.priority;
    let user = field(fields.user).map(xxh3_64);
    match endpoint {
        Endpoint::Chat if !fields.saw_prompt => Err(RouterError::new(
            Kind::InvalidBody,
            "'messages' is required for /v1/chat/completions",
        )),
        Endpoint::Completions if !fields.saw_prompt => Err(RouterError::new(
            Kind::InvalidBody,
            "'prompt' is required for /v1/completions",
        )),
        Endpoint::Generate if !fields.saw_prompt => match fields.input_ids {
            // `input_ids` came before any `text`: read it now.
            Some(at) => {
                let mut again = Scanner {
                    b: body,
                    i: at,
                    canon,
                    key: Vec::new(),
                    decoded_len: 0,
                };
                again
                    .prompt_input(true, false)
                    .map_err(|e| e.into_error(body))?;
                Ok(Prompt { seed, user })
            }
            None => Err(RouterError::new(
                Kind::InvalidBody,
                "'text' or 'input_ids' is required for /generate",
            )),
        },
        _ => Ok(Prompt { seed, user }),
    }
}

/// Why a body was refused, and where.
struct Bad {
    at: usize,
    what: &'static str,
}

impl Bad {
    fn into_error(self, body: &[u8]) -> RouterError {
        let line = 1 + memchr::memchr_iter(b'\n', &body[..self.at.min(body.len())]).count();
        RouterError::new(
            Kind::InvalidBody,
            format!(
                "request body is not valid JSON: {} at byte {} (line {line})",
                self.what, self.at
            ),
        )
    }
}

type Res<T> = Result<T, Bad>;

/// A string value: where its bytes are.
#[derive(Clone, Copy)]
enum Str {
    /// Bytes of the body (no escapes).
    Raw(usize, usize),
    /// Bytes of `Fields::decoded`.
    Decoded(usize, usize),
}

impl Str {
    fn bytes<'a>(self, body: &'a [u8], decoded: &'a [u8]) -> &'a [u8] {
        match self {
            Str::Raw(s, e) => &body[s..e],
            Str::Decoded(s, e) => &decoded[s..e],
        }
    }
}

/// The top-level fields routing reads.
#[derive(Default)]
struct Fields {
    model: Option<Str>,
    user: Option<Str>,
    cache_salt: Option<Str>,
    service_tier: Option<Str>,
    lora_path: Option<Str>,
    /// A `priority` is there.
    priority: bool,
    /// Decoded bytes of the fields above that had escapes.
    decoded: Vec<u8>,
    /// The endpoint's prompt was read into the canonical form.
    saw_prompt: bool,
    /// `/generate`: where `input_ids` starts, when it came before `text`.
    input_ids: Option<usize>,
}

/// Which top-level keys were seen (serde refuses duplicates of its fields).
#[derive(Default)]
struct Seen {
    model: bool,
    messages: bool,
    prompt: bool,
    text: bool,
    input_ids: bool,
    user: bool,
    cache_salt: bool,
    lora_path: bool,
    service_tier: bool,
}

/// Decoded bytes of a key kept: more than the longest key routing reads,
/// so a longer one, cut here, is classified as no key it knows.
const KEY_KEEP: usize = 64;

/// A buffer a string is decoded into, holding at most `max` bytes; the
/// string's whole decoded length is counted.
struct Kept<'o> {
    out: &'o mut Vec<u8>,
    max: usize,
    total: usize,
}

impl Kept<'_> {
    #[inline]
    fn put(&mut self, bytes: &[u8]) {
        self.total += bytes.len();
        let room = self.max.saturating_sub(self.out.len());
        self.out.extend_from_slice(&bytes[..bytes.len().min(room)]);
    }

    #[inline]
    fn byte(&mut self, b: u8) {
        self.total += 1;
        if self.out.len() < self.max {
            self.out.push(b);
        }
    }
}

struct Scanner<'a, 'c> {
    b: &'a [u8],
    i: usize,
    canon: &'c mut Canonical,
    /// A key with escapes, decoded.
    key: Vec<u8>,
    /// The whole decoded length of the last string with escapes (what its
    /// `Str::Decoded` holds may be cut, see `string_kept`).
    decoded_len: usize,
}

/// Bytes a string's fast scan stops at: the quote, a backslash, a control
/// character, or a byte of a multi-byte UTF-8 sequence.
#[inline]
fn special(c: u8) -> bool {
    // Bitwise, not short-circuit: the block scan below compiles to vector
    // compares. `c - 0x20 >= 0x60` is `c < 0x20 || c >= 0x80`.
    (c == b'"') | (c == b'\\') | (c.wrapping_sub(0x20) >= 0x60)
}

/// Bytes scanned at a time by the portable scan: a block the compiler turns
/// into vector compares.
const LANES: usize = 32;

/// The index of the first special byte of `b` at or after `i`, or
/// `b.len()`. With AVX2 (checked at run time) by explicit vector compares:
/// `special` is `c == '"' | c == '\\' | (c as i8) < 0x20`, three compares
/// a vector, 3.3x and 3.6x faster than the portable scan over 400 KB in
/// two runs (decision 0009, string scan with explicit vector
/// compares).
#[inline]
fn next_special(b: &[u8], i: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { simd::next_special_avx2(b, i) };
    }
    next_special_portable(b, i)
}

/// [`next_special`] without explicit vectors: the scan on CPUs without
/// AVX2, and the reference the vector scan is tested against.
fn next_special_portable(b: &[u8], mut i: usize) -> usize {
    while i + LANES <= b.len() {
        let block: &[u8; LANES] = b[i..i + LANES].try_into().expect("LANES bytes");
        if block.iter().fold(0u8, |acc, &c| acc | u8::from(special(c))) != 0 {
            break;
        }
        i += LANES;
    }
    while i < b.len() && !special(b[i]) {
        i += 1;
    }
    i
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::{
        __m256i, _mm256_cmpeq_epi8, _mm256_cmpgt_epi8, _mm256_loadu_si256, _mm256_movemask_epi8,
        _mm256_or_si256, _mm256_set1_epi8,
    };

    use super::special;

    /// 64 bytes a round (two vectors, one test), then 32, then byte by byte.
    ///
    /// # Safety
    /// The CPU must have AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn next_special_avx2(b: &[u8], mut i: usize) -> usize {
        let quote = _mm256_set1_epi8(b'"' as i8);
        let backslash = _mm256_set1_epi8(b'\\' as i8);
        let space = _mm256_set1_epi8(0x20);
        // Signed: below 0x20, or 0x80 and up (negative).
        let mask = |v: __m256i| {
            let m = _mm256_or_si256(
                _mm256_or_si256(_mm256_cmpeq_epi8(v, quote), _mm256_cmpeq_epi8(v, backslash)),
                _mm256_cmpgt_epi8(space, v),
            );
            _mm256_movemask_epi8(m) as u32
        };
        let load = |at: usize| {
            debug_assert!(at + 32 <= b.len());
            // SAFETY: `at + 32 <= b.len()` at every call below; unaligned
            // loads are allowed.
            unsafe { _mm256_loadu_si256(b.as_ptr().add(at).cast::<__m256i>()) }
        };
        while i + 64 <= b.len() {
            let (lo, hi) = (mask(load(i)), mask(load(i + 32)));
            if lo | hi != 0 {
                let both = u64::from(lo) | (u64::from(hi) << 32);
                return i + both.trailing_zeros() as usize;
            }
            i += 64;
        }
        if i + 32 <= b.len() {
            let m = mask(load(i));
            if m != 0 {
                return i + m.trailing_zeros() as usize;
            }
            i += 32;
        }
        while i < b.len() && !special(b[i]) {
            i += 1;
        }
        i
    }
}

impl<'a> Scanner<'a, '_> {
    fn bad<T>(&self, what: &'static str) -> Res<T> {
        Err(Bad { at: self.i, what })
    }

    #[inline]
    fn ws(&mut self) {
        while let Some(&c) = self.b.get(self.i) {
            if !matches!(c, b' ' | b'\t' | b'\n' | b'\r') {
                break;
            }
            self.i += 1;
        }
    }

    #[inline]
    fn peek(&mut self) -> Option<u8> {
        self.ws();
        self.b.get(self.i).copied()
    }

    fn eat(&mut self, c: u8, what: &'static str) -> Res<()> {
        if self.peek() == Some(c) {
            self.i += 1;
            Ok(())
        } else {
            self.bad(what)
        }
    }

    fn top(&mut self, endpoint: Endpoint) -> Res<Fields> {
        let mut f = Fields::default();
        let mut seen = Seen::default();
        if self.peek() != Some(b'{') {
            return self.bad("expected an object");
        }
        self.fields(top_key, |s, key| {
            match key {
                Key::Model => {
                    once(&mut seen.model, s)?;
                    f.model = s.opt_string(&mut f.decoded)?;
                }
                Key::User => {
                    once(&mut seen.user, s)?;
                    f.user = s.opt_string(&mut f.decoded)?;
                }
                Key::CacheSalt => {
                    once(&mut seen.cache_salt, s)?;
                    f.cache_salt = s.opt_string(&mut f.decoded)?;
                }
                Key::ServiceTier => {
                    once(&mut seen.service_tier, s)?;
                    f.service_tier = s.opt_string(&mut f.decoded)?;
                }
                Key::LoraPath => {
                    once(&mut seen.lora_path, s)?;
                    f.lora_path = s.opt_string(&mut f.decoded)?;
                }
                Key::Messages => {
                    once(&mut seen.messages, s)?;
                    let write = endpoint == Endpoint::Chat;
                    f.saw_prompt |= s.messages(write)? && write;
                }
                Key::Prompt => {
                    once(&mut seen.prompt, s)?;
                    let write = endpoint == Endpoint::Completions;
                    f.saw_prompt |= s.opt_prompt(write)? && write;
                }
                Key::Text => {
                    once(&mut seen.text, s)?;
                    let write = endpoint == Endpoint::Generate;
                    let wrote = s.opt_prompt(write)?;
                    if wrote && write {
                        // A `text` wins over `input_ids` wherever it is.
                        f.saw_prompt = true;
                        f.input_ids = None;
                    }
                }
                Key::InputIds => {
                    once(&mut seen.input_ids, s)?;
                    let at = s.i;
                    // Read it only if no `text` came first; a `text`
                    // later replaces it.
                    let present = s.opt_prompt(false)?;
                    if endpoint == Endpoint::Generate && present && !f.saw_prompt {
                        f.input_ids = Some(at);
                    }
                }
                Key::Priority => {
                    f.priority = true;
                    s.skip()?;
                }
                Key::Other => s.skip()?,
            }
            Ok(())
        })?;
        self.ws();
        if self.i != self.b.len() {
            return self.bad("trailing characters after the object");
        }
        Ok(f)
    }

    /// The fields of the object at the cursor: each key classified by
    /// `classify`, then `f` reads its value.
    fn fields<K>(
        &mut self,
        classify: fn(&[u8]) -> K,
        mut f: impl FnMut(&mut Self, K) -> Res<()>,
    ) -> Res<()> {
        self.i += 1; // the brace
        if self.peek() == Some(b'}') {
            self.i += 1;
            return Ok(());
        }
        loop {
            if self.peek() != Some(b'"') {
                return self.bad("expected a key");
            }
            let key = match self.string_kept(None, KEY_KEEP)? {
                Str::Raw(a, e) => classify(&self.b[a..e]),
                Str::Decoded(..) => classify(&self.key),
            };
            self.eat(b':', "expected ':'")?;
            f(self, key)?;
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b'}') => {
                    self.i += 1;
                    return Ok(());
                }
                _ => return self.bad("expected ',' or '}'"),
            }
        }
    }

    /// The elements of the array at the cursor (its bracket eaten), each
    /// read by `f`.
    fn elements(&mut self, mut f: impl FnMut(&mut Self) -> Res<()>) -> Res<()> {
        if self.peek() == Some(b']') {
            self.i += 1;
            return Ok(());
        }
        loop {
            f(self)?;
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b']') => {
                    self.i += 1;
                    return Ok(());
                }
                _ => return self.bad("expected ',' or ']'"),
            }
        }
    }

    /// A string or null.
    fn opt_string(&mut self, decoded: &mut Vec<u8>) -> Res<Option<Str>> {
        self.opt_string_kept(decoded, usize::MAX)
    }

    /// A string or null, as [`Self::string_kept`] reads it.
    fn opt_string_kept(&mut self, decoded: &mut Vec<u8>, keep: usize) -> Res<Option<Str>> {
        match self.peek() {
            Some(b'"') => self.string_kept(Some(decoded), keep).map(Some),
            Some(b'n') => self.literal(b"null").map(|()| None),
            _ => self.bad("expected a string or null"),
        }
    }

    /// A string at the cursor. Escaped strings are decoded into `decoded`
    /// when given, else into `self.key`.
    fn string(&mut self, decoded: Option<&mut Vec<u8>>) -> Res<Str> {
        self.string_kept(decoded, usize::MAX)
    }

    /// A string at the cursor. An escaped one is decoded into `decoded`
    /// (else `self.key`) up to `keep` bytes, the rest validated and
    /// counted, not stored: its whole decoded length is `decoded_len`.
    fn string_kept(&mut self, decoded: Option<&mut Vec<u8>>, keep: usize) -> Res<Str> {
        self.i += 1; // the quote
        let start = self.i;
        let mut utf8_from = None;
        loop {
            self.fast_scan();
            match self.b.get(self.i) {
                None => return self.bad("unterminated string"),
                Some(b'"') => {
                    let end = self.i;
                    self.i += 1;
                    self.check_utf8(utf8_from, end)?;
                    return Ok(Str::Raw(start, end));
                }
                Some(b'\\') => {
                    self.check_utf8(utf8_from, self.i)?;
                    return self.escaped(start, decoded, keep);
                }
                Some(&c) if c < 0x20 => return self.bad("control character in a string"),
                Some(_) => {
                    utf8_from.get_or_insert(self.i);
                    self.i += 1;
                }
            }
        }
    }

    /// Moves the cursor to the next special byte (or the end).
    #[inline]
    fn fast_scan(&mut self) {
        self.i = next_special(self.b, self.i);
    }

    fn check_utf8(&self, from: Option<usize>, end: usize) -> Res<()> {
        match from {
            Some(s) if std::str::from_utf8(&self.b[s..end]).is_err() => Err(Bad {
                at: s,
                what: "invalid UTF-8 in a string",
            }),
            _ => Ok(()),
        }
    }

    /// The rest of a string that has escapes, from `start` (its first byte)
    /// with the cursor on the first backslash; at most `keep` bytes of it
    /// decoded into the buffer.
    fn escaped(&mut self, start: usize, decoded: Option<&mut Vec<u8>>, keep: usize) -> Res<Str> {
        let mut key = std::mem::take(&mut self.key);
        let out = match decoded {
            Some(d) => d,
            None => {
                key.clear();
                &mut key
            }
        };
        let from = out.len();
        let mut out = Kept {
            max: from.saturating_add(keep),
            out,
            total: 0,
        };
        out.put(&self.b[start..self.i]);
        let r = self.decode_rest(&mut out);
        let end = out.out.len();
        self.decoded_len = out.total;
        self.key = key;
        r.map(|()| Str::Decoded(from, end))
    }

    /// Decodes up to the closing quote into `out`; the cursor is on a backslash.
    fn decode_rest(&mut self, out: &mut Kept) -> Res<()> {
        loop {
            let seg = self.i;
            self.fast_scan();
            let mut utf8_from = None;
            loop {
                match self.b.get(self.i) {
                    Some(&c) if c >= 0x80 => {
                        utf8_from.get_or_insert(self.i);
                        self.i += 1;
                        self.fast_scan();
                    }
                    _ => break,
                }
            }
            self.check_utf8(utf8_from, self.i)?;
            out.put(&self.b[seg..self.i]);
            match self.b.get(self.i) {
                None => return self.bad("unterminated string"),
                Some(b'"') => {
                    self.i += 1;
                    return Ok(());
                }
                Some(b'\\') => {
                    self.i += 1;
                    let Some(&e) = self.b.get(self.i) else {
                        return self.bad("unterminated string");
                    };
                    self.i += 1;
                    match e {
                        b'"' => out.byte(b'"'),
                        b'\\' => out.byte(b'\\'),
                        b'/' => out.byte(b'/'),
                        b'b' => out.byte(0x08),
                        b'f' => out.byte(0x0c),
                        b'n' => out.byte(b'\n'),
                        b'r' => out.byte(b'\r'),
                        b't' => out.byte(b'\t'),
                        b'u' => {
                            let c = self.unicode_escape()?;
                            let mut buf = [0u8; 4];
                            out.put(c.encode_utf8(&mut buf).as_bytes());
                        }
                        _ => {
                            self.i -= 1;
                            return self.bad("invalid escape");
                        }
                    }
                }
                Some(_) => return self.bad("control character in a string"),
            }
        }
    }

    fn hex4(&mut self) -> Res<u32> {
        let Some(h) = self.b.get(self.i..self.i + 4) else {
            return self.bad("truncated \\u escape");
        };
        let mut v = 0;
        for &c in h {
            let d = match c {
                b'0'..=b'9' => c - b'0',
                b'a'..=b'f' => c - b'a' + 10,
                b'A'..=b'F' => c - b'A' + 10,
                _ => return self.bad("invalid \\u escape"),
            };
            v = v << 4 | u32::from(d);
        }
        self.i += 4;
        Ok(v)
    }

    /// The code point of `\uXXXX` (the cursor after the `u`), with a
    /// surrogate pair read whole.
    fn unicode_escape(&mut self) -> Res<char> {
        let hi = self.hex4()?;
        let cp = if (0xD800..0xDC00).contains(&hi) {
            if self.b.get(self.i..self.i + 2) != Some(b"\\u") {
                return self.bad("lone surrogate in a \\u escape");
            }
            self.i += 2;
            let lo = self.hex4()?;
            if !(0xDC00..0xE000).contains(&lo) {
                return self.bad("lone surrogate in a \\u escape");
            }
            0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)
        } else if (0xDC00..0xE000).contains(&hi) {
            return self.bad("lone surrogate in a \\u escape");
        } else {
            hi
        };
        char::from_u32(cp).ok_or(Bad {
            at: self.i,
            what: "invalid \\u escape",
        })
    }

    fn literal(&mut self, word: &'static [u8]) -> Res<()> {
        if self.b.get(self.i..self.i + word.len()) == Some(word) {
            self.i += word.len();
            Ok(())
        } else {
            self.bad("invalid literal")
        }
    }

    /// A number; `Some(v)` when it is an integer that fits a `u32`
    /// (a token id), `None` for any other number.
    fn number(&mut self) -> Res<Option<u32>> {
        let b = self.b;
        let neg = b.get(self.i) == Some(&b'-');
        if neg {
            self.i += 1;
        }
        let digits = self.i;
        match b.get(self.i) {
            Some(b'0') => self.i += 1,
            Some(b'1'..=b'9') => {
                while b.get(self.i).is_some_and(u8::is_ascii_digit) {
                    self.i += 1;
                }
            }
            _ => return self.bad("invalid number"),
        }
        let int_end = self.i;
        let mut integer = true;
        if b.get(self.i) == Some(&b'.') {
            integer = false;
            self.i += 1;
            if !b.get(self.i).is_some_and(u8::is_ascii_digit) {
                return self.bad("invalid number");
            }
            while b.get(self.i).is_some_and(u8::is_ascii_digit) {
                self.i += 1;
            }
        }
        if matches!(b.get(self.i), Some(b'e' | b'E')) {
            integer = false;
            self.i += 1;
            if matches!(b.get(self.i), Some(b'+' | b'-')) {
                self.i += 1;
            }
            if !b.get(self.i).is_some_and(u8::is_ascii_digit) {
                return self.bad("invalid number");
            }
            while b.get(self.i).is_some_and(u8::is_ascii_digit) {
                self.i += 1;
            }
        }
        if !integer {
            return Ok(None);
        }
        let text = &b[digits..int_end];
        if neg {
            // -0 is 0; any other negative is no token id.
            return Ok((text == b"0").then_some(0));
        }
        if text.len() > 10 {
            return Ok(None);
        }
        let v = text.iter().fold(0u64, |v, &d| v * 10 + u64::from(d - b'0'));
        Ok(u32::try_from(v).ok())
    }

    /// Skips any value, validating it, without recursion.
    fn skip(&mut self) -> Res<()> {
        // Open containers: true for an object.
        let mut stack: Vec<bool> = Vec::new();
        loop {
            // A value.
            match self.peek() {
                Some(b'{') => {
                    self.i += 1;
                    if self.peek() == Some(b'}') {
                        self.i += 1;
                    } else {
                        stack.push(true);
                        self.skip_key()?;
                        continue;
                    }
                }
                Some(b'[') => {
                    self.i += 1;
                    if self.peek() == Some(b']') {
                        self.i += 1;
                    } else {
                        stack.push(false);
                        continue;
                    }
                }
                Some(b'"') => {
                    self.skip_string()?;
                }
                Some(b't') => self.literal(b"true")?,
                Some(b'f') => self.literal(b"false")?,
                Some(b'n') => self.literal(b"null")?,
                Some(b'-' | b'0'..=b'9') => {
                    self.number()?;
                }
                _ => return self.bad("expected a value"),
            }
            // After a value: close containers or go to the next element.
            loop {
                let Some(&object) = stack.last() else {
                    return Ok(());
                };
                match self.peek() {
                    Some(b',') => {
                        self.i += 1;
                        if object {
                            self.skip_key()?;
                        }
                        break;
                    }
                    Some(b'}') if object => {
                        self.i += 1;
                        stack.pop();
                    }
                    Some(b']') if !object => {
                        self.i += 1;
                        stack.pop();
                    }
                    _ => return self.bad("expected ',' or the end of a container"),
                }
            }
        }
    }

    fn skip_key(&mut self) -> Res<()> {
        if self.peek() != Some(b'"') {
            return self.bad("expected a key");
        }
        self.skip_string()?;
        self.eat(b':', "expected ':'")
    }

    /// Skips a string, validating its escapes and UTF-8 (nothing decoded
    /// is kept).
    fn skip_string(&mut self) -> Res<()> {
        let mut scratch = std::mem::take(&mut self.key);
        scratch.clear();
        let r = self.string_kept(Some(&mut scratch), 0).map(|_| ());
        self.key = scratch;
        r
    }

    /// A string whose bytes go to the canonical prompt when `write` (as
    /// much as the canonical form keeps, see `Canonical::set_limit`).
    fn canon_string(&mut self, write: bool) -> Res<()> {
        if !write {
            return self.skip_string();
        }
        let mut dec = std::mem::take(&mut self.key);
        dec.clear();
        let r = self.string_kept(Some(&mut dec), self.canon.room());
        let r = r.map(|s| self.canon_push(s, &dec, self.decoded_len));
        self.key = dec;
        r
    }

    /// A string read by [`Self::string_kept`] into the canonical prompt,
    /// its decoded bytes (if any) in `decoded`.
    fn canon_push(&mut self, s: Str, decoded: &[u8], decoded_len: usize) {
        match s {
            Str::Raw(a, e) => self.canon.body(a, e),
            Str::Decoded(a, e) => self.canon.aux_of(&decoded[a..e], decoded_len),
        }
    }

    /// `messages`: null (returns false) or an array of messages.
    fn messages(&mut self, write: bool) -> Res<bool> {
        match self.peek() {
            Some(b'n') => return self.literal(b"null").map(|()| false),
            Some(b'[') => self.i += 1,
            _ => return self.bad("'messages' must be an array"),
        }
        self.elements(|s| s.message(write))?;
        Ok(true)
    }

    /// One message: `RS role US content`. The role is required, its place
    /// among the keys free, so the content's pieces are put after it.
    fn message(&mut self, write: bool) -> Res<()> {
        if self.peek() != Some(b'{') {
            return self.bad("a message must be an object");
        }
        let mark = self.canon.pieces.len();
        let (len_before, kept_before) = (self.canon.len, self.canon.kept);
        self.canon.merge_from = mark;
        let mut role: Option<Str> = None;
        let mut role_buf = Vec::new();
        let mut content_seen = false;
        self.fields(inner_key, |s, key| match key {
            InnerKey::Role => {
                if role.is_some() {
                    return s.bad("duplicate field 'role'");
                }
                if s.peek() != Some(b'"') {
                    return s.bad("'role' must be a string");
                }
                role = Some(s.string(Some(&mut role_buf))?);
                Ok(())
            }
            InnerKey::Content => {
                if std::mem::replace(&mut content_seen, true) {
                    return s.bad("duplicate field 'content'");
                }
                s.content(write)
            }
            _ => s.skip(),
        })?;
        let Some(role) = role else {
            return self.bad("a message lacks its 'role'");
        };
        self.canon.answered |= role.bytes(self.b, &role_buf) == b"assistant";
        if write {
            // The content's pieces (pushed since `mark`) go after the
            // header, as much of them as the limit keeps then.
            let content: Vec<Piece> = self.canon.pieces.drain(mark..).collect();
            let content_len = self.canon.len - len_before;
            let content_kept = self.canon.kept - kept_before;
            (self.canon.len, self.canon.kept) = (len_before, kept_before);
            self.canon.merge_from = 0;
            self.canon.aux(&[MESSAGE_START]);
            match role {
                Str::Raw(a, e) => self.canon.body(a, e),
                Str::Decoded(a, e) => self.canon.aux(&role_buf[a..e]),
            }
            self.canon.aux(&[ROLE_END]);
            if content_kept <= self.canon.room() {
                // All of it (any prompt under the limit).
                self.canon.pieces.extend(content);
                self.canon.kept += content_kept;
            } else {
                for p in content {
                    let room = self.canon.room();
                    let p = match p {
                        Piece::Body(s, e) => Piece::Body(s, s + (e - s).min(room)),
                        Piece::Aux(s, e) => Piece::Aux(s, s + (e - s).min(room)),
                    };
                    let (Piece::Body(s, e) | Piece::Aux(s, e)) = p;
                    if e > s {
                        self.canon.pieces.push(p);
                        self.canon.kept += e - s;
                    }
                }
            }
            self.canon.len += content_len;
        }
        self.canon.merge_from = 0;
        Ok(())
    }

    /// A message's content: null, a string, or an array of parts.
    fn content(&mut self, write: bool) -> Res<()> {
        match self.peek() {
            Some(b'n') => self.literal(b"null"),
            Some(b'"') => self.canon_string(write),
            Some(b'[') => {
                self.i += 1;
                self.elements(|s| s.part(write))
            }
            _ => self.bad("'content' must be a string, an array of parts or null"),
        }
    }

    /// A content part: its `text`, else its `image_url.url`.
    fn part(&mut self, write: bool) -> Res<()> {
        if self.peek() != Some(b'{') {
            return self.bad("a content part must be an object");
        }
        let (mut text, mut url) = (None, None);
        let (mut text_len, mut url_len) = (0, 0);
        // Decoded bytes past what the canonical form keeps are not stored.
        let keep = if write { self.canon.room() } else { 0 };
        let (mut text_buf, mut url_buf) = (Vec::new(), Vec::new());
        let (mut saw_text, mut saw_image) = (false, false);
        self.fields(inner_key, |s, key| match key {
            InnerKey::Text => {
                if std::mem::replace(&mut saw_text, true) {
                    return s.bad("duplicate field 'text'");
                }
                text = s.opt_string_kept(&mut text_buf, keep)?;
                text_len = s.decoded_len;
                Ok(())
            }
            InnerKey::ImageUrl => {
                if std::mem::replace(&mut saw_image, true) {
                    return s.bad("duplicate field 'image_url'");
                }
                url = s.image_url(&mut url_buf, keep)?;
                url_len = s.decoded_len;
                Ok(())
            }
            _ => s.skip(),
        })?;
        if write {
            match (text, url) {
                (Some(t), _) => self.canon_push(t, &text_buf, text_len),
                (None, Some(u)) => self.canon_push(u, &url_buf, url_len),
                (None, None) => {}
            }
        }
        Ok(())
    }

    /// `image_url`: null or an object with a string `url` (decoded into
    /// `buf` up to `keep` bytes).
    fn image_url(&mut self, buf: &mut Vec<u8>, keep: usize) -> Res<Option<Str>> {
        match self.peek() {
            Some(b'n') => return self.literal(b"null").map(|()| None),
            Some(b'{') => {}
            _ => return self.bad("'image_url' must be an object"),
        }
        let mut url = None;
        self.fields(inner_key, |s, key| match key {
            InnerKey::Url => {
                if url.is_some() {
                    return s.bad("duplicate field 'url'");
                }
                if s.peek() != Some(b'"') {
                    return s.bad("'url' must be a string");
                }
                url = Some(s.string_kept(Some(&mut *buf), keep)?);
                Ok(())
            }
            _ => s.skip(),
        })?;
        match url {
            Some(u) => Ok(Some(u)),
            None => self.bad("'image_url' lacks its 'url'"),
        }
    }

    /// `prompt`, `text` or `input_ids`: null (false), or a prompt.
    fn opt_prompt(&mut self, write: bool) -> Res<bool> {
        if self.peek() == Some(b'n') {
            return self.literal(b"null").map(|()| false);
        }
        self.prompt_input(write, false).map(|()| true)
    }

    /// A string, token ids, or a batch of either; a batch counts by its
    /// first prompt. `nested`: inside a batch already.
    fn prompt_input(&mut self, write: bool, nested: bool) -> Res<()> {
        match self.peek() {
            Some(b'"') => return self.canon_string(write),
            Some(b'[') => self.i += 1,
            _ => return self.bad("a prompt must be a string, an array of strings or token ids"),
        }
        if self.peek() == Some(b']') {
            self.i += 1;
            return Ok(());
        }
        match self.peek() {
            Some(b'-' | b'0'..=b'9') => return self.tokens(write),
            Some(b'"') if !nested => self.canon_string(write)?,
            Some(b'[') if !nested => self.prompt_input(write, true)?,
            Some(b'"' | b'[') => return self.bad("prompt arrays nest too deep"),
            _ => return self.bad("expected a token id, a string or an array of token ids"),
        }
        // The rest of a batch: any values.
        loop {
            match self.peek() {
                Some(b',') => {
                    self.i += 1;
                    self.skip()?;
                }
                Some(b']') => {
                    self.i += 1;
                    return Ok(());
                }
                _ => return self.bad("expected ',' or ']'"),
            }
        }
    }

    /// Token ids (the cursor on the first), each a u32, little-endian in
    /// the canonical form.
    fn tokens(&mut self, write: bool) -> Res<()> {
        loop {
            self.ws();
            let Some(t) = self.number()? else {
                return self.bad("token ids must be integers from 0 to 4294967295");
            };
            if write {
                self.canon.token_ids = true;
                self.canon.aux(&t.to_le_bytes());
            }
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b']') => {
                    self.i += 1;
                    return Ok(());
                }
                _ => return self.bad("expected ',' or ']'"),
            }
            if !matches!(self.peek(), Some(b'-' | b'0'..=b'9')) {
                return self.bad("token ids must be integers from 0 to 4294967295");
            }
        }
    }
}

/// A field seen twice is refused, as serde refuses it.
fn once(seen: &mut bool, s: &Scanner) -> Res<()> {
    if std::mem::replace(seen, true) {
        s.bad("duplicate field")
    } else {
        Ok(())
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Key {
    Model,
    Messages,
    Prompt,
    Text,
    InputIds,
    User,
    CacheSalt,
    LoraPath,
    ServiceTier,
    Priority,
    Other,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum InnerKey {
    Role,
    Content,
    Text,
    ImageUrl,
    Url,
    Other,
}

fn top_key(name: &[u8]) -> Key {
    match name {
        b"model" => Key::Model,
        b"messages" => Key::Messages,
        b"prompt" => Key::Prompt,
        b"text" => Key::Text,
        b"input_ids" => Key::InputIds,
        b"user" => Key::User,
        b"cache_salt" => Key::CacheSalt,
        b"lora_path" => Key::LoraPath,
        b"service_tier" => Key::ServiceTier,
        b"priority" => Key::Priority,
        _ => Key::Other,
    }
}

/// A key inside a message, a part or an image URL.
fn inner_key(name: &[u8]) -> InnerKey {
    match name {
        b"role" => InnerKey::Role,
        b"content" => InnerKey::Content,
        b"text" => InnerKey::Text,
        b"image_url" => InnerKey::ImageUrl,
        b"url" => InnerKey::Url,
        _ => InnerKey::Other,
    }
}

#[cfg(test)]
mod tests;
