//! Decoding vLLM's KV-cache event batches (`vllm/distributed/kv_events.py`;
//! SGLang publishes the same), tolerantly.
//!
//! A batch is `[ts, events, data_parallel_rank]` or a map with those names;
//! an event is an array tagged first (`["BlockStored", block_hashes,
//! parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
//! extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window]`,
//! older versions stopping earlier) or a map with a `type` key and default
//! fields left out. Both encodings are accepted at both levels, in any mix.
//!
//! Tolerance: an unknown event kind, an unknown field or a field of the wrong
//! type is counted in [`Skipped`] and passed over; only a payload that is not
//! msgpack or not a batch at all is an error. Block hashes are opaque ids: a
//! u64 (which may exceed `i64::MAX`, or arrive as a negative i64 from a
//! signed encoder) is taken as is, 32 raw bytes (or any other byte string)
//! are folded into a u64 with xxh3; they are never recomputed. Events of
//! groups that are not full attention (sliding-window or mamba groups of a
//! hybrid model) are counted and left out: their blocks say nothing of the
//! prefix a request can reuse.

use rmpv::Value;
use xxhash_rust::xxh3::xxh3_64;

/// An engine's block hash, as an opaque id.
pub type EngineHash = u64;

/// One decoded event.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// Blocks the engine computed and now caches, one chain: block `i+1`'s
    /// parent is block `i`, block 0's is `parent` (`None`: a sequence start).
    Stored {
        hashes: Vec<EngineHash>,
        parent: Option<EngineHash>,
        /// The tokens of all the blocks, `block_size` each.
        token_ids: Vec<u32>,
        /// Tokens per block (`None` when the event leaves it out).
        block_size: Option<u32>,
        lora_name: Option<String>,
        /// Per block, the extra keys the engine folded into its hash (LoRA
        /// name, multimodal ids, the cache salt on a sequence's first block),
        /// each as bytes.
        extra_keys: Vec<Vec<Vec<u8>>>,
    },
    /// Blocks the engine evicted.
    Removed { hashes: Vec<EngineHash> },
    /// The engine dropped its whole cache.
    Cleared,
}

/// What decoding passed over, for the counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Skipped {
    /// Events of a kind this decoder does not know (or without a kind).
    pub unknown_kinds: u32,
    /// Fields this decoder does not know, or known ones of the wrong type.
    pub unknown_fields: u32,
    /// Events of groups that are not full attention.
    pub other_groups: u32,
}

/// A decoded batch.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// When the engine published it (seconds since the Unix epoch).
    pub ts: f64,
    pub events: Vec<Event>,
    pub dp_rank: Option<i64>,
    pub skipped: Skipped,
}

/// A payload that is not a batch at all.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("payload is not msgpack: {0}")]
    NotMsgpack(String),
    #[error("payload is not an event batch: {0}")]
    NotABatch(&'static str),
}

/// Group indices of groups that are not full attention, learned from the
/// `BlockStored` events that name their kind (a `BlockRemoved` names only
/// the group index). One per stream.
#[derive(Clone, Copy, Debug, Default)]
pub struct Groups {
    other: u64,
}

impl Groups {
    fn is_other(&self, g: Option<i64>) -> bool {
        g.is_some_and(|g| (0..64).contains(&g) && self.other & (1 << g) != 0)
    }
}

