//! Worker threads: one io_uring event loop per core, each with its own
//! SO_REUSEPORT listener on the traffic address, so the kernel spreads
//! connections over the workers and no two workers share a socket.

use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::thread::JoinHandle;

use anyhow::Context;
use monoio::net::{ListenerOpts, TcpListener};
use tracing::{debug, error, warn};

use crate::error::{Kind, RouterError};
use crate::proxy::conn;
use crate::proxy::io::write_all;
use crate::proxy::worker::Worker;
use crate::shared::Router;

/// Submission queue entries per worker ring.
const RING_ENTRIES: u32 = 4096;
/// Pending connections the kernel queues per listener.
const BACKLOG: i32 = 4096;
/// How often idle pooled backend connections are swept.
const POOL_SWEEP_SECS: u64 = 5;
/// How often each worker checks whether a reload swapped the fleet (one
/// pointer load), to drop removed backends' pooled connections.
const FLEET_WATCH: std::time::Duration = std::time::Duration::from_millis(100);

type Runtime = monoio::Runtime<monoio::time::TimeDriver<monoio::IoUringDriver>>;

/// A worker's runtime. Its ring is set up with `COOP_TASKRUN`: a completion
/// that arrives while the worker runs (a peer's data, delivered by the other
/// core) waits for the worker's next entry to the kernel, which the event
/// loop makes at every turn, instead of interrupting it with an IPI. At 64
/// connections of tiny requests that cut the router's CPU per request from
/// 20.5-24.4 us to 17.7 us and raised throughput 13-35% (decision
/// 0002, io_uring rings with COOP_TASKRUN). Kernels before 5.19 refuse the
/// flag: the ring is then set up without it.
fn runtime() -> std::io::Result<Runtime> {
    let mut coop = io_uring::IoUring::builder();
    coop.setup_coop_taskrun();
    build_runtime(coop).or_else(|e| {
        tracing::debug!(error = %e, "io_uring without COOP_TASKRUN");
        build_runtime(io_uring::IoUring::builder())
    })
}

fn build_runtime(urb: io_uring::Builder) -> std::io::Result<Runtime> {
    monoio::RuntimeBuilder::<monoio::IoUringDriver>::new()
        .with_entries(RING_ENTRIES)
        .uring_builder(urb)
        .enable_timer()
        .build()
}

/// glibc's malloc raises its mmap threshold each time a large mapped block
/// is freed (up to 32 MiB); after that, large body buffers come from the
/// heap, whose memory is not given back to the system (an upload burst left
/// 260 MB resident). A fixed threshold keeps every block above it in its own
/// mapping, unmapped when freed and grown by `mremap` without a copy; below
/// it (the usual prompts) the heap serves as before.
pub const MMAP_THRESHOLD: usize = crate::proxy::worker::RETURN_ABOVE;

fn fix_mmap_threshold() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets an allocator parameter; it is called once,
    // before the worker threads start.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int);
    }
}

/// Fails with a clear message when io_uring cannot be used here.
pub fn check_io_uring() -> anyhow::Result<()> {
    runtime().map(drop).map_err(|e| {
        let disabled = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled").unwrap_or_default();
        anyhow::anyhow!(
            "io_uring is not available ({e}); prefix-router needs Linux 5.11+ with io_uring enabled \
             (kernel.io_uring_disabled is {:?}; set it to 0), and a memlock limit that allows the rings",
            disabled.trim()
        )
    })
}

