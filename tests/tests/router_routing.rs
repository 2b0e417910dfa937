//! The router end to end with real processes: a `prefix-router` in front of
//! several `sim-engine`s, driven by the workload generator. What a user of
//! the router would notice: cache hits, sticky conversations, spread load.

use std::collections::{BTreeMap, HashMap};

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
#[test]
fn prefix_hit_rate_is_near_the_ceiling_and_far_above_round_robin() {
    let engine_args = ["--time-scale", "0.002", "--kv-blocks", "400"];
    let mut scenario = Scenario::new(ScenarioKind::Chat);
    scenario.prefixes = 6;
    let mut results = BTreeMap::new();
    for policy in ["prefix", "round-robin"] {
        let e = SimEngine::fleet(4, &engine_args);
        let r = Router::spawn(&urls(&e), &["--policy", policy, "--debug-headers"], "");
        let (_, s) = run(&r, scenario.clone(), 16, 240);
        assert_eq!(s.ok, 240, "{policy}: {s}");
        results.insert(policy, s);
    }
    let (p, rr) = (&results["prefix"], &results["round-robin"]);
    println!("prefix: {p}\nround-robin: {rr}");
    assert!(
        p.hit_rate >= 0.9 * p.ceiling_hit_rate,
        "prefix hit rate {:.3} vs ceiling {:.3}",
        p.hit_rate,
        p.ceiling_hit_rate
    );
    assert!(
        p.hit_rate >= rr.hit_rate + 0.15,
        "prefix {:.3} vs round-robin {:.3}",
        p.hit_rate,
        rr.hit_rate
    );
    assert!(
        p.load_max_mean_ratio <= 1.5,
        "prefix load max/mean {:.2}",
        p.load_max_mean_ratio
    );
}

/// Every request shares one system prompt: the load bound spreads it over
/// every replica instead of piling it onto the first that cached it.
#[test]
fn a_hot_system_prompt_is_spread_within_the_load_bound() {
    // Real-time-ish engines so requests overlap and load is visible.
    let e = SimEngine::fleet(4, &["--time-scale", "0.05"]);
    let r = Router::spawn(&urls(&e), &["--debug-headers"], "");
    let mut scenario = Scenario::new(ScenarioKind::HotPrefix);
    scenario.prefixes = 1;
    scenario.hot_fraction = 1.0;
    let (_, s) = run(&r, scenario, 24, 240);
    assert_eq!(s.ok, 240, "{s}");
    assert_eq!(
        s.per_instance.len(),
        4,
        "every engine takes a share: {:?}",
        s.per_instance
    );
    assert!(
        s.load_max_mean_ratio <= 1.6,
        "max/mean load {:.2}: {:?}",
        s.load_max_mean_ratio,
        s.per_instance
    );
    assert!(
        s.hit_rate >= 0.5 * s.ceiling_hit_rate,
        "replicas still hit the shared prompt: {s}"
    );
}
