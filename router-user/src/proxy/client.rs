//! A client connection's buffers, and reading one request from it: the head
//! within `timeouts.client_header_ms`, the body (Content-Length or chunked)
//! within `timeouts.client_body_ms`, every buffer charged to the body budget
//! as it grows.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::config::{Config, ms};
use crate::error::{Kind, RouterError};
use crate::http::chunked::ChunkedDecoder;
use crate::http::request::{self, BodyFraming, RequestHead};
use crate::proxy::budget;
use crate::proxy::io::{Read, read_more, write_all};
use crate::proxy::stream::Stream;
use crate::shared::PromptBlocks;

/// Buffers that grew past this for one large request are given back after it,
/// so idle connections stay small.
const KEEP_BUFFER: usize = 64 * 1024;

/// A body buffer doubles (growing by at least one read chunk, and at once
/// to the connection's free `budget::FREE_BYTES`) as bytes arrive: never
/// by the declared length up front, so what a connection holds past its
/// free share stays within twice what it was sent. Growing by half from
/// 8 KB made a 400 KB body take nine reallocations and 12.8 `io_uring`
/// operations per request (decision 0006).
const GROW_MIN: usize = crate::proxy::io::READ_CHUNK;

/// After a 413 or 503 with a body unread, the router reads (and discards)
/// what the client still sends, so a client that writes its whole request
/// before it reads (most do) finishes its write and reads the answer,
/// instead of a broken pipe or a reset. It stops at the end of a body of
/// known length, at the client's close, after this long without a byte
/// (the client is done or gone), after `timeouts.client_body_ms` in all
/// (what any body may take), or after [`LINGER_MAX_BYTES`]. A fixed 2 s
/// cut a 51 MB upload at 12 MB/s: the client's write broke.
const LINGER_IDLE: Duration = Duration::from_secs(2);

/// Most bytes discarded after a refused body: a client declaring or
/// sending more than this gets its connection closed under it.
const LINGER_MAX_BYTES: u64 = 1 << 30;

/// Where the request body is.
#[derive(Clone, Copy, Debug)]
pub enum Body {
    /// In the client buffer, as received (Content-Length framing).
    InBuf { start: usize, end: usize },
    /// Decoded from chunked framing into `ClientConn::body`.
    Decoded,
}

/// A request read whole: its head, where its body is, and when the router
/// had it all (the router's own time starts there).
#[derive(Clone, Copy)]
pub struct Request<'a> {
    pub head: &'a RequestHead,
    pub body: Body,
    pub read_at: Instant,
}

/// A client connection's buffers, reused across its requests.
pub struct ClientConn {
    pub stream: Stream,
    pub peer: SocketAddr,
    /// Bytes received and not yet consumed (pipelined requests wait here).
    pub buf: Vec<u8>,
    /// Bytes of `buf` that belong to the current request (head and raw body).
    pub consumed: usize,
    /// Decoded chunked request body.
    pub body: Vec<u8>,
    /// What is sent to the backend: the head, and the body when small.
    pub fwd: Vec<u8>,
    /// Bytes of a large body already in `fwd` behind the head (those up to
    /// an added field, `priority_field`): the rest is sent from its buffer.
    pub fwd_body_from: usize,
    /// The response head sent to the client.
    pub out: Vec<u8>,
    /// Response bytes read from the backend.
    pub rbuf: Vec<u8>,
    pub blocks: PromptBlocks,
    /// A write timed out and took one of the buffers with it: the
    /// connection must close after this request.
    pub lost_buffers: bool,
    /// This connection's share of `limits.max_buffered_body_bytes`.
    pub charge: budget::Charge,
    /// A refused request's body bytes not read yet, when its length is
    /// known: what `linger` discards before it may close without a reset.
    pub unread_body: Option<u64>,
    /// The accepted API key (its number in the keys file) the current
    /// request presented, when `auth.keys_file` is set.
    pub key: Option<u32>,
    /// The caller's credential header lines, taken out of `fwd` when the
    /// configuration rewrites them (`Loaded::rewrites_authorization`).
    pub caller_auth: Vec<u8>,
    /// Where in `fwd` the credentials an attempt sends go (the end of the
    /// headers), and how many bytes of them are there now.
    pub auth_at: usize,
    pub auth_len: usize,
}

impl ClientConn {
    pub fn new(stream: Stream, peer: SocketAddr) -> ClientConn {
        ClientConn {
            stream,
            peer,
            buf: Vec::with_capacity(8 * 1024),
            consumed: 0,
            body: Vec::new(),
            fwd: Vec::with_capacity(1024),
            fwd_body_from: 0,
            out: Vec::with_capacity(1024),
            rbuf: Vec::new(),
            blocks: PromptBlocks::default(),
            lost_buffers: false,
            charge: budget::Charge::default(),
            unread_body: None,
            key: None,
            caller_auth: Vec::new(),
            auth_at: 0,
            auth_len: 0,
        }
    }

