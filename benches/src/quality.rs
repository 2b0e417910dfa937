//! Routing quality: the rows of [`crate::scenarios`] under prefix-router's
//! policies and the peer routers, each run on a freshly started fleet of
//! engines with a GPU-like timing model and caches too small to hold
//! everything, with the same traffic (same seed) for every router.

use crate::fleet::{self, Bins, Engine, Router};
use crate::peers::{Peer, PeerRouter, Venv};
pub use crate::scenarios::{Drive, QualityScenario, kv_blocks_for, scenario_for};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::Duration;

use crate::cost::Cost;
use crate::engine_metrics::{LoadSampler, Work};
use anyhow::Context;
use testkit::workload::{Record, RunConfig, Summary};

/// The GPU-like timing model: what `sim-engine` runs at `time_scale` 1.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Timing {
    /// Prefill tokens per second (an 8B model on one H100-class GPU does
    /// about 10k with chunked prefill alongside decodes).
    pub prefill_tps: f64,
    /// Fixed time of one forward pass in ms.
    pub decode_step_ms: f64,
    /// Extra step time per running sequence in ms.
    pub decode_step_per_seq_ms: f64,
    /// Multiplies all simulated time (0.1 = ten times faster than the GPU).
    pub time_scale: f64,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            prefill_tps: 10_000.0,
            decode_step_ms: 15.0,
            decode_step_per_seq_ms: 0.1,
            // 4x faster than the GPU: at 0.1 the fixed real-time cost of a
            // request (HTTP on loopback, scheduling on 2 vCPUs) is a large
            // part of a scaled TTFT and hides the prefill the policies change.
            time_scale: 0.25,
        }
    }
}

impl Timing {
    /// `sim-engine` flags for row `qs`: this timing, or the row's capped
    /// engines' with their batch cap.
    pub fn engine_args_for(&self, qs: &QualityScenario) -> Vec<String> {
        let Some(c) = qs.capped else {
            return self.engine_args(qs.kv_blocks, qs.hide_capacity);
        };
        let timing = Timing {
            prefill_tps: c.prefill_tps,
            decode_step_ms: c.decode_step_ms,
            decode_step_per_seq_ms: 0.0,
            ..self.clone()
        };
        let mut v = timing.engine_args(qs.kv_blocks, qs.hide_capacity);
        v.extend(["--max-num-seqs".to_string(), c.max_num_seqs.to_string()]);
        v
    }

    /// `sim-engine` flags for this timing, `kv_blocks` per engine, and
    /// `--hide-capacity` when the router must not be told it.
    pub fn engine_args(&self, kv_blocks: usize, hide_capacity: bool) -> Vec<String> {
        let mut v: Vec<String> = [
            ("--prefill-tps", self.prefill_tps),
            ("--decode-step-ms", self.decode_step_ms),
            ("--decode-step-per-seq-ms", self.decode_step_per_seq_ms),
            ("--time-scale", self.time_scale),
            ("--kv-blocks", kv_blocks as f64),
        ]
        .iter()
        .flat_map(|(k, v)| [k.to_string(), v.to_string()])
        .collect();
        if hide_capacity {
            v.push("--hide-capacity".into());
        }
        v
    }

    pub fn describe(&self) -> String {
        format!(
            "prefill {:.0} tok/s, decode step {} ms + {} ms per running sequence, time scale {} (simulated time runs {:.0}x faster than the GPU; TTFT and latency below are real, scaled)",
            self.prefill_tps,
            self.decode_step_ms,
            self.decode_step_per_seq_ms,
            self.time_scale,
            1.0 / self.time_scale
        )
    }
}

/// `prefix_router_routing_seconds`: time from request read to decision.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct RoutingTime {
    pub count: u64,
    pub mean_us: f64,
    /// Upper bound of the histogram bucket holding the 99th percentile.
    pub p99_le_us: f64,
}

impl RoutingTime {
    /// Reads the histogram from the router's `/metrics` text.
    pub fn parse(metrics: &str) -> RoutingTime {
        let name = "prefix_router_routing_seconds";
        let mut sum = 0.0;
        let mut count = 0u64;
        let mut buckets: Vec<(f64, u64)> = Vec::new();
        for line in metrics.lines() {
            let Some(rest) = line.strip_prefix(name) else {
                continue;
            };
            let val = line.rsplit(' ').next().unwrap_or("0");
            if rest.starts_with("_sum") {
                sum = val.parse().unwrap_or(0.0);
            } else if rest.starts_with("_count") {
                count = val.parse::<f64>().unwrap_or(0.0) as u64;
            } else if let Some(le) = rest.split("le=\"").nth(1) {
                let le = le.split('"').next().unwrap_or("+Inf");
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().unwrap_or(f64::INFINITY)
                };
                buckets.push((le, val.parse::<f64>().unwrap_or(0.0) as u64));
            }
        }
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        let want = (count as f64 * 0.99).ceil() as u64;
        let p99 = buckets
            .iter()
            .find(|(_, c)| *c >= want && count > 0)
            .map_or(0.0, |(le, _)| *le * 1e6);
        RoutingTime {
            count,
            mean_us: if count > 0 {
                sum / count as f64 * 1e6
            } else {
                0.0
            },
            p99_le_us: p99,
        }
    }
}

/// Who routes a run: one of prefix-router's policies or a peer router.
#[derive(Clone, Copy, Debug)]
pub enum Front<'a> {
    Policy(&'a str),
    Peer(&'a Venv, Peer),
}

impl Front<'_> {
    /// The name in tables: the policy, or the peer's package name.
    pub fn name(&self) -> String {
        match self {
            Front::Policy(p) => p.to_string(),
            Front::Peer(_, peer) => peer.name().to_string(),
        }
    }
}

/// A policy name ending so runs on the baseline build (see `run_one`).
pub const BASELINE_SUFFIX: &str = "@baseline";

/// A policy name ending so runs in precise mode: the engines publish their
/// KV-cache events as vLLM does and the router subscribes (`[precise]`).
/// `prefix@precise+extra.toml` adds that file's settings.
pub const PRECISE_SUFFIX: &str = "@precise";

/// A prefix-router front's name, read: `POLICY[@baseline|@precise][@alone][+FILE.toml]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PolicyFront<'a> {
    policy: &'a str,
    /// On the build in `overhead::BASELINE_ENV`.
    baseline: bool,
    /// The engines publish KV events and the router subscribes.
    precise: bool,
    /// Replicas share nothing ([`crate::replicas::ALONE_SUFFIX`]).
    alone: bool,
    /// A config file whose settings are added.
    config: Option<&'a str>,
    /// Behind Envoy, the router as its endpoint picker
    /// ([`crate::envoy::PICKER_SUFFIX`]).
    envoy: bool,
}

