//! The one parser of `http://` URLs in the workspace: backends in the
//! configuration, targets of the workload and bench clients.

use std::fmt;

/// An `http://host[:port][/path]` URL, split.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpUrl {
    /// Host name or address, without brackets for IPv6.
    pub host: String,
    /// The port, 80 when the URL gives none.
    pub port: u16,
    /// The path without a trailing slash; empty for `http://h:p` and `http://h:p/`.
    pub path: String,
    /// `https://` (the port defaults to 443).
    pub tls: bool,
}

/// Why a URL was refused.
#[derive(Debug, PartialEq, Eq)]
pub struct BadUrl(pub String);

impl fmt::Display for BadUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BadUrl {}

impl HttpUrl {
    pub fn parse(url: &str) -> Result<HttpUrl, BadUrl> {
        let bad = |why: &str| BadUrl(format!("URL {url:?} {why}"));
        let (rest, tls) = match url.strip_prefix("https://") {
            Some(rest) => (rest, true),
            None => (
                url.strip_prefix("http://")
                    .ok_or_else(|| bad("must start with http:// or https://"))?,
                false,
            ),
        };
        let (authority, path) = rest.find('/').map_or((rest, ""), |i| rest.split_at(i));
        if authority.is_empty() {
            return Err(bad("has no host"));
        }
        if authority.contains(['@', '?', '#']) || path.contains(['?', '#']) {
            return Err(bad(
                "must be http://host[:port][/path], without user, query or fragment",
            ));
        }
        let (host, port) = match authority.strip_prefix('[') {
            // [v6]:port
            Some(v6) => {
                let (h, after) = v6.split_once(']').ok_or_else(|| bad("has an unclosed ["))?;
                match after.strip_prefix(':') {
                    Some(p) => (h, Some(p)),
                    None if after.is_empty() => (h, None),
                    None => return Err(bad("has text after its IPv6 address")),
                }
            }
            None => match authority.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            },
        };
        let port = match port {
            Some(p) => p.parse().map_err(|_| bad("has a bad port"))?,
            None if tls => 443,
            None => 80,
        };
        if host.is_empty() {
            return Err(bad("has no host"));
        }
        Ok(HttpUrl {
            host: host.to_owned(),
            port,
            path: path.trim_end_matches('/').to_owned(),
            tls,
        })
    }

    /// `host:port` for a resolver (brackets around an IPv6 address).
    pub fn host_port(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_urls_split() {
        let u = HttpUrl::parse("http://127.0.0.1:8001").unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.path.as_str()),
            ("127.0.0.1", 8001, "")
        );
        assert_eq!(HttpUrl::parse("http://engine/").unwrap().port, 80);
        assert_eq!(HttpUrl::parse("http://e:1/v1/").unwrap().path, "/v1");
        let v6 = HttpUrl::parse("http://[::1]:9000/x").unwrap();
        assert_eq!((v6.host.as_str(), v6.port), ("::1", 9000));
        assert_eq!(v6.host_port(), "[::1]:9000");
        let s = HttpUrl::parse("https://engine").unwrap();
        assert_eq!((s.port, s.tls), (443, true));
        assert!(!HttpUrl::parse("http://e:1").unwrap().tls);
        for bad in [
            "ftp://e:1",
            "http://",
            "http://:80",
            "http://e:port",
            "http://u@e:1",
            "http://e:1/a?b",
            "http://[::1",
            "http://e:70000",
        ] {
            assert!(HttpUrl::parse(bad).is_err(), "{bad}");
        }
    }
}
