//! Anthropic's Messages API (`POST /v1/messages`) as vLLM serves it: the
//! request turned into the chat it stands for ([`conversation`]), run as a
//! chat completion, answered in Anthropic's shapes.
//!
//! The conversion follows vLLM's: `system` (a string, or text blocks joined
//! with nothing, blocks starting with `x-anthropic-billing-header` left out
//! because their per-request hash would defeat prefix caching) and any
//! `system` message become one leading system message; a user's
//! `tool_result` blocks become `tool` messages placed before the rest of
//! that user message, an assistant's `tool_use` blocks its tool calls
//! (`input` as JSON text); `tools` become functions (`input_schema` as
//! their parameters, `"type":"object"` when it has no type).
//!
//! The answer: `id` (vLLM gives the chat completion's, `chatcmpl-…`),
//! `type` `message`, `role`, `model`, `content` (one text block),
//! `stop_reason` (`max_tokens`: the engine always generates `max_tokens`),
//! `stop_sequence` (null) and `usage` with `input_tokens` (the prompt less
//! the cached tokens, Anthropic's contract), `output_tokens`,
//! `cache_creation_input_tokens` (0: vLLM counts only reads) and
//! `cache_read_input_tokens`. Streams are SSE with named events:
//! `message_start` (usage: the whole prompt as input, 0 output),
//! `ping` (Anthropic's API sends one; vLLM does not: what passes streams
//! through must let it by), `content_block_start`, one `content_block_delta` (`text_delta`)
//! per token, `content_block_stop`, `message_delta` (`stop_reason` and the
//! final usage), `message_stop`. Errors are `{"type":"error","error":
//! {"type","message"}}` with Anthropic's type for the status.
//!
//! Accepted and not simulated: `temperature`, `top_p`, `top_k`,
//! `stop_sequences`, `metadata`, `tool_choice`, images (opaque to the
//! simulated template).
//!
//! [`conversation`]: super::conversation

use super::api::{self, ApiError, ApiKind, Job, Responder};
use super::conversation::{ChatMessage, Conversation, Tool, ToolCall};
use serde::Deserialize;
use serde_json::{Value, json};
use std::borrow::Cow;
use std::io::Write;

#[derive(Deserialize)]
#[serde(untagged)]
enum Content<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    Blocks(#[serde(borrow)] Vec<Block<'a>>),
}

/// A content block; which fields matter depends on `type`.
#[derive(Deserialize)]
struct Block<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    input: Option<Value>,
    #[serde(default)]
    tool_use_id: Option<String>,
    /// A `tool_result`'s content: a string or blocks.
    #[serde(default)]
    content: Option<Value>,
    #[serde(default)]
    source: Option<Value>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow)]
    role: Cow<'a, str>,
    #[serde(borrow)]
    content: Content<'a>,
}

#[derive(Deserialize)]
struct AnthropicTool {
    name: String,
    #[serde(default)]
    description: Option<String>,
    input_schema: Value,
}

#[derive(Deserialize)]
struct MessagesRequest<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow)]
    messages: Vec<Message<'a>>,
    #[serde(default)]
    max_tokens: Option<i64>,
    #[serde(borrow, default)]
    system: Option<Content<'a>>,
    #[serde(default)]
    tools: Option<Vec<AnthropicTool>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    priority: Option<i64>,
}

/// Parses a Messages request into the job it runs.
pub fn parse(body: &[u8], models: &[String]) -> Result<Job, ApiError> {
    let r: MessagesRequest = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("Invalid request body: {e}")))?;
    let model = match r.model.as_deref() {
        None | Some("") => return Err(ApiError::bad_request("Field required: model")),
        Some(m) => api::model_index(Some(m), models)?,
    };
    let max_tokens = match r.max_tokens {
        None => return Err(ApiError::bad_request("Field required: max_tokens")),
        Some(n) if n <= 0 => return Err(ApiError::bad_request("max_tokens must be positive")),
        Some(n) => api::max_tokens(Some(n), 1)?,
    };
    if r.messages.is_empty() {
        return Err(ApiError::bad_request(
            "messages must contain at least one item",
        ));
    }
    if r.messages
        .iter()
        .any(|m| matches!(&m.content, Content::Blocks(b) if b.is_empty()))
    {
        return Err(ApiError::bad_request("message content must not be empty"));
    }
    let stream = r.stream.unwrap_or(false);
    let priority = r.priority.unwrap_or(0);
    let tokens = conversation(r)
        .tokens(true)
        .map_err(ApiError::bad_request)?;
    Ok(Job {
        kind: ApiKind::Messages,
        model,
        tokens,
        max_tokens,
        stream,
        include_usage: true,
        cache_salt: None,
        priority,
    })
}

