//! Each backend's models, read from its `GET /v1/models` (the OpenAI list
//! vLLM, SGLang, llama.cpp and TensorRT-LLM answer) after each passing
//! health probe, and the model table rebuilt when they, the fleet or the
//! config change. The rules, logged once per change:
//!
//! - a well-formed list: the backend serves exactly those (base models, and
//!   LoRA adapters with their `parent`);
//! - a malformed answer (not JSON, no `data` array, an entry without a
//!   string `id`): nothing new is believed: the last good list stays (a
//!   backend never listed stays unknown), with a warning;
//! - an entry whose name may not be published (`fleet::models::check_name`:
//!   too long, control characters) is skipped with a warning, the others
//!   believed; when no entry is left it is a malformed answer;
//! - a status other than 2xx (an engine without the endpoint): its models
//!   are unknown, so it serves any model as a fallback (`fleet::models`);
//! - an answer too large (over `probe::MAX_BODY_BYTES`) or too slow (not
//!   whole within `health.timeout_ms`): nothing changes, with a warning;
//! - no answer (connect error): nothing changes; health decides.
//!
//! Each problem shows in `/admin/backends` (`models_problem`) until a good
//! answer clears it.

use std::sync::Arc;
use std::time::Duration;

use tracing::{info, warn};

use super::probe::{self, ProbeError};
use crate::config::Config;
use crate::fleet::backend::{Backend, Fleet};
use crate::fleet::models::{Served, ServedModel, check_name};
use crate::shared::Router;

/// The path every OpenAI-compatible engine lists its models on.
const MODELS_PATH: &str = "/v1/models";
/// Entries of one answer believed; an engine lists a handful of models and
/// its loaded adapters (vLLM's `--max-loras` is usually 1-8).
const MAX_ENTRIES: usize = 4096;

/// Reads `b`'s `/v1/models` (one GET within `timeout`) unless the config
/// pins its models or turns discovery off, and rebuilds the model table
/// when what it serves changed.
pub fn refresh(router: &Router, b: &Backend, timeout: Duration) {
    let cfg = router.config.load();
    let pinned = cfg
        .backends
        .iter()
        .any(|c| c.url() == b.url && c.models().is_some());
    let served = if pinned || !cfg.models.discover {
        Served::Unknown
    } else {
        match probe::get(
            &probe::Target::of(&router.config.load(), b),
            MODELS_PATH,
            timeout,
        ) {
            Err(e @ (ProbeError::TimedOut(_) | ProbeError::Invalid(_))) => {
                let why = format!("GET {MODELS_PATH}: {e}");
                if router.models.note_problem(b.generation, Some(why.clone())) {
                    warn!(backend = %b.url, error = %why, "the backend's model list is too large or too slow: keeping what it served before");
                }
                return;
            }
            Err(_) => return,
            Ok(a) if !(200..300).contains(&a.status) => {
                let why = format!("GET {MODELS_PATH} answered {}", a.status);
                if router.models.note_problem(b.generation, Some(why.clone())) {
                    info!(backend = %b.url, status = a.status, "the backend does not list its models: it may be sent any model (pin them with `models` in its backends table)");
                }
                Served::Unknown
            }
            Ok(a) => match parse_models(&a.body) {
                Ok((list, skipped)) => {
                    if router.models.note_problem(b.generation, skipped.clone())
                        && let Some(why) = skipped
                    {
                        warn!(backend = %b.url, error = %why, "skipping model names that may not be published");
                    }
                    Served::Known(list)
                }
                Err(why) => {
                    if router.models.note_problem(b.generation, Some(why.clone())) {
                        warn!(backend = %b.url, error = %why, "malformed GET /v1/models answer: keeping what it served before");
                    }
                    return;
                }
            },
        }
    };
    if router.models.set_discovered(b.generation, served.clone()) {
        if let Served::Known(list) = &served {
            let names: Vec<&str> = list.iter().map(|m| m.id.as_str()).collect();
            info!(backend = %b.url, models = ?names, "backend models changed");
        }
        router.sync_models();
    }
}

/// The config and fleet the model table was last built for.
#[derive(Default)]
pub struct Seen(Option<(Arc<Config>, Arc<Fleet>)>);

/// Rebuilds the model table when a reload changed the fleet or the config
/// since the last call (the health supervisor calls it every pass).
pub fn sync(router: &Router, seen: &mut Seen) {
    let cfg = router.config.load_full();
    let fleet = router.fleet.load_full();
    if let Some((c, f)) = &seen.0
        && Arc::ptr_eq(c, &cfg)
        && Arc::ptr_eq(f, &fleet)
    {
        return;
    }
    let first = seen.0.is_none();
    seen.0 = Some((cfg, fleet));
    if !first {
        router.sync_models();
    }
}

