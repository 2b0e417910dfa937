use super::*;
use serde_json::json;

/// A one-replica row with these figures (the other fields their defaults).
fn row(scenario: &str, api: Api, policy: &str, hit_rate: f64, errors: u64) -> QualityRow {
    serde_json::from_value(json!({
        "scenario": scenario, "api": api, "policy": policy, "kv_blocks": 100,
        "requests": 500, "errors": errors, "hit_rate": hit_rate, "ceiling": 0.93,
        "ttft_p50_ms": 14.0, "ttft_p90_ms": 100.0, "ttft_p99_ms": 420.4,
        "latency_p50_ms": 700.0, "rps": 20.0, "load_max_mean": 1.02,
        "routing": {"count": 500, "mean_us": 50.0, "p99_le_us": 100.0},
    }))
    .expect("a row")
}

#[test]
fn each_row_runs_once_per_api_with_its_second_workload_on_the_same_api() {
    let rows = crate::scenarios::all()
        .into_iter()
        .filter(|s| s.name == "think-48" || s.name == "chat-and-batch")
        .collect::<Vec<_>>();
    let expanded = per_api(rows.clone(), &[Api::Chat, Api::Messages]);
    let got: Vec<(String, Api)> = expanded.iter().map(|q| (q.name.clone(), q.api)).collect();
    assert_eq!(
        got,
        [
            ("think-48".to_string(), Api::Chat),
            ("think-48".into(), Api::Messages),
            ("chat-and-batch".into(), Api::Chat),
            ("chat-and-batch".into(), Api::Messages),
        ]
    );
    let side = expanded[3].alongside.as_deref().expect("its batch");
    assert_eq!(side.api, Api::Messages);
    assert_eq!(expanded[0].label(), "think-48");
    assert_eq!(expanded[1].label(), "think-48.messages");
    assert_eq!(
        per_api(rows, &[]).len(),
        2,
        "no --api: the rows as they are"
    );
}

#[test]
fn the_apis_sit_side_by_side_against_the_chat_s_hit_rate() {
    let rows = vec![
        row("think-48", Api::Chat, "prefix", 0.737, 0),
        row("think-48", Api::Chat, "round-robin", 0.524, 0),
        row("think-48", Api::Messages, "prefix", 0.731, 0),
        row("think-48", Api::Messages, "round-robin", 0.530, 0),
        row("think-48", Api::ResponsesChained, "prefix", 0.70, 2),
    ];
    assert!(several(&rows) && !several(&rows[..2]) && !several(&[]));
    let md = side_by_side(&rows).markdown();
    let lines: Vec<&str> = md.lines().collect();
    assert_eq!(
        lines[0],
        "| scenario | router | chat | messages | responses-chained |"
    );
    assert_eq!(
        lines[2],
        "| think-48 | prefix | 73.7% · 14 / 420 | 73.1% (-0.6) · 14 / 420 | 70.0% (-3.7) · 14 / 420 · 2 err |"
    );
    assert_eq!(
        lines[3],
        "| think-48 | round-robin | 52.4% · 14 / 420 | 53.0% (+0.6) · 14 / 420 | - |"
    );
    assert!(markdown(&rows).starts_with("### The same conversations on each API"));
    assert_eq!(markdown(&rows[..2]), "", "one API: no section");
}

#[test]
fn every_api_is_held_to_the_chat_s_hit_rate_and_above_round_robin() {
    let rows = vec![
        row("think-48", Api::Chat, "prefix", 0.737, 0),
        row("think-48", Api::Chat, "round-robin", 0.524, 0),
        row("think-48", Api::Messages, "prefix", 0.731, 0),
        row("think-48", Api::Messages, "round-robin", 0.530, 0),
        row("think-48", Api::ResponsesChained, "prefix", 0.70, 0),
        row("think-48", Api::ResponsesChained, "round-robin", 0.66, 0),
    ];
    let mut c = Vec::new();
    check_targets(&rows, &mut c);
    let got: Vec<(&str, bool)> = c.iter().map(|c| (c.target.as_str(), c.met)).collect();
    assert_eq!(
        got,
        [
            (
                "think-48: chat hit rate >= round-robin's on chat + 10 points",
                true
            ),
            (
                "think-48: messages hit rate within 1 point of the chat's",
                true
            ),
            (
                "think-48: messages hit rate >= round-robin's on messages + 10 points",
                true
            ),
            (
                "think-48: responses-chained hit rate within 1 point of the chat's",
                false
            ),
            (
                "think-48: responses-chained hit rate >= round-robin's on responses-chained + 10 points",
                false
            ),
        ]
    );
    assert_eq!(c[3].margin, "-3.7 points");
    let mut none = Vec::new();
    check_targets(&rows[..2], &mut none);
    assert!(none.is_empty(), "one API: nothing to hold it to");
}
