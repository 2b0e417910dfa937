//! The control plane, beside the traffic: health probes, the XDP load view,
//! configuration reloads, the admin listener, logging.

pub(crate) mod admin;
pub mod ebpf;
pub(crate) mod health;
pub(crate) mod loadview;
pub(crate) mod logging;
pub(crate) mod reload;
