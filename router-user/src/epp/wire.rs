//! Envoy's ext_proc messages, read and written: headers in and out, the
//! metadata the protocol names, immediate responses. No routing here.

use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap, HeaderValue, HeaderValueOption, Metadata, header_value_option::HeaderAppendAction,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingResponse, StreamedBodyResponse, body_mutation, processing_response::Response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};

use crate::error::RouterError;

/// A header's value: Envoy sends `raw_value` (bytes), older ones `value`.
pub fn value(h: &HeaderValue) -> &[u8] {
    if h.raw_value.is_empty() {
        h.value.as_bytes()
    } else {
        &h.raw_value
    }
}

/// The value of header `name` (lower case, as Envoy sends them).
pub fn header<'a>(map: Option<&'a HeaderMap>, name: &str) -> Option<&'a [u8]> {
    map?.headers.iter().find(|h| h.key == name).map(value)
}

/// The headers (not the pseudo-headers) as the lines of an HTTP/1 head,
/// after a placeholder request line, for the head readers the proxy uses
/// (`http::request::header_value`, `api_key`).
pub fn as_head(map: Option<&HeaderMap>, out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(b"- - -\r\n");
    for h in map.iter().flat_map(|m| &m.headers) {
        if h.key.starts_with(':') {
            continue;
        }
        out.extend_from_slice(h.key.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value(h));
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// The strings under `namespace`.`key` of a metadata: a list of strings,
/// or one string holding a comma-separated list. `None`: the key is absent.
pub fn metadata_strings(md: Option<&Metadata>, namespace: &str, key: &str) -> Option<Vec<String>> {
    let v = md?.filter_metadata.get(namespace)?.fields.get(key)?;
    let mut out = Vec::new();
    match &v.kind {
        Some(Kind::ListValue(l)) => {
            for item in &l.values {
                if let Some(Kind::StringValue(s)) = &item.kind {
                    out.extend(split_list(s));
                }
            }
        }
        Some(Kind::StringValue(s)) => out.extend(split_list(s)),
        _ => {}
    }
    Some(out)
}

fn split_list(s: &str) -> impl Iterator<Item = String> + '_ {
    s.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(str::to_owned)
}

/// Sets (overwriting) a header.
pub fn set_header(key: &str, value: &[u8]) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            value: String::new(),
            raw_value: value.to_vec(),
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

/// `{namespace: {key: value}}`, the dynamic metadata the picked endpoints go in.
pub fn dynamic_metadata(namespace: &str, key: &str, value: &str) -> Struct {
    let inner = Struct {
        fields: [(
            key.to_owned(),
            Value {
                kind: Some(Kind::StringValue(value.to_owned())),
            },
        )]
        .into(),
    };
    Struct {
        fields: [(
            namespace.to_owned(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
        .into(),
    }
}

/// Lets a phase go on unchanged, or with `mutation` of its headers.
pub fn common(mutation: Option<HeaderMutation>) -> CommonResponse {
    CommonResponse {
        header_mutation: mutation,
        ..Default::default()
    }
}

pub fn request_headers(c: CommonResponse) -> ProcessingResponse {
    respond(Response::RequestHeaders(HeadersResponse {
        response: Some(c),
    }))
}

pub fn response_headers() -> ProcessingResponse {
    respond(Response::ResponseHeaders(HeadersResponse {
        response: Some(common(None)),
    }))
}

pub fn request_body(c: CommonResponse) -> ProcessingResponse {
    respond(Response::RequestBody(BodyResponse { response: Some(c) }))
}

/// A body chunk sent on (full-duplex streaming: the picker sends the body).
pub fn streamed_body(request: bool, body: Vec<u8>, end_of_stream: bool) -> ProcessingResponse {
    let c = CommonResponse {
        body_mutation: Some(BodyMutation {
            mutation: Some(body_mutation::Mutation::StreamedResponse(
                StreamedBodyResponse {
                    body,
                    end_of_stream,
                    ..Default::default()
                },
            )),
        }),
        ..Default::default()
    };
    if request {
        request_body(c)
    } else {
        respond(Response::ResponseBody(BodyResponse { response: Some(c) }))
    }
}

/// A body chunk let through as it is (the other body modes).
pub fn body_continue(request: bool) -> ProcessingResponse {
    let b = BodyResponse {
        response: Some(common(None)),
    };
    respond(if request {
        Response::RequestBody(b)
    } else {
        Response::ResponseBody(b)
    })
}

pub fn trailers(request: bool) -> ProcessingResponse {
    let t = Default::default();
    respond(if request {
        Response::RequestTrailers(t)
    } else {
        Response::ResponseTrailers(t)
    })
}

/// The router's own answer instead of any backend's: its status and the
/// OpenAI-shaped error body the proxy answers with.
pub fn immediate(e: &RouterError, retry_after: Option<u32>) -> ProcessingResponse {
    let raw = e.to_response(false, retry_after, false);
    let split = memchr::memmem::find(&raw, b"\r\n\r\n").map_or(raw.len(), |i| i + 4);
    let mut set = vec![set_header("content-type", b"application/json")];
    if let Some(s) = retry_after {
        set.push(set_header("retry-after", s.to_string().as_bytes()));
    }
    respond(Response::ImmediateResponse(ImmediateResponse {
        status: Some(HttpStatus {
            code: i32::from(e.status()),
        }),
        headers: Some(HeaderMutation {
            set_headers: set,
            ..Default::default()
        }),
        body: raw[split..].to_vec(),
        details: format!("prefix_router_epp_{}", e.status()),
        ..Default::default()
    }))
}

fn respond(r: Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(r),
        ..Default::default()
    }
}
