//! `cargo xtask test`: the README's test command, and what `.ci/run` calls.

use std::process::Command;

use anyhow::{Context, bail};

#[derive(clap::Args)]
pub struct Args {
    /// Extra arguments passed to `cargo test` (after `--workspace`).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    rest: Vec<String>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    crate::setup::run()?;
    // The end-to-end tests start the binaries as real processes; build them first.
    cargo(&["build", "--workspace", "--bins"])?;
    let mut test_args = vec!["test", "--workspace"];
    test_args.extend(args.rest.iter().map(String::as_str));
    cargo(&test_args)
}

pub fn cargo(args: &[&str]) -> anyhow::Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!("+ cargo {}", args.join(" "));
    let status = Command::new(&cargo)
        .args(args)
        .status()
        .with_context(|| format!("running {cargo}"))?;
    if !status.success() {
        bail!("cargo {} failed: {status}", args.join(" "));
    }
    Ok(())
}
