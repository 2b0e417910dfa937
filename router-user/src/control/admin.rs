//! The operators' listener, apart from traffic: `/metrics`, `/admin/backends`,
//! drain and undrain, `/admin/explain`, `/admin/reload`, `/health`. This
//! file says what each path answers; `admin/serve.rs` serves the connections
//! (concurrently, with the traffic side's head limits and timeouts) and
//! `admin/query.rs` decodes query strings.

mod query;
mod serve;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use serde_json::json;
use sha2::{Digest, Sha256};
use tracing::info;

use crate::config::classes::Caller;
use crate::http::request::{api_key, header_value};
use crate::prompt::extract::Endpoint;
use crate::shared::{PromptBlocks, RouteQuery, RouteScratch, Router};

/// Re-reads the configuration source and applies it.
pub type Reloader = Box<dyn Fn() -> anyhow::Result<()> + Send + Sync>;

/// Binds `addr` and serves the admin API on threads of its own.
pub fn start(router: Arc<Router>, addr: SocketAddr, reload: Reloader) -> anyhow::Result<()> {
    serve::start(router, addr, reload)
}

/// One admin request, read whole.
pub struct Request<'a> {
    pub method: &'a str,
    /// The target's path, before any `?`.
    pub path: &'a str,
    /// The target's query, after the `?` (still percent-encoded).
    pub query: &'a str,
    /// The head as received, request line first.
    pub head: &'a [u8],
    pub body: &'a [u8],
}

/// What an admin request is answered.
pub struct Reply {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
}

impl Reply {
    fn text(status: u16, body: impl Into<String>) -> Reply {
        Reply {
            status,
            content_type: "text/plain",
            body: body.into(),
        }
    }

    fn json(status: u16, v: &serde_json::Value) -> Reply {
        Reply {
            status,
            content_type: "application/json",
            body: v.to_string(),
        }
    }
}

/// Whether the request may be served: with `admin.token_sha256` set,
/// every path but `/health` and `/ready` wants `Authorization: Bearer
/// TOKEN` (compared as SHA-256 digests; the token is never logged).
fn authorized(router: &Router, req: &Request) -> bool {
    let Some(want) = router.config.load().admin.token_digest() else {
        return true;
    };
    if matches!(req.path, "/health" | "/ready") {
        return true;
    }
    bearer(req.head).is_some_and(|t| <[u8; 32]>::from(Sha256::digest(t)) == want)
}

/// The `Authorization: Bearer` token only (`x-api-key` is a traffic key).
fn bearer(head: &[u8]) -> Option<&[u8]> {
    let v = header_value(head, "authorization")?;
    let (scheme, token) = v.split_at(v.iter().position(|&b| b == b' ')?);
    scheme
        .eq_ignore_ascii_case(b"bearer")
        .then(|| token.trim_ascii())
        .filter(|t| !t.is_empty())
}

/// Answers one request.
fn handle(router: &Router, req: &Request, reload: &Reloader) -> Reply {
    if !authorized(router, req) {
        return Reply::text(
            401,
            "the admin listener wants its token: Authorization: Bearer TOKEN (admin.token_sha256)\n",
        );
    }
    let param = |name: &str| query::param(req.query, name);
    match (req.method, req.path) {
        ("GET", "/health") => Reply::text(200, "ok\n"),
        ("GET", "/metrics") => {
            let text = router.metrics.render(crate::proxy::budget::in_use());
            Reply {
                status: 200,
                content_type: "text/plain; version=0.0.4",
                body: text,
            }
        }
        // Readiness: a replica that has not caught up from its peers yet
        // answers 503 (a single router is always ready).
        ("GET", "/ready") => match &router.replica {
            Some(r) if !r.status.is_warm() => Reply::text(503, "catching up from peers\n"),
            _ => Reply::text(200, "ready\n"),
        },
        ("GET", "/admin/backends") => Reply::json(200, &backends_json(router)),
        ("GET", "/admin/replicas") => Reply::json(200, &replicas_json(router)),
        ("POST", "/admin/drain") | ("POST", "/admin/undrain") => {
            let drain = req.path.ends_with("/drain");
            let url = match param("backend") {
                Ok(Some(url)) => url,
                Ok(None) => return Reply::text(400, "give ?backend=URL\n"),
                Err(e) => return Reply::text(400, format!("{e}\n")),
            };
            let fleet = router.fleet.load();
            let Some(b) = fleet.backends.iter().find(|b| b.url == url) else {
                return Reply::text(404, format!("no backend {url}\n"));
            };
            b.health.set_draining(drain);
            info!(backend = %b.url, drain, "backend drain changed by operator");
            Reply::json(200, &backends_json(router))
        }
        ("POST", "/admin/explain") => {
            let ep = match param("endpoint") {
                Ok(ep) => ep.unwrap_or_else(|| "chat".into()),
                Err(e) => return Reply::text(400, format!("{e}\n")),
            };
            let ep = match ep.as_str() {
                "completions" => Endpoint::Completions,
                "generate" => Endpoint::Generate,
                "messages" => Endpoint::Messages,
                "responses" => Endpoint::Responses,
                _ => Endpoint::Chat,
            };
            let (status, v) = explain(router, ep, req.head, req.body);
            Reply::json(status, &v)
        }
        ("POST", "/admin/reload") => match reload() {
            Ok(()) => Reply::json(200, &backends_json(router)),
            Err(e) => Reply::text(400, format!("reload failed: {e:#}\n")),
        },
        _ => Reply::text(404, "not found\n"),
    }
}

