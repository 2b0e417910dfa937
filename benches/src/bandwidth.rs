//! The replicas' stream at a production rate: sharing prefix-router
//! replicas in front of zero-cost engines (`--time-scale 0`, so the engines
//! are not what limits the rate), an open loop of single-turn chat requests
//! at a fixed rate, and what each replica's stream published meanwhile
//! (`prefix-bench replicas-bandwidth`).

use crate::fleet::{self, Bins, Engine};
use crate::replicas::{ReplicaTraffic, StreamCounters};
use crate::report::Machine;
use crate::table::Table;
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::time::Duration;
use testkit::workload::{RunConfig, Scenario, ScenarioKind};

/// What runs: how many replicas, at what rate, on what traffic.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BandwidthCfg {
    /// Sharing prefix-router replicas; each request to one at random.
    pub replicas: usize,
    pub engines: usize,
    /// Requests per second offered, Poisson arrivals (open loop).
    pub rate: f64,
    pub duration_s: f64,
    /// Shared system prompts, each this many tokens.
    pub system_prompts: usize,
    pub system_tokens: usize,
    /// Tokens of each request's own user message.
    pub user_tokens: usize,
    pub max_tokens: u32,
    pub seed: u64,
}

impl Default for BandwidthCfg {
    /// 2 replicas at 1,000 requests/s for 10 s: 2,000-token chat requests,
    /// 1,500 of them one of 8 shared system prompts.
    fn default() -> Self {
        BandwidthCfg {
            replicas: 2,
            engines: 2,
            rate: 1_000.0,
            duration_s: 10.0,
            system_prompts: 8,
            system_tokens: 1_500,
            user_tokens: 500,
            max_tokens: 16,
            seed: 1,
        }
    }
}

impl BandwidthCfg {
    /// Single-turn chats: a shared system prompt and a user message.
    fn scenario(&self) -> Scenario {
        Scenario {
            prefixes: self.system_prompts,
            prefix_tokens: self.system_tokens,
            user_tokens: self.user_tokens,
            turns: (1, 1),
            max_tokens: self.max_tokens,
            ..Scenario::new(ScenarioKind::Chat)
        }
    }
}

/// What a run measured.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BandwidthResults {
    pub unix_time: u64,
    pub machine: Machine,
    pub command: String,
    pub cfg: BandwidthCfg,
    pub requests: u64,
    pub errors: u64,
    /// From the first request to the last answer.
    pub seconds: f64,
    /// Successful requests per second achieved.
    pub rps: f64,
    pub prompt_tokens_mean: f64,
    pub hit_rate: f64,
    pub replicas: Vec<ReplicaTraffic>,
}

/// Starts the engines and the replicas, runs the open loop, reads each
/// replica's `/admin/replicas` before and after it, stops everything.
pub fn run(bins: &Bins, cfg: &BandwidthCfg, command: String) -> anyhow::Result<BandwidthResults> {
    anyhow::ensure!(cfg.replicas >= 2, "sharing needs 2 replicas or more");
    anyhow::ensure!(
        cfg.rate > 0.0 && cfg.duration_s > 0.0,
        "a rate and a duration"
    );
    let args: Vec<String> = ["--time-scale", "0", "--kv-blocks", "100000"]
        .map(String::from)
        .to_vec();
    let engines = fleet::start_engines(bins, cfg.engines.max(1), &args)?;
    let urls: Vec<String> = engines.iter().map(Engine::url).collect();
    let front = crate::quality::parse_policy("prefix");
    let (routers, files) = crate::quality::start_ours(bins, &front, &urls, &[], cfg.replicas)?;
    let before: Vec<Option<StreamCounters>> = routers.iter().map(StreamCounters::read).collect();
    let mut run = RunConfig::new(routers[0].url(), cfg.scenario());
    run.replicas = routers[1..].iter().map(|r| r.url()).collect();
    run.rate = Some(cfg.rate);
    run.requests = None;
    run.duration = Some(Duration::from_secs_f64(cfg.duration_s));
    run.seed = cfg.seed;
    run.model = Some(crate::quality::engine_model(&engines[0])?);
    // Answers whole, not streamed: the router's work per request, and so
    // its stream, is the same, and the load generator keeps up.
    run.stream = false;
    run.request_timeout = Duration::from_secs(30);
    let (records, summary) = testkit::workload::run_blocking(run)?;
    let replicas: Vec<ReplicaTraffic> = routers
        .iter()
        .zip(&before)
        .enumerate()
        .map(|(i, (r, b))| {
            let end = StreamCounters::read(r).unwrap_or_default();
            let served = records
                .iter()
                .filter(|x| x.ok() && x.replica == Some(i as u32))
                .count() as u64;
            ReplicaTraffic::new(i, cfg.replicas, end.since(*b), summary.duration_s, served)
        })
        .collect();
    drop(routers);
    drop(files);
    drop(engines);
    Ok(BandwidthResults {
        unix_time: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        machine: Machine::detect(),
        command,
        cfg: cfg.clone(),
        requests: summary.ok,
        errors: summary.errors,
        seconds: summary.duration_s,
        rps: summary.throughput_rps,
        prompt_tokens_mean: summary.prompt_tokens as f64 / summary.ok.max(1) as f64,
        hit_rate: summary.hit_rate,
        replicas,
    })
}

/// The report: the run's rate, then each replica's stream.
pub fn markdown(r: &BandwidthResults) -> String {
    let c = &r.cfg;
    let mut m = String::from("# Replica stream bandwidth\n\n");
    let _ = writeln!(
        m,
        "`{}` on {} ({} vCPUs, shared with whatever else runs).\n",
        r.command, r.machine.cpu, r.machine.vcpus
    );
    let _ = writeln!(
        m,
        "{} sharing prefix-router replicas (`[replicas]`, each naming all) in front of {} zero-cost sim-engines (`--time-scale 0`); an open loop of {:.0} requests/s offered (Poisson) for {:.0} s, each to one replica at random: single-turn chats of one of {} shared system prompts of {} tokens and a user message of {} tokens, `max_tokens` {}, answers not streamed.\n",
        c.replicas,
        c.engines,
        c.rate,
        c.duration_s,
        c.system_prompts,
        c.system_tokens,
        c.user_tokens,
        c.max_tokens
    );
    let _ = writeln!(
        m,
        "Achieved: **{:.0} requests/s** ({} requests, {} errors, {:.1} s; {:.0} prompt tokens per request; hit rate {}).\n",
        r.rps,
        r.requests,
        r.errors,
        r.seconds,
        r.prompt_tokens_mean,
        crate::table::pct(r.hit_rate)
    );
    let _ = writeln!(m, "{}", table(&r.replicas).markdown());
    let _ = writeln!(
        m,
        "From each replica's `/admin/replicas` before and after the traffic: `published_bytes` and `published_messages` (each frame counted once; each of its peers receives a copy), `outbox_dropped`, and the gaps it saw in its peers' streams."
    );
    m
}

fn table(rows: &[ReplicaTraffic]) -> Table {
    let mut t = Table::new(&[
        "replica",
        "requests/s served",
        "messages/s",
        "bytes/s published",
        "bytes/request",
        "outbox drops",
        "gaps",
    ]);
    for b in rows {
        t.row(vec![
            (b.replica + 1).to_string(),
            format!("{:.0}", b.requests as f64 / b.seconds.max(1e-9)),
            format!("{:.0}", b.messages_per_s()),
            format!("{:.0}", b.bytes_per_s()),
            format!("{:.0}", b.bytes_per_request()),
            b.outbox_dropped.to_string(),
            b.peer_gaps.to_string(),
        ]);
    }
    t
}
