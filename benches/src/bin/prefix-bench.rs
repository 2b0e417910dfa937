//! `prefix-bench`: the demo and the bench of prefix-router. `cargo xtask demo`
//! and `cargo xtask bench` build the release binaries and run this.

use anyhow::Context;
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use router_benches::demo::{self, DemoCfg};
use router_benches::fleet::{self, Bins};
use router_benches::nginx::NginxMode;
use router_benches::overhead::{self, OverheadCfg};
use router_benches::peers::{self, Peer, PeersMode, Venv};
use router_benches::quality::{self, QualityCfg};
use router_benches::report::{self, BenchResults, Machine};
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "prefix-bench", about = "prefix-router demo and benchmarks")]
struct Cli {
    /// Folder holding the release `prefix-router` and `sim-engine`
    /// [default: this executable's folder].
    #[arg(long, global = true)]
    bin_dir: Option<PathBuf>,
    /// Where results folders go.
    #[arg(long, global = true, default_value = "results")]
    results_root: PathBuf,
    /// Results folder of this run [default: RESULTS_ROOT/<demo|bench|quality>-<unix time>].
    #[arg(long, global = true)]
    out: Option<PathBuf>,
    /// The peer routers' virtualenv [default: BIN_DIR/../peers-venv, i.e.
    /// target/peers-venv].
    #[arg(long, global = true)]
    peers_venv: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// The router in front of simulated engines, policy against policy.
    Demo(DemoArgs),
    /// Router overhead against direct and nginx, and routing quality.
    Bench(BenchArgs),
    /// Routing quality alone: some or all scenarios, some policies, the
    /// peer routers (e.g. `quality --scenario pressure-unpublished
    /// --policies prefix,round-robin --peers`).
    Quality(QualityArgs),
    /// Routing quality on real llama.cpp servers built by `cargo xtask
    /// setup` (real prefill on this CPU): every policy on every seed.
    Llama(LlamaArgs),
    /// The replicas' stream at a production rate: sharing prefix-router
    /// replicas in front of zero-cost engines, an open loop of chat
    /// requests, each replica's published bytes and messages per second.
    ReplicasBandwidth(BandwidthArgs),
}

#[derive(clap::Args)]
struct BandwidthArgs {
    /// Sharing replicas, each request to one at random.
    #[arg(long, default_value_t = 2)]
    replicas: usize,
    /// Zero-cost engines (`--time-scale 0`).
    #[arg(long, default_value_t = 2)]
    engines: usize,
    /// Requests per second offered (open loop, Poisson arrivals).
    #[arg(long, default_value_t = 1000.0)]
    rate: f64,
    /// Seconds of traffic.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Tokens of each shared system prompt.
    #[arg(long, default_value_t = 1500)]
    system_tokens: usize,
    /// Tokens of each request's own user message.
    #[arg(long, default_value_t = 500)]
    user_tokens: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[derive(clap::Args)]
struct LlamaArgs {
    /// llama-servers in the fleet.
    #[arg(long, default_value_t = 2)]
    servers: usize,
    /// Slots per server (`-np`).
    #[arg(long, default_value_t = 2)]
    slots: usize,
    /// Closed-loop users (conversations in flight at once).
    #[arg(long, default_value_t = 4)]
    users: usize,
    /// Requests per policy and seed.
    #[arg(long, default_value_t = 40)]
    requests: u64,
    /// Seeds, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
    seeds: Vec<u64>,
    /// Policies, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "prefix,round-robin,least-request"
    )]
    policies: Vec<String>,
    /// Mean think time between a conversation's turns, in ms (exponential).
    #[arg(long)]
    think_ms: Option<f64>,
    /// Extra prefix-router flags, e.g. `--router-arg=--log-level=info`.
    #[arg(long = "router-arg", allow_hyphen_values = true)]
    router_args: Vec<String>,
}

