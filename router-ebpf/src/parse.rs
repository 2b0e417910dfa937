//! Header parsing: Ethernet (one optional 802.1Q tag), IPv4 (with options),
//! IPv6 (up to `MAX_IPV6_EXT_HEADERS` extension headers), TCP. Every read goes
//! through `ptr_at`, which checks the bounds the verifier demands.

use core::mem;

use aya_ebpf::programs::{TcContext, XdpContext};
use router_common::BackendKey;

/// A packet's bytes as the program may read them directly: an XDP frame, or
/// the linear part of a socket buffer at TC ingress (which starts at the
/// Ethernet header, as an XDP frame does).
pub trait Frame {
    fn data(&self) -> usize;
    fn data_end(&self) -> usize;
}

impl Frame for XdpContext {
    #[inline(always)]
    fn data(&self) -> usize {
        XdpContext::data(self)
    }
    #[inline(always)]
    fn data_end(&self) -> usize {
        XdpContext::data_end(self)
    }
}

impl Frame for TcContext {
    #[inline(always)]
    fn data(&self) -> usize {
        TcContext::data(self)
    }
    #[inline(always)]
    fn data_end(&self) -> usize {
        TcContext::data_end(self)
    }
}

/// Why a frame carries no TCP segment we can attribute.
pub enum Skip {
    /// Neither IPv4 nor IPv6.
    NonIp,
    /// IP without a TCP header: other protocol, or a later fragment.
    NonTcp,
    /// Cut short or malformed headers.
    Malformed,
}

/// What the counters need from a TCP segment: its source and its flags.
pub struct TcpSegment {
    pub key: BackendKey,
    pub flags: u8,
}

const ETH_HLEN: usize = 14;
const VLAN_HLEN: usize = 4;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;
const IPPROTO_TCP: u8 = 6;
const IPV6_HLEN: usize = 40;
/// Extension headers walked before giving up (counted as a parse failure). Real
/// traffic toward a backend carries none; 4 covers hop-by-hop, routing,
/// fragment and destination options while keeping the verifier's work small.
const MAX_IPV6_EXT_HEADERS: usize = 4;
/// Largest L4 offset accepted: keeps offsets bounded for the verifier.
const MAX_L4_OFFSET: usize = 512;

/// Pointer to a `T` at `offset` in the frame, or `Malformed` when the frame is
/// shorter. The only way this program touches packet memory.
#[inline(always)]
fn ptr_at<T>(ctx: &impl Frame, offset: usize) -> Result<*const T, Skip> {
    let start = ctx.data();
    let end = ctx.data_end();
    if start + offset + mem::size_of::<T>() > end {
        return Err(Skip::Malformed);
    }
    Ok((start + offset) as *const T)
}

/// `N` bytes at `offset`, copied out of the frame.
#[inline(always)]
fn bytes<const N: usize>(ctx: &impl Frame, offset: usize) -> Result<[u8; N], Skip> {
    let p = ptr_at::<[u8; N]>(ctx, offset)?;
    // SAFETY: `ptr_at` checked that `N` bytes from `p` lie inside the frame; a
    // byte array has alignment 1.
    Ok(unsafe { p.read() })
}

#[inline(always)]
fn be16(b: [u8; 2]) -> u16 {
    u16::from_be_bytes(b)
}

#[inline(always)]
pub fn tcp_segment<F: Frame>(ctx: &F) -> Result<TcpSegment, Skip> {
    let mut l3 = ETH_HLEN;
    let mut proto = be16(bytes::<2>(ctx, 12)?);
    if proto == ETH_P_8021Q || proto == ETH_P_8021AD {
        proto = be16(bytes::<2>(ctx, ETH_HLEN + 2)?);
        l3 += VLAN_HLEN;
    }
    let (addr, l4) = match proto {
        ETH_P_IP => ipv4(ctx, l3)?,
        ETH_P_IPV6 => ipv6(ctx, l3)?,
        _ => return Err(Skip::NonIp),
    };
    if l4 > MAX_L4_OFFSET {
        return Err(Skip::Malformed);
    }
    let tcp = bytes::<20>(ctx, l4)?;
    let doff = (tcp[12] >> 4) as usize * 4;
    if doff < 20 || ctx.data() + l4 + doff > ctx.data_end() {
        return Err(Skip::Malformed);
    }
    Ok(TcpSegment {
        key: BackendKey::v6(addr, be16([tcp[0], tcp[1]])),
        flags: tcp[13],
    })
}

/// Source address (IPv4-mapped) and TCP header offset of an IPv4 packet.
#[inline(always)]
fn ipv4<F: Frame>(ctx: &F, l3: usize) -> Result<([u8; 16], usize), Skip> {
    let ip = bytes::<20>(ctx, l3)?;
    let ihl = (ip[0] & 0x0f) as usize * 4;
    if ip[0] >> 4 != 4 || ihl < 20 {
        return Err(Skip::Malformed);
    }
    // Options: the whole header must be in the frame.
    if ctx.data() + l3 + ihl > ctx.data_end() {
        return Err(Skip::Malformed);
    }
    if ip[9] != IPPROTO_TCP || be16([ip[6], ip[7]]) & 0x1fff != 0 {
        return Err(Skip::NonTcp);
    }
    let key = BackendKey::v4([ip[12], ip[13], ip[14], ip[15]], 0);
    Ok((key.addr, l3 + ihl))
}

/// Source address and TCP header offset of an IPv6 packet, after walking up to
/// `MAX_IPV6_EXT_HEADERS` extension headers.
#[inline(always)]
fn ipv6<F: Frame>(ctx: &F, l3: usize) -> Result<([u8; 16], usize), Skip> {
    let ip = bytes::<8>(ctx, l3)?;
    if ip[0] >> 4 != 6 {
        return Err(Skip::Malformed);
    }
    let addr = bytes::<16>(ctx, l3 + 8)?;
    let mut next = ip[6];
    let mut off = l3 + IPV6_HLEN;
    for _ in 0..MAX_IPV6_EXT_HEADERS {
        match next {
            IPPROTO_TCP => return Ok((addr, off)),
            // Hop-by-hop, routing, destination options: length in 8-byte units,
            // not counting the first 8.
            0 | 43 | 60 => {
                let h = bytes::<2>(ctx, off)?;
                next = h[0];
                off += (h[1] as usize + 1) * 8;
            }
            // Fragment: fixed 8 bytes; only the first fragment has the TCP header.
            44 => {
                let h = bytes::<4>(ctx, off)?;
                if be16([h[2], h[3]]) & 0xfff8 != 0 {
                    return Err(Skip::NonTcp);
                }
                next = h[0];
                off += 8;
            }
            // Authentication header: length in 4-byte units, minus 2.
            51 => {
                let h = bytes::<2>(ctx, off)?;
                next = h[0];
                off += (h[1] as usize + 2) * 4;
            }
            _ => return Err(Skip::NonTcp),
        }
        if off > MAX_L4_OFFSET {
            return Err(Skip::Malformed);
        }
    }
    if next == IPPROTO_TCP {
        Ok((addr, off))
    } else {
        Err(Skip::Malformed)
    }
}