fn backends_json(router: &Router) -> serde_json::Value {
    let fleet = router.fleet.load();
    let total = router.index.total_tracked().max(1) as f64;
    let models = router.models.table();
    let list: Vec<_> = fleet
        .backends
        .iter()
        .map(|b| {
            let (load, stats) = (&b.load, &b.stats);
            let blocks = router.index.len(b.slot);
            json!({
                "url": b.url,
                "slot": b.slot,
                "healthy": b.health.is_healthy(),
                "unproven": b.health.is_unproven(),
                "draining": b.health.is_draining(),
                "in_flight": load.in_flight(),
                "queued_prefill_blocks": load.queued_prefill_blocks(),
                // The peer replicas' work here, as they report it.
                "peers_in_flight": load.remote.in_flight(),
                "peers_queued_prefill_blocks": load.remote.queued_prefill_blocks(),
                "open_connections": load.open_conns(),
                "external_connections": load.external_conns(),
                // Of those, the peer replicas' on this host (not load).
                "peers_connections": load.remote.local_peer_conns(),
                "resets_per_sec": load.resets_per_sec(),
                "index_blocks": blocks,
                "index_share": blocks as f64 / total,
                "kv_blocks": router.index.capacity(b.slot),
                "engine": if b.slots.is_slot_engine() { "slots" } else { "blocks" },
                // What it serves, listed or pinned; null while unknown.
                "models": models.models_of(b.slot, b.generation),
                // Why its last `/v1/models` answer was not (wholly) believed.
                "models_problem": router.models.problem(b.generation),
                "slots": b.slots.count(),
                "learned_capacity_blocks": b.feedback.capacity(),
                "capacity_known": b.feedback.capacity_known(),
                "prefill_blocks_per_s": b.feedback.prefill_rate(),
                "private_lead_kept": b.feedback.private_kept(),
                "prediction": {
                    "reports": b.feedback.reports(),
                    "predicted_blocks": b.feedback.predicted_blocks(),
                    "reported_blocks": b.feedback.reported_blocks(),
                    "error_blocks": b.feedback.error_blocks(),
                    "over": b.feedback.over_predictions(),
                    "under": b.feedback.under_predictions(),
                    "flushes": b.feedback.flushes(),
                    "invalid_reports": b.feedback.invalid_reports(),
                },
                "requests": stats.requests(),
                "errors": stats.errors(),
                "precise": router
                    .precise
                    .as_ref()
                    .map(|p| crate::precise::metrics::backend_json(p, b.slot)),
            })
        })
        .collect();
    let discovery: serde_json::Map<_, _> = router
        .metrics
        .discovery
        .snapshot()
        .into_iter()
        .map(|(k, v)| (k, json!(v)))
        .collect();
    json!({
        "policy": router.config.load().policy.name(),
        "backends": list,
        "discovery": discovery,
        "precise": router.precise.as_ref().map(|p| crate::precise::metrics::tokenizers_json(p)),
        "replicas": replicas_json(router),
    })
}

/// This replica's stream and each peer's (null without `[replicas]`).
fn replicas_json(router: &Router) -> serde_json::Value {
    let Some(r) = &router.replica else {
        return serde_json::Value::Null;
    };
    let s = &r.status;
    let peers: serde_json::Map<_, _> = s.peers().into_iter().map(|(k, v)| (k, json!(v))).collect();
    json!({
        "id": format!("{:016x}", r.id),
        "warm": s.is_warm(),
        "snapshot_blocks": s.snapshot_blocks.load(Relaxed),
        "published_messages": s.published_messages.load(Relaxed),
        "published_bytes": s.published_bytes.load(Relaxed),
        "outbox_dropped": r.outbox.dropped(),
        "snapshots_served": s.snapshots_served.load(Relaxed),
        "peers": peers,
    })
}

