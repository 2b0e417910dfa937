//! Start-up and the process's life: logging, the XDP load signal, the
//! workers, health probes, the admin listener, then signals (SIGHUP
//! reloads, SIGTERM and SIGINT drain and exit).

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use anyhow::Context;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use tracing::{error, info};

use crate::config::{Config, ms};
use crate::control::membership::Membership;
use crate::control::{admin, discovery, health, loadview, logging, reload, replicas};
use crate::epp;
use crate::proxy::listener;
use crate::shared::Router;

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

/// Runs the router with `cfg` until SIGTERM or SIGINT; `reread` gives the
/// configuration again on SIGHUP and `POST /admin/reload`.
pub fn run(
    cfg: Config,
    reread: impl Fn() -> anyhow::Result<Config> + Send + Sync + 'static,
) -> anyhow::Result<()> {
    let reread = Arc::new(reread);
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
    epp::start(router.clone())?;
    health::spawn_checker(router.clone());
    let membership = Arc::new(Membership::default());
    discovery::spawn(router.clone(), membership.clone()).context("starting discovery")?;
    replicas::spawn(router.clone()).context("replicas")?;
    {
        let (r, c, m) = (router.clone(), reread.clone(), membership.clone());
        reload::spawn_watch(
            router.clone(),
            Arc::new(move || reload::apply(&r, &m, c()?)),
        )
        .context("watching the configuration's files")?;
    }
    if let Some(addr) = cfg.admin.listen {
        let (r, c, m) = (router.clone(), reread.clone(), membership.clone());
        admin::start(
            router.clone(),
            addr,
            Box::new(move || reload::apply(&r, &m, c()?)),
        )?;
    }
    info!(
        listen = %cfg.listen,
        tls = cfg.loaded.server_tls.is_some(),
        api_keys = cfg.loaded.keys.as_ref().map_or(0, |k| k.names().len()),
        workers = cfg.worker_count(),
        policy = cfg.policy.name(),
        backends = cfg.backends.len(),
        "prefix-router is serving"
    );
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP])
        .context("installing signal handlers")?;
    for sig in signals.forever() {
        match sig {
            SIGHUP => match reread().and_then(|c| reload::apply(&router, &membership, c)) {
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
