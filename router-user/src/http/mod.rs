//! HTTP/1.1 framing: request heads, response heads, chunked bodies. Only what
//! a proxy needs: parse, validate against smuggling, and rewrite the
//! hop-by-hop headers; bodies pass through untouched.

pub mod chunked;
pub mod request;
pub(crate) mod response;
pub mod url;

/// Most headers a head may carry; more is answered 431.
pub const MAX_HEADERS: usize = 100;

/// Headers that describe one hop, never forwarded as they are.
fn is_hop_by_hop(name: &str) -> bool {
    const HOP: [&str; 9] = [
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",
        "content-length",
    ];
    HOP.iter().any(|h| h.eq_ignore_ascii_case(name))
}

/// True when a comma-separated header value lists `token` (case-insensitive).
fn has_token(value: &[u8], token: &str) -> bool {
    value
        .split(|&b| b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
}