/// The models of an OpenAI list answer, `{"object": "list", "data": [{"id":
/// ..., "parent": ...}]}`, sorted by id, and what was skipped (entries
/// whose `id` or `parent` may not be published: how many, and the first
/// reason); an error saying what is wrong.
pub fn parse_models(body: &[u8]) -> Result<(Vec<ServedModel>, Option<String>), String> {
    let v: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    let data = v
        .get("data")
        .and_then(|d| d.as_array())
        .ok_or("no \"data\" array")?;
    if data.len() > MAX_ENTRIES {
        return Err(format!("{} entries, more than {MAX_ENTRIES}", data.len()));
    }
    let mut out = Vec::with_capacity(data.len());
    let mut skipped = 0;
    let mut first_skip = None;
    for (i, m) in data.iter().enumerate() {
        let id = m
            .get("id")
            .and_then(|id| id.as_str())
            .filter(|id| !id.is_empty())
            .ok_or_else(|| format!("entry {i} has no \"id\" string"))?;
        let parent = m
            .get("parent")
            .and_then(|p| p.as_str())
            .filter(|p| !p.is_empty() && *p != id);
        let checked = check_name(id).and_then(|()| parent.map_or(Ok(()), check_name));
        if let Err(why) = checked {
            skipped += 1;
            first_skip.get_or_insert_with(|| format!("entry {i}: {why}"));
            continue;
        }
        out.push(ServedModel {
            id: id.to_owned(),
            parent: parent.map(str::to_owned),
        });
    }
    let skipped = first_skip.map(|first| format!("{skipped} entries skipped; {first}"));
    if out.is_empty()
        && let Some(why) = skipped
    {
        return Err(format!("no entry may be published ({why})"));
    }
    out.sort();
    out.dedup_by(|a, b| a.id == b.id);
    Ok((out, skipped))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vllm_models_with_adapters() {
        let body = br#"{"object":"list","data":[
            {"id":"llama","object":"model","owned_by":"vllm","root":"/m/llama","parent":null,"max_model_len":8192},
            {"id":"sql-lora","object":"model","owned_by":"vllm","root":"/a/sql","parent":"llama","max_model_len":null},
            {"id":"llama","object":"model"}]}"#;
        let (m, skipped) = parse_models(body).unwrap();
        assert_eq!(skipped, None);
        assert_eq!(
            m,
            [
                ServedModel {
                    id: "llama".into(),
                    parent: None
                },
                ServedModel {
                    id: "sql-lora".into(),
                    parent: Some("llama".into())
                },
            ]
        );
        assert_eq!(parse_models(br#"{"data":[]}"#).unwrap(), (vec![], None));
    }

    #[test]
    fn names_that_may_not_be_published_are_skipped() {
        let long = "x".repeat(crate::fleet::models::MAX_NAME_BYTES + 1);
        let body = serde_json::json!({"data": [
            {"id": "good"},
            {"id": long},
            {"id": "esc\u{1b}[31m"},
            {"id": "nul\u{0}"},
            {"id": "cr\rinjected 1"},
            {"id": "rtl\u{202e}"},
            {"id": "lora", "parent": "bad\nparent"},
            {"id": "caf\u{e9}/mod\u{e8}le-7b"},
        ]})
        .to_string();
        let (m, skipped) = parse_models(body.as_bytes()).unwrap();
        let ids: Vec<&str> = m.iter().map(|m| m.id.as_str()).collect();
        assert_eq!(ids, ["caf\u{e9}/mod\u{e8}le-7b", "good"]);
        let why = skipped.unwrap();
        assert!(
            why.starts_with("6 entries skipped; entry 1: a name of 513 bytes"),
            "{why}"
        );
        let only_bad = br#"{"data":[{"id":"a\u0000"}]}"#;
        let e = parse_models(only_bad).unwrap_err();
        assert!(e.contains("no entry may be published"), "{e}");
    }

    #[test]
    fn malformed_answers_are_errors() {
        for body in [
            &b"<html>"[..],
            br#"{"object":"list"}"#,
            br#"{"data":{"id":"x"}}"#,
            br#"{"data":[{"id":7}]}"#,
            br#"{"data":[{"name":"x"}]}"#,
            br#"{"data":[{"id":""}]}"#,
            br#"[{"id":"x"}]"#,
        ] {
            assert!(
                parse_models(body).is_err(),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }
}
