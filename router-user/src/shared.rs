//! The state every worker shares (configuration, fleet, prefix index,
//! metrics, retry budget) and the one routing entry point, used by the
//! proxy and `/admin/explain` alike: a request's body in, a ranked choice
//! of backends out.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering::Relaxed};

use arc_swap::ArcSwap;
use tracing::{info, warn};

mod admission;

pub use admission::Admission;

use crate::config::classes::{Caller, Placed, Source};
use crate::config::{BackendConfig, Classes, Config, backend_addr};
use crate::error::RouterError;
use crate::fleet::MAX_BACKENDS;
use crate::fleet::backend::{Backend, Fleet};
use crate::fleet::feedback::{Correction, Lesson, Usage};
use crate::fleet::index::{Matches, PrefixIndex};
use crate::fleet::models::{self, Member, ModelStats, Models, Served};
use crate::fleet::owners::BackendSet;
use crate::fleet::stored::StoredResponses;
use crate::metrics::{Metrics, Sources};
use crate::policy::select::{self, BackendLoad, Choice, Decision, Policy, RouteInput};
use crate::precise::Precise;
use crate::precise::keys::{EngineTokens, PromptText};
use crate::precise::offload::Job;
use crate::precise::subscriber::Subscriber;
use crate::precise::tokenizer::CUT_BYTES_PER_TOKEN;
use crate::prompt::extract::{Class, Endpoint, Prompt};
use crate::prompt::hash::{MAX_PROMPT_BLOCKS, block_hashes_pieces, cold_key};
use crate::prompt::scan::{Canonical, scan};
use crate::replica::Replica;

pub struct Router {
    pub config: Arc<ArcSwap<Config>>,
    pub fleet: Arc<ArcSwap<Fleet>>,
    pub index: Arc<PrefixIndex>,
    /// Which backend serves which model (`fleet::models`).
    pub models: Arc<Models>,
    pub metrics: Metrics,
    /// Round-robin counter and random stream.
    ticket: AtomicU64,
    pub client_conns: AtomicUsize,
    pub retry_budget: RetryBudget,
    shutting_down: AtomicBool,
    /// Precise mode (`[precise] enabled`, read at start): the engines' own
    /// account of their caches and each backend's confidence in it.
    pub precise: Option<Arc<Precise>>,
    /// The event subscriptions, by slot.
    subscribers: std::sync::Mutex<Vec<Option<Subscriber>>>,
    /// Replicas (`[replicas] listen`, read at start): what this router
    /// tells its peers (drained by `control::replicas`) and knows of them.
    pub replica: Option<Arc<Replica>>,
    /// Which backend stored each stored response (`/v1/responses`).
    pub stored: StoredResponses,
    /// Requests waiting in the router for room: a class goes only when
    /// none above waits, tenants of one class by weight.
    pub admission: Admission,
}

/// Retries across all requests are capped at `retry.budget_percent` of
/// first attempts (plus a reserve of `RETRY_RESERVE`), so a failing fleet is
/// not hit with a multiple of its load: a token bucket in hundredths.
pub struct RetryBudget {
    tokens: AtomicI64,
    percent: AtomicI64,
}

/// Retries allowed before any request has paid into the budget.
const RETRY_RESERVE: i64 = 10;

impl RetryBudget {
    fn new(percent: u32) -> RetryBudget {
        RetryBudget {
            tokens: AtomicI64::new(RETRY_RESERVE * 100),
            percent: AtomicI64::new(i64::from(percent)),
        }
    }

    pub fn set_percent(&self, percent: u32) {
        self.percent.store(i64::from(percent), Relaxed);
    }

    /// A first attempt pays `percent` hundredths of a retry, up to a cap.
    pub fn deposit(&self) {
        let p = self.percent.load(Relaxed);
        if self.tokens.load(Relaxed) < 100 * 1000 {
            self.tokens.fetch_add(p, Relaxed);
        }
    }

    /// Takes one retry from the budget, if there is one.
    pub fn withdraw(&self) -> bool {
        self.tokens
            .fetch_update(Relaxed, Relaxed, |t| (t >= 100).then_some(t - 100))
            .is_ok()
    }
}

/// Scratch space for the synchronous routing step, reused by a worker.
#[derive(Default)]
pub struct RouteScratch {
    /// The last routed request's canonical prompt, as pieces of its body.
    canon: Canonical,
    /// Its partial last block (the whole prompt when it is shorter than a
    /// block: what a cold key of a short prompt hashes).
    carry: Vec<u8>,
    /// Precise mode: the canonical prompt written out, for the tokenizer.
    canonical: Vec<u8>,
    loads: Vec<BackendLoad>,
    matches: Vec<u32>,
    /// The prefix index's matches, by slot, and the precise index's.
    prefix_matches: Matches,
    exact_matches: Matches,
    /// Learned prefill rates, sorted for their median.
    rates: Vec<f32>,
    /// Each backend's rank for the request's model (`models::Want::rank`).
    ranks: Vec<u8>,
    /// The last routed request's cold key (for [`Router::scores`]).
    cold_key: u64,
    /// Whether the last routed chat held an earlier answer (`None`: not a
    /// chat).
    answered: Option<bool>,
    /// Precise mode: the request's engine tokens and their rendered text,
    /// and the extra keys of its first block (its cache salt).
    tokens: Vec<u32>,
    text: crate::precise::keys::TokenScratch,
    first_extra: Vec<Vec<u8>>,
    /// Precise mode: the backends (by slot) the last request was matched
    /// on the precise index for (the others: on the approximate one).
    pub precise_mask: BackendSet,
    /// What [`Router::token_job`]'s scan of the body in `canon` said.
    scanned: Option<Prompt>,
    /// The last routed request's class, tenant, and where they came from.
    placed: Placed,
}

