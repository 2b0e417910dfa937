//! Synthetic text: seeded pseudo-words, about [`BYTES_PER_TOKEN`] bytes per
//! token of the engine's tokenizer, with sentences and paragraph breaks.

use crate::engine::tokenize::BYTES_PER_TOKEN;
use rand::Rng;

const SYLLABLES: &[&str] = &[
    "ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "de", "fa", "go", "hu", "ji", "pe", "qua",
    "ri", "su", "te", "ul", "ve", "wa", "xo", "yu", "ze", "bra", "cli", "dro", "fle", "gri", "pla",
    "sto", "tra", "an", "en", "in", "on", "or", "ar", "el", "is",
];

/// One pseudo-word of one to four syllables.
pub fn word(rng: &mut impl Rng, out: &mut String) {
    let n = 1 + rng.random_range(0..4u32).min(rng.random_range(0..4u32));
    for _ in 0..=n {
        out.push_str(SYLLABLES[rng.random_range(0..SYLLABLES.len())]);
    }
}

/// Appends text of about `tokens` tokens to `out`.
pub fn push_text(rng: &mut impl Rng, tokens: usize, out: &mut String) {
    let target = out.len() + tokens * BYTES_PER_TOKEN;
    let mut in_sentence = 0;
    while out.len() < target {
        word(rng, out);
        in_sentence += 1;
        if in_sentence > 6 && rng.random_bool(0.15) {
            in_sentence = 0;
            if rng.random_bool(0.1) {
                out.push_str(".\n");
            } else {
                out.push_str(". ");
            }
        } else {
            out.push(' ');
        }
    }
}

/// Text of about `tokens` tokens.
pub fn text(rng: &mut impl Rng, tokens: usize) -> String {
    let mut s = String::with_capacity(tokens * BYTES_PER_TOKEN + 16);
    push_text(rng, tokens, &mut s);
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::tokenize::count_tokens;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn seeded_and_sized() {
        let a = text(&mut ChaCha8Rng::seed_from_u64(1), 1000);
        let b = text(&mut ChaCha8Rng::seed_from_u64(1), 1000);
        assert_eq!(a, b);
        let n = count_tokens(&a);
        assert!((950..1100).contains(&n), "{n} tokens");
    }
}
