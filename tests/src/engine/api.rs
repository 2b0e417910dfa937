//! The OpenAI-compatible (and SGLang `/generate`) request parsing and
//! response rendering. Requests are parsed from borrowed JSON; responses are
//! written straight into byte buffers. Anthropic's Messages and OpenAI's
//! Responses have modules of their own ([`super::messages`],
//! [`super::responses`]); [`Responder`] renders every endpoint's answer.
//!
//! Completions `prompt` may be a string, token ids, or a one-element array of
//! either; larger batches are rejected with 400 (send one prompt per request).

use super::conversation::{ChatMessage, Conversation, Tool, ToolCall};
use super::output_text;
use super::tokenize::{self, Token};
use super::{messages, responses};
use serde::Deserialize;
use std::borrow::Cow;
use std::io::Write;

/// Which endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApiKind {
    /// `POST /v1/chat/completions`
    Chat,
    /// `POST /v1/completions`
    Completion,
    /// SGLang's `POST /generate`
    Generate,
    /// Anthropic's `POST /v1/messages`
    Messages,
    /// OpenAI's `POST /v1/responses`
    Responses,
}

/// A parsed inference request.
#[derive(Debug)]
pub struct Job {
    pub kind: ApiKind,
    /// Index into the served model names.
    pub model: usize,
    pub tokens: Vec<Token>,
    pub max_tokens: u32,
    pub stream: bool,
    pub include_usage: bool,
    /// vLLM's `cache_salt`: only requests with the same salt share cached
    /// blocks (it is folded into the first block's hash).
    pub cache_salt: Option<String>,
    /// vLLM's `priority` (lower first; 0 when absent): orders the waiting
    /// queue under `--scheduling-policy priority`, refused otherwise.
    pub priority: i64,
}

/// A request error, answered in OpenAI's error shape.
#[derive(Debug)]
pub struct ApiError {
    pub status: u16,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<&'static str>,
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: 400,
            kind: "BadRequestError",
            message: message.into(),
            param: None,
        }
    }

    /// The body in the shape of the endpoint it answers: Anthropic's for
    /// `/v1/messages`, OpenAI's for the others.
    pub fn body_for(&self, kind: ApiKind) -> Vec<u8> {
        match kind {
            ApiKind::Messages => messages::error_body(self),
            _ => self.body(),
        }
    }

    /// The JSON body: `{"error":{"message","type","param","code"}}`.
    pub fn body(&self) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({"error": {
            "message": self.message, "type": self.kind, "param": self.param, "code": self.status,
        }}))
        .unwrap_or_default()
    }
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    Parts(#[serde(borrow)] Vec<Part<'a>>),
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow)]
    role: Cow<'a, str>,
    #[serde(borrow, default)]
    content: Option<Content<'a>>,
    #[serde(default)]
    tool_calls: Option<Vec<ChatToolCall>>,
    #[serde(default)]
    tool_call_id: Option<String>,
}

/// An assistant message's `tool_calls` entry.
#[derive(Deserialize)]
struct ChatToolCall {
    #[serde(default)]
    id: String,
    function: ChatFunction,
}

#[derive(Deserialize)]
struct ChatFunction {
    name: String,
    #[serde(default)]
    arguments: String,
}

/// A `tools` entry: `{"type":"function","function":{...}}`.
#[derive(Deserialize)]
struct ChatTool {
    function: ChatToolSpec,
}

#[derive(Deserialize)]
struct ChatToolSpec {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    parameters: Option<serde_json::Value>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Prompt<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    Ids(Vec<Token>),
    Texts(#[serde(borrow)] Vec<Cow<'a, str>>),
    IdBatches(Vec<Vec<Token>>),
}

#[derive(Deserialize)]
struct OpenAiRequest<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(borrow, default)]
    prompt: Option<Prompt<'a>>,
    #[serde(default)]
    max_tokens: Option<i64>,
    #[serde(default)]
    max_completion_tokens: Option<i64>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    cache_salt: Option<String>,
    #[serde(default)]
    tools: Option<Vec<ChatTool>>,
    #[serde(default)]
    priority: Option<i64>,
}

#[derive(Deserialize)]
struct SamplingParams {
    #[serde(default)]
    max_new_tokens: Option<i64>,
}

