//! Router overhead, side by side in one run: the same zero-delay engines
//! reached directly, through nginx and through prefix-router, at several
//! concurrencies and prompt sizes, plus streaming time to first byte.
//!
//! The machine is noisy, so runs alternate (the order of the three targets
//! rotates every round) and repeat; a proxy's added latency is its
//! percentile minus direct's in the same round, and the figure reported is
//! the median over rounds.

use crate::body;
use crate::cpu;
use crate::envoy::Envoy;
use crate::fleet::{self, Bins, Engine, Router};
use crate::loadgen::{self, LoadSpec, q_us};
use crate::nginx::{Nginx, NginxMode};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// Engines of the overhead bench: answer at once, and accept 400 KB prompts
/// (the sim-engine's longest sequence is its KV capacity, 40000 x 16 tokens).
const ZERO_ENGINE: &[&str] = &["--time-scale", "0", "--kv-blocks", "40000"];
/// Engines of the streaming run: no prefill cost, 2 ms per token, so the
/// first token leaves well before the last and a buffering proxy would show.
const STREAM_ENGINE: &[&str] = &[
    "--prefill-tps",
    "0",
    "--decode-step-ms",
    "2",
    "--decode-step-per-seq-ms",
    "0",
];
/// A path to another `prefix-router` binary: run it side by side as the
/// target `baseline` (a build before a change, for a before/after in one run).
pub const BASELINE_ENV: &str = "PREFIX_BENCH_BASELINE_ROUTER";
/// Tokens per streamed answer.
const STREAM_TOKENS: u32 = 16;
/// Tiny requests on kept-alive connections, the TLS targets beside the rest.
pub const TLS_PHASE: &str = "tls-tiny";
/// Tiny requests, a new connection (and TLS handshake) for each.
pub const HANDSHAKE_PHASE: &str = "tls-handshake";

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OverheadCfg {
    pub engines: usize,
    pub concurrencies: Vec<usize>,
    /// Prompt sizes in KB, run at `size_concurrency`.
    pub sizes_kb: Vec<usize>,
    pub size_concurrency: usize,
    pub stream_concurrency: usize,
    /// Whether the streaming phase runs.
    #[serde(default = "yes")]
    pub stream: bool,
    pub repeats: usize,
    pub warmup_ms: u64,
    pub duration_ms: u64,
    /// Worker threads of prefix-router and worker processes of nginx.
    pub workers: usize,
    /// Concurrencies of the TLS rows (`tls-tiny`: keep-alive connections;
    /// `tls-handshake` runs at 1, a new connection per request); empty: no
    /// TLS rows.
    #[serde(default)]
    pub tls_concurrencies: Vec<usize>,
}

impl OverheadCfg {
    pub fn full() -> Self {
        OverheadCfg {
            engines: 4,
            concurrencies: vec![1, 16, 64, 256],
            sizes_kb: vec![4, 64, 400],
            size_concurrency: 1,
            stream_concurrency: 1,
            stream: true,
            repeats: 3,
            warmup_ms: 300,
            duration_ms: 1500,
            workers: std::thread::available_parallelism().map_or(2, |n| n.get()),
            tls_concurrencies: vec![1, 64],
        }
    }

    pub fn quick() -> Self {
        OverheadCfg {
            engines: 2,
            concurrencies: vec![1, 8],
            sizes_kb: vec![64],
            tls_concurrencies: vec![1],
            repeats: 1,
            warmup_ms: 100,
            duration_ms: 300,
            ..Self::full()
        }
    }

    /// Measured runs this config makes per target.
    pub fn runs(&self) -> usize {
        let tls = if self.tls_concurrencies.is_empty() {
            0
        } else {
            self.tls_concurrencies.len() + 1
        };
        self.repeats
            * (self.concurrencies.len() + self.sizes_kb.len() + usize::from(self.stream) + tls)
    }
}

