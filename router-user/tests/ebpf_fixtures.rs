//! The XDP program on synthetic frames through `BPF_PROG_TEST_RUN` (aya 0.14's
//! `TestRun` for `Xdp`, via `EbpfLoad::test_run`). Each fixture states the
//! input frame, the expected action (always `XDP_PASS`) and the expected
//! counter change. The kernel refuses test frames shorter than an Ethernet
//! header, so the shortest fixture is a bare Ethernet header.

mod ebpf_support;

use std::net::SocketAddr;
use std::time::Instant;

use prefix_router::control::ebpf::{
    BackendCounters, EbpfConfig, EbpfLoad, EbpfMode, GlobalCounters,
};

const XDP_PASS: u32 = 2;
const FIN: u8 = 0x01;
const SYN: u8 = 0x02;
const RST: u8 = 0x04;
const PSH: u8 = 0x08;
const ACK: u8 = 0x10;

const B4: [u8; 4] = [10, 0, 0, 2];
const B6: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];
const CLIENT4: [u8; 4] = [10, 0, 0, 1];
const CLIENT6: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
const PORT: u16 = 8000;

fn backends() -> Vec<SocketAddr> {
    vec![
        "10.0.0.2:8000".parse().unwrap(),
        "[fd00::2]:8000".parse().unwrap(),
    ]
}

// ---- frame builders -------------------------------------------------------

fn eth(ethertype: u16, l3: &[u8]) -> Vec<u8> {
    let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2];
    f.extend(ethertype.to_be_bytes());
    f.extend(l3);
    f
}

fn tcp(sport: u16, flags: u8, payload: &[u8]) -> Vec<u8> {
    let mut t = Vec::new();
    t.extend(sport.to_be_bytes());
    t.extend(40_000u16.to_be_bytes());
    t.extend([0, 0, 0, 1, 0, 0, 0, 1]); // seq, ack
    t.extend([5 << 4, flags, 0xff, 0xff, 0, 0, 0, 0]); // doff=5, flags, window, csum, urg
    t.extend(payload);
    t
}

fn ipv4_opts(src: [u8; 4], dst: [u8; 4], proto: u8, options: &[u8], l4: &[u8]) -> Vec<u8> {
    assert_eq!(options.len() % 4, 0);
    let ihl = 5 + options.len() / 4;
    let total = (ihl * 4 + l4.len()) as u16;
    let mut h = vec![0x40 | ihl as u8, 0];
    h.extend(total.to_be_bytes());
    h.extend([0, 1, 0x40, 0, 64, proto, 0, 0]); // id, DF, ttl, proto, csum
    h.extend(src);
    h.extend(dst);
    h.extend(options);
    h.extend(l4);
    eth(0x0800, &h)
}

fn ipv4(src: [u8; 4], dst: [u8; 4], l4: &[u8]) -> Vec<u8> {
    ipv4_opts(src, dst, 6, &[], l4)
}

/// IPv6 with `ext` extension headers already encoded; `next` is the first one's type.
fn ipv6_ext(src: [u8; 16], next: u8, ext: &[u8], l4: &[u8]) -> Vec<u8> {
    let mut h = vec![0x60, 0, 0, 0];
    h.extend(((ext.len() + l4.len()) as u16).to_be_bytes());
    h.extend([next, 64]);
    h.extend(src);
    h.extend(CLIENT6);
    h.extend(ext);
    h.extend(l4);
    eth(0x86dd, &h)
}

fn ipv6(src: [u8; 16], l4: &[u8]) -> Vec<u8> {
    ipv6_ext(src, 6, &[], l4)
}

/// An 8-byte options header (hop-by-hop, destination options) followed by `next`.
fn opts_hdr(next: u8) -> [u8; 8] {
    [next, 0, 1, 4, 0, 0, 0, 0] // PadN
}

// ---- fixtures -------------------------------------------------------------

