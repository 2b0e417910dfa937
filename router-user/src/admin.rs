//! The operators' listener, apart from traffic: `/metrics`, `/admin/backends`,
//! drain and undrain, `/admin/explain`, `/admin/reload`, `/health`. Small
//! blocking HTTP/1.1 on one thread: operators' calls are rare and tiny.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use anyhow::Context;
use serde_json::json;
use tracing::{info, warn};

use crate::extract::{Endpoint, Extractor};
use crate::router::{PromptBlocks, RouteRequest, RouteScratch, Router};

/// Largest admin request body (`/admin/explain` takes a whole request body).
const MAX_ADMIN_BODY: usize = 64 * 1024 * 1024;
/// A stalled operator's connection is dropped after this.
const ADMIN_IO_TIMEOUT: Duration = Duration::from_secs(10);

/// Re-reads the configuration source and applies it.
pub type Reloader = Box<dyn Fn() -> anyhow::Result<()> + Send + Sync>;

pub fn start(router: Arc<Router>, addr: SocketAddr, reload: Reloader) -> anyhow::Result<()> {
    let listener =
        TcpListener::bind(addr).with_context(|| format!("binding the admin listener {addr}"))?;
    let addr = listener.local_addr()?;
    info!(%addr, "admin listener (metrics, /admin/*)");
    println!("admin listening on {addr}");
    std::thread::Builder::new()
        .name("admin".into())
        .spawn(move || {
            for stream in listener.incoming().flatten() {
                if let Err(e) = serve(&router, stream, &reload) {
                    warn!(error = %e, "admin request failed");
                }
            }
        })?;
    Ok(())
}

fn serve(router: &Router, mut stream: TcpStream, reload: &Reloader) -> anyhow::Result<()> {
    stream.set_read_timeout(Some(ADMIN_IO_TIMEOUT))?;
    stream.set_write_timeout(Some(ADMIN_IO_TIMEOUT))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or("/"));
    let mut length = 0usize;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h == "\r\n" || h == "\n" {
            break;
        }
        if let Some((k, v)) = h.split_once(':')
            && k.trim().eq_ignore_ascii_case("content-length")
        {
            length = v.trim().parse().unwrap_or(0);
        }
    }
    if length > MAX_ADMIN_BODY {
        return respond(&mut stream, 413, "text/plain", "body too large\n");
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body)?;
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let param = |name: &str| {
        query.split('&').find_map(|kv| {
            kv.split_once('=')
                .filter(|(k, _)| *k == name)
                .map(|(_, v)| v.to_owned())
        })
    };
    match (method, path) {
        ("GET", "/health") => respond(&mut stream, 200, "text/plain", "ok\n"),
        ("GET", "/metrics") => {
            let cfg = router.config.load();
            let text =
                router
                    .metrics
                    .render(&router.fleet.load(), &router.index, cfg.policy.name());
            respond(&mut stream, 200, "text/plain; version=0.0.4", &text)
        }
        ("GET", "/admin/backends") => respond(
            &mut stream,
            200,
            "application/json",
            &backends_json(router).to_string(),
        ),
        ("POST", "/admin/drain") | ("POST", "/admin/undrain") => {
            let drain = path.ends_with("/drain");
            let Some(url) = param("backend") else {
                return respond(&mut stream, 400, "text/plain", "give ?backend=URL\n");
            };
            let url = url.replace("%3A", ":").replace("%2F", "/");
            let fleet = router.fleet.load();
            let Some(b) = fleet.backends.iter().find(|b| b.url == url) else {
                return respond(
                    &mut stream,
                    404,
                    "text/plain",
                    &format!("no backend {url}\n"),
                );
            };
            b.state.draining.store(drain, Relaxed);
            info!(backend = %b.url, drain, "backend drain changed by operator");
            respond(
                &mut stream,
                200,
                "application/json",
                &backends_json(router).to_string(),
            )
        }
        ("POST", "/admin/explain") => {
            let ep = param("endpoint").unwrap_or_else(|| "chat".into());
            let ep = match ep.as_str() {
                "completions" => Endpoint::Completions,
                "generate" => Endpoint::Generate,
                _ => Endpoint::Chat,
            };
            let (status, v) = explain(router, ep, &body);
            respond(&mut stream, status, "application/json", &v.to_string())
        }
        ("POST", "/admin/reload") => match reload() {
            Ok(()) => respond(
                &mut stream,
                200,
                "application/json",
                &backends_json(router).to_string(),
            ),
            Err(e) => respond(
                &mut stream,
                400,
                "text/plain",
                &format!("reload failed: {e:#}\n"),
            ),
        },
        _ => respond(&mut stream, 404, "text/plain", "not found\n"),
    }
}

