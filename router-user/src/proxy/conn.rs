//! One client connection: read a request, route it, forward it, stream the
//! answer back; repeat while the client keeps the connection alive. Requests
//! on one connection are routed one by one (pipelined ones in order).

use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;
use std::time::Instant;

use monoio::net::TcpStream;
use tracing::{info, warn};

use crate::config::{Config, ms};
use crate::error::{Kind, RouterError, Side};
use crate::http::chunked::ChunkedDecoder;
use crate::http::request::{self, BodyFraming, RequestHead};
use crate::proxy::budget;
use crate::proxy::forward::{self, Body};
use crate::proxy::io::{Read, read_more, write_all};
use crate::proxy::pool::Pool;
use crate::route::extract::Extractor;
use crate::router::{PromptBlocks, RouteRequest, RouteScratch, Routed, Router};

/// Buffers that grew past this for one large request are given back after it,
/// so idle connections stay small.
const KEEP_BUFFER: usize = 64 * 1024;
/// Body buffers (and the worker's parse scratch) over this are given back
/// to the system after their request: rare uploads this large must not keep
/// their memory, while the usual prompts (up to a few hundred KB) keep
/// their scratch warm. Matches the allocator's fixed mmap threshold
/// (`listener::MMAP_THRESHOLD`), so they are their own mappings.
pub const RETURN_ABOVE: usize = 4 * 1024 * 1024;
/// A body buffer grows by half its size (at least one read chunk) at a
/// time, as bytes arrive: never by the declared length up front.
const GROW_MIN: usize = crate::proxy::io::READ_CHUNK;
/// After a 413 or 503 with a body unread, how long the router keeps reading
/// (and discarding) it, so the client reads the answer instead of a reset.
const LINGER: Duration = Duration::from_secs(2);
/// How often a request queued for room under `limits.max_in_flight_per_backend`
/// checks the backends' in-flight counters (atomic loads; it routes again only
/// when one has room). 1 ms is short next to a generation and cheap to poll.
const QUEUE_POLL: Duration = Duration::from_millis(1);

/// What one worker thread owns.
pub struct Worker {
    pub router: Arc<Router>,
    pub pool: Pool,
    scratch: RefCell<(Extractor, RouteScratch)>,
}

impl Worker {
    pub fn new(router: Arc<Router>) -> Worker {
        Worker {
            router,
            pool: Pool::default(),
            scratch: RefCell::new(Default::default()),
        }
    }

    /// Drops the parse scratch (a copy of the body, the canonical prompt)
    /// after a body over `RETURN_ABOVE`; smaller ones keep theirs for speed.
    fn shrink_scratch(&self) {
        let mut s = self.scratch.borrow_mut();
        s.0 = Extractor::default();
        if s.1.canonical.capacity() > RETURN_ABOVE {
            s.1.canonical = Vec::new();
        }
    }
}

/// A client connection's buffers, reused across its requests.
pub struct ClientConn {
    pub stream: TcpStream,
    pub peer: SocketAddr,
    /// Bytes received and not yet consumed (pipelined requests wait here).
    pub buf: Vec<u8>,
    /// Bytes of `buf` that belong to the current request (head and raw body).
    consumed: usize,
    /// Decoded chunked request body.
    pub body: Vec<u8>,
    /// What is sent to the backend: the head, and the body when small.
    pub fwd: Vec<u8>,
    /// The response head sent to the client.
    pub out: Vec<u8>,
    /// Response bytes read from the backend.
    pub rbuf: Vec<u8>,
    pub blocks: PromptBlocks,
    /// A write timed out and took one of the buffers with it: the
    /// connection must close after this request.
    pub lost_buffers: bool,
    /// This connection's share of `limits.max_buffered_body_bytes`.
    charge: budget::Charge,
}

