//! Request heads: parse, refuse what could smuggle a second request past a
//! backend, and write the head to forward (hop-by-hop headers dropped).

use std::ops::Range;

use xxhash_rust::xxh3::xxh3_64;

use super::{MAX_HEADERS, has_token, is_hop_by_hop};
use crate::error::{Kind, RouterError};

/// How the request body is framed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyFraming {
    None,
    Length(u64),
    Chunked,
}

/// What the proxy needs from a request head.
#[derive(Clone, Debug)]
pub struct RequestHead {
    /// Bytes the head takes in the buffer, final CRLF included.
    pub len: usize,
    pub method_is_head: bool,
    pub body: BodyFraming,
    /// The client wants the connection kept open after the response.
    pub keep_alive: bool,
    pub expect_continue: bool,
    /// `x-session-id`, hashed.
    pub session: Option<u64>,
    /// Where the normalised path (no query) sits in the forwarded head.
    pub path: Range<usize>,
    /// The client speaks HTTP/1.0 (no chunked responses).
    pub http10: bool,
}

impl RequestHead {
    /// The method, from the forwarded head `fwd` it was written to.
    pub fn method<'a>(&self, fwd: &'a [u8]) -> &'a str {
        fwd.get(..self.path.start.saturating_sub(1))
            .and_then(|m| std::str::from_utf8(m).ok())
            .unwrap_or("-")
    }

    /// The normalised path, from the forwarded head `fwd` it was written to.
    pub fn path<'a>(&self, fwd: &'a [u8]) -> &'a str {
        fwd.get(self.path.clone())
            .and_then(|p| std::str::from_utf8(p).ok())
            .unwrap_or("-")
    }
}

/// The value of the first header `name` (ASCII case-insensitive), trimmed,
/// in a head as written out: the forwarded head, or one as received. Lines
/// after the request line, up to the first empty one.
pub fn header_value<'a>(head: &'a [u8], name: &str) -> Option<&'a [u8]> {
    head.split(|&b| b == b'\n')
        .skip(1)
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l))
        .take_while(|l| !l.is_empty())
        .find_map(|l| {
            let colon = l.iter().position(|&b| b == b':')?;
            l[..colon]
                .eq_ignore_ascii_case(name.as_bytes())
                .then(|| l[colon + 1..].trim_ascii())
        })
}

/// The caller's API key: the `Authorization: Bearer` token, else
/// `x-api-key` (Anthropic's SDK).
pub fn api_key(head: &[u8]) -> Option<&[u8]> {
    let bearer = header_value(head, "authorization").and_then(|v| {
        let (scheme, token) = v.split_at(v.iter().position(|&b| b == b' ')?);
        scheme
            .eq_ignore_ascii_case(b"bearer")
            .then(|| token.trim_ascii())
    });
    bearer
        .or_else(|| header_value(head, "x-api-key"))
        .filter(|k| !k.is_empty())
}

/// Moves the header lines named `names` (case-insensitive) out of a
/// forwarded head (`parse`'s `forward`, request line first, no final
/// CRLF) into `out`, each line whole with its CRLF.
pub fn take_headers(fwd: &mut Vec<u8>, names: &[&str], out: &mut Vec<u8>) {
    out.clear();
    let Some(first) = memchr::memmem::find(fwd, b"\r\n") else {
        return;
    };
    let mut at = first + 2;
    while at < fwd.len() {
        let end = memchr::memmem::find(&fwd[at..], b"\r\n").map_or(fwd.len(), |e| at + e + 2);
        let line = &fwd[at..end];
        let name = line.split(|&b| b == b':').next().unwrap_or(b"");
        if names
            .iter()
            .any(|n| name.eq_ignore_ascii_case(n.as_bytes()))
        {
            out.extend_from_slice(line);
            fwd.drain(at..end);
        } else {
            at = end;
        }
    }
}

/// Methods forwarded, case-sensitive (RFC 9110 section 9.1); any other is 501.
const METHODS: [&str; 7] = ["GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"];

