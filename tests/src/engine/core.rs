//! The engine proper: admission, continuous batching and prefix caching, as
//! pure state transitions. The scheduler task ([`super::scheduler`]) calls
//! [`Engine::plan_step`], sleeps for the step's simulated duration, then calls
//! [`Engine::apply_step`]; zero-cost mode calls [`Engine::run_now`] instead.
//!
//! Invariant: this module does no I/O and never waits; progress reaches the
//! connection tasks through one unbounded channel per request.

use super::block_hash::{BLOCK_SIZE, PromptBlocks};
use super::config::{EngineArgs, SchedulingPolicy};
use super::faults::{Dice, Faults};
use super::kv_cache::KvCache;
use super::metrics::{Gauges, Metrics};
use super::output_text;
use super::tokenize::Token;
use std::collections::{HashMap, VecDeque};
use std::time::Instant;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

/// What a request's connection task learns after each engine step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// Tokens generated so far.
    pub generated: u32,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u32,
    /// The request is complete.
    pub done: bool,
}

/// Step timing, in simulated seconds.
#[derive(Clone, Copy, Debug)]
struct Timing {
    step_s: f64,
    per_seq_s: f64,
    prefill_tps: f64,
    max_num_seqs: usize,
    max_batched: usize,
    policy: SchedulingPolicy,
}

struct Seq {
    prompt: PromptBlocks,
    /// The prompt's tokens while KV events are published (their BlockStored
    /// events carry them), else empty.
    tokens: Vec<Token>,
    /// Its `cache_salt`, the extra key of its first block's event.
    salt: Option<Vec<u8>>,
    max_tokens: u32,
    /// Its `priority` (lower first under `SchedulingPolicy::Priority`).
    priority: i64,
    arrival: Instant,
    tx: UnboundedSender<Progress>,
    blocks: Vec<u32>,
    computed: usize,
    registered: usize,
    generated: u32,
    cached: u32,
}

/// One engine step: which sequences decode and how many prompt tokens each
/// prefilling sequence computes.
#[derive(Clone, Debug, Default)]
pub struct StepPlan {
    /// Simulated duration in seconds (before --time-scale).
    pub dur_s: f64,
    /// The part of `dur_s` spent computing prompt tokens.
    pub prefill_s: f64,
    decodes: Vec<u64>,
    prefills: Vec<(u64, usize)>,
}

/// Engine state shared by the connection tasks and the scheduler.
pub struct Engine {
    pub cache: KvCache,
    pub metrics: Metrics,
    pub faults: Faults,
    pub dice: Dice,
    timing: Timing,
    seqs: HashMap<u64, Seq>,
    /// In the order they are admitted: arrival, or (priority, arrival)
    /// under `SchedulingPolicy::Priority`.
    waiting: VecDeque<u64>,
    running: Vec<u64>,
    next_id: u64,
}

impl Engine {
    /// An idle engine configured by `args`.
    pub fn new(args: &EngineArgs) -> Self {
        Self {
            cache: KvCache::new(args.kv_blocks),
            metrics: Metrics::default(),
            faults: Faults {
                fail_rate: args.fail_rate,
                drop_mid_stream_rate: args.drop_mid_stream_rate,
                stall_first_byte_ms: args.stall_first_byte_ms,
                bad_cached_tokens: args.bad_cached_tokens.clone(),
                ..Faults::default()
            },
            dice: Dice::new(args.seed),
            timing: Timing {
                step_s: args.decode_step_ms / 1e3,
                per_seq_s: args.decode_step_per_seq_ms / 1e3,
                prefill_tps: args.prefill_tps,
                max_num_seqs: args.max_num_seqs.max(1),
                max_batched: args.max_num_batched_tokens.max(1),
                policy: args.scheduling_policy,
            },
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
        }
    }

    /// Blocks a request needs for its prompt and all its output.
    pub fn blocks_needed(num_prompt: usize, max_tokens: u32) -> usize {
        (num_prompt + max_tokens as usize).div_ceil(BLOCK_SIZE)
    }

    /// Queues a request; progress arrives on the returned channel.
    pub fn submit(
        &mut self,
        prompt: PromptBlocks,
        max_tokens: u32,
        now: Instant,
    ) -> UnboundedReceiver<Progress> {
        self.submit_tokens(prompt, Vec::new(), None, (max_tokens, 0), now)
    }