impl RouteScratch {
    /// The last routed request's canonical prompt and the fields read with it.
    pub fn canon(&self) -> &Canonical {
        &self.canon
    }

    /// The last routed request's class, tenant and where they came from.
    pub fn placed(&self) -> Placed {
        self.placed
    }

    /// Takes the scan [`Router::token_job`] left here, to be put back by
    /// [`Self::restore_scan`] for the same body.
    pub fn take_scan(&mut self) -> Option<Scanned> {
        let prompt = self.scanned.take()?;
        Some(Scanned {
            canon: std::mem::take(&mut self.canon),
            prompt,
        })
    }

    /// Puts a taken scan back; its result goes in [`RouteQuery::scanned`].
    pub fn restore_scan(&mut self, s: Scanned) -> Prompt {
        self.canon = s.canon;
        s.prompt
    }

    /// Bytes of the last routed request's canonical prompt.
    pub fn canonical_len(&self) -> usize {
        self.canon.len()
    }

    /// Gives back parse buffers over `keep` bytes (a rare huge body).
    pub fn shrink(&mut self, keep: usize) {
        self.canon.shrink(keep);
        if self.canonical.capacity() > keep {
            self.canonical = Vec::new();
        }
    }
}

/// A request's prompt blocks: their chained hashes, and the index slots the
/// lookup found them in (so learning them does not probe again). Owned by
/// the connection, reused across its requests.
#[derive(Default)]
pub struct PromptBlocks {
    pub hashes: Vec<u64>,
    pub found: Vec<u32>,
    /// Each block's age on the chosen backend when it was sent (see
    /// `PrefixIndex::insert_aging`), for the closed loop.
    pub ages: Vec<u64>,
    /// The slot a slot engine was predicted to give the request being sent
    /// (the `InFlight` guard holds it until the attempt ends).
    pub slot: Option<usize>,
    /// Precise mode: the keys of the prompt's engine blocks.
    pub keys: Vec<u64>,
    /// Replicas: the id the peers know the request being sent by, when
    /// they were told of it (`Router::learn`).
    pub shared_as: Option<u64>,
    /// The request was routed by the `prefix` policy (its pool's or the
    /// router's): what was sent is learned, answers close the loop.
    pub prefix: bool,
}

/// What routing decided for one request.
pub struct Routed {
    pub choice: Choice,
    pub fleet: Arc<Fleet>,
    /// The counters of the request's model.
    pub model: Arc<ModelStats>,
}

impl Routed {
    /// Pins the choice to `backend` (its URL's hash), the engine that
    /// stored the response a request names, and no other: no candidate
    /// while it is at `max_in_flight` (the request waits for it); `false`
    /// when it left the fleet or is down (its memory went with it).
    pub fn pin_stored(&mut self, backend: u64, max_in_flight: u32, prompt_blocks: u32) -> bool {
        let Some(pos) = self
            .fleet
            .backends
            .iter()
            .position(|b| b.id_hash == backend && b.health.is_healthy())
        else {
            return false;
        };
        let ch = &mut self.choice;
        if !self.fleet.backends[pos].has_room(max_in_flight) {
            ch.len = 0;
            return true;
        }
        if ch.first() != Some(pos) {
            ch.matched_blocks = 0;
            ch.shared_blocks = 0;
            ch.prefill_blocks = prompt_blocks;
        }
        ch.candidates[0] = pos as u16;
        ch.len = 1;
        ch.decision = Decision::Stored;
        true
    }
}

/// What one request gives routing.
pub struct RouteQuery<'a> {
    /// The endpoint whose body carries the prompt; `None` for requests
    /// without one (e.g. `GET /v1/models`), which go to the least loaded.
    pub endpoint: Option<Endpoint>,
    pub body: &'a [u8],
    /// `x-session-id`, hashed (the body's `user` stands in when absent).
    pub session: Option<u64>,
    /// Precise mode: where the request's engine tokens come from.
    pub tokens: TokensFrom<'a>,
    /// The body was scanned already and its canonical prompt is in the
    /// scratch ([`RouteScratch::restore_scan`]): this is what the scan said.
    pub scanned: Option<Prompt>,
    /// No prompt, but a JSON body whose `model` picks the backends (a
    /// `POST` to a path of `routes.extra_allowed`: embeddings, rerank...):
    /// the least loaded of those that serve it.
    pub by_model: bool,
    /// What the head says of the caller (`classes.header`, the API key):
    /// read only when `[classes]` asks for it.
    pub caller: Caller<'a>,
    /// Only these backends (by slot) may be chosen: a gateway's subset
    /// hint (`epp`). `None`: any.
    pub only: Option<&'a BackendSet>,
}

/// A body's scan kept across a wait (a request's tokens made off the
/// worker), so routing does not scan a long body twice.
pub struct Scanned {
    canon: Canonical,
    prompt: Prompt,
}

/// Where a request's engine tokens come from (precise mode).
#[derive(Clone, Copy, Debug)]
pub enum TokensFrom<'a> {
    /// Made here, on the caller's thread, cut to the token budget (the
    /// admin's explain).
    Here,
    /// The traffic path: token ids and the toy tokenizer here (cheap, cut
    /// to the budget), a model tokenizer's only as given, made off the
    /// worker ([`Router::token_job`]); `None`: none came (the tokenizing
    /// threads were busy or slow, or failed), the approximate index routes.
    Worker(Option<&'a EngineTokens>),
}

