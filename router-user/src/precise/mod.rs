//! Precise mode: follow what each engine's KV cache really holds, from the
//! engine's own KV-cache event stream (vLLM's, SGLang's), with a confidence
//! state per backend.
//!
//! - [`events`]: decoding event batches, both encodings, tolerantly.
//! - [`subscriber`]: one thread per backend: the ZMQ subscription, gap
//!   detection and replay, restart detection.
//! - [`confidence`]: EXACT / DEGRADED per backend and the stream counters.
//! - [`index`]: the precise index, keyed by block content, with the burst
//!   guard.
//! - [`keys`]: the keys of blocks, and a request's engine tokens.
//! - [`tokenizer`]: the model's tokenizer and chat template, with a cache
//!   of the tokens of messages already seen.
//! - [`offload`]: the threads that tokenize for the traffic workers,
//!   bounded in work per request, in threads and in jobs waiting.
//!
//! Routing reads, per backend, the precise index while that backend is
//! EXACT and the approximate index (`fleet::index`, always kept) while it
//! is DEGRADED. Invariant: nothing here runs on the request path but
//! [`Precise::matches`] and [`Precise::guard`] (atomics, no lock, no I/O),
//! [`Adapters::of_model`] (a snapshot's load), the toy tokenizer and
//! token ids (cut to the token budget), and handing a model tokenizer's
//! work to [`offload`] (a queue's `try_send`). A model tokenizer and its
//! chat template run on the offload threads, or the admin's.

pub mod confidence;
pub mod events;
pub mod index;
pub mod keys;
pub mod metrics;
pub mod offload;
pub mod subscriber;
pub mod tokenizer;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::Instant;

use arc_swap::ArcSwap;

use confidence::{Confidence, Reason, State};
use events::{Batch, Event};
use index::{PreciseIndex, StoreMiss};
use tokenizer::Tokenizers;

use crate::fleet::MAX_BACKENDS;
use crate::fleet::index::{Matches, PrefixIndex};
use crate::fleet::owners::BackendSet;

/// Tuning of precise mode (`config::precise`, `[precise]`, documented there).
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    /// Tokens per engine block when an event does not say.
    pub block_tokens: usize,
    /// How long a just-routed request's blocks count as held (burst guard).
    pub burst_ms: u32,
    /// How long a backend stays DEGRADED after a lost batch.
    pub recover_ms: u64,
}

/// Most LoRA adapter names remembered (a bound on memory; vLLM serves a
/// handful per engine, `--max-loras`).
const MAX_ADAPTERS: usize = 4096;

/// The LoRA adapters the engines' events name. vLLM keys an adapter's
/// blocks apart (its name in every block's extra keys); a request names the
/// adapter in its `model`. So a request whose `model` is a name seen here
/// is keyed in that adapter's namespace, as the subscriber keys the
/// engine's blocks, and matches them; any other is keyed as the base model.
#[derive(Default)]
pub struct Adapters {
    names: ArcSwap<hashbrown::HashSet<Box<[u8]>>>,
    full: AtomicBool,
}

impl Adapters {
    /// Remembers `name` (an event's `lora_name`).
    pub fn learn(&self, name: &str) {
        if self.names.load().contains(name.as_bytes()) {
            return;
        }
        if self.names.load().len() >= MAX_ADAPTERS {
            if !self.full.swap(true, Relaxed) {
                tracing::warn!(
                    max = MAX_ADAPTERS,
                    "precise mode: too many LoRA adapters named in events; requests for new ones are keyed as the base model"
                );
            }
            return;
        }
        self.names.rcu(|set| {
            let mut set = (**set).clone();
            set.insert(name.as_bytes().into());
            set
        });
    }

    /// The adapter a request's `model` names, if the engines serve it.
    pub fn of_model<'a>(&self, model: &'a [u8]) -> Option<&'a str> {
        if model.is_empty() || !self.names.load().contains(model) {
            return None;
        }
        std::str::from_utf8(model).ok()
    }
}

/// The precise index and every backend's confidence.
pub struct Precise {
    pub index: PreciseIndex,
    /// The approximate index: an engine that flushed or restarted holds
    /// nothing the router sent it either.
    approx: Arc<PrefixIndex>,
    pub confidence: Box<[Confidence]>,
    pub settings: Settings,
    /// Each model's tokenizer (loaded at start).
    pub tokenizers: Tokenizers,
    /// LoRA adapters the events name.
    pub adapters: Adapters,
    started: Instant,
}

