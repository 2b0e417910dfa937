//! The backend registry (ip:port -> dense index) and reading the counters.

use std::net::SocketAddr;

use aya::maps::PerCpuValues;
use router_common::{
    BackendCounters as CpuCounters, BackendKey, GLOBAL_BACKEND_PACKETS, GLOBAL_NON_IP,
    GLOBAL_NON_TCP, GLOBAL_PACKETS, GLOBAL_PARSE_FAILURES, MAP_BACKEND_SLOTS,
};

use super::{BackendCounters, EbpfError, EbpfLoad, GlobalCounters};

/// The registry key of a backend: IPv4 as IPv4-mapped IPv6, port in host order.
pub(crate) fn key(addr: SocketAddr) -> BackendKey {
    match addr {
        SocketAddr::V4(a) => BackendKey::v4(a.ip().octets(), a.port()),
        SocketAddr::V6(a) => BackendKey::v6(a.ip().octets(), a.port()),
    }
}

impl EbpfLoad {
    /// Rewrites the registry: dense index = position in `backends`. A backend
    /// that stays keeps its counters (moved to its new index); a new one starts
    /// at zero. Segments counted during the rewrite itself (a few map syscalls)
    /// may land on the old index and be lost. With no interfaces configured,
    /// interfaces routing to new backends are attached too.
    pub fn set_backends(&mut self, backends: &[SocketAddr]) -> Result<(), EbpfError> {
        if backends.len() > MAP_BACKEND_SLOTS as usize {
            return Err(EbpfError::TooManyBackends {
                count: backends.len(),
                max: MAP_BACKEND_SLOTS,
            });
        }
        for (i, b) in backends.iter().enumerate() {
            if backends[..i].contains(b) {
                return Err(EbpfError::DuplicateBackend(*b));
            }
        }
        // Read every old slot first: a backend may move onto a slot not yet read.
        let mut old: Vec<(SocketAddr, PerCpuValues<CpuCounters>)> = Vec::new();
        for (i, b) in self.backends.iter().enumerate() {
            old.push((*b, self.counters.get(&(i as u32), 0)?));
        }
        let slots = backends.len().max(self.backends.len());
        for i in 0..slots {
            let carried = backends
                .get(i)
                .and_then(|b| old.iter().position(|(o, _)| o == b))
                .map(|p| old.swap_remove(p).1);
            let values = match carried {
                Some(v) => v,
                None => zeroed()?,
            };
            self.counters.set(i as u32, values, 0)?;
        }
        for gone in self.backends.iter().filter(|b| !backends.contains(b)) {
            self.registry.remove(&key(*gone))?;
        }
        for (i, b) in backends.iter().enumerate() {
            self.registry.insert(key(*b), i as u32, 0)?;
        }
        self.backends = backends.to_vec();
        tracing::debug!(backends = backends.len(), "eBPF: registry rewritten");
        self.follow_backend_routes(backends)
    }

    /// One snapshot per backend, index i = `backends[i]` of the last
    /// `set_backends`, each summed over CPUs. Costs one map-lookup syscall per
    /// backend.
    pub fn snapshot(&self) -> Result<Vec<BackendCounters>, EbpfError> {
        let mut out = Vec::with_capacity(self.backends.len());
        for i in 0..self.backends.len() as u32 {
            out.push(BackendCounters::sum(&self.counters.get(&i, 0)?));
        }
        tracing::debug!(counters = ?out, "eBPF: backend counters");
        Ok(out)
    }

    /// The global counters, summed over CPUs.
    pub fn globals(&self) -> Result<GlobalCounters, EbpfError> {
        let get = |offset: u32| -> Result<u64, EbpfError> {
            Ok(self.globals.get(&offset, 0)?.iter().sum())
        };
        let g = GlobalCounters {
            packets: get(GLOBAL_PACKETS)?,
            parse_failures: get(GLOBAL_PARSE_FAILURES)?,
            non_ip: get(GLOBAL_NON_IP)?,
            non_tcp: get(GLOBAL_NON_TCP)?,
            backend_packets: get(GLOBAL_BACKEND_PACKETS)?,
        };
        tracing::debug!(globals = ?g, "eBPF: global counters");
        Ok(g)
    }

    /// The backends as last registered; position = dense index.
    pub fn backends(&self) -> &[SocketAddr] {
        &self.backends
    }
}

fn zeroed() -> Result<PerCpuValues<CpuCounters>, EbpfError> {
    let cpus = aya::util::nr_cpus().map_err(|(_, e)| EbpfError::Cpus(e))?;
    PerCpuValues::try_from(vec![CpuCounters::default(); cpus]).map_err(EbpfError::Cpus)
}
