//! Closed- and open-loop drivers: sessions, request bodies, records.

use super::api::{Api, Fields};
use super::ceiling::Ceiling;
use super::client::{Client, Read, Target};
use super::record::{Record, Summary};
use super::scenario::{Corpus, Msg, Scenario, Session};
use anyhow::{Context, bail};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Most sessions in flight at once in open loop (arrivals beyond wait).
const MAX_OPEN_SESSIONS: usize = 10_000;

/// How a run is driven. [`RunConfig::new`] gives the defaults.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// Base URL of any OpenAI-compatible server: router, engine or vLLM.
    pub target: String,
    /// The API the conversations are sent in; every API sends the same
    /// conversations, which the engine renders to the same prompts.
    pub api: Api,
    /// More base URLs serving the same fleet (router replicas). Each
    /// request goes to one of `target` and these, drawn at random for that
    /// request alone (seeded by `seed`, the session and the turn), as an L4
    /// balancer or a Kubernetes Service spreads connections: a
    /// conversation's turns may land on different replicas.
    pub replicas: Vec<String>,
    pub scenario: Scenario,
    /// Closed loop: concurrent users, each running sessions back to back.
    pub users: usize,
    /// Open loop: Poisson session arrivals per second (overrides `users`);
    /// for one-request sessions this is the request rate.
    pub rate: Option<f64>,
    /// Stop after this many requests.
    pub requests: Option<u64>,
    /// Stop starting requests after this long.
    pub duration: Option<Duration>,
    pub seed: u64,
    /// Model to ask for [default: the first of `GET /v1/models`].
    pub model: Option<String>,
    /// Streamed answers (chat: with `stream_options.include_usage`), TTFT
    /// = the first event carrying text; otherwise TTFT = first body byte.
    pub stream: bool,
    /// Per-request timeout.
    pub request_timeout: Duration,
    /// Write records here as JSONL.
    pub out: Option<PathBuf>,
    /// Time zero of the records' `start_ms` and `end_ms` and of
    /// `duration` [default: when the run starts]. Workloads run together
    /// share one, and so does whoever acts on the fleet during the run.
    pub epoch: Option<Instant>,
    /// Which replicas take traffic now (a balancer's readiness view); a
    /// request drawn for one that does not goes to the next one that does.
    pub gate: Option<Arc<ReplicaGate>>,
}

/// Which of a run's targets (`target`, then `replicas`) take traffic, as
/// a Kubernetes Service's endpoints follow readiness: one taken out gets
/// no new request until it is put back. Shared by the run and whoever
/// stops and starts the replicas.
#[derive(Debug)]
pub struct ReplicaGate {
    up: Vec<std::sync::atomic::AtomicBool>,
    rerouted: AtomicU64,
}

impl ReplicaGate {
    /// `n` targets, all taking traffic.
    pub fn new(n: usize) -> Self {
        Self {
            up: (0..n)
                .map(|_| std::sync::atomic::AtomicBool::new(true))
                .collect(),
            rerouted: AtomicU64::new(0),
        }
    }

    /// Takes target `i` out (`false`) or puts it back (`true`).
    pub fn set_up(&self, i: usize, up: bool) {
        if let Some(u) = self.up.get(i) {
            u.store(up, Ordering::SeqCst);
        }
    }

    /// Requests drawn for a target that was out, sent to another.
    pub fn rerouted(&self) -> u64 {
        self.rerouted.load(Ordering::Relaxed)
    }

    /// Target `i`, or the next one taking traffic when it is out (`i`
    /// itself when none is).
    fn route(&self, i: usize) -> usize {
        let n = self.up.len();
        if n == 0 || self.up.get(i).is_none_or(|u| u.load(Ordering::SeqCst)) {
            return i;
        }
        match (1..n)
            .map(|k| (i + k) % n)
            .find(|&j| self.up[j].load(Ordering::SeqCst))
        {
            Some(j) => {
                self.rerouted.fetch_add(1, Ordering::Relaxed);
                j
            }
            None => i,
        }
    }
}

impl RunConfig {
    /// Closed loop with 8 users and 100 requests, streaming, seed 1.
    pub fn new(target: impl Into<String>, scenario: Scenario) -> Self {
        RunConfig {
            target: target.into(),
            api: Api::Chat,
            replicas: Vec::new(),
            scenario,
            users: 8,
            rate: None,
            requests: Some(100),
            duration: None,
            seed: 1,
            model: None,
            stream: true,
            request_timeout: Duration::from_secs(300),
            out: None,
            epoch: None,
            gate: None,
        }
    }
}

struct Ctx {
    cfg: RunConfig,
    /// `target`'s client, then one per replica.
    clients: Vec<Client>,
    corpus: Corpus,
    model_json: String,
    t0: Instant,
    deadline: Option<Instant>,
    tickets: AtomicU64,
    records: Mutex<Vec<Record>>,
    ceiling: Mutex<Ceiling>,
}