/// Decodes one batch payload.
pub fn decode_batch(payload: &[u8], groups: &mut Groups) -> Result<Batch, DecodeError> {
    let mut rd = payload;
    let v =
        rmpv::decode::read_value(&mut rd).map_err(|e| DecodeError::NotMsgpack(e.to_string()))?;
    let mut skipped = Skipped::default();
    let (ts, events, rank) = match v {
        Value::Array(a) => {
            let mut it = a.into_iter();
            let ts = it.next();
            let events = it.next();
            let rank = it.next();
            skipped.unknown_fields += it.count() as u32;
            (ts, events, rank)
        }
        Value::Map(m) => {
            let (mut ts, mut events, mut rank) = (None, None, None);
            for (k, v) in m {
                match k.as_str() {
                    Some("ts") => ts = Some(v),
                    Some("events") => events = Some(v),
                    Some("data_parallel_rank") => rank = Some(v),
                    _ => skipped.unknown_fields += 1,
                }
            }
            (ts, events, rank)
        }
        _ => return Err(DecodeError::NotABatch("neither an array nor a map")),
    };
    let ts = match ts {
        Some(v) => v.as_f64().or_else(|| v.as_i64().map(|i| i as f64)),
        None => None,
    }
    .ok_or(DecodeError::NotABatch("no timestamp"))?;
    let Some(Value::Array(raw)) = events else {
        return Err(DecodeError::NotABatch("no event list"));
    };
    let dp_rank = rank.and_then(|r| r.as_i64());
    let mut events = Vec::with_capacity(raw.len());
    for e in raw {
        if let Some(ev) = decode_event(e, groups, &mut skipped) {
            events.push(ev);
        }
    }
    Ok(Batch {
        ts,
        events,
        dp_rank,
        skipped,
    })
}

/// The fields of an event by name, from either encoding.
#[derive(Default)]
struct Fields {
    hashes: Option<Value>,
    parent: Option<Value>,
    token_ids: Option<Value>,
    block_size: Option<Value>,
    lora_name: Option<Value>,
    extra_keys: Option<Value>,
    group_idx: Option<Value>,
    spec_kind: Option<Value>,
    sliding_window: Option<Value>,
}

impl Fields {
    /// Puts a named field in place; false when the name is unknown.
    fn set(&mut self, name: &str, v: Value) -> bool {
        let slot = match name {
            "block_hashes" => &mut self.hashes,
            "parent_block_hash" => &mut self.parent,
            "token_ids" => &mut self.token_ids,
            "block_size" => &mut self.block_size,
            "lora_name" => &mut self.lora_name,
            "extra_keys" => &mut self.extra_keys,
            "group_idx" => &mut self.group_idx,
            "kv_cache_spec_kind" => &mut self.spec_kind,
            "kv_cache_spec_sliding_window" => &mut self.sliding_window,
            // Known and not needed here.
            "lora_id" | "medium" => return true,
            _ => return false,
        };
        *slot = Some(v);
        true
    }
}

/// The array positions of each kind's fields (after the tag).
const STORED_FIELDS: [&str; 11] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
];
const REMOVED_FIELDS: [&str; 3] = ["block_hashes", "medium", "group_idx"];
const CLEARED_FIELDS: [&str; 1] = ["medium"];

