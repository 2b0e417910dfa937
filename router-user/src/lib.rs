//! prefix-router: routes OpenAI-compatible requests to the inference server
//! predicted to answer first: the one holding the prompt's prefix in its KV
//! cache, weighed against queued work and load, under a safety cap. See
//! ARCHITECTURE.md for the map of this crate and which folder may use which.

pub mod config;
pub mod control;
pub mod error;
pub mod http;
pub mod metrics;
pub mod precise;
pub mod proxy;
pub mod route;
pub mod router;
