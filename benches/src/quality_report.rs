//! The quality bench's part of the report: the rows of each scenario, the
//! scenarios against the peer routers side by side, and the placement targets.

use crate::quality::QualityRow;
use crate::report::{BenchResults, Check, Table, pct};
use std::fmt::Write as _;

/// How the peer routers ran: said beside every table that has them.
pub const PEERS_NOTE: &str = "Peer routers: sglang-router 0.3.2, vllm-router 0.1.17 and smg 1.13.0 from PyPI, each with its `cache_aware` policy and defaults otherwise (smg with `--worker-warmup-secs 0` and `--disable-tokenizer-autoload`), on the same engines and the same traffic (same seed), the whole run inside a network namespace with only loopback. The engines answer vLLM's `/tokenize` and render endpoints, so vllm-router routes on the real token ids. TTFT is the first streamed content event; the client acknowledges at once (TCP_QUICKACK), which keeps sglang-router's Nagle/delayed-ACK stall (+40 ms on a reused connection) out of the figures.";

impl BenchResults {
    /// The placement targets, on the rows that ran: against the best peer under
    /// memory pressure, and against round-robin on the hot prompt.
    pub(crate) fn check_placement_targets(&self, c: &mut Vec<Check>) {
        let row = |sc: &str, p: &str| {
            self.quality_rows
                .iter()
                .find(|r| r.scenario == sc && r.policy == p)
        };
        for sc in ["pressure-unpublished", "pressure-published", "think-48"] {
            let Some(ours) = row(sc, "prefix") else {
                continue;
            };
            let peers: Vec<&QualityRow> = self
                .quality_rows
                .iter()
                .filter(|r| r.scenario == sc && r.peer)
                .collect();
            let Some(best) = peers
                .iter()
                .max_by(|a, b| a.hit_rate.total_cmp(&b.hit_rate))
            else {
                continue;
            };
            let d = (ours.hit_rate - best.hit_rate) * 100.0;
            // What the target asks beside what one pooled cache hits on the
            // same traffic: a target above the pool is beyond placement.
            let pool = match ours.pooled {
                Some(p) => format!(
                    " (target {}; one pooled cache of the fleet's blocks: {})",
                    pct(best.hit_rate + 0.02),
                    pct(p)
                ),
                None => String::new(),
            };
            c.push(Check {
                target: format!("{sc}: hit rate >= best peer's + 2 points"),
                measured: format!(
                    "{} vs {} {}{pool}",
                    pct(ours.hit_rate),
                    best.policy,
                    pct(best.hit_rate)
                ),
                met: d >= 2.0,
                margin: format!("{d:+.1} points"),
            });
            let p50 = peers
                .iter()
                .map(|r| r.ttft_p50_ms)
                .fold(f64::INFINITY, f64::min);
            let p99 = peers
                .iter()
                .map(|r| r.ttft_p99_ms)
                .fold(f64::INFINITY, f64::min);
            c.push(Check {
                target: format!("{sc}: TTFT p50 and p99 <= the best peer's"),
                measured: format!(
                    "p50 {:.1} ms (best peer {p50:.1}), p99 {:.1} ms (best peer {p99:.1})",
                    ours.ttft_p50_ms, ours.ttft_p99_ms
                ),
                met: ours.ttft_p50_ms <= p50 && ours.ttft_p99_ms <= p99,
                margin: format!(
                    "{:+.1} / {:+.1} ms",
                    ours.ttft_p50_ms - p50,
                    ours.ttft_p99_ms - p99
                ),
            });
        }
        if let (Some(u), Some(p)) = (
            row("pressure-unpublished", "prefix"),
            row("pressure-published", "prefix"),
        ) {
            let d = (u.hit_rate - p.hit_rate) * 100.0;
            c.push(Check {
                target: "capacity not published: hit rate within 1 point of published".into(),
                measured: format!("{} vs {}", pct(u.hit_rate), pct(p.hit_rate)),
                met: d >= -1.0,
                margin: format!("{d:+.1} points"),
            });
        }
        if let (Some(ours), Some(rr)) = (
            row("hot-prompt", "prefix"),
            row("hot-prompt", "round-robin"),
        ) {
            c.push(Check {
                target: format!(
                    "hot-prompt: TTFT p99 <= round-robin's ({})",
                    if ours.runs >= 3 {
                        format!("median of {} runs", ours.runs)
                    } else {
                        "the target is a median of three runs: --repeats 3".into()
                    }
                ),
                measured: format!("{:.1} ms vs {:.1} ms", ours.ttft_p99_ms, rr.ttft_p99_ms),
                met: ours.ttft_p99_ms <= rr.ttft_p99_ms,
                margin: format!("{:+.1} ms", ours.ttft_p99_ms - rr.ttft_p99_ms),
            });
            c.push(Check {
                target: "hot-prompt: max/mean load <= 1.25".into(),
                measured: format!("{:.2}", ours.load_max_mean),
                met: ours.load_max_mean <= 1.25,
                margin: format!("{:+.2}", ours.load_max_mean - 1.25),
            });
            let d = (ours.hit_rate - rr.hit_rate) * 100.0;
            c.push(Check {
                target: "hot-prompt: hit rate >= round-robin's".into(),
                measured: format!("{} vs {}", pct(ours.hit_rate), pct(rr.hit_rate)),
                met: d >= 0.0,
                margin: format!("{d:+.1} points"),
            });
        }
    }
}

