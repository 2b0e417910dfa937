//! Starting `prefix-router` processes from tests: free ports for the traffic
//! and admin listeners, an optional config file, and a wait until both answer.
//!
//! ```no_run
//! use testkit::engine_proc::SimEngine;
//! use testkit::router_proc::Router;
//! let e = SimEngine::spawn(&["--time-scale", "0"]);
//! let r = Router::spawn(&[e.url()], &[], "[limits]\nmax_body_bytes = 1024\n");
//! let backends = r.backends(); // GET /admin/backends on the admin listener
//! assert_eq!(backends[0]["healthy"], true);
//! ```

use crate::proc::{Spawned, free_port, wait_http_ready};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

/// How long a starting router may take to answer on both listeners.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// A running `prefix-router`, killed on drop (its config file removed).
pub struct Router {
    /// The traffic listener.
    pub addr: SocketAddr,
    /// The admin listener (`/metrics`, `/admin/*`, `/health`).
    pub admin: SocketAddr,
    pub child: Spawned,
    config: Option<PathBuf>,
}

impl Router {
    /// Starts `prefix-router` with `--backend` for each of `backends`
    /// (`http://host:port`), `--listen` and `--admin-listen` on free
    /// 127.0.0.1 ports, `--workers 2`, then `extra_args` (later flags win, so
    /// `--workers 1` there overrides). A non-empty `config_toml` is written to
    /// a temp file and passed as `--config` (flags override it). Waits until
    /// the admin `/health` answers 200 and the traffic port accepts.
    ///
    /// # Panics
    /// If it does not start, with its stderr in the message.
    pub fn spawn(backends: &[String], extra_args: &[&str], config_toml: &str) -> Router {
        Self::try_spawn(backends, extra_args, config_toml).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Like [`Router::spawn`], returning the failure (with the router's
    /// stderr) instead of panicking; ports are picked again up to 3 times if
    /// another process took one in between.
    pub fn try_spawn(
        backends: &[String],
        extra_args: &[&str],
        config_toml: &str,
    ) -> Result<Router, String> {
        let mut last = String::new();
        for _ in 0..3 {
            match Self::spawn_once(backends, extra_args, config_toml) {
                Ok(r) => return Ok(r),
                // Only a port taken in between is worth another try.
                Err(e) if e.contains("Address already in use") => last = e,
                Err(e) => return Err(e),
            }
        }
        Err(last)
    }

    fn spawn_once(
        backends: &[String],
        extra_args: &[&str],
        config_toml: &str,
    ) -> Result<Router, String> {
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        let mut cmd = Command::new(crate::bin_path("prefix-router"));
        cmd.args(["--listen", &addr.to_string()])
            .args(["--admin-listen", &admin.to_string()])
            .args(["--workers", "2"]);
        for b in backends {
            cmd.args(["--backend", b]);
        }
        let config = (!config_toml.is_empty()).then(|| {
            let path = std::env::temp_dir().join(format!(
                "testkit-router-{}-{}.toml",
                std::process::id(),
                addr.port()
            ));
            std::fs::write(&path, config_toml).expect("write router config");
            cmd.arg("--config").arg(&path);
            path
        });
        cmd.args(extra_args);
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "info");
        }
        let child = Spawned::spawn(cmd, "prefix-router").map_err(|e| e.to_string())?;
        let router = Router {
            addr,
            admin,
            child,
            config,
        };
        let mut router = router;
        let deadline = Instant::now() + START_TIMEOUT;
        let mut ready = false;
        // Short waits, so a router that exits (a bad config) fails at once.
        while Instant::now() < deadline && router.child.is_running() {
            if wait_http_ready(admin, "/health", Duration::from_millis(200)) {
                ready = wait_connectable(addr, deadline.saturating_duration_since(Instant::now()));
                break;
            }
        }
        if ready {
            return Ok(router);
        }
        let tail = router.child.stderr_tail(4096);
        drop(router);
        Err(format!("prefix-router did not start on {addr}:\n{tail}"))
    }

