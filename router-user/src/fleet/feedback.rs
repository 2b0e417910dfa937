//! The closed loop: what each engine says it really had cached, against what
//! the prefix index predicted.
//!
//! Every OpenAI-compatible answer carries `usage.prompt_tokens` and, on
//! engines that report it, `usage.prompt_tokens_details.cached_tokens`
//! (SGLang's `/generate` puts both in `meta_info`). [`UsageScanner`] picks
//! them out of the response bytes as they stream to the client, without
//! changing or holding back a byte. [`Feedback::observe`] turns one report
//! into what the index should do:
//!
//! - the engine held about what was predicted: nothing;
//! - it held none of a prompt it was predicted to hold well: its cache was
//!   flushed or it restarted, so everything the index believes of it goes;
//! - it held less: it evicts sooner than the index thinks, so the capacity
//!   the index allows it shrinks (and the index forgets its oldest blocks
//!   down to it);
//! - it held more: the capacity grows back.
//!
//! So an engine that does not publish its capacity (SGLang, llama.cpp,
//! TensorRT-LLM) converges to what it really keeps. The same reports teach
//! each engine's prefill rate from the time to the first streamed byte.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering::Relaxed};

use memchr::memmem;

use crate::fleet::index::{AGE_UNKNOWN, anchor_after, anchor_of};
use crate::policy::select::SHARED_MIN_BLOCKS;

/// Bytes kept from the end of one read so a key split across two reads is
/// still found: a key (up to 29 bytes), a colon, spaces and a 10-digit number.
const CARRY: usize = 64;

/// What an answer said of its prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
    /// Tokens generated (0 when the answer did not say): their KV takes
    /// the engine's cache as the prompt's does.
    pub completion_tokens: u32,
}

/// Finds `"prompt_tokens": N`, `"cached_tokens": N` and
/// `"completion_tokens": N` in a response as it streams by, and the other
/// APIs' names for them: the Responses API's `input_tokens` (cached ones
/// included) and `output_tokens`; Anthropic's `input_tokens` (cached ones
/// not included), `cache_read_input_tokens` and
/// `cache_creation_input_tokens`. Scans with
/// memchr's SIMD search for the keys' common end; a response's last values
/// win (a stream's usage chunk comes last). A key split by chunked framing
/// is missed: the answer then reports nothing, which costs only a sample.
pub struct UsageScanner {
    /// The last bytes seen, then (while scanning) the head of the new read.
    carry: [u8; 2 * CARRY],
    carry_len: usize,
    prompt_tokens: Field,
    cached_tokens: Field,
    completion_tokens: Field,
    input_tokens: Field,
    output_tokens: Field,
    cache_read_tokens: Field,
    cache_creation_tokens: Field,
}

/// A usage number as the scanner last read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Field {
    /// Not seen (or `null`: not counted by the engine).
    Missing,
    /// A non-negative integer that fits in 32 bits.
    Int(u32),
    /// Anything else: a fraction (`3.7`), a negative number, an exponent,
    /// a string, a boolean, too many digits.
    Bad,
}

/// What an answer reported of its prompt, checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reported {
    /// No usage, or usage without cached tokens (an engine that does not
    /// count them): one sample fewer.
    Nothing,
    Valid(Usage),
    /// Numbers no honest engine writes (see [`Invalid`]): ignored for this
    /// answer, and counted against the backend.
    Invalid(Invalid),
}

/// Why an answer's usage was not believed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Invalid {
    /// `prompt_tokens`, `cached_tokens` or `completion_tokens` was not a
    /// non-negative integer.
    NotAnInteger,
    /// More cached tokens than prompt tokens.
    CachedOverPrompt,
}

impl Invalid {
    pub fn describe(self) -> &'static str {
        match self {
            Invalid::NotAnInteger => "a usage number is not a non-negative integer",
            Invalid::CachedOverPrompt => "cached_tokens is above prompt_tokens",
        }
    }
}

impl Default for UsageScanner {
    fn default() -> Self {
        UsageScanner {
            carry: [0; 2 * CARRY],
            carry_len: 0,
            prompt_tokens: Field::Missing,
            cached_tokens: Field::Missing,
            completion_tokens: Field::Missing,
            input_tokens: Field::Missing,
            output_tokens: Field::Missing,
            cache_read_tokens: Field::Missing,
            cache_creation_tokens: Field::Missing,
        }
    }
}

impl Usage {
    /// The engine's cached tokens onto a prompt of `prompt_blocks` router
    /// blocks, by share of the prompt (engines tokenize and template the
    /// prompt their own way).
    pub fn held_blocks(&self, prompt_blocks: u32) -> u32 {
        if self.prompt_tokens == 0 {
            return 0;
        }
        (u64::from(self.cached_tokens.min(self.prompt_tokens)) * u64::from(prompt_blocks)
            / u64::from(self.prompt_tokens)) as u32
    }

    /// The generated tokens in router blocks, at the prompt's tokens per
    /// block (the engine caches them as it caches the prompt).
    pub fn completion_blocks(&self, prompt_blocks: u32) -> u32 {
        if self.prompt_tokens == 0 {
            return 0;
        }
        (u64::from(self.completion_tokens) * u64::from(prompt_blocks)
            / u64::from(self.prompt_tokens))
        .min(u64::from(u32::MAX)) as u32
    }
}

/// The end every usage key shares; the scan looks for it and then at what
/// precedes it.
const KEY_END: &[u8] = b"_tokens\"";
const PROMPT_KEY: &[u8] = b"\"prompt";
const CACHED_KEY: &[u8] = b"\"cached";
const COMPLETION_KEY: &[u8] = b"\"completion";
const INPUT_KEY: &[u8] = b"\"input";
const OUTPUT_KEY: &[u8] = b"\"output";
const CACHE_READ_KEY: &[u8] = b"\"cache_read_input";
const CACHE_CREATION_KEY: &[u8] = b"\"cache_creation_input";

/// One searcher for the whole process: building it per read showed in
/// profiles.
fn key_end_finder() -> &'static memmem::Finder<'static> {
    static FINDER: std::sync::OnceLock<memmem::Finder<'static>> = std::sync::OnceLock::new();
    FINDER.get_or_init(|| memmem::Finder::new(KEY_END))
}

