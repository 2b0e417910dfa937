//! The process-wide budget for buffered request bodies
//! (`limits.max_buffered_body_bytes`). A request body is read whole before
//! routing (the prompt is in it), so many large uploads at once could take
//! all the memory; each connection charges the buffer capacity it grows
//! beyond [`FREE_BYTES`] as its body arrives (never the declared length up
//! front), and gives it back when its buffers shrink after the request or
//! the connection ends. One atomic, touched only when a buffer grows.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// Buffer capacity a connection keeps without charge: its head buffer and a
/// small body fit (and every connection's share is bounded by the
/// connection limit instead).
pub const FREE_BYTES: usize = 64 * 1024;

/// Bytes charged over all connections.
static IN_USE: AtomicUsize = AtomicUsize::new(0);

/// What one connection holds of the budget; gives it back when dropped.
#[derive(Debug, Default)]
pub struct Charge {
    held: usize,
}

impl Charge {
    /// Bytes this connection holds now.
    pub fn held(&self) -> usize {
        self.held
    }

    /// Sets this connection's charge to `bytes`. Growing fails (and changes
    /// nothing) when the budget of `max` bytes over all connections cannot
    /// cover it; shrinking always succeeds.
    pub fn set(&mut self, bytes: usize, max: usize) -> bool {
        if bytes <= self.held {
            IN_USE.fetch_sub(self.held - bytes, Relaxed);
            self.held = bytes;
            return true;
        }
        let more = bytes - self.held;
        let ok = IN_USE
            .fetch_update(Relaxed, Relaxed, |n| {
                n.checked_add(more).filter(|&t| t <= max)
            })
            .is_ok();
        if ok {
            self.held = bytes;
        }
        ok
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        IN_USE.fetch_sub(self.held, Relaxed);
    }
}

/// Whether `bytes` more would fit now (a check, not a reservation).
pub fn would_fit(bytes: usize, max: usize) -> bool {
    IN_USE.load(Relaxed).saturating_add(bytes) <= max
}

/// Bytes charged over all connections now (for `/metrics`).
pub fn in_use() -> usize {
    IN_USE.load(Relaxed)
}

/// The charge for a connection's body buffers of these capacities.
pub fn charge_for(capacities: [usize; 2]) -> usize {
    capacities
        .iter()
        .map(|c| c.saturating_sub(FREE_BYTES))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_grow_within_the_budget_and_come_back() {
        let base = in_use();
        let max = base + 1000;
        let mut a = Charge::default();
        let mut b = Charge::default();
        assert!(a.set(600, max));
        assert!(!b.set(600, max), "over the budget");
        assert!(b.set(400, max));
        assert!(a.set(100, max), "shrinking always works");
        assert!(b.set(900, max));
        drop(a);
        drop(b);
        assert_eq!(in_use(), base);
    }
}
