//! The control plane, beside the traffic: health probes, the XDP load view,
//! configuration reloads and discovery (both through `membership`), the
//! replicas' shared stream, the admin listener, logging.

pub(crate) mod admin;
pub(crate) mod discovery;
pub mod ebpf;
pub(crate) mod health;
pub(crate) mod loadview;
pub(crate) mod logging;
pub(crate) mod membership;
pub(crate) mod reload;
pub(crate) mod replicas;
