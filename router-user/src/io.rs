//! Small helpers over monoio's owned-buffer I/O.

use std::io;
use std::time::Duration;

use monoio::buf::{IoBuf, IoBufMut};
use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::TcpStream;

/// Spare room ensured before each read.
const READ_CHUNK: usize = 16 * 1024;

/// Outcome of a read with a deadline.
pub enum Read {
    Data(usize),
    Eof,
    TimedOut,
    Err(io::Error),
}

/// Appends what the socket has to `buf` (growing it by up to `READ_CHUNK`).
pub async fn read_more(stream: &mut TcpStream, buf: &mut Vec<u8>, timeout: Duration) -> Read {
    if buf.capacity() - buf.len() < READ_CHUNK / 4 {
        buf.reserve(READ_CHUNK);
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
                Err(e) => Read::Err(e),
            }
        }
        // The buffer went with the cancelled read; the caller closes the connection.
        Err(_) => Read::TimedOut,
    }
}

/// Writes `buf[range]` whole. The buffer is taken and given back.
pub async fn write_range(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    start: usize,
    end: usize,
) -> io::Result<()> {
    if start == end {
        return Ok(());
    }
    let owned = std::mem::take(buf);
    let (res, slice) = stream.write_all(owned.slice(start..end)).await;
    *buf = slice.into_inner();
    res.map(|_| ())
}

/// Writes all of `buf`.
pub async fn write_all(stream: &mut TcpStream, buf: &mut Vec<u8>) -> io::Result<()> {
    let end = buf.len();
    write_range(stream, buf, 0, end).await
}
