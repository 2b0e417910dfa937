//! prefix-router: routes OpenAI-compatible requests to the inference server
//! predicted to answer first: the one holding the prompt's prefix in its KV
//! cache, weighed against queued work and load, under a safety cap. See
//! ARCHITECTURE.md for the map of this crate and which folder may use which.
//!
//! The public surface is what the binary, the benchmarks, the fuzz targets
//! and the tests use: `app::run`, the configuration, the HTTP framing, the
//! routing core and the eBPF loader. The proxy, the shared state and the
//! rest of the control plane are the crate's own.

pub mod app;
pub mod config;
pub mod control;
pub(crate) mod epp;
pub mod error;
pub mod fleet;
pub mod http;
pub(crate) mod metrics;
pub mod policy;
pub mod precise;
pub mod prompt;
pub(crate) mod proxy;
pub mod replica;
pub(crate) mod shared;
