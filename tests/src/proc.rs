//! Child processes for tests: a guard that always kills them, with their
//! stderr kept in a file for diagnostics, and bounded readiness waits.

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long a child gets to exit after SIGTERM before SIGKILL.
const TERM_GRACE: Duration = Duration::from_secs(2);

static SEQ: AtomicU64 = AtomicU64::new(0);

/// A running child process, killed (SIGTERM, then SIGKILL after
/// [`TERM_GRACE`]) when dropped. Its stdout lines are readable with
/// [`Spawned::wait_stdout_line`]; its stderr goes to a temp file, printed
/// (last 4 KiB) if the test panics.
pub struct Spawned {
    pub child: Child,
    name: String,
    stderr_path: PathBuf,
    stdout_lines: mpsc::Receiver<String>,
}

impl Spawned {
    /// Starts `cmd` (stdout piped, stderr to a temp file).
    pub fn spawn(mut cmd: Command, name: &str) -> std::io::Result<Self> {
        let stderr_path = std::env::temp_dir().join(format!(
            "testkit-{}-{}-{}.stderr",
            name,
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let file = std::fs::File::create(&stderr_path)?;
        cmd.stdout(Stdio::piped()).stderr(file).stdin(Stdio::null());
        let mut child = cmd.spawn()?;
        let (tx, rx) = mpsc::channel();
        if let Some(out) = child.stdout.take() {
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines().map_while(Result::ok) {
                    let _ = tx.send(line);
                }
            });
        }
        Ok(Self {
            child,
            name: name.to_string(),
            stderr_path,
            stdout_lines: rx,
        })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits up to `timeout` for a stdout line starting with `prefix`;
    /// returns the rest of the line.
    pub fn wait_stdout_line(&self, prefix: &str, timeout: Duration) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            match self.stdout_lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(rest) = line.strip_prefix(prefix) {
                        return Some(rest.to_string());
                    }
                }
                Err(_) => return None,
            }
        }
    }

    /// The last `max` bytes of the child's stderr.
    pub fn stderr_tail(&self, max: usize) -> String {
        let data = std::fs::read(&self.stderr_path).unwrap_or_default();
        String::from_utf8_lossy(&data[data.len().saturating_sub(max)..]).into_owned()
    }

    /// Whether the child is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Stops the child (SIGTERM, grace period, SIGKILL) and reaps it.
    pub fn stop(&mut self) {
        if !self.is_running() {
            return;
        }
        // SAFETY: kill(2) with a pid we spawned and have not reaped yet.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + TERM_GRACE;
        while Instant::now() < deadline {
            if !self.is_running() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        self.stop();
        if std::thread::panicking() {
            eprintln!(
                "---- stderr of {} (pid {}) ----\n{}",
                self.name,
                self.child.id(),
                self.stderr_tail(4096)
            );
        }
        let _ = std::fs::remove_file(&self.stderr_path);
    }
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind 127.0.0.1:0")
}

/// Polls `GET path` on `addr` every 20 ms until it answers 200 or `timeout`
/// passes; returns whether it did.
pub fn wait_http_ready(addr: SocketAddr, path: &str, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if crate::http::request(addr, "GET", path, &[], b"").is_ok_and(|r| r.status == 200) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}