pub(crate) fn parse_policy(front: &str) -> PolicyFront<'_> {
    let (name, config) = front
        .split_once(CONFIG_SEPARATOR)
        .map_or((front, None), |(n, c)| (n, Some(c)));
    let (name, alone) = name
        .strip_suffix(crate::replicas::ALONE_SUFFIX)
        .map_or((name, false), |n| (n, true));
    let (name, envoy) = name
        .strip_suffix(crate::envoy::PICKER_SUFFIX)
        .map_or((name, false), |n| (n, true));
    let mut f = PolicyFront {
        policy: name,
        baseline: false,
        precise: false,
        alone,
        config,
        envoy,
    };
    if let Some(p) = name.strip_suffix(BASELINE_SUFFIX) {
        f.policy = p;
        f.baseline = true;
    } else if let Some(p) = name.strip_suffix(PRECISE_SUFFIX) {
        f.policy = p;
        f.precise = true;
    }
    f
}

/// A config file the bench wrote for one router process; removed on drop.
pub(crate) struct ConfigFile(std::path::PathBuf);

impl ConfigFile {
    fn write(text: &str) -> anyhow::Result<ConfigFile> {
        static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!(
            "prefix-bench-router-{}-{seq}.toml",
            std::process::id()
        ));
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        Ok(ConfigFile(path))
    }

    fn args(&self) -> Vec<String> {
        vec!["--config".to_string(), self.0.display().to_string()]
    }
}

impl Drop for ConfigFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The text of the config file `extra` (empty without one).
fn extra_text(extra: Option<&str>) -> anyhow::Result<String> {
    match extra {
        Some(f) => std::fs::read_to_string(f).with_context(|| format!("reading {f}")),
        None => Ok(String::new()),
    }
}

/// Whether a front's config file sets `[classes] engine_priority`: its
/// engines then run by priority, as vLLM's `--scheduling-policy priority`
/// (an engine that does not refuses a nonzero `priority`).
fn engines_by_priority(extra: Option<&str>) -> anyhow::Result<bool> {
    let text = extra_text(extra)?;
    let value: toml::Table = toml::from_str(&text)
        .with_context(|| format!("reading {}", extra.unwrap_or("the config")))?;
    Ok(value
        .get("classes")
        .and_then(|c| c.get("engine_priority"))
        .is_some())
}

/// The config of a precise-mode run: every engine with its event
/// endpoints, `[precise]` on, then the settings of `extra` (a file).
fn precise_text(
    urls: &[String],
    events: &[fleet::EventPorts],
    extra: Option<&str>,
) -> anyhow::Result<String> {
    use std::fmt::Write as _;
    let mut text = String::from("backends = [\n");
    for (url, p) in urls.iter().zip(events) {
        writeln!(
            text,
            "  {{ url = \"{url}\", kv_events = \"tcp://127.0.0.1:{}\", kv_events_replay = \"tcp://127.0.0.1:{}\" }},",
            p.live, p.replay
        )?;
    }
    text.push_str("]\n");
    let extra = extra_text(extra)?;
    // `enabled` goes into the file's own `[precise]` table if it has one.
    match extra.find("[precise]\n") {
        Some(at) => {
            let end = at + "[precise]\n".len();
            text.push_str(&extra[..end]);
            text.push_str("enabled = true\n");
            text.push_str(&extra[end..]);
        }
        None => {
            text.push_str(&extra);
            text.push_str("\n[precise]\nenabled = true\n");
        }
    }
    Ok(text)
}

/// Prints the capacity the router learned for each engine beside the real one.
fn print_learned_capacity(r: &Router, qs: &QualityScenario) {
    let Ok(v) = r.backends() else { return };
    let backends = v.get("backends").and_then(|b| b.as_array());
    let field = |f: &dyn Fn(&serde_json::Value) -> Option<u64>| -> Vec<u64> {
        backends.into_iter().flatten().filter_map(f).collect()
    };
    let learned = field(&|b| b.get("learned_capacity_blocks")?.as_u64());
    let flushes = field(&|b| b.get("prediction")?.get("flushes")?.as_u64());
    let rates = field(&|b| Some(b.get("prefill_blocks_per_s")?.as_f64()? as u64));
    eprintln!(
        "  {}: learned capacity {learned:?} router blocks (each engine holds {} of its own 16-token blocks); flushes detected {flushes:?}; prefill rates {rates:?} blocks/s",
        qs.name, qs.kv_blocks
    );
    // How many decisions were made at the looser bounds.
    let metrics = r.metrics().unwrap_or_default();
    let count = |name: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    eprintln!(
        "  {}: routed at the full-cache bounds {:.0}, with the fleet saturated {:.0}",
        qs.name,
        count("prefix_router_full_cache_routes_total"),
        count("prefix_router_saturated_routes_total"),
    );
}

/// A folder to write every run's per-request records into, as
/// `<scenario>.<router>.jsonl` (for studying where hits were lost).
pub const RECORDS_ENV: &str = "PREFIX_BENCH_RECORDS";

/// Writes a run's records under `PREFIX_BENCH_RECORDS`, when it is set.
fn keep_records(
    qs: &QualityScenario,
    front: Front<'_>,
    replicas: usize,
    records: &[Record],
) -> anyhow::Result<()> {
    let Some(dir) = std::env::var_os(RECORDS_ENV) else {
        return Ok(());
    };
    let name = match replicas {
        1 => front.name(),
        n => format!("{}-x{n}", front.name()),
    };
    write_records(Path::new(&dir), &qs.label(), &name, records)
}

fn write_records(
    dir: &Path,
    scenario: &str,
    router: &str,
    records: &[Record],
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let name: String = router
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let mut out = String::new();
    for r in records {
        out.push_str(&serde_json::to_string(r)?);
        out.push('\n');
    }
    let path = dir.join(format!("{scenario}.{name}.jsonl"));
    std::fs::write(&path, out).with_context(|| format!("writing {}", path.display()))
}

/// `policy+file.toml` runs the policy with that config file (see `run_one`).
pub const CONFIG_SEPARATOR: char = '+';

/// One row under one router on a fresh fleet.
#[derive(Clone, Debug)]
pub struct PolicyRun {
    /// The policy or peer router.
    pub policy: String,
    /// Processes of it in front of the fleet, each request to one at random.
    pub replicas: usize,
    pub summary: Summary,
    pub records: Vec<Record>,
    /// prefix-router's routing time (zero for the peers).
    pub routing: RoutingTime,
    /// Inference requests each engine completed during the workload.
    pub per_engine: Vec<u64>,
    /// What the engines did during the workload, all together, by their
    /// own counters.
    pub work: Work,
    /// Each engine's requests in flight over the run, by its id, sampled
    /// from its own gauges.
    pub load: crate::charts::Series,
    /// The replica killed and started again mid-run (`--restart-replica`).
    pub restart: Option<crate::replicas::RestartFigures>,
    /// What each sharing replica's stream published during the workload.
    pub bandwidth: Vec<crate::replicas::ReplicaTraffic>,
    /// How long the tenant rows' tenants waited in prefix-router.
    pub tenant_waits: crate::tenants::RouterWaits,
}

impl PolicyRun {
    /// Busiest engine's requests over the mean, counted by the engines
    /// themselves (a router's own readiness probes excluded).
    pub fn load_max_mean(&self) -> f64 {
        max_over_mean(&self.per_engine)
    }