/// One measured run of one target.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Sample {
    pub phase: String,
    pub target: String,
    pub concurrency: usize,
    pub repeat: usize,
    pub ok: u64,
    pub errors: u64,
    pub rps: f64,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub first_byte_p50_us: f64,
    pub first_byte_p99_us: f64,
    /// CPU microseconds per request of the proxy (master and workers).
    pub cpu_us_per_req: Option<f64>,
    /// CPU microseconds per request of the endpoint picker behind the
    /// proxy (`envoy+epp`: prefix-router answering Envoy's ext_proc).
    #[serde(default)]
    pub picker_cpu_us_per_req: Option<f64>,
    /// CPU microseconds per request of all the engines together: what the
    /// proxy in front makes them spend (how it spreads and batches).
    #[serde(default)]
    pub engines_cpu_us_per_req: f64,
    /// Share of one core the load generator used.
    pub loadgen_core: f64,
}

/// Medians over rounds of one (phase, concurrency, target).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Row {
    pub phase: String,
    pub concurrency: usize,
    pub target: String,
    pub rps: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// Percentile minus direct's in the same round (0 for direct).
    pub added_p50_us: f64,
    pub added_p90_us: f64,
    pub added_p99_us: f64,
    pub added_p999_us: f64,
    pub added_first_byte_p50_us: f64,
    pub added_first_byte_p99_us: f64,
    pub cpu_us_per_req: Option<f64>,
    /// The endpoint picker's CPU per request (median over rounds).
    #[serde(default)]
    pub picker_cpu_us_per_req: Option<f64>,
    /// The engines' CPU per request (median over rounds).
    #[serde(default)]
    pub engines_cpu_us_per_req: f64,
    /// The load generator's CPU per request (median over rounds).
    #[serde(default)]
    pub loadgen_cpu_us_per_req: f64,
    pub errors: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OverheadResults {
    pub cfg: OverheadCfg,
    pub samples: Vec<Sample>,
    pub rows: Vec<Row>,
    /// Highest direct throughput: what the load generator can drive.
    pub loadgen_ceiling_rps: f64,
    /// Share of a core the load generator used at that point.
    pub loadgen_ceiling_core: f64,
    /// Why nginx is absent, when it is.
    pub nginx_note: Option<String>,
    /// Why the Envoy targets are absent, when they are.
    #[serde(default)]
    pub envoy_note: Option<String>,
}

struct Target {
    name: &'static str,
    addrs: Vec<SocketAddr>,
    /// Pid whose CPU is the proxy's, and whether its children count too.
    cpu: Option<(u32, bool)>,
    /// Reached over TLS (only in the `tls-*` phases).
    tls: Option<(Arc<rustls::ClientConfig>, String)>,
    /// Pid of the endpoint picker the proxy asks, counted apart.
    picker: Option<u32>,
}

/// Envoy round-robin, and Envoy with prefix-router as its picker.
struct Gateways {
    round_robin: Envoy,
    picker: Router,
    with_picker: Envoy,
}

impl Gateways {
    fn start(bins: &Bins, engines: &[Engine], workers: usize) -> anyhow::Result<Gateways> {
        let addrs: Vec<SocketAddr> = engines.iter().map(|e| e.addr).collect();
        let round_robin = Envoy::round_robin(&addrs, workers)?;
        let epp_port = testkit::proc::free_port();
        // The picker's own HTTP front takes no traffic: one worker.
        let picker = Router::start(
            bins,
            engines,
            "prefix",
            &[
                "--workers".into(),
                "1".into(),
                "--epp-listen".into(),
                format!("127.0.0.1:{epp_port}"),
            ],
        )?;
        let with_picker = Envoy::with_picker(epp_port, addrs[0], workers)?;
        Ok(Gateways {
            round_robin,
            picker,
            with_picker,
        })
    }
}

/// The TLS side of the stand: one certificate from a CA made for the run,
/// the router and nginx each terminating TLS with it.
struct TlsStand {
    client: Arc<rustls::ClientConfig>,
    router: Router,
    nginx: Option<Nginx>,
}

