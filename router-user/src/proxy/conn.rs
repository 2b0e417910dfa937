//! One client connection: read a request, have it handled, answer errors;
//! repeat while the client keeps the connection alive. Requests on one
//! connection are handled one by one (pipelined ones in order).

use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Instant;

use monoio::net::TcpStream;
use tracing::{debug, info, warn};

use crate::config::{Config, ms};
use crate::error::{Kind, RouterError, Shape, Side};
use crate::proxy::budget;
use crate::proxy::client::{ClientConn, Request, linger, read_request, shrink};
use crate::proxy::io::{Read, read_more, write_all};
use crate::proxy::request;
use crate::proxy::stream::Stream;
use crate::proxy::worker::{RETURN_ABOVE, Worker};

/// How long a TLS connection's close_notify may take to leave; a client
/// that reads nothing more does not hold the task longer.
const CLOSE_NOTIFY_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// Serves a client connection until it closes, errs or idles out.
/// On a `[tls]` listener the handshake comes first, within
/// `timeouts.client_header_ms`; a client that fails it (garbage, a
/// truncated hello, a certificate `tls.client_ca` refuses) is closed and
/// counted, and no other connection notices.
pub async fn serve(worker: Rc<Worker>, tcp: TcpStream, peer: SocketAddr) {
    let tls = worker.router.config.load().loaded.server_tls.clone();
    let stream = match tls {
        None => Stream::plain(tcp),
        Some(tls) => {
            let timeout = ms(worker.router.config.load().timeouts.client_header_ms);
            match Stream::accept(tcp, tls, timeout).await {
                Ok(s) => {
                    worker.router.metrics.tls_handshake(true);
                    s
                }
                Err(e) => {
                    worker.router.metrics.tls_handshake(false);
                    debug!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
            }
        }
    };
    let mut c = ClientConn::new(stream, peer);
    loop {
        // A kept-alive connection may idle across a reload: the request is
        // judged (its key above all) by the configuration of when it came.
        if c.buf.is_empty() {
            let idle = ms(worker.router.config.load().timeouts.client_idle_ms);
            if !matches!(
                read_more(&mut c.stream, &mut c.buf, idle).await,
                Read::Data(_)
            ) {
                // Closed, failed or idle between requests: nothing to answer.
                break;
            }
        }
        let cfg = worker.router.config.load_full();
        let result = one_request(&worker, &cfg, &mut c).await;
        if c.buf.capacity().max(c.body.capacity()) > RETURN_ABOVE {
            // The worker's parse scratch grew with this body: give it back.
            worker.shrink_scratch();
        }
        match result {
            Ok(true) if !worker.router.shutting_down() => {
                shrink(&mut c);
                let bytes = budget::charge_for([c.buf.capacity(), c.body.capacity()]);
                c.charge.set(bytes, usize::MAX);
            }
            Ok(_) => break,
            Err(e) => {
                if e.kind == Kind::Unauthorized {
                    worker.router.metrics.unauthorized();
                }
                if e.kind != Kind::Internal || !e.message.is_empty() {
                    log_error(&e, &c.peer, "-");
                    // After a framing error the rest of the stream cannot be trusted.
                    let retry_after = retry_after(&e);
                    let mut resp = e.to_response(true, retry_after, cfg.debug_headers);
                    let write = ms(cfg.timeouts.client_write_ms);
                    if write_all(&mut c.stream, &mut resp, write).await.is_ok()
                        && matches!(
                            e.kind,
                            Kind::BodyTooLarge | Kind::Unavailable | Kind::Unauthorized
                        )
                    {
                        linger(&cfg, &mut c).await;
                    }
                }
                break;
            }
        }
    }
    if c.stream.is_tls() && !c.lost_buffers {
        // TLS says a connection ended on purpose with close_notify: a body
        // delimited by the close (HTTP/1.0) is then whole, not cut.
        use monoio::io::AsyncWriteRent;
        let _ = monoio::time::timeout(CLOSE_NOTIFY_WAIT, c.stream.shutdown()).await;
    }
}

/// Handles one request; `Ok(true)` when the connection may carry another.
/// `Err` means the connection must close after the error is answered.
async fn one_request(
    worker: &Worker,
    cfg: &Config,
    c: &mut ClientConn,
) -> Result<bool, RouterError> {
    let Some((head, body)) = read_request(cfg, c).await? else {
        return Ok(false);
    };
    let req = Request {
        head: &head,
        body,
        read_at: Instant::now(),
    };
    let result = request::handle(worker, cfg, c, req).await;
    // A write that timed out took a buffer with it: answer, then close.
    let reusable = head.keep_alive && !c.lost_buffers;
    if !c.lost_buffers {
        // Drop this request's bytes; keep any pipelined request behind them.
        c.buf.drain(..c.consumed);
    }
    c.consumed = 0;
    match result {
        Ok(close) => Ok(reusable && !close),
        Err(e) => {
            log_error(&e, &c.peer, head.path(&c.fwd));
            // The request was read whole, so the connection stays usable.
            let retry_after = retry_after(&e);
            let shape = Shape::of_path(head.path(&c.fwd));
            let mut resp = e.to_response_in(shape, !reusable, retry_after, cfg.debug_headers);
            if write_all(&mut c.stream, &mut resp, ms(cfg.timeouts.client_write_ms))
                .await
                .is_err()
            {
                return Ok(false);
            }
            Ok(reusable)
        }
    }
}

/// Seconds a client should wait before it tries again, for the errors
/// that say so.
fn retry_after(e: &RouterError) -> Option<u32> {
    match e.kind {
        Kind::Unavailable => Some(1),
        Kind::Shed => Some(5),
        _ => None,
    }
}

fn log_error(e: &RouterError, peer: &SocketAddr, path: &str) {
    let detail = e.detail.as_deref().unwrap_or("");
    match e.kind.side() {
        Side::Client => {
            info!(%peer, path, status = e.status(), error = %e.message, detail, "refused request")
        }
        Side::Backend | Side::Internal => {
            warn!(%peer, path, status = e.status(), error = %e.message, detail, "request failed")
        }
    }
}
