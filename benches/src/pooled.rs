//! What one cache pooled from the whole fleet's blocks would have hit on a
//! recorded trace: the same requests at the same times, on one engine with
//! every engine's KV blocks and no placement at all. A reference for the
//! hit-rate target under pressure: the pool keeps each system prompt once
//! where separate caches keep a copy on each engine that serves it, and in
//! the replays of decision 0041 the best assignment of whole system
//! prompts to engines came within half a point of the pool or under it.
//!
//! The cache is the sim-engine's own ([`KvCache`]: vLLM's block pool, LRU
//! free list, a released request's tail evicted first) and the rest is
//! `benches/scripts/kv_replay.py`'s model, which reproduces the engines'
//! reported hit rates within about a point: a request reserves its prompt
//! plus `max_tokens` at admission and waits FIFO until they fit; its new
//! prompt blocks are cached at once; its answer's blocks are cached when it
//! ends, after its recorded duration.
//!
//! The trace gives no prompt contents, so blocks are keys: a system prompt's
//! first blocks (the shortest prefix any first turn of it could have hit)
//! are shared by its conversations, the rest are the conversation's own,
//! and a later turn carries over as many of its conversation's blocks as an
//! unbounded cache would have hit (`ceiling_cached_tokens`).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use testkit::engine::block_hash::{BLOCK_SIZE, BlockHash};
use testkit::engine::kv_cache::KvCache;
use testkit::workload::Record;

/// A block's content: a system prompt's i-th block, or a conversation's
/// i-th block as first computed by one of its turns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Key {
    Prompt { prefix: u32, i: usize },
    Conv { session: u64, i: usize, turn: u32 },
}

impl Key {
    fn block_hash(self) -> BlockHash {
        let mut h = std::hash::DefaultHasher::new();
        Hash::hash(&self, &mut h);
        h.finish()
    }
}

/// One request of the trace, as blocks.
struct Req {
    start_ns: u64,
    dur_ns: u64,
    prompt_tokens: usize,
    /// The prompt's full blocks.
    prompt: Vec<BlockHash>,
    /// The answer's blocks past the prompt's.
    out: Vec<BlockHash>,
}

/// Requests in start order with their blocks (see the module's doc).
fn requests(records: &[Record]) -> Vec<Req> {
    let mut recs: Vec<&Record> = records.iter().filter(|r| r.status == 200).collect();
    recs.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
    let mut prompt_blocks: HashMap<u32, usize> = HashMap::new();
    for r in recs
        .iter()
        .filter(|r| r.turn == 1 && r.ceiling_cached_tokens > 0)
    {
        let b = r.ceiling_cached_tokens as usize / BLOCK_SIZE;
        prompt_blocks
            .entry(r.prefix_id)
            .and_modify(|x| *x = (*x).min(b))
            .or_insert(b);
    }
    let mut chains: HashMap<u64, Vec<Key>> = HashMap::new();
    let ns = |ms: f64| (ms.max(0.0) * 1e6) as u64;
    recs.iter()
        .map(|r| {
            let p = r.prompt_tokens as usize;
            let shared = prompt_blocks.get(&r.prefix_id).copied().unwrap_or(0);
            let keep = if r.turn > 1 {
                r.ceiling_cached_tokens as usize / BLOCK_SIZE
            } else {
                0
            };
            let full = (p + r.completion_tokens as usize).saturating_sub(1) / BLOCK_SIZE;
            let mut keys: Vec<Key> = (0..full)
                .map(|i| {
                    if i < shared {
                        Key::Prompt {
                            prefix: r.prefix_id,
                            i,
                        }
                    } else {
                        Key::Conv {
                            session: r.session,
                            i,
                            turn: r.turn,
                        }
                    }
                })
                .collect();
            if let Some(old) = chains.get(&r.session) {
                let n = old.len().min(keep).min(full);
                keys[..n].copy_from_slice(&old[..n]);
            }
            let mut prompt: Vec<BlockHash> = keys.iter().map(|k| k.block_hash()).collect();
            chains.insert(r.session, keys);
            let out = prompt.split_off((p / BLOCK_SIZE).min(prompt.len()));
            Req {
                start_ns: ns(r.start_ms),
                dur_ns: ns(r.end_ms - r.start_ms),
                prompt_tokens: p,
                prompt,
                out,
            }
        })
        .collect()
}

/// The pooled engine: its cache and what it counted.
struct Pool {
    cache: KvCache,
    max_tokens: usize,
    in_flight: usize,
    prompt_tokens: u64,
    cached_tokens: u64,
}

impl Pool {
    /// Admits `q` if its blocks fit beside the running requests: counts its
    /// hit (the leading cached blocks, at most all but the last token's, as
    /// the engine computes at least one) and caches its new prompt blocks.
    fn admit(&mut self, q: &Req) -> Option<Vec<u32>> {
        let hit = self
            .cache
            .lookup(&q.prompt)
            .min(q.prompt_tokens.saturating_sub(1) / BLOCK_SIZE);
        let total = (q.prompt_tokens + self.max_tokens).div_ceil(BLOCK_SIZE);
        let blocks = self.cache.allocate(&q.prompt, hit, total)?;
        for (&b, &h) in blocks.iter().zip(&q.prompt).skip(hit) {
            self.cache.register(b, h);
        }
        self.in_flight += 1;
        self.prompt_tokens += q.prompt_tokens as u64;
        self.cached_tokens += (hit * BLOCK_SIZE) as u64;
        Some(blocks)
    }