#[derive(Deserialize)]
struct GenerateRequest<'a> {
    #[serde(borrow, default)]
    text: Option<Prompt<'a>>,
    #[serde(default)]
    input_ids: Option<Prompt<'a>>,
    #[serde(default)]
    sampling_params: Option<SamplingParams>,
    #[serde(default)]
    stream: Option<bool>,
}

fn prompt_tokens(p: Prompt<'_>) -> Result<Vec<Token>, ApiError> {
    match p {
        Prompt::Text(s) => text_tokens(&s),
        Prompt::Ids(ids) => Ok(ids),
        Prompt::Texts(v) if v.len() == 1 => text_tokens(&v[0]),
        Prompt::IdBatches(mut v) if v.len() == 1 => Ok(v.pop().unwrap_or_default()),
        _ => Err(ApiError::bad_request(
            "sim-engine serves one prompt per request; batched prompts are not supported",
        )),
    }
}

/// A completion prompt's tokens (the model's tokenizer when given).
fn text_tokens(s: &str) -> Result<Vec<Token>, ApiError> {
    match tokenize::model() {
        None => Ok(tokenize::tokenize(s)),
        Some(m) => m.encode(s, true).map_err(ApiError::bad_request),
    }
}

pub(super) fn max_tokens(v: Option<i64>, default: u32) -> Result<u32, ApiError> {
    match v {
        None => Ok(default),
        Some(n) if n >= 1 => Ok(n.min(i64::from(u32::MAX)) as u32),
        Some(n) => Err(ApiError::bad_request(format!(
            "max_tokens must be at least 1, got {n}."
        ))),
    }
}

/// The served model a request names (the first when it names none), or 404.
pub(super) fn model_index(name: Option<&str>, models: &[String]) -> Result<usize, ApiError> {
    match name {
        None => Ok(0),
        Some(m) => models.iter().position(|x| x == m).ok_or_else(|| ApiError {
            status: 404,
            kind: "NotFoundError",
            message: format!("The model `{m}` does not exist."),
            param: Some("model"),
        }),
    }
}

/// The prompt tokens of a chat: the messages rendered with the chat
/// template, then (when asked) the generation prompt. The chat endpoint,
/// `/tokenize` and `/v1/chat/completions/render` all go through here, so
/// they always agree; Messages and Responses requests render through the
/// same [`Conversation`].
fn chat_tokens(
    msgs: Vec<Message<'_>>,
    tools: Option<Vec<ChatTool>>,
    add_generation_prompt: bool,
) -> Result<Vec<Token>, ApiError> {
    let conv = Conversation {
        messages: msgs.into_iter().map(chat_message).collect(),
        tools: tools
            .unwrap_or_default()
            .into_iter()
            .map(|t| Tool {
                name: t.function.name,
                description: t.function.description,
                parameters: t.function.parameters.unwrap_or(serde_json::Value::Null),
            })
            .collect(),
    };
    conv.tokens(add_generation_prompt)
        .map_err(ApiError::bad_request)
}

/// A chat completions message as the template sees it.
fn chat_message(m: Message<'_>) -> ChatMessage<'_> {
    let content = match m.content {
        None => Cow::Borrowed(""),
        Some(Content::Text(s)) => s,
        Some(Content::Parts(parts)) => {
            Cow::Owned(join_text(parts.iter().filter_map(|p| p.text.as_deref())))
        }
    };
    ChatMessage {
        role: m.role,
        content,
        tool_calls: m
            .tool_calls
            .unwrap_or_default()
            .into_iter()
            .map(|c| ToolCall {
                id: c.id,
                name: c.function.name,
                arguments: c.function.arguments,
            })
            .collect(),
        tool_call_id: m.tool_call_id,
    }
}

/// Text parts joined as vLLM joins them for a template that takes a
/// string content: with `\n`.
pub(super) fn join_text<'a>(parts: impl Iterator<Item = &'a str>) -> String {
    parts.collect::<Vec<_>>().join("\n")
}

#[derive(Deserialize)]
struct TokenizeRequest<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    prompt: Option<Prompt<'a>>,
    #[serde(borrow, default)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    tools: Option<Vec<ChatTool>>,
}