    /// Whether a request of this `priority` is accepted: vLLM refuses a
    /// nonzero one unless it schedules by priority.
    pub fn check_priority(&self, priority: i64) -> Result<(), String> {
        if priority != 0 && self.timing.policy != SchedulingPolicy::Priority {
            return Err(format!(
                "Got priority {priority} but Priority scheduling is not enabled."
            ));
        }
        Ok(())
    }

    /// [`submit`](Self::submit) with the prompt's `tokens`, for the KV
    /// events of its blocks, and its `(max_tokens, priority)`. Under
    /// `SchedulingPolicy::Priority` it waits behind every request of a
    /// lower or equal priority, ahead of the others, as vLLM's waiting
    /// heap orders by (priority, arrival).
    pub fn submit_tokens(
        &mut self,
        prompt: PromptBlocks,
        tokens: Vec<Token>,
        salt: Option<Vec<u8>>,
        (max_tokens, priority): (u32, i64),
        now: Instant,
    ) -> UnboundedReceiver<Progress> {
        let (tx, rx) = unbounded_channel();
        let id = self.next_id;
        self.next_id += 1;
        let seq = Seq {
            prompt,
            tokens,
            salt,
            max_tokens: max_tokens.max(1),
            priority,
            arrival: now,
            tx,
            blocks: Vec::new(),
            computed: 0,
            registered: 0,
            generated: 0,
            cached: 0,
        };
        self.seqs.insert(id, seq);
        match self.timing.policy {
            SchedulingPolicy::Fcfs => self.waiting.push_back(id),
            SchedulingPolicy::Priority => {
                let seqs = &self.seqs;
                let at = self
                    .waiting
                    .partition_point(|w| seqs.get(w).is_some_and(|s| s.priority <= priority));
                self.waiting.insert(at, id);
            }
        }
        rx
    }

    /// Serves a request at once (zero-cost mode): cache lookup, insertion of
    /// prompt and output blocks, release. Returns the cached prompt tokens,
    /// or `None` if its blocks do not fit next to the running requests.
    pub fn run_now(&mut self, prompt: &PromptBlocks, max_tokens: u32) -> Option<u32> {
        self.run_now_tokens(prompt, &[], None, max_tokens)
    }

    /// [`run_now`](Self::run_now) with the prompt's `tokens`, for the KV
    /// events of its blocks.
    pub fn run_now_tokens(
        &mut self,
        prompt: &PromptBlocks,
        tokens: &[Token],
        salt: Option<&[u8]>,
        max_tokens: u32,
    ) -> Option<u32> {
        let hit = prompt.usable_hit_blocks(self.cache.lookup(&prompt.hashes));
        let need = Self::blocks_needed(prompt.num_tokens, max_tokens);
        let blocks = self.cache.allocate(&prompt.hashes, hit, need)?;
        store_prompt_blocks(
            &mut self.cache,
            &blocks,
            prompt,
            (tokens, salt),
            hit..prompt.hashes.len(),
        );
        let output = output_text::tokens(prompt.digest(), max_tokens);
        store_output_blocks(&mut self.cache, &blocks, prompt, &output, salt);
        self.cache.release(&blocks);
        let cached = (hit * BLOCK_SIZE) as u32;
        let m = &mut self.metrics;
        m.prefix_cache_queries += prompt.num_tokens as u64;
        m.prefix_cache_hits += u64::from(cached);
        m.prompt_tokens += prompt.num_tokens as u64;
        m.generation_tokens += u64::from(max_tokens);
        m.requests_success += 1;
        m.ttft.observe(0.0);
        m.e2e.observe(0.0);
        Some(cached)
    }

