//! Backend selection: a pure function of the request's prefix matches and a
//! load snapshot. No I/O, no clocks, no shared state: the caller passes a
//! ticket (a counter or a random number) where a policy needs one.
//!
//! The `prefix` policy:
//! 1. Bound: a backend may take the request only while its load (requests in
//!    flight plus connections others hold to it, as seen by XDP) is under
//!    `(1 + epsilon) * mean + slack`, the mean counting this request. This
//!    keeps a hot shared prefix from piling onto one replica.
//! 2. Warm: among backends within the bound, pick the one with the lowest
//!    estimated time to first token, in units of one block's prefill:
//!    `queued prefill blocks + uncached blocks + in_flight_cost * in flight`.
//! 3. Cold (no backend holds `min_match_blocks`): rendezvous hashing of the
//!    prompt's first blocks, first backend within the bound. The same cold
//!    prefix lands on the same backend, and router instances agree without
//!    talking.

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
    /// Prompt blocks sent to it whose first response byte has not come back.
    pub queued_prefill_blocks: u32,
    /// Connections to it that are not this router's (from the XDP counters).
    pub external_conns: u32,
    /// A stable hash of the backend's address, for rendezvous hashing.
    pub id_hash: u64,
}

impl BackendLoad {
    fn load(&self) -> u64 {
        u64::from(self.in_flight) + u64::from(self.external_conns)
    }
}

/// Tuning of the `prefix` policy. Defaults are in `config.rs`, documented there.
#[derive(Clone, Copy, Debug)]
pub struct PrefixParams {
    pub epsilon: f64,
    pub slack: u32,
    pub in_flight_cost_blocks: f64,
    pub min_match_blocks: u32,
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
}

/// Why the first choice was made, for metrics and `/admin/explain`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
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
}

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
}

impl Choice {
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.candidates[..self.len].iter().map(|&c| usize::from(c))
    }

    pub fn first(&self) -> Option<usize> {
        self.iter().next()
    }
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
    };
    let eligible = loads.iter().filter(|l| l.eligible).count();
    if eligible == 0 {
        return choice;
    }
    let first = match policy {
        Policy::Prefix => prefix(input, loads, params, &mut choice.decision),
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
    // Fallbacks for retries: rendezvous order of the other eligible backends.
    fill_fallbacks(&mut choice, loads, input.cold_key);
    choice
}

fn prefix(
    input: &RouteInput,
    loads: &[BackendLoad],
    p: &PrefixParams,
    decision: &mut Decision,
) -> usize {
    let (mut total, mut n) = (0u64, 0u64);
    for l in loads.iter().filter(|l| l.eligible) {
        total += l.load();
        n += 1;
    }
    let mean = (total + 1) as f64 / n as f64;
    let cap = ((1.0 + p.epsilon) * mean).floor() as u64 + u64::from(p.slack);
    let within = |l: &BackendLoad| l.eligible && l.load() < cap.max(1);

    let mut longest = 0;
    let mut longest_at = usize::MAX;
    for (b, l) in loads.iter().enumerate() {
        let m = input.matches.get(b).copied().unwrap_or(0);
        if l.eligible && m > longest {
            longest = m;
            longest_at = b;
        }
    }
    if longest < p.min_match_blocks.max(1) {
        *decision = Decision::Cold;
        return rendezvous(loads, input.cold_key, within)
            .unwrap_or_else(|| least_loaded(loads, input.cold_key));
    }
    let mut best = usize::MAX;
    let mut best_cost = f64::INFINITY;
    let mut best_rank = 0;
    for (b, l) in loads.iter().enumerate() {
        if !within(l) {
            continue;
        }
        let m = input.matches.get(b).copied().unwrap_or(0);
        let cost = f64::from(l.queued_prefill_blocks)
            + f64::from(input.blocks.saturating_sub(m))
            + p.in_flight_cost_blocks * f64::from(l.in_flight);
        let rank = mix(input.cold_key ^ l.id_hash);
        if cost < best_cost || (cost == best_cost && rank > best_rank) {
            best = b;
            best_cost = cost;
            best_rank = rank;
        }
    }
    if best == usize::MAX {
        // Every backend is over the bound (the bound is loose by `slack`, so
        // only with very few backends): the least loaded one.
        *decision = Decision::Bounded;
        return least_loaded(loads, input.cold_key);
    }
    *decision = if within(&loads[longest_at]) {
        Decision::Warm
    } else {
        Decision::Bounded
    };
    best
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
