use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
    processing_request::Request, processing_response::Response,
};
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value, value::Kind};

use super::exchange::Exchange;
use super::wire;
use crate::config::Config;
use crate::shared::Router;

fn router() -> Arc<Router> {
    let cfg: Config =
        toml::from_str("backends = [\"http://127.0.0.1:9001\", \"http://127.0.0.1:9002\"]")
            .expect("config");
    Router::new(cfg).expect("router")
}

fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> HttpHeaders {
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
        end_of_stream,
        ..Default::default()
    }
}

fn msg(r: Request, mode: Option<BodySendMode>) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(r),
        protocol_config: mode.map(|m| ProtocolConfiguration {
            request_body_mode: m as i32,
            response_body_mode: m as i32,
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn body(b: &[u8], end_of_stream: bool) -> HttpBody {
    HttpBody {
        body: b.to_vec(),
        end_of_stream,
        ..Default::default()
    }
}

const CHAT: &[u8] = br#"{"model":"m","messages":[{"role":"system","content":"You are a careful assistant who answers in full sentences and cites sources."},{"role":"user","content":"hi"}]}"#;
const USAGE: &[u8] = br#"data: {"choices":[],"usage":{"prompt_tokens":30,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":16}}}

data: [DONE]

"#;

fn run<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(f)
}

async fn feed(x: &mut Exchange, m: ProcessingRequest) -> Vec<ProcessingResponse> {
    let mut out = Vec::new();
    x.on_message(m, &mut out).await.expect("in order");
    out
}

fn post() -> Request {
    Request::RequestHeaders(headers(
        &[(":method", "POST"), (":path", "/v1/chat/completions")],
        false,
    ))
}

/// The endpoint a pick answered with (header), and the metadata's.
fn destination(r: &ProcessingResponse) -> (String, String) {
    let common = match &r.response {
        Some(Response::RequestHeaders(h)) => h.response.as_ref(),
        Some(Response::RequestBody(b)) => b.response.as_ref(),
        other => panic!("not a pick: {other:?}"),
    };
    let set = &common
        .and_then(|c| c.header_mutation.as_ref())
        .expect("a mutation")
        .set_headers;
    let header = set
        .iter()
        .find_map(|o| {
            o.header
                .as_ref()
                .filter(|h| h.key == "x-gateway-destination-endpoint")
        })
        .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned())
        .expect("the header");
    let md = r.dynamic_metadata.as_ref().expect("metadata");
    let Some(Kind::StructValue(lb)) = &md.fields["envoy.lb"].kind else {
        panic!("envoy.lb is a struct");
    };
    let Some(Kind::StringValue(v)) = &lb.fields["x-gateway-destination-endpoint"].kind else {
        panic!("a string");
    };
    (header, v.clone())
}

#[test]
fn a_streamed_exchange_picks_echoes_the_body_and_closes_the_loop() {
    let router = router();
    run(async {
        let mut x = Exchange::new(router.clone());
        let dup = Some(BodySendMode::FullDuplexStreamed);
        assert!(
            feed(&mut x, msg(post(), dup)).await.is_empty(),
            "headers wait for the body"
        );
        let (a, b) = CHAT.split_at(40);
        assert!(
            feed(&mut x, msg(Request::RequestBody(body(a, false)), None))
                .await
                .is_empty()
        );
        let out = feed(&mut x, msg(Request::RequestBody(body(b, true)), None)).await;
        let (header, md) = destination(&out[0]);
        assert_eq!(header, md, "header and metadata never differ");
        let fleet = router.fleet.load();
        let chosen = fleet
            .backends
            .iter()
            .find(|b| b.addr.to_string() == header)
            .expect("a backend");
        assert_eq!(chosen.load.in_flight(), 1);
        // The body goes back whole, as the last chunk.
        let Some(Response::RequestBody(rb)) = &out[1].response else {
            panic!("{:?}", out[1]);
        };
        let echoed = format!(
            "{:?}",
            rb.response.as_ref().and_then(|c| c.body_mutation.as_ref())
        );
        assert!(echoed.contains("end_of_stream: true"), "{echoed}");
        let resp = headers(
            &[(":status", "200"), ("content-type", "text/event-stream")],
            false,
        );
        feed(&mut x, msg(Request::ResponseHeaders(resp), None)).await;
        let out = feed(&mut x, msg(Request::ResponseBody(body(USAGE, true)), None)).await;
        let Some(Response::ResponseBody(_)) = &out[0].response else {
            panic!("{out:?}");
        };
        assert!(x.done());
        assert_eq!(
            chosen.load.in_flight(),
            0,
            "the answer's end gives the count back"
        );
        assert_eq!(
            chosen.feedback.reports(),
            1,
            "its usage reached the closed loop"
        );
    });
}

