//! A tiny blocking HTTP/1.1 client for tests: one request per connection,
//! bounded by [`IO_TIMEOUT`], and a variant that records when each chunk of
//! a chunked body arrived (to prove that SSE events are streamed).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use prefix_router::http::chunked::ChunkedDecoder;

/// Read/write timeout of every socket operation.
pub const IO_TIMEOUT: Duration = Duration::from_secs(60);

/// A complete response.
#[derive(Clone, Debug)]
pub struct Response {
    pub status: u16,
    /// Header names are lower-cased.
    pub headers: Vec<(String, String)>,
    /// The body, de-chunked.
    pub body: Vec<u8>,
}

impl Response {
    /// The first header named `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as JSON (panics if it is not).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", self.text()))
    }

    /// The `data:` payloads of an SSE body, in order.
    pub fn sse_data(&self) -> Vec<String> {
        self.text()
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .map(str::to_string)
            .collect()
    }

    /// The body's SSE events with their names: `(event, data)`, `event`
    /// empty for an event without an `event:` line.
    pub fn sse_events(&self) -> Vec<(String, String)> {
        self.text()
            .split("\n\n")
            .filter(|e| !e.trim().is_empty())
            .map(|e| {
                let mut name = String::new();
                let mut data = String::new();
                for line in e.lines() {
                    if let Some(n) = line.strip_prefix("event: ") {
                        name = n.to_string();
                    } else if let Some(d) = line.strip_prefix("data: ") {
                        data = d.to_string();
                    }
                }
                (name, data)
            })
            .collect()
    }
}

/// One chunk of a chunked body and when it was read.
#[derive(Clone, Debug)]
pub struct Chunk {
    pub at: Instant,
    pub data: Vec<u8>,
}

/// Sends one request (`connection: close`) and reads the whole response.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<Response> {
    request_chunks(addr, method, path, headers, body).map(|(r, _)| r)
}

/// POSTs a JSON value.
pub fn post_json(
    addr: SocketAddr,
    path: &str,
    body: &serde_json::Value,
) -> std::io::Result<Response> {
    let bytes = serde_json::to_vec(body).expect("json");
    request(
        addr,
        "POST",
        path,
        &[("content-type", "application/json")],
        &bytes,
    )
}

fn invalid(msg: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg.to_string())
}

/// Like [`request`], also returning each chunk of a chunked body with the
/// instant it was read (chunks that arrive in one read share an instant).
/// Fails with `UnexpectedEof` if the connection closes mid-body.
pub fn request_chunks(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<(Response, Vec<Chunk>)> {
    let mut s = connect(addr)?;
    request_on(&mut s, &addr.to_string(), method, path, headers, body)
}

/// A connection with the timeouts every request here uses.
pub fn connect(addr: SocketAddr) -> std::io::Result<TcpStream> {
    let s = TcpStream::connect_timeout(&addr, IO_TIMEOUT)?;
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    s.set_nodelay(true)?;
    Ok(s)
}

/// [`request_chunks`] on a connection already made (a TLS stream over it,
/// say), with `host` as the Host header; a `connection` header among
/// `headers` replaces the usual `connection: close`.
pub fn request_on<S: Read + Write>(
    s: &mut S,
    host: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<(Response, Vec<Chunk>)> {
    // `connection: close` unless the caller gives its own.
    let close = if headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("connection"))
    {
        ""
    } else {
        "connection: close\r\n"
    };
    let mut req = format!("{method} {path} HTTP/1.1\r\nhost: {host}\r\n{close}");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() || method == "POST" {
        req.push_str(&format!("content-length: {}\r\n", body.len()));
    }
    req.push_str("\r\n");
    let mut bytes = req.into_bytes();
    bytes.extend_from_slice(body);
    s.write_all(&bytes)?;
    s.flush()?;

    let mut buf = Vec::new();
    let mut tmp = [0u8; 64 * 1024];
    let mut read_more = |s: &mut S, buf: &mut Vec<u8>| -> std::io::Result<usize> {
        let n = s.read(&mut tmp)?;
        buf.extend_from_slice(&tmp[..n]);
        Ok(n)
    };
    let (status, hdrs, head_len) = loop {
        let mut hs = [httparse::EMPTY_HEADER; 64];
        let mut r = httparse::Response::new(&mut hs);
        match r.parse(&buf).map_err(|_| invalid("bad response head"))? {
            httparse::Status::Complete(n) => {
                let hdrs: Vec<(String, String)> = r
                    .headers
                    .iter()
                    .map(|h| {
                        (
                            h.name.to_ascii_lowercase(),
                            String::from_utf8_lossy(h.value).trim().to_string(),
                        )
                    })
                    .collect();
                break (r.code.unwrap_or(0), hdrs, n);
            }
            httparse::Status::Partial => {
                if read_more(s, &mut buf)? == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
            }
        }
    };
    buf.drain(..head_len);
    let get = |n: &str| hdrs.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
    let chunked = get("transfer-encoding").is_some_and(|v| v.contains("chunked"));
    let mut chunks = Vec::new();
    let body = if chunked {
        let mut body = Vec::new();
        let mut at = Instant::now();
        let mut dec = ChunkedDecoder::new();
        let mut data = Vec::new();
        loop {
            // Decode chunk by chunk what the buffer holds; a chunk cut by
            // the buffer's end is completed by the next read.
            while !buf.is_empty() {
                let used = dec
                    .feed_chunk(&buf, Some(&mut data))
                    .map_err(|e| invalid(&e.message))?;
                buf.drain(..used);
                if dec.is_done() {
                    return Ok((
                        Response {
                            status,
                            headers: hdrs,
                            body,
                        },
                        chunks,
                    ));
                }
                if dec.between_chunks() && !data.is_empty() {
                    body.extend_from_slice(&data);
                    chunks.push(Chunk {
                        at,
                        data: std::mem::take(&mut data),
                    });
                }
            }
            if read_more(s, &mut buf)? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            at = Instant::now();
        }
    } else if let Some(len) = get("content-length").and_then(|v| v.parse::<usize>().ok()) {
        while buf.len() < len {
            if read_more(s, &mut buf)? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
        }
        buf.truncate(len);
        buf
    } else {
        while read_more(s, &mut buf)? > 0 {}
        buf
    };
    Ok((
        Response {
            status,
            headers: hdrs,
            body,
        },
        chunks,
    ))
}