    /// Admits waiting requests (in the queue's order, while a seat and the
    /// first one's blocks are free) and plans the next step, or returns `None` when there is nothing to run.
    pub fn plan_step(&mut self) -> Option<StepPlan> {
        while self.running.len() < self.timing.max_num_seqs {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let seq = self.seqs.get_mut(&id).expect("waiting seq exists");
            if seq.tx.is_closed() {
                self.waiting.pop_front();
                self.seqs.remove(&id);
                continue;
            }
            let hit = seq
                .prompt
                .usable_hit_blocks(self.cache.lookup(&seq.prompt.hashes));
            let need = Self::blocks_needed(seq.prompt.num_tokens, seq.max_tokens);
            let Some(blocks) = self.cache.allocate(&seq.prompt.hashes, hit, need) else {
                break;
            };
            seq.blocks = blocks;
            seq.cached = (hit * BLOCK_SIZE) as u32;
            seq.computed = hit * BLOCK_SIZE;
            seq.registered = hit;
            self.metrics.prefix_cache_queries += seq.prompt.num_tokens as u64;
            self.metrics.prefix_cache_hits += u64::from(seq.cached);
            self.metrics.prompt_tokens += seq.prompt.num_tokens as u64;
            self.waiting.pop_front();
            self.running.push(id);
        }
        if self.running.is_empty() {
            return None;
        }
        let t = self.timing;
        let mut plan = StepPlan::default();
        for &id in &self.running {
            let s = &self.seqs[&id];
            if s.computed == s.prompt.num_tokens {
                plan.decodes.push(id);
            }
        }
        let mut budget = t.max_batched.saturating_sub(plan.decodes.len());
        let mut prefill_tokens = 0;
        for &id in &self.running {
            let s = &self.seqs[&id];
            let left = s.prompt.num_tokens - s.computed;
            if left > 0 && budget > 0 {
                let chunk = left.min(budget);
                budget -= chunk;
                prefill_tokens += chunk;
                plan.prefills.push((id, chunk));
            }
        }
        let seqs = plan.decodes.len() + plan.prefills.len();
        plan.dur_s = t.step_s + t.per_seq_s * seqs as f64;
        if t.prefill_tps > 0.0 {
            plan.prefill_s = prefill_tokens as f64 / t.prefill_tps;
            plan.dur_s += plan.prefill_s;
        }
        Some(plan)
    }

    /// Applies a planned step that ended at `at`.
    pub fn apply_step(&mut self, plan: &StepPlan, at: Instant) {
        self.metrics.busy_seconds += plan.dur_s;
        self.metrics.prefill_seconds += plan.prefill_s;
        for &(id, chunk) in &plan.prefills {
            let Some(s) = self.seqs.get_mut(&id) else {
                continue;
            };
            s.computed += chunk;
            let full = s.computed / BLOCK_SIZE;
            let upto = full.min(s.prompt.hashes.len()).max(s.registered);
            store_prompt_blocks(
                &mut self.cache,
                &s.blocks,
                &s.prompt,
                (&s.tokens, s.salt.as_deref()),
                s.registered..upto,
            );
            s.registered = upto;
            if s.computed == s.prompt.num_tokens {
                self.metrics
                    .ttft
                    .observe(at.saturating_duration_since(s.arrival).as_secs_f64());
                self.advance(id, at);
            }
        }
        for &id in &plan.decodes {
            self.advance(id, at);
        }
    }

    /// One more token for `id`; finishes or aborts it as needed.
    fn advance(&mut self, id: u64, at: Instant) {
        let Some(s) = self.seqs.get_mut(&id) else {
            return;
        };
        s.generated += 1;
        let done = s.generated >= s.max_tokens;
        let sent =
            s.tx.send(Progress {
                generated: s.generated,
                cached_tokens: s.cached,
                done,
            })
            .is_ok();
        if done || !sent {
            self.finish(id, at, sent);
        }
    }

    /// Caches the output blocks, frees the request's blocks and forgets it.
    fn finish(&mut self, id: u64, at: Instant, completed: bool) {
        self.running.retain(|&r| r != id);
        let Some(s) = self.seqs.remove(&id) else {
            return;
        };
        let output = output_text::tokens(s.prompt.digest(), s.generated);
        store_output_blocks(
            &mut self.cache,
            &s.blocks,
            &s.prompt,
            &output,
            s.salt.as_deref(),
        );
        self.cache.release(&s.blocks);
        self.metrics.generation_tokens += u64::from(s.generated);
        if completed {
            self.metrics.requests_success += 1;
            self.metrics
                .e2e
                .observe(at.saturating_duration_since(s.arrival).as_secs_f64());
        }
    }

    /// Gauges for `/metrics`.
    pub fn gauges(&self) -> Gauges {
        Gauges {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_usage: self.cache.used_blocks() as f64 / self.cache.num_blocks().max(1) as f64,
            num_blocks: Some(self.cache.num_blocks()),
        }
    }
}

