//! The traffic side: accept client connections, read requests, send each to
//! the backend routing chose, stream the answer back.

pub mod api;
pub mod budget;
pub mod client;
pub mod conn;
pub mod forward;
pub mod io;
pub mod listener;
pub mod pool;
pub mod priority_field;
pub mod request;
pub mod stream;
pub mod worker;
