//! Which backend serves which model: each backend's models (discovered from
//! its `GET /v1/models` by the control plane, or pinned in the config), the
//! optional pools, and the per-request filter. Pure: no I/O, no clock.
//!
//! The request path reads one immutable [`ModelTable`] (swapped whole when
//! a backend's models or the fleet change): the request's `model` is looked
//! up once (a hash of its bytes, no allocation) to a small id, and each
//! backend is then one bit test. Ranks, best first:
//!
//! - 3: the backend serves the model and lists the request's `lora_path`
//!   adapter (its adapter is loaded there);
//! - 2: it serves the model (a base model or an adapter named in `model`);
//! - 1: its models are unknown (no `/v1/models` answer yet, an engine that
//!   does not serve it, discovery off and nothing pinned): it serves any
//!   model, as a fallback only, so a fleet without `/v1/models` routes as
//!   before and a new backend takes a model only when no known server of it
//!   has room;
//! - 0: it does not serve the model, or is outside the model's pool.
//!
//! A request goes only to the eligible backends of the best rank present.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard};

use arc_swap::ArcSwap;

use crate::error::{Kind, RouterError};
use crate::fleet::MAX_BACKENDS;
use crate::policy::select::{BackendLoad, Policy};

/// Words of a [`SlotSet`].
const SLOT_WORDS: usize = MAX_BACKENDS.div_ceil(64);

/// Model names that get a metrics label of their own. Names come from the
/// backends' `/v1/models` and the config, never from requests; past this
/// (a fleet loading thousands of adapters over its life) new names are
/// counted under [`OTHER_LABEL`].
pub const MAX_MODEL_LABELS: usize = 256;

/// The `model` label of requests for names no backend serves (routed to
/// backends whose models are unknown), without a model, or past
/// [`MAX_MODEL_LABELS`].
pub const OTHER_LABEL: &str = "(other)";

/// Longest model or adapter name believed from a backend. Names reach
/// `/v1/models`, a `/metrics` label and the logs: a Hugging Face id is
/// under 100 bytes, an engine serving a model by its path a few hundred at
/// most. Longer names are skipped, not cut (a cut name serves nothing).
pub const MAX_NAME_BYTES: usize = 512;

/// Why `name` may not be published as a model name: empty, longer than
/// [`MAX_NAME_BYTES`], or holding a control character (NUL, ESC, CR, LF,
/// DEL, C1) or an invisible one that changes how text around it reads
/// (line and paragraph separators, bidirectional overrides, a BOM), which
/// would reach `/metrics` and terminals raw.
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("an empty name".into());
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(format!(
            "a name of {} bytes, more than {MAX_NAME_BYTES}",
            name.len()
        ));
    }
    let hidden = |c: char| {
        c.is_control()
            || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{feff}')
    };
    if let Some((at, c)) = name.char_indices().find(|(_, c)| hidden(*c)) {
        return Err(format!(
            "a name with the control character U+{:04X} at byte {at}",
            u32::from(c)
        ));
    }
    Ok(())
}

/// Bytes of a request's model name echoed in a 404 (a name is short; a
/// client sending a huge one gets it cut).
const ECHO_BYTES: usize = 128;

/// A set of backend slots.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotSet([u64; SLOT_WORDS]);

impl SlotSet {
    pub fn insert(&mut self, slot: usize) {
        self.0[slot / 64] |= 1 << (slot % 64);
    }

    #[inline]
    pub fn contains(&self, slot: usize) -> bool {
        self.0
            .get(slot / 64)
            .is_some_and(|w| w & (1 << (slot % 64)) != 0)
    }

    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|w| *w == 0)
    }

    fn intersects(&self, other: &SlotSet) -> bool {
        self.0.iter().zip(&other.0).any(|(a, b)| a & b != 0)
    }
}

/// One entry of a backend's `/v1/models`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ServedModel {
    pub id: String,
    /// For a LoRA adapter, its base model (vLLM's `parent`).
    pub parent: Option<String>,
}

/// What the router knows of one backend's models.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Served {
    /// Not known (yet): it serves any model, as a fallback.
    Unknown,
    /// These, and nothing else.
    Known(Vec<ServedModel>),
}

/// What a request without a `model` field gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WithoutModel {
    /// Any backend (each engine answers with its own default model, as
    /// vLLM does with its first served name).
    Any,
    /// A 400 naming the missing field.
    Reject,
    /// The pool with this index in [`Spec::pools`].
    Pool(usize),
}

