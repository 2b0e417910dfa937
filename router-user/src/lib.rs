//! prefix-router library.
