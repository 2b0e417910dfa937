//! The eBPF load signal: an XDP program (crate `router-ebpf`) counts, per
//! backend, the connections it accepted, closed and reset and the traffic it
//! sent; this module loads it, keeps its backend registry current and sums its
//! per-CPU counters into typed snapshots.
//!
//! ```no_run
//! # use prefix_router::control::ebpf::*;
//! # fn main() -> Result<(), EbpfError> {
//! let backends: Vec<std::net::SocketAddr> = vec!["10.0.0.2:8000".parse().unwrap()];
//! if let Some(load) = EbpfLoad::start(&EbpfConfig::default(), &backends)? {
//!     let per_backend = load.snapshot()?; // index i = backends[i]
//!     println!("live: {}", per_backend[0].live_connections());
//! }
//! # Ok(()) }
//! ```
//!
//! Invariants: map names and layouts come from `router-common` only; the
//! program never drops a packet; nothing here runs on the request path
//! (`snapshot` is for a refresh thread: one map lookup syscall per backend).

mod counters;
mod load;
mod registry;
mod routes;

pub use crate::config::ebpf::{EbpfConfig, EbpfMode, XdpMode};
pub use counters::{BackendCounters, GlobalCounters};
pub use load::EbpfLoad;

/// The XDP object built by `build.rs`, when this build has one.
#[cfg(prefix_router_ebpf_obj)]
static OBJECT: Option<&[u8]> = Some(aya::include_bytes_aligned!(concat!(
    env!("OUT_DIR"),
    "/router-ebpf"
)));
#[cfg(not(prefix_router_ebpf_obj))]
static OBJECT: Option<&[u8]> = None;

/// True when this build embeds the XDP object (see `router-user/build.rs`).
pub fn has_object() -> bool {
    OBJECT.is_some()
}

/// Why the eBPF signal is not available or an operation on it failed.
#[derive(Debug, thiserror::Error)]
pub enum EbpfError {
    #[error(
        "this build has no eBPF object (bpf-linker or nightly rust-src was missing when it \
         was built): run `cargo xtask setup` and rebuild"
    )]
    NoObject,
    #[error("loading the XDP object failed{hint}: {source}")]
    Load {
        hint: &'static str,
        #[source]
        source: Box<aya::EbpfError>,
    },
    #[error("the XDP object lacks {0}")]
    Missing(&'static str),
    #[error("loading the XDP program into the kernel failed{hint}: {source}")]
    Program {
        hint: &'static str,
        #[source]
        source: Box<aya::programs::ProgramError>,
    },
    #[error("attaching XDP to {interface} ({mode}) failed: {source}")]
    Attach {
        interface: String,
        mode: &'static str,
        #[source]
        source: Box<aya::programs::ProgramError>,
    },
    #[error("no interface to attach to: none configured and no backend route resolved")]
    NoInterface,
    #[error("eBPF map operation failed: {0}")]
    Map(#[from] Box<aya::maps::MapError>),
    #[error("{count} backends exceed the eBPF registry's capacity of {max}")]
    TooManyBackends { count: usize, max: u32 },
    #[error("backend {0} is listed twice")]
    DuplicateBackend(std::net::SocketAddr),
    #[error("counting CPUs: {0}")]
    Cpus(std::io::Error),
}

impl From<aya::maps::MapError> for EbpfError {
    fn from(e: aya::maps::MapError) -> Self {
        Self::Map(Box::new(e))
    }
}

/// A hint for permission errors when not running as root.
fn privilege_hint() -> &'static str {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        ""
    } else {
        " (not root: loading XDP needs root, or CAP_BPF and CAP_NET_ADMIN)"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Meaningful in a build without the object (`AYA_BUILD_SKIP=1`); with the
    /// object, `tests/ebpf_*.rs` cover loading.
    #[test]
    fn without_object_required_refuses_and_auto_carries_on() {
        let backends = ["127.0.0.1:8000".parse().unwrap()];
        let mut cfg = EbpfConfig {
            mode: EbpfMode::Off,
            ..Default::default()
        };
        assert!(EbpfLoad::start(&cfg, &backends).unwrap().is_none());
        if has_object() {
            return;
        }
        cfg.mode = EbpfMode::Required;
        let err = EbpfLoad::start(&cfg, &backends).unwrap_err();
        assert!(err.to_string().contains("this build has no eBPF object"));
        cfg.mode = EbpfMode::Auto;
        assert!(EbpfLoad::start(&cfg, &backends).unwrap().is_none());
    }
}
