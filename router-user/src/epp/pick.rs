//! The pick: the request's body through the one routing core
//! (`Router::route`), admission on the chosen backend (the in-flight count
//! the proxy keeps, exactly), what was sent learned. The same steps as the
//! proxy's request path up to the send, which is the gateway's.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::classes::Caller;
use crate::config::{Config, ms};
use crate::error::{Kind, RouterError};
use crate::fleet::backend::{Backend, InFlight};
use crate::fleet::models::ModelStats;
use crate::fleet::owners::BackendSet;
use crate::fleet::stored;
use crate::http::request::{api_key, header_value};
use crate::policy::select::Decision;
use crate::prompt::extract::{Class, Endpoint};
use crate::shared::{PromptBlocks, RouteQuery, RouteScratch, Router, TokensFrom};

/// How often a pick waiting for room under the in-flight limit looks again
/// (atomic loads, and a new ranking only when some backend has room); the
/// proxy's queue polls as often.
const QUEUE_POLL: Duration = Duration::from_millis(1);

/// What the head of a request says, as routing reads it.
pub struct Head<'a> {
    pub method: &'a str,
    pub path: &'a str,
    /// The headers as an HTTP/1 head (`wire::as_head`).
    pub lines: &'a [u8],
    /// `x-session-id`, hashed.
    pub session: Option<u64>,
}

/// A request picked and admitted: counted in flight on its backend until
/// this drops, as the proxy counts one it sends.
pub struct Picked {
    pub backend: Arc<Backend>,
    /// The chosen endpoint first, then the fallbacks (`epp.fallbacks`).
    pub endpoints: Vec<SocketAddr>,
    pub inflight: InFlight,
    pub model: Arc<ModelStats>,
    pub matched_blocks: u32,
    pub shared_blocks: u32,
    pub prefill_blocks: u32,
    /// Prefill queued on the backend before this request (a TTFT taken
    /// behind a queue says nothing of the engine's rate).
    pub queued_ahead: u32,
    /// The replicas' id of the request, when they were told of it.
    pub shared_as: Option<u64>,
    /// It continues or reads a stored response: its engine was not ranked
    /// for its prompt, and its usage says nothing of the router's guess.
    pub pinned: bool,
    /// Its answer will be stored by the engine (`/v1/responses`, `store`):
    /// the id is read from the answer.
    pub stores: bool,
}

/// Where a request may go: the gateway's subset hint as backend slots.
/// `Err`: a hint naming no backend of the fleet (the protocol's 503).
pub fn subset(router: &Router, hint: Option<&[String]>) -> Result<Option<BackendSet>, RouterError> {
    let Some(hint) = hint else {
        return Ok(None);
    };
    let addrs: Vec<SocketAddr> = hint.iter().filter_map(|s| s.parse().ok()).collect();
    let mut set = BackendSet::default();
    for b in &router.fleet.load().backends {
        if addrs.contains(&b.addr) {
            set.insert(b.slot);
        }
    }
    if set.is_empty() {
        return Err(RouterError::new(
            Kind::Unavailable,
            "no endpoint of the gateway's subset hint (x-gateway-destination-endpoint-subset) is in the pool",
        ));
    }
    Ok(Some(set))
}

