//! One ext_proc stream: one HTTP request through the gateway. Its
//! headers and body are read in the body mode Envoy says it uses, the
//! pick answered as the endpoint-picker protocol asks (the header and the
//! `envoy.lb` metadata), and the response followed as the proxy follows
//! one: its first body byte ends the request's queued prefill, its
//! `usage` closes the loop, its end gives the in-flight count back.

use std::time::Instant;

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HeaderMutation, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
    processing_request::Request,
};
use tracing::{debug, warn};
use xxhash_rust::xxh3::xxh3_64;

use super::pick::{self, Head, Picked};
use super::wire;
use crate::config::epp::{DESTINATION_KEY, SUBSET_KEY};
use crate::error::{Kind, RouterError};
use crate::fleet::feedback::{Reported, UsageScanner};
use crate::fleet::stored::IdScanner;
use crate::shared::{PromptBlocks, RouteScratch, Router};

/// Body chunks sent back to Envoy at most this long: well under gRPC's
/// usual 4 MiB message limit on Envoy's side.
const CHUNK: usize = 64 * 1024;

/// Where the stream is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Waiting for the request headers.
    Start,
    /// Reading the request body (full-duplex streaming or buffered).
    Body,
    /// Picked; waiting for the response.
    Sent,
    /// Following the response body.
    Response,
    /// The response is whole, or the router answered itself.
    Done,
}

/// What Envoy sends the body in (`ProtocolConfiguration`, on the first
/// message); without it, the protocol's own: full-duplex streaming.
fn mode(m: i32) -> BodySendMode {
    BodySendMode::try_from(m).unwrap_or(BodySendMode::FullDuplexStreamed)
}

pub struct Exchange {
    router: std::sync::Arc<Router>,
    phase: Phase,
    request_mode: BodySendMode,
    response_mode: BodySendMode,
    method: String,
    path: String,
    lines: Vec<u8>,
    session: Option<u64>,
    /// The subset hint, as the gateway sent it (`None`: none sent).
    hint: Option<Vec<String>>,
    body: Vec<u8>,
    /// The request's trailers came (full duplex): answered after the body.
    trailers: bool,
    scratch: RouteScratch,
    blocks: PromptBlocks,
    picked: Option<Picked>,
    sent_at: Option<Instant>,
    status: u16,
    streaming: bool,
    usage: UsageScanner,
    first_body_at: Option<Instant>,
    told_prefilled: bool,
    /// The id of a response the engine stores, read as the answer passes.
    ids: Option<IdScanner>,
}

impl Exchange {
    pub fn new(router: std::sync::Arc<Router>) -> Exchange {
        Exchange {
            router,
            phase: Phase::Start,
            request_mode: BodySendMode::FullDuplexStreamed,
            response_mode: BodySendMode::FullDuplexStreamed,
            method: String::new(),
            path: String::new(),
            lines: Vec::new(),
            session: None,
            hint: None,
            body: Vec::new(),
            trailers: false,
            scratch: RouteScratch::default(),
            blocks: PromptBlocks::default(),
            picked: None,
            sent_at: None,
            status: 0,
            streaming: false,
            usage: UsageScanner::default(),
            first_body_at: None,
            told_prefilled: false,
            ids: None,
        }
    }

    /// Whether the stream has nothing more to do.
    pub fn done(&self) -> bool {
        self.phase == Phase::Done
    }

    /// One message from Envoy in, the messages that answer it out. `Err`:
    /// the stream broke the protocol (a message out of order): Envoy gets
    /// the error and applies its failure mode.
    pub async fn on_message(
        &mut self,
        msg: ProcessingRequest,
        out: &mut Vec<ProcessingResponse>,
    ) -> Result<(), tonic::Status> {
        if let Some(pc) = msg.protocol_config {
            self.request_mode = mode(pc.request_body_mode);
            self.response_mode = mode(pc.response_body_mode);
        }
        let Some(req) = msg.request else {
            return Err(out_of_order("a message with no request in it"));
        };
        match (self.phase, req) {
            (Phase::Start, Request::RequestHeaders(h)) => {
                self.hint = wire::metadata_strings(
                    msg.metadata_context.as_ref(),
                    &self.router.config.load().epp.subset_namespace,
                    SUBSET_KEY,
                );
                self.request_headers(h, out).await;
            }
            (Phase::Body, Request::RequestBody(b)) => self.request_body(b, out).await,
            (Phase::Body, Request::RequestTrailers(_)) => {
                self.trailers = true;
                self.finish_request(out).await;
            }
            // Chunks after the pick: the other body modes (streamed,
            // buffered partial), let through.
            (Phase::Sent, Request::RequestBody(_)) => out.push(wire::body_continue(true)),
            (Phase::Sent, Request::RequestTrailers(_)) => out.push(wire::trailers(true)),
            (Phase::Sent, Request::ResponseHeaders(h)) => {
                self.response_headers(&h);
                out.push(wire::response_headers());
                self.phase = if h.end_of_stream {
                    self.finish_response();
                    Phase::Done
                } else {
                    Phase::Response
                };
            }
            (Phase::Response, Request::ResponseBody(b)) => self.response_body(b, out),
            (Phase::Response, Request::ResponseTrailers(_)) => {
                out.push(wire::trailers(false));
                self.finish_response();
                self.phase = Phase::Done;
            }
            (phase, req) => {
                return Err(out_of_order(&format!(
                    "{} while {}",
                    name(&req),
                    match phase {
                        Phase::Start => "waiting for the request headers",
                        Phase::Body => "reading the request body",
                        Phase::Sent => "waiting for the response headers",
                        Phase::Response => "following the response body",
                        Phase::Done => "done",
                    }
                )));
            }
        }
        Ok(())
    }

