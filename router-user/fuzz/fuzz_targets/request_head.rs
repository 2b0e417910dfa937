//! The request head parser on arbitrary bytes: it never panics, and a head it
//! accepts is consistent (its length fits the input and the limit, and the
//! forwarded head is a well-formed request line plus headers).
#![no_main]

use libfuzzer_sys::fuzz_target;
use prefix_router::http::request::{BodyFraming, parse};

/// The default `limits.max_header_bytes`.
const MAX_HEAD: usize = 16 * 1024;

fuzz_target!(|data: &[u8]| {
    let mut fwd = Vec::new();
    if let Ok(Some(head)) = parse(data, MAX_HEAD, &mut fwd) {
        assert!(head.len <= data.len() && head.len <= MAX_HEAD);
        assert!(fwd.ends_with(b"\r\n"), "forwarded head ends its last line");
        assert!(
            !fwd.windows(2).any(|w| w == b"\n\n"),
            "no blank line inside"
        );
        // Framing headers are never forwarded as sent: the proxy re-frames.
        for line in fwd.split(|&b| b == b'\n').skip(1) {
            let name = line.split(|&b| b == b':').next().unwrap_or(b"");
            assert!(!name.eq_ignore_ascii_case(b"transfer-encoding"));
            assert!(!name.eq_ignore_ascii_case(b"content-length"));
        }
        if let BodyFraming::Length(n) = head.body {
            assert!(n > 0);
        }
    }
});
