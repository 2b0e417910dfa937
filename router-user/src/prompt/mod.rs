//! Reading the prompt: a request body in, its prefix blocks out. One pass
//! over the body validates it as JSON and records the canonical prompt as
//! pieces of the body (`scan`); `extract` is the reference reader `scan`
//! must agree with; `apis` reads the Anthropic Messages and OpenAI
//! Responses bodies into the same form; `hash` chains the blocks' hashes. No sockets, no
//! configuration file, no metrics.

pub mod apis;
pub mod extract;
pub mod hash;
pub mod scan;
