//! `cargo xtask test`: the README's test command, and what `.ci/run` calls.
//! Set-up (with the llama.cpp build the `engine_llamacpp` tests need: about
//! 12 minutes once per machine, cached after; under `CI=true` a failed build
//! fails here), `cargo fmt --check` and `cargo clippy --all-targets -D warnings`,
//! a build of every binary (the end-to-end tests start them as real
//! processes), the fuzz targets for a bounded time, then every test; it ends
//! with one line counting what passed and failed.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use anyhow::{Context, bail};

/// Seconds each fuzz target runs in the test command.
const FUZZ_SECONDS: u32 = 20;

#[derive(clap::Args)]
pub struct Args {
    /// Skip the fuzz targets (they need a sanitizer build: minutes when cold).
    #[arg(long)]
    no_fuzz: bool,
    /// Extra arguments passed to `cargo test` (after `--workspace`).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    rest: Vec<String>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    crate::setup::run()?;
    // Unformatted code or a clippy warning fails the test command.
    cargo(&["fmt", "--all", "--check"])?;
    cargo(&[
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ])?;
    cargo(&["build", "--workspace", "--bins"])?;
    if !args.no_fuzz {
        let secs = FUZZ_SECONDS.to_string();
        run_cmd(
            Command::new("bash").args(["router-user/fuzz/run.sh", &secs]),
            "fuzzing",
        )?;
    }
    // Every test binary runs even after one fails: the count says all.
    let mut test_args = vec!["test", "--workspace", "--no-fail-fast"];
    test_args.extend(args.rest.iter().map(String::as_str));
    let (passed, failed, ok) = cargo_test(&test_args)?;
    println!("tests: {passed} passed, {failed} failed");
    if !ok {
        bail!("cargo test failed");
    }
    Ok(())
}

/// Runs `cargo test`, echoing its output, and sums its `test result:` lines.
fn cargo_test(args: &[&str]) -> anyhow::Result<(u64, u64, bool)> {
    eprintln!("+ cargo {}", args.join(" "));
    let mut child = cargo_cmd()
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .context("running cargo test")?;
    let (mut passed, mut failed) = (0, 0);
    let out = child.stdout.take().context("cargo test stdout")?;
    for line in BufReader::new(out).lines() {
        let line = line?;
        println!("{line}");
        if let Some(rest) = line.strip_prefix("test result: ") {
            passed += count(rest, " passed");
            failed += count(rest, " failed");
        }
    }
    let status = child.wait()?;
    Ok((passed, failed, status.success()))
}

/// The number before `what` in `ok. 12 passed; 0 failed; ...`.
fn count(line: &str, what: &str) -> u64 {
    line.split(';')
        .find_map(|part| {
            part.trim()
                .trim_start_matches("ok. ")
                .trim_start_matches("FAILED. ")
                .strip_suffix(what.trim_start())
                .map(str::trim)
        })
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

fn cargo_bin() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

/// A `cargo` command; under `CI` without incremental state, which a clean
/// clone never reuses and which costs about 2 GB of disk on a cold build.
fn cargo_cmd() -> Command {
    let mut cmd = Command::new(cargo_bin());
    if std::env::var_os("CI").is_some() {
        cmd.env("CARGO_INCREMENTAL", "0");
    }
    cmd
}

pub fn cargo(args: &[&str]) -> anyhow::Result<()> {
    run_cmd(cargo_cmd().args(args), &format!("cargo {}", args.join(" ")))
}

fn run_cmd(cmd: &mut Command, what: &str) -> anyhow::Result<()> {
    eprintln!("+ {what}");
    let status = cmd.status().with_context(|| format!("starting {what}"))?;
    if !status.success() {
        bail!("{what} failed: {status}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::count;

    #[test]
    fn counts_cargo_test_result_lines() {
        let l = "ok. 12 passed; 3 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.1s";
        assert_eq!(count(l, " passed"), 12);
        assert_eq!(count(l, " failed"), 3);
        assert_eq!(count("FAILED. 2 passed; 1 failed; 0 ignored", " failed"), 1);
    }
}