impl Router {
    pub fn new(config: Config) -> anyhow::Result<Arc<Router>> {
        config.validate()?;
        let budget_percent = config.retry.budget_percent;
        let total: usize = config
            .backends
            .iter()
            .map(|b| b.kv_blocks().unwrap_or(config.prefix.kv_blocks))
            .sum::<usize>()
            + config
                .discovery
                .index_reserve_blocks(config.prefix.kv_blocks);
        let index = PrefixIndex::new(total);
        let mut backends = Vec::new();
        for (slot, b) in config.backends.iter().enumerate() {
            let kv = b.kv_blocks().unwrap_or(config.prefix.kv_blocks);
            let backend = Backend::new(slot, b.url(), backend_addr(b.url())?, kv);
            if let Some(known) = b.kv_blocks() {
                backend.feedback.set_known_capacity(known);
            }
            backends.push(Arc::new(backend));
            index.set_capacity(slot, kv);
        }
        let index = Arc::new(index);
        let members: Vec<Member> = backends
            .iter()
            .map(|b| member(b, Served::Unknown))
            .collect();
        let models = Arc::new(Models::new(&members, &config.model_spec()));
        let precise = config.precise.enabled.then(|| {
            Arc::new(Precise::new(
                total,
                config.precise.settings(),
                config.precise.load_tokenizers(),
                index.clone(),
            ))
        });
        let replica = config
            .replicas
            .enabled()
            .then(|| Arc::new(Replica::new(replica_id())));
        let stored = StoredResponses::new(
            config.routes.responses_max_ids,
            std::time::Duration::from_secs(config.routes.responses_ttl_s),
        );
        let config = Arc::new(ArcSwap::from_pointee(config));
        let fleet = Arc::new(ArcSwap::from_pointee(Fleet { backends }));
        let metrics = Metrics::new(Sources {
            config: config.clone(),
            fleet: fleet.clone(),
            index: index.clone(),
            precise: precise.clone(),
            models: models.clone(),
            replica: replica.clone(),
        });
        let router = Arc::new(Router {
            replica,
            stored,
            models,
            precise,
            subscribers: std::sync::Mutex::new(Vec::new()),
            config,
            fleet,
            index,
            metrics,
            ticket: AtomicU64::new(0),
            client_conns: AtomicUsize::new(0),
            retry_budget: RetryBudget::new(budget_percent),
            shutting_down: AtomicBool::new(false),
            admission: Admission::new(),
        });
        router.sync_subscribers();
        Ok(router)
    }

    /// Precise mode: one subscription per backend of the fleet, to the
    /// endpoints the config gives it; a slot whose backend or endpoints
    /// changed (a reload) starts over, forgotten and DEGRADED.
    pub fn sync_subscribers(&self) {
        let Some(p) = &self.precise else {
            return;
        };
        let cfg = self.config.load();
        let fleet = self.fleet.load();
        let mut subs = self.subscribers.lock().unwrap_or_else(|e| e.into_inner());
        subs.resize_with(MAX_BACKENDS, || None);
        for (slot, sub) in subs.iter_mut().enumerate() {
            // A discovered backend has no table: its host and the precise ports.
            let want =
                fleet
                    .by_slot(slot)
                    .map(|b| match cfg.backends.iter().find(|c| c.url() == b.url) {
                        Some(bc) => cfg.precise.endpoints(bc),
                        None => cfg.precise.endpoints(&BackendConfig::Url(b.url.clone())),
                    });
            if sub.as_ref().map(|s| &s.endpoints) == want.as_ref() {
                continue;
            }
            // Joins the old thread, so nothing it applies outlives this.
            *sub = None;
            p.forget(slot);
            p.confidence[slot].reset();
            if let Some(ep) = want {
                info!(slot, live = %ep.live, replay = ?ep.replay, "KV events: subscribing");
                match Subscriber::spawn(p.clone(), slot, ep) {
                    Ok(s) => *sub = Some(s),
                    Err(e) => tracing::warn!(slot, error = %e, "KV events: no subscriber thread"),
                }
            }
        }
    }

    /// Builds the model table again from the fleet, the config and what
    /// discovery found (after either changed; see `control::health::models`).
    pub fn sync_models(&self) {
        let _one = self.models.rebuilding();
        let fleet = self.fleet.load();
        let members: Vec<Member> = fleet
            .backends
            .iter()
            .map(|b| member(b, Served::Unknown))
            .collect();
        self.models
            .rebuild(&members, &self.config.load().model_spec());
    }