/// Stores the prompt's blocks `range` (computed now) in `blocks`. Their
/// tokens come from `tokens` when the cache records events (else none),
/// the first block's extra key from `salt`.
fn store_prompt_blocks(
    cache: &mut KvCache,
    blocks: &[u32],
    prompt: &PromptBlocks,
    (tokens, salt): (&[Token], Option<&[u8]>),
    range: std::ops::Range<usize>,
) {
    for i in range {
        let parent = i.checked_sub(1).map(|p| prompt.hashes[p]);
        let toks = tokens
            .get(i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE)
            .unwrap_or(&[]);
        // The salt is folded into a sequence's first block.
        let extra = if i == 0 { salt } else { None };
        cache.store(blocks[i], prompt.hashes[i], parent, toks, extra);
    }
}

/// Stores the full blocks after the prompt's own once `output` was
/// generated (see `PromptBlocks::output_block_hashes`).
fn store_output_blocks(
    cache: &mut KvCache,
    blocks: &[u32],
    prompt: &PromptBlocks,
    output: &[Token],
    salt: Option<&[u8]>,
) {
    let hashes = prompt.output_block_hashes(output);
    let first = prompt.hashes.len();
    let mut seq = Vec::new();
    if cache.records_events() {
        seq.extend_from_slice(&prompt.tail);
        seq.extend_from_slice(output);
    }
    let mut parent = prompt.hashes.last().copied();
    for (j, h) in hashes.into_iter().enumerate() {
        let toks = seq.get(j * BLOCK_SIZE..(j + 1) * BLOCK_SIZE).unwrap_or(&[]);
        let extra = if parent.is_none() { salt } else { None };
        cache.store(blocks[first + j], h, parent, toks, extra);
        parent = Some(h);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn engine(extra: &[&str]) -> Engine {
        let mut args = vec!["sim-engine"];
        args.extend_from_slice(extra);
        Engine::new(&EngineArgs::parse_from(args))
    }

    fn prompt(n: u32) -> PromptBlocks {
        PromptBlocks::new(1, &(0..n).collect::<Vec<_>>())
    }

    /// Runs steps until every request is done; returns the number of steps.
    fn drain(e: &mut Engine) -> usize {
        let mut steps = 0;
        while let Some(p) = e.plan_step() {
            e.apply_step(&p, Instant::now());
            steps += 1;
            assert!(steps < 10_000);
        }
        steps
    }

    #[test]
    fn prefill_is_chunked_then_one_token_per_step() {
        let mut e = engine(&["--max-num-batched-tokens", "100"]);
        let mut rx = e.submit(prompt(250), 4, Instant::now());
        assert_eq!(
            drain(&mut e),
            3 + 3,
            "3 prefill steps (the last gives token 1), 3 decodes"
        );
        let mut last = None;
        while let Ok(p) = rx.try_recv() {
            last = Some(p);
        }
        assert_eq!(
            last,
            Some(Progress {
                generated: 4,
                cached_tokens: 0,
                done: true
            })
        );
        assert_eq!(e.cache.used_blocks(), 0);
    }

    #[test]
    fn busy_time_is_every_step_s_duration_and_prefill_its_prompt_part() {
        // 250 prompt tokens at 1,000 tok/s in 3 chunks, then 3 decodes:
        // 6 steps of 10 ms + 1 ms for the one sequence, plus 0.25 s.
        let mut e = engine(&[
            "--max-num-batched-tokens",
            "100",
            "--prefill-tps",
            "1000",
            "--decode-step-ms",
            "10",
            "--decode-step-per-seq-ms",
            "1",
        ]);
        let _rx = e.submit(prompt(250), 4, Instant::now());
        drain(&mut e);
        assert!((e.metrics.prefill_seconds - 0.25).abs() < 1e-9);
        assert!((e.metrics.busy_seconds - (0.25 + 6.0 * 0.011)).abs() < 1e-9);
        let text = e.metrics.render("m", &e.gauges());
        assert!(text.contains("sim_engine_prefill_seconds_total{model_name=\"m\"} 0.25\n"));
    }

    #[test]
    fn second_identical_request_hits_and_queue_respects_max_seqs() {
        let mut e = engine(&["--max-num-seqs", "1"]);
        let mut a = e.submit(prompt(64), 2, Instant::now());
        let mut b = e.submit(prompt(64), 2, Instant::now());
        let plan = e.plan_step().unwrap();
        assert_eq!(e.gauges().running, 1);
        assert_eq!(e.gauges().waiting, 1);
        e.apply_step(&plan, Instant::now());
        drain(&mut e);
        let last = |rx: &mut UnboundedReceiver<Progress>| {
            let mut l = None;
            while let Ok(p) = rx.try_recv() {
                l = Some(p);
            }
            l.unwrap()
        };
        assert_eq!(last(&mut a).cached_tokens, 0);
        assert_eq!(
            last(&mut b).cached_tokens,
            48,
            "fully cached aligned prompt recomputes its last block"
        );
    }

    #[test]
    fn disconnected_requests_free_their_blocks() {
        let mut e = engine(&[]);
        let rx = e.submit(prompt(64), 100, Instant::now());
        let p = e.plan_step().unwrap();
        drop(rx);
        e.apply_step(&p, Instant::now());
        assert!(e.plan_step().is_none());
        assert_eq!(e.cache.used_blocks(), 0);
    }

    /// Steps until every request is done; the order they finished in,
    /// by their index in `rxs`.
    fn finish_order(e: &mut Engine, rxs: &mut [UnboundedReceiver<Progress>]) -> Vec<usize> {
        let mut order = Vec::new();
        while let Some(p) = e.plan_step() {
            e.apply_step(&p, Instant::now());
            for (i, rx) in rxs.iter_mut().enumerate() {
                while let Ok(p) = rx.try_recv() {
                    if p.done {
                        order.push(i);
                    }
                }
            }
        }
        order
    }

    #[test]
    fn priority_mode_runs_the_lowest_priority_first_then_by_arrival() {
        let mut e = engine(&["--max-num-seqs", "1", "--scheduling-policy", "priority"]);
        let now = Instant::now();
        // The first takes the only seat; the others wait: two batch (1),
        // a chat (0), an urgent one (-1), another chat (0).
        let mut rxs = vec![e.submit_tokens(prompt(32), Vec::new(), None, (2, 0), now)];
        let first = e.plan_step().unwrap();
        e.apply_step(&first, now);
        for (i, p) in [1, 1, 0, -1, 0].into_iter().enumerate() {
            let prompt = prompt(40 + i as u32);
            rxs.push(e.submit_tokens(prompt, Vec::new(), None, (2, p), now));
        }
        assert_eq!(e.gauges().waiting, 5);
        assert_eq!(finish_order(&mut e, &mut rxs), [0, 4, 3, 5, 1, 2]);
    }

    #[test]
    fn fcfs_mode_serves_by_arrival_and_refuses_a_priority() {
        let mut e = engine(&["--max-num-seqs", "1"]);
        assert_eq!(
            e.check_priority(1).unwrap_err(),
            "Got priority 1 but Priority scheduling is not enabled."
        );
        assert!(e.check_priority(0).is_ok());
        let now = Instant::now();
        let mut rxs: Vec<_> = (0..4).map(|i| e.submit(prompt(32 + i), 2, now)).collect();
        assert_eq!(finish_order(&mut e, &mut rxs), [0, 1, 2, 3]);
        let p = engine(&["--scheduling-policy", "priority"]);
        assert!(p.check_priority(-7).is_ok());
    }

    #[test]
    fn a_waiting_request_that_left_does_not_hold_its_place_in_priority_mode() {
        let mut e = engine(&["--max-num-seqs", "1", "--scheduling-policy", "priority"]);
        let now = Instant::now();
        let a = e.submit_tokens(prompt(32), Vec::new(), None, (2, 0), now);
        let gone = e.submit_tokens(prompt(33), Vec::new(), None, (2, -1), now);
        let b = e.submit_tokens(prompt(34), Vec::new(), None, (2, 1), now);
        drop(gone);
        let mut rxs = vec![a, b];
        assert_eq!(finish_order(&mut e, &mut rxs), [0, 1]);
        assert_eq!(e.gauges().waiting, 0);
        assert_eq!(e.cache.used_blocks(), 0);
    }
}
