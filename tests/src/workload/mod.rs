//! The workload generator: scenario traffic against any OpenAI-compatible
//! server, with per-request records and a summary judged against the
//! trace's own hit-rate ceiling. The conversations go as chat completions,
//! Anthropic Messages or OpenAI Responses requests ([`Api`]); the records
//! are the same whichever API carried them.
//!
//! ```no_run
//! use testkit::workload::{RunConfig, Scenario, ScenarioKind, run_blocking};
//! let mut cfg = RunConfig::new("http://127.0.0.1:8000", Scenario::new(ScenarioKind::Chat));
//! cfg.users = 8;
//! cfg.requests = Some(200);
//! let (records, summary) = run_blocking(cfg).unwrap();
//! println!("{summary}");
//! assert!(summary.hit_rate <= summary.ceiling_hit_rate + 0.01);
//! # let _ = records;
//! ```
//!
//! Modules: [`scenario`] (what sessions send), [`synth`] (seeded text),
//! [`api`] (each request's body in each API), [`answer`] (each API's
//! answers and streams read into text, usage and id),
//! [`client`] (HTTP/1.1 keep-alive client, SSE, TTFT), [`ceiling`] (the
//! unbounded single-cache hit rate), [`record`] (records and summary),
//! [`runner`] (closed and open loops).

pub mod answer;
pub mod api;
pub mod ceiling;
pub mod client;
pub mod record;
pub mod runner;
pub mod scenario;
pub mod synth;

pub use api::Api;
pub use record::{Percentiles, Record, Summary};
pub use runner::{ReplicaGate, RunConfig, run, run_blocking};
pub use scenario::{Scenario, ScenarioKind};
