//! The cache root shared by every clone on this machine:
//! `$PREFIX_ROUTER_CACHE_DIR`, else `$XDG_CACHE_HOME/prefix-router`, else
//! `~/.cache/prefix-router`. Set-up writes there and the tests read there,
//! so this one file is compiled into both (`tests/src/llama_proc.rs`
//! includes it by path).

use std::path::PathBuf;

/// The cache root.
pub fn root() -> PathBuf {
    if let Some(p) = std::env::var_os("PREFIX_ROUTER_CACHE_DIR") {
        return PathBuf::from(p);
    }
    if let Some(p) = std::env::var_os("XDG_CACHE_HOME").filter(|p| !p.is_empty()) {
        return PathBuf::from(p).join("prefix-router");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache/prefix-router")
}
