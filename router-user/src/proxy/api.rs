//! The inference API the traffic port serves: which paths and methods are
//! forwarded at all, and which carry a prompt to route on.

use crate::error::{Kind, RouterError};
use crate::fleet::backend::Fleet;
use crate::fleet::models::ModelTable;
use crate::fleet::stored;
use crate::http::request::RequestHead;
use crate::prompt::extract::Endpoint;

/// The traffic port's allowlist: the inference API, plus `extra` (paths in
/// normal form, any method). Anything else is a 404 (405 for a known path
/// with the wrong method), answered without touching an engine. `fwd` is
/// the forwarded head `head` was parsed into.
pub fn check_route(head: &RequestHead, fwd: &[u8], extra: &[String]) -> Result<(), RouterError> {
    let path = head.path(fwd);
    let method = head.method(fwd).as_bytes();
    let allowed: &[&[u8]] = match path {
        "/v1/chat/completions"
        | "/v1/completions"
        | "/generate"
        | "/v1/messages"
        | "/v1/responses" => &[b"POST"],
        "/v1/models" => &[b"GET", b"HEAD"],
        p if p.ends_with("/cancel") && stored::id_in_path(p).is_some() => &[b"POST"],
        p if stored::id_in_path(p).is_some() && p.ends_with("/input_items") => &[b"GET"],
        p if stored::id_in_path(p).is_some() => &[b"GET", b"DELETE"],
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
                allowed
                    .iter()
                    .map(|m| String::from_utf8_lossy(m))
                    .collect::<Vec<_>>()
                    .join(" or ")
            ),
        ))
    }
}

/// Whether the router answers the request itself: `GET` (or `HEAD`)
/// `/v1/models`, the fleet's models.
pub fn answers_itself(head: &RequestHead, fwd: &[u8]) -> bool {
    head.path(fwd) == "/v1/models" && matches!(head.method(fwd), "GET" | "HEAD")
}

/// The router's own `GET /v1/models` (`HEAD`: the same head, no body):
/// the OpenAI list of every model the fleet's up backends serve, each once,
/// adapters with their `parent` (as vLLM lists them). Names only: no
/// backend, no path on an engine's disk (`root` is the model's id).
pub fn models_answer(table: &ModelTable, fleet: &Fleet, head_only: bool, close: bool) -> Vec<u8> {
    let up = |slot: usize| fleet.by_slot(slot).is_some_and(|b| b.health.is_up());
    let data: Vec<serde_json::Value> = table
        .served(up)
        .into_iter()
        .map(|(id, parent)| {
            serde_json::json!({
                "id": id, "object": "model", "created": 0, "owned_by": "prefix-router",
                "root": parent.unwrap_or(id), "parent": parent,
            })
        })
        .collect();
    let body = serde_json::json!({"object": "list", "data": data}).to_string();
    let mut out = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{}\r\n",
        body.len(),
        if close { "connection: close\r\n" } else { "" }
    )
    .into_bytes();
    if !head_only {
        out.extend_from_slice(body.as_bytes());
    }
    out
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
    fn the_models_answer_lists_what_up_backends_serve_and_names_no_backend() {
        use crate::fleet::backend::Backend;
        use crate::fleet::models::{Member, ModelTable, Served, ServedModel, Spec};
        use std::sync::Arc;
        let urls = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"];
        let fleet = Fleet {
            backends: urls
                .iter()
                .enumerate()
                .map(|(i, u)| Arc::new(Backend::new(i, u, "10.0.0.1:8000".parse().unwrap(), 16)))
                .collect(),
        };
        let served = |names: &[(&str, Option<&str>)]| {
            Served::Known(
                names
                    .iter()
                    .map(|(id, p)| ServedModel {
                        id: (*id).into(),
                        parent: p.map(Into::into),
                    })
                    .collect(),
            )
        };
        let members: Vec<Member> = fleet
            .backends
            .iter()
            .zip([
                served(&[("chat", None), ("sql", Some("chat"))]),
                served(&[("chat", None), ("small", None)]),
            ])
            .map(|(b, served)| Member {
                slot: b.slot,
                generation: b.generation,
                url: &b.url,
                served,
            })
            .collect();
        let table = ModelTable::build(
            &members,
            &Spec::default(),
            |_| Arc::default(),
            Arc::default(),
        );
        fleet.backends[1].health.set_draining(true);
        let resp = String::from_utf8(models_answer(&table, &fleet, false, false)).unwrap();
        let (head, body) = resp.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        assert!(head.contains(&format!("content-length: {}", body.len())));
        assert!(!resp.contains("10.0.0"), "{resp}");
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        let ids: Vec<(&str, &serde_json::Value)> = v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| (m["id"].as_str().unwrap(), &m["parent"]))
            .collect();
        // `small` is served only by the drained backend.
        assert_eq!(
            ids,
            [
                ("chat", &serde_json::Value::Null),
                ("sql", &serde_json::json!("chat"))
            ]
        );
        let head_only = models_answer(&table, &fleet, true, true);
        let text = String::from_utf8(head_only).unwrap();
        assert!(text.ends_with("connection: close\r\n\r\n"), "{text}");
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
        for ok in [
            "POST /v1/messages",
            "POST /v1/responses",
            "GET /v1/responses/resp_1",
            "DELETE /v1/responses/resp_1",
            "GET /v1/responses/resp_1/input_items",
            "POST /v1/responses/resp_1/cancel",
        ] {
            assert_eq!(status(&format!("{ok} HTTP/1.1\r\n\r\n"), &[]), 200, "{ok}");
        }
        for (refused, code) in [
            ("GET /v1/messages", 405),
            ("POST /v1/responses/resp_1", 405),
            ("GET /v1/responses/resp_1/cancel", 405),
            ("GET /v1/responses/resp_1/other", 404),
        ] {
            assert_eq!(
                status(&format!("{refused} HTTP/1.1\r\n\r\n"), &[]),
                code,
                "{refused}"
            );
        }
        let extra = ["/v1/embeddings".to_owned()];
        assert_eq!(status("POST /v1/embeddings HTTP/1.1\r\n\r\n", &extra), 200);
    }
}
