//! Configuration: a TOML file (see `prefix-router.example.toml` for every key,
//! commented) and command-line flags, which override the file.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, bail};
use serde::Deserialize;

pub mod classes;
pub mod discovery;
pub mod ebpf;
pub mod epp;
pub mod keys;
pub mod models;
pub mod precise;
pub mod replicas;
pub mod tls;

use crate::fleet::MAX_BACKENDS;
use crate::fleet::slots::EngineKind;
use crate::http::url::HttpUrl;
use crate::policy::select::{Policy, PrefixParams};
use crate::prompt::hash::DEFAULT_BLOCK_BYTES;
pub use classes::Classes;

/// The whole configuration. Every field has a default but `backends`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Address the traffic listener binds (every worker binds it with SO_REUSEPORT).
    pub listen: SocketAddr,
    /// Worker threads, each with its own io_uring event loop. 0: one per core.
    pub workers: usize,
    /// Routing policy.
    pub policy: Policy,
    /// Backends, as `http://host:port` URLs or tables with a per-backend `kv_blocks`.
    pub backends: Vec<BackendConfig>,
    pub prefix: PrefixConfig,
    pub limits: Limits,
    pub timeouts: Timeouts,
    pub retry: Retry,
    pub routes: Routes,
    pub health: Health,
    pub admin: Admin,
    pub log: Log,
    /// Precise mode: the engines' KV-cache events (`[precise]`, off by default).
    pub precise: precise::PreciseConfig,
    /// The XDP connection counters (`[ebpf]`).
    pub ebpf: ebpf::EbpfConfig,
    /// Model discovery and requests without a model (`[models]`).
    pub models: models::ModelsConfig,
    /// Optional pools: models, their backends, their policy (`[[pools]]`).
    pub pools: Vec<models::PoolConfig>,
    /// Backends from DNS names and files, besides `backends` (`[discovery]`).
    pub discovery: discovery::DiscoveryConfig,
    /// Router replicas sharing what they learn (`[replicas]`, off by default).
    pub replicas: replicas::ReplicasConfig,
    /// Request classes (`service_tier`): batch work held back while the
    /// engines are busy (`[classes]`).
    pub classes: Classes,
    /// The endpoint-picker front for Envoy and other inference gateways
    /// (`[epp]`, off by default).
    pub epp: epp::EppConfig,
    /// Add `x-prefix-router-backend` and `x-prefix-router-matched-blocks` to
    /// responses, keep the engine's identity headers (`server`,
    /// `x-engine-id`), and put the internal detail (backend URL, OS error)
    /// in error answers. Off, clients learn nothing of the backends.
    pub debug_headers: bool,
    /// How often the files the configuration names (certificates, keys,
    /// the keys file) are checked for a change, which reloads as SIGHUP
    /// does (0: only SIGHUP and `POST /admin/reload`). One `stat` each.
    pub watch_files_ms: u64,
    /// TLS on the traffic listener (`[tls]`, off by default).
    pub tls: tls::TlsConfig,
    /// TLS to `https://` backends (`[backend_tls]`).
    pub backend_tls: tls::BackendTlsConfig,
    /// API keys on the traffic port (`[auth]`, off by default).
    pub auth: keys::AuthConfig,
    /// What the files above hold, read by [`Config::load_files`].
    #[serde(skip)]
    pub loaded: Loaded,
}

/// What the configuration's files hold, read and checked: swapped with
/// the configuration on reload, so a request sees one consistent set.
#[derive(Clone, Default)]
pub struct Loaded {
    /// The listener's TLS (`[tls]`), when on.
    pub server_tls: Option<std::sync::Arc<rustls::ServerConfig>>,
    /// For `https://` backends, when any is configured.
    pub client_tls: Option<std::sync::Arc<rustls::ClientConfig>>,
    /// The accepted API keys, when `auth.keys_file` is set.
    pub keys: Option<std::sync::Arc<keys::Keys>>,
    /// Each backend's `authorization` line, by URL, for those with an
    /// `api_key_file`.
    pub backend_keys: std::sync::Arc<hashbrown::HashMap<String, Vec<u8>>>,
}

