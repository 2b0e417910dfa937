//! The `[precise]` configuration section (every key in
//! `prefix-router.example.toml`, commented), and where each backend
//! publishes its events.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Deserialize;

use super::BackendConfig;
use crate::precise::subscriber::Endpoints;

/// Precise mode: off by default (the approximate index alone routes).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PreciseConfig {
    /// Subscribe to every backend's KV-cache events and route EXACT
    /// backends on what their engines say they hold.
    pub enabled: bool,
    /// Port of a backend's live event stream, on the backend's host, when
    /// the backend gives no `kv_events` endpoint (vLLM's example: 5557).
    pub port: u16,
    /// Port of its replay socket [default: `port` + 1].
    pub replay_port: Option<u16>,
    /// Topic prefix subscribed to ("" for every topic).
    pub topic: String,
    /// Tokens per engine block when an event does not say (vLLM: 16).
    pub block_tokens: usize,
    /// Burst guard: the blocks of a request just routed count as held by its
    /// backend for this long, so siblings of a burst land together before
    /// the engine's events arrive (milliseconds after the request). 0: off.
    pub burst_ms: u32,
    /// `prefix.move_cost` for a request routed on the engines' events.
    /// They show an evicted history at once, so a conversation's holder
    /// matches only what it still has, and at 0.5 a block the conversation
    /// leaves for any shorter queue, splitting system prompts over engines
    /// that then evict more: 5.5 points of hits lost on pressure-published
    /// (decision 0029). 4 keeps it with its prompt's engine.
    pub move_cost: f64,
    /// A backend whose stream lost a batch for good (a gap replay could not
    /// fill, a batch that did not decode) is forgotten by the precise index
    /// and stays DEGRADED this long, while its stream refills the index.
    pub recover_ms: u64,
    /// The model's tokenizer: a local directory holding its `tokenizer.json`
    /// and `tokenizer_config.json` (with `chat_template`), used for every
    /// model without an entry in `tokenizers`. Unset: `sim-engine`'s
    /// 4-byte tokenizer and ChatML, which a real engine does not share.
    /// Read at start; one that cannot be read is logged and its model
    /// routes on the approximate index.
    pub tokenizer_dir: Option<PathBuf>,
    /// Per model (the requests' `model`): its tokenizer directory.
    pub tokenizers: BTreeMap<String, PathBuf>,
    /// Budget of the cache of tokenized messages (shared by the workers),
    /// in tokens (4 bytes each): a chat turn tokenizes only messages not in
    /// it.
    pub tokenizer_cache_tokens: usize,
    /// A chat's last message up to this many bytes, not in the cache, is
    /// tokenized off the request's wait (no engine can hold its blocks
    /// yet): the request routes on the blocks before it. Longer ones (a
    /// document that other requests may share) are tokenized at once. 0:
    /// every message on the wait.
    pub tokenizer_defer_bytes: usize,
    /// Most tokens of a prompt routing uses: a longer prompt is cut to
    /// about this many (its first `4 x` this many bytes) before it is
    /// tokenized, so no prompt costs more than this; past it a backend
    /// that holds it all is credited with what the approximate index says
    /// it holds beyond. The engine rejects a prompt over its context, not
    /// the router.
    pub tokenizer_max_tokens: usize,
    /// Threads that tokenize for the traffic workers (with a model
    /// tokenizer; the toy tokenizer and token ids stay on the workers).
    pub tokenizer_threads: usize,
    /// Requests waiting for a tokenizing thread, beyond those being
    /// tokenized; when it is full a request routes on the approximate
    /// index at once.
    pub tokenizer_queue: usize,
    /// Longest a request waits for its tokens (milliseconds); then it
    /// routes on the approximate index.
    pub tokenizer_wait_ms: u64,
}

impl Default for PreciseConfig {
    fn default() -> Self {
        PreciseConfig {
            enabled: false,
            port: 5557,
            replay_port: None,
            topic: String::new(),
            block_tokens: crate::precise::keys::DEFAULT_BLOCK_TOKENS,
            burst_ms: 2000,
            move_cost: 4.0,
            recover_ms: 10_000,
            tokenizer_dir: None,
            tokenizers: BTreeMap::new(),
            tokenizer_cache_tokens: crate::precise::tokenizer::DEFAULT_CACHE_TOKENS,
            tokenizer_defer_bytes: crate::precise::tokenizer::DEFAULT_DEFER_BYTES,
            tokenizer_max_tokens: crate::precise::tokenizer::DEFAULT_MAX_TOKENS,
            tokenizer_threads: crate::precise::offload::DEFAULT_THREADS,
            tokenizer_queue: crate::precise::offload::DEFAULT_QUEUE,
            tokenizer_wait_ms: crate::precise::offload::DEFAULT_WAIT_MS,
        }
    }
}