#[test]
fn buffered_bodies_are_picked_in_the_body_answer() {
    let router = router();
    run(async {
        let mut x = Exchange::new(router.clone());
        let buf = Some(BodySendMode::Buffered);
        let out = feed(&mut x, msg(post(), buf)).await;
        assert!(
            matches!(out[0].response, Some(Response::RequestHeaders(_))),
            "{out:?}"
        );
        let out = feed(&mut x, msg(Request::RequestBody(body(CHAT, true)), None)).await;
        let (header, _) = destination(&out[0]);
        assert!(header.starts_with("127.0.0.1:900"), "{header}");
        assert_eq!(out.len(), 1, "nothing echoed: Envoy kept the body");
    });
}

#[test]
fn a_stream_cut_after_the_pick_gives_the_in_flight_count_back() {
    let router = router();
    run(async {
        let mut x = Exchange::new(router.clone());
        let r = Request::RequestHeaders(headers(
            &[(":method", "GET"), (":path", "/v1/models")],
            true,
        ));
        let out = feed(&mut x, msg(r, None)).await;
        destination(&out[0]);
        let total = |r: &Router| {
            r.fleet
                .load()
                .backends
                .iter()
                .map(|b| b.load.in_flight())
                .sum::<u32>()
        };
        assert_eq!(total(&router), 1);
        drop(x);
        assert_eq!(total(&router), 0);
    });
}

#[test]
fn out_of_order_messages_are_refused_by_name() {
    let router = router();
    run(async {
        let mut x = Exchange::new(router);
        let mut out = Vec::new();
        let e = x
            .on_message(msg(Request::ResponseBody(body(b"x", true)), None), &mut out)
            .await
            .expect_err("a response body first");
        assert!(
            e.message()
                .contains("a response body while waiting for the request headers"),
            "{}",
            e.message()
        );
    });
}

#[test]
fn the_subset_hint_reads_lists_and_comma_separated_strings() {
    let s = |v: &str| Value {
        kind: Some(Kind::StringValue(v.into())),
    };
    let md = |v: Value| Metadata {
        filter_metadata: [(
            "envoy.lb.subset_hint".to_owned(),
            Struct {
                fields: [("x-gateway-destination-endpoint-subset".to_owned(), v)].into(),
            },
        )]
        .into(),
        ..Default::default()
    };
    let list = md(Value {
        kind: Some(Kind::ListValue(ListValue {
            values: vec![s("10.0.0.1:8000"), s("10.0.0.2:8000")],
        })),
    });
    let read = |m: &Metadata| {
        wire::metadata_strings(
            Some(m),
            "envoy.lb.subset_hint",
            "x-gateway-destination-endpoint-subset",
        )
    };
    assert_eq!(
        read(&list),
        Some(vec!["10.0.0.1:8000".into(), "10.0.0.2:8000".into()])
    );
    assert_eq!(
        read(&md(s(" 10.0.0.3:1, ,10.0.0.4:2"))),
        Some(vec!["10.0.0.3:1".into(), "10.0.0.4:2".into()])
    );
    assert_eq!(
        read(&md(s(""))),
        Some(vec![]),
        "present but empty: the protocol's 503"
    );
    assert_eq!(read(&Metadata::default()), None, "absent: any endpoint");
}

#[test]
fn a_subset_naming_no_backend_is_a_503_and_one_naming_one_allows_only_it() {
    let router = router();
    let e = super::pick::subset(&router, Some(&["10.1.1.1:80".into()])).expect_err("none");
    assert_eq!(e.status(), 503);
    let only = super::pick::subset(&router, Some(&["127.0.0.1:9002".into(), "junk".into()]))
        .expect("one")
        .expect("a set");
    assert_eq!(only.iter().collect::<Vec<_>>(), vec![1]);
    assert!(
        super::pick::subset(&router, None)
            .expect("none given")
            .is_none()
    );
}
