//! A small async HTTP/1.1 client for load generation: a keep-alive
//! connection pool, Content-Length / chunked / close-delimited bodies, and
//! an SSE reader that timestamps the first content event (TTFT).

use super::answer::{Answer, Usage};
use super::api::Api;
use anyhow::{Context, bail};
use bytes::{Buf, BytesMut};
use prefix_router::http::chunked::ChunkedDecoder;
use prefix_router::http::url::HttpUrl;
use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Largest response accepted.
const MAX_RESPONSE: usize = 64 * 1024 * 1024;

/// Where requests go: `http://host:port[/prefix]` (a trailing `/v1` is dropped).
#[derive(Clone, Debug)]
pub struct Target {
    pub addr: SocketAddr,
    pub host: String,
    pub prefix: String,
}

impl Target {
    /// Parses and resolves a base URL.
    pub async fn parse(url: &str) -> anyhow::Result<Self> {
        let u = HttpUrl::parse(url).context("target")?;
        anyhow::ensure!(!u.tls, "the workload client speaks plain HTTP only: {url}");
        let hostport = u.host_port();
        let addr = tokio::net::lookup_host(&hostport)
            .await?
            .next()
            .context("target host does not resolve")?;
        let prefix = u.path.strip_suffix("/v1").unwrap_or(&u.path).to_string();
        Ok(Target {
            addr,
            host: hostport,
            prefix,
        })
    }
}

/// The outcome of one request.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub status: u16,
    /// First content event (stream) or first body byte (non-stream).
    pub first: Option<Instant>,
    pub end: Instant,
    /// The generated text (a body that is no answer: the body).
    pub text: String,
    pub usage: Option<Usage>,
    /// The answer's `id` (what a Responses `previous_response_id` names).
    pub id: Option<String>,
    /// The `x-engine-id` response header (else `x-prefix-router-backend`).
    pub instance: Option<String>,
    /// prefix-router's `x-prefix-router-decision` and `-matched-blocks`
    /// (with `debug_headers`), as `Warm 12`.
    pub decision: Option<String>,
    pub error: Option<String>,
}

/// How a response body is read.
#[derive(Clone, Copy, Debug)]
pub enum Read {
    /// Kept as text (`GET`s).
    Text,
    /// An answer of this API: its event stream when the server streams,
    /// else its JSON body (a body of another shape is kept as text).
    Answer(Api),
}

/// A keep-alive client for one target.
pub struct Client {
    pub target: Target,
    pool: Mutex<Vec<TcpStream>>,
}

/// A failure and whether it happened before any response byte (so a
/// request on a reused connection may be retried on a fresh one).
struct Failure {
    msg: String,
    before_response: bool,
}

impl Client {
    pub fn new(target: Target) -> Self {
        Self {
            target,
            pool: Mutex::new(Vec::new()),
        }
    }

    /// `GET path` → (status, body).
    pub async fn get(&self, path: &str) -> anyhow::Result<(u16, Vec<u8>)> {
        let o = self
            .send("GET", path, &[], b"", Read::Text, Duration::from_secs(30))
            .await;
        match o.error {
            Some(e) if o.status == 0 => bail!("GET {path}: {e}"),
            _ => Ok((o.status, o.text.into_bytes())),
        }
    }

