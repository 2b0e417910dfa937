//! The hit-rate ceiling of a trace: what one engine with an unbounded prefix
//! cache would hit, computed with the engine's own template, tokenizer and
//! block hashing over the prompts actually sent, in send order (answers'
//! blocks are added when they arrive, as the engine caches generated tokens).

use super::scenario::Msg;
use crate::engine::block_hash::{BlockHash, PromptBlocks, chain_seed};
use crate::engine::tokenize;
use std::collections::HashSet;

/// An unbounded prefix cache.
#[derive(Debug)]
pub struct Ceiling {
    seed: u64,
    cached: HashSet<BlockHash>,
}

impl Ceiling {
    /// A cache namespaced like the engine's for `model`.
    pub fn new(model: &str) -> Self {
        Self {
            seed: chain_seed(model),
            cached: HashSet::new(),
        }
    }

    /// Renders and hashes a chat prompt.
    pub fn prompt(&self, messages: &[Msg]) -> PromptBlocks {
        let text = tokenize::render_chat(messages.iter().map(|m| (m.role, &*m.content)));
        PromptBlocks::new(self.seed, &tokenize::tokenize(&text))
    }

    /// Looks a prompt up (cached tokens, with the engine's last-token rule)
    /// and caches its blocks.
    pub fn on_send(&mut self, p: &PromptBlocks) -> u64 {
        let leading = p
            .hashes
            .iter()
            .take_while(|h| self.cached.contains(h))
            .count();
        self.cached.extend(p.hashes.iter().copied());
        (p.usable_hit_blocks(leading) * crate::engine::block_hash::BLOCK_SIZE) as u64
    }

    /// Caches the blocks of the answer to prompt `p`.
    pub fn on_answer(&mut self, p: &PromptBlocks, answer: &str) {
        self.cached
            .extend(p.output_block_hashes(&tokenize::tokenize(answer)));
    }
}
