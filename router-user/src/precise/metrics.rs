//! Precise mode in `/metrics` and `/admin/*`: each backend's stream state,
//! lag, gaps, replays and decode errors, and the tokenizer's pool. The
//! collector is registered in the router's one registry (`crate::metrics`)
//! and reads the owners' atomics at each scrape.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use arc_swap::ArcSwap;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use super::Precise;
use super::confidence::{Snapshot, State};
use super::tokenizer::TemplateState;
use crate::fleet::backend::Fleet;

/// How a per-backend series reads its value.
enum Read {
    Gauge(fn(&Precise, usize, &Snapshot) -> f64),
    Int(fn(&Precise, usize, &Snapshot) -> i64),
    Counter(fn(&Snapshot) -> u64),
}

/// Every per-backend series: name (after `prefix_router_precise_`), help.
const PER_BACKEND: &[(&str, &str, Read)] = &[
    (
        "exact",
        "1 while the backend's event stream is whole (EXACT), 0 while DEGRADED",
        Read::Int(|_, _, s| i64::from(s.state == State::Exact)),
    ),
    (
        "lag_seconds",
        "Publish-to-apply lag of the last event batch",
        Read::Gauge(|_, _, s| s.lag_ms / 1e3),
    ),
    (
        "last_seq",
        "Sequence number of the last batch applied (-1: none)",
        Read::Int(|_, _, s| s.last_seq),
    ),
    (
        "held_blocks",
        "Blocks the engine's events say it holds",
        Read::Int(|p, slot, _| i64::try_from(p.index.held_blocks(slot)).unwrap_or(i64::MAX)),
    ),
    (
        "batches",
        "Event batches applied",
        Read::Counter(|s| s.batches),
    ),
    ("events", "Events applied", Read::Counter(|s| s.events)),
    (
        "gaps",
        "Sequence gaps seen on the live stream",
        Read::Counter(|s| s.gaps),
    ),
    (
        "unfilled_gaps",
        "Gaps replay could not fill (the backend was forgotten)",
        Read::Counter(|s| s.unfilled_gaps),
    ),
    (
        "replays",
        "Replay requests sent",
        Read::Counter(|s| s.replays),
    ),
    (
        "replayed_batches",
        "Batches applied from replay",
        Read::Counter(|s| s.replayed_batches),
    ),
    (
        "restarts",
        "Engine restarts seen (the sequence went back)",
        Read::Counter(|s| s.restarts),
    ),
    (
        "decode_errors",
        "Payloads that were not an event batch",
        Read::Counter(|s| s.decode_errors),
    ),
    (
        "skipped_events",
        "Events of unknown kinds, skipped",
        Read::Counter(|s| s.skipped_events),
    ),
    (
        "skipped_fields",
        "Unknown or malformed fields, skipped",
        Read::Counter(|s| s.skipped_fields),
    ),
    (
        "disconnects",
        "Event connections lost",
        Read::Counter(|s| s.disconnects),
    ),
];

/// Precise mode's series, for the router's registry.
pub struct PreciseCollector {
    pub precise: Arc<Precise>,
    pub fleet: Arc<ArcSwap<Fleet>>,
}

impl std::fmt::Debug for PreciseCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PreciseCollector")
    }
}

