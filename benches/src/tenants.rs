//! Two tenants of one class on the capped engines: the small tenant's TTFT
//! alone (`capped-tenant-alone`) and beside a big tenant sending ten times
//! as much (`capped-tenants`), and what became of the big one's requests.
//! Each request is told apart by the `user` it was sent as
//! (`Record::tenant`, [`crate::scenarios::SMALL_TENANT`] and
//! [`crate::scenarios::BIG_TENANT`]).

use crate::scenarios::{BIG_TENANT, SMALL_TENANT};
use serde::{Deserialize, Serialize};
use testkit::workload::{Percentiles, Record};

/// The row with the small tenant alone, and the row with both.
pub const ALONE: &str = "capped-tenant-alone";
pub const TOGETHER: &str = "capped-tenants";

/// The target: the small tenant's TTFT p99 beside the big one at most
/// this many times its p99 alone.
pub const P99_OVER_ALONE: f64 = 1.25;

/// One run's requests split by tenant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TenantFigures {
    /// The small tenant's requests answered, and their TTFT.
    pub small_answered: u64,
    pub small_ttft_p50_ms: f64,
    pub small_ttft_p99_ms: f64,
    /// The small tenant's requests refused (429 or 503).
    pub small_refused: u64,
    /// The big tenant's requests sent (0: it did not run), answered, and
    /// refused (429 or 503: its wait in the router over, or too many of
    /// its requests waiting already).
    pub big_sent: u64,
    pub big_answered: u64,
    pub big_refused: u64,
    /// Either tenant's requests that failed otherwise (no answer, another
    /// status).
    pub failed: u64,
    /// How long each tenant's requests waited in prefix-router for room,
    /// by its own count (none: no tenants configured, or another router).
    #[serde(default)]
    pub waits: RouterWaits,
}

/// The mean wait in the router of the tenants `benches/configs/tenants.toml`
/// names [`SMALL_NAME`] and [`BIG_NAME`], in ms, from its
/// `prefix_router_class_wait_seconds` (`None`: none of theirs waited).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RouterWaits {
    pub small_ms: Option<f64>,
    pub big_ms: Option<f64>,
}

/// The tenants' names in `benches/configs/tenants.toml`.
pub const SMALL_NAME: &str = "small";
pub const BIG_NAME: &str = "big";

impl RouterWaits {
    /// Reads the means from a router's `/metrics` text.
    pub fn parse(metrics: &str) -> RouterWaits {
        let mean = |tenant: &str| {
            let label = format!("tenant=\"{tenant}\"");
            let value = |suffix: &str| {
                let name = format!("prefix_router_class_wait_seconds{suffix}{{");
                metrics
                    .lines()
                    .filter(|l| l.starts_with(&name) && l.contains(&label))
                    .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                    .sum::<f64>()
            };
            let (sum, count) = (value("_sum"), value("_count"));
            (count > 0.0).then(|| sum / count * 1e3)
        };
        RouterWaits {
            small_ms: mean(SMALL_NAME),
            big_ms: mean(BIG_NAME),
        }
    }
}

/// An answer that says "not now": the router's 429 and 503 (both with
/// Retry-After).
fn refused(r: &Record) -> bool {
    matches!(r.status, 429 | 503)
}

impl TenantFigures {
    /// The split of a run's records; `None` when no request was the
    /// small tenant's (another row).
    pub fn of(records: &[Record], waits: RouterWaits) -> Option<TenantFigures> {
        let of = |t: &'static str| {
            records
                .iter()
                .filter(move |r| r.tenant.as_deref() == Some(t))
        };
        of(SMALL_TENANT).next()?;
        let ttft = Percentiles::of(
            of(SMALL_TENANT)
                .filter(|r| r.ok())
                .filter_map(|r| r.ttft_ms)
                .collect(),
        );
        let count = |t: &'static str, f: fn(&Record) -> bool| of(t).filter(|r| f(r)).count() as u64;
        Some(TenantFigures {
            small_answered: count(SMALL_TENANT, Record::ok),
            small_ttft_p50_ms: ttft.p50,
            small_ttft_p99_ms: ttft.p99,
            small_refused: count(SMALL_TENANT, refused),
            big_sent: of(BIG_TENANT).count() as u64,
            big_answered: count(BIG_TENANT, Record::ok),
            big_refused: count(BIG_TENANT, refused),
            failed: [SMALL_TENANT, BIG_TENANT]
                .iter()
                .map(|t| count(t, |r| !r.ok() && !refused(r)))
                .sum(),
            waits,
        })
    }

    /// Repeated runs as one: TTFTs are the medians of the runs', counts
    /// their sums (as the rows' requests).
    pub fn median(runs: &[TenantFigures]) -> Option<TenantFigures> {
        runs.first()?;
        let m = |f: fn(&TenantFigures) -> f64| crate::table::median(runs.iter().map(f).collect());
        let sum = |f: fn(&TenantFigures) -> u64| runs.iter().map(f).sum();
        let m_opt = |f: fn(&TenantFigures) -> Option<f64>| {
            let v: Vec<f64> = runs.iter().filter_map(f).collect();
            (!v.is_empty()).then(|| crate::table::median(v))
        };
        Some(TenantFigures {
            small_answered: sum(|t| t.small_answered),
            small_ttft_p50_ms: m(|t| t.small_ttft_p50_ms),
            small_ttft_p99_ms: m(|t| t.small_ttft_p99_ms),
            small_refused: sum(|t| t.small_refused),
            big_sent: sum(|t| t.big_sent),
            big_answered: sum(|t| t.big_answered),
            big_refused: sum(|t| t.big_refused),
            failed: sum(|t| t.failed),
            waits: RouterWaits {
                small_ms: m_opt(|t| t.waits.small_ms),
                big_ms: m_opt(|t| t.waits.big_ms),
            },
        })
    }

    /// The small tenant's TTFT p99 here over its p99 in `alone`.
    pub fn p99_over(&self, alone: &TenantFigures) -> f64 {
        self.small_ttft_p99_ms / alone.small_ttft_p99_ms.max(1e-9)
    }
}

pub mod report;

#[cfg(test)]
mod tests;