/// One pool of the config: requests for its models go only to its backends,
/// ranked by its policy.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolSpec {
    pub name: String,
    pub models: Vec<String>,
    /// Backend URLs; `None`: every backend.
    pub backends: Option<Vec<String>>,
    /// `None`: the router's `policy`.
    pub policy: Option<Policy>,
}

/// What the config says of models.
#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    /// Backends whose models the config pins, by URL: never discovered.
    pub pinned: Vec<(String, Vec<String>)>,
    pub pools: Vec<PoolSpec>,
    pub without_model: WithoutModel,
}

impl Default for Spec {
    fn default() -> Self {
        Spec {
            pinned: Vec::new(),
            pools: Vec::new(),
            without_model: WithoutModel::Any,
        }
    }
}

/// One backend as the table is built for it.
#[derive(Clone, Debug)]
pub struct Member<'a> {
    pub slot: usize,
    pub generation: u64,
    pub url: &'a str,
    /// What discovery found (ignored when the config pins its models).
    pub served: Served,
}

/// Per-model counters for `/metrics`, updated in place on the request path.
#[derive(Debug, Default)]
pub struct ModelStats {
    requests: AtomicU64,
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    ttft_buckets: [AtomicU64; TTFT_BUCKETS.len()],
    ttft_count: AtomicU64,
    ttft_sum_us: AtomicU64,
}

/// Upper bounds (seconds) of the per-model TTFT histogram: 10 ms to 20 s.
pub const TTFT_BUCKETS: [f64; 10] = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 20.0];

impl ModelStats {
    pub fn requested(&self) {
        self.requests.fetch_add(1, Relaxed);
    }

    /// An answer's `usage`: prompt tokens and how many were cached.
    pub fn usage(&self, prompt_tokens: u32, cached_tokens: u32) {
        self.prompt_tokens
            .fetch_add(u64::from(prompt_tokens), Relaxed);
        self.cached_tokens
            .fetch_add(u64::from(cached_tokens.min(prompt_tokens)), Relaxed);
    }

    /// A streamed answer's first token came `secs` after the request was sent.
    pub fn ttft(&self, secs: f64) {
        if let Some(i) = TTFT_BUCKETS.iter().position(|&b| secs <= b) {
            self.ttft_buckets[i].fetch_add(1, Relaxed);
        }
        self.ttft_count.fetch_add(1, Relaxed);
        self.ttft_sum_us.fetch_add((secs * 1e6) as u64, Relaxed);
    }

    pub fn requests(&self) -> u64 {
        self.requests.load(Relaxed)
    }

    /// `(prompt tokens, cached tokens)` over the answers that reported usage.
    pub fn tokens(&self) -> (u64, u64) {
        (
            self.prompt_tokens.load(Relaxed),
            self.cached_tokens.load(Relaxed),
        )
    }

    /// `(per-bucket counts (not cumulative), count, sum in seconds)`.
    pub fn ttft_histogram(&self) -> ([u64; TTFT_BUCKETS.len()], u64, f64) {
        let mut b = [0; TTFT_BUCKETS.len()];
        for (o, c) in b.iter_mut().zip(&self.ttft_buckets) {
            *o = c.load(Relaxed);
        }
        (
            b,
            self.ttft_count.load(Relaxed),
            self.ttft_sum_us.load(Relaxed) as f64 / 1e6,
        )
    }
}

/// A pool as the request path sees it.
#[derive(Debug)]
pub struct Pool {
    pub name: String,
    /// `None`: every backend.
    backends: Option<SlotSet>,
    pub policy: Option<Policy>,
}

#[derive(Debug)]
struct Entry {
    name: String,
    /// Backends that serve it (listed by discovery, or pinned).
    servers: SlotSet,
    parent: Option<String>,
    pool: Option<usize>,
    stats: Arc<ModelStats>,
}

/// Which backend serves which model, as of the last change. Immutable.
#[derive(Debug)]
pub struct ModelTable {
    /// hashbrown's foldhash: a few nanoseconds for a model name (std's
    /// SipHash guards against collisions a client could force, but the
    /// keys here come from the backends and the config only).
    ids: hashbrown::HashMap<Box<[u8]>, u32>,
    entries: Vec<Entry>,
    /// Backends whose models are unknown.
    unknown: SlotSet,
    /// The generation each slot's facts are for: a backend that took the
    /// slot since (a reload) counts as unknown until the next build.
    generations: Box<[u64]>,
    pools: Vec<Pool>,
    without_model: WithoutModel,
    other: Arc<ModelStats>,
}

