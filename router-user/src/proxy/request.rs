//! The request path, in one place: route a request read whole, send it to
//! the first candidate, learn what was sent, re-send only where no backend
//! can have processed it, and report what the answer says of the backend.
//! `forward` below it is transport only.

use std::time::{Duration, Instant};

use monoio::io::AsyncReadRent;
use tracing::warn;

use crate::config::{Config, ms};
use crate::error::{Kind, Resend, RouterError};
use crate::fleet::backend::Backend;
use crate::fleet::feedback::{Lesson, Reported};
use crate::fleet::models::ModelStats;

use crate::config::classes::{Caller, Placed};
use crate::fleet::stored;
use crate::http::request::{api_key, header_value};
use crate::policy::select::Decision;
use crate::precise::keys::EngineTokens;
use crate::prompt::extract::Class;
use crate::proxy::api;
use crate::proxy::client::{Body, ClientConn, Request};
use crate::proxy::forward::{self, Attempt, Failure};
use crate::proxy::io::write_all;
use crate::proxy::priority_field::Insert;
use crate::proxy::worker::Worker;
use crate::shared::{RouteQuery, Routed, Scanned, TokensFrom};

/// How often a request queued for room under `limits.max_in_flight_per_backend`
/// checks the backends' in-flight counters (atomic loads; it routes again only
/// when one has room). 1 ms is short next to a generation and cheap to poll.
const QUEUE_POLL: Duration = Duration::from_millis(1);

/// How often a waiting request checks that its client is still there (one
/// `recv(MSG_PEEK)`): a client that gives up frees its place within this.
const CLIENT_CHECK: Duration = Duration::from_millis(10);

