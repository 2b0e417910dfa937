//! Routing quality: workload scenarios under routing policies, each run on a
//! freshly started fleet of engines with a GPU-like timing model and caches
//! too small to hold everything.

use crate::fleet::{self, Bins, Router};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;
use testkit::workload::{Record, RunConfig, Scenario, ScenarioKind, Summary};

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
    pub fn engine_args(&self, kv_blocks: usize) -> Vec<String> {
        [
            ("--prefill-tps", self.prefill_tps),
            ("--decode-step-ms", self.decode_step_ms),
            ("--decode-step-per-seq-ms", self.decode_step_per_seq_ms),
            ("--time-scale", self.time_scale),
            ("--kv-blocks", kv_blocks as f64),
        ]
        .iter()
        .flat_map(|(k, v)| [k.to_string(), v.to_string()])
        .collect()
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

/// The workload of each scenario. Chat is shaped like a support chatbot:
/// 4 shared system prompts of 500 tokens, users' turns of ~200 tokens (a
/// question with an order number, a pasted error), answers of 150 tokens,
/// 6-14 turns, the whole history resent each turn.
pub fn scenario_for(kind: ScenarioKind) -> Scenario {
    match kind {
        ScenarioKind::Chat => Scenario {
            prefixes: 4,
            user_tokens: 200,
            max_tokens: 150,
            turns: (6, 14),
            ..Scenario::new(kind)
        },
        _ => Scenario::new(kind),
    }
}

/// Per-engine KV capacity (16-token blocks) of each scenario: less than the
/// scenario's working set over the fleet, more than one session needs.
pub fn kv_blocks_for(kind: ScenarioKind) -> usize {
    match kind {
        // 4 system prompts of 32 blocks; conversations grow to ~300 blocks:
        // an engine holds its share of 24 conversations, not all of them.
        ScenarioKind::Chat => 1536,
        // 4 templates of ~94 blocks: one engine holds two or three.
        ScenarioKind::FewShot => 256,
        // 16 prompts of ~63 blocks: ~1000 blocks in all.
        ScenarioKind::HotPrefix => 384,
        // 4 documents of 600-1250 blocks.
        ScenarioKind::LongDoc => 2048,
        // 2 tool sets of ~94 blocks; loops grow to ~450 blocks.
        ScenarioKind::Agent => 1024,
    }
}

/// One workload through one policy on a fresh fleet.
#[derive(Clone, Debug)]
pub struct PolicyRun {
    pub policy: String,
    pub summary: Summary,
    pub records: Vec<Record>,
    pub routing: RoutingTime,
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

/// How a scenario is driven.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Drive {
    pub engines: usize,
    pub users: usize,
    pub duration_s: f64,
    pub seed: u64,
}

/// Starts `drive.engines` engines and the router with `policy`, runs the
/// workload for the drive's duration, stops everything.
pub fn policy_run(
    bins: &Bins,
    scenario: &Scenario,
    policy: &str,
    engine_args: &[String],
    drive: &Drive,
) -> anyhow::Result<PolicyRun> {
    anyhow::ensure!(!fleet::interrupted(), "interrupted");
    let engines = fleet::start_engines(bins, drive.engines, engine_args)?;
    let router = Router::start(bins, &engines, policy, &[])?;
    let mut cfg = RunConfig::new(router.url(), scenario.clone());
    cfg.users = drive.users;
    cfg.requests = None;
    cfg.duration = Some(Duration::from_secs_f64(drive.duration_s));
    cfg.seed = drive.seed;
    cfg.request_timeout = Duration::from_secs(60);
    let (records, summary) = testkit::workload::run_blocking(cfg)?;
    let routing = RoutingTime::parse(&router.metrics().unwrap_or_default());
    drop(router);
    drop(engines);
    Ok(PolicyRun {
        policy: policy.to_string(),
        summary,
        records,
        routing,
    })
}

/// A policy's figures on one scenario.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct QualityRow {
    pub scenario: String,
    pub policy: String,
    pub kv_blocks: usize,
    pub requests: u64,
    pub errors: u64,
    pub hit_rate: f64,
    pub ceiling: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    pub latency_p50_ms: f64,
    pub rps: f64,
    pub load_max_mean: f64,
    pub routing: RoutingTime,
}

