//! eBPF programs of prefix-router: count, per registered backend, the TCP
//! connections it opened (SYN-ACK), closed (FIN) and reset (RST), and its
//! packets and bytes. They observe only: every frame gets `XDP_PASS`, every
//! socket buffer `TC_ACT_UNSPEC` (the next program or the default decides).
//!
//! Two hooks, one count: `router_xdp` for interfaces with native XDP, and
//! `router_tc` at TC ingress for the others (`lo`, drivers without XDP),
//! where generic XDP would copy every packet whole first (decision
//! 0003, docs/decisions/0003-tc-ingress-where-xdp-would-be-generic.md).
//!
//! Both see ingress only; on the router host the backends' packets arrive on
//! the interface toward them, so a segment whose *source* ip:port is
//! registered in `BACKENDS` is one the backend sent.
//!
//! Map layouts, names and capacities live in `router-common`; this file only
//! declares the statics with those names (checked at compile time below).
#![no_std]
#![no_main]

mod parse;

use aya_ebpf::{
    bindings::{TC_ACT_UNSPEC, xdp_action},
    macros::{classifier, map, xdp},
    maps::{HashMap, PerCpuArray},
    programs::{TcContext, XdpContext},
};
use router_common::{
    BACKEND_COUNTERS_MAP, BACKENDS_MAP, BackendCounters, BackendKey, GLOBAL_BACKEND_PACKETS,
    GLOBAL_COUNTER_SLOTS, GLOBAL_COUNTERS_MAP, GLOBAL_NON_IP, GLOBAL_NON_TCP, GLOBAL_PACKETS,
    GLOBAL_PARSE_FAILURES, MAP_BACKEND_SLOTS, TC_PROGRAM, XDP_PROGRAM,
};

use crate::parse::{Frame, Skip, TcpSegment};

/// Backend ip:port -> dense backend index; written by userspace (`set_backends`).
#[map]
static BACKENDS: HashMap<BackendKey, u32> = HashMap::with_max_entries(MAP_BACKEND_SLOTS, 0);

/// Per-CPU counters per dense backend index; summed over CPUs by userspace.
#[map]
static BACKEND_COUNTERS: PerCpuArray<BackendCounters> =
    PerCpuArray::with_max_entries(MAP_BACKEND_SLOTS, 0);

/// Per-CPU global counters at the `GLOBAL_*` offsets (packets, parse failures, ...).
#[map]
static GLOBAL_COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(GLOBAL_COUNTER_SLOTS, 0);

// The statics' identifiers are the map names userspace looks up (the `#[map]`
// macro takes only literals); these asserts tie them to `router-common`.
const _: () = assert!(str_eq(BACKENDS_MAP, "BACKENDS"));
const _: () = assert!(str_eq(BACKEND_COUNTERS_MAP, "BACKEND_COUNTERS"));
const _: () = assert!(str_eq(GLOBAL_COUNTERS_MAP, "GLOBAL_COUNTERS"));
const _: () = assert!(str_eq(XDP_PROGRAM, "router_xdp"));
const _: () = assert!(str_eq(TC_PROGRAM, "router_tc"));

/// TCP flag bits (byte 13 of the TCP header).
const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;

#[xdp]
pub fn router_xdp(ctx: XdpContext) -> u32 {
    bump_global(GLOBAL_PACKETS);
    let bytes = (ctx.data_end() - ctx.data()) as u64;
    note(count(&ctx, bytes));
    xdp_action::XDP_PASS
}

/// Bytes pulled into the linear part when the headers were not all there:
/// Ethernet, a VLAN tag, the longest IP header walked, a TCP header.
const PULL_BYTES: u32 = 14 + 4 + 512 + 60;

#[classifier]
pub fn router_tc(ctx: TcContext) -> i32 {
    bump_global(GLOBAL_PACKETS);
    let len = ctx.len();
    let mut counted = count(&ctx, u64::from(len));
    // A socket buffer's headers are in its linear part on every path seen
    // (loopback, GRO); should one not be, pull them in (a copy) and look again.
    if matches!(counted, Err(Skip::Malformed))
        && ((ctx.data_end() - ctx.data()) as u64) < u64::from(len)
        && ctx.pull_data(len.min(PULL_BYTES)).is_ok()
    {
        counted = count(&ctx, u64::from(len));
    }
    note(counted);
    TC_ACT_UNSPEC
}

/// Counts a segment from a registered backend; `bytes` is the packet's length.
#[inline(always)]
fn count<F: Frame>(ctx: &F, bytes: u64) -> Result<(), Skip> {
    let TcpSegment { key, flags } = parse::tcp_segment(ctx)?;
    let Some(index) = BACKENDS.get_ptr(key) else {
        return Ok(());
    };
    // SAFETY: a non-null pointer returned by a map lookup points at the value,
    // valid for the duration of the program; u32 needs no more alignment than the
    // kernel's 8-byte aligned value storage gives.
    let index = unsafe { *index };
    let Some(counters) = BACKEND_COUNTERS.get_ptr_mut(index) else {
        return Ok(());
    };
    // SAFETY: the pointer is this CPU's slot of a per-CPU array, so no other
    // program run touches it concurrently; it is valid for the program's run.
    let c = unsafe { &mut *counters };
    c.packets += 1;
    c.bytes += bytes;
    if flags & (TCP_SYN | TCP_ACK) == TCP_SYN | TCP_ACK {
        c.opened += 1;
    }
    if flags & TCP_FIN != 0 {
        c.closed += 1;
    }
    if flags & TCP_RST != 0 {
        c.reset += 1;
    }
    bump_global(GLOBAL_BACKEND_PACKETS);
    Ok(())
}

/// Counts why a packet was not attributed.
#[inline(always)]
fn note(counted: Result<(), Skip>) {
    match counted {
        Ok(()) => {}
        Err(Skip::NonIp) => bump_global(GLOBAL_NON_IP),
        Err(Skip::NonTcp) => bump_global(GLOBAL_NON_TCP),
        Err(Skip::Malformed) => bump_global(GLOBAL_PARSE_FAILURES),
    }
}

#[inline(always)]
fn bump_global(offset: u32) {
    if let Some(p) = GLOBAL_COUNTERS.get_ptr_mut(offset) {
        // SAFETY: this CPU's slot of a per-CPU array: no concurrent writer.
        unsafe { *p += 1 };
    }
}

const fn str_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

/// The kernel lets only GPL-compatible programs call some helpers.
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