impl Loaded {
    /// Whether the callers' credentials are taken out of forwarded heads
    /// (and put back, or replaced, per backend).
    pub fn rewrites_authorization(&self, auth: &keys::AuthConfig) -> bool {
        !auth.forward_authorization || !self.backend_keys.is_empty()
    }
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded")
            .field("server_tls", &self.server_tls.is_some())
            .field("client_tls", &self.client_tls.is_some())
            .field("keys", &self.keys)
            .field("backend_keys", &self.backend_keys.len())
            .finish()
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: "0.0.0.0:8080".parse().expect("literal address"),
            workers: 0,
            policy: Policy::Prefix,
            backends: Vec::new(),
            prefix: PrefixConfig::default(),
            limits: Limits::default(),
            timeouts: Timeouts::default(),
            retry: Retry::default(),
            routes: Routes::default(),
            health: Health::default(),
            admin: Admin::default(),
            log: Log::default(),
            precise: Default::default(),
            ebpf: ebpf::EbpfConfig::default(),
            models: models::ModelsConfig::default(),
            pools: Vec::new(),
            discovery: discovery::DiscoveryConfig::default(),
            replicas: replicas::ReplicasConfig::default(),
            classes: Classes::default(),
            epp: epp::EppConfig::default(),
            debug_headers: false,
            watch_files_ms: 1_000,
            tls: Default::default(),
            backend_tls: Default::default(),
            auth: Default::default(),
            loaded: Loaded::default(),
        }
    }
}

/// One backend: a URL, or a table with its KV capacity.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum BackendConfig {
    Url(String),
    Table {
        url: String,
        /// KV-cache capacity in blocks; overrides `prefix.kv_blocks` and the engine's own report.
        kv_blocks: Option<usize>,
        /// Precise mode: the engine's KV event stream, `tcp://host:port`
        /// [default: the backend's host and `precise.port`].
        kv_events: Option<String>,
        /// Precise mode: its replay socket [default: none when `kv_events`
        /// is given, else the backend's host and `precise.replay_port`].
        kv_events_replay: Option<String>,
        /// How its cache is modelled; overrides `prefix.engine`.
        #[serde(default)]
        engine: Option<EngineKind>,
        /// Slot engines: its slot count; overrides what `/props` says.
        #[serde(default)]
        slots: Option<usize>,
        /// The models (and adapters) it serves; given, its `/v1/models` is
        /// not read.
        #[serde(default)]
        models: Option<Vec<String>>,
        /// A file holding the key this backend wants: sent as
        /// `Authorization: Bearer KEY` in place of the caller's.
        #[serde(default)]
        api_key_file: Option<String>,
    },
}

impl BackendConfig {
    pub fn url(&self) -> &str {
        match self {
            BackendConfig::Url(u) | BackendConfig::Table { url: u, .. } => u,
        }
    }

    pub fn kv_blocks(&self) -> Option<usize> {
        match self {
            BackendConfig::Url(_) => None,
            BackendConfig::Table { kv_blocks, .. } => *kv_blocks,
        }
    }

    /// The endpoints of its KV event stream and replay socket, if given.
    pub fn kv_events(&self) -> (Option<&str>, Option<&str>) {
        match self {
            BackendConfig::Url(_) => (None, None),
            BackendConfig::Table {
                kv_events,
                kv_events_replay,
                ..
            } => (kv_events.as_deref(), kv_events_replay.as_deref()),
        }
    }

    /// The models its table pins, if any.
    pub fn models(&self) -> Option<&[String]> {
        match self {
            BackendConfig::Url(_) => None,
            BackendConfig::Table { models, .. } => models.as_deref(),
        }
    }

    /// The file of the key the router sends it, if the table names one.
    pub fn api_key_file(&self) -> Option<&str> {
        match self {
            BackendConfig::Url(_) => None,
            BackendConfig::Table { api_key_file, .. } => api_key_file.as_deref(),
        }
    }

    /// Its own engine kind and slot count, if the table sets them.
    pub fn engine(&self) -> (Option<EngineKind>, Option<usize>) {
        match self {
            BackendConfig::Url(_) => (None, None),
            BackendConfig::Table { engine, slots, .. } => (*engine, *slots),
        }
    }
}

