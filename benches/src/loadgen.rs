//! The closed-loop HTTP/1.1 load generator: `concurrency` keep-alive
//! connections on one thread (a current-thread tokio runtime, like `wrk -t1`),
//! each sending the same request back to back and timing every answer.
//!
//! A run has a warm-up (not recorded) and a measured window; a request counts
//! when it completes inside the window. The caller's probe runs at both ends
//! of the window on the calling thread, so CPU counters read there cover
//! exactly what was measured.

use hdrhistogram::Histogram;
use prefix_router::http::chunked::ChunkedDecoder;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

/// Longest time one request may take before its connection is dropped.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Latency histogram range: 1 us to 60 s at 3 significant digits.
const HIST_MAX_NS: u64 = 60_000_000_000;

/// How connections are made.
#[derive(Clone, Default)]
pub struct ConnSpec {
    /// TLS with this client configuration, checking the server's
    /// certificate against the name (plain TCP when `None`).
    pub tls: Option<(Arc<rustls::ClientConfig>, String)>,
    /// A new connection for every request (each pays the TCP, and TLS,
    /// handshake); otherwise connections are kept alive.
    pub fresh: bool,
}

/// What to send, where, and for how long.
#[derive(Clone)]
pub struct LoadSpec {
    /// Connection `i` goes to `targets[i % len]`.
    pub targets: Vec<SocketAddr>,
    pub conn: ConnSpec,
    /// One complete HTTP/1.1 request, sent as is.
    pub request: Arc<Vec<u8>>,
    pub concurrency: usize,
    pub warmup: Duration,
    pub duration: Duration,
}

/// What a run measured in its window.
#[derive(Clone)]
pub struct LoadResult {
    pub ok: u64,
    pub errors: u64,
    pub window_s: f64,
    /// Request sent to last response byte, ns.
    pub latency: Histogram<u64>,
    /// Request sent to first response byte, ns.
    pub first_byte: Histogram<u64>,
    /// CPU seconds the load generator's thread used in the window.
    pub loadgen_cpu_s: f64,
}

impl LoadResult {
    pub fn rps(&self) -> f64 {
        self.ok as f64 / self.window_s.max(1e-9)
    }
}

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1_000, HIST_MAX_NS, 3).expect("histogram bounds")
}

struct ConnStats {
    ok: u64,
    errors: u64,
    latency: Histogram<u64>,
    first_byte: Histogram<u64>,
}

/// Runs `spec`; calls `probe` when the measured window opens and when it
/// closes (from this thread) and returns the difference of each of its
/// values (CPU seconds of the proxy and of the engines, say) with the result.
pub fn run<const N: usize, P: FnMut() -> [f64; N]>(
    spec: &LoadSpec,
    mut probe: P,
) -> anyhow::Result<(LoadResult, [f64; N])> {
    anyhow::ensure!(
        !spec.targets.is_empty() && spec.concurrency > 0,
        "nothing to load"
    );
    let start = Instant::now();
    let t0 = start + spec.warmup;
    let t1 = t0 + spec.duration;
    let s = spec.clone();
    let generator = std::thread::Builder::new().name("loadgen".into()).spawn(
        move || -> anyhow::Result<(Vec<ConnStats>, f64)> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(async move {
                let cpu = tokio::spawn(async move {
                    tokio::time::sleep_until(t0.into()).await;
                    let a = crate::cpu::thread_cpu_s();
                    tokio::time::sleep_until(t1.into()).await;
                    crate::cpu::thread_cpu_s() - a
                });
                let mut tasks = Vec::with_capacity(s.concurrency);
                for i in 0..s.concurrency {
                    let addr = s.targets[i % s.targets.len()];
                    let req = s.request.clone();
                    let conn = s.conn.clone();
                    tasks.push(tokio::spawn(async move {
                        match conn.tls {
                            None => conn_loop(addr, req, t0, t1, conn.fresh, Plain).await,
                            Some((cfg, name)) => {
                                let tls = Tls {
                                    connector: tokio_rustls::TlsConnector::from(cfg),
                                    name,
                                };
                                conn_loop(addr, req, t0, t1, conn.fresh, tls).await
                            }
                        }
                    }));
                }
                let mut out = Vec::with_capacity(tasks.len());
                for t in tasks {
                    out.push(t.await?);
                }
                Ok((out, cpu.await?))
            })
        },
    )?;
    std::thread::sleep(t0.saturating_duration_since(Instant::now()));
    let a = probe();
    std::thread::sleep(t1.saturating_duration_since(Instant::now()));
    let b = probe();
    let (stats, loadgen_cpu_s) = generator
        .join()
        .map_err(|_| anyhow::anyhow!("load generator panicked"))??;
    let mut r = LoadResult {
        ok: 0,
        errors: 0,
        window_s: (t1 - t0).as_secs_f64(),
        latency: hist(),
        first_byte: hist(),
        loadgen_cpu_s,
    };
    for c in stats {
        r.ok += c.ok;
        r.errors += c.errors;
        r.latency.add(&c.latency)?;
        r.first_byte.add(&c.first_byte)?;
    }
    Ok((r, std::array::from_fn(|i| b[i] - a[i])))
}

