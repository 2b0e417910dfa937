//! One error type for the data path (what went wrong, which side caused
//! it), and why a failed attempt may be sent again.

use std::fmt;

/// Who is to blame for an error; decides the log level and the metrics label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The client sent something we refuse (4xx).
    Client,
    /// A backend failed or misbehaved (502/503/504).
    Backend,
    /// The router itself (500).
    Internal,
}

/// What went wrong. Each kind maps to exactly one HTTP status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Malformed request line, header or framing (400).
    BadRequest,
    /// The body is not valid JSON, or lacks the prompt the endpoint needs (400).
    InvalidBody,
    /// No valid API key, with `auth.keys_file` set (401).
    Unauthorized,
    /// The path is not on the traffic port's allowlist (404).
    NotFound,
    /// No backend serves the request's `model` (404, OpenAI's `model_not_found`).
    ModelNotFound,
    /// The request names no `model` and the config wants one (400).
    ModelRequired,
    /// The path is, but not with this method (405).
    MethodNotAllowed,
    /// The request body is over `limits.max_body_bytes` (413).
    BodyTooLarge,
    /// The request head is over `limits.max_header_bytes` (431).
    HeadersTooLarge,
    /// A transfer coding other than `chunked`, or an unknown method (501).
    NotImplemented,
    /// The client took too long to send its request (408).
    ClientTimeout,
    /// No backend could be reached, or a backend answered garbage (502).
    BadGateway,
    /// No healthy backend, or every candidate is at its in-flight limit (503).
    Unavailable,
    /// A `flex` request waited its `classes.flex_wait_ms` for room (429).
    Shed,
    /// The backend did not answer in time (504).
    GatewayTimeout,
    /// A bug or resource failure in the router (500).
    Internal,
}

impl Kind {
    pub fn status(self) -> u16 {
        match self {
            Kind::BadRequest | Kind::InvalidBody | Kind::ModelRequired => 400,
            Kind::Unauthorized => 401,
            Kind::NotFound | Kind::ModelNotFound => 404,
            Kind::MethodNotAllowed => 405,
            Kind::ClientTimeout => 408,
            Kind::BodyTooLarge => 413,
            Kind::HeadersTooLarge => 431,
            Kind::Internal => 500,
            Kind::NotImplemented => 501,
            Kind::Shed => 429,
            Kind::BadGateway => 502,
            Kind::Unavailable => 503,
            Kind::GatewayTimeout => 504,
        }
    }

    pub fn side(self) -> Side {
        match self {
            Kind::BadRequest
            | Kind::InvalidBody
            | Kind::Unauthorized
            | Kind::NotFound
            | Kind::ModelNotFound
            | Kind::ModelRequired
            | Kind::MethodNotAllowed
            | Kind::BodyTooLarge
            | Kind::HeadersTooLarge
            | Kind::NotImplemented
            | Kind::ClientTimeout => Side::Client,
            Kind::BadGateway | Kind::Unavailable | Kind::GatewayTimeout | Kind::Shed => {
                Side::Backend
            }
            Kind::Internal => Side::Internal,
        }
    }

    /// Anthropic's `error.type` for this kind.
    fn anthropic_type(self) -> &'static str {
        match self {
            Kind::NotFound | Kind::ModelNotFound => "not_found_error",
            Kind::Unauthorized => "authentication_error",
            Kind::BodyTooLarge => "request_too_large",
            Kind::Unavailable => "overloaded_error",
            Kind::Shed => "rate_limit_error",
            k => match k.side() {
                Side::Client => "invalid_request_error",
                Side::Backend | Side::Internal => "api_error",
            },
        }
    }

    /// OpenAI's `error.type` for this kind.
    fn openai_type(self) -> &'static str {
        match self.side() {
            Side::Client => "invalid_request_error",
            Side::Backend => "upstream_error",
            Side::Internal => "internal_error",
        }
    }

    /// OpenAI's `error.param` and `error.code` for this kind (the status
    /// when OpenAI has no code for it).
    fn openai_param_code(self) -> (Option<&'static str>, serde_json::Value) {
        match self {
            Kind::ModelNotFound => (Some("model"), "model_not_found".into()),
            Kind::ModelRequired => (Some("model"), "model_required".into()),
            Kind::Unauthorized => (None, "invalid_api_key".into()),
            k => (None, k.status().into()),
        }
    }
}

/// The error body's shape: the API the request was made in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// `{"error": {"message", "type", "param", "code"}}`: OpenAI's, and
    /// every engine's OpenAI-compatible API.
    OpenAi,
    /// `{"type": "error", "error": {"type", "message"}}`: Anthropic's
    /// Messages API (`/v1/messages`).
    Anthropic,
}

impl Shape {
    /// The shape for a request to `path` (normalised).
    pub fn of_path(path: &str) -> Shape {
        let path = path.split('?').next().unwrap_or(path);
        if path == "/v1/messages" || path.starts_with("/v1/messages/") {
            Shape::Anthropic
        } else {
            Shape::OpenAi
        }
    }
}

/// Why a request is sent again; the `reason` label of
/// `prefix_router_resends_total`. A re-send is only ever of a request no
/// backend can have processed (the delivery rule in ARCHITECTURE.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Resend {
    /// A pooled connection failed before the request was written whole: the
    /// same backend, on a fresh connection.
    StalePooled,
    /// Connecting to the backend failed or timed out: the next candidate.
    ConnectFailed,
    /// A fresh connection broke before the request was written whole: the
    /// next candidate.
    WriteFailed,
}

