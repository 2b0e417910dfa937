//! The request path, in one place: route a request read whole, send it to
//! the first candidate, learn what was sent, re-send only where no backend
//! can have processed it, and report what the answer says of the backend.
//! `forward` below it is transport only.

use std::time::{Duration, Instant};

use tracing::warn;

use crate::config::{Config, ms};
use crate::error::{Kind, Resend, RouterError};
use crate::proxy::api;
use crate::proxy::client::{Body, ClientConn, Request};
use crate::proxy::forward::{self, Attempt, Failure};
use crate::proxy::io::write_all;
use crate::proxy::worker::Worker;
use crate::route::models::ModelStats;
use crate::route::select::SHARED_MIN_BLOCKS;
use crate::router::{RouteQuery, Routed};

/// How often a request queued for room under `limits.max_in_flight_per_backend`
/// checks the backends' in-flight counters (atomic loads; it routes again only
/// when one has room). 1 ms is short next to a generation and cheap to poll.
const QUEUE_POLL: Duration = Duration::from_millis(1);

/// Routes a request read whole and sends it, with re-sends where the
/// delivery rule allows them. `Ok(true)` when the client connection must
/// close (close-delimited response).
pub async fn handle(
    worker: &Worker,
    cfg: &Config,
    c: &mut ClientConn,
    req: Request<'_>,
) -> Result<bool, RouterError> {
    let router = &worker.router;
    api::check_route(req.head, &c.fwd, &cfg.routes.extra_allowed)?;
    // Until some backend's models are known (discovery off, engines that
    // do not list them, or before the first answer) `/v1/models` is
    // forwarded to a backend, as any request.
    if api::answers_itself(req.head, &c.fwd) && router.models.table().knows_models() {
        let head_only = req.head.method(&c.fwd) == "HEAD";
        let close = !req.head.keep_alive;
        let mut resp = api::models_answer(
            &router.models.table(),
            &router.fleet.load(),
            head_only,
            close,
        );
        let sent = write_all(&mut c.stream, &mut resp, ms(cfg.timeouts.client_write_ms)).await;
        return Ok(close || sent.is_err());
    }
    let deadline = Instant::now() + ms(cfg.timeouts.queue_ms);
    let mut head_finished = false;
    // Sends so far, the reason for the next one, and whether the first paid
    // into the retry budget; kept across re-routing after slot races.
    let mut attempts = 0;
    let mut resend: Option<Resend> = None;
    let mut deposited = false;
    loop {
        let started = Instant::now();
        let mut routed = route_once(worker, c, req)?;
        // The router's own time: from the request read to the first
        // decision, plus each decision again after waiting; the wait itself
        // is the queue's.
        let mut routing = if attempts == 0 {
            req.read_at.elapsed()
        } else {
            started.elapsed()
        };
        let queued = routed.choice.len == 0 && queueable(cfg, &routed);
        if queued {
            // Every up backend is at `limits.max_in_flight_per_backend`: wait
            // for room (atomic loads only), then route again, until `queue_ms`.
            let waiting = Instant::now();
            while routed.choice.len == 0 && Instant::now() < deadline {
                monoio::time::sleep(QUEUE_POLL).await;
                if has_room(cfg, &routed) {
                    let again = Instant::now();
                    routed = route_once(worker, c, req)?;
                    routing += again.elapsed();
                }
            }
            router
                .metrics
                .observe_queue(waiting.elapsed().saturating_sub(routing));
        }
        router.metrics.observe_routing(&routed.choice, routing);
        routed.model.requested();
        if routed.choice.len == 0 {
            return Err(if queued {
                at_limit(cfg)
            } else {
                RouterError::new(
                    Kind::Unavailable,
                    "no backend is up: every backend is unhealthy, draining or at its in-flight limit",
                )
            });
        }
        if !head_finished {
            forward::finish_request_head(c, req.head, req.body);
            head_finished = true;
        }
        // Every send counts toward `retry.max_attempts` and, after the
        // first, takes a token from the retry budget: a re-send is only ever
        // of a request no backend can have processed (see `forward`).
        let mut last = None;
        let mut full = false;
        let mut i = 0;
        let mut fresh_only = false;
        while i < routed.choice.len && attempts < cfg.retry.max_attempts {
            if let Some(reason) = resend {
                if !router.retry_budget.withdraw() {
                    warn!(
                        reason = reason.name(),
                        "retry budget spent: not re-sending (retry.budget_percent)"
                    );
                    break;
                }
            } else if !deposited {
                router.retry_budget.deposit();
                deposited = true;
            }
            let pos = usize::from(routed.choice.candidates[i]);
            let backend = routed.fleet.backends[pos].clone();
            let (matched, shared, everywhere) = if i == 0 {
                let c = &routed.choice;
                (c.matched_blocks, c.shared_blocks, c.everywhere_blocks)
            } else {
                (0, 0, 0)
            };
            let at = Attempt {
                backend: &backend,
                matched_blocks: matched,
                shared_blocks: shared,
                everywhere_blocks: everywhere,
                decision: routed.choice.decision,
                fresh_only,
            };
            let sent = attempt(worker, cfg, c, req, &at, &routed.model).await;
            if !matches!(sent, Err(Failure::Full))
                && let Some(reason) = resend.take()
            {
                router.metrics.resent(reason);
            }
            match sent {
                Ok(close) => return Ok(close),
                Err(Failure::Retry(e, reason)) => {
                    attempts += 1;
                    warn!(backend = %backend.url, attempts, reason = reason.name(), error = %e, "attempt failed before the backend could have processed the request; it may be sent again");
                    resend = Some(reason);
                    // A stale pooled connection: the same backend, on a fresh one.
                    fresh_only = reason == Resend::StalePooled;
                    if !fresh_only {
                        i += 1;
                    }
                    last = Some(e);
                }
                Err(Failure::Answer(e) | Failure::Unanswered(e)) => return Err(e),
                Err(Failure::BrokeMidStream(_) | Failure::ClientGone) => return Ok(true),
                Err(Failure::Full) => {
                    full = true;
                    i += 1;
                }
            }
        }
        match last {
            // Lost every slot race: queue again while `queue_ms` lasts.
            None if full && Instant::now() < deadline => continue,
            None if full => return Err(at_limit(cfg)),
            last => {
                return Err(last.unwrap_or_else(|| {
                    RouterError::new(Kind::BadGateway, "no backend could be reached")
                }));
            }
        }
    }
}