/// Tuning of the prefix policy and index.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrefixConfig {
    /// Bytes of canonical prompt per block. 64 is about 16 tokens, one vLLM block.
    pub block_bytes: usize,
    /// Balance bound: each request a backend has over `(1 + epsilon) * mean
    /// load + slack` adds `overload_cost_blocks` to its predicted TTFT, and
    /// new prefixes go only to backends under it. 0.25 lets a warm backend
    /// run 25% over the mean before sharing its prefix gets cheaper.
    pub epsilon: f64,
    /// Absolute headroom of the bounds, so small fleets at low load are not
    /// forced apart by a single request. 3 (measured with `hold_private`,
    /// beside 2).
    pub slack: u32,
    /// Cost of one request already in flight on a backend, in blocks of
    /// prefill: a running decode slows a new prompt's prefill a little.
    pub in_flight_cost_blocks: f64,
    /// Cost of being over the balance bound, in blocks of prefill: `n`
    /// requests over cost `n² * overload_cost_blocks`. 64 blocks (about
    /// 1,000 tokens, 0.1 s on the reference GPU): a new conversation on a
    /// hot system prompt moves to a second engine once the first is two
    /// requests over, a conversation with a long history stays where its
    /// history is until three.
    pub overload_cost_blocks: f64,
    /// Safety cap: no backend at or above `safety_factor * mean load + slack`,
    /// whatever its cache holds. 1.5 stops pile-ups (measured on the
    /// hot-prompt scenario: 2 let the first engine holding a hot prompt keep
    /// a quarter more conversations than the others); balance within it is
    /// the predicted TTFT's job.
    pub safety_factor: f64,
    /// A new prefix skips backends whose cache (tracked blocks up to the
    /// capacity, plus running prompts) holds more than the emptiest
    /// backend's by this share of the fleet's mean, so a few system prompts
    /// cannot load one engine's cache with more than it holds.
    pub pressure_slack: f64,
    /// Extra cost of each block of the longest match a backend lacks, on top
    /// of recomputing it: writing it evicts as much of someone else's prefix
    /// there, when caches are full. 0.5 counts half of it.
    pub move_cost: f64,
    /// A request whose longest holder leads the next by fewer blocks than
    /// this has no history at stake: the balance bound is a hard cap for it.
    /// 4 blocks (about 64 tokens): less than any turn of a conversation.
    pub sticky_min_blocks: u32,
    /// Conversations are held, new ones kept with their prompt: a chat
    /// holding an earlier answer (a conversation past its first turn; for
    /// other endpoints, a lead of `sticky_min_blocks`) stays on its longest
    /// holder up to the safety cap, and the balance bound does not move it;
    /// a chat without one (a new conversation) is private to no engine and
    /// goes where its prompt is, within the balance bound and
    /// `shared_gap`. On: 74.7% against 66.8% on pressure-unpublished and
    /// TTFT p99 472 ms against 785 ms on hot-prompt, side by side
    /// (decision 0017). Off: the lead alone decides, and the
    /// balance bound moves conversations.
    pub hold_private: bool,
    /// Block-equivalents of each request in flight for a request with no
    /// private lead. 2 (as `in_flight_cost_blocks`): a new conversation
    /// stays with its prompt's engines unless `shared_gap` or the bound
    /// says otherwise; 64 spread new conversations at a gap of 2 to 3,
    /// which split system prompts on fluctuations and cost hits.
    pub shared_in_flight_cost_blocks: f64,
    /// A request with no private lead does not go to a backend with this
    /// many more requests in flight than the least loaded one (0: off). 6:
    /// at 24 users on 3 engines a gap of 4 or 5 is a passing fluctuation
    /// (a fifth of arrivals see one), and copying a system prompt to an
    /// engine on it costs more than the wait: pressure-unpublished 74.9%
    /// against 70.2% at 4 (TTFT p99 363 against 759 ms), hot-prompt alike
    /// (75.1% against 75.6%, p99 485 against 479 ms), medians of 3 side
    /// by side (decision 0018). Off, the mean-relative bound
    /// alone let two engines holding a hot prompt reach 20 in flight
    /// before a third got it (decision 0017).
    pub shared_gap: u32,
    /// Share of the fleet's KV capacity (published, configured or learned)
    /// in use from which the caches count as full: the bounds are then
    /// `full_cache_epsilon`, `full_cache_safety_factor` and
    /// `full_cache_shared_gap`, not the three above. 0.9. `inf`: never
    /// (used counts running prompts too, so it can pass 1).
    pub full_cache_pressure: f64,
    /// `epsilon` when the caches are full. 1.0: a backend runs at twice the
    /// mean before its prompt gets cheaper elsewhere. Caches that cannot
    /// hold the working set evict whatever a second copy of a prompt takes
    /// room from, so prompts kept whole on uneven engines win: 75.5, 75.1
    /// and 75.6% of hits on think-48 and both pressure scenarios against
    /// 71.1, 74.1 and 72.3% at the tight bounds, side by side, with a lower
    /// TTFT p99 on each (decision 0020).
    pub full_cache_epsilon: f64,
    /// `safety_factor` when the caches are full. 2.5.
    pub full_cache_safety_factor: f64,
    /// `shared_gap` when the caches are full. 14.
    pub full_cache_shared_gap: u32,
    /// The fleet counts as saturated when every eligible backend has at
    /// least this many ms of prefill queued at its rate (0: never). Then a
    /// request goes where it adds the least work (blocks it lacks, history
    /// expected lost, a move's stranded copy), at the full-cache bounds:
    /// spreading for a shorter queue recomputes prefixes that every queued
    /// request then waits for (decision 0053). 250.
    pub saturated_queue_ms: f64,
    /// Blocks a backend must hold for the request to count as warm there.
    pub min_match_blocks: u32,
    /// Leading blocks that key cold prompts (256 bytes: a system prompt's start).
    pub cold_key_blocks: usize,
    /// Blocks each backend's index share may track when neither the backend's
    /// `kv_blocks` nor its `vllm:cache_config_info` says (about 1M tokens).
    pub kv_blocks: usize,
    /// Read each engine's capacity from `vllm:cache_config_info` on `/metrics`.
    pub read_kv_capacity: bool,
    /// Correct the index from what answers report cached
    /// (`usage.prompt_tokens_details.cached_tokens`): forget a flushed
    /// engine's blocks, learn capacities nobody published. Off, the
    /// prediction error is still measured and exported.
    pub learn_from_answers: bool,
    /// Expect the share of conversations' histories an engine lost by their
    /// next turn (its answers say) to be lost again, on its queue and on
    /// the request's: later turns leave a busy engine that keeps evicting
    /// their history. Only past a prompt every eligible engine holds
    /// (`policy::select::SHARED_MIN_BLOCKS`), so that the lead it discounts
    /// is a history and never a prompt's only copy: on by default, as it
    /// cut the hot prompt's TTFT p99 from 436 to 238 ms
    /// (round-robin 422) and lost no hits under pressure (decision
    /// 0025). Needs `learn_from_answers`.
    pub expect_lost_history: bool,
    /// Longest a request waits, in ms, before it is sent to an engine that
    /// is still computing part of the prefix it was predicted to find
    /// there, for another request in flight (0: never waits). Sent at
    /// once, both would compute it (an engine caches a block once it has
    /// computed it); after that request's first token it is a hit. A burst
    /// of new conversations on one prompt is what waits (decision
    /// 0027).
    pub prefill_wait_ms: u64,
    /// How backends' caches are modelled: `auto` (a backend whose `/props`
    /// answers `total_slots`, llama.cpp's, is a slot engine, any other a
    /// block cache), `blocks` (vLLM-like: the prefix index) or `slots`
    /// (llama.cpp-like: one prompt per slot, `fleet::slots`).
    pub engine: EngineKind,
    /// Slot engines: cost of each block of a live conversation's prompt
    /// that a request would overwrite by taking its slot, in blocks of
    /// prefill. 1: that conversation recomputes it on its next turn.
    pub slot_evict_cost: f64,
    /// Slot engines: cost, in blocks of prefill, of taking a live
    /// conversation's slot at all, on top of its blocks: it will want its
    /// slot back next turn, and on an engine with more live conversations
    /// than slots they keep evicting each other. 64 (as
    /// `overload_cost_blocks`): a new conversation goes to an engine with a
    /// free slot even if another holds its system prompt.
    pub slot_live_evict_blocks: f64,
}

