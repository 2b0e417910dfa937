//! prefix-router as a Gateway API endpoint picker behind a real Envoy
//! (`deploy/envoy.yaml`, `testkit::envoy_proc`): clients talk to Envoy,
//! Envoy asks the router over ext_proc and connects to the engine it
//! names. Routing, streaming, the closed loop, the subset hint, 503 and
//! 429, both failure modes with the picker down, the picker restarting
//! under traffic, and a malformed ext_proc stream.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, processing_request,
    processing_response,
};
use serde_json::{Value, json};
use testkit::engine_proc::SimEngine;
use testkit::envoy_proc::{self, Envoy, Options};
use testkit::http::{Response, post_json, request};
use testkit::proc::free_port;
use testkit::router_proc::Router;

const SYSTEM: &str = "You are the support assistant of a shop that sells bicycles, \
    helmets, lights and locks. Answer briefly, in the customer's language, and never \
    promise a delivery date you cannot keep.";

fn chat(system: &str, user: &str, stream: bool) -> Value {
    let mut b = json!({
        "model": "sim-llama-8b",
        "max_tokens": 4,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    });
    if stream {
        b["stream"] = json!(true);
        b["stream_options"] = json!({"include_usage": true});
    }
    b
}

fn send(addr: SocketAddr, body: &Value, headers: &[(&str, &str)]) -> Response {
    let bytes = serde_json::to_vec(body).expect("json");
    let mut h = vec![("content-type", "application/json")];
    h.extend_from_slice(headers);
    request(addr, "POST", "/v1/chat/completions", &h, &bytes).expect("a request through Envoy")
}

/// The engine that answered (the sim-engine's `x-engine-id`: its address).
fn engine_of(r: &Response) -> String {
    r.header("x-engine-id").unwrap_or("none").to_owned()
}

/// `usage.prompt_tokens_details.cached_tokens` of an answer, streamed or not.
fn cached_tokens(r: &Response) -> u64 {
    let usage = if r
        .header("content-type")
        .is_some_and(|c| c.contains("event-stream"))
    {
        r.sse_data()
            .iter()
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .find(|v| v["usage"].is_object())
            .map(|v| v["usage"].clone())
    } else {
        Some(r.json()["usage"].clone())
    };
    usage
        .and_then(|u| u["prompt_tokens_details"]["cached_tokens"].as_u64())
        .unwrap_or(0)
}

/// The router with its picker on `epp_port`.
fn picker(engines: &[&SimEngine], epp_port: u16, config: &str) -> Router {
    let urls: Vec<String> = engines.iter().map(|e| e.url()).collect();
    let epp = format!("127.0.0.1:{epp_port}");
    let r = Router::spawn(&urls, &["--epp-listen", &epp], config);
    assert!(
        testkit::router_proc::wait_connectable(epp.parse().expect("addr"), Duration::from_secs(10)),
        "the picker does not listen on {epp}"
    );
    r
}

/// Sums a numeric field of every backend in `/admin/backends`.
fn backends_sum(r: &Router, field: impl Fn(&Value) -> u64) -> u64 {
    r.backends().iter().map(field).sum()
}