/// One send to one backend: admission, learning what was sent, the
/// transport, then what the answer teaches (cached tokens, prefill time)
/// and says of the backend's health. `Ok(true)`: the client connection must
/// close afterwards.
async fn attempt(
    worker: &Worker,
    cfg: &Config,
    c: &mut ClientConn,
    req: Request<'_>,
    at: &Attempt<'_>,
    model: &ModelStats,
) -> Result<bool, Failure> {
    let router = &worker.router;
    let backend = at.backend;
    let prompt_blocks = c.blocks.hashes.len() as u32;
    // What it will prefill: the blocks it lacks, and (with
    // `prefix.expect_lost_history`) the share of a private lead its answers
    // say it loses by the next turn, as selection predicted it, so the
    // queue ahead of later requests counts it too.
    let lead = if cfg.prefix.expects_lost_history() && at.everywhere_blocks >= SHARED_MIN_BLOCKS {
        at.matched_blocks.saturating_sub(at.shared_blocks)
    } else {
        0
    };
    let uncached = prompt_blocks.saturating_sub(at.matched_blocks)
        + ((1.0 - backend.feedback.private_kept()).clamp(0.0, 1.0) * f64::from(lead)).round()
            as u32;
    // Prefill work ahead of this request, for learning the engine's rate.
    let queued_ahead = backend.load.queued_prefill_blocks();
    // Routing saw room, but workers route concurrently: admission holds the
    // limit exactly, and a request that lost the race tries the next candidate.
    let Some(mut inflight) = backend.admit(
        cfg.limits.max_in_flight_per_backend,
        uncached,
        prompt_blocks,
    ) else {
        return Err(Failure::Full);
    };
    // Admitted first, so that routing counts it on this backend while it
    // waits: else the whole burst would wait here, then land at once.
    wait_for_prefill(worker, cfg, c, at).await;
    let sent_at = Instant::now();
    if let Some(stamp) = router.learn(backend, &mut c.blocks) {
        // What the engine computes for it starts where the prediction ends.
        let computing = c
            .blocks
            .hashes
            .get(at.matched_blocks as usize)
            .map(|&h| (at.matched_blocks, h));
        inflight.pin(stamp, computing);
    }
    inflight.hold_slot(c.blocks.slot);
    let sent = forward::forward(&worker.pool, cfg, c, req, at, &mut inflight).await;
    drop(inflight);
    let answer = match sent {
        Ok(a) => a,
        Err(f) => {
            if let Some(why) = f.backend_fault() {
                router.request_failed(backend, why);
            }
            if matches!(f, Failure::Unanswered(_)) {
                router.metrics.unanswered();
            }
            return Err(f);
        }
    };
    if (200..300).contains(&answer.status) {
        if let Some(u) = answer.usage {
            router.observe_answer(backend, &c.blocks, at.matched_blocks, at.shared_blocks, u);
            model.usage(u.prompt_tokens, u.cached_tokens);
        }
        if answer.streaming
            && let Some(t) = answer.first_body_at
        {
            model.ttft((t - sent_at).as_secs_f64());
        }
        // Only a request that found no prefill queued ahead says how fast
        // the engine prefills; behind a queue it measures the queue.
        if answer.streaming
            && queued_ahead == 0
            && let Some(t) = answer.first_body_at
        {
            backend
                .feedback
                .observe_ttft(uncached, (t - sent_at).as_secs_f64());
        }
    }
    if answer.status >= 500 {
        router.request_failed(backend, "5xx answer");
    } else {
        backend.health.request_succeeded();
    }
    backend.stats.responded(answer.status);
    Ok(answer.close_client)
}

