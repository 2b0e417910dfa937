//! Typed snapshots of the XDP counters, summed over CPUs.

use router_common::BackendCounters as CpuCounters;

/// One backend's counters since it was registered, summed over CPUs. Only
/// segments the backend sent are counted (XDP sees ingress only).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendCounters {
    /// SYN-ACKs: connections the backend accepted.
    pub opened: u64,
    /// Segments with FIN: connections the backend closed.
    pub closed: u64,
    /// Segments with RST: connections the backend reset.
    pub reset: u64,
    /// TCP segments from the backend.
    pub packets: u64,
    /// Bytes of those frames, link-layer header included.
    pub bytes: u64,
}

impl BackendCounters {
    /// Connections open now, approximately: `opened - closed - reset`, never
    /// below zero. Retransmitted SYN-ACKs or FINs, and a RST after a FIN, skew
    /// it by one each; the saturation keeps such skew from going negative.
    pub fn live_connections(&self) -> u64 {
        self.opened
            .saturating_sub(self.closed)
            .saturating_sub(self.reset)
    }

    pub(crate) fn sum(per_cpu: &[CpuCounters]) -> Self {
        per_cpu.iter().fold(Self::default(), |a, c| Self {
            opened: a.opened + c.opened,
            closed: a.closed + c.closed,
            reset: a.reset + c.reset,
            packets: a.packets + c.packets,
            bytes: a.bytes + c.bytes,
        })
    }
}

/// Counters over every frame the program saw, summed over CPUs and interfaces.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GlobalCounters {
    /// Every frame.
    pub packets: u64,
    /// Frames cut short or with malformed headers.
    pub parse_failures: u64,
    /// Frames neither IPv4 nor IPv6.
    pub non_ip: u64,
    /// IP packets without a TCP header (other protocols, later fragments).
    pub non_tcp: u64,
    /// TCP segments from a registered backend.
    pub backend_packets: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_cpus_and_saturates_live() {
        let cpu = CpuCounters {
            opened: 2,
            closed: 1,
            reset: 3,
            packets: 10,
            bytes: 100,
        };
        let s = BackendCounters::sum(&[cpu, cpu]);
        assert_eq!((s.opened, s.packets, s.bytes), (4, 20, 200));
        assert_eq!(s.live_connections(), 0);
        let s = BackendCounters {
            opened: 5,
            closed: 1,
            reset: 1,
            ..Default::default()
        };
        assert_eq!(s.live_connections(), 3);
    }
}
