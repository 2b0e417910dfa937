//! nginx as the baseline: Debian's package, set up as a plain keep-alive
//! round-robin reverse proxy, the floor a mature proxy reaches on this machine.
//!
//! Settings that matter for a fair comparison, each as an LLM deployment
//! would set it: as many workers as prefix-router has (one per core),
//! upstream keep-alive, `proxy_buffering off` (streamed tokens pass at once),
//! request bodies up to 1 MB kept in memory (the 400 KB prompt never touches
//! the disk), no access log.

use crate::fleet::Child;
use anyhow::{Context, bail};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Idle upstream connections each nginx worker keeps (covers concurrency 256).
const UPSTREAM_KEEPALIVE: usize = 512;

/// Whether the bench uses nginx.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum NginxMode {
    /// Use it when installed; say why not otherwise.
    Auto,
    /// Fail when it is missing (CI).
    Require,
    /// Do not use it.
    Off,
}

/// The nginx binary, if installed.
pub fn binary() -> Option<PathBuf> {
    ["/usr/sbin/nginx", "/usr/bin/nginx", "/usr/local/sbin/nginx"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
}

/// The config of a keep-alive round-robin proxy on `listen` to `upstreams`;
/// with `tls` (certificate and key files), terminating TLS there.
pub fn config(
    dir: &Path,
    listen: SocketAddr,
    upstreams: &[SocketAddr],
    workers: usize,
    tls: Option<(&Path, &Path)>,
) -> String {
    // TLS 1.2 and 1.3 as the router offers them; the session cache and
    // tickets as a site would keep them (the bench's client resumes no
    // session: each handshake is whole).
    let ssl = match tls {
        Some((cert, key)) => format!(
            " ssl;\n    ssl_certificate {};\n    ssl_certificate_key {};\n    ssl_protocols TLSv1.2 TLSv1.3;\n    ssl_session_cache shared:SSL:10m",
            cert.display(),
            key.display()
        ),
        None => String::new(),
    };
    let d = dir.display();
    let servers: String = upstreams
        .iter()
        .map(|u| format!("    server {u};\n"))
        .collect();
    format!(
        "user root;
worker_processes {workers};
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 8192; multi_accept on; }}
http {{
  access_log off;
  client_body_temp_path {d}/body;
  proxy_temp_path {d}/proxy;
  fastcgi_temp_path {d}/fastcgi;
  uwsgi_temp_path {d}/uwsgi;
  scgi_temp_path {d}/scgi;
  upstream engines {{
{servers}    keepalive {UPSTREAM_KEEPALIVE};
    keepalive_requests 1000000;
  }}
  server {{
    listen {listen} reuseport backlog=4096{ssl};
    keepalive_requests 1000000;
    keepalive_timeout 120s;
    client_max_body_size 64m;
    client_body_buffer_size 1m;
    location / {{
      proxy_pass http://engines;
      proxy_http_version 1.1;
      proxy_set_header Connection \"\";
      proxy_buffering off;
      proxy_read_timeout 300s;
    }}
  }}
}}
"
    )
}

/// A running nginx (master in the foreground, workers its children).
pub struct Nginx {
    pub addr: SocketAddr,
    pub child: Child,
    _dir: PathBuf,
}

impl Nginx {
    /// Starts nginx in `dir` with `workers` worker processes.
    pub fn start(dir: &Path, upstreams: &[SocketAddr], workers: usize) -> anyhow::Result<Nginx> {
        Self::start_with(dir, upstreams, workers, None)
    }

    /// [`Nginx::start`] terminating TLS with `cert` and `key` (PEM files).
    pub fn start_tls(
        dir: &Path,
        upstreams: &[SocketAddr],
        workers: usize,
        cert: &Path,
        key: &Path,
    ) -> anyhow::Result<Nginx> {
        Self::start_with(dir, upstreams, workers, Some((cert, key)))
    }

    fn start_with(
        dir: &Path,
        upstreams: &[SocketAddr],
        workers: usize,
        tls: Option<(&Path, &Path)>,
    ) -> anyhow::Result<Nginx> {
        let Some(bin) = binary() else {
            bail!("nginx is not installed (run `cargo xtask setup`)");
        };
        std::fs::create_dir_all(dir)?;
        // nginx resolves relative paths against its prefix: give it absolute ones.
        let dir = &dir.canonicalize()?;
        let addr: SocketAddr = format!("127.0.0.1:{}", testkit::proc::free_port()).parse()?;
        let conf = dir.join("nginx.conf");
        std::fs::write(&conf, config(dir, addr, upstreams, workers, tls))
            .with_context(|| format!("write {}", conf.display()))?;
        let mut cmd = Command::new(bin);
        cmd.arg("-p")
            .arg(dir)
            .arg("-c")
            .arg(&conf)
            .args(["-g", "daemon off; master_process on;"]);
        let mut child = Child::spawn(cmd, "nginx")?;
        child.wait_port(addr)?;
        Ok(Nginx {
            addr,
            child,
            _dir: dir.to_path_buf(),
        })
    }
}