/// vLLM's `POST /tokenize`: `{"prompt": ...}` or `{"messages": [...],
/// "add_generation_prompt": true}` (the default) → `(model, tokens)`.
pub fn parse_tokenize(body: &[u8], models: &[String]) -> Result<(usize, Vec<Token>), ApiError> {
    let r: TokenizeRequest = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("Invalid request body: {e}")))?;
    let model = model_index(r.model.as_deref(), models)?;
    let tokens = match (r.messages, r.prompt) {
        (Some(msgs), _) => chat_tokens(msgs, r.tools, r.add_generation_prompt.unwrap_or(true))?,
        (None, Some(p)) => prompt_tokens(p)?,
        (None, None) => {
            return Err(ApiError::bad_request(
                "Either prompt or messages should be provided.",
            ));
        }
    };
    Ok((model, tokens))
}

/// The body of vLLM's `/tokenize` answer.
pub fn tokenize_body(tokens: &[Token], max_model_len: usize) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "count": tokens.len(), "max_model_len": max_model_len, "tokens": tokens, "token_strs": null,
    }))
    .unwrap_or_default()
}

/// The body of vLLM's render answer for a parsed request: the prompt's
/// token ids as the engine would run them (`/v1/chat/completions/render`
/// answers one object, `/v1/completions/render` a list of one).
pub fn render_body(job: &Job, id: u64, model_json: &str) -> Vec<u8> {
    let prefix = if job.kind == ApiKind::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    };
    let mut o = Vec::with_capacity(job.tokens.len() * 8 + 256);
    if job.kind != ApiKind::Chat {
        o.push(b'[');
    }
    let _ = write!(
        o,
        r#"{{"request_id":"{prefix}-render-{id:016x}","model":{model_json},"token_ids":"#
    );
    let _ = serde_json::to_writer(&mut o, &job.tokens);
    let _ = write!(
        o,
        r#","features":null,"sampling_params":{{"max_tokens":{}}},"stream":false}}"#,
        job.max_tokens
    );
    if job.kind != ApiKind::Chat {
        o.push(b']');
    }
    o
}

/// Parses a request body for endpoint `kind`.
pub fn parse(
    kind: ApiKind,
    body: &[u8],
    models: &[String],
    default_max: u32,
) -> Result<Job, ApiError> {
    let invalid =
        |e: serde_json::Error| ApiError::bad_request(format!("Invalid request body: {e}"));
    if kind == ApiKind::Generate {
        let r: GenerateRequest = serde_json::from_slice(body).map_err(invalid)?;
        let tokens = match (r.text, r.input_ids) {
            (Some(p), _) | (None, Some(p)) => prompt_tokens(p)?,
            (None, None) => {
                return Err(ApiError::bad_request(
                    "Either text or input_ids should be provided.",
                ));
            }
        };
        let mt = max_tokens(
            r.sampling_params.and_then(|s| s.max_new_tokens),
            default_max,
        )?;
        let stream = r.stream.unwrap_or(false);
        return Ok(Job {
            kind,
            model: 0,
            tokens,
            max_tokens: mt,
            stream,
            include_usage: false,
            cache_salt: None,
            priority: 0,
        });
    }
    let r: OpenAiRequest = serde_json::from_slice(body).map_err(invalid)?;
    let model = model_index(r.model.as_deref(), models)?;
    let tokens = if kind == ApiKind::Chat {
        let msgs = r
            .messages
            .ok_or_else(|| ApiError::bad_request("Field required: messages"))?;
        chat_tokens(msgs, r.tools, true)?
    } else {
        prompt_tokens(
            r.prompt
                .ok_or_else(|| ApiError::bad_request("Field required: prompt"))?,
        )?
    };
    let mt = max_tokens(r.max_completion_tokens.or(r.max_tokens), default_max)?;
    let stream = r.stream.unwrap_or(false);
    let include_usage = r
        .stream_options
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    Ok(Job {
        kind,
        model,
        tokens,
        max_tokens: mt,
        stream,
        include_usage,
        cache_salt: r.cache_salt,
        priority: r.priority.unwrap_or(0),
    })
}

/// Renders the answer of one request in its endpoint's shape.
pub struct Responder<'a> {
    pub kind: ApiKind,
    pub id: u64,
    pub created: u64,
    /// The model name as a JSON string (quoted, escaped).
    pub model_json: &'a str,
    /// Seeds the generated text.
    pub digest: u64,
    pub prompt_tokens: usize,
    pub max_tokens: u32,
    /// Fault: written in place of the cached-token count.
    pub bad_cached: Option<&'a str>,
    /// A Responses answer's request context.
    pub ctx: Option<&'a std::sync::Arc<responses::Ctx>>,
}

