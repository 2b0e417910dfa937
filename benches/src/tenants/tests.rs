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

/// The small tenant's figures with these TTFTs (the report's tests too).
pub(super) fn small(p50: f64, p99: f64) -> TenantFigures {
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