#[test]
fn through_envoy_a_prefix_goes_to_its_engine_and_every_answer_closes_the_loop() {
    let Some(bin) = envoy_proc::require("epp routing") else {
        return;
    };
    let engines = SimEngine::fleet(3, &["--time-scale", "0"]);
    let refs: Vec<&SimEngine> = engines.iter().collect();
    let epp_port = free_port();
    let router = picker(&refs, epp_port, "");
    let envoy = Envoy::spawn(
        &bin,
        epp_port,
        &engines[0].addr.to_string(),
        &Options::default(),
    );
    let mut served = Vec::new();
    for i in 0..6 {
        let r = send(
            envoy.addr,
            &chat(SYSTEM, &format!("question {i}"), i % 2 == 1),
            &[],
        );
        assert_eq!(r.status, 200, "{}", r.text());
        if i % 2 == 1 {
            let events = r.sse_data();
            assert!(
                events.len() > 2 && events.last().is_some_and(|d| d == "[DONE]"),
                "a whole stream: {events:?}"
            );
        }
        if i > 0 {
            assert!(
                cached_tokens(&r) >= 32,
                "turn {i} found the shared prompt cached: {}",
                r.text()
            );
        }
        served.push(engine_of(&r));
    }
    assert!(
        served.iter().all(|e| *e == served[0]),
        "one prompt, one engine: {served:?}"
    );
    // The picker followed each answer: its usage, its end.
    let reports = backends_sum(&router, |b| {
        b["prediction"]["reports"].as_u64().unwrap_or(0)
    });
    assert_eq!(reports, 6, "every answer's usage reached the closed loop");
    let in_flight = backends_sum(&router, |b| b["in_flight"].as_u64().unwrap_or(99));
    assert_eq!(in_flight, 0, "every answer gave its in-flight count back");
    // Another prompt is another engine's (rendezvous on its first blocks)
    // or the same one's: either way it is answered through the picker.
    let other = send(
        envoy.addr,
        &chat(
            "A different assistant entirely, with other rules.",
            "hi",
            false,
        ),
        &[],
    );
    assert_eq!(other.status, 200);
}

#[test]
fn the_subset_hint_limits_the_pick_and_a_hint_naming_no_endpoint_is_a_503() {
    let Some(bin) = envoy_proc::require("epp subset") else {
        return;
    };
    let engines = SimEngine::fleet(2, &["--time-scale", "0"]);
    let epp_port = free_port();
    let _router = picker(&[&engines[0], &engines[1]], epp_port, "");
    let opts = Options {
        subset_header: Some("x-test-subset".into()),
        ..Options::default()
    };
    let envoy = Envoy::spawn(&bin, epp_port, &engines[0].addr.to_string(), &opts);
    // The same prompt each time: only the hint moves it.
    for i in [1, 0, 1, 0] {
        let hint = engines[i].addr.to_string();
        let r = send(
            envoy.addr,
            &chat(SYSTEM, "where is my order?", false),
            &[("x-test-subset", &hint)],
        );
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(
            engine_of(&r),
            format!("e{i}"),
            "the pick stays inside the hint"
        );
    }
    let r = send(
        envoy.addr,
        &chat(SYSTEM, "hello", false),
        &[("x-test-subset", "127.0.0.1:1,10.9.9.9:80")],
    );
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(
        r.text().contains("subset"),
        "the error says why: {}",
        r.text()
    );
}

#[test]
fn nothing_up_is_a_503_and_a_shed_flex_request_a_429_with_retry_after() {
    let Some(bin) = envoy_proc::require("epp 503/429") else {
        return;
    };
    // Steps of 3 ms: a 100-token answer takes about 300 ms.
    let engine = SimEngine::spawn(&["--time-scale", "0.2"]);
    let epp_port = free_port();
    let config = "[classes]\nflex_max_in_flight_per_backend = 1\nflex_wait_ms = 100\n";
    let router = picker(&[&engine], epp_port, config);
    let envoy = Envoy::spawn(
        &bin,
        epp_port,
        &engine.addr.to_string(),
        &Options::default(),
    );
    let addr = envoy.addr;
    let mut long = chat(SYSTEM, "write a long story", false);
    long["max_tokens"] = json!(100);
    long["service_tier"] = json!("flex");
    let first = std::thread::spawn(move || send(addr, &long, &[]));
    std::thread::sleep(Duration::from_millis(60));
    let mut flex = chat(SYSTEM, "and another", false);
    flex["service_tier"] = json!("flex");
    let shed = send(addr, &flex, &[]);
    assert_eq!(shed.status, 429, "{}", shed.text());
    assert_eq!(shed.header("retry-after"), Some("5"));
    assert!(
        shed.json()["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("flex_wait_ms")),
        "OpenAI-shaped, saying why: {}",
        shed.text()
    );
    assert_eq!(first.join().expect("first").status, 200);
    // The only engine drained: nothing can serve.
    let url = format!("/admin/drain?backend={}", engine.url());
    assert_eq!(
        request(router.admin, "POST", &url, &[], b"")
            .expect("drain")
            .status,
        200
    );
    let r = send(addr, &chat(SYSTEM, "anyone?", false), &[]);
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("1"));
    assert!(r.text().contains("no backend is up"), "{}", r.text());
}

