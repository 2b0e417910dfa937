//! One probe: a blocking HTTP/1.1 GET with a deadline for the whole exchange
//! (connect, request, whole answer), the answer read by its framing
//! (`Content-Length`, chunked, or until close), so a backend that keeps the
//! connection open after a complete answer is not waited on, and one that
//! trickles its answer is cut at the deadline.

use std::fmt;
use std::io::{self, Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::Config;
use crate::fleet::backend::Backend;

use crate::http::MAX_HEADERS;
use crate::http::chunked::ChunkedDecoder;

/// Largest answer body kept (an engine's `/metrics` page is a few KB).
pub const MAX_BODY_BYTES: usize = 1 << 20;
/// Largest answer head (status line and headers) read.
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Bytes asked of the socket per read.
const READ_CHUNK: usize = 16 * 1024;

/// A complete answer.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    /// The body, de-chunked.
    pub body: Vec<u8>,
}

/// Why a probe failed.
#[derive(Debug)]
pub enum ProbeError {
    /// The deadline passed before the whole answer was in.
    TimedOut(Duration),
    /// Connect, write or read failed.
    Io(io::Error),
    /// The connection closed before the whole answer was in.
    Closed,
    /// The answer is not valid HTTP/1.1, or is too large.
    Invalid(String),
}

impl fmt::Display for ProbeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProbeError::TimedOut(t) => write!(f, "no whole answer within {} ms", t.as_millis()),
            ProbeError::Io(e) => write!(f, "{e}"),
            ProbeError::Closed => f.write_str("connection closed before the whole answer"),
            ProbeError::Invalid(why) => write!(f, "invalid answer: {why}"),
        }
    }
}

/// How the answer's body is delimited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Framing {
    None,
    Length(usize),
    Chunked,
    Close,
}

/// Where a probe goes: the backend's address, and for an `https://`
/// backend the TLS configuration and the name its certificate must carry.
pub struct Target {
    pub addr: SocketAddr,
    pub tls: Option<(Arc<rustls::ClientConfig>, String)>,
}

impl Target {
    /// A backend as the data path reaches it (`[backend_tls]` for https).
    pub fn of(cfg: &Config, b: &Backend) -> Target {
        Target {
            addr: b.addr,
            tls: b
                .tls_name
                .clone()
                .and_then(|n| Some((cfg.loaded.client_tls.clone()?, n))),
        }
    }
}

/// A probe's connection: plain, or rustls over the blocking socket.
trait Conn: io::Read + io::Write {}
impl<T: io::Read + io::Write> Conn for T {}

