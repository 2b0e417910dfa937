//! The quality bench across inference APIs (`--api`): each row's
//! conversations sent as chat completions, as Anthropic Messages, as OpenAI
//! Responses carrying the whole conversation, and as Responses chained by
//! `previous_response_id` ([`testkit::workload::Api`]), each under each
//! router on a fresh fleet with the same seed. The conversations and the
//! prompts the engines render are the same on every API, so the hit rates
//! compare directly. The report sets the APIs side by side; the targets:
//! through prefix-router, every API's hit rate within [`WITHIN_POINTS`] of
//! the chat's, and at least [`ABOVE_ROUND_ROBIN_POINTS`] above
//! round-robin's on the same API.

use crate::quality::QualityRow;
use crate::scenarios::QualityScenario;
use crate::table::{Check, Table, pct};
use std::fmt::Write as _;
use testkit::workload::Api;

/// How far another API's hit rate through prefix-router may fall below the
/// chat's on the same row, in points: the router reads every API into the
/// chat's blocks, so what is left is run-to-run noise.
pub const WITHIN_POINTS: f64 = 1.0;

/// How far prefix-router's hit rate must be above round-robin's on the
/// same API, in points ("far above"): on the chats with think time the
/// chat's margin is about 20 points.
pub const ABOVE_ROUND_ROBIN_POINTS: f64 = 10.0;

/// Each row once per API of `apis`, a row's APIs one after the other (the
/// rows as they are when `apis` is empty).
pub fn per_api(rows: Vec<QualityScenario>, apis: &[Api]) -> Vec<QualityScenario> {
    if apis.is_empty() {
        return rows;
    }
    rows.into_iter()
        .flat_map(|qs| {
            apis.iter().map(move |&api| {
                let mut q = qs.clone();
                q.api = api;
                if let Some(side) = &mut q.alongside {
                    side.api = api;
                }
                q
            })
        })
        .collect()
}

/// Whether rows of more than one API ran.
pub fn several(rows: &[QualityRow]) -> bool {
    rows.first()
        .is_some_and(|first| rows.iter().any(|r| r.api != first.api))
}

/// The row of `api` beside `r`: the same scenario, router and replicas.
fn beside<'a>(rows: &'a [QualityRow], r: &QualityRow, api: Api) -> Option<&'a QualityRow> {
    rows.iter().find(|b| {
        b.scenario == r.scenario && b.policy == r.policy && b.replicas == r.replicas && b.api == api
    })
}

/// Scenarios and routers down, APIs across: hit rate (points against the
/// chat's), TTFT p50 / p99 ms, errors when there were any.
pub fn side_by_side(rows: &[QualityRow]) -> Table {
    let apis: Vec<Api> = Api::ALL
        .into_iter()
        .filter(|a| rows.iter().any(|r| r.api == *a))
        .collect();
    let replicas = rows.iter().any(|r| r.replicas != 1);
    let mut lines: Vec<&QualityRow> = Vec::new();
    for r in rows {
        if !lines
            .iter()
            .any(|l| l.scenario == r.scenario && l.policy == r.policy && l.replicas == r.replicas)
        {
            lines.push(r);
        }
    }
    let mut head = vec!["scenario", "router"];
    if replicas {
        head.push("replicas");
    }
    head.extend(apis.iter().map(|a| a.name()));
    let mut t = Table::new(&head);
    for l in lines {
        let mut line = vec![l.scenario.clone(), l.policy.clone()];
        if replicas {
            line.push(l.replicas.to_string());
        }
        let chat = beside(rows, l, Api::Chat);
        for &api in &apis {
            line.push(beside(rows, l, api).map_or("-".into(), |r| {
                let against = match chat {
                    Some(c) if api != Api::Chat => {
                        format!(" ({:+.1})", (r.hit_rate - c.hit_rate) * 100.0)
                    }
                    _ => String::new(),
                };
                let errors = match r.errors {
                    0 => String::new(),
                    n => format!(" · {n} err"),
                };
                format!(
                    "{}{against} · {:.0} / {:.0}{errors}",
                    pct(r.hit_rate),
                    r.ttft_p50_ms,
                    r.ttft_p99_ms
                )
            }));
        }
        t.row(line);
    }
    t
}

/// The report's section: the APIs side by side (nothing when one API ran).
pub fn markdown(rows: &[QualityRow]) -> String {
    let mut m = String::new();
    if !several(rows) {
        return m;
    }
    let _ = writeln!(m, "### The same conversations on each API\n");
    let _ = writeln!(m, "{}", side_by_side(rows).markdown());
    let _ = writeln!(
        m,
        "Each cell: hit rate (points against the chat's on the same router) · TTFT p50 / p99 ms. The same conversations (same seed) sent as `chat` completions; `messages`: Anthropic's `/v1/messages`, the system prompt as `system`, the history as `messages`, the usage read as `input_tokens + cache_read_input_tokens + cache_creation_input_tokens` with `cache_read_input_tokens` cached; `responses`: OpenAI's `/v1/responses` with the whole conversation each turn (`instructions` and `input`, `store: false`); `responses-chained`: the first turn stored, each later one only the new message with `previous_response_id`, which the router pins to the engine that stored the previous answer, whatever the policy (round-robin places only first turns there). Every API's requests render to the chat's prompt tokens on the engines; TTFT is the first streamed event carrying text.\n"
    );
    m
}

/// Through prefix-router, on each row that ran one replica: every API's
/// hit rate within [`WITHIN_POINTS`] of the chat's, and at least
/// [`ABOVE_ROUND_ROBIN_POINTS`] above round-robin's on the same API.
pub fn check_targets(rows: &[QualityRow], c: &mut Vec<Check>) {
    if !several(rows) {
        return;
    }
    for r in rows
        .iter()
        .filter(|r| r.policy == "prefix" && r.replicas == 1)
    {
        if let (Some(chat), true) = (beside(rows, r, Api::Chat), r.api != Api::Chat) {
            let d = (r.hit_rate - chat.hit_rate) * 100.0;
            c.push(Check {
                target: format!(
                    "{}: {} hit rate within {WITHIN_POINTS} point of the chat's",
                    r.scenario, r.api
                ),
                measured: format!("{} vs {}", pct(r.hit_rate), pct(chat.hit_rate)),
                met: d >= -WITHIN_POINTS,
                margin: format!("{d:+.1} points"),
            });
        }
        let round_robin = rows.iter().find(|b| {
            b.scenario == r.scenario
                && b.api == r.api
                && b.replicas == 1
                && b.policy == "round-robin"
        });
        if let Some(rr) = round_robin {
            let d = (r.hit_rate - rr.hit_rate) * 100.0;
            c.push(Check {
                target: format!(
                    "{}: {} hit rate >= round-robin's on {} + {ABOVE_ROUND_ROBIN_POINTS} points",
                    r.scenario, r.api, r.api
                ),
                measured: format!("{} vs {}", pct(r.hit_rate), pct(rr.hit_rate)),
                met: d >= ABOVE_ROUND_ROBIN_POINTS,
                margin: format!("{d:+.1} points"),
            });
        }
    }
}

#[cfg(test)]
mod tests;
