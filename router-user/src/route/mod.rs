//! What the router knows and decides, with no sockets, no configuration file
//! and no metrics: the prompt's prefix blocks (extract, hash), which backend
//! holds which (index), what the engines' answers taught (feedback), the
//! fleet's live facts (backend), what each slot of a llama.cpp-like engine
//! holds (slots) and the ranking of backends (select).

/// The most backends a fleet holds over all pools: every per-backend table
/// (index rings, connection pools, confidence, model generations) has this
/// many slots. The indexes name a block's owners by id in a few lanes
/// (`owners`), so their memory per block does not depend on it.
pub const MAX_BACKENDS: usize = 1024;

pub(crate) mod backend;
pub mod extract;
pub(crate) mod feedback;
pub mod hash;
pub mod index;
pub mod models;
pub mod owners;
pub mod scan;
pub mod select;
pub mod slots;