impl Default for PrefixConfig {
    fn default() -> Self {
        PrefixConfig {
            block_bytes: DEFAULT_BLOCK_BYTES,
            epsilon: 0.25,
            slack: 3,
            in_flight_cost_blocks: 2.0,
            overload_cost_blocks: 64.0,
            safety_factor: 1.5,
            pressure_slack: 0.1,
            move_cost: 0.5,
            sticky_min_blocks: 4,
            hold_private: true,
            shared_in_flight_cost_blocks: 2.0,
            shared_gap: 6,
            full_cache_pressure: 0.9,
            full_cache_epsilon: 1.0,
            full_cache_safety_factor: 2.5,
            full_cache_shared_gap: 14,
            saturated_queue_ms: 250.0,
            min_match_blocks: 1,
            cold_key_blocks: 4,
            kv_blocks: 65_536,
            read_kv_capacity: true,
            learn_from_answers: true,
            expect_lost_history: true,
            prefill_wait_ms: 1000,
            engine: EngineKind::Auto,
            slot_evict_cost: 1.0,
            slot_live_evict_blocks: 64.0,
        }
    }
}

impl PrefixConfig {
    /// Whether selection counts histories expected lost (it learns them
    /// from answers, so only when it learns from them).
    pub fn expects_lost_history(&self) -> bool {
        self.expect_lost_history && self.learn_from_answers
    }

