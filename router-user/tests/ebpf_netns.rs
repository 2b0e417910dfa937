//! Real TCP connections counted by XDP, inside network namespaces this test
//! creates (and removes, through a drop guard, even when it fails). Traffic
//! only ever goes to addresses inside those namespaces.
//!
//! - veth: backends (std `TcpListener`s) in namespace S, the client side in
//!   namespace C, a veth pair between them; XDP attached to C's end (the
//!   interface routing to the backends), native mode expected.
//! - lo: backends and clients in one namespace on 127.0.0.1; `lo` has no
//!   native XDP, so `auto` must fall back to the TC ingress program; generic
//!   (SKB) XDP, asked for, must count the same.
//!
//! Each backend accepts connections, then closes some (FIN), resets some
//! (SO_LINGER 0, then close: RST) and keeps the rest open; the counters must
//! match exactly.

mod ebpf_support;

use std::fs::File;
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd as _;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use prefix_router::control::ebpf::{BackendCounters, EbpfConfig, EbpfLoad, EbpfMode, XdpMode};

/// A network namespace made by this test; deleted on drop.
struct Netns(String);

impl Netns {
    fn new(tag: &str) -> Self {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "prt{}{tag}{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        ip(&["netns", "add", &name]);
        let ns = Self(name);
        ns.exec(&["ip", "link", "set", "lo", "up"]);
        ns
    }

    /// Runs a command inside the namespace; panics when it fails.
    fn exec(&self, args: &[&str]) {
        let mut all = vec!["netns", "exec", &self.0];
        all.extend(args);
        ip(&all);
    }