impl UsageScanner {
    /// Scans the next bytes of the response.
    pub fn feed(&mut self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        // Keys that start in the carried tail and end in `bytes`.
        let start = self.carry_len;
        if start > 0 {
            let head = bytes.len().min(CARRY);
            let mut joined = self.carry;
            joined[start..start + head].copy_from_slice(&bytes[..head]);
            self.scan(&joined[..start + head], Some(start));
        }
        self.scan(bytes, None);
        // Keep the last CARRY bytes of everything seen.
        if bytes.len() >= CARRY {
            self.carry[..CARRY].copy_from_slice(&bytes[bytes.len() - CARRY..]);
            self.carry_len = CARRY;
        } else {
            let keep = (CARRY - bytes.len()).min(start);
            self.carry.copy_within(start - keep..start, 0);
            self.carry[keep..keep + bytes.len()].copy_from_slice(bytes);
            self.carry_len = keep + bytes.len();
        }
    }

    /// What the response reported, checked: every number a non-negative
    /// integer, the cached tokens not above the prompt's. One engine's
    /// broken counts must not teach the closed loop (and through it,
    /// where other engines' requests go) anything.
    pub fn report(&self) -> Reported {
        let fields = [
            self.prompt_tokens,
            self.cached_tokens,
            self.completion_tokens,
            self.input_tokens,
            self.output_tokens,
            self.cache_read_tokens,
            self.cache_creation_tokens,
        ];
        if fields.contains(&Field::Bad) {
            return Reported::Invalid(Invalid::NotAnInteger);
        }
        let int = |f: Field| match f {
            Field::Int(n) => Some(n),
            Field::Missing | Field::Bad => None,
        };
        let (prompt, cached) = match (self.prompt_tokens, self.cache_read_tokens) {
            (Field::Int(p), _) => (Some(p), int(self.cached_tokens)),
            // Anthropic's: the prompt is the uncached, read and written parts.
            (Field::Missing, Field::Int(read)) => {
                let input = int(self.input_tokens).unwrap_or(0);
                let written = int(self.cache_creation_tokens).unwrap_or(0);
                (
                    input.checked_add(read).and_then(|n| n.checked_add(written)),
                    Some(read),
                )
            }
            // The Responses API's: `input_tokens` counts the cached ones.
            _ => (int(self.input_tokens), int(self.cached_tokens)),
        };
        let (Some(prompt_tokens), Some(cached_tokens)) = (prompt, cached) else {
            return Reported::Nothing;
        };
        if cached_tokens > prompt_tokens {
            return Reported::Invalid(Invalid::CachedOverPrompt);
        }
        Reported::Valid(Usage {
            prompt_tokens,
            cached_tokens,
            completion_tokens: int(self.completion_tokens)
                .or(int(self.output_tokens))
                .unwrap_or(0),
        })
    }

    /// Scans `hay` for the keys; with `starts_before`, only keys starting
    /// before that offset (the carried part) count.
    fn scan(&mut self, hay: &[u8], starts_before: Option<usize>) {
        for end in key_end_finder().find_iter(hay) {
            for (name, slot) in [
                (PROMPT_KEY, &mut self.prompt_tokens),
                (CACHED_KEY, &mut self.cached_tokens),
                (COMPLETION_KEY, &mut self.completion_tokens),
                (INPUT_KEY, &mut self.input_tokens),
                (OUTPUT_KEY, &mut self.output_tokens),
                (CACHE_READ_KEY, &mut self.cache_read_tokens),
                (CACHE_CREATION_KEY, &mut self.cache_creation_tokens),
            ] {
                let Some(start) = end.checked_sub(name.len()) else {
                    continue;
                };
                if &hay[start..end] != name || starts_before.is_some_and(|s| start >= s) {
                    continue;
                }
                if let Some(v) = number_after(&hay[end + KEY_END.len()..]) {
                    *slot = v;
                }
            }
        }
    }
}

/// The value after `: ` at the start of `rest`: an integer, `Bad` for
/// any other JSON value but `null`; `None` when there is no colon, the
/// value is `null`, or it runs to the end of `rest` (it may continue in
/// the next read).
fn number_after(rest: &[u8]) -> Option<Field> {
    let mut i = 0;
    let skip_ws = |i: &mut usize| {
        while *i < rest.len() && matches!(rest[*i], b' ' | b'\t' | b'\r' | b'\n') && *i < 16 {
            *i += 1;
        }
    };
    skip_ws(&mut i);
    if rest.get(i) != Some(&b':') {
        return None;
    }
    i += 1;
    skip_ws(&mut i);
    let start = i;
    let mut v: u64 = 0;
    // One digit past u32's ten shows a number too large.
    while i < rest.len() && rest[i].is_ascii_digit() && i - start <= 10 {
        v = v * 10 + u64::from(rest[i] - b'0');
        i += 1;
    }
    // A value must end inside what we have, or it may be cut short.
    let next = *rest.get(i)?;
    if i == start {
        // Not a number: `null` is an engine that does not count; anything
        // else (a sign, a string, a boolean, an object) is not a count.
        return match next {
            b'n' => None,
            _ => Some(Field::Bad),
        };
    }
    if !matches!(next, b',' | b'}' | b']' | b' ' | b'\t' | b'\r' | b'\n') {
        // A fraction, an exponent, more digits than a u32 holds.
        return Some(Field::Bad);
    }
    Some(u32::try_from(v).map_or(Field::Bad, Field::Int))
}

/// What one report says the index should do for the backend it came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Correction {
    /// The prediction was right, or wrong in a way the capacity estimate
    /// absorbs.
    None,
    /// The engine held none of a prompt it was sent recently (far more
    /// recently than its capacity would evict): its cache was flushed or it
    /// restarted. Forget everything of it.
    Flushed,
}

/// One thing an answer taught about its engine, as router replicas share
/// it: each applies its peers' to its own estimates as if it had seen the
/// answer (`control::replicas`). Ages are on the backend's clock, which
/// counts the blocks every replica sent it, so they mean the same to each.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Lesson {
    /// A block was still cached at this age: the capacity is at least it.
    Kept { age: u64 },
    /// A block was evicted at this age: the capacity is below it, loosely.
    Evicted { age: u64 },
    /// This many uncached blocks were prefilled in this many seconds, with
    /// nothing queued ahead.
    Prefill { blocks: u32, seconds: f64 },
}

impl Lesson {
    /// As three numbers: what, then its two values (seconds in nanoseconds).
    pub fn encode(self) -> (u32, u64, u64) {
        match self {
            Lesson::Kept { age } => (1, age, 0),
            Lesson::Evicted { age } => (2, age, 0),
            Lesson::Prefill { blocks, seconds } => (3, u64::from(blocks), (seconds * 1e9) as u64),
        }
    }

