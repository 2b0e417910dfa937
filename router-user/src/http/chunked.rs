//! The chunked transfer coding (RFC 9112 section 7.1), incrementally: decode
//! a request body, or find where a streamed response body ends without
//! copying it.

use crate::error::{Kind, RouterError};

/// A chunk size has at most this many hex digits (2^64 - 1 fits in 16).
const MAX_SIZE_DIGITS: u32 = 16;
/// Bytes a chunk extension or trailer line may take before it is refused.
const MAX_LINE: usize = 8 * 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Size { digits: u32 },
    Ext,
    SizeLf,
    Data,
    DataCr,
    DataLf,
    TrailerStart,
    Trailer,
    TrailerLf { empty_line: bool },
    Done,
}

/// The decoder's state between calls; feed it bytes as they arrive.
#[derive(Clone, Debug)]
pub struct ChunkedDecoder {
    state: State,
    size: u64,
    line: usize,
    decoded: u64,
}

impl Default for ChunkedDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl ChunkedDecoder {
    pub fn new() -> Self {
        ChunkedDecoder {
            state: State::Size { digits: 0 },
            size: 0,
            line: 0,
            decoded: 0,
        }
    }

    /// True once the last chunk and the trailers have been read.
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// True after a chunk's closing CRLF, before the next size line.
    pub fn between_chunks(&self) -> bool {
        self.state == State::Size { digits: 0 }
    }

    /// Body bytes decoded so far.
    pub fn decoded_len(&self) -> u64 {
        self.decoded
    }

    /// Consumes bytes of `input`, appending the chunk data to `out` when given.
    /// Returns how many bytes were consumed: all of them, or fewer once the
    /// body has ended (the rest belongs to the next message).
    pub fn feed(&mut self, input: &[u8], out: Option<&mut Vec<u8>>) -> Result<usize, RouterError> {
        self.feed_until(input, out, false)
    }

    /// Like [`ChunkedDecoder::feed`], but returns once one chunk's data and
    /// its CRLF are consumed: a client that times each chunk calls it once
    /// per chunk.
    pub fn feed_chunk(
        &mut self,
        input: &[u8],
        out: Option<&mut Vec<u8>>,
    ) -> Result<usize, RouterError> {
        self.feed_until(input, out, true)
    }

