//! `prefix-router`: the binary. Flags override the config file.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use prefix_router::config::{BackendConfig, Config};
use prefix_router::policy::select::Policy;

/// Prefix-cache-aware router for OpenAI-compatible inference servers.
#[derive(Parser, Clone, Debug)]
#[command(name = "prefix-router", version, args_override_self = true)]
struct Cli {
    /// Traffic listener address [default: 0.0.0.0:8080].
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Backend URL (http://host:port); repeat for each backend. Replaces the config's list.
    #[arg(long = "backend", value_name = "URL")]
    backends: Vec<String>,
    /// Routing policy [default: prefix].
    #[arg(long, value_enum)]
    policy: Option<Policy>,
    /// TOML config file (see prefix-router.example.toml).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Worker threads (0: one per core).
    #[arg(long)]
    workers: Option<usize>,
    /// Admin listener (metrics, /admin/*); "off" disables it.
    #[arg(long, value_name = "ADDR|off")]
    admin_listen: Option<String>,
    /// Serve Envoy's ext_proc as a Gateway API endpoint picker on ADDR (gRPC).
    #[arg(long, value_name = "ADDR")]
    epp_listen: Option<SocketAddr>,
    /// Log level or tracing filter (RUST_LOG wins).
    #[arg(long)]
    log_level: Option<String>,
    /// Log one JSON object per line.
    #[arg(long)]
    log_json: bool,
    /// Add x-prefix-router-* headers naming the chosen backend to responses.
    #[arg(long)]
    debug_headers: bool,
    /// Health probe interval in ms (0 disables active checks).
    #[arg(long)]
    health_interval_ms: Option<u64>,
}

impl Cli {
    fn config(&self) -> anyhow::Result<Config> {
        let mut cfg = match &self.config {
            Some(path) => Config::from_file(path)?,
            None => Config::default(),
        };
        if let Some(l) = self.listen {
            cfg.listen = l;
        }
        if !self.backends.is_empty() {
            cfg.backends = self
                .backends
                .iter()
                .map(|u| BackendConfig::Url(u.clone()))
                .collect();
        }
        if let Some(p) = self.policy {
            cfg.policy = p;
        }
        if let Some(w) = self.workers {
            cfg.workers = w;
        }
        if let Some(a) = &self.admin_listen {
            cfg.admin.listen = match a.as_str() {
                "off" => None,
                a => Some(a.parse().with_context(|| format!("--admin-listen {a:?}"))?),
            };
        }
        if let Some(a) = self.epp_listen {
            cfg.epp.listen = Some(a);
        }
        if let Some(l) = &self.log_level {
            cfg.log.level = l.clone();
        }
        cfg.log.json |= self.log_json;
        cfg.debug_headers |= self.debug_headers;
        if let Some(i) = self.health_interval_ms {
            cfg.health.interval_ms = i;
        }
        cfg.validate()?;
        cfg.load_files()?;
        Ok(cfg)
    }
}

fn main() {
    let cli = Cli::parse();
    let result = cli
        .config()
        .and_then(|cfg| prefix_router::app::run(cfg, move || cli.config()));
    if let Err(e) = result {
        eprintln!("prefix-router: error: {e:#}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A flag given twice takes its last value (a wrapper script can add to
    /// a command line), and `--backend` still adds one backend per use.
    #[test]
    fn the_last_of_a_repeated_flag_wins_and_backends_add_up() {
        let cli = Cli::try_parse_from([
            "prefix-router",
            "--workers",
            "2",
            "--backend",
            "http://127.0.0.1:1",
            "--workers",
            "1",
            "--backend",
            "http://127.0.0.1:2",
        ])
        .expect("parses");
        assert_eq!(cli.workers, Some(1));
        assert_eq!(cli.backends, ["http://127.0.0.1:1", "http://127.0.0.1:2"]);
    }
}