    /// Back from [`Self::encode`]; `None` for what this build does not know.
    pub fn decode(what: u32, a: u64, b: u64) -> Option<Lesson> {
        match what {
            1 => Some(Lesson::Kept { age: a }),
            2 => Some(Lesson::Evicted { age: a }),
            3 => Some(Lesson::Prefill {
                blocks: u32::try_from(a).ok()?,
                seconds: b as f64 / 1e9,
            }),
            _ => None,
        }
    }
}

/// Weight of a kept block in the capacity estimate: a block kept at an
/// age above the estimate pushes it a quarter of the way up to that age.
/// An eviction of a block younger than the estimate pulls it down, by
/// [`EVICT_STEP`]. The estimate settles where the engine starts to evict.
/// An unpublished capacity's first samples weigh more (see
/// [`Feedback::learn_capacity`]).
const CAPACITY_STEP: f64 = 0.25;
/// Weight of an eviction, a fifth of a kept block's: an age counts fewer
/// blocks than the engine's LRU order puts after the block (the engine
/// frees a request's blocks when it ends, the clock counts them when it is
/// sent; and what running requests hold is only estimated, see
/// `Load::pinned_before`), so a block kept at age `a` proves a capacity of
/// at least `a`, while one evicted at `a` bounds it only loosely. At equal
/// weights the estimate settled 15-30% low (engines of 1,151 blocks
/// evicted blocks from age 850 and kept none past 1,198: decision
/// 0023).
const EVICT_STEP: f64 = 0.05;
/// A match within this many blocks of the prediction is a hit (the engine's
/// tokens and the router's 64-byte blocks round differently).
const TOLERANCE_BLOCKS: u32 = 2;
/// Predictions shorter than this cannot tell a flush from an eviction.
const FLUSH_MIN_BLOCKS: u32 = 16;
/// Recent prompts lost whole, in a row, that make a flush.
const FLUSH_REPORTS: u32 = 3;
/// Capacity samples before an unpublished capacity is trusted to call a
/// prompt recent.
const FLUSH_MIN_SAMPLES: u64 = 8;
/// A prompt sent this recently (a share of the capacity estimate, in new
/// blocks since) cannot have been evicted by an LRU cache: losing all of it
/// means the cache was flushed.
const FLUSH_AGE_SHARE: f64 = 0.25;
/// No backend's learned capacity goes below this.
pub const MIN_CAPACITY_BLOCKS: usize = 64;
/// Weight of a new prefill-rate sample (an exponential moving average).
const RATE_ALPHA: f64 = 0.05;
/// Private leads shorter than this say little of what the engine keeps.
const PRIVATE_MIN_BLOCKS: u32 = 8;
/// Weight of one report in the share of private leads kept: about the last
/// 20 answers with one.
const PRIVATE_ALPHA: f64 = 0.05;
/// Prefill-rate samples before the learned rate is used. One sample taken
/// while an engine was busy decoding (the hot-prompt scenario's start: 7
/// requests in flight) once set an engine at a third of its fleet's rate;
/// selection then starved it, and an engine that gets no new conversations
/// takes no new samples (decision 0023).
pub const RATE_MIN_SAMPLES: u32 = 8;
/// Samples with less prefill work than this say more about the network than
/// the engine, and teach nothing.
const RATE_MIN_BLOCKS: u32 = 32;

/// Per-backend learned state, written by the data path after each answer.
#[derive(Debug)]
pub struct Feedback {
    /// Reports compared with a prediction.
    reports: AtomicU64,
    /// Sum of predicted cached blocks over reports.
    predicted_blocks: AtomicU64,
    /// Sum of reported cached blocks over reports.
    reported_blocks: AtomicU64,
    /// Sum of |predicted - reported| blocks over reports.
    error_blocks: AtomicU64,
    /// Reports that held less than predicted (by more than the tolerance).
    over_predictions: AtomicU64,
    /// Reports that held more than predicted.
    under_predictions: AtomicU64,
    /// Flushes detected.
    flushes: AtomicU64,
    /// Recent prompts lost whole in a row (see `FLUSH_REPORTS`).
    empty_in_row: AtomicU32,
    /// Learned capacity in the router's blocks, as `f64` bits.
    capacity: AtomicU64,
    /// Age samples that moved the capacity estimate.
    capacity_samples: AtomicU64,
    /// Learned prefill rate, blocks per second, as `f64` bits (0: none yet).
    prefill_rate: AtomicU64,
    /// Prefill-rate samples taken.
    rate_samples: AtomicU32,
    /// Mean blocks of an answer (a moving average), as `f64` bits: what a
    /// running request's answer holds of the engine's cache.
    answer_blocks: AtomicU64,
    /// The capacity the engine published or the config gives, in index
    /// blocks (0: unknown): the estimate starts there and never exceeds it.
    known_capacity: AtomicUsize,
    /// The engine's published capacity was looked for (once, after its
    /// first passed probe).
    capacity_looked_up: AtomicBool,
    /// Share of a private lead (the blocks only this engine was predicted
    /// to hold: a conversation's history) that its answers said it still
    /// held; a moving average, `f64` bits. 1 until a report says less.
    private_kept: AtomicU64,
    /// Answers whose usage was not believed ([`Reported::Invalid`]).
    invalid_reports: AtomicU64,
}

impl Feedback {
    /// State for a backend whose capacity is assumed `capacity` blocks.
    pub fn new(capacity: usize) -> Feedback {
        Feedback {
            reports: AtomicU64::new(0),
            predicted_blocks: AtomicU64::new(0),
            reported_blocks: AtomicU64::new(0),
            error_blocks: AtomicU64::new(0),
            over_predictions: AtomicU64::new(0),
            under_predictions: AtomicU64::new(0),
            flushes: AtomicU64::new(0),
            empty_in_row: AtomicU32::new(0),
            capacity: AtomicU64::new((capacity as f64).to_bits()),
            capacity_samples: AtomicU64::new(0),
            prefill_rate: AtomicU64::new(0f64.to_bits()),
            rate_samples: AtomicU32::new(0),
            answer_blocks: AtomicU64::new(0f64.to_bits()),
            known_capacity: AtomicUsize::new(0),
            capacity_looked_up: AtomicBool::new(false),
            private_kept: AtomicU64::new(1f64.to_bits()),
            invalid_reports: AtomicU64::new(0),
        }
    }

