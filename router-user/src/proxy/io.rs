//! Small helpers over monoio's owned-buffer I/O.

use std::io;
use std::time::Duration;

use monoio::buf::{IoBuf, IoBufMut};
use monoio::io::{AsyncReadRent, AsyncWriteRent};
use monoio::net::TcpStream;

/// Room added before a read when less than `MIN_SPARE` is left.
pub const READ_CHUNK: usize = 16 * 1024;
/// Spare room below which a read first grows the buffer.
pub const MIN_SPARE: usize = READ_CHUNK / 4;

/// Outcome of a read with a deadline.
pub enum Read {
    Data(usize),
    Eof,
    TimedOut,
    /// The socket failed (reset, or another OS error).
    Err,
}

/// Appends what the socket has to `buf` (growing it by `READ_CHUNK` when
/// less than `MIN_SPARE` is free).
pub async fn read_more(stream: &mut TcpStream, buf: &mut Vec<u8>, timeout: Duration) -> Read {
    if buf.capacity() - buf.len() < MIN_SPARE {
        // Exact: bodies grow by the caller's policy (and budget), never by
        // the allocator's doubling behind its back.
        buf.reserve_exact(READ_CHUNK);
    }
    let len = buf.len();
    let owned = std::mem::take(buf);
    let fut = stream.read(owned.slice_mut(len..));
    match monoio::time::timeout(timeout, fut).await {
        Ok((res, slice)) => {
            *buf = slice.into_inner();
            match res {
                Ok(0) => Read::Eof,
                Ok(n) => Read::Data(n),
                Err(_) => Read::Err,
            }
        }
        // The buffer went with the cancelled read; the caller closes the connection.
        Err(_) => Read::TimedOut,
    }
}

/// Writes `buf[start..end]` whole, failing with `TimedOut` when the peer
/// accepts no byte for `timeout` (each partial write restarts the clock: a
/// slow reader that keeps reading is not cut, one that stopped is). The
/// buffer is taken and given back, except after a timeout: then it went
/// with the cancelled write and `buf` is left empty, so the caller must
/// close the connection.
pub async fn write_range(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    start: usize,
    end: usize,
    timeout: Duration,
) -> io::Result<()> {
    let mut owned = std::mem::take(buf);
    let mut pos = start;
    while pos < end {
        let fut = stream.write(owned.slice(pos..end));
        let Ok((res, slice)) = monoio::time::timeout(timeout, fut).await else {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the peer accepted no bytes in time",
            ));
        };
        owned = slice.into_inner();
        match res {
            Ok(0) => {
                *buf = owned;
                return Err(io::ErrorKind::WriteZero.into());
            }
            Ok(n) => pos += n,
            Err(e) => {
                *buf = owned;
                return Err(e);
            }
        }
    }
    *buf = owned;
    Ok(())
}

/// Writes all of `buf` (see [`write_range`]).
pub async fn write_all(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    timeout: Duration,
) -> io::Result<()> {
    let end = buf.len();
    write_range(stream, buf, 0, end, timeout).await
}