    /// Routes one request: extracts its prompt (400 when the body is not
    /// what its endpoint takes), hashes it into `blocks`, ranks backends
    /// among those that serve its model (404 when none may).
    pub fn route(
        &self,
        query: &RouteQuery,
        scratch: &mut RouteScratch,
        blocks: &mut PromptBlocks,
    ) -> Result<Routed, RouterError> {
        let cfg = self.config.load();
        let (seed, user, has_prompt) = match query.endpoint {
            Some(ep) => {
                let p = match query.scanned {
                    Some(p) => p,
                    None => {
                        scratch.canon.set_limit(self.canonical_limit(&cfg));
                        scan(ep, query.body, &mut scratch.canon)?
                    }
                };
                scratch.answered = ep.is_chat().then(|| scratch.canon.answered());
                (p.seed, p.user, true)
            }
            None => {
                scratch.answered = None;
                scratch.canon.clear();
                scratch.carry.clear();
                if query.by_model {
                    crate::prompt::apis::model_only(query.body, &mut scratch.canon);
                }
                (0, None, false)
            }
        };
        let cfg = self.config.load();
        scratch.placed = place(&cfg.classes, &query.caller, user, scratch.canon.tier());
        let session = query.session.or(user);
        let table = self.models.table();
        let want = if query.endpoint.is_some() || !scratch.canon.model().is_empty() {
            table.resolve(scratch.canon.model(), scratch.canon.adapter())?
        } else {
            table.unfiltered()
        };
        let PromptBlocks { hashes, found, .. } = blocks;
        let policy = want.policy().unwrap_or(cfg.policy);
        let fleet = self.fleet.load_full();
        hashes.clear();
        if has_prompt {
            // A prompt's first `MAX_PROMPT_BLOCKS` only.
            let max = cfg.prefix.block_bytes.saturating_mul(MAX_PROMPT_BLOCKS);
            block_hashes_pieces(
                seed,
                scratch.canon.pieces_upto(query.body, max),
                cfg.prefix.block_bytes,
                &mut scratch.carry,
                hashes,
            );
        }
        let mut matches = std::mem::take(&mut scratch.prefix_matches);
        matches.clear();
        if policy == Policy::Prefix && !hashes.is_empty() {
            // Every slot: only the fleet's are read below (a slot is
            // cleared before a new backend takes it, `control::membership`),
            // so the request makes no pass over the fleet for this.
            self.index
                .longest_matches_noting(hashes, &BackendSet::ALL, &mut matches, found);
        }
        scratch.precise_mask = BackendSet::default();
        blocks.keys.clear();
        if let (Some(_), Some(_), Policy::Prefix) = (&self.precise, query.endpoint, policy) {
            self.precise_matches(
                query,
                &fleet,
                scratch,
                &mut blocks.keys,
                hashes.len(),
                &mut matches,
            );
        }
        scratch.loads.clear();
        scratch.matches.clear();
        scratch.ranks.clear();
        let cap = cfg
            .classes
            .max_in_flight(scratch.placed.class, cfg.limits.max_in_flight_per_backend);
        // Waiting requests of a higher class go first.
        let above_waiting = self.waits_above(scratch.placed.class);
        let ticket = self.ticket.fetch_add(1, Relaxed);
        let fleet_slots = fleet_slots(&fleet);
        for b in &fleet.backends {
            let mut load = b.view(cap);
            if above_waiting || query.only.is_some_and(|o| !o.contains(b.slot)) {
                load.eligible = false;
            }
            if !cfg.prefix.expects_lost_history() {
                load.private_lost = 0.0;
            }
            load.cached_blocks = u32::try_from(self.index.tracked(b.slot)).unwrap_or(u32::MAX);
            if let Some(p) = self
                .precise
                .as_ref()
                .filter(|_| scratch.precise_mask.contains(b.slot))
            {
                // What its engine says it holds, traffic from elsewhere included.
                load.cached_blocks = u32::try_from(p.index.held_blocks(b.slot)).unwrap_or(u32::MAX);
            }
            let mut m = matches[b.slot];
            scratch.ranks.push(want.rank(&table, b.slot, b.generation));
            if b.slots.is_slot_engine() && policy == Policy::Prefix {
                // A slot engine: what the slot it would take holds.
                let p = b.slots.predict(hashes, ticket, load.in_flight, fleet_slots);
                m = p.cached_blocks;
                // A live conversation's slot: its blocks and the slot
                // itself, weighed by how likely it is still going.
                let evict = (f64::from(p.evicted_blocks) * cfg.prefix.slot_evict_cost
                    + cfg.prefix.slot_live_evict_blocks)
                    * f64::from(p.live_weight);
                // Every slot running: it waits for a whole request first.
                let wait = f64::from(p.waits) * cfg.prefix.overload_cost_blocks;
                load.evict_cost_blocks = (evict + wait) as f32;
            }
            scratch.loads.push(load);
            scratch.matches.push(m);
        }
        scratch.prefix_matches = matches;
        models::keep_best(&mut scratch.loads, &scratch.ranks);
        same_hardware_same_rate(&mut scratch.loads, &mut scratch.rates);
        // Without a full block, the carry is the whole canonical prompt.
        scratch.cold_key = cold_key(seed, &scratch.carry, hashes, cfg.prefix.cold_key_blocks);
        let input = RouteInput {
            matches: &scratch.matches,
            blocks: hashes.len() as u32,
            cold_key: scratch.cold_key,
            session_key: session,
            ticket,
            answered: scratch.answered,
        };
        blocks.prefix = policy == Policy::Prefix;
        let policy = if has_prompt {
            policy
        } else {
            Policy::LeastRequest
        };
        // Candidates are positions in `fleet.backends`.
        let params = prefix_params(&cfg, scratch);
        let choice = select::select(policy, &input, &scratch.loads, &params);
        let model = want.stats().clone();
        Ok(Routed {
            choice,
            fleet,
            model,
        })
    }

    /// The most of a canonical prompt routing reads: the blocks it hashes
    /// (`MAX_PROMPT_BLOCKS`) and precise mode's token budget. A scan keeps
    /// no more of it (`Canonical::set_limit`).
    fn canonical_limit(&self, cfg: &Config) -> usize {
        let blocks = cfg.prefix.block_bytes.saturating_mul(MAX_PROMPT_BLOCKS);
        let tokens = self.precise.as_ref().map_or(0, |p| {
            p.tokenizers.max_tokens.saturating_mul(CUT_BYTES_PER_TOKEN)
        });
        blocks.max(tokens)
    }