impl QualityRow {
    pub fn of(run: &PolicyRun, kv_blocks: usize) -> QualityRow {
        let s = &run.summary;
        QualityRow {
            scenario: s.scenario.clone(),
            policy: run.policy.clone(),
            kv_blocks,
            requests: s.ok,
            errors: s.errors,
            hit_rate: s.hit_rate,
            ceiling: s.ceiling_hit_rate,
            ttft_p50_ms: s.ttft_ms.p50,
            ttft_p90_ms: s.ttft_ms.p90,
            ttft_p99_ms: s.ttft_ms.p99,
            latency_p50_ms: s.latency_ms.p50,
            rps: s.throughput_rps,
            load_max_mean: s.load_max_mean_ratio,
            routing: run.routing,
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct QualityCfg {
    pub scenarios: Vec<ScenarioKind>,
    pub policies: Vec<String>,
    pub drive: Drive,
    /// How the chat scenario is driven (the targets are judged on it).
    pub chat_drive: Drive,
    pub timing: Timing,
}

impl QualityCfg {
    pub fn full() -> Self {
        QualityCfg {
            scenarios: vec![
                ScenarioKind::Chat,
                ScenarioKind::FewShot,
                ScenarioKind::HotPrefix,
                ScenarioKind::LongDoc,
                ScenarioKind::Agent,
            ],
            policies: [
                "prefix",
                "round-robin",
                "least-request",
                "random",
                "power-of-two",
                "session",
            ]
            .map(String::from)
            .to_vec(),
            drive: Drive {
                engines: 4,
                users: 16,
                duration_s: 6.0,
                seed: 1,
            },
            chat_drive: Drive {
                engines: 4,
                users: 24,
                duration_s: 24.0,
                seed: 1,
            },
            timing: Timing::default(),
        }
    }

    pub fn quick() -> Self {
        QualityCfg {
            scenarios: vec![ScenarioKind::Chat],
            policies: ["prefix", "round-robin"].map(String::from).to_vec(),
            drive: Drive {
                engines: 2,
                users: 4,
                duration_s: 1.5,
                seed: 1,
            },
            chat_drive: Drive {
                engines: 2,
                users: 4,
                duration_s: 1.5,
                seed: 1,
            },
            ..Self::full()
        }
    }
}

/// Runs every scenario under every policy. `tick` is called before each run.
pub fn run(
    bins: &Bins,
    cfg: &QualityCfg,
    tick: &mut dyn FnMut(&str),
) -> anyhow::Result<Vec<QualityRow>> {
    let mut rows = Vec::new();
    for &kind in &cfg.scenarios {
        let scenario = scenario_for(kind);
        let kv = kv_blocks_for(kind);
        let args = cfg.timing.engine_args(kv);
        // Chat is judged at steady state: long enough for conversations to
        // reach their later turns, where history dominates the prompt.
        let drive = if kind == ScenarioKind::Chat {
            &cfg.chat_drive
        } else {
            &cfg.drive
        };
        for policy in &cfg.policies {
            tick(&format!("{} / {policy}", kind.name()));
            let run = policy_run(bins, &scenario, policy, &args, drive)?;
            rows.push(QualityRow::of(&run, kv));
        }
    }
    Ok(rows)
}

/// Requests in flight on each engine over time, sampled every `step_s`.
pub fn load_over_time(records: &[Record], step_s: f64) -> BTreeMap<String, Vec<(f64, f64)>> {
    let end_s = records.iter().map(|r| r.end_ms).fold(0.0, f64::max) / 1e3;
    let steps = ((end_s / step_s).ceil() as usize).min(100_000);
    let mut out: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for r in records.iter().filter(|r| r.ok()) {
        let id = r.instance.clone().unwrap_or_else(|| "unknown".into());
        let series = out
            .entry(id)
            .or_insert_with(|| (0..=steps).map(|i| (i as f64 * step_s, 0.0)).collect());
        let (a, b) = (r.start_ms / 1e3, r.end_ms / 1e3);
        for p in series.iter_mut().filter(|p| p.0 >= a && p.0 < b) {
            p.1 += 1.0;
        }
    }
    out
}