    /// Ends a request: its answer is cached in the blocks it reserved past
    /// the prompt, then all its blocks are freed.
    fn end(&mut self, q: &Req, blocks: &[u32]) {
        for (&b, &h) in blocks.iter().skip(q.prompt.len()).zip(&q.out) {
            self.cache.register(b, h);
        }
        self.cache.release(blocks);
        self.in_flight -= 1;
    }
}

/// The hit rate (cached over prompt tokens) of `records` replayed on one
/// cache of `blocks` blocks whose requests reserve `max_tokens` for their
/// answers; `None` for a trace with no request that fits. A request larger
/// than the whole cache is left out.
pub fn pooled_hit_rate(records: &[Record], blocks: usize, max_tokens: usize) -> Option<f64> {
    let reqs = requests(records);
    let mut pool = Pool {
        cache: KvCache::new(blocks),
        max_tokens,
        in_flight: 0,
        prompt_tokens: 0,
        cached_tokens: 0,
    };
    // (time, arrival after completion at the same time, request)
    let mut events: BinaryHeap<Reverse<(u64, bool, usize)>> = reqs
        .iter()
        .enumerate()
        .map(|(i, q)| Reverse((q.start_ns, true, i)))
        .collect();
    let mut waiting: VecDeque<usize> = VecDeque::new();
    let mut holding: HashMap<usize, Vec<u32>> = HashMap::new();
    while let Some(Reverse((t, arrival, i))) = events.pop() {
        if arrival {
            waiting.push_back(i);
        } else if let Some(b) = holding.remove(&i) {
            pool.end(&reqs[i], &b);
        }
        while let Some(&j) = waiting.front() {
            match pool.admit(&reqs[j]) {
                Some(b) => {
                    waiting.pop_front();
                    holding.insert(j, b);
                    events.push(Reverse((t + reqs[j].dur_ns, false, j)));
                }
                // Too large for the whole cache: it would block the queue.
                None if pool.in_flight == 0 => {
                    waiting.pop_front();
                }
                None => break,
            }
        }
    }
    (pool.prompt_tokens > 0).then(|| pool.cached_tokens as f64 / pool.prompt_tokens as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 200-status record of `prompt` tokens answered with 16.
    fn rec(session: u64, turn: u32, prefix: u32, start: f64, prompt: u64, ceiling: u64) -> Record {
        Record {
            seq: 0,
            scenario: "chat".into(),
            user: session,
            session,
            turn,
            turns: 2,
            prefix_id: prefix,
            start_ms: start,
            ttft_ms: Some(1.0),
            end_ms: start + 10.0,
            latency_ms: 10.0,
            status: 200,
            error: None,
            prompt_tokens: prompt,
            cached_tokens: 0,
            completion_tokens: 16,
            local_prompt_tokens: prompt,
            ceiling_cached_tokens: ceiling,
            instance: None,
            decision: None,
            replica: None,
            tenant: None,
        }
    }

    /// Two conversations on one 320-token system prompt: the second's first
    /// turn hits the prompt, each second turn hits its own history. In a
    /// cache too small for both histories, the one written last survives.
    #[test]
    fn a_pooled_cache_hits_what_it_still_holds() {
        // Turn 1: 320 prompt + 16 user tokens; turn 2 adds the answer and
        // another user turn, and an unbounded cache would hit 336 of it.
        let trace = [
            rec(1, 1, 0, 0.0, 336, 0),
            rec(2, 1, 0, 20.0, 336, 320),
            rec(1, 2, 0, 40.0, 368, 336),
            rec(2, 2, 0, 60.0, 368, 336),
        ];
        let prompt = (2 * 336 + 2 * 368) as f64;
        let big = pooled_hit_rate(&trace, 1000, 16).unwrap();
        assert_eq!(big, (320 + 336 + 336) as f64 / prompt);
        // 24 blocks: a second turn reserves all of them (368 + 16 tokens),
        // so the first one evicts the least recent block, the other
        // conversation's history, and the last turn hits only the prompt.
        let small = pooled_hit_rate(&trace, 24, 16).unwrap();
        assert_eq!(small, (320 + 336 + 320) as f64 / prompt);
        assert_eq!(pooled_hit_rate(&[], 100, 16), None);
    }

    /// A request that does not fit waits for the one ahead to end, and then
    /// finds its blocks cached: waiting does not lose the hit.
    #[test]
    fn a_request_waits_for_room_and_keeps_its_hit() {
        let mut a = rec(1, 1, 0, 0.0, 320, 0);
        a.end_ms = 100.0;
        let b = rec(2, 1, 0, 1.0, 320, 320);
        // Each reserves 21 blocks (320 + 16 tokens), the second 2 past the
        // 19 it shares: 22 blocks leave it 1 while the first runs.
        let r = pooled_hit_rate(&[a, b], 22, 16).unwrap();
        assert_eq!(r, 304.0 / 640.0);
    }
}
