//! The simulated vLLM engine behind the `sim-engine` binary.
//!
//! Stages, one module each: [`tokenize`] (tokenizer and chat template),
//! [`block_hash`] (vLLM's chained block hashes), [`kv_cache`] (block pool,
//! prefix index, LRU), [`core`] (admission, continuous batching),
//! [`scheduler`] (steps in simulated time), [`api`] (OpenAI/SGLang request
//! parsing and response shapes), [`messages`] (Anthropic's Messages API),
//! [`responses`] (OpenAI's Responses API and its store), [`conversation`]
//! (the chat those APIs render through the template), [`http1`] (HTTP/1.1 framing), [`server`]
//! (listener, routing, faults), [`metrics`] (Prometheus text), [`faults`],
//! [`kv_events`] (vLLM's KV-cache event stream over ZMQ), [`output_text`]
//! (the generated pseudo-words), [`config`] (flags).
//!
//! The workload generator reuses [`tokenize`] and [`block_hash`] to compute
//! the hit-rate ceiling of a trace, so the two always agree.

pub mod api;
pub mod block_hash;
pub mod config;
pub mod conversation;
pub mod core;
pub mod faults;
pub mod http1;
pub mod kv_cache;
pub mod kv_events;
pub mod messages;
pub mod metrics;
pub mod output_text;
pub mod responses;
pub mod scheduler;
pub mod server;
pub mod tokenize;

pub use config::EngineArgs;
pub use server::serve;