/// Parses the head at the start of `buf`. `Ok(None)`: incomplete, read more.
/// The head to forward is written to `forward` (cleared first) without its
/// final CRLF: the caller appends `content-length` and the blank line.
pub fn parse(
    buf: &[u8],
    max_header_bytes: usize,
    forward: &mut Vec<u8>,
) -> Result<Option<RequestHead>, RouterError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let len = match req.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => {
            if buf.len() > max_header_bytes {
                return Err(too_large(max_header_bytes));
            }
            return Ok(None);
        }
        Err(httparse::Error::TooManyHeaders) => {
            return Err(RouterError::new(
                Kind::HeadersTooLarge,
                format!("request has more than {MAX_HEADERS} headers"),
            ));
        }
        Err(e) => {
            return Err(RouterError::new(
                Kind::BadRequest,
                format!("malformed request head: {e}"),
            ));
        }
    };
    if len > max_header_bytes {
        return Err(too_large(max_header_bytes));
    }
    let method = req.method.unwrap_or("");
    let target = req.path.unwrap_or("/");
    let version = req.version.unwrap_or(1);
    if !METHODS.contains(&method) {
        return Err(RouterError::new(
            Kind::NotImplemented,
            format!("method {method:?} is not supported (methods are case-sensitive)"),
        ));
    }

    let mut content_length: Option<u64> = None;
    let mut chunked = false;
    let mut transfer_encoding = false;
    let mut conn_close = false;
    let mut conn_keep_alive = false;
    let mut expect_continue = false;
    let mut session = None;

    forward.clear();
    forward.extend_from_slice(method.as_bytes());
    forward.push(b' ');
    let path = write_target(target.as_bytes(), forward)?;
    forward.extend_from_slice(b" HTTP/1.1\r\n");
    for h in req.headers.iter() {
        let name = h.name;
        if name.eq_ignore_ascii_case("content-length") {
            let v = parse_length(h.value)?;
            if content_length.is_some_and(|c| c != v) {
                return Err(RouterError::new(
                    Kind::BadRequest,
                    "conflicting Content-Length headers",
                ));
            }
            content_length = Some(v);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            transfer_encoding = true;
            let v = h.value.trim_ascii();
            if v.eq_ignore_ascii_case(b"chunked") && !chunked {
                chunked = true;
            } else {
                return Err(RouterError::new(
                    Kind::NotImplemented,
                    format!(
                        "transfer coding {:?} is not supported (only \"chunked\")",
                        String::from_utf8_lossy(v)
                    ),
                ));
            }
        } else if name.eq_ignore_ascii_case("connection") {
            conn_close |= has_token(h.value, "close");
            conn_keep_alive |= has_token(h.value, "keep-alive");
        } else if name.eq_ignore_ascii_case("expect") {
            if h.value.trim_ascii().eq_ignore_ascii_case(b"100-continue") {
                expect_continue = true;
            }
        } else if name.eq_ignore_ascii_case("x-session-id") {
            session = Some(xxh3_64(h.value));
        }
        if !is_hop_by_hop(name) {
            forward.extend_from_slice(name.as_bytes());
            forward.extend_from_slice(b": ");
            forward.extend_from_slice(h.value);
            forward.extend_from_slice(b"\r\n");
        }
    }
    if transfer_encoding && content_length.is_some() {
        return Err(RouterError::new(
            Kind::BadRequest,
            "request has both Content-Length and Transfer-Encoding",
        ));
    }
    if transfer_encoding && version == 0 {
        return Err(RouterError::new(
            Kind::BadRequest,
            "Transfer-Encoding in an HTTP/1.0 request",
        ));
    }
    let body = match (chunked, content_length) {
        (true, _) => BodyFraming::Chunked,
        (false, Some(0)) | (false, None) => BodyFraming::None,
        (false, Some(n)) => BodyFraming::Length(n),
    };
    let keep_alive = if version == 0 {
        conn_keep_alive && !conn_close
    } else {
        !conn_close
    };
    Ok(Some(RequestHead {
        len,
        method_is_head: method == "HEAD",
        body,
        keep_alive,
        expect_continue,
        session,
        path,
        http10: version == 0,
    }))
}

/// Writes the request target in normal origin form to `out`: an absolute
/// form's scheme and authority dropped, empty and `.` segments removed
/// (so `//a/b/` is `/a/b`), `..` resolved, percent-encoded unreserved
/// characters decoded (RFC 3986 section 6.2.2); the query kept as sent.
/// Routing and validation see what the backend gets. Returns where the
/// path (without the query) sits in `out`.
fn write_target(target: &[u8], out: &mut Vec<u8>) -> Result<Range<usize>, RouterError> {
    let origin = if target.first() == Some(&b'/') {
        target
    } else if let Some(rest) = strip_scheme(target) {
        let at = rest
            .iter()
            .position(|&b| b == b'/' || b == b'?')
            .unwrap_or(rest.len());
        if at == 0 {
            return Err(bad_target());
        }
        &rest[at..]
    } else {
        return Err(bad_target());
    };
    if origin.contains(&b'#') {
        return Err(bad_target());
    }
    let (path, query) = match origin.iter().position(|&b| b == b'?') {
        Some(q) => (&origin[..q], &origin[q..]),
        None => (origin, &b""[..]),
    };
    let start = out.len();
    normalise_path(path, out);
    let end = out.len();
    out.extend_from_slice(query);
    Ok(start..end)
}

