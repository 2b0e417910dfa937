//! What each backend holds and has taught: which blocks were sent where
//! (`index`, named by `owners`), the backends' live facts (`backend`), which
//! backend serves which model (`models`), what each slot of a llama.cpp-like
//! engine holds (`slots`), what the engines' answers taught (`feedback`)
//! and which engine stored each stored response (`stored`).
//! No sockets, no configuration file, no metrics.

/// The most backends a fleet holds over all pools: every per-backend table
/// (index rings, connection pools, confidence, model generations) has this
/// many slots. The indexes name a block's owners by id in a few lanes
/// (`owners`), so their memory per block does not depend on it.
pub const MAX_BACKENDS: usize = 1024;

pub(crate) mod backend;
pub(crate) mod feedback;
pub mod index;
pub mod models;
pub mod owners;
pub mod slots;
pub mod stored;
