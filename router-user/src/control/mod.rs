//! The control plane, beside the traffic: health probes, the XDP load view,
//! configuration reloads, the admin listener, logging.

pub mod admin;
pub mod ebpf;
pub mod health;
pub mod loadview;
pub mod logging;
pub mod reload;
