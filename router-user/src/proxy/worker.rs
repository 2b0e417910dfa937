//! What one worker thread owns: the shared router, its own pool of backend
//! connections, and the scratch routing reuses.

use std::cell::RefCell;
use std::sync::Arc;

use crate::proxy::pool::Pool;
use crate::shared::{RouteScratch, Router};

/// Body buffers (and the worker's parse scratch) over this are given back
/// to the system after their request: rare uploads this large must not keep
/// their memory, while the usual prompts (up to a few hundred KB) keep
/// their scratch warm. Matches the allocator's fixed mmap threshold
/// (`listener::MMAP_THRESHOLD`), so they are their own mappings.
pub const RETURN_ABOVE: usize = 4 * 1024 * 1024;

/// What one worker thread owns.
pub struct Worker {
    pub router: Arc<Router>,
    pub pool: Pool,
    /// Never borrowed across an await: routing is synchronous.
    pub scratch: RefCell<RouteScratch>,
}

impl Worker {
    pub fn new(router: Arc<Router>) -> Worker {
        Worker {
            router,
            pool: Pool::default(),
            scratch: RefCell::new(RouteScratch::default()),
        }
    }

    /// Drops the parse scratch (a copy of the body, the canonical prompt)
    /// after a body over `RETURN_ABOVE`; smaller ones keep theirs for speed.
    pub fn shrink_scratch(&self) {
        self.scratch.borrow_mut().shrink(RETURN_ABOVE);
    }
}