/// A request's model, resolved against a table.
#[derive(Clone, Copy, Debug)]
pub struct Want<'t> {
    model: Option<&'t Entry>,
    /// The request's `lora_path`, when some backend lists it.
    adapter: Option<&'t Entry>,
    pool: Option<&'t Pool>,
    /// A model name the table does not know: only backends whose models
    /// are unknown may take it.
    unlisted: bool,
    stats: &'t Arc<ModelStats>,
}

impl<'t> Want<'t> {
    /// The policy of the request's pool, if it sets one.
    pub fn policy(&self) -> Option<Policy> {
        self.pool.and_then(|p| p.policy)
    }

    pub fn stats(&self) -> &'t Arc<ModelStats> {
        self.stats
    }

    /// The backend in `slot` (of `generation`) for this request: 0 (not a
    /// candidate) to 3 (see the module's documentation).
    #[inline]
    pub fn rank(&self, table: &ModelTable, slot: usize, generation: u64) -> u8 {
        if let Some(set) = self.pool.and_then(|p| p.backends.as_ref())
            && !set.contains(slot)
        {
            return 0;
        }
        if self.model.is_none() && !self.unlisted {
            // No model named: every engine answers with its default one.
            return 2;
        }
        let unknown =
            table.generations.get(slot) != Some(&generation) || table.unknown.contains(slot);
        if unknown {
            return 1;
        }
        if self.unlisted {
            return 0;
        }
        match self.model {
            Some(e) if e.servers.contains(slot) => {
                2 + u8::from(self.adapter.is_some_and(|a| a.servers.contains(slot)))
            }
            _ => 0,
        }
    }
}

impl ModelTable {
    /// The table for `members` (the fleet) under `spec`; `stats` gives each
    /// model name its counters (see [`Models`]).
    pub fn build(
        members: &[Member],
        spec: &Spec,
        mut stats: impl FnMut(&str) -> Arc<ModelStats>,
        other: Arc<ModelStats>,
    ) -> ModelTable {
        let mut t = ModelTable {
            ids: hashbrown::HashMap::new(),
            entries: Vec::new(),
            unknown: SlotSet::default(),
            generations: vec![0; MAX_BACKENDS].into_boxed_slice(),
            pools: Vec::new(),
            without_model: spec.without_model,
            other,
        };
        let mut id_of = |t: &mut ModelTable, name: &str| -> usize {
            if let Some(&id) = t.ids.get(name.as_bytes()) {
                return id as usize;
            }
            let id = t.entries.len();
            t.entries.push(Entry {
                name: name.to_owned(),
                servers: SlotSet::default(),
                parent: None,
                pool: None,
                stats: stats(name),
            });
            t.ids.insert(name.as_bytes().into(), id as u32);
            id
        };
        for m in members {
            if m.slot >= MAX_BACKENDS {
                continue;
            }
            t.generations[m.slot] = m.generation;
            let pinned = spec.pinned.iter().find(|(u, _)| u == m.url);
            let served = match (pinned, &m.served) {
                (Some((_, names)), _) => names
                    .iter()
                    .map(|n| ServedModel {
                        id: n.clone(),
                        parent: None,
                    })
                    .collect(),
                (None, Served::Known(list)) => list.clone(),
                (None, Served::Unknown) => {
                    t.unknown.insert(m.slot);
                    continue;
                }
            };
            for s in served {
                let id = id_of(&mut t, &s.id);
                let e = &mut t.entries[id];
                e.servers.insert(m.slot);
                if e.parent.is_none() {
                    e.parent = s.parent;
                }
            }
        }
        for (p, ps) in spec.pools.iter().enumerate() {
            let backends = ps.backends.as_ref().map(|urls| {
                let mut set = SlotSet::default();
                for m in members.iter().filter(|m| urls.iter().any(|u| u == m.url)) {
                    set.insert(m.slot);
                }
                set
            });
            t.pools.push(Pool {
                name: ps.name.clone(),
                backends,
                policy: ps.policy,
            });
            for name in &ps.models {
                let id = id_of(&mut t, name);
                t.entries[id].pool.get_or_insert(p);
            }
        }
        // An adapter no pool names goes to its base model's pool.
        for i in 0..t.entries.len() {
            if t.entries[i].pool.is_none()
                && let Some(parent) = t.entries[i].parent.as_deref()
                && let Some(&pid) = t.ids.get(parent.as_bytes())
            {
                t.entries[i].pool = t.entries[pid as usize].pool;
            }
        }
        t
    }

