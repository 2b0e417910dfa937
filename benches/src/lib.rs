//! Benchmark harness for prefix-router: the demo, the router-overhead bench
//! against direct and nginx, the routing-quality bench, and their reports.
//!
//! The `prefix-bench` binary drives it; `cargo xtask demo` and `cargo xtask
//! bench` build the release binaries and run it. The criterion
//! micro-benchmarks live in `benches/hot_path.rs`.
//!
//! Modules:
//! - [`fleet`]: child processes (engines, router, nginx) that always die with
//!   the harness, also on Ctrl-C;
//! - [`loadgen`]: the closed-loop HTTP/1.1 load generator (one thread, like
//!   `wrk -t1`), hdrhistogram latencies;
//! - [`cpu`]: CPU time of a process and its children from `/proc`;
//! - [`nginx`]: the baseline proxy's config;
//! - [`body`]: request bodies of a given size;
//! - [`overhead`], [`quality`], [`demo`]: the three measurements;
//! - [`engine_metrics`]: what the engines say of themselves on `/metrics`
//!   (their work over a run, their requests in flight over time), so no
//!   router's response headers are needed to tell the engines apart;
//! - [`cost`]: a conversation's cost to the engines (prompt tokens
//!   computed, busy seconds) and the saving against round-robin;
//! - [`llama`]: routing quality on real llama.cpp servers (real prefill on
//!   this CPU), several seeds, with its own report;
//! - [`scenarios`]: the quality bench's rows (named production-shaped
//!   scenarios, and the lock-step shapes of the first benches);
//! - [`apis`]: the same rows sent as chat completions, Anthropic Messages
//!   and OpenAI Responses (whole or chained), side by side;
//! - [`peers`]: sglang-router, vllm-router and smg in their own virtualenv,
//!   run inside a network namespace with only loopback;
//! - [`replicas`]: several router processes in front of one fleet, each
//!   request to one at random: the ports and `[replicas]` section of each,
//!   a replica killed and restarted mid-run, each one's stream's bytes;
//! - [`bandwidth`]: sharing replicas' streams at 1,000 requests/s on
//!   zero-cost engines;
//! - [`tenants`]: two tenants of one class, the small one's TTFT alone
//!   and beside a big one, split from the records by tenant;
//! - [`micro`]: criterion's figures read back from its output folder;
//! - [`report`], [`quality_report`], [`charts`]: Markdown, JSON, SVG, and
//!   the comparison with a previous run.
//!
//! Invariants: every child process is registered in [`fleet`] and killed on
//! drop, on panic and on SIGINT/SIGTERM; every loop is bounded in time; all
//! traffic goes to 127.0.0.1; the peer routers only ever run inside a
//! network namespace that has nothing but loopback.

pub mod apis;
pub mod bandwidth;
pub mod body;
pub mod charts;
pub mod cost;
pub mod cpu;
pub mod demo;
pub mod engine_metrics;
pub mod envoy;
pub mod fleet;
pub mod llama;
pub mod loadgen;
pub mod micro;
pub mod nginx;
pub mod overhead;
pub mod overhead_report;
pub mod peers;
pub mod pooled;
pub mod quality;
pub mod quality_report;
pub mod replicas;
pub mod report;
pub mod scenarios;
pub mod table;
pub mod tenants;