#[derive(clap::Args)]
struct QualityArgs {
    /// Scenarios to run, comma-separated or repeated [default: all but the
    /// extra cache-pressure and capped rows; with several replica counts,
    /// cache-pressure]. Known: pressure-unpublished, pressure-published,
    /// think-48, hot-prompt, open-loop, think-48-published, templated-batch,
    /// chat-and-batch, capped-chat, capped-restart, capped-chat-and-batch,
    /// capped-surge, capped-tenant-alone, capped-tenants, chat, few-shot,
    /// hot-prefix, long-doc, agent; cache-pressure stands for think-48,
    /// think-48-published, templated-batch and chat-and-batch, capped for
    /// the four capped rows (engines that run at most 6 requests at once).
    #[arg(long = "scenario", visible_alias = "scenarios", value_delimiter = ',')]
    scenarios: Vec<String>,
    /// prefix-router policies for every scenario [default: each scenario's
    /// own; with several replica counts, prefix,prefix@alone].
    /// `POLICY+FILE.toml` runs it with that config file; `POLICY@baseline` on
    /// the build in PREFIX_BENCH_BASELINE_ROUTER; `POLICY@precise` in precise
    /// mode (the engines publish KV events, the router subscribes);
    /// `POLICY@alone` runs several replicas that share nothing;
    /// `POLICY@envoy` runs behind Envoy, the router as its endpoint picker;
    /// `envoy-round-robin` is Envoy alone, round-robin.
    #[arg(long, value_delimiter = ',')]
    policies: Option<Vec<String>>,
    /// Replica counts, comma-separated: each router (ours and the peers)
    /// runs as that many processes in front of the same engines, each
    /// request to one at random; prefix-router's replicas share what they
    /// learn (`[replicas]`) unless the policy ends in @alone.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    replicas: Vec<usize>,
    /// APIs, comma-separated: each scenario runs once per API, the same
    /// conversations sent as chat completions (chat), Anthropic Messages
    /// (messages), OpenAI Responses with the whole conversation each turn
    /// (responses) or chained by previous_response_id (responses-chained);
    /// the report sets them side by side.
    #[arg(
        long = "api",
        visible_alias = "apis",
        value_enum,
        value_delimiter = ',',
        default_value = "chat"
    )]
    apis: Vec<testkit::workload::Api>,
    #[command(flatten)]
    peers: PeersArgs,
    /// Seconds per run [default: each scenario's own].
    #[arg(long)]
    duration: Option<f64>,
    /// Seed of the traffic [default: each scenario's own].
    #[arg(long)]
    seed: Option<u64>,
    /// Simulated time multiplier [default: 0.25].
    #[arg(long)]
    time_scale: Option<f64>,
    /// Runs of each router on each scenario, in rounds; the figures are
    /// medians (the hot prompt's p99 target is judged on a median of three).
    #[arg(long, default_value_t = 1)]
    repeats: usize,
    /// Seconds into each run of prefix-router's sharing replicas (2 or
    /// more, not @alone) at which the last replica is killed (SIGKILL) and
    /// started again at once on the same ports and config. The balancer
    /// sends its share to the next replica until its `/ready` answers 200,
    /// as a Kubernetes readiness probe would; the report compares its hit
    /// rate over the 5 s after that with the other replicas'.
    #[arg(long, value_name = "AT_S")]
    restart_replica: Option<f64>,
    /// The command line to quote in the report.
    #[arg(long)]
    command: Option<String>,
}

#[derive(clap::Args, Clone)]
struct PeersArgs {
    /// The peer routers (sglang-router, vllm-router, smg): off; installed
    /// (only if already installed); auto (install when missing, skip when
    /// impossible); require (install when missing, fail when impossible).
    /// `--peers` alone means require. They run in a network namespace with
    /// only loopback: the bench re-executes itself under `unshare -n` (root).
    #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "require", default_value = "off")]
    peers: PeersMode,
    /// Which peers, comma-separated [default: all three].
    #[arg(long, value_delimiter = ',')]
    peer_list: Option<Vec<String>>,
}

impl PeersArgs {
    fn list(&self) -> anyhow::Result<Vec<Peer>> {
        match &self.peer_list {
            None => Ok(Peer::ALL.to_vec()),
            Some(v) => v
                .iter()
                .map(|n| {
                    Peer::from_name(n).with_context(|| {
                        format!("unknown peer {n:?}: sglang-router, vllm-router or smg")
                    })
                })
                .collect(),
        }
    }
}

#[derive(clap::Args)]
struct DemoArgs {
    /// Engines in the fleet.
    #[arg(long, default_value_t = 4)]
    engines: usize,
    /// Seconds of traffic per policy (3 policies; 32 s keeps the demo near 2 minutes).
    #[arg(long, default_value_t = 32.0)]
    duration: f64,
    /// Closed-loop chat users.
    #[arg(long, default_value_t = 24)]
    users: usize,
    /// KV-cache blocks per engine (default: what the chat scenario is sized for).
    #[arg(long, default_value_t = router_benches::quality::kv_blocks_for(testkit::workload::ScenarioKind::Chat))]
    kv_blocks: usize,
    /// Simulated time multiplier (1 = GPU speed).
    #[arg(long, default_value_t = 0.25)]
    time_scale: f64,
    /// Policies, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "prefix,round-robin,least-request"
    )]
    policies: Vec<String>,
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Mean think time between turns in simulated seconds (0 = lock-step users).
    #[arg(long, default_value_t = router_benches::scenarios::THINK_S)]
    think_s: f64,
    /// The peer routers beside the policies [default: installed: shown when
    /// their virtualenv is already there, never fetched].
    #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "require", default_value = "installed")]
    peers: PeersMode,
}

