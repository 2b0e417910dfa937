//! Backend selection: a pure function of the request's prefix matches and a
//! load snapshot. No I/O, no clocks, no shared state: the caller passes a
//! ticket (a counter or a random number) where a policy needs one.
//!
//! The `prefix` policy predicts each backend's time to first token and
//! takes the fastest:
//!
//! `ttft = (queued prefill + uncached blocks + in-flight cost + overload) / prefill rate`
//!
//! 1. *Queued prefill*: prompt blocks sent to the backend whose first
//!    response byte has not come back. *Uncached*: the request's blocks the
//!    backend does not hold, so a conversation stays on the engine holding
//!    its history unless another is predicted faster counting the history
//!    it would recompute. *In-flight cost*: running decodes slow a prefill.
//!    *Lost* (`prefix.expect_lost_history`; otherwise the router passes
//!    0): on the longest holder, the share of its private lead (the
//!    history no other backend holds) that its answers said a busy engine
//!    had evicted by the next turn, expected gone again; moving off it
//!    costs the history it still keeps only. Only when every eligible
//!    backend holds [`SHARED_MIN_BLOCKS`] of the request (its shared
//!    prompt), so the lead is a history, not also a prompt's only copy.
//! 2. *Overload*: `n` requests over the balance bound `(1 + epsilon) * mean
//!    load + slack` cost `n² * overload_cost_blocks`, so a shared prefix hot
//!    enough to crowd one engine gets a second engine (it is replicated)
//!    while a long conversation history still outweighs a small imbalance.
//! 3. *Safety cap*: no backend at or above `safety_factor * mean + slack`.
//!    With `hold_private` a conversation past its first turn (a chat
//!    holding an answer) stays on its longest holder up to it, whatever
//!    the balance bound says. A request with nothing private at stake (a
//!    new conversation: a chat without an answer, or a longest holder
//!    leading the next by fewer than `sticky_min_blocks`) is capped by the
//!    balance bound and by `shared_gap` requests over the least loaded
//!    backend, so new conversations stay with their prompt through small
//!    fluctuations and a prompt hot enough to crowd its engines gets
//!    another.
//!    When the fleet's caches are full (`full_cache_pressure` of their
//!    capacity in use), epsilon, the safety factor and `shared_gap` are
//!    the looser `full_cache_*` ones: a copy of a prompt on one more
//!    engine then evicts as much of another's.
//!    When the fleet is saturated (every backend has `saturated_queue_s`
//!    of prefill queued) the bounds are those too, and backends rank by the
//!    work a request adds (uncached, lost, moved, evicted) rather than by
//!    predicted TTFT: a shorter queue is bought with a recomputed prefix
//!    every queued request then waits for.
//! 4. *Cold* (no backend holds `min_match_blocks`): rendezvous hashing on
//!    the prompt's first blocks, skipping backends over the balance bound or
//!    whose cache holds more than the emptiest's by `pressure_slack` of the
//!    fleet's mean: a new prefix lands where it costs the least cache
//!    pressure, and router replicas that see the same fleet agree.

/// The routing policies.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize, clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Longest cached prefix, weighed against load, within a hard load bound.
    Prefix,
    /// Each backend in turn.
    RoundRobin,
    /// The backend with the fewest requests in flight.
    LeastRequest,
    /// Uniformly at random.
    Random,
    /// The less loaded of two random backends.
    PowerOfTwo,
    /// Sticky by `x-session-id` header or `user` field (rendezvous hashing).
    Session,
}

impl Policy {
    pub fn name(self) -> &'static str {
        match self {
            Policy::Prefix => "prefix",
            Policy::RoundRobin => "round-robin",
            Policy::LeastRequest => "least-request",
            Policy::Random => "random",
            Policy::PowerOfTwo => "power-of-two",
            Policy::Session => "session",
        }
    }
}

