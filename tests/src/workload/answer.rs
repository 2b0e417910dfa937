//! Reading an answer of any of the APIs ([`Api`]): a whole JSON body, or a
//! stream's server-sent events one by one, into the generated text, the
//! usage in one shape, and the answer's `id`.
//!
//! The usage each API reports, and what it becomes:
//! - chat: `prompt_tokens` (cached included),
//!   `prompt_tokens_details.cached_tokens`, `completion_tokens`;
//! - Messages: `input_tokens` counts only the tokens neither read from nor
//!   written to the cache (Anthropic's contract), so the prompt is
//!   `input_tokens + cache_read_input_tokens + cache_creation_input_tokens`
//!   and the cached tokens are `cache_read_input_tokens`; a stream reports
//!   usage in `message_start` and again in `message_delta`, the later
//!   figures winning field by field;
//! - Responses: `input_tokens` (cached included),
//!   `input_tokens_details.cached_tokens`, `output_tokens`.
//!
//! A stream is complete at chat's `[DONE]`, Messages' `message_stop`, or
//! the Responses `response.completed` / `response.incomplete` event.

use super::api::Api;
use serde::Deserialize;
use serde_json::Value;

/// Token counts of an answer, whatever API carried it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// The whole prompt, cached tokens included.
    pub prompt_tokens: u64,
    /// Prompt tokens the engine found in its prefix cache (0 if not reported).
    pub cached_tokens: u64,
    pub completion_tokens: u64,
}

/// An answer, read as it arrives.
#[derive(Clone, Debug, Default)]
pub struct Answer {
    api: Api,
    /// The generated text so far.
    pub text: String,
    pub usage: Option<Usage>,
    /// The answer's `id` (what `previous_response_id` names).
    pub id: Option<String>,
    /// The stream's closing event arrived.
    pub done: bool,
    /// An error the stream reported (an `error` event, a failed response).
    pub error: Option<String>,
    /// Messages: the usage fields seen so far, merged.
    anthropic: AnthropicUsage,
}

impl Answer {
    pub fn new(api: Api) -> Self {
        Answer {
            api,
            ..Answer::default()
        }
    }

    /// One server-sent event: its `data`, the joined `data:` lines (the
    /// `event:` name is not needed: every API repeats it as `type`).
    /// Returns whether it carried generated text (the first such event is
    /// the time to the first token).
    pub fn event(&mut self, data: &[u8]) -> bool {
        let before = self.text.len();
        match self.api {
            Api::Chat => {
                if data == b"[DONE]" {
                    self.done = true;
                } else if let Ok(b) = serde_json::from_slice::<ChatBody>(data) {
                    self.chat(b);
                }
            }
            Api::Messages => {
                if let Ok(v) = serde_json::from_slice::<Value>(data) {
                    self.messages_event(&v);
                }
            }
            Api::Responses | Api::ResponsesChained => {
                if let Ok(v) = serde_json::from_slice::<Value>(data) {
                    self.responses_event(&v);
                }
            }
        }
        self.text.len() > before
    }

    /// A whole (non-streamed) JSON body. Returns false when it is not an
    /// answer of this API (the caller keeps the body as text).
    pub fn body(&mut self, raw: &[u8]) -> bool {
        match self.api {
            Api::Chat => match serde_json::from_slice::<ChatBody>(raw) {
                Ok(b) if b.choices.is_some() => {
                    self.chat(b);
                    true
                }
                _ => false,
            },
            Api::Messages => match serde_json::from_slice::<Value>(raw) {
                Ok(v) if v["type"] == "message" => {
                    self.messages_message(&v);
                    true
                }
                _ => false,
            },
            Api::Responses | Api::ResponsesChained => match serde_json::from_slice::<Value>(raw) {
                Ok(v) if v["object"] == "response" => {
                    self.response(&v);
                    self.text = output_text(&v["output"]);
                    true
                }
                _ => false,
            },
        }
    }

    fn chat(&mut self, b: ChatBody) {
        if self.id.is_none() {
            self.id = b.id;
        }
        for c in b.choices.into_iter().flatten() {
            if let Some(t) = c
                .delta
                .and_then(|d| d.content)
                .or(c.message.and_then(|m| m.content))
                .or(c.text)
            {
                self.text.push_str(&t);
            }
        }
        if let Some(u) = b.usage {
            self.usage = Some(Usage {
                prompt_tokens: u.prompt_tokens,
                cached_tokens: u
                    .prompt_tokens_details
                    .and_then(|d| d.cached_tokens)
                    .unwrap_or(0),
                completion_tokens: u.completion_tokens,
            });
        }
    }

    /// A Messages `message` object: its id, text blocks and usage.
    fn messages_message(&mut self, m: &Value) {
        if let Some(id) = m["id"].as_str() {
            self.id = Some(id.to_owned());
        }
        for block in m["content"].as_array().into_iter().flatten() {
            if block["type"] == "text"
                && let Some(t) = block["text"].as_str()
            {
                self.text.push_str(t);
            }
        }
        self.messages_usage(&m["usage"]);
    }

