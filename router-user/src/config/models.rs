//! The model settings: `[models]` (discovery, requests without a model),
//! `[[pools]]`, and a backend table's `models` pin, turned into the
//! routing core's [`Spec`].

use anyhow::bail;
use serde::Deserialize;

use crate::fleet::models::{PoolSpec, Spec, WithoutModel};
use crate::policy::select::Policy;

/// `[models]`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ModelsConfig {
    /// Read each backend's models from its `GET /v1/models` after each
    /// passing health probe (backends whose table pins `models` excepted).
    pub discover: bool,
    /// A request without `model`: `"any"` (any backend; each engine answers
    /// with its default model, as vLLM does), `"reject"` (400), or a pool's
    /// name (its backends and policy).
    pub default_pool: String,
}

impl Default for ModelsConfig {
    fn default() -> Self {
        ModelsConfig {
            discover: true,
            default_pool: "any".into(),
        }
    }
}

/// One `[[pools]]` table.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    pub name: String,
    /// Models (or adapters) whose requests go to this pool.
    pub models: Vec<String>,
    /// Backend URLs of the pool, each one of `backends`; left out: every backend.
    #[serde(default)]
    pub backends: Option<Vec<String>>,
    /// Its routing policy; left out: the router's `policy`.
    #[serde(default)]
    pub policy: Option<Policy>,
}

/// The routing core's view of the config's model settings; `pinned` lists
/// the backends whose tables pin `models`, by URL.
pub fn spec(
    models: &ModelsConfig,
    pools: &[PoolConfig],
    pinned: Vec<(String, Vec<String>)>,
) -> Spec {
    let without_model = match models.default_pool.as_str() {
        "any" => WithoutModel::Any,
        "reject" => WithoutModel::Reject,
        name => pools
            .iter()
            .position(|p| p.name == name)
            .map_or(WithoutModel::Reject, WithoutModel::Pool),
    };
    Spec {
        pinned,
        pools: pools
            .iter()
            .map(|p| PoolSpec {
                name: p.name.clone(),
                models: p.models.clone(),
                backends: p.backends.clone(),
                policy: p.policy,
            })
            .collect(),
        without_model,
    }
}

/// Checks the pools against each other and the backend URLs.
pub fn validate(models: &ModelsConfig, pools: &[PoolConfig], urls: &[&str]) -> anyhow::Result<()> {
    for (i, p) in pools.iter().enumerate() {
        if p.name.is_empty() || p.name == "any" || p.name == "reject" {
            bail!("pools: a pool needs a name other than \"any\" and \"reject\"");
        }
        if pools[..i].iter().any(|q| q.name == p.name) {
            bail!("pools: two pools are named {:?}", p.name);
        }
        if p.models.is_empty() {
            bail!("pools: pool {:?} lists no models", p.name);
        }
        for m in &p.models {
            if let Some(q) = pools[..i].iter().find(|q| q.models.contains(m)) {
                bail!(
                    "pools: model {m:?} is in pools {:?} and {:?}",
                    q.name,
                    p.name
                );
            }
        }
        for u in p.backends.iter().flatten() {
            if !urls.contains(&u.as_str()) {
                bail!(
                    "pools: pool {:?} names backend {u:?}, which is not in `backends`",
                    p.name
                );
            }
        }
    }
    let d = models.default_pool.as_str();
    if d != "any" && d != "reject" && !pools.iter().any(|p| p.name == d) {
        bail!("models.default_pool: {d:?} is neither \"any\", \"reject\" nor a pool's name");
    }
    Ok(())
}