    /// Precise mode: the tokenizing [`Router::route`] will need for this
    /// request when it is a model tokenizer's, to be done off the traffic
    /// worker (`precise::offload`) and handed to `route` as
    /// [`TokensFrom::Worker`]; `None` when there is none to do (precise
    /// mode off, a prompt given as token ids, the toy tokenizer, no EXACT
    /// backend, a chat template not used, a pool whose policy is not
    /// `prefix`, a body `route` will refuse). The prompt is cut to the
    /// token budget first.
    pub fn token_job(&self, query: &RouteQuery, scratch: &mut RouteScratch) -> Option<Job> {
        scratch.scanned = None;
        let p = self.precise.as_ref()?;
        let ep = query.endpoint?;
        let cfg = self.config.load();
        scratch.canon.set_limit(self.canonical_limit(&cfg));
        scratch.scanned = Some(scan(ep, query.body, &mut scratch.canon).ok()?);
        let crate::precise::tokenizer::Choice::Model(t) =
            p.tokenizers.for_model(scratch.canon.model())
        else {
            return None;
        };
        if scratch.canon.token_ids() && !ep.is_chat() {
            return None;
        }
        let now = p.now_ms();
        if !self
            .fleet
            .load()
            .backends
            .iter()
            .any(|b| p.exact(b.slot, now))
        {
            return None;
        }
        let table = self.models.table();
        let want = table
            .resolve(scratch.canon.model(), scratch.canon.adapter())
            .ok()?;
        if want.policy().unwrap_or(cfg.policy) != Policy::Prefix {
            return None;
        }
        if ep.is_chat() && !t.use_template() {
            return None;
        }
        let mut canonical = Vec::new();
        let max = p.tokenizers.max_tokens.saturating_mul(CUT_BYTES_PER_TOKEN);
        let cut = scratch
            .canon
            .write_prefix_to(query.body, &mut canonical, max);
        if cut {
            crate::precise::keys::cut(&mut canonical, ep, false);
        }
        Some(Job {
            tokenizer: t.clone(),
            endpoint: ep,
            canonical,
            cut,
        })
    }

    /// Precise mode: replaces, for every EXACT backend, its approximate
    /// match by what its engine's events say it holds, in the approximate
    /// index's units (a share of the prompt's `approx_blocks`), so selection
    /// weighs both alike. (The longer of the two was tried: no clear gain,
    /// see "Precise mode" in ARCHITECTURE.md.) A prompt cut to the token
    /// budget counts its tokens as the share of the prompt they cover; a
    /// backend that holds them all keeps its approximate match when that is
    /// longer (what it holds past the cut).
    fn precise_matches(
        &self,
        query: &RouteQuery,
        fleet: &Fleet,
        scratch: &mut RouteScratch,
        keys: &mut Vec<u64>,
        approx_blocks: usize,
        matches: &mut Matches,
    ) {
        scratch.precise_mask = BackendSet::default();
        let (Some(p), Some(ep)) = (&self.precise, query.endpoint) else {
            return;
        };
        let now = p.now_ms();
        let mut exact = BackendSet::default();
        for b in &fleet.backends {
            if p.exact(b.slot, now) {
                exact.insert(b.slot);
            }
        }
        if exact.is_empty() {
            return;
        }
        let choice = p.tokenizers.for_model(scratch.canon.model());
        let ids = scratch.canon.token_ids() && !ep.is_chat();
        let offloaded = !ids && matches!(choice, crate::precise::tokenizer::Choice::Model(_));
        let max_tokens = p.tokenizers.max_tokens;
        let (tokens, covered, cut): (&[u32], usize, bool) = match query.tokens {
            TokensFrom::Worker(given) if offloaded => match given {
                Some(t) => (&t.tokens, t.covered, t.cut),
                // No tokens for it (see `TokensFrom`): every backend on
                // the approximate index.
                None => return,
            },
            TokensFrom::Worker(_) | TokensFrom::Here => {
                let max = max_tokens.saturating_mul(CUT_BYTES_PER_TOKEN);
                let mut cut =
                    scratch
                        .canon
                        .write_prefix_to(query.body, &mut scratch.canonical, max);
                if cut {
                    crate::precise::keys::cut(&mut scratch.canonical, ep, ids);
                }
                let prompt = PromptText {
                    endpoint: ep,
                    canonical: &scratch.canonical,
                    token_ids: scratch.canon.token_ids(),
                    cut,
                };
                if !crate::precise::keys::engine_tokens(
                    choice,
                    &p.tokenizers.pool,
                    &prompt,
                    &mut scratch.text,
                    &mut scratch.tokens,
                ) {
                    // No tokens for this model (its tokenizer is missing or
                    // failed, reported once): the approximate index.
                    return;
                }
                let mut covered = scratch.canonical.len();
                if scratch.tokens.len() > max_tokens {
                    covered =
                        (covered as u64 * max_tokens as u64 / scratch.tokens.len() as u64) as usize;
                    scratch.tokens.truncate(max_tokens);
                    cut = true;
                }
                (&scratch.tokens, covered, cut)
            }
        };
        scratch.first_extra.clear();
        let salt = scratch.canon.salt();
        if !salt.is_empty() {
            scratch.first_extra.push(salt.to_vec());
        }
        let adapter = p.adapters.of_model(scratch.canon.model());
        crate::precise::keys::request_keys(
            crate::precise::keys::chain_seed(adapter),
            tokens,
            p.settings.block_tokens,
            &scratch.first_extra,
            keys,
        );
        scratch.precise_mask = exact;
        let pm = &mut scratch.exact_matches;
        pm.clear();
        if !keys.is_empty() {
            p.matches(keys, &exact, now, pm);
        }
        // The approximate blocks the tokens stand for.
        let covered_blocks = if cut {
            (approx_blocks as u64 * covered as u64 / scratch.canon.len().max(1) as u64)
                .min(approx_blocks as u64)
        } else {
            approx_blocks as u64
        };
        for slot in exact.iter() {
            let held = u64::from(pm[slot]);
            let mut m = if keys.is_empty() {
                0
            } else {
                (held * covered_blocks / keys.len() as u64) as u32
            };
            if cut && !keys.is_empty() && held == keys.len() as u64 {
                m = m.max(matches[slot]);
            }
            matches.set(slot, m);
        }
    }