/// Binds every worker's listener (so bind errors surface at once), then runs
/// the workers. Returns their handles.
pub fn start(router: Arc<Router>) -> anyhow::Result<Vec<JoinHandle<()>>> {
    check_io_uring()?;
    fix_mmap_threshold();
    let cfg = router.config.load_full();
    let n = cfg.worker_count();
    // Port 0: take a port once and have every worker bind that one. The
    // placeholder socket holds the port until the workers have bound it.
    let (listen, _placeholder) = resolve_port(cfg.listen)?;
    let mut handles = Vec::with_capacity(n);
    let (tx, rx) = std::sync::mpsc::channel::<anyhow::Result<()>>();
    for i in 0..n {
        let router = router.clone();
        let tx = tx.clone();
        let h = std::thread::Builder::new()
            .name(format!("worker-{i}"))
            .spawn(move || {
                let mut rt = match runtime() {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = tx.send(Err(anyhow::anyhow!(
                            "worker {i}: building the io_uring runtime: {e}"
                        )));
                        return;
                    }
                };
                rt.block_on(async move {
                    let opts = ListenerOpts::new().reuse_port(true).backlog(BACKLOG);
                    let listener = match TcpListener::bind_with_config(listen, &opts)
                        .with_context(|| format!("binding {listen}"))
                    {
                        Ok(l) => l,
                        Err(e) => {
                            let _ = tx.send(Err(e));
                            return;
                        }
                    };
                    let _ = tx.send(Ok(()));
                    drop(tx);
                    accept_loop(Rc::new(Worker::new(router)), listener).await;
                });
            })?;
        handles.push(h);
    }
    drop(tx);
    for _ in 0..n {
        rx.recv().context("a worker died while starting")??;
    }
    // Scripts and tests wait for this line (with port 0 it names the port).
    println!("listening on {listen}");
    Ok(handles)
}

fn resolve_port(addr: SocketAddr) -> anyhow::Result<(SocketAddr, Option<socket2::Socket>)> {
    if addr.port() != 0 {
        return Ok((addr, None));
    }
    let sock = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        None,
    )?;
    sock.set_reuse_port(true)?;
    sock.bind(&addr.into())?;
    let bound = sock.local_addr()?.as_socket().context("bound address")?;
    Ok((bound, Some(sock)))
}

async fn accept_loop(worker: Rc<Worker>, listener: TcpListener) {
    let sweeper = worker.clone();
    monoio::spawn(async move {
        // Sweep every POOL_SWEEP_SECS, and at once after a reload swapped the
        // fleet (so removed backends' connections close promptly).
        let mut fleet = sweeper.router.fleet.load_full();
        let mut swept = std::time::Instant::now();
        loop {
            monoio::time::sleep(FLEET_WATCH).await;
            let now = sweeper.router.fleet.load_full();
            if Arc::ptr_eq(&now, &fleet) && swept.elapsed().as_secs() < POOL_SWEEP_SECS {
                continue;
            }
            fleet = now;
            swept = std::time::Instant::now();
            let cfg = sweeper.router.config.load();
            sweeper
                .pool
                .sweep(crate::config::ms(cfg.timeouts.backend_pool_idle_ms));
        }
    });
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                error!(error = %e, "accept failed");
                monoio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let router = &worker.router;
        let _ = stream.set_nodelay(true);
        let (max, write_timeout, tls) = {
            let cfg = router.config.load();
            (
                cfg.limits.max_client_connections,
                crate::config::ms(cfg.timeouts.client_write_ms),
                cfg.loaded.server_tls.is_some(),
            )
        };
        if router.shutting_down() || router.client_conns.load(Relaxed) >= max {
            let overloaded = !router.shutting_down();
            if overloaded {
                warn!(%peer, max, "refusing a connection: limits.max_client_connections reached");
            }
            if tls {
                // A plain answer means nothing to a TLS client, and a
                // handshake is what the limit is there to spare: closed.
                drop(stream);
                continue;
            }
            monoio::spawn(async move {
                let mut stream = stream;
                let e = RouterError::new(
                    Kind::Unavailable,
                    "the router is at its connection limit or shutting down; retry shortly",
                );
                let _ = write_all(
                    &mut stream,
                    &mut e.to_response(true, Some(1), false),
                    write_timeout,
                )
                .await;
            });
            continue;
        }
        router.client_conns.fetch_add(1, Relaxed);
        let w = worker.clone();
        monoio::spawn(async move {
            debug!(%peer, "client connected");
            conn::serve(w.clone(), stream, peer).await;
            w.router.client_conns.fetch_sub(1, Relaxed);
        });
    }
}
