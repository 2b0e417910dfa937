//! The router's metrics, registered once in one registry. The data path's
//! own events (routing decisions, re-sends, answers nobody sent) are
//! families keyed by enums, updated in place. Each backend's facts stay
//! with their owners (`fleet::backend`: load, health, stats; the feedback;
//! the index): a collector reads them at each scrape, so nothing is copied
//! on the data path and a backend that leaves the fleet leaves the page.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabelSet, EncodeLabelValue, EncodeMetric, LabelValueEncoder,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::config::Config;
use crate::error::Resend;
use crate::fleet::backend::{Backend, Fleet, StatusClass};
use crate::fleet::index::PrefixIndex;
use crate::fleet::models::{Models, TTFT_BUCKETS};
use crate::policy::select::{Choice, Decision};
use crate::precise::Precise;
use crate::precise::metrics::PreciseCollector;
use crate::prompt::extract::Class;
use crate::replica::Replica;
use crate::replica::status::PeerPhase;

/// Label values are the enums' own names.
macro_rules! label_value {
    ($($t:ty),*) => {$(
        impl EncodeLabelValue for $t {
            fn encode(&self, e: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
                std::fmt::Write::write_str(e, self.name())
            }
        }
    )*};
}

/// `Decision` as a label value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct DecisionName(Decision);

impl DecisionName {
    fn name(self) -> &'static str {
        match self.0 {
            Decision::Warm => "warm",
            Decision::Cold => "cold",
            Decision::Bounded => "bounded",
            Decision::Baseline => "baseline",
            Decision::Stored => "stored",
        }
    }
}

/// `Resend` as a label value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct ResendName(Resend);

impl ResendName {
    fn name(self) -> &'static str {
        self.0.name()
    }
}

/// `Class` as a label value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct ClassName(Class);

impl ClassName {
    fn name(self) -> &'static str {
        self.0.name()
    }
}

/// A class and a tenant: tenant names come from the config only (`-`
/// for callers no tenant names), so the label set stays bounded.
#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ClassLabels {
    class: ClassName,
    tenant: String,
}