/// Polls in a row a waiting request may see room that the first of its
/// class leaves untaken before it takes it itself: the first may be
/// waiting for other backends (another model's), and room must not idle.
/// The first takes room within a poll or two when it can.
const ROOM_UNTAKEN_POLLS: u32 = 20;

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
    let (tokens, mut scanned) = offload_tokens(worker, cfg, c, req).await;
    let mut deadline = Instant::now() + ms(cfg.timeouts.queue_ms);
    let mut head_finished = false;
    let mut tries = Tries::default();
    // `/v1/responses/{id}...`: only the engine that stored it knows it.
    let path_id = api::endpoint(req.head, &c.fwd)
        .is_none()
        .then(|| stored::id_in_path(req.head.path(&c.fwd)).map(str::to_owned))
        .flatten();
    let mut pin = None;
    loop {
        let started = Instant::now();
        let mut routed = route_once(worker, c, req, tokens.as_ref(), scanned.take())?;
        if tries.attempts == 0 && !tries.full {
            pin = stored_pin(worker, path_id.as_deref())?;
        }
        if let Some(p) = &pin {
            p.apply(cfg, &mut routed, c.blocks.hashes.len() as u32)?;
        }
        let placed = worker.scratch.borrow().placed();
        let class = placed.class;
        let cap = cfg
            .classes
            .max_in_flight(class, cfg.limits.max_in_flight_per_backend);
        if tries.attempts == 0 && !tries.full && class == Class::Flex {
            deadline = Instant::now() + ms(cfg.classes.flex_wait_ms);
        }
        // The router's own time: from the request read to the first
        // decision, plus each decision again after waiting; the wait itself
        // is the queue's.
        let mut routing = if tries.attempts == 0 {
            req.read_at.elapsed()
        } else {
            started.elapsed()
        };
        // A new request of a class that has requests waiting waits behind
        // them, in its tenant's turn, rather than take room that frees.
        let behind = cap > 0
            && tries.attempts == 0
            && !tries.full
            && routed.choice.len > 0
            && router.admission.waiting(class) > 0;
        let queued = (routed.choice.len == 0 || behind)
            && (pin.is_some() || queueable(cap, deadline, &routed));
        if queued {
            if behind {
                routed.choice.len = 0;
            }
            // Every up backend is at its in-flight limit for this class: wait
            // for room (atomic loads only) and the tenant's turn, then route
            // again, until the deadline (`queue_ms`, `classes.flex_wait_ms`).
            let tenant = cfg.classes.tenant_name(placed.tenant);
            let Some(place) = router.admission.enter(
                class,
                placed.tenant,
                cfg.classes.weight(placed.tenant),
                cfg.classes.max_waiting_of(placed.tenant),
            ) else {
                return Err(queue_full(cfg, router, placed));
            };
            let waiting = Instant::now();
            let _counted = router.metrics.class_waiting(class, tenant);
            let mut checked = waiting;
            let mut room_polls = 0u32;
            while routed.choice.len == 0 && Instant::now() < deadline {
                monoio::time::sleep(QUEUE_POLL).await;
                if checked.elapsed() >= CLIENT_CHECK {
                    checked = Instant::now();
                    if client_gone(&c.stream) {
                        // Its place goes to the next at once (`place` dropped).
                        router.metrics.class_left(class, tenant, waiting.elapsed());
                        return Ok(true);
                    }
                }
                if !has_room(cap, &routed) || router.waits_above(class) {
                    room_polls = 0;
                    continue;
                }
                room_polls += 1;
                if place.is_first() || room_polls > ROOM_UNTAKEN_POLLS {
                    let again = Instant::now();
                    routed = route_once(worker, c, req, tokens.as_ref(), None)?;
                    if let Some(p) = &pin {
                        p.apply(cfg, &mut routed, c.blocks.hashes.len() as u32)?;
                    }
                    routing += again.elapsed();
                }
            }
            if routed.choice.len > 0 {
                place.let_in();
            }
            let waited = waiting.elapsed();
            router.metrics.observe_queue(waited.saturating_sub(routing));
            router.metrics.class_waited(class, tenant, waited);
        }
        router.metrics.observe_routing(&routed.choice, routing);
        routed.model.requested();
        if routed.choice.len == 0 {
            return Err(if queued && class == Class::Flex {
                shed(cfg, router, class, cfg.classes.tenant_name(placed.tenant))
            } else if queued {
                at_limit(cfg)
            } else {
                RouterError::new(
                    Kind::Unavailable,
                    "no backend is up: every backend is unhealthy, draining or at its in-flight limit",
                )
            });
        }
        if !head_finished {
            let insert = engine_priority(cfg, worker, c, req, class);
            forward::finish_request_head(c, req.head, req.body, insert.as_ref());
            head_finished = true;
        }
        tries.new_round();
        // The engine keeps the answer under its id: read it on the way.
        let stores_answer = api::endpoint(req.head, &c.fwd)
            == Some(crate::prompt::extract::Endpoint::Responses)
            && worker.scratch.borrow().canon().stores();
        let mut i = 0;
        while i < routed.choice.len && tries.attempts < cfg.retry.max_attempts {
            if !tries.may_send(worker) {
                break;
            }
            let pos = usize::from(routed.choice.candidates[i]);
            let backend = routed.fleet.backends[pos].clone();
            let prompt_blocks = c.blocks.hashes.len() as u32;
            // Routing predicted the first candidate's work; a fallback is
            // sent the whole prompt as far as the router knows.
            let at = if i == 0 {
                let ch = &routed.choice;
                Attempt {
                    backend: &backend,
                    matched_blocks: ch.matched_blocks,
                    shared_blocks: ch.shared_blocks,
                    prefill_blocks: ch.prefill_blocks,
                    decision: ch.decision,
                    fresh_only: tries.fresh_only,
                    stores_answer,
                    max_in_flight: cap,
                }
            } else {
                Attempt {
                    backend: &backend,
                    matched_blocks: 0,
                    shared_blocks: 0,
                    prefill_blocks: prompt_blocks,
                    decision: routed.choice.decision,
                    fresh_only: tries.fresh_only,
                    stores_answer,
                    max_in_flight: cap,
                }
            };
            let sent = attempt(worker, cfg, c, req, &at, &routed.model).await;
            match tries.after(worker, &backend, sent) {
                Next::Done(result) => return result,
                Next::SameBackend => {}
                Next::OtherCandidate => i += 1,
            }
        }
        match tries.last.take() {
            // Lost every slot race: queue again while `queue_ms` lasts.
            None if tries.full && Instant::now() < deadline => continue,
            None if tries.full && class == Class::Flex => {
                return Err(shed(
                    cfg,
                    router,
                    class,
                    cfg.classes.tenant_name(placed.tenant),
                ));
            }
            None if tries.full => return Err(at_limit(cfg)),
            // The engine that stored the response cannot be reached: it
            // is gone, and what it stored with it.
            Some(_) if pin.is_some() => {
                return Err(pin.as_ref().map_or_else(
                    || RouterError::new(Kind::Internal, "pinned"),
                    StoredPin::gone,
                ));
            }
            last => {
                return Err(last.unwrap_or_else(|| {
                    RouterError::new(Kind::BadGateway, "no backend could be reached")
                }));
            }
        }
    }
}

