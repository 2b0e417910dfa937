//! OpenAI's Responses API (`/v1/responses`) as vLLM serves it: the request
//! turned into the chat it stands for ([`conversation`]), run as a chat
//! completion, answered as a `response` object; stored responses in this
//! process's memory ([`Store`]) for `previous_response_id`, retrieval and
//! cancelling.
//!
//! The conversion follows vLLM's: `instructions` first as a system message;
//! with `previous_response_id`, the stored response's messages (its system
//! messages left out: instructions do not carry over) and its output text
//! as assistant messages; then `input`, a string (one user message) or
//! items: messages (string content, or parts whose `text` is joined with
//! `\n`), `function_call` (a tool call, joined to the assistant message
//! before it), `function_call_output` (a `tool` message); `tools` of type
//! `function` as functions. `prompt_cache_key`, like vLLM's `cache_salt`
//! (which wins when both are given), salts the first block's hash: a
//! different key, a different cache namespace. (vLLM itself accepts
//! `prompt_cache_key` and ignores it.)
//!
//! The answer is a `response` object: `id` (`resp_…`, first in the body),
//! `object`, `created_at`, `status` (`incomplete` with `incomplete_details`
//! `{"reason":"max_output_tokens"}`, as vLLM reports a generation cut by
//! its token limit, which every simulated one is), `model`, `output` (one
//! `message` item with one `output_text` part), `usage` (`input_tokens`,
//! `input_tokens_details.cached_tokens`, `output_tokens`,
//! `output_tokens_details.reasoning_tokens`, `total_tokens`), the request's
//! settings echoed (`instructions`, `previous_response_id`, `store`,
//! `background`, `max_output_tokens`, `tools`, `metadata`...). Streams are
//! SSE with named events, each data object carrying `type` and
//! `sequence_number` (from 0): `response.created` and
//! `response.in_progress` (the response, `in_progress`, its `id` already
//! final), `response.output_item.added`, `response.content_part.added`,
//! one `response.output_text.delta` per token, `response.output_text.done`,
//! `response.content_part.done`, `response.output_item.done`,
//! `response.completed` (the final response, whatever its status, as vLLM
//! sends it).
//!
//! `store` defaults to true (vLLM stores only when started with
//! `VLLM_ENABLE_RESPONSES_API_STORE=1`; this engine always can). A response
//! is stored when its generation ends, or at once with status `queued` when
//! `background` is set (then it runs without the connection). Errors are
//! OpenAI's shape; an unknown id is a 404 `invalid_request_error` with
//! `param` `response_id` and the message `Response with id '…' not found.`
//! Cancelling answers the cancelled response while it is queued or in
//! progress, else 400 `Cannot cancel a synchronous response.`, as vLLM.
//! `GET /v1/responses/{id}/input_items` (which vLLM does not serve) lists
//! the request's input items as OpenAI does; `DELETE` is a 405, as on
//! vLLM. Not simulated: streaming a background response (a 400 here),
//! resuming a stream (`GET ...?stream=true`), reasoning items (accepted,
//! not rendered), `include`, `text.format`, `truncation`.

use super::api::{self, ApiError, ApiKind, Job};
use super::conversation::{ChatMessage, Conversation, Tool, ToolCall};
use super::output_text;
use serde::Deserialize;
use serde_json::{Value, json};
use std::borrow::Cow;

#[derive(Deserialize)]
struct ResponsesRequest {
    #[serde(default)]
    model: Option<String>,
    input: Value,
    #[serde(default)]
    instructions: Option<String>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    store: Option<bool>,
    #[serde(default)]
    previous_response_id: Option<String>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    background: Option<bool>,
    #[serde(default)]
    max_output_tokens: Option<i64>,
    #[serde(default)]
    prompt_cache_key: Option<String>,
    #[serde(default)]
    cache_salt: Option<String>,
    #[serde(default)]
    priority: Option<i64>,
    #[serde(default)]
    metadata: Option<Value>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
    #[serde(default)]
    text: Option<Value>,
    #[serde(default)]
    reasoning: Option<Value>,
    #[serde(default)]
    truncation: Option<String>,
    #[serde(default)]
    service_tier: Option<String>,
}

/// What a response's renderings need from its request: ids, the settings
/// it echoes, and for the store the chat it ran and its input items.
#[derive(Debug)]
pub struct Ctx {
    pub id: String,
    /// The output message item's id.
    pub item_id: String,
    pub created_at: u64,
    pub store: bool,
    pub background: bool,
    pub max_output_tokens: u32,
    /// The other echoed settings, each as JSON text, in vLLM's order
    /// around the fields written per rendering.
    echo: Echo,
    /// The chat this request ran (a later `previous_response_id` goes on
    /// from it).
    messages: Vec<ChatMessage<'static>>,
    /// The request's `input` as items (`input_items`).
    input_items: Vec<Value>,
}

#[derive(Debug)]
struct Echo {
    instructions: String,
    metadata: String,
    model: String,
    parallel_tool_calls: bool,
    temperature: String,
    tool_choice: String,
    tools: String,
    top_p: String,
    previous_response_id: String,
    reasoning: String,
    service_tier: String,
    text: String,
    truncation: String,
    user: String,
}