struct Fixture {
    name: &'static str,
    frame: Vec<u8>,
    /// Backend index and the change of its counters (bytes = frame length when
    /// packets is 1).
    backend: Option<(usize, BackendCounters)>,
    global: GlobalCounters,
}

fn counted(index: usize, flags: u8, frame: &[u8]) -> Option<(usize, BackendCounters)> {
    let c = BackendCounters {
        opened: u64::from(flags & (SYN | ACK) == SYN | ACK),
        closed: u64::from(flags & FIN != 0),
        reset: u64::from(flags & RST != 0),
        packets: 1,
        bytes: frame.len() as u64,
    };
    Some((index, c))
}

fn g(parse_failures: u64, non_ip: u64, non_tcp: u64, backend_packets: u64) -> GlobalCounters {
    GlobalCounters {
        packets: 1,
        parse_failures,
        non_ip,
        non_tcp,
        backend_packets,
    }
}

fn from_backend(name: &'static str, index: usize, flags: u8, frame: Vec<u8>) -> Fixture {
    Fixture {
        name,
        backend: counted(index, flags, &frame),
        frame,
        global: g(0, 0, 0, 1),
    }
}

fn ignored(name: &'static str, frame: Vec<u8>, global: GlobalCounters) -> Fixture {
    Fixture {
        name,
        frame,
        backend: None,
        global,
    }
}

