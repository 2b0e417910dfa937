//! Keep-alive connections to backends, one pool per worker thread (no
//! sharing, no locks), a stack per backend (keyed by its slot and
//! generation): the most recently used connection is the likeliest still
//! open.

use std::cell::RefCell;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use monoio::net::TcpStream;
use tracing::info;

use crate::route::MAX_BACKENDS;
use crate::route::backend::{Backend, ConnCount};

/// A connection to a backend; counted in the backend's open connections
/// while it lives.
pub struct BackendConn {
    pub stream: TcpStream,
    count: ConnCount,
    /// The connection came from the pool (it may have been closed by the peer).
    pub reused: bool,
    /// Its last answer was streamed (chunked).
    pub after_stream: bool,
}

impl BackendConn {
    pub fn new(stream: TcpStream, backend: &Arc<Backend>) -> BackendConn {
        BackendConn {
            stream,
            count: backend.conn_opened(),
            reused: false,
            after_stream: false,
        }
    }

    fn backend(&self) -> &Backend {
        self.count.backend()
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

/// A connection pooled after a streamed answer and found closed sooner
/// than this was closed because of the stream, not by a keep-alive timeout
/// (uvicorn's and cpp-httplib's are 5 s).
const CLOSED_AFTER_STREAM: Duration = Duration::from_secs(1);

struct Idle {
    conn: BackendConn,
    since: Instant,
}

/// The idle connections of one slot, and the backend generation they are to.
#[derive(Default)]
struct Stack {
    generation: u64,
    idle: Vec<Idle>,
}

/// Idle connections by backend identity: indexed by slot for speed, each
/// stack tagged with the generation of the backend that owns the slot, so a
/// backend that takes a freed slot after a reload never gets the previous
/// owner's connections.
pub struct Pool {
    stacks: RefCell<Vec<Stack>>,
}

impl Default for Pool {
    fn default() -> Self {
        Pool {
            stacks: RefCell::new((0..MAX_BACKENDS).map(|_| Stack::default()).collect()),
        }
    }
}

impl Pool {
    /// An idle connection to `backend`, still open, that has not sat longer
    /// than `max_idle`.
    pub fn take(&self, backend: &Backend, max_idle: Duration) -> Option<BackendConn> {
        let mut stacks = self.stacks.borrow_mut();
        let stack = &mut stacks[backend.slot];
        if stack.generation != backend.generation {
            stack.idle.clear();
            stack.generation = backend.generation;
            return None;
        }
        while let Some(i) = stack.idle.pop() {
            let idle = i.since.elapsed();
            if idle <= max_idle && still_open(&i.conn.stream) {
                let mut conn = i.conn;
                conn.reused = true;
                return Some(conn);
            }
            if i.conn.after_stream
                && idle < CLOSED_AFTER_STREAM
                && !backend.closes_after_stream.swap(true, Relaxed)
            {
                info!(backend = %backend.url, "backend closes connections after streamed answers; not pooling those");
            }
        }
        None
    }

    /// Keeps `conn` for reuse, unless its backend left the fleet or the
    /// stack is full. A backend that is not removed owns its slot, so its
    /// generation replaces an older one's.
    pub fn put(&self, conn: BackendConn, max_per_backend: usize) {
        let b = conn.backend();
        if b.health.is_removed() {
            return;
        }
        let mut stacks = self.stacks.borrow_mut();
        let stack = &mut stacks[b.slot];
        if stack.generation != b.generation {
            stack.idle.clear();
            stack.generation = b.generation;
        }
        if stack.idle.len() < max_per_backend {
            stack.idle.push(Idle {
                conn,
                since: Instant::now(),
            });
        }
    }

    /// Drops idle connections older than `max_idle`, and every one to a
    /// backend that left the fleet.
    pub fn sweep(&self, max_idle: Duration) {
        for stack in self.stacks.borrow_mut().iter_mut() {
            stack
                .idle
                .retain(|i| i.since.elapsed() <= max_idle && !i.conn.backend().health.is_removed());
        }
    }
}
