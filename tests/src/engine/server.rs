//! The listener and per-connection tasks: routing, fault injection and
//! response streaming. Engine state sits behind one mutex that is never held
//! across an await.

use super::api::{self, ApiError, ApiKind, Job, Responder};
use super::block_hash::{PromptBlocks, chain_seed, salted_seed};
use super::config::EngineArgs;
use super::core::{Engine, Progress};
use super::faults::FaultUpdate;
use super::http1::{self, ReadError, Request};
use super::responses::{self, Ctx, Outcome};
use super::{messages, scheduler};
use bytes::BytesMut;
use std::io::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::sync::mpsc::UnboundedReceiver;

/// How a streamed answer goes: with a usage chunk at the end, cut after
/// `drop_at` tokens (a fault), and whether the connection stays open.
#[derive(Clone, Copy)]
struct StreamHow {
    include_usage: bool,
    drop_at: Option<u32>,
    keep_alive: bool,
}

/// A body longer than this is parsed and tokenized on a blocking thread,
/// off the runtime, which is single-threaded by default: a 30 MiB chat
/// costs about 150 ms there, and would hold every other request on this
/// engine that long (vLLM tokenizes off its event loop too).
const PARSE_OFF_LOOP: usize = 1 << 20;

/// What the engine runs for a request.
struct Run {
    prompt: PromptBlocks,
    /// The prompt's tokens while KV events are published, else empty.
    tokens: Vec<super::tokenize::Token>,
    salt: Option<Vec<u8>>,
    priority: i64,
}

/// Everything the connection tasks share.
struct Server {
    engine: Arc<Mutex<Engine>>,
    wake: Arc<Notify>,
    args: EngineArgs,
    engine_id: String,
    /// Every name a request may give (served models, then LoRA adapters).
    names: Vec<String>,
    /// Model names as JSON strings.
    model_json: Vec<String>,
    /// Inference requests accepted per name in `names`, and those naming a
    /// model it does not serve (404): `sim:model_requests_total` and
    /// `sim:unknown_model_requests_total` on `/metrics`, so a test can
    /// prove where a router sent each model.
    model_requests: Vec<AtomicU64>,
    unknown_model_requests: AtomicU64,
    model_seeds: Vec<u64>,
    zero_cost: bool,
    next_id: AtomicU64,
    /// KV events are published: requests keep their tokens for them.
    kv_events: bool,
    /// Responses stored for `previous_response_id` and retrieval.
    responses: responses::Store,
}

type Conn = TcpStream;

/// Binds (after `--refuse-connections-ms`), prints `listening on ADDR` on
/// stdout and serves until the process ends.
pub async fn serve(args: EngineArgs) -> anyhow::Result<()> {
    if let Some(dir) = &args.tokenizer_dir {
        super::tokenize::install(dir)?;
    }
    if args.refuse_connections_ms > 0 {
        tracing::info!(
            ms = args.refuse_connections_ms,
            "refusing connections: binding later"
        );
        tokio::time::sleep(Duration::from_millis(args.refuse_connections_ms)).await;
    }
    if args.ports > 1 {
        anyhow::ensure!(
            args.kv_events_port.is_none(),
            "--ports serves engines without KV events"
        );
        let want: std::net::SocketAddr = args
            .listen
            .parse()
            .map_err(|e| anyhow::anyhow!("--ports needs --listen as IP:PORT: {e}"))?;
        let mut engines = Vec::new();
        for k in 0..args.ports {
            let port = if want.port() == 0 {
                0
            } else {
                want.port().saturating_add(k)
            };
            let listener = TcpListener::bind((want.ip(), port)).await?;
            let mut one = args.clone();
            one.ports = 1;
            one.id = match &args.id {
                Some(id) => Some(format!("{id}-{k}")),
                None => Some(listener.local_addr()?.to_string()),
            };
            engines.push(tokio::spawn(serve_on(listener, one)));
        }
        for e in engines {
            e.await??;
        }
        return Ok(());
    }
    let listener = TcpListener::bind(&args.listen).await?;
    serve_on(listener, args).await
}