impl Ctx {
    /// Claims the right to send one more request.
    fn claim(&self) -> Option<u64> {
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            return None;
        }
        let t = self.tickets.fetch_add(1, Ordering::Relaxed);
        match self.cfg.requests {
            Some(max) if t >= max => None,
            _ => Some(t),
        }
    }

    /// The body of a request of `messages` (the whole conversation so
    /// far) in the run's API; `previous` is the last answer's `id`.
    fn body(&self, session: u64, messages: &[Msg], previous: Option<&str>) -> Vec<u8> {
        let fields = Fields {
            model_json: &self.model_json,
            max_tokens: self.cfg.scenario.max_tokens,
            session,
            stream: self.cfg.stream,
            service_tier: self.cfg.scenario.service_tier.as_deref(),
            user: self.cfg.scenario.user.as_deref(),
        };
        self.cfg.api.body(&fields, messages, previous)
    }

    /// Which client sends turn `turn` of session `session`: the same for
    /// every run of one seed, independent from request to request.
    fn pick(&self, session: u64, turn: u32) -> usize {
        let n = self.clients.len() as u64;
        if n <= 1 {
            return 0;
        }
        let drawn = (mix(self.cfg.seed ^ 0x5bead, session, u64::from(turn)) % n) as usize;
        match &self.cfg.gate {
            Some(g) => g.route(drawn),
            None => drawn,
        }
    }

    fn ms(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.t0).as_secs_f64() * 1e3
    }

    /// Runs one session to its end (or until the run's bounds are reached);
    /// returns false when the run is over.
    async fn run_session(&self, user: u64, session_id: u64, seed: u64) -> bool {
        let mut s = Session::new(&self.corpus, session_id, seed);
        let api = self.cfg.api;
        // The last answer's id, which a chained turn names.
        let mut previous: Option<String> = None;
        while let Some(messages) = s.next_messages() {
            let Some(seq) = self.claim() else {
                return false;
            };
            let body = self.body(session_id, &messages, previous.as_deref());
            let prompt = self.ceiling.lock().expect("ceiling").prompt(&messages);
            let ceiling_cached = self.ceiling.lock().expect("ceiling").on_send(&prompt);
            let sid = session_id.to_string();
            let headers = [("x-session-id", sid.as_str())];
            let replica = self.pick(session_id, s.turn);
            let start = Instant::now();
            let o = self.clients[replica]
                .send(
                    "POST",
                    api.path(),
                    &headers,
                    &body,
                    Read::Answer(api),
                    self.cfg.request_timeout,
                )
                .await;
            let usage = o.usage.unwrap_or_default();
            let rec = Record {
                seq,
                scenario: self.cfg.scenario.kind.name().into(),
                user,
                session: session_id,
                turn: s.turn,
                turns: s.turns(),
                prefix_id: s.prefix_id,
                start_ms: self.ms(start),
                ttft_ms: o
                    .first
                    .map(|t| t.saturating_duration_since(start).as_secs_f64() * 1e3),
                end_ms: self.ms(o.end),
                latency_ms: o.end.saturating_duration_since(start).as_secs_f64() * 1e3,
                status: o.status,
                error: o.error.clone().or_else(|| {
                    // Without it the chain cannot go on.
                    (o.status == 200 && api.chains() && o.id.is_none())
                        .then(|| "the answer carries no id".to_string())
                }),
                prompt_tokens: usage.prompt_tokens,
                cached_tokens: usage.cached_tokens,
                completion_tokens: usage.completion_tokens,
                local_prompt_tokens: prompt.num_tokens as u64,
                ceiling_cached_tokens: ceiling_cached,
                instance: o.instance.clone(),
                decision: o.decision.clone(),
                replica: (self.clients.len() > 1).then_some(replica as u32),
                tenant: self.cfg.scenario.user.clone(),
            };
            let ok = rec.ok();
            if !ok {
                tracing::debug!(session = session_id, error = ?rec.error, "request failed");
            }
            self.records.lock().expect("records").push(rec);
            if !ok {
                // The conversation cannot go on without the answer.
                return true;
            }
            self.ceiling
                .lock()
                .expect("ceiling")
                .on_answer(&prompt, &o.text);
            s.record_answer(&o.text);
            previous = o.id;
            if s.has_more() {
                let think = s.think_time();
                if !think.is_zero() {
                    tokio::time::sleep(think).await;
                }
            }
        }
        true
    }
}

fn mix(a: u64, b: u64, c: u64) -> u64 {
    let mut z = a ^ b.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ c.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z ^ (z >> 31)
}