/// The `priority` field `classes.engine_priority` adds to the request's
/// body for its class: on the inference APIs, when the class's value is
/// not 0 and the client sent none (theirs stands).
fn engine_priority(
    cfg: &Config,
    worker: &Worker,
    c: &ClientConn,
    req: Request<'_>,
    class: Class,
) -> Option<Insert> {
    use crate::prompt::extract::Endpoint;
    let value = cfg.classes.engine_priority?.of(class);
    let inference = matches!(
        api::endpoint(req.head, &c.fwd)?,
        Endpoint::Chat | Endpoint::Completions | Endpoint::Messages | Endpoint::Responses
    );
    if value == 0 || !inference || worker.scratch.borrow().canon().priority_given() {
        return None;
    }
    let insert = Insert::priority(c.body_bytes(req.body), value);
    if insert.is_none() {
        // The scan read it as an object: only a long run of whitespace
        // before its brace gets here.
        tracing::debug!("the body opens too late to add its engine priority; sent as it is");
    }
    insert
}

/// The retry state of one request, kept across re-routing after slot
/// races: sends so far, the reason for the next one, whether the first
/// paid into the retry budget, and how the last round ended.
#[derive(Default)]
struct Tries {
    /// Sends that failed before the backend could have processed them;
    /// each counts toward `retry.max_attempts`.
    attempts: usize,
    /// Why the next send is a re-send (none before the first failure).
    resend: Option<Resend>,
    /// The first send paid into the retry budget.
    deposited: bool,
    /// The next send takes a fresh connection (a pooled one just failed).
    fresh_only: bool,
    /// Some candidate of this round was at its in-flight limit.
    full: bool,
    /// The last re-sendable failure, answered when no send is left.
    last: Option<RouterError>,
}

/// What `handle` does after one send.
enum Next {
    /// Answer the client: `Ok(close)` or the error.
    Done(Result<bool, RouterError>),
    /// Send again to the same backend (on a fresh connection).
    SameBackend,
    OtherCandidate,
}

impl Tries {
    /// Whether another send may go: the first pays into the retry budget,
    /// a re-send takes a token from it (a re-send is only ever of a request
    /// no backend can have processed; see `forward`).
    fn may_send(&mut self, worker: &Worker) -> bool {
        let budget = &worker.router.retry_budget;
        if let Some(reason) = self.resend {
            if !budget.withdraw() {
                warn!(
                    reason = reason.name(),
                    "retry budget spent: not re-sending (retry.budget_percent)"
                );
                return false;
            }
        } else if !self.deposited {
            budget.deposit();
            self.deposited = true;
        }
        true
    }

    /// A round over a fresh ranking (after lost slot races) starts on
    /// pooled connections and with no candidate known full.
    fn new_round(&mut self) {
        self.full = false;
        self.fresh_only = false;
    }

