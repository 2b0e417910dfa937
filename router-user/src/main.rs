//! `prefix-router`: the binary. Flags override the config file.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use prefix_router::config::{BackendConfig, Config, ms};
use prefix_router::route::select::Policy;
use prefix_router::router::Router;
use prefix_router::{
    control::health, control::loadview, control::logging, control::reload, proxy::listener,
};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use tracing::{error, info};

/// Prefix-cache-aware router for OpenAI-compatible inference servers.
#[derive(Parser, Clone, Debug)]
#[command(name = "prefix-router", version)]
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
        if let Some(l) = &self.log_level {
            cfg.log.level = l.clone();
        }
        cfg.log.json |= self.log_json;
        cfg.debug_headers |= self.debug_headers;
        if let Some(i) = self.health_interval_ms {
            cfg.health.interval_ms = i;
        }
        cfg.validate()?;
        Ok(cfg)
    }
}

/// Raises the soft open-files limit to the hard one: every client connection
/// and every backend connection is a descriptor, and the usual soft limit
/// (1024) is far below `limits.max_client_connections`.
fn raise_nofile_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to an rlimit we own.
    let raised = unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max && {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim) == 0
        }
    };
    if raised {
        info!(nofile = lim.rlim_cur, "raised the open-files limit");
    }
}

fn main() {
    if let Err(e) = run() {
        eprintln!("prefix-router: error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let cfg = cli.config()?;
    logging::init(&cfg.log);
    raise_nofile_limit();
    let router = Router::new(cfg.clone())?;
    // Load XDP before the workers start: in `required` mode a failure stops
    // the router before it takes traffic.
    if let Some(load) =
        loadview::start(&router).context("eBPF load signal (ebpf.mode = \"required\")")?
    {
        loadview::spawn(router.clone(), load)?;
    }
    let _workers = listener::start(router.clone())?;
    health::spawn_checker(router.clone());
    if let Some(addr) = cfg.admin.listen {
        let (r, c) = (router.clone(), cli.clone());
        prefix_router::control::admin::start(
            router.clone(),
            addr,
            Box::new(move || reload::apply(&r, c.config()?)),
        )?;
    }
    info!(
        listen = %cfg.listen,
        workers = cfg.worker_count(),
        policy = cfg.policy.name(),
        backends = cfg.backends.len(),
        "prefix-router is serving"
    );
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP])
        .context("installing signal handlers")?;
    for sig in signals.forever() {
        match sig {
            SIGHUP => match cli.config().and_then(|c| reload::apply(&router, c)) {
                Ok(()) => info!("configuration reloaded"),
                Err(e) => {
                    error!(error = %format!("{e:#}"), "reload failed; keeping the running configuration")
                }
            },
            _ => {
                let grace = ms(router.config.load().timeouts.shutdown_grace_ms);
                info!(
                    grace_ms = grace.as_millis() as u64,
                    "shutting down: no new requests, finishing those in flight"
                );
                router.begin_shutdown();
                let deadline = Instant::now() + grace;
                while router.in_flight() > 0 && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(20));
                }
                let left = router.in_flight();
                if left > 0 {
                    error!(left, "grace period over; exiting with requests in flight");
                }
                info!(connections = router.client_conns.load(Relaxed), "bye");
                std::process::exit(0);
            }
        }
    }
    Ok(())
}
