//! What the router knows and decides, with no sockets, no configuration file
//! and no metrics: the prompt's prefix blocks (extract, hash), which backend
//! holds which (index), what the engines' answers taught (feedback), the
//! fleet's live facts (backend) and the ranking of backends (select).

pub mod backend;
pub mod extract;
pub mod feedback;
pub mod hash;
pub mod index;
pub mod select;
