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
//! - a status other than 2xx (an engine without the endpoint): its models
//!   are unknown, so it serves any model as a fallback (`fleet::models`);
//! - no answer (connect error, timeout): nothing changes; health decides.

use std::sync::Arc;
use std::time::Duration;

use tracing::{info, warn};

use super::probe;
use crate::config::Config;
use crate::fleet::backend::{Backend, Fleet};
use crate::fleet::models::{Served, ServedModel};
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
        match probe::get(b.addr, MODELS_PATH, timeout) {
            Err(_) => return,
            Ok(a) if !(200..300).contains(&a.status) => {
                let why = format!("GET {MODELS_PATH} answered {}", a.status);
                if router.models.note_problem(b.generation, Some(why.clone())) {
                    info!(backend = %b.url, status = a.status, "the backend does not list its models: it may be sent any model (pin them with `models` in its backends table)");
                }
                Served::Unknown
            }
            Ok(a) => match parse_models(&a.body) {
                Ok(list) => {
                    router.models.note_problem(b.generation, None);
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
/// ..., "parent": ...}]}`, sorted by id; an error saying what is wrong.
pub fn parse_models(body: &[u8]) -> Result<Vec<ServedModel>, String> {
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
    for (i, m) in data.iter().enumerate() {
        let id = m
            .get("id")
            .and_then(|id| id.as_str())
            .filter(|id| !id.is_empty())
            .ok_or_else(|| format!("entry {i} has no \"id\" string"))?;
        let parent = m
            .get("parent")
            .and_then(|p| p.as_str())
            .filter(|p| !p.is_empty() && *p != id)
            .map(str::to_owned);
        out.push(ServedModel {
            id: id.to_owned(),
            parent,
        });
    }
    out.sort();
    out.dedup_by(|a, b| a.id == b.id);
    Ok(out)
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
        let m = parse_models(body).unwrap();
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
        assert_eq!(parse_models(br#"{"data":[]}"#).unwrap(), []);
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
