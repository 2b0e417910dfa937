//! `cargo xtask`: the project's commands. One file per subcommand.
//!
//! - `cargo xtask setup`: install what builds and tests need (idempotent).
//! - `cargo xtask test`: setup, build, then every test of the workspace.
//! - `cargo xtask demo`: the router in front of a fleet of simulated engines.
//! - `cargo xtask bench`: benchmarks, side by side with baselines.

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
    /// Install what the build and the tests need (nightly rust-src, bpf-linker, nginx).
    Setup,
    /// Set up, build, and run every test of the workspace.
    Test(test::Args),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::Setup => setup::run(),
        Cmd::Test(args) => test::run(args),
    }
}