fn fixtures() -> Vec<Fixture> {
    let syn_ack = tcp(PORT, SYN | ACK, &[]);
    let fin = tcp(PORT, FIN | ACK, &[]);
    let rst = tcp(PORT, RST, &[]);
    let data = tcp(PORT, PSH | ACK, &[b'x'; 100]);
    let ip_opts = [0x94, 0x04, 0, 0, 0x01, 0x01, 0x01, 0x00]; // router alert, NOPs, EOL
    let mut frag_first = vec![6, 0, 0, 0, 0, 0, 0, 7]; // offset 0, more fragments
    frag_first[3] = 1;
    let frag_later = [6, 0, 0x05, 0xa8, 0, 0, 0, 7]; // offset 181 (x8)
    let mut six_ext = Vec::new();
    for _ in 0..5 {
        six_ext.extend(opts_hdr(60));
    }
    let last = six_ext.len() - 8;
    six_ext[last] = 6;
    let mut vlan = eth(0x8100, &[0, 7, 0x08, 0x00]);
    vlan.extend(&ipv4(B4, CLIENT4, &syn_ack)[14..]);
    let mut doff4 = tcp(PORT, SYN | ACK, &[]);
    doff4[12] = 4 << 4;
    let mut doff10 = tcp(PORT, SYN | ACK, &[]);
    doff10[12] = 10 << 4;
    let mut ihl3 = ipv4(B4, CLIENT4, &syn_ack);
    ihl3[14] = 0x43;

    vec![
        from_backend("v4 SYN-ACK", 0, SYN | ACK, ipv4(B4, CLIENT4, &syn_ack)),
        from_backend("v4 FIN", 0, FIN | ACK, ipv4(B4, CLIENT4, &fin)),
        from_backend("v4 RST", 0, RST, ipv4(B4, CLIENT4, &rst)),
        from_backend("v4 data", 0, PSH | ACK, ipv4(B4, CLIENT4, &data)),
        from_backend(
            "v4 with options",
            0,
            SYN | ACK,
            ipv4_opts(B4, CLIENT4, 6, &ip_opts, &syn_ack),
        ),
        from_backend("v4 in a VLAN tag", 0, SYN | ACK, vlan),
        from_backend("v6 SYN-ACK", 1, SYN | ACK, ipv6(B6, &syn_ack)),
        from_backend("v6 FIN", 1, FIN | ACK, ipv6(B6, &fin)),
        from_backend("v6 data", 1, PSH | ACK, ipv6(B6, &data)),
        from_backend(
            "v6 hop-by-hop then RST",
            1,
            RST,
            ipv6_ext(B6, 0, &opts_hdr(6), &rst),
        ),
        from_backend(
            "v6 first fragment FIN",
            1,
            FIN | ACK,
            ipv6_ext(B6, 44, &frag_first, &fin),
        ),
        ignored(
            "v6 later fragment",
            ipv6_ext(B6, 44, &frag_later, &data),
            g(0, 0, 1, 0),
        ),
        ignored(
            "v6 five extension headers (over the bound)",
            ipv6_ext(B6, 60, &six_ext, &syn_ack),
            g(1, 0, 0, 0),
        ),
        ignored(
            "v4 non-registered port",
            ipv4(B4, CLIENT4, &tcp(8001, SYN | ACK, &[])),
            g(0, 0, 0, 0),
        ),
        ignored(
            "v6 non-registered address",
            ipv6(CLIENT6, &syn_ack),
            g(0, 0, 0, 0),
        ),
        ignored(
            "v4 SYN-ACK toward the backend (client source)",
            ipv4(CLIENT4, B4, &tcp(40_000, SYN | ACK, &[])),
            g(0, 0, 0, 0),
        ),
        ignored(
            "v4 UDP from the backend's ip:port",
            ipv4_opts(B4, CLIENT4, 17, &[], &[0x1f, 0x40, 0x9c, 0x40, 0, 8, 0, 0]),
            g(0, 0, 1, 0),
        ),
        ignored("ARP", eth(0x0806, &[0; 28]), g(0, 1, 0, 0)),
        ignored("bare Ethernet header", eth(0x0800, &[]), g(1, 0, 0, 0)),
        ignored(
            "truncated IPv4 header",
            ipv4(B4, CLIENT4, &syn_ack)[..14 + 10].to_vec(),
            g(1, 0, 0, 0),
        ),
        ignored(
            "truncated IPv6 header",
            ipv6(B6, &syn_ack)[..14 + 30].to_vec(),
            g(1, 0, 0, 0),
        ),
        ignored("IPv4 IHL 3", ihl3, g(1, 0, 0, 0)),
        ignored(
            "IPv4 options cut short",
            ipv4_opts(B4, CLIENT4, 6, &ip_opts, &[])[..14 + 22].to_vec(),
            g(1, 0, 0, 0),
        ),
        ignored(
            "truncated TCP header",
            ipv4(B4, CLIENT4, &syn_ack[..8]),
            g(1, 0, 0, 0),
        ),
        ignored(
            "TCP data offset 4",
            ipv4(B4, CLIENT4, &doff4),
            g(1, 0, 0, 0),
        ),
        ignored(
            "TCP options cut short (data offset 10, 20 bytes)",
            ipv4(B4, CLIENT4, &doff10),
            g(1, 0, 0, 0),
        ),
    ]
}

fn delta(after: &BackendCounters, before: &BackendCounters) -> BackendCounters {
    BackendCounters {
        opened: after.opened - before.opened,
        closed: after.closed - before.closed,
        reset: after.reset - before.reset,
        packets: after.packets - before.packets,
        bytes: after.bytes - before.bytes,
    }
}

fn global_delta(after: &GlobalCounters, before: &GlobalCounters) -> GlobalCounters {
    GlobalCounters {
        packets: after.packets - before.packets,
        parse_failures: after.parse_failures - before.parse_failures,
        non_ip: after.non_ip - before.non_ip,
        non_tcp: after.non_tcp - before.non_tcp,
        backend_packets: after.backend_packets - before.backend_packets,
    }
}

