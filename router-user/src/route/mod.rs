//! What the router knows and decides, with no sockets, no configuration file
//! and no metrics: the prompt's prefix blocks (extract, hash), which backend
//! holds which (index), what the engines' answers taught (feedback), the
//! fleet's live facts (backend), what each slot of a llama.cpp-like engine
//! holds (slots) and the ranking of backends (select).

/// The most backends a fleet holds: the index keeps one bit per backend in
/// each block's owner mask, and every per-backend table has this many slots.
pub const MAX_BACKENDS: usize = 64;

pub(crate) mod backend;
pub mod extract;
pub(crate) mod feedback;
pub mod hash;
pub mod index;
pub mod models;
pub mod scan;
pub mod select;
pub mod slots;