/// Serves a client connection until it closes, errs or idles out.
pub async fn serve(worker: Rc<Worker>, stream: TcpStream, peer: SocketAddr) {
    let mut c = ClientConn {
        stream,
        peer,
        buf: Vec::with_capacity(8 * 1024),
        consumed: 0,
        body: Vec::new(),
        fwd: Vec::with_capacity(1024),
        out: Vec::with_capacity(1024),
        rbuf: Vec::new(),
        blocks: PromptBlocks::default(),
        lost_buffers: false,
        charge: budget::Charge::default(),
    };
    loop {
        let cfg = worker.router.config.load_full();
        let result = one_request(&worker, &cfg, &mut c).await;
        if c.buf.capacity().max(c.body.capacity()) > RETURN_ABOVE {
            // The worker's parse scratch grew with this body: give it back.
            worker.shrink_scratch();
        }
        match result {
            Ok(true) if !worker.router.shutting_down() => {
                shrink(&mut c);
                let bytes = budget::charge_for([c.buf.capacity(), c.body.capacity()]);
                c.charge.set(bytes, usize::MAX);
            }
            Ok(_) => break,
            Err(e) => {
                if e.kind != Kind::Internal || !e.message.is_empty() {
                    log_error(&e, &c.peer, "-");
                    // After a framing error the rest of the stream cannot be trusted.
                    let retry_after = (e.kind == Kind::Unavailable).then_some(1);
                    let mut resp = e.to_response(true, retry_after, cfg.debug_headers);
                    let write = ms(cfg.timeouts.client_write_ms);
                    if write_all(&mut c.stream, &mut resp, write).await.is_ok()
                        && matches!(e.kind, Kind::BodyTooLarge | Kind::Unavailable)
                    {
                        linger(&mut c).await;
                    }
                }
                break;
            }
        }
    }
}

/// Handles one request; `Ok(true)` when the connection may carry another.
/// `Err` means the connection must close after the error is answered.
async fn one_request(
    worker: &Worker,
    cfg: &Config,
    c: &mut ClientConn,
) -> Result<bool, RouterError> {
    let Some(head) = read_head(cfg, c).await? else {
        return Ok(false);
    };
    let body = match head.body {
        BodyFraming::None => {
            c.consumed = head.len;
            Body::InBuf {
                start: head.len,
                end: head.len,
            }
        }
        BodyFraming::Length(n) => read_length_body(cfg, c, &head, n).await?,
        BodyFraming::Chunked => read_chunked_body(cfg, c, &head).await?,
    };
    // The router's own time starts once the whole request is in.
    let started = Instant::now();
    let result = route_and_forward(worker, cfg, c, &head, body, started).await;
    // A write that timed out took a buffer with it: answer, then close.
    let reusable = head.keep_alive && !c.lost_buffers;
    if !c.lost_buffers {
        // Drop this request's bytes; keep any pipelined request behind them.
        c.buf.drain(..c.consumed);
    }
    c.consumed = 0;
    match result {
        Ok(close) => Ok(reusable && !close),
        Err(e) => {
            log_error(&e, &c.peer, head.path(&c.fwd));
            // The request was read whole, so the connection stays usable.
            let retry_after = (e.kind == Kind::Unavailable).then_some(1);
            let mut resp = e.to_response(!reusable, retry_after, cfg.debug_headers);
            if write_all(&mut c.stream, &mut resp, ms(cfg.timeouts.client_write_ms))
                .await
                .is_err()
            {
                return Ok(false);
            }
            Ok(reusable)
        }
    }
}