    /// Resolves a request's `model` and `lora_path` (empty: absent): a 404
    /// for a model no backend of its pool may serve, a 400 for a missing
    /// one when the config says so.
    pub fn resolve<'t>(&'t self, model: &[u8], adapter: &[u8]) -> Result<Want<'t>, RouterError> {
        if model.is_empty() {
            let pool = match self.without_model {
                WithoutModel::Any => None,
                WithoutModel::Reject => {
                    return Err(RouterError::new(
                        Kind::ModelRequired,
                        "'model' is required: name one of GET /v1/models",
                    ));
                }
                WithoutModel::Pool(p) => self.pools.get(p),
            };
            return Ok(Want {
                model: None,
                adapter: None,
                pool,
                unlisted: false,
                stats: &self.other,
            });
        }
        let entry = self.ids.get(model).map(|&id| &self.entries[id as usize]);
        let pool = entry.and_then(|e| e.pool).and_then(|p| self.pools.get(p));
        let within = |set: &SlotSet| match pool.and_then(|p| p.backends.as_ref()) {
            Some(b) => set.intersects(b),
            None => !set.is_empty(),
        };
        let servable = within(&self.unknown) || entry.is_some_and(|e| within(&e.servers));
        if !servable {
            let shown = &model[..model.len().min(ECHO_BYTES)];
            return Err(RouterError::new(
                Kind::ModelNotFound,
                format!(
                    "The model `{}` does not exist.",
                    String::from_utf8_lossy(shown)
                ),
            ));
        }
        let adapter = (!adapter.is_empty())
            .then(|| self.ids.get(adapter))
            .flatten()
            .map(|&id| &self.entries[id as usize]);
        Ok(Want {
            model: entry,
            adapter,
            pool,
            unlisted: entry.is_none(),
            stats: entry.map_or(&self.other, |e| &e.stats),
        })
    }

    /// No model filter (a request on a path that carries no `model`).
    pub fn unfiltered(&self) -> Want<'_> {
        Want {
            model: None,
            adapter: None,
            pool: None,
            unlisted: false,
            stats: &self.other,
        }
    }

    /// The models the backends in the slots `up` accepts serve,
    /// deduplicated, in name order: `(id, parent)`, for the router's own
    /// `GET /v1/models`.
    pub fn served(&self, up: impl Fn(usize) -> bool) -> Vec<(&str, Option<&str>)> {
        let mut v: Vec<_> = self
            .entries
            .iter()
            .filter(|e| (0..MAX_BACKENDS).any(|s| e.servers.contains(s) && up(s)))
            .map(|e| (e.name.as_str(), e.parent.as_deref()))
            .collect();
        v.sort_unstable();
        v
    }

    /// What the backend in `slot` (of `generation`) serves, by name;
    /// `None` while its models are unknown.
    pub fn models_of(&self, slot: usize, generation: u64) -> Option<Vec<&str>> {
        if self.generations.get(slot) != Some(&generation) || self.unknown.contains(slot) {
            return None;
        }
        Some(
            self.entries
                .iter()
                .filter(|e| e.servers.contains(slot))
                .map(|e| e.name.as_str())
                .collect(),
        )
    }

    /// Whether any backend's models are known (listed or pinned).
    pub fn knows_models(&self) -> bool {
        self.entries.iter().any(|e| !e.servers.is_empty())
    }

    /// The pools' names, in config order.
    pub fn pools(&self) -> impl Iterator<Item = &Pool> {
        self.pools.iter()
    }
}

/// Keeps eligible only the backends of the best rank any eligible backend
/// has (`ranks` by position, as `loads`); rank 0 is never eligible.
pub fn keep_best(loads: &mut [BackendLoad], ranks: &[u8]) {
    let best = loads
        .iter()
        .zip(ranks)
        .filter(|(l, _)| l.eligible)
        .map(|(_, &r)| r)
        .max()
        .unwrap_or(0);
    for (l, &r) in loads.iter_mut().zip(ranks) {
        if r == 0 || r < best {
            l.eligible = false;
        }
    }
}