/// What selection knows of one backend.
#[derive(Clone, Copy, Debug, Default)]
pub struct BackendLoad {
    /// Healthy, not draining, and under its in-flight limit.
    pub eligible: bool,
    /// Requests this router has in flight on it.
    pub in_flight: u32,
    /// Prompt blocks sent to it whose first body byte has not come back (an engine streaming sends its head at once, its first event after prefill).
    pub queued_prefill_blocks: u32,
    /// Connections to it that are not this router's (from the XDP counters).
    pub external_conns: u32,
    /// A stable hash of the backend's address, for rendezvous hashing.
    pub id_hash: u64,
    /// Blocks the prefix index tracks for it.
    pub cached_blocks: u32,
    /// Prompt blocks of its requests in flight: KV held by running requests.
    pub in_flight_blocks: u32,
    /// Blocks the index allows it: its KV capacity, known or learned (0: unknown).
    pub capacity_blocks: u32,
    /// Prefill rate in blocks per second, learned from observed TTFTs (0: unknown).
    pub prefill_rate: f32,
    /// Share of a conversation's history (a private lead) its answers said
    /// it no longer held when the next turn came (0: all kept, or unknown).
    pub private_lost: f32,
    /// Slot engines: the cost in blocks of the slot this request would take
    /// there (a live conversation's blocks it overwrites, the wait when
    /// every slot is running; `fleet::slots`); 0 elsewhere.
    pub evict_cost_blocks: f32,
}

impl BackendLoad {
    fn load(&self) -> u64 {
        u64::from(self.in_flight) + u64::from(self.external_conns)
    }

    /// Blocks per second, with the default before anything was learned.
    fn rate(&self) -> f64 {
        if self.prefill_rate > 0.0 {
            f64::from(self.prefill_rate)
        } else {
            DEFAULT_PREFILL_BLOCKS_PER_S
        }
    }

    /// Blocks its cache holds for cached and running prompts, as far as
    /// the router can tell: tracked blocks up to its capacity, plus the
    /// prompts of its requests in flight.
    fn used(&self) -> f64 {
        let cached = if self.capacity_blocks == 0 {
            self.cached_blocks
        } else {
            self.cached_blocks.min(self.capacity_blocks)
        };
        f64::from(cached) + f64::from(self.in_flight_blocks)
    }

    /// [`Self::used`] as a share of its capacity (0 when unknown).
    fn pressure(&self) -> f64 {
        if self.capacity_blocks == 0 {
            return 0.0;
        }
        self.used() / f64::from(self.capacity_blocks)
    }
}

/// Prefill rate assumed before one is learned: 10,000 tokens/s (an 8B model
/// on an H100-class GPU) over 16-token blocks.
pub const DEFAULT_PREFILL_BLOCKS_PER_S: f64 = 625.0;

/// Tuning of the `prefix` policy. Defaults are in `config.rs`, documented there.
#[derive(Clone, Copy, Debug)]
pub struct PrefixParams {
    pub epsilon: f64,
    pub slack: u32,
    pub in_flight_cost_blocks: f64,
    pub min_match_blocks: u32,
    pub overload_cost_blocks: f64,
    pub safety_factor: f64,
    pub pressure_slack: f64,
    pub move_cost: f64,
    pub sticky_min_blocks: u32,
    pub hold_private: bool,
    pub shared_in_flight_cost_blocks: f64,
    pub shared_gap: u32,
    /// From this share of the fleet's known capacity in use, the bounds
    /// below replace `epsilon`, `safety_factor` and `shared_gap`.
    pub full_cache_pressure: f64,
    pub full_cache_epsilon: f64,
    pub full_cache_safety_factor: f64,
    pub full_cache_shared_gap: u32,
    /// The fleet is saturated when every eligible backend has at least this
    /// much prefill queued, in seconds at its rate (0: never): placement
    /// then ranks by the work a request adds, at the full-cache bounds.
    pub saturated_queue_s: f64,
}

/// What the request brings to selection.
#[derive(Clone, Copy, Debug)]
pub struct RouteInput<'a> {
    /// Per backend: leading prompt blocks it holds (same indexing as loads).
    pub matches: &'a [u32],
    /// Full blocks in the prompt.
    pub blocks: u32,
    /// Hash of the prompt's first blocks (rendezvous key of cold prompts).
    pub cold_key: u64,
    /// `x-session-id` header or `user` field, hashed.
    pub session_key: Option<u64>,
    /// A counter (round-robin) or random number (random, power-of-two).
    pub ticket: u64,
    /// Chats: whether the chat holds an earlier answer, a conversation past
    /// its first turn (`None`: not a chat). With `hold_private` it decides
    /// what is private, instead of the longest holder's lead.
    pub answered: Option<bool>,
}

