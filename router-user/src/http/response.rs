//! Response heads from backends: status and framing, and the head written
//! back to the client (hop-by-hop headers dropped, ours added).

use super::{MAX_HEADERS, has_token};
use crate::error::{Kind, RouterError};

/// How the response body is framed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResponseFraming {
    None,
    Length(u64),
    Chunked,
    /// Until the backend closes the connection.
    Close,
}

#[derive(Clone, Copy, Debug)]
pub struct ResponseHead {
    pub len: usize,
    pub status: u16,
    pub framing: ResponseFraming,
    /// The backend connection can carry another request afterwards.
    pub reusable: bool,
}

/// What the head written for the client depends on.
#[derive(Clone, Copy, Debug, Default)]
pub struct Client {
    /// The request was `HEAD`: no body follows whatever the framing says.
    pub request_was_head: bool,
    /// The client speaks HTTP/1.0: a chunked body reaches it decoded and
    /// close-delimited, so `Transfer-Encoding` is not relayed (and codings
    /// other than `chunked` are refused: it could not undo them).
    pub http10: bool,
    /// Drop the headers that name the engine (`ENGINE_IDENTITY`); off with
    /// `debug_headers`.
    pub hide_engine: bool,
}

/// Headers that tell a client which engine (and which software) answered.
const ENGINE_IDENTITY: [&str; 2] = ["server", "x-engine-id"];

/// Headers of one hop, never relayed from a backend: framing is re-checked
/// and written by us, and the client's connection is ours to manage.
const HOP_BY_HOP: [&str; 7] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
    "proxy-authenticate",
];

/// Parses the backend's response head at the start of `buf`; `Ok(None)` when
/// incomplete. Writes the head for the client to `out` (cleared first)
/// without the final CRLF. Ambiguous framing is refused as a 502, as on the
/// request side: both Content-Length and Transfer-Encoding, a transfer
/// coding list that does not end in `chunked` (RFC 9112 section 6.3), a
/// 101 nobody asked for (the router never forwards `Upgrade`). Hop-by-hop
/// headers and those the `Connection` header lists are dropped.
pub fn parse(
    buf: &[u8],
    client: &Client,
    max_header_bytes: usize,
    out: &mut Vec<u8>,
) -> Result<Option<ResponseHead>, RouterError> {
    let request_was_head = client.request_was_head;
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut headers);
    let len = match resp.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) if buf.len() <= max_header_bytes => return Ok(None),
        Ok(httparse::Status::Partial) => return Err(garbage("response head over the size limit")),
        Err(e) => return Err(garbage(&format!("malformed response head: {e}"))),
    };
    let status = resp.code.unwrap_or(0);
    if status == 101 {
        return Err(garbage(
            "101 Switching Protocols, but no upgrade was asked for",
        ));
    }
    if status < 100 {
        return Err(garbage("status code below 100"));
    }
    let mut length = None;
    let mut coded = false;
    let mut chunked_last = false;
    let mut chunked_times = 0;
    let mut listed = false;
    let mut close = resp.version == Some(0);
    for h in resp.headers.iter() {
        let name = h.name;
        if name.eq_ignore_ascii_case("content-length") {
            let v = decimal(h.value.trim_ascii());
            match (v, length) {
                (Some(v), None) => length = Some(v),
                (Some(v), Some(l)) if v == l => {}
                _ => return Err(garbage("invalid or conflicting Content-Length")),
            }
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            for coding in h.value.split(|&b| b == b',').map(<[u8]>::trim_ascii) {
                if coding.is_empty() {
                    continue;
                }
                coded = true;
                chunked_last = coding.eq_ignore_ascii_case(b"chunked");
                chunked_times += usize::from(chunked_last);
            }
        } else if name.eq_ignore_ascii_case("connection") {
            close |= has_token(h.value, "close");
            listed = true;
        }
    }
    if coded && length.is_some() {
        return Err(garbage("both Content-Length and Transfer-Encoding"));
    }
    if coded && (!chunked_last || chunked_times != 1) {
        return Err(garbage("a transfer coding that does not end in chunked"));
    }
    let only_chunked = !client.http10 || !coded || {
        let mut codings = resp
            .headers
            .iter()
            .filter(|h| h.name.eq_ignore_ascii_case("transfer-encoding"))
            .flat_map(|h| h.value.split(|&b| b == b',').map(<[u8]>::trim_ascii))
            .filter(|c| !c.is_empty());
        codings
            .next()
            .is_some_and(|c| c.eq_ignore_ascii_case(b"chunked"))
            && codings.next().is_none()
    };
    if !only_chunked {
        return Err(garbage("a transfer coding an HTTP/1.0 client cannot undo"));
    }
    out.clear();
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(itoa::Buffer::new().format(status).as_bytes());
    out.push(b' ');
    out.extend_from_slice(resp.reason.unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    for h in resp.headers.iter() {
        let name = h.name;
        if HOP_BY_HOP.iter().any(|n| n.eq_ignore_ascii_case(name))
            || (listed && connection_lists(resp.headers, name))
            || (client.http10 && name.eq_ignore_ascii_case("transfer-encoding"))
            || (client.hide_engine && ENGINE_IDENTITY.iter().any(|n| n.eq_ignore_ascii_case(name)))
        {
            continue;
        }
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(h.value);
        out.extend_from_slice(b"\r\n");
    }
    let framing = if request_was_head || status < 200 || status == 204 || status == 304 {
        ResponseFraming::None
    } else if coded {
        ResponseFraming::Chunked
    } else if let Some(n) = length {
        ResponseFraming::Length(n)
    } else {
        ResponseFraming::Close
    };
    let reusable = !close && framing != ResponseFraming::Close;
    Ok(Some(ResponseHead {
        len,
        status,
        framing,
        reusable,
    }))
}

