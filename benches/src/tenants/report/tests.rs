use super::*;
use crate::tenants::TenantFigures;
use crate::tenants::tests::small;
use serde_json::json;

/// A one-replica row of `scenario` under `policy` with this split.
fn row(scenario: &str, policy: &str, f: TenantFigures) -> QualityRow {
    let mut r: QualityRow = serde_json::from_value(json!({
        "scenario": scenario, "policy": policy, "kv_blocks": 100,
        "requests": 500, "errors": 0, "hit_rate": 0.5, "ceiling": 0.9,
        "ttft_p50_ms": 14.0, "ttft_p90_ms": 100.0, "ttft_p99_ms": 420.0,
        "latency_p50_ms": 70.0, "rps": 20.0, "load_max_mean": 1.0,
        "routing": {"count": 500, "mean_us": 50.0, "p99_le_us": 100.0},
    }))
    .expect("a row");
    r.tenants = Some(f);
    r
}

#[test]
fn the_target_sets_each_router_s_p99_against_the_small_tenant_alone() {
    let with_file = "prefix+benches/configs/tenants.toml";
    let mut both = small(30.0, 120.0);
    both.big_sent = 5000;
    both.big_answered = 3000;
    both.big_refused = 2000;
    let rows = vec![
        row(ALONE, "prefix", small(20.0, 100.0)),
        row(TOGETHER, "prefix", small(300.0, 900.0)),
        row(TOGETHER, with_file, both),
    ];
    // No alone row of its own router: its policy's without the file.
    assert_eq!(alone_for(&rows, &rows[2]).unwrap().policy, "prefix");
    assert!((both.p99_over(&small(20.0, 100.0)) - 1.2).abs() < 1e-9);
    let mut c = Vec::new();
    check_targets(&rows, &mut c);
    assert_eq!(c.len(), 2, "one check per router on the row with both");
    assert!(!c[0].met && c[0].margin == "9.00x", "{:?}", c[0]);
    assert!(c[1].met && c[1].margin == "1.20x", "{:?}", c[1]);
    assert!(c[1].measured.contains("3000 answered, 2000 refused"));
    // The alone row of the same router when there is one.
    let mut rows = rows;
    rows.push(row(ALONE, with_file, small(20.0, 60.0)));
    assert_eq!(alone_for(&rows, &rows[2]).unwrap().policy, with_file);
    let mut c = Vec::new();
    check_targets(&rows, &mut c);
    assert!(!c[1].met && c[1].margin == "2.00x");
    let md = markdown(&rows);
    assert!(md.contains("| capped-tenants | prefix+benches/configs/tenants.toml | 100 (0) | 30.0 / 120.0 | 20.0 / 60.0 | 2.00x | - / - | 5000 | 3000 | 2000 | 0 |"), "{md}");
    assert!(markdown(&[]).is_empty());
}