/// Why the first choice was made, for metrics and `/admin/explain`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Decision {
    /// A backend holding a prefix was chosen.
    Warm,
    /// No backend held enough of the prefix: rendezvous hashing.
    Cold,
    /// The backend with the longest prefix was over the load bound.
    Bounded,
    /// A baseline policy chose.
    Baseline,
    /// The request continues or reads a stored response: the backend that
    /// stored it, and no other (`fleet::stored`).
    Stored,
}

/// Fewest blocks of a request every eligible backend must hold for the rest
/// of the longest holder's match to count as a conversation's own history,
/// which `prefix.expect_lost_history` expects lost at the holder's rate.
/// With less, some engine lacks the prompt the conversation shares with
/// others, and a move may copy it there or crowd the engines that hold it
/// (decision 0025: gated on one other holder, it still cost 2-4
/// points of hits under pressure). The feedback learns the lost share from
/// leads that another backend's shared match bounds by as much.
pub const SHARED_MIN_BLOCKS: u32 = 8;

/// Most candidates a choice carries: the first pick and fallbacks for retries.
pub const MAX_CANDIDATES: usize = 4;

/// Backends best first; retries walk down the list.
#[derive(Clone, Copy, Debug)]
pub struct Choice {
    pub candidates: [u16; MAX_CANDIDATES],
    pub len: usize,
    pub decision: Decision,
    /// Blocks of the prompt the first candidate holds.
    pub matched_blocks: u32,
    /// The longest match of any other eligible backend: the part of
    /// `matched_blocks` that is not private to the first candidate.
    pub shared_blocks: u32,
    /// The shortest match over the eligible backends: what every one holds
    /// (the `prefix` policy; 0 under the others).
    pub everywhere_blocks: u32,
    /// The `prefix` policy chose at the full-cache bounds.
    pub full_cache: bool,
    /// The `prefix` policy chose with the fleet saturated: by the work the
    /// request adds, at the full-cache bounds.
    pub saturated: bool,
    /// Blocks the first candidate is predicted to prefill: those it lacks,
    /// plus the share of its private lead its answers say it loses
    /// (`BackendLoad::private_lost`), as its score counted them. Admission
    /// queues this much prefill on it, so later requests see it too.
    pub prefill_blocks: u32,
}

impl Choice {
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.candidates[..self.len].iter().map(|&c| usize::from(c))
    }

    pub fn first(&self) -> Option<usize> {
        self.iter().next()
    }
}

/// What the first candidate will prefill: the blocks it lacks and, when it
/// is the longest holder of a prompt whose start every eligible backend
/// holds, the share of its private lead it is expected to have lost (the
/// `lost_blocks` of its score).
fn first_prefill(input: &RouteInput, first: &BackendLoad, choice: &Choice) -> u32 {
    let m = choice.matched_blocks;
    let lead = if choice.everywhere_blocks >= SHARED_MIN_BLOCKS {
        m.saturating_sub(choice.shared_blocks)
    } else {
        0
    };
    let lost = f64::from(first.private_lost).clamp(0.0, 1.0) * f64::from(lead);
    input.blocks.saturating_sub(m) + lost.round() as u32
}

/// Picks backends for one request. Returns an empty choice when no backend is
/// eligible.
pub fn select(
    policy: Policy,
    input: &RouteInput,
    loads: &[BackendLoad],
    params: &PrefixParams,
) -> Choice {
    let mut choice = Choice {
        candidates: [0; MAX_CANDIDATES],
        len: 0,
        decision: Decision::Baseline,
        matched_blocks: 0,
        shared_blocks: 0,
        everywhere_blocks: 0,
        full_cache: false,
        saturated: false,
        prefill_blocks: 0,
    };
    let eligible = loads.iter().filter(|l| l.eligible).count();
    if eligible == 0 {
        return choice;
    }
    let first = match policy {
        Policy::Prefix => prefix(input, loads, params, &mut choice),
        Policy::RoundRobin => nth_eligible(loads, (input.ticket % eligible as u64) as usize),
        Policy::Random => nth_eligible(loads, (mix(input.ticket) % eligible as u64) as usize),
        Policy::LeastRequest => least_loaded(loads, input.ticket),
        Policy::PowerOfTwo => {
            let r = mix(input.ticket);
            let a = nth_eligible(loads, (r % eligible as u64) as usize);
            let b = nth_eligible(loads, ((r >> 32) % eligible as u64) as usize);
            if loads[b].load() < loads[a].load() {
                b
            } else {
                a
            }
        }
        Policy::Session => {
            let key = input.session_key.unwrap_or(input.cold_key);
            rendezvous(loads, key, |_| true).unwrap_or_else(|| nth_eligible(loads, 0))
        }
    };
    choice.push(first);
    choice.matched_blocks = input.matches.get(first).copied().unwrap_or(0);
    choice.shared_blocks = loads
        .iter()
        .zip(input.matches)
        .enumerate()
        .filter(|&(b, (l, _))| b != first && l.eligible)
        .map(|(_, (_, &m))| m)
        .max()
        .unwrap_or(0);
    choice.prefill_blocks = first_prefill(input, &loads[first], &choice);
    // Fallbacks for retries: rendezvous order of the other eligible backends.
    fill_fallbacks(&mut choice, loads, input.cold_key);
    choice
}

