//! The demo: a fleet of simulated engines with a GPU-like timing model,
//! prefix-router in front, and a multi-turn chat workload with shared system
//! prompts (people thinking between turns) replayed through each policy, and
//! through the peer routers when they are installed, against freshly started
//! engines. Prints a table per policy and what a conversation cost the
//! engines under each against round-robin, and writes a Markdown report
//! with SVG charts. Per-engine figures come from the engines' own
//! `/metrics` ([`crate::engine_metrics`]).

use crate::charts;
use crate::cost::{self, Cost, Figures};
use crate::fleet::Bins;
use crate::peers::{Peer, Venv};
use crate::quality::{self, Drive, Front, PolicyRun, QualityScenario, Timing};
use crate::table::{Table, pct};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use testkit::workload::{Scenario, ScenarioKind};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DemoCfg {
    pub policies: Vec<String>,
    pub drive: Drive,
    pub timing: Timing,
    /// Per-engine KV capacity in 16-token blocks.
    pub kv_blocks: usize,
    /// Shared system prompts of the chat workload.
    pub system_prompts: usize,
    /// Mean think time between turns in simulated seconds (scaled).
    #[serde(default)]
    pub think_s: f64,
    /// The peer routers that ran beside the policies.
    #[serde(default)]
    pub peers: Vec<Peer>,
}

impl Default for DemoCfg {
    /// About 100 s of traffic: 3 policies x 32 s, plus engine starts.
    fn default() -> Self {
        DemoCfg {
            policies: ["prefix", "round-robin", "least-request"]
                .map(String::from)
                .to_vec(),
            drive: Drive {
                engines: 4,
                users: 24,
                duration_s: 32.0,
                seed: 7,
                arrivals_per_s: None,
            },
            timing: Timing::default(),
            // One engine holds its share of the 24 live conversations (up to
            // ~300 blocks each) when they stay put, not all of them.
            kv_blocks: quality::kv_blocks_for(ScenarioKind::Chat),
            system_prompts: 4,
            think_s: crate::scenarios::THINK_S,
            peers: Vec::new(),
        }
    }
}

impl DemoCfg {
    pub fn scenario(&self) -> Scenario {
        Scenario {
            prefixes: self.system_prompts,
            ..quality::scenario_for(ScenarioKind::Chat)
        }
    }

