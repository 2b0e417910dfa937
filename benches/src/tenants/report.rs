//! The tenant rows in the quality report: the small tenant's figures
//! beside its figures alone, the report's section and its target.

use super::{ALONE, BIG_NAME, P99_OVER_ALONE, SMALL_NAME, TOGETHER};
use crate::quality::QualityRow;
use crate::scenarios::{BIG_TENANT, SMALL_TENANT};
use crate::table::{Check, Table};
use std::fmt::Write as _;

/// The small tenant alone, for a row with both under `r`'s router: the
/// alone row of the same router, else of its policy without a config file
/// (one tenant alone never fills the fleet, so the file changes nothing
/// there), else the first alone row.
pub fn alone_for<'a>(rows: &'a [QualityRow], r: &QualityRow) -> Option<&'a QualityRow> {
    let alone = |p: Option<&str>| {
        rows.iter().find(|a| {
            a.scenario == ALONE
                && a.replicas == r.replicas
                && a.tenants.is_some()
                && p.is_none_or(|p| a.policy == p)
        })
    };
    let base = r.policy.split(crate::quality::CONFIG_SEPARATOR).next();
    alone(Some(&r.policy))
        .or_else(|| alone(base))
        .or_else(|| alone(None))
}

/// Each tenant row's split, the small tenant beside its figures alone.
pub fn table(rows: &[QualityRow]) -> Table {
    let mut t = Table::new(&[
        "scenario",
        "router",
        "small: answered (refused)",
        "small: TTFT p50 / p99 ms",
        "alone: p50 / p99 ms",
        "p99 over alone",
        "mean wait in the router ms: small / big",
        "big: sent",
        "big: answered",
        "big: refused",
        "failed",
    ]);
    for r in rows {
        let Some(f) = &r.tenants else { continue };
        let alone = (r.scenario != ALONE)
            .then(|| alone_for(rows, r))
            .flatten()
            .and_then(|a| a.tenants.as_ref());
        let big = |n: u64| {
            if f.big_sent == 0 {
                "-".to_string()
            } else {
                n.to_string()
            }
        };
        t.row(vec![
            r.scenario.clone(),
            r.policy.clone(),
            format!("{} ({})", f.small_answered, f.small_refused),
            format!("{:.1} / {:.1}", f.small_ttft_p50_ms, f.small_ttft_p99_ms),
            alone.map_or("-".into(), |a| {
                format!("{:.1} / {:.1}", a.small_ttft_p50_ms, a.small_ttft_p99_ms)
            }),
            alone.map_or("-".into(), |a| format!("{:.2}x", f.p99_over(a))),
            format!(
                "{} / {}",
                f.waits.small_ms.map_or("-".into(), |w| format!("{w:.1}")),
                f.waits.big_ms.map_or("-".into(), |w| format!("{w:.1}"))
            ),
            big(f.big_sent),
            big(f.big_answered),
            big(f.big_refused),
            f.failed.to_string(),
        ]);
    }
    t
}

/// The report's section on the tenant rows (empty when none ran).
pub fn markdown(rows: &[QualityRow]) -> String {
    let mut m = String::new();
    if !rows.iter().any(|r| r.tenants.is_some()) {
        return m;
    }
    let _ = writeln!(m, "### Two tenants of one class\n");
    let _ = writeln!(m, "{}\n", table(rows).markdown());
    let _ = writeln!(
        m,
        "The small tenant's requests (`user` {SMALL_TENANT}) split from the big one's (`user` {BIG_TENANT}) by the `user` each was sent as; TTFT over the small tenant's answered requests; alone = the same router's `{ALONE}` row (else the same policy's without a config file). Mean wait in the router: each tenant's time waiting in prefix-router for room, by its `prefix_router_class_wait_seconds` (tenants `{SMALL_NAME}` and `{BIG_NAME}` of `benches/configs/tenants.toml`; `-`: none waited); the rest of a TTFT is the engine's. Refused = answered 429 or 503 (with Retry-After); failed = no answer or another status.\n"
    );
    m
}

/// On every `capped-tenants` row of one of prefix-router's fronts with
/// an alone row to compare: the small tenant's TTFT p99 beside the big
/// one at most [`P99_OVER_ALONE`] times its p99 alone.
pub fn check_targets(rows: &[QualityRow], c: &mut Vec<Check>) {
    for r in rows.iter().filter(|r| r.scenario == TOGETHER && !r.peer) {
        let (Some(f), Some(a)) = (
            r.tenants.as_ref(),
            alone_for(rows, r).and_then(|a| a.tenants.as_ref()),
        ) else {
            continue;
        };
        let ratio = f.p99_over(a);
        c.push(Check {
            target: format!(
                "{TOGETHER} ({}): small tenant's TTFT p99 with the big one <= {P99_OVER_ALONE}x alone",
                r.policy
            ),
            measured: format!(
                "{:.1} ms vs {:.1} ms alone (p50 {:.1} vs {:.1}); big tenant {} answered, {} refused",
                f.small_ttft_p99_ms,
                a.small_ttft_p99_ms,
                f.small_ttft_p50_ms,
                a.small_ttft_p50_ms,
                f.big_answered,
                f.big_refused
            ),
            met: f.small_answered > 0 && ratio <= P99_OVER_ALONE,
            margin: format!("{ratio:.2}x"),
        });
    }
}

#[cfg(test)]
mod tests;