/// How often a request waiting for another's prefill looks again.
const PREFILL_POLL: Duration = Duration::from_millis(1);

/// Holds the request while the backend is still computing, for another
/// request in flight, blocks it was predicted to find cached there (a
/// burst of new conversations on one system prompt): sent now, the engine
/// would compute them twice, as an engine caches a block only once it has
/// computed it. It goes when that request's first token comes back (or it
/// ends), or after `prefix.prefill_wait_ms`.
async fn wait_for_prefill(worker: &Worker, cfg: &Config, c: &ClientConn, at: &Attempt<'_>) {
    let load = &at.backend.load;
    if cfg.prefix.prefill_wait_ms == 0
        || at.matched_blocks == 0
        || !load.computing_within(&c.blocks.hashes, at.matched_blocks)
    {
        return;
    }
    let started = Instant::now();
    let deadline = started + ms(cfg.prefix.prefill_wait_ms);
    while Instant::now() < deadline && load.computing_within(&c.blocks.hashes, at.matched_blocks) {
        monoio::time::sleep(PREFILL_POLL).await;
    }
    worker
        .router
        .metrics
        .observe_prefill_wait(started.elapsed());
}

/// The 503 for a request that waited `timeouts.queue_ms` without room.
fn at_limit(cfg: &Config) -> RouterError {
    RouterError::new(
        Kind::Unavailable,
        format!(
            "every backend stayed at its in-flight limit ({}, limits.max_in_flight_per_backend) for {} ms (timeouts.queue_ms)",
            cfg.limits.max_in_flight_per_backend, cfg.timeouts.queue_ms
        ),
    )
}

/// Ranks the backends for the request through the one routing entry point
/// (`Router::route`, which `/admin/explain` calls too). Synchronous: the
/// worker's scratch is never borrowed across an await, so a queued request
/// routes again from its body.
fn route_once(
    worker: &Worker,
    c: &mut ClientConn,
    req: Request<'_>,
) -> Result<Routed, RouterError> {
    let endpoint = api::endpoint(req.head, &c.fwd);
    let ClientConn {
        buf, body, blocks, ..
    } = c;
    let query = RouteQuery {
        endpoint,
        body: match req.body {
            Body::InBuf { start, end } => &buf[start..end],
            Body::Decoded => body,
        },
        session: req.head.session,
    };
    let mut scratch = worker.scratch.borrow_mut();
    worker.router.route(&query, &mut scratch, blocks)
}

/// Whether a request that found no candidate should wait: some backend is up
/// and only its in-flight limit keeps it out.
fn queueable(cfg: &Config, routed: &Routed) -> bool {
    cfg.limits.max_in_flight_per_backend > 0
        && cfg.timeouts.queue_ms > 0
        && routed.fleet.backends.iter().any(|b| b.health.is_up())
}

/// Whether an up backend has room under its in-flight limit now.
fn has_room(cfg: &Config, routed: &Routed) -> bool {
    let max = cfg.limits.max_in_flight_per_backend;
    routed.fleet.backends.iter().any(|b| b.has_room(max))
}