impl ClassLabels {
    fn of(class: Class, tenant: &str) -> ClassLabels {
        ClassLabels {
            class: ClassName(class),
            tenant: tenant.to_owned(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct HandshakeLabels {
    result: String,
}

/// A key of the keys file (its name), and which count.
#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct KeyLabels {
    key: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct KeyTokenLabels {
    key: String,
    kind: String,
}

/// Per-key requests and tokens, read at each scrape from the counters the
/// keys carry (`config::keys::Keys`): nothing is locked on the data path.
#[derive(Debug)]
struct KeysCollector(Arc<ArcSwap<Config>>);

impl Collector for KeysCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let cfg = self.0.load();
        let Some(keys) = &cfg.loaded.keys else {
            return Ok(());
        };
        let counts = |i: usize| keys.counts(i as u32).expect("one per name");
        let mut family = encoder.encode_descriptor(
            "api_key_requests",
            "Requests let in with each API key of auth.keys_file, by key name.",
            None,
            MetricType::Counter,
        )?;
        for (i, name) in keys.names().iter().enumerate() {
            let v = counts(i)
                .requests
                .load(std::sync::atomic::Ordering::Relaxed);
            ConstCounter::new(v).encode(family.encode_family(&KeyLabels { key: name.clone() })?)?;
        }
        let mut family = encoder.encode_descriptor(
            "api_key_tokens",
            "Tokens the answers to each API key's requests reported (usage), by key name and kind (prompt, completion).",
            None,
            MetricType::Counter,
        )?;
        for (i, name) in keys.names().iter().enumerate() {
            let c = counts(i);
            for (kind, v) in [
                ("prompt", &c.prompt_tokens),
                ("completion", &c.completion_tokens),
            ] {
                let l = KeyTokenLabels {
                    key: name.clone(),
                    kind: kind.into(),
                };
                ConstCounter::new(v.load(std::sync::atomic::Ordering::Relaxed))
                    .encode(family.encode_family(&l)?)?;
            }
        }
        Ok(())
    }
}

/// Buckets, in seconds, of the time a request waits in its class's queue
/// (a `flex` request may wait `classes.flex_wait_ms`, 30 s by default).
const CLASS_WAIT_BUCKETS: [f64; 12] = [
    1e-3, 1e-2, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

fn class_wait_histogram() -> Histogram {
    Histogram::new(CLASS_WAIT_BUCKETS)
}

/// Counts a request waiting in its class's queue while it waits (however
/// it stops: room, its deadline, or its client gone).
pub struct ClassWaiting(Gauge);

impl Drop for ClassWaiting {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// `StatusClass` as a label value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct StatusName(StatusClass);

impl StatusName {
    fn name(self) -> &'static str {
        self.0.name()
    }
}

label_value!(DecisionName, ResendName, StatusName, ClassName);

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DecisionLabels {
    decision: DecisionName,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ResendLabels {
    reason: ResendName,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct BackendLabels {
    backend: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ResponseLabels {
    backend: String,
    status: StatusName,
    policy: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct KindLabels {
    backend: String,
    kind: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ResultLabels {
    backend: String,
    result: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ModelLabels {
    model: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct CounterLabels {
    backend: String,
    counter: &'static str,
}

/// One family member per routing decision, looked up once: the data path
/// bumps an atomic, with no lock or hash per request.
struct DecisionCounters {
    warm: Counter,
    cold: Counter,
    bounded: Counter,
    baseline: Counter,
    stored: Counter,
}

impl DecisionCounters {
    fn of(&self, d: Decision) -> &Counter {
        match d {
            Decision::Warm => &self.warm,
            Decision::Cold => &self.cold,
            Decision::Bounded => &self.bounded,
            Decision::Baseline => &self.baseline,
            Decision::Stored => &self.stored,
        }
    }
}

/// Buckets, in seconds, of the times a request waits before it is sent.
const WAIT_BUCKETS: [f64; 11] = [1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0, 5.0];

pub struct Metrics {
    registry: Registry,
    decisions: DecisionCounters,
    /// Requests the prefix policy routed at the full-cache bounds.
    full_cache_routes: Counter,
    saturated_routes: Counter,
    resends: Family<ResendLabels, Counter>,
    /// Requests answered 429 after waiting their class's deadline.
    shed: Family<ClassLabels, Counter>,
    /// Requests answered at once because their tenant's queue was full.
    class_refused: Family<ClassLabels, Counter>,
    /// Requests whose client left while they waited.
    class_left: Family<ClassLabels, Counter>,
    /// Requests waiting in the router now, and how long each waited.
    class_waiting: Family<ClassLabels, Gauge>,
    class_wait_seconds: Family<ClassLabels, Histogram, fn() -> Histogram>,
    matched_blocks: Histogram,
    routing_seconds: Histogram,
    queue_seconds: Histogram,
    /// Requests held for another request's prefill of their prefix.
    prefill_wait_seconds: Histogram,
    /// Requests a backend closed on after reading them whole (502, not re-sent).
    unanswered: Counter,
    /// Admin connections refused because `MAX_CONNECTIONS` were open.
    admin_refused: Counter,
    buffered_body_bytes: Gauge,
    /// Requests answered 401: no valid API key (`auth.keys_file`).
    unauthorized: Counter,
    /// TLS handshakes on the traffic listener that succeeded, and failed.
    tls_ok: Counter,
    tls_failed: Counter,
    /// Each discovery source's state (`control::discovery` writes it).
    pub discovery: Arc<DiscoveryStatus>,
}

/// Where the per-backend collector reads: the shared state's own handles.
pub struct Sources {
    pub config: Arc<ArcSwap<Config>>,
    pub fleet: Arc<ArcSwap<Fleet>>,
    pub index: Arc<PrefixIndex>,
    /// Precise mode, when on: its streams and tokenizer.
    pub precise: Option<Arc<Precise>>,
    /// Per-model counters (`fleet::models`), labelled by model name.
    pub models: Arc<Models>,
    /// Replicas, when on: this replica's stream and its peers'.
    pub replica: Option<Arc<Replica>>,
}

impl Metrics {
    /// Registers every family once; the per-backend ones read `sources`.
    pub fn new(sources: Sources) -> Metrics {
        let mut registry = Registry::with_prefix("prefix_router");
        let decisions: Family<DecisionLabels, Counter> = Family::default();
        registry.register(
            "routing_decisions",
            "Routing decisions by kind",
            decisions.clone(),
        );
        let full_cache_routes = Counter::default();
        registry.register(
            "full_cache_routes",
            "Requests the prefix policy routed at the full-cache bounds (the fleet's caches held prefix.full_cache_pressure of their capacity)",
            full_cache_routes.clone(),
        );
        let saturated_routes = Counter::default();
        registry.register(
            "saturated_routes",
            "Requests the prefix policy routed with the fleet saturated (every backend had prefix.saturated_queue_ms of prefill queued): by the work they add",
            saturated_routes.clone(),
        );
        let resends = Family::default();
        registry.register(
            "resends",
            "Requests sent again because no backend can have processed them, by reason",
            resends.clone(),
        );
        let shed = Family::default();
        registry.register(
            "class_shed",
            "Requests answered 429 after waiting their class's deadline for room (classes.flex_wait_ms), by class and tenant",
            shed.clone(),
        );
        let class_refused = Family::default();
        registry.register(
            "class_refused",
            "Requests answered at once (flex 429, others 503, with Retry-After) because classes.max_waiting of their tenant's requests of their class waited already, by class and tenant",
            class_refused.clone(),
        );
        let class_left = Family::default();
        registry.register(
            "class_left",
            "Requests whose client closed its connection while they waited in the router for room, by class and tenant",
            class_left.clone(),
        );
        let class_waiting = Family::default();
        registry.register(
            "class_waiting",
            "Requests waiting in the router for room now, by class and tenant",
            class_waiting.clone(),
        );
        let class_wait_seconds =
            Family::new_with_constructor(class_wait_histogram as fn() -> Histogram);
        registry.register(
            "class_wait_seconds",
            "Time a request waited in the router for room and its turn, by class and tenant, waiting requests only (let in, shed, or left)",
            class_wait_seconds.clone(),
        );
        // Every class shows from the start, at zero, for callers of no tenant.
        for c in Class::ALL {
            let l = ClassLabels::of(c, crate::config::classes::NO_TENANT);
            drop(shed.get_or_create(&l));
            drop(class_waiting.get_or_create(&l));
        }
        // Every reason and decision shows from the start, at zero.
        for r in Resend::ALL {
            drop(resends.get_or_create(&ResendLabels {
                reason: ResendName(r),
            }));
        }
        let member = |d: Decision| {
            decisions
                .get_or_create(&DecisionLabels {
                    decision: DecisionName(d),
                })
                .clone()
        };
        let decisions = DecisionCounters {
            warm: member(Decision::Warm),
            cold: member(Decision::Cold),
            bounded: member(Decision::Bounded),
            baseline: member(Decision::Baseline),
            stored: member(Decision::Stored),
        };
        let matched_blocks =
            Histogram::new([0.0, 1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0]);
        registry.register(
            "matched_blocks",
            "Prompt blocks the chosen backend already held",
            matched_blocks.clone(),
        );
        let routing_seconds =
            Histogram::new([5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3]);
        registry.register(
            "routing_seconds",
            "Router time from the whole request read to the routing decision (extraction, hashing, index, selection), without the time queued for a backend with room",
            routing_seconds.clone(),
        );
        let queue_seconds = Histogram::new(WAIT_BUCKETS);
        registry.register(
            "queue_seconds",
            "Time a request waited for a backend with room (every one at limits.max_in_flight_per_backend), queued requests only",
            queue_seconds.clone(),
        );
        let prefill_wait_seconds = Histogram::new(WAIT_BUCKETS);
        registry.register(
            "prefill_wait_seconds",
            "Time a request waited for its engine to finish computing, for another request in flight, the prefix it was sent there for (prefix.prefill_wait_ms), waiting requests only",
            prefill_wait_seconds.clone(),
        );
        let unanswered = Counter::default();
        registry.register(
            "unanswered",
            "Requests a backend read whole and closed on without answering: a 502, never sent again",
            unanswered.clone(),
        );
        let admin_refused = Counter::default();
        registry.register(
            "admin_connections_refused",
            "Admin connections answered 503 because the admin listener's connection cap was reached",
            admin_refused.clone(),
        );
        let buffered_body_bytes = Gauge::default();
        registry.register(
            "buffered_body_bytes",
            "Request body bytes buffered now, against limits.max_buffered_body_bytes",
            buffered_body_bytes.clone(),
        );
        let unauthorized = Counter::default();
        registry.register(
            "unauthorized",
            "Requests answered 401 on their head: no valid API key (auth.keys_file)",
            unauthorized.clone(),
        );
        let handshakes: Family<HandshakeLabels, Counter> = Family::default();
        registry.register(
            "tls_handshakes",
            "TLS handshakes on the traffic listener, by result (failed: garbage, a truncated or refused hello, a client certificate tls.client_ca refuses, a timeout)",
            handshakes.clone(),
        );
        let handshake = |result: &'static str| {
            handshakes
                .get_or_create(&HandshakeLabels {
                    result: result.into(),
                })
                .clone()
        };
        let (tls_ok, tls_failed) = (handshake("ok"), handshake("failed"));
        registry.register_collector(Box::new(KeysCollector(sources.config.clone())));
        if let Some(precise) = sources.precise.clone() {
            registry.register_collector(Box::new(PreciseCollector {
                precise,
                fleet: sources.fleet.clone(),
            }));
        }
        if let Some(replica) = sources.replica.clone() {
            registry.register_collector(Box::new(ReplicaCollector(replica)));
        }
        registry.register_collector(Box::new(FleetCollector(sources)));
        let discovery = Arc::new(DiscoveryStatus::default());
        registry.register_collector(Box::new(DiscoveryCollector(discovery.clone())));
        Metrics {
            discovery,
            registry,
            decisions,
            full_cache_routes,
            saturated_routes,
            resends,
            shed,
            class_refused,
            class_left,
            class_waiting,
            class_wait_seconds,
            matched_blocks,
            routing_seconds,
            queue_seconds,
            prefill_wait_seconds,
            unanswered,
            admin_refused,
            buffered_body_bytes,
            unauthorized,
            tls_ok,
            tls_failed,
        }
    }

    /// A request was answered 401 (no valid API key).
    pub fn unauthorized(&self) {
        self.unauthorized.inc();
    }

    /// A TLS handshake on the traffic listener ended.
    pub fn tls_handshake(&self, ok: bool) {
        if ok {
            self.tls_ok.inc();
        } else {
            self.tls_failed.inc();
        }
    }

    /// Called once per routed request: what was decided and how long the
    /// router took from the request being read to the decision.
    pub fn observe_routing(&self, choice: &Choice, took: Duration) {
        self.decisions.of(choice.decision).inc();
        if choice.full_cache {
            self.full_cache_routes.inc();
        }
        if choice.saturated {
            self.saturated_routes.inc();
        }
        let matched_blocks = choice.matched_blocks;
        self.matched_blocks.observe(f64::from(matched_blocks));
        self.routing_seconds.observe(took.as_secs_f64());
    }

    /// A request waited this long for a backend with room.
    pub fn observe_queue(&self, waited: Duration) {
        self.queue_seconds.observe(waited.as_secs_f64());
    }

    /// A request waited `waited` for another's prefill of its prefix.
    pub fn observe_prefill_wait(&self, waited: Duration) {
        self.prefill_wait_seconds.observe(waited.as_secs_f64());
    }

    /// The admin listener refused a connection (too many open).
    pub fn admin_refused(&self) {
        self.admin_refused.inc();
    }

    /// A request of `class` and `tenant` waited its deadline and was
    /// answered 429.
    pub fn shed(&self, class: Class, tenant: &str) {
        self.shed
            .get_or_create(&ClassLabels::of(class, tenant))
            .inc();
    }

    /// A request was refused at once: its tenant's queue of its class was full.
    pub fn class_refused(&self, class: Class, tenant: &str) {
        self.class_refused
            .get_or_create(&ClassLabels::of(class, tenant))
            .inc();
    }

    /// A request starts to wait in the router; counted until the guard drops.
    pub fn class_waiting(&self, class: Class, tenant: &str) -> ClassWaiting {
        let g = self
            .class_waiting
            .get_or_create(&ClassLabels::of(class, tenant))
            .clone();
        g.inc();
        ClassWaiting(g)
    }

    /// A request stopped waiting after `waited` (let in or shed).
    pub fn class_waited(&self, class: Class, tenant: &str, waited: Duration) {
        self.class_wait_seconds
            .get_or_create(&ClassLabels::of(class, tenant))
            .observe(waited.as_secs_f64());
    }

    /// A request's client left while it waited `waited`.
    pub fn class_left(&self, class: Class, tenant: &str, waited: Duration) {
        self.class_left
            .get_or_create(&ClassLabels::of(class, tenant))
            .inc();
        self.class_waited(class, tenant, waited);
    }

    pub fn resent(&self, reason: Resend) {
        self.resends
            .get_or_create(&ResendLabels {
                reason: ResendName(reason),
            })
            .inc();
    }

    pub fn unanswered(&self) {
        self.unanswered.inc();
    }

    /// Prometheus text exposition of everything the router knows.
    /// `buffered_body_bytes`: what the proxy buffers now (`budget::in_use`).
    pub fn render(&self, buffered_body_bytes: usize) -> String {
        self.buffered_body_bytes
            .set(i64::try_from(buffered_body_bytes).unwrap_or(i64::MAX));
        let mut out = String::new();
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// Reads each backend's facts from their owners at scrape time.
struct FleetCollector(Sources);

impl std::fmt::Debug for FleetCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FleetCollector")
    }
}

/// One per-backend family: a name, its help, its type, and how to write
/// each backend's samples.
type PerBackend = (
    &'static str,
    &'static str,
    MetricType,
    fn(
        &Backend,
        &PrefixIndex,
        &str,
        &mut dyn FnMut(Sample) -> std::fmt::Result,
    ) -> std::fmt::Result,
);

/// One sample of a per-backend family.
enum Sample {
    Gauge(BackendLabels, i64),
    Rate(BackendLabels, f64),
    Counter(BackendLabels, u64),
    Response(ResponseLabels, u64),
    Kind(KindLabels, u64),
    Result(ResultLabels, u64),
    Xdp(CounterLabels, u64),
}

const PER_BACKEND: &[PerBackend] = &[
    (
        "responses",
        "Responses relayed, by backend, status class and policy",
        MetricType::Counter,
        |b, _, policy, out| {
            for class in StatusClass::ALL {
                let v = b.stats.responses(class);
                if v > 0 {
                    let l = ResponseLabels {
                        backend: b.url.clone(),
                        status: StatusName(class),
                        policy: policy.to_owned(),
                    };
                    out(Sample::Response(l, v))?;
                }
            }
            Ok(())
        },
    ),
    (
        "xdp",
        "XDP counters per backend: connections opened (SYN-ACK), closed (FIN), reset (RST), packets and bytes it sent",
        MetricType::Counter,
        |b, _, _, out| {
            let x = b.stats.xdp();
            for (counter, v) in [
                ("opened", x.opened),
                ("closed", x.closed),
                ("reset", x.reset),
                ("packets", x.packets),
                ("bytes", x.bytes),
            ] {
                let l = CounterLabels {
                    backend: b.url.clone(),
                    counter,
                };
                out(Sample::Xdp(l, v))?;
            }
            Ok(())
        },
    ),
    (
        "health_probes",
        "Active health probes per backend, passed or failed (refused, timed out at health.timeout_ms, not 2xx, or badly framed)",
        MetricType::Counter,
        |b, _, _, out| {
            let (passed, failed) = b.stats.probes();
            for (result, v) in [("passed", passed), ("failed", failed)] {
                let l = ResultLabels {
                    backend: b.url.clone(),
                    result,
                };
                out(Sample::Result(l, v))?;
            }
            Ok(())
        },
    ),
    (
        "backend_in_flight",
        "Requests in flight per backend",
        MetricType::Gauge,
        |b, _, _, out| out(Sample::Gauge(label(b), i64::from(b.load.in_flight()))),
    ),
    (
        "backend_healthy",
        "1 when the backend passes health checks",
        MetricType::Gauge,
        |b, _, _, out| out(Sample::Gauge(label(b), i64::from(b.health.is_healthy()))),
    ),
    (
        "backend_draining",
        "1 when the backend is drained by an operator",
        MetricType::Gauge,
        |b, _, _, out| out(Sample::Gauge(label(b), i64::from(b.health.is_draining()))),
    ),
    (
        "backend_open_connections",
        "This router's connections to the backend",
        MetricType::Gauge,
        |b, _, _, out| out(Sample::Gauge(label(b), i64::from(b.load.open_conns()))),
    ),
    (
        "backend_external_connections",
        "Connections to the backend seen by XDP beyond this router's",
        MetricType::Gauge,
        |b, _, _, out| out(Sample::Gauge(label(b), i64::from(b.load.external_conns()))),
    ),
    (
        "index_blocks",
        "Prefix blocks tracked per backend",
        MetricType::Gauge,
        |b, index, _, out| out(Sample::Gauge(label(b), count(index.len(b.slot)))),
    ),
    (
        "index_capacity_blocks",
        "Blocks the index remembers per backend: its configured kv_blocks, else prefix.kv_blocks, or its published KV capacity when larger",
        MetricType::Gauge,
        |b, index, _, out| out(Sample::Gauge(label(b), count(index.capacity(b.slot)))),
    ),
    (
        "learned_capacity_blocks",
        "KV capacity per backend in the router's blocks, learned from the cached tokens its answers report (starts at the published or configured capacity)",
        MetricType::Gauge,
        |b, _, _, out| out(Sample::Gauge(label(b), count(b.feedback.capacity()))),
    ),
    (
        "prefill_rate_blocks_per_second",
        "Prefill rate per backend learned from observed times to first token",
        MetricType::Gauge,
        |b, _, _, out| out(Sample::Rate(label(b), b.feedback.prefill_rate())),
    ),
    (
        "private_lead_kept_ratio",
        "Share of a conversation's history (blocks only this backend was predicted to hold) its answers said it still held, a moving average; selection expects the rest lost again",
        MetricType::Gauge,
        |b, _, _, out| out(Sample::Rate(label(b), b.feedback.private_kept())),
    ),
    (
        "predicted_cached_blocks",
        "Prompt blocks the index predicted the backend held, over answers that reported cached tokens",
        MetricType::Counter,
        |b, _, _, out| out(Sample::Counter(label(b), b.feedback.predicted_blocks())),
    ),
    (
        "reported_cached_blocks",
        "Prompt blocks the backend reported cached (usage.prompt_tokens_details.cached_tokens, in the router's blocks)",
        MetricType::Counter,
        |b, _, _, out| out(Sample::Counter(label(b), b.feedback.reported_blocks())),
    ),
    (
        "prediction_error_blocks",
        "Sum of |predicted - reported| cached blocks per backend",
        MetricType::Counter,
        |b, _, _, out| out(Sample::Counter(label(b), b.feedback.error_blocks())),
    ),
    (
        "prediction_reports",
        "Answers whose reported cached tokens were compared with the prediction",
        MetricType::Counter,
        |b, _, _, out| out(Sample::Counter(label(b), b.feedback.reports())),
    ),
    (
        "usage_invalid",
        "Answers whose usage was not believed (a count that is not a non-negative integer, or cached_tokens above prompt_tokens): ignored, nothing learned from them",
        MetricType::Counter,
        |b, _, _, out| out(Sample::Counter(label(b), b.feedback.invalid_reports())),
    ),
    (
        "mispredictions",
        "Answers that held fewer (over) or more (under) blocks than predicted, and detected cache flushes",
        MetricType::Counter,
        |b, _, _, out| {
            let f = &b.feedback;
            for (kind, v) in [
                ("over", f.over_predictions()),
                ("under", f.under_predictions()),
                ("flush", f.flushes()),
            ] {
                let l = KindLabels {
                    backend: b.url.clone(),
                    kind,
                };
                out(Sample::Kind(l, v))?;
            }
            Ok(())
        },
    ),
];

fn label(b: &Backend) -> BackendLabels {
    BackendLabels {
        backend: b.url.clone(),
    }
}

fn count(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl Collector for FleetCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Sources {
            config,
            fleet,
            index,
            precise: _,
            replica: _,
            models,
        } = &self.0;
        let policy = config.load().policy.name();
        let fleet = fleet.load();
        for (name, help, kind, samples) in PER_BACKEND {
            // The registry ends registered help with a period; so do these.
            let help = format!("{help}.");
            let mut family = encoder.encode_descriptor(name, &help, None, *kind)?;
            for b in &fleet.backends {
                samples(b, index, policy, &mut |s| match s {
                    Sample::Gauge(l, v) => ConstGauge::new(v).encode(family.encode_family(&l)?),
                    Sample::Rate(l, v) => ConstGauge::new(v).encode(family.encode_family(&l)?),
                    Sample::Counter(l, v) => ConstCounter::new(v).encode(family.encode_family(&l)?),
                    Sample::Response(l, v) => {
                        ConstCounter::new(v).encode(family.encode_family(&l)?)
                    }
                    Sample::Kind(l, v) => ConstCounter::new(v).encode(family.encode_family(&l)?),
                    Sample::Result(l, v) => ConstCounter::new(v).encode(family.encode_family(&l)?),
                    Sample::Xdp(l, v) => ConstCounter::new(v).encode(family.encode_family(&l)?),
                })?;
            }
        }
        encode_models(models, &mut encoder)?;
        for (name, help, kind, v) in [
            (
                "index_evictions",
                "Blocks the index forgot to stay within capacity",
                MetricType::Counter,
                index.evictions(),
            ),
            (
                "index_tracked_blocks",
                "Blocks tracked over all backends",
                MetricType::Gauge,
                index.total_tracked() as u64,
            ),
        ] {
            let help = format!("{help}.");
            let m = encoder.encode_descriptor(name, &help, None, kind)?;
            match kind {
                MetricType::Counter => ConstCounter::new(v).encode(m)?,
                _ => ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX)).encode(m)?,
            }
        }
        Ok(())
    }
}

/// The per-model families: requests, prompt and cached tokens of the
/// answers that reported usage (their ratio is the model's hit rate), and
/// the time to first token of streamed answers. One label per model a
/// backend serves or the config names, at most `MAX_MODEL_LABELS`; the
/// rest under `(other)`.
fn encode_models(models: &Models, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
    let stats = models.stats();
    let label = |name: &str| ModelLabels {
        model: name.to_owned(),
    };
    type Read = fn(&crate::fleet::models::ModelStats) -> u64;
    let counters: [(&str, &str, Read); 3] = [
        (
            "model_requests",
            "Requests routed, by the model they name ((other): no model, or a model no backend lists)",
            |s| s.requests(),
        ),
        (
            "model_prompt_tokens",
            "Prompt tokens of the answers that reported usage, by model",
            |s| s.tokens().0,
        ),
        (
            "model_cached_tokens",
            "Of those, tokens the engine had cached (cached / prompt is the model's hit rate)",
            |s| s.tokens().1,
        ),
    ];
    for (name, help, read) in counters {
        let help = format!("{help}.");
        let mut family = encoder.encode_descriptor(name, &help, None, MetricType::Counter)?;
        for (model, s) in &stats {
            ConstCounter::new(read(s)).encode(family.encode_family(&label(model))?)?;
        }
    }
    let mut family = encoder.encode_descriptor(
        "model_ttft_seconds",
        "Time from sending a streamed request to its first token, by model.",
        None,
        MetricType::Histogram,
    )?;
    for (model, s) in &stats {
        let (counts, count, sum) = s.ttft_histogram();
        let mut buckets: Vec<(f64, u64)> = TTFT_BUCKETS.iter().copied().zip(counts).collect();
        buckets.push((f64::INFINITY, count - counts.iter().sum::<u64>().min(count)));
        family
            .encode_family(&label(model))?
            .encode_histogram::<ModelLabels>(sum, count, &buckets, None)?;
    }
    Ok(())
}

/// What one discovery source last did.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct SourceState {
    /// Backends in its last good answer (what the fleet holds from it).
    pub backends: usize,
    /// When its last resolution or read succeeded, in seconds since 1970.
    pub last_success_unix: Option<f64>,
    /// Its last error (kept after a later success, with its time).
    pub last_error: Option<String>,
    pub last_error_unix: Option<f64>,
    /// Whether its last attempt failed.
    pub failing: bool,
    /// Failed attempts since start.
    pub errors: u64,
    /// Empty answers in a row not yet taken as removal (`discovery.empty_after`).
    pub empty_in_row: u32,
    /// Backends it lists that the fleet left out (past `fleet::MAX_BACKENDS`).
    pub left_out: usize,
    /// The first few of them, in the source's order.
    pub left_out_first: Vec<String>,
    /// Backends it no longer lists that serve until its new ones passed a
    /// probe (`control::membership`'s handover).
    pub handing_over: usize,
}

/// The discovery sources' states by source key, written by
/// `control::discovery`, read at each scrape and by `/admin/backends`.
#[derive(Debug, Default)]
pub struct DiscoveryStatus(std::sync::Mutex<std::collections::BTreeMap<String, SourceState>>);

impl DiscoveryStatus {
    /// Changes the state of `source` (a new one starts at the default).
    pub fn update(&self, source: &str, f: impl FnOnce(&mut SourceState)) {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        f(m.entry(source.to_owned()).or_default());
    }

    /// Whether `source` has a state yet (it answered, or the fleet left
    /// some of its backends out).
    pub fn has(&self, source: &str) -> bool {
        let m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.contains_key(source)
    }

    /// Drops the sources not in `keep` (a reload removed them).
    pub fn retain(&self, keep: &[String]) {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.retain(|k, _| keep.contains(k));
    }

    pub fn snapshot(&self) -> Vec<(String, SourceState)> {
        let m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct SourceLabels {
    source: String,
}

/// Reads the discovery sources' states at scrape time.
#[derive(Debug)]
struct DiscoveryCollector(Arc<DiscoveryStatus>);

impl Collector for DiscoveryCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let states = self.0.snapshot();
        type Value = fn(&SourceState) -> Option<f64>;
        let families: [(&str, &str, MetricType, Value); 7] = [
            (
                "discovery_backends",
                "Backends each discovery source gives the fleet (its last good answer)",
                MetricType::Gauge,
                |s| Some(s.backends as f64),
            ),
            (
                "discovery_up",
                "1 when the discovery source's last resolution or read succeeded",
                MetricType::Gauge,
                |s| Some(if s.failing { 0.0 } else { 1.0 }),
            ),
            (
                "discovery_last_success_timestamp_seconds",
                "When the discovery source last succeeded, in seconds since 1970",
                MetricType::Gauge,
                |s| s.last_success_unix,
            ),
            (
                "discovery_last_error_timestamp_seconds",
                "When the discovery source last failed, in seconds since 1970",
                MetricType::Gauge,
                |s| s.last_error_unix,
            ),
            (
                "discovery_errors",
                "Failed resolutions or reads per discovery source (DNS error or timeout, unreadable file)",
                MetricType::Counter,
                |s| Some(s.errors as f64),
            ),
            (
                "discovery_left_out_backends",
                "Backends a discovery source lists that the fleet left out (past its limit of 1024)",
                MetricType::Gauge,
                |s| Some(s.left_out as f64),
            ),
            (
                "discovery_handover_backends",
                "Backends a discovery source no longer lists that serve until its new ones passed a probe",
                MetricType::Gauge,
                |s| Some(s.handing_over as f64),
            ),
        ];
        for (name, help, kind, value) in families {
            let help = format!("{help}.");
            let mut family = encoder.encode_descriptor(name, &help, None, kind)?;
            for (source, s) in &states {
                let Some(v) = value(s) else { continue };
                let l = SourceLabels {
                    source: source.clone(),
                };
                match kind {
                    MetricType::Counter => {
                        ConstCounter::new(v as u64).encode(family.encode_family(&l)?)?
                    }
                    _ => ConstGauge::new(v).encode(family.encode_family(&l)?)?,
                }
            }
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct PeerLabels {
    peer: String,
}

/// Reads the replica's stream and its peers' at scrape time.
#[derive(Debug)]
struct ReplicaCollector(Arc<Replica>);

impl Collector for ReplicaCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use std::sync::atomic::Ordering::Relaxed;
        let r = &self.0;
        let s = &r.status;
        let own: [(&str, &str, MetricType, f64); 5] = [
            (
                "replica_warm",
                "1 once the replica caught up from a peer's snapshot (or none answered in time)",
                MetricType::Gauge,
                if s.is_warm() { 1.0 } else { 0.0 },
            ),
            (
                "replica_published_messages",
                "Messages this replica published to its peers",
                MetricType::Counter,
                s.published_messages.load(Relaxed) as f64,
            ),
            (
                "replica_published_bytes",
                "Bytes this replica published to its peers (each subscriber receives them all)",
                MetricType::Counter,
                s.published_bytes.load(Relaxed) as f64,
            ),
            (
                "replica_outbox_dropped",
                "Messages dropped because the outbox to the publisher was full",
                MetricType::Counter,
                r.outbox.dropped() as f64,
            ),
            (
                "replica_snapshot_blocks",
                "Index blocks restored from a peer's snapshot at start",
                MetricType::Gauge,
                s.snapshot_blocks.load(Relaxed) as f64,
            ),
        ];
        for (name, help, kind, v) in own {
            let help = format!("{help}.");
            let family = encoder.encode_descriptor(name, &help, None, kind)?;
            match kind {
                MetricType::Counter => ConstCounter::new(v as u64).encode(family)?,
                _ => ConstGauge::new(v).encode(family)?,
            }
        }
        let peers = s.peers();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        type Value = fn(&crate::replica::status::PeerState, f64) -> Option<f64>;
        let families: [(&str, &str, MetricType, Value); 8] = [
            (
                "replica_peer_up",
                "1 while the peer's stream is live (0 connecting or stalled; the replica's own address is not listed)",
                MetricType::Gauge,
                |p, _| Some(if p.phase == PeerPhase::Live { 1.0 } else { 0.0 }),
            ),
            (
                "replica_peer_lag_seconds",
                "Seconds since the peer's last message (it sends one at least every 100 ms)",
                MetricType::Gauge,
                |p, now| p.last_message_unix.map(|t| (now - t).max(0.0)),
            ),
            (
                "replica_peer_messages",
                "Messages applied from the peer",
                MetricType::Counter,
                |p, _| Some(p.messages as f64),
            ),
            (
                "replica_peer_bytes",
                "Bytes received from the peer",
                MetricType::Counter,
                |p, _| Some(p.bytes as f64),
            ),
            (
                "replica_peer_gaps",
                "Messages of the peer's stream missed (sequence numbers skipped)",
                MetricType::Counter,
                |p, _| Some(p.gaps as f64),
            ),
            (
                "replica_peer_restarts",
                "Times the peer came back under a new id",
                MetricType::Counter,
                |p, _| Some(p.restarts as f64),
            ),
            (
                "replica_peer_unauthenticated",
                "Frames from the peer's address not signed with the shared key, dropped",
                MetricType::Counter,
                |p, _| Some(p.unauthenticated as f64),
            ),
            (
                "replica_peer_malformed",
                "Signed frames from the peer that did not parse, dropped",
                MetricType::Counter,
                |p, _| Some(p.malformed as f64),
            ),
        ];
        for (name, help, kind, value) in families {
            let help = format!("{help}.");
            let mut family = encoder.encode_descriptor(name, &help, None, kind)?;
            for (peer, p) in &peers {
                if p.phase == PeerPhase::Myself {
                    continue;
                }
                let Some(v) = value(p, now) else { continue };
                let l = PeerLabels { peer: peer.clone() };
                match kind {
                    MetricType::Counter => {
                        ConstCounter::new(v as u64).encode(family.encode_family(&l)?)?
                    }
                    _ => ConstGauge::new(v).encode(family.encode_family(&l)?)?,
                }
            }
        }
        Ok(())
    }
}
