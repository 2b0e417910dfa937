//! Request bodies and raw HTTP/1.1 requests for the load generator.

/// The model every simulated engine serves by default.
pub const MODEL: &str = "sim-llama-8b";

/// Deterministic English-looking text of exactly `len` bytes.
pub fn text(len: usize, seed: u64) -> String {
    const WORDS: [&str; 16] = [
        "the", "model", "router", "prefix", "cache", "token", "engine", "request", "answer",
        "system", "prompt", "block", "latency", "of", "and", "with",
    ];
    let mut s = String::with_capacity(len + 16);
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    while s.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.push_str(WORDS[(x % 16) as usize]);
        s.push(' ');
    }
    s.truncate(len);
    s
}

/// A chat completion body of about `size` bytes: a system prompt carrying
/// the bulk and a short user turn, `max_tokens: 1`.
pub fn chat_body(size: usize, seed: u64) -> Vec<u8> {
    let overhead = 160;
    let sys = text(size.saturating_sub(overhead), seed);
    serde_json::to_vec(&serde_json::json!({
        "model": MODEL,
        "messages": [
            {"role": "system", "content": sys},
            {"role": "user", "content": "Summarize the above in one word."}
        ],
        "max_tokens": 1
    }))
    .expect("json")
}

/// The tiny chat request of the overhead bench.
pub fn tiny_body(stream: bool, max_tokens: u32) -> Vec<u8> {
    let mut v = serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens
    });
    if stream {
        v["stream"] = serde_json::Value::Bool(true);
    }
    serde_json::to_vec(&v).expect("json")
}

/// A complete keep-alive `POST /v1/chat/completions` request carrying `body`.
pub fn http_request(body: &[u8]) -> Vec<u8> {
    let mut r = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_have_the_asked_size_and_parse() {
        for size in [4096, 65536] {
            let b = chat_body(size, 3);
            assert!(b.len().abs_diff(size) < 200, "{} vs {size}", b.len());
            let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
            assert_eq!(v["model"], MODEL);
        }
    }
}