    /// Counts an answer whose usage was not believed; true for this
    /// backend's first (the caller warns once per backend).
    pub fn invalid_report(&self) -> bool {
        self.invalid_reports.fetch_add(1, Relaxed) == 0
    }

    /// Answers whose usage was not believed.
    pub fn invalid_reports(&self) -> u64 {
        self.invalid_reports.load(Relaxed)
    }

    /// Share of a private lead this engine still held when the request came
    /// (see [`Self::observe_private`]): 1 while nothing says otherwise.
    pub fn private_kept(&self) -> f64 {
        f64::from_bits(self.private_kept.load(Relaxed))
    }

    /// A report on a request that had a private lead: `predicted` blocks
    /// predicted held, `shared` of them held by another engine too. What
    /// it held of the lead, `held - shared` of `predicted - shared`, moves
    /// the average. A busy engine evicts a conversation's history between
    /// its turns; selection then counts the history it would recompute
    /// there (`select`), instead of keeping the conversation waiting
    /// behind a queue for a history that is gone.
    pub fn observe_private(&self, usage: Usage, prompt_blocks: u32, predicted: u32, shared: u32) {
        let lead = predicted.saturating_sub(shared);
        if usage.prompt_tokens == 0 || shared < SHARED_MIN_BLOCKS || lead < PRIVATE_MIN_BLOCKS {
            return;
        }
        let held = usage.held_blocks(prompt_blocks).min(predicted);
        // Within the tolerance of the prediction is all of it.
        let kept = if held + TOLERANCE_BLOCKS >= predicted {
            1.0
        } else {
            f64::from(held.saturating_sub(shared)) / f64::from(lead)
        };
        let old = self.private_kept();
        self.private_kept
            .store((old + PRIVATE_ALPHA * (kept - old)).to_bits(), Relaxed);
    }

    /// The engine's capacity was published or configured: start there.
    pub fn set_known_capacity(&self, blocks: usize) {
        self.known_capacity.store(blocks, Relaxed);
        self.capacity.store((blocks as f64).to_bits(), Relaxed);
    }

    /// Whether answers have taught a capacity here (or a peer's snapshot).
    pub fn capacity_learned(&self) -> bool {
        self.capacity_samples.load(Relaxed) > 0
    }

    /// A peer's learned capacity, from its snapshot, while this router has
    /// neither been told one nor learned one (a replica catching up): the
    /// estimate starts there, as one sample, instead of at the guess, and
    /// answers refine it as they would have. Ignored when it is 0 or not
    /// under the current estimate.
    pub fn adopt_capacity(&self, blocks: usize) {
        if blocks == 0 || self.capacity_known() || blocks >= self.capacity() {
            return;
        }
        if self
            .capacity_samples
            .compare_exchange(0, 1, Relaxed, Relaxed)
            .is_ok()
        {
            let cap = blocks.max(MIN_CAPACITY_BLOCKS) as f64;
            self.capacity.store(cap.to_bits(), Relaxed);
        }
    }

    /// True the first time it is called: the caller looks up the engine's
    /// published capacity then.
    pub fn first_capacity_lookup(&self) -> bool {
        !self.capacity_looked_up.swap(true, Relaxed)
    }

    /// Answers compared with a prediction.
    pub fn reports(&self) -> u64 {
        self.reports.load(Relaxed)
    }

    /// Predicted cached blocks, summed over reports.
    pub fn predicted_blocks(&self) -> u64 {
        self.predicted_blocks.load(Relaxed)
    }

    /// Reported cached blocks, summed over reports.
    pub fn reported_blocks(&self) -> u64 {
        self.reported_blocks.load(Relaxed)
    }

    /// |predicted - reported| blocks, summed over reports.
    pub fn error_blocks(&self) -> u64 {
        self.error_blocks.load(Relaxed)
    }

    pub fn over_predictions(&self) -> u64 {
        self.over_predictions.load(Relaxed)
    }

    pub fn under_predictions(&self) -> u64 {
        self.under_predictions.load(Relaxed)
    }

    pub fn flushes(&self) -> u64 {
        self.flushes.load(Relaxed)
    }

    /// The engine published its capacity, or the config gives it.
    pub fn capacity_known(&self) -> bool {
        self.known_capacity.load(Relaxed) > 0
    }

    /// The learned capacity in the router's blocks.
    pub fn capacity(&self) -> usize {
        f64::from_bits(self.capacity.load(Relaxed)) as usize
    }

    /// The learned prefill rate in blocks per second; 0 (selection then
    /// takes the fleet's) before [`RATE_MIN_SAMPLES`] samples.
    pub fn prefill_rate(&self) -> f64 {
        if self.rate_samples.load(Relaxed) < RATE_MIN_SAMPLES {
            return 0.0;
        }
        self.raw_prefill_rate()
    }

    fn raw_prefill_rate(&self) -> f64 {
        f64::from_bits(self.prefill_rate.load(Relaxed))
    }

    /// Blocks an answer takes, on average (0 before any).
    pub fn answer_blocks(&self) -> u64 {
        f64::from_bits(self.answer_blocks.load(Relaxed)) as u64
    }

    /// An answer of `blocks` blocks came back.
    pub fn observe_answer_blocks(&self, blocks: u32) {
        let old = f64::from_bits(self.answer_blocks.load(Relaxed));
        let new = if old == 0.0 {
            f64::from(blocks)
        } else {
            old + RATE_ALPHA * (f64::from(blocks) - old)
        };
        self.answer_blocks.store(new.to_bits(), Relaxed);
    }

    /// Learns from the time between dispatch and the first streamed byte of
    /// a request that found nothing queued ahead of it.
    pub fn observe_ttft(&self, work_blocks: u32, ttft_s: f64) {
        if work_blocks < RATE_MIN_BLOCKS || ttft_s.is_nan() || ttft_s <= 0.0 {
            return;
        }
        let sample = f64::from(work_blocks) / ttft_s;
        let old = self.raw_prefill_rate();
        let n = self.rate_samples.load(Relaxed);
        // The first samples are averaged whole (one taken while the engine
        // was busy with other work must not stand for it), then a moving
        // average follows the engine.
        let alpha = if n < RATE_MIN_SAMPLES {
            1.0 / f64::from(n + 1)
        } else {
            RATE_ALPHA
        };
        let new = old + alpha * (sample - old);
        self.prefill_rate
            .store(new.clamp(1.0, 1e9).to_bits(), Relaxed);
        self.rate_samples.fetch_add(1, Relaxed);
    }