    /// Runs `f` on a thread that joined this namespace. Sockets made there stay
    /// in the namespace wherever they are used afterwards.
    fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/run/netns/{}", self.0);
        std::thread::spawn(move || {
            let ns = File::open(&path).expect("open the namespace");
            // SAFETY: setns on a valid namespace fd moves only this thread (a
            // network namespace may be joined by one thread of a process).
            let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
            f()
        })
        .join()
        .expect("thread in namespace")
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .expect("run ip (iproute2)");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// What one backend does with the connections it accepts.
struct Plan {
    addr: SocketAddr,
    /// Connections the client opens.
    open: usize,
    /// Of those, closed by the backend with FIN.
    fin: usize,
    /// Then, reset by the backend with RST.
    rst: usize,
}

/// Opens, closes and resets connections per `plans`; returns what stays open
/// (dropped by the caller after the counters are checked).
fn exercise(
    server_ns: &Netns,
    client_ns: &Netns,
    plans: &[Plan],
) -> Vec<(TcpStream, Option<TcpStream>)> {
    let addrs: Vec<SocketAddr> = plans.iter().map(|p| p.addr).collect();
    let listeners = server_ns.run(move || {
        addrs
            .iter()
            .map(|a| TcpListener::bind(a).expect("bind backend"))
            .collect::<Vec<_>>()
    });
    let mut kept = Vec::new();
    for (plan, listener) in plans.iter().zip(&listeners) {
        let (addr, n) = (plan.addr, plan.open);
        let clients = client_ns.run(move || {
            (0..n)
                .map(|_| {
                    TcpStream::connect_timeout(&addr, Duration::from_secs(2)).expect("connect")
                })
                .collect::<Vec<_>>()
        });
        for (i, mut client) in clients.into_iter().enumerate() {
            let (mut server, _) = listener.accept().expect("accept");
            server.write_all(b"hello").unwrap();
            let mut buf = [0u8; 5];
            client.read_exact(&mut buf).unwrap();
            if i < plan.fin {
                drop(server); // FIN
                kept.push((client, None));
            } else if i < plan.fin + plan.rst {
                socket2::SockRef::from(&server)
                    .set_linger(Some(Duration::ZERO))
                    .unwrap();
                drop(server); // RST
                kept.push((client, None));
            } else {
                kept.push((client, Some(server)));
            }
        }
    }
    kept
}

/// Polls until the counters match `plans` (segments may still be in flight).
fn assert_counts(load: &EbpfLoad, plans: &[Plan]) {
    let want: Vec<(u64, u64, u64)> = plans
        .iter()
        .map(|p| (p.open as u64, p.fin as u64, p.rst as u64))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let snap = load.snapshot().unwrap();
        let got: Vec<_> = snap.iter().map(|c| (c.opened, c.closed, c.reset)).collect();
        if got == want {
            for (c, p) in snap.iter().zip(plans) {
                check_traffic(c, p);
            }
            return;
        }
        assert!(
            Instant::now() < deadline,
            "counters (opened, closed, reset) {got:?}, want {want:?}; globals {:?}",
            load.globals().unwrap()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn check_traffic(c: &BackendCounters, p: &Plan) {
    // Per connection at least: SYN-ACK, the data segment, an ACK or FIN/RST.
    assert!(c.packets >= 2 * p.open as u64, "{c:?}");
    assert!(c.bytes >= c.packets * 54, "{c:?}");
    assert_eq!(c.live_connections(), (p.open - p.fin - p.rst) as u64);
}

#[test]
fn veth_native_counts_connections() {
    if !ebpf_support::privileged("veth_native_counts_connections") {
        return;
    }
    let server = Netns::new("s");
    let client = Netns::new("c");
    let (vc, vs) = (
        format!("vc{}", std::process::id()),
        format!("vs{}", std::process::id()),
    );
    ip(&[
        "link", "add", &vc, "netns", &client.0, "type", "veth", "peer", "name", &vs, "netns",
        &server.0,
    ]);
    client.exec(&["ip", "addr", "add", "10.201.0.1/24", "dev", &vc]);
    server.exec(&["ip", "addr", "add", "10.201.0.2/24", "dev", &vs]);
    client.exec(&[
        "ip",
        "-6",
        "addr",
        "add",
        "fd00:c9::1/64",
        "dev",
        &vc,
        "nodad",
    ]);
    server.exec(&[
        "ip",
        "-6",
        "addr",
        "add",
        "fd00:c9::2/64",
        "dev",
        &vs,
        "nodad",
    ]);
    client.exec(&["ip", "link", "set", &vc, "up"]);
    server.exec(&["ip", "link", "set", &vs, "up"]);

    let plans = [
        Plan {
            addr: "10.201.0.2:18001".parse().unwrap(),
            open: 4,
            fin: 1,
            rst: 2,
        },
        Plan {
            addr: "[fd00:c9::2]:18002".parse().unwrap(),
            open: 3,
            fin: 2,
            rst: 1,
        },
    ];
    // A backend not registered: its connections must not be counted anywhere.
    let stranger = [Plan {
        addr: "10.201.0.2:18003".parse().unwrap(),
        open: 2,
        fin: 1,
        rst: 1,
    }];
    let backends: Vec<SocketAddr> = plans.iter().map(|p| p.addr).collect();
    let load = client
        .run(move || EbpfLoad::start(&required(XdpMode::Auto), &backends))
        .expect("start")
        .expect("required mode loads");
    assert_eq!(load.attached(), [(vc.clone(), XdpMode::Native)]);

    let _open = exercise(&server, &client, &plans);
    let _stranger = exercise(&server, &client, &stranger);
    assert_counts(&load, &plans);
}

#[test]
fn lo_falls_back_to_tc_ingress() {
    if !ebpf_support::privileged("lo_falls_back_to_tc_ingress") {
        return;
    }
    counts_on_lo(XdpMode::Auto, XdpMode::Tc, 18011);
}

#[test]
fn lo_counts_the_same_in_generic_xdp() {
    if !ebpf_support::privileged("lo_counts_the_same_in_generic_xdp") {
        return;
    }
    counts_on_lo(XdpMode::Skb, XdpMode::Skb, 18031);
}

/// Two backends on `lo` of a new namespace, the program attached as `ask`
/// says: it must take `took`, and count every connection exactly.
fn counts_on_lo(ask: XdpMode, took: XdpMode, port: u16) {
    let ns = Netns::new("l");
    let plans = [
        Plan {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            open: 3,
            fin: 1,
            rst: 1,
        },
        Plan {
            addr: SocketAddr::from(([127, 0, 0, 1], port + 1)),
            open: 2,
            fin: 0,
            rst: 2,
        },
    ];
    let backends: Vec<SocketAddr> = plans.iter().map(|p| p.addr).collect();
    let load = ns
        .run(move || EbpfLoad::start(&required(ask), &backends))
        .expect("start")
        .expect("required mode loads");
    assert_eq!(load.attached(), [("lo".to_owned(), took)]);
    let _open = exercise(&ns, &ns, &plans);
    assert_counts(&load, &plans);
}

#[test]
fn native_only_on_lo_is_refused() {
    if !ebpf_support::privileged("native_only_on_lo_is_refused") {
        return;
    }
    let ns = Netns::new("n");
    let backends: Vec<SocketAddr> = vec!["127.0.0.1:18021".parse().unwrap()];
    let result = ns.run(move || EbpfLoad::start(&required(XdpMode::Native), &backends));
    let err = result.expect_err("lo has no native XDP");
    assert!(err.to_string().contains("lo (native)"), "{err}");
}

fn required(xdp_mode: XdpMode) -> EbpfConfig {
    EbpfConfig {
        mode: EbpfMode::Required,
        interfaces: Vec::new(),
        xdp_mode,
        ..Default::default()
    }
}
