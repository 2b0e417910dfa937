//! The inference API the traffic port serves: which paths and methods are
//! forwarded at all, and which carry a prompt to route on.

use crate::error::{Kind, RouterError};
use crate::http::request::RequestHead;
use crate::route::extract::Endpoint;

/// The traffic port's allowlist: the inference API, plus `extra` (paths in
/// normal form, any method). Anything else is a 404 (405 for a known path
/// with the wrong method), answered without touching an engine. `fwd` is
/// the forwarded head `head` was parsed into.
pub fn check_route(head: &RequestHead, fwd: &[u8], extra: &[String]) -> Result<(), RouterError> {
    let path = head.path(fwd);
    let method = head.method(fwd).as_bytes();
    let allowed: &[&[u8]] = match path {
        "/v1/chat/completions" | "/v1/completions" | "/generate" => &[b"POST"],
        "/v1/models" => &[b"GET", b"HEAD"],
        p if extra.iter().any(|e| e == p) => return Ok(()),
        _ => {
            return Err(RouterError::new(
                Kind::NotFound,
                format!("{path} is not served here (routes.extra_allowed adds paths)"),
            ));
        }
    };
    if allowed.contains(&method) {
        Ok(())
    } else {
        Err(RouterError::new(
            Kind::MethodNotAllowed,
            format!(
                "{path} takes {}",
                if allowed.len() == 1 { "POST" } else { "GET" }
            ),
        ))
    }
}

/// The endpoint whose body carries the prompt, if the request is one.
pub fn endpoint(head: &RequestHead, fwd: &[u8]) -> Option<Endpoint> {
    Endpoint::from_path(head.method(fwd), head.path(fwd))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::request::parse;

    fn head(raw: &str) -> (RequestHead, Vec<u8>) {
        let mut fwd = Vec::new();
        let h = parse(raw.as_bytes(), 8192, &mut fwd).unwrap().unwrap();
        (h, fwd)
    }

    #[test]
    fn prompts_are_read_from_the_normalised_inference_paths() {
        for (t, ep) in [
            ("/v1/chat/completions", Some(Endpoint::Chat)),
            ("//v1/chat/completions/", Some(Endpoint::Chat)),
            ("/x/../v1/chat/completion%73", Some(Endpoint::Chat)),
            ("http://e/v1/completions?a=1", Some(Endpoint::Completions)),
            ("/generate", Some(Endpoint::Generate)),
            ("/v1/models", None),
        ] {
            let (h, fwd) = head(&format!("POST {t} HTTP/1.1\r\n\r\n"));
            assert_eq!(endpoint(&h, &fwd), ep, "{t}");
        }
        let (h, fwd) = head("GET /v1/chat/completions HTTP/1.1\r\n\r\n");
        assert_eq!(endpoint(&h, &fwd), None, "a GET carries no prompt");
    }

    #[test]
    fn only_the_inference_api_is_served() {
        let status = |raw: &str, extra: &[String]| {
            let (h, fwd) = head(raw);
            check_route(&h, &fwd, extra).map_or_else(|e| e.status(), |()| 200)
        };
        assert_eq!(
            status("POST /v1/chat/completions HTTP/1.1\r\n\r\n", &[]),
            200
        );
        assert_eq!(status("GET /v1/models HTTP/1.1\r\n\r\n", &[]), 200);
        assert_eq!(
            status("GET /v1/chat/completions HTTP/1.1\r\n\r\n", &[]),
            405
        );
        assert_eq!(status("GET /admin HTTP/1.1\r\n\r\n", &[]), 404);
        let extra = ["/v1/embeddings".to_owned()];
        assert_eq!(status("POST /v1/embeddings HTTP/1.1\r\n\r\n", &extra), 200);
    }
}
