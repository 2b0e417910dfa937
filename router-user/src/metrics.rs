//! Counters the data path bumps (plain atomics and lock-light histograms) and
//! their Prometheus rendering for the admin listener.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::error::Resend;
use crate::route::MAX_BACKENDS;
use crate::route::backend::Fleet;
use crate::route::index::PrefixIndex;
use crate::route::select::Decision;

/// Status classes counted per backend: 2xx, 3xx, 4xx, 5xx, other.
const CLASSES: [&str; 5] = ["2xx", "3xx", "4xx", "5xx", "other"];

pub struct Metrics {
    responses: Box<[[AtomicU64; 5]]>,
    decisions: [AtomicU64; 4],
    matched_blocks: Histogram,
    routing_seconds: Histogram,
    /// Requests sent again, by `Resend` reason.
    resends: [AtomicU64; 3],
    /// Requests a backend closed on after reading them whole (502, not re-sent).
    unanswered: AtomicU64,
    /// Health probes per backend slot: passed, failed.
    probes: Box<[[AtomicU64; 2]]>,
    /// Admin connections refused because `MAX_CONNECTIONS` were open.
    admin_refused: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            responses: (0..MAX_BACKENDS).map(|_| Default::default()).collect(),
            decisions: Default::default(),
            matched_blocks: Histogram::new([
                0.0, 1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0,
            ]),
            routing_seconds: Histogram::new([5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3]),
            resends: Default::default(),
            unanswered: AtomicU64::new(0),
            probes: (0..MAX_BACKENDS).map(|_| Default::default()).collect(),
            admin_refused: AtomicU64::new(0),
        }
    }
}

impl Metrics {
    /// Called once per routed request: what was decided and how long the
    /// router took from the request being read to the decision.
    pub fn observe_routing(&self, decision: Decision, matched_blocks: u32, took: Duration) {
        let d = match decision {
            Decision::Warm => 0,
            Decision::Cold => 1,
            Decision::Bounded => 2,
            Decision::Baseline => 3,
        };
        self.decisions[d].fetch_add(1, Relaxed);
        self.matched_blocks.observe(f64::from(matched_blocks));
        self.routing_seconds.observe(took.as_secs_f64());
    }

    /// A new backend took `slot`: its response counts start at zero.
    pub fn clear_slot(&self, slot: usize) {
        for c in self.responses[slot].iter().chain(&self.probes[slot]) {
            c.store(0, Relaxed);
        }
    }

    /// A health probe of the backend in `slot` passed or failed.
    pub fn observe_probe(&self, slot: usize, passed: bool) {
        self.probes[slot][usize::from(!passed)].fetch_add(1, Relaxed);
    }

    /// The admin listener refused a connection (too many open).
    pub fn admin_refused(&self) {
        self.admin_refused.fetch_add(1, Relaxed);
    }

    pub fn resent(&self, reason: Resend) {
        self.resends[reason as usize].fetch_add(1, Relaxed);
    }

    pub fn unanswered(&self) {
        self.unanswered.fetch_add(1, Relaxed);
    }

    pub fn observe_response(&self, slot: usize, status: u16) {
        let class = match status {
            200..=299 => 0,
            300..=399 => 1,
            400..=499 => 2,
            500..=599 => 3,
            _ => 4,
        };
        self.responses[slot][class].fetch_add(1, Relaxed);
    }