    pub fn params(&self) -> PrefixParams {
        PrefixParams {
            epsilon: self.epsilon,
            slack: self.slack,
            in_flight_cost_blocks: self.in_flight_cost_blocks,
            min_match_blocks: self.min_match_blocks,
            overload_cost_blocks: self.overload_cost_blocks,
            safety_factor: self.safety_factor,
            pressure_slack: self.pressure_slack,
            move_cost: self.move_cost,
            sticky_min_blocks: self.sticky_min_blocks,
            hold_private: self.hold_private,
            shared_in_flight_cost_blocks: self.shared_in_flight_cost_blocks,
            shared_gap: self.shared_gap,
            full_cache_pressure: self.full_cache_pressure,
            full_cache_epsilon: self.full_cache_epsilon,
            full_cache_safety_factor: self.full_cache_safety_factor,
            full_cache_shared_gap: self.full_cache_shared_gap,
            saturated_queue_s: self.saturated_queue_ms / 1e3,
        }
    }
}

/// Limits on what clients may send and hold.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Request head bytes; more is 431.
    pub max_header_bytes: usize,
    /// Request body bytes; more is 413. 32 MiB holds a 100k-token prompt many times over.
    pub max_body_bytes: usize,
    /// Open client connections over all workers; past it new ones get 503 and are closed.
    pub max_client_connections: usize,
    /// Requests in flight per backend (0: no limit); past it a request waits
    /// up to `timeouts.queue_ms` for room, then gets 503 with Retry-After.
    pub max_in_flight_per_backend: u32,
    /// Idle pooled connections kept per backend per worker.
    pub max_idle_per_backend: usize,
    /// Request body bytes buffered over all connections (bodies are read
    /// whole before routing). Past it, a body that would grow gets 503 with
    /// Retry-After. 256 MiB holds eight maximal bodies, or thousands of
    /// usual prompts; the first 64 KiB of each connection are not counted.
    pub max_buffered_body_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_header_bytes: 16 * 1024,
            max_body_bytes: 32 * 1024 * 1024,
            max_client_connections: 20_000,
            max_in_flight_per_backend: 0,
            max_idle_per_backend: 128,
            max_buffered_body_bytes: 256 * 1024 * 1024,
        }
    }
}

/// Timeouts, in milliseconds.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Timeouts {
    /// A client must send a whole request head within this (slowloris guard).
    pub client_header_ms: u64,
    /// A client must send the whole body within this once the head is in.
    pub client_body_ms: u64,
    /// An idle client keep-alive connection is closed after this.
    pub client_idle_ms: u64,
    /// A client that accepts no response byte for this long is cut: its
    /// backend request is cancelled (the backend connection closed) and its
    /// in-flight slot given back. 10 s is far above any live reader's
    /// pause, and short next to a generation a stuck client would hold.
    pub client_write_ms: u64,
    /// Connecting to a backend.
    pub backend_connect_ms: u64,
    /// From request sent to the first response byte: covers queueing and
    /// prefill of a long prompt on a busy engine, hence generous.
    pub backend_first_byte_ms: u64,
    /// Longest silence between two reads of a streaming response.
    pub backend_idle_ms: u64,
    /// A pooled backend connection idle longer than this is not reused.
    pub backend_pool_idle_ms: u64,
    /// How long a request may wait for room on a backend at its in-flight limit.
    pub queue_ms: u64,
    /// On SIGTERM, how long in-flight requests get to finish.
    pub shutdown_grace_ms: u64,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            client_header_ms: 10_000,
            client_body_ms: 60_000,
            client_idle_ms: 120_000,
            client_write_ms: 10_000,
            backend_connect_ms: 2_000,
            backend_first_byte_ms: 300_000,
            backend_idle_ms: 300_000,
            backend_pool_idle_ms: 30_000,
            queue_ms: 1_000,
            shutdown_grace_ms: 30_000,
        }
    }
}

