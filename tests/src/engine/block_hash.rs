//! Block hashing with vLLM's automatic-prefix-caching scheme: a prompt is cut
//! into blocks of [`BLOCK_SIZE`] tokens and each full block is keyed by a hash
//! chained over every block before it, so equal keys mean equal prefixes.
//! The chain starts from a per-model seed, so two models never share blocks.

use super::tokenize::Token;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Tokens per KV-cache block (vLLM's default `--block-size` on GPUs).
pub const BLOCK_SIZE: usize = 16;

/// The key of one full block.
pub type BlockHash = u64;

/// The chain seed of a model: the "parent hash" of a sequence's first block.
pub fn chain_seed(model: &str) -> u64 {
    xxh3_64(model.as_bytes())
}

/// The chain seed of a request with a `cache_salt`: the model's seed with
/// the salt folded in, so only requests with the same salt share blocks
/// (vLLM folds it into the first block's hash).
pub fn salted_seed(seed: u64, salt: &str) -> u64 {
    xxh3_64_with_seed(salt.as_bytes(), seed)
}

/// The hash of one block given its parent's hash (or the chain seed).
#[inline]
pub fn block_hash(parent: u64, tokens: &[Token]) -> BlockHash {
    let mut bytes = [0u8; BLOCK_SIZE * 4];
    for (dst, t) in bytes.chunks_exact_mut(4).zip(tokens) {
        dst.copy_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(&bytes[..tokens.len() * 4], parent)
}

/// A prompt as the cache sees it: the hashes of its full blocks and the
/// tokens after the last full block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptBlocks {
    /// Chain seed (model namespace).
    pub seed: u64,
    /// Hashes of the full blocks, in order.
    pub hashes: Vec<BlockHash>,
    /// Tokens after the last full block (fewer than [`BLOCK_SIZE`]).
    pub tail: Vec<Token>,
    /// Number of prompt tokens.
    pub num_tokens: usize,
}

impl PromptBlocks {
    /// Hashes the full blocks of `tokens` in namespace `seed`.
    pub fn new(seed: u64, tokens: &[Token]) -> Self {
        let mut hashes = Vec::with_capacity(tokens.len() / BLOCK_SIZE);
        let mut parent = seed;
        let mut chunks = tokens.chunks_exact(BLOCK_SIZE);
        for block in &mut chunks {
            parent = block_hash(parent, block);
            hashes.push(parent);
        }
        Self {
            seed,
            hashes,
            tail: chunks.remainder().to_vec(),
            num_tokens: tokens.len(),
        }
    }

    /// The longest usable cache hit in blocks, given how many leading blocks
    /// the cache holds: vLLM always computes the last prompt token (it needs
    /// its logits), so a hit never covers it and a fully cached,
    /// block-aligned prompt recomputes its last block.
    pub fn usable_hit_blocks(&self, cached_leading_blocks: usize) -> usize {
        cached_leading_blocks.min(self.num_tokens.saturating_sub(1) / BLOCK_SIZE)
    }

    /// A 64-bit digest of the whole prompt (seeds the generated text).
    pub fn digest(&self) -> u64 {
        let parent = self.hashes.last().copied().unwrap_or(self.seed);
        block_hash(parent, &self.tail) ^ self.num_tokens as u64
    }

    /// Hashes of the full blocks after the prompt's own, once `output` has
    /// been generated. Like vLLM, only tokens whose KV was computed count:
    /// the last generated token is not, so its block stays uncached.
    pub fn output_block_hashes(&self, output: &[Token]) -> Vec<BlockHash> {
        let cached_len = (self.num_tokens + output.len()).saturating_sub(1);
        let full = cached_len / BLOCK_SIZE;
        let mut out = Vec::with_capacity(full.saturating_sub(self.hashes.len()));
        if full <= self.hashes.len() {
            return out;
        }
        let mut seq: Vec<Token> = Vec::with_capacity(self.tail.len() + output.len());
        seq.extend_from_slice(&self.tail);
        seq.extend_from_slice(output);
        let mut parent = self.hashes.last().copied().unwrap_or(self.seed);
        for block in seq.chunks_exact(BLOCK_SIZE).take(full - self.hashes.len()) {
            parent = block_hash(parent, block);
            out.push(parent);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(n: usize) -> Vec<Token> {
        (0..n as u32).collect()
    }

    #[test]
    fn only_full_blocks_are_hashed_and_chained() {
        let p = PromptBlocks::new(1, &toks(40));
        assert_eq!(p.hashes.len(), 2);
        assert_eq!(p.tail.len(), 8);
        let mut other = toks(40);
        other[0] = 999;
        let q = PromptBlocks::new(1, &other);
        assert_ne!(
            p.hashes[1], q.hashes[1],
            "a change in block 0 changes every later key"
        );
        assert_ne!(
            PromptBlocks::new(2, &toks(40)).hashes[0],
            p.hashes[0],
            "model namespaces"
        );
    }

    #[test]
    fn last_token_is_always_computed() {
        let aligned = PromptBlocks::new(0, &toks(32));
        assert_eq!(aligned.usable_hit_blocks(2), 1);
        let unaligned = PromptBlocks::new(0, &toks(33));
        assert_eq!(unaligned.usable_hit_blocks(2), 2);
        assert_eq!(PromptBlocks::new(0, &toks(1)).usable_hit_blocks(0), 0);
    }

    #[test]
    fn output_blocks_continue_the_prompt_chain() {
        let prompt = toks(40);
        let output: Vec<Token> = (100..130).collect();
        let p = PromptBlocks::new(7, &prompt);
        let out = p.output_block_hashes(&output);
        let mut whole = prompt.clone();
        whole.extend(&output);
        let all = PromptBlocks::new(7, &whole[..whole.len() - 1]);
        assert_eq!(out, all.hashes[2..].to_vec());
        assert_eq!(out.len(), 2); // 69 cached tokens -> 4 full blocks, 2 new
    }
}