/// Picks a backend for the request and admits it there; waits for room up
/// to `timeouts.queue_ms` (`classes.flex_wait_ms` for `flex`) when every
/// backend is at its in-flight limit, then answers 503 (429 for `flex`).
pub async fn pick(
    router: &Router,
    head: &Head<'_>,
    body: &[u8],
    only: Option<&BackendSet>,
    scratch: &mut RouteScratch,
    blocks: &mut PromptBlocks,
) -> Result<Picked, RouterError> {
    let cfg = router.config.load_full();
    let endpoint = Endpoint::from_path(head.method, head.path.split('?').next().unwrap_or(""));
    let by_model = endpoint.is_none()
        && head.method == "POST"
        && cfg.routes.extra_allowed.iter().any(|p| p == head.path);
    let started = Instant::now();
    let mut deadline = None;
    // The engine that stored the response the request names, once read.
    let mut pin: Option<Option<(String, u64)>> = None;
    loop {
        let again = Instant::now();
        let query = RouteQuery {
            endpoint,
            body,
            session: head.session,
            tokens: TokensFrom::Worker(None),
            scanned: None,
            by_model,
            caller: caller(&cfg, head.lines),
            only,
        };
        let mut routed = router.route(&query, scratch, blocks)?;
        if pin.is_none() {
            pin = Some(stored_pin(router, head.path, endpoint, scratch)?);
        }
        if let Some(Some((id, backend))) = &pin {
            apply_pin(&cfg, &mut routed, id, *backend, blocks.hashes.len() as u32)?;
        }
        let placed = scratch.placed();
        let cap = cfg
            .classes
            .max_in_flight(placed.class, cfg.limits.max_in_flight_per_backend);
        let deadline = *deadline.get_or_insert_with(|| {
            started
                + ms(if placed.class == Class::Flex {
                    cfg.classes.flex_wait_ms
                } else {
                    cfg.timeouts.queue_ms
                })
        });
        router
            .metrics
            .observe_routing(&routed.choice, again.elapsed());
        for (i, pos) in routed.choice.iter().enumerate() {
            let backend = &routed.fleet.backends[pos];
            let prompt_blocks = blocks.hashes.len() as u32;
            let (matched, shared, prefill) = if i == 0 {
                let c = &routed.choice;
                (c.matched_blocks, c.shared_blocks, c.prefill_blocks)
            } else {
                (0, 0, prompt_blocks)
            };
            let queued_ahead = backend.load.queued_prefill_blocks();
            let Some(mut inflight) = backend.admit(cap, prefill, prompt_blocks) else {
                continue;
            };
            // Admitted first, so routing counts it there while it waits.
            wait_for_prefill(router, &cfg, backend, &blocks.hashes, matched).await;
            if let Some(stamp) = router.learn(backend, blocks, matched, prefill) {
                let computing = blocks.hashes.get(matched as usize).map(|&h| (matched, h));
                inflight.pin(stamp, computing);
            }
            inflight.hold_slot(blocks.slot);
            routed.model.requested();
            let endpoints = std::iter::once(backend.addr)
                .chain(
                    routed
                        .choice
                        .iter()
                        .filter(|&p| p != pos)
                        .take(cfg.epp.fallbacks)
                        .map(|p| routed.fleet.backends[p].addr),
                )
                .collect();
            if started.elapsed() > again.elapsed() {
                router
                    .metrics
                    .observe_queue(started.elapsed().saturating_sub(again.elapsed()));
            }
            return Ok(Picked {
                backend: backend.clone(),
                endpoints,
                inflight,
                model: routed.model.clone(),
                matched_blocks: matched,
                shared_blocks: shared,
                prefill_blocks: prefill,
                queued_ahead,
                shared_as: blocks.shared_as,
                pinned: routed.choice.decision == Decision::Stored,
                stores: endpoint == Some(Endpoint::Responses) && scratch.canon().stores(),
            });
        }
        let some_up = routed.fleet.backends.iter().any(|b| b.health.is_up());
        if cap == 0 || !some_up || Instant::now() >= deadline {
            return Err(refusal(
                &cfg,
                router,
                placed.class,
                placed.tenant,
                cap > 0 && some_up,
            ));
        }
        // Every backend it may go to is at its in-flight limit: wait for
        // room (atomic loads), then rank again.
        while Instant::now() < deadline
            && !routed
                .fleet
                .backends
                .iter()
                .any(|b| b.has_room(cap) && only.is_none_or(|o| o.contains(b.slot)))
        {
            tokio::time::sleep(QUEUE_POLL).await;
        }
    }
}

