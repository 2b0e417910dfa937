//! The workload generator against one engine: the chat trace's hit rate
//! reaches its ceiling, records are complete, runs are reproducible.

use std::process::Command;
use testkit::engine_proc::SimEngine;
use testkit::workload::{Record, RunConfig, Scenario, ScenarioKind, Summary, run_blocking};

#[test]
fn one_big_engine_reaches_the_chat_ceiling() {
    let e = SimEngine::spawn(&[
        "--time-scale",
        "0.01",
        "--kv-blocks",
        "100000",
        "--id",
        "solo",
    ]);
    let out = std::env::temp_dir().join(format!("workload-chat-{}.jsonl", std::process::id()));
    let mut cfg = RunConfig::new(e.url(), Scenario::new(ScenarioKind::Chat));
    cfg.users = 6;
    cfg.requests = Some(80);
    cfg.out = Some(out.clone());
    let (records, s) = run_blocking(cfg).unwrap();
    assert_eq!(s.ok, 80, "{s}");
    assert!(s.ceiling_hit_rate > 0.5, "chat reuses history: {s}");
    assert!(s.hit_rate >= 0.97 * s.ceiling_hit_rate, "{s}");
    assert!(
        s.hit_rate <= s.ceiling_hit_rate + 1e-9,
        "nothing beats the ceiling: {s}"
    );
    assert_eq!(s.per_instance.get("solo"), Some(&80));
    assert_eq!(s.load_max_mean_ratio, 1.0);
    assert!(
        s.ttft_ms.p50 > 0.0 && s.ttft_ms.p99 >= s.ttft_ms.p50 && s.latency_ms.p50 >= s.ttft_ms.p50
    );
    // The engine's token counts agree with the workload's own tokenizer.
    assert!(
        records
            .iter()
            .all(|r| r.prompt_tokens == r.local_prompt_tokens && r.completion_tokens == 64)
    );
    let lines = std::fs::read_to_string(&out).unwrap();
    let parsed: Vec<Record> = lines
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(parsed.len(), 80);
    assert!(parsed.iter().any(|r| r.turn > 1));
    std::fs::remove_file(out).ok();
}

#[test]
fn a_small_cache_falls_below_the_ceiling() {
    let e = SimEngine::spawn(&["--time-scale", "0", "--kv-blocks", "200"]);
    let mut cfg = RunConfig::new(e.url(), Scenario::new(ScenarioKind::Chat));
    cfg.users = 8;
    cfg.requests = Some(80);
    let (_, s) = run_blocking(cfg).unwrap();
    assert!(
        s.hit_rate < 0.8 * s.ceiling_hit_rate,
        "200 blocks cannot hold 8 conversations: {s}"
    );
}

#[test]
fn same_seed_same_trace() {
    let trace = |seed| {
        let e = SimEngine::spawn(&["--time-scale", "0"]);
        let mut cfg = RunConfig::new(e.url(), Scenario::new(ScenarioKind::Agent));
        cfg.users = 1;
        cfg.requests = Some(12);
        cfg.seed = seed;
        let (r, _) = run_blocking(cfg).unwrap();
        r.iter()
            .map(|r| (r.prompt_tokens, r.cached_tokens, r.prefix_id))
            .collect::<Vec<_>>()
    };
    let a = trace(5);
    assert_eq!(a.len(), 12);
    assert_eq!(a, trace(5));
    assert_ne!(a, trace(6));
}

#[test]
fn every_scenario_runs_closed_and_open_loop() {
    let e = SimEngine::spawn(&["--time-scale", "0"]);
    for kind in [
        ScenarioKind::Chat,
        ScenarioKind::FewShot,
        ScenarioKind::HotPrefix,
        ScenarioKind::LongDoc,
        ScenarioKind::Agent,
    ] {
        let mut cfg = RunConfig::new(e.url(), Scenario::new(kind));
        cfg.users = 3;
        cfg.requests = Some(12);
        let (_, s) = run_blocking(cfg.clone()).unwrap();
        assert_eq!((s.ok, s.errors), (12, 0), "{kind:?} closed loop: {s}");
        assert!(s.ceiling_hit_rate > 0.3, "{kind:?} shares prefixes: {s}");
        cfg.rate = Some(400.0);
        cfg.requests = Some(10);
        let (_, s) = run_blocking(cfg).unwrap();
        assert_eq!(s.ok, 10, "{kind:?} open loop: {s}");
    }
}

#[test]
fn long_doc_prompts_reach_100k_tokens() {
    let e = SimEngine::spawn(&["--time-scale", "0", "--kv-blocks", "20000"]);
    let mut sc = Scenario::new(ScenarioKind::LongDoc);
    sc.prefixes = 1;
    sc.prefix_tokens = 100_000;
    sc.turns = (3, 3);
    let mut cfg = RunConfig::new(e.url(), sc);
    cfg.users = 1;
    cfg.requests = Some(3);
    let (r, s) = run_blocking(cfg).unwrap();
    assert_eq!(s.ok, 3, "{s}");
    assert!(r[0].prompt_tokens >= 50_000);
    assert!(
        r[2].cached_tokens > 49_000,
        "later questions reuse the document"
    );
}

#[test]
fn cli_prints_a_json_summary() {
    let e = SimEngine::spawn(&["--time-scale", "0"]);
    let out = Command::new(testkit::bin_path("workload"))
        .args([
            "--target",
            &e.url(),
            "--scenario",
            "hot-prefix",
            "--users",
            "4",
            "--requests",
            "40",
            "--seed",
            "3",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s: Summary = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(s.ok, 40);
    assert!(s.hit_rate > 0.5, "{s}");
}