    async fn request_headers(&mut self, h: HttpHeaders, out: &mut Vec<ProcessingResponse>) {
        let map = h.headers.as_ref();
        let text =
            |n| String::from_utf8_lossy(wire::header(map, n).unwrap_or_default()).into_owned();
        self.method = text(":method");
        self.path = text(":path");
        self.session = wire::header(map, "x-session-id").map(xxh3_64);
        wire::as_head(map, &mut self.lines);
        if h.end_of_stream {
            // No body (a GET): picked on the head alone.
            self.pick_and_answer(true, out).await;
            return;
        }
        match self.request_mode {
            BodySendMode::FullDuplexStreamed => self.phase = Phase::Body,
            BodySendMode::Buffered => {
                out.push(wire::request_headers(wire::common(None)));
                self.phase = Phase::Body;
            }
            other => {
                // Envoy sends no body, or sends it after the headers are
                // answered: picked without the prompt.
                debug!(mode = ?other, "ext_proc request body mode without the whole body first: picking without the prompt");
                self.pick_and_answer(true, out).await;
            }
        }
    }

    async fn request_body(&mut self, b: HttpBody, out: &mut Vec<ProcessingResponse>) {
        let max = self.router.config.load().limits.max_body_bytes;
        if self.body.len() + b.body.len() > max {
            let e = RouterError::new(
                Kind::BodyTooLarge,
                format!("request body over {max} bytes (limits.max_body_bytes)"),
            );
            out.push(wire::immediate(&e, None));
            self.phase = Phase::Done;
            return;
        }
        self.body.extend_from_slice(&b.body);
        if b.end_of_stream || self.request_mode == BodySendMode::Buffered {
            self.finish_request(out).await;
        }
    }

    /// The request is whole: pick, then hand the gateway its body back
    /// (full duplex) or let it go (buffered).
    async fn finish_request(&mut self, out: &mut Vec<ProcessingResponse>) {
        let duplex = self.request_mode == BodySendMode::FullDuplexStreamed;
        if !self.pick_and_answer(duplex, out).await {
            return;
        }
        if duplex {
            let body = std::mem::take(&mut self.body);
            let n = body.len().div_ceil(CHUNK).max(1);
            for (i, piece) in body.chunks(CHUNK).enumerate() {
                out.push(wire::streamed_body(
                    true,
                    piece.to_vec(),
                    i + 1 == n && !self.trailers,
                ));
            }
            if body.is_empty() {
                out.push(wire::streamed_body(true, Vec::new(), !self.trailers));
            }
        }
        if self.trailers {
            out.push(wire::trailers(true));
        }
    }

    /// Picks and answers: the destination as a header mutation of the
    /// request headers (`as_headers`) or of the buffered body's answer,
    /// the same value in the dynamic metadata. `false`: refused (an
    /// immediate response went instead).
    async fn pick_and_answer(
        &mut self,
        as_headers: bool,
        out: &mut Vec<ProcessingResponse>,
    ) -> bool {
        let router = self.router.clone();
        let head = Head {
            method: &self.method,
            path: &self.path,
            lines: &self.lines,
            session: self.session,
        };
        let picked = match pick::subset(&router, self.hint.as_deref()) {
            Ok(only) => {
                pick::pick(
                    &router,
                    &head,
                    &self.body,
                    only.as_ref(),
                    &mut self.scratch,
                    &mut self.blocks,
                )
                .await
            }
            Err(e) => Err(e),
        };
        let picked = match picked {
            Ok(p) => p,
            Err(e) => {
                let retry_after = match e.kind {
                    Kind::Unavailable => Some(1),
                    Kind::Shed => Some(5),
                    _ => None,
                };
                match e.kind.side() {
                    crate::error::Side::Client => {
                        debug!(path = %self.path, status = e.status(), error = %e.message, "refused request")
                    }
                    _ => {
                        warn!(path = %self.path, status = e.status(), error = %e.message, "no endpoint picked")
                    }
                }
                out.push(wire::immediate(&e, retry_after));
                self.phase = Phase::Done;
                return false;
            }
        };
        let list = picked
            .endpoints
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let mutation = HeaderMutation {
            set_headers: vec![wire::set_header(DESTINATION_KEY, list.as_bytes())],
            ..Default::default()
        };
        let mut resp = if as_headers {
            wire::request_headers(wire::common(Some(mutation)))
        } else {
            wire::request_body(wire::common(Some(mutation)))
        };
        resp.dynamic_metadata = Some(wire::dynamic_metadata(
            &self.router.config.load().epp.destination_namespace,
            DESTINATION_KEY,
            &list,
        ));
        out.push(resp);
        self.ids = picked.stores.then(IdScanner::default);
        self.picked = Some(picked);
        self.sent_at = Some(Instant::now());
        self.phase = Phase::Sent;
        true
    }