impl PreciseConfig {
    pub fn settings(&self) -> crate::precise::Settings {
        crate::precise::Settings {
            block_tokens: self.block_tokens.max(1),
            burst_ms: self.burst_ms,
            recover_ms: self.recover_ms,
        }
    }

    /// Loads the configured tokenizers (failures logged, see `tokenizer_dir`).
    pub fn load_tokenizers(&self) -> crate::precise::tokenizer::Tokenizers {
        use crate::precise::tokenizer::{Limits, TokenPool, Tokenizers};
        Tokenizers::load(
            self.tokenizer_dir.as_deref(),
            &self.tokenizers,
            TokenPool::new(self.tokenizer_cache_tokens, self.tokenizer_defer_bytes),
            Limits {
                threads: self.tokenizer_threads,
                queue: self.tokenizer_queue,
                max_tokens: self.tokenizer_max_tokens,
            },
        )
    }

    /// Where `backend` publishes: its own `kv_events` / `kv_events_replay`
    /// endpoints, else its host with `port` and `replay_port`.
    pub fn endpoints(&self, backend: &BackendConfig) -> Endpoints {
        let (live, replay) = backend.kv_events();
        let host = || {
            let rest = backend.url().split("://").nth(1).unwrap_or(backend.url());
            let authority = rest.split('/').next().unwrap_or(rest);
            authority
                .rsplit_once(':')
                .map_or(authority, |(h, _)| h)
                .to_owned()
        };
        let live = live.map_or_else(|| format!("tcp://{}:{}", host(), self.port), str::to_owned);
        let replay = replay.map(str::to_owned).or_else(|| {
            backend.kv_events().0.is_none().then(|| {
                let p = self.replay_port.unwrap_or(self.port.wrapping_add(1));
                format!("tcp://{}:{p}", host())
            })
        });
        Endpoints {
            live,
            replay,
            topic: self.topic.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn the_example_config_says_the_defaults() {
        let text = include_str!("../../prefix-router.example.toml");
        let cfg: crate::config::Config = toml::from_str(text).unwrap();
        assert_eq!(cfg.precise, PreciseConfig::default());
        assert!(!cfg.precise.enabled, "approximate mode stays the default");
        assert_eq!(
            cfg.backends[3].kv_events(),
            (Some("tcp://127.0.0.1:5557"), Some("tcp://127.0.0.1:5558"))
        );
    }

    #[test]
    fn tokenizers_are_configured_by_default_and_per_model() {
        let c: PreciseConfig = toml::from_str(
            "tokenizer_dir = \"/models/a\"\ntokenizer_cache_tokens = 1000\n\
             [tokenizers]\n\"llama-3.1-8b\" = \"/models/llama\"",
        )
        .unwrap();
        assert_eq!(c.tokenizer_dir.as_deref(), Some(Path::new("/models/a")));
        assert_eq!(c.tokenizers["llama-3.1-8b"], Path::new("/models/llama"));
        assert_eq!(c.tokenizer_cache_tokens, 1000);
        // Neither directory exists: both models fall back, nothing panics.
        let t = c.load_tokenizers();
        use crate::precise::tokenizer::Choice;
        assert!(matches!(t.for_model(b"llama-3.1-8b"), Choice::Unavailable));
        assert!(matches!(t.for_model(b"any"), Choice::Unavailable));
        assert!(matches!(
            PreciseConfig::default().load_tokenizers().for_model(b"any"),
            Choice::Toy
        ));
    }

    #[test]
    fn endpoints_are_derived_from_the_backend_host_or_given() {
        let c = PreciseConfig::default();
        let e = c.endpoints(&BackendConfig::Url("http://10.0.0.7:8000".into()));
        assert_eq!(e.live, "tcp://10.0.0.7:5557");
        assert_eq!(e.replay.as_deref(), Some("tcp://10.0.0.7:5558"));
        let t: BackendConfig = toml::from_str::<toml::Table>(
            "b = { url = \"http://h:1\", kv_events = \"tcp://h:9\" }",
        )
        .unwrap()["b"]
            .clone()
            .try_into()
            .unwrap();
        let e = c.endpoints(&t);
        assert_eq!(e.live, "tcp://h:9");
        assert_eq!(
            e.replay, None,
            "a given live endpoint without replay has none"
        );
    }
}
