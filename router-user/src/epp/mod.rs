//! The endpoint-picker front: the router as a Gateway API Inference
//! Extension endpoint picker (EPP). Envoy, or any gateway speaking its
//! external-processing protocol, streams each request's headers and body
//! here over gRPC; the router picks with `Router::route`, the routing
//! core the proxy uses, and answers with `x-gateway-destination-endpoint`
//! (a header and the `envoy.lb` dynamic metadata); the gateway connects.
//! The response comes back through the same stream, so its cached tokens,
//! its first byte and its end feed the closed loop and the in-flight
//! counts as the proxy's own answers do. One routing core, two fronts
//! (decision 0055).
//!
//! gRPC runs on a tokio runtime of its own threads (`epp.threads`), never
//! on a traffic worker; a stream holds its routing scratch, so a pick
//! takes no lock the proxy takes.

mod exchange;
mod pick;
mod wire;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures::Stream;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status, Streaming};
use tonic_health::ServingStatus;
use tracing::{debug, info, warn};

use crate::shared::Router;
use exchange::Exchange;

/// Responses queued to one stream's gRPC writer: a pick's answer and a
/// request body's chunks; the reader waits when Envoy reads slowly.
const STREAM_QUEUE: usize = 32;

/// How often the health service's readiness is brought up to date.
const HEALTH_REFRESH: Duration = Duration::from_millis(500);

/// The gRPC services whose health the picker reports: the protocol's
/// `liveness` and `readiness`, and the processor's own name.
const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// Starts the picker when `epp.listen` is set: binds first, so a busy port
/// fails start-up, then serves on a thread of its own.
pub fn start(router: Arc<Router>) -> anyhow::Result<()> {
    let cfg = router.config.load_full();
    let Some(listen) = cfg.epp.listen else {
        return Ok(());
    };
    let listener =
        std::net::TcpListener::bind(listen).with_context(|| format!("epp.listen {listen}"))?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.epp.threads)
        .thread_name("epp")
        .enable_all()
        .build()
        .context("the endpoint picker's runtime")?;
    let max_message = cfg.limits.max_body_bytes.saturating_add(1 << 20);
    std::thread::Builder::new()
        .name("epp-serve".into())
        .spawn(move || {
            rt.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => l,
                    Err(e) => {
                        warn!(error = %e, "endpoint picker: listener");
                        return;
                    }
                };
                let (reporter, health) = tonic_health::server::health_reporter();
                tokio::spawn(report_health(router.clone(), reporter));
                let picker = ExternalProcessorServer::new(Picker { router })
                    .max_decoding_message_size(max_message);
                // No Nagle on the accepted sockets: a pick's answer is a
                // small write waiting for no more, and Envoy's delayed ACK
                // would hold it 40 ms (measured: +42 ms per request).
                let incoming =
                    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
                let served = tonic::transport::Server::builder()
                    .add_service(health)
                    .add_service(picker)
                    .serve_with_incoming(incoming)
                    .await;
                if let Err(e) = served {
                    warn!(error = %e, "endpoint picker stopped");
                }
            });
        })
        .context("the endpoint picker's thread")?;
    info!(%addr, "endpoint picker (ext_proc) is serving");
    Ok(())
}

/// Liveness is the process; readiness (and the processor's service) is
/// SERVING while the router takes requests: not shutting down, and with
/// replicas, caught up from its peers.
async fn report_health(router: Arc<Router>, reporter: tonic_health::server::HealthReporter) {
    reporter
        .set_service_status("liveness", ServingStatus::Serving)
        .await;
    loop {
        let ready =
            !router.shutting_down() && router.replica.as_ref().is_none_or(|r| r.status.is_warm());
        let status = if ready {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        for service in ["", "readiness", EXT_PROC_SERVICE] {
            reporter.set_service_status(service, status).await;
        }
        tokio::time::sleep(HEALTH_REFRESH).await;
    }
}

struct Picker {
    router: Arc<Router>,
}

type Responses = std::pin::Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = Responses;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(STREAM_QUEUE);
        let router = self.router.clone();
        tokio::spawn(async move {
            let mut exchange = Exchange::new(router);
            let mut out = Vec::new();
            loop {
                let msg = match inbound.message().await {
                    Ok(Some(m)) => m,
                    // Envoy closed its side: the request is over.
                    Ok(None) => break,
                    Err(e) => {
                        debug!(error = %e, "ext_proc stream ended");
                        break;
                    }
                };
                out.clear();
                if let Err(e) = exchange.on_message(msg, &mut out).await {
                    warn!(error = %e.message(), "ext_proc stream refused");
                    let _ = tx.send(Err(e)).await;
                    break;
                }
                for r in out.drain(..) {
                    if tx.send(Ok(r)).await.is_err() {
                        return;
                    }
                }
                if exchange.done() {
                    break;
                }
            }
        });
        let stream = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

#[cfg(test)]
mod tests;