fn decode_event(e: Value, groups: &mut Groups, skipped: &mut Skipped) -> Option<Event> {
    let mut f = Fields::default();
    let kind = match e {
        Value::Array(a) => {
            let mut it = a.into_iter();
            let kind = it.next().and_then(|t| t.as_str().map(str::to_owned));
            let names: &[&str] = match kind.as_deref() {
                Some("BlockStored") => &STORED_FIELDS,
                Some("BlockRemoved") => &REMOVED_FIELDS,
                Some("AllBlocksCleared") => &CLEARED_FIELDS,
                _ => {
                    skipped.unknown_kinds += 1;
                    return None;
                }
            };
            for (i, v) in it.enumerate() {
                match names.get(i) {
                    Some(n) => {
                        f.set(n, v);
                    }
                    None => skipped.unknown_fields += 1,
                }
            }
            kind
        }
        Value::Map(m) => {
            let mut kind = None;
            for (k, v) in m {
                match k.as_str() {
                    Some("type") => kind = v.as_str().map(str::to_owned),
                    Some(name) if f.set(name, v.clone()) => {}
                    _ => skipped.unknown_fields += 1,
                }
            }
            kind
        }
        _ => {
            skipped.unknown_kinds += 1;
            return None;
        }
    };
    let group = opt(f.group_idx.take()).and_then(|g| g.as_i64());
    match kind.as_deref() {
        Some("BlockStored") => {
            let kind_other = opt(f.spec_kind.take())
                .and_then(|k| k.as_str().map(|s| s != "full_attention"))
                .unwrap_or(false);
            let sliding = opt(f.sliding_window.take()).is_some();
            if kind_other || sliding {
                if let Some(g) = group.filter(|g| (0..64).contains(g)) {
                    groups.other |= 1 << g;
                }
                skipped.other_groups += 1;
                return None;
            }
            if groups.is_other(group) {
                skipped.other_groups += 1;
                return None;
            }
            let Some(hashes) = hash_list(f.hashes.take(), skipped) else {
                skipped.unknown_fields += 1;
                return None;
            };
            let parent = opt(f.parent.take()).and_then(|p| {
                let h = hash_of(&p);
                if h.is_none() {
                    skipped.unknown_fields += 1;
                }
                h
            });
            let token_ids = match opt(f.token_ids.take()) {
                Some(Value::Array(a)) => {
                    let mut t = Vec::with_capacity(a.len());
                    for v in &a {
                        match v.as_u64().and_then(|x| u32::try_from(x).ok()) {
                            Some(x) => t.push(x),
                            None => {
                                skipped.unknown_fields += 1;
                                return None;
                            }
                        }
                    }
                    t
                }
                Some(_) => {
                    skipped.unknown_fields += 1;
                    return None;
                }
                None => Vec::new(),
            };
            let block_size = opt(f.block_size.take())
                .and_then(|b| b.as_u64())
                .and_then(|b| u32::try_from(b).ok())
                .filter(|&b| b > 0);
            let lora_name = opt(f.lora_name.take()).and_then(|l| l.as_str().map(str::to_owned));
            let extra_keys = match opt(f.extra_keys.take()) {
                Some(Value::Array(per_block)) => per_block.iter().map(extra_of).collect(),
                _ => Vec::new(),
            };
            Some(Event::Stored {
                hashes,
                parent,
                token_ids,
                block_size,
                lora_name,
                extra_keys,
            })
        }
        Some("BlockRemoved") => {
            if groups.is_other(group) {
                skipped.other_groups += 1;
                return None;
            }
            let Some(hashes) = hash_list(f.hashes.take(), skipped) else {
                skipped.unknown_fields += 1;
                return None;
            };
            Some(Event::Removed { hashes })
        }
        Some("AllBlocksCleared") => Some(Event::Cleared),
        _ => {
            skipped.unknown_kinds += 1;
            None
        }
    }
}

/// `None` for an absent field and for nil.
fn opt(v: Option<Value>) -> Option<Value> {
    v.filter(|v| !v.is_nil())
}

/// A block hash as an opaque u64 id.
pub fn hash_of(v: &Value) -> Option<EngineHash> {
    match v {
        Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|x| x as u64)),
        Value::Binary(b) => Some(xxh3_64(b)),
        Value::String(s) => Some(xxh3_64(s.as_bytes())),
        _ => None,
    }
}

fn hash_list(v: Option<Value>, skipped: &mut Skipped) -> Option<Vec<EngineHash>> {
    let Some(Value::Array(a)) = v else {
        return None;
    };
    let mut out = Vec::with_capacity(a.len());
    for h in &a {
        match hash_of(h) {
            Some(h) => out.push(h),
            None => skipped.unknown_fields += 1,
        }
    }
    Some(out)
}

/// One block's extra keys, each as bytes (strings and byte strings as they
/// are, integers as 8 little-endian bytes, nested arrays flattened).
fn extra_of(v: &Value) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    fn walk(v: &Value, out: &mut Vec<Vec<u8>>) {
        match v {
            Value::String(s) => out.push(s.as_bytes().to_vec()),
            Value::Binary(b) => out.push(b.clone()),
            Value::Integer(i) => {
                let x = i.as_u64().or_else(|| i.as_i64().map(|x| x as u64));
                out.push(x.unwrap_or(0).to_le_bytes().to_vec());
            }
            Value::Array(a) => a.iter().for_each(|x| walk(x, out)),
            _ => {}
        }
    }
    walk(v, &mut out);
    out
}

#[cfg(test)]
mod tests;