/// A Content-Length value: ASCII digits only (no sign, no blank inside),
/// not past `u64`.
fn decimal(v: &[u8]) -> Option<u64> {
    if v.is_empty() {
        return None;
    }
    v.iter().try_fold(0u64, |n, &b| {
        b.is_ascii_digit().then_some(())?;
        n.checked_mul(10)?.checked_add(u64::from(b - b'0'))
    })
}

/// Whether a `Connection` header among `headers` lists `name`.
fn connection_lists(headers: &[httparse::Header], name: &str) -> bool {
    headers
        .iter()
        .any(|h| h.name.eq_ignore_ascii_case("connection") && has_token(h.value, name))
}

fn garbage(what: &str) -> RouterError {
    RouterError::new(
        Kind::BadGateway,
        format!("backend sent an invalid response: {what}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A complete, accepted head from a plain client's request.
    fn parsed(raw: &[u8], out: &mut Vec<u8>) -> ResponseHead {
        parse(raw, &Client::default(), 8192, out)
            .unwrap()
            .expect("a complete head")
    }

    #[test]
    fn content_length_is_digits_only() {
        let mut out = Vec::new();
        let h = parsed(b"HTTP/1.1 200 OK\r\nContent-Length:  42 \r\n\r\n", &mut out);
        assert_eq!(h.framing, ResponseFraming::Length(42));
        let max = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", u64::MAX);
        assert_eq!(
            parsed(max.as_bytes(), &mut out).framing,
            ResponseFraming::Length(u64::MAX)
        );
        // A sign, a blank inside, a non-digit, nothing, or past u64: a
        // backend whose framing cannot be trusted gets a 502.
        for bad in [
            "+5",
            "-5",
            "1 2",
            "5a",
            "",
            "18446744073709551616",
            "\u{663}",
        ] {
            let raw = format!("HTTP/1.1 200 OK\r\nContent-Length: {bad}\r\n\r\n");
            let e = parse(raw.as_bytes(), &Client::default(), 8192, &mut out).unwrap_err();
            assert!(e.to_string().contains("Content-Length"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn framing_and_reuse() {
        let mut out = Vec::new();
        let h = parsed(
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: keep-alive\r\n\r\nhello",
            &mut out,
        );
        assert_eq!(h.framing, ResponseFraming::Length(5));
        assert!(h.reusable);
        assert_eq!(out, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n");
        let h = parsed(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            &mut out,
        );
        assert_eq!(h.framing, ResponseFraming::Chunked);
        let h = parsed(b"HTTP/1.1 200 OK\r\n\r\n", &mut out);
        assert_eq!(h.framing, ResponseFraming::Close);
        assert!(!h.reusable);
        let h = parsed(
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\n",
            &mut out,
        );
        assert!(!h.reusable);
        let h = parse(
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n",
            &Client {
                request_was_head: true,
                ..Client::default()
            },
            8192,
            &mut out,
        )
        .unwrap()
        .unwrap();
        assert_eq!(h.framing, ResponseFraming::None);
    }

    #[test]
    fn ambiguous_framing_and_upgrades_are_refused() {
        let mut out = Vec::new();
        for raw in [
            &b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: gzip\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, chunked\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n",
        ] {
            let e = parse(raw, &Client::default(), 8192, &mut out).unwrap_err();
            assert_eq!(e.status(), 502, "{:?}", String::from_utf8_lossy(raw));
        }
        let h = parsed(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
            &mut out,
        );
        assert_eq!(h.framing, ResponseFraming::Chunked);
    }

    #[test]
    fn connection_listed_and_hop_by_hop_headers_are_dropped() {
        let mut out = Vec::new();
        parsed(b"HTTP/1.1 200 OK\r\nConnection: close, X-Secret\r\nX-Secret: s\r\nKeep-Alive: 5\r\nUpgrade: h2c\r\nX-Kept: 1\r\nContent-Length: 2\r\n\r\n", &mut out);
        let head = String::from_utf8(out).unwrap();
        assert_eq!(
            head,
            "HTTP/1.1 200 OK\r\nX-Kept: 1\r\nContent-Length: 2\r\n"
        );
    }

    #[test]
    fn http10_clients_get_no_transfer_encoding() {
        let mut out = Vec::new();
        let ten = Client {
            http10: true,
            ..Client::default()
        };
        let h = parse(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: 1\r\n\r\n",
            &ten,
            8192,
            &mut out,
        )
        .unwrap()
        .unwrap();
        assert_eq!(h.framing, ResponseFraming::Chunked);
        assert_eq!(out, b"HTTP/1.1 200 OK\r\nX-A: 1\r\n");
        let raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n";
        assert_eq!(parse(raw, &ten, 8192, &mut out).unwrap_err().status(), 502);
    }

    #[test]
    fn engine_identity_is_hidden_unless_asked() {
        let raw = b"HTTP/1.1 200 OK\r\nServer: uvicorn\r\nX-Engine-Id: e3\r\nX-A: 1\r\nContent-Length: 0\r\n\r\n";
        let mut out = Vec::new();
        let hide = Client {
            hide_engine: true,
            ..Client::default()
        };
        parse(raw, &hide, 8192, &mut out).unwrap().unwrap();
        assert_eq!(out, b"HTTP/1.1 200 OK\r\nX-A: 1\r\nContent-Length: 0\r\n");
        parse(raw, &Client::default(), 8192, &mut out)
            .unwrap()
            .unwrap();
        assert!(String::from_utf8_lossy(&out).contains("X-Engine-Id: e3"));
    }

    #[test]
    fn garbage_is_a_bad_gateway() {
        let mut out = Vec::new();
        assert_eq!(
            parse(
                b"SSH-2.0-OpenSSH\r\n\r\n",
                &Client::default(),
                8192,
                &mut out
            )
            .unwrap_err()
            .status(),
            502
        );
        assert_eq!(
            parse(
                b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
                &Client::default(),
                8192,
                &mut out
            )
            .unwrap_err()
            .status(),
            502
        );
    }
}
