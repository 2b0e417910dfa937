//! Precise mode in `/metrics` and `/admin/*`: each backend's stream state,
//! lag, gaps, replays and decode errors.

use std::fmt::Write as _;

use super::Precise;
use super::confidence::State;
use crate::route::backend::Fleet;

/// The per-backend series, in Prometheus text format, inserted before an
/// OpenMetrics `# EOF` line if `text` has one.
pub fn append(text: &mut String, p: &Precise, fleet: &Fleet) {
    let now = p.now_ms();
    let snaps: Vec<_> = fleet
        .backends
        .iter()
        .map(|b| (b.url.as_str(), b.slot, p.confidence[b.slot].snapshot(now)))
        .collect();
    let mut out = String::new();
    let mut series = |name: &str,
                      kind: &str,
                      help: &str,
                      v: &dyn Fn(usize, &super::confidence::Snapshot) -> f64| {
        let _ = writeln!(out, "# HELP prefix_router_precise_{name} {help}");
        let _ = writeln!(out, "# TYPE prefix_router_precise_{name} {kind}");
        for (url, slot, s) in &snaps {
            let suffix = if kind == "counter" { "_total" } else { "" };
            let _ = writeln!(
                out,
                "prefix_router_precise_{name}{suffix}{{backend=\"{url}\"}} {}",
                v(*slot, s)
            );
        }
    };
    series(
        "exact",
        "gauge",
        "1 while the backend's event stream is whole (EXACT), 0 while DEGRADED.",
        &|_, s| f64::from(u8::from(s.state == State::Exact)),
    );
    series(
        "lag_seconds",
        "gauge",
        "Publish-to-apply lag of the last event batch.",
        &|_, s| s.lag_ms / 1e3,
    );
    series(
        "last_seq",
        "gauge",
        "Sequence number of the last batch applied (-1: none).",
        &|_, s| s.last_seq as f64,
    );
    series(
        "held_blocks",
        "gauge",
        "Blocks the engine's events say it holds.",
        &|slot, _| p.index.held_blocks(slot) as f64,
    );
    series("batches", "counter", "Event batches applied.", &|_, s| {
        s.batches as f64
    });
    series("events", "counter", "Events applied.", &|_, s| {
        s.events as f64
    });
    series(
        "gaps",
        "counter",
        "Sequence gaps seen on the live stream.",
        &|_, s| s.gaps as f64,
    );
    series(
        "unfilled_gaps",
        "counter",
        "Gaps replay could not fill (the backend was forgotten).",
        &|_, s| s.unfilled_gaps as f64,
    );
    series("replays", "counter", "Replay requests sent.", &|_, s| {
        s.replays as f64
    });
    series(
        "replayed_batches",
        "counter",
        "Batches applied from replay.",
        &|_, s| s.replayed_batches as f64,
    );
    series(
        "restarts",
        "counter",
        "Engine restarts seen (the sequence went back).",
        &|_, s| s.restarts as f64,
    );
    series(
        "decode_errors",
        "counter",
        "Payloads that were not an event batch.",
        &|_, s| s.decode_errors as f64,
    );
    series(
        "skipped_events",
        "counter",
        "Events of unknown kinds, skipped.",
        &|_, s| s.skipped_events as f64,
    );
    series(
        "skipped_fields",
        "counter",
        "Unknown or malformed fields, skipped.",
        &|_, s| s.skipped_fields as f64,
    );
    series(
        "disconnects",
        "counter",
        "Event connections lost.",
        &|_, s| s.disconnects as f64,
    );
    match text.rfind("# EOF") {
        Some(i) => text.insert_str(i, &out),
        None => text.push_str(&out),
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
