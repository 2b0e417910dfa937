//! The peer routers, run on the same engines and traffic as prefix-router:
//! sglang-router 0.3.2, vllm-router 0.1.17 and smg 1.13.0, installed from
//! PyPI (prebuilt abi3 wheels with a Rust core, nothing compiled) into a
//! virtualenv of their own that later runs reuse.
//!
//! Traps (see the project's FACTS, "Running the peer routers here"), and
//! what this module does about each:
//! - sglang-router downloads a tokenizer from the Hugging Face hub when a
//!   worker names a model path: the peers only run inside a network
//!   namespace that has nothing but loopback ([`isolate`] re-executes the
//!   bench under `unshare -n`), with `HF_ENDPOINT` on a dead loopback port,
//!   and smg gets `--disable-tokenizer-autoload`;
//! - sglang-router and smg bind 0.0.0.0 and Prometheus on port 29000 by
//!   default: every peer gets `--host 127.0.0.1`, `--prometheus-host
//!   127.0.0.1` and a port of its own;
//! - sglang-router installs a script named `smg` too: smg is installed last,
//!   and sglang-router is started as `python -m sglang_router.launch_router`;
//! - smg's cache_aware starts with a 60 s warm-up slice: `--worker-warmup-secs 0`;
//! - smg keeps its port for seconds after SIGTERM: a peer is reaped (the
//!   process has exited) before the next run starts, and ports are fresh.
//!
//! Readiness is a 1-token chat request answered 200 (a peer's own health
//! endpoint says nothing about whether it reached its workers).

use crate::fleet::{Child, Engine};
use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// What is installed, in order: smg must come after sglang-router, which
/// ships a script of the same name.
pub const PIP_SETS: &[&[&str]] = &[
    &["sglang-router==0.3.2", "vllm-router==0.1.17"],
    &["smg==1.13.0"],
];

/// Written into the virtualenv once every set installed; its content is the
/// pinned versions, so a change of versions reinstalls.
const MARKER: &str = "prefix-bench-peers.txt";

/// Set in the re-executed bench: it runs inside its own network namespace.
pub const NETNS_ENV: &str = "PREFIX_BENCH_NETNS";

/// `HF_ENDPOINT` of every peer: a loopback port nothing listens on, so a
/// tokenizer download fails at once instead of reaching the hub.
const DEAD_HUB: &str = "http://127.0.0.1:9";

/// How long a peer may take to answer its first request. They start in
/// 0.3-1.4 s here; the margin is for a loaded 2-core machine.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// Whether and how the peers take part.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum PeersMode {
    /// Without the peers.
    Off,
    /// Only if their virtualenv is already installed (nothing is fetched).
    Installed,
    /// Install them when missing; skip them, saying why, when that fails or
    /// no network namespace can be made (not root).
    Auto,
    /// Install them when missing; fail when they cannot run.
    Require,
}

/// One peer router.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Peer {
    Sglang,
    Vllm,
    Smg,
}

impl Peer {
    pub const ALL: [Peer; 3] = [Peer::Sglang, Peer::Vllm, Peer::Smg];

    /// The name in tables (the package and its version).
    pub fn name(self) -> &'static str {
        match self {
            Peer::Sglang => "sglang-router",
            Peer::Vllm => "vllm-router",
            Peer::Smg => "smg",
        }
    }

    pub fn version(self) -> &'static str {
        match self {
            Peer::Sglang => "0.3.2",
            Peer::Vllm => "0.1.17",
            Peer::Smg => "1.13.0",
        }
    }

    /// A table name: a policy column shows `sglang-router` etc.
    pub fn from_name(s: &str) -> Option<Peer> {
        Peer::ALL.into_iter().find(|p| p.name() == s)
    }

    /// The command line that starts this peer with its cache_aware policy
    /// (defaults otherwise) in front of `workers`.
    fn command(self, venv: &Path, port: u16, prom_port: u16, workers: &[String]) -> Command {
        let bin = venv.join("bin");
        let mut c = match self {
            Peer::Sglang => {
                let mut c = Command::new(bin.join("python"));
                c.args(["-m", "sglang_router.launch_router"]);
                c
            }
            Peer::Vllm => Command::new(bin.join("vllm-router")),
            Peer::Smg => {
                let mut c = Command::new(bin.join("smg"));
                c.arg("launch");
                c
            }
        };
        c.args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--prometheus-host", "127.0.0.1"])
            .args(["--prometheus-port", &prom_port.to_string()])
            .args(["--policy", "cache_aware"])
            .arg("--worker-urls")
            .args(workers);
        match self {
            Peer::Sglang => c.args(["--log-level", "warn"]),
            Peer::Vllm => c.args(["--log-level", "warning"]),
            Peer::Smg => c
                .args(["--log-level", "warn"])
                .args(["--worker-warmup-secs", "0"])
                .arg("--disable-tokenizer-autoload"),
        };
        c.env("HF_ENDPOINT", DEAD_HUB)
            .env("HF_HUB_DISABLE_TELEMETRY", "1")
            .env("NO_PROXY", "*")
            .env_remove("HTTP_PROXY")
            .env_remove("HTTPS_PROXY")
            .env_remove("http_proxy")
            .env_remove("https_proxy");
        c
    }
}

