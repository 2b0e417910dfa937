//! A small authoritative DNS server on loopback UDP for discovery tests:
//! A, AAAA and SRV records the test changes while it runs, real DNS
//! messages (`hickory-proto`'s wire format), and failure modes (SERVFAIL,
//! no answer at all). A name it does not hold is NXDOMAIN; a name it holds
//! without the asked type is an empty NOERROR answer.
//!
//! ```no_run
//! use testkit::dns::{DnsServer, Mode};
//! let dns = DnsServer::spawn();
//! dns.set_a("engines.test", &["127.0.0.2".parse().unwrap()]);
//! dns.set_srv("_http._tcp.engines.test", &[("e0.test", 8001)]);
//! dns.set_mode(Mode::ServFail);
//! dns.remove("engines.test"); // NXDOMAIN from now on
//! ```

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA, SRV};
use hickory_proto::rr::{Name, RData, Record, RecordType};

/// TTL of every answer: the router must re-resolve on its own interval,
/// not wait for expiry, so a long TTL would show if it cached.
const TTL: u32 = 300;
/// How often the server thread looks whether it should stop.
const POLL: Duration = Duration::from_millis(100);

/// How the server answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// From its records.
    Normal,
    /// SERVFAIL to every query.
    ServFail,
    /// No answer at all (the resolver times out).
    Silent,
}

#[derive(Default)]
struct Zone {
    ips: HashMap<String, Vec<IpAddr>>,
    srv: HashMap<String, Vec<(String, u16)>>,
}

struct Shared {
    zone: Mutex<Zone>,
    mode: Mutex<Mode>,
    queries: AtomicU64,
    stop: AtomicBool,
}

/// A running server; it stops when dropped.
pub struct DnsServer {
    /// Where it listens (UDP, 127.0.0.1).
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// `name` in one canonical form: lower case, without the final dot.
fn key(name: &str) -> String {
    name.trim_end_matches('.').to_ascii_lowercase()
}

impl DnsServer {
    /// Binds a free UDP port on 127.0.0.1 and serves on a thread.
    ///
    /// # Panics
    /// If the socket cannot be bound.
    pub fn spawn() -> DnsServer {
        let sock = UdpSocket::bind("127.0.0.1:0").expect("bind the DNS server");
        sock.set_read_timeout(Some(POLL)).expect("read timeout");
        let addr = sock.local_addr().expect("local addr");
        let shared = Arc::new(Shared {
            zone: Mutex::new(Zone::default()),
            mode: Mutex::new(Mode::Normal),
            queries: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        let thread = std::thread::spawn(move || serve(&sock, &s));
        DnsServer {
            addr,
            shared,
            thread: Some(thread),
        }
    }

    /// `name` answers these addresses (A and AAAA by family); an empty
    /// list keeps the name with no address records (NOERROR, no data).
    pub fn set_a(&self, name: &str, ips: &[IpAddr]) {
        let mut z = self.shared.zone.lock().unwrap();
        z.ips.insert(key(name), ips.to_vec());
    }

    /// `name` answers these SRV records (target, port).
    pub fn set_srv(&self, name: &str, targets: &[(&str, u16)]) {
        let mut z = self.shared.zone.lock().unwrap();
        let t = targets.iter().map(|(h, p)| (key(h), *p)).collect();
        z.srv.insert(key(name), t);
    }

    /// `name` no longer exists (NXDOMAIN).
    pub fn remove(&self, name: &str) {
        let mut z = self.shared.zone.lock().unwrap();
        z.ips.remove(&key(name));
        z.srv.remove(&key(name));
    }

    pub fn set_mode(&self, mode: Mode) {
        *self.shared.mode.lock().unwrap() = mode;
    }

    /// Queries received so far.
    pub fn queries(&self) -> u64 {
        self.shared.queries.load(Ordering::Relaxed)
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(sock: &UdpSocket, shared: &Shared) {
    let mut buf = [0u8; 4096];
    while !shared.stop.load(Ordering::Relaxed) {
        let Ok((n, peer)) = sock.recv_from(&mut buf) else {
            continue;
        };
        shared.queries.fetch_add(1, Ordering::Relaxed);
        let Ok(query) = Message::from_vec(&buf[..n]) else {
            continue;
        };
        let mode = *shared.mode.lock().unwrap();
        if mode == Mode::Silent {
            continue;
        }
        let reply = answer(&query, &shared.zone.lock().unwrap(), mode);
        if let Ok(bytes) = reply.to_vec() {
            let _ = sock.send_to(&bytes, peer);
        }
    }
}

fn answer(query: &Message, zone: &Zone, mode: Mode) -> Message {
    let mut reply = Message::new(query.metadata.id, MessageType::Response, OpCode::Query);
    reply.metadata.authoritative = true;
    reply.metadata.recursion_desired = query.metadata.recursion_desired;
    reply.queries = query.queries.clone();
    reply.edns = query.edns.clone();
    if mode == Mode::ServFail {
        reply.metadata.response_code = ResponseCode::ServFail;
        return reply;
    }
    let Some(q) = query.queries.first() else {
        reply.metadata.response_code = ResponseCode::FormErr;
        return reply;
    };
    let name = key(&q.name.to_ascii());
    let (ips, srv) = (zone.ips.get(&name), zone.srv.get(&name));
    if ips.is_none() && srv.is_none() {
        reply.metadata.response_code = ResponseCode::NXDomain;
        return reply;
    }
    let owner = q.name.clone();
    let records: Vec<RData> = match q.query_type {
        RecordType::A => ips
            .into_iter()
            .flatten()
            .filter_map(|ip| match ip {
                IpAddr::V4(v4) => Some(RData::A(A(*v4))),
                IpAddr::V6(_) => None,
            })
            .collect(),
        RecordType::AAAA => ips
            .into_iter()
            .flatten()
            .filter_map(|ip| match ip {
                IpAddr::V6(v6) => Some(RData::AAAA(AAAA(*v6))),
                IpAddr::V4(_) => None,
            })
            .collect(),
        RecordType::SRV => srv
            .into_iter()
            .flatten()
            .filter_map(|(target, port)| {
                let t = Name::from_ascii(format!("{target}.")).ok()?;
                Some(RData::SRV(SRV::new(10, 10, *port, t)))
            })
            .collect(),
        _ => Vec::new(),
    };
    for data in records {
        reply
            .answers
            .push(Record::from_rdata(owner.clone(), TTL, data));
    }
    reply
}