/// Serves one engine on `listener` until the process ends.
async fn serve_on(listener: TcpListener, args: EngineArgs) -> anyhow::Result<()> {
    let addr = listener.local_addr()?;
    let engine = Arc::new(Mutex::new(Engine::new(&args)));
    let wake = Arc::new(Notify::new());
    let kv_events = super::kv_events::Settings::from_args(&args);
    let publishing = kv_events.is_some();
    if let Some(s) = kv_events {
        engine
            .lock()
            .expect("engine lock")
            .faults
            .kv_events_drop_seq = args.kv_events_drop_seq;
        super::kv_events::start(engine.clone(), s).await?;
    }
    let zero_cost = args.zero_cost();
    if !zero_cost {
        tokio::spawn(scheduler::run(
            engine.clone(),
            wake.clone(),
            args.time_scale,
        ));
    }
    let names = args.served_names();
    let srv = Arc::new(Server {
        engine,
        wake,
        engine_id: args.id.clone().unwrap_or_else(|| addr.to_string()),
        model_json: names
            .iter()
            .map(|m| serde_json::to_string(m).unwrap_or_default())
            .collect(),
        model_seeds: names.iter().map(|m| chain_seed(m)).collect(),
        model_requests: names.iter().map(|_| AtomicU64::new(0)).collect(),
        unknown_model_requests: AtomicU64::new(0),
        names,
        zero_cost,
        next_id: AtomicU64::new(0),
        kv_events: publishing,
        responses: responses::Store::default(),
        args,
    });
    tracing::info!(%addr, id = %srv.engine_id, zero_cost, models = ?srv.names, "sim-engine ready");
    println!("listening on {addr}");
    let _ = std::io::stdout().flush();
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        if srv
            .engine
            .lock()
            .expect("engine lock")
            .faults
            .refusing(Instant::now())
        {
            // Reset at once: SO_LINGER 0 makes close send RST.
            let _ = socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO));
            drop(stream);
            continue;
        }
        tokio::spawn(connection(srv.clone(), stream));
    }
}

