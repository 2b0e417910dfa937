//! The quality bench's part of the report: the rows of each scenario, the
//! scenarios against the peer routers side by side, the routers at several
//! replica counts side by side, and the targets they are checked against.

use crate::quality::QualityRow;
use crate::table::{Check, Table, pct};
use std::fmt::Write as _;

/// How the peer routers ran: said beside every table that has them.
pub const PEERS_NOTE: &str = "Peer routers: sglang-router 0.3.2, vllm-router 0.1.17 and smg 1.13.0 from PyPI, each with its `cache_aware` policy and defaults otherwise (smg with `--worker-warmup-secs 0` and `--disable-tokenizer-autoload`), on the same engines and the same traffic (same seed), the whole run inside a network namespace with only loopback. The engines answer vLLM's `/tokenize` and render endpoints, so vllm-router routes on the real token ids. TTFT is the first streamed content event; the client acknowledges at once (TCP_QUICKACK), which keeps sglang-router's Nagle/delayed-ACK stall (+40 ms on a reused connection) out of the figures.";

/// Envoy with prefix-router as its endpoint picker, on every row that ran
/// it beside prefix-router as the proxy: the same hits (within a point),
/// and far more than Envoy's own round-robin.
pub(crate) fn check_picker_targets(rows: &[QualityRow], c: &mut Vec<Check>) {
    let row = |sc: &str, p: &str| {
        rows.iter()
            .find(|r| r.scenario == sc && r.policy == p && r.replicas == 1)
    };
    for picked in rows.iter().filter(|r| r.policy == "prefix@envoy") {
        let sc = picked.scenario.as_str();
        let Some(proxy) = row(sc, "prefix") else {
            continue;
        };
        let d = (picked.hit_rate - proxy.hit_rate) * 100.0;
        let rr = row(sc, crate::envoy::ROUND_ROBIN)
            .map(|r| format!("; Envoy round-robin {}", pct(r.hit_rate)))
            .unwrap_or_default();
        c.push(Check {
            target: format!(
                "{sc}: through Envoy with the picker, hit rate within 1 point of the proxy's"
            ),
            measured: format!(
                "{} vs {}{rr}; TTFT p50 {:.1} vs {:.1} ms",
                pct(picked.hit_rate),
                pct(proxy.hit_rate),
                picked.ttft_p50_ms,
                proxy.ttft_p50_ms
            ),
            met: d >= -1.0,
            margin: format!("{d:+.1} points"),
        });
    }
}