    /// The demo as a quality row.
    pub fn row(&self) -> QualityScenario {
        QualityScenario {
            name: "demo-chat".into(),
            about: "the demo's support chat".into(),
            scenario: self.scenario(),
            kv_blocks: self.kv_blocks,
            hide_capacity: false,
            think_s: self.think_s,
            drive: self.drive.clone(),
            policies: self.policies.clone(),
            alongside: None,
            api: testkit::workload::Api::Chat,
            capped: None,
            engine_restarts_s: Vec::new(),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DemoPolicy {
    pub policy: String,
    pub summary: testkit::workload::Summary,
    pub routing: quality::RoutingTime,
    /// What one cache with all the engines' blocks would hit on this
    /// policy's trace ([`crate::pooled`]).
    #[serde(default)]
    pub pooled: Option<f64>,
    /// What a conversation cost the engines ([`crate::cost`]).
    #[serde(default)]
    pub cost: Option<Cost>,
}

impl DemoPolicy {
    fn figures(&self) -> Figures {
        Figures {
            cost: self.cost,
            ttft_p50_ms: self.summary.ttft_ms.p50,
            ttft_p90_ms: self.summary.ttft_ms.p90,
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DemoResults {
    pub cfg: DemoCfg,
    pub policies: Vec<DemoPolicy>,
}

impl DemoResults {
    /// The baseline's row, round-robin's, when it ran.
    pub fn baseline(&self) -> Option<&DemoPolicy> {
        self.policies.iter().find(|p| p.policy == cost::BASELINE)
    }
}

/// Runs the demo (the peers too when `venv` is given and `cfg.peers` lists
/// them) and writes its report into `out`; returns the report's path.
pub fn run(bins: &Bins, cfg: &DemoCfg, venv: Option<&Venv>, out: &Path) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(out)?;
    let row = cfg.row();
    let mut fronts: Vec<Front<'_>> = cfg.policies.iter().map(|p| Front::Policy(p)).collect();
    if let Some(v) = venv {
        fronts.extend(cfg.peers.iter().map(|&p| Front::Peer(v, p)));
    }
    let total = cfg.drive.duration_s * fronts.len() as f64;
    let pb = ProgressBar::new((total * 10.0) as u64);
    pb.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {wide_bar} {percent:>3}% {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    println!(
        "demo: {} engines ({}; {} KV blocks each), {} chat users over {} shared system prompts, thinking {} s between turns (scaled), {:.0} s per policy",
        cfg.drive.engines,
        cfg.timing.describe(),
        cfg.kv_blocks,
        cfg.drive.users,
        cfg.system_prompts,
        cfg.think_s,
        cfg.drive.duration_s
    );
    if venv.is_some() && !cfg.peers.is_empty() {
        let names: Vec<&str> = cfg.peers.iter().map(|p| p.name()).collect();
        println!(
            "demo: peer routers beside the policies: {}",
            names.join(", ")
        );
    }
    let mut runs: Vec<PolicyRun> = Vec::new();
    for (i, front) in fronts.iter().enumerate() {
        let policy = front.name();
        pb.set_message(format!("{policy}: running"));
        let base = (i as f64 * cfg.drive.duration_s * 10.0) as u64;
        let done = Arc::new(AtomicBool::new(false));
        let ticker = {
            let (pb, done) = (pb.clone(), done.clone());
            let span = (cfg.drive.duration_s * 10.0) as u64;
            std::thread::spawn(move || {
                let t0 = Instant::now();
                while !done.load(Ordering::Relaxed) {
                    let p = (t0.elapsed().as_secs_f64() * 10.0) as u64;
                    pb.set_position(base + p.min(span));
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        };
        let r = quality::run_one(bins, &row, *front, &cfg.timing, 1, None);
        done.store(true, Ordering::Relaxed);
        let _ = ticker.join();
        let r = r?;
        pb.println(format!(
            "{policy}: {} requests, hit rate {}, TTFT p50 {:.1} ms, per conversation {}",
            r.summary.ok,
            pct(r.summary.hit_rate),
            r.summary.ttft_ms.p50,
            r.cost().map_or("-".into(), |c| format!(
                "{:.0} prompt tokens computed, {:.2} engine GPU s",
                c.computed_tokens, c.busy_s
            ))
        ));
        runs.push(r);
    }
    pb.finish_and_clear();

    for r in &runs {
        let path = out.join(format!("records-{}.jsonl", r.policy));
        let mut s = String::new();
        for rec in &r.records {
            let _ = writeln!(s, "{}", serde_json::to_string(rec)?);
        }
        std::fs::write(path, s)?;
    }
    let results = DemoResults {
        cfg: cfg.clone(),
        policies: runs
            .iter()
            .map(|r| DemoPolicy {
                policy: r.policy.clone(),
                summary: r.summary.clone(),
                routing: r.routing,
                pooled: crate::pooled::pooled_hit_rate(
                    &r.records,
                    cfg.drive.engines * cfg.kv_blocks,
                    row.scenario.max_tokens as usize,
                ),
                cost: r.cost(),
            })
            .collect(),
    };
    std::fs::write(
        out.join("results.json"),
        serde_json::to_string_pretty(&results)?,
    )?;
    let ttft: Vec<(String, Vec<f64>)> = runs
        .iter()
        .map(|r| {
            let v = r
                .records
                .iter()
                .filter(|x| x.ok())
                .filter_map(|x| x.ttft_ms)
                .collect();
            (r.policy.clone(), v)
        })
        .collect();
    charts::ttft_cdf(&out.join("ttft.svg"), &ttft)?;
    let load: Vec<_> = runs
        .iter()
        .map(|r| (r.policy.clone(), r.load.clone()))
        .collect();
    charts::load_over_time(&out.join("load.svg"), &load)?;
    if let Some(base) = results.baseline() {
        let groups: Vec<(String, Vec<Option<f64>>)> = results
            .policies
            .iter()
            .filter(|p| p.policy != cost::BASELINE)
            .map(|p| {
                let v = p.figures().versus(&base.figures());
                // Savings drawn as the cost's change: below zero is cheaper.
                let down = |s: Option<f64>| s.map(|s| -s);
                (
                    p.policy.clone(),
                    vec![
                        down(v.tokens_saving),
                        down(v.busy_saving),
                        v.ttft_p50,
                        v.ttft_p90,
                    ],
                )
            })
            .collect();
        charts::versus_bars(
            &out.join("cost.svg"),
            &[
                "prompt tokens computed / conversation",
                "engine GPU s / conversation",
                "TTFT p50",
                "TTFT p90",
            ],
            &groups,
        )?;
    }
    let bars: Vec<_> = runs
        .iter()
        .map(|r| {
            (
                r.policy.clone(),
                r.summary.hit_rate,
                r.summary.ceiling_hit_rate,
            )
        })
        .collect();
    charts::hit_rate_bars(&out.join("hit-rate.svg"), &bars)?;

    let table = table(&results);
    let costs = cost_table(&results);
    println!("\n{}", table.text());
    println!("Cost per conversation:\n{}", costs.text());
    println!("{}", headline(&results));
    let report = out.join("report.md");
    std::fs::write(&report, markdown(&results, &table, &costs))?;
    Ok(report)
}

/// One row per policy.
pub fn table(r: &DemoResults) -> Table {
    let mut t = Table::new(&[
        "policy",
        "requests",
        "hit rate",
        "ceiling",
        "pooled",
        "TTFT p50 ms",
        "p90",
        "p99",
        "latency p50 ms",
        "p99",
        "req/s",
        "out tok/s",
        "max/mean load",
        "routing us (mean / p99 <=)",
    ]);
    for p in &r.policies {
        let s = &p.summary;
        t.row(vec![
            p.policy.clone(),
            format!("{} ({} err)", s.ok, s.errors),
            pct(s.hit_rate),
            pct(s.ceiling_hit_rate),
            p.pooled.map_or("-".into(), pct),
            format!("{:.1}", s.ttft_ms.p50),
            format!("{:.1}", s.ttft_ms.p90),
            format!("{:.1}", s.ttft_ms.p99),
            format!("{:.1}", s.latency_ms.p50),
            format!("{:.1}", s.latency_ms.p99),
            format!("{:.1}", s.throughput_rps),
            format!("{:.0}", s.output_tokens_per_s),
            format!("{:.2}", s.load_max_mean_ratio),
            if Peer::from_name(&p.policy).is_some() {
                "-".into()
            } else {
                format!("{:.1} / {:.0}", p.routing.mean_us, p.routing.p99_le_us)
            },
        ]);
    }
    t
}

/// Requests each engine completed under each policy, by the engines' own
/// counts, and the busiest over the mean.
pub fn engines_table(r: &DemoResults) -> Table {
    let mut engines: Vec<&str> = Vec::new();
    for p in &r.policies {
        for e in p.summary.per_instance.keys() {
            if !engines.contains(&e.as_str()) {
                engines.push(e);
            }
        }
    }
    let mut head = vec!["policy"];
    head.extend(engines.iter().copied());
    head.push("max/mean");
    let mut t = Table::new(&head);
    for p in &r.policies {
        let mut line = vec![p.policy.clone()];
        line.extend(engines.iter().map(|e| {
            p.summary
                .per_instance
                .get(*e)
                .map_or("-".into(), u64::to_string)
        }));
        line.push(format!("{:.2}", p.summary.load_max_mean_ratio));
        t.row(line);
    }
    t
}

/// What a conversation cost under each policy, against round-robin.
pub fn cost_table(r: &DemoResults) -> Table {
    let mut t = cost::table(&["policy"]);
    let base = r.baseline().map(DemoPolicy::figures);
    for p in &r.policies {
        let mut line = vec![p.policy.clone()];
        line.extend(cost::cells(&p.figures(), base.as_ref()));
        t.row(line);
    }
    t
}

/// The report's first paragraph: each policy's cost per conversation and
/// TTFT against round-robin's, in words.
pub fn headline(r: &DemoResults) -> String {
    let Some(base) = r.baseline() else {
        return format!(
            "Cost per conversation: no {} run to set the policies against.",
            cost::BASELINE
        );
    };
    let Some(bc) = base.cost else {
        return format!("Cost per conversation: {} served none.", cost::BASELINE);
    };
    let mut m = format!(
        "**What a conversation cost.** Under {}, a conversation made the engines compute {:.0} prompt tokens and kept them busy {:.2} GPU seconds.",
        cost::BASELINE,
        bc.computed_tokens,
        bc.busy_s
    );
    for p in r.policies.iter().filter(|p| p.policy != cost::BASELINE) {
        let Some(c) = p.cost else { continue };
        let v = p.figures().versus(&base.figures());
        let _ = write!(
            m,
            " Under {}: {:.0} tokens and {:.2} GPU seconds, {} prompt computation and {} engine time; TTFT p50 {}, p90 {} against {}'s.",
            p.policy,
            c.computed_tokens,
            c.busy_s,
            cost::less(v.tokens_saving),
            cost::less(v.busy_saving),
            cost::signed(v.ttft_p50),
            cost::signed(v.ttft_p90),
            cost::BASELINE
        );
    }
    m
}

fn markdown(r: &DemoResults, table: &Table, costs: &Table) -> String {
    let c = &r.cfg;
    let sc = c.scenario();
    let mut m = String::new();
    let _ = writeln!(m, "# prefix-router demo\n");
    let _ = writeln!(m, "{}\n", headline(r));
    let _ = writeln!(
        m,
        "{} simulated vLLM engines (`sim-engine`), each started fresh for every policy, with {} KV-cache blocks of 16 tokens; timing model: {}.\n",
        c.drive.engines,
        c.kv_blocks,
        c.timing.describe()
    );
    let _ = writeln!(
        m,
        "Workload: multi-turn support chat, {} closed-loop users thinking {} s (simulated, exponential mean) between turns, {} shared system prompts of {} tokens, user turns of {} tokens, {}-{} turns per conversation each resending the whole history, {} output tokens per turn, streaming; {:.0} s per policy, seed {}. The ceiling is the hit rate one engine with an unbounded cache would reach on the same trace; pooled, one engine with all the engines' KV blocks (the same trace replayed through the engine's cache model, no placement at all).\n",
        c.drive.users,
        c.think_s,
        c.system_prompts,
        sc.prefix_tokens,
        sc.user_tokens,
        sc.turns.0,
        sc.turns.1,
        sc.max_tokens,
        c.drive.duration_s,
        c.drive.seed
    );
    let _ = writeln!(m, "## Cost per conversation\n");
    let _ = writeln!(m, "{}", costs.markdown());
    let _ = writeln!(m, "{}\n", cost::NOTE);
    if r.baseline().is_some() {
        let _ = writeln!(m, "![against round-robin](cost.svg)\n");
    }
    let _ = writeln!(m, "## Every figure\n");
    let _ = writeln!(m, "{}", table.markdown());
    if !c.peers.is_empty() {
        let _ = writeln!(m, "{}\n", crate::quality_report::PEERS_NOTE);
    }
    let _ = writeln!(
        m,
        "Routing us: the router's own time from request read to routing decision (`prefix_router_routing_seconds`); p99 is the upper bound of its histogram bucket.\n"
    );
    if let (Some(p), Some(rr)) = (
        r.policies.iter().find(|p| p.policy == "prefix"),
        r.policies.iter().find(|p| p.policy == "round-robin"),
    ) {
        let _ = writeln!(
            m,
            "prefix vs round-robin: hit rate {} vs {} ({} of the ceiling), TTFT p50 {:.2}x round-robin's, max/mean load {:.2}.\n",
            pct(p.summary.hit_rate),
            pct(rr.summary.hit_rate),
            pct(p.summary.hit_rate / p.summary.ceiling_hit_rate.max(1e-9)),
            p.summary.ttft_ms.p50 / rr.summary.ttft_ms.p50.max(1e-9),
            p.summary.load_max_mean_ratio
        );
    }
    let _ = writeln!(m, "## Time to first token\n\n![TTFT](ttft.svg)\n");
    let _ = writeln!(m, "## Hit rate per policy\n\n![hit rate](hit-rate.svg)\n");
    let _ = writeln!(
        m,
        "## Load per engine over time\n\n![load](load.svg)\n\nEach engine's requests in flight (running and waiting), read from its own `/metrics` every {} ms. Requests each engine completed, as it counted them (`vllm:request_success_total`):\n",
        crate::engine_metrics::LOAD_STEP.as_millis()
    );
    let _ = writeln!(m, "{}", engines_table(r).markdown());
    let _ = writeln!(
        m,
        "Per-request records: `records-<policy>.jsonl`; figures: `results.json`."
    );
    m
}
