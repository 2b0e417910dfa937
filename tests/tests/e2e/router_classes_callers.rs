//! Where a request's class comes from, through real processes: the body's
//! `service_tier`, a configured header, the caller's API key and the
//! body's `user` (both mapped to a tenant in the config file), and a reload
//! of that mapping. A request counts as `flex` when the router holds it
//! behind `classes.flex_max_in_flight_per_backend` and sheds it (429 with
//! Retry-After, counted by class and tenant); `/admin/explain` names the
//! class, the tenant and the source.

use std::net::SocketAddr;

use serde_json::{Value, json};
use testkit::engine_proc::SimEngine;
use testkit::http::request;
use testkit::router_proc::Router;

/// `printf %s sk-outreach | sha256sum`, as an operator writes it.
const OUTREACH_KEY_SHA256: &str =
    "d352ee425163724bb84de8ab128766dcdea90c5dfc8c7811e834c753b9572370";
/// `printf %s sk-support | sha256sum`.
const SUPPORT_KEY_SHA256: &str = "beaef536095dbbb3c07a260593e2b466dc0e25204cba503bf4fe10ebfec8ffa8";

/// One request at a time for `flex`, a short wait: of a burst of four
/// 50-token requests (150 ms each) held as flex, some are shed.
fn config() -> String {
    format!(
        r#"[classes]
flex_max_in_flight_per_backend = 1
flex_wait_ms = 100
header = "x-request-class"
[[classes.tenants]]
name = "outreach"
class = "flex"
keys_sha256 = ["{OUTREACH_KEY_SHA256}"]
users = ["mailer"]
[[classes.tenants]]
name = "support"
class = "priority"
keys_sha256 = ["{SUPPORT_KEY_SHA256}"]
"#
    )
}

fn start(config: &str) -> (SimEngine, Router) {
    // Steps of 3 ms: a 50-token answer takes about 150 ms.
    let engine = SimEngine::spawn(&["--time-scale", "0.2"]);
    let r = Router::spawn(&[engine.url()], &[], config);
    (engine, r)
}

fn chat(extra: &Value) -> Value {
    let mut b = json!({"max_tokens": 50, "messages": [{"role": "user", "content": "hello"}]});
    for (k, v) in extra.as_object().into_iter().flatten() {
        b[k] = v.clone();
    }
    b
}

/// Four requests at once with these headers and body fields: each one's
/// status (a 429 must carry Retry-After).
fn burst(addr: SocketAddr, headers: &[(&'static str, &'static str)], extra: &Value) -> Vec<u16> {
    let threads: Vec<_> = (0..4)
        .map(|i| {
            let headers = headers.to_vec();
            let mut body = chat(extra);
            body["messages"][0]["content"] = json!(format!("request {i}"));
            std::thread::spawn(move || {
                let mut h = headers;
                h.push(("content-type", "application/json"));
                let bytes = serde_json::to_vec(&body).unwrap();
                let resp = request(addr, "POST", "/v1/chat/completions", &h, &bytes).unwrap();
                if resp.status == 429 {
                    assert!(
                        resp.header("retry-after").is_some(),
                        "429 without Retry-After"
                    );
                }
                resp.status
            })
        })
        .collect();
    let statuses: Vec<u16> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(
        statuses.iter().all(|&s| s == 200 || s == 429),
        "{statuses:?}"
    );
    statuses
}

fn held_as_flex(statuses: &[u16]) -> bool {
    statuses.contains(&429) && statuses.contains(&200)
}

/// `prefix_router_class_shed_total` for a class and tenant.
fn shed(r: &Router, class: &str, tenant: &str) -> u64 {
    let want = format!("class=\"{class}\",tenant=\"{tenant}\"");
    r.metrics()
        .lines()
        .find(|l| l.starts_with("prefix_router_class_shed_total") && l.contains(&want))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0)
}

/// `/admin/explain` of a chat with these headers and body fields: its
/// class, tenant and source.
fn explain(r: &Router, headers: &[(&str, &str)], extra: &Value) -> (String, String, String) {
    let bytes = serde_json::to_vec(&chat(extra)).unwrap();
    let resp = request(r.admin, "POST", "/admin/explain", headers, &bytes).unwrap();
    assert_eq!(resp.status, 200, "{}", resp.text());
    let v = resp.json();
    let s = |k: &str| v[k].as_str().unwrap_or("?").to_string();
    (s("class"), s("tenant"), s("class_from"))
}

fn triple(c: &str, t: &str, s: &str) -> (String, String, String) {
    (c.into(), t.into(), s.into())
}

#[test]
fn the_body_names_the_class_of_a_caller_of_no_tenant() {
    let (_e, r) = start(&config());
    assert!(held_as_flex(&burst(
        r.addr,
        &[],
        &json!({"service_tier": "flex"})
    )));
    assert!(shed(&r, "flex", "-") >= 1);
    assert!(burst(r.addr, &[], &json!({})).iter().all(|&s| s == 200));
    assert_eq!(
        explain(&r, &[], &json!({"service_tier": "flex"})),
        triple("flex", "-", "body")
    );
    assert_eq!(explain(&r, &[], &json!({})), triple("default", "-", "none"));
}