    /// Sends one request and reads the response as `read` says.
    pub async fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        read: Read,
        timeout: Duration,
    ) -> Outcome {
        let start = Instant::now();
        for attempt in 0..2 {
            // The retry goes on a fresh connection: the pool may hold more
            // that the server closed (a server restarted closed them all).
            let pooled = if attempt == 0 {
                self.pool.lock().expect("pool").pop()
            } else {
                None
            };
            let reused = pooled.is_some();
            let mut conn = match pooled {
                Some(c) => c,
                None => match tokio::time::timeout(timeout, TcpStream::connect(self.target.addr))
                    .await
                {
                    Ok(Ok(c)) => {
                        let _ = c.set_nodelay(true);
                        c
                    }
                    Ok(Err(e)) => return failed(format!("connect: {e}"), start),
                    Err(_) => return failed("connect timed out".into(), start),
                },
            };
            let r = tokio::time::timeout(
                timeout,
                self.exchange(&mut conn, method, path, headers, body, read),
            )
            .await;
            match r {
                Ok(Ok((outcome, reusable))) => {
                    if reusable {
                        self.pool.lock().expect("pool").push(conn);
                    }
                    return outcome;
                }
                Ok(Err(f)) if f.before_response && reused && attempt == 0 => continue,
                Ok(Err(f)) => return failed(f.msg, start),
                Err(_) => return failed(format!("timed out after {timeout:?}"), start),
            }
        }
        failed("retry failed".into(), start)
    }

    async fn exchange(
        &self,
        conn: &mut TcpStream,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        read: Read,
    ) -> Result<(Outcome, bool), Failure> {
        let mut req = Vec::with_capacity(256 + body.len());
        req.extend_from_slice(
            format!(
                "{method} {}{path} HTTP/1.1\r\nhost: {}\r\n",
                self.target.prefix, self.target.host
            )
            .as_bytes(),
        );
        for (k, v) in headers {
            req.extend_from_slice(format!("{k}: {v}\r\n").as_bytes());
        }
        if method != "GET" {
            req.extend_from_slice(
                format!(
                    "content-type: application/json\r\ncontent-length: {}\r\n",
                    body.len()
                )
                .as_bytes(),
            );
        }
        req.extend_from_slice(b"\r\n");
        req.extend_from_slice(body);
        let early = |e: std::io::Error| Failure {
            msg: format!("write: {e}"),
            before_response: true,
        };
        conn.write_all(&req).await.map_err(early)?;

        let mut buf = BytesMut::with_capacity(16 * 1024);
        let fail = |msg: String| Failure {
            msg,
            before_response: false,
        };
        // Head.
        let (status, instance, decision, framing, keep_alive, event_stream) = loop {
            let mut hs = [httparse::EMPTY_HEADER; 64];
            let mut r = httparse::Response::new(&mut hs);
            match r.parse(&buf) {
                Ok(httparse::Status::Complete(n)) => {
                    let mut instance = None;
                    let (mut decision, mut matched) = (None, None);
                    let mut framing = Framing::Close;
                    let mut keep_alive = r.version == Some(1);
                    let mut event_stream = false;
                    for h in r.headers.iter() {
                        let v = String::from_utf8_lossy(h.value).trim().to_string();
                        let name = h.name.to_ascii_lowercase();
                        match name.as_str() {
                            "x-engine-id" => instance = Some(v),
                            // Engines without an id header (llama-server):
                            // the router's debug header names the backend.
                            "x-prefix-router-backend" if instance.is_none() => instance = Some(v),
                            "x-prefix-router-decision" => decision = Some(v),
                            "x-prefix-router-matched-blocks" => matched = Some(v),
                            "content-length" => {
                                framing = Framing::Length(
                                    v.parse().map_err(|_| fail("bad content-length".into()))?,
                                )
                            }
                            "transfer-encoding" if v.to_ascii_lowercase().contains("chunked") => {
                                framing = Framing::Chunked
                            }
                            "connection" => keep_alive = !v.eq_ignore_ascii_case("close"),
                            "content-type" => event_stream = v.starts_with("text/event-stream"),
                            _ => {}
                        }
                    }
                    let status = r.code.unwrap_or(0);
                    buf.advance(n);
                    if status == 100 {
                        continue;
                    }
                    let decision = decision.map(|d| match matched {
                        Some(m) => format!("{d} {m}"),
                        None => d,
                    });
                    break (
                        status,
                        instance,
                        decision,
                        framing,
                        keep_alive,
                        event_stream,
                    );
                }
                Ok(httparse::Status::Partial) => {}
                Err(e) => return Err(fail(format!("bad response head: {e}"))),
            }
            quickack(conn);
            let got = conn.read_buf(&mut buf).await.map_err(|e| Failure {
                msg: format!("read: {e}"),
                before_response: buf.is_empty(),
            })?;
            if got == 0 {
                return Err(Failure {
                    msg: "connection closed before response".into(),
                    before_response: buf.is_empty(),
                });
            }
        };
        let keep_alive = keep_alive && framing != Framing::Close;
        let mut reader = BodyReader {
            framing,
            buf,
            chunked: ChunkedDecoder::new(),
            done: false,
        };
        let mut first = None;
        let mut answer = match read {
            Read::Answer(api) => Some(Answer::new(api)),
            Read::Text => None,
        };
        let streaming = answer.is_some() && event_stream && status == 200;
        let mut raw = Vec::new();
        let mut sse_buf = Vec::new();
        loop {
            let piece = reader
                .next(conn)
                .await
                .map_err(|e| fail(format!("{e} (after {} body bytes)", raw.len())))?;
            let Some(piece) = piece else { break };
            if first.is_none() && !streaming {
                first = Some(Instant::now());
            }
            if let (true, Some(a)) = (streaming, answer.as_mut()) {
                sse_buf.extend_from_slice(&piece);
                while let Some(end) = memchr::memmem::find(&sse_buf, b"\n\n") {
                    let event: Vec<u8> = sse_buf.drain(..end + 2).collect();
                    if a.event(&event_data(&event)) && first.is_none() {
                        first = Some(Instant::now());
                    }
                }
            } else {
                raw.extend_from_slice(&piece);
                if raw.len() > MAX_RESPONSE {
                    return Err(fail("response too large".into()));
                }
            }
        }
        let end = Instant::now();
        let mut error = None;
        let mut text = String::new();
        let (mut usage, mut id) = (None, None);
        if status != 200 {
            error = Some(format!(
                "HTTP {status}: {}",
                String::from_utf8_lossy(&raw[..raw.len().min(300)])
            ));
        } else {
            let read = match answer {
                Some(a) if streaming => {
                    error = a.incomplete();
                    Some(a)
                }
                Some(mut a) => a.body(&raw).then_some(a),
                None => None,
            };
            match read {
                Some(a) => (text, usage, id) = (a.text, a.usage, a.id),
                None => text = String::from_utf8_lossy(&raw).into_owned(),
            }
        }
        Ok((
            Outcome {
                status,
                first,
                end,
                text,
                usage,
                id,
                instance,
                decision,
                error,
            },
            keep_alive,
        ))
    }
}

