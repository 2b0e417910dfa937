//! What `demo` and `bench` share: the release build, the target folder, and
//! running `prefix-bench` (the harness in `benches/`) with Ctrl-C left to it.

use anyhow::{Context, bail};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

/// The workspace root (xtask's parent folder).
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask sits in the workspace")
        .to_path_buf()
}

/// `CARGO_TARGET_DIR`, or `<workspace>/target`.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|p| {
            if p.is_absolute() {
                p
            } else {
                workspace().join(p)
            }
        })
        .unwrap_or_else(|| workspace().join("target"))
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(workspace());
    c
}

fn run(mut cmd: Command, what: &str) -> anyhow::Result<()> {
    eprintln!("xtask: {what}");
    let status = cmd.status().with_context(|| format!("run {what}"))?;
    if !status.success() {
        bail!("{what} failed ({status})");
    }
    Ok(())
}

/// Builds the router, the simulated engine and the harness in release mode;
/// returns the folder holding them.
pub fn build_release() -> anyhow::Result<PathBuf> {
    let mut c = cargo();
    c.args([
        "build",
        "--release",
        "--bins",
        "-p",
        "router-user",
        "-p",
        "router-tests",
        "-p",
        "router-benches",
    ]);
    run(
        c,
        "cargo build --release (prefix-router, sim-engine, prefix-bench)",
    )?;
    Ok(target_dir().join("release"))
}

/// Runs criterion's micro-benchmarks (`benches/benches/hot_path.rs`);
/// returns criterion's output folder.
pub fn criterion(warm_up_s: f64, measure_s: f64) -> anyhow::Result<PathBuf> {
    let mut c = cargo();
    c.args([
        "bench",
        "-p",
        "router-benches",
        "--bench",
        "hot_path",
        "--",
        "--noplot",
        "--warm-up-time",
        &warm_up_s.to_string(),
        "--measurement-time",
        &measure_s.to_string(),
    ]);
    run(c, "cargo bench -p router-benches --bench hot_path")?;
    Ok(target_dir().join("criterion"))
}

/// Runs `prefix-bench ARGS` from `bin_dir` in the workspace root. Ctrl-C
/// reaches it (same process group) and it stops its own children; xtask
/// only waits for it.
pub fn prefix_bench(bin_dir: &Path, args: &[String]) -> anyhow::Result<()> {
    let ignore = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGINT, ignore.clone())?;
    signal_hook::flag::register(signal_hook::consts::SIGTERM, ignore)?;
    let mut c = Command::new(bin_dir.join("prefix-bench"));
    c.current_dir(workspace())
        .arg("--bin-dir")
        .arg(bin_dir)
        .args(args);
    let status = c.status().context("run prefix-bench")?;
    if !status.success() {
        bail!("prefix-bench failed ({status})");
    }
    Ok(())
}
