use super::*;
use serde_json::json;

fn rec(tenant: &str, status: u16, ttft_ms: f64) -> Record {
    serde_json::from_value(json!({
        "seq": 0, "scenario": "few-shot", "user": 0, "session": 0, "turn": 1,
        "prefix_id": 0, "start_ms": 0.0, "ttft_ms": ttft_ms, "end_ms": 1.0,
        "latency_ms": 1.0, "status": status, "error": null, "prompt_tokens": 10,
        "cached_tokens": 0, "completion_tokens": 1, "local_prompt_tokens": 10,
        "ceiling_cached_tokens": 0, "instance": null, "tenant": tenant,
    }))
    .expect("a record")
}

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

fn small(p50: f64, p99: f64) -> TenantFigures {
    TenantFigures {
        small_answered: 100,
        small_ttft_p50_ms: p50,
        small_ttft_p99_ms: p99,
        ..Default::default()
    }
}

#[test]
fn records_split_by_the_user_they_were_sent_as() {
    // The small tenant: 100 answers of 1..=100 ms, one refused.
    let mut v: Vec<Record> = (1..=100)
        .map(|i| rec(SMALL_TENANT, 200, f64::from(i)))
        .collect();
    v.push(rec(SMALL_TENANT, 503, 0.0));
    // The big one: 30 answers (slow: not the small tenant's), 50 refused
    // (429 or 503), one that failed.
    v.extend((0..30).map(|_| rec(BIG_TENANT, 200, 5000.0)));
    v.extend((0..25).map(|_| rec(BIG_TENANT, 503, 0.0)));
    v.extend((0..25).map(|_| rec(BIG_TENANT, 429, 0.0)));
    v.push(rec(BIG_TENANT, 502, 0.0));
    let f = TenantFigures::of(&v, RouterWaits::default()).expect("the small tenant's requests");
    assert_eq!(
        f,
        TenantFigures {
            small_answered: 100,
            small_ttft_p50_ms: 50.0,
            small_ttft_p99_ms: 99.0,
            small_refused: 1,
            big_sent: 81,
            big_answered: 30,
            big_refused: 50,
            failed: 1,
            waits: RouterWaits::default(),
        }
    );
    // Records with no tenant (another row): no split.
    let mut other = rec(SMALL_TENANT, 200, 1.0);
    other.tenant = None;
    assert_eq!(TenantFigures::of(&[other], RouterWaits::default()), None);
    // The small tenant alone: no big one.
    let alone = TenantFigures::of(&v[..101], RouterWaits::default()).unwrap();
    assert_eq!((alone.big_sent, alone.small_answered), (0, 100));
}

#[test]
fn repeated_runs_take_median_ttfts_and_summed_counts() {
    let runs = [small(10.0, 90.0), small(30.0, 50.0), small(20.0, 70.0)];
    let m = TenantFigures::median(&runs).unwrap();
    assert_eq!((m.small_ttft_p50_ms, m.small_ttft_p99_ms), (20.0, 70.0));
    assert_eq!(m.small_answered, 300);
    assert_eq!(TenantFigures::median(&[]), None);
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

#[test]
fn each_tenant_s_mean_wait_is_read_from_the_router_s_metrics() {
    let text = "# TYPE prefix_router_class_wait_seconds histogram\n\
        prefix_router_class_wait_seconds_sum{class=\"default\",tenant=\"small\"} 0.5\n\
        prefix_router_class_wait_seconds_count{class=\"default\",tenant=\"small\"} 100\n\
        prefix_router_class_wait_seconds_bucket{le=\"0.01\",class=\"default\",tenant=\"small\"} 100\n\
        prefix_router_class_wait_seconds_sum{class=\"default\",tenant=\"big\"} 40.0\n\
        prefix_router_class_wait_seconds_count{class=\"default\",tenant=\"big\"} 100\n";
    let w = RouterWaits::parse(text);
    assert_eq!((w.small_ms, w.big_ms), (Some(5.0), Some(400.0)));
    assert_eq!(RouterWaits::parse(""), RouterWaits::default());
}