    /// What a conversation cost the engines in this run.
    pub fn cost(&self) -> Option<Cost> {
        Cost::of(&self.work, self.summary.conversations)
    }
}

/// The largest count over the mean (1.0 = perfectly even; 0 when empty).
pub fn max_over_mean(counts: &[u64]) -> f64 {
    let total: u64 = counts.iter().sum();
    let max = counts.iter().copied().max().unwrap_or(0);
    if total == 0 {
        return 0.0;
    }
    max as f64 / (total as f64 / counts.len() as f64)
}

/// The served model of an engine (`GET /v1/models`), asked of the engine
/// itself: not every peer router answers `/v1/models`.
pub(crate) fn engine_model(e: &Engine) -> anyhow::Result<String> {
    let r = testkit::http::request(e.addr, "GET", "/v1/models", &[], b"")?;
    let v: serde_json::Value = serde_json::from_slice(&r.body)?;
    Ok(v["data"][0]["id"]
        .as_str()
        .unwrap_or("sim-llama-8b")
        .to_string())
}

/// A running router of either kind; stops (and is reaped) on drop.
enum Running {
    Ours(Router),
    Peer(PeerRouter),
    /// Envoy with prefix-router as its endpoint picker (`POLICY@envoy`).
    Picker(Router, crate::envoy::Envoy),
    /// Envoy round-robin ([`crate::envoy::ROUND_ROBIN`]).
    Envoy(crate::envoy::Envoy),
}

impl Running {
    fn url(&self) -> String {
        match self {
            Running::Ours(r) => r.url(),
            Running::Peer(p) => p.url(),
            Running::Picker(_, e) | Running::Envoy(e) => e.url(),
        }
    }

    /// prefix-router's process, whichever front it serves.
    fn ours(&self) -> Option<&Router> {
        match self {
            Running::Ours(r) | Running::Picker(r, _) => Some(r),
            Running::Peer(_) | Running::Envoy(_) => None,
        }
    }
}

/// Envoy's worker threads in the benches: as many as prefix-router's.
fn envoy_threads() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get())
}

/// Starts how many tries a set of sharing replicas gets: a port found free
/// may be taken before a replica binds it.
const REPLICA_START_TRIES: usize = 3;

/// Starts `n` prefix-router processes as `f` says in front of the engines
/// at `urls`: with `[replicas]` sections naming each other when `n > 1`
/// and `f` is not alone. Returns them with the config files they read.
pub(crate) fn start_ours(
    bins: &Bins,
    f: &PolicyFront<'_>,
    urls: &[String],
    events: &[fleet::EventPorts],
    n: usize,
) -> anyhow::Result<(Vec<Router>, Vec<ConfigFile>)> {
    // `prefix@baseline`: the policy on another build of the router
    // (`overhead::BASELINE_ENV`), for a before/after in one run.
    let bin = if f.baseline {
        std::path::PathBuf::from(
            std::env::var_os(crate::overhead::BASELINE_ENV).with_context(|| {
                format!(
                    "{} needs {} set to a router binary",
                    f.policy,
                    crate::overhead::BASELINE_ENV
                )
            })?,
        )
    } else {
        bins.path("prefix-router")
    };
    let share = n > 1 && !f.alone;
    // What every replica's config file holds before its `[replicas]`
    // section; none when the router needs no file of the bench's own
    // (`prefix+tuned.toml` passes that file as it is).
    let base = if f.precise {
        Some(precise_text(urls, events, f.config)?)
    } else if share {
        Some(extra_text(f.config)?)
    } else {
        None
    };
    // In precise mode the backends are in the file, with their events.
    let flag_urls: &[String] = if f.precise { &[] } else { urls };
    let mut tries = 0;
    loop {
        tries += 1;
        let listens = if share {
            crate::replicas::listen_addrs(n)?
        } else {
            Vec::new()
        };
        let mut files = Vec::new();
        let mut routers = Vec::new();
        for i in 0..n {
            let args = match &base {
                Some(text) => {
                    let mut text = text.clone();
                    if share {
                        text.push_str(&crate::replicas::section(listens[i], &listens));
                    }
                    let file = ConfigFile::write(&text)?;
                    let args = file.args();
                    files.push(file);
                    args
                }
                None => f
                    .config
                    .map(|c| vec!["--config".to_string(), c.to_string()])
                    .unwrap_or_default(),
            };
            routers.push(Router::spawn_bin(&bin, flag_urls, f.policy, &args)?);
        }
        // Every replica is started before any is waited for: a starting
        // replica may wait for its peers' snapshots before it is ready.
        let ready = routers.iter_mut().try_for_each(Router::wait_ready);
        // Traffic starts once every sharing replica caught up from the others.
        let ready = ready.and_then(|()| {
            routers
                .iter()
                .filter(|_| share)
                .try_for_each(Router::wait_warm)
        });
        match ready {
            Ok(()) => return Ok((routers, files)),
            // Only a port taken meanwhile is worth another try.
            Err(e)
                if share && tries < REPLICA_START_TRIES && format!("{e:#}").contains("in use") =>
            {
                eprintln!("  {n} replicas did not start (a port was taken); again on fresh ports");
            }
            Err(e) => return Err(e),
        }
    }
}

/// The routing time of several replicas as one: counts summed, the mean
/// over all their decisions, the largest p99 bound.
fn combined_routing(times: &[RoutingTime]) -> RoutingTime {
    let count: u64 = times.iter().map(|t| t.count).sum();
    let sum: f64 = times.iter().map(|t| t.mean_us * t.count as f64).sum();
    RoutingTime {
        count,
        mean_us: if count > 0 { sum / count as f64 } else { 0.0 },
        p99_le_us: times.iter().map(|t| t.p99_le_us).fold(0.0, f64::max),
    }
}