pub fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

/// Re-sends, only where a generation cannot be duplicated: the connection
/// failed, or broke before the request was written whole. A request written
/// whole is never sent again (a close without an answer is a 502).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Retry {
    /// Sends per request, the first included (at most 4 candidates); a
    /// fresh connection after a stale pooled one counts too.
    pub max_attempts: usize,
    /// Retries over all requests may be at most this percentage of first
    /// attempts (plus a reserve of 10), so retries cannot multiply the load
    /// on a failing fleet.
    pub budget_percent: u32,
}

impl Default for Retry {
    fn default() -> Self {
        Retry {
            max_attempts: 3,
            budget_percent: 20,
        }
    }
}

/// What the traffic port forwards. By default the inference API only:
/// `POST /v1/chat/completions`, `POST /v1/completions`, `POST /generate`
/// and `GET /v1/models`; any other path is a 404 that never reaches an
/// engine (engines serve management routes such as `/reset_prefix_cache`
/// and `/metrics` on the same port). Paths are matched after normalisation
/// (`http::request::normalise_path`).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Routes {
    /// More paths to forward, with any method, in normal form (e.g.
    /// `"/v1/embeddings"`, `"/tokenize"`).
    pub extra_allowed: Vec<String>,
    /// Stored responses (`/v1/responses`) whose engine the router keeps
    /// (`fleet::stored`): about 100 bytes each; the oldest go first.
    pub responses_max_ids: usize,
    /// How long the router keeps a stored response's engine, in seconds.
    pub responses_ttl_s: u64,
}

impl Default for Routes {
    fn default() -> Self {
        Routes {
            extra_allowed: Vec::new(),
            responses_max_ids: 262_144,
            responses_ttl_s: 86_400,
        }
    }
}

/// Active health checks, and passive ejection.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Health {
    /// Path probed with GET; any 2xx is healthy.
    pub path: String,
    /// From the start of one probe of a backend to the start of the next.
    pub interval_ms: u64,
    /// Deadline of one whole probe: connect, request and the whole answer.
    pub timeout_ms: u64,
    /// Successes in a row before an unhealthy backend gets traffic again.
    pub rise: u32,
    /// Failed probes in a row before a healthy backend is taken out.
    pub fall: u32,
    /// Failed requests in a row (connect errors, resets, 5xx) that eject a backend.
    pub passive_fall: u32,
}

impl Default for Health {
    fn default() -> Self {
        Health {
            path: "/health".into(),
            interval_ms: 1_000,
            timeout_ms: 1_000,
            rise: 2,
            fall: 2,
            passive_fall: 3,
        }
    }
}

/// The operators' listener: metrics and admin API.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Admin {
    /// Where `/metrics` and `/admin/*` are served; keep it off the traffic network.
    pub listen: Option<SocketAddr>,
    /// The SHA-256 (64 hex digits) of the admin token: with it set, every
    /// admin path but `/health` and `/ready` wants `Authorization: Bearer
    /// TOKEN` (401 otherwise). Needed when `listen` is not a loopback
    /// address, unless `allow_unauthenticated`.
    pub token_sha256: String,
    /// Serve the admin listener on a non-loopback address without a token
    /// (anyone who reaches it may reload, drain and read the fleet).
    pub allow_unauthenticated: bool,
}

impl Default for Admin {
    fn default() -> Self {
        Admin {
            listen: Some("127.0.0.1:9090".parse().expect("literal address")),
            token_sha256: String::new(),
            allow_unauthenticated: false,
        }
    }
}

impl Admin {
    /// The token's digest, when one is set (checked by `validate`).
    pub fn token_digest(&self) -> Option<[u8; 32]> {
        classes::hex32(&self.token_sha256)
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Log {
    /// `error`, `warn`, `info`, `debug`, `trace`, or a tracing filter; `RUST_LOG` wins.
    pub level: String,
    /// One JSON object per line instead of text.
    pub json: bool,
}

impl Default for Log {
    fn default() -> Self {
        Log {
            level: "info".into(),
            json: false,
        }
    }
}

impl Config {
    pub fn from_file(path: &Path) -> anyhow::Result<Config> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("parsing config {}", path.display()))
    }