/// The name the TLS targets' certificate carries.
const TLS_NAME: &str = "localhost";

/// Engines with a router and (maybe) nginx in front.
struct Stand {
    engines: Vec<Engine>,
    router: Router,
    /// Another build of the router, side by side (`BASELINE_ENV`).
    baseline: Option<Router>,
    nginx: Option<Nginx>,
    tls: Option<TlsStand>,
    gateways: Option<Gateways>,
}

impl Stand {
    fn start(
        bins: &Bins,
        cfg: &OverheadCfg,
        engine_args: &[&str],
        nginx: NginxMode,
        dir: &Path,
    ) -> anyhow::Result<(Stand, Option<String>, Option<String>)> {
        let args: Vec<String> = engine_args.iter().map(|s| s.to_string()).collect();
        let nginx_mode = nginx;
        let engines = fleet::start_engines(bins, cfg.engines, &args)?;
        let router = Router::start(
            bins,
            &engines,
            "prefix",
            &["--workers".into(), cfg.workers.to_string()],
        )?;
        let baseline = match std::env::var_os(BASELINE_ENV) {
            Some(bin) => Some(Router::start_bin(
                Path::new(&bin),
                &engines.iter().map(Engine::url).collect::<Vec<_>>(),
                "prefix",
                &["--workers".into(), cfg.workers.to_string()],
            )?),
            None => None,
        };
        let addrs: Vec<SocketAddr> = engines.iter().map(|e| e.addr).collect();
        let (nginx, note) = match nginx {
            NginxMode::Off => (None, Some("nginx disabled (--nginx off)".to_string())),
            mode => match Nginx::start(dir, &addrs, cfg.workers) {
                Ok(n) => (Some(n), None),
                Err(e) if mode == NginxMode::Auto => (None, Some(format!("{e:#}"))),
                Err(e) => return Err(e),
            },
        };
        let tls = if cfg.tls_concurrencies.is_empty() || engine_args == STREAM_ENGINE {
            None
        } else {
            Some(TlsStand::start(bins, cfg, &engines, nginx_mode, dir)?)
        };
        let (gateways, envoy_note) = match testkit::envoy_proc::binary() {
            Ok(_) => (Some(Gateways::start(bins, &engines, cfg.workers)?), None),
            Err(why) => (None, Some(why)),
        };
        Ok((
            Stand {
                engines,
                router,
                baseline,
                nginx,
                tls,
                gateways,
            },
            note,
            envoy_note,
        ))
    }

    /// The targets of a phase: the TLS ones only in the `tls-*` phases.
    fn targets(&self, tls_phase: bool) -> Vec<Target> {
        let mut t = vec![Target {
            name: "direct",
            addrs: self.engines.iter().map(|e| e.addr).collect(),
            cpu: None,
            tls: None,
            picker: None,
        }];
        if let Some(n) = &self.nginx {
            t.push(Target {
                name: "nginx",
                addrs: vec![n.addr],
                cpu: Some((n.child.pid(), true)),
                tls: None,
                picker: None,
            });
        }
        t.push(Target {
            name: "prefix-router",
            addrs: vec![self.router.addr],
            cpu: Some((self.router.child.pid(), false)),
            tls: None,
            picker: None,
        });
        if let Some(b) = &self.baseline {
            t.push(Target {
                name: "baseline",
                addrs: vec![b.addr],
                cpu: Some((b.child.pid(), false)),
                tls: None,
                picker: None,
            });
        }
        if let (true, Some(s)) = (tls_phase, &self.tls) {
            let tls = Some((s.client.clone(), TLS_NAME.to_string()));
            if let Some(n) = &s.nginx {
                t.push(Target {
                    name: "nginx-tls",
                    addrs: vec![n.addr],
                    cpu: Some((n.child.pid(), true)),
                    tls: tls.clone(),
                    picker: None,
                });
            }
            t.push(Target {
                name: "prefix-router-tls",
                addrs: vec![s.router.addr],
                cpu: Some((s.router.child.pid(), false)),
                tls,
                picker: None,
            });
        }
        if let (false, Some(g)) = (tls_phase, &self.gateways) {
            t.push(Target {
                name: "envoy",
                addrs: vec![g.round_robin.addr],
                cpu: Some((g.round_robin.child.pid(), false)),
                tls: None,
                picker: None,
            });
            t.push(Target {
                name: "envoy+epp",
                addrs: vec![g.with_picker.addr],
                cpu: Some((g.with_picker.child.pid(), false)),
                tls: None,
                picker: Some(g.picker.child.pid()),
            });
        }
        t
    }
}