/// How a connection is made: plain TCP, or TLS over it.
trait Connect {
    type Stream: AsyncRead + AsyncWrite + Unpin;
    async fn connect(&self, addr: SocketAddr) -> std::io::Result<Self::Stream>;
}

struct Plain;

impl Connect for Plain {
    type Stream = TcpStream;
    async fn connect(&self, addr: SocketAddr) -> std::io::Result<TcpStream> {
        let s = TcpStream::connect(addr).await?;
        let _ = s.set_nodelay(true);
        Ok(s)
    }
}

struct Tls {
    connector: tokio_rustls::TlsConnector,
    name: String,
}

impl Connect for Tls {
    type Stream = tokio_rustls::client::TlsStream<TcpStream>;
    async fn connect(&self, addr: SocketAddr) -> std::io::Result<Self::Stream> {
        let tcp = Plain.connect(addr).await?;
        let name = rustls::pki_types::ServerName::try_from(self.name.clone())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        self.connector.connect(name, tcp).await
    }
}

/// One connection's loop. With `fresh`, each request's time includes
/// making its connection (and the TLS handshake).
async fn conn_loop<C: Connect>(
    addr: SocketAddr,
    req: Arc<Vec<u8>>,
    t0: Instant,
    t1: Instant,
    fresh: bool,
    connector: C,
) -> ConnStats {
    let mut st = ConnStats {
        ok: 0,
        errors: 0,
        latency: hist(),
        first_byte: hist(),
    };
    let mut buf = Vec::with_capacity(64 << 10);
    let mut conn: Option<C::Stream> = None;
    while Instant::now() < t1 {
        let start = Instant::now();
        let s = match conn.take() {
            Some(s) => s,
            None => match connector.connect(addr).await {
                Ok(s) => s,
                Err(_) => {
                    st.errors += 1;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let r = tokio::time::timeout(REQUEST_TIMEOUT, exchange(s, &req, &mut buf)).await;
        let end = Instant::now();
        let in_window = end >= t0 && end <= t1;
        match r {
            Ok(Ok((s, status, first))) => {
                conn = (!fresh).then_some(s);
                if in_window {
                    if status == 200 {
                        st.ok += 1;
                        let _ = st.latency.record(ns(end - start));
                        let _ = st.first_byte.record(ns(first - start));
                    } else {
                        st.errors += 1;
                    }
                }
            }
            _ => {
                if in_window {
                    st.errors += 1;
                }
            }
        }
    }
    st
}

fn ns(d: Duration) -> u64 {
    (d.as_nanos() as u64).clamp(1_000, HIST_MAX_NS)
}

/// Sends `req` and reads one whole response (Content-Length or chunked);
/// returns the connection, the status and the instant of the first byte.
async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    req: &[u8],
    buf: &mut Vec<u8>,
) -> std::io::Result<(S, u16, Instant)> {
    let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string());
    s.write_all(req).await?;
    buf.clear();
    let mut first = None;
    let (status, head_len, body) = loop {
        read_more(&mut s, buf).await?;
        first.get_or_insert_with(Instant::now);
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut resp = httparse::Response::new(&mut headers);
        match resp.parse(buf).map_err(|e| bad(&e.to_string()))? {
            httparse::Status::Partial => continue,
            httparse::Status::Complete(n) => {
                let mut body = Body::Empty;
                for h in resp.headers.iter() {
                    if h.name.eq_ignore_ascii_case("content-length") {
                        let v = std::str::from_utf8(h.value).map_err(|_| bad("length"))?;
                        body = Body::Length(v.trim().parse().map_err(|_| bad("length"))?);
                    } else if h.name.eq_ignore_ascii_case("transfer-encoding")
                        && h.value.eq_ignore_ascii_case(b"chunked")
                    {
                        body = Body::Chunked;
                    }
                }
                break (resp.code.unwrap_or(0), n, body);
            }
        }
    };
    match body {
        Body::Empty => {}
        Body::Length(len) => {
            while buf.len() < head_len + len {
                read_more(&mut s, buf).await?;
            }
        }
        Body::Chunked => {
            let mut dec = ChunkedDecoder::new();
            let mut pos = head_len;
            loop {
                pos += dec.feed(&buf[pos..], None).map_err(|e| bad(&e.message))?;
                if dec.is_done() {
                    break;
                }
                read_more(&mut s, buf).await?;
            }
        }
    }
    Ok((s, status, first.unwrap_or_else(Instant::now)))
}

enum Body {
    Empty,
    Length(usize),
    Chunked,
}

async fn read_more<S: AsyncRead + Unpin>(s: &mut S, buf: &mut Vec<u8>) -> std::io::Result<()> {
    if buf.capacity() - buf.len() < 16 << 10 {
        buf.reserve(64 << 10);
    }
    let n = s.read_buf(buf).await?;
    if n == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

/// Microseconds at quantile `q` of a ns histogram.
pub fn q_us(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1e3
}