/// `GET path` on `target`, the whole exchange (the TLS handshake
/// included) within `timeout`.
pub fn get(target: &Target, path: &str, timeout: Duration) -> Result<Answer, ProbeError> {
    let addr = target.addr;
    let deadline = Instant::now() + timeout;
    let left = || {
        deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or(ProbeError::TimedOut(timeout))
    };
    let sock = TcpStream::connect_timeout(&addr, left()?).map_err(|e| io_error(e, timeout))?;
    let _ = sock.set_nodelay(true);
    sock.set_write_timeout(Some(left()?))
        .map_err(ProbeError::Io)?;
    sock.set_read_timeout(Some(left()?))
        .map_err(ProbeError::Io)?;
    let host = match &target.tls {
        Some((_, name)) => name.clone(),
        None => addr.to_string(),
    };
    let mut s: Box<dyn Conn> = match &target.tls {
        None => Box::new(sock.try_clone().map_err(ProbeError::Io)?),
        Some((cfg, name)) => {
            let name = rustls::pki_types::ServerName::try_from(name.clone())
                .map_err(|e| ProbeError::Invalid(format!("TLS name: {e}")))?;
            let conn = rustls::ClientConnection::new(cfg.clone(), name)
                .map_err(|e| ProbeError::Io(io::Error::other(e)))?;
            Box::new(rustls::StreamOwned::new(
                conn,
                sock.try_clone().map_err(ProbeError::Io)?,
            ))
        }
    };
    // A few dozen bytes, formatted first so they leave in one segment, into
    // an empty socket buffer.
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: prefix-router-health\r\nConnection: close\r\n\r\n"
    );
    s.write_all(request.as_bytes())
        .and_then(|()| s.flush())
        .map_err(|e| io_error(e, timeout))?;

    let mut buf = Vec::with_capacity(4096);
    let mut read_more = |buf: &mut Vec<u8>| -> Result<usize, ProbeError> {
        sock.set_read_timeout(Some(left()?))
            .map_err(ProbeError::Io)?;
        let len = buf.len();
        buf.resize(len + READ_CHUNK, 0);
        let r = s.read(&mut buf[len..]);
        buf.truncate(len + *r.as_ref().unwrap_or(&0));
        r.map_err(|e| io_error(e, timeout))
    };
    // Interim (1xx) answers are skipped; the final one is kept.
    let (status, framing, head_len) = loop {
        match parse_head(&buf)? {
            Some((status, _, len)) if (100..200).contains(&status) && status != 101 => {
                buf.drain(..len);
            }
            Some(head) => break head,
            None if buf.len() > MAX_HEAD_BYTES => {
                return Err(ProbeError::Invalid(format!(
                    "head over {MAX_HEAD_BYTES} bytes"
                )));
            }
            None => {
                if read_more(&mut buf)? == 0 {
                    return Err(ProbeError::Closed);
                }
            }
        }
    };
    let mut body = Vec::new();
    let mut pos = head_len;
    match framing {
        Framing::None => {}
        Framing::Length(n) => {
            while buf.len() < head_len + n {
                if read_more(&mut buf)? == 0 {
                    return Err(ProbeError::Closed);
                }
            }
            body.extend_from_slice(&buf[head_len..head_len + n]);
        }
        Framing::Chunked => {
            let mut dec = ChunkedDecoder::new();
            loop {
                pos += dec
                    .feed(&buf[pos..], Some(&mut body))
                    .map_err(|e| ProbeError::Invalid(e.message))?;
                if dec.is_done() {
                    break;
                }
                if body.len() > MAX_BODY_BYTES {
                    return Err(too_large());
                }
                buf.drain(..pos);
                pos = 0;
                if read_more(&mut buf)? == 0 {
                    return Err(ProbeError::Closed);
                }
            }
        }
        Framing::Close => {
            while read_more(&mut buf)? > 0 {
                if buf.len() - head_len > MAX_BODY_BYTES {
                    return Err(too_large());
                }
            }
            body.extend_from_slice(&buf[head_len..]);
        }
    }
    Ok(Answer { status, body })
}

/// The status, body framing and head length of a complete head at the start
/// of `buf`; `None` while incomplete.
fn parse_head(buf: &[u8]) -> Result<Option<(u16, Framing, usize)>, ProbeError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut headers);
    let len = match resp.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(ProbeError::Invalid(format!("malformed head: {e}"))),
    };
    let status = resp.code.unwrap_or(0);
    let mut length: Option<usize> = None;
    let mut transfer_encoding: Option<&[u8]> = None;
    for h in resp.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            let v = parse_length(h.value)?;
            if length.is_some_and(|l| l != v) {
                return Err(ProbeError::Invalid("conflicting Content-Length".into()));
            }
            length = Some(v);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            if transfer_encoding.is_some() {
                return Err(ProbeError::Invalid("repeated Transfer-Encoding".into()));
            }
            transfer_encoding = Some(h.value);
        }
    }
    // RFC 9112 section 6.3, with ambiguous framing refused rather than guessed.
    let framing = if status < 200 || status == 204 || status == 304 {
        Framing::None
    } else if let Some(te) = transfer_encoding {
        if length.is_some() {
            return Err(ProbeError::Invalid(
                "both Content-Length and Transfer-Encoding".into(),
            ));
        }
        if !te.trim_ascii().eq_ignore_ascii_case(b"chunked") {
            return Err(ProbeError::Invalid(format!(
                "transfer coding {:?} (only \"chunked\")",
                String::from_utf8_lossy(te)
            )));
        }
        Framing::Chunked
    } else if let Some(n) = length {
        if n > MAX_BODY_BYTES {
            return Err(too_large());
        }
        Framing::Length(n)
    } else {
        Framing::Close
    };
    Ok(Some((status, framing, len)))
}

