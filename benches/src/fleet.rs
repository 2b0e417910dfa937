//! The processes a benchmark starts: simulated engines, the router, nginx.
//!
//! Every child is registered here while it runs. [`install_signal_handler`]
//! makes SIGINT/SIGTERM stop them all before the harness exits, drop guards
//! stop them on the normal path and on panic, and each child gets
//! `PR_SET_PDEATHSIG` so a harness killed with SIGKILL takes them along.

use anyhow::{Context, bail};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use testkit::proc::Spawned;

/// How long an engine, the router or nginx may take to start listening.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// Pids of the children alive now.
static CHILDREN: Mutex<Vec<u32>> = Mutex::new(Vec::new());
/// Set once SIGINT or SIGTERM arrived.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Whether the user asked to stop (Ctrl-C).
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
}

/// On SIGINT or SIGTERM: stop every registered child (SIGTERM, then SIGKILL
/// after half a second) and exit with 130.
pub fn install_signal_handler() -> anyhow::Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])?;
    std::thread::spawn(move || {
        if signals.forever().next().is_some() {
            INTERRUPTED.store(true, Ordering::Relaxed);
            let pids = CHILDREN.lock().map(|c| c.clone()).unwrap_or_default();
            eprintln!("\ninterrupted: stopping {} processes", pids.len());
            for &p in &pids {
                signal(p, libc::SIGTERM);
            }
            std::thread::sleep(Duration::from_millis(500));
            for &p in &pids {
                signal(p, libc::SIGKILL);
            }
            std::process::exit(130);
        }
    });
    Ok(())
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) on a pid this process spawned and registered; a pid
    // already reaped is removed from the registry before its guard drops.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// A running child process, stopped on drop.
pub struct Child {
    spawned: Spawned,
    pub name: String,
}