/// Extracts the prompt, routes, and forwards with retries. `Ok(true)` when
/// the client connection must close (close-delimited response).
async fn route_and_forward(
    worker: &Worker,
    cfg: &Config,
    c: &mut ClientConn,
    head: &RequestHead,
    body: Body,
    started: Instant,
) -> Result<bool, RouterError> {
    let router = &worker.router;
    request::check_route(head, &c.fwd, &cfg.routes.extra_allowed)?;
    let deadline = Instant::now() + ms(cfg.timeouts.queue_ms);
    let mut head_finished = false;
    // Sends so far, the reason for the next one, and whether the first paid
    // into the retry budget; kept across re-routing after slot races.
    let mut attempts = 0;
    let mut resend: Option<forward::Resend> = None;
    let mut deposited = false;
    loop {
        let mut routed = route_once(worker, c, head, body)?;
        let queued = routed.choice.len == 0 && queueable(cfg, &routed);
        if queued {
            // Every up backend is at `limits.max_in_flight_per_backend`: wait
            // for room (atomic loads only), then route again, until `queue_ms`.
            while routed.choice.len == 0 && Instant::now() < deadline {
                monoio::time::sleep(QUEUE_POLL).await;
                if has_room(cfg, &routed) {
                    routed = route_once(worker, c, head, body)?;
                }
            }
        }
        router.metrics.observe_routing(&routed, started.elapsed());
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
            forward::finish_request_head(c, head, body);
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
            let matched = if i == 0 {
                routed.choice.matched_blocks
            } else {
                0
            };
            let sent = forward::forward(
                worker, cfg, c, head, body, &backend, &routed, matched, fresh_only,
            )
            .await;
            if !matches!(sent, Err(forward::Failure::Full))
                && let Some(reason) = resend.take()
            {
                router.metrics.resent(reason);
            }
            match sent {
                Ok(close) => return Ok(close),
                Err(forward::Failure::Retry(e, reason)) => {
                    attempts += 1;
                    warn!(backend = %backend.url, attempts, reason = reason.name(), error = %e, "attempt failed before the backend could have processed the request; it may be sent again");
                    resend = Some(reason);
                    // A stale pooled connection: the same backend, on a fresh one.
                    fresh_only = reason == forward::Resend::StalePooled;
                    if !fresh_only {
                        i += 1;
                    }
                    last = Some(e);
                }
                Err(forward::Failure::Answer(e)) => return Err(e),
                Err(forward::Failure::Abort) => return Ok(true),
                Err(forward::Failure::Full) => {
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

/// Extracts the prompt and ranks the backends. Synchronous: the worker's
/// scratch (which holds the canonical prompt) is never borrowed across an
/// await, so a queued request extracts again when it routes again.
fn route_once(
    worker: &Worker,
    c: &mut ClientConn,
    head: &RequestHead,
    body: Body,
) -> Result<Routed, RouterError> {
    let mut scratch = worker.scratch.borrow_mut();
    let (extractor, route_scratch) = &mut *scratch;
    let body_bytes = match body {
        Body::InBuf { start, end } => &c.buf[start..end],
        Body::Decoded => &c.body[..],
    };
    let (seed, user, has_prompt) = match head.endpoint {
        Some(ep) => {
            let p = extractor.extract(ep, body_bytes, &mut route_scratch.canonical)?;
            (p.seed, p.user, true)
        }
        None => (0, None, false),
    };
    let req = RouteRequest {
        seed,
        session: head.session.or(user),
        has_prompt,
        endpoint: head.endpoint,
    };
    Ok(worker.router.route(&req, route_scratch, &mut c.blocks))
}

/// Whether a request that found no candidate should wait: some backend is up
/// and only its in-flight limit keeps it out.
fn queueable(cfg: &Config, routed: &Routed) -> bool {
    cfg.limits.max_in_flight_per_backend > 0
        && cfg.timeouts.queue_ms > 0
        && routed.fleet.backends.iter().any(|b| b.is_up())
}

/// Whether an up backend has room under its in-flight limit now.
fn has_room(cfg: &Config, routed: &Routed) -> bool {
    let max = cfg.limits.max_in_flight_per_backend;
    routed
        .fleet
        .backends
        .iter()
        .any(|b| b.is_up() && b.state.in_flight.load(Relaxed) < max)
}

/// Reads until a whole head is in `c.buf`; `Ok(None)` when the client closed
/// or idled out between requests.
async fn read_head(cfg: &Config, c: &mut ClientConn) -> Result<Option<RequestHead>, RouterError> {
    let mut first_byte_at = (!c.buf.is_empty()).then(Instant::now);
    loop {
        if !c.buf.is_empty()
            && let Some(head) = request::parse(&c.buf, cfg.limits.max_header_bytes, &mut c.fwd)?
        {
            return Ok(Some(head));
        }
        let timeout = match first_byte_at {
            None => ms(cfg.timeouts.client_idle_ms),
            Some(t) => ms(cfg.timeouts.client_header_ms).saturating_sub(t.elapsed()),
        };
        match read_more(&mut c.stream, &mut c.buf, timeout).await {
            Read::Data(_) => {
                first_byte_at.get_or_insert_with(Instant::now);
            }
            Read::Eof | Read::Err(_) if c.buf.is_empty() => return Ok(None),
            Read::TimedOut if first_byte_at.is_none() => return Ok(None),
            Read::TimedOut => {
                return Err(RouterError::new(
                    Kind::ClientTimeout,
                    format!(
                        "request head not received within {} ms",
                        cfg.timeouts.client_header_ms
                    ),
                ));
            }
            Read::Eof | Read::Err(_) => return Err(closed()),
        }
    }
}

async fn read_length_body(
    cfg: &Config,
    c: &mut ClientConn,
    head: &RequestHead,
    n: u64,
) -> Result<Body, RouterError> {
    let max = cfg.limits.max_body_bytes;
    if n > max as u64 {
        return Err(RouterError::new(
            Kind::BodyTooLarge,
            format!("request body is {n} bytes; the limit is {max} (limits.max_body_bytes)"),
        ));
    }
    let end = head.len + n as usize;
    if c.buf.len() < end {
        let budget = cfg.limits.max_buffered_body_bytes;
        let need = budget::charge_for([end, c.body.capacity()]).saturating_sub(c.charge.held());
        if !budget::would_fit(need, budget) {
            return Err(budget_spent(cfg));
        }
        if head.expect_continue {
            send_continue(cfg, c).await?;
        }
        let deadline = Instant::now() + ms(cfg.timeouts.client_body_ms);
        while c.buf.len() < end {
            let other = c.body.capacity();
            grow(cfg, &mut c.buf, other, &mut c.charge, Some(end))?;
            read_body_more(cfg, c, deadline).await?;
        }
    }
    c.consumed = end;
    Ok(Body::InBuf {
        start: head.len,
        end,
    })
}

async fn read_chunked_body(
    cfg: &Config,
    c: &mut ClientConn,
    head: &RequestHead,
) -> Result<Body, RouterError> {
    let max = cfg.limits.max_body_bytes as u64;
    let mut dec = ChunkedDecoder::new();
    c.body.clear();
    let mut pos = head.len;
    let deadline = Instant::now() + ms(cfg.timeouts.client_body_ms);
    let mut sent_continue = false;
    loop {
        // Decoded bytes are no more than raw ones: room for them all first.
        let incoming = c.buf.len() - pos;
        if c.body.capacity() - c.body.len() < incoming {
            let cap = c.body.capacity();
            let target = (cap + cap / 2).max(c.body.len() + incoming);
            let bytes = budget::charge_for([c.buf.capacity(), target]);
            if !c.charge.set(bytes, cfg.limits.max_buffered_body_bytes) {
                return Err(budget_spent(cfg));
            }
            c.body.reserve_exact(target - c.body.len());
        }
        pos += dec.feed(&c.buf[pos..], Some(&mut c.body))?;
        if dec.decoded_len() > max {
            return Err(RouterError::new(
                Kind::BodyTooLarge,
                format!("request body is over the limit of {max} bytes (limits.max_body_bytes)"),
            ));
        }
        if dec.is_done() {
            break;
        }
        if head.expect_continue && !sent_continue {
            sent_continue = true;
            send_continue(cfg, c).await?;
        }
        let other = c.body.capacity();
        grow(cfg, &mut c.buf, other, &mut c.charge, None)?;
        read_body_more(cfg, c, deadline).await?;
    }
    c.consumed = pos;
    Ok(Body::Decoded)
}

/// Makes room in `buf` for the next read of a body (ending at `end` in
/// `buf` when known), charging the growth to the connection's share of the
/// body budget first: 503 when it is spent.
fn grow(
    cfg: &Config,
    buf: &mut Vec<u8>,
    other: usize,
    charge: &mut budget::Charge,
    end: Option<usize>,
) -> Result<(), RouterError> {
    if buf.capacity() - buf.len() >= crate::proxy::io::MIN_SPARE {
        return Ok(());
    }
    let cap = buf.capacity();
    let mut target = (cap + cap / 2).max(buf.len() + GROW_MIN);
    if let Some(end) = end {
        target = target.min(end + crate::proxy::io::MIN_SPARE);
    }
    if !charge.set(
        budget::charge_for([target, other]),
        cfg.limits.max_buffered_body_bytes,
    ) {
        return Err(budget_spent(cfg));
    }
    buf.reserve_exact(target - buf.len());
    Ok(())
}

fn budget_spent(cfg: &Config) -> RouterError {
    RouterError::new(
        Kind::Unavailable,
        format!(
            "the router is buffering {} MiB of request bodies, its limit (limits.max_buffered_body_bytes); retry shortly",
            cfg.limits.max_buffered_body_bytes >> 20
        ),
    )
}

/// Reads and discards what the client still sends, for up to `LINGER`,
/// after the write side is shut: a close with unread bytes would reset the
/// connection and could destroy the answer before the client read it.
async fn linger(c: &mut ClientConn) {
    use monoio::io::AsyncWriteRent;
    let _ = c.stream.shutdown().await;
    c.buf = Vec::with_capacity(crate::proxy::io::READ_CHUNK);
    let deadline = Instant::now() + LINGER;
    loop {
        c.buf.clear();
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero()
            || !matches!(
                read_more(&mut c.stream, &mut c.buf, left).await,
                Read::Data(_)
            )
        {
            return;
        }
    }
}

/// Reads more of the body, within the body deadline.
async fn read_body_more(
    cfg: &Config,
    c: &mut ClientConn,
    deadline: Instant,
) -> Result<(), RouterError> {
    match read_more(
        &mut c.stream,
        &mut c.buf,
        deadline.saturating_duration_since(Instant::now()),
    )
    .await
    {
        Read::Data(_) => Ok(()),
        Read::TimedOut => Err(body_timeout(cfg)),
        Read::Eof | Read::Err(_) => Err(closed()),
    }
}

/// Answers `Expect: 100-continue` before the body is read.
async fn send_continue(cfg: &Config, c: &mut ClientConn) -> Result<(), RouterError> {
    let mut cont = b"HTTP/1.1 100 Continue\r\n\r\n".to_vec();
    write_all(&mut c.stream, &mut cont, ms(cfg.timeouts.client_write_ms))
        .await
        .map_err(|_| closed())
}

fn body_timeout(cfg: &Config) -> RouterError {
    RouterError::new(
        Kind::ClientTimeout,
        format!(
            "request body not received within {} ms",
            cfg.timeouts.client_body_ms
        ),
    )
}

/// The client went away: nothing to answer, nothing to log at warn.
fn closed() -> RouterError {
    RouterError::new(Kind::Internal, "")
}

fn shrink(c: &mut ClientConn) {
    for b in [&mut c.buf, &mut c.body, &mut c.rbuf, &mut c.out, &mut c.fwd] {
        if b.capacity() > KEEP_BUFFER && b.len() <= KEEP_BUFFER / 4 {
            b.shrink_to(KEEP_BUFFER / 4);
        }
    }
    if c.blocks.hashes.capacity() > KEEP_BUFFER / 8 {
        c.blocks = PromptBlocks::default();
    }
}

fn log_error(e: &RouterError, peer: &SocketAddr, path: &str) {
    let detail = e.detail.as_deref().unwrap_or("");
    match e.kind.side() {
        Side::Client => {
            info!(%peer, path, status = e.status(), error = %e.message, detail, "refused request")
        }
        Side::Backend | Side::Internal => {
            warn!(%peer, path, status = e.status(), error = %e.message, detail, "request failed")
        }
    }
}