fn parse_length(v: &[u8]) -> Result<usize, ProbeError> {
    let v = v.trim_ascii();
    if v.is_empty() || v.len() > 19 || !v.iter().all(u8::is_ascii_digit) {
        return Err(ProbeError::Invalid(format!(
            "Content-Length {:?}",
            String::from_utf8_lossy(v)
        )));
    }
    Ok(v.iter().fold(0usize, |n, d| {
        n.saturating_mul(10).saturating_add(usize::from(d - b'0'))
    }))
}

fn too_large() -> ProbeError {
    ProbeError::Invalid(format!("body over {MAX_BODY_BYTES} bytes"))
}

/// Socket timeouts surface as `WouldBlock` or `TimedOut`: both are the deadline.
fn io_error(e: io::Error, timeout: Duration) -> ProbeError {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ProbeError::TimedOut(timeout),
        _ => ProbeError::Io(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plain-HTTP probe of `addr`.
    fn get(addr: SocketAddr, path: &str, timeout: Duration) -> Result<Answer, ProbeError> {
        super::get(&Target { addr, tls: None }, path, timeout)
    }
    use std::net::TcpListener;

    /// A server that reads a request head on the first connection, writes
    /// `answer`, and keeps the connection open for `hold`.
    fn serve_once(answer: &'static [u8], hold: Duration) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut head = Vec::new();
            let mut tmp = [0u8; 1024];
            while !head.ends_with(b"\r\n\r\n") {
                match s.read(&mut tmp) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => head.extend_from_slice(&tmp[..n]),
                }
            }
            let _ = s.write_all(answer);
            std::thread::sleep(hold);
        });
        addr
    }

    const HOLD: Duration = Duration::from_secs(5);
    const TIMEOUT: Duration = Duration::from_secs(2);

    #[test]
    fn framed_answers_end_without_waiting_for_close() {
        let cases: [(&[u8], u16, &[u8]); 4] = [
            (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", 200, b""),
            (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", 200, b"ok"),
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n1\r\n!\r\n0\r\n\r\n",
                200,
                b"ok!",
            ),
            (
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 503 Busy\r\nContent-Length: 1\r\n\r\nx",
                503,
                b"x",
            ),
        ];
        for (answer, status, body) in cases {
            let t = Instant::now();
            let a = get(serve_once(answer, HOLD), "/health", TIMEOUT).unwrap();
            assert_eq!((a.status, &a.body[..]), (status, body));
            assert!(t.elapsed() < TIMEOUT, "did not wait for the close");
        }
    }

    #[test]
    fn an_unframed_answer_waits_for_close_and_times_out_at_the_deadline() {
        let addr = serve_once(b"HTTP/1.1 200 OK\r\n\r\npartial", HOLD);
        let t = Instant::now();
        let e = get(addr, "/health", Duration::from_millis(300)).unwrap_err();
        assert!(matches!(e, ProbeError::TimedOut(_)), "{e}");
        assert!(t.elapsed() < Duration::from_secs(2));
        let addr = serve_once(b"HTTP/1.1 200 OK\r\n\r\nall", Duration::ZERO);
        assert_eq!(get(addr, "/", TIMEOUT).unwrap().body, b"all");
    }

    #[test]
    fn ambiguous_or_broken_answers_fail() {
        for answer in [
            &b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: +1\r\n\r\n",
            b"SSH-2.0-OpenSSH\r\n\r\n",
        ] {
            let e = get(serve_once(answer, HOLD), "/", TIMEOUT).unwrap_err();
            assert!(matches!(e, ProbeError::Invalid(_)), "{e}");
        }
        let e = get(
            serve_once(
                b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab",
                Duration::ZERO,
            ),
            "/",
            TIMEOUT,
        )
        .unwrap_err();
        assert!(matches!(e, ProbeError::Closed), "{e}");
    }
}
