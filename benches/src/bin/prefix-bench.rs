//! `prefix-bench`: the demo and the bench of prefix-router. `cargo xtask demo`
//! and `cargo xtask bench` build the release binaries and run this.

use anyhow::Context;
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use router_benches::demo::{self, DemoCfg};
use router_benches::fleet::{self, Bins};
use router_benches::nginx::NginxMode;
use router_benches::overhead::{self, OverheadCfg};
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
    /// Results folder of this run [default: RESULTS_ROOT/<demo|bench>-<unix time>].
    #[arg(long, global = true)]
    out: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// The router in front of simulated engines, policy against policy.
    Demo(DemoArgs),
    /// Router overhead against direct and nginx, and routing quality.
    Bench(BenchArgs),
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
    /// Seconds per quality run.
    #[arg(long)]
    quality_duration: Option<f64>,
    /// The command line to quote in the report.
    #[arg(long, default_value = "cargo xtask bench")]
    command: String,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    fleet::install_signal_handler()?;
    let bins = Bins::new(cli.bin_dir.clone())?;
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
            let report = demo::run(&bins, &cfg, &out)?;
            println!("report: {}", report.display());
            Ok(())
        }
        Cmd::Bench(a) => bench(&bins, cli.results_root, cli.out, a),
    }
}

fn bench(bins: &Bins, root: PathBuf, out: Option<PathBuf>, a: BenchArgs) -> anyhow::Result<()> {
    let out = out.unwrap_or_else(|| fleet::results_dir(&root, "bench"));
    std::fs::create_dir_all(&out).with_context(|| format!("create {}", out.display()))?;
    let mut ocfg = if a.quick {
        OverheadCfg::quick()
    } else {
        OverheadCfg::full()
    };
    if let Some(r) = a.repeats {
        ocfg.repeats = r.max(1);
    }
    let mut qcfg = if a.quick {
        QualityCfg::quick()
    } else {
        QualityCfg::full()
    };
    if let Some(d) = a.quality_duration {
        qcfg.drive.duration_s = d;
    }
    let targets = if a.nginx == NginxMode::Off { 2 } else { 3 };
    let total = if a.skip_overhead {
        0
    } else {
        ocfg.runs() * targets
    } + if a.skip_quality {
        0
    } else {
        qcfg.scenarios.len() * qcfg.policies.len()
    };
    let pb = ProgressBar::new(total as u64);
    pb.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {wide_bar} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut tick = |msg: &str| {
        pb.inc(1);
        pb.set_message(msg.to_string());
    };
    let mut r = BenchResults {
        unix_time: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        machine: Machine::detect(),
        command: a.command.clone(),
        ..Default::default()
    };
    if let Some(dir) = &a.criterion_dir {
        r.micro = router_benches::micro::read(dir, &["extract", "hash", "index", "select"]);
    }
    if !a.skip_overhead {
        pb.set_position(0);
        r.overhead = Some(overhead::run(bins, &ocfg, a.nginx, &out, &mut tick)?);
    }
    if !a.skip_quality {
        r.quality_rows = quality::run(bins, &qcfg, &mut tick)?;
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
    std::fs::write(out.join("results.json"), serde_json::to_string_pretty(&r)?)?;
    let md = report::markdown(&r, comparison.as_deref());
    std::fs::write(out.join("report.md"), &md)?;
    println!("{md}");
    println!("results: {}", out.join("results.json").display());
    println!("report: {}", out.join("report.md").display());
    Ok(())
}