    /// The request body's bytes.
    pub fn body_bytes(&self, body: Body) -> &[u8] {
        match body {
            Body::InBuf { start, end } => &self.buf[start..end],
            Body::Decoded => &self.body,
        }
    }
}

/// Reads the next request's head and body. `Ok(None)` when the client
/// closed or idled out between requests.
pub async fn read_request(
    cfg: &Config,
    c: &mut ClientConn,
) -> Result<Option<(RequestHead, Body)>, RouterError> {
    c.unread_body = None;
    let Some(head) = read_head(cfg, c).await? else {
        return Ok(None);
    };
    if let Some(keys) = &cfg.loaded.keys {
        c.key = authenticate(keys, &c.buf[..head.len]);
        if c.key.is_none() {
            // Refused on its head: nothing of the body is read (the rest
            // of it is discarded by `linger`, so the client reads the 401).
            c.unread_body = match head.body {
                BodyFraming::Length(n) => Some(n.saturating_sub((c.buf.len() - head.len) as u64)),
                BodyFraming::None => Some(0),
                BodyFraming::Chunked => None,
            };
            return Err(RouterError::new(
                Kind::Unauthorized,
                "no valid API key: send it as Authorization: Bearer KEY (or x-api-key)",
            ));
        }
    }
    if cfg.loaded.rewrites_authorization(&cfg.auth) {
        // Out of the forwarded head; each attempt puts back what its
        // backend gets (`forward::set_authorization`).
        request::take_headers(
            &mut c.fwd,
            &["authorization", "x-api-key"],
            &mut c.caller_auth,
        );
    }
    c.auth_at = c.fwd.len();
    c.auth_len = 0;
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
    Ok(Some((head, body)))
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
            Read::Eof | Read::Err if c.buf.is_empty() => return Ok(None),
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
            Read::Eof | Read::Err => return Err(closed()),
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
    // What `linger` discards should the body be refused here.
    let unread = Some(n.saturating_sub((c.buf.len() - head.len) as u64));
    if n > max as u64 {
        c.unread_body = unread;
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
            c.unread_body = unread;
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
    // Up to `FREE_BYTES` at once: a connection holds that much without
    // charge anyway, and a body that small then takes one read, not four.
    let mut target = (cap * 2).max(buf.len() + GROW_MIN).max(budget::FREE_BYTES);
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

/// The number of the accepted key a request's head presents, if any. The
/// key itself is never logged or kept.
fn authenticate(keys: &crate::config::keys::Keys, head: &[u8]) -> Option<u32> {
    let key = request::api_key(head).and_then(|k| keys.find(k))?;
    if let Some(c) = keys.counts(key) {
        c.requests
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    Some(key)
}

/// Reads and discards what the client still sends after a refused body,
/// the write side shut (see [`LINGER_IDLE`] for when it stops): a close
/// with unread bytes would reset the connection, break the client's write
/// and could destroy the answer before the client read it.
pub async fn linger(cfg: &Config, c: &mut ClientConn) {
    use monoio::io::AsyncWriteRent;
    let _ = c.stream.shutdown().await;
    // Bytes still to come: the rest of a body of known length, else up to
    // the bound.
    let mut left = c
        .unread_body
        .take()
        .map_or(LINGER_MAX_BYTES, |n| n.min(LINGER_MAX_BYTES));
    c.buf = Vec::with_capacity(crate::proxy::io::READ_CHUNK);
    let deadline = Instant::now() + ms(cfg.timeouts.client_body_ms);
    while left > 0 {
        c.buf.clear();
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .min(LINGER_IDLE);
        if wait.is_zero() {
            return;
        }
        match read_more(&mut c.stream, &mut c.buf, wait).await {
            Read::Data(n) => left = left.saturating_sub(n as u64),
            Read::Eof | Read::Err | Read::TimedOut => return,
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
        Read::Eof | Read::Err => Err(closed()),
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
pub fn closed() -> RouterError {
    RouterError::new(Kind::Internal, "")
}

pub fn shrink(c: &mut ClientConn) {
    for b in [&mut c.buf, &mut c.body, &mut c.rbuf, &mut c.out, &mut c.fwd] {
        if b.capacity() > KEEP_BUFFER && b.len() <= KEEP_BUFFER / 4 {
            b.shrink_to(KEEP_BUFFER / 4);
        }
    }
    if c.blocks.hashes.capacity() > KEEP_BUFFER / 8 {
        c.blocks = PromptBlocks::default();
    }
}