impl TlsStand {
    /// A certificate for `localhost` from a CA made here; prefix-router
    /// (`[tls]`) and nginx (`listen ... ssl`, TLS 1.2 and 1.3, session
    /// tickets and cache as shipped) serving it in front of `engines`.
    fn start(
        bins: &Bins,
        cfg: &OverheadCfg,
        engines: &[Engine],
        nginx: NginxMode,
        dir: &Path,
    ) -> anyhow::Result<TlsStand> {
        let dir = dir.join("tls");
        std::fs::create_dir_all(&dir)?;
        let dir = dir.canonicalize()?;
        let ca = testkit::tls::TestCa::new("overhead bench CA");
        let (cert, key) = ca
            .issue(&[TLS_NAME], testkit::tls::Validity::Now, false)
            .write(&dir, "server");
        let conf = dir.join("router.toml");
        std::fs::write(
            &conf,
            format!(
                "[tls]\ncert = \"{}\"\nkey = \"{}\"\n",
                cert.display(),
                key.display()
            ),
        )?;
        let router = Router::start(
            bins,
            engines,
            "prefix",
            &[
                "--workers".into(),
                cfg.workers.to_string(),
                "--config".into(),
                conf.display().to_string(),
            ],
        )?;
        let addrs: Vec<SocketAddr> = engines.iter().map(|e| e.addr).collect();
        let nginx = match nginx {
            NginxMode::Off => None,
            mode => match Nginx::start_tls(&dir.join("nginx"), &addrs, cfg.workers, &cert, &key) {
                Ok(n) => Some(n),
                Err(_) if mode == NginxMode::Auto => None,
                Err(e) => return Err(e),
            },
        };
        Ok(TlsStand {
            client: testkit::tls::client_config(&ca.pem, None),
            router,
            nginx,
        })
    }
}

fn measure(
    t: &Target,
    engines: &[u32],
    phase: &str,
    concurrency: usize,
    repeat: usize,
    request: &Arc<Vec<u8>>,
    cfg: &OverheadCfg,
) -> anyhow::Result<Sample> {
    let spec = LoadSpec {
        targets: t.addrs.clone(),
        conn: loadgen::ConnSpec {
            tls: t.tls.clone(),
            fresh: phase == HANDSHAKE_PHASE,
        },
        request: request.clone(),
        concurrency,
        warmup: Duration::from_millis(cfg.warmup_ms),
        duration: Duration::from_millis(cfg.duration_ms),
    };
    let probe = || {
        let proxy = match t.cpu {
            Some((pid, true)) => cpu::tree_cpu_s(pid),
            Some((pid, false)) => cpu::process_cpu_s(pid),
            None => 0.0,
        };
        [
            proxy,
            engines.iter().map(|&e| cpu::process_cpu_s(e)).sum(),
            t.picker.map_or(0.0, cpu::process_cpu_s),
        ]
    };
    let (r, [cpu_s, engines_s, picker_s]) = loadgen::run(&spec, probe)?;
    Ok(Sample {
        phase: phase.to_string(),
        target: t.name.to_string(),
        concurrency,
        repeat,
        ok: r.ok,
        errors: r.errors,
        rps: r.rps(),
        p50_us: q_us(&r.latency, 0.5),
        p90_us: q_us(&r.latency, 0.9),
        p99_us: q_us(&r.latency, 0.99),
        p999_us: q_us(&r.latency, 0.999),
        first_byte_p50_us: q_us(&r.first_byte, 0.5),
        first_byte_p99_us: q_us(&r.first_byte, 0.99),
        cpu_us_per_req: t.cpu.map(|_| cpu_s * 1e6 / r.ok.max(1) as f64),
        picker_cpu_us_per_req: t.picker.map(|_| picker_s * 1e6 / r.ok.max(1) as f64),
        engines_cpu_us_per_req: engines_s * 1e6 / r.ok.max(1) as f64,
        loadgen_core: r.loadgen_cpu_s / r.window_s,
    })
}