/// `http://` or `https://` (case-insensitive) and the rest.
fn strip_scheme(target: &[u8]) -> Option<&[u8]> {
    for scheme in [&b"http://"[..], b"https://"] {
        if target.len() > scheme.len() && target[..scheme.len()].eq_ignore_ascii_case(scheme) {
            return Some(&target[scheme.len()..]);
        }
    }
    None
}

/// Appends `path` normalised (see [`write_target`]) to `out`; always
/// starts with `/`, never ends with one unless it is the root.
pub fn normalise_path(path: &[u8], out: &mut Vec<u8>) {
    let root = out.len();
    for seg in path.split(|&b| b == b'/') {
        let at = out.len();
        out.push(b'/');
        let mut i = 0;
        while i < seg.len() {
            match seg[i] {
                b'%' if i + 2 < seg.len() => match (hex(seg[i + 1]), hex(seg[i + 2])) {
                    (Some(h), Some(l)) if is_unreserved(h << 4 | l) => {
                        out.push(h << 4 | l);
                        i += 3;
                        continue;
                    }
                    _ => out.push(b'%'),
                },
                b => out.push(b),
            }
            i += 1;
        }
        match &out[at + 1..] {
            b"" | b"." => out.truncate(at),
            b".." => {
                out.truncate(at);
                let parent = out[root..]
                    .iter()
                    .rposition(|&b| b == b'/')
                    .map_or(root, |p| root + p);
                out.truncate(parent);
            }
            _ => {}
        }
    }
    if out.len() == root {
        out.push(b'/');
    }
}

