//! The KV-cache block pool with vLLM's automatic prefix caching: a fixed
//! number of blocks, each either held by running requests (reference count
//! above zero) or free. Free blocks that still carry a hash keep their cached
//! content until they are reused; free blocks are reused in LRU order.
//!
//! Invariants: a hash maps to at most one block; a block is in the free list
//! exactly when its reference count is zero.

use super::block_hash::BlockHash;
use super::kv_events::{CacheEvent, EventLog};
use super::tokenize::Token;
use std::collections::HashMap;

const NIL: u32 = u32::MAX;

#[derive(Clone, Debug)]
struct Block {
    hash: Option<BlockHash>,
    refs: u32,
    prev: u32,
    next: u32,
}

/// A pool of KV-cache blocks with a prefix-cache index and an LRU free list.
#[derive(Debug)]
pub struct KvCache {
    blocks: Vec<Block>,
    by_hash: HashMap<BlockHash, u32>,
    head: u32,
    tail: u32,
    free: usize,
    /// What the cache stored, evicted and cleared, in order, while KV events
    /// are published (`kv_events`); `None` otherwise.
    log: Option<EventLog>,
}

impl KvCache {
    /// A pool of `num_blocks` empty, free blocks.
    pub fn new(num_blocks: usize) -> Self {
        assert!(num_blocks < NIL as usize, "too many blocks");
        let mut c = Self {
            blocks: vec![
                Block {
                    hash: None,
                    refs: 0,
                    prev: NIL,
                    next: NIL
                };
                num_blocks
            ],
            by_hash: HashMap::new(),
            head: NIL,
            tail: NIL,
            free: 0,
            log: None,
        };
        for b in 0..num_blocks as u32 {
            c.push_back(b);
        }
        c
    }

    /// Total blocks.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks held by running requests.
    pub fn used_blocks(&self) -> usize {
        self.blocks.len() - self.free
    }

    /// Blocks that hold a cached prefix (held or free).
    pub fn cached_blocks(&self) -> usize {
        self.by_hash.len()
    }

