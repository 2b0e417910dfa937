//! The bench's results: one JSON file and one Markdown report per run, the
//! project's targets checked, and a comparison against a previous results file.

use crate::micro::MicroRow;
use crate::overhead::OverheadResults;
use crate::quality::QualityRow;
use crate::table::{Check, Table, pct};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// A change worse than this share of the previous value is a regression.
const REGRESSION: f64 = 0.10;

/// Reads a field that may hold an older shape as `None` (so an old results
/// file still compares on what it shares).
fn lenient<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::de::DeserializeOwned,
{
    let v = serde_json::Value::deserialize(d)?;
    Ok(serde_json::from_value(v).ok())
}

/// The machine a run came from.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Machine {
    pub cpu: String,
    pub vcpus: usize,
    pub kernel: String,
    pub nginx: String,
}

impl Machine {
    pub fn detect() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split(':').nth(1))
            .unwrap_or("unknown")
            .trim()
            .to_string();
        let vcpus = cpuinfo
            .lines()
            .filter(|l| l.starts_with("processor"))
            .count();
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_string();
        let nginx = crate::nginx::binary()
            .and_then(|b| std::process::Command::new(b).arg("-v").output().ok())
            .map(|o| String::from_utf8_lossy(&o.stderr).trim().to_string())
            .unwrap_or_else(|| "not installed".into());
        Machine {
            cpu,
            vcpus,
            kernel,
            nginx,
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct BenchResults {
    pub unix_time: u64,
    pub machine: Machine,
    pub command: String,
    pub micro: Vec<MicroRow>,
    pub overhead: Option<OverheadResults>,
    #[serde(default, deserialize_with = "lenient")]
    pub quality: Option<crate::quality::QualityCfg>,
    pub quality_rows: Vec<QualityRow>,
    pub checks: Vec<Check>,
}

impl BenchResults {
    /// Checks every target whose inputs this run measured.
    pub fn check_targets(&mut self) {
        let mut c = Vec::new();
        if let Some(o) = &self.overhead {
            crate::overhead_report::check_overhead_targets(o, &mut c);
        }
        let mut push = |target: &str, measured: String, met: bool, margin: String| {
            c.push(Check {
                target: target.into(),
                measured,
                met,
                margin,
            })
        };
        if let Some(o) = &self.overhead
            && let Some((r, n)) = o
                .row("tiny", 1, "prefix-router")
                .zip(o.row("tiny", 1, "nginx"))
        {
            push(
                "added latency p50 at concurrency 1 <= nginx's",
                format!("{:.0} us vs nginx {:.0} us", r.added_p50_us, n.added_p50_us),
                r.added_p50_us <= n.added_p50_us,
                format!("{:+.0} us", r.added_p50_us - n.added_p50_us),
            );
        }
        let min_gbps = |prefix: &str| {
            self.micro
                .iter()
                .filter(|m| m.id.starts_with(prefix))
                .filter_map(|m| m.gb_per_s())
                .fold(None, |a: Option<f64>, x| Some(a.map_or(x, |a| a.min(x))))
        };
        if let Some(h) = min_gbps("hash/") {
            push(
                "hashing >= 4 GB/s per core (slowest size)",
                format!("{h:.2} GB/s"),
                h >= 4.0,
                format!("{:+.0}%", (h / 4.0 - 1.0) * 100.0),
            );
        }
        // Long prompts: what the router does per request to one, the
        // one-pass scan and the block hashes, on one core.
        if let Some(g) = self
            .micro
            .iter()
            .find(|m| m.id == "extract_hash/scan/400KB")
            .and_then(|m| m.gb_per_s())
        {
            push(
                "extraction + hashing of a 400 KB chat >= 4 GB/s per core",
                format!("{g:.2} GB/s"),
                g >= 4.0,
                format!("{:+.0}%", (g / 4.0 - 1.0) * 100.0),
            );
        }
        if let Some(e) = min_gbps("extract/") {
            push(
                "extraction >= 1 GB/s (slowest size)",
                format!("{e:.2} GB/s"),
                e >= 1.0,
                format!("{:+.0}%", (e - 1.0) * 100.0),
            );
        }
        let q = |p: &str| {
            self.quality_rows.iter().find(|r| {
                r.scenario == "chat"
                    && r.policy == p
                    && r.replicas == 1
                    && r.api == testkit::workload::Api::Chat
            })
        };
        if let (Some(p), Some(rr)) = (q("prefix"), q("round-robin")) {
            let share = p.hit_rate / p.ceiling.max(1e-9);
            push(
                "chat: hit rate >= 90% of the ceiling",
                format!("{} of ceiling {}", pct(p.hit_rate), pct(p.ceiling)),
                share >= 0.9,
                format!("{} of the ceiling", pct(share)),
            );
            let ratio = p.ttft_p50_ms / rr.ttft_p50_ms.max(1e-9);
            push(
                "chat: TTFT p50 <= half of round-robin's",
                format!("{:.1} ms vs {:.1} ms", p.ttft_p50_ms, rr.ttft_p50_ms),
                ratio <= 0.5,
                format!("{ratio:.2}x round-robin's"),
            );
            push(
                "chat: max/mean load <= 1.3",
                format!("{:.2}", p.load_max_mean),
                p.load_max_mean <= 1.3,
                format!("{:+.2}", p.load_max_mean - 1.3),
            );
        }
        crate::quality_report::check_placement_targets(&self.quality_rows, &mut c);
        crate::quality_report::check_picker_targets(&self.quality_rows, &mut c);
        crate::apis::check_targets(&self.quality_rows, &mut c);
        crate::tenants::report::check_targets(&self.quality_rows, &mut c);
        self.checks = c;
    }

    /// Key figures as `name -> (value, higher is better)`, for comparisons.
    pub fn figures(&self) -> BTreeMap<String, (f64, bool)> {
        let mut f = BTreeMap::new();
        for m in &self.micro {
            if let Some(g) = m.gb_per_s() {
                f.insert(format!("micro {} GB/s", m.id), (g, true));
            } else if let Some(n) = m.ns_per_element() {
                f.insert(format!("micro {} ns/elem", m.id), (n, false));
            }
        }
        if let Some(o) = &self.overhead {
            for r in o.rows.iter().filter(|r| r.target != "direct") {
                let k = format!("{} c={} {}", r.phase, r.concurrency, r.target);
                f.insert(format!("{k} req/s"), (r.rps, true));
                f.insert(format!("{k} added p50 us"), (r.added_p50_us, false));
                if let Some(c) = r.cpu_us_per_req {
                    f.insert(format!("{k} CPU us/req"), (c, false));
                }
            }
        }
        for q in &self.quality_rows {
            let mut k = match q.replicas {
                1 => format!("{} {}", q.scenario, q.policy),
                n => format!("{} {} x{n}", q.scenario, q.policy),
            };
            if q.api != testkit::workload::Api::Chat {
                k = format!("{k} on {}", q.api);
            }
            f.insert(format!("{k} hit rate"), (q.hit_rate, true));
            f.insert(format!("{k} TTFT p50 ms"), (q.ttft_p50_ms, false));
            if let Some(c) = q.cost {
                f.insert(
                    format!("{k} prompt tokens computed per conversation"),
                    (c.computed_tokens, false),
                );
                f.insert(
                    format!("{k} engine GPU s per conversation"),
                    (c.busy_s, false),
                );
            }
        }
        f
    }
}

/// The newest `results/bench-*/results.json` other than `current`.
pub fn previous_results(results_root: &Path, current: &Path) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(results_root)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("bench-"))
                && p != current
                && p.join("results.json").exists()
        })
        .collect();
    dirs.sort();
    dirs.pop().map(|d| d.join("results.json"))
}

