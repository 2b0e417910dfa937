//! A misbehaving HTTP/1.1 backend for router tests, on std::net and
//! loopback: it reads each request whole (head and Content-Length body),
//! counts and records it, then lets the test's handler answer however it
//! likes (or not at all). `GET /health` is answered 200 (`connection: close`)
//! without reaching the handler or the counters.
//!
//! ```no_run
//! use testkit::fake_backend::{FakeBackend, respond};
//! let b = FakeBackend::spawn(|req, s| {
//!     if req.body.windows(4).any(|w| w == b"drop") {
//!         return false; // read the whole request, close without a byte
//!     }
//!     respond(s, 200, "content-type: application/json\r\n", b"{}")
//! });
//! assert_eq!(b.requests(), 0);
//! ```

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a connection may sit idle before the fake closes it.
const IDLE: Duration = Duration::from_secs(30);

/// A request as the fake read it.
#[derive(Clone, Debug)]
pub struct FakeRequest {
    pub method: String,
    /// The request target as sent (origin or absolute form).
    pub target: String,
    /// Header names lower-cased.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

type Handler = dyn Fn(&FakeRequest, &mut TcpStream) -> bool + Send + Sync;

/// A running fake backend; its accept loop stops when dropped.
pub struct FakeBackend {
    pub addr: SocketAddr,
    requests: Arc<AtomicUsize>,
    open: Arc<AtomicUsize>,
    log: Arc<Mutex<Vec<FakeRequest>>>,
    stop: Arc<AtomicBool>,
}

impl FakeBackend {
    /// Listens on 127.0.0.1:<free port>. For every complete request (but
    /// `GET /health`) it bumps [`FakeBackend::requests`], records it, and calls
    /// `handler`, which writes what it wants to the socket and returns
    /// whether to read another request on the connection.
    pub fn spawn<F>(handler: F) -> FakeBackend
    where
        F: Fn(&FakeRequest, &mut TcpStream) -> bool + Send + Sync + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind fake backend");
        let addr = listener.local_addr().expect("local addr");
        let requests = Arc::new(AtomicUsize::new(0));
        let open = Arc::new(AtomicUsize::new(0));
        let log = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let handler: Arc<Handler> = Arc::new(handler);
        let (r, o, l, st) = (requests.clone(), open.clone(), log.clone(), stop.clone());
        std::thread::spawn(move || {
            for s in listener.incoming() {
                if st.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(s) = s else { continue };
                let (r, o, l, h) = (r.clone(), o.clone(), l.clone(), handler.clone());
                o.fetch_add(1, Ordering::SeqCst);
                std::thread::spawn(move || {
                    connection(s, &r, &l, &*h);
                    o.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        FakeBackend {
            addr,
            requests,
            open,
            log,
            stop,
        }
    }

    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Complete requests received (health probes not counted).
    pub fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }

    /// Connections accepted and not yet closed (by either side; a peer's
    /// close is seen when the fake next reads).
    pub fn open_connections(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    /// Every request received so far, in order.
    pub fn log(&self) -> Vec<FakeRequest> {
        self.log.lock().expect("fake log").clone()
    }
}

impl Drop for FakeBackend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

/// Writes a whole response with a Content-Length; returns true (keep the
/// connection) when the write succeeded.
pub fn respond(s: &mut TcpStream, status: u16, headers: &str, body: &[u8]) -> bool {
    let mut out = format!(
        "HTTP/1.1 {status} X\r\ncontent-length: {}\r\n{headers}\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    s.write_all(&out).is_ok()
}

/// A minimal non-streaming chat completion body.
pub const CHAT_ANSWER: &[u8] = br#"{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;

fn connection(
    mut s: TcpStream,
    requests: &AtomicUsize,
    log: &Mutex<Vec<FakeRequest>>,
    handler: &Handler,
) {
    let _ = s.set_read_timeout(Some(IDLE));
    let _ = s.set_nodelay(true);
    let mut buf = Vec::new();
    let mut tmp = vec![0u8; 64 * 1024];
    loop {
        let Some(req) = read_request(&mut s, &mut buf, &mut tmp) else {
            return;
        };
        if req.method == "GET" && req.target == "/health" {
            let _ =
                s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
            return;
        }
        requests.fetch_add(1, Ordering::SeqCst);
        log.lock().expect("fake log").push(req.clone());
        if !handler(&req, &mut s) {
            return;
        }
    }
}

fn read_request(s: &mut TcpStream, buf: &mut Vec<u8>, tmp: &mut [u8]) -> Option<FakeRequest> {
    loop {
        let mut hs = [httparse::EMPTY_HEADER; 64];
        let mut r = httparse::Request::new(&mut hs);
        if let Ok(httparse::Status::Complete(n)) = r.parse(buf) {
            let headers: Vec<(String, String)> = r
                .headers
                .iter()
                .map(|h| {
                    (
                        h.name.to_ascii_lowercase(),
                        String::from_utf8_lossy(h.value).trim().to_string(),
                    )
                })
                .collect();
            let len = headers
                .iter()
                .find(|(k, _)| k == "content-length")
                .and_then(|(_, v)| v.parse::<usize>().ok())
                .unwrap_or(0);
            let method = r.method.unwrap_or("").to_string();
            let target = r.path.unwrap_or("").to_string();
            while buf.len() < n + len {
                match s.read(tmp) {
                    Ok(0) | Err(_) => return None,
                    Ok(k) => buf.extend_from_slice(&tmp[..k]),
                }
            }
            let body = buf[n..n + len].to_vec();
            buf.drain(..n + len);
            return Some(FakeRequest {
                method,
                target,
                headers,
                body,
            });
        }
        match s.read(tmp) {
            Ok(0) | Err(_) => return None,
            Ok(k) => buf.extend_from_slice(&tmp[..k]),
        }
    }
}