#[test]
fn fixtures_pass_and_count() {
    if !ebpf_support::privileged("fixtures_pass_and_count") {
        return;
    }
    let load = EbpfLoad::load_unattached(&backends()).expect("load the XDP program");
    let mut failures = Vec::new();
    for f in fixtures() {
        let before = load.snapshot().unwrap();
        let g_before = load.globals().unwrap();
        let action = load.test_run(&f.frame).expect("BPF_PROG_TEST_RUN");
        let after = load.snapshot().unwrap();
        let got_global = global_delta(&load.globals().unwrap(), &g_before);
        let mut want = vec![BackendCounters::default(); before.len()];
        if let Some((i, c)) = f.backend {
            want[i] = c;
        }
        let got: Vec<_> = after
            .iter()
            .zip(&before)
            .map(|(a, b)| delta(a, b))
            .collect();
        if action != XDP_PASS || got != want || got_global != f.global {
            failures.push(format!(
                "{}: action {action} (want {XDP_PASS})\n  backends {got:?}\n  want     {want:?}\n  \
                 globals {got_global:?}\n  want    {:?}",
                f.name, f.global
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "fixtures failed:\n{}",
        failures.join("\n")
    );
}

#[test]
fn set_backends_moves_counters_with_the_backend() {
    if !ebpf_support::privileged("set_backends_moves_counters_with_the_backend") {
        return;
    }
    let [a, b] = backends()[..] else {
        unreachable!()
    };
    let c: SocketAddr = "10.0.0.3:8000".parse().unwrap();
    let mut load = EbpfLoad::load_unattached(&[a, b]).unwrap();
    let syn_ack_v6 = ipv6(B6, &tcp(PORT, SYN | ACK, &[]));
    load.test_run(&syn_ack_v6).unwrap();
    assert_eq!(load.snapshot().unwrap()[1].opened, 1);

    // b moves from index 1 to 0 and keeps its count; a is gone.
    load.set_backends(&[b]).unwrap();
    let s = load.snapshot().unwrap();
    assert_eq!((s.len(), s[0].opened), (1, 1));
    load.test_run(&ipv4(B4, CLIENT4, &tcp(PORT, SYN | ACK, &[])))
        .unwrap();
    assert_eq!(
        load.globals().unwrap().backend_packets,
        1,
        "a is unregistered"
    );

    // c is new at index 0 and starts at zero; b moves to 1.
    load.set_backends(&[c, b]).unwrap();
    let s = load.snapshot().unwrap();
    assert_eq!((s[0].opened, s[0].packets, s[1].opened), (0, 0, 1));
    assert_eq!(load.backends(), [c, b]);
    assert!(load.set_backends(&[c, c]).is_err(), "duplicates refused");
}

#[test]
fn start_modes() {
    if !ebpf_support::privileged("start_modes") {
        return;
    }
    let off = EbpfConfig {
        mode: EbpfMode::Off,
        ..Default::default()
    };
    assert!(EbpfLoad::start(&off, &backends()).unwrap().is_none());
    let mut cfg = EbpfConfig {
        mode: EbpfMode::Required,
        interfaces: vec!["prt-no-such-if".into()],
        ..Default::default()
    };
    let err = EbpfLoad::start(&cfg, &backends()).unwrap_err();
    assert!(err.to_string().contains("prt-no-such-if"), "{err}");
    cfg.mode = EbpfMode::Auto;
    assert!(EbpfLoad::start(&cfg, &backends()).unwrap().is_none());
}

/// Cost of one `snapshot()` (what the router's refresh thread pays every
/// ~100 ms), printed for 4 and 64 backends.
#[test]
fn snapshot_cost() {
    if !ebpf_support::privileged("snapshot_cost") {
        return;
    }
    for n in [4usize, 64] {
        let addrs: Vec<SocketAddr> = (0..n)
            .map(|i| SocketAddr::from(([10, 1, (i / 250) as u8, (i % 250) as u8 + 1], 8000)))
            .collect();
        let load = EbpfLoad::load_unattached(&addrs).unwrap();
        let rounds = 2_000;
        let start = Instant::now();
        for _ in 0..rounds {
            assert_eq!(load.snapshot().unwrap().len(), n);
        }
        let per = start.elapsed() / rounds;
        eprintln!("snapshot() with {n} backends: {per:?} per call ({rounds} calls)");
        assert!(per.as_millis() < 10, "snapshot() too slow: {per:?}");
    }
}