/// Runs a workload and returns every request's record and the summary.
pub async fn run(cfg: RunConfig) -> anyhow::Result<(Vec<Record>, Summary)> {
    if cfg.requests.is_none() && cfg.duration.is_none() {
        bail!("a run needs a request count or a duration");
    }
    let mut clients = vec![Client::new(Target::parse(&cfg.target).await?)];
    for r in &cfg.replicas {
        clients.push(Client::new(Target::parse(r).await?));
    }
    let client = &clients[0];
    let model = match &cfg.model {
        Some(m) => m.clone(),
        None => {
            let (status, body) = client.get("/v1/models").await?;
            if status != 200 {
                bail!("GET /v1/models answered {status}");
            }
            let v: serde_json::Value =
                serde_json::from_slice(&body).context("/v1/models is not JSON")?;
            v["data"][0]["id"]
                .as_str()
                .context("/v1/models lists no model")?
                .to_string()
        }
    };
    let t0 = cfg.epoch.unwrap_or_else(Instant::now);
    let ctx = Arc::new(Ctx {
        corpus: Corpus::new(&cfg.scenario, cfg.seed),
        model_json: serde_json::to_string(&model)?,
        ceiling: Mutex::new(Ceiling::new(&model)),
        clients,
        t0,
        deadline: cfg.duration.map(|d| t0 + d),
        tickets: AtomicU64::new(0),
        records: Mutex::new(Vec::new()),
        cfg,
    });
    let mut tasks = tokio::task::JoinSet::new();
    if let Some(rate) = ctx.cfg.rate {
        anyhow::ensure!(rate > 0.0, "rate must be positive");
        let mut rng = ChaCha8Rng::seed_from_u64(mix(ctx.cfg.seed, 0xa11, 0));
        let mut next = Instant::now();
        for arrival in 0u64.. {
            let u: f64 = rng.random_range(f64::EPSILON..1.0);
            next += Duration::from_secs_f64(-u.ln() / rate);
            tokio::time::sleep_until(next.into()).await;
            let over = ctx.deadline.is_some_and(|d| Instant::now() >= d)
                || ctx
                    .cfg
                    .requests
                    .is_some_and(|m| ctx.tickets.load(Ordering::Relaxed) >= m);
            if over {
                break;
            }
            while tasks.len() >= MAX_OPEN_SESSIONS {
                tasks.join_next().await;
            }
            while tasks.try_join_next().is_some() {}
            let c = ctx.clone();
            let seed = mix(c.cfg.seed, arrival, 1);
            tasks.spawn(async move {
                c.run_session(arrival, arrival, seed).await;
            });
        }
    } else {
        anyhow::ensure!(ctx.cfg.users > 0, "users must be positive");
        for user in 0..ctx.cfg.users as u64 {
            let c = ctx.clone();
            tasks.spawn(async move {
                for k in 0u64.. {
                    let session_id = user * 1_000_000 + k;
                    if !c
                        .run_session(user, session_id, mix(c.cfg.seed, user, k + 2))
                        .await
                    {
                        break;
                    }
                }
            });
        }
    }
    while let Some(r) = tasks.join_next().await {
        r.context("workload task panicked")?;
    }
    let duration_s = Instant::now().saturating_duration_since(t0).as_secs_f64();
    let mut records = std::mem::take(&mut *ctx.records.lock().expect("records"));
    records.sort_by_key(|r| r.seq);
    if let Some(path) = &ctx.cfg.out {
        use std::io::Write;
        let mut w = std::io::BufWriter::new(
            std::fs::File::create(path).with_context(|| format!("create {}", path.display()))?,
        );
        for r in &records {
            serde_json::to_writer(&mut w, r)?;
            w.write_all(b"\n")?;
        }
        w.flush()?;
    }
    let summary = Summary::from_records(ctx.cfg.scenario.kind.name(), &records, duration_s);
    Ok((records, summary))
}

/// [`run`] on a fresh single-threaded runtime (do not call from inside a
/// tokio runtime).
pub fn run_blocking(cfg: RunConfig) -> anyhow::Result<(Vec<Record>, Summary)> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(run(cfg))
}

#[cfg(test)]
mod tests {
    use super::ReplicaGate;

    #[test]
    fn a_replica_taken_out_sends_its_share_to_the_next_one_in() {
        let g = ReplicaGate::new(3);
        assert_eq!((g.route(0), g.route(2)), (0, 2));
        g.set_up(2, false);
        assert_eq!(g.route(2), 0, "wraps around");
        g.set_up(0, false);
        assert_eq!((g.route(2), g.route(0)), (1, 1));
        assert_eq!(g.rerouted(), 3);
        g.set_up(1, false);
        assert_eq!(g.route(1), 1, "none in: where it was drawn");
        g.set_up(2, true);
        assert_eq!(g.route(2), 2);
    }
}