    /// Checks what serde cannot; run before the config is used.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.backends.is_empty() && !self.discovery.any() {
            bail!(
                "no backends: pass --backend URL, set `backends` or a [discovery] source in the config file"
            );
        }
        self.discovery.validate()?;
        self.replicas.validate()?;
        self.epp.validate()?;
        if self.backends.len() > MAX_BACKENDS {
            bail!(
                "{} backends configured; at most {MAX_BACKENDS} are supported",
                self.backends.len()
            );
        }
        for b in &self.backends {
            backend_addr(b.url())?;
        }
        if self.prefix.block_bytes == 0 {
            bail!("prefix.block_bytes must be at least 1");
        }
        if !(0.0..=10.0).contains(&self.prefix.epsilon)
            || !(0.0..=10.0).contains(&self.prefix.full_cache_epsilon)
        {
            bail!("prefix.epsilon and prefix.full_cache_epsilon must be between 0 and 10");
        }
        if !(1.0..=100.0).contains(&self.prefix.safety_factor)
            || !(1.0..=100.0).contains(&self.prefix.full_cache_safety_factor)
        {
            bail!(
                "prefix.safety_factor and prefix.full_cache_safety_factor must be between 1 and 100"
            );
        }
        if self.prefix.full_cache_pressure.is_nan() || self.prefix.full_cache_pressure < 0.0 {
            bail!("prefix.full_cache_pressure must be at least 0 (inf: never)");
        }
        if !(self.prefix.overload_cost_blocks >= 0.0 && self.prefix.pressure_slack >= 0.0) {
            bail!("prefix.overload_cost_blocks and prefix.pressure_slack must be at least 0");
        }
        if !(self.prefix.move_cost >= 0.0 && self.precise.move_cost >= 0.0) {
            bail!("prefix.move_cost and precise.move_cost must be at least 0");
        }
        for p in &self.routes.extra_allowed {
            let mut norm = Vec::new();
            crate::http::request::normalise_path(p.as_bytes(), &mut norm);
            if !p.starts_with('/') || norm != p.as_bytes() || p.contains(['?', '%']) {
                bail!(
                    "routes.extra_allowed: {p:?} must be a path in normal form, like \"/v1/embeddings\""
                );
            }
        }
        if self.retry.max_attempts == 0 {
            bail!("retry.max_attempts must be at least 1");
        }
        if !self.admin.token_sha256.is_empty() && self.admin.token_digest().is_none() {
            bail!(
                "admin.token_sha256 is not 64 hex digits (the SHA-256 of the token: printf %s TOKEN | sha256sum)"
            );
        }
        if let Some(a) = self.admin.listen
            && !a.ip().is_loopback()
            && self.admin.token_sha256.is_empty()
            && !self.admin.allow_unauthenticated
        {
            bail!(
                "admin.listen {a} is not a loopback address and admin.token_sha256 is not set: anyone reaching it could reload, drain and read the fleet; set a token, or admin.allow_unauthenticated = true"
            );
        }
        if !self.tls.enabled() && (!self.tls.key.is_empty() || !self.tls.client_ca.is_empty()) {
            bail!("tls.key and tls.client_ca need tls.cert");
        }
        let urls: Vec<&str> = self.backends.iter().map(BackendConfig::url).collect();
        models::validate(&self.models, &self.pools, &urls)
    }

    /// Reads the files the configuration names (`[tls]`, `[backend_tls]`,
    /// `[auth]`) into `loaded`, and the keys file's tenants into
    /// `classes`. Any file that cannot be used is an error: at start the
    /// router does not start, on reload the running configuration stays.
    pub fn load_files(&mut self) -> anyhow::Result<()> {
        let mut loaded = Loaded::default();
        if self.tls.enabled() {
            loaded.server_tls = Some(tls::server_config(&self.tls)?);
        }
        let https = self
            .backends
            .iter()
            .any(|b| b.url().starts_with("https://"))
            || !self.backend_tls.ca.is_empty()
            || !self.backend_tls.cert.is_empty();
        if https {
            loaded.client_tls = Some(tls::client_config(&self.backend_tls)?);
        } else if self.discovery.any() {
            // Discovery may find https:// backends; a host without CA
            // certificates still serves the http:// ones.
            match tls::client_config(&self.backend_tls) {
                Ok(c) => loaded.client_tls = Some(c),
                Err(e) => {
                    tracing::warn!(error = %format!("{e:#}"), "no TLS for discovered https:// backends")
                }
            }
        }
        if !self.auth.keys_file.is_empty() {
            let (keys, entries) = keys::load(&self.auth.keys_file)?;
            self.classes = self.classes.with_keys(&entries)?;
            loaded.keys = Some(std::sync::Arc::new(keys));
        }
        let mut backend_keys = hashbrown::HashMap::new();
        for b in &self.backends {
            if let Some(path) = b.api_key_file() {
                backend_keys.insert(b.url().to_owned(), keys::backend_key_line(b.url(), path)?);
            }
        }
        loaded.backend_keys = std::sync::Arc::new(backend_keys);
        self.loaded = loaded;
        Ok(())
    }

    /// The files whose change reloads the configuration.
    pub fn watched_files(&self) -> Vec<String> {
        let mut files: Vec<String> = tls::files(&self.tls, &self.backend_tls)
            .map(str::to_owned)
            .collect();
        if !self.auth.keys_file.is_empty() {
            files.push(self.auth.keys_file.clone());
        }
        files.extend(
            self.backends
                .iter()
                .filter_map(|b| b.api_key_file().map(str::to_owned)),
        );
        files
    }

    /// The routing core's view of `[models]`, `[[pools]]` and the backends'
    /// `models` pins.
    pub fn model_spec(&self) -> crate::fleet::models::Spec {
        let pinned = self
            .backends
            .iter()
            .filter_map(|b| Some((b.url().to_owned(), b.models()?.to_vec())))
            .collect();
        models::spec(&self.models, &self.pools, pinned)
    }

    pub fn worker_count(&self) -> usize {
        match self.workers {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        }
    }
}

