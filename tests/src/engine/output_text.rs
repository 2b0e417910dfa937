//! The generated text: deterministic pseudo-words derived from the prompt's
//! digest, so the same prompt always gets the same answer (on any engine,
//! whatever its seed) and a chat's next turn is reproducible.
//!
//! Each generated token is one 4-byte piece, three letters and a space, so
//! the answer tokenizes back to exactly the generated tokens.

use super::tokenize::{Token, token_of};

const ONSETS: &[u8; 16] = b"bcdfghklmnprstvz";
const VOWELS: &[u8; 8] = b"aeiouaei";
const CODAS: &[u8; 8] = b"lnrstmkx";

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The `i`-th generated piece for a prompt with digest `digest`.
#[inline]
pub fn piece(digest: u64, i: u32) -> [u8; 4] {
    let h = mix(digest ^ (u64::from(i) << 32 | u64::from(i)));
    [
        ONSETS[(h & 15) as usize],
        VOWELS[((h >> 8) & 7) as usize],
        CODAS[((h >> 16) & 7) as usize],
        b' ',
    ]
}

/// Appends pieces `from..to` as text.
pub fn push_text(out: &mut String, digest: u64, from: u32, to: u32) {
    for i in from..to {
        let p = piece(digest, i);
        // Pieces are ASCII by construction.
        out.push_str(std::str::from_utf8(&p).unwrap_or(""));
    }
}

/// The tokens of pieces `0..n`.
pub fn tokens(digest: u64, n: u32) -> Vec<Token> {
    (0..n).map(|i| token_of(&piece(digest, i))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::tokenize::tokenize;

    #[test]
    fn text_tokenizes_to_the_generated_tokens() {
        let mut s = String::new();
        push_text(&mut s, 42, 0, 10);
        assert_eq!(s.len(), 40);
        assert_eq!(tokenize(&s), tokens(42, 10));
        let mut t = String::new();
        push_text(&mut t, 43, 0, 10);
        assert_ne!(s, t);
    }
}
