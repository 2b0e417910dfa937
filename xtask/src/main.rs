//! `cargo xtask`: the project's commands. One file per subcommand.
//!
//! - `cargo xtask setup`: install what builds and tests need (idempotent).
//! - `cargo xtask test`: setup, build, then every test of the workspace
//!   (`--fast`: the unit, property and layout tests alone).
//! - `cargo xtask demo`: the router in front of a fleet of simulated engines
//!   (`--engine llama.cpp`: real llama.cpp servers).
//! - `cargo xtask bench`: benchmarks, side by side with baselines.

mod bench;
mod cache;
mod cache_root;
mod demo;
mod envoy;
mod harness;
mod llama;
mod sdk;
mod setup;
mod test;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "prefix-router project commands")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what the build and the tests need (nightly rust-src, bpf-linker,
    /// cargo-nextest, nginx, llama-server and its model).
    Setup,
    /// Set up, build, and run every test of the workspace (`--fast`: unit,
    /// property and layout tests only).
    Test(test::Args),
    /// Build, start a fleet of simulated engines behind prefix-router, and
    /// compare routing policies on a chat workload (report with charts).
    Demo(demo::Args),
    /// Micro-benchmarks, router overhead against direct and nginx, routing
    /// quality; results and a comparison with the previous run in results/.
    Bench(bench::Args),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::Setup => setup::run(),
        Cmd::Test(args) => test::run(args),
        Cmd::Demo(args) => demo::run(args),
        Cmd::Bench(args) => bench::run(args),
    }
}