fn backends_json(router: &Router) -> serde_json::Value {
    let fleet = router.fleet.load();
    let total = router.index.total_tracked().max(1) as f64;
    let list: Vec<_> = fleet
        .backends
        .iter()
        .map(|b| {
            let s = &b.state;
            let blocks = router.index.len(b.slot);
            json!({
                "url": b.url,
                "slot": b.slot,
                "healthy": s.healthy.load(Relaxed),
                "draining": s.draining.load(Relaxed),
                "in_flight": s.in_flight.load(Relaxed),
                "queued_prefill_blocks": s.queued_prefill_blocks.load(Relaxed),
                "open_connections": s.open_conns.load(Relaxed),
                "external_connections": s.external_conns.load(Relaxed),
                "resets_per_sec": s.rst_per_sec.load(Relaxed),
                "index_blocks": blocks,
                "index_share": blocks as f64 / total,
                "kv_blocks": s.kv_blocks.load(Relaxed),
                "learned_capacity_blocks": b.feedback.capacity(),
                "capacity_known": b.feedback.known_capacity.load(Relaxed) > 0,
                "prefill_blocks_per_s": b.feedback.prefill_rate(),
                "prediction": {
                    "reports": b.feedback.reports.load(Relaxed),
                    "predicted_blocks": b.feedback.predicted_blocks.load(Relaxed),
                    "reported_blocks": b.feedback.reported_blocks.load(Relaxed),
                    "error_blocks": b.feedback.error_blocks.load(Relaxed),
                    "over": b.feedback.over_predictions.load(Relaxed),
                    "under": b.feedback.under_predictions.load(Relaxed),
                    "flushes": b.feedback.flushes.load(Relaxed),
                },
                "requests": s.requests.load(Relaxed),
                "errors": s.errors.load(Relaxed),
            })
        })
        .collect();
    json!({ "policy": router.config.load().policy.name(), "backends": list })
}

/// Which backend a request body would go to now, and why. Changes nothing.
fn explain(router: &Router, ep: Endpoint, body: &[u8]) -> (u16, serde_json::Value) {
    let mut ex = Extractor::default();
    let mut scratch = RouteScratch::default();
    let p = match ex.extract(ep, body, &mut scratch.canonical) {
        Ok(p) => p,
        Err(e) => return (e.status(), json!({ "error": e.message })),
    };
    let mut blocks = PromptBlocks::default();
    let routed = router.route(
        &RouteRequest {
            seed: p.seed,
            session: p.user,
            has_prompt: true,
        },
        &mut scratch,
        &mut blocks,
    );
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
    (
        200,
        json!({
            "canonical_bytes": scratch.canonical.len(),
            "blocks": blocks.hashes.len(),
            "decision": routed.choice.decision,
            "matched_blocks": routed.choice.matched_blocks,
            "chosen": candidates.first(),
            "why": why,
            "candidates": scored,
            "fallbacks": candidates.get(1..).unwrap_or(&[]),
            "backends": backends_json(router)["backends"],
        }),
    )
}

/// One sentence on why the first candidate won.
fn why(
    policy: crate::select::Policy,
    routed: &crate::router::Routed,
    scores: &[crate::select::Score],
    fleet: &crate::backend::Fleet,
) -> String {
    use crate::select::{Decision, Policy};
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

fn respond(stream: &mut TcpStream, status: u16, ctype: &str, body: &str) -> anyhow::Result<()> {
    write!(
        stream,
        "HTTP/1.1 {status} {}\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        crate::error::reason(status),
        body.len()
    )?;
    Ok(())
}