/// An event's data: its `data:` lines, each trimmed, joined with `\n`.
fn event_data(event: &[u8]) -> Cow<'_, [u8]> {
    let mut lines = event
        .split(|&b| b == b'\n')
        .filter_map(|l| l.strip_prefix(b"data:"))
        .map(<[u8]>::trim_ascii);
    let Some(one) = lines.next() else {
        return Cow::Borrowed(b"");
    };
    match lines.next() {
        None => Cow::Borrowed(one),
        Some(two) => {
            let mut v = [one, two].join(&b'\n');
            for l in lines {
                v.push(b'\n');
                v.extend_from_slice(l);
            }
            Cow::Owned(v)
        }
    }
}

/// Acknowledges what arrives at once instead of after Linux's delayed-ACK
/// timer (up to 40 ms). A server that writes a response in two small
/// segments without TCP_NODELAY (sglang-router 0.3.2 writes the SSE head,
/// then the first event) waits for that ACK under Nagle's rule, which would
/// add 40 ms to every TTFT measured through it on a reused connection. The
/// flag does not stick (the kernel clears it), so it is set before every read.
fn quickack(conn: &TcpStream) {
    let _ = socket2::SockRef::from(conn).set_tcp_quickack(true);
}

fn failed(msg: String, _start: Instant) -> Outcome {
    Outcome {
        status: 0,
        first: None,
        end: Instant::now(),
        text: String::new(),
        usage: None,
        id: None,
        instance: None,
        decision: None,
        error: Some(msg),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Framing {
    Length(usize),
    Chunked,
    Close,
}

/// Yields a response body's decoded pieces as they arrive.
struct BodyReader {
    framing: Framing,
    buf: BytesMut,
    chunked: ChunkedDecoder,
    done: bool,
}

impl BodyReader {
    async fn fill(&mut self, conn: &mut TcpStream) -> std::io::Result<usize> {
        quickack(conn);
        conn.read_buf(&mut self.buf).await
    }

    async fn next(&mut self, conn: &mut TcpStream) -> std::io::Result<Option<Vec<u8>>> {
        let eof = || {
            std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "connection closed mid-body",
            )
        };
        let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "bad chunked encoding");
        if self.done {
            return Ok(None);
        }
        match self.framing {
            Framing::Length(left) => {
                if left == 0 {
                    self.done = true;
                    return Ok(None);
                }
                if self.buf.is_empty() && self.fill(conn).await? == 0 {
                    return Err(eof());
                }
                let n = left.min(self.buf.len());
                self.framing = Framing::Length(left - n);
                Ok(Some(self.buf.split_to(n).to_vec()))
            }
            Framing::Close => {
                if self.buf.is_empty() && self.fill(conn).await? == 0 {
                    self.done = true;
                    return Ok(None);
                }
                Ok(Some(self.buf.split().to_vec()))
            }
            Framing::Chunked => loop {
                // Whatever the buffer holds, decoded; read more when it
                // held no body bytes.
                let mut out = Vec::new();
                let used = self
                    .chunked
                    .feed(&self.buf, Some(&mut out))
                    .map_err(|_| bad())?;
                self.buf.advance(used);
                if self.chunked.is_done() {
                    self.done = true;
                }
                if !out.is_empty() {
                    return Ok(Some(out));
                }
                if self.done {
                    return Ok(None);
                }
                if self.fill(conn).await? == 0 {
                    return Err(eof());
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::event_data;

    #[test]
    fn an_event_s_data_lines_are_joined_and_its_name_left_out() {
        let named = b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
        assert_eq!(&*event_data(named), br#"{"type":"message_stop"}"#);
        assert_eq!(&*event_data(b"data: [DONE]\n\n"), b"[DONE]");
        assert_eq!(&*event_data(b"data: {\"a\":\ndata: 1}\n\n"), b"{\"a\":\n1}");
        assert_eq!(&*event_data(b": keep-alive\n\n"), b"");
    }
}
