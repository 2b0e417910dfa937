//! Test ground for prefix-router: the simulated vLLM engine, the workload
//! generator and helpers for end-to-end tests.
//!
//! # For tests
//! - [`bin_path`]`(name) -> PathBuf`: a workspace binary (`sim-engine`,
//!   `workload`, `prefix-router`), built on demand.
//! - [`engine_proc::SimEngine::spawn`]`(&["--kv-blocks", "64"]) -> SimEngine { addr, child }`:
//!   a running engine on `127.0.0.1:<free port>`, killed on drop.
//! - [`proc::Spawned`] (child guard: SIGTERM then SIGKILL on drop, stderr
//!   kept for diagnostics), [`proc::free_port`], [`proc::wait_http_ready`].
//! - [`http::request`]`(addr, method, path, headers, body) -> Response { status, headers, body }`
//!   and [`http::request_chunks`] (each chunk with its arrival instant).
//!
//! - [`dns::DnsServer::spawn`]`()`: an authoritative DNS server on loopback
//!   UDP whose A/AAAA/SRV records (and failure modes) a test changes while
//!   the router resolves it.
//! - [`fake_backend::FakeBackend::spawn`]`(handler)`: a misbehaving backend on
//!   std::net that counts and records every request and answers as the
//!   handler writes (or closes without a byte).
//! - [`router_proc::Router::spawn`]`(&backend_urls, &extra_flags, config_toml) -> Router { addr, admin, child }`:
//!   a running `prefix-router` on free ports, killed on drop; `.backends()`
//!   and `.metrics()` read its admin listener.
//! - [`llama_proc::require`]`(test) -> Option<LlamaPaths>` (the llama.cpp
//!   build from `cargo xtask setup`; skips, or fails under `CI=true`) and
//!   [`llama_proc::LlamaServer::spawn`]`(&paths, slots, &extra)`: a real
//!   `llama-server` on a free port, killed on drop.
//!
//! - [`sdk::require`]`(test) -> Option<PathBuf>` (the official Anthropic
//!   and OpenAI Python SDKs from `cargo xtask setup`; skips, or fails under
//!   `CI=true`) and [`sdk::run`]`(&python, Script::Anthropic, base_url, model, &extra)`:
//!   every kind of Messages or Responses call against any base URL, one
//!   parsed JSON line per call.
//!
//! - [`tls::TestCa::new`]`(name)` and `.issue(&names, Validity::Now, client)`:
//!   certificates made in the test (expired ones too), written as PEM;
//!   [`tls::request`]`(addr, &tls::client_config(&ca.pem, None), name, ...)`:
//!   one HTTPS request over rustls.
//!
//! - [`tokenizer_fixture::write`]`(dir)`: a real `tokenizer.json` (a small
//!   BPE trained here) and a ChatML `tokenizer_config.json`, for
//!   `sim-engine --tokenizer-dir` and the router's `[precise] tokenizer_dir`.
//!
//! # For benchmarks and router tests
//! - [`workload::RunConfig`] (target URL, [`workload::Scenario`], users or
//!   rate, request count and/or duration, seed) and
//!   [`workload::run`]`(cfg).await -> anyhow::Result<(Vec<Record>, Summary)>`, or
//!   [`workload::run_blocking`]. [`workload::Summary`] carries the hit rate,
//!   its ceiling, TTFT and latency percentiles, throughput and per-instance load.
//!
//! # The engine
//! [`engine`] holds the simulated engine's logic (the `sim-engine` binary is
//! a thin wrapper); its tokenizer and block hashing are what the workload's
//! hit-rate ceiling uses.

mod bin_path;
pub mod dns;
pub mod engine;
pub mod engine_proc;
pub mod envoy_proc;
pub mod fake_backend;
pub mod http;
pub mod llama_proc;
pub mod proc;
pub mod router_proc;
pub mod sdk;
pub mod tls;
pub mod tokenizer_fixture;
pub mod workload;

pub use bin_path::bin_path;