#[derive(clap::Args)]
struct BenchArgs {
    /// Small sizes (seconds, not minutes): what the smoke test runs.
    #[arg(long)]
    quick: bool,
    /// nginx baseline: auto (when installed), require, off.
    #[arg(long, value_enum, default_value = "auto")]
    nginx: NginxMode,
    /// Criterion's output folder to fold micro-benchmark figures from.
    #[arg(long)]
    criterion_dir: Option<PathBuf>,
    /// Previous results.json to compare with [default: the newest other
    /// RESULTS_ROOT/bench-*/results.json]; "none" skips the comparison.
    #[arg(long)]
    baseline: Option<String>,
    #[arg(long)]
    skip_overhead: bool,
    #[arg(long)]
    skip_quality: bool,
    /// Rounds of the overhead runs.
    #[arg(long)]
    repeats: Option<usize>,
    /// Concurrencies of the overhead bench's tiny requests, comma-separated
    /// [default: 1,16,64,256].
    #[arg(long, value_delimiter = ',')]
    concurrencies: Vec<usize>,
    /// Overhead bench: tiny requests only (no prompt sizes, no streaming),
    /// for many rounds of one case (`--concurrencies 64 --repeats 100`).
    #[arg(long)]
    tiny_only: bool,
    /// Concurrencies of the TLS rows over kept-alive connections,
    /// comma-separated [default: 1,64]; the handshake row runs at 1. 0: no
    /// TLS rows.
    #[arg(long, value_delimiter = ',')]
    tls_concurrencies: Vec<usize>,
    /// Overhead bench: the TLS rows only (prefix-router and nginx
    /// terminating TLS beside the plain targets).
    #[arg(long)]
    tls_only: bool,
    /// Seconds per quality run.
    #[arg(long)]
    quality_duration: Option<f64>,
    /// The command line to quote in the report.
    #[arg(long, default_value = "cargo xtask bench")]
    command: String,
    /// Quality scenarios, comma-separated [default: all].
    #[arg(long = "scenario", value_delimiter = ',')]
    scenarios: Vec<String>,
    #[command(flatten)]
    peers: PeersArgs,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let bins = Bins::new(cli.bin_dir.clone())?;
    let venv_dir = cli
        .peers_venv
        .clone()
        .unwrap_or_else(|| Venv::default_dir(&bins.dir));
    // Peers first: installing needs the network, so it happens before the
    // run moves into its namespace (a re-execution of this program).
    let mode = match &cli.cmd {
        Cmd::Demo(a) => a.peers,
        Cmd::Bench(a) => a.peers.peers,
        Cmd::Quality(a) => a.peers.peers,
        Cmd::Llama(_) | Cmd::ReplicasBandwidth(_) => PeersMode::Off,
    };
    let venv = peers::prepare(mode, &venv_dir)?;
    if venv.is_some()
        && let Some(code) = peers::isolate()?
    {
        std::process::exit(code);
    }
    fleet::install_signal_handler()?;
    match cli.cmd {
        Cmd::Demo(a) => {
            let out = cli
                .out
                .unwrap_or_else(|| fleet::results_dir(&cli.results_root, "demo"));
            let mut cfg = DemoCfg::default();
            cfg.drive.engines = a.engines;
            cfg.drive.duration_s = a.duration;
            cfg.drive.users = a.users;
            cfg.drive.seed = a.seed;
            cfg.kv_blocks = a.kv_blocks;
            cfg.timing.time_scale = a.time_scale;
            cfg.policies = a.policies;
            cfg.think_s = a.think_s;
            if venv.is_some() {
                cfg.peers = Peer::ALL.to_vec();
            }
            let report = demo::run(&bins, &cfg, venv.as_ref(), &out)?;
            println!("report: {}", report.display());
            Ok(())
        }
        Cmd::Bench(a) => bench(&bins, cli.results_root, cli.out, venv.as_ref(), a),
        Cmd::Quality(a) => quality_only(&bins, cli.results_root, cli.out, venv.as_ref(), a),
        Cmd::Llama(a) => {
            let out = cli
                .out
                .unwrap_or_else(|| fleet::results_dir(&cli.results_root, "llama"));
            let mut cfg = router_benches::llama::LlamaCfg {
                servers: a.servers,
                slots: a.slots,
                users: a.users,
                requests: a.requests,
                seeds: a.seeds,
                policies: a.policies,
                router_args: [vec!["--debug-headers".to_string()], a.router_args].concat(),
                ..Default::default()
            };
            if let Some(t) = a.think_ms {
                cfg.scenario.think_time_ms = t;
            }
            let report = router_benches::llama::run(&bins, &cfg, &out)?;
            println!("report: {}", report.display());
            Ok(())
        }
        Cmd::ReplicasBandwidth(a) => {
            let out = cli
                .out
                .unwrap_or_else(|| fleet::results_dir(&cli.results_root, "replicas-bandwidth"));
            std::fs::create_dir_all(&out).with_context(|| format!("create {}", out.display()))?;
            anyhow::ensure!(
                (2..=MAX_REPLICAS).contains(&a.replicas),
                "--replicas: from 2 to {MAX_REPLICAS}"
            );
            let cfg = router_benches::bandwidth::BandwidthCfg {
                replicas: a.replicas,
                engines: a.engines,
                rate: a.rate,
                duration_s: a.duration,
                system_tokens: a.system_tokens,
                user_tokens: a.user_tokens,
                seed: a.seed,
                ..Default::default()
            };
            let args: Vec<String> = std::env::args().skip(1).collect();
            let command = format!("prefix-bench {}", args.join(" "));
            let r = router_benches::bandwidth::run(&bins, &cfg, command)?;
            std::fs::write(out.join("results.json"), serde_json::to_string_pretty(&r)?)?;
            let md = router_benches::bandwidth::markdown(&r);
            std::fs::write(out.join("report.md"), &md)?;
            println!("{md}");
            println!("report: {}", out.join("report.md").display());
            Ok(())
        }
    }
}