/// The peers' virtualenv.
#[derive(Clone, Debug)]
pub struct Venv {
    pub dir: PathBuf,
}

impl Venv {
    /// The default place: `peers-venv` beside the release folder, i.e.
    /// `target/peers-venv` (gitignored, kept across runs).
    pub fn default_dir(bin_dir: &Path) -> PathBuf {
        bin_dir
            .parent()
            .map_or_else(|| bin_dir.join("peers-venv"), |t| t.join("peers-venv"))
    }

    fn marker_text() -> String {
        PIP_SETS
            .iter()
            .map(|s| s.join(" "))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The virtualenv at `dir` if the pinned peers are installed there.
    /// pip writes the venv's absolute path into each script's `#!` line, so a
    /// venv copied or moved elsewhere is not an install (its scripts would
    /// run another venv's Python, or none).
    pub fn installed(dir: &Path) -> Option<Venv> {
        let marker = std::fs::read_to_string(dir.join(MARKER)).ok()?;
        let runs_here = |script: &str| {
            let text = std::fs::read_to_string(dir.join("bin").join(script)).unwrap_or_default();
            let interpreter = text.lines().next().unwrap_or("").trim_start_matches("#!");
            let real = |p: &Path| std::fs::canonicalize(p).ok();
            let bin = real(&dir.join("bin"));
            bin.is_some() && Path::new(interpreter.trim()).parent().and_then(real) == bin
        };
        let ok = marker.trim() == Self::marker_text()
            && dir.join("bin/python").exists()
            && runs_here("vllm-router")
            && runs_here("smg");
        ok.then(|| Venv {
            dir: dir.to_path_buf(),
        })
    }

    /// Installs the pinned peers at `dir` (a fresh virtualenv, then pip
    /// from PyPI); reuses a complete install.
    pub fn install(dir: &Path) -> anyhow::Result<Venv> {
        if let Some(v) = Self::installed(dir) {
            return Ok(v);
        }
        let python = ["python3", "python"]
            .into_iter()
            .find(|p| {
                Command::new(p)
                    .arg("--version")
                    .output()
                    .is_ok_and(|o| o.status.success())
            })
            .context("the peer routers need python3 (with venv) to install")?;
        eprintln!(
            "peers: installing {} into {} (about 90 MB of prebuilt wheels)",
            PIP_SETS.concat().join(" "),
            dir.display()
        );
        let _ = std::fs::remove_dir_all(dir);
        run(Command::new(python).args(["-m", "venv"]).arg(dir)).context("python3 -m venv")?;
        for set in PIP_SETS {
            run(Command::new(dir.join("bin/pip"))
                .args(["install", "--quiet", "--disable-pip-version-check"])
                .args(*set))
            .with_context(|| format!("pip install {}", set.join(" ")))?;
        }
        std::fs::write(dir.join(MARKER), Self::marker_text())?;
        Self::installed(dir).context("peers installed but their commands are missing")
    }
}

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let st = cmd
        .status()
        .with_context(|| format!("run {:?}", cmd.get_program()))?;
    if !st.success() {
        bail!("{:?} failed ({st})", cmd.get_program());
    }
    Ok(())
}

