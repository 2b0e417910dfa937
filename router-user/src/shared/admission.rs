//! The order in which requests waiting in the router for room are let in.
//!
//! Between classes: a class goes only when none above it waits
//! (`Router::waits_above`). Within a class, tenants share admissions by
//! weight, by start-time fair queueing: a request entering the wait gets a
//! virtual start tag, `max(class clock, its tenant's last tag) + 1 /
//! weight`, and only the smallest tag waiting may take room; the class
//! clock moves to each admitted request's tag. A tenant sending ten times
//! as many requests as another of the same weight gets its tags ten times
//! as far ahead, so the small tenant's next request is always near the
//! front; a tenant idle for a while comes back at the clock, with no
//! credit saved up. Each tenant's waiting requests in each class are
//! bounded (`classes.max_waiting`).
//!
//! Only waiting requests touch this: one short lock on entering and on
//! leaving the wait; while waiting, one atomic load per poll.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

use crate::prompt::extract::Class;

/// The waiting requests of every class.
#[derive(Default)]
pub struct Admission {
    classes: [Mutex<Queue>; 3],
    /// The smallest tag waiting in each class, as the bits of an `f64`
    /// (non-negative `f64`s order as their bits); `u64::MAX`: none.
    first: [AtomicU64; 3],
    /// Requests waiting, by class (`Class::ALL`'s order).
    waiting: [AtomicUsize; 3],
}

/// One class's waiting requests.
#[derive(Default)]
struct Queue {
    /// The tag of the last request let in.
    clock: f64,
    /// By tenant slot (0: tenant `-`, n + 1: tenant n).
    tenants: Vec<TenantQueue>,
    /// The tags waiting, smallest first, with an entry number for ties.
    tags: BTreeSet<(u64, u64)>,
    entries: u64,
}

#[derive(Clone, Copy, Default)]
struct TenantQueue {
    last: f64,
    waiting: u32,
}

/// A request's place in the wait, given up when dropped (let in, its
/// deadline passed, or its client gone).
pub struct Place<'a> {
    admission: &'a Admission,
    class: usize,
    slot: usize,
    key: (u64, u64),
    let_in: bool,
}

impl Admission {
    pub fn new() -> Admission {
        Admission {
            first: std::array::from_fn(|_| AtomicU64::new(u64::MAX)),
            ..Admission::default()
        }
    }

    /// Requests of `class` waiting now.
    pub fn waiting(&self, class: Class) -> usize {
        self.waiting[class as usize].load(Relaxed)
    }

    /// A request of `class` and `tenant` (`None`: tenant `-`) starts to
    /// wait. `None` when `max_waiting` (0: no bound) of that tenant's
    /// requests of that class wait already.
    pub fn enter(
        &self,
        class: Class,
        tenant: Option<u16>,
        weight: u32,
        max_waiting: u32,
    ) -> Option<Place<'_>> {
        let c = class as usize;
        let slot = tenant.map_or(0, |t| usize::from(t) + 1);
        let mut q = lock(&self.classes[c]);
        if q.tenants.len() <= slot {
            q.tenants.resize(slot + 1, TenantQueue::default());
        }
        let t = q.tenants[slot];
        if max_waiting > 0 && t.waiting >= max_waiting {
            return None;
        }
        let tag = q.clock.max(t.last) + 1.0 / f64::from(weight.max(1));
        q.tenants[slot] = TenantQueue {
            last: tag,
            waiting: t.waiting + 1,
        };
        q.entries += 1;
        let key = (tag.to_bits(), q.entries);
        q.tags.insert(key);
        self.publish_first(c, &q);
        self.waiting[c].fetch_add(1, Relaxed);
        Some(Place {
            admission: self,
            class: c,
            slot,
            key,
            let_in: false,
        })
    }

    fn publish_first(&self, c: usize, q: &Queue) {
        let first = q.tags.first().map_or(u64::MAX, |k| k.0);
        self.first[c].store(first, Relaxed);
    }
}

impl Place<'_> {
    /// No request of its class waiting has a smaller tag (ties all go).
    pub fn is_first(&self) -> bool {
        self.key.0 <= self.admission.first[self.class].load(Relaxed)
    }

    /// The request got room: its class's clock moves to its tag.
    pub fn let_in(mut self) {
        self.let_in = true;
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        let a = self.admission;
        let mut q = lock(&a.classes[self.class]);
        q.tags.remove(&self.key);
        let t = &mut q.tenants[self.slot];
        t.waiting = t.waiting.saturating_sub(1);
        if self.let_in {
            q.clock = q.clock.max(f64::from_bits(self.key.0));
        }
        a.publish_first(self.class, &q);
        a.waiting[self.class].fetch_sub(1, Relaxed);
    }
}

/// The lock, even if a thread panicked holding it (the queue stays whole:
/// every change under it is made before anything that may panic).
fn lock(m: &Mutex<Queue>) -> std::sync::MutexGuard<'_, Queue> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests;
