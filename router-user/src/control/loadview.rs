//! Feeds the XDP counters into the load view selection reads: a thread reads
//! them every `ebpf.refresh_ms`, keeps the program's backend registry equal
//! to the fleet, and stores per backend the connections others hold to it
//! (XDP's live count minus this router's own) and its recent reset rate.

use std::sync::Arc;
use std::time::Instant;

use tracing::{debug, warn};

use crate::config::ms;
use crate::control::ebpf::{EbpfError, EbpfLoad};
use crate::fleet::backend::{Fleet, XdpCounts};
use crate::shared::Router;

/// Loads the XDP program per `ebpf.mode` for the current fleet. `Ok(None)`
/// when it is off or unavailable in `auto` mode.
pub fn start(router: &Router) -> Result<Option<EbpfLoad>, EbpfError> {
    let cfg = router.config.load();
    let fleet = router.fleet.load();
    EbpfLoad::start(&cfg.ebpf, &addrs(&fleet))
}

fn addrs(fleet: &Fleet) -> Vec<std::net::SocketAddr> {
    fleet.backends.iter().map(|b| b.addr).collect()
}

/// Runs the refresh loop on its own thread until the process exits.
pub fn spawn(
    router: Arc<Router>,
    mut load: EbpfLoad,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("ebpf-refresh".into())
        .spawn(move || {
            let mut fleet = router.fleet.load_full();
            let mut last = Instant::now();
            let mut last_reset: Vec<u64> = vec![0; fleet.backends.len()];
            let mut last_log = Instant::now();
            loop {
                std::thread::sleep(ms(router.config.load().ebpf.refresh_ms.max(1)));
                let now_fleet = router.fleet.load_full();
                if !Arc::ptr_eq(&now_fleet, &fleet) {
                    if let Err(e) = load.set_backends(&addrs(&now_fleet)) {
                        warn!(error = %e, "updating the XDP backend registry failed");
                    }
                    fleet = now_fleet;
                    last_reset = vec![0; fleet.backends.len()];
                }
                match load.snapshot() {
                    Ok(snap) => refresh(
                        &router,
                        &fleet,
                        &snap,
                        &mut last_reset,
                        last.elapsed().as_secs_f64(),
                    ),
                    Err(e) => warn!(error = %e, "reading the XDP counters failed"),
                }
                last = Instant::now();
                if last_log.elapsed().as_secs() >= 10 {
                    last_log = Instant::now();
                    if let Ok(g) = load.globals() {
                        debug!(
                            packets = g.packets,
                            parse_failures = g.parse_failures,
                            "XDP global counters"
                        );
                    }
                }
            }
        })
}

fn refresh(
    router: &Router,
    fleet: &Fleet,
    snap: &[crate::control::ebpf::BackendCounters],
    last_reset: &mut [u64],
    secs: f64,
) {
    let threshold = router.config.load().ebpf.reset_failure_per_sec;
    for (i, (b, c)) in fleet.backends.iter().zip(snap).enumerate() {
        b.stats.set_xdp(XdpCounts {
            opened: c.opened,
            closed: c.closed,
            reset: c.reset,
            packets: c.packets,
            bytes: c.bytes,
        });
        let resets = c.reset.saturating_sub(last_reset[i]);
        last_reset[i] = c.reset;
        let per_sec = (resets as f64 / secs.max(1e-3)) as u32;
        b.load.set_observed(c.live_connections(), per_sec);
        if threshold > 0 && per_sec >= threshold {
            router.request_failed(b, "connection resets seen by XDP");
        }
        debug!(backend = %b.url, opened = c.opened, closed = c.closed, reset = c.reset, external = b.load.external_conns(), "XDP counters");
    }
}