#[test]
fn a_configured_header_names_the_class_before_the_body() {
    let (_e, r) = start(&config());
    let flex = [("X-Request-Class", "flex")];
    assert!(held_as_flex(&burst(r.addr, &flex, &json!({}))));
    assert!(shed(&r, "flex", "-") >= 1);
    // The header is read before the body.
    let priority = [("x-request-class", "priority")];
    assert!(
        burst(r.addr, &priority, &json!({"service_tier": "flex"}))
            .iter()
            .all(|&s| s == 200)
    );
    assert_eq!(
        explain(&r, &priority, &json!({"service_tier": "flex"})),
        triple("priority", "-", "header")
    );
    // Unknown: default.
    assert_eq!(
        explain(&r, &[("x-request-class", "gold")], &json!({})),
        triple("default", "-", "header")
    );
}

#[test]
fn an_api_key_puts_its_caller_in_its_tenant_and_class() {
    let (_e, r) = start(&config());
    let outreach = [("authorization", "Bearer sk-outreach")];
    assert!(held_as_flex(&burst(r.addr, &outreach, &json!({}))));
    assert!(shed(&r, "flex", "outreach") >= 1);
    assert_eq!(shed(&r, "flex", "-"), 0, "counted under the tenant");
    // A tenant's class is a ceiling: asking for priority does not raise it.
    let asks_more = [
        ("authorization", "Bearer sk-outreach"),
        ("x-request-class", "priority"),
    ];
    assert_eq!(
        explain(&r, &asks_more, &json!({})),
        triple("flex", "outreach", "key")
    );
    // A priority tenant may lower its own requests.
    let support = [("x-api-key", "sk-support")];
    assert_eq!(
        explain(&r, &support, &json!({})),
        triple("priority", "support", "key")
    );
    assert_eq!(
        explain(&r, &support, &json!({"service_tier": "flex"})),
        triple("flex", "support", "body")
    );
    // An unknown key is no error: default, tenant "-".
    let stranger = [("authorization", "Bearer sk-stranger")];
    assert!(
        burst(r.addr, &stranger, &json!({}))
            .iter()
            .all(|&s| s == 200)
    );
    assert_eq!(
        explain(&r, &stranger, &json!({})),
        triple("default", "-", "none")
    );
    // The key is never written to the log.
    assert!(!r.child.stderr_tail(1 << 20).contains("sk-outreach"));
}

#[test]
fn the_bodys_user_puts_its_caller_in_its_tenant_and_class() {
    let (_e, r) = start(&config());
    assert!(held_as_flex(&burst(
        r.addr,
        &[],
        &json!({"user": "mailer"})
    )));
    assert!(shed(&r, "flex", "outreach") >= 1);
    assert_eq!(
        explain(&r, &[], &json!({"user": "mailer"})),
        triple("flex", "outreach", "user")
    );
    assert_eq!(
        explain(&r, &[], &json!({"user": "someone-else"})),
        triple("default", "-", "none")
    );
}

#[test]
fn a_reload_of_the_mapping_changes_a_callers_class() {
    let engine = SimEngine::spawn(&["--time-scale", "0.2"]);
    let dir = std::env::temp_dir().join(format!("classes-tenants-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("router.toml");
    let write = |class: &str| {
        let text = format!(
            "backends = [\"{}\"]\n[classes]\nflex_max_in_flight_per_backend = 1\nflex_wait_ms = 100\n[[classes.tenants]]\nname = \"acme\"\nclass = \"{class}\"\nusers = [\"acme-app\"]\n",
            engine.url()
        );
        std::fs::write(&path, text).unwrap();
    };
    write("default");
    let r = Router::spawn(&[], &["--config", path.to_str().unwrap()], "");
    let acme = json!({"user": "acme-app"});
    assert!(burst(r.addr, &[], &acme).iter().all(|&s| s == 200));
    assert_eq!(explain(&r, &[], &acme), triple("default", "acme", "user"));
    write("flex");
    let resp = request(r.admin, "POST", "/admin/reload", &[], b"").unwrap();
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(explain(&r, &[], &acme), triple("flex", "acme", "user"));
    assert!(held_as_flex(&burst(r.addr, &[], &acme)));
    assert!(shed(&r, "flex", "acme") >= 1);
    // A mapping that does not parse is refused, and the last one stays.
    std::fs::write(
        &path,
        format!(
            "backends = [\"{}\"]\n[[classes.tenants]]\nname = \"-\"\n",
            engine.url()
        ),
    )
    .unwrap();
    let resp = request(r.admin, "POST", "/admin/reload", &[], b"").unwrap();
    assert_eq!(resp.status, 400, "{}", resp.text());
    assert_eq!(explain(&r, &[], &acme), triple("flex", "acme", "user"));
    let _ = std::fs::remove_dir_all(&dir);
}
