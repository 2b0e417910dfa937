//! Which inference API a run speaks, and each request's body in it: the
//! same conversation as an OpenAI chat, as an Anthropic Messages request,
//! as an OpenAI Responses request carrying the whole conversation, or as a
//! Responses chain that sends only what is new since the last answer and
//! names that answer (`previous_response_id`).
//!
//! Every form renders, through an engine's chat template, to the same
//! tokens as the chat (vLLM turns Messages and Responses requests into
//! chat messages before its template runs; so does `sim-engine`): a run on
//! any API has the same prompts, and its hit rate compares with the chat's
//! directly. A `tool` message (the agent scenario's tool results) goes as
//! a `tool_result` block (Messages) or a `function_call_output` item
//! (Responses), which the template renders as the chat's `tool` message.

use super::scenario::Msg;
use serde::{Deserialize, Serialize};

/// The API a run sends its conversations in.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum Api {
    /// OpenAI's `POST /v1/chat/completions`, the whole history each turn.
    #[default]
    Chat,
    /// Anthropic's `POST /v1/messages`: the system message as `system`,
    /// the rest as `messages`, the whole history each turn.
    Messages,
    /// OpenAI's `POST /v1/responses` with `store: false`: the system
    /// message as `instructions`, the whole history as `input` items.
    Responses,
    /// OpenAI's `POST /v1/responses`, stored: the first turn as
    /// `responses`, each later one only the messages after the last answer
    /// with `previous_response_id` naming that answer (the engine that
    /// stored it holds the rest of the conversation).
    ResponsesChained,
}

impl Api {
    /// Every API, in the order reports show them.
    pub const ALL: [Api; 4] = [
        Api::Chat,
        Api::Messages,
        Api::Responses,
        Api::ResponsesChained,
    ];

    /// The CLI name.
    pub fn name(self) -> &'static str {
        match self {
            Api::Chat => "chat",
            Api::Messages => "messages",
            Api::Responses => "responses",
            Api::ResponsesChained => "responses-chained",
        }
    }

    /// The path requests are sent to.
    pub fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Messages => "/v1/messages",
            Api::Responses | Api::ResponsesChained => "/v1/responses",
        }
    }

    /// Whether later turns need the previous answer's `id`.
    pub fn chains(self) -> bool {
        self == Api::ResponsesChained
    }

    /// The body of one request of `messages` (the whole conversation so
    /// far, system message first). `previous` is the `id` of the last
    /// answer, which only [`Api::ResponsesChained`] sends (when it has
    /// one; the first turn has none).
    pub fn body(self, f: &Fields<'_>, messages: &[Msg], previous: Option<&str>) -> Vec<u8> {
        let mut b =
            Vec::with_capacity(messages.iter().map(|m| m.content.len() + 64).sum::<usize>() + 256);
        b.extend_from_slice(b"{\"model\":");
        b.extend_from_slice(f.model_json.as_bytes());
        match self {
            Api::Chat => {
                b.extend_from_slice(b",\"messages\":[");
                for (i, m) in messages.iter().enumerate() {
                    comma(&mut b, i);
                    object(&mut b, &[("role", m.role), ("content", &m.content)]);
                }
                b.extend_from_slice(b"],\"max_tokens\":");
                number(&mut b, f.max_tokens);
                b.extend_from_slice(b",\"user\":");
                string(&mut b, &f.user());
                if f.stream {
                    b.extend_from_slice(
                        b",\"stream\":true,\"stream_options\":{\"include_usage\":true}",
                    );
                }
            }
            Api::Messages => {
                let (system, rest) = split_system(messages);
                if let Some(s) = system {
                    b.extend_from_slice(b",\"system\":");
                    string(&mut b, s);
                }
                b.extend_from_slice(b",\"messages\":[");
                for (i, m) in rest.iter().enumerate() {
                    comma(&mut b, i);
                    messages_turn(&mut b, m, i);
                }
                b.extend_from_slice(b"],\"max_tokens\":");
                number(&mut b, f.max_tokens);
                b.extend_from_slice(b",\"metadata\":{\"user_id\":");
                string(&mut b, &f.user());
                b.push(b'}');
                if f.stream {
                    b.extend_from_slice(b",\"stream\":true");
                }
            }
            Api::Responses | Api::ResponsesChained => {
                let (system, rest) = split_system(messages);
                if let Some(s) = system {
                    b.extend_from_slice(b",\"instructions\":");
                    string(&mut b, s);
                }
                // A chain sends what follows the last answer; the engine
                // that stored that answer holds everything before it.
                let previous = previous.filter(|_| self.chains());
                let new = match previous {
                    Some(_) => rest
                        .iter()
                        .rposition(|m| m.role == "assistant")
                        .map_or(0, |i| i + 1),
                    None => 0,
                };
                if let Some(id) = previous {
                    b.extend_from_slice(b",\"previous_response_id\":");
                    string(&mut b, id);
                }
                b.extend_from_slice(b",\"input\":[");
                for (i, m) in rest[new..].iter().enumerate() {
                    comma(&mut b, i);
                    responses_item(&mut b, m, new + i);
                }
                b.extend_from_slice(b"],\"max_output_tokens\":");
                number(&mut b, f.max_tokens);
                b.extend_from_slice(if self.chains() {
                    b",\"store\":true"
                } else {
                    b",\"store\":false"
                });
                b.extend_from_slice(b",\"user\":");
                string(&mut b, &f.user());
                if f.stream {
                    b.extend_from_slice(b",\"stream\":true");
                }
            }
        }
        if let Some(tier) = f.service_tier {
            b.extend_from_slice(b",\"service_tier\":");
            string(&mut b, tier);
        }
        b.push(b'}');
        b
    }
}