/// The two passes of the warm choice (see [`prefix`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Tier {
    HoldsStartUnderBound,
    UnderSafetyCap,
}

/// What the `prefix` policy works out once per request, before scoring.
struct PrefixView {
    /// Requests over this load count as overload (balance bound).
    bound: u64,
    /// No backend at or above this load (safety cap).
    cap: u64,
    /// No request without a private lead at or above this load.
    shared_cap: u64,
    /// The longest match over eligible backends, and the next one.
    longest: u32,
    second: u32,
    /// The shortest match over eligible backends: what every one holds.
    /// At `SHARED_MIN_BLOCKS` or more the longest holder's lead is a
    /// history (`prefix.expect_lost_history`).
    everywhere: u32,
    /// What the longest holder keeps of a private lead (1 when two or
    /// more hold the longest match: nothing is private then).
    holder_kept: f64,
    /// The longest holder's lead over the next: fewer than
    /// `sticky_min_blocks` means nothing private is at stake (a new
    /// conversation on a shared prompt), and the balance bound is hard.
    shared: bool,
    /// The fleet's caches are full (`full_cache_pressure`): the bounds are
    /// the looser `full_cache_*` ones.
    full_cache: bool,
    /// Every eligible backend has `saturated_queue_s` of prefill queued.
    saturated: bool,
}

/// One backend's predicted time to first token, and its parts in blocks.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct Score {
    pub backend: usize,
    /// Leading blocks it holds.
    pub matched_blocks: u32,
    /// Prompt blocks queued on it ahead of this request.
    pub queued_blocks: u32,
    /// Blocks it would prefill for this request.
    pub uncached_blocks: u32,
    /// Blocks of the longest match it lacks, times `move_cost`, times the
    /// share of a private lead the longest holder keeps.
    pub move_blocks: f64,
    /// The longest holder: the blocks of its private lead it is expected
    /// to have lost (`BackendLoad::private_lost`), to prefill again.
    pub lost_blocks: f64,
    /// Slot engines: a live conversation's blocks it would overwrite, times
    /// `prefix.slot_evict_cost`.
    pub evict_blocks: f64,
    /// Block-equivalents of its running requests and of its overload.
    pub in_flight_cost_blocks: f64,
    pub overload_blocks: f64,
    pub prefill_blocks_per_s: f64,
    pub predicted_ttft_s: f64,
    /// Over the safety cap: not a candidate.
    pub capped: bool,
    /// Share of its capacity in use (cold placement).
    pub pressure: f64,
}

impl Score {
    /// The blocks a request routed here makes the fleet compute or lose:
    /// what it lacks, the history expected lost, a slot's live
    /// conversation it overwrites, the copy a move strands.
    fn work_blocks(&self) -> f64 {
        f64::from(self.uncached_blocks) + self.lost_blocks + self.evict_blocks + self.move_blocks
    }
}

