//! A few backend ids packed in one atomic word: who holds a block, for the
//! prefix index and the precise index, at any fleet size.
//!
//! A word has [`LANES`] lanes of 16 bits: 0 is an empty lane, else the low
//! 15 bits are `backend + 1` and the top bit is that backend's referenced
//! bit (the CLOCK second chance of `fleet::index`). A block is held by few
//! backends at once (a conversation lives on one engine, a shared system
//! prompt on the few it was replicated to), so a handful of lanes per block
//! replaces a bit per backend: memory per block no longer grows with the
//! fleet. When every lane is taken a writer replaces one (the caller picks
//! which): the indexes are routing hints, so a lost owner costs at most one
//! cache miss.
//!
//! Readers load the word; writers change it with compare-and-swap, so two
//! writers never lose each other's lane.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Lanes in one word.
pub const LANES: usize = 4;

/// The referenced bit of a lane.
const REF: u64 = 1 << 15;
/// The id bits of a lane (`backend + 1`).
const ID: u64 = REF - 1;

/// Backends a lane can name (`fleet::MAX_BACKENDS` must not exceed it).
pub const MAX_ID: usize = ID as usize - 1;

const _: () = assert!(crate::fleet::MAX_BACKENDS <= MAX_ID + 1);

#[inline]
fn lane(word: u64, k: usize) -> u64 {
    (word >> (16 * k)) & 0xffff
}

#[inline]
fn code(backend: usize) -> u64 {
    backend as u64 + 1
}

/// The backends a word names, with their lanes' positions.
#[inline]
pub fn each(word: u64) -> impl Iterator<Item = (usize, usize)> {
    (0..LANES).filter_map(move |k| {
        let id = lane(word, k) & ID;
        (id != 0).then(|| (k, id as usize - 1))
    })
}

/// The lane of `backend` in `word`.
#[inline]
pub fn position(word: u64, backend: usize) -> Option<usize> {
    let c = code(backend);
    (0..LANES).find(|&k| lane(word, k) & ID == c)
}

/// Whether `backend`'s lane in `word` has its referenced bit set.
#[inline]
pub fn referenced_at(word: u64, k: usize) -> bool {
    lane(word, k) & REF != 0
}

/// Lanes in use.
#[inline]
pub fn count(word: u64) -> u32 {
    each(word).count() as u32
}

/// What [`add`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Added {
    /// A free lane now names the backend.
    New,
    /// It was named already.
    Held,
    /// Every lane is taken by others.
    Full,
}

/// Names `backend` in a free lane of `a` (its referenced bit clear). A
/// lane without an id is free even with its referenced bit set (a
/// [`touch`] that raced the lane's removal leaves one).
pub fn add(a: &AtomicU64, backend: usize) -> Added {
    let mut w = a.load(Relaxed);
    loop {
        if position(w, backend).is_some() {
            return Added::Held;
        }
        let Some(k) = (0..LANES).find(|&k| lane(w, k) & ID == 0) else {
            return Added::Full;
        };
        let next = (w & !(0xffff << (16 * k))) | code(backend) << (16 * k);
        match a.compare_exchange_weak(w, next, Relaxed, Relaxed) {
            Ok(_) => return Added::New,
            Err(now) => w = now,
        }
    }
}

/// Replaces lane `k` of `a`, if it still names `victim`, by `backend`.
/// Returns whether it did.
pub fn replace(a: &AtomicU64, k: usize, victim: usize, backend: usize) -> bool {
    let mut w = a.load(Relaxed);
    loop {
        if lane(w, k) & ID != code(victim) || position(w, backend).is_some() {
            return false;
        }
        let next = (w & !(0xffff << (16 * k))) | code(backend) << (16 * k);
        match a.compare_exchange_weak(w, next, Relaxed, Relaxed) {
            Ok(_) => return true,
            Err(now) => w = now,
        }
    }
}

/// A word naming `backend` alone.
pub fn only(backend: usize) -> u64 {
    code(backend)
}

/// Clears `backend`'s lane of `a`; returns the word left.
pub fn remove(a: &AtomicU64, backend: usize) -> u64 {
    let mut w = a.load(Relaxed);
    loop {
        let Some(k) = position(w, backend) else {
            return w;
        };
        let next = w & !(0xffff << (16 * k));
        match a.compare_exchange_weak(w, next, Relaxed, Relaxed) {
            Ok(_) => return next,
            Err(now) => w = now,
        }
    }
}

/// Sets `backend`'s referenced bit, if it is named and the bit is clear
/// (no write otherwise, so a held block's line stays shared).
pub fn touch(a: &AtomicU64, backend: usize) {
    let w = a.load(Relaxed);
    if let Some(k) = position(w, backend)
        && lane(w, k) & REF == 0
    {
        // A lane reassigned or emptied since the load gets a stray bit: a
        // hint only (`add` takes an emptied lane all the same).
        a.fetch_or(REF << (16 * k), Relaxed);
    }
}