    /// Takes in one send's outcome.
    fn after(&mut self, worker: &Worker, backend: &Backend, sent: Result<bool, Failure>) -> Next {
        if !matches!(sent, Err(Failure::Full))
            && let Some(reason) = self.resend.take()
        {
            worker.router.metrics.resent(reason);
        }
        match sent {
            Ok(close) => Next::Done(Ok(close)),
            Err(Failure::Retry(e, reason)) => {
                self.attempts += 1;
                let attempts = self.attempts;
                warn!(backend = %backend.url, attempts, reason = reason.name(), error = %e, "attempt failed before the backend could have processed the request; it may be sent again");
                self.resend = Some(reason);
                self.fresh_only = reason == Resend::StalePooled;
                self.last = Some(e);
                if self.fresh_only {
                    Next::SameBackend
                } else {
                    Next::OtherCandidate
                }
            }
            Err(Failure::Answer(e) | Failure::Unanswered(e)) => Next::Done(Err(e)),
            Err(Failure::BrokeMidStream(_) | Failure::ClientGone) => Next::Done(Ok(true)),
            Err(Failure::Full) => {
                self.full = true;
                Next::OtherCandidate
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
    // What it will prefill, as selection predicted it, so the queue ahead
    // of later requests counts it too.
    let uncached = at.prefill_blocks;
    // Prefill work ahead of this request, for learning the engine's rate.
    let queued_ahead = backend.load.queued_prefill_blocks();
    // Routing saw room, but workers route concurrently: admission holds the
    // limit exactly, and a request that lost the race tries the next candidate.
    let Some(mut inflight) = backend.admit(at.max_in_flight, uncached, prompt_blocks) else {
        return Err(Failure::Full);
    };
    // Admitted first, so that routing counts it on this backend while it
    // waits: else the whole burst would wait here, then land at once.
    wait_for_prefill(worker, cfg, c, at).await;
    let sent_at = Instant::now();
    if let Some(stamp) = router.learn(backend, &mut c.blocks, at.matched_blocks, uncached) {
        // What the engine computes for it starts where the prediction ends.
        let computing = c
            .blocks
            .hashes
            .get(at.matched_blocks as usize)
            .map(|&h| (at.matched_blocks, h));
        inflight.pin(stamp, computing);
    }
    inflight.hold_slot(c.blocks.slot);
    let shared = router
        .replica
        .as_deref()
        .zip(c.blocks.shared_as)
        .map(|(r, id)| (r, backend.id_hash, id));
    let store = |id: &str| router.stored_response(id, backend);
    let mut sending = forward::Sending::new(inflight, shared);
    if at.stores_answer {
        sending.store = Some(&store);
    }
    let sent = forward::forward(&worker.pool, cfg, c, req, at, &mut sending).await;
    drop(sending);
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
    // A request continuing a stored response: the engine's prompt is the
    // stored conversation and this body, of which the router hashed only
    // the body. Its usage says nothing of what the router predicted.
    let continues = at.decision == Decision::Stored;
    if (200..300).contains(&answer.status) {
        if let Reported::Valid(u) = answer.usage
            && let Some(keys) = &cfg.loaded.keys
            && let Some(k) = c.key.and_then(|k| keys.counts(k))
        {
            use std::sync::atomic::Ordering::Relaxed;
            k.prompt_tokens
                .fetch_add(u64::from(u.prompt_tokens), Relaxed);
            k.completion_tokens
                .fetch_add(u64::from(u.completion_tokens), Relaxed);
        }
        match answer.usage {
            Reported::Valid(u) if continues => model.usage(u.prompt_tokens, u.cached_tokens),
            Reported::Valid(u) => {
                router.observe_answer(backend, &c.blocks, at.matched_blocks, at.shared_blocks, u);
                model.usage(u.prompt_tokens, u.cached_tokens);
            }
            // Nothing learned from it, for this backend or any other.
            Reported::Invalid(why) => {
                if backend.feedback.invalid_report() {
                    warn!(backend = %backend.url, why = why.describe(), "an answer's usage is not believed: such answers teach the closed loop nothing (counted in prefix_router_usage_invalid_total; warned once per backend)");
                }
            }
            Reported::Nothing => {}
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
            && !continues
            && let Some(t) = answer.first_body_at
        {
            let seconds = (t - sent_at).as_secs_f64();
            backend.feedback.observe_ttft(uncached, seconds);
            router.taught(
                backend,
                Lesson::Prefill {
                    blocks: uncached,
                    seconds,
                },
            );
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

/// The stored response a request continues (`previous_response_id`) or
/// reads (`/v1/responses/{id}...`), and the backend (URL hash) that stored it.
struct StoredPin {
    id: String,
    backend: u64,
}

impl StoredPin {
    /// The engine that stored it and no other: a 404 when it left the
    /// fleet or is down (its memory went with it), no candidate while it is
    /// at its in-flight limit (the request queues for it).
    fn apply(
        &self,
        cfg: &Config,
        routed: &mut Routed,
        prompt_blocks: u32,
    ) -> Result<(), RouterError> {
        if routed.pin_stored(
            self.backend,
            cfg.limits.max_in_flight_per_backend,
            prompt_blocks,
        ) {
            Ok(())
        } else {
            Err(self.gone())
        }
    }

    fn gone(&self) -> RouterError {
        not_stored(&self.id, "the engine that stored it is gone")
    }
}

/// OpenAI's answer for an id no engine here holds.
fn not_stored(id: &str, why: &str) -> RouterError {
    RouterError::new(
        Kind::NotFound,
        format!("Response with id '{id}' not found: {why}"),
    )
}

/// The stored response the request names, if any: by its path
/// (`path_id`), or by the `previous_response_id` routing just read.
fn stored_pin(worker: &Worker, path_id: Option<&str>) -> Result<Option<StoredPin>, RouterError> {
    let id = match path_id {
        Some(id) => id.to_owned(),
        None => {
            let scratch = worker.scratch.borrow();
            let previous = scratch.canon().previous_response();
            if previous.is_empty() {
                return Ok(None);
            }
            String::from_utf8_lossy(previous).into_owned()
        }
    };
    match worker.router.stored.backend_of(&id) {
        Some(backend) => Ok(Some(StoredPin { id, backend })),
        None => Err(not_stored(&id, "no engine here is known to have stored it")),
    }
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
    tokens: Option<&EngineTokens>,
    scanned: Option<Scanned>,
) -> Result<Routed, RouterError> {
    let endpoint = api::endpoint(req.head, &c.fwd);
    let cfg = worker.router.config.load();
    let by_model = endpoint.is_none()
        && req.head.method(&c.fwd) == "POST"
        && cfg
            .routes
            .extra_allowed
            .iter()
            .any(|p| p == req.head.path(&c.fwd));
    let ClientConn {
        buf,
        body,
        blocks,
        fwd,
        ..
    } = c;
    let query = RouteQuery {
        caller: caller(&cfg.classes, fwd),
        endpoint,
        by_model,
        body: match req.body {
            Body::InBuf { start, end } => &buf[start..end],
            Body::Decoded => body,
        },
        session: req.head.session,
        tokens: TokensFrom::Worker(tokens),
        scanned: None,
        only: None,
    };
    let mut scratch = worker.scratch.borrow_mut();
    let query = RouteQuery {
        scanned: scanned.map(|s| scratch.restore_scan(s)),
        ..query
    };
    worker.router.route(&query, &mut scratch, blocks)
}

/// What the forwarded head says of the caller, read only when `[classes]`
/// has a header or tenants with keys.
fn caller<'a>(classes: &crate::config::Classes, fwd: &'a [u8]) -> Caller<'a> {
    if !classes.reads_caller() {
        return Caller::default();
    }
    Caller {
        header: (!classes.header.is_empty())
            .then(|| header_value(fwd, &classes.header))
            .flatten(),
        key: classes.reads_keys().then(|| api_key(fwd)).flatten(),
    }
}

/// Precise mode: the request's engine tokens when a model tokenizer makes
/// them, made by the tokenizing threads (`precise::offload`) while this
/// worker serves its other connections. `None` (the request routes on the
/// approximate index) when there is nothing to make, the threads are busy,
/// or the tokens take longer than `precise.tokenizer_wait_ms`. With them,
/// the body's scan, for routing to take up (a long body is scanned once).
async fn offload_tokens(
    worker: &Worker,
    cfg: &Config,
    c: &ClientConn,
    req: Request<'_>,
) -> (Option<EngineTokens>, Option<Scanned>) {
    let Some(precise) = worker.router.precise.as_ref() else {
        return (None, None);
    };
    let (job, scanned) = {
        let query = RouteQuery {
            endpoint: api::endpoint(req.head, &c.fwd),
            body: match req.body {
                Body::InBuf { start, end } => &c.buf[start..end],
                Body::Decoded => &c.body,
            },
            session: None,
            tokens: TokensFrom::Worker(None),
            scanned: None,
            by_model: false,
            caller: Caller::default(),
            only: None,
        };
        let mut scratch = worker.scratch.borrow_mut();
        let job = worker.router.token_job(&query, &mut scratch);
        (job, scratch.take_scan())
    };
    let Some(pending) = job.and_then(|j| precise.tokenizers.offload.submit(j)) else {
        return (None, scanned);
    };
    let offload = &precise.tokenizers.offload;
    let mut pending = pending;
    // The thread drops its end when the tokens are in: the read ends.
    if let Some(done) = pending.done.take()
        && let Ok(mut done) = monoio::net::UnixStream::from_std(done)
    {
        let wait = ms(cfg.precise.tokenizer_wait_ms);
        let _ = monoio::time::timeout(wait, done.read(vec![0u8; 1])).await;
    }
    let tokens = pending.take();
    if tokens.is_none() {
        offload.late();
    }
    (tokens.flatten(), scanned)
}

/// Whether a request that found no candidate should wait: some backend is up
/// and only the in-flight limit of its class (`cap`) keeps it out, or a
/// request of a higher class waits.
fn queueable(cap: u32, deadline: Instant, routed: &Routed) -> bool {
    cap > 0 && Instant::now() < deadline && routed.fleet.backends.iter().any(|b| b.health.is_up())
}

/// Whether an up backend has room under the class's in-flight limit now.
fn has_room(cap: u32, routed: &Routed) -> bool {
    routed.fleet.backends.iter().any(|b| b.has_room(cap))
}

/// Whether the client closed (or reset) its connection while its request
/// waits: one non-blocking `recv(MSG_PEEK)`. Bytes waiting (a pipelined
/// request) or none yet: still there. A client that shuts its sending side
/// and still waits for the answer looks gone; HTTP/1.1 clients do not.
fn client_gone(stream: &crate::proxy::stream::Stream) -> bool {
    use nix::errno::Errno;
    use nix::sys::socket::{MsgFlags, recv};
    use std::os::fd::AsRawFd;
    let mut byte = [0u8; 1];
    match recv(
        stream.as_raw_fd(),
        &mut byte,
        MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT,
    ) {
        Ok(0) => true,
        Ok(_) | Err(Errno::EAGAIN | Errno::EINTR) => false,
        Err(_) => true,
    }
}

/// The answer to a request whose tenant has `classes.max_waiting` requests
/// of its class waiting already: 429 for `flex`, 503 for the others, both
/// with Retry-After.
fn queue_full(cfg: &Config, router: &crate::shared::Router, placed: Placed) -> RouterError {
    let class = placed.class;
    router
        .metrics
        .class_refused(class, cfg.classes.tenant_name(placed.tenant));
    let kind = if class == Class::Flex {
        Kind::Shed
    } else {
        Kind::Unavailable
    };
    RouterError::new(
        kind,
        format!(
            "{} {} requests of this caller wait already (classes.max_waiting); try again later",
            cfg.classes.max_waiting_of(placed.tenant),
            class.name()
        ),
    )
}

/// The 429 for a request of `class` that waited its deadline for room.
fn shed(cfg: &Config, router: &crate::shared::Router, class: Class, tenant: &str) -> RouterError {
    router.metrics.shed(class, tenant);
    RouterError::new(
        Kind::Shed,
        format!(
            "the engines stayed busy for {} ms (classes.flex_wait_ms) while this {} request waited; try again later",
            cfg.classes.flex_wait_ms,
            class.name()
        ),
    )
}
