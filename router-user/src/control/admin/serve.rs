//! Serving admin connections: a thread per connection, at most
//! [`MAX_CONNECTIONS`] at once, so an idle or slow operator's connection
//! never holds up another's `GET /metrics`. Each request is read under the
//! traffic side's limits and timeouts: `limits.max_header_bytes` (431 past
//! it), `limits.max_body_bytes` (413), `timeouts.client_idle_ms` for the
//! first byte, `timeouts.client_header_ms` for the whole head and
//! `timeouts.client_body_ms` for the body (408). One request per connection.

use std::io::{self, Read as _, Write as _};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

use anyhow::Context;
use tracing::{debug, info, warn};

use super::{Reloader, Reply, Request, handle};
use crate::config::{Config, ms};
use crate::http::MAX_HEADERS;
use crate::http::chunked::ChunkedDecoder;
use crate::shared::Router;

/// Admin connections served at once. Operators' calls are rare and short;
/// past this a new connection is answered 503 and closed at once, so a pile
/// of idle connections costs at most this many small threads.
const MAX_CONNECTIONS: usize = 32;
/// Stack of a connection thread (`/admin/explain` runs the JSON extractor).
const CONN_STACK: usize = 1024 * 1024;
/// Writing an answer to an operator who stopped reading gives up after this.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Bytes asked of the socket per read; a head grows past the limit by at
/// most this before it is refused.
const READ_CHUNK: usize = 8 * 1024;
/// After an error answer, unread request bytes are drained for at most this
/// long (and [`LINGER_BYTES`]) before closing, so the close does not reset
/// the connection before the client has read the answer.
const LINGER: Duration = Duration::from_millis(500);
const LINGER_BYTES: usize = 256 * 1024;
/// Pause after a failed accept (out of descriptors): no busy loop.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

pub fn start(router: Arc<Router>, addr: SocketAddr, reload: Reloader) -> anyhow::Result<()> {
    let listener =
        TcpListener::bind(addr).with_context(|| format!("binding the admin listener {addr}"))?;
    let addr = listener.local_addr()?;
    info!(%addr, "admin listener (metrics, /admin/*)");
    println!("admin listening on {addr}");
    // Connections run concurrently, reloads one at a time (as on one thread
    // before): two at once could both hand out the same free slot.
    let serial = std::sync::Mutex::new(());
    let reload: Arc<Reloader> = Arc::new(Box::new(move || {
        let _one = serial.lock().unwrap_or_else(|e| e.into_inner());
        reload()
    }));
    let active = Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("admin".into())
        .spawn(move || {
            loop {
                match listener.accept() {
                    Ok((stream, peer)) => admit(&router, &reload, &active, stream, peer),
                    Err(e) => {
                        warn!(error = %e, "admin accept failed");
                        std::thread::sleep(ACCEPT_BACKOFF);
                    }
                }
            }
        })?;
    Ok(())
}

/// Counts a connection thread until dropped.
struct Active(Arc<AtomicUsize>);

impl Drop for Active {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

fn admit(
    router: &Arc<Router>,
    reload: &Arc<Reloader>,
    active: &Arc<AtomicUsize>,
    stream: TcpStream,
    peer: SocketAddr,
) {
    if active.fetch_add(1, Relaxed) >= MAX_CONNECTIONS {
        active.fetch_sub(1, Relaxed);
        router.metrics.admin_refused();
        warn!(%peer, max = MAX_CONNECTIONS, "refusing an admin connection: too many open");
        refuse(stream);
        return;
    }
    let guard = Active(active.clone());
    let (router, reload) = (router.clone(), reload.clone());
    let spawned = std::thread::Builder::new()
        .name("admin-conn".into())
        .stack_size(CONN_STACK)
        .spawn(move || {
            let _guard = guard;
            if let Err(e) = serve(&router, stream, &reload) {
                debug!(%peer, error = %e, "admin connection ended with an error");
            }
        });
    // On failure the closure, guard and stream included, is dropped.
    if let Err(e) = spawned {
        warn!(%peer, error = %e, "cannot start an admin connection thread");
    }
}

/// Answers 503 without blocking the accept loop.
fn refuse(mut stream: TcpStream) {
    let reply = Reply::text(503, "too many admin connections; retry shortly\n");
    if stream.set_nonblocking(true).is_ok() {
        let _ = stream.write_all(&encode(&reply, &[("retry-after", "1")]));
    }
    let _ = stream.shutdown(Shutdown::Write);
}

/// A request read whole.
struct Incoming {
    method: String,
    target: String,
    /// The head as received (what `/admin/explain` reads a caller from).
    head: Vec<u8>,
    body: Vec<u8>,
}

fn serve(router: &Router, mut stream: TcpStream, reload: &Reloader) -> io::Result<()> {
    let cfg = router.config.load_full();
    stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
    let _ = stream.set_nodelay(true);
    let mut buf = Vec::with_capacity(READ_CHUNK);
    let inc = match read_request(&cfg, &mut stream, &mut buf) {
        Ok(Some(inc)) => inc,
        Ok(None) => return Ok(()),
        Err(reply) => {
            debug!(status = reply.status, error = %reply.body.trim_end(), "refused admin request");
            stream.write_all(&encode(&reply, &[]))?;
            linger(stream);
            return Ok(());
        }
    };
    drop(buf);
    let (path, query) = inc.target.split_once('?').unwrap_or((&inc.target, ""));
    let reply = handle(
        router,
        &Request {
            method: &inc.method,
            path,
            query,
            head: &inc.head,
            body: &inc.body,
        },
        reload,
    );
    stream.write_all(&encode(&reply, &[]))
}

/// The response bytes (always `connection: close`).
fn encode(reply: &Reply, extra: &[(&str, &str)]) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: {}\r\ncontent-length: {}\r\nconnection: close\r\n",
        reply.status,
        crate::error::reason(reply.status),
        reply.content_type,
        reply.body.len()
    );
    for (k, v) in extra {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str("\r\n");
    out.push_str(&reply.body);
    out.into_bytes()
}