/// Resolves `http://host:port[/]` or `https://...` to a socket address.
pub fn backend_addr(url: &str) -> anyhow::Result<SocketAddr> {
    let u = HttpUrl::parse(url).with_context(|| format!("backend {url:?}"))?;
    if !u.path.is_empty() {
        bail!("backend URL {url:?} must not have a path");
    }
    u.host_port()
        .to_socket_addrs()
        .with_context(|| format!("resolving backend {url:?}"))?
        .next()
        .with_context(|| format!("backend {url:?} resolves to no address"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn example_config_parses_and_matches_defaults() {
        let text = include_str!("../prefix-router.example.toml");
        let cfg: Config = toml::from_str(text).unwrap();
        cfg.validate().unwrap();
        assert_eq!(cfg.policy, Policy::Prefix);
        assert_eq!(cfg.prefix.block_bytes, PrefixConfig::default().block_bytes);
        assert_eq!(
            cfg.limits.max_header_bytes,
            Limits::default().max_header_bytes
        );
        assert_eq!(cfg.backends[1].kv_blocks(), Some(8192));
        let (d, e) = (PrefixConfig::default(), &cfg.prefix);
        assert_eq!(
            (e.full_cache_pressure, e.full_cache_epsilon),
            (d.full_cache_pressure, d.full_cache_epsilon)
        );
        assert_eq!(
            (e.full_cache_safety_factor, e.full_cache_shared_gap),
            (d.full_cache_safety_factor, d.full_cache_shared_gap)
        );
    }

    #[test]
    fn out_of_range_full_cache_bounds_are_refused() {
        for bad in [
            "full_cache_pressure = -0.5",
            "full_cache_epsilon = 11.0",
            "full_cache_safety_factor = 0.5",
        ] {
            let text = format!("backends = [\"http://127.0.0.1:1\"]\n[prefix]\n{bad}\n");
            let cfg: Config = toml::from_str(&text).unwrap();
            let err = cfg.validate().unwrap_err().to_string();
            assert!(err.contains("full_cache"), "{bad}: {err}");
        }
    }

    #[test]
    fn unknown_keys_are_errors() {
        assert!(toml::from_str::<Config>("lisen = \"1.2.3.4:5\"").is_err());
    }

    #[test]
    fn backend_urls() {
        assert_eq!(backend_addr("http://127.0.0.1:8001").unwrap().port(), 8001);
        assert_eq!(backend_addr("http://127.0.0.1/").unwrap().port(), 80);
        assert_eq!(backend_addr("https://127.0.0.1").unwrap().port(), 443);
        assert!(backend_addr("ftp://127.0.0.1:1").is_err());
        assert!(backend_addr("http://127.0.0.1:1/v1").is_err());
    }
}
