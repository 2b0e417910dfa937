//! Minimal HTTP/1.1 server framing: request heads via `httparse`, bodies by
//! Content-Length or chunked transfer coding, `Expect: 100-continue`, and
//! response heads and chunks written into byte buffers.

use bytes::{Buf, BytesMut};
use prefix_router::http::chunked::ChunkedDecoder;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Largest request head accepted.
const MAX_HEAD: usize = 64 * 1024;
/// Largest request body accepted (a 100k-token prompt is about 400 KB).
const MAX_BODY: usize = 256 * 1024 * 1024;
/// Most headers in one request.
const MAX_HEADERS: usize = 64;

/// One parsed request.
#[derive(Debug)]
pub struct Request {
    pub method: String,
    /// Path without the query string.
    pub path: String,
    /// The query string (after `?`), empty when there is none.
    pub query: String,
    pub keep_alive: bool,
    pub body: Vec<u8>,
}

/// Why no request could be read.
#[derive(Debug)]
pub enum ReadError {
    /// The peer sent something that is not HTTP/1.1 we accept.
    Bad(&'static str),
    /// The connection failed or closed mid-request.
    Io,
}

/// Reads the next request, or `Ok(None)` on a clean close between requests.
pub async fn read_request<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    buf: &mut BytesMut,
) -> Result<Option<Request>, ReadError> {
    loop {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(buf) {
            Ok(httparse::Status::Complete(head_len)) => {
                let method = req.method.unwrap_or("").to_string();
                let target = req.path.unwrap_or("/");
                let (path, query) = target.split_once('?').unwrap_or((target, ""));
                let (path, query) = (path.to_string(), query.to_string());
                let http10 = req.version == Some(0);
                let mut keep_alive = !http10;
                let mut content_length = None;
                let mut chunked = false;
                let mut expect_continue = false;
                for h in req.headers.iter() {
                    let v = std::str::from_utf8(h.value).unwrap_or("").trim();
                    if h.name.eq_ignore_ascii_case("content-length") {
                        content_length = Some(
                            v.parse::<usize>()
                                .map_err(|_| ReadError::Bad("bad content-length"))?,
                        );
                    } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                        chunked = v.to_ascii_lowercase().contains("chunked");
                    } else if h.name.eq_ignore_ascii_case("connection") {
                        let v = v.to_ascii_lowercase();
                        if v.contains("close") {
                            keep_alive = false;
                        } else if v.contains("keep-alive") {
                            keep_alive = true;
                        }
                    } else if h.name.eq_ignore_ascii_case("expect") {
                        expect_continue = v.eq_ignore_ascii_case("100-continue");
                    }
                }
                buf.advance(head_len);
                let body_len = if chunked {
                    None
                } else {
                    Some(content_length.unwrap_or(0))
                };
                if body_len.is_some_and(|n| n > MAX_BODY) {
                    return Err(ReadError::Bad("request body too large"));
                }
                let have_body = match body_len {
                    Some(n) => buf.len() >= n,
                    None => decode_chunked(buf)?.is_some(),
                };
                if expect_continue && !have_body {
                    s.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
                        .await
                        .map_err(|_| ReadError::Io)?;
                }
                let body = read_body(s, buf, body_len).await?;
                return Ok(Some(Request {
                    method,
                    path,
                    query,
                    keep_alive,
                    body,
                }));
            }
            Ok(httparse::Status::Partial) => {
                if buf.len() > MAX_HEAD {
                    return Err(ReadError::Bad("request head too large"));
                }
            }
            Err(_) => return Err(ReadError::Bad("malformed request head")),
        }
        match s.read_buf(buf).await {
            Ok(0) if buf.is_empty() => return Ok(None),
            Ok(0) | Err(_) => return Err(ReadError::Io),
            Ok(_) => {}
        }
    }
}

async fn read_body<S: AsyncRead + Unpin>(
    s: &mut S,
    buf: &mut BytesMut,
    len: Option<usize>,
) -> Result<Vec<u8>, ReadError> {
    loop {
        match len {
            Some(n) if buf.len() >= n => return Ok(buf.split_to(n).to_vec()),
            Some(n) => buf.reserve(n - buf.len()),
            None => {
                if let Some((body, used)) = decode_chunked(buf)? {
                    buf.advance(used);
                    return Ok(body);
                }
                if buf.len() > MAX_BODY {
                    return Err(ReadError::Bad("request body too large"));
                }
            }
        }
        match s.read_buf(buf).await {
            Ok(0) | Err(_) => return Err(ReadError::Io),
            Ok(_) => {}
        }
    }
}

/// Decodes a complete chunked body at the start of `data`: the body and the
/// bytes used, `None` if incomplete. Trailers are skipped.
pub fn decode_chunked(data: &[u8]) -> Result<Option<(Vec<u8>, usize)>, ReadError> {
    let mut dec = ChunkedDecoder::new();
    let mut body = Vec::new();
    let used = dec
        .feed(data, Some(&mut body))
        .map_err(|_| ReadError::Bad("bad chunked body"))?;
    if dec.decoded_len() > MAX_BODY as u64 {
        return Err(ReadError::Bad("request body too large"));
    }
    Ok(dec.is_done().then_some((body, used)))
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Unknown",
    }
}

/// Appends a response head; `len: None` means a chunked body.
pub fn head(
    out: &mut Vec<u8>,
    status: u16,
    content_type: &str,
    len: Option<usize>,
    engine_id: &str,
    keep_alive: bool,
) {
    use std::io::Write;
    let _ = write!(
        out,
        "HTTP/1.1 {status} {}\r\nserver: sim-engine\r\nx-engine-id: {engine_id}\r\ncontent-type: {content_type}\r\n",
        reason(status)
    );
    match len {
        Some(n) => {
            let _ = write!(out, "content-length: {n}\r\n");
        }
        None => out.extend_from_slice(b"transfer-encoding: chunked\r\ncache-control: no-cache\r\n"),
    }
    out.extend_from_slice(if keep_alive {
        b"connection: keep-alive\r\n\r\n"
    } else {
        b"connection: close\r\n\r\n"
    });
}

/// Appends one chunk of a chunked body.
pub fn chunk(out: &mut Vec<u8>, payload: &[u8]) {
    use std::io::Write;
    let _ = write!(out, "{:x}\r\n", payload.len());
    out.extend_from_slice(payload);
    out.extend_from_slice(b"\r\n");
}

/// The end of a chunked body.
pub const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// Writes a complete response with a Content-Length body.
pub async fn write_full<S: AsyncWrite + Unpin>(
    s: &mut S,
    out: &mut Vec<u8>,
    status: u16,
    content_type: &str,
    body: &[u8],
    engine_id: &str,
    keep_alive: bool,
) -> std::io::Result<()> {
    out.clear();
    head(
        out,
        status,
        content_type,
        Some(body.len()),
        engine_id,
        keep_alive,
    );
    out.extend_from_slice(body);
    s.write_all(out).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_bodies() {
        let d = b"4\r\nabcd\r\n3;ext=1\r\nefg\r\n0\r\n\r\nNEXT";
        let (body, used) = decode_chunked(d).unwrap().unwrap();
        assert_eq!(body, b"abcdefg");
        assert_eq!(&d[used..], b"NEXT");
        assert!(decode_chunked(b"4\r\nab").unwrap().is_none());
        assert!(decode_chunked(b"zz\r\n").is_err());
    }
}