/// Runs every round of one phase: `cases` are (phase name, concurrency, request).
fn rounds(
    stand: &Stand,
    cfg: &OverheadCfg,
    cases: &[(String, usize, Arc<Vec<u8>>)],
    samples: &mut Vec<Sample>,
    tick: &mut dyn FnMut(&str),
) -> anyhow::Result<()> {
    let engines: Vec<u32> = stand.engines.iter().map(|e| e.child.pid()).collect();
    for rep in 0..cfg.repeats {
        for (i, (phase, c, req)) in cases.iter().enumerate() {
            let targets = stand.targets(phase.starts_with("tls-"));
            for k in 0..targets.len() {
                anyhow::ensure!(!fleet::interrupted(), "interrupted");
                let t = &targets[(k + rep + i) % targets.len()];
                tick(&format!("{phase} c={c} {} round {}", t.name, rep + 1));
                samples.push(measure(t, &engines, phase, *c, rep, req, cfg)?);
            }
        }
    }
    Ok(())
}

/// Runs the whole overhead bench. `tick` is called before each measured run.
pub fn run(
    bins: &Bins,
    cfg: &OverheadCfg,
    nginx: NginxMode,
    dir: &Path,
    tick: &mut dyn FnMut(&str),
) -> anyhow::Result<OverheadResults> {
    let mut samples = Vec::new();
    let (stand, nginx_note, envoy_note) =
        Stand::start(bins, cfg, ZERO_ENGINE, nginx, &dir.join("nginx"))?;
    let tiny = Arc::new(body::http_request(&body::tiny_body(false, 1)));
    let cases: Vec<_> = cfg
        .concurrencies
        .iter()
        .map(|&c| ("tiny".to_string(), c, tiny.clone()))
        .collect();
    rounds(&stand, cfg, &cases, &mut samples, tick)?;
    let cases: Vec<_> = cfg
        .sizes_kb
        .iter()
        .map(|&kb| {
            let req = body::http_request(&body::chat_body(kb << 10, kb as u64));
            (
                format!("prompt-{kb}KB"),
                cfg.size_concurrency,
                Arc::new(req),
            )
        })
        .collect();
    rounds(&stand, cfg, &cases, &mut samples, tick)?;
    if stand.tls.is_some() {
        // Every target at each concurrency over kept-alive connections,
        // then a new connection per request (a whole TLS handshake each
        // for the TLS targets, a TCP one for the others).
        let mut cases: Vec<_> = cfg
            .tls_concurrencies
            .iter()
            .map(|&c| (TLS_PHASE.to_string(), c, tiny.clone()))
            .collect();
        cases.push((HANDSHAKE_PHASE.to_string(), 1, tiny.clone()));
        rounds(&stand, cfg, &cases, &mut samples, tick)?;
    }
    drop(stand);

    if cfg.stream {
        let (stand, _, _) =
            Stand::start(bins, cfg, STREAM_ENGINE, nginx, &dir.join("nginx-stream"))?;
        let req = Arc::new(body::http_request(&body::tiny_body(true, STREAM_TOKENS)));
        let cases = vec![("stream".to_string(), cfg.stream_concurrency, req)];
        rounds(&stand, cfg, &cases, &mut samples, tick)?;
        drop(stand);
    }

    let (loadgen_ceiling_rps, loadgen_ceiling_core) = samples
        .iter()
        .filter(|s| s.target == "direct" && s.phase == "tiny")
        .map(|s| (s.rps, s.loadgen_core))
        .fold((0.0, 0.0), |a, b| if b.0 > a.0 { b } else { a });
    Ok(OverheadResults {
        cfg: cfg.clone(),
        rows: aggregate(&samples),
        samples,
        loadgen_ceiling_rps,
        loadgen_ceiling_core,
        nginx_note,
        envoy_note,
    })
}