impl Child {
    /// SIGKILL, then waits (up to 5 s) until it has exited, so a process
    /// started after it can bind its ports.
    fn kill_and_wait(&mut self) {
        signal(self.pid(), libc::SIGKILL);
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.spawned.is_running() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Starts `cmd`, registered for cleanup, dying with the harness.
    pub fn spawn(mut cmd: Command, name: &str) -> anyhow::Result<Child> {
        if interrupted() {
            bail!("interrupted");
        }
        // SAFETY: prctl is async-signal-safe; it only sets the death signal.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let spawned = Spawned::spawn(cmd, name).with_context(|| format!("spawn {name}"))?;
        CHILDREN.lock().expect("registry").push(spawned.pid());
        Ok(Child {
            spawned,
            name: name.to_string(),
        })
    }

    pub fn pid(&self) -> u32 {
        self.spawned.pid()
    }

    /// The last 4 KiB of its stderr.
    pub fn stderr_tail(&self) -> String {
        self.spawned.stderr_tail(4096)
    }

    /// Waits for a stdout line starting with `prefix`.
    pub fn wait_line(&self, prefix: &str) -> anyhow::Result<String> {
        self.spawned
            .wait_stdout_line(prefix, START_TIMEOUT)
            .with_context(|| format!("{} did not start:\n{}", self.name, self.stderr_tail()))
    }

    /// Waits until `addr` accepts TCP connections.
    pub fn wait_port(&mut self, addr: SocketAddr) -> anyhow::Result<()> {
        let deadline = Instant::now() + START_TIMEOUT;
        while Instant::now() < deadline {
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return Ok(());
            }
            if !self.spawned.is_running() {
                bail!("{} exited:\n{}", self.name, self.stderr_tail());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        bail!(
            "{} does not listen on {addr}:\n{}",
            self.name,
            self.stderr_tail()
        )
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let pid = self.spawned.pid();
        self.spawned.stop();
        if let Ok(mut c) = CHILDREN.lock() {
            c.retain(|&p| p != pid);
        }
    }
}

/// Where the release binaries are (`prefix-router`, `sim-engine`).
#[derive(Clone, Debug)]
pub struct Bins {
    pub dir: PathBuf,
}

impl Bins {
    /// `dir`, or the folder of the running executable.
    pub fn new(dir: Option<PathBuf>) -> anyhow::Result<Bins> {
        let dir = match dir {
            Some(d) => d,
            None => std::env::current_exe()?
                .parent()
                .context("exe has a folder")?
                .to_path_buf(),
        };
        for b in ["prefix-router", "sim-engine"] {
            if !dir.join(b).exists() {
                bail!("{} not found in {}: build it first", b, dir.display());
            }
        }
        Ok(Bins { dir })
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

/// A running `sim-engine`.
pub struct Engine {
    pub addr: SocketAddr,
    pub id: String,
    pub child: Child,
}

impl Engine {
    /// Starts `sim-engine --id ID ARGS` on a free port.
    pub fn start(bins: &Bins, id: &str, args: &[String]) -> anyhow::Result<Engine> {
        let (child, line) = Self::spawn(bins, id, "127.0.0.1:0", args)?;
        let addr = line.trim().parse().context("engine address")?;
        Ok(Engine {
            addr,
            id: id.to_string(),
            child,
        })
    }

    /// `sim-engine --listen LISTEN --id ID ARGS`, and the address it printed.
    fn spawn(
        bins: &Bins,
        id: &str,
        listen: &str,
        args: &[String],
    ) -> anyhow::Result<(Child, String)> {
        let mut cmd = Command::new(bins.path("sim-engine"));
        cmd.args(["--listen", listen, "--id", id]).args(args);
        cmd.env("RUST_LOG", "warn");
        let child = Child::spawn(cmd, &format!("sim-engine {id}"))?;
        let line = child.wait_line("listening on ")?;
        Ok((child, line))
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Kills it (SIGKILL: requests in flight are cut, its cache is lost)
    /// and, `down` later, starts it again with `args` on the same address.
    /// Call it from a thread that outlives the new process: a child dies
    /// with the thread that started it (`PR_SET_PDEATHSIG`).
    pub fn restart(&mut self, bins: &Bins, args: &[String], down: Duration) -> anyhow::Result<()> {
        self.child.kill_and_wait();
        std::thread::sleep(down);
        // The old child is reaped as it is replaced.
        (self.child, _) = Self::spawn(bins, &self.id, &self.addr.to_string(), args)?;
        Ok(())
    }
}

/// Starts `n` engines named `engine-0..n`.
pub fn start_engines(bins: &Bins, n: usize, args: &[String]) -> anyhow::Result<Vec<Engine>> {
    (0..n)
        .map(|i| Engine::start(bins, &format!("engine-{i}"), args))
        .collect()
}

/// Where an engine publishes its KV-cache events: the live stream's port
/// and the replay socket's, on 127.0.0.1.
#[derive(Clone, Copy, Debug)]
pub struct EventPorts {
    pub live: u16,
    pub replay: u16,
}

/// [`start_engines`] publishing vLLM's KV-cache events, each engine on two
/// free ports. A port picked free can be taken before the engine binds it:
/// a start that fails is tried again on fresh ports, 3 times.
pub fn start_engines_with_events(
    bins: &Bins,
    n: usize,
    args: &[String],
) -> anyhow::Result<Vec<(Engine, EventPorts)>> {
    (0..n)
        .map(|i| {
            let id = format!("engine-{i}");
            let mut tries = 0;
            loop {
                let ports = EventPorts {
                    live: testkit::proc::free_port(),
                    replay: testkit::proc::free_port(),
                };
                let mut all = vec![
                    "--kv-events-port".to_string(),
                    ports.live.to_string(),
                    "--kv-events-replay-port".to_string(),
                    ports.replay.to_string(),
                ];
                all.extend_from_slice(args);
                tries += 1;
                match Engine::start(bins, &id, &all) {
                    Ok(e) => return Ok((e, ports)),
                    Err(e) if tries >= 3 => return Err(e),
                    Err(_) => {}
                }
            }
        })
        .collect()
}

/// A running `prefix-router`.
pub struct Router {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub child: Child,
    /// The command it was started with, to start it again as it was.
    bin: PathBuf,
    args: Vec<String>,
}

impl Router {
    /// Starts `prefix-router` in front of `engines` with `policy` and extra
    /// `args`; waits for its admin `/health`.
    pub fn start(
        bins: &Bins,
        engines: &[Engine],
        policy: &str,
        args: &[String],
    ) -> anyhow::Result<Router> {
        let urls: Vec<String> = engines.iter().map(Engine::url).collect();
        Self::start_bin(&bins.path("prefix-router"), &urls, policy, args)
    }

    /// [`Router::start`] in front of engines given by URL (`http://host:port`).
    pub fn start_urls(
        bins: &Bins,
        urls: &[String],
        policy: &str,
        args: &[String],
    ) -> anyhow::Result<Router> {
        Self::start_bin(&bins.path("prefix-router"), urls, policy, args)
    }

    /// [`Router::start_urls`] with another build of the router (a baseline).
    pub fn start_bin(
        bin: &Path,
        urls: &[String],
        policy: &str,
        args: &[String],
    ) -> anyhow::Result<Router> {
        let mut r = Self::spawn_bin(bin, urls, policy, args)?;
        r.wait_ready()?;
        Ok(r)
    }

    /// Starts `bin` on free ports without waiting for it (replicas that
    /// wait for each other start together, then [`Router::wait_ready`]).
    pub fn spawn_bin(
        bin: &Path,
        urls: &[String],
        policy: &str,
        args: &[String],
    ) -> anyhow::Result<Router> {
        let port = testkit::proc::free_port();
        let admin_port = testkit::proc::free_port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
        let admin: SocketAddr = format!("127.0.0.1:{admin_port}").parse()?;
        let mut all: Vec<String> = [
            "--listen",
            &addr.to_string(),
            "--admin-listen",
            &admin.to_string(),
            "--policy",
            policy,
            "--log-level",
            "warn",
        ]
        .map(String::from)
        .to_vec();
        all.extend_from_slice(args);
        for u in urls {
            all.extend(["--backend".to_string(), u.clone()]);
        }
        let mut cmd = Command::new(bin);
        cmd.args(&all);
        let child = Child::spawn(cmd, "prefix-router")?;
        Ok(Router {
            addr,
            admin,
            child,
            bin: bin.to_path_buf(),
            args: all,
        })
    }

    /// Kills the process at once (SIGKILL: no drain, no goodbye to its
    /// peers) and starts it again with the same command, on the same
    /// ports and config. Returns without waiting for it. Call it from a
    /// thread that outlives the new process: a child dies with the thread
    /// that started it (`PR_SET_PDEATHSIG`).
    pub fn kill_and_restart(&mut self) -> anyhow::Result<()> {
        // Gone (and reaped) before the new one binds its ports.
        self.child.kill_and_wait();
        let mut cmd = Command::new(&self.bin);
        cmd.args(&self.args);
        // The old child is reaped as it is replaced.
        self.child = Child::spawn(cmd, "prefix-router")?;
        Ok(())
    }

    /// Whether its admin `/ready` answers 200 now.
    pub fn is_ready(&self) -> bool {
        testkit::http::request(self.admin, "GET", "/ready", &[], b"").is_ok_and(|r| r.status == 200)
    }

    /// `GET /admin/replicas`: its own stream and each peer's, as JSON.
    pub fn replicas(&self) -> anyhow::Result<serde_json::Value> {
        let r = testkit::http::request(self.admin, "GET", "/admin/replicas", &[], b"")?;
        Ok(serde_json::from_slice(&r.body)?)
    }

    /// Waits until the router listens and its admin `/health` answers.
    pub fn wait_ready(&mut self) -> anyhow::Result<()> {
        self.child.wait_port(self.addr)?;
        if !testkit::proc::wait_http_ready(self.admin, "/health", START_TIMEOUT) {
            bail!(
                "prefix-router admin not ready:\n{}",
                self.child.stderr_tail()
            );
        }
        Ok(())
    }

    /// Waits until the router's admin `/ready` answers 200: a replica
    /// sharing with others is ready once it caught up from them.
    pub fn wait_warm(&self) -> anyhow::Result<()> {
        if !testkit::proc::wait_http_ready(self.admin, "/ready", START_TIMEOUT) {
            bail!(
                "prefix-router never caught up:\n{}",
                self.child.stderr_tail()
            );
        }
        Ok(())
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// `GET /admin/backends`: each backend's state as JSON.
    pub fn backends(&self) -> anyhow::Result<serde_json::Value> {
        let r = testkit::http::request(self.admin, "GET", "/admin/backends", &[], b"")?;
        Ok(serde_json::from_slice(&r.body)?)
    }

    /// `GET /metrics` on the admin listener.
    pub fn metrics(&self) -> anyhow::Result<String> {
        let r = testkit::http::request(self.admin, "GET", "/metrics", &[], b"")?;
        Ok(String::from_utf8_lossy(&r.body).into_owned())
    }
}

/// The results folder `results/<kind>-<unix time>` under `root`.
pub fn results_dir(root: &Path, kind: &str) -> PathBuf {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    root.join(format!("{kind}-{secs}"))
}
