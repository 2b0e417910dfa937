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

/// Parses the backend's response head at the start of `buf`; `Ok(None)` when
/// incomplete. Writes the head for the client to `out` (cleared first)
/// without the final CRLF.
pub fn parse(
    buf: &[u8],
    request_was_head: bool,
    max_header_bytes: usize,
    out: &mut Vec<u8>,
) -> Result<Option<ResponseHead>, RouterError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut headers);
    let len = match resp.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) if buf.len() <= max_header_bytes => return Ok(None),
        Ok(httparse::Status::Partial) => return Err(garbage("response head over the size limit")),
        Err(e) => return Err(garbage(&format!("malformed response head: {e}"))),
    };
    let status = resp.code.unwrap_or(0);
    let mut length = None;
    let mut chunked = false;
    let mut close = resp.version == Some(0);
    out.clear();
    out.extend_from_slice(
        format!("HTTP/1.1 {status} {}\r\n", resp.reason.unwrap_or("")).as_bytes(),
    );
    for h in resp.headers.iter() {
        let name = h.name;
        if name.eq_ignore_ascii_case("content-length") {
            let v = std::str::from_utf8(h.value)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok());
            match (v, length) {
                (Some(v), None) => length = Some(v),
                (Some(v), Some(l)) if v == l => continue,
                _ => return Err(garbage("invalid or conflicting Content-Length")),
            }
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            if !has_token(h.value, "chunked") {
                return Err(garbage("unsupported response transfer coding"));
            }
            chunked = true;
        } else if name.eq_ignore_ascii_case("connection") {
            close |= has_token(h.value, "close");
            continue;
        } else if name.eq_ignore_ascii_case("keep-alive") {
            continue;
        }
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(h.value);
        out.extend_from_slice(b"\r\n");
    }
    let framing = if request_was_head || status < 200 || status == 204 || status == 304 {
        ResponseFraming::None
    } else if chunked {
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

fn garbage(what: &str) -> RouterError {
    RouterError::new(
        Kind::BadGateway,
        format!("backend sent an invalid response: {what}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn framing_and_reuse() {
        let mut out = Vec::new();
        let h = parse(
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: keep-alive\r\n\r\nhello",
            false,
            8192,
            &mut out,
        )
        .unwrap()
        .unwrap();
        assert_eq!(h.framing, ResponseFraming::Length(5));
        assert!(h.reusable);
        assert_eq!(out, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n");
        let h = parse(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            false,
            8192,
            &mut out,
        )
        .unwrap()
        .unwrap();
        assert_eq!(h.framing, ResponseFraming::Chunked);
        let h = parse(b"HTTP/1.1 200 OK\r\n\r\n", false, 8192, &mut out)
            .unwrap()
            .unwrap();
        assert_eq!(h.framing, ResponseFraming::Close);
        assert!(!h.reusable);
        let h = parse(
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\n",
            false,
            8192,
            &mut out,
        )
        .unwrap()
        .unwrap();
        assert!(!h.reusable);
        let h = parse(
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n",
            true,
            8192,
            &mut out,
        )
        .unwrap()
        .unwrap();
        assert_eq!(h.framing, ResponseFraming::None);
    }

    #[test]
    fn garbage_is_a_bad_gateway() {
        let mut out = Vec::new();
        assert_eq!(
            parse(b"SSH-2.0-OpenSSH\r\n\r\n", false, 8192, &mut out)
                .unwrap_err()
                .status(),
            502
        );
        assert_eq!(
            parse(
                b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
                false,
                8192,
                &mut out
            )
            .unwrap_err()
            .status(),
            502
        );
    }
}