impl Precise {
    pub fn new(
        total_capacity: usize,
        settings: Settings,
        tokenizers: Tokenizers,
        approx: Arc<PrefixIndex>,
    ) -> Precise {
        Precise {
            tokenizers,
            index: PreciseIndex::new(total_capacity),
            approx,
            confidence: (0..MAX_BACKENDS).map(|_| Confidence::new()).collect(),
            settings,
            adapters: Adapters::default(),
            started: Instant::now(),
        }
    }

    /// Milliseconds since start (the clock of the guard and the recovery).
    pub fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Whether routing reads the precise index for `slot` now.
    #[inline]
    pub fn exact(&self, slot: usize, now_ms: u64) -> bool {
        self.confidence[slot].state(now_ms) == State::Exact
    }

    /// Leading blocks of `keys` each backend in `candidates` holds.
    pub fn matches(&self, keys: &[u64], candidates: &BackendSet, now_ms: u64, out: &mut Matches) {
        self.index
            .longest_matches(keys, candidates, now_ms as u32, self.settings.burst_ms, out);
    }

    /// The burst guard: `keys` were just sent to `slot`.
    pub fn guard(&self, slot: usize, keys: &[u64], now_ms: u64) {
        if self.settings.burst_ms > 0 {
            self.index
                .guard(slot, keys, now_ms as u32, self.settings.burst_ms);
        }
    }

    /// Forgets `slot`'s blocks (flush, restart, or a stream no longer trusted).
    pub fn forget(&self, slot: usize) {
        self.index.clear_backend(slot);
        self.confidence[slot].clears.fetch_add(1, Relaxed);
    }

    /// `slot`'s engine dropped its whole cache (`AllBlocksCleared`, a
    /// restart): both indexes forget it.
    pub fn flushed(&self, slot: usize) {
        self.approx.clear_backend(slot);
        self.forget(slot);
    }

    /// A batch of `slot` was lost for good: forget, DEGRADED for a while.
    pub fn lost(&self, slot: usize, reason: Reason) {
        self.confidence[slot].lost(reason, self.now_ms() + self.settings.recover_ms);
        self.forget(slot);
    }

    /// Applies one decoded batch of `slot` with sequence number `seq`.
    pub fn apply(&self, slot: usize, seq: u64, batch: &Batch) {
        let c = &self.confidence[slot];
        c.skipped_events
            .fetch_add(u64::from(batch.skipped.unknown_kinds), Relaxed);
        c.skipped_fields
            .fetch_add(u64::from(batch.skipped.unknown_fields), Relaxed);
        c.other_group_events
            .fetch_add(u64::from(batch.skipped.other_groups), Relaxed);
        for e in &batch.events {
            match e {
                Event::Stored {
                    hashes,
                    parent,
                    token_ids,
                    block_size,
                    lora_name,
                    extra_keys,
                } => {
                    let block = block_size.map_or(self.settings.block_tokens, |b| b as usize);
                    let seed = keys::chain_seed(lora_name.as_deref());
                    // The adapter is in the chain's seed: its name, which
                    // vLLM also puts in every block's extra keys (some
                    // versions do not), is left out of them, so the keys
                    // are the same whichever the engine sends.
                    let stripped;
                    let extra = match lora_name {
                        Some(l) => {
                            self.adapters.learn(l);
                            stripped = without(extra_keys, l.as_bytes());
                            &stripped
                        }
                        None => extra_keys,
                    };
                    match self.index.stored(
                        slot,
                        &index::StoredChain {
                            seed,
                            parent: *parent,
                            hashes,
                            tokens: token_ids,
                            block,
                            extra,
                        },
                    ) {
                        Ok(_) => {}
                        Err(StoreMiss::UnknownParent) => {
                            c.unknown_parents.fetch_add(1, Relaxed);
                        }
                        Err(StoreMiss::TokenCount) => {
                            c.skipped_fields.fetch_add(1, Relaxed);
                        }
                    }
                }
                Event::Removed { hashes } => {
                    self.index.removed(slot, hashes);
                }
                Event::Cleared => self.flushed(slot),
            }
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let lag_us = ((now - batch.ts).max(0.0) * 1e6) as u64;
        c.applied(seq, lag_us, batch.events.len());
    }
}

/// `extra` (per block, its extra keys) without the key `name`.
fn without(extra: &[Vec<Vec<u8>>], name: &[u8]) -> Vec<Vec<Vec<u8>>> {
    extra
        .iter()
        .map(|keys| {
            keys.iter()
                .filter(|k| k.as_slice() != name)
                .cloned()
                .collect()
        })
        .collect()
}
