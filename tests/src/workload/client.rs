//! A small async HTTP/1.1 client for load generation: a keep-alive
//! connection pool, Content-Length / chunked / close-delimited bodies, and
//! an SSE reader that timestamps the first content event (TTFT).

use anyhow::{Context, bail};
use bytes::{Buf, BytesMut};
use prefix_router::http::chunked::ChunkedDecoder;
use prefix_router::http::url::HttpUrl;
use serde::Deserialize;
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

/// Token counts as reported in `usage`.
#[derive(Clone, Copy, Debug, Default, Deserialize)]
pub struct Usage {
    #[serde(default)]
    pub prompt_tokens: u64,
    #[serde(default)]
    pub completion_tokens: u64,
    #[serde(default)]
    pub prompt_tokens_details: Option<Details>,
}

/// `usage.prompt_tokens_details`.
#[derive(Clone, Copy, Debug, Default, Deserialize)]
pub struct Details {
    #[serde(default)]
    pub cached_tokens: Option<u64>,
}

impl Usage {
    /// Cached prompt tokens (0 if not reported).
    pub fn cached(&self) -> u64 {
        self.prompt_tokens_details
            .and_then(|d| d.cached_tokens)
            .unwrap_or(0)
    }
}

/// The outcome of one request.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub status: u16,
    /// First content event (stream) or first body byte (non-stream).
    pub first: Option<Instant>,
    pub end: Instant,
    /// The generated text.
    pub text: String,
    pub usage: Option<Usage>,
    /// The `x-engine-id` response header (else `x-prefix-router-backend`).
    pub instance: Option<String>,
    pub error: Option<String>,
}

#[derive(Deserialize)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
}

#[derive(Deserialize)]
struct Message {
    #[serde(default)]
    content: Option<String>,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    delta: Option<Delta>,
    #[serde(default)]
    message: Option<Message>,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct Body {
    #[serde(default)]
    choices: Vec<Choice>,
    #[serde(default)]
    usage: Option<Usage>,
}

impl Body {
    fn content(self) -> (String, Option<Usage>) {
        let mut s = String::new();
        for c in self.choices {
            if let Some(t) = c
                .delta
                .and_then(|d| d.content)
                .or(c.message.and_then(|m| m.content))
                .or(c.text)
            {
                s.push_str(&t);
            }
        }
        (s, self.usage)
    }
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
            .send("GET", path, &[], b"", false, Duration::from_secs(30))
            .await;
        match o.error {
            Some(e) if o.status == 0 => bail!("GET {path}: {e}"),
            _ => Ok((o.status, o.text.into_bytes())),
        }
    }

    /// Sends one request and reads the response. `sse` parses an
    /// event-stream body into the generated text; otherwise a JSON body is
    /// parsed if it has `choices`, and kept as text if not.
    pub async fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        sse: bool,
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
                self.exchange(&mut conn, method, path, headers, body, sse),
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
        sse: bool,
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
        let (status, instance, framing, keep_alive, event_stream) = loop {
            let mut hs = [httparse::EMPTY_HEADER; 64];
            let mut r = httparse::Response::new(&mut hs);
            match r.parse(&buf) {
                Ok(httparse::Status::Complete(n)) => {
                    let mut instance = None;
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
                    break (status, instance, framing, keep_alive, event_stream);
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
        let mut text = String::new();
        let mut usage = None;
        let mut raw = Vec::new();
        let mut sse_buf = Vec::new();
        let mut saw_done = false;
        loop {
            let piece = reader
                .next(conn)
                .await
                .map_err(|e| fail(format!("{e} (after {} body bytes)", raw.len())))?;
            let Some(piece) = piece else { break };
            if first.is_none() && !(sse && event_stream) {
                first = Some(Instant::now());
            }
            if sse && event_stream && status == 200 {
                sse_buf.extend_from_slice(&piece);
                while let Some(end) = memchr::memmem::find(&sse_buf, b"\n\n") {
                    let event: Vec<u8> = sse_buf.drain(..end + 2).collect();
                    for line in event.split(|&b| b == b'\n') {
                        let Some(data) = line.strip_prefix(b"data:") else {
                            continue;
                        };
                        let data = data.trim_ascii();
                        if data == b"[DONE]" {
                            saw_done = true;
                            continue;
                        }
                        if let Ok(b) = serde_json::from_slice::<Body>(data) {
                            let (t, u) = b.content();
                            if !t.is_empty() && first.is_none() {
                                first = Some(Instant::now());
                            }
                            text.push_str(&t);
                            if u.is_some() {
                                usage = u;
                            }
                        }
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
        if status != 200 {
            error = Some(format!(
                "HTTP {status}: {}",
                String::from_utf8_lossy(&raw[..raw.len().min(300)])
            ));
        } else if sse && event_stream {
            if !saw_done {
                error = Some("stream ended without [DONE]".into());
            }
        } else if let Ok(b) = serde_json::from_slice::<Body>(&raw) {
            if raw.starts_with(b"{") && memchr::memmem::find(&raw, b"\"choices\"").is_some() {
                let (t, u) = b.content();
                text = t;
                usage = u;
            } else {
                text = String::from_utf8_lossy(&raw).into_owned();
            }
        } else {
            text = String::from_utf8_lossy(&raw).into_owned();
        }
        Ok((
            Outcome {
                status,
                first,
                end,
                text,
                usage,
                instance,
                error,
            },
            keep_alive,
        ))
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
        instance: None,
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
