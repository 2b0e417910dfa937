//! The router end to end with real processes: a `prefix-router` in front of
//! several `sim-engine`s, driven by the workload generator. What a user of
//! the router would notice: cache hits, sticky conversations, spread load.

use std::collections::HashMap;

use testkit::engine_proc::SimEngine;
use testkit::router_proc::Router;
use testkit::workload::{RunConfig, Scenario, ScenarioKind, Summary, run_blocking};

fn urls(engines: &[SimEngine]) -> Vec<String> {
    engines.iter().map(SimEngine::url).collect()
}

fn run(
    router: &Router,
    scenario: Scenario,
    users: usize,
    requests: u64,
) -> (Vec<testkit::workload::Record>, Summary) {
    let mut cfg = RunConfig::new(router.url(), scenario);
    cfg.users = users;
    cfg.requests = Some(requests);
    cfg.seed = 7;
    run_blocking(cfg).expect("workload run")
}

#[test]
fn conversations_stay_on_their_backend() {
    // Zero-cost engines: load stays low, so nothing should move a conversation.
    let e = SimEngine::fleet(3, &["--time-scale", "0"]);
    // Debug headers: the records name the engine that answered.
    let r = Router::spawn(&urls(&e), &["--debug-headers"], "");
    r.wait_models_known();
    let (records, s) = run(&r, Scenario::new(ScenarioKind::Chat), 6, 90);
    assert_eq!(s.ok, 90, "{s}");
    let mut by_session: HashMap<u64, Vec<String>> = HashMap::new();
    for rec in &records {
        by_session
            .entry(rec.session)
            .or_default()
            .push(rec.instance.clone().unwrap_or_default());
    }
    let multi_turn: Vec<_> = by_session.values().filter(|v| v.len() > 1).collect();
    assert!(
        multi_turn.len() >= 5,
        "too few multi-turn sessions: {}",
        multi_turn.len()
    );
    let moved: usize = multi_turn
        .iter()
        .map(|v| v.windows(2).filter(|w| w[0] != w[1]).count())
        .sum();
    let turns: usize = multi_turn.iter().map(|v| v.len() - 1).sum();
    assert!(
        moved * 10 <= turns,
        "{moved} of {turns} follow-up turns changed backend"
    );
    assert!(
        s.per_instance.len() >= 2,
        "conversations spread over engines: {:?}",
        s.per_instance
    );
}

/// Engines whose caches cannot hold every conversation: the prefix policy
/// keeps each conversation where its history is, round-robin scatters them.
///
/// Medians of five prefix runs: at this pressure (6 system prompts on 4
/// engines of 400 blocks, engines 500x faster than a GPU) single runs
/// scatter by several points. The TTFT policy (decision 0016) keeps a
/// conversation with its history, and a system prompt with its engine,
/// over a moderate imbalance, so the request count per engine follows the
/// random prompt mix (6 prompts on 4 engines alone give 1.33) up to the
/// policy's in-flight cap (1.5x the mean plus slack, 2.5x once the caches
/// are full). CI runs measured 1.55-1.80 per run (medians 1.62 and 1.77),
/// 1.08-1.28 with the full-cache bounds (decision 0020); the bound of 2.0 is what
/// "never piles onto one engine" means here: everything on one would be
/// 4.0, and round-robin gives 1.0.
#[test]
fn prefix_hit_rate_is_near_the_ceiling_and_far_above_round_robin() {
    let engine_args = ["--time-scale", "0.002", "--kv-blocks", "400"];
    let mut scenario = Scenario::new(ScenarioKind::Chat);
    scenario.prefixes = 6;
    let once = |policy: &str| {
        let e = SimEngine::fleet(4, &engine_args);
        let r = Router::spawn(&urls(&e), &["--policy", policy, "--debug-headers"], "");
        let (_, s) = run(&r, scenario.clone(), 16, 240);
        assert_eq!(s.ok, 240, "{policy}: {s}");
        if policy == "prefix" {
            // Caches this small fill within the run: the prefix policy
            // routes at the full-cache bounds, and says so.
            let m = r.metrics();
            let full = m
                .lines()
                .find_map(|l| l.strip_prefix("prefix_router_full_cache_routes_total "))
                .and_then(|v| v.trim().parse::<f64>().ok());
            assert!(full.is_some_and(|n| n > 0.0), "full-cache routes {full:?}");
        }
        s
    };
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let runs: Vec<Summary> = (0..5).map(|_| once("prefix")).collect();
    let rr = once("round-robin");
    let hit = median(runs.iter().map(|s| s.hit_rate).collect());
    let ceiling = median(runs.iter().map(|s| s.ceiling_hit_rate).collect());
    let load = median(runs.iter().map(|s| s.load_max_mean_ratio).collect());
    for s in &runs {
        println!("prefix: {s}");
    }
    println!("round-robin: {rr}");
    assert!(
        hit >= 0.85 * ceiling,
        "prefix hit rate {hit:.3} (median) vs ceiling {ceiling:.3}"
    );
    assert!(
        hit >= rr.hit_rate + 0.15,
        "prefix {hit:.3} (median) vs round-robin {:.3}",
        rr.hit_rate
    );
    assert!(load <= 2.0, "prefix load max/mean {load:.2} (median)");
}

/// Every request shares one system prompt: the load bound spreads it over
/// every replica instead of piling it onto the first that cached it. The
/// load is judged on the median of three runs: single runs of 240 requests
/// scatter by a tenth.
#[test]
fn a_hot_system_prompt_is_spread_within_the_load_bound() {
    let mut scenario = Scenario::new(ScenarioKind::HotPrefix);
    scenario.prefixes = 1;
    scenario.hot_fraction = 1.0;
    let runs: Vec<Summary> = (0..3)
        .map(|_| {
            // Real-time-ish engines so requests overlap and load is visible.
            let e = SimEngine::fleet(4, &["--time-scale", "0.05"]);
            let r = Router::spawn(&urls(&e), &["--debug-headers"], "");
            let (_, s) = run(&r, scenario.clone(), 24, 240);
            assert_eq!(s.ok, 240, "{s}");
            assert_eq!(
                s.per_instance.len(),
                4,
                "every engine takes a share: {:?}",
                s.per_instance
            );
            assert!(
                s.hit_rate >= 0.5 * s.ceiling_hit_rate,
                "replicas still hit the shared prompt: {s}"
            );
            s
        })
        .collect();
    let mut loads: Vec<f64> = runs.iter().map(|s| s.load_max_mean_ratio).collect();
    loads.sort_by(f64::total_cmp);
    println!("hot prompt: max/mean load per run {loads:?}");
    // The router promises the safety cap (the engines' caches have room,
    // so not the full-cache one): no engine at or above 1.5 times the mean
    // in flight plus 2, here (1.5 * 6 + 2) / 6 = 1.83 times the
    // mean; an engine's share of the requests follows its share in flight.
    // Medians of 11 runs here: 1.17-1.57; CI's machine gave 1.77 (runs of
    // 1.67-1.78). Piling onto one engine is 4.0.
    assert!(
        loads[1] <= 2.0,
        "max/mean load {:.2} (median of {loads:?})",
        loads[1]
    );
}