/// Kills the last engine at each of `at_s` (real seconds after `epoch`)
/// and starts it again on its address after a second down, its cache
/// lost, until the traffic is `done`. Runs on the thread that outlives the
/// engines (`PR_SET_PDEATHSIG`).
fn restart_engines_at(
    bins: &Bins,
    engines: &mut [Engine],
    args: &[String],
    at_s: &[f64],
    epoch: std::time::Instant,
    done: &std::sync::atomic::AtomicBool,
) -> anyhow::Result<()> {
    let Some(engine) = engines.last_mut() else {
        return Ok(());
    };
    for &at in at_s {
        let when = epoch + Duration::from_secs_f64(at.max(0.0));
        while std::time::Instant::now() < when {
            if done.load(std::sync::atomic::Ordering::Relaxed) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        engine.restart(bins, args, Duration::from_secs(1))?;
        eprintln!(
            "  engine {} killed and started again {:.1} s in",
            engine.id,
            epoch.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// Runs the workloads of `cfgs` at once against the same routers and
/// returns one trace: the later workloads' sessions and prefixes
/// renumbered apart from the first's, every request numbered in the order
/// it was sent.
fn run_together(mut cfgs: Vec<RunConfig>) -> anyhow::Result<(Vec<Record>, Summary)> {
    let name = cfgs[0].scenario.kind.name();
    let second = match cfgs.len() {
        1 => return testkit::workload::run_blocking(cfgs.remove(0)),
        2 => cfgs.remove(1),
        n => anyhow::bail!("{n} workloads at once: at most two"),
    };
    let first = cfgs.remove(0);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (a, b) = rt.block_on(async {
        tokio::join!(
            testkit::workload::run(first),
            testkit::workload::run(second)
        )
    });
    let ((mut records, sa), (more, sb)) = (a?, b?);
    for mut r in more {
        r.session += 1 << 40;
        r.user += 1 << 40;
        r.prefix_id += 1 << 16;
        records.push(r);
    }
    records.sort_by(|x, y| x.start_ms.total_cmp(&y.start_ms));
    for (i, r) in records.iter_mut().enumerate() {
        r.seq = i as u64;
    }
    let summary = Summary::from_records(name, &records, sa.duration_s.max(sb.duration_s));
    Ok((records, summary))
}

/// Starts `qs.drive.engines` engines and `replicas` processes of `front`
/// in front of them, runs the row's workload for its duration (streaming,
/// TTFT = first content event; each request to one replica at random),
/// stops everything. With `restart_at_s`, sharing prefix-router replicas
/// have their last one killed that far into the run and started again
/// ([`crate::replicas::kill_and_restart_at`]).
pub fn run_one(
    bins: &Bins,
    qs: &QualityScenario,
    front: Front<'_>,
    timing: &Timing,
    replicas: usize,
    restart_at_s: Option<f64>,
) -> anyhow::Result<PolicyRun> {
    anyhow::ensure!(!fleet::interrupted(), "interrupted");
    anyhow::ensure!(replicas >= 1, "at least one replica");
    let mut args = timing.engine_args_for(qs);
    let parsed = match front {
        Front::Policy(p) if p == crate::envoy::ROUND_ROBIN => None,
        Front::Policy(p) => Some(parse_policy(p)),
        Front::Peer(..) => None,
    };
    if engines_by_priority(parsed.and_then(|f| f.config))? {
        args.extend(["--scheduling-policy".into(), "priority".into()]);
    }
    let precise = parsed.is_some_and(|f| f.precise);
    let (mut engines, events): (Vec<Engine>, Vec<fleet::EventPorts>) = if precise {
        fleet::start_engines_with_events(bins, qs.drive.engines, &args)?
            .into_iter()
            .unzip()
    } else {
        (
            fleet::start_engines(bins, qs.drive.engines, &args)?,
            Vec::new(),
        )
    };
    let model = engine_model(&engines[0])?;
    let urls: Vec<String> = engines.iter().map(Engine::url).collect();
    let mut config_files = Vec::new();
    let routers: Vec<Running> = match (front, parsed) {
        (Front::Peer(venv, peer), _) => (0..replicas)
            .map(|_| PeerRouter::start(venv, peer, &engines, &model).map(Running::Peer))
            .collect::<anyhow::Result<_>>()?,
        (Front::Policy(_), Some(f)) if f.envoy => {
            anyhow::ensure!(replicas == 1, "{}: one picker", front.name());
            let epp_port = testkit::proc::free_port();
            let mut r = Router::spawn_bin(
                &bins.path("prefix-router"),
                &urls,
                f.policy,
                &["--epp-listen".to_string(), format!("127.0.0.1:{epp_port}")]
                    .into_iter()
                    .chain(f.config.map(|c| format!("--config={c}")))
                    .collect::<Vec<_>>(),
            )?;
            r.wait_ready()?;
            let e = crate::envoy::Envoy::with_picker(epp_port, engines[0].addr, envoy_threads())?;
            vec![Running::Picker(r, e)]
        }
        (Front::Policy(p), None) if p == crate::envoy::ROUND_ROBIN => {
            let addrs: Vec<_> = engines.iter().map(|e| e.addr).collect();
            (0..replicas)
                .map(|_| {
                    crate::envoy::Envoy::round_robin(&addrs, envoy_threads()).map(Running::Envoy)
                })
                .collect::<anyhow::Result<_>>()?
        }
        (Front::Policy(_), Some(f)) => {
            let (ours, files) = start_ours(bins, &f, &urls, &events, replicas)?;
            config_files = files;
            ours.into_iter().map(Running::Ours).collect()
        }
        (Front::Policy(p), None) => anyhow::bail!("front {p} not parsed"),
    };
    let before: Vec<Work> = engines.iter().map(Work::read).collect();
    // Sharing replicas: their streams' counters as the traffic starts.
    let share = replicas > 1 && parsed.is_some_and(|f| !f.alone);
    let ours = |r: &Running| match r {
        Running::Ours(r) => Some(crate::replicas::StreamCounters::read(r)),
        _ => None,
    };
    let counters: Vec<Option<crate::replicas::StreamCounters>> = if share {
        routers.iter().filter_map(ours).collect()
    } else {
        Vec::new()
    };
    let restart_at = restart_at_s.filter(|_| share);
    let gate = std::sync::Arc::new(testkit::workload::ReplicaGate::new(replicas));
    let epoch = std::time::Instant::now();
    let sampler = LoadSampler::start(&engines, epoch);
    let drive = |part: &QualityScenario, seed: u64| {
        let mut cfg = RunConfig::new(routers[0].url(), part.scaled(timing.time_scale));
        cfg.replicas = routers[1..].iter().map(Running::url).collect();
        cfg.users = part.drive.users;
        cfg.rate = part.rate(timing.time_scale);
        cfg.requests = None;
        cfg.duration = Some(Duration::from_secs_f64(qs.drive.duration_s));
        cfg.seed = seed;
        cfg.model = Some(model.clone());
        cfg.api = qs.api;
        cfg.request_timeout = Duration::from_secs(60);
        cfg.epoch = Some(epoch);
        if restart_at.is_some() {
            cfg.gate = Some(gate.clone());
        }
        cfg
    };
    let mut cfgs = vec![drive(qs, qs.drive.seed)];
    if let Some(side) = &qs.alongside {
        // Another seed: the second workload's choices are its own.
        cfgs.push(drive(side, qs.drive.seed ^ 0xba7c4));
    }
    let mut routers = routers;
    let victim = replicas - 1;
    let done = std::sync::atomic::AtomicBool::new(false);
    // The traffic runs on a thread of its own; the replica is killed and
    // started again from this one, which outlives it: a child dies with
    // the thread that started it (`PR_SET_PDEATHSIG`).
    let (ran, restarted) = std::thread::scope(|s| {
        let done = &done;
        let traffic = s.spawn(move || {
            let ran = run_together(cfgs);
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            ran
        });
        let restarted = match (restart_at, routers.get_mut(victim)) {
            (Some(at), Some(Running::Ours(r))) => crate::replicas::kill_and_restart_at(
                r,
                &gate,
                victim,
                epoch,
                Duration::from_secs_f64(at.max(0.0)),
                done,
            ),
            _ => restart_engines_at(
                bins,
                &mut engines,
                &args,
                &qs.engine_restarts_s,
                epoch,
                done,
            )
            .map(|()| None),
        };
        let ran = traffic
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the workload thread panicked")));
        (ran, restarted)
    });
    let load = sampler.finish();
    let (records, mut summary) = ran?;
    let restarted = restarted?;
    summary.scenario = qs.name.clone();
    let restart = restarted.map(|t| {
        let f = crate::replicas::RestartFigures::of(&records, t, victim, replicas, gate.rerouted());
        eprintln!(
            "  {}: replica {} of {replicas} killed at {:.1} s, ready {:.3} s later; next {:.1} s: its hit rate {} ({} requests) vs the others' {} ({} requests)",
            qs.name,
            victim + 1,
            f.killed_at_s,
            f.ready_after_s,
            f.window_s,
            crate::table::pct(f.restarted.hit_rate),
            f.restarted.requests,
            crate::table::pct(f.others.hit_rate),
            f.others.requests,
        );
        f
    });
    let bandwidth: Vec<crate::replicas::ReplicaTraffic> = if share {
        routers
            .iter()
            .filter_map(ours)
            .zip(&counters)
            .enumerate()
            .filter_map(|(i, (end, start))| {
                let again = restarted.filter(|_| i == victim);
                let from_ms = again.map_or(0.0, |t| (t.killed_at_s + t.ready_after_s) * 1e3);
                let served = records
                    .iter()
                    .filter(|r| r.ok() && r.replica == Some(i as u32) && r.start_ms >= from_ms)
                    .count() as u64;
                let seconds = summary.duration_s - again.map_or(0.0, |t| t.killed_at_s);
                let c = end?.since(if again.is_some() { None } else { *start });
                let mut t = crate::replicas::ReplicaTraffic::new(i, replicas, c, seconds, served);
                t.restarted = again.is_some();
                Some(t)
            })
            .collect()
    } else {
        Vec::new()
    };
    keep_records(qs, front, replicas, &records)?;
    let each: Vec<Work> = engines
        .iter()
        .zip(&before)
        .map(|(e, b)| Work::read(e).since(b))
        .collect();
    let per_engine: Vec<u64> = each.iter().map(|w| w.requests).collect();
    // The engines' own counts: the same for every router, whatever
    // response headers it passes on.
    summary.load_max_mean_ratio = max_over_mean(&per_engine);
    summary.per_instance = engines
        .iter()
        .map(|e| e.id.clone())
        .zip(per_engine.iter().copied())
        .collect();
    if let Some(r) = routers.first().and_then(Running::ours) {
        print_learned_capacity(r, qs);
    }
    let times: Vec<RoutingTime> = routers
        .iter()
        .filter_map(Running::ours)
        .map(|r| RoutingTime::parse(&r.metrics().unwrap_or_default()))
        .collect();
    let routing = combined_routing(&times);
    // How long each tenant's requests waited in the router (one replica).
    let tenant_waits = routers
        .first()
        .and_then(Running::ours)
        .and_then(|r| r.metrics().ok())
        .map(|m| crate::tenants::RouterWaits::parse(&m))
        .unwrap_or_default();
    drop(routers);
    drop(config_files);
    drop(engines);
    Ok(PolicyRun {
        policy: front.name(),
        replicas,
        summary,
        records,
        routing,
        per_engine,
        work: Work::sum(&each),
        load,
        restart,
        bandwidth,
        tenant_waits,
    })
}

fn one() -> usize {
    1
}

/// A router's figures on one row.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct QualityRow {
    pub scenario: String,
    /// The API the conversations were sent in ([`crate::apis`]).
    #[serde(default)]
    pub api: testkit::workload::Api,
    pub policy: String,
    /// Whether `policy` is a peer router rather than one of ours.
    #[serde(default)]
    pub peer: bool,
    /// Processes of the router in front of the fleet, each request to one
    /// at random.
    #[serde(default = "one")]
    pub replicas: usize,
    /// Hit rate over the same router's with one replica (for a front
    /// running alone, over the sharing front's), when several replica
    /// counts ran.
    #[serde(default)]
    pub kept: Option<f64>,
    pub kv_blocks: usize,
    #[serde(default)]
    pub engines: usize,
    #[serde(default)]
    pub hide_capacity: bool,
    #[serde(default)]
    pub think_s: f64,
    /// Runs the figures are medians of (`--repeats`); requests and errors
    /// are their sums.
    #[serde(default = "one")]
    pub runs: usize,
    pub requests: u64,
    pub errors: u64,
    /// Cached over prompt tokens, over all successful requests.
    pub hit_rate: f64,
    pub ceiling: f64,
    /// The same trace on one cache with all the engines' blocks
    /// ([`crate::pooled`]): a reference no placement is expected to pass.
    #[serde(default)]
    pub pooled: Option<f64>,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    pub latency_p50_ms: f64,
    #[serde(default)]
    pub latency_p99_ms: f64,
    pub rps: f64,
    /// Busiest engine's requests over the mean, as the engines counted them.
    pub load_max_mean: f64,
    /// What a conversation cost the engines ([`crate::cost`]).
    #[serde(default)]
    pub cost: Option<Cost>,
    pub routing: RoutingTime,
    /// Each run's replica killed and started again (`--restart-replica`).
    #[serde(default)]
    pub restarts: Vec<crate::replicas::RestartFigures>,
    /// What each sharing replica's stream published, run by run.
    #[serde(default)]
    pub bandwidth: Vec<crate::replicas::ReplicaTraffic>,
    /// The small and the big tenant's requests apart, on a row whose
    /// traffic names its tenants ([`crate::tenants`]).
    #[serde(default)]
    pub tenants: Option<crate::tenants::TenantFigures>,
}

impl QualityRow {
    /// One row of figures from repeated runs of the same router on the same
    /// row: each figure is the median over the runs (taken separately, so
    /// the p99 is the median p99); requests and errors are summed.
    pub fn median(runs: &[QualityRow]) -> QualityRow {
        let mut r = runs[0].clone();
        if runs.len() == 1 {
            return r;
        }
        let m = |f: fn(&QualityRow) -> f64| crate::table::median(runs.iter().map(f).collect());
        r.runs = runs.iter().map(|x| x.runs).sum();
        r.requests = runs.iter().map(|x| x.requests).sum();
        r.errors = runs.iter().map(|x| x.errors).sum();
        r.hit_rate = m(|x| x.hit_rate);
        r.ceiling = m(|x| x.ceiling);
        let pooled: Vec<f64> = runs.iter().filter_map(|x| x.pooled).collect();
        r.pooled = (!pooled.is_empty()).then(|| crate::table::median(pooled));
        r.ttft_p50_ms = m(|x| x.ttft_p50_ms);
        r.ttft_p90_ms = m(|x| x.ttft_p90_ms);
        r.ttft_p99_ms = m(|x| x.ttft_p99_ms);
        r.latency_p50_ms = m(|x| x.latency_p50_ms);
        r.latency_p99_ms = m(|x| x.latency_p99_ms);
        r.rps = m(|x| x.rps);
        r.load_max_mean = m(|x| x.load_max_mean);
        let costs: Vec<Cost> = runs.iter().filter_map(|x| x.cost).collect();
        r.cost = (!costs.is_empty()).then(|| {
            let m = |f: fn(&Cost) -> f64| crate::table::median(costs.iter().map(f).collect());
            Cost {
                conversations: m(|c| c.conversations),
                computed_tokens: m(|c| c.computed_tokens),
                busy_s: m(|c| c.busy_s),
                prefill_s: m(|c| c.prefill_s),
            }
        });
        r.routing.mean_us = m(|x| x.routing.mean_us);
        r.routing.p99_le_us = m(|x| x.routing.p99_le_us);
        r.restarts = runs.iter().flat_map(|x| x.restarts.clone()).collect();
        r.bandwidth = runs
            .iter()
            .enumerate()
            .flat_map(|(k, x)| {
                x.bandwidth.iter().cloned().map(move |mut b| {
                    b.run = k;
                    b
                })
            })
            .collect();
        let split: Vec<crate::tenants::TenantFigures> =
            runs.iter().filter_map(|x| x.tenants).collect();
        r.tenants = crate::tenants::TenantFigures::median(&split);
        r
    }

    /// The figures the cost table sets against round-robin's.
    pub fn figures(&self) -> crate::cost::Figures {
        crate::cost::Figures {
            cost: self.cost,
            ttft_p50_ms: self.ttft_p50_ms,
            ttft_p90_ms: self.ttft_p90_ms,
        }
    }

    pub fn of(run: &PolicyRun, qs: &QualityScenario) -> QualityRow {
        let s = &run.summary;
        QualityRow {
            scenario: qs.name.clone(),
            api: qs.api,
            policy: run.policy.clone(),
            peer: Peer::from_name(&run.policy).is_some(),
            replicas: run.replicas,
            kept: None,
            kv_blocks: qs.kv_blocks,
            engines: qs.drive.engines,
            hide_capacity: qs.hide_capacity,
            think_s: qs.think_s,
            runs: 1,
            requests: s.ok,
            errors: s.errors,
            hit_rate: s.hit_rate,
            ceiling: s.ceiling_hit_rate,
            pooled: crate::pooled::pooled_hit_rate(
                &run.records,
                qs.drive.engines * qs.kv_blocks,
                qs.scenario.max_tokens as usize,
            ),
            ttft_p50_ms: s.ttft_ms.p50,
            ttft_p90_ms: s.ttft_ms.p90,
            ttft_p99_ms: s.ttft_ms.p99,
            latency_p50_ms: s.latency_ms.p50,
            latency_p99_ms: s.latency_ms.p99,
            rps: s.throughput_rps,
            load_max_mean: run.load_max_mean(),
            cost: run.cost(),
            routing: run.routing,
            restarts: run.restart.iter().cloned().collect(),
            bandwidth: run.bandwidth.clone(),
            tenants: crate::tenants::TenantFigures::of(&run.records, run.tenant_waits),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct QualityCfg {
    pub scenarios: Vec<QualityScenario>,
    /// Overrides every row's own policies when set (`--policies`).
    #[serde(default)]
    pub policies: Option<Vec<String>>,
    /// The peer routers that ran (filled when their virtualenv is there).
    #[serde(default)]
    pub peers: Vec<Peer>,
    /// Runs of each router on each row; the figures are medians.
    #[serde(default = "one")]
    pub repeats: usize,
    /// Replica counts: each router runs as this many processes in front
    /// of the fleet, each request to one at random (`--replicas`).
    #[serde(default = "one_replica_count")]
    pub replicas: Vec<usize>,
    /// Seconds into each run of prefix-router's sharing replicas at which
    /// one of them is killed and started again (`--restart-replica`).
    #[serde(default)]
    pub restart_at_s: Option<f64>,
    pub timing: Timing,
}

fn one_replica_count() -> Vec<usize> {
    vec![1]
}

impl QualityCfg {
    /// The named rows, then the lock-step ones.
    pub fn full() -> Self {
        QualityCfg {
            scenarios: crate::scenarios::default_rows(),
            policies: None,
            peers: Vec::new(),
            repeats: 1,
            replicas: one_replica_count(),
            restart_at_s: None,
            timing: Timing::default(),
        }
    }

    /// One small chat row, prefix against round-robin: the smoke test.
    pub fn quick() -> Self {
        let mut chat = crate::scenarios::lockstep(testkit::workload::ScenarioKind::Chat);
        chat.drive = Drive {
            engines: 2,
            users: 4,
            duration_s: 1.5,
            seed: 1,
            arrivals_per_s: None,
        };
        chat.policies = ["prefix", "round-robin"].map(String::from).to_vec();
        QualityCfg {
            scenarios: vec![chat],
            ..Self::full()
        }
    }

    /// Keeps only the rows named in `names` (all when empty;
    /// `cache-pressure` stands for [`crate::scenarios::CACHE_PRESSURE`],
    /// `capped` for [`crate::scenarios::capped_rows`]);
    /// errors on an unknown name, listing the known ones.
    pub fn select(&mut self, names: &[String]) -> anyhow::Result<()> {
        if names.is_empty() {
            return Ok(());
        }
        let names: Vec<String> = names
            .iter()
            .flat_map(|n| {
                if n == crate::scenarios::CACHE_PRESSURE_SET {
                    crate::scenarios::CACHE_PRESSURE.map(String::from).to_vec()
                } else if n == crate::scenarios::CAPPED_SET {
                    crate::scenarios::capped_rows()
                        .into_iter()
                        .map(|r| r.name)
                        .collect()
                } else {
                    vec![n.clone()]
                }
            })
            .collect();
        let names = &names[..];
        let known: Vec<String> = crate::scenarios::all()
            .into_iter()
            .map(|s| s.name)
            .collect();
        for n in names {
            anyhow::ensure!(
                known.contains(n),
                "unknown scenario {n:?}; known: {}",
                known.join(", ")
            );
        }
        let mut picked: Vec<QualityScenario> = crate::scenarios::all()
            .into_iter()
            .filter(|s| names.contains(&s.name))
            .collect();
        picked.sort_by_key(|s| names.iter().position(|n| *n == s.name));
        self.scenarios = picked;
        Ok(())
    }

    /// prefix-router's policies on row `qs`.
    pub fn policies_for<'a>(&'a self, qs: &'a QualityScenario) -> &'a [String] {
        self.policies.as_deref().unwrap_or(&qs.policies)
    }

    /// The routers of row `qs` by name: its policies, then the peers.
    fn front_names(&self, qs: &QualityScenario) -> Vec<String> {
        let mut v = self.policies_for(qs).to_vec();
        v.extend(self.peers.iter().map(|p| p.name().to_string()));
        v
    }

    /// One round of row `qs`: `(router, replicas)`, the router as an index
    /// of [`QualityCfg::front_names`], replica count by replica count. A
    /// front running alone is left out at one replica when the front that
    /// shares runs too: one replica has no one to share with.
    fn plan(&self, qs: &QualityScenario) -> Vec<(usize, usize)> {
        let names = self.front_names(qs);
        let counts = if self.replicas.is_empty() {
            one_replica_count()
        } else {
            self.replicas.clone()
        };
        counts
            .iter()
            .flat_map(|&n| {
                let names = &names;
                (0..names.len())
                    .filter(move |&i| {
                        n != 1
                            || crate::replicas::shared_name(&names[i])
                                .is_none_or(|base| !names.contains(&base))
                    })
                    .map(move |i| (i, n))
            })
            .collect()
    }

    /// Runs in all: every row under its policies and every peer, at each
    /// replica count, repeated.
    pub fn runs(&self) -> usize {
        self.repeats.max(1)
            * self
                .scenarios
                .iter()
                .map(|s| self.plan(s).len())
                .sum::<usize>()
    }
}

/// Fills each row's `kept` when several replica counts ran: its hit rate
/// over the one-replica row of the same router on the same scenario (for
/// a front running alone, of the front that shares).
pub fn fill_kept(rows: &mut [QualityRow]) {
    if rows.iter().all(|r| r.replicas == 1) {
        return;
    }
    let base: Vec<Option<f64>> = rows
        .iter()
        .map(|r| {
            let names = [
                r.policy.clone(),
                crate::replicas::shared_name(&r.policy).unwrap_or_default(),
            ];
            names.iter().find_map(|n| {
                rows.iter()
                    .find(|b| {
                        b.scenario == r.scenario
                            && b.api == r.api
                            && b.replicas == 1
                            && b.policy == *n
                    })
                    .map(|b| b.hit_rate)
            })
        })
        .collect();
    for (r, b) in rows.iter_mut().zip(base) {
        r.kept = b.filter(|&b| b > 0.0).map(|b| r.hit_rate / b);
    }
}

/// Runs every row under its policies, then under each peer in `venv`.
/// `tick` is called before each run.
pub fn run(
    bins: &Bins,
    cfg: &QualityCfg,
    venv: Option<&Venv>,
    tick: &mut dyn FnMut(&str),
) -> anyhow::Result<Vec<QualityRow>> {
    let mut rows = Vec::new();
    for qs in &cfg.scenarios {
        let mut fronts: Vec<Front<'_>> = cfg
            .policies_for(qs)
            .iter()
            .map(|p| Front::Policy(p))
            .collect();
        if let Some(v) = venv {
            fronts.extend(cfg.peers.iter().map(|&p| Front::Peer(v, p)));
        }
        let plan: Vec<(usize, usize)> = cfg
            .plan(qs)
            .into_iter()
            .filter(|&(i, _)| i < fronts.len())
            .collect();
        // Rounds over all routers and replica counts, so a noisy minute of
        // the machine is spread over every router rather than landing on one.
        let mut runs: Vec<Vec<QualityRow>> = vec![Vec::new(); plan.len()];
        for round in 0..cfg.repeats.max(1) {
            for (k, &(i, n)) in plan.iter().enumerate() {
                let front = fronts[i];
                let times = if n == 1 {
                    String::new()
                } else {
                    format!(" x{n}")
                };
                tick(&format!(
                    "{} / {}{times} (round {})",
                    qs.label(),
                    front.name(),
                    round + 1
                ));
                let mut run = run_one(bins, qs, front, &cfg.timing, n, cfg.restart_at_s)?;
                if let Some(f) = run.restart.as_mut() {
                    // The same traffic with nothing killed: what the
                    // restarted replica's requests hit without the restart.
                    tick(&format!(
                        "{} / {}{times} (round {}, control: no restart)",
                        qs.label(),
                        front.name(),
                        round + 1
                    ));
                    let control = run_one(bins, qs, front, &cfg.timing, n, None)?;
                    // The kept records are the run's with the restart, not
                    // the control's written over them.
                    keep_records(qs, front, n, &run.records)?;
                    f.pair(&run.records, &control.records);
                    if let Some(p) = &f.paired {
                        eprintln!(
                            "  {}: the same {} requests without the restart hit {} (with it {}, {:+.1} points)",
                            qs.name,
                            p.restarted.requests,
                            crate::table::pct(p.unrestarted.hit_rate),
                            crate::table::pct(p.restarted.hit_rate),
                            -p.points_behind()
                        );
                    }
                }
                runs[k].push(QualityRow::of(&run, qs));
            }
        }
        rows.extend(runs.iter().map(|r| QualityRow::median(r)));
    }
    fill_kept(&mut rows);
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn select_keeps_the_named_rows_in_the_asked_order() {
        let mut q = QualityCfg::full();
        let names = ["hot-prompt".to_string(), "pressure-unpublished".into()];
        q.select(&names).unwrap();
        let got: Vec<&str> = q.scenarios.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(got, ["hot-prompt", "pressure-unpublished"]);
        q.peers = Peer::ALL.to_vec();
        assert_eq!(q.runs(), 2 * (3 + 3), "3 policies + 3 peers per row");
        q.policies = Some(vec!["prefix".into()]);
        assert_eq!(q.runs(), 2 * (1 + 3));
        let err = QualityCfg::full()
            .select(&["pressure".to_string()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("pressure-published"), "{err}");
    }

    #[test]
    fn engines_run_by_priority_only_when_the_front_s_file_sets_engine_priority() {
        assert!(!engines_by_priority(None).unwrap());
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/configs/");
        let by = |f: &str| engines_by_priority(Some(&format!("{root}{f}"))).unwrap();
        assert!(by("classes-priority.toml"));
        assert!(!by("classes.toml"));
        assert!(engines_by_priority(Some("/nonexistent/x.toml")).is_err());
    }

    #[test]
    fn a_precise_front_gives_the_router_every_engine_s_events() {
        let front = |policy, baseline, precise, alone, config| PolicyFront {
            policy,
            baseline,
            precise,
            alone,
            config,
            envoy: false,
        };
        assert_eq!(
            parse_policy("prefix"),
            front("prefix", false, false, false, None)
        );
        assert_eq!(
            parse_policy("prefix@baseline+a.toml"),
            front("prefix", true, false, false, Some("a.toml"))
        );
        assert_eq!(
            parse_policy("prefix@precise"),
            front("prefix", false, true, false, None)
        );
        assert_eq!(
            parse_policy("prefix@precise@alone+a.toml"),
            front("prefix", false, true, true, Some("a.toml"))
        );
        assert_eq!(
            parse_policy("prefix@envoy+a.toml"),
            PolicyFront {
                envoy: true,
                ..front("prefix", false, false, false, Some("a.toml"))
            }
        );
        let urls = [
            "http://127.0.0.1:7001".to_string(),
            "http://127.0.0.1:7002".into(),
        ];
        let ports = [
            fleet::EventPorts {
                live: 9001,
                replay: 9002,
            },
            fleet::EventPorts {
                live: 9003,
                replay: 9004,
            },
        ];
        let extra = std::env::temp_dir().join(format!("precise-extra-{}.toml", std::process::id()));
        std::fs::write(
            &extra,
            "[precise]\nburst_ms = 500\n[prefix]\nblock_bytes = 64\n",
        )
        .unwrap();
        let extra_name = extra.display().to_string();
        for (extra, burst) in [(None, 2000), (Some(extra_name.as_str()), 500)] {
            let file = ConfigFile::write(&precise_text(&urls, &ports, extra).unwrap()).unwrap();
            let cfg = prefix_router::config::Config::from_file(&file.0).unwrap();
            assert!(cfg.precise.enabled);
            assert_eq!(cfg.precise.burst_ms, burst);
            let endpoints: Vec<_> = cfg.backends.iter().map(|b| b.kv_events()).collect();
            assert_eq!(
                endpoints,
                [
                    (Some("tcp://127.0.0.1:9001"), Some("tcp://127.0.0.1:9002")),
                    (Some("tcp://127.0.0.1:9003"), Some("tcp://127.0.0.1:9004")),
                ]
            );
            let path = file.0.clone();
            drop(file);
            assert!(!path.exists(), "removed after the run");
        }
        std::fs::remove_file(extra).unwrap();
    }

    #[test]
    fn repeated_runs_give_medians_figure_by_figure() {
        let qs = crate::scenarios::named_scenarios().remove(0);
        let run = |hit: f64, p99: f64| PolicyRun {
            policy: "prefix".into(),
            summary: Summary {
                ok: 10,
                hit_rate: hit,
                ttft_ms: testkit::workload::Percentiles {
                    p99,
                    ..Default::default()
                },
                ..Default::default()
            },
            replicas: 1,
            records: Vec::new(),
            routing: RoutingTime::default(),
            per_engine: vec![5, 5],
            work: Work::default(),
            load: Default::default(),
            restart: None,
            bandwidth: Vec::new(),
            tenant_waits: Default::default(),
        };
        let rows: Vec<QualityRow> = [(0.7, 900.0), (0.5, 300.0), (0.6, 100.0)]
            .iter()
            .map(|&(h, p)| QualityRow::of(&run(h, p), &qs))
            .collect();
        let m = QualityRow::median(&rows);
        assert_eq!((m.hit_rate, m.ttft_p99_ms), (0.6, 300.0));
        assert_eq!((m.runs, m.requests), (3, 30));
        assert_eq!(m.load_max_mean, 1.0);
    }

    #[test]
    fn a_sharing_replica_s_config_names_it_and_every_peer() {
        let all = crate::replicas::listen_addrs(3).unwrap();
        let urls = ["http://127.0.0.1:7001".to_string()];
        let ports = [fleet::EventPorts {
            live: 9001,
            replay: 9002,
        }];
        for base in [String::new(), precise_text(&urls, &ports, None).unwrap()] {
            let text = base + &crate::replicas::section(all[1], &all);
            let file = ConfigFile::write(&text).unwrap();
            let cfg = prefix_router::config::Config::from_file(&file.0).unwrap();
            assert_eq!(cfg.replicas.listen, Some(all[1]));
            let peers: Vec<String> = all.iter().map(|a| a.to_string()).collect();
            assert_eq!(cfg.replicas.peers, peers);
            assert!(cfg.replicas.enabled());
        }
    }

    #[test]
    fn replica_counts_run_every_router_and_alone_only_where_it_differs() {
        let mut q = QualityCfg::full();
        q.select(&["cache-pressure".to_string()]).unwrap();
        let got: Vec<&str> = q.scenarios.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(got, crate::scenarios::CACHE_PRESSURE);
        q.peers = vec![Peer::Sglang, Peer::Vllm];
        q.policies = Some(vec!["prefix".into(), "prefix@alone".into()]);
        q.replicas = vec![1, 2, 4];
        let plan = q.plan(&q.scenarios[0]);
        // prefix, sglang, vllm at 1; all four at 2 and at 4.
        assert_eq!(
            plan,
            [
                (0, 1),
                (2, 1),
                (3, 1),
                (0, 2),
                (1, 2),
                (2, 2),
                (3, 2),
                (0, 4),
                (1, 4),
                (2, 4),
                (3, 4)
            ]
        );
        assert_eq!(q.runs(), 4 * 11);
        // Alone without the front that shares: it runs at one replica too.
        q.policies = Some(vec!["prefix@alone".into()]);
        q.peers.clear();
        assert_eq!(q.plan(&q.scenarios[0]), [(0, 1), (0, 2), (0, 4)]);
    }

    #[test]
    fn kept_is_over_the_same_router_s_one_replica_row() {
        let qs = crate::scenarios::named_scenarios().remove(0);
        let row = |policy: &str, replicas: usize, hit: f64| {
            let mut r = QualityRow::of(
                &PolicyRun {
                    policy: policy.into(),
                    replicas,
                    summary: Summary {
                        hit_rate: hit,
                        ..Default::default()
                    },
                    records: Vec::new(),
                    routing: RoutingTime::default(),
                    per_engine: vec![1],
                    work: Work::default(),
                    load: Default::default(),
                    restart: None,
                    bandwidth: Vec::new(),
                    tenant_waits: Default::default(),
                },
                &qs,
            );
            r.hit_rate = hit;
            r
        };
        let mut rows = vec![
            row("prefix", 1, 0.8),
            row("sglang-router", 1, 0.5),
            row("prefix", 2, 0.78),
            row("prefix@alone", 2, 0.6),
            row("sglang-router", 2, 0.4),
        ];
        fill_kept(&mut rows);
        let kept: Vec<f64> = rows.iter().map(|r| r.kept.unwrap()).collect();
        let want = [1.0, 1.0, 0.78 / 0.8, 0.6 / 0.8, 0.8];
        for (k, w) in kept.iter().zip(want) {
            assert!((k - w).abs() < 1e-9, "{kept:?}");
        }
        assert!(rows[1].peer && !rows[0].peer);
        let mut single = vec![row("prefix", 1, 0.8)];
        fill_kept(&mut single);
        assert_eq!(single[0].kept, None, "one replica count: nothing to keep");
    }

    #[test]
    fn replicas_routing_times_combine_by_their_counts() {
        let t = |count, mean_us, p99_le_us| RoutingTime {
            count,
            mean_us,
            p99_le_us,
        };
        let c = combined_routing(&[t(100, 10.0, 50.0), t(300, 30.0, 100.0)]);
        assert_eq!((c.count, c.mean_us, c.p99_le_us), (400, 25.0, 100.0));
        assert_eq!(combined_routing(&[]).mean_us, 0.0);
    }

    #[test]
    fn load_is_busiest_over_mean() {
        assert_eq!(max_over_mean(&[10, 10, 10]), 1.0);
        assert_eq!(max_over_mean(&[30, 0, 0]), 3.0);
        assert_eq!(max_over_mean(&[]), 0.0);
    }
}