/// Which backend a request body would go to now, and why, and the
/// request's class and tenant (from the explain request's own head, as
/// the traffic listener would read them; with an admin token, the key
/// from `x-api-key`). Changes nothing.
fn explain(router: &Router, ep: Endpoint, head: &[u8], body: &[u8]) -> (u16, serde_json::Value) {
    let mut scratch = RouteScratch::default();
    let mut blocks = PromptBlocks::default();
    let cfg = router.config.load();
    let classes = &cfg.classes;
    let query = RouteQuery {
        caller: Caller {
            header: (!classes.header.is_empty())
                .then(|| header_value(head, &classes.header))
                .flatten(),
            // With an admin token, `Authorization` carries it: the caller's
            // key is read from `x-api-key` only.
            key: match cfg.admin.token_digest() {
                Some(_) => header_value(head, "x-api-key"),
                None => api_key(head),
            },
        },
        endpoint: Some(ep),
        body,
        session: None,
        tokens: crate::shared::TokensFrom::Here,
        scanned: None,
        by_model: false,
        only: None,
    };
    let routed = match router.route(&query, &mut scratch, &mut blocks) {
        Ok(r) => r,
        Err(e) => return (e.status(), json!({ "error": e.message })),
    };
    let fleet = &routed.fleet;
    let candidates: Vec<_> = routed
        .choice
        .iter()
        .map(|i| fleet.backends[i].url.clone())
        .collect();
    let policy = router.config.load().policy;
    let scores = router.scores(&scratch, blocks.hashes.len() as u32);
    let scored: Vec<_> = scores
        .iter()
        .map(|s| {
            json!({
                "url": fleet.backends[s.backend].url,
                "predicted_ttft_ms": s.predicted_ttft_s * 1e3,
                "matched_blocks": s.matched_blocks,
                "queued_blocks": s.queued_blocks,
                "uncached_blocks": s.uncached_blocks,
                "move_blocks": s.move_blocks,
                "in_flight_cost_blocks": s.in_flight_cost_blocks,
                "overload_blocks": s.overload_blocks,
                "prefill_blocks_per_s": s.prefill_blocks_per_s,
                "over_safety_cap": s.capped,
                "cache_pressure": s.pressure,
            })
        })
        .collect();
    let why = why(policy, &routed, &scores, fleet);
    let placed = scratch.placed();
    (
        200,
        json!({
            "class": placed.class.name(),
            "tenant": classes.tenant_name(placed.tenant),
            "class_from": placed.source.name(),
            "canonical_bytes": scratch.canonical_len(),
            "blocks": blocks.hashes.len(),
            "precise_blocks": router.precise.as_ref().map(|_| blocks.keys.len()),
            "matched_on": fleet.backends.iter().map(|b| {
                let precise = scratch.precise_mask.contains(b.slot);
                json!({ "url": b.url, "index": if precise { "precise" } else { "approximate" } })
            }).collect::<Vec<_>>(),
            "decision": routed.choice.decision,
            "matched_blocks": routed.choice.matched_blocks,
            "chosen": candidates.first(),
            "why": why,
            "full_cache_bounds": routed.choice.full_cache,
            "saturated": routed.choice.saturated,
            "candidates": scored,
            "fallbacks": candidates.get(1..).unwrap_or(&[]),
            "backends": backends_json(router)["backends"],
        }),
    )
}

/// One sentence on why the first candidate won.
fn why(
    policy: crate::policy::select::Policy,
    routed: &crate::shared::Routed,
    scores: &[crate::policy::select::Score],
    fleet: &crate::fleet::backend::Fleet,
) -> String {
    use crate::policy::select::{Decision, Policy};
    let Some(first) = routed.choice.first() else {
        return "no backend is eligible (unhealthy, draining or at its in-flight limit)".into();
    };
    let url = &fleet.backends[first].url;
    let ms = |b: usize| {
        scores
            .iter()
            .find(|s| s.backend == b)
            .map_or(f64::NAN, |s| s.predicted_ttft_s * 1e3)
    };
    match (policy, routed.choice.decision) {
        (Policy::Prefix, Decision::Warm) => format!(
            "{url} holds the longest prefix ({} blocks) and its predicted TTFT ({:.1} ms) is the lowest",
            routed.choice.matched_blocks,
            ms(first)
        ),
        (Policy::Prefix, Decision::Bounded) => {
            let holder = scores.iter().max_by_key(|s| s.matched_blocks).map(|s| {
                (
                    fleet.backends[s.backend].url.clone(),
                    s.predicted_ttft_s * 1e3,
                    s.capped,
                )
            });
            match holder {
                Some((h, t, true)) => format!(
                    "{h} holds the longest prefix but is over the safety cap; {url} is predicted fastest ({:.1} ms, was {t:.1} ms there)",
                    ms(first)
                ),
                Some((h, t, false)) => format!(
                    "{h} holds the longest prefix but is predicted slower ({t:.1} ms, queue and load) than {url} ({:.1} ms, counting what it recomputes)",
                    ms(first)
                ),
                None => format!("{url} is the least loaded"),
            }
        }
        (Policy::Prefix, Decision::Cold) => format!(
            "no backend holds the prefix: {url} is first in rendezvous order on its first blocks among backends under the balance bound and cache pressure"
        ),
        (p, _) => format!("{url} chosen by the {} policy", p.name()),
    }
}
