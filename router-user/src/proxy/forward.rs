//! Transport for one attempt: send the request on a connection to one
//! backend and stream the response back as it arrives. Every chunk the
//! backend sends is written to the client at once (TCP_NODELAY on both
//! sides), so SSE tokens are not held back. Deciding, learning, re-sending
//! and health are the request path's (`request`), not this file's.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use monoio::net::TcpStream;
use tracing::{debug, info};

use crate::config::{Config, ms};
use crate::error::{Kind, Resend, RouterError};
use crate::fleet::backend::{Backend, InFlight};
use crate::fleet::feedback::{Reported, UsageScanner};
use crate::fleet::stored::IdScanner;
use crate::http::chunked::ChunkedDecoder;
use crate::http::request::{BodyFraming, RequestHead};
use crate::http::response::{self, ResponseFraming};
use crate::policy::select::Decision;
use crate::proxy::client::{Body, ClientConn, Request};
use crate::proxy::io::{Read, read_more, write_all, write_head_and_body, write_range};
use crate::proxy::pool::{BackendConn, Pool};
use crate::proxy::priority_field::Insert;
use crate::proxy::stream::Stream;
use crate::replica::Replica;

/// Bodies up to this size are copied behind the head and sent in one
/// `send`; a larger one is not copied: head and body go in one `writev`
/// (`io::write_head_and_body`). On 400 KB prompts the `writev` took the
/// router's CPU per request from 274-394 us to 237-277 (decision
/// 0005, head and body in one writev).
const COALESCE_BODY: usize = 16 * 1024;
/// Largest response head accepted from a backend.
const MAX_RESPONSE_HEAD: usize = 64 * 1024;

/// One searcher for the whole process: `memmem::find` builds one per call,
/// 0.5% of the router's samples on tiny requests.
fn event_stream_finder() -> &'static memchr::memmem::Finder<'static> {
    static FINDER: std::sync::OnceLock<memchr::memmem::Finder<'static>> =
        std::sync::OnceLock::new();
    FINDER.get_or_init(|| memchr::memmem::Finder::new(b"text/event-stream"))
}

/// One send of a request to one backend.
pub struct Attempt<'a> {
    pub backend: &'a Arc<Backend>,
    /// Prompt blocks routing found the backend holding.
    pub matched_blocks: u32,
    /// How many of them another backend held too (the rest is private:
    /// a conversation's history).
    pub shared_blocks: u32,
    /// Blocks it is predicted to prefill (`Choice::prefill_blocks`).
    pub prefill_blocks: u32,
    pub decision: Decision,
    /// Only a fresh connection (a pooled one just failed).
    pub fresh_only: bool,
    /// The engine stores the answer (`/v1/responses`): read its id.
    pub stores_answer: bool,
    /// The backend's in-flight limit for this request's class (0: none).
    pub max_in_flight: u32,
}

/// A request in flight on a backend, as this replica counts it and, with
/// `[replicas]`, as its peers are told: its first body byte, and its end
/// however the attempt ends (the guard drops).
pub struct Sending<'a> {
    pub inflight: InFlight,
    /// The replica, the backend's id and the request's id its peers know.
    pub shared: Option<(&'a Replica, u64, u64)>,
    /// Pins a stored response's id to the backend, as soon as the answer
    /// shows it (`Attempt::stores_answer`).
    pub store: Option<&'a dyn Fn(&str)>,
    told_prefilled: bool,
}

