//! Small helpers over monoio's owned-buffer I/O.

use std::io;
use std::time::Duration;

use monoio::buf::{IoBuf, IoBufMut};
use monoio::io::{AsyncReadRent, AsyncWriteRent};

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
pub async fn read_more<S: AsyncReadRent>(
    stream: &mut S,
    buf: &mut Vec<u8>,
    timeout: Duration,
) -> Read {
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
pub async fn write_range<S: AsyncWriteRent>(
    stream: &mut S,
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
pub async fn write_all<S: AsyncWriteRent>(
    stream: &mut S,
    buf: &mut Vec<u8>,
    timeout: Duration,
) -> io::Result<()> {
    let end = buf.len();
    write_range(stream, buf, 0, end, timeout).await
}

/// `head` and then `body[start..end]`, owned for one `writev` (the iovecs
/// on the heap, where the kernel reads them, so moving this value into the
/// operation does not move them).
struct HeadAndBody {
    head: Vec<u8>,
    body: Vec<u8>,
    iov: Box<[libc::iovec; 2]>,
}

impl HeadAndBody {
    fn new(head: Vec<u8>, body: Vec<u8>, start: usize, end: usize) -> HeadAndBody {
        let part = &body[start..end];
        let iov = Box::new([
            libc::iovec {
                iov_base: head.as_ptr() as *mut libc::c_void,
                iov_len: head.len(),
            },
            libc::iovec {
                iov_base: part.as_ptr() as *mut libc::c_void,
                iov_len: part.len(),
            },
        ]);
        HeadAndBody { head, body, iov }
    }

    fn left(&self) -> usize {
        self.iov.iter().map(|v| v.iov_len).sum()
    }

    /// Drops the first `n` bytes not yet written.
    fn consume(&mut self, mut n: usize) {
        for v in self.iov.iter_mut() {
            let k = n.min(v.iov_len);
            // SAFETY: `k <= iov_len`, so the pointer stays inside (or one
            // past the end of) the buffer this iovec was made from.
            v.iov_base = unsafe { v.iov_base.cast::<u8>().add(k) }.cast();
            v.iov_len -= k;
            n -= k;
        }
    }
}

// SAFETY: the iovecs point into `head` and `body`, which this value owns and
// never touches while it lives (so their heap memory stays put), and the
// iovec array is boxed, so its address does not change when the value moves.
unsafe impl monoio::buf::IoVecBuf for HeadAndBody {
    fn read_iovec_ptr(&self) -> *const libc::iovec {
        let skip = usize::from(self.iov[0].iov_len == 0);
        self.iov[skip..].as_ptr()
    }

    fn read_iovec_len(&self) -> usize {
        2 - usize::from(self.iov[0].iov_len == 0)
    }
}

/// Writes all of `head`, then `body[start..end]`, in one `writev` where the
/// socket takes it all: no copy of a long body behind the head, and one
/// operation, not two. Times out and loses the buffers as [`write_range`]
/// does; otherwise both are given back.
pub async fn write_head_and_body<S: AsyncWriteRent>(
    stream: &mut S,
    head: &mut Vec<u8>,
    body: &mut Vec<u8>,
    start: usize,
    end: usize,
    timeout: Duration,
) -> io::Result<()> {
    let mut bufs = HeadAndBody::new(std::mem::take(head), std::mem::take(body), start, end);
    let mut res = Ok(());
    while bufs.left() > 0 {
        let Ok((r, b)) = monoio::time::timeout(timeout, stream.writev(bufs)).await else {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the peer accepted no bytes in time",
            ));
        };
        bufs = b;
        match r {
            Ok(0) => {
                res = Err(io::ErrorKind::WriteZero.into());
                break;
            }
            Ok(n) => bufs.consume(n),
            Err(e) => {
                res = Err(e);
                break;
            }
        }
    }
    *head = bufs.head;
    *body = bufs.body;
    res
}

#[cfg(test)]
mod tests {
    use super::*;
    use monoio::net::TcpStream;
    use std::io::Read as _;
    use std::time::Instant;

    fn runtime() -> monoio::Runtime<monoio::time::TimeDriver<monoio::IoUringDriver>> {
        monoio::RuntimeBuilder::<monoio::IoUringDriver>::new()
            .enable_timer()
            .build()
            .expect("io_uring runtime")
    }

    /// A loopback peer that takes `read_delay` before each small read and
    /// returns everything it read once the writer closes.
    fn slow_reader(
        read_delay: Duration,
    ) -> (std::net::SocketAddr, std::thread::JoinHandle<Vec<u8>>) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            socket2::SockRef::from(&s)
                .set_recv_buffer_size(4096)
                .unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut got = Vec::new();
            let mut chunk = [0u8; 16 * 1024];
            loop {
                std::thread::sleep(read_delay);
                match s.read(&mut chunk) {
                    Ok(0) | Err(_) => return got,
                    Ok(n) => got.extend_from_slice(&chunk[..n]),
                }
            }
        });
        (addr, t)
    }

    async fn small_send_buffer(addr: std::net::SocketAddr) -> TcpStream {
        let s = TcpStream::connect(addr).await.unwrap();
        use nix::sys::socket::{setsockopt, sockopt::SndBuf};
        setsockopt(std::os::fd::AsRawFd::as_raw_fd(&s), SndBuf, &4096).unwrap();
        s
    }

    #[test]
    fn head_and_body_arrive_whole_through_partial_writes() {
        let (addr, peer) = slow_reader(Duration::from_micros(200));
        let head = b"POST / HTTP/1.1\r\ncontent-length: 299000\r\n\r\n".to_vec();
        let body: Vec<u8> = (0..400_000u32).map(|i| (i % 251) as u8).collect();
        let (h, b) = runtime().block_on(async {
            let mut s = small_send_buffer(addr).await;
            let (mut h, mut b) = (head.clone(), body.clone());
            write_head_and_body(
                &mut s,
                &mut h,
                &mut b,
                1_000,
                300_000,
                Duration::from_secs(5),
            )
            .await
            .unwrap();
            (h, b)
        });
        let mut want = head.clone();
        want.extend_from_slice(&body[1_000..300_000]);
        let got = peer.join().unwrap();
        assert_eq!(got.len(), want.len());
        assert!(got == want, "bytes changed or reordered on the way");
        assert!(h == head && b == body, "the buffers were not given back");
    }

    #[test]
    fn a_peer_that_stops_reading_times_the_write_out() {
        // A peer that never reads (it sleeps past the timeout first).
        let (addr, peer) = slow_reader(Duration::from_secs(2));
        let started = Instant::now();
        let res = runtime().block_on(async {
            let mut s = small_send_buffer(addr).await;
            let (mut h, mut b) = (b"head".to_vec(), vec![7u8; 8 << 20]);
            let end = b.len();
            let res =
                write_head_and_body(&mut s, &mut h, &mut b, 0, end, Duration::from_millis(200))
                    .await;
            (res.map_err(|e| e.kind()), h.is_empty() && b.is_empty())
        });
        assert_eq!(res, (Err(io::ErrorKind::TimedOut), true));
        assert!(started.elapsed() < Duration::from_secs(2));
        drop(peer);
    }
}
