//! Query strings of admin requests (`application/x-www-form-urlencoded`):
//! `name=value` pairs split on `&`, `+` for a space, `%XX` in either case.

use std::fmt;

/// A query that cannot be decoded (a stray `%`, or bytes that are not UTF-8).
#[derive(Debug, PartialEq, Eq)]
pub struct BadQuery(String);

impl fmt::Display for BadQuery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "malformed query string: {}", self.0)
    }
}

/// The decoded value of the first `name` parameter of `query`.
pub fn param(query: &str, name: &str) -> Result<Option<String>, BadQuery> {
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if decode(k)? == name {
            return decode(v).map(Some);
        }
    }
    Ok(None)
}

/// Percent-decodes one component (`+` is a space).
pub fn decode(s: &str) -> Result<String, BadQuery> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = |j: usize| bytes.get(j).and_then(|&b| (b as char).to_digit(16));
                let (Some(hi), Some(lo)) = (hex(i + 1), hex(i + 2)) else {
                    return Err(BadQuery(format!("bad percent escape in {s:?}")));
                };
                out.push((hi * 16 + lo) as u8);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| BadQuery(format!("{s:?} does not decode to UTF-8")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn decodes_escapes_in_either_case_and_plus() {
        assert_eq!(
            param("x=1&backend=http%3a%2F%2F127.0.0.1%3A8001", "backend").unwrap(),
            Some("http://127.0.0.1:8001".into())
        );
        assert_eq!(param("a+b=c+d%2B", "a b").unwrap(), Some("c d+".into()));
        assert_eq!(param("flag", "flag").unwrap(), Some(String::new()));
        assert_eq!(param("", "x").unwrap(), None);
        assert_eq!(decode("%E2%9C%93").unwrap(), "\u{2713}");
    }

    #[test]
    fn malformed_escapes_are_errors() {
        for bad in ["%", "%4", "%zz", "a%g1", "%ff"] {
            assert!(decode(bad).is_err(), "{bad}");
        }
    }

    proptest! {
        /// Any text, escaped byte by byte, decodes to itself.
        #[test]
        fn round_trip(text in ".{0,40}", upper in any::<bool>()) {
            let escaped: String = text
                .bytes()
                .map(|b| if upper { format!("%{b:02X}") } else { format!("%{b:02x}") })
                .collect();
            prop_assert_eq!(decode(&escaped).unwrap(), text);
        }
    }
}