/// The placement targets, on the rows that ran with one replica: against
/// the best peer under memory pressure, and against round-robin on the
/// hot prompt.
pub(crate) fn check_placement_targets(rows: &[QualityRow], c: &mut Vec<Check>) {
    // Judged on the chat (other APIs: `crate::apis`).
    let single: Vec<&QualityRow> = rows
        .iter()
        .filter(|r| r.replicas == 1 && r.api == testkit::workload::Api::Chat)
        .collect();
    let row = |sc: &str, p: &str| {
        single
            .iter()
            .copied()
            .find(|r| r.scenario == sc && r.policy == p)
    };
    for sc in ["pressure-unpublished", "pressure-published", "think-48"] {
        let Some(ours) = row(sc, "prefix") else {
            continue;
        };
        let peers: Vec<&QualityRow> = single
            .iter()
            .copied()
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
    check_replica_targets(rows, c);
}

/// The replicas' targets, on every row that ran prefix-router's
/// sharing front (`prefix`) at several replica counts: N replicas keep
/// at least 0.97x of one router's hit rate, with TTFT p50 and p99 at
/// most 1.1x one router's.
fn check_replica_targets(rows: &[QualityRow], c: &mut Vec<Check>) {
    for r in rows
        .iter()
        .filter(|r| r.policy == "prefix" && r.replicas > 1)
    {
        let Some(one) = rows
            .iter()
            .find(|b| b.scenario == r.scenario && b.policy == r.policy && b.replicas == 1)
        else {
            continue;
        };
        let kept = r.kept.unwrap_or(0.0);
        // A run with a replica killed in it says so in its targets.
        let restarted = if r.restarts.is_empty() {
            ""
        } else {
            " (one restarted mid-run)"
        };
        c.push(Check {
            target: format!(
                "{}: {} replicas{restarted} keep >= 0.97x one router's hit rate",
                r.scenario, r.replicas
            ),
            measured: format!("{} vs {}", pct(r.hit_rate), pct(one.hit_rate)),
            met: kept >= 0.97,
            margin: format!("{kept:.3}x"),
        });
        let ratio = |a: f64, b: f64| a / b.max(1e-9);
        let (p50, p99) = (
            ratio(r.ttft_p50_ms, one.ttft_p50_ms),
            ratio(r.ttft_p99_ms, one.ttft_p99_ms),
        );
        c.push(Check {
            target: format!(
                "{}: {} replicas'{restarted} TTFT p50 and p99 <= 1.1x one router's",
                r.scenario, r.replicas
            ),
            measured: format!(
                "p50 {:.1} ms vs {:.1}, p99 {:.1} ms vs {:.1}",
                r.ttft_p50_ms, one.ttft_p50_ms, r.ttft_p99_ms, one.ttft_p99_ms
            ),
            met: p50 <= 1.1 && p99 <= 1.1,
            margin: format!("{p50:.2}x / {p99:.2}x"),
        });
    }
    for r in rows {
        for f in &r.restarts {
            let behind = f.points_behind();
            c.push(Check {
                    target: format!(
                        "{}: 1 of {} replicas restarted: its hit rate in the {:.0} s after /ready within 1 point of the others'",
                        r.scenario,
                        f.replicas,
                        crate::replicas::RESTART_WINDOW_S
                    ),
                    measured: format!(
                        "{} ({} requests) vs {} ({} requests); ready {:.2} s after the kill",
                        pct(f.restarted.hit_rate),
                        f.restarted.requests,
                        pct(f.others.hit_rate),
                        f.others.requests,
                        f.ready_after_s
                    ),
                    met: f.restarted.requests > 0 && behind <= 1.0,
                    margin: format!("{:+.1} points", -behind),
                });
        }
        if let Some(p) =
            crate::replicas::Paired::pooled(r.restarts.iter().filter_map(|f| f.paired.as_ref()))
        {
            let behind = p.points_behind();
            c.push(Check {
                target: format!(
                    "{}: 1 of {} replicas restarted: its requests in the {:.0} s after /ready within 1 point of the same requests in a run without the restart ({} runs pooled)",
                    r.scenario,
                    r.replicas,
                    crate::replicas::RESTART_WINDOW_S,
                    r.restarts.len()
                ),
                measured: format!(
                    "{} vs {} ({} requests)",
                    pct(p.restarted.hit_rate),
                    pct(p.unrestarted.hit_rate),
                    p.restarted.requests
                ),
                met: p.restarted.requests > 0 && behind <= 1.0,
                margin: format!("{:+.1} points", -behind),
            });
        }
    }
}

/// The replica killed and started again in each run that had one.
pub fn restarts_table(rows: &[QualityRow]) -> Table {
    let mut t = Table::new(&[
        "scenario",
        "replicas",
        "killed at s",
        "ready after s",
        "window s",
        "restarted: hit rate (requests)",
        "others: hit rate (requests)",
        "points behind",
        "before the kill: it · others · points behind",
        "same requests without the restart: with · without · points behind",
        "sent elsewhere",
        "failed",
    ]);
    for r in rows {
        for f in &r.restarts {
            let hits = |h: &crate::replicas::Hits| format!("{} ({})", pct(h.hit_rate), h.requests);
            t.row(vec![
                r.scenario.clone(),
                f.replicas.to_string(),
                format!("{:.1}", f.killed_at_s),
                format!("{:.3}", f.ready_after_s),
                format!("{:.1}", f.window_s),
                hits(&f.restarted),
                hits(&f.others),
                format!("{:+.1}", f.points_behind()),
                format!(
                    "{} · {} · {:+.1}",
                    hits(&f.before),
                    hits(&f.others_before),
                    f.points_behind_before()
                ),
                f.paired.map_or_else(
                    || "-".to_string(),
                    |p| {
                        format!(
                            "{} · {} · {:+.1}",
                            hits(&p.restarted),
                            hits(&p.unrestarted),
                            p.points_behind()
                        )
                    },
                ),
                f.rerouted.to_string(),
                f.failed.to_string(),
            ]);
        }
    }
    t
}

/// Each sharing replica's stream over each run: its rate and its bytes
/// per request.
pub fn bandwidth_table(rows: &[QualityRow]) -> Table {
    let mut t = Table::new(&[
        "scenario",
        "router",
        "replicas",
        "replica",
        "s",
        "requests",
        "messages/s",
        "bytes/s",
        "bytes/request",
        "bytes/s at 1,000 req/s",
        "outbox drops",
        "gaps",
    ]);
    for r in rows {
        for b in &r.bandwidth {
            let run = if r.runs > 1 {
                format!(" (run {})", b.run + 1)
            } else {
                String::new()
            };
            let again = if b.restarted {
                " (since its restart)"
            } else {
                ""
            };
            t.row(vec![
                r.scenario.clone(),
                r.policy.clone(),
                b.replicas.to_string(),
                format!("{}{again}{run}", b.replica + 1),
                format!("{:.1}", b.seconds),
                b.requests.to_string(),
                format!("{:.0}", b.messages_per_s()),
                format!("{:.0}", b.bytes_per_s()),
                format!("{:.0}", b.bytes_per_request()),
                format!("{:.0}", b.bytes_per_s_at_1000_rps()),
                b.outbox_dropped.to_string(),
                b.peer_gaps.to_string(),
            ]);
        }
    }
    t
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
    // A row run on several APIs is listed once.
    let mut listed: Vec<&str> = Vec::new();
    for s in &q.scenarios {
        if listed.contains(&s.name.as_str()) {
            continue;
        }
        listed.push(&s.name);
        t.row(vec![
            s.name.clone(),
            format!("{} x {}", s.drive.engines, s.kv_blocks),
            if s.hide_capacity {
                "not published"
            } else {
                "published"
            }
            .into(),
            drive_cell(s),
            format!("{}", s.think_s),
            format!("{:.0}", s.drive.duration_s),
            s.about.clone(),
        ]);
    }
    let _ = writeln!(m, "{}", t.markdown());
    let several = rows.iter().any(|r| r.replicas > 1);
    let apis = crate::apis::several(rows);
    let mut head = vec!["scenario", "router"];
    if apis {
        head.insert(1, "api");
    }
    if several {
        head.push("replicas");
    }
    head.extend([
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
    let mut t = Table::new(&head);
    for x in rows {
        let mut line = vec![x.scenario.clone(), x.policy.clone()];
        if apis {
            line.insert(1, x.api.to_string());
        }
        if several {
            line.push(x.replicas.to_string());
        }
        line.extend([
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
        t.row(line);
    }
    let _ = writeln!(m, "{}", t.markdown());
    let _ = writeln!(m, "### Cost per conversation\n");
    let _ = writeln!(m, "{}", cost_table(rows).markdown());
    let _ = writeln!(m, "{}\n", crate::cost::NOTE);
    if several {
        let _ = writeln!(m, "### Router replicas\n");
        let _ = writeln!(m, "{}\n", replicas_side_by_side(rows).markdown());
        let _ = writeln!(
            m,
            "Each router ran as 1 to N processes in front of the same engines; every request went to one of them at random (seeded, drawn per request: a conversation's turns land on different replicas, as behind an L4 balancer or a Kubernetes Service). Each cell: hit rate · TTFT p50 / p99 ms · kept = hit rate over the same router's with one replica. prefix-router's replicas share what they learn (`[replicas]`); `{}` runs them without sharing, each knowing only what it sent, and is kept against the sharing front's single replica.\n",
            crate::replicas::ALONE_SUFFIX
        );
    }
    if rows.iter().any(|r| !r.restarts.is_empty()) {
        let _ = writeln!(m, "### A replica killed and restarted\n");
        let _ = writeln!(m, "{}\n", restarts_table(rows).markdown());
        let _ = writeln!(
            m,
            "In each run of prefix-router's sharing replicas, the last replica was killed (SIGKILL) {} s into the run and started again at once on the same ports and config; it caught up from a peer's snapshot before its admin `/ready` answered 200. The load generator's balancer acts as a Kubernetes Service with a readiness probe: it takes the replica out the moment it is killed, sends the requests drawn for it to the next replica meanwhile (sent elsewhere), and puts it back the moment `/ready` answers 200 and its listener accepts. Requests in flight on it when it was killed fail (failed). Its hit rate is over the requests it served that started in the {:.0} s after it was ready; the others' over theirs in the same window (cut short by the run's end: window s); before the kill, its own and the others' over the same length of time before it (how far apart the two are over so short a window anyway). Points behind = the others' hit rate less its own.\n",
            q.restart_at_s.unwrap_or_default(),
            crate::replicas::RESTART_WINDOW_S
        );
    }
    if rows.iter().any(|r| !r.bandwidth.is_empty()) {
        let _ = writeln!(m, "### Replica stream bandwidth\n");
        let _ = writeln!(m, "{}\n", bandwidth_table(rows).markdown());
        let _ = writeln!(
            m,
            "What each sharing replica published on its stream from the traffic's start to its end (`published_bytes` and `published_messages` of its `/admin/replicas`, read before it was stopped; a restarted replica from its restart): its decisions, each request's first byte and end, the engines it found flushed, what answers taught of their engines, its load every 10 ms while it changes or it decided (at least every 100 ms) and its connections when they change (at least every second). Bytes are counted once per frame; each of its N-1 peers receives a copy. Bytes/request = its bytes over the requests it served; bytes/s at 1,000 req/s = bytes/request x 1,000 / N, the fleet serving 1,000 requests/s spread evenly (the load messages scale with it here, so this overstates; `prefix-bench replicas-bandwidth` measures it directly). Gaps = messages it missed of its peers' streams.\n"
        );
    }
    let single: Vec<QualityRow> = rows.iter().filter(|r| r.replicas == 1).cloned().collect();
    if single.iter().any(|r| r.peer) {
        let _ = writeln!(m, "### Against the peer routers\n");
        let _ = writeln!(m, "{}\n", side_by_side(&single).markdown());
        let _ = writeln!(
            m,
            "Each cell: hit rate · TTFT p50 / p99 ms · max/mean load.\n\n{PEERS_NOTE}\n"
        );
    }
    m.push_str(&crate::apis::markdown(rows));
    m.push_str(&crate::tenants::report::markdown(rows));
    m
}

/// What a conversation cost under each router on each scenario, against
/// round-robin's row on the same scenario (at the same replica count, else
/// its one-replica row).
pub fn cost_table(rows: &[QualityRow]) -> Table {
    let several = rows.iter().any(|r| r.replicas > 1);
    let mut lead = vec!["scenario", "router"];
    if several {
        lead.push("replicas");
    }
    let mut t = crate::cost::table(&lead);
    for x in rows {
        let base = rows
            .iter()
            .filter(|b| b.scenario == x.scenario && b.policy == crate::cost::BASELINE)
            .min_by_key(|b| (b.replicas != x.replicas, b.replicas))
            .map(QualityRow::figures);
        let mut line = vec![x.scenario.clone(), x.policy.clone()];
        if several {
            line.push(x.replicas.to_string());
        }
        line.extend(crate::cost::cells(&x.figures(), base.as_ref()));
        t.row(line);
    }
    t
}

/// How a row is driven, for the scenarios' table: users, or the open
/// loop's arrivals, and the workload beside it.
fn drive_cell(s: &crate::scenarios::QualityScenario) -> String {
    let one = |s: &crate::scenarios::QualityScenario| match s.drive.arrivals_per_s {
        Some(r) => format!("open loop, {r:.2} arrivals per simulated s"),
        None => s.drive.users.to_string(),
    };
    match &s.alongside {
        Some(b) => format!("{} + {}", one(s), one(b)),
        None => one(s),
    }
}

/// Scenarios and replica counts down, routers across: hit rate, TTFT
/// p50/p99, kept.
pub fn replicas_side_by_side(rows: &[QualityRow]) -> Table {
    let mut routers: Vec<&str> = Vec::new();
    let mut lines: Vec<(&str, usize)> = Vec::new();
    for r in rows {
        if !routers.contains(&r.policy.as_str()) {
            routers.push(&r.policy);
        }
        if !lines.contains(&(r.scenario.as_str(), r.replicas)) {
            lines.push((&r.scenario, r.replicas));
        }
    }
    // Each scenario's lines together, by replica count, in the order run.
    let order: Vec<&str> = lines.iter().map(|l| l.0).fold(Vec::new(), |mut v, s| {
        if !v.contains(&s) {
            v.push(s);
        }
        v
    });
    lines.sort_by_key(|&(sc, n)| (order.iter().position(|s| *s == sc), n));
    let mut head = vec!["scenario", "replicas"];
    head.extend(routers.iter().copied());
    let mut t = Table::new(&head);
    for (sc, n) in lines {
        let mut line = vec![sc.to_string(), n.to_string()];
        for p in &routers {
            line.push(
                rows.iter()
                    .find(|r| r.scenario == sc && r.policy == *p && r.replicas == n)
                    .map_or("-".into(), |r| {
                        let kept = r.kept.map_or(String::new(), |k| format!(" · {k:.2}x"));
                        format!(
                            "{} · {:.0} / {:.0}{kept}",
                            pct(r.hit_rate),
                            r.ttft_p50_ms,
                            r.ttft_p99_ms
                        )
                    }),
            );
        }
        t.row(line);
    }
    t
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