fn hex(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn bad_target() -> RouterError {
    RouterError::new(
        Kind::BadRequest,
        "the request target must be a path (origin form) or an http:// URL",
    )
}

fn parse_length(v: &[u8]) -> Result<u64, RouterError> {
    let v = v.trim_ascii();
    if v.is_empty() || v.len() > 19 || !v.iter().all(u8::is_ascii_digit) {
        return Err(RouterError::new(
            Kind::BadRequest,
            format!("invalid Content-Length {:?}", String::from_utf8_lossy(v)),
        ));
    }
    Ok(v.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0')))
}

fn too_large(max: usize) -> RouterError {
    RouterError::new(
        Kind::HeadersTooLarge,
        format!("request head is over the {max}-byte limit"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(raw: &str) -> Result<Option<RequestHead>, RouterError> {
        let mut fwd = Vec::new();
        parse(raw.as_bytes(), 8192, &mut fwd)
    }

    #[test]
    fn header_values_and_api_keys_are_read_from_a_written_head() {
        let mut fwd = Vec::new();
        let raw = "POST /v1/chat/completions HTTP/1.1\r\nAuthorization: bearer  sk-1 \r\nX-Request-Class:flex\r\nContent-Length: 2\r\n\r\n{}";
        parse(raw.as_bytes(), 8192, &mut fwd).unwrap().unwrap();
        for head in [&fwd[..], raw.as_bytes()] {
            assert_eq!(header_value(head, "x-request-class"), Some(&b"flex"[..]));
            assert_eq!(api_key(head), Some(&b"sk-1"[..]));
            assert_eq!(header_value(head, "x-other"), None);
        }
        // The body is not read as a header; x-api-key stands in for Bearer.
        let raw = b"POST / HTTP/1.1\r\nX-Api-Key: k2\r\nAuthorization: Basic abc\r\n\r\nx-request-class: flex";
        assert_eq!(header_value(raw, "x-request-class"), None);
        assert_eq!(api_key(raw), Some(&b"k2"[..]));
        assert_eq!(
            api_key(b"GET / HTTP/1.1\r\nAuthorization: Bearer \r\n\r\n"),
            None
        );
    }

    #[test]
    fn credentials_are_taken_out_of_a_forwarded_head() {
        let mut fwd = Vec::new();
        let raw = "POST /v1/chat/completions HTTP/1.1\r\nAuthorization: Bearer sk-1\r\nX-Other: 1\r\nx-api-key: k\r\nContent-Length: 2\r\n\r\n{}";
        parse(raw.as_bytes(), 8192, &mut fwd).unwrap().unwrap();
        let mut taken = Vec::new();
        take_headers(&mut fwd, &["authorization", "x-api-key"], &mut taken);
        assert_eq!(taken, b"Authorization: Bearer sk-1\r\nx-api-key: k\r\n");
        let left = String::from_utf8(fwd).unwrap();
        assert!(left.starts_with("POST /v1/chat/completions HTTP/1.1\r\n"));
        assert!(left.contains("X-Other: 1\r\n") && !left.contains("sk-1") && !left.contains(": k"));
    }

    #[test]
    fn forwards_end_to_end_headers_only() {
        let mut fwd = Vec::new();
        let raw = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\nExpect: 100-continue\r\nContent-Length: 2\r\nX-Session-Id: s1\r\n\r\n{}";
        let h = parse(raw.as_bytes(), 8192, &mut fwd).unwrap().unwrap();
        assert_eq!(h.method(&fwd), "POST");
        let fwd = String::from_utf8(fwd).unwrap();
        assert_eq!(
            fwd,
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Session-Id: s1\r\n"
        );
        assert_eq!(h.body, BodyFraming::Length(2));
        assert!(h.expect_continue && h.keep_alive && h.session.is_some());
        assert_eq!(h.len, raw.len() - 2);
    }

    #[test]
    fn incomplete_heads_wait_and_oversized_heads_are_431() {
        assert!(p("GET / HTTP/1.1\r\nHost: x\r\n").unwrap().is_none());
        let big = format!("GET / HTTP/1.1\r\nX: {}\r\n", "a".repeat(9000));
        assert_eq!(p(&big).unwrap_err().status(), 431);
    }

    #[test]
    fn smuggling_shapes_are_refused() {
        let cases = [
            (
                "POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
                400,
            ),
            (
                "POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n",
                400,
            ),
            ("POST / HTTP/1.1\r\nContent-Length: +3\r\n\r\n", 400),
            ("POST / HTTP/1.1\r\nContent-Length: 3, 3\r\n\r\n", 400),
            (
                "POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
                501,
            ),
            (
                "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
                501,
            ),
            ("POST / HTTP/1.1\r\nX-A: 1\r\n folded\r\n\r\n", 400),
            ("POST / HTTP/1.1\r\nX-A: 1\rX-B: 2\r\n\r\n", 400),
            ("POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
            ("POST / HTTP/1.1\r\nBad Header: 1\r\n\r\n", 400),
        ];
        for (raw, status) in cases {
            assert_eq!(p(raw).unwrap_err().status(), status, "{raw:?}");
        }
    }

    #[test]
    fn keep_alive_defaults_by_version() {
        assert!(p("GET / HTTP/1.1\r\n\r\n").unwrap().unwrap().keep_alive);
        assert!(
            !p("GET / HTTP/1.1\r\nConnection: close\r\n\r\n")
                .unwrap()
                .unwrap()
                .keep_alive
        );
        assert!(!p("GET / HTTP/1.0\r\n\r\n").unwrap().unwrap().keep_alive);
        assert!(
            p("GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
                .unwrap()
                .unwrap()
                .keep_alive
        );
    }

    #[test]
    fn targets_are_normalised_before_routing() {
        let norm = |t: &str| {
            let mut fwd = Vec::new();
            let raw = format!("POST {t} HTTP/1.1\r\n\r\n");
            let h = parse(raw.as_bytes(), 8192, &mut fwd).unwrap().unwrap();
            let line = String::from_utf8(fwd.clone()).unwrap();
            (h.path(&fwd).to_owned(), line)
        };
        for t in [
            "/v1/chat/completions",
            "//v1/chat/completions",
            "/v1/chat/completions/",
            "/v1/./chat//completions",
            "/x/../v1/chat/completions",
            "/../../v1/chat/completions",
            "/v1/chat/completion%73",
            "http://engine:8000/v1/chat/completions",
            "HTTPS://engine/v1/chat/completions",
        ] {
            assert_eq!(norm(t).0, "/v1/chat/completions", "{t}");
        }
        let (path, line) = norm("http://e/v1/completions?a=1&b=%2F");
        assert_eq!(path, "/v1/completions");
        assert!(
            line.starts_with("POST /v1/completions?a=1&b=%2F HTTP/1.1\r\n"),
            "{line}"
        );
        assert_eq!(norm("/v1/chat%2Fcompletions").0, "/v1/chat%2Fcompletions");
        assert_eq!(norm("/").0, "/");
        assert_eq!(norm("http://e").0, "/");
        assert_eq!(norm("/%2e%2e/generate").0, "/generate");
        for bad in ["*", "v1/chat", "http:///v1", "/a#b"] {
            let raw = format!("POST {bad} HTTP/1.1\r\n\r\n");
            assert_eq!(p(&raw).unwrap_err().status(), 400, "{bad}");
        }
        for m in ["post", "Post", "CONNECT", "TRACE", "FOO"] {
            let raw = format!("{m} /v1/chat/completions HTTP/1.1\r\n\r\n");
            assert_eq!(p(&raw).unwrap_err().status(), 501, "{m}");
        }
    }

    #[test]
    fn identical_duplicate_lengths_are_one_length() {
        let h = p("POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(h.body, BodyFraming::Length(3));
    }
}