/// Clears `backend`'s referenced bit; returns whether it was set.
pub fn take_referenced(a: &AtomicU64, backend: usize) -> bool {
    let w = a.load(Relaxed);
    match position(w, backend) {
        Some(k) if lane(w, k) & REF != 0 => {
            a.fetch_and(!(REF << (16 * k)), Relaxed) & (REF << (16 * k)) != 0
        }
        _ => false,
    }
}

/// A set of backends by slot, a bit each: the candidates of a lookup.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct BackendSet([u64; crate::fleet::MAX_BACKENDS.div_ceil(64)]);

impl Default for BackendSet {
    fn default() -> Self {
        BackendSet([0; crate::fleet::MAX_BACKENDS.div_ceil(64)])
    }
}

impl std::fmt::Debug for BackendSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

impl BackendSet {
    /// Every slot.
    pub const ALL: BackendSet = BackendSet([u64::MAX; crate::fleet::MAX_BACKENDS.div_ceil(64)]);

    /// Backends `0..n`.
    pub fn first(n: usize) -> BackendSet {
        let mut s = BackendSet::default();
        for b in 0..n.min(crate::fleet::MAX_BACKENDS) {
            s.insert(b);
        }
        s
    }

    #[inline]
    pub fn insert(&mut self, b: usize) {
        self.0[b / 64] |= 1 << (b % 64);
    }

    #[inline]
    pub fn contains(&self, b: usize) -> bool {
        self.0.get(b / 64).is_some_and(|w| w & (1 << (b % 64)) != 0)
    }

    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|&w| w == 0)
    }

    /// The members, lowest first.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.0.iter().enumerate().flat_map(|(i, &w)| {
            let mut w = w;
            std::iter::from_fn(move || {
                if w == 0 {
                    return None;
                }
                let b = w.trailing_zeros() as usize;
                w &= w - 1;
                Some(i * 64 + b)
            })
        })
    }
}

impl FromIterator<usize> for BackendSet {
    fn from_iter<I: IntoIterator<Item = usize>>(it: I) -> Self {
        let mut s = BackendSet::default();
        for b in it {
            s.insert(b);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_add_hold_fill_replace_and_remove() {
        let a = AtomicU64::new(0);
        for b in [0, 7, 1023, 500] {
            assert_eq!(add(&a, b), Added::New);
        }
        assert_eq!(add(&a, 7), Added::Held);
        assert_eq!(add(&a, 9), Added::Full);
        let w = a.load(Relaxed);
        let mut named: Vec<usize> = each(w).map(|(_, b)| b).collect();
        named.sort();
        assert_eq!(named, [0, 7, 500, 1023]);
        touch(&a, 1023);
        let k = position(a.load(Relaxed), 1023).unwrap();
        assert!(referenced_at(a.load(Relaxed), k));
        assert!(take_referenced(&a, 1023));
        assert!(!take_referenced(&a, 1023));
        let k = position(a.load(Relaxed), 0).unwrap();
        assert!(!replace(&a, k, 7, 9), "lane k names 0, not 7");
        assert!(replace(&a, k, 0, 9));
        assert_eq!(position(a.load(Relaxed), 0), None);
        assert_eq!(position(a.load(Relaxed), 9), Some(k));
        let left = remove(&a, 9);
        assert_eq!(count(left), 3);
        assert_eq!(add(&a, 0), Added::New);
    }

    #[test]
    fn a_stray_referenced_bit_does_not_take_a_lane() {
        let a = AtomicU64::new(REF << 16);
        assert_eq!(count(a.load(Relaxed)), 0);
        for b in 0..LANES {
            assert_eq!(add(&a, b), Added::New, "lane for {b}");
        }
        assert!(each(a.load(Relaxed)).all(|(k, _)| !referenced_at(a.load(Relaxed), k)));
    }

    #[test]
    fn concurrent_writers_never_lose_each_others_lanes() {
        // Four threads add, touch and remove their own id on one word: a
        // lane named by one is never cleared or overwritten by another.
        let a = std::sync::Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = [3usize, 99, 700, 1023]
            .into_iter()
            .map(|id| {
                let a = a.clone();
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        assert_eq!(add(&a, id), Added::New);
                        touch(&a, id);
                        let w = a.load(Relaxed);
                        let k = position(w, id).expect("still named");
                        assert!(referenced_at(w, k) || position(a.load(Relaxed), id).is_some());
                        assert!(take_referenced(&a, id));
                        remove(&a, id);
                        assert_eq!(position(a.load(Relaxed), id), None);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("writer");
        }
        assert_eq!(a.load(Relaxed), 0);
    }

    #[test]
    fn backend_sets_cover_every_slot() {
        let s: BackendSet = [0, 63, 64, 1023].into_iter().collect();
        assert!(s.contains(64) && s.contains(1023) && !s.contains(1) && !s.contains(5000));
        assert_eq!(s.iter().collect::<Vec<_>>(), [0, 63, 64, 1023]);
        assert_eq!(BackendSet::first(1024).iter().count(), 1024);
        assert!(BackendSet::first(1024) == BackendSet::ALL);
        assert!(BackendSet::default().is_empty());
    }
}
