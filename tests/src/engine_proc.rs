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
            panic!("sim-engine did not start:\n{}", child.stderr_tail(4096));
        };
        let addr = line.trim().parse().expect("address after `listening on`");
        SimEngine { addr, child }
    }

    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}
