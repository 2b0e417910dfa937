//! The official Anthropic and OpenAI Python SDKs, for the tests that call
//! `/v1/messages` and `/v1/responses` as a user's program does
//! (`tests/sdk/*.py`, run by `testkit::sdk`). One virtualenv per machine in
//! the cache folder `llama.rs` uses (outside the work tree, so fresh clones
//! and CI runs reuse it), with the pinned versions from PyPI:
//!
//! ```text
//! <cache>/sdk-venv.lock                      flock: one install at a time
//! <cache>/sdk-venv/                          the virtualenv
//! <cache>/sdk-venv/.prefix-router-ready      the pins it holds
//! ```
//!
//! `tests/src/sdk.rs` finds it there (its constants must match these; a
//! test there checks it).

use std::fs::File;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, bail};

/// The SDKs, pinned so every machine runs the same clients.
pub const ANTHROPIC: &str = "anthropic==2.10.0";
pub const OPENAI: &str = "openai==3.51.0";
/// The virtualenv's folder in the cache root.
pub const VENV_DIR: &str = "sdk-venv";

/// `<cache>/sdk-venv`.
pub fn venv() -> PathBuf {
    crate::llama::cache_root().join(VENV_DIR)
}

/// What the ready marker holds once the pins are installed.
fn pins() -> String {
    format!("{ANTHROPIC} {OPENAI}")
}

fn ready() -> bool {
    let v = venv();
    v.join("bin/python").is_file()
        && std::fs::read_to_string(v.join(".prefix-router-ready")).is_ok_and(|s| s == pins())
}

/// Makes the virtualenv when it is missing or holds other pins; says
/// either way where it is.
pub fn ensure() -> anyhow::Result<()> {
    let venv = venv();
    if ready() {
        eprintln!(
            "setup: SDK clients ({}) cached in {}",
            pins(),
            venv.display()
        );
        return Ok(());
    }
    let root = crate::llama::cache_root();
    std::fs::create_dir_all(&root).with_context(|| format!("create {}", root.display()))?;
    let lock_path = root.join(format!("{VENV_DIR}.lock"));
    let lock = File::create(&lock_path).with_context(|| format!("{}", lock_path.display()))?;
    lock.lock().context("lock the SDK clients' virtualenv")?;
    if ready() {
        eprintln!(
            "setup: SDK clients ({}) cached in {} (by another run)",
            pins(),
            venv.display()
        );
        return Ok(());
    }
    let started = Instant::now();
    eprintln!(
        "setup: SDK clients ({}) into {}, cached there for later runs",
        pins(),
        venv.display()
    );
    let _ = std::fs::remove_dir_all(&venv);
    run(
        Command::new("python3").arg("-m").arg("venv").arg(&venv),
        "python3 -m venv (Debian: apt-get install python3-venv)",
    )?;
    run(
        Command::new(venv.join("bin/python"))
            .args(["-m", "pip", "install", "-q", "--only-binary", ":all:"])
            .args([ANTHROPIC, OPENAI]),
        "pip install anthropic openai",
    )?;
    std::fs::write(venv.join(".prefix-router-ready"), pins())?;
    eprintln!(
        "setup: SDK clients installed in {:.0}s",
        started.elapsed().as_secs_f64()
    );
    drop(lock);
    Ok(())
}

/// Runs a set-up step; its failure names it.
pub(crate) fn run(cmd: &mut Command, what: &str) -> anyhow::Result<()> {
    let status = cmd.status().with_context(|| what.to_string())?;
    if !status.success() {
        bail!("{what} failed: {status}");
    }
    Ok(())
}
