//! What a conversation costs the fleet, and what a router saves against
//! round-robin on the same traffic.
//!
//! Cost is the engines' own count of their work over the run (the prompt
//! tokens they computed rather than served from their prefix caches, and
//! their busy time in the timing model's GPU seconds), divided by the
//! conversations served ([`testkit::workload::Summary::conversations`]: a
//! conversation the run's end cut short counts as the share of its turns
//! answered). Savings and TTFT changes are against round-robin's row on
//! the same scenario, because every router there sent the same
//! conversations (same seed).

use crate::engine_metrics::Work;
use crate::table::Table;
pub use crate::table::{less, percent, signed};
use serde::{Deserialize, Serialize};

/// The name of the run every other is set against.
pub const BASELINE: &str = "round-robin";

/// A run's cost per conversation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Cost {
    /// Conversations served.
    pub conversations: f64,
    /// Prompt tokens the engines computed (not cached), per conversation.
    pub computed_tokens: f64,
    /// The engines' busy seconds (simulated GPU time, all engines), per
    /// conversation.
    pub busy_s: f64,
    /// The prefill part of `busy_s`.
    pub prefill_s: f64,
}

impl Cost {
    /// The fleet's `work` spread over `conversations`; `None` when none
    /// was served.
    pub fn of(work: &Work, conversations: f64) -> Option<Cost> {
        (conversations > 0.0).then(|| Cost {
            conversations,
            computed_tokens: work.computed_tokens() as f64 / conversations,
            busy_s: work.busy_s / conversations,
            prefill_s: work.prefill_s / conversations,
        })
    }
}

/// One router against the baseline: savings (positive: cheaper) and TTFT
/// changes (negative: sooner), as shares.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Versus {
    pub tokens_saving: Option<f64>,
    pub busy_saving: Option<f64>,
    pub ttft_p50: Option<f64>,
    pub ttft_p90: Option<f64>,
}

/// What `x` saves against `base`: `1 - x / base` (`None` without a base).
pub fn saving(x: f64, base: f64) -> Option<f64> {
    (base > 0.0).then(|| 1.0 - x / base)
}

/// How `x` changed against `base`: `x / base - 1`.
pub fn change(x: f64, base: f64) -> Option<f64> {
    (base > 0.0).then(|| x / base - 1.0)
}

/// The figures of one row the cost table needs.
#[derive(Clone, Copy, Debug, Default)]
pub struct Figures {
    pub cost: Option<Cost>,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
}

impl Figures {
    pub fn versus(&self, base: &Figures) -> Versus {
        let both = self.cost.zip(base.cost);
        Versus {
            tokens_saving: both.and_then(|(c, b)| saving(c.computed_tokens, b.computed_tokens)),
            busy_saving: both.and_then(|(c, b)| saving(c.busy_s, b.busy_s)),
            ttft_p50: change(self.ttft_p50_ms, base.ttft_p50_ms),
            ttft_p90: change(self.ttft_p90_ms, base.ttft_p90_ms),
        }
    }
}

/// The cost columns' heads, after the row's own leading columns.
pub const HEAD: [&str; 8] = [
    "conversations",
    "prompt tok computed / conv",
    "saving vs RR",
    "engine GPU s / conv",
    "saving vs RR",
    "TTFT p50 vs RR",
    "TTFT p90 vs RR",
    "prefill GPU s / conv",
];

/// The cost cells of `row` against `base` (the baseline's own row too:
/// its savings are 0%).
pub fn cells(row: &Figures, base: Option<&Figures>) -> Vec<String> {
    let v = base.map(|b| row.versus(b)).unwrap_or_default();
    let c = row.cost;
    vec![
        c.map_or("-".into(), |c| format!("{:.1}", c.conversations)),
        c.map_or("-".into(), |c| format!("{:.0}", c.computed_tokens)),
        percent(v.tokens_saving),
        c.map_or("-".into(), |c| format!("{:.2}", c.busy_s)),
        percent(v.busy_saving),
        signed(v.ttft_p50),
        signed(v.ttft_p90),
        c.map_or("-".into(), |c| format!("{:.2}", c.prefill_s)),
    ]
}

/// A table with `lead` columns first, then the cost columns.
pub fn table(lead: &[&str]) -> Table {
    let mut head = lead.to_vec();
    head.extend(HEAD);
    Table::new(&head)
}

/// What the cost columns mean, said under every table that has them.
pub const NOTE: &str = "Cost per conversation: the engines' own counters over the run (`vllm:prompt_tokens_total` less `vllm:prefix_cache_hits_total`: prompt tokens computed rather than served from a prefix cache; `sim_engine_busy_seconds_total`: the engines' busy time in the timing model's GPU seconds, every step's duration before the time scale, all engines together; its prefill part beside it) over the conversations served (each conversation's answered turns over its turns: one the run's end cut short counts as that share of one). Saving vs RR = 1 - cost / round-robin's on the same traffic; TTFT vs RR = the percentile / round-robin's - 1 (negative: sooner).";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn savings_are_against_the_baseline_and_signed() {
        let work = Work {
            requests: 40,
            prompt_tokens: 10_000,
            cached_tokens: 6_000,
            busy_s: 8.0,
            prefill_s: 2.0,
        };
        let c = Cost::of(&work, 4.0).unwrap();
        assert_eq!(
            (c.computed_tokens, c.busy_s, c.prefill_s),
            (1000.0, 2.0, 0.5)
        );
        assert_eq!(Cost::of(&work, 0.0), None);
        let rr = Figures {
            cost: Some(Cost {
                computed_tokens: 2000.0,
                busy_s: 2.5,
                ..c
            }),
            ttft_p50_ms: 20.0,
            ttft_p90_ms: 40.0,
        };
        let ours = Figures {
            cost: Some(c),
            ttft_p50_ms: 10.0,
            ttft_p90_ms: 50.0,
        };
        let v = ours.versus(&rr);
        assert_eq!(v.tokens_saving, Some(0.5));
        assert!((v.busy_saving.unwrap() - 0.2).abs() < 1e-12);
        assert_eq!((v.ttft_p50, v.ttft_p90), (Some(-0.5), Some(0.25)));
        let cells = cells(&ours, Some(&rr));
        assert_eq!(
            cells,
            ["4.0", "1000", "50%", "2.00", "20%", "-50%", "+25%", "0.50"]
        );
        assert_eq!(cells.len(), HEAD.len());
        assert_eq!(super::cells(&ours, None)[2], "-");
        assert_eq!(percent(Some(-0.004)), "0%");
        assert_eq!(signed(Some(-0.004)), "0%");
        assert_eq!(less(Some(-0.05)), "5% more");
        assert_eq!(less(Some(0.38)), "38% less");
    }
}