    /// Every eligible backend's predicted TTFT for the request last routed
    /// with `scratch` (`blocks` of them), as the `prefix` policy ranks them.
    pub fn scores(&self, scratch: &RouteScratch, blocks: u32) -> Vec<select::Score> {
        let input = RouteInput {
            matches: &scratch.matches,
            blocks,
            cold_key: scratch.cold_key,
            session_key: None,
            ticket: 0,
            answered: scratch.answered,
        };
        let params = prefix_params(&self.config.load(), scratch);
        select::prefix_scores(&input, &scratch.loads, &params)
    }

    /// Stop taking new connections and requests (SIGTERM).
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Relaxed);
    }

    pub fn shutting_down(&self) -> bool {
        self.shutting_down.load(Relaxed)
    }

    /// Requests in flight over all backends.
    pub fn in_flight(&self) -> u32 {
        self.fleet
            .load()
            .backends
            .iter()
            .map(|b| b.load.in_flight())
            .sum()
    }

    /// A request to `backend` failed (connect error, reset, 5xx, XDP resets):
    /// after `health.passive_fall` in a row it is ejected, and forgotten by
    /// the index, until probes pass.
    pub fn request_failed(&self, backend: &Backend, why: &str) {
        backend.stats.failed();
        let fall = self.config.load().health.passive_fall;
        if let (n, Some(_)) = backend.health.request_failed(fall) {
            self.index.clear_backend(backend.slot);
            backend.slots.clear();
            warn!(backend = %backend.url, failures = n, last = why, "backend ejected after failed requests");
        }
    }

    /// Whether a request of a class above `class` waits for room.
    pub fn waits_above(&self, class: Class) -> bool {
        Class::ALL
            .iter()
            .take_while(|&&c| c < class)
            .any(|&c| self.admission.waiting(c) > 0)
    }

    /// `backend` stored the response `id` (`/v1/responses`): requests
    /// that name it go there.
    pub fn stored_response(&self, id: &str, backend: &Backend) {
        self.stored.store(id, backend.id_hash);
        if let Some(r) = &self.replica {
            r.outbox.stored(backend.id_hash, id);
        }
    }

    /// Records that `backend` was sent the prompt with these block hashes,
    /// predicted to hold `matched` and prefill `prefill` of them, and tells
    /// the peer replicas. Returns the clock stamp its blocks took in the
    /// index, for the request's `InFlight::pin`.
    pub fn learn(
        &self,
        backend: &Backend,
        blocks: &mut PromptBlocks,
        matched: u32,
        prefill: u32,
    ) -> Option<u64> {
        blocks.ages.clear();
        blocks.slot = None;
        blocks.shared_as = None;
        if let Some(p) = &self.precise
            && !blocks.keys.is_empty()
        {
            p.guard(backend.slot, &blocks.keys, p.now_ms());
        }
        let learned = blocks.prefix && !blocks.hashes.is_empty();
        if let Some(r) = &self.replica
            && (learned || !blocks.keys.is_empty())
        {
            let hashes: &[u64] = if learned { &blocks.hashes } else { &[] };
            let request = r.outbox.request_id();
            let prompt = crate::replica::Prompt {
                hashes,
                keys: &blocks.keys,
            };
            r.outbox
                .sent(backend.id_hash, request, matched, prefill, prompt);
            blocks.shared_as = Some(request);
        }
        if !learned {
            return None;
        }
        if backend.slots.is_slot_engine() {
            // It takes the slot the model predicts (the request is counted
            // in flight by now, so it is not its own busy slot).
            let now = self.ticket.load(Relaxed);
            let fleet = self.fleet.load();
            let in_flight = backend.load.in_flight().saturating_sub(1);
            let p = backend
                .slots
                .predict(&blocks.hashes, now, in_flight, fleet_slots(&fleet));
            blocks.slot = backend.slots.dispatched(p.slot, &blocks.hashes, now);
            for other in fleet.backends.iter().filter(|b| b.slot != backend.slot) {
                other.slots.moved_away(&blocks.hashes);
            }
            return None;
        }
        let sent = self.index.insert_aging(
            backend.slot,
            &blocks.hashes,
            &blocks.found,
            &mut blocks.ages,
        );
        // What the engine's running requests hold counts toward every age
        // (`Load::pinned_before`), or the capacity learned from the ages
        // comes out low on a busy engine (decision 0023).
        let answer = backend.feedback.answer_blocks();
        let slot = backend.slot;
        self.index
            .distinct_ages_pinned(slot, sent, &mut blocks.ages, |stamp| {
                backend
                    .load
                    .pinned_before(stamp, answer, |s, n| self.index.resent(slot, s, n))
            });
        Some(sent.now + blocks.hashes.len() as u64)
    }
}

