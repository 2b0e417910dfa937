//! Layouts shared by `router-ebpf` (the XDP program) and `router-user`.
//!
//! Every map's name, type, capacity and value layout is defined here once.
//! All types are `#[repr(C)]`, hold no `bool` and no implicit padding, so the
//! kernel and userspace read the same bytes. With the `user` feature they
//! implement `aya::Pod`.
#![no_std]

/// Most backends the registry and the per-backend counters can hold. Sized for a
/// large fleet; a per-CPU slot costs 40 bytes, so 1024 slots cost 40 KiB per CPU.
pub const MAP_BACKEND_SLOTS: u32 = 1024;

/// Map name: `HashMap<BackendKey, u32>`, backend ip:port -> dense backend index.
/// Written by userspace, read by XDP on every TCP packet.
pub const BACKENDS_MAP: &str = "BACKENDS";
/// Map name: `PerCpuArray<BackendCounters>` of `MAP_BACKEND_SLOTS` slots, indexed by the
/// dense backend index. Written by XDP, summed over CPUs by userspace.
pub const BACKEND_COUNTERS_MAP: &str = "BACKEND_COUNTERS";
/// Map name: `PerCpuArray<u64>` of `GLOBAL_COUNTER_SLOTS` slots, one per `GLOBAL_*` offset.
pub const GLOBAL_COUNTERS_MAP: &str = "GLOBAL_COUNTERS";
/// Name of the XDP program in the object.
pub const XDP_PROGRAM: &str = "router_xdp";
/// Name of the TC ingress program in the eBPF object (interfaces without native XDP).
pub const TC_PROGRAM: &str = "router_tc";

/// Offsets into `GLOBAL_COUNTERS`.
/// Every frame the program saw.
pub const GLOBAL_PACKETS: u32 = 0;
/// Frames cut short or with a malformed header (bad IHL, TCP data offset, too many
/// IPv6 extension headers).
pub const GLOBAL_PARSE_FAILURES: u32 = 1;
/// Frames that are neither IPv4 nor IPv6 (ARP, ...).
pub const GLOBAL_NON_IP: u32 = 2;
/// IP packets that carry no TCP header (UDP, ICMP, later fragments).
pub const GLOBAL_NON_TCP: u32 = 3;
/// TCP segments whose source ip:port is a registered backend.
pub const GLOBAL_BACKEND_PACKETS: u32 = 4;
/// Number of global counters.
pub const GLOBAL_COUNTER_SLOTS: u32 = 5;

/// Key of `BACKENDS`: a backend's source address and port as seen in packets.
///
/// IPv4 addresses are stored IPv4-mapped (`::ffff:a.b.c.d`), so one key type
/// holds both families. 20 bytes, alignment 2, no implicit padding.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BackendKey {
    /// IPv6 address, or IPv4-mapped IPv6 address, in network byte order.
    pub addr: [u8; 16],
    /// TCP port in host byte order.
    pub port: u16,
    /// Always zero: makes the tail padding explicit so hashing is stable.
    pub pad: u16,
}

impl BackendKey {
    /// Key of an IPv4 backend; `addr` is the address's bytes in network order.
    pub const fn v4(addr: [u8; 4], port: u16) -> Self {
        let [a, b, c, d] = addr;
        Self {
            addr: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, a, b, c, d],
            port,
            pad: 0,
        }
    }

    /// Key of an IPv6 backend; `addr` is the address's bytes in network order.
    pub const fn v6(addr: [u8; 16], port: u16) -> Self {
        Self { addr, port, pad: 0 }
    }
}

/// One backend's counters on one CPU (value of `BACKEND_COUNTERS`).
/// Only packets whose source is the backend are counted (XDP sees ingress only).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendCounters {
    /// SYN-ACK segments: connections the backend accepted.
    pub opened: u64,
    /// Segments with FIN: connections the backend closed (or half-closed).
    pub closed: u64,
    /// Segments with RST: connections the backend reset.
    pub reset: u64,
    /// TCP segments from the backend.
    pub packets: u64,
    /// Bytes of those frames, link-layer header included.
    pub bytes: u64,
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: `BackendKey` is `#[repr(C)]`, `Copy`, made only of integers and byte
    // arrays with no implicit padding (16 + 2 + 2 bytes, alignment 2); every bit
    // pattern is valid.
    unsafe impl aya::Pod for super::BackendKey {}
    // SAFETY: `BackendCounters` is `#[repr(C)]`, `Copy`, five `u64`s, no padding;
    // every bit pattern is valid.
    unsafe impl aya::Pod for super::BackendCounters {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_have_no_padding() {
        assert_eq!(core::mem::size_of::<BackendKey>(), 20);
        assert_eq!(core::mem::size_of::<BackendCounters>(), 40);
    }

    #[test]
    fn v4_keys_are_ipv4_mapped() {
        let k = BackendKey::v4([10, 0, 0, 1], 8000);
        assert_eq!(k.addr[10..], [0xff, 0xff, 10, 0, 0, 1]);
        assert_eq!(k.port, 8000);
    }
}
