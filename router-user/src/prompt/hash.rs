//! Prefix hashing: the canonical prompt cut into fixed-size blocks, each block's
//! hash chained over every block before it (as vLLM keys its KV-cache blocks),
//! so equal hashes at position i mean equal prompts up to the end of block i.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Default block size in bytes of canonical prompt: about 16 tokens at the
/// usual ~4 bytes per token, i.e. one vLLM KV-cache block.
pub const DEFAULT_BLOCK_BYTES: usize = 64;

/// Most blocks hashed of one prompt: 16,384 blocks of 64 bytes is a 1 MiB
/// prompt (a quarter of a million tokens), past any model's context and
/// any engine's cache. What lies beyond is never matched: hashing, looking
/// up and learning it would only cost the worker time (a 30 MB body) and
/// push every other prompt of its backend out of the index.
pub const MAX_PROMPT_BLOCKS: usize = 16_384;

/// Chains block `block` onto the hash `prev` of every block before it.
///
/// The block is hashed on its own and only then folded into the chain (one
/// multiply), so the hashes of a prompt's blocks do not wait on each other
/// and the CPU overlaps them: seeding each block's xxh3 with the previous
/// hash made every block wait for the whole hash of the one before. On
/// 400 KB of prompt that took 45 us (9 GB/s); the fold takes it to
/// the figure in decision 0011, block hashes folded, not seeded.
/// Never 0: the prefix index uses 0 for an empty slot.
#[inline(always)]
fn link(prev: u64, block: &[u8]) -> u64 {
    // The folded multiply of foldhash and wyhash, of the chain so far and
    // the block's own hash, each offset by an odd constant so that a zero
    // on either side does not zero the product.
    let m = u128::from(prev ^ 0x243f_6a88_85a3_08d3)
        * u128::from(xxh3_64(block) ^ 0x1319_8a2e_0370_7344);
    ((m as u64) ^ ((m >> 64) as u64)).max(1)
}

/// The first link of every chain: a hash of the namespace (model, adapter,
/// cache salt), so different models never share a block hash.
pub fn namespace_seed(parts: &[&[u8]]) -> u64 {
    let mut seed = 0x7072_6566_6978_7274; // "prefixrt"
    for p in parts {
        seed = xxh3_64_with_seed(p, seed ^ p.len() as u64);
    }
    seed
}

/// Appends the chained hashes of every full block of `canonical` to `out`.
/// A partial last block is not hashed (engines cache only full blocks).
/// Hashes are never 0: the prefix index uses 0 for an empty slot.
pub fn block_hashes(seed: u64, canonical: &[u8], block_bytes: usize, out: &mut Vec<u64>) {
    debug_assert!(block_bytes > 0);
    out.reserve(canonical.len() / block_bytes);
    let mut h = seed;
    for block in canonical.chunks_exact(block_bytes) {
        h = link(h, block);
        out.push(h);
    }
}

/// [`block_hashes`] of the concatenation of `pieces`, read once: blocks
/// inside a piece are hashed where they are, only blocks that straddle two
/// pieces are copied (into `carry`, which ends holding the partial last
/// block).
pub fn block_hashes_pieces<'a>(
    seed: u64,
    pieces: impl IntoIterator<Item = &'a [u8]>,
    block_bytes: usize,
    carry: &mut Vec<u8>,
    out: &mut Vec<u64>,
) {
    debug_assert!(block_bytes > 0);
    carry.clear();
    let mut h = seed;
    for mut p in pieces {
        if !carry.is_empty() {
            let take = (block_bytes - carry.len()).min(p.len());
            carry.extend_from_slice(&p[..take]);
            p = &p[take..];
            if carry.len() < block_bytes {
                continue;
            }
            h = link(h, carry);
            out.push(h);
            carry.clear();
        }
        let mut blocks = p.chunks_exact(block_bytes);
        for block in &mut blocks {
            h = link(h, block);
            out.push(h);
        }
        carry.extend_from_slice(blocks.remainder());
    }
}

/// The key a cold prompt is placed by: the chained hash after its first
/// `key_blocks` blocks, so every prompt that shares those blocks (the same
/// system prompt or few-shot template) lands on the same backend. Prompts
/// shorter than one block hash what they have.
pub fn cold_key(seed: u64, canonical: &[u8], hashes: &[u64], key_blocks: usize) -> u64 {
    match hashes.len().min(key_blocks.max(1)) {
        0 => xxh3_64_with_seed(canonical, seed),
        n => hashes[n - 1],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn only_full_blocks_are_hashed() {
        let mut out = Vec::new();
        block_hashes(1, &[7u8; 64 * 3 + 63], 64, &mut out);
        assert_eq!(out.len(), 3);
    }

    #[test]
    fn namespaces_separate_models() {
        let text = [b'a'; 128];
        let (mut a, mut b) = (Vec::new(), Vec::new());
        block_hashes(namespace_seed(&[b"llama"]), &text, 64, &mut a);
        block_hashes(namespace_seed(&[b"qwen"]), &text, 64, &mut b);
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
    }

    proptest! {
        /// A prompt's hashes are a prefix of the hashes of any extension of it:
        /// turn N+1 of a chat matches turn N block for block.
        #[test]
        fn extensions_share_the_prefix_chain(base in proptest::collection::vec(any::<u8>(), 0..600),
                                              ext in proptest::collection::vec(any::<u8>(), 0..300)) {
            let mut full = base.clone();
            full.extend_from_slice(&ext);
            let (mut a, mut b) = (Vec::new(), Vec::new());
            block_hashes(9, &base, 64, &mut a);
            block_hashes(9, &full, 64, &mut b);
            prop_assert_eq!(&b[..a.len()], &a[..]);
        }

        /// Hashing pieces is hashing their concatenation, however it is cut.
        #[test]
        fn pieces_hash_as_their_concatenation(text in proptest::collection::vec(any::<u8>(), 0..700),
                                              cuts in proptest::collection::vec(0usize..700, 0..12),
                                              block in 1usize..100) {
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(text.len())).collect();
            cuts.push(0);
            cuts.push(text.len());
            cuts.sort_unstable();
            let pieces: Vec<&[u8]> = cuts.windows(2).map(|w| &text[w[0]..w[1]]).collect();
            let (mut a, mut b, mut carry) = (Vec::new(), Vec::new(), Vec::new());
            block_hashes(5, &text, block, &mut a);
            block_hashes_pieces(5, pieces, block, &mut carry, &mut b);
            prop_assert_eq!(a, b);
            prop_assert_eq!(&carry[..], &text[text.len() / block * block..]);
        }

        /// Changing one byte changes the hash of its block and every block after.
        #[test]
        fn a_change_breaks_the_chain_from_its_block_on(text in proptest::collection::vec(any::<u8>(), 256..512),
                                                       at in 0usize..256) {
            let mut other = text.clone();
            other[at] ^= 0x55;
            let (mut a, mut b) = (Vec::new(), Vec::new());
            block_hashes(3, &text, 64, &mut a);
            block_hashes(3, &other, 64, &mut b);
            let first = at / 64;
            prop_assert_eq!(&a[..first], &b[..first]);
            prop_assert!(a[first..].iter().zip(&b[first..]).all(|(x, y)| x != y));
        }
    }
}