impl Router {
    /// A peer replica sent `backend` a prompt of these blocks (precise
    /// mode's engine keys when it had them): learned as if sent from here,
    /// but its ages are the peer's to measure.
    ///
    /// Its blocks count on the backend's clock and its re-sent blocks in
    /// the retouch counts, as a send from here would, so the ages this
    /// replica's closed loop reads are the fleet's. `ages` is scratch.
    pub fn learn_remote(
        &self,
        backend: &Backend,
        hashes: &[u64],
        keys: &[u64],
        ages: &mut Vec<u64>,
    ) -> Option<u64> {
        if let Some(p) = &self.precise
            && !keys.is_empty()
        {
            p.guard(backend.slot, keys, p.now_ms());
        }
        if hashes.is_empty() {
            return None;
        }
        if backend.slots.is_slot_engine() {
            let now = self.ticket.load(Relaxed);
            let fleet = self.fleet.load();
            let in_flight = backend.load.in_flight();
            let p = backend
                .slots
                .predict(hashes, now, in_flight, fleet_slots(&fleet));
            backend.slots.dispatched(p.slot, hashes, now);
            for other in fleet.backends.iter().filter(|b| b.slot != backend.slot) {
                other.slots.moved_away(hashes);
            }
            return None;
        }
        let sent = self.index.insert_aging(backend.slot, hashes, &[], ages);
        let stamp = sent.now + hashes.len() as u64;
        self.index.distinct_ages(backend.slot, sent, ages);
        Some(stamp)
    }

    /// A peer replica's answers from `backend` wrote `blocks` blocks: they
    /// count on its clock, as this replica's own answers do.
    pub fn answered_remote(&self, backend: &Backend, blocks: u32) {
        if blocks > 0 && !backend.slots.is_slot_engine() {
            self.index.allocated(backend.slot, u64::from(blocks));
        }
    }

    /// A peer replica found `backend`'s engine flushed: it holds this
    /// prompt and nothing else the index believed.
    pub fn flushed_remote(&self, backend: &Backend, hashes: &[u64]) {
        if backend.slots.is_slot_engine() {
            return;
        }
        self.index.clear_backend(backend.slot);
        self.index.insert(backend.slot, hashes);
    }
}

/// A random id for this process's replica stream: a peer that sees it
/// change knows the replica restarted.
fn replica_id() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let stack = &t as *const u64 as u64;
    xxhash_rust::xxh3::xxh3_64_with_seed(&t.to_le_bytes(), u64::from(std::process::id()) ^ stack)
}

/// A backend as the model table is built for it.
fn member(b: &Backend, served: Served) -> Member<'_> {
    Member {
        slot: b.slot,
        generation: b.generation,
        url: &b.url,
        served,
    }
}

/// Slots over the fleet's slot engines (liveness in `fleet::slots` is
/// measured against it).
fn fleet_slots(fleet: &Fleet) -> usize {
    fleet.backends.iter().map(|b| b.slots.count()).sum()
}

/// Learned prefill rates within this factor of the fleet's median count as
/// the median: observed TTFTs scatter by tens of percent on identical
/// engines (the fixed cost of a step, the network), and selection should not
/// chase that noise; a GPU twice as fast still shows.
const SAME_RATE_FACTOR: f32 = 1.5;

/// The prefix policy's tuning for the request routed with `scratch`:
/// `precise.move_cost` when some backend's match came from its engine's
/// events.
fn prefix_params(cfg: &Config, scratch: &RouteScratch) -> select::PrefixParams {
    let mut p = cfg.prefix.params();
    if !scratch.precise_mask.is_empty() {
        p.move_cost = cfg.precise.move_cost;
    }
    p
}

/// Replaces rates near the fleet's median by the median (see `SAME_RATE_FACTOR`).
fn same_hardware_same_rate(loads: &mut [BackendLoad], rates: &mut Vec<f32>) {
    rates.clear();
    rates.extend(loads.iter().map(|l| l.prefill_rate).filter(|&r| r > 0.0));
    let n = rates.len();
    if n == 0 {
        return;
    }
    rates.sort_unstable_by(f32::total_cmp);
    let median = rates[n / 2];
    for l in loads.iter_mut() {
        let r = l.prefill_rate;
        if r <= 0.0 || (r < median * SAME_RATE_FACTOR && r * SAME_RATE_FACTOR > median) {
            l.prefill_rate = median;
        }
    }
}

impl Router {
    /// An answer from `backend` taught `lesson`: the peer replicas learn
    /// it as if they had seen the answer.
    pub fn taught(&self, backend: &Backend, lesson: Lesson) {
        if let Some(r) = &self.replica {
            let (what, a, b) = lesson.encode();
            r.outbox.learned(backend.id_hash, what, a, b);
        }
    }