/// Resolves `mode` into the virtualenv to use (or none, with the reason
/// printed). Runs before [`isolate`]: installing needs the network.
pub fn prepare(mode: PeersMode, dir: &Path) -> anyhow::Result<Option<Venv>> {
    let why_not = match mode {
        PeersMode::Off => return Ok(None),
        PeersMode::Installed => match Venv::installed(dir) {
            Some(v) => return Ok(Some(v).filter(|_| can_isolate_or_say())),
            None => format!(
                "not installed in {} (install with --peers auto, or `cargo xtask demo --peers`)",
                dir.display()
            ),
        },
        PeersMode::Auto | PeersMode::Require => {
            if !in_netns() && !is_root() {
                "a network namespace needs root (unshare -n)".to_string()
            } else {
                match Venv::install(dir) {
                    Ok(v) => return Ok(Some(v)),
                    Err(e) => format!("install failed: {e:#}"),
                }
            }
        }
    };
    if mode == PeersMode::Require {
        bail!("peer routers: {why_not}");
    }
    eprintln!("peers: skipped ({why_not})");
    Ok(None)
}

fn can_isolate_or_say() -> bool {
    let ok = in_netns() || is_root();
    if !ok {
        eprintln!("peers: skipped (a network namespace needs root)");
    }
    ok
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Whether this process is the re-executed bench inside its namespace.
pub fn in_netns() -> bool {
    std::env::var_os(NETNS_ENV).is_some()
}

/// The network interfaces of this process's namespace (`/proc/self/net/dev`
/// follows the namespace; `/sys/class/net` shows the one sysfs was mounted in).
fn interfaces() -> Vec<String> {
    std::fs::read_to_string("/proc/self/net/dev")
        .unwrap_or_default()
        .lines()
        .skip(2)
        .filter_map(|l| Some(l.split(':').next()?.trim().to_string()))
        .filter(|n| !n.is_empty())
        .collect()
}

/// Makes sure the rest of this run happens in a network namespace with only
/// loopback. Outside one, re-executes this program with the same arguments
/// under `unshare -n` and returns its exit status (`Some`); the caller exits
/// with it. Inside (the re-executed program), brings `lo` up, checks that
/// nothing but `lo` is there, and returns `None`: go on.
pub fn isolate() -> anyhow::Result<Option<i32>> {
    if in_netns() {
        run(Command::new("ip").args(["link", "set", "lo", "up"]))
            .context("ip link set lo up (in the bench's namespace)")?;
        let other: Vec<String> = interfaces().into_iter().filter(|i| i != "lo").collect();
        if !other.is_empty() {
            bail!("the bench's network namespace has interfaces besides lo: {other:?}");
        }
        return Ok(None);
    }
    let exe = std::env::current_exe()?;
    eprintln!("peers: re-running in a network namespace with only loopback (unshare -n)");
    // Ctrl-C reaches the inner bench too (same process group): it stops its
    // children and exits; this one only waits for it.
    let ignore = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGINT, ignore.clone())?;
    signal_hook::flag::register(signal_hook::consts::SIGTERM, ignore)?;
    let st = Command::new("unshare")
        .arg("-n")
        .arg("--")
        .arg(exe)
        .args(std::env::args_os().skip(1))
        .env(NETNS_ENV, "1")
        .status()
        .context("unshare -n (util-linux)")?;
    Ok(Some(st.code().unwrap_or(1)))
}

/// A running peer router in front of a fleet.
pub struct PeerRouter {
    pub peer: Peer,
    pub addr: SocketAddr,
    pub prom: SocketAddr,
    pub child: Child,
}