/// Stops writing, then discards what the client still sends, within bounds.
fn linger(mut stream: TcpStream) {
    let _ = stream.shutdown(Shutdown::Write);
    let deadline = Instant::now() + LINGER;
    let mut tmp = [0u8; READ_CHUNK];
    let mut drained = 0;
    while drained < LINGER_BYTES {
        let Some(left) = deadline.checked_duration_since(Instant::now()) else {
            break;
        };
        if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
            break;
        }
        match stream.read(&mut tmp) {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n,
        }
    }
}

/// Outcome of one read with a timeout.
enum Got {
    Data,
    Closed,
    TimedOut,
}

/// Appends up to [`READ_CHUNK`] bytes to `buf`, waiting at most `timeout`.
fn read_some(s: &mut TcpStream, buf: &mut Vec<u8>, timeout: Duration) -> Got {
    if timeout.is_zero() || s.set_read_timeout(Some(timeout)).is_err() {
        return Got::TimedOut;
    }
    let len = buf.len();
    buf.resize(len + READ_CHUNK, 0);
    let r = s.read(&mut buf[len..]);
    buf.truncate(len + *r.as_ref().unwrap_or(&0));
    match r {
        Ok(0) => Got::Closed,
        Ok(_) => Got::Data,
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            Got::TimedOut
        }
        Err(_) => Got::Closed,
    }
}

/// How the request body is framed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Framing {
    Length(usize),
    Chunked,
}

/// What the head says.
struct Head {
    method: String,
    target: String,
    framing: Framing,
    expect_continue: bool,
    len: usize,
}

/// Reads one request. `Ok(None)`: the client closed or stayed silent for
/// `timeouts.client_idle_ms` before sending anything; `Err`: the answer to a
/// request refused.
fn read_request(
    cfg: &Config,
    s: &mut TcpStream,
    buf: &mut Vec<u8>,
) -> Result<Option<Incoming>, Reply> {
    let t = &cfg.timeouts;
    let mut head_deadline: Option<Instant> = None;
    let head = loop {
        if !buf.is_empty()
            && let Some(head) = parse_head(buf, cfg.limits.max_header_bytes)?
        {
            break head;
        }
        let timeout = match head_deadline {
            None => ms(t.client_idle_ms),
            Some(d) => d.saturating_duration_since(Instant::now()),
        };
        match read_some(s, buf, timeout) {
            Got::Data => {
                head_deadline.get_or_insert_with(|| Instant::now() + ms(t.client_header_ms));
            }
            Got::Closed => return Ok(None),
            Got::TimedOut if head_deadline.is_none() => return Ok(None),
            Got::TimedOut => {
                return Err(Reply::text(
                    408,
                    format!(
                        "request head not received within {} ms (timeouts.client_header_ms)\n",
                        t.client_header_ms
                    ),
                ));
            }
        }
    };
    let head_bytes = buf[..head.len].to_vec();
    let max_body = cfg.limits.max_body_bytes;
    let body_deadline = Instant::now() + ms(t.client_body_ms);
    let body_timeout = || {
        Reply::text(
            408,
            format!(
                "request body not received within {} ms (timeouts.client_body_ms)\n",
                t.client_body_ms
            ),
        )
    };
    let more = |s: &mut TcpStream, buf: &mut Vec<u8>| match read_some(
        s,
        buf,
        body_deadline.saturating_duration_since(Instant::now()),
    ) {
        Got::Data => Ok(()),
        Got::TimedOut => Err(body_timeout()),
        Got::Closed => Err(Reply::text(400, "connection closed mid-body\n")),
    };
    let continue_if_asked = |s: &mut TcpStream, have: bool| {
        if head.expect_continue && !have {
            let _ = s.write_all(b"HTTP/1.1 100 Continue\r\n\r\n");
        }
    };
    let body = match head.framing {
        Framing::Length(n) => {
            if n > max_body {
                return Err(too_large(max_body));
            }
            let end = head.len + n;
            continue_if_asked(s, buf.len() >= end);
            buf.reserve(end.saturating_sub(buf.len()));
            while buf.len() < end {
                more(s, buf)?;
            }
            buf[head.len..end].to_vec()
        }
        Framing::Chunked => {
            continue_if_asked(s, false);
            let mut dec = ChunkedDecoder::new();
            let mut body = Vec::new();
            let mut pos = head.len;
            loop {
                pos += dec
                    .feed(&buf[pos..], Some(&mut body))
                    .map_err(|e| Reply::text(400, format!("{}\n", e.message)))?;
                if body.len() > max_body {
                    return Err(too_large(max_body));
                }
                if dec.is_done() {
                    break body;
                }
                buf.drain(..pos);
                pos = 0;
                more(s, buf)?;
            }
        }
    };
    Ok(Some(Incoming {
        method: head.method,
        target: head.target,
        head: head_bytes,
        body,
    }))
}

