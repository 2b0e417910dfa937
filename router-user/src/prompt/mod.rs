//! Reading the prompt: a request body in, its prefix blocks out. One pass
//! over the body validates it as JSON and records the canonical prompt as
//! pieces of the body (`scan`); `extract` is the reference reader `scan`
//! must agree with; `hash` chains the blocks' hashes. No sockets, no
//! configuration file, no metrics.

pub mod extract;
pub mod hash;
pub mod scan;