/// Whether a system block is left out: Claude Code's attribution header
/// carries a hash that changes per request.
fn skipped_system_text(t: &str) -> bool {
    t.is_empty() || t.starts_with("x-anthropic-billing-header")
}

/// The chat a Messages request stands for.
fn conversation(r: MessagesRequest<'_>) -> Conversation<'_> {
    let mut system = String::new();
    let mut add_system = |c: &Content<'_>| match c {
        Content::Text(s) => system.push_str(s),
        Content::Blocks(blocks) => {
            for b in blocks {
                if let (true, Some(t)) = (b.kind == "text", b.text.as_deref())
                    && !skipped_system_text(t)
                {
                    system.push_str(t);
                }
            }
        }
    };
    if let Some(s) = &r.system {
        add_system(s);
    }
    for m in r.messages.iter().filter(|m| m.role == "system") {
        add_system(&m.content);
    }
    let mut out = Vec::with_capacity(r.messages.len() + 1);
    if !system.is_empty() {
        out.push(ChatMessage::text("system", system));
    }
    for m in r.messages {
        if m.role == "system" {
            continue;
        }
        match m.content {
            Content::Text(s) => out.push(ChatMessage::text(m.role, s)),
            Content::Blocks(blocks) => push_blocks(&mut out, m.role, blocks),
        }
    }
    let tools = r
        .tools
        .unwrap_or_default()
        .into_iter()
        .map(|t| {
            let mut schema = t.input_schema;
            if let Some(o) = schema.as_object_mut() {
                o.entry("type").or_insert_with(|| "object".into());
            }
            Tool {
                name: t.name,
                description: t.description,
                parameters: schema,
            }
        })
        .collect();
    Conversation {
        messages: out,
        tools,
    }
}

/// One message of blocks: its tool results first (each a `tool` message),
/// then the message itself, unless a user message kept nothing else.
fn push_blocks<'a>(out: &mut Vec<ChatMessage<'a>>, role: Cow<'a, str>, blocks: Vec<Block<'a>>) {
    let mut texts: Vec<Cow<'a, str>> = Vec::new();
    let mut parts = 0;
    let mut tool_calls = Vec::new();
    for b in blocks {
        match &*b.kind {
            "text" => {
                if let Some(t) = b.text.filter(|t| !t.is_empty()) {
                    texts.push(t);
                    parts += 1;
                }
            }
            "image" if b.source.is_some() => parts += 1,
            // Reasoning is given to the template apart; the simulated
            // one does not render it.
            "thinking" => {}
            "tool_use" => tool_calls.push(ToolCall {
                id: b.id.unwrap_or_default(),
                name: b.name.unwrap_or_default(),
                arguments: b.input.unwrap_or_else(|| json!({})).to_string(),
            }),
            "tool_result" if role == "user" => {
                let (text, images) = tool_result_text(b.content.as_ref());
                out.push(ChatMessage {
                    tool_call_id: Some(b.tool_use_id.unwrap_or_default()),
                    ..ChatMessage::text("tool", text)
                });
                if images {
                    out.push(ChatMessage::text("user", ""));
                }
            }
            "tool_result" => {
                let text = match &b.content {
                    Some(Value::String(s)) => s.clone(),
                    Some(v) if !v.is_null() => v.to_string(),
                    _ => String::new(),
                };
                texts.push(Cow::Owned(format!("Tool result: {text}")));
                parts += 1;
            }
            _ => {}
        }
    }
    // A user message left with no content part (only tool results, say)
    // is not sent; an assistant's is, with its tool calls.
    if parts == 0 && role == "user" {
        return;
    }
    let content = if texts.len() == 1 {
        texts.pop().unwrap_or_default()
    } else {
        Cow::Owned(api::join_text(texts.iter().map(|t| &**t)))
    };
    out.push(ChatMessage {
        tool_calls,
        ..ChatMessage::text(role, content)
    });
}