    /// How many leading `hashes` are cached (the lookup stops at the first miss).
    pub fn lookup(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.by_hash.contains_key(h))
            .count()
    }

    /// Reserves `total` blocks for a request whose first `hit` blocks are the
    /// cached blocks of `hashes[..hit]` (as found by [`lookup`](Self::lookup)).
    /// Returns the request's blocks in sequence order, or `None` (and changes
    /// nothing) when too few free blocks remain.
    pub fn allocate(&mut self, hashes: &[BlockHash], hit: usize, total: usize) -> Option<Vec<u32>> {
        let hit = hit.min(total);
        let hit_ids: Vec<u32> = hashes[..hit].iter().map(|h| self.by_hash[h]).collect();
        let hits_free = hit_ids
            .iter()
            .filter(|&&b| self.blocks[b as usize].refs == 0)
            .count();
        if self.free - hits_free < total - hit {
            return None;
        }
        for &b in &hit_ids {
            if self.blocks[b as usize].refs == 0 {
                self.unlink(b);
            }
            self.blocks[b as usize].refs += 1;
        }
        let mut ids = hit_ids;
        for _ in hit..total {
            let b = self.head;
            self.unlink(b);
            let blk = &mut self.blocks[b as usize];
            let evicted = blk.hash.take();
            blk.refs = 1;
            if let Some(h) = evicted {
                self.by_hash.remove(&h);
                self.record(CacheEvent::Removed(h));
            }
            ids.push(b);
        }
        Some(ids)
    }

    /// Records that held block `block` now holds the computed content keyed by
    /// `hash`. Returns false (and leaves it uncached) when another block
    /// already caches that hash or the block already has a key.
    pub fn register(&mut self, block: u32, hash: BlockHash) -> bool {
        if self.blocks[block as usize].hash.is_some() || self.by_hash.contains_key(&hash) {
            return false;
        }
        self.blocks[block as usize].hash = Some(hash);
        self.by_hash.insert(hash, block);
        true
    }

    /// [`register`](Self::register), recording a stored block (its parent's
    /// hash, `None` for a sequence's first block, its tokens, and its extra
    /// key: the cache salt of a sequence's first block) when KV events are
    /// published.
    pub fn store(
        &mut self,
        block: u32,
        hash: BlockHash,
        parent: Option<BlockHash>,
        tokens: &[Token],
        extra: Option<&[u8]>,
    ) -> bool {
        let stored = self.register(block, hash);
        if stored && self.log.is_some() {
            self.record(CacheEvent::Stored {
                hash,
                parent,
                tokens: tokens.to_vec(),
                extra: extra.map(<[u8]>::to_vec),
            });
        }
        stored
    }

    /// Starts recording events into `log` (see [`CacheEvent`]).
    pub fn record_events(&mut self, log: EventLog) {
        self.log = Some(log);
    }

    /// Whether events are recorded (callers then pass real tokens to
    /// [`store`](Self::store)).
    pub fn records_events(&self) -> bool {
        self.log.is_some()
    }

    /// The events recorded since the last call, oldest first.
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.log
            .as_mut()
            .map(|l| std::mem::take(&mut l.events))
            .unwrap_or_default()
    }

    fn record(&mut self, e: CacheEvent) {
        if let Some(l) = &mut self.log {
            l.events.push(e);
            l.wake.notify_one();
        }
    }

    /// Drops one reference to each of a request's blocks. Like vLLM, blocks
    /// are freed last-first so a sequence's tail is evicted before its head;
    /// blocks without cached content go to the front, to be reused first.
    pub fn release(&mut self, blocks: &[u32]) {
        for &b in blocks.iter().rev() {
            let blk = &mut self.blocks[b as usize];
            debug_assert!(blk.refs > 0);
            blk.refs -= 1;
            if blk.refs == 0 {
                if blk.hash.is_some() {
                    self.push_back(b);
                } else {
                    self.push_front(b);
                }
            }
        }
    }

    /// Forgets every cached prefix (held blocks stay held, uncached).
    pub fn reset(&mut self) {
        self.by_hash.clear();
        for b in &mut self.blocks {
            b.hash = None;
        }
        self.record(CacheEvent::Cleared);
    }

    fn unlink(&mut self, b: u32) {
        let (prev, next) = (self.blocks[b as usize].prev, self.blocks[b as usize].next);
        if prev == NIL {
            self.head = next
        } else {
            self.blocks[prev as usize].next = next
        }
        if next == NIL {
            self.tail = prev
        } else {
            self.blocks[next as usize].prev = prev
        }
        self.blocks[b as usize].prev = NIL;
        self.blocks[b as usize].next = NIL;
        self.free -= 1;
    }

    fn push_back(&mut self, b: u32) {
        self.blocks[b as usize].prev = self.tail;
        self.blocks[b as usize].next = NIL;
        if self.tail == NIL {
            self.head = b
        } else {
            self.blocks[self.tail as usize].next = b
        }
        self.tail = b;
        self.free += 1;
    }

    fn push_front(&mut self, b: u32) {
        self.blocks[b as usize].next = self.head;
        self.blocks[b as usize].prev = NIL;
        if self.head == NIL {
            self.tail = b
        } else {
            self.blocks[self.head as usize].prev = b
        }
        self.head = b;
        self.free += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Allocates, registers every block as hashes 1.., and releases.
    fn run(c: &mut KvCache, hashes: &[u64]) -> usize {
        let hit = c.lookup(hashes);
        let ids = c.allocate(hashes, hit, hashes.len()).expect("fits");
        for (i, &b) in ids.iter().enumerate().skip(hit) {
            c.register(b, hashes[i]);
        }
        c.release(&ids);
        hit
    }

    #[test]
    fn hits_stop_at_first_miss() {
        let mut c = KvCache::new(8);
        assert_eq!(run(&mut c, &[1, 2, 3]), 0);
        assert_eq!(run(&mut c, &[1, 2, 3, 4]), 3);
        assert_eq!(c.lookup(&[1, 9, 3]), 1);
    }

    #[test]
    fn lru_evicts_least_recent_and_tail_first() {
        let mut c = KvCache::new(4);
        run(&mut c, &[1, 2]);
        run(&mut c, &[3, 4]);
        run(&mut c, &[1, 2]); // touch 1,2: now 3,4 are least recent
        run(&mut c, &[5]); // evicts 4 (a sequence's tail goes first)
        assert_eq!(c.lookup(&[3]), 1);
        assert_eq!(c.lookup(&[3, 4]), 1);
        assert_eq!(c.lookup(&[1, 2]), 2);
    }

    #[test]
    fn held_blocks_are_never_evicted() {
        let mut c = KvCache::new(3);
        let held = c.allocate(&[1, 2], 0, 2).unwrap();
        c.register(held[0], 1);
        c.register(held[1], 2);
        assert!(c.allocate(&[7, 8], 0, 2).is_none(), "only one free block");
        assert_eq!(c.used_blocks(), 2);
        let again = c.allocate(&[1, 2], 2, 3).expect("shares held blocks");
        assert_eq!(&again[..2], &held[..]);
        c.release(&again);
        c.release(&held);
        assert_eq!(c.used_blocks(), 0);
        assert_eq!(c.cached_blocks(), 2);
        c.reset();
        assert_eq!(c.cached_blocks(), 0);
    }
}