/// A response's state: `queued` (background, not done) or `in_progress`
/// (streaming), then `incomplete` (every simulated generation ends at its
/// token limit), `cancelled`, or `failed` (a background run the engine
/// could not finish).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Queued,
    InProgress,
    Incomplete,
    Cancelled,
    Failed,
}

impl Status {
    fn as_str(self) -> &'static str {
        match self {
            Status::Queued => "queued",
            Status::InProgress => "in_progress",
            Status::Incomplete => "incomplete",
            Status::Cancelled => "cancelled",
            Status::Failed => "failed",
        }
    }
}

/// Token counts of a finished response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Usage {
    pub input: usize,
    /// The cached-token count as written (a fault may write other text).
    pub cached: String,
    pub output: u32,
}

/// What a response has produced so far.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub status: Status,
    pub text: Option<String>,
    pub usage: Option<Usage>,
}

impl Outcome {
    /// A background response not run yet.
    pub fn queued() -> Outcome {
        Outcome {
            status: Status::Queued,
            text: None,
            usage: None,
        }
    }

    /// A background response the engine could not run.
    pub fn failed() -> Outcome {
        Outcome {
            status: Status::Failed,
            text: None,
            usage: None,
        }
    }

    /// A finished generation of `max_tokens` tokens for a prompt of
    /// `prompt_tokens` with digest `digest`, `cached` written as the cached
    /// count: `incomplete`, as vLLM reports a generation its token limit
    /// ended.
    pub fn finished(digest: u64, prompt_tokens: usize, max_tokens: u32, cached: String) -> Outcome {
        let mut text = String::with_capacity(4 * max_tokens as usize);
        output_text::push_text(&mut text, digest, 0, max_tokens);
        Outcome {
            status: Status::Incomplete,
            text: Some(text),
            usage: Some(Usage {
                input: prompt_tokens,
                cached,
                output: max_tokens,
            }),
        }
    }
}

fn random_hex() -> String {
    format!("{:032x}", rand::random::<u128>())
}

fn json_text(v: &impl serde::Serialize) -> String {
    serde_json::to_string(v).unwrap_or_else(|_| "null".into())
}

fn not_found(id: &str) -> ApiError {
    ApiError {
        status: 404,
        kind: "invalid_request_error",
        message: format!("Response with id '{id}' not found."),
        param: Some("response_id"),
    }
}

fn invalid(message: impl Into<String>, param: &'static str) -> ApiError {
    ApiError {
        status: 400,
        kind: "invalid_request_error",
        message: message.into(),
        param: Some(param),
    }
}

/// Parses a Responses request into the job it runs and its context; a
/// `previous_response_id` is looked up in `store`.
pub fn parse(
    body: &[u8],
    models: &[String],
    default_max: u32,
    store: &Store,
) -> Result<(Job, Ctx), ApiError> {
    let r: ResponsesRequest = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("Invalid request body: {e}")))?;
    let model = api::model_index(r.model.as_deref(), models)?;
    let keep = r.store.unwrap_or(true);
    let background = r.background.unwrap_or(false);
    let stream = r.stream.unwrap_or(false);
    if background && !keep {
        return Err(invalid(
            "background can only be used when `store` is true",
            "background",
        ));
    }
    if background && stream {
        return Err(invalid(
            "sim-engine does not stream background responses",
            "background",
        ));
    }
    let previous = match &r.previous_response_id {
        Some(id) => Some(store.chain(id).ok_or_else(|| not_found(id))?),
        None => None,
    };
    let max_tokens = api::max_tokens(r.max_output_tokens, default_max)?;

    let mut messages = Vec::new();
    if let Some(i) = r.instructions.as_deref().filter(|i| !i.is_empty()) {
        messages.push(ChatMessage::text("system", i.to_owned()));
    }
    if let Some((prev, output)) = previous {
        messages.extend(prev.into_iter().filter(|m| m.role != "system"));
        messages.extend(output.map(|t| ChatMessage::text("assistant", t)));
    }
    let input_items = match &r.input {
        Value::String(s) => {
            messages.push(ChatMessage::text("user", s.clone()));
            vec![
                json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": s}]}),
            ]
        }
        Value::Array(items) => {
            push_items(&mut messages, items)?;
            items.clone()
        }
        _ => {
            return Err(invalid(
                "input must be a string or a list of items",
                "input",
            ));
        }
    };
    let input_items = input_items.into_iter().map(with_item_id).collect();
    let tools: Vec<Tool> = r
        .tools
        .iter()
        .flatten()
        .filter(|t| t["type"] == "function")
        .filter_map(|t| {
            Some(Tool {
                name: t["name"].as_str()?.to_owned(),
                description: t["description"].as_str().map(str::to_owned),
                parameters: t.get("parameters").cloned().unwrap_or(Value::Null),
            })
        })
        .collect();
    let conv = Conversation { messages, tools };
    let tokens = conv.tokens(true).map_err(ApiError::bad_request)?;
    let has_tools = r.tools.as_ref().is_some_and(|t| !t.is_empty());
    let echo = Echo {
        instructions: json_text(&r.instructions),
        metadata: json_text(&r.metadata),
        model: json_text(&models[model]),
        parallel_tool_calls: r.parallel_tool_calls.unwrap_or(true),
        temperature: json_text(&r.temperature.unwrap_or(1.0)),
        tool_choice: match (&r.tool_choice, has_tools) {
            (Some(c), true) => json_text(c),
            (None, true) => "\"auto\"".into(),
            (_, false) => "\"none\"".into(),
        },
        tools: json_text(&r.tools.unwrap_or_default()),
        top_p: json_text(&r.top_p.unwrap_or(1.0)),
        previous_response_id: json_text(&r.previous_response_id),
        reasoning: json_text(&r.reasoning),
        service_tier: json_text(&r.service_tier.unwrap_or_else(|| "auto".into())),
        text: json_text(&r.text),
        truncation: json_text(&r.truncation.unwrap_or_else(|| "disabled".into())),
        user: json_text(&r.user),
    };
    let ctx = Ctx {
        id: format!("resp_{}", random_hex()),
        item_id: format!("msg_{}", random_hex()),
        created_at: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        store: keep,
        background,
        max_output_tokens: max_tokens,
        echo,
        messages: conv.messages,
        input_items,
    };
    let job = Job {
        kind: ApiKind::Responses,
        model,
        tokens,
        max_tokens,
        stream,
        include_usage: true,
        cache_salt: r.cache_salt.or(r.prompt_cache_key),
        priority: r.priority.unwrap_or(0),
    };
    Ok((job, ctx))
}