    /// `http://ADDR` of the traffic listener.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// `GET /admin/backends`: `body["backends"]`, one object per backend
    /// with `url`, `healthy`, `draining`, `in_flight`, `requests`, `errors`...
    ///
    /// # Panics
    /// If the admin listener does not answer 200 with JSON.
    pub fn backends(&self) -> Vec<serde_json::Value> {
        let r = crate::http::request(self.admin, "GET", "/admin/backends", &[], b"")
            .expect("GET /admin/backends");
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["backends"].as_array().cloned().unwrap_or_default()
    }

    /// The `/admin/backends` entry of the backend with this URL.
    pub fn backend(&self, url: &str) -> serde_json::Value {
        self.backends()
            .into_iter()
            .find(|b| b["url"] == url)
            .unwrap_or_else(|| panic!("no backend {url} in /admin/backends"))
    }

    /// Polls `/admin/backends` every 20 ms until `pred` holds for the
    /// backend `url` or `timeout` passes; returns whether it did.
    pub fn wait_backend(
        &self,
        url: &str,
        timeout: Duration,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if pred(&self.backend(url)) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits (up to 10 s) until every backend's models are discovered
    /// (`GET /v1/models` answered). Until then the model table changes
    /// under the requests (a backend whose models are unknown is only a
    /// fallback), so a prompt sent twice across its rebuild could be routed
    /// on two footings: tests that assert where a repeat goes wait first.
    ///
    /// # Panics
    /// If some backend's models are still unknown after 10 s.
    pub fn wait_models_known(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let backends = self.backends();
            let known =
                |b: &serde_json::Value| b["models"].as_array().is_some_and(|m| !m.is_empty());
            if backends.iter().all(known) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "models never discovered: {backends:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `GET /metrics` on the admin listener: the Prometheus text.
    ///
    /// # Panics
    /// If the admin listener does not answer 200.
    pub fn metrics(&self) -> String {
        let r =
            crate::http::request(self.admin, "GET", "/metrics", &[], b"").expect("GET /metrics");
        assert_eq!(r.status, 200, "{}", r.text());
        r.text()
    }

    /// The router's resident memory in KiB (`VmRSS` of /proc/PID/status).
    pub fn rss_kib(&self) -> u64 {
        rss_kib(self.child.pid())
    }

    /// The most resident memory the router has held so far, in KiB.
    pub fn peak_rss_kib(&self) -> u64 {
        peak_rss_kib(self.child.pid())
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        self.child.stop();
        if let Some(p) = self.config.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Resident memory of process `pid` in KiB, 0 if it cannot be read.
pub fn rss_kib(pid: u32) -> u64 {
    status_kib(pid, "VmRSS:")
}

/// The most resident memory process `pid` has held so far, in KiB
/// (`VmHWM`), 0 if it cannot be read.
pub fn peak_rss_kib(pid: u32) -> u64 {
    status_kib(pid, "VmHWM:")
}

fn status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

/// Waits until a TCP connect to `addr` succeeds, up to `timeout`.
pub fn wait_connectable(addr: SocketAddr, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// Writes `raw` to a new connection to `addr` and reads until the peer
/// closes or `timeout` passes; returns everything read. For requests the
/// ordinary client cannot send (smuggling shapes, malformed framing).
pub fn raw_exchange(addr: SocketAddr, raw: &[u8], timeout: Duration) -> std::io::Result<Vec<u8>> {
    let mut s = TcpStream::connect_timeout(&addr, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.write_all(raw)?;
    let mut out = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) if out.is_empty() => return Err(e),
            Err(_) => break,
        }
    }
    Ok(out)
}

/// `POST /admin/explain?endpoint=ENDPOINT` with `body` on the admin
/// listener `admin`: how the router would route it (asserts a 200).
pub fn explain(admin: SocketAddr, endpoint: &str, body: &serde_json::Value) -> serde_json::Value {
    let r = crate::http::post_json(admin, &format!("/admin/explain?endpoint={endpoint}"), body)
        .expect("explain");
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

/// Which index (`precise` or `approximate`) routing read for `url` in an
/// explain answer; `?` when `url` is not in it.
pub fn matched_on<'a>(ex: &'a serde_json::Value, url: &str) -> &'a str {
    ex["matched_on"]
        .as_array()
        .and_then(|a| a.iter().find(|m| m["url"] == url))
        .and_then(|m| m["index"].as_str())
        .unwrap_or("?")
}