impl std::fmt::Display for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What every request of a run carries besides its conversation.
#[derive(Clone, Copy, Debug)]
pub struct Fields<'a> {
    /// The model name as a JSON string (quoted, escaped).
    pub model_json: &'a str,
    /// `max_tokens` (Messages, chat) or `max_output_tokens` (Responses).
    pub max_tokens: u32,
    /// The conversation, named as its end user (`user`, Messages'
    /// `metadata.user_id`): what the router's session policy keys on.
    pub session: u64,
    /// Streamed answers (chat: with the usage chunk).
    pub stream: bool,
    /// The OpenAI API's `service_tier` (`priority`, `default`, `flex`),
    /// sent on every API when set.
    pub service_tier: Option<&'a str>,
    /// The `user` sent in place of the conversation's own (a tenant).
    pub user: Option<&'a str>,
}

impl Fields<'_> {
    fn user(&self) -> String {
        match self.user {
            Some(u) => u.to_string(),
            None => format!("session-{}", self.session),
        }
    }
}

/// The leading system message, if any, and the rest.
fn split_system(messages: &[Msg]) -> (Option<&str>, &[Msg]) {
    match messages.split_first() {
        Some((first, rest)) if first.role == "system" => (Some(&first.content), rest),
        _ => (None, messages),
    }
}

/// The id a tool result answers: the scenarios' tool messages answer no
/// real call, so each gets one from its place in the conversation.
fn call_id(at: usize) -> String {
    format!("call_{at}")
}

/// One Messages turn: a tool message as a user's `tool_result` block.
fn messages_turn(b: &mut Vec<u8>, m: &Msg, at: usize) {
    if m.role == "tool" {
        b.extend_from_slice(b"{\"role\":\"user\",\"content\":[");
        object(
            b,
            &[
                ("type", "tool_result"),
                ("tool_use_id", &call_id(at)),
                ("content", &m.content),
            ],
        );
        b.extend_from_slice(b"]}");
    } else {
        object(b, &[("role", m.role), ("content", &m.content)]);
    }
}

/// One Responses input item: a message, or a tool message as a
/// `function_call_output`.
fn responses_item(b: &mut Vec<u8>, m: &Msg, at: usize) {
    if m.role == "tool" {
        object(
            b,
            &[
                ("type", "function_call_output"),
                ("call_id", &call_id(at)),
                ("output", &m.content),
            ],
        );
    } else {
        object(b, &[("role", m.role), ("content", &m.content)]);
    }
}

fn comma(b: &mut Vec<u8>, i: usize) {
    if i > 0 {
        b.push(b',');
    }
}

fn number(b: &mut Vec<u8>, n: u32) {
    b.extend_from_slice(n.to_string().as_bytes());
}

fn string(b: &mut Vec<u8>, s: &str) {
    let _ = serde_json::to_writer(&mut *b, s);
}

/// `{"k":"v",...}` with every value a string.
fn object(b: &mut Vec<u8>, fields: &[(&str, &str)]) {
    b.push(b'{');
    for (i, (k, v)) in fields.iter().enumerate() {
        comma(b, i);
        string(b, k);
        b.push(b':');
        string(b, v);
    }
    b.push(b'}');
}

#[cfg(test)]
mod tests;