impl PrefixView {
    fn new(input: &RouteInput, loads: &[BackendLoad], p: &PrefixParams) -> PrefixView {
        let (mut total, mut n, mut longest, mut second) = (0u64, 0u64, 0u32, 0u32);
        let (mut least, mut fewest) = (u64::MAX, u32::MAX);
        let (mut used, mut capacity) = (0f64, 0f64);
        let mut holder_lost = 0f32;
        let mut least_queue_s = f64::INFINITY;
        for (b, l) in loads.iter().enumerate() {
            if l.eligible {
                least_queue_s = least_queue_s.min(f64::from(l.queued_prefill_blocks) / l.rate());
                total += l.load();
                least = least.min(l.load());
                n += 1;
                if l.capacity_blocks > 0 {
                    used += l.used();
                    capacity += f64::from(l.capacity_blocks);
                }
                let m = input.matches.get(b).copied().unwrap_or(0);
                fewest = fewest.min(m);
                if m > longest {
                    second = longest;
                    longest = m;
                    holder_lost = l.private_lost;
                } else {
                    second = second.max(m);
                }
            }
        }
        // Caches that cannot hold the working set evict whatever a second
        // copy of a prompt pushes out: the prompt is worth more kept whole
        // on its engines than spread for balance (decision 0020).
        let full_cache = capacity > 0.0 && used >= p.full_cache_pressure * capacity;
        // Every engine has work queued: a request sent to a shorter queue
        // gets its first token sooner only by prefilling what another
        // holds, which every request queued behind it then waits for. The
        // fleet serves most by recomputing least (decision 0053).
        let saturated = n > 0 && p.saturated_queue_s > 0.0 && least_queue_s >= p.saturated_queue_s;
        let (epsilon, safety_factor, shared_gap) = if full_cache || saturated {
            (
                p.full_cache_epsilon,
                p.full_cache_safety_factor,
                p.full_cache_shared_gap,
            )
        } else {
            (p.epsilon, p.safety_factor, p.shared_gap)
        };
        let mean = (total + 1) as f64 / n.max(1) as f64;
        let everywhere = if n == 0 { 0 } else { fewest };
        let bound = (((1.0 + epsilon) * mean).floor() as u64 + u64::from(p.slack)).max(1);
        let shared_cap = if shared_gap == 0 || least == u64::MAX {
            bound
        } else {
            bound.min(least + u64::from(shared_gap))
        };
        PrefixView {
            bound,
            shared_cap,
            cap: ((safety_factor.max(1.0 + epsilon) * mean).floor() as u64 + u64::from(p.slack))
                .max(1),
            longest,
            second,
            everywhere,
            holder_kept: if longest > second && everywhere >= SHARED_MIN_BLOCKS {
                1.0 - f64::from(holder_lost).clamp(0.0, 1.0)
            } else {
                1.0
            },
            shared: match input.answered {
                Some(answered) if p.hold_private => !answered,
                _ => longest - second < p.sticky_min_blocks,
            },
            full_cache,
            saturated,
        }
    }

    fn score(&self, input: &RouteInput, l: &BackendLoad, b: usize, p: &PrefixParams) -> Score {
        let m = input.matches.get(b).copied().unwrap_or(0);
        let uncached = input.blocks.saturating_sub(m);
        let over = if self.shared {
            0
        } else {
            (l.load() + 1).saturating_sub(self.bound)
        };
        let per_request = if self.shared {
            p.shared_in_flight_cost_blocks
        } else {
            p.in_flight_cost_blocks
        };
        let in_flight_cost = per_request * f64::from(l.in_flight);
        // Quadratic: one request over is cheap next to a long history, three
        // over outweigh almost any prefix.
        let overload = p.overload_cost_blocks * (over * over) as f64;
        // Moving off the engine with the longest match also evicts as much
        // from the new engine's cache, and strands the copy on the old one
        // (if it is still there).
        let moved = p.move_cost * f64::from(self.longest.saturating_sub(m)) * self.holder_kept;
        // A busy engine evicts a conversation's history between its turns:
        // the share its answers said was gone is expected gone again, and
        // prefilled again there.
        let lost = if m >= self.longest && self.everywhere >= SHARED_MIN_BLOCKS {
            f64::from(l.private_lost).clamp(0.0, 1.0) * f64::from(m - self.second)
        } else {
            0.0
        };
        let work = f64::from(l.queued_prefill_blocks)
            + f64::from(uncached)
            + lost
            + f64::from(l.evict_cost_blocks)
            + moved
            + in_flight_cost
            + overload;
        let rate = l.rate();
        Score {
            backend: b,
            matched_blocks: m,
            queued_blocks: l.queued_prefill_blocks,
            uncached_blocks: uncached,
            move_blocks: moved,
            lost_blocks: lost,
            evict_blocks: f64::from(l.evict_cost_blocks),
            in_flight_cost_blocks: in_flight_cost,
            overload_blocks: overload,
            prefill_blocks_per_s: rate,
            predicted_ttft_s: work / rate,
            capped: !l.eligible
                || l.load()
                    >= if self.shared {
                        self.shared_cap
                    } else {
                        self.cap
                    },
            pressure: l.pressure(),
        }
    }
}