/// Most router processes `--replicas` starts in front of one fleet.
const MAX_REPLICAS: usize = 16;

/// `prefix-bench quality`: the quality part of the bench alone.
fn quality_only(
    bins: &Bins,
    root: PathBuf,
    out: Option<PathBuf>,
    venv: Option<&Venv>,
    a: QualityArgs,
) -> anyhow::Result<()> {
    let out = out.unwrap_or_else(|| fleet::results_dir(&root, "quality"));
    std::fs::create_dir_all(&out).with_context(|| format!("create {}", out.display()))?;
    let mut qcfg = QualityCfg::full();
    anyhow::ensure!(
        a.replicas.iter().all(|&n| (1..=MAX_REPLICAS).contains(&n)),
        "--replicas: counts from 1 to {MAX_REPLICAS}"
    );
    let several = a.replicas.iter().any(|&n| n > 1);
    let scenarios = if a.scenarios.is_empty() && several {
        vec![router_benches::scenarios::CACHE_PRESSURE_SET.to_string()]
    } else {
        a.scenarios.clone()
    };
    qcfg.select(&scenarios)?;
    qcfg.scenarios = router_benches::apis::per_api(std::mem::take(&mut qcfg.scenarios), &a.apis);
    qcfg.policies = a.policies.clone();
    if several && qcfg.policies.is_none() {
        qcfg.policies = Some(vec![
            "prefix".into(),
            format!("prefix{}", router_benches::replicas::ALONE_SUFFIX),
        ]);
    }
    qcfg.replicas = a.replicas.clone();
    if let Some(at) = a.restart_replica {
        anyhow::ensure!(
            at >= 0.0 && several,
            "--restart-replica AT_S: a time of 0 or more, with --replicas 2 or more"
        );
        qcfg.restart_at_s = Some(at);
    }
    for s in &mut qcfg.scenarios {
        if let Some(d) = a.duration {
            s.drive.duration_s = d;
        }
        if let Some(seed) = a.seed {
            s.drive.seed = seed;
        }
    }
    if let Some(t) = a.time_scale {
        qcfg.timing.time_scale = t;
    }
    qcfg.repeats = a.repeats.max(1);
    if venv.is_some() {
        qcfg.peers = a.peers.list()?;
    }
    let command = a.command.clone().unwrap_or_else(|| {
        let args: Vec<String> = std::env::args().skip(1).collect();
        format!("prefix-bench {}", args.join(" "))
    });
    let pb = progress(qcfg.runs());
    let mut tick = |msg: &str| {
        pb.inc(1);
        pb.set_message(msg.to_string());
    };
    let mut r = BenchResults {
        unix_time: unix_now(),
        machine: Machine::detect(),
        command,
        ..Default::default()
    };
    r.quality_rows = quality::run(bins, &qcfg, venv, &mut tick)?;
    r.quality = Some(qcfg);
    pb.finish_and_clear();
    r.check_targets();
    write_results(&r, &out, None)
}

