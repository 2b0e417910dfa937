//! `cargo xtask demo`: builds what it needs, then runs the demo (a fleet of
//! simulated engines behind prefix-router, the chat workload replayed through
//! prefix, round-robin and least-request). About two minutes by default;
//! `--long` for a longer, steadier run. The logic is in `benches/src/demo.rs`.
//! The peer routers (sglang-router, vllm-router, smg) are shown beside the
//! policies when they are installed in `target/peers-venv` (by `cargo xtask
//! bench`, or `--peers` here); a fresh clone runs without them.

use crate::harness;

#[derive(clap::Args)]
pub struct Args {
    /// Five minutes per policy instead of 32 s.
    #[arg(long)]
    long: bool,
    /// Seconds of traffic per policy (overrides --long).
    #[arg(long)]
    duration: Option<f64>,
    /// Engines in the fleet.
    #[arg(long, default_value_t = 4)]
    engines: usize,
    /// Skip `cargo xtask setup`.
    #[arg(long)]
    no_setup: bool,
    /// Install the peer routers when missing (pip, from PyPI) and run them
    /// beside the policies (root: they run in a network namespace).
    #[arg(long)]
    peers: bool,
    /// More `prefix-bench demo` flags (see `prefix-bench demo --help`).
    #[arg(last = true)]
    rest: Vec<String>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if !a.no_setup {
        crate::setup::run()?;
    }
    let bins = harness::build_release()?;
    let duration = a.duration.unwrap_or(if a.long { 300.0 } else { 32.0 });
    let mut args = vec![
        "demo".to_string(),
        "--engines".into(),
        a.engines.to_string(),
        "--duration".into(),
        duration.to_string(),
    ];
    if a.peers {
        args.push("--peers=require".into());
    }
    args.extend(a.rest);
    harness::prefix_bench(&bins, &args)
}
