//! Starting `sim-engine` processes from tests.

use crate::proc::Spawned;
use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

/// How long a starting engine may take to print `listening on`.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// A running `sim-engine`, killed on drop.
pub struct SimEngine {
    pub addr: SocketAddr,
    pub child: Spawned,
}

impl SimEngine {
    /// Starts `sim-engine` with `args` (listening on `127.0.0.1:0` unless
    /// `--listen` is given) and waits for `listening on ADDR`.
    ///
    /// # Panics
    /// If it does not start, with its stderr in the message.
    pub fn spawn(args: &[&str]) -> SimEngine {
        Self::try_spawn(args).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`spawn`](Self::spawn), with a failure to start as an error (its
    /// stderr in the message), for callers that retry: ports picked by
    /// binding and closing can be taken by another test before the engine
    /// binds them.
    pub fn try_spawn(args: &[&str]) -> Result<SimEngine, String> {
        let mut cmd = Command::new(crate::bin_path("sim-engine"));
        if !args.contains(&"--listen") {
            cmd.args(["--listen", "127.0.0.1:0"]);
        }
        cmd.args(args);
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "warn");
        }
        let child = Spawned::spawn(cmd, "sim-engine").expect("spawn sim-engine");
        let Some(line) = child.wait_stdout_line("listening on ", START_TIMEOUT) else {
            return Err(format!(
                "sim-engine did not start:\n{}",
                child.stderr_tail(4096)
            ));
        };
        let addr = line.trim().parse().expect("address after `listening on`");
        Ok(SimEngine { addr, child })
    }

    /// [`spawn`](Self::spawn) publishing KV events (`--kv-events-port`,
    /// `--kv-events-replay-port`) on two free ports, returned after the
    /// engine. The ports are picked free and bound by the engine later, so
    /// a concurrent test can take one in between (seen in CI): a start
    /// that fails is tried again on fresh ports, 3 times.
    ///
    /// # Panics
    /// If the third start fails, with its stderr in the message.
    pub fn spawn_with_event_ports(args: &[&str]) -> (SimEngine, u16, u16) {
        let mut tries = 0;
        loop {
            let (p, r) = (crate::proc::free_port(), crate::proc::free_port());
            let (ps, rs) = (p.to_string(), r.to_string());
            let mut all = vec!["--kv-events-port", &ps, "--kv-events-replay-port", &rs];
            all.extend_from_slice(args);
            tries += 1;
            match Self::try_spawn(&all) {
                Ok(e) => return (e, p, r),
                Err(err) if tries >= 3 => panic!("{err}"),
                Err(_) => {}
            }
        }
    }

    /// One `sim-engine` process serving `ports` engines (`--ports`) on
    /// 127.0.0.1 ports the OS picks, each with its own cache and its
    /// address as its id; returns it (its `addr`: the first) and every
    /// engine's address.
    ///
    /// # Panics
    /// If it does not start, with its stderr in the message.
    pub fn spawn_ports(ports: usize, args: &[&str]) -> (SimEngine, Vec<SocketAddr>) {
        let mut cmd = Command::new(crate::bin_path("sim-engine"));
        cmd.args(["--listen", "127.0.0.1:0", "--ports", &ports.to_string()]);
        cmd.args(args);
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "warn");
        }
        let child = Spawned::spawn(cmd, "sim-engine").expect("spawn sim-engine");
        let addrs: Vec<SocketAddr> = (0..ports)
            .map(|_| {
                let Some(line) = child.wait_stdout_line("listening on ", START_TIMEOUT) else {
                    panic!("sim-engine did not start:\n{}", child.stderr_tail(4096));
                };
                line.trim().parse().expect("address after `listening on`")
            })
            .collect();
        (
            SimEngine {
                addr: addrs[0],
                child,
            },
            addrs,
        )
    }

    /// `n` engines with ids `e0`, `e1`, ... and the same extra `args`.
    pub fn fleet(n: usize, args: &[&str]) -> Vec<SimEngine> {
        (0..n)
            .map(|i| {
                let id = format!("e{i}");
                let mut a = vec!["--id", id.as_str()];
                a.extend_from_slice(args);
                SimEngine::spawn(&a)
            })
            .collect()
    }

    /// Requests the engine generated for (`vllm:request_success_total`; in
    /// zero-cost mode dropped streams count too).
    pub fn requests_served(&self) -> u64 {
        let m =
            crate::http::request(self.addr, "GET", "/metrics", &[], b"").expect("engine /metrics");
        m.text()
            .lines()
            .find(|l| l.starts_with("vllm:request_success_total"))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .map_or(0, |v| v as u64)
    }

    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}