/// A `tool_result`'s text (text blocks joined with `\n`) and whether it
/// carried images (they become a user message of their own).
fn tool_result_text(content: Option<&Value>) -> (String, bool) {
    match content {
        Some(Value::String(s)) => (s.clone(), false),
        Some(Value::Array(items)) => {
            let texts = items
                .iter()
                .filter(|i| i["type"] == "text")
                .map(|i| i["text"].as_str().unwrap_or(""));
            let images = items.iter().any(|i| i["type"] == "image");
            (api::join_text(texts), images)
        }
        _ => (String::new(), false),
    }
}

/// Anthropic's error type for an HTTP status.
fn error_type(status: u16) -> &'static str {
    match status {
        400 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    }
}

/// `{"type":"error","error":{"type","message"}}`.
pub fn error_body(e: &ApiError) -> Vec<u8> {
    serde_json::to_vec(&json!({"type": "error", "error": {
        "type": error_type(e.status), "message": e.message,
    }}))
    .unwrap_or_default()
}

impl Responder<'_> {
    /// The message's `id`, as vLLM gives it: the chat completion's.
    fn message_id(&self) -> String {
        format!("chatcmpl-{:016x}", self.id)
    }

    /// The final `usage` object.
    fn messages_usage(&self, out: &mut Vec<u8>, cached: u32) {
        let _ = write!(
            out,
            r#"{{"input_tokens":{},"output_tokens":{},"cache_creation_input_tokens":0,"cache_read_input_tokens":{}}}"#,
            self.prompt_tokens.saturating_sub(cached as usize),
            self.max_tokens,
            self.cached(cached),
        );
    }

    /// The whole non-streaming answer.
    pub(super) fn messages_body(&self, cached: u32) -> Vec<u8> {
        let text = self.text(0, self.max_tokens);
        let mut o = Vec::with_capacity(text.len() + 384);
        let _ = write!(
            o,
            r#"{{"id":"{}","type":"message","role":"assistant","model":{},"content":[{{"type":"text","text":"{text}"}}],"stop_reason":"max_tokens","stop_sequence":null,"usage":"#,
            self.message_id(),
            self.model_json,
        );
        self.messages_usage(&mut o, cached);
        o.push(b'}');
        o
    }

    /// `message_start`, `ping` and the text block's `content_block_start`.
    pub(super) fn messages_start_events(&self, events: &mut Vec<Vec<u8>>) {
        let mut e = b"event: message_start\ndata: ".to_vec();
        let _ = write!(
            e,
            r#"{{"type":"message_start","message":{{"id":"{}","type":"message","role":"assistant","model":{},"content":[],"stop_reason":null,"stop_sequence":null,"usage":{{"input_tokens":{},"output_tokens":0}}}}}}"#,
            self.message_id(),
            self.model_json,
            self.prompt_tokens,
        );
        e.extend_from_slice(b"\n\n");
        events.push(e);
        events.push(b"event: ping\ndata: {\"type\":\"ping\"}\n\n".to_vec());
        events.push(
            b"event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n"
                .to_vec(),
        );
    }

    /// One token's `content_block_delta`.
    pub(super) fn messages_delta_event(&self, i: u32) -> Vec<u8> {
        let mut e = Vec::with_capacity(128);
        let _ = write!(
            e,
            "event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"text_delta\",\"text\":\"{}\"}}}}\n\n",
            self.text(i, i + 1)
        );
        e
    }

    /// `content_block_stop`, `message_delta` (stop reason, final usage),
    /// `message_stop`.
    pub(super) fn messages_final_events(&self, events: &mut Vec<Vec<u8>>, cached: u32) {
        events.push(
            b"event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n"
                .to_vec(),
        );
        let mut e = b"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"max_tokens\",\"stop_sequence\":null},\"usage\":".to_vec();
        self.messages_usage(&mut e, cached);
        e.extend_from_slice(b"}\n\n");
        events.push(e);
        events.push(b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n".to_vec());
    }
}

#[cfg(test)]
mod tests;