/// The shared model state: the table the request path reads, each
/// backend's discovered models (by generation), and the per-model counters.
pub struct Models {
    table: ArcSwap<ModelTable>,
    inner: Mutex<Inner>,
    /// Held from reading the fleet to swapping its table in, so two
    /// rebuilds (a prober's, the supervisor's after a reload) cannot swap
    /// an older fleet's table over a newer one's.
    rebuilding: Mutex<()>,
}

#[derive(Default)]
struct Inner {
    /// By backend generation.
    discovered: HashMap<u64, Served>,
    /// The last problem reported per backend generation (a malformed
    /// `/v1/models`), so each is logged once until it changes.
    problems: HashMap<u64, String>,
    /// Counters by model name, at most `MAX_MODEL_LABELS`.
    stats: Vec<(String, Arc<ModelStats>)>,
    other: Arc<ModelStats>,
}

impl Models {
    pub fn new(members: &[Member], spec: &Spec) -> Models {
        let m = Models {
            table: ArcSwap::from_pointee(ModelTable::build(
                &[],
                &Spec::default(),
                |_| Arc::default(),
                Arc::default(),
            )),
            inner: Mutex::new(Inner::default()),
            rebuilding: Mutex::new(()),
        };
        m.rebuild(members, spec);
        m
    }

    /// The table now (one atomic load).
    pub fn table(&self) -> arc_swap::Guard<Arc<ModelTable>> {
        self.table.load()
    }

    pub fn table_full(&self) -> Arc<ModelTable> {
        self.table.load_full()
    }

    /// Take it before reading the fleet a rebuild is for; hold it until
    /// [`Self::rebuild`] returned.
    pub fn rebuilding(&self) -> MutexGuard<'_, ()> {
        self.rebuilding.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What discovery last found for the backend of `generation`.
    pub fn discovered(&self, generation: u64) -> Served {
        self.lock()
            .discovered
            .get(&generation)
            .cloned()
            .unwrap_or(Served::Unknown)
    }

    /// Notes a problem with the backend's models answer (`None`: a good
    /// answer); `true` when it differs from the last one noted, i.e. when
    /// it should be logged.
    pub fn note_problem(&self, generation: u64, problem: Option<String>) -> bool {
        let mut inner = self.lock();
        match problem {
            None => inner.problems.remove(&generation).is_some(),
            Some(p) => inner.problems.insert(generation, p.clone()).as_ref() != Some(&p),
        }
    }

    /// The problem last noted for the backend of `generation`, if any.
    pub fn problem(&self, generation: u64) -> Option<String> {
        self.lock().problems.get(&generation).cloned()
    }

    /// Records what discovery found; `true` when it changed.
    pub fn set_discovered(&self, generation: u64, served: Served) -> bool {
        let mut inner = self.lock();
        let old = inner.discovered.insert(generation, served.clone());
        old.unwrap_or(Served::Unknown) != served
    }

    /// Builds the table again for `members` (the whole fleet, with what
    /// discovery found filled in from [`Self::discovered`] when
    /// `members[i].served` is `Unknown`) and swaps it in. Off the request
    /// path: it allocates.
    pub fn rebuild(&self, members: &[Member], spec: &Spec) {
        let mut inner = self.lock();
        let live: Vec<u64> = members.iter().map(|m| m.generation).collect();
        inner.discovered.retain(|g, _| live.contains(g));
        inner.problems.retain(|g, _| live.contains(g));
        let members: Vec<Member> = members
            .iter()
            .map(|m| Member {
                served: match &m.served {
                    Served::Unknown => inner
                        .discovered
                        .get(&m.generation)
                        .cloned()
                        .unwrap_or(Served::Unknown),
                    known => known.clone(),
                },
                ..m.clone()
            })
            .collect();
        let Inner { stats, other, .. } = &mut *inner;
        let table = ModelTable::build(
            &members,
            spec,
            |name| {
                if let Some((_, s)) = stats.iter().find(|(n, _)| n == name) {
                    return s.clone();
                }
                if stats.len() >= MAX_MODEL_LABELS {
                    return other.clone();
                }
                let s = Arc::new(ModelStats::default());
                stats.push((name.to_owned(), s.clone()));
                s
            },
            other.clone(),
        );
        self.table.store(Arc::new(table));
    }

    /// Every model with a label of its own, then [`OTHER_LABEL`]'s.
    pub fn stats(&self) -> Vec<(String, Arc<ModelStats>)> {
        let inner = self.lock();
        let mut v = inner.stats.clone();
        v.push((OTHER_LABEL.to_owned(), inner.other.clone()));
        v
    }
}

#[cfg(test)]
mod tests;