fn prefix(
    input: &RouteInput,
    loads: &[BackendLoad],
    p: &PrefixParams,
    choice: &mut Choice,
) -> usize {
    let view = PrefixView::new(input, loads, p);
    choice.everywhere_blocks = view.everywhere;
    choice.full_cache = view.full_cache;
    choice.saturated = view.saturated;
    let decision = &mut choice.decision;
    if view.longest < p.min_match_blocks.max(1) {
        *decision = Decision::Cold;
        return cold(input, loads, p, &view);
    }
    // Two tiers. First, backends under the balance bound that hold at least
    // the start of the prompt (its system prompt, say): the lowest predicted
    // TTFT among them, so a conversation moves off a crowded engine only to
    // one that already holds its shared part, recomputing its history only.
    // Else (every such backend is over the bound) the lowest predicted TTFT
    // with the overload cost, under the safety cap: moving a conversation to
    // an engine that lacks its system prompt too must be worth it.
    //
    // With nothing private at stake (a new conversation on a prompt several
    // engines hold) each request in flight weighs `overload_cost_blocks`,
    // not `in_flight_cost_blocks`: the conversation will stay where it
    // starts, so starts are what spreads load, while a copy of the prompt on
    // one more engine still costs its prefill and the room it takes.
    let holds_start = |s: &Score| s.matched_blocks >= p.min_match_blocks.max(1);
    // Saturated, a request is ranked by the blocks it makes the fleet
    // compute (or lose) alone: queues are long everywhere, and even a
    // small weight on them spreads prompts for a shorter one (46.8% of
    // hits at 0.02 of a block per queued block, 53.8% at 0, decision
    // 0053). Ties go by rendezvous on the prompt's start, so a shared
    // prompt keeps to one engine until the bounds move it.
    let unloaded = |s: &Score| {
        if view.saturated {
            s.work_blocks() / s.prefill_blocks_per_s
        } else {
            s.predicted_ttft_s - s.overload_blocks / s.prefill_blocks_per_s
        }
    };
    // The fastest start-holder, overload aside: a backend that lacks the
    // start joins the first tier only if it beats that (a long queue there).
    let holder_ttft = loads
        .iter()
        .enumerate()
        .map(|(b, l)| view.score(input, l, b, p))
        .filter(|s| !s.capped && holds_start(s))
        .map(|s| unloaded(&s))
        .fold(f64::INFINITY, f64::min);
    let mut best = usize::MAX;
    for tier in [Tier::HoldsStartUnderBound, Tier::UnderSafetyCap] {
        let mut best_key = f64::INFINITY;
        let mut best_rank = 0;
        for (b, l) in loads.iter().enumerate() {
            let s = view.score(input, l, b, p);
            if s.capped {
                continue;
            }
            // A conversation's longest holder is bounded by the safety cap
            // alone when private leads are held.
            let held = p.hold_private && !view.shared && s.matched_blocks >= view.longest;
            if tier == Tier::HoldsStartUnderBound
                && ((l.load() >= view.bound && !held)
                    || (!holds_start(&s) && unloaded(&s) >= holder_ttft))
            {
                continue;
            }
            // Under the bound nothing is overloaded.
            let key = if tier == Tier::HoldsStartUnderBound {
                unloaded(&s)
            } else if view.saturated {
                unloaded(&s) + s.overload_blocks / s.prefill_blocks_per_s
            } else {
                s.predicted_ttft_s
            };
            let rank = mix(input.cold_key ^ l.id_hash);
            if key < best_key || (key == best_key && rank > best_rank) {
                best = b;
                best_key = key;
                best_rank = rank;
            }
        }
        if best != usize::MAX {
            break;
        }
    }
    if best == usize::MAX {
        // Every backend is at the safety cap (only with very few backends,
        // the cap being loose by `slack`): the least loaded one.
        *decision = Decision::Bounded;
        return least_loaded(loads, input.cold_key);
    }
    *decision = if input.matches.get(best).copied().unwrap_or(0) >= view.longest {
        Decision::Warm
    } else {
        Decision::Bounded
    };
    best
}