/// An input item with an `id` (`input_items` lists every item with one).
fn with_item_id(mut item: Value) -> Value {
    if let Some(o) = item.as_object_mut()
        && !o.contains_key("id")
    {
        let prefix = match o.get("type").and_then(Value::as_str) {
            Some("function_call") => "fc",
            Some("function_call_output") => "fco",
            _ => "msg",
        };
        o.insert("id".into(), format!("{prefix}_{}", random_hex()).into());
        o.entry("type").or_insert_with(|| "message".into());
    }
    item
}

/// The text of a message item's content: a string, or its parts' `text`
/// joined with `\n`.
fn content_text(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => api::join_text(parts.iter().filter_map(|p| p["text"].as_str())),
        _ => String::new(),
    }
}

/// Appends the chat messages of input `items`, as vLLM builds them.
fn push_items(out: &mut Vec<ChatMessage<'static>>, items: &[Value]) -> Result<(), ApiError> {
    // Whether the last message is an assistant's whose content is unset
    // (made for a tool call): an assistant text then fills it.
    let mut open_assistant = false;
    for item in items {
        let last_is_assistant = out.last().is_some_and(|m| m.role == "assistant");
        let kind = item["type"].as_str();
        let role = item["role"].as_str();
        match (kind, role) {
            (Some("function_call"), _) => {
                let call = ToolCall {
                    id: item["call_id"].as_str().unwrap_or("").to_owned(),
                    name: item["name"].as_str().unwrap_or("").to_owned(),
                    arguments: item["arguments"].as_str().unwrap_or("").to_owned(),
                };
                match out.last_mut() {
                    Some(m) if last_is_assistant => m.tool_calls.push(call),
                    _ => {
                        out.push(ChatMessage {
                            tool_calls: vec![call],
                            ..ChatMessage::text("assistant", "")
                        });
                        open_assistant = true;
                    }
                }
            }
            (Some("function_call_output"), _) => {
                let output = match &item["output"] {
                    Value::String(s) => s.clone(),
                    v => content_text(v),
                };
                out.push(ChatMessage {
                    tool_call_id: item["call_id"].as_str().map(str::to_owned),
                    ..ChatMessage::text("tool", output)
                });
                open_assistant = false;
            }
            // Reasoning is given to the template apart; the simulated one
            // does not render it.
            (Some("reasoning"), _) => {}
            (_, Some("assistant")) => {
                let text = match &item["content"] {
                    Value::Array(parts) => parts
                        .first()
                        .and_then(|p| p["text"].as_str())
                        .unwrap_or("")
                        .to_owned(),
                    c => content_text(c),
                };
                match out.last_mut() {
                    Some(m) if last_is_assistant && open_assistant => {
                        m.content = Cow::Owned(text);
                    }
                    _ => out.push(ChatMessage::text("assistant", text)),
                }
                open_assistant = false;
            }
            (_, Some(role)) => {
                out.push(ChatMessage::text(
                    role.to_owned(),
                    content_text(&item["content"]),
                ));
                open_assistant = false;
            }
            _ => {
                return Err(invalid(format!("unsupported input item: {item}"), "input"));
            }
        }
    }
    Ok(())
}

mod render;
mod store;

pub use store::{STORE_CAPACITY, Store};

#[cfg(test)]
mod tests;