    /// Prometheus text exposition of everything the router knows.
    /// `buffered_body_bytes`: what the proxy buffers now (`budget::in_use`).
    pub fn render(
        &self,
        fleet: &Fleet,
        index: &PrefixIndex,
        policy: &str,
        buffered_body_bytes: usize,
    ) -> String {
        let mut reg = Registry::with_prefix("prefix_router");
        // Counters are rebuilt at each scrape from the data path's atomics.
        let requests = Family::<Vec<(String, String)>, Counter>::default();
        let xdp = Family::<Vec<(String, String)>, Counter>::default();
        let in_flight = Family::<Vec<(String, String)>, Gauge>::default();
        let healthy = Family::<Vec<(String, String)>, Gauge>::default();
        let draining = Family::<Vec<(String, String)>, Gauge>::default();
        let open_conns = Family::<Vec<(String, String)>, Gauge>::default();
        let external = Family::<Vec<(String, String)>, Gauge>::default();
        let index_blocks = Family::<Vec<(String, String)>, Gauge>::default();
        let capacity = Family::<Vec<(String, String)>, Gauge>::default();
        let learned = Family::<Vec<(String, String)>, Gauge>::default();
        let rate =
            Family::<Vec<(String, String)>, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        let predicted = Family::<Vec<(String, String)>, Counter>::default();
        let reported = Family::<Vec<(String, String)>, Counter>::default();
        let error = Family::<Vec<(String, String)>, Counter>::default();
        let reports = Family::<Vec<(String, String)>, Counter>::default();
        let mispredictions = Family::<Vec<(String, String)>, Counter>::default();
        let probes = Family::<Vec<(String, String)>, Counter>::default();
        for b in &fleet.backends {
            let l = vec![("backend".to_owned(), b.url.clone())];
            for (i, result) in ["passed", "failed"].iter().enumerate() {
                let mut l = l.clone();
                l.push(("result".to_owned(), (*result).to_owned()));
                probes
                    .get_or_create(&l)
                    .inc_by(self.probes[b.slot][i].load(Relaxed));
            }
            for (i, class) in CLASSES.iter().enumerate() {
                let v = self.responses[b.slot][i].load(Relaxed);
                if v > 0 {
                    let mut l = l.clone();
                    l.push(("status".to_owned(), (*class).to_owned()));
                    l.push(("policy".to_owned(), policy.to_owned()));
                    requests.get_or_create(&l).inc_by(v);
                }
            }
            let (load, health) = (&b.load, &b.health);
            in_flight.get_or_create(&l).set(i64::from(load.in_flight()));
            healthy
                .get_or_create(&l)
                .set(i64::from(health.is_healthy()));
            draining
                .get_or_create(&l)
                .set(i64::from(health.is_draining()));
            open_conns
                .get_or_create(&l)
                .set(i64::from(load.open_conns()));
            external
                .get_or_create(&l)
                .set(i64::from(load.external_conns()));
            index_blocks.get_or_create(&l).set(index.len(b.slot) as i64);
            capacity
                .get_or_create(&l)
                .set(index.capacity(b.slot) as i64);
            let f = &b.feedback;
            learned.get_or_create(&l).set(f.capacity() as i64);
            rate.get_or_create(&l).set(f.prefill_rate());
            predicted
                .get_or_create(&l)
                .inc_by(f.predicted_blocks.load(Relaxed));
            reported
                .get_or_create(&l)
                .inc_by(f.reported_blocks.load(Relaxed));
            error.get_or_create(&l).inc_by(f.error_blocks.load(Relaxed));
            reports.get_or_create(&l).inc_by(f.reports.load(Relaxed));
            for (kind, v) in [
                ("over", &f.over_predictions),
                ("under", &f.under_predictions),
                ("flush", &f.flushes),
            ] {
                let mut l = l.clone();
                l.push(("kind".to_owned(), kind.to_owned()));
                mispredictions.get_or_create(&l).inc_by(v.load(Relaxed));
            }
            let x = b.stats.xdp();
            for (what, v) in [
                ("opened", x.opened),
                ("closed", x.closed),
                ("reset", x.reset),
                ("packets", x.packets),
                ("bytes", x.bytes),
            ] {
                let mut l = l.clone();
                l.push(("counter".to_owned(), what.to_owned()));
                xdp.get_or_create(&l).inc_by(v);
            }
        }
        reg.register(
            "responses",
            "Responses relayed, by backend, status class and policy",
            requests,
        );
        reg.register(
            "xdp",
            "XDP counters per backend: connections opened (SYN-ACK), closed (FIN), reset (RST), packets and bytes it sent",
            xdp,
        );
        reg.register(
            "health_probes",
            "Active health probes per backend, passed or failed (refused, timed out at health.timeout_ms, not 2xx, or badly framed)",
            probes,
        );
        let admin_refused = Counter::<u64>::default();
        admin_refused.inc_by(self.admin_refused.load(Relaxed));
        reg.register(
            "admin_connections_refused",
            "Admin connections answered 503 because the admin listener's connection cap was reached",
            admin_refused,
        );
        reg.register(
            "backend_in_flight",
            "Requests in flight per backend",
            in_flight,
        );
        reg.register(
            "backend_healthy",
            "1 when the backend passes health checks",
            healthy,
        );
        reg.register(
            "backend_draining",
            "1 when the backend is drained by an operator",
            draining,
        );
        reg.register(
            "backend_open_connections",
            "This router's connections to the backend",
            open_conns,
        );
        reg.register(
            "backend_external_connections",
            "Connections to the backend seen by XDP beyond this router's",
            external,
        );
        reg.register(
            "index_blocks",
            "Prefix blocks tracked per backend",
            index_blocks,
        );
        reg.register(
            "index_capacity_blocks",
            "Blocks the index remembers per backend: its KV capacity as configured or published, else prefix.kv_blocks",
            capacity,
        );
        reg.register(
            "learned_capacity_blocks",
            "KV capacity per backend in the router's blocks, learned from the cached tokens its answers report (starts at the published or configured capacity)",
            learned,
        );
        reg.register(
            "prefill_rate_blocks_per_second",
            "Prefill rate per backend learned from observed times to first token",
            rate,
        );
        reg.register(
            "predicted_cached_blocks",
            "Prompt blocks the index predicted the backend held, over answers that reported cached tokens",
            predicted,
        );
        reg.register(
            "reported_cached_blocks",
            "Prompt blocks the backend reported cached (usage.prompt_tokens_details.cached_tokens, in the router's blocks)",
            reported,
        );
        reg.register(
            "prediction_error_blocks",
            "Sum of |predicted - reported| cached blocks per backend",
            error,
        );
        reg.register(
            "prediction_reports",
            "Answers whose reported cached tokens were compared with the prediction",
            reports,
        );
        reg.register(
            "mispredictions",
            "Answers that held fewer (over) or more (under) blocks than predicted, and detected cache flushes",
            mispredictions,
        );
        let decisions = Family::<Vec<(String, String)>, Counter>::default();
        for (i, name) in ["warm", "cold", "bounded", "baseline"].iter().enumerate() {
            decisions
                .get_or_create(&vec![("decision".to_owned(), (*name).to_owned())])
                .inc_by(self.decisions[i].load(Relaxed));
        }
        reg.register("routing_decisions", "Routing decisions by kind", decisions);
        let evictions = Counter::<u64>::default();
        evictions.inc_by(index.evictions());
        reg.register(
            "index_evictions",
            "Blocks the index forgot to stay within capacity",
            evictions,
        );
        let tracked = Gauge::<i64>::default();
        tracked.set(index.total_tracked() as i64);
        reg.register(
            "index_tracked_blocks",
            "Blocks tracked over all backends",
            tracked,
        );
        reg.register(
            "matched_blocks",
            "Prompt blocks the chosen backend already held",
            self.matched_blocks.clone(),
        );
        reg.register(
            "routing_seconds",
            "Router time from the whole request read to the routing decision (extraction, hashing, index, selection)",
            self.routing_seconds.clone(),
        );
        let resends = Family::<Vec<(String, String)>, Counter>::default();
        for r in Resend::ALL {
            resends
                .get_or_create(&vec![("reason".to_owned(), r.name().to_owned())])
                .inc_by(self.resends[r as usize].load(Relaxed));
        }
        reg.register(
            "resends",
            "Requests sent again because no backend can have processed them, by reason",
            resends,
        );
        let buffered = Gauge::<i64>::default();
        buffered.set(buffered_body_bytes as i64);
        reg.register(
            "buffered_body_bytes",
            "Request body bytes buffered now, against limits.max_buffered_body_bytes",
            buffered,
        );
        let unanswered = Counter::<u64>::default();
        unanswered.inc_by(self.unanswered.load(Relaxed));
        reg.register(
            "unanswered",
            "Requests a backend read whole and closed on without answering: a 502, never sent again",
            unanswered,
        );
        let mut out = String::new();
        let _ = encode(&mut out, &reg);
        out
    }
}