fn too_large(max: usize) -> Reply {
    Reply::text(
        413,
        format!("request body is over {max} bytes (limits.max_body_bytes)\n"),
    )
}

/// Parses the head at the start of `buf`; `Ok(None)` while incomplete.
fn parse_head(buf: &[u8], max_header_bytes: usize) -> Result<Option<Head>, Reply> {
    let too_big = || {
        Reply::text(
            431,
            format!("request head is over {max_header_bytes} bytes (limits.max_header_bytes)\n"),
        )
    };
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let len = match req.parse(buf) {
        Ok(httparse::Status::Complete(len)) if len <= max_header_bytes => len,
        Ok(httparse::Status::Complete(_)) => return Err(too_big()),
        Ok(httparse::Status::Partial) if buf.len() > max_header_bytes => return Err(too_big()),
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => {
            return Err(Reply::text(
                431,
                format!("request has more than {MAX_HEADERS} headers\n"),
            ));
        }
        Err(e) => return Err(Reply::text(400, format!("malformed request head: {e}\n"))),
    };
    let mut length: Option<usize> = None;
    let mut chunked = false;
    let mut expect_continue = false;
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            let v = h.value.trim_ascii();
            let n = std::str::from_utf8(v)
                .ok()
                .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|v| v.parse::<usize>().ok());
            match (n, length) {
                (Some(n), None) => length = Some(n),
                (Some(n), Some(l)) if n == l => {}
                _ => return Err(Reply::text(400, "invalid or conflicting Content-Length\n")),
            }
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            if chunked || !h.value.trim_ascii().eq_ignore_ascii_case(b"chunked") {
                return Err(Reply::text(
                    501,
                    "only one \"chunked\" transfer coding is supported\n",
                ));
            }
            chunked = true;
        } else if h.name.eq_ignore_ascii_case("expect") {
            expect_continue = h.value.trim_ascii().eq_ignore_ascii_case(b"100-continue");
        }
    }
    let framing = match (chunked, length) {
        (true, Some(_)) => {
            return Err(Reply::text(
                400,
                "both Content-Length and Transfer-Encoding\n",
            ));
        }
        (true, None) => Framing::Chunked,
        (false, n) => Framing::Length(n.unwrap_or(0)),
    };
    Ok(Some(Head {
        method: req.method.unwrap_or("").to_owned(),
        target: req.path.unwrap_or("/").to_owned(),
        framing,
        expect_continue,
        len,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(raw: &str) -> Result<Option<Framing>, u16> {
        parse_head(raw.as_bytes(), 1024)
            .map(|h| h.map(|h| h.framing))
            .map_err(|r| r.status)
    }

    #[test]
    fn heads_are_framed_or_refused() {
        assert_eq!(status("GET /metrics HTTP/1.1\r\nHost: x\r\n"), Ok(None));
        assert_eq!(
            status("POST /admin/explain HTTP/1.1\r\nContent-Length: 7\r\n\r\n"),
            Ok(Some(Framing::Length(7)))
        );
        assert_eq!(
            status("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"),
            Ok(Some(Framing::Chunked))
        );
        for (raw, code) in [
            (
                "POST / HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
                400,
            ),
            (
                "POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
                400,
            ),
            ("POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
            ("POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
            ("GET / HTTP/1.1\r\nBad Header: 1\r\n\r\n", 400),
        ] {
            assert_eq!(status(raw), Err(code), "{raw:?}");
        }
        let long = format!("GET / HTTP/1.1\r\nX: {}", "a".repeat(2000));
        assert_eq!(status(&long), Err(431), "an unfinished line over the limit");
    }
}