    /// Compares a report with the prediction. `ages[i]` is block `i`'s age
    /// when the request was sent (new blocks this backend was sent since it
    /// last was sent block `i`; `index::AGE_UNKNOWN` when not known, as
    /// for the blocks between two anchors of a long prompt).
    /// `pinned_blocks`: prompt blocks of the backend's requests in flight.
    pub fn observe(
        &self,
        usage: Usage,
        predicted: u32,
        ages: &[u64],
        pinned_blocks: u32,
    ) -> Correction {
        self.observe_teaching(usage, predicted, ages, pinned_blocks, |_| {})
    }

    /// [`Self::observe`], handing `taught` each capacity lesson it drew.
    pub fn observe_teaching(
        &self,
        usage: Usage,
        predicted: u32,
        ages: &[u64],
        pinned_blocks: u32,
        mut taught: impl FnMut(Lesson),
    ) -> Correction {
        let prompt_blocks = ages.len() as u32;
        if usage.prompt_tokens == 0 || prompt_blocks == 0 {
            return Correction::None;
        }
        let held = usage.held_blocks(prompt_blocks);
        self.reports.fetch_add(1, Relaxed);
        self.predicted_blocks
            .fetch_add(u64::from(predicted), Relaxed);
        self.reported_blocks.fetch_add(u64::from(held), Relaxed);
        self.error_blocks
            .fetch_add(u64::from(predicted.abs_diff(held)), Relaxed);
        // Past a long prompt's head only anchors have ages
        // (`index::is_anchor`), and a block between two reads one of them,
        // on the side that cannot mislead. The hashes are chained, so a send
        // of a block was a send of every block before it: the anchor before
        // it is at most as old, the one after it at least as old. An
        // eviction reads the anchor after (the capacity is below that too),
        // a kept block the anchor before (it is at least that). An
        // anchor's own age, as every block's of a prompt's head, is read as
        // it is.
        let known = |i: usize| ages.get(i).copied().filter(|&a| a != AGE_UNKNOWN);
        let age_at_least = |i: u32| known(anchor_after(i as usize));
        let age_at_most = |i: u32| known(anchor_of(i as usize));
        let cap = f64::from_bits(self.capacity.load(Relaxed));
        let pinned = f64::from(pinned_blocks);
        if held > 0 {
            self.empty_in_row.store(0, Relaxed);
        }
        if held + TOLERANCE_BLOCKS < predicted {
            self.over_predictions.fetch_add(1, Relaxed);
            // One recent prompt lost whole can be an overloaded engine
            // evicting under the memory its running requests hold; several
            // in a row, with nothing held in between, is a flush.
            // An engine whose running requests hold much of its memory
            // evicts anything; only a calm engine's loss tells. And "recent"
            // needs a capacity to compare with: published, or learned.
            let calm = pinned < FLUSH_AGE_SHARE * cap;
            let trusted = self.known_capacity.load(Relaxed) > 0
                || self.capacity_samples.load(Relaxed) >= FLUSH_MIN_SAMPLES;
            if held == 0
                && predicted >= FLUSH_MIN_BLOCKS
                && calm
                && trusted
                && known(0).is_some_and(|a| (a as f64) < FLUSH_AGE_SHARE * cap)
            {
                // A recent prompt lost whole says nothing of the capacity.
                if self.empty_in_row.fetch_add(1, Relaxed) + 1 >= FLUSH_REPORTS {
                    self.empty_in_row.store(0, Relaxed);
                    self.flushes.fetch_add(1, Relaxed);
                    return Correction::Flushed;
                }
                return Correction::None;
            }
            // Evicted at this age: the capacity is below it, loosely. (An
            // age counts the distinct blocks sent since and what running
            // requests hold, `PrefixIndex::distinct_ages_pinned`; the
            // blocks of requests sent before but freed after it are not
            // among them, so an eviction weighs less: `EVICT_STEP`.)
            if let Some(a) = age_at_least(held + TOLERANCE_BLOCKS) {
                self.learn_capacity(cap, a as f64, EVICT_STEP, |a, c| a < c);
                taught(Lesson::Evicted { age: a });
            }
        } else if predicted + TOLERANCE_BLOCKS < held {
            self.under_predictions.fetch_add(1, Relaxed);
        }
        // Kept at this age: the capacity is at least it.
        if held > TOLERANCE_BLOCKS
            && let Some(a) = age_at_most(held.min(predicted).saturating_sub(TOLERANCE_BLOCKS + 1))
        {
            self.learn_capacity(cap, a as f64, CAPACITY_STEP, |a, c| a > c);
            taught(Lesson::Kept { age: a });
        }
        Correction::None
    }

    /// Applies a peer replica's lesson about this engine.
    pub fn learn(&self, lesson: Lesson) {
        let cap = f64::from_bits(self.capacity.load(Relaxed));
        match lesson {
            Lesson::Kept { age } => {
                self.learn_capacity(cap, age as f64, CAPACITY_STEP, |a, c| a > c)
            }
            Lesson::Evicted { age } => {
                self.learn_capacity(cap, age as f64, EVICT_STEP, |a, c| a < c)
            }
            Lesson::Prefill { blocks, seconds } => self.observe_ttft(blocks, seconds),
        }
    }