impl<'a> Sending<'a> {
    pub fn new(inflight: InFlight, shared: Option<(&'a Replica, u64, u64)>) -> Sending<'a> {
        Sending {
            inflight,
            shared,
            store: None,
            told_prefilled: false,
        }
    }

    /// The first byte of the response body arrived: the prompt is prefilled.
    pub fn prefilled(&mut self) {
        self.inflight.prefilled();
        if let Some((r, backend, request)) = self.shared
            && !self.told_prefilled
        {
            self.told_prefilled = true;
            r.outbox.prefilled(backend, request);
        }
    }
}

impl Drop for Sending<'_> {
    fn drop(&mut self) {
        if let Some((r, backend, request)) = self.shared {
            r.outbox.done(backend, request);
        }
    }
}

/// Why an attempt did not complete.
pub enum Failure {
    /// No backend can have processed the request: send it again, for this
    /// reason (counted toward `retry.max_attempts` and the retry budget).
    Retry(RouterError, Resend),
    /// The backend failed before any response byte reached the client:
    /// answer the client with this error.
    Answer(RouterError),
    /// The backend read the request whole and closed without a byte: a
    /// 502, never sent again (it may have run the generation).
    Unanswered(RouterError),
    /// Response bytes already reached the client and the backend's stream
    /// broke: the client connection closes, so it sees a truncated response.
    BrokeMidStream(&'static str),
    /// The client stopped reading or went away mid-response.
    ClientGone,
    /// Admission: the backend reached `limits.max_in_flight_per_backend`
    /// after it was chosen (another worker took the last slot); nothing was
    /// sent.
    Full,
}

impl Failure {
    /// What the backend did wrong, if it is to blame (for passive health).
    pub fn backend_fault(&self) -> Option<&str> {
        match self {
            Failure::Retry(e, r) if r.blames_backend() => Some(&e.message),
            Failure::Answer(e) | Failure::Unanswered(e) => Some(&e.message),
            Failure::BrokeMidStream(why) => Some(why),
            _ => None,
        }
    }
}

/// A response relayed whole.
pub struct Answered {
    pub status: u16,
    /// The client connection must close afterwards.
    pub close_client: bool,
    /// What the engine said it had cached of the prompt, checked.
    pub usage: Reported,
    /// The answer was an event stream (its first byte is a first token).
    pub streaming: bool,
    pub first_body_at: Option<Instant>,
}

/// Puts the credentials this attempt's backend gets where the caller's
/// were: its `api_key_file`'s key, else the caller's own when
/// `auth.forward_authorization`, else none. Nothing to do unless the
/// configuration rewrites credentials.
fn set_authorization(cfg: &Config, c: &mut ClientConn, backend: &str) {
    if !cfg.loaded.rewrites_authorization(&cfg.auth) {
        return;
    }
    let ClientConn {
        fwd,
        caller_auth,
        auth_at,
        auth_len,
        ..
    } = c;
    let line: &[u8] = match cfg.loaded.backend_keys.get(backend) {
        Some(l) => l,
        None if cfg.auth.forward_authorization => caller_auth,
        None => b"",
    };
    fwd.splice(*auth_at..*auth_at + *auth_len, line.iter().copied());
    *auth_len = line.len();
}

/// Completes `c.fwd` (the forwarded head) with the body's length and, when
/// small, the body itself, with `insert`'s field in place when given. A
/// large body's bytes up to the field go behind the head with it; the rest
/// is sent from where it lies (`c.fwd_body_from`).
pub fn finish_request_head(
    c: &mut ClientConn,
    head: &RequestHead,
    body: Body,
    insert: Option<&Insert>,
) {
    let len = c.body_bytes(body).len();
    let insert = insert.filter(|_| head.body != BodyFraming::None);
    let added = insert.map_or(0, |i| i.bytes().len());
    if head.body != BodyFraming::None {
        c.fwd.extend_from_slice(b"content-length: ");
        c.fwd
            .extend_from_slice(itoa::Buffer::new().format(len + added).as_bytes());
        c.fwd.extend_from_slice(b"\r\n");
    }
    c.fwd.extend_from_slice(b"\r\n");
    let ClientConn {
        fwd,
        buf,
        body: decoded,
        fwd_body_from,
        ..
    } = c;
    let bytes = match body {
        Body::InBuf { start, end } => &buf[start..end],
        Body::Decoded => &decoded[..],
    };
    *fwd_body_from = 0;
    match insert {
        Some(i) if len <= COALESCE_BODY => i.write(bytes, fwd),
        Some(i) => {
            fwd.extend_from_slice(&bytes[..i.at()]);
            fwd.extend_from_slice(i.bytes());
            *fwd_body_from = i.at();
        }
        None if len <= COALESCE_BODY => fwd.extend_from_slice(bytes),
        None => {}
    }
}

/// Sends the request on a connection to `at.backend` and streams the
/// response to the client, each read written before the next is taken.
/// Transport only: the request path (`request`) admits, learns and reports.
pub async fn forward(
    pool: &Pool,
    cfg: &Config,
    c: &mut ClientConn,
    req: Request<'_>,
    at: &Attempt<'_>,
    inflight: &mut Sending<'_>,
) -> Result<Answered, Failure> {
    let (head, body, backend) = (req.head, req.body, at.backend);
    // The delivery rule: a request goes again (to this backend on a fresh
    // connection, or to the next candidate) only when no backend can have
    // processed it: the connection failed, or broke before the request was
    // written whole. Once it was written whole, a close without a response
    // byte is a 502: the engine may have run the generation.
    let mut bc = get_conn(pool, cfg, backend, at.fresh_only)
        .await
        .map_err(|e| Failure::Retry(e, Resend::ConnectFailed))?;
    set_authorization(cfg, c, &backend.url);
    let rhead = match exchange(cfg, c, head, body, &mut bc).await {
        Ok(h) => h,
        Err(Exchange::NotSent(why)) if bc.reused => {
            pool.closed_young(&bc, backend);
            debug!(backend = %backend.url, why, "pooled connection failed before the request was written; sending it on a fresh one");
            return Err(Failure::Retry(
                RouterError::new(Kind::BadGateway, "a pooled backend connection failed")
                    .with_detail(format!("backend {}: {why}", backend.url)),
                Resend::StalePooled,
            ));
        }
        Err(Exchange::NotSent(why)) => {
            return Err(Failure::Retry(
                RouterError::new(
                    Kind::BadGateway,
                    "sending the request to the backend failed",
                )
                .with_detail(format!("backend {}: {why}", backend.url)),
                Resend::WriteFailed,
            ));
        }
        Err(Exchange::Unanswered(why)) => {
            return Err(Failure::Unanswered(
                RouterError::new(
                    Kind::BadGateway,
                    "the backend closed the connection without answering; the request is not sent again, as the backend may have processed it",
                )
                .with_detail(format!("backend {}: {why}", backend.url)),
            ));
        }
        Err(Exchange::Failed(e)) => return Err(Failure::Answer(e)),
    };

    // The client's head: the backend's, hop-by-hop headers dropped, ours added.
    // An HTTP/1.0 client has no chunked coding: it gets the body decoded and
    // delimited by the close of the connection.
    let dechunk = head.http10 && rhead.framing == ResponseFraming::Chunked;
    let close_client = rhead.framing == ResponseFraming::Close || !head.keep_alive || dechunk;
    if cfg.debug_headers {
        use std::io::Write as _;
        let _ = write!(
            c.out,
            "x-prefix-router-backend: {}\r\nx-prefix-router-matched-blocks: {}\r\nx-prefix-router-decision: {:?}\r\n",
            backend.url, at.matched_blocks, at.decision
        );
    }
    if close_client {
        c.out.extend_from_slice(b"connection: close\r\n");
    }
    c.out.extend_from_slice(b"\r\n");
    // The closed loop: what the engine says it had cached, and when the
    // first streamed token came (see `feedback`). Read-only on the bytes.
    let streaming = event_stream_finder().find(&c.out).is_some();
    let mut usage = UsageScanner::default();
    let mut first_body_at = None;
    let mut response_id = at.stores_answer.then(IdScanner::default);

    // The response body, in one loop that every byte passes, in order: the
    // bytes read with the head first (sent behind the head in one write),
    // then each read from the backend. The next read waits until the client
    // took this one, so a slow reader backs up into the backend, not memory.
    let mut tracker = Tracker::new(rhead.framing);
    let client_write = ms(cfg.timeouts.client_write_ms);
    let idle = ms(cfg.timeouts.backend_idle_ms);
    let mut leftover = false;
    let (mut start, mut end) = (rhead.len, c.rbuf.len());
    let mut first = true;
    loop {
        if dechunk && !first {
            c.out.clear();
        }
        // `bytes` is what the backend sent; with `dechunk` the decoded body
        // goes to `c.out`.
        let bytes = &c.rbuf[start..end];
        let fed = tracker.feed(bytes, dechunk.then_some(&mut c.out));
        let (take, done) = match fed {
            Ok(x) => x,
            Err(e) if first => {
                // Nothing reached the client yet: still a clean 502.
                return Err(Failure::Answer(RouterError::new(
                    Kind::BadGateway,
                    format!("backend sent an invalid response body ({})", e.message),
                )));
            }
            Err(e) => {
                debug!(backend = %backend.url, error = %e.message, "invalid response body mid-stream; closing the client connection");
                return Err(Failure::BrokeMidStream("invalid response body"));
            }
        };
        leftover |= take < bytes.len();
        usage.feed(&bytes[..take]);
        // A stored response is pinned before its id reaches the client,
        // which may name it in its next request at once.
        if let Some(ids) = &mut response_id
            && let Some(id) = ids.feed(&bytes[..take])
            && (200..300).contains(&rhead.status)
            && let Some(store) = inflight.store
        {
            store(id);
        }
        if take > 0 && first_body_at.is_none() {
            // The first body byte, not the head: an engine streaming an
            // answer (vLLM, the sim-engine) sends its head when it takes
            // the request, and the first event once it has prefilled.
            first_body_at = Some(Instant::now());
            inflight.prefilled();
        }
        let sent = if dechunk {
            write_all(&mut c.stream, &mut c.out, client_write).await
        } else if first {
            c.out.extend_from_slice(&c.rbuf[start..start + take]);
            write_all(&mut c.stream, &mut c.out, client_write).await
        } else {
            write_range(
                &mut c.stream,
                &mut c.rbuf,
                start,
                start + take,
                client_write,
            )
            .await
        };
        sent.map_err(|e| client_gone(cfg, c, &e))?;
        first = false;
        if done {
            break;
        }
        c.rbuf.clear();
        match read_more(&mut bc.stream, &mut c.rbuf, idle).await {
            Read::Data(n) => (start, end) = (0, n),
            Read::Eof if rhead.framing == ResponseFraming::Close => break,
            Read::Eof | Read::Err | Read::TimedOut => {
                debug!(backend = %backend.url, "backend stream ended early; closing the client connection");
                return Err(Failure::BrokeMidStream("response stream broke"));
            }
        }
    }
    let streamed = rhead.framing == ResponseFraming::Chunked;
    if rhead.reusable && !leftover && !(streamed && backend.closes_after_stream.load(Relaxed)) {
        bc.after_stream = streamed;
        bc.answered();
        pool.put(bc, cfg.limits.max_idle_per_backend);
    }
    Ok(Answered {
        status: rhead.status,
        close_client,
        usage: usage.report(),
        streaming,
        first_body_at,
    })
}

/// How an exchange failed before the response head was complete.
enum Exchange {
    /// The request was not written whole: no backend can have processed it.
    NotSent(&'static str),
    /// The request was written whole and the backend closed without a
    /// response byte: it may have processed it.
    Unanswered(&'static str),
    /// The backend answered garbage or too late.
    Failed(RouterError),
}

/// Writes the request and reads the response head into `c.rbuf` (the head
/// for the client goes to `c.out`).
async fn exchange(
    cfg: &Config,
    c: &mut ClientConn,
    head: &RequestHead,
    body: Body,
    bc: &mut BackendConn,
) -> Result<response::ResponseHead, Exchange> {
    let timeout = ms(cfg.timeouts.backend_idle_ms);
    let body_len = c.body_bytes(body).len();
    // A small body is already behind the head in `c.fwd`, and a large
    // one's first `fwd_body_from` bytes.
    let skip = c.fwd_body_from;
    let separate_body = if body_len > COALESCE_BODY {
        body_len - skip
    } else {
        0
    };
    bc.sending(c.fwd.len() + separate_body);
    let res = if body_len > COALESCE_BODY {
        let ClientConn {
            fwd,
            buf,
            body: decoded,
            ..
        } = c;
        let (from, start, end) = match body {
            Body::InBuf { start, end } => (buf, start + skip, end),
            Body::Decoded => {
                let end = decoded.len();
                (decoded, skip, end)
            }
        };
        write_head_and_body(&mut bc.stream, fwd, from, start, end, timeout).await
    } else {
        write_all(&mut bc.stream, &mut c.fwd, timeout).await
    };
    backend_written(cfg, c, res)?;
    c.rbuf.clear();
    let deadline = Instant::now() + ms(cfg.timeouts.backend_first_byte_ms);
    loop {
        match read_more(
            &mut bc.stream,
            &mut c.rbuf,
            deadline.saturating_duration_since(Instant::now()),
        )
        .await
        {
            Read::Data(_) => {}
            // A pooled connection is sent on without a check when it was
            // idle briefly (`pool`); its backend may have closed it before
            // reading the request, which its acknowledgements tell. A reset
            // without a close (an abortive close after reading) does not.
            Read::Eof if c.rbuf.is_empty() && bc.reused && bc.request_unacknowledged() => {
                return Err(Exchange::NotSent(
                    "the backend had closed the pooled connection before reading the request",
                ));
            }
            Read::Eof if c.rbuf.is_empty() => return Err(Exchange::Unanswered("closed")),
            Read::Err if c.rbuf.is_empty() => return Err(Exchange::Unanswered("reset")),
            Read::Eof | Read::Err => {
                return Err(Exchange::Failed(RouterError::new(
                    Kind::BadGateway,
                    "backend closed the connection in the middle of its response head",
                )));
            }
            Read::TimedOut => {
                return Err(Exchange::Failed(RouterError::new(
                    Kind::GatewayTimeout,
                    format!(
                        "backend sent nothing within {} ms",
                        cfg.timeouts.backend_first_byte_ms
                    ),
                )));
            }
        }
        loop {
            let client = response::Client {
                request_was_head: head.method_is_head,
                http10: head.http10,
                hide_engine: !cfg.debug_headers,
            };
            match response::parse(&c.rbuf, &client, MAX_RESPONSE_HEAD, &mut c.out) {
                Ok(Some(h)) if (100..200).contains(&h.status) && h.status != 101 => {
                    // An interim response (we never forward Expect): skip it.
                    c.rbuf.drain(..h.len);
                }
                Ok(Some(h)) => return Ok(h),
                Ok(None) => break,
                Err(e) => return Err(Exchange::Failed(e)),
            }
        }
    }
}

/// A failed write to the backend: a timeout lost the buffer with the
/// cancelled write, so the request cannot be sent again.
fn backend_written(
    cfg: &Config,
    c: &mut ClientConn,
    res: std::io::Result<()>,
) -> Result<(), Exchange> {
    match res {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
            c.lost_buffers = true;
            Err(Exchange::Failed(RouterError::new(
                Kind::GatewayTimeout,
                format!(
                    "backend accepted no request bytes for {} ms (timeouts.backend_idle_ms)",
                    cfg.timeouts.backend_idle_ms
                ),
            )))
        }
        Err(_) => Err(Exchange::NotSent("write failed")),
    }
}

/// The client connection failed while the response was streamed to it: a
/// client that stopped reading is cut after `timeouts.client_write_ms`.
/// Dropping the backend connection cancels the generation; the in-flight
/// guard gives the slot back.
fn client_gone(cfg: &Config, c: &mut ClientConn, e: &std::io::Error) -> Failure {
    if e.kind() == std::io::ErrorKind::TimedOut {
        c.lost_buffers = true;
        info!(
            peer = %c.peer,
            ms = cfg.timeouts.client_write_ms,
            "client accepted no response bytes (timeouts.client_write_ms); cutting it and its backend request"
        );
    }
    Failure::ClientGone
}

async fn get_conn(
    pool: &Pool,
    cfg: &Config,
    backend: &Arc<Backend>,
    fresh_only: bool,
) -> Result<BackendConn, RouterError> {
    if !fresh_only && let Some(conn) = pool.take(backend, ms(cfg.timeouts.backend_pool_idle_ms)) {
        return Ok(conn);
    }
    let connect = async {
        let tcp = TcpStream::connect_addr(backend.addr).await?;
        let _ = tcp.set_nodelay(true);
        match (&backend.tls_name, &cfg.loaded.client_tls) {
            (None, _) => Ok(Stream::plain(tcp)),
            (Some(name), Some(tls)) => Stream::connect(tcp, tls.clone(), name).await,
            (Some(_), None) => Err(std::io::Error::other(
                "an https:// backend and no [backend_tls] configuration loaded",
            )),
        }
    };
    // The TLS handshake, when there is one, within the connect deadline.
    let stream = match monoio::time::timeout(ms(cfg.timeouts.backend_connect_ms), connect).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            return Err(
                RouterError::new(Kind::BadGateway, "cannot connect to the backend")
                    .with_detail(format!("backend {}: {e}", backend.url)),
            );
        }
        Err(_) => {
            return Err(RouterError::new(
                Kind::BadGateway,
                format!(
                    "connecting to the backend took over {} ms",
                    cfg.timeouts.backend_connect_ms
                ),
            )
            .with_detail(format!("backend {}", backend.url)));
        }
    };
    Ok(BackendConn::new(stream, backend))
}

/// Follows the response framing to find where the response ends.
enum Tracker {
    Done,
    Length(u64),
    Chunked(ChunkedDecoder),
    Close,
}

impl Tracker {
    fn new(framing: ResponseFraming) -> Tracker {
        match framing {
            ResponseFraming::None | ResponseFraming::Length(0) => Tracker::Done,
            ResponseFraming::Length(n) => Tracker::Length(n),
            ResponseFraming::Chunked => Tracker::Chunked(ChunkedDecoder::new()),
            ResponseFraming::Close => Tracker::Close,
        }
    }

    /// How many of `bytes` belong to the response, and whether it is
    /// complete. A chunked body's data is appended to `decoded` when given.
    fn feed(
        &mut self,
        bytes: &[u8],
        decoded: Option<&mut Vec<u8>>,
    ) -> Result<(usize, bool), RouterError> {
        match self {
            Tracker::Done => Ok((0, true)),
            Tracker::Length(left) => {
                let take = (*left).min(bytes.len() as u64);
                *left -= take;
                Ok((take as usize, *left == 0))
            }
            Tracker::Chunked(d) => {
                let take = d.feed(bytes, decoded)?;
                Ok((take, d.is_done()))
            }
            Tracker::Close => Ok((bytes.len(), false)),
        }
    }
}