#[test]
fn with_the_picker_down_envoy_fails_closed_or_open_and_a_restarted_picker_takes_over() {
    let Some(bin) = envoy_proc::require("epp failure modes") else {
        return;
    };
    let engines = SimEngine::fleet(2, &["--time-scale", "0"]);
    let epp_port = free_port();
    let mut router = picker(&[&engines[0], &engines[1]], epp_port, "");
    let closed = Envoy::spawn(
        &bin,
        epp_port,
        &engines[1].addr.to_string(),
        &Options::default(),
    );
    let open = Envoy::spawn(
        &bin,
        epp_port,
        &engines[1].addr.to_string(),
        &Options {
            fail_open: true,
            ..Options::default()
        },
    );
    // Traffic through the fail-open Envoy the whole time.
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let traffic = {
        let (stop, ok, failed, addr) = (stop.clone(), ok.clone(), failed.clone(), open.addr);
        std::thread::spawn(move || {
            let mut i = 0;
            while !stop.load(Relaxed) {
                i += 1;
                match post_json(
                    addr,
                    "/v1/chat/completions",
                    &chat(SYSTEM, &format!("t{i}"), i % 2 == 0),
                ) {
                    Ok(r) if r.status == 200 => ok.fetch_add(1, Relaxed),
                    _ => failed.fetch_add(1, Relaxed),
                };
            }
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        send(closed.addr, &chat(SYSTEM, "up", false), &[]).status,
        200
    );
    router.child.stop();
    // Down: closed refuses, open goes round-robin (here: its one engine).
    let r = send(closed.addr, &chat(SYSTEM, "down", false), &[]);
    assert_eq!(r.status, 500, "fail closed: {}", r.text());
    let r = send(open.addr, &chat(SYSTEM, "down", false), &[]);
    assert_eq!(r.status, 200, "fail open: {}", r.text());
    assert_eq!(engine_of(&r), "e1", "the fail-open route's engine");
    std::thread::sleep(Duration::from_millis(300));
    // Back on the same port: the closed Envoy serves again within seconds.
    router = picker(&[&engines[0], &engines[1]], epp_port, "");
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut status = 0;
    while Instant::now() < deadline {
        status = send(closed.addr, &chat(SYSTEM, "back", false), &[]).status;
        if status == 200 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        status, 200,
        "the restarted picker serves the fail-closed Envoy"
    );
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Relaxed);
    traffic.join().expect("traffic");
    assert_eq!(
        failed.load(Relaxed),
        0,
        "fail open: no request failed while the picker restarted"
    );
    assert!(ok.load(Relaxed) > 10, "traffic ran: {}", ok.load(Relaxed));
    let picked = backends_sum(&router, |b| {
        b["prediction"]["reports"].as_u64().unwrap_or(0)
    });
    assert!(
        picked > 0,
        "the restarted picker picks and follows answers again"
    );
}

fn headers(pairs: &[(&str, &str)]) -> HttpHeaders {
    HttpHeaders {
        headers: Some(HeaderMap {
            headers: pairs
                .iter()
                .map(|(k, v)| HeaderValue {
                    key: (*k).into(),
                    raw_value: v.as_bytes().to_vec(),
                    ..Default::default()
                })
                .collect(),
        }),
        end_of_stream: false,
        ..Default::default()
    }
}

fn msg(r: processing_request::Request) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(r),
        ..Default::default()
    }
}