impl Responder<'_> {
    fn object_head(&self, out: &mut Vec<u8>, object: &str) {
        let prefix = if self.kind == ApiKind::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        };
        let _ = write!(
            out,
            r#"{{"id":"{prefix}-{:016x}","object":"{object}","created":{},"model":{}"#,
            self.id, self.created, self.model_json
        );
    }

    fn usage(&self, out: &mut Vec<u8>, completion: u32, cached: u32) {
        let cached = self.cached(cached);
        let _ = write!(
            out,
            r#""usage":{{"prompt_tokens":{p},"total_tokens":{t},"completion_tokens":{completion},"prompt_tokens_details":{{"cached_tokens":{cached}}}}}"#,
            p = self.prompt_tokens,
            t = self.prompt_tokens + completion as usize
        );
    }

    /// The generated text of tokens `from..to`.
    pub(super) fn text(&self, from: u32, to: u32) -> String {
        let mut s = String::with_capacity(4 * (to - from) as usize);
        output_text::push_text(&mut s, self.digest, from, to);
        s
    }

    /// The whole non-streaming body.
    pub fn full_body(&self, cached: u32) -> Vec<u8> {
        let n = self.max_tokens;
        let text = self.text(0, n);
        let mut o = Vec::with_capacity(text.len() + 512);
        match self.kind {
            ApiKind::Chat => {
                self.object_head(&mut o, "chat.completion");
                let _ = write!(
                    o,
                    r#","choices":[{{"index":0,"message":{{"role":"assistant","content":"{text}","tool_calls":[]}},"logprobs":null,"finish_reason":"length","stop_reason":null}}],"#
                );
                self.usage(&mut o, n, cached);
                o.push(b'}');
            }
            ApiKind::Completion => {
                self.object_head(&mut o, "text_completion");
                let _ = write!(
                    o,
                    r#","choices":[{{"index":0,"text":"{text}","logprobs":null,"finish_reason":"length","stop_reason":null}}],"#
                );
                self.usage(&mut o, n, cached);
                o.push(b'}');
            }
            ApiKind::Generate => {
                let _ = write!(o, r#"{{"text":"{text}","meta_info":"#);
                self.meta_info(&mut o, n, cached, true);
                o.push(b'}');
            }
            ApiKind::Messages => return self.messages_body(cached),
            ApiKind::Responses => return self.responses_body(cached),
        }
        o
    }

    /// The cached-token count as written: the true one, or the fault's.
    pub(super) fn cached(&self, cached: u32) -> String {
        self.bad_cached
            .map_or_else(|| cached.to_string(), str::to_owned)
    }

    fn meta_info(&self, o: &mut Vec<u8>, generated: u32, cached: u32, done: bool) {
        let cached = self.cached(cached);
        let _ = write!(o, r#"{{"id":"{:016x}","finish_reason":"#, self.id);
        if done {
            let _ = write!(o, r#"{{"type":"length","length":{generated}}}"#);
        } else {
            o.extend_from_slice(b"null");
        }
        let _ = write!(
            o,
            r#","prompt_tokens":{},"completion_tokens":{generated},"cached_tokens":{cached}}}"#,
            self.prompt_tokens
        );
    }

    /// Appends the SSE events for tokens `from..to` (one event per token; the
    /// chat role event first when `from == 0`) to `events`, each closed by a
    /// blank line. `cached` is reported by SGLang-shaped events.
    pub fn token_events(&self, events: &mut Vec<Vec<u8>>, from: u32, to: u32, cached: u32) {
        if matches!(self.kind, ApiKind::Messages | ApiKind::Responses) {
            if from == 0 && to > 0 {
                if self.kind == ApiKind::Messages {
                    self.messages_start_events(events);
                } else {
                    self.responses_start_events(events);
                }
            }
            events.extend((from..to).map(|i| {
                if self.kind == ApiKind::Messages {
                    self.messages_delta_event(i)
                } else {
                    self.responses_delta_event(i)
                }
            }));
            return;
        }
        if from == 0 && to > 0 && self.kind == ApiKind::Chat {
            let mut e = b"data: ".to_vec();
            self.object_head(&mut e, "chat.completion.chunk");
            e.extend_from_slice(
                br#","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}"#,
            );
            e.extend_from_slice(b"\n\n");
            events.push(e);
        }
        for i in from..to {
            let last = i + 1 == self.max_tokens;
            let finish = if last { r#""length""# } else { "null" };
            let piece = self.text(i, i + 1);
            let mut e = b"data: ".to_vec();
            match self.kind {
                ApiKind::Chat => {
                    self.object_head(&mut e, "chat.completion.chunk");
                    let _ = write!(
                        e,
                        r#","choices":[{{"index":0,"delta":{{"content":"{piece}"}},"logprobs":null,"finish_reason":{finish}}}]}}"#
                    );
                }
                ApiKind::Completion => {
                    self.object_head(&mut e, "text_completion");
                    let _ = write!(
                        e,
                        r#","choices":[{{"index":0,"text":"{piece}","logprobs":null,"finish_reason":{finish},"stop_reason":null}}]}}"#
                    );
                }
                ApiKind::Generate => {
                    let _ = write!(e, r#"{{"text":"{}","meta_info":"#, self.text(0, i + 1));
                    self.meta_info(&mut e, i + 1, cached, last);
                    e.push(b'}');
                }
                ApiKind::Messages | ApiKind::Responses => unreachable!("rendered above"),
            }
            e.extend_from_slice(b"\n\n");
            events.push(e);
        }
    }

    /// The final events: the usage chunk (if asked for) and `[DONE]`;
    /// Messages and Responses close their streams with their own events.
    pub fn final_events(&self, events: &mut Vec<Vec<u8>>, include_usage: bool, cached: u32) {
        match self.kind {
            ApiKind::Messages => return self.messages_final_events(events, cached),
            ApiKind::Responses => return self.responses_final_events(events, cached),
            _ => {}
        }
        if include_usage && self.kind != ApiKind::Generate {
            let mut e = b"data: ".to_vec();
            let obj = if self.kind == ApiKind::Chat {
                "chat.completion.chunk"
            } else {
                "text_completion"
            };
            self.object_head(&mut e, obj);
            e.extend_from_slice(br#","choices":[],"#);
            self.usage(&mut e, self.max_tokens, cached);
            e.extend_from_slice(b"}\n\n");
            events.push(e);
        }
        events.push(b"data: [DONE]\n\n".to_vec());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn models() -> Vec<String> {
        vec!["m".to_string()]
    }

    #[test]
    fn chat_content_string_and_parts_render_alike() {
        let a = br#"{"model":"m","messages":[{"role":"user","content":"hi there"}]}"#;
        let b = br#"{"messages":[{"role":"user","content":[{"type":"text","text":"hi there"}]}],"max_tokens":3}"#;
        let ja = parse(ApiKind::Chat, a, &models(), 32).unwrap();
        let jb = parse(ApiKind::Chat, b, &models(), 32).unwrap();
        assert_eq!(ja.tokens, jb.tokens);
        assert_eq!((ja.max_tokens, jb.max_tokens), (32, 3));
    }

    #[test]
    fn errors() {
        let cases: [(ApiKind, &[u8], u16); 4] = [
            (ApiKind::Chat, b"{nope", 400),
            (ApiKind::Chat, br#"{"model":"x","messages":[]}"#, 404),
            (ApiKind::Completion, br#"{"prompt":["a","b"]}"#, 400),
            (
                ApiKind::Completion,
                br#"{"prompt":"a","max_tokens":0}"#,
                400,
            ),
        ];
        for (kind, body, status) in cases {
            let err = parse(kind, body, &models(), 1).unwrap_err();
            assert_eq!(err.status, status, "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn completion_prompt_forms() {
        let ids = parse(ApiKind::Completion, br#"{"prompt":[5,6,7]}"#, &models(), 1).unwrap();
        assert_eq!(ids.tokens, vec![5, 6, 7]);
        let one = parse(
            ApiKind::Completion,
            br#"{"prompt":["abcdefgh"]}"#,
            &models(),
            1,
        )
        .unwrap();
        assert_eq!(one.tokens.len(), 2);
        let g = parse(
            ApiKind::Generate,
            br#"{"input_ids":[1,2],"sampling_params":{"max_new_tokens":4}}"#,
            &models(),
            1,
        );
        assert_eq!(g.unwrap().max_tokens, 4);
    }
}