/// A prompt no backend holds: the first backend in rendezvous order on its
/// key that is within the balance bound and not fuller than the emptiest by
/// `pressure_slack`; then within the bound alone; then the least loaded.
fn cold(input: &RouteInput, loads: &[BackendLoad], p: &PrefixParams, view: &PrefixView) -> usize {
    let within = |l: &BackendLoad| l.eligible && l.load() < view.bound;
    // Compared in blocks, so it works before any capacity is known: the
    // slack is a share of the fleet's mean use.
    let (mut emptiest, mut total, mut n) = (f64::INFINITY, 0.0, 0.0);
    for l in loads.iter().filter(|l| within(l)) {
        emptiest = emptiest.min(l.used());
        total += l.used();
        n += 1.0;
    }
    let slack = p.pressure_slack * (total / f64::max(n, 1.0)).max(1.0);
    rendezvous(loads, input.cold_key, |l| {
        within(l) && l.used() <= emptiest + slack
    })
    .or_else(|| rendezvous(loads, input.cold_key, within))
    .unwrap_or_else(|| least_loaded(loads, input.cold_key))
}

/// Every eligible backend's score under the `prefix` policy, for
/// `/admin/explain`; the same arithmetic [`select`] ranks by.
pub fn prefix_scores(input: &RouteInput, loads: &[BackendLoad], p: &PrefixParams) -> Vec<Score> {
    let view = PrefixView::new(input, loads, p);
    loads
        .iter()
        .enumerate()
        .filter(|(_, l)| l.eligible)
        .map(|(b, l)| view.score(input, l, b, p))
        .collect()
}

impl Choice {
    fn push(&mut self, b: usize) {
        if self.len < MAX_CANDIDATES && !self.candidates[..self.len].contains(&(b as u16)) {
            self.candidates[self.len] = b as u16;
            self.len += 1;
        }
    }
}

/// Adds the eligible backends with the highest rendezvous scores after the
/// first choice, until the choice is full.
fn fill_fallbacks(choice: &mut Choice, loads: &[BackendLoad], key: u64) {
    let mut top: [(u64, u16); MAX_CANDIDATES] = [(0, 0); MAX_CANDIDATES];
    let mut n = 0;
    for (b, l) in loads.iter().enumerate() {
        if !l.eligible || choice.candidates[..choice.len].contains(&(b as u16)) {
            continue;
        }
        let s = mix(key ^ l.id_hash);
        // Insertion into a tiny sorted array (descending score).
        let mut i = n.min(MAX_CANDIDATES - 1);
        if n == MAX_CANDIDATES && s <= top[i].0 {
            continue;
        }
        while i > 0 && top[i - 1].0 < s {
            top[i] = top[i - 1];
            i -= 1;
        }
        top[i] = (s, b as u16);
        n = (n + 1).min(MAX_CANDIDATES);
    }
    for &(_, b) in &top[..n] {
        choice.push(usize::from(b));
    }
}

/// The eligible backend with the highest rendezvous score among those `ok` accepts.
fn rendezvous(loads: &[BackendLoad], key: u64, ok: impl Fn(&BackendLoad) -> bool) -> Option<usize> {
    let mut best = None;
    let mut best_score = 0;
    for (b, l) in loads.iter().enumerate() {
        if l.eligible && ok(l) {
            let s = mix(key ^ l.id_hash);
            if best.is_none() || s > best_score {
                best = Some(b);
                best_score = s;
            }
        }
    }
    best
}

fn least_loaded(loads: &[BackendLoad], ticket: u64) -> usize {
    // Ties are broken by rotating the start with the ticket, so equal backends share.
    let n = loads.len();
    let start = (ticket % n as u64) as usize;
    let mut best = usize::MAX;
    for i in 0..n {
        let b = (start + i) % n;
        if loads[b].eligible && (best == usize::MAX || loads[b].load() < loads[best].load()) {
            best = b;
        }
    }
    best
}

fn nth_eligible(loads: &[BackendLoad], n: usize) -> usize {
    loads
        .iter()
        .enumerate()
        .filter(|(_, l)| l.eligible)
        .nth(n)
        .map_or(0, |(b, _)| b)
}

/// A 64-bit finalizer (splitmix64): good avalanche for rendezvous scores.
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests;
