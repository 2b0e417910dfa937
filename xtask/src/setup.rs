//! `cargo xtask setup`: installs what the build and the tests need, when missing.

use std::process::Command;

use anyhow::{Context, bail};

pub fn run() -> anyhow::Result<()> {
    ensure_nightly_rust_src()
}

/// The eBPF crate is built with nightly's `-Z build-std=core`, which needs `rust-src`.
fn ensure_nightly_rust_src() -> anyhow::Result<()> {
    let status = Command::new("rustup")
        .args(["component", "add", "rust-src", "--toolchain", "nightly"])
        .status()
        .context("running rustup")?;
    if !status.success() {
        bail!("rustup could not add rust-src to the nightly toolchain");
    }
    Ok(())
}