/// One ext_proc stream: sends `msgs`, returns what came back until the
/// server closed or 2 s passed, and the gRPC error if one came.
async fn exchange(
    epp: SocketAddr,
    msgs: Vec<ProcessingRequest>,
) -> (Vec<ProcessingResponse>, Option<tonic::Status>) {
    let mut client = ExternalProcessorClient::connect(format!("http://{epp}"))
        .await
        .expect("connect to the picker");
    let stream = futures::stream::iter(msgs);
    let mut got = Vec::new();
    let mut inbound = match client.process(stream).await {
        Ok(r) => r.into_inner(),
        Err(e) => return (got, Some(e)),
    };
    loop {
        match tokio::time::timeout(Duration::from_secs(2), inbound.message()).await {
            Ok(Ok(Some(m))) => got.push(m),
            Ok(Ok(None)) | Err(_) => return (got, None),
            Ok(Err(e)) => return (got, Some(e)),
        }
    }
}

#[test]
fn a_malformed_or_out_of_order_ext_proc_stream_is_refused_and_the_picker_keeps_serving() {
    let engine = SimEngine::spawn(&["--time-scale", "0"]);
    let epp_port = free_port();
    let router = picker(&[&engine], epp_port, "");
    let epp: SocketAddr = format!("127.0.0.1:{epp_port}").parse().expect("addr");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    use processing_request::Request as Req;
    let post = || {
        Req::RequestHeaders(headers(&[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("content-type", "application/json"),
        ]))
    };
    let body = |b: &[u8]| {
        Req::RequestBody(HttpBody {
            body: b.to_vec(),
            end_of_stream: true,
            ..Default::default()
        })
    };
    // A response before any request: refused by name.
    let (_, err) = rt.block_on(exchange(
        epp,
        vec![msg(Req::ResponseHeaders(headers(&[(":status", "200")])))],
    ));
    let err = err.expect("an out-of-order stream is an error");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert!(err.message().contains("out of order"), "{}", err.message());
    // Headers twice: refused.
    let (_, err) = rt.block_on(exchange(epp, vec![msg(post()), msg(post())]));
    assert!(err.is_some_and(|e| e.message().contains("request headers")));
    // A message with nothing in it: refused.
    let (_, err) = rt.block_on(exchange(epp, vec![ProcessingRequest::default()]));
    assert!(err.is_some());
    // A body that is not JSON: the client's 400, answered by the picker.
    let (got, err) = rt.block_on(exchange(epp, vec![msg(post()), msg(body(b"{not json"))]));
    assert!(err.is_none(), "{err:?}");
    let status = got.iter().find_map(|m| match &m.response {
        Some(processing_response::Response::ImmediateResponse(i)) => i.status.map(|s| s.code),
        _ => None,
    });
    assert_eq!(status, Some(400), "{got:?}");
    // And a good one still picks the engine, header and metadata alike.
    let good = serde_json::to_vec(&chat(SYSTEM, "hi", false)).expect("json");
    let (got, err) = rt.block_on(exchange(epp, vec![msg(post()), msg(body(&good))]));
    assert!(err.is_none(), "{err:?}");
    let first = got.first().expect("an answer");
    let Some(processing_response::Response::RequestHeaders(h)) = &first.response else {
        panic!("the headers answered first: {first:?}");
    };
    let set = &h
        .response
        .as_ref()
        .expect("common")
        .header_mutation
        .as_ref()
        .expect("mutation")
        .set_headers;
    let dest = set.iter().find_map(|o| {
        o.header
            .as_ref()
            .filter(|h| h.key == "x-gateway-destination-endpoint")
    });
    assert_eq!(
        dest.map(|h| h.raw_value.clone()),
        Some(engine.addr.to_string().into_bytes())
    );
    let md = format!("{:?}", first.dynamic_metadata);
    assert!(
        md.contains("envoy.lb") && md.contains(&engine.addr.to_string()),
        "{md}"
    );
    // The body goes back to Envoy whole.
    let echoed: usize = got
        .iter()
        .filter_map(|m| match &m.response {
            Some(processing_response::Response::RequestBody(b)) => {
                b.response.as_ref()?.body_mutation.as_ref()
            }
            _ => None,
        })
        .map(|b| format!("{b:?}").len())
        .sum();
    assert!(echoed > 0, "{got:?}");
    // Health: alive and ready.
    let ready = rt.block_on(async {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{epp}"))
            .expect("endpoint")
            .connect()
            .await
            .expect("connect");
        let mut h = tonic_health::pb::health_client::HealthClient::new(ch);
        h.check(tonic_health::pb::HealthCheckRequest {
            service: "readiness".into(),
        })
        .await
        .map(|r| r.into_inner().status)
    });
    assert_eq!(
        ready.ok(),
        Some(tonic_health::pb::health_check_response::ServingStatus::Serving as i32)
    );
    // Nothing was left counted in flight by the broken streams.
    assert_eq!(router.backends()[0]["in_flight"], 0);
}