/// Markdown comparing `now` with `before`: every figure present in both,
/// regressions (worse by more than 10%) marked.
pub fn compare(now: &BenchResults, before: &BenchResults, before_path: &Path) -> String {
    let (a, b) = (before.figures(), now.figures());
    let mut t = Table::new(&["figure", "before", "now", "change", ""]);
    let mut regressions = 0;
    for (k, (new, higher)) in &b {
        let Some((old, _)) = a.get(k) else { continue };
        let change = if old.abs() > 1e-12 {
            new / old - 1.0
        } else {
            0.0
        };
        let worse = if *higher { -change } else { change };
        let flag = if worse > REGRESSION && (new - old).abs() > 1e-9 {
            regressions += 1;
            "REGRESSION"
        } else if worse < -REGRESSION {
            "better"
        } else {
            ""
        };
        t.row(vec![
            k.clone(),
            format!("{old:.3}"),
            format!("{new:.3}"),
            format!("{:+.1}%", change * 100.0),
            flag.into(),
        ]);
    }
    format!(
        "Against `{}` ({} figures worse by more than {:.0}%; the machine is noisy, so read single flags with care):\n\n{}",
        before_path.display(),
        regressions,
        REGRESSION * 100.0,
        t.markdown()
    )
}

/// The Markdown report of a bench run.
pub fn markdown(r: &BenchResults, comparison: Option<&str>) -> String {
    let mut m = String::new();
    let _ = writeln!(m, "# prefix-router benchmarks\n");
    let _ = writeln!(
        m,
        "Machine: {} vCPU, {}, Linux {}; {}. Command: `{}`.\n",
        r.machine.vcpus, r.machine.cpu, r.machine.kernel, r.machine.nginx, r.command
    );
    if !r.checks.is_empty() {
        let _ = writeln!(m, "## Targets\n");
        let mut t = Table::new(&["target", "measured", "met", "margin"]);
        for c in &r.checks {
            t.row(vec![
                c.target.clone(),
                c.measured.clone(),
                if c.met { "yes" } else { "**no**" }.into(),
                c.margin.clone(),
            ]);
        }
        let _ = writeln!(m, "{}", t.markdown());
    }
    if !r.micro.is_empty() {
        let _ = writeln!(m, "## Micro-benchmarks (criterion, one core)\n");
        let mut t = Table::new(&["benchmark", "mean", "throughput"]);
        for x in &r.micro {
            let tp = if let Some(g) = x.gb_per_s() {
                format!("{g:.2} GB/s")
            } else if let Some(e) = x.elements {
                if e > 1 {
                    format!("{:.2} ns per block", x.mean_ns / e as f64)
                } else {
                    format!("{:.1} ns per op", x.mean_ns)
                }
            } else {
                String::new()
            };
            t.row(vec![x.id.clone(), fmt_ns(x.mean_ns), tp]);
        }
        let _ = writeln!(m, "{}", t.markdown());
    }
    if let Some(o) = &r.overhead {
        let c = &o.cfg;
        let _ = writeln!(m, "## Router overhead: direct vs nginx vs prefix-router\n");
        let _ = writeln!(
            m,
            "{} zero-delay `sim-engine`s; prefix-router (`--policy prefix`, {} workers) and nginx ({} workers, keep-alive round-robin) in front of the same engines, all running side by side. {} rounds, target order rotating each round; each run {} ms warm-up then {} ms measured. Added latency = percentile minus direct's in the same round, median over rounds. CPU = the proxy's utime+stime from /proc (nginx: master + workers) over the measured window, per request; engines CPU is all the engines' together in the same window and load gen CPU the load generator's thread, per request: on a machine they share, what one proxy makes the others spend moves the throughput as much as its own CPU. Phases: `tiny` (a 90-byte chat request, `max_tokens` 1), `prompt-N KB` (a chat whose system prompt makes the body N KB) at concurrency {}, `stream` (streamed answer of 16 tokens at 2 ms each; first byte = first response byte) at concurrency {}.\n",
            c.engines,
            c.workers,
            c.workers,
            c.repeats,
            c.warmup_ms,
            c.duration_ms,
            c.size_concurrency,
            c.stream_concurrency
        );
        if let Some(n) = &o.nginx_note {
            let _ = writeln!(m, "nginx absent: {n}\n");
        }
        let mut t = Table::new(&[
            "phase",
            "conc",
            "target",
            "req/s",
            "p50 us",
            "p99 us",
            "added p50",
            "p90",
            "p99",
            "p99.9",
            "added 1st byte p50",
            "p99",
            "CPU us/req",
            "picker CPU us/req",
            "engines CPU us/req",
            "load gen CPU us/req",
            "errors",
        ]);
        for x in &o.rows {
            let direct = x.target == "direct";
            let a = |v: f64| {
                if direct {
                    "-".to_string()
                } else {
                    format!("{v:+.0}")
                }
            };
            t.row(vec![
                x.phase.clone(),
                x.concurrency.to_string(),
                x.target.clone(),
                format!("{:.0}", x.rps),
                format!("{:.0}", x.p50_us),
                format!("{:.0}", x.p99_us),
                a(x.added_p50_us),
                a(x.added_p90_us),
                a(x.added_p99_us),
                a(x.added_p999_us),
                a(x.added_first_byte_p50_us),
                a(x.added_first_byte_p99_us),
                x.cpu_us_per_req.map_or("-".into(), |c| format!("{c:.1}")),
                x.picker_cpu_us_per_req
                    .map_or("-".into(), |c| format!("{c:.1}")),
                format!("{:.1}", x.engines_cpu_us_per_req),
                format!("{:.1}", x.loadgen_cpu_us_per_req),
                x.errors.to_string(),
            ]);
        }
        let _ = writeln!(m, "{}", t.markdown());
        let _ = writeln!(
            m,
            "Load generator ceiling: {:.0} req/s direct against zero-delay engines, its thread using {:.0}% of a core (Rust, one thread, closed loop).\n",
            o.loadgen_ceiling_rps,
            o.loadgen_ceiling_core * 100.0
        );
    }
    if let (Some(q), false) = (&r.quality, r.quality_rows.is_empty()) {
        let _ = writeln!(m, "## Routing quality\n");
        let _ = writeln!(
            m,
            "{}",
            crate::quality_report::quality_markdown(q, &r.quality_rows)
        );
    }
    if let Some(c) = comparison {
        let _ = writeln!(m, "## Comparison with the previous run\n\n{c}");
    }
    m
}

fn fmt_ns(ns: f64) -> String {
    if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.2} us", ns / 1e3)
    } else {
        format!("{ns:.1} ns")
    }
}