    fn response_headers(&mut self, h: &HttpHeaders) {
        let map = h.headers.as_ref();
        self.status = std::str::from_utf8(wire::header(map, ":status").unwrap_or_default())
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        self.streaming = wire::header(map, "content-type")
            .is_some_and(|v| memchr::memmem::find(v, b"text/event-stream").is_some());
    }

    fn response_body(&mut self, b: HttpBody, out: &mut Vec<ProcessingResponse>) {
        // Read-only: the bytes go back as they came.
        self.usage.feed(&b.body);
        // A stored response is pinned before its id goes back to Envoy and
        // on to the client, which may name it in its next request at once.
        if let Some(ids) = &mut self.ids
            && let Some(id) = ids.feed(&b.body)
            && (200..300).contains(&self.status)
            && let Some(p) = &self.picked
        {
            self.router.stored_response(id, &p.backend);
        }
        if !b.body.is_empty() && self.first_body_at.is_none() {
            self.first_body_at = Some(Instant::now());
            self.prefilled();
        }
        let eos = b.end_of_stream;
        if self.response_mode == BodySendMode::FullDuplexStreamed {
            out.push(wire::streamed_body(false, b.body, eos));
        } else {
            out.push(wire::body_continue(false));
        }
        if eos {
            self.finish_response();
            self.phase = Phase::Done;
        }
    }

    /// The first body byte: the engine has prefilled the prompt.
    fn prefilled(&mut self) {
        let Some(p) = &mut self.picked else {
            return;
        };
        p.inflight.prefilled();
        if let (Some(r), Some(id)) = (&self.router.replica, p.shared_as)
            && !self.told_prefilled
        {
            self.told_prefilled = true;
            r.outbox.prefilled(p.backend.id_hash, id);
        }
    }

    /// The response is whole: what it teaches, as the proxy learns from
    /// an answer (`proxy::request::attempt`).
    fn finish_response(&mut self) {
        let Some(p) = self.picked.take() else {
            return;
        };
        let router = &self.router;
        let backend = &p.backend;
        if (200..300).contains(&self.status) {
            self.ids = None;
            match self.usage.report() {
                // A stored conversation's usage: the engine's prompt is
                // more than the router hashed; it teaches nothing.
                Reported::Valid(u) if p.pinned => p.model.usage(u.prompt_tokens, u.cached_tokens),
                Reported::Valid(u) => {
                    router.observe_answer(
                        backend,
                        &self.blocks,
                        p.matched_blocks,
                        p.shared_blocks,
                        u,
                    );
                    p.model.usage(u.prompt_tokens, u.cached_tokens);
                }
                Reported::Invalid(why) => {
                    if backend.feedback.invalid_report() {
                        warn!(backend = %backend.url, why = why.describe(), "an answer's usage is not believed: such answers teach the closed loop nothing (counted in prefix_router_usage_invalid_total; warned once per backend)");
                    }
                }
                Reported::Nothing => {}
            }
            if let (true, Some(t), Some(sent)) = (self.streaming, self.first_body_at, self.sent_at)
            {
                let ttft = (t - sent).as_secs_f64();
                p.model.ttft(ttft);
                if p.queued_ahead == 0 && !p.pinned {
                    backend.feedback.observe_ttft(p.prefill_blocks, ttft);
                }
            }
        }
        if self.status >= 500 {
            router.request_failed(backend, "5xx answer");
        } else if self.status > 0 {
            backend.health.request_succeeded();
        }
        if self.status > 0 {
            backend.stats.responded(self.status);
        }
        self.release(p);
    }

    fn release(&self, p: Picked) {
        if let (Some(r), Some(id)) = (&self.router.replica, p.shared_as) {
            r.outbox.done(p.backend.id_hash, id);
        }
        drop(p);
    }
}

impl Drop for Exchange {
    /// A stream that ends early (the client left, the upstream failed, the
    /// gateway restarted) gives its in-flight count back all the same.
    fn drop(&mut self) {
        if let Some(p) = self.picked.take() {
            self.release(p);
        }
    }
}

fn out_of_order(what: &str) -> tonic::Status {
    tonic::Status::failed_precondition(format!("ext_proc stream out of order: {what}"))
}

fn name(r: &Request) -> &'static str {
    match r {
        Request::RequestHeaders(_) => "request headers",
        Request::ResponseHeaders(_) => "response headers",
        Request::RequestBody(_) => "a request body",
        Request::ResponseBody(_) => "a response body",
        Request::RequestTrailers(_) => "request trailers",
        Request::ResponseTrailers(_) => "response trailers",
    }
}