impl Resend {
    pub const ALL: [Resend; 3] = [
        Resend::StalePooled,
        Resend::ConnectFailed,
        Resend::WriteFailed,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Resend::StalePooled => "stale_pooled",
            Resend::ConnectFailed => "connect_failed",
            Resend::WriteFailed => "write_failed",
        }
    }

    /// Whether the backend is to blame (a pooled connection its keep-alive
    /// timeout closed is not its fault).
    pub fn blames_backend(self) -> bool {
        self != Resend::StalePooled
    }
}

/// An error on the data path, answered to the client as OpenAI-shaped JSON.
#[derive(Debug)]
pub struct RouterError {
    pub kind: Kind,
    /// A message a person can act on; sent to the client, so it names no
    /// backend address and no OS error.
    pub message: String,
    /// What only the operator should see (backend URL, OS error): logged,
    /// and sent to the client only with `debug_headers`.
    pub detail: Option<String>,
}

impl RouterError {
    pub fn new(kind: Kind, message: impl Into<String>) -> Self {
        RouterError {
            kind,
            message: message.into(),
            detail: None,
        }
    }

    /// Adds what only the operator should see (see `detail`).
    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    pub fn status(&self) -> u16 {
        self.kind.status()
    }

    /// The whole HTTP response for this error, OpenAI-shaped. `close` adds
    /// `connection: close` (after framing errors the byte stream can no
    /// longer be trusted); `debug` (`debug_headers`) appends the detail to
    /// the message.
    pub fn to_response(&self, close: bool, retry_after: Option<u32>, debug: bool) -> Vec<u8> {
        self.to_response_in(Shape::OpenAi, close, retry_after, debug)
    }

    /// [`RouterError::to_response`] in the shape of the request's API.
    pub fn to_response_in(
        &self,
        shape: Shape,
        close: bool,
        retry_after: Option<u32>,
        debug: bool,
    ) -> Vec<u8> {
        let message = match &self.detail {
            Some(d) if debug => format!("{}: {d}", self.message),
            _ => self.message.clone(),
        };
        let body = match shape {
            Shape::OpenAi => {
                let (param, code) = self.kind.openai_param_code();
                serde_json::json!({
                    "error": {
                        "message": message,
                        "type": self.kind.openai_type(),
                        "param": param,
                        "code": code,
                    }
                })
            }
            Shape::Anthropic => serde_json::json!({
                "type": "error",
                "error": {"type": self.kind.anthropic_type(), "message": message},
            }),
        }
        .to_string();
        let mut out = Vec::with_capacity(body.len() + 160);
        out.extend_from_slice(
            format!(
                "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
                self.status(),
                reason(self.status()),
                body.len()
            )
            .as_bytes(),
        );
        if let Some(secs) = retry_after {
            out.extend_from_slice(format!("retry-after: {secs}\r\n").as_bytes());
        }
        if close {
            out.extend_from_slice(b"connection: close\r\n");
        }
        out.extend_from_slice(b"x-prefix-router-error: 1\r\n\r\n");
        out.extend_from_slice(body.as_bytes());
        out
    }
}

impl fmt::Display for RouterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.detail {
            Some(d) => write!(f, "{}: {d} ({})", self.message, self.status()),
            None => write!(f, "{} ({})", self.message, self.status()),
        }
    }
}

impl std::error::Error for RouterError {}

/// The reason phrase for the statuses the router itself produces.
pub fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Content Too Large",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_messages_api_gets_anthropics_error_shape() {
        let e = RouterError::new(Kind::InvalidBody, "'messages' is required");
        let resp =
            String::from_utf8(e.to_response_in(Shape::Anthropic, false, None, false)).unwrap();
        let body = resp.split_once("\r\n\r\n").unwrap().1;
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["message"], "'messages' is required");
        assert_eq!(Shape::of_path("/v1/messages"), Shape::Anthropic);
        assert_eq!(Shape::of_path("/v1/responses"), Shape::OpenAi);
        let busy = RouterError::new(Kind::Unavailable, "busy");
        let resp = String::from_utf8(busy.to_response_in(Shape::Anthropic, false, Some(1), false))
            .unwrap();
        assert!(resp.contains("overloaded_error"), "{resp}");
    }

    #[test]
    fn error_response_is_openai_shaped_json() {
        let e = RouterError::new(Kind::BodyTooLarge, "body is 5 bytes, the limit is 4");
        let resp = String::from_utf8(e.to_response(true, None, false)).unwrap();
        assert!(resp.starts_with("HTTP/1.1 413 Content Too Large\r\n"));
        assert!(resp.contains("connection: close\r\n"));
        let body = resp.split("\r\n\r\n").nth(1).unwrap();
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], 413);
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["message"], "body is 5 bytes, the limit is 4");
    }

    #[test]
    fn details_reach_the_client_only_in_debug_mode() {
        let e = RouterError::new(Kind::BadGateway, "cannot connect to the backend")
            .with_detail("http://10.0.0.7:8000: Connection refused (os error 111)");
        let plain = String::from_utf8(e.to_response(false, None, false)).unwrap();
        assert!(
            !plain.contains("10.0.0.7") && !plain.contains("os error"),
            "{plain}"
        );
        let debug = String::from_utf8(e.to_response(false, None, true)).unwrap();
        assert!(debug.contains("10.0.0.7:8000"), "{debug}");
        assert!(
            e.to_string().contains("os error 111"),
            "logs keep the detail"
        );
    }
}