impl PeerRouter {
    /// Starts `peer` in front of `engines` and waits until it answers a
    /// 1-token chat request for `model`. (smg rejects a request without a
    /// model, and sglang-router's circuit breaker opens on such failures.)
    pub fn start(
        venv: &Venv,
        peer: Peer,
        engines: &[Engine],
        model: &str,
    ) -> anyhow::Result<PeerRouter> {
        anyhow::ensure!(
            in_netns(),
            "peer routers run only inside the bench's network namespace"
        );
        let port = testkit::proc::free_port();
        let prom_port = loop {
            let p = testkit::proc::free_port();
            if p != port {
                break p;
            }
        };
        let workers: Vec<String> = engines.iter().map(Engine::url).collect();
        let cmd = peer.command(&venv.dir, port, prom_port, &workers);
        let mut child = Child::spawn(cmd, peer.name())?;
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
        let prom: SocketAddr = format!("127.0.0.1:{prom_port}").parse()?;
        child.wait_port(addr)?;
        let deadline = Instant::now() + READY_TIMEOUT;
        let body = serde_json::json!({"model": model, "max_tokens": 1,
            "messages": [{"role": "user", "content": "ready?"}]})
        .to_string();
        loop {
            let r = testkit::http::request(
                addr,
                "POST",
                "/v1/chat/completions",
                &[("content-type", "application/json")],
                body.as_bytes(),
            );
            match r {
                Ok(r) if r.status == 200 => break,
                _ if Instant::now() >= deadline => bail!(
                    "{} did not answer a chat request within {READY_TIMEOUT:?}:\n{}",
                    peer.name(),
                    child.stderr_tail()
                ),
                _ => std::thread::sleep(Duration::from_millis(100)),
            }
        }
        Ok(PeerRouter {
            peer,
            addr,
            prom,
            child,
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(c: &Command) -> Vec<String> {
        c.get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    fn env(c: &Command, key: &str) -> Option<String> {
        c.get_envs()
            .find(|(k, _)| *k == key)
            .and_then(|(_, v)| v.map(|v| v.to_string_lossy().into_owned()))
    }

    #[test]
    fn every_peer_binds_loopback_with_its_own_ports_and_a_dead_hub() {
        let workers = [
            "http://127.0.0.1:1".to_string(),
            "http://127.0.0.1:2".into(),
        ];
        for p in Peer::ALL {
            let c = p.command(Path::new("/v"), 4100, 4200, &workers);
            let a = args(&c);
            let after = |flag: &str| {
                let i = a
                    .iter()
                    .position(|x| x == flag)
                    .unwrap_or_else(|| panic!("{} lacks {flag}: {a:?}", p.name()));
                a[i + 1].clone()
            };
            assert_eq!(after("--host"), "127.0.0.1", "{}", p.name());
            assert_eq!(after("--port"), "4100");
            assert_eq!(after("--prometheus-host"), "127.0.0.1");
            assert_eq!(after("--prometheus-port"), "4200");
            assert_eq!(after("--policy"), "cache_aware");
            let w = a.iter().position(|x| x == "--worker-urls").unwrap();
            assert_eq!(&a[w + 1..w + 3], &workers[..]);
            assert_eq!(env(&c, "HF_ENDPOINT").as_deref(), Some(DEAD_HUB));
            assert_eq!(Peer::from_name(p.name()), Some(p));
        }
        let smg = args(&Peer::Smg.command(Path::new("/v"), 1, 2, &workers));
        assert_eq!(smg[0], "launch");
        assert!(smg.contains(&"--disable-tokenizer-autoload".to_string()));
        let w = smg
            .iter()
            .position(|x| x == "--worker-warmup-secs")
            .unwrap();
        assert_eq!(smg[w + 1], "0");
        // sglang-router by module: its `smg` script would shadow the real smg.
        let sg = Peer::Sglang.command(Path::new("/v"), 1, 2, &workers);
        assert_eq!(sg.get_program(), "/v/bin/python");
        assert_eq!(&args(&sg)[..2], ["-m", "sglang_router.launch_router"]);
    }

    #[test]
    fn an_install_counts_only_with_its_marker_of_the_pinned_versions() {
        let dir = std::env::temp_dir().join(format!("peers-venv-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("bin")).unwrap();
        let shebang = format!("#!{}\n", dir.join("bin/python").display());
        for b in ["python", "vllm-router", "smg"] {
            std::fs::write(dir.join("bin").join(b), &shebang).unwrap();
        }
        assert!(
            Venv::installed(&dir).is_none(),
            "no marker: a broken install"
        );
        std::fs::write(dir.join(MARKER), "sglang-router==0.3.1").unwrap();
        assert!(Venv::installed(&dir).is_none(), "other versions");
        std::fs::write(dir.join(MARKER), Venv::marker_text()).unwrap();
        assert!(Venv::installed(&dir).is_some());
        // The default dir is `BIN_DIR/../peers-venv`: the same venv.
        assert!(
            Venv::installed(&dir.join("bin/..")).is_some(),
            "a path with .."
        );
        // A venv copied from elsewhere: its scripts run the other venv's Python.
        std::fs::write(dir.join("bin/smg"), "#!/elsewhere/peers-venv/bin/python3\n").unwrap();
        assert!(Venv::installed(&dir).is_none(), "a moved venv");
        std::fs::remove_file(dir.join("bin/smg")).unwrap();
        assert!(Venv::installed(&dir).is_none(), "smg missing");
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(
            Venv::default_dir(Path::new("/w/target/release")),
            Path::new("/w/target/peers-venv")
        );
    }

    #[test]
    fn this_namespace_lists_loopback() {
        assert!(interfaces().iter().any(|i| i == "lo"), "{:?}", interfaces());
    }
}
