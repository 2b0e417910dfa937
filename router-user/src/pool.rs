//! Keep-alive connections to backends, one pool per worker thread (no
//! sharing, no locks), a stack per backend slot: the most recently used
//! connection is the likeliest still open.

use std::cell::RefCell;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use monoio::net::TcpStream;

use crate::backend::Backend;
use crate::index::MAX_BACKENDS;

/// A connection to a backend; counted in the backend's `open_conns` while it lives.
pub struct BackendConn {
    pub stream: TcpStream,
    backend: Arc<Backend>,
    /// The connection came from the pool (it may have been closed by the peer).
    pub reused: bool,
}

impl BackendConn {
    pub fn new(stream: TcpStream, backend: Arc<Backend>) -> BackendConn {
        backend.state.open_conns.fetch_add(1, Relaxed);
        BackendConn {
            stream,
            backend,
            reused: false,
        }
    }
}

impl Drop for BackendConn {
    fn drop(&mut self) {
        self.backend.state.open_conns.fetch_sub(1, Relaxed);
    }
}

/// Whether an idle connection can carry a request: the backend has not
/// closed or reset it, and sent nothing nobody asked for. One non-blocking
/// `recv(MSG_PEEK)`: a backend's keep-alive timeout (uvicorn's is 5 s) closes
/// idle connections, and a request written to one of them could not be told
/// apart from one the backend read and dropped (see the delivery rule in
/// `forward`). A close racing this check still gets a 502, never a re-send.
fn still_open(stream: &TcpStream) -> bool {
    use nix::sys::socket::{MsgFlags, recv};
    let mut byte = [0u8; 1];
    matches!(
        recv(
            stream.as_raw_fd(),
            &mut byte,
            MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT
        ),
        Err(nix::errno::Errno::EAGAIN)
    )
}

struct Idle {
    conn: BackendConn,
    since: Instant,
}

pub struct Pool {
    idle: RefCell<Vec<Vec<Idle>>>,
}

impl Default for Pool {
    fn default() -> Self {
        Pool {
            idle: RefCell::new((0..MAX_BACKENDS).map(|_| Vec::new()).collect()),
        }
    }
}

impl Pool {
    /// An idle connection to `backend` that has not sat longer than `max_idle`.
    pub fn take(&self, backend: &Backend, max_idle: Duration) -> Option<BackendConn> {
        let mut idle = self.idle.borrow_mut();
        let stack = &mut idle[backend.slot];
        while let Some(i) = stack.pop() {
            // A slot reused by a new backend after a reload has no old conns:
            // `forget` empties it on removal.
            if i.since.elapsed() <= max_idle && still_open(&i.conn.stream) {
                let mut conn = i.conn;
                conn.reused = true;
                return Some(conn);
            }
        }
        None
    }

    pub fn put(&self, conn: BackendConn, max_per_backend: usize) {
        let mut idle = self.idle.borrow_mut();
        let stack = &mut idle[conn.backend.slot];
        if stack.len() < max_per_backend {
            stack.push(Idle {
                conn,
                since: Instant::now(),
            });
        }
    }

    /// Drops every idle connection to `slot`.
    pub fn forget(&self, slot: usize) {
        self.idle.borrow_mut()[slot].clear();
    }

    /// Drops idle connections older than `max_idle`, and those to slots whose
    /// backend is not `alive` (removed by a reload).
    pub fn sweep(&self, max_idle: Duration, alive: impl Fn(usize, &Arc<Backend>) -> bool) {
        for (slot, stack) in self.idle.borrow_mut().iter_mut().enumerate() {
            stack.retain(|i| i.since.elapsed() <= max_idle && alive(slot, &i.conn.backend));
        }
    }
}