impl Collector for PreciseCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let p = &*self.precise;
        let now = p.now_ms();
        let fleet = self.fleet.load();
        let snaps: Vec<_> = fleet
            .backends
            .iter()
            .map(|b| (b.url.as_str(), b.slot, p.confidence[b.slot].snapshot(now)))
            .collect();
        for (name, help, read) in PER_BACKEND {
            let kind = match read {
                Read::Gauge(_) | Read::Int(_) => MetricType::Gauge,
                Read::Counter(_) => MetricType::Counter,
            };
            let name = format!("precise_{name}");
            let help = format!("{help}.");
            let mut family = encoder.encode_descriptor(&name, &help, None, kind)?;
            for (url, slot, s) in &snaps {
                let labels = [("backend", *url)];
                let m = family.encode_family(&labels)?;
                match read {
                    Read::Gauge(f) => ConstGauge::new(f(p, *slot, s)).encode(m)?,
                    Read::Int(f) => ConstGauge::new(f(p, *slot, s)).encode(m)?,
                    Read::Counter(f) => ConstCounter::new(f(s)).encode(m)?,
                }
            }
        }
        let pool = &p.tokenizers.pool;
        for (name, help, v) in [
            (
                "precise_tokenizer_tokenized",
                "Message pieces tokenized (not found in the tokenizer's cache)",
                pool.tokenized.load(Relaxed),
            ),
            (
                "precise_tokenizer_deferred",
                "New last messages tokenized off the request's wait",
                pool.deferred.load(Relaxed),
            ),
            (
                "precise_tokenizer_dropped",
                "New last messages not tokenized off the wait (its queue full): the next turn tokenizes them",
                pool.dropped.load(Relaxed),
            ),
        ] {
            let help = format!("{help}.");
            let m = encoder.encode_descriptor(name, &help, None, MetricType::Counter)?;
            ConstCounter::new(v).encode(m)?;
        }
        let off = &p.tokenizers.offload.stats;
        for (name, help, v) in [
            (
                "precise_tokenizer_jobs",
                "Prompts handed to the tokenizing threads",
                off.submitted.load(Relaxed),
            ),
            (
                "precise_tokenizer_busy",
                "Prompts not tokenized, every tokenizing thread busy and the queue full: routed on the approximate index",
                off.busy.load(Relaxed),
            ),
            (
                "precise_tokenizer_late",
                "Requests whose tokens took longer than precise.tokenizer_wait_ms: routed on the approximate index",
                off.late.load(Relaxed),
            ),
            (
                "precise_tokenizer_abandoned",
                "Prompts not tokenized, their request gone before a thread took them",
                off.abandoned.load(Relaxed),
            ),
            (
                "precise_tokenizer_cut",
                "Prompts cut to precise.tokenizer_max_tokens before tokenizing",
                off.cut.load(Relaxed),
            ),
        ] {
            let help = format!("{help}.");
            let m = encoder.encode_descriptor(name, &help, None, MetricType::Counter)?;
            ConstCounter::new(v).encode(m)?;
        }
        let loaded = p.tokenizers.loaded();
        let states: Vec<_> = loaded
            .iter()
            .map(|(model, t)| (*model, t.template_state()))
            .collect();
        let mut family = encoder.encode_descriptor(
            "precise_template_usable",
            "1 while a model tokenizer's chat template is used, 0 once it failed or cost too much (until reload; its model's chats route on the approximate index).",
            None,
            MetricType::Gauge,
        )?;
        for (model, (state, ..)) in &states {
            let labels = [("model", *model), ("state", state.name())];
            let m = family.encode_family(&labels)?;
            ConstGauge::new(i64::from(*state == TemplateState::Ok)).encode(m)?;
        }
        let mut family = encoder.encode_descriptor(
            "precise_template_skipped",
            "Chats routed on the approximate index because their chat template is not used (failed or costly).",
            None,
            MetricType::Counter,
        )?;
        for (model, (_, _, skipped, _)) in &states {
            let labels = [("model", *model)];
            let m = family.encode_family(&labels)?;
            ConstCounter::new(*skipped).encode(m)?;
        }
        let mut family = encoder.encode_descriptor(
            "precise_template_refused",
            "Chats the chat template refused (raise_exception): routed on the approximate index.",
            None,
            MetricType::Counter,
        )?;
        for (model, (_, _, _, refused)) in &states {
            let labels = [("model", *model)];
            let m = family.encode_family(&labels)?;
            ConstCounter::new(*refused).encode(m)?;
        }
        let m = encoder.encode_descriptor(
            "precise_tokenizer_cache_tokens",
            "Tokens held by the tokenizer's cache.",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(i64::try_from(pool.tokens()).unwrap_or(i64::MAX)).encode(m)?;
        Ok(())
    }
}

/// One backend's precise state for `/admin/backends`.
pub fn backend_json(p: &Precise, slot: usize) -> serde_json::Value {
    let mut v = serde_json::to_value(p.confidence[slot].snapshot(p.now_ms()))
        .unwrap_or(serde_json::Value::Null);
    if let Some(o) = v.as_object_mut() {
        o.insert("held_blocks".into(), p.index.held_blocks(slot).into());
    }
    v
}

/// The model tokenizers and their chat templates, and the tokenizing
/// threads, for `/admin/backends`.
pub fn tokenizers_json(p: &Precise) -> serde_json::Value {
    let t = &p.tokenizers;
    let templates: Vec<_> = t
        .loaded()
        .iter()
        .map(|(model, tk)| {
            let (state, why, skipped, refused) = tk.template_state();
            serde_json::json!({
                "model": model,
                "tokenizer": tk.dir().display().to_string(),
                "template": state.name(),
                "why": (!why.is_empty()).then_some(why),
                "skipped_chats": skipped,
                "refused_chats": refused,
            })
        })
        .collect();
    let s = &t.offload.stats;
    serde_json::json!({
        "tokenizers": templates,
        "max_tokens": t.max_tokens,
        "threads": t.offload.threads,
        "jobs": s.submitted.load(Relaxed),
        "busy": s.busy.load(Relaxed),
        "late": s.late.load(Relaxed),
        "abandoned": s.abandoned.load(Relaxed),
        "cut": s.cut.load(Relaxed),
    })
}