async fn connection(srv: Arc<Server>, mut stream: Conn) {
    let _ = stream.set_nodelay(true);
    let mut buf = BytesMut::with_capacity(16 * 1024);
    let mut out = Vec::with_capacity(4096);
    loop {
        let req = match http1::read_request(&mut stream, &mut buf).await {
            Ok(Some(r)) => r,
            Ok(None) | Err(ReadError::Io) => return,
            Err(ReadError::Bad(msg)) => {
                let body = ApiError::bad_request(msg).body();
                let _ = http1::write_full(
                    &mut stream,
                    &mut out,
                    400,
                    "application/json",
                    &body,
                    &srv.engine_id,
                    false,
                )
                .await;
                return;
            }
        };
        match srv.handle(&mut stream, &mut buf, &mut out, req).await {
            Ok(true) => {}
            _ => return,
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Closes the connection without finishing the response (fault injection).
#[derive(Debug)]
struct Dropped;

impl Server {
    /// Serves one request; `Ok(keep_alive)`.
    async fn handle(
        self: &Arc<Self>,
        s: &mut Conn,
        buf: &mut BytesMut,
        out: &mut Vec<u8>,
        req: Request,
    ) -> Result<bool, Dropped> {
        let ka = req.keep_alive;
        let id = &self.engine_id;
        let json = "application/json";
        let r = match (req.method.as_str(), req.path.as_str()) {
            ("POST", "/v1/chat/completions") => {
                return self.infer(s, buf, out, ApiKind::Chat, req.body, ka).await;
            }
            ("POST", "/v1/completions") => {
                return self
                    .infer(s, buf, out, ApiKind::Completion, req.body, ka)
                    .await;
            }
            ("POST", "/generate") => {
                return self
                    .infer(s, buf, out, ApiKind::Generate, req.body, ka)
                    .await;
            }
            ("POST", "/v1/messages") => {
                return self
                    .infer(s, buf, out, ApiKind::Messages, req.body, ka)
                    .await;
            }
            ("POST", "/v1/responses") => {
                return self
                    .infer(s, buf, out, ApiKind::Responses, req.body, ka)
                    .await;
            }
            (method, path) if path.starts_with("/v1/responses/") => {
                let rest = &path["/v1/responses/".len()..];
                let (status, body) = self.stored_response(method, rest, &req.query);
                http1::write_full(s, out, status, json, &body, id, ka).await
            }
            ("POST", "/tokenize") => {
                let (status, body) = match api::parse_tokenize(&req.body, &self.names) {
                    Ok((_, tokens)) => {
                        (200, api::tokenize_body(&tokens, self.args.max_model_len()))
                    }
                    Err(e) => (e.status, e.body()),
                };
                http1::write_full(s, out, status, json, &body, id, ka).await
            }
            ("POST", "/v1/chat/completions/render") => {
                let body = self.render(ApiKind::Chat, &req.body);
                http1::write_full(s, out, body.0, json, &body.1, id, ka).await
            }
            ("POST", "/v1/completions/render") => {
                let body = self.render(ApiKind::Completion, &req.body);
                http1::write_full(s, out, body.0, json, &body.1, id, ka).await
            }
            ("GET", "/health") => http1::write_full(s, out, 200, json, b"", id, ka).await,
            ("GET", "/v1/models") => {
                http1::write_full(s, out, 200, json, &self.models_body(), id, ka).await
            }
            ("GET", "/metrics") => {
                let text = {
                    let e = self.engine.lock().expect("engine lock");
                    let mut g = e.gauges();
                    if self.args.hide_capacity {
                        g.num_blocks = None;
                    }
                    let mut text = e.metrics.render(&self.args.models[0], &g);
                    self.render_model_requests(&mut text);
                    text
                };
                http1::write_full(
                    s,
                    out,
                    200,
                    "text/plain; version=0.0.4",
                    text.as_bytes(),
                    id,
                    ka,
                )
                .await
            }
            ("POST", "/sim/reset_cache") | ("POST", "/reset_prefix_cache") => {
                self.engine.lock().expect("engine lock").cache.reset();
                http1::write_full(s, out, 200, json, b"{\"reset\":true}", id, ka).await
            }
            ("POST", "/sim/faults") => {
                let (status, body) = match serde_json::from_slice::<FaultUpdate>(&req.body) {
                    Ok(u) => {
                        let now = Instant::now();
                        let mut e = self.engine.lock().expect("engine lock");
                        e.faults.apply(&u, now);
                        tracing::info!(faults = ?e.faults, "faults changed");
                        (
                            200,
                            serde_json::to_vec(&e.faults.report(now)).unwrap_or_default(),
                        )
                    }
                    Err(err) => (
                        400,
                        ApiError::bad_request(format!("Invalid faults: {err}")).body(),
                    ),
                };
                http1::write_full(s, out, status, json, &body, id, ka).await
            }
            (
                _,
                "/v1/chat/completions"
                | "/v1/completions"
                | "/generate"
                | "/v1/messages"
                | "/v1/responses"
                | "/health"
                | "/v1/models"
                | "/metrics"
                | "/tokenize"
                | "/v1/chat/completions/render"
                | "/v1/completions/render",
            ) => {
                http1::write_full(
                    s,
                    out,
                    405,
                    json,
                    br#"{"detail":"Method Not Allowed"}"#,
                    id,
                    ka,
                )
                .await
            }
            _ => http1::write_full(s, out, 404, json, br#"{"detail":"Not Found"}"#, id, ka).await,
        };
        r.map(|_| ka).map_err(|_| Dropped)
    }

    /// A non-streaming answer's head and JSON body; with `dropped`, only the
    /// first half of the body (the fault of a connection cut mid-answer).
    fn json_answer(&self, out: &mut Vec<u8>, body: &[u8], keep_alive: bool, dropped: bool) {
        http1::head(
            out,
            200,
            "application/json",
            Some(body.len()),
            &self.engine_id,
            keep_alive,
        );
        let keep = if dropped { body.len() / 2 } else { body.len() };
        out.extend_from_slice(&body[..keep]);
    }

    /// vLLM's render endpoints: the request's prompt token ids, exactly as
    /// the inference endpoint would tokenize the same body, without running
    /// it (no engine state is touched). `(status, body)`.
    fn render(&self, kind: ApiKind, body: &[u8]) -> (u16, Vec<u8>) {
        match api::parse(kind, body, &self.names, self.args.default_max_tokens) {
            Ok(job) => {
                let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                (200, api::render_body(&job, id, &self.model_json[job.model]))
            }
            Err(e) => (e.status, e.body()),
        }
    }

    /// vLLM's `/v1/models`: each served model name (`parent: null`), then
    /// each LoRA adapter (`root`: its path, `parent`: the base model).
    fn models_body(&self) -> Vec<u8> {
        let created = unix_now();
        let base = &self.args.models[0];
        let mut data: Vec<_> = self
            .args
            .models
            .iter()
            .map(|m| {
                serde_json::json!({"id": m, "object": "model", "created": created, "owned_by": "vllm",
                    "root": m, "parent": null, "max_model_len": self.args.max_model_len()})
            })
            .collect();
        data.extend(self.args.lora_adapters().into_iter().map(|(name, path)| {
            serde_json::json!({"id": name, "object": "model", "created": created, "owned_by": "vllm",
                "root": path, "parent": base, "max_model_len": null})
        }));
        serde_json::to_vec(&serde_json::json!({"object": "list", "data": data})).unwrap_or_default()
    }

    /// Appends the per-model request counters to a `/metrics` page.
    fn render_model_requests(&self, out: &mut String) {
        use std::fmt::Write as _;
        let _ = writeln!(out, "# TYPE sim:model_requests_total counter");
        for (name, n) in self.names.iter().zip(&self.model_requests) {
            let name = name.replace('\\', "\\\\").replace('"', "\\\"");
            let _ = writeln!(
                out,
                "sim:model_requests_total{{model=\"{name}\"}} {}",
                n.load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# TYPE sim:unknown_model_requests_total counter\nsim:unknown_model_requests_total {}",
            self.unknown_model_requests.load(Ordering::Relaxed)
        );
    }

    /// `/v1/responses/{id}` (`GET`), `/v1/responses/{id}/cancel` (`POST`)
    /// and `/v1/responses/{id}/input_items` (`GET`), with `rest` the path
    /// after `/v1/responses/`. `(status, body)`.
    fn stored_response(&self, method: &str, rest: &str, query: &str) -> (u16, Vec<u8>) {
        let (id, action) = rest.split_once('/').unwrap_or((rest, ""));
        let answer = match (method, action) {
            ("GET", "") => self.responses.retrieve(id),
            ("POST", "cancel") => self.responses.cancel(id),
            ("GET", "input_items") => self.responses.input_items(id, query),
            (_, "" | "cancel" | "input_items") => {
                return (405, br#"{"detail":"Method Not Allowed"}"#.to_vec());
            }
            _ => return (404, br#"{"detail":"Not Found"}"#.to_vec()),
        };
        match answer {
            Ok(body) => (200, body),
            Err(e) => (e.status, e.body()),
        }
    }

    async fn error(
        &self,
        s: &mut Conn,
        out: &mut Vec<u8>,
        kind: ApiKind,
        e: ApiError,
        ka: bool,
    ) -> Result<bool, Dropped> {
        http1::write_full(
            s,
            out,
            e.status,
            "application/json",
            &e.body_for(kind),
            &self.engine_id,
            ka,
        )
        .await
        .map(|_| ka)
        .map_err(|_| Dropped)
    }

    /// Parses an inference request of endpoint `kind`: its job, and a
    /// Responses request's context.
    fn parse(&self, kind: ApiKind, body: &[u8]) -> Result<(Job, Option<Arc<Ctx>>), ApiError> {
        let default_max = self.args.default_max_tokens;
        match kind {
            ApiKind::Messages => Ok((messages::parse(body, &self.names)?, None)),
            ApiKind::Responses => {
                let (job, ctx) = responses::parse(body, &self.names, default_max, &self.responses)?;
                Ok((job, Some(Arc::new(ctx))))
            }
            _ => Ok((api::parse(kind, body, &self.names, default_max)?, None)),
        }
    }

    /// Stores a finished Responses answer (when its request asked to be
    /// stored), before its last bytes go out: a client may name it in its
    /// next request at once.
    fn finished(&self, resp: &Responder<'_>, cached: u32) {
        if let Some(ctx) = resp.ctx.filter(|c| c.store) {
            self.responses
                .put(ctx.clone(), resp.responses_outcome(cached));
        }
    }

    async fn infer(
        self: &Arc<Self>,
        s: &mut Conn,
        buf: &mut BytesMut,
        out: &mut Vec<u8>,
        kind: ApiKind,
        body: Vec<u8>,
        ka: bool,
    ) -> Result<bool, Dropped> {
        let arrival = Instant::now();
        let parsed = if body.len() > PARSE_OFF_LOOP {
            let srv = self.clone();
            tokio::task::spawn_blocking(move || srv.parse(kind, &body))
                .await
                .unwrap_or_else(|_| Err(ApiError::bad_request("the request could not be read")))
        } else {
            self.parse(kind, &body)
        };
        let (job, ctx) = match parsed {
            Ok(j) => j,
            Err(e) => {
                if e.status == 404 && e.param == Some("model") {
                    self.unknown_model_requests.fetch_add(1, Ordering::Relaxed);
                }
                return self.error(s, out, kind, e, ka).await;
            }
        };
        self.model_requests[job.model].fetch_add(1, Ordering::Relaxed);
        let refused = (self.engine.lock().expect("engine lock")).check_priority(job.priority);
        if let Err(why) = refused {
            return self
                .error(s, out, kind, ApiError::bad_request(why), ka)
                .await;
        }
        let (fail, drop_mid, stall, bad_cached) = {
            let mut e = self.engine.lock().expect("engine lock");
            let (f, d) = (e.faults.fail_rate, e.faults.drop_mid_stream_rate);
            (
                e.dice.roll(f),
                e.dice.roll(d),
                e.faults.stall_first_byte_ms,
                e.faults.bad_cached_tokens.clone(),
            )
        };
        if stall > 0 {
            tokio::time::sleep(Duration::from_millis(stall)).await;
        }
        if fail {
            let e = ApiError {
                status: 500,
                kind: "InternalServerError",
                message: "simulated failure (--fail-rate)".into(),
                param: None,
            };
            return self.error(s, out, kind, e, ka).await;
        }
        let n = job.tokens.len();
        let total = n + job.max_tokens as usize;
        if n == 0 {
            return self
                .error(
                    s,
                    out,
                    kind,
                    ApiError::bad_request("The prompt is empty."),
                    ka,
                )
                .await;
        }
        let limit = self
            .args
            .max_model_len()
            .min(self.args.kv_blocks * super::block_hash::BLOCK_SIZE);
        if total > limit {
            let msg = format!(
                "This model's maximum context length is {limit} tokens. However, you requested {total} tokens ({n} in the messages, {} in the completion). Please reduce the length of the messages or completion.",
                job.max_tokens
            );
            return self
                .error(s, out, kind, ApiError::bad_request(msg), ka)
                .await;
        }
        let seed = match &job.cache_salt {
            Some(salt) => salted_seed(self.model_seeds[job.model], salt),
            None => self.model_seeds[job.model],
        };
        let prompt = PromptBlocks::new(seed, &job.tokens);
        let salt = job.cache_salt.map(String::into_bytes);
        let tokens = if self.kv_events {
            job.tokens
        } else {
            Vec::new()
        };
        let resp = Responder {
            kind: job.kind,
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            created: unix_now(),
            model_json: &self.model_json[job.model],
            digest: prompt.digest(),
            prompt_tokens: n,
            max_tokens: job.max_tokens,
            bad_cached: bad_cached.as_deref(),
            ctx: ctx.as_ref(),
        };
        if ctx.as_ref().is_some_and(|c| c.background) {
            let run = Run {
                prompt,
                tokens,
                salt,
                priority: job.priority,
            };
            return self.background(s, out, &resp, run, ka).await;
        }
        let drop_at = drop_mid.then_some(job.max_tokens / 2);
        if self.zero_cost {
            let cached = self.engine.lock().expect("engine lock").run_now_tokens(
                &prompt,
                &tokens,
                salt.as_deref(),
                job.max_tokens,
            );
            let Some(cached) = cached else {
                let e = ApiError {
                    status: 503,
                    kind: "ServiceUnavailableError",
                    message: "KV cache full".into(),
                    param: None,
                };
                return self.error(s, out, kind, e, ka).await;
            };
            if drop_at.is_none() {
                self.finished(&resp, cached);
            }
            out.clear();
            if job.stream {
                http1::head(out, 200, "text/event-stream", None, &self.engine_id, ka);
                let mut events = Vec::new();
                resp.token_events(&mut events, 0, drop_at.unwrap_or(job.max_tokens), cached);
                if drop_at.is_none() {
                    resp.final_events(&mut events, job.include_usage, cached);
                }
                for e in &events {
                    http1::chunk(out, e);
                }
                if drop_at.is_none() {
                    out.extend_from_slice(http1::LAST_CHUNK);
                }
            } else {
                self.json_answer(out, &resp.full_body(cached), ka, drop_at.is_some());
            }
            s.write_all(out).await.map_err(|_| Dropped)?;
            return if drop_at.is_some() {
                Err(Dropped)
            } else {
                Ok(ka)
            };
        }
        let rx = self.engine.lock().expect("engine lock").submit_tokens(
            prompt,
            tokens,
            salt,
            (job.max_tokens, job.priority),
            arrival,
        );
        self.wake.notify_one();
        if job.stream {
            let how = StreamHow {
                include_usage: job.include_usage,
                drop_at,
                keep_alive: ka,
            };
            self.stream(s, buf, out, &resp, rx, how).await
        } else {
            let mut rx = rx;
            let mut last = Progress {
                generated: 0,
                cached_tokens: 0,
                done: false,
            };
            while !last.done {
                last = next_progress(s, buf, &mut rx).await.ok_or(Dropped)?;
            }
            drop(rx);
            if drop_at.is_none() {
                self.finished(&resp, last.cached_tokens);
            }
            out.clear();
            self.json_answer(
                out,
                &resp.full_body(last.cached_tokens),
                ka,
                drop_at.is_some(),
            );
            s.write_all(out).await.map_err(|_| Dropped)?;
            if drop_at.is_some() {
                Err(Dropped)
            } else {
                Ok(ka)
            }
        }
    }

    /// A background Responses request: stored `queued` and answered at
    /// once, then run on a task of its own (the connection may close),
    /// stored again when done; a cancel aborts the task, which aborts the
    /// request in the engine.
    async fn background(
        self: &Arc<Self>,
        s: &mut Conn,
        out: &mut Vec<u8>,
        resp: &Responder<'_>,
        run: Run,
        ka: bool,
    ) -> Result<bool, Dropped> {
        let ctx = resp
            .ctx
            .expect("a background request has its context")
            .clone();
        let queued = Outcome::queued();
        let mut body = Vec::with_capacity(2048);
        ctx.render(&mut body, &queued);
        self.responses.put(ctx.clone(), queued);
        let (digest, n, max_tokens) = (resp.digest, resp.prompt_tokens, resp.max_tokens);
        let bad_cached = resp.bad_cached.map(str::to_owned);
        let srv = self.clone();
        let id = ctx.id.clone();
        let task = tokio::spawn(async move {
            let cached = if srv.zero_cost {
                srv.engine.lock().expect("engine lock").run_now_tokens(
                    &run.prompt,
                    &run.tokens,
                    run.salt.as_deref(),
                    max_tokens,
                )
            } else {
                let mut rx = srv.engine.lock().expect("engine lock").submit_tokens(
                    run.prompt,
                    run.tokens,
                    run.salt,
                    (max_tokens, run.priority),
                    Instant::now(),
                );
                srv.wake.notify_one();
                let mut done = None;
                while let Some(p) = rx.recv().await {
                    if p.done {
                        done = Some(p.cached_tokens);
                        break;
                    }
                }
                done
            };
            let outcome = match cached {
                Some(c) => {
                    let written = bad_cached.unwrap_or_else(|| c.to_string());
                    Outcome::finished(digest, n, max_tokens, written)
                }
                None => Outcome::failed(),
            };
            srv.responses.put(ctx, outcome);
        });
        self.responses.set_task(&id, task.abort_handle());
        http1::write_full(s, out, 200, "application/json", &body, &self.engine_id, ka)
            .await
            .map(|_| ka)
            .map_err(|_| Dropped)
    }

    async fn stream(
        &self,
        s: &mut Conn,
        buf: &mut BytesMut,
        out: &mut Vec<u8>,
        resp: &Responder<'_>,
        mut rx: UnboundedReceiver<Progress>,
        how: StreamHow,
    ) -> Result<bool, Dropped> {
        let StreamHow {
            include_usage,
            drop_at,
            keep_alive: ka,
        } = how;
        out.clear();
        http1::head(out, 200, "text/event-stream", None, &self.engine_id, ka);
        s.write_all(out).await.map_err(|_| Dropped)?;
        let mut sent = 0;
        let mut events = Vec::new();
        loop {
            let p = next_progress(s, buf, &mut rx).await.ok_or(Dropped)?;
            let upto = drop_at.map_or(p.generated, |d| p.generated.min(d));
            events.clear();
            resp.token_events(&mut events, sent, upto, p.cached_tokens);
            sent = upto;
            let dropping = drop_at.is_some_and(|d| p.generated >= d);
            if p.done && !dropping {
                self.finished(resp, p.cached_tokens);
                resp.final_events(&mut events, include_usage, p.cached_tokens);
            }
            out.clear();
            for e in &events {
                http1::chunk(out, e);
            }
            if p.done && !dropping {
                out.extend_from_slice(http1::LAST_CHUNK);
            }
            if !out.is_empty() {
                s.write_all(out).await.map_err(|_| Dropped)?;
            }
            if dropping {
                return Err(Dropped);
            }
            if p.done {
                return Ok(ka);
            }
        }
    }
}

/// Waits for the next progress (coalescing any already queued), watching the
/// client: if it closes the connection the request is abandoned (dropping
/// the receiver makes the engine abort it). Pipelined bytes are kept in `buf`.
async fn next_progress(
    s: &mut Conn,
    buf: &mut BytesMut,
    rx: &mut UnboundedReceiver<Progress>,
) -> Option<Progress> {
    loop {
        tokio::select! {
            p = rx.recv() => {
                let mut p = p?;
                while let Ok(q) = rx.try_recv() {
                    p = q;
                }
                return Some(p);
            }
            r = s.read_buf(buf) => match r {
                Ok(0) | Err(_) => return None,
                Ok(_) if buf.len() > 1 << 20 => return None,
                Ok(_) => {}
            }
        }
    }
}