    /// Closes the loop on one answer: `usage` is what the engine said it had
    /// cached of the prompt in `blocks`, `predicted` what the index said
    /// `backend` held when the request was routed, `shared` how much of it
    /// another backend held too. Corrects the index when they disagree (see
    /// `feedback`).
    pub fn observe_answer(
        &self,
        backend: &Backend,
        blocks: &PromptBlocks,
        predicted: u32,
        shared: u32,
        usage: Usage,
    ) {
        let cfg = self.config.load();
        if blocks.hashes.is_empty() || !blocks.prefix {
            return;
        }
        // Slot engines are modelled by their slots, not the block index.
        if backend.slots.is_slot_engine() || blocks.ages.len() != blocks.hashes.len() {
            return;
        }
        let slot = backend.slot;
        let pinned = backend.load.in_flight_blocks();
        let prompt_blocks = blocks.hashes.len() as u32;
        // The engine's cache takes the generated tokens too (the next turn
        // finds them there): they count on its clock, or the capacity
        // learned in the clock's blocks comes out too small by the
        // answers' share of what it uses.
        let answer = usage.completion_blocks(prompt_blocks);
        self.index.allocated(slot, u64::from(answer));
        if self.replica.is_some() {
            backend.load.remote.answered(answer);
        }
        backend.feedback.observe_answer_blocks(answer);
        if cfg.prefix.learn_from_answers {
            backend
                .feedback
                .observe_private(usage, prompt_blocks, predicted, shared);
        }
        match backend
            .feedback
            .observe_teaching(usage, predicted, &blocks.ages, pinned, |l| {
                self.taught(backend, l)
            }) {
            _ if !cfg.prefix.learn_from_answers => {}
            Correction::None => {}
            Correction::Flushed => {
                // The engine holds this prompt now (it just computed it) and
                // nothing else the index believed.
                info!(backend = %backend.url, predicted, "engine held none of a prompt it was predicted to hold: forgetting what the index had of it");
                self.index.clear_backend(slot);
                self.index.insert(slot, &blocks.hashes);
                if let Some(r) = &self.replica {
                    r.outbox.flushed(backend.id_hash, &blocks.hashes);
                }
            }
        }
    }
}

/// A request's class and tenant (`Classes::place`); a class word the
/// router does not know counts as default (warned once per source).
fn place(classes: &Classes, caller: &Caller, user: Option<u64>, tier: &[u8]) -> Placed {
    let placed = classes.place(caller, user, tier);
    if let Some(from) = placed.unknown {
        static WARNED: [AtomicBool; 2] = [AtomicBool::new(false), AtomicBool::new(false)];
        let (i, value) = match from {
            Source::Header => (0, caller.header.unwrap_or_default()),
            _ => (1, tier),
        };
        if !WARNED[i].swap(true, Relaxed) {
            tracing::warn!(source = from.name(), value = %String::from_utf8_lossy(value), "a class the router does not know counts as default (priority, default or flex; warned once)");
        }
    }
    placed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn near_rates_count_as_one_and_far_ones_show() {
        let mut loads: Vec<BackendLoad> = [1000.0, 1300.0, 0.0, 800.0, 3000.0]
            .iter()
            .map(|&r| BackendLoad {
                prefill_rate: r,
                ..Default::default()
            })
            .collect();
        same_hardware_same_rate(&mut loads, &mut Vec::new());
        let rates: Vec<f32> = loads.iter().map(|l| l.prefill_rate).collect();
        // 800 is more than 1.5x below the median: a slower engine, kept.
        assert_eq!(rates, [1300.0, 1300.0, 1300.0, 800.0, 3000.0]);
    }

    #[test]
    fn a_request_routed_on_engine_events_moves_at_the_precise_cost() {
        let mut cfg = Config::default();
        cfg.precise.move_cost = 3.0;
        let mut scratch = RouteScratch::default();
        assert_eq!(
            prefix_params(&cfg, &scratch).move_cost,
            cfg.prefix.move_cost
        );
        scratch.precise_mask.insert(1);
        assert_eq!(prefix_params(&cfg, &scratch).move_cost, 3.0);
    }

    #[test]
    fn a_prompt_past_any_context_is_hashed_only_to_the_cap() {
        use crate::prompt::hash::DEFAULT_BLOCK_BYTES;
        let cfg: Config = toml::from_str("backends = [\"http://127.0.0.1:9\"]").unwrap();
        let router = Router::new(cfg).unwrap();
        let (mut scratch, mut blocks) = (RouteScratch::default(), PromptBlocks::default());
        let mut route = |content: &str| {
            let body = serde_json::json!({"messages": [{"role": "user", "content": content}]});
            let body = serde_json::to_vec(&body).unwrap();
            let query = RouteQuery {
                endpoint: Some(Endpoint::Chat),
                body: &body,
                session: None,
                tokens: TokensFrom::Here,
                scanned: None,
                by_model: false,
                caller: Caller::default(),
                only: None,
            };
            router.route(&query, &mut scratch, &mut blocks).unwrap();
            blocks.hashes.clone()
        };
        let long = "x".repeat(DEFAULT_BLOCK_BYTES * (MAX_PROMPT_BLOCKS + 1000));
        let capped = route(&long);
        assert_eq!(capped.len(), MAX_PROMPT_BLOCKS);
        // The first blocks are the prompt's own: a shorter one shares them.
        let short = route(&long[..DEFAULT_BLOCK_BYTES * 100]);
        assert_eq!(short[..], capped[..short.len()]);
    }

    #[test]
    fn retries_are_capped_by_the_budget() {
        let b = RetryBudget::new(20);
        let reserve = (0..100).take_while(|_| b.withdraw()).count();
        assert_eq!(reserve, RETRY_RESERVE as usize);
        for _ in 0..50 {
            b.deposit();
        }
        assert_eq!(
            (0..100).take_while(|_| b.withdraw()).count(),
            10,
            "20% of 50 requests"
        );
    }
}
