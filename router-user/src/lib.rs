//! prefix-router: routes OpenAI-compatible requests to the inference server
//! predicted to answer first: the one holding the prompt's prefix in its KV
//! cache, weighed against queued work and load, under a safety cap. See
//! ARCHITECTURE.md for the map of this crate.

pub mod admin;
pub mod backend;
pub mod budget;
pub mod config;
pub mod ebpf;
pub mod error;
pub mod extract;
pub mod feedback;
pub mod forward;
pub mod hash;
pub mod health;
pub mod http;
pub mod index;
pub mod io;
pub mod listener;
pub mod loadview;
pub mod logging;
pub mod metrics;
pub mod pool;
pub mod proxy;
pub mod reload;
pub mod router;
pub mod select;