/// The rows of each scenario, one line each; then, when peers ran, the
/// scenarios against the routers side by side.
pub fn quality_markdown(q: &crate::quality::QualityCfg, rows: &[QualityRow]) -> String {
    let mut m = String::new();
    let _ = writeln!(
        m,
        "Each row under each router on freshly started engines ({}), the same traffic (same seed) for every router. Hit rate = cached / prompt tokens over all requests, as the engines reported them; ceiling = what one engine with an unbounded cache would hit on the same trace; pooled = the same trace replayed on one engine with all the engines' KV blocks, no placement at all (`benches/src/pooled.rs`; a reference the best placement over separate caches has not passed by more than half a point in any replay); max/mean load = the busiest engine's requests over the mean, as the engines counted them.\n",
        q.timing.describe()
    );
    if q.repeats > 1 {
        let _ = writeln!(
            m,
            "Each router ran {} times on each scenario, in rounds over all routers; every figure below is the median of its runs (requests are their sum).\n",
            q.repeats
        );
    }
    let mut t = Table::new(&[
        "scenario",
        "engines x KV blocks",
        "capacity",
        "users",
        "think s",
        "s",
        "what",
    ]);
    for s in &q.scenarios {
        t.row(vec![
            s.name.clone(),
            format!("{} x {}", s.drive.engines, s.kv_blocks),
            if s.hide_capacity {
                "not published"
            } else {
                "published"
            }
            .into(),
            match s.drive.arrivals_per_s {
                Some(r) => format!("open loop, {r:.2} new chats per simulated s"),
                None => s.drive.users.to_string(),
            },
            format!("{}", s.think_s),
            format!("{:.0}", s.drive.duration_s),
            s.about.clone(),
        ]);
    }
    let _ = writeln!(m, "{}", t.markdown());
    let mut t = Table::new(&[
        "scenario",
        "router",
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
        "max/mean load",
        "routing us",
    ]);
    for x in rows {
        t.row(vec![
            x.scenario.clone(),
            x.policy.clone(),
            format!("{} ({} err)", x.requests, x.errors),
            pct(x.hit_rate),
            pct(x.ceiling),
            x.pooled.map_or("-".into(), pct),
            format!("{:.1}", x.ttft_p50_ms),
            format!("{:.1}", x.ttft_p90_ms),
            format!("{:.1}", x.ttft_p99_ms),
            format!("{:.1}", x.latency_p50_ms),
            format!("{:.1}", x.latency_p99_ms),
            format!("{:.1}", x.rps),
            format!("{:.2}", x.load_max_mean),
            if x.peer {
                "-".into()
            } else {
                format!("{:.1}", x.routing.mean_us)
            },
        ]);
    }
    let _ = writeln!(m, "{}", t.markdown());
    if rows.iter().any(|r| r.peer) {
        let _ = writeln!(m, "### Against the peer routers\n");
        let _ = writeln!(m, "{}\n", side_by_side(rows).markdown());
        let _ = writeln!(
            m,
            "Each cell: hit rate · TTFT p50 / p99 ms · max/mean load.\n\n{PEERS_NOTE}\n"
        );
    }
    m
}

/// Scenarios down, routers across: hit rate, TTFT p50/p99, max/mean load.
pub fn side_by_side(rows: &[QualityRow]) -> Table {
    let mut routers: Vec<&str> = Vec::new();
    let mut scenarios: Vec<&str> = Vec::new();
    for r in rows {
        if !routers.contains(&r.policy.as_str()) {
            routers.push(&r.policy);
        }
        if !scenarios.contains(&r.scenario.as_str()) {
            scenarios.push(&r.scenario);
        }
    }
    let mut head = vec!["scenario"];
    head.extend(routers.iter().copied());
    let mut t = Table::new(&head);
    for sc in scenarios {
        let mut line = vec![sc.to_string()];
        for p in &routers {
            line.push(
                rows.iter()
                    .find(|r| r.scenario == sc && r.policy == *p)
                    .map_or("-".into(), |r| {
                        format!(
                            "{} · {:.0} / {:.0} · {:.2}",
                            pct(r.hit_rate),
                            r.ttft_p50_ms,
                            r.ttft_p99_ms,
                            r.load_max_mean
                        )
                    }),
            );
        }
        t.row(line);
    }
    t
}