    fn messages_event(&mut self, e: &Value) {
        match e["type"].as_str() {
            Some("message_start") => self.messages_message(&e["message"]),
            Some("content_block_delta") if e["delta"]["type"] == "text_delta" => {
                if let Some(t) = e["delta"]["text"].as_str() {
                    self.text.push_str(t);
                }
            }
            Some("message_delta") => self.messages_usage(&e["usage"]),
            Some("message_stop") => self.done = true,
            Some("error") => self.error = Some(error_message(&e["error"])),
            _ => {}
        }
    }

    fn messages_usage(&mut self, u: &Value) {
        let Ok(u) = AnthropicUsage::deserialize(u) else {
            return;
        };
        let a = &mut self.anthropic;
        a.input_tokens = u.input_tokens.or(a.input_tokens);
        a.output_tokens = u.output_tokens.or(a.output_tokens);
        a.cache_creation_input_tokens = u
            .cache_creation_input_tokens
            .or(a.cache_creation_input_tokens);
        a.cache_read_input_tokens = u.cache_read_input_tokens.or(a.cache_read_input_tokens);
        let read = a.cache_read_input_tokens.unwrap_or(0);
        self.usage = Some(Usage {
            prompt_tokens: a.input_tokens.unwrap_or(0)
                + read
                + a.cache_creation_input_tokens.unwrap_or(0),
            cached_tokens: read,
            completion_tokens: a.output_tokens.unwrap_or(0),
        });
    }

    /// A Responses `response` object: its id and, once there, its usage.
    fn response(&mut self, r: &Value) {
        if let Some(id) = r["id"].as_str() {
            self.id = Some(id.to_owned());
        }
        let u = &r["usage"];
        if u.is_object() {
            let n = |v: &Value| v.as_u64().unwrap_or(0);
            self.usage = Some(Usage {
                prompt_tokens: n(&u["input_tokens"]),
                cached_tokens: n(&u["input_tokens_details"]["cached_tokens"]),
                completion_tokens: n(&u["output_tokens"]),
            });
        }
    }

    fn responses_event(&mut self, e: &Value) {
        match e["type"].as_str() {
            Some("response.created" | "response.in_progress") => self.response(&e["response"]),
            Some("response.output_text.delta") => {
                if let Some(t) = e["delta"].as_str() {
                    self.text.push_str(t);
                }
            }
            Some("response.completed" | "response.incomplete") => {
                self.response(&e["response"]);
                self.done = true;
            }
            Some("response.failed") => {
                self.response(&e["response"]);
                self.error = Some(error_message(&e["response"]["error"]));
                self.done = true;
            }
            Some("error") => self.error = Some(error_message(e)),
            _ => {}
        }
    }

    /// Why the stream is not a whole answer, if it is not.
    pub fn incomplete(&self) -> Option<String> {
        if let Some(e) = &self.error {
            return Some(e.clone());
        }
        (!self.done).then(|| {
            let end = match self.api {
                Api::Chat => "[DONE]",
                Api::Messages => "message_stop",
                Api::Responses | Api::ResponsesChained => "response.completed",
            };
            format!("stream ended without {end}")
        })
    }
}

/// The text of a Responses `output`: its messages' `output_text` parts.
fn output_text(output: &Value) -> String {
    let mut s = String::new();
    for item in output.as_array().into_iter().flatten() {
        if item["type"] != "message" {
            continue;
        }
        for part in item["content"].as_array().into_iter().flatten() {
            if part["type"] == "output_text"
                && let Some(t) = part["text"].as_str()
            {
                s.push_str(t);
            }
        }
    }
    s
}

/// An error object's message (or the whole object when it has none).
fn error_message(e: &Value) -> String {
    e["message"]
        .as_str()
        .map_or_else(|| e.to_string(), str::to_owned)
}

#[derive(Clone, Copy, Debug, Default, Deserialize)]
struct AnthropicUsage {
    #[serde(default)]
    input_tokens: Option<u64>,
    #[serde(default)]
    output_tokens: Option<u64>,
    #[serde(default)]
    cache_creation_input_tokens: Option<u64>,
    #[serde(default)]
    cache_read_input_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct ChatUsage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    #[serde(default)]
    prompt_tokens_details: Option<ChatDetails>,
}

#[derive(Deserialize)]
struct ChatDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
}

#[derive(Deserialize)]
struct Message {
    #[serde(default)]
    content: Option<String>,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    delta: Option<Delta>,
    #[serde(default)]
    message: Option<Message>,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct ChatBody {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    choices: Option<Vec<Choice>>,
    #[serde(default)]
    usage: Option<ChatUsage>,
}

#[cfg(test)]
mod tests;