fn yes() -> bool {
    true
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Medians over rounds, with added latency against direct in the same round.
pub fn aggregate(samples: &[Sample]) -> Vec<Row> {
    let mut groups: BTreeMap<(String, usize, String), Vec<&Sample>> = BTreeMap::new();
    for s in samples {
        groups
            .entry((s.phase.clone(), s.concurrency, s.target.clone()))
            .or_default()
            .push(s);
    }
    let direct = |phase: &str, c: usize, rep: usize| {
        samples.iter().find(|d| {
            d.target == "direct" && d.phase == phase && d.concurrency == c && d.repeat == rep
        })
    };
    let mut rows = Vec::new();
    for ((phase, c, target), ss) in &groups {
        let added = |f: fn(&Sample) -> f64| {
            median(
                ss.iter()
                    .filter_map(|s| direct(phase, *c, s.repeat).map(|d| f(s) - f(d)))
                    .collect(),
            )
        };
        let cpu: Vec<f64> = ss.iter().filter_map(|s| s.cpu_us_per_req).collect();
        let picker: Vec<f64> = ss.iter().filter_map(|s| s.picker_cpu_us_per_req).collect();
        rows.push(Row {
            phase: phase.clone(),
            concurrency: *c,
            target: target.clone(),
            rps: median(ss.iter().map(|s| s.rps).collect()),
            p50_us: median(ss.iter().map(|s| s.p50_us).collect()),
            p99_us: median(ss.iter().map(|s| s.p99_us).collect()),
            added_p50_us: added(|s| s.p50_us),
            added_p90_us: added(|s| s.p90_us),
            added_p99_us: added(|s| s.p99_us),
            added_p999_us: added(|s| s.p999_us),
            added_first_byte_p50_us: added(|s| s.first_byte_p50_us),
            added_first_byte_p99_us: added(|s| s.first_byte_p99_us),
            cpu_us_per_req: (!cpu.is_empty()).then(|| median(cpu)),
            picker_cpu_us_per_req: (!picker.is_empty()).then(|| median(picker)),
            engines_cpu_us_per_req: median(ss.iter().map(|s| s.engines_cpu_us_per_req).collect()),
            loadgen_cpu_us_per_req: median(
                ss.iter()
                    .map(|s| s.loadgen_core * 1e6 / s.rps.max(1e-9))
                    .collect(),
            ),
            errors: ss.iter().map(|s| s.errors).sum(),
        });
    }
    // Direct first, then nginx, then the router, for each case in run order.
    let order = |t: &str| match t {
        "direct" => 0,
        "nginx" => 1,
        "nginx-tls" => 3,
        "prefix-router-tls" => 4,
        _ => 2,
    };
    let phase_order = |p: &str| match p {
        "tiny" => 0,
        "stream" => 2,
        TLS_PHASE => 3,
        HANDSHAKE_PHASE => 4,
        _ => 1,
    };
    rows.sort_by(|a, b| {
        (
            phase_order(&a.phase),
            a.concurrency,
            &a.phase,
            order(&a.target),
        )
            .cmp(&(
                phase_order(&b.phase),
                b.concurrency,
                &b.phase,
                order(&b.target),
            ))
    });
    rows
}

impl OverheadResults {
    /// The row of `target` in `phase` at `concurrency`.
    pub fn row(&self, phase: &str, concurrency: usize, target: &str) -> Option<&Row> {
        self.rows
            .iter()
            .find(|r| r.phase == phase && r.concurrency == concurrency && r.target == target)
    }
}
