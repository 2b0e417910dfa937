//! The official Anthropic and OpenAI Python SDKs, for the tests that call
//! `/v1/messages` and `/v1/responses` as a user's program does
//! (`tests/sdk/*.py`, run by `testkit::sdk`). One virtualenv per machine in
//! the cache folder of `cache.rs` (outside the work tree, so fresh clones
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

use std::path::PathBuf;

use crate::cache::Venv;

/// The SDKs, pinned so every machine runs the same clients.
pub const ANTHROPIC: &str = "anthropic==2.10.0";
pub const OPENAI: &str = "openai==3.51.0";
/// The virtualenv's folder in the cache root.
pub const VENV_DIR: &str = "sdk-venv";

/// `<cache>/sdk-venv`.
pub fn venv() -> PathBuf {
    crate::cache::root().join(VENV_DIR)
}

/// Makes the virtualenv when it is missing or holds other pins; says
/// either way where it is.
pub fn ensure() -> anyhow::Result<()> {
    Venv {
        path: venv(),
        pins: &[ANTHROPIC, OPENAI],
        what: "SDK clients",
        usable: |_| true,
    }
    .ensure()
    .map(drop)
}
