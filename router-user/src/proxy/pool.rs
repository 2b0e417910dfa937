//! Keep-alive connections to backends, one pool per worker thread (no
//! sharing, no locks), a stack per backend (keyed by its slot and
//! generation): the most recently used connection is the likeliest still
//! open.

use std::cell::RefCell;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use tracing::info;

use crate::fleet::MAX_BACKENDS;
use crate::fleet::backend::{Backend, ConnCount};
use crate::proxy::stream::Stream;

/// A connection to a backend; counted in the backend's open connections
/// while it lives.
pub struct BackendConn {
    pub stream: Stream,
    count: ConnCount,
    /// The connection came from the pool (it may have been closed by the peer).
    pub reused: bool,
    /// Its last answer was streamed (chunked).
    pub after_stream: bool,
    /// How long it sat in the pool before this request.
    pub idle: Duration,
    /// Bytes written on it before the current request, all of which the
    /// backend acknowledged (it answered them); on a TLS connection,
    /// starting with the handshake's (what `TCP_INFO` said after it).
    written: u64,
    /// Bytes of the request being sent on it.
    current: u64,
}

impl BackendConn {
    pub fn new(stream: Stream, backend: &Arc<Backend>) -> BackendConn {
        // TLS: the handshake's bytes are acknowledged already.
        let mut conn = BackendConn {
            stream,
            count: backend.conn_opened(),
            reused: false,
            after_stream: false,
            idle: Duration::ZERO,
            written: 0,
            current: 0,
        };
        if conn.stream.is_tls() {
            conn.written = conn.acked_so_far();
        }
        conn
    }

    fn backend(&self) -> &Backend {
        self.count.backend()
    }

    /// A request of `bytes` is being sent on it.
    pub fn sending(&mut self, bytes: usize) {
        self.current = bytes as u64;
    }

    /// The current request was answered whole.
    pub fn answered(&mut self) {
        let current = std::mem::take(&mut self.current);
        self.written = match self.stream.is_tls() {
            // Records are longer than their bytes: ask the socket (one
            // `getsockopt` per answer on TLS backend connections).
            true => self.acked_so_far(),
            false => self.written + current,
        };
    }

    /// What `TCP_INFO` says was acknowledged, less our SYN.
    fn acked_so_far(&self) -> u64 {
        bytes_acked(self.stream.as_raw_fd()).map_or(u64::MAX / 2, |a| a.saturating_sub(1))
    }

    /// Whether the backend's TCP acknowledged none of the current request's
    /// bytes (asked after the backend closed the connection). Its
    /// application reads only what its kernel received, and a close sends
    /// a FIN acknowledging everything received; so a close that acknowledged
    /// nothing of the request came before the backend read any of it. One
    /// `getsockopt(TCP_INFO)`, on the failure path only. `false` when the
    /// kernel does not say.
    pub fn request_unacknowledged(&self) -> bool {
        // Our SYN counts as one acknowledged byte.
        bytes_acked(self.stream.as_raw_fd()).is_some_and(|acked| acked <= 1 + self.written)
    }
}

/// `tcpi_bytes_acked` (Linux 4.1+) of a TCP socket.
fn bytes_acked(fd: std::os::fd::RawFd) -> Option<u64> {
    /// Offset of `tcpi_bytes_acked` in `struct tcp_info` (stable ABI).
    const BYTES_ACKED_AT: usize = 120;
    let mut info = [0u8; 256];
    let mut len = info.len() as libc::socklen_t;
    // SAFETY: `info` is a writable buffer of `len` bytes that the kernel
    // fills with at most `len` bytes of `struct tcp_info`, and `len` is
    // updated to what it wrote; `fd` is an open socket owned by the caller.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            info.as_mut_ptr().cast(),
            &mut len,
        )
    };
    let field = info.get(BYTES_ACKED_AT..BYTES_ACKED_AT + 8)?;
    (rc == 0 && len as usize >= BYTES_ACKED_AT + 8)
        .then(|| u64::from_ne_bytes(field.try_into().expect("8 bytes")))
}

/// Learns, from a pooled connection found closed, whether the backend
/// closes connections after streamed answers (llama-server does).
fn found_closed(conn: &BackendConn, backend: &Backend) {
    if conn.after_stream
        && conn.idle < CLOSED_AFTER_STREAM
        && !backend.closes_after_stream.swap(true, Relaxed)
    {
        info!(backend = %backend.url, "backend closes connections after streamed answers; not pooling those");
    }
}

