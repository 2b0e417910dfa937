//! A connection of the data path, plain TCP or TLS (rustls driven over
//! monoio's owned-buffer I/O by `monoio-rustls`, decision 0054): a client
//! connection on a `[tls]` listener, a connection to an `https://`
//! backend. The rest of the proxy reads and writes a `Stream` and never
//! asks which it is, but for the socket checks that peek at the TCP
//! socket itself (`fd`).

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use monoio::BufResult;
use monoio::buf::{IoBuf, IoBufMut, IoVecBuf, IoVecBufMut};
use monoio::io::{AsyncReadRent, AsyncWriteRent};
use monoio::net::TcpStream;
use monoio_rustls::{ClientTlsStream, ServerTlsStream, TlsAcceptor, TlsConnector};

enum Inner {
    Plain(TcpStream),
    /// Boxed: a TLS session is about 1 KB of state plus its buffers.
    Server(Box<ServerTlsStream<TcpStream>>),
    Client(Box<ClientTlsStream<TcpStream>>),
}

/// A data-path connection.
pub struct Stream {
    /// The TCP socket under it, for `recv(MSG_PEEK)` and `TCP_INFO`.
    fd: RawFd,
    inner: Inner,
}

impl Stream {
    pub fn plain(tcp: TcpStream) -> Stream {
        Stream {
            fd: tcp.as_raw_fd(),
            inner: Inner::Plain(tcp),
        }
    }

    /// Whether bytes on the socket are TLS records (a peek sees records,
    /// not the application's bytes).
    pub fn is_tls(&self) -> bool {
        !matches!(self.inner, Inner::Plain(_))
    }

    /// The server side of a TLS handshake on an accepted connection, within
    /// `timeout` (a client that stalls its handshake holds a connection
    /// slot no longer than a slow request head would).
    pub async fn accept(
        tcp: TcpStream,
        cfg: Arc<rustls::ServerConfig>,
        timeout: Duration,
    ) -> io::Result<Stream> {
        let fd = tcp.as_raw_fd();
        let acceptor = TlsAcceptor::from(cfg);
        match monoio::time::timeout(timeout, acceptor.accept(tcp)).await {
            Ok(Ok(s)) => Ok(Stream {
                fd,
                inner: Inner::Server(Box::new(s)),
            }),
            Ok(Err(e)) => Err(io::Error::new(io::ErrorKind::InvalidData, e.to_string())),
            Err(_) => Err(io::ErrorKind::TimedOut.into()),
        }
    }

    /// The client side of a TLS handshake with a backend, checking its
    /// certificate against `name` (sent as SNI).
    pub async fn connect(
        tcp: TcpStream,
        cfg: Arc<rustls::ClientConfig>,
        name: &str,
    ) -> io::Result<Stream> {
        let fd = tcp.as_raw_fd();
        let name = rustls::pki_types::ServerName::try_from(name.to_owned())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let s = TlsConnector::from(cfg)
            .connect(name, tcp)
            .await
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
        Ok(Stream {
            fd,
            inner: Inner::Client(Box::new(s)),
        })
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        self.fd
    }
}

impl AsyncReadRent for Stream {
    async fn read<T: IoBufMut>(&mut self, buf: T) -> BufResult<usize, T> {
        match &mut self.inner {
            Inner::Plain(s) => s.read(buf).await,
            Inner::Server(s) => s.read(buf).await,
            Inner::Client(s) => s.read(buf).await,
        }
    }

    async fn readv<T: IoVecBufMut>(&mut self, buf: T) -> BufResult<usize, T> {
        match &mut self.inner {
            Inner::Plain(s) => s.readv(buf).await,
            Inner::Server(s) => s.readv(buf).await,
            Inner::Client(s) => s.readv(buf).await,
        }
    }
}

impl AsyncWriteRent for Stream {
    async fn write<T: IoBuf>(&mut self, buf: T) -> BufResult<usize, T> {
        match &mut self.inner {
            Inner::Plain(s) => s.write(buf).await,
            Inner::Server(s) => s.write(buf).await,
            Inner::Client(s) => s.write(buf).await,
        }
    }

    async fn writev<T: IoVecBuf>(&mut self, buf: T) -> BufResult<usize, T> {
        match &mut self.inner {
            Inner::Plain(s) => s.writev(buf).await,
            Inner::Server(s) => s.writev(buf).await,
            Inner::Client(s) => s.writev(buf).await,
        }
    }

    async fn flush(&mut self) -> io::Result<()> {
        match &mut self.inner {
            Inner::Plain(s) => s.flush().await,
            Inner::Server(s) => s.flush().await,
            Inner::Client(s) => s.flush().await,
        }
    }

    async fn shutdown(&mut self) -> io::Result<()> {
        match &mut self.inner {
            Inner::Plain(s) => s.shutdown().await,
            Inner::Server(s) => s.shutdown().await,
            Inner::Client(s) => s.shutdown().await,
        }
    }
}