    fn learn_capacity(
        &self,
        cap: f64,
        age: f64,
        weight: f64,
        contradicts: impl Fn(f64, f64) -> bool,
    ) {
        if !contradicts(age, cap) {
            return;
        }
        let known = self.known_capacity.load(Relaxed);
        let ceiling = if known > 0 { known as f64 } else { f64::MAX };
        // An unpublished capacity starts at a guess (65,536 blocks), not a
        // measurement: the first samples replace it, as a running mean of
        // them, before the steps settle at a quarter. At a quarter from the
        // start, an engine that rarely evicts (few requests, or a cache
        // that fits its share) kept most of the guess for a whole run:
        // 27,648 = 65,536 x 0.75^3 for a real 1,325 (decision 0023).
        let n = self.capacity_samples.fetch_add(1, Relaxed);
        let step = if known > 0 {
            weight
        } else {
            weight.max(1.0 / (n as f64 + 1.0))
        };
        let next = (cap + step * (age - cap)).clamp(MIN_CAPACITY_BLOCKS as f64, ceiling);
        self.capacity.store(next.to_bits(), Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(parts: &[&[u8]]) -> Option<Usage> {
        let mut s = UsageScanner::default();
        for p in parts {
            s.feed(p);
        }
        match s.report() {
            Reported::Valid(u) => Some(u),
            Reported::Nothing | Reported::Invalid(_) => None,
        }
    }

    const JSON: &[u8] = br#"{"id":"x","choices":[{"text":"a"}],"usage":{"prompt_tokens":1234,"total_tokens":1300,"completion_tokens":66,"prompt_tokens_details":{"cached_tokens":1024}}}"#;

    #[test]
    fn finds_usage_in_a_json_answer() {
        let u = scan(&[JSON]).unwrap();
        assert_eq!(
            u,
            Usage {
                prompt_tokens: 1234,
                cached_tokens: 1024,
                completion_tokens: 66
            }
        );
    }

    #[test]
    fn reads_the_messages_and_responses_apis_usage() {
        // Anthropic's `input_tokens` leaves out the tokens read from the cache.
        let messages = br#"{"type":"message","content":[{"type":"text","text":"input_tokens"}],"usage":{"input_tokens":210,"cache_creation_input_tokens":0,"cache_read_input_tokens":1024,"output_tokens":24}}"#;
        let want = Some(Usage {
            prompt_tokens: 1234,
            cached_tokens: 1024,
            completion_tokens: 24,
        });
        for cut in 1..messages.len() {
            assert_eq!(
                scan(&[&messages[..cut], &messages[cut..]]),
                want,
                "cut {cut}"
            );
        }
        // Its stream: the prompt in `message_start`, the output last.
        let sse: &[&[u8]] = &[
            b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":210,\"cache_read_input_tokens\":1024,\"output_tokens\":1}}}\n\n",
            b"event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":24}}\n\n",
        ];
        assert_eq!(scan(sse), want);
        // The Responses API's `input_tokens` counts the cached ones.
        let responses = br#"{"object":"response","usage":{"input_tokens":1234,"input_tokens_details":{"cached_tokens":1024},"output_tokens":24,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":1258}}"#;
        assert_eq!(scan(&[responses]), want);
        let created = br#"data: {"type":"response.created","response":{"usage":null}}"#;
        assert_eq!(scan(&[created, b"\n\n", responses]), want);
        // Without cached counts there is nothing to learn from.
        assert_eq!(
            scan(&[br#"{"usage":{"input_tokens":5,"output_tokens":2}}"#]),
            None
        );
    }

    #[test]
    fn finds_usage_split_at_every_byte() {
        for cut in 1..JSON.len() {
            let u = scan(&[&JSON[..cut], &JSON[cut..]]);
            assert_eq!(
                u,
                Some(Usage {
                    prompt_tokens: 1234,
                    cached_tokens: 1024,
                    completion_tokens: 66
                }),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn finds_usage_fed_byte_by_byte_and_in_sse() {
        let sse = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\": 40, \"prompt_tokens_details\": {\"cached_tokens\": 32}}}\n\ndata: [DONE]\n\n";
        let parts: Vec<&[u8]> = sse.chunks(1).collect();
        assert_eq!(
            scan(&parts),
            Some(Usage {
                prompt_tokens: 40,
                cached_tokens: 32,
                completion_tokens: 0
            })
        );
    }

    #[test]
    fn null_or_missing_cached_tokens_reports_nothing() {
        assert_eq!(
            scan(&[br#"{"usage":{"prompt_tokens":12,"prompt_tokens_details":null}}"#]),
            None
        );
        assert_eq!(scan(&[br#"{"usage":{"prompt_tokens":12}}"#]), None);
        // A number cut by the end of the stream is not trusted.
        assert_eq!(scan(&[br#"{"prompt_tokens":12,"cached_tokens":1"#]), None);
    }

    fn report(text: &[u8]) -> Reported {
        let mut s = UsageScanner::default();
        s.feed(text);
        s.report()
    }

    #[test]
    fn cached_tokens_that_are_not_a_count_are_invalid_however_they_are_cut() {
        let bad = Reported::Invalid(Invalid::NotAnInteger);
        for v in [
            "3.7",
            "-5",
            "-0",
            "1e3",
            "\"12\"",
            "true",
            "{}",
            "99999999999",
            "4294967296",
        ] {
            let text = format!(
                r#"{{"usage":{{"prompt_tokens":100,"prompt_tokens_details":{{"cached_tokens":{v}}}}}}}"#
            );
            assert_eq!(report(text.as_bytes()), bad, "{v}");
            // Cut anywhere, byte by byte too, the verdict is the same.
            for cut in 1..text.len() {
                let mut s = UsageScanner::default();
                s.feed(&text.as_bytes()[..cut]);
                s.feed(&text.as_bytes()[cut..]);
                assert_eq!(s.report(), bad, "{v} cut at {cut}");
            }
        }
        assert_eq!(
            report(br#"{"prompt_tokens":10.5,"prompt_tokens_details":{"cached_tokens":3}}"#),
            bad
        );
        assert_eq!(
            report(br#"{"prompt_tokens":100,"prompt_tokens_details":{"cached_tokens":101}}"#),
            Reported::Invalid(Invalid::CachedOverPrompt)
        );
        // The largest honest values still pass; null is "not counted".
        assert!(matches!(
            report(br#"{"prompt_tokens":4294967295,"prompt_tokens_details":{"cached_tokens":4294967295} }"#),
            Reported::Valid(_)
        ));
        assert_eq!(
            report(br#"{"prompt_tokens":12,"prompt_tokens_details":{"cached_tokens":null}}"#),
            Reported::Nothing
        );
        assert_eq!(
            report(br#"{"prompt_tokens":12,"prompt_tokens_details":{"cached_tokens":12}}"#),
            Reported::Valid(Usage {
                prompt_tokens: 12,
                cached_tokens: 12,
                completion_tokens: 0
            })
        );
    }

    #[test]
    fn prompt_tokens_details_is_not_prompt_tokens() {
        let u = scan(&[br#"{"prompt_tokens_details":{"cached_tokens":5},"prompt_tokens":9}"#]);
        assert_eq!(
            u,
            Some(Usage {
                prompt_tokens: 9,
                cached_tokens: 5,
                completion_tokens: 0
            })
        );
    }

    fn usage(cached_of_1600: u32) -> Usage {
        Usage {
            prompt_tokens: 1600,
            cached_tokens: cached_of_1600,
            completion_tokens: 0,
        }
    }

    /// 100 blocks, block i last sent `base + i` new blocks ago.
    fn ages(base: u64) -> Vec<u64> {
        (0..100).map(|i| base + i).collect()
    }

    #[test]
    fn a_right_prediction_changes_nothing() {
        let f = Feedback::new(4096);
        assert_eq!(f.observe(usage(800), 50, &ages(10), 0), Correction::None);
        assert_eq!(f.observe(usage(784), 50, &ages(10), 0), Correction::None);
        assert_eq!(f.capacity(), 4096);
        assert_eq!(f.reports.load(Relaxed), 2);
    }

    #[test]
    fn nothing_held_of_a_recent_prompt_is_a_flush() {
        // Not before the capacity is known or learned: "recent" means nothing.
        let f = Feedback::new(65_536);
        for _ in 0..5 {
            assert_eq!(f.observe(usage(0), 50, &ages(10), 0), Correction::None);
        }
        let f = Feedback::new(65_536);
        f.set_known_capacity(4096);
        assert_eq!(f.observe(usage(0), 50, &ages(10), 0), Correction::None);
        assert_eq!(f.observe(usage(0), 50, &ages(10), 0), Correction::None);
        assert_eq!(f.observe(usage(0), 50, &ages(10), 0), Correction::Flushed);
        assert_eq!(f.flushes.load(Relaxed), 1);
        // Something held in between starts the count again.
        assert_eq!(f.observe(usage(0), 50, &ages(10), 0), Correction::None);
        assert_eq!(f.observe(usage(800), 50, &ages(10), 0), Correction::None);
        assert_eq!(f.observe(usage(0), 50, &ages(10), 0), Correction::None);
        assert_eq!(f.observe(usage(0), 50, &ages(10), 0), Correction::None);
        assert_eq!(f.flushes.load(Relaxed), 1);
        assert_eq!(f.capacity(), 4096, "a flush teaches no capacity");
        // Nothing held of an old prompt is an eviction: the capacity learns.
        assert_eq!(f.observe(usage(0), 50, &ages(2000), 0), Correction::None);
        assert!(f.capacity() < 4096);
        // Nor is a busy engine's loss (its running requests hold memory).
        let f = Feedback::new(4096);
        f.set_known_capacity(4096);
        for _ in 0..5 {
            assert_eq!(f.observe(usage(0), 50, &ages(10), 2000), Correction::None);
        }
        // A short prediction is not evidence enough.
        let f = Feedback::new(4096);
        for _ in 0..5 {
            assert_eq!(f.observe(usage(0), 8, &ages(10), 0), Correction::None);
        }
    }

    /// Feeds `f` 400 reports of an LRU engine that keeps the leading
    /// blocks younger than `keeps` (ages grow along the prompt).
    fn observe_lru(f: &Feedback, keeps: u64, seed: u64) {
        let mut rng = seed;
        for _ in 0..400 {
            rng = crate::policy::select::mix(rng);
            let a = ages(rng % 3000);
            let held = a.iter().take_while(|&&x| x < keeps).count() as u32;
            let u = Usage {
                prompt_tokens: 1600,
                cached_tokens: held * 16,
                completion_tokens: 0,
            };
            f.observe(u, 100, &a, 0);
        }
    }

    #[test]
    fn the_capacity_converges_to_where_the_engine_evicts() {
        // An LRU engine keeping blocks up to 1,500 new blocks old.
        let real = 1500u64;
        for start in [65_536usize, 300] {
            let f = Feedback::new(start);
            observe_lru(&f, real, 12345);
            let c = f.capacity() as f64;
            assert!(
                (c - real as f64).abs() < 0.25 * real as f64,
                "from {start}: learned {c}, real {real}"
            );
        }
    }

    #[test]
    fn recorded_ages_learn_the_capacity_within_a_quarter() {
        // The ages one router read in the quality bench, as they came: an
        // engine of 1,151 blocks evicted blocks it had sent from age 850 on
        // and kept none past 1,198. At an eviction's weight equal to a kept
        // block's, these learned 792 and 956 (`EVICT_STEP`).
        let text = include_str!("feedback/samples.txt");
        let mut engines: Vec<(&str, f64, Vec<&str>)> = Vec::new();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            match line.strip_prefix("engine ") {
                Some(e) => {
                    let (name, cap) = e.rsplit_once(' ').unwrap();
                    engines.push((name, cap.parse().unwrap(), Vec::new()));
                }
                None => engines.last_mut().unwrap().2.extend(line.split(' ')),
            }
        }
        assert_eq!(engines.len(), 2);
        for (name, real, samples) in engines {
            let f = Feedback::new(65_536);
            for s in samples {
                let (kind, age) = s.split_at(1);
                let age: u64 = age.parse().unwrap();
                // 100 blocks sent at `age`, after 10 sent just now: all
                // held, or the 10 only.
                let mut a = vec![age; 110];
                a[..10].fill(5);
                let held = if kind == "k" { 110 } else { 10 };
                let u = Usage {
                    prompt_tokens: 110 * 16,
                    cached_tokens: held * 16,
                    completion_tokens: 0,
                };
                f.observe(u, 110, &a, 0);
            }
            let c = f.capacity() as f64;
            assert!(
                (c - real).abs() < 0.25 * real,
                "{name}: learned {c}, real {real}"
            );
        }
    }

    #[test]
    fn an_engine_that_rarely_evicts_leaves_the_guess_at_once() {
        // Three evictions in a whole run (the engine took few requests):
        // from the 65,536-block guess the estimate lands at the ages the
        // engine evicted at, not at 65,536 x 0.75^3.
        let f = Feedback::new(65_536);
        let held = Usage {
            prompt_tokens: 1600,
            cached_tokens: 50 * 16,
            completion_tokens: 0,
        };
        for age in [1_400, 1_200, 1_300] {
            f.observe(held, 100, &ages(age), 0);
        }
        let c = f.capacity();
        assert!((1_200..=1_400).contains(&c), "learned {c}");
    }

    #[test]
    fn sparse_ages_are_read_on_the_side_that_cannot_mislead() {
        // A long prompt's ages as the index gives them: known at anchors
        // only past its head, growing along the prompt. The engine held 600
        // of 800 blocks.
        use crate::fleet::index::is_anchor;
        let ages: Vec<u64> = (0..800u64)
            .map(|i| {
                if is_anchor(i as usize) {
                    5_000 + i
                } else {
                    AGE_UNKNOWN
                }
            })
            .collect();
        assert!(!is_anchor(602) && is_anchor(608) && is_anchor(576) && !is_anchor(597));
        let held_600 = Usage {
            prompt_tokens: 12_800,
            cached_tokens: 9_600,
            completion_tokens: 0,
        };
        // Evicted at block 602: the anchor after it (608, older) bounds its
        // age from above, so the capacity moves toward 5,608 (all the way:
        // the first sample of an unpublished capacity replaces the guess).
        let f = Feedback::new(65_536);
        f.observe(held_600, 800, &ages, 0);
        assert_eq!(f.capacity(), 5_608);
        // Kept up to block 597: the anchor before it (576, younger) bounds
        // it from below.
        let f = Feedback::new(1_000);
        f.observe(held_600, 600, &ages, 0);
        assert_eq!(f.capacity(), 5_576);
        // A published capacity moves by an eviction's weight.
        let f = Feedback::new(65_536);
        f.set_known_capacity(8_000);
        f.observe(held_600, 800, &ages, 0);
        let want = 8_000.0 + EVICT_STEP * (5_608.0 - 8_000.0);
        assert_eq!(f.capacity(), want as usize);
        // The anchor's age unknown (another backend was sent it since):
        // nothing is learned.
        let f = Feedback::new(1_000);
        f.observe(held_600, 600, &[AGE_UNKNOWN; 800], 0);
        assert_eq!(f.capacity(), 1_000);
    }

    #[test]
    fn a_peer_taught_the_lessons_learns_what_the_observer_learned() {
        let (seen, taught) = (Feedback::new(65_536), Feedback::new(65_536));
        let mut lessons = Vec::new();
        // Kept at ages 300-400, evicted from 500: the capacity settles between.
        for i in 0..40u64 {
            let (held, age) = if i % 2 == 0 {
                (usage(1600), 300 + i)
            } else {
                (usage(0), 500 + i)
            };
            seen.observe_teaching(held, 100, &ages(age), 0, |l| lessons.push(l));
        }
        for l in &lessons {
            taught.learn(*l);
        }
        assert!(lessons.iter().any(|l| matches!(l, Lesson::Evicted { .. })));
        assert!(lessons.iter().any(|l| matches!(l, Lesson::Kept { .. })));
        assert_ne!(seen.capacity(), 65_536);
        assert_eq!(taught.capacity(), seen.capacity());
        // Prefill rates too, once there are enough samples.
        for _ in 0..RATE_MIN_SAMPLES {
            taught.learn(Lesson::Prefill {
                blocks: 200,
                seconds: 0.1,
            });
        }
        assert_eq!(taught.prefill_rate(), 2_000.0);
    }

    #[test]
    fn a_known_capacity_is_a_ceiling() {
        let f = Feedback::new(65_536);
        f.set_known_capacity(1000);
        assert_eq!(f.capacity(), 1000);
        // Kept blocks far older than 1000 cannot raise it above.
        for _ in 0..20 {
            f.observe(usage(1600), 100, &ages(5000), 0);
        }
        assert_eq!(f.capacity(), 1000);
    }

    #[test]
    fn a_replica_catching_up_starts_from_its_peer_s_learned_capacity() {
        // Nothing learned here: a peer's 480 replaces the guess, as one
        // sample, and the next eviction moves it halfway, not all the way.
        let f = Feedback::new(65_536);
        assert!(!f.capacity_learned());
        f.adopt_capacity(480);
        assert_eq!(f.capacity(), 480);
        assert!(f.capacity_learned());
        f.learn(Lesson::Evicted { age: 400 });
        assert_eq!(f.capacity(), 440);
        // Once learned here, a snapshot changes nothing.
        f.adopt_capacity(100);
        assert_eq!(f.capacity(), 440);
        // Nothing from a peer that learned nothing (0), nor what is not
        // under the guess (an older build's index capacity).
        let g = Feedback::new(65_536);
        g.adopt_capacity(0);
        g.adopt_capacity(65_536);
        assert_eq!((g.capacity(), g.capacity_learned()), (65_536, false));
        // A published capacity stays.
        g.set_known_capacity(1000);
        g.adopt_capacity(500);
        assert_eq!(g.capacity(), 1000);
    }

    #[test]
    fn private_leads_lost_lower_the_share_kept_and_kept_ones_raise_it() {
        let f = Feedback::new(10_000);
        assert_eq!(f.private_kept(), 1.0);
        // 100 blocks predicted, 40 of them shared: the engine held the shared
        // part only (640 of 1600 tokens), so none of the lead.
        for _ in 0..40 {
            f.observe_private(usage(640), 100, 100, 40);
        }
        let lost = f.private_kept();
        assert!(lost < 0.2, "{lost}");
        // Half the lead held (70 of 100 blocks).
        for _ in 0..200 {
            f.observe_private(usage(1120), 100, 100, 40);
        }
        assert!(
            (f.private_kept() - 0.5).abs() < 0.05,
            "{}",
            f.private_kept()
        );
        // All held.
        for _ in 0..200 {
            f.observe_private(usage(1600), 100, 100, 40);
        }
        assert!(f.private_kept() > 0.95, "{}", f.private_kept());
        // No lead to speak of: no change.
        let before = f.private_kept();
        f.observe_private(usage(0), 100, 45, 40);
        assert_eq!(f.private_kept(), before);
        // A lead no other engine shares a prompt with (the prompt's only
        // copy and the history) says nothing of histories: no change.
        f.observe_private(usage(0), 100, 100, SHARED_MIN_BLOCKS - 1);
        assert_eq!(f.private_kept(), before);
    }

    #[test]
    fn prefill_rate_follows_observations() {
        let f = Feedback::new(1000);
        assert_eq!(f.prefill_rate(), 0.0);
        for _ in 0..40 {
            f.observe_ttft(200, 0.1);
        }
        assert!(
            (f.prefill_rate() - 2000.0).abs() < 50.0,
            "{}",
            f.prefill_rate()
        );
        // Tiny requests teach nothing.
        f.observe_ttft(3, 10.0);
        f.observe_ttft(31, 10.0);
        assert!((f.prefill_rate() - 2000.0).abs() < 50.0);
    }

    #[test]
    fn one_slow_first_sample_does_not_mark_an_engine_slow() {
        let f = Feedback::new(1000);
        // Taken while the engine was busy: a third of its rate.
        f.observe_ttft(200, 0.3);
        assert_eq!(f.prefill_rate(), 0.0, "one sample is not a rate yet");
        for _ in 1..RATE_MIN_SAMPLES {
            f.observe_ttft(200, 0.1);
        }
        let r = f.prefill_rate();
        assert!(r > 1500.0, "the busy sample is one of eight: {r}");
    }
}