    fn feed_until(
        &mut self,
        input: &[u8],
        mut out: Option<&mut Vec<u8>>,
        one_chunk: bool,
    ) -> Result<usize, RouterError> {
        let mut i = 0;
        while i < input.len() {
            let b = input[i];
            match self.state {
                State::Done => return Ok(i),
                State::Size { digits } => match b {
                    b'0'..=b'9' | b'a'..=b'f' | b'A'..=b'F' => {
                        if digits == MAX_SIZE_DIGITS {
                            return Err(bad("chunk size has too many digits"));
                        }
                        let v = (b as char).to_digit(16).unwrap_or(0);
                        self.size = (self.size << 4) | u64::from(v);
                        self.state = State::Size { digits: digits + 1 };
                    }
                    b';' | b' ' | b'\t' if digits > 0 => {
                        self.line = 0;
                        self.state = State::Ext;
                    }
                    b'\r' if digits > 0 => self.state = State::SizeLf,
                    _ => return Err(bad("malformed chunk size")),
                },
                State::Ext => match b {
                    b'\r' => self.state = State::SizeLf,
                    b'\n' => return Err(bad("bare LF in chunk extension")),
                    _ => {
                        self.line += 1;
                        if self.line > MAX_LINE {
                            return Err(bad("chunk extension too long"));
                        }
                    }
                },
                State::SizeLf => {
                    if b != b'\n' {
                        return Err(bad("chunk size line not ended by CRLF"));
                    }
                    self.state = if self.size == 0 {
                        State::TrailerStart
                    } else {
                        State::Data
                    };
                }
                State::Data => {
                    let n = (input.len() - i).min(usize::try_from(self.size).unwrap_or(usize::MAX));
                    if let Some(out) = out.as_deref_mut() {
                        out.extend_from_slice(&input[i..i + n]);
                    }
                    self.size -= n as u64;
                    self.decoded += n as u64;
                    i += n;
                    if self.size == 0 {
                        self.state = State::DataCr;
                    }
                    continue;
                }
                State::DataCr => {
                    if b != b'\r' {
                        return Err(bad("chunk data not followed by CRLF"));
                    }
                    self.state = State::DataLf;
                }
                State::DataLf => {
                    if b != b'\n' {
                        return Err(bad("chunk data not followed by CRLF"));
                    }
                    self.state = State::Size { digits: 0 };
                    if one_chunk {
                        return Ok(i + 1);
                    }
                }
                State::TrailerStart => match b {
                    b'\r' => self.state = State::TrailerLf { empty_line: true },
                    _ => {
                        self.line = 1;
                        self.state = State::Trailer;
                    }
                },
                State::Trailer => match b {
                    b'\r' => self.state = State::TrailerLf { empty_line: false },
                    b'\n' => return Err(bad("bare LF in trailer")),
                    _ => {
                        self.line += 1;
                        if self.line > MAX_LINE {
                            return Err(bad("trailer line too long"));
                        }
                    }
                },
                State::TrailerLf { empty_line } => {
                    if b != b'\n' {
                        return Err(bad("trailer line not ended by CRLF"));
                    }
                    if empty_line {
                        self.state = State::Done;
                        return Ok(i + 1);
                    }
                    self.state = State::TrailerStart;
                }
            }
            i += 1;
        }
        Ok(i)
    }
}

fn bad(what: &str) -> RouterError {
    RouterError::new(Kind::BadRequest, format!("invalid chunked body: {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn decode_all(input: &[u8]) -> Result<(Vec<u8>, usize, bool), RouterError> {
        let mut d = ChunkedDecoder::new();
        let mut out = Vec::new();
        let n = d.feed(input, Some(&mut out))?;
        Ok((out, n, d.is_done()))
    }

    #[test]
    fn decodes_chunks_extensions_and_trailers() {
        let (out, n, done) =
            decode_all(b"5;x=y\r\nhello\r\n1\r\n!\r\n0\r\nx-t: 1\r\n\r\nNEXT").unwrap();
        assert_eq!(out, b"hello!");
        assert!(done);
        assert_eq!(n, 33, "stops at the end of the body");
    }

    #[test]
    fn malformed_sizes_are_refused() {
        for bad in [
            &b"z\r\n"[..],
            b"\r\n",
            b"-1\r\n",
            b"11111111111111111\r\n",
            b"5\nhello",
            b"5\r\nhelloXX",
        ] {
            assert!(
                decode_all(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    proptest! {
        /// Any body, chunked any way and fed in any pieces, decodes to itself.
        #[test]
        fn round_trip(body in proptest::collection::vec(any::<u8>(), 0..2000),
                      cuts in proptest::collection::vec(1usize..300, 1..20),
                      feed in 1usize..64) {
            let mut enc = Vec::new();
            let mut rest = &body[..];
            let mut k = 0;
            while !rest.is_empty() {
                let n = cuts[k % cuts.len()].min(rest.len());
                enc.extend_from_slice(format!("{n:x}\r\n").as_bytes());
                enc.extend_from_slice(&rest[..n]);
                enc.extend_from_slice(b"\r\n");
                rest = &rest[n..];
                k += 1;
            }
            enc.extend_from_slice(b"0\r\n\r\n");
            let mut d = ChunkedDecoder::new();
            let mut out = Vec::new();
            for piece in enc.chunks(feed) {
                d.feed(piece, Some(&mut out)).unwrap();
            }
            prop_assert!(d.is_done());
            prop_assert_eq!(out, body);
        }
    }
}