/// Whether an idle connection can carry a request: the backend has not
/// closed or reset it, and sent nothing nobody asked for. One non-blocking
/// `recv(MSG_PEEK)`, for connections idle [`PEEK_AFTER_IDLE`] or longer: a
/// backend's keep-alive timeout (uvicorn's is 5 s) closes idle connections,
/// and finding them before use spares a wasted send and a re-send each
/// (after a quiet spell, a burst would find many). A connection idle for
/// less is sent on unchecked: a close the backend made before reading the
/// request is told by its acknowledgements afterwards
/// ([`BackendConn::request_unacknowledged`]), and re-sent.
///
/// On a TLS connection the bytes waiting may be records the backend sent
/// unasked (TLS 1.3 session tickets after the handshake): only a close or
/// an error tells it is gone.
fn still_open(stream: &Stream) -> bool {
    use nix::sys::socket::{MsgFlags, recv};
    let mut byte = [0u8; 1];
    match recv(
        stream.as_raw_fd(),
        &mut byte,
        MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT,
    ) {
        Err(nix::errno::Errno::EAGAIN) => true,
        Ok(n) if n > 0 => stream.is_tls(),
        _ => false,
    }
}

/// A connection pooled after a streamed answer and found closed sooner
/// than this was closed because of the stream, not by a keep-alive timeout
/// (uvicorn's and cpp-httplib's are 5 s).
const CLOSED_AFTER_STREAM: Duration = Duration::from_secs(1);

/// Pooled connections idle this long or longer are checked before use
/// (`still_open`); fresher ones are not, which saves a system call per
/// request under load: 0.40 a tiny request at 64 connections instead of
/// 1.42 (the CPU per request did not move past the noise; decision
/// 0036, pooled connection reuse without a system call). Keep-alive
/// timeouts are seconds (uvicorn's, Node's and cpp-httplib's 5 s, nginx's
/// 75 s), so this check sees the closes they make.
const PEEK_AFTER_IDLE: Duration = Duration::from_secs(1);
/// After a connection of a backend is found closed younger than
/// [`PEEK_AFTER_IDLE`], all of its connections are checked for this long
/// (a backend that closes after every answer would otherwise cost a wasted
/// send and a re-send per request).
const CHECK_AFTER_YOUNG_CLOSE: Duration = Duration::from_secs(60);

struct Idle {
    conn: BackendConn,
    since: Instant,
}

/// The idle connections of one slot, and the backend generation they are to.
#[derive(Default)]
struct Stack {
    generation: u64,
    idle: Vec<Idle>,
    /// Until then every connection is checked before reuse, however fresh:
    /// one of this backend's was found closed young.
    check_until: Option<Instant>,
}

impl Stack {
    fn reset(&mut self, generation: u64) {
        self.idle.clear();
        self.generation = generation;
        self.check_until = None;
    }
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
            stack.reset(backend.generation);
            return None;
        }
        let now = Instant::now();
        let check_all = stack.check_until.is_some_and(|t| now < t);
        while let Some(i) = stack.idle.pop() {
            let mut conn = i.conn;
            conn.idle = now.saturating_duration_since(i.since);
            let (young, usable) = (conn.idle < PEEK_AFTER_IDLE, conn.idle <= max_idle);
            if usable && ((young && !check_all) || still_open(&conn.stream)) {
                conn.reused = true;
                return Some(conn);
            }
            if usable && young {
                // Checked (the backend is under watch) and found closed young.
                stack.check_until = Some(now + CHECK_AFTER_YOUNG_CLOSE);
            }
            found_closed(&conn, backend);
        }
        None
    }

    /// `conn`, taken to `backend` unchecked, was found closed: learn what
    /// that says of the backend, and check every one of its connections
    /// before reuse for a while.
    pub fn closed_young(&self, conn: &BackendConn, backend: &Backend) {
        found_closed(conn, backend);
        let mut stacks = self.stacks.borrow_mut();
        let stack = &mut stacks[backend.slot];
        if stack.generation == backend.generation {
            stack.check_until = Some(Instant::now() + CHECK_AFTER_YOUNG_CLOSE);
        }
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
            stack.reset(b.generation);
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
