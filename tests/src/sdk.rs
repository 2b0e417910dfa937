//! The official Anthropic and OpenAI Python SDKs as a user's program runs
//! them: `tests/sdk/*_calls.py` make every kind of Messages and Responses
//! call against a base URL (a sim-engine, a router, anything serving the
//! APIs) and print one JSON line per call; `tests/sdk/calls.py` holds what
//! they share.
//!
//! `cargo xtask setup` installs the pinned SDKs into a virtualenv in the
//! cache folder (`xtask/src/sdk.rs`); this module finds it there.
//!
//! ```no_run
//! use testkit::sdk::{self, Script};
//! let Some(py) = sdk::require("my_test") else { return }; // skips, or fails under CI
//! let run = sdk::run(&py, Script::Anthropic, "http://127.0.0.1:8000", "sim-llama-8b", &[]);
//! run.assert_success();
//! assert_eq!(run.call("messages.create")["stop_reason"], "max_tokens");
//! ```

use serde_json::Value;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Must match `xtask/src/sdk.rs` (checked by a test below).
pub const ANTHROPIC: &str = "anthropic==2.10.0";
/// Must match `xtask/src/sdk.rs`.
pub const OPENAI: &str = "openai==3.51.0";
/// Must match `xtask/src/sdk.rs`.
pub const VENV_DIR: &str = "sdk-venv";
/// How long one script may run: about twenty calls, each well under a
/// second against a sim-engine.
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(120);

/// A script of `tests/sdk/`.
#[derive(Clone, Copy, Debug)]
pub enum Script {
    /// `anthropic_calls.py`: Messages create, both streams, a tool round
    /// trip, a multi-turn chat, an unknown model.
    Anthropic,
    /// `openai_responses_calls.py`: Responses create, both streams, a
    /// `previous_response_id` chain, tools, retrieve, cancel, input items,
    /// unknown ids.
    OpenAiResponses,
    /// `openai_tls_calls.py`: chat completions (plain and streamed) and
    /// the model list over HTTPS with a given CA, an API key, optionally a
    /// client certificate, and a wrong key that must get 401.
    OpenAiTls,
}

impl Script {
    /// The script's path in the work tree.
    pub fn path(self) -> PathBuf {
        let name = match self {
            Script::Anthropic => "anthropic_calls.py",
            Script::OpenAiResponses => "openai_responses_calls.py",
            Script::OpenAiTls => "openai_tls_calls.py",
        };
        Path::new(env!("CARGO_MANIFEST_DIR")).join("sdk").join(name)
    }
}

/// `<cache>/sdk-venv`.
pub fn venv() -> PathBuf {
    crate::llama_proc::cache_root().join(VENV_DIR)
}

/// The virtualenv's Python, or why it cannot be used.
pub fn python() -> Result<PathBuf, String> {
    let venv = venv();
    let py = venv.join("bin/python");
    let want = format!("{ANTHROPIC} {OPENAI}");
    let have = std::fs::read_to_string(venv.join(".prefix-router-ready")).ok();
    if !py.is_file() || have.as_deref() != Some(want.as_str()) {
        return Err(format!(
            "the SDK clients' virtualenv {} is missing or holds other versions ({}): \
             run `cargo xtask setup` (it installs {want} from PyPI)",
            venv.display(),
            have.as_deref().unwrap_or("none")
        ));
    }
    Ok(py)
}

/// The Python, or `None` after printing why the caller skips. Under
/// `CI=true` a missing virtualenv is a failure, not a skip.
///
/// # Panics
/// Under `CI=true` when the virtualenv is missing.
pub fn require(test: &str) -> Option<PathBuf> {
    match python() {
        Ok(p) => Some(p),
        Err(why) if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("{test}: no SDK clients under CI=true: {why}")
        }
        Err(why) => {
            eprintln!("{test}: skipped: {why}");
            None
        }
    }
}

/// What one script run printed.
#[derive(Debug)]
pub struct SdkRun {
    pub script: Script,
    /// One JSON object per call, in order: `call`, `ok`, then what came back.
    pub calls: Vec<Value>,
    pub status: ExitStatus,
    pub stderr: String,
}

impl SdkRun {
    /// The line of call `name`.
    ///
    /// # Panics
    /// If the script printed none, with its output in the message.
    pub fn call(&self, name: &str) -> &Value {
        self.calls
            .iter()
            .find(|c| c["call"] == name)
            .unwrap_or_else(|| panic!("{:?} printed no `{name}` line\n{self}", self.script))
    }

    /// Every call succeeded and the script exited 0.
    ///
    /// # Panics
    /// Otherwise, with its output in the message.
    pub fn assert_success(&self) {
        let failed: Vec<&Value> = self.calls.iter().filter(|c| c["ok"] != true).collect();
        assert!(
            self.status.success() && failed.is_empty() && !self.calls.is_empty(),
            "{:?} failed ({}): {failed:?}\n{self}",
            self.script,
            self.status
        );
    }
}

impl std::fmt::Display for SdkRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for c in &self.calls {
            writeln!(f, "{c}")?;
        }
        let tail = self
            .stderr
            .char_indices()
            .rev()
            .nth(4000)
            .map_or(&*self.stderr, |(i, _)| &self.stderr[i..]);
        write!(f, "stderr:\n{tail}")
    }
}

/// Runs `script` with `python` against `base_url` (`http://HOST:PORT`, no
/// `/v1`), naming `model`, with `extra` arguments; returns what it printed.
///
/// # Panics
/// If the script cannot start, prints a line that is not JSON, or runs
/// past its time limit (it is killed).
pub fn run(python: &Path, script: Script, base_url: &str, model: &str, extra: &[&str]) -> SdkRun {
    let mut child = Command::new(python)
        .arg(script.path())
        .args(["--base-url", base_url, "--model", model])
        .args(extra)
        .env("PYTHONUNBUFFERED", "1")
        // The scripts import `calls.py` beside them: no `__pycache__` in the work tree.
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
    let reader = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = reader(Box::new(child.stdout.take().expect("piped stdout")));
    let err = reader(Box::new(child.stderr.take().expect("piped stderr")));
    let deadline = Instant::now() + SCRIPT_TIMEOUT;
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait for the script") {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{script:?} ran past {SCRIPT_TIMEOUT:?}; stdout:\n{}\nstderr:\n{}",
                out.join().unwrap_or_default(),
                err.join().unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    let calls = stdout
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            serde_json::from_str(l).unwrap_or_else(|e| {
                panic!("{script:?} printed a line that is not JSON ({e}): {l}\nstderr:\n{stderr}")
            })
        })
        .collect();
    SdkRun {
        script,
        calls,
        status,
        stderr,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pins_match_xtask() {
        let xtask = include_str!("../../xtask/src/sdk.rs");
        for (name, value) in [
            ("ANTHROPIC", ANTHROPIC),
            ("OPENAI", OPENAI),
            ("VENV_DIR", VENV_DIR),
        ] {
            assert!(
                xtask.contains(&format!("pub const {name}: &str = \"{value}\";")),
                "xtask/src/sdk.rs has another {name}"
            );
        }
    }

    #[test]
    fn the_scripts_are_in_the_work_tree() {
        for s in [
            Script::Anthropic,
            Script::OpenAiResponses,
            Script::OpenAiTls,
        ] {
            assert!(s.path().is_file(), "{}", s.path().display());
        }
    }
}