#[test]
fn an_engine_gone_between_pick_and_send_is_a_quick_error_and_then_left_out() {
    let Some(bin) = envoy_proc::require("epp gone engine") else {
        return;
    };
    let mut engines = SimEngine::fleet(2, &["--time-scale", "0"]);
    let epp_port = free_port();
    // Probes off: only the answers Envoy reports tell the picker.
    let router = picker(
        &[&engines[0], &engines[1]],
        epp_port,
        "[health]\ninterval_ms = 0\n",
    );
    let envoy = Envoy::spawn(
        &bin,
        epp_port,
        &engines[1].addr.to_string(),
        &Options::default(),
    );
    let first = send(envoy.addr, &chat(SYSTEM, "hi", false), &[]);
    assert_eq!(first.status, 200);
    let holder = engine_of(&first);
    let gone = usize::from(holder == "e1");
    engines[gone].child.stop();
    let mut statuses = Vec::new();
    for i in 0..8 {
        let started = Instant::now();
        let r = send(envoy.addr, &chat(SYSTEM, &format!("again {i}"), false), &[]);
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "no hang on a gone engine"
        );
        statuses.push((r.status, engine_of(&r)));
    }
    let failed = statuses.iter().filter(|(s, _)| *s >= 500).count();
    assert!(
        (1..=3).contains(&failed),
        "a few failures eject the gone engine (health.passive_fall): {statuses:?}"
    );
    assert!(
        statuses[failed..]
            .iter()
            .all(|(s, e)| *s == 200 && *e == format!("e{}", 1 - gone)),
        "then the other engine serves: {statuses:?}"
    );
    assert_eq!(router.backend(&engines[gone].url())["healthy"], false);
}

#[test]
fn a_stored_response_is_asked_of_the_engine_that_stored_it() {
    let Some(bin) = envoy_proc::require("epp stored responses") else {
        return;
    };
    let engines = SimEngine::fleet(3, &["--time-scale", "0"]);
    let epp_port = free_port();
    let _router = picker(&[&engines[0], &engines[1], &engines[2]], epp_port, "");
    let envoy = Envoy::spawn(
        &bin,
        epp_port,
        &engines[0].addr.to_string(),
        &Options::default(),
    );
    // Each turn with instructions of its own: its prompt alone would go
    // anywhere, the chain only to where its previous turn is stored.
    let mut last: Option<String> = None;
    for t in 0..5 {
        let mut body = json!({
            "model": "sim-llama-8b",
            "instructions": format!("Persona {t}: {}", SYSTEM.repeat(t + 1)),
            "input": format!("step {t}"),
            "max_output_tokens": 4,
        });
        if let Some(p) = &last {
            body["previous_response_id"] = json!(p);
        }
        let r = post_json(envoy.addr, "/v1/responses", &body).expect("responses");
        assert_eq!(r.status, 200, "turn {t}: {}", r.text());
        last = r.json()["id"].as_str().map(str::to_owned);
    }
    let id = last.expect("an id");
    let got = request(envoy.addr, "GET", &format!("/v1/responses/{id}"), &[], b"").expect("get");
    assert_eq!(got.status, 200, "{}", got.text());
    assert_eq!(got.json()["id"], json!(id));
    let unknown = request(envoy.addr, "GET", "/v1/responses/resp_nope", &[], b"").expect("get");
    assert_eq!(unknown.status, 404, "{}", unknown.text());
    assert!(unknown.text().contains("not found"), "{}", unknown.text());
}