/// The stored response a request names (`/v1/responses/{id}...`, or the
/// `previous_response_id` routing just read) and the engine that stored
/// it; 404 when no engine here is known to have.
fn stored_pin(
    router: &Router,
    path: &str,
    endpoint: Option<Endpoint>,
    scratch: &RouteScratch,
) -> Result<Option<(String, u64)>, RouterError> {
    let path = path.split('?').next().unwrap_or(path);
    let id = match endpoint {
        None => match stored::id_in_path(path) {
            Some(id) => id.to_owned(),
            None => return Ok(None),
        },
        Some(_) => {
            let previous = scratch.canon().previous_response();
            if previous.is_empty() {
                return Ok(None);
            }
            String::from_utf8_lossy(previous).into_owned()
        }
    };
    match router.stored.backend_of(&id) {
        Some(b) => Ok(Some((id, b))),
        None => Err(not_stored(&id, "no engine here is known to have stored it")),
    }
}

/// Sends a request naming a stored response to the engine that stored it
/// and no other, as the proxy does: a 404 when it left the fleet or is
/// down, no candidate while it has no room (the pick waits for it).
fn apply_pin(
    cfg: &Config,
    routed: &mut crate::shared::Routed,
    id: &str,
    backend: u64,
    prompt_blocks: u32,
) -> Result<(), RouterError> {
    if routed.pin_stored(backend, cfg.limits.max_in_flight_per_backend, prompt_blocks) {
        Ok(())
    } else {
        Err(not_stored(id, "the engine that stored it is gone"))
    }
}

/// OpenAI's answer for an id no engine here holds.
fn not_stored(id: &str, why: &str) -> RouterError {
    RouterError::new(
        Kind::NotFound,
        format!("Response with id '{id}' not found: {why}"),
    )
}

/// How often a pick waiting for another request's prefill looks again.
const PREFILL_POLL: Duration = Duration::from_millis(1);

/// Holds the pick while the backend is still computing, for another
/// request in flight, blocks this one was predicted to find cached there,
/// as the proxy holds the send (decision 0027): named now, the engine
/// would compute them twice. It goes when that request's first token came
/// back (or it ended), or after `prefix.prefill_wait_ms`.
async fn wait_for_prefill(
    router: &Router,
    cfg: &Config,
    backend: &Backend,
    hashes: &[u64],
    matched: u32,
) {
    let load = &backend.load;
    if cfg.prefix.prefill_wait_ms == 0 || matched == 0 || !load.computing_within(hashes, matched) {
        return;
    }
    let started = Instant::now();
    let deadline = started + ms(cfg.prefix.prefill_wait_ms);
    while Instant::now() < deadline && load.computing_within(hashes, matched) {
        tokio::time::sleep(PREFILL_POLL).await;
    }
    router.metrics.observe_prefill_wait(started.elapsed());
}

/// The answer when no backend took the request: a `flex` request that
/// waited its turn is shed (429), any other request is a 503.
fn refusal(
    cfg: &Config,
    router: &Router,
    class: Class,
    tenant: Option<u16>,
    waited: bool,
) -> RouterError {
    if waited && class == Class::Flex {
        let tenant = cfg.classes.tenant_name(tenant);
        router.metrics.shed(class, tenant);
        return RouterError::new(
            Kind::Shed,
            format!(
                "the engines stayed busy for {} ms (classes.flex_wait_ms) while this {} request waited; try again later",
                cfg.classes.flex_wait_ms,
                class.name()
            ),
        );
    }
    if waited {
        return RouterError::new(
            Kind::Unavailable,
            format!(
                "every backend stayed at its in-flight limit ({}, limits.max_in_flight_per_backend) for {} ms (timeouts.queue_ms)",
                cfg.limits.max_in_flight_per_backend, cfg.timeouts.queue_ms
            ),
        );
    }
    RouterError::new(
        Kind::Unavailable,
        "no backend is up: every backend is unhealthy, draining or at its in-flight limit",
    )
}

/// What the head says of the caller, read only when `[classes]` asks.
fn caller<'a>(cfg: &Config, lines: &'a [u8]) -> Caller<'a> {
    let classes = &cfg.classes;
    if !classes.reads_caller() {
        return Caller::default();
    }
    Caller {
        header: (!classes.header.is_empty())
            .then(|| header_value(lines, &classes.header))
            .flatten(),
        key: classes.reads_keys().then(|| api_key(lines)).flatten(),
    }
}