fn progress(total: usize) -> ProgressBar {
    let pb = ProgressBar::new(total as u64);
    pb.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {wide_bar} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Writes `results.json` and `report.md` into `out` and prints the report.
fn write_results(
    r: &BenchResults,
    out: &std::path::Path,
    comparison: Option<&str>,
) -> anyhow::Result<()> {
    std::fs::write(out.join("results.json"), serde_json::to_string_pretty(r)?)?;
    let md = report::markdown(r, comparison);
    std::fs::write(out.join("report.md"), &md)?;
    println!("{md}");
    println!("results: {}", out.join("results.json").display());
    println!("report: {}", out.join("report.md").display());
    Ok(())
}

fn bench(
    bins: &Bins,
    root: PathBuf,
    out: Option<PathBuf>,
    venv: Option<&Venv>,
    a: BenchArgs,
) -> anyhow::Result<()> {
    let out = out.unwrap_or_else(|| fleet::results_dir(&root, "bench"));
    std::fs::create_dir_all(&out).with_context(|| format!("create {}", out.display()))?;
    let mut ocfg = if a.quick {
        OverheadCfg::quick()
    } else {
        OverheadCfg::full()
    };
    if !a.concurrencies.is_empty() {
        ocfg.concurrencies = a.concurrencies.iter().map(|&c| c.max(1)).collect();
    }
    if a.tiny_only {
        ocfg.sizes_kb.clear();
        ocfg.stream = false;
        ocfg.tls_concurrencies.clear();
    }
    if !a.tls_concurrencies.is_empty() {
        ocfg.tls_concurrencies = a
            .tls_concurrencies
            .iter()
            .copied()
            .filter(|&c| c > 0)
            .collect();
    }
    if a.tls_only {
        ocfg.concurrencies.clear();
        ocfg.sizes_kb.clear();
        ocfg.stream = false;
    }
    if let Some(r) = a.repeats {
        ocfg.repeats = r.max(1);
    }
    let mut qcfg = if a.quick {
        QualityCfg::quick()
    } else {
        QualityCfg::full()
    };
    qcfg.select(&a.scenarios)?;
    if let Some(d) = a.quality_duration {
        for s in &mut qcfg.scenarios {
            s.drive.duration_s = d;
        }
    }
    if venv.is_some() {
        qcfg.peers = a.peers.list()?;
    }
    let targets = if a.nginx == NginxMode::Off { 2 } else { 3 };
    let total = if a.skip_overhead {
        0
    } else {
        ocfg.runs() * targets
    } + if a.skip_quality { 0 } else { qcfg.runs() };
    let pb = progress(total);
    let mut tick = |msg: &str| {
        pb.inc(1);
        pb.set_message(msg.to_string());
    };
    let mut r = BenchResults {
        unix_time: unix_now(),
        machine: Machine::detect(),
        command: a.command.clone(),
        ..Default::default()
    };
    if let Some(dir) = &a.criterion_dir {
        r.micro = router_benches::micro::read(
            dir,
            &["extract", "extract_hash", "hash", "index", "select"],
        );
    }
    if !a.skip_overhead {
        pb.set_position(0);
        r.overhead = Some(overhead::run(bins, &ocfg, a.nginx, &out, &mut tick)?);
    }
    if !a.skip_quality {
        r.quality_rows = quality::run(bins, &qcfg, venv, &mut tick)?;
        r.quality = Some(qcfg);
    }
    pb.finish_and_clear();
    r.check_targets();

    let baseline = match a.baseline.as_deref() {
        Some("none") => None,
        Some(p) => Some(PathBuf::from(p)),
        None => report::previous_results(&root, &out),
    };
    let comparison = baseline.and_then(|p| {
        let before: BenchResults = serde_json::from_slice(&std::fs::read(&p).ok()?).ok()?;
        Some(report::compare(&r, &before, &p))
    });
    write_results(&r, &out, comparison.as_deref())
}
