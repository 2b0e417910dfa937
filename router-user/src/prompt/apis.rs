//! The Anthropic Messages (`POST /v1/messages`) and OpenAI Responses
//! (`POST /v1/responses`) bodies, read into the canonical form of the chat
//! an engine renders them as: the system prompt (`system`, `instructions`)
//! as a `system` message first, then each turn as `RS role US text`. The
//! same conversation sent as a chat, as messages or as responses has the
//! same blocks, so it finds the same engine.
//!
//! - Content blocks and items: text as it is; a tool call as its name and
//!   arguments, a tool result as its call id and output, an image as its
//!   source (the same image in the same place is the same prefix).
//! - `tools` render ahead of the conversation on every engine: they are
//!   folded into the chain's seed, so requests with other tools share no
//!   block (and requests without tools share a chat's seed).
//! - Responses: `prompt_cache_key` is the cache salt (vLLM reads it as
//!   `cache_salt`); `previous_response_id` and `store` are kept for the
//!   stored-response pins (`fleet::stored`).
//!
//! Read with serde on the body itself (borrowed strings, no copy of the
//! body); the chat hot path keeps its single-pass scanner (`scan`).

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use serde::Deserialize;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde_json::value::RawValue;
use xxhash_rust::xxh3::xxh3_64;

use crate::error::{Kind, RouterError};
use crate::prompt::extract::Prompt;
use crate::prompt::hash::namespace_seed;

/// Where a body's canonical prompt goes (`prompt::scan::Canonical`).
pub trait Sink {
    /// Starts a message: `RS role US`.
    fn push_message(&mut self, role: &[u8]);
    /// Appends text to the prompt.
    fn push_text(&mut self, text: &[u8]);
    /// The body's `service_tier`.
    fn set_tier(&mut self, tier: &[u8]);
    /// The body has a top-level `priority`.
    fn set_priority_given(&mut self);
    /// The fields read besides the prompt.
    fn set_fields(&mut self, model: &[u8], salt: &[u8], previous: &[u8], store: bool);
}

/// Reads a `/v1/messages` body into `canon` (cleared by the caller).
pub fn messages(body: &[u8], canon: &mut impl Sink) -> Result<Prompt, RouterError> {
    let m: MessagesBody<'_> = parse(body)?;
    let Some(turns) = m.messages else {
        return Err(invalid("'messages' is required for /v1/messages"));
    };
    if let Some(system) = &m.system {
        canon.push_message(b"system");
        system.write(canon, write_block);
    }
    for t in &turns {
        canon.push_message(t.role.as_bytes());
        if let Some(c) = &t.content {
            c.write(canon, write_block);
        }
    }
    let model = m.model.as_deref().unwrap_or("");
    canon.set_fields(model.as_bytes(), b"", b"", false);
    if let Some(t) = &m.service_tier {
        canon.set_tier(t.as_bytes());
    }
    if m.priority {
        canon.set_priority_given();
    }
    let user = m
        .metadata
        .and_then(|md| md.user_id)
        .map(|u| xxh3_64(u.as_bytes()));
    Ok(Prompt {
        seed: seed(model, "", m.tools),
        user,
    })
}

/// Reads a `/v1/responses` body into `canon` (cleared by the caller).
pub fn responses(body: &[u8], canon: &mut impl Sink) -> Result<Prompt, RouterError> {
    let r: ResponsesBody<'_> = parse(body)?;
    if r.input.is_none() && r.previous_response_id.is_none() {
        return Err(invalid("'input' is required for /v1/responses"));
    }
    if let Some(i) = &r.instructions {
        canon.push_message(b"system");
        canon.push_text(i.as_bytes());
    }
    match &r.input {
        Some(OneOrMany::One(text)) => {
            canon.push_message(b"user");
            canon.push_text(text.as_bytes());
        }
        Some(OneOrMany::Many(items)) => items.iter().for_each(|i| write_item(i, canon)),
        None => {}
    }
    let model = r.model.as_deref().unwrap_or("");
    let salt = r.prompt_cache_key.as_deref().unwrap_or("");
    let previous = r.previous_response_id.as_deref().unwrap_or("");
    canon.set_fields(
        model.as_bytes(),
        salt.as_bytes(),
        previous.as_bytes(),
        r.store.unwrap_or(true),
    );
    if let Some(t) = &r.service_tier {
        canon.set_tier(t.as_bytes());
    }
    if r.priority {
        canon.set_priority_given();
    }
    let user = r
        .safety_identifier
        .or(r.user)
        .map(|u| xxh3_64(u.as_bytes()));
    Ok(Prompt {
        seed: seed(model, salt, r.tools),
        user,
    })
}

/// The `model` of a body routed by its model alone (a path of
/// `routes.extra_allowed`): none when the body is not a JSON object with
/// a string `model` (the engine judges the body, not the router).
pub fn model_only(body: &[u8], canon: &mut impl Sink) {
    #[derive(Deserialize)]
    struct Model<'a> {
        #[serde(borrow, default)]
        model: Option<Cow<'a, str>>,
    }
    if let Ok(Model { model: Some(m) }) = serde_json::from_slice::<Model<'_>>(body) {
        canon.set_fields(m.as_bytes(), b"", b"", false);
    }
}

fn invalid(message: impl Into<String>) -> RouterError {
    RouterError::new(Kind::InvalidBody, message)
}

fn parse<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, RouterError> {
    serde_json::from_slice(body)
        .map_err(|e| invalid(format!("request body is not valid for this API: {e}")))
}

/// The chain's seed: a chat's (model, no adapter, salt), and the tools
/// when there are any.
fn seed(model: &str, salt: &str, tools: Option<&RawValue>) -> u64 {
    match tools {
        Some(t) if !matches!(t.get(), "null" | "[]") => {
            namespace_seed(&[model.as_bytes(), b"", salt.as_bytes(), t.get().as_bytes()])
        }
        _ => namespace_seed(&[model.as_bytes(), b"", salt.as_bytes()]),
    }
}

#[derive(Deserialize)]
struct MessagesBody<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    system: Option<OneOrMany<'a, Block<'a>>>,
    #[serde(borrow, default)]
    messages: Option<Vec<Turn<'a>>>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
    #[serde(borrow, default)]
    metadata: Option<Metadata<'a>>,
    #[serde(borrow, default)]
    service_tier: Option<Cow<'a, str>>,
    #[serde(default, deserialize_with = "present")]
    priority: bool,
}

/// True for a field that is there, whatever its value (`null` too).
fn present<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    de::IgnoredAny::deserialize(d).map(|_| true)
}

#[derive(Deserialize)]
struct Metadata<'a> {
    #[serde(borrow, default)]
    user_id: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Turn<'a> {
    #[serde(borrow)]
    role: Cow<'a, str>,
    #[serde(borrow, default)]
    content: Option<OneOrMany<'a, Block<'a>>>,
}

/// A Messages content block (any type; the fields each type has).
#[derive(Deserialize)]
struct Block<'a> {
    #[serde(borrow, rename = "type", default)]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    thinking: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tool_use_id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<Box<OneOrMany<'a, Block<'a>>>>,
    #[serde(borrow, default)]
    source: Option<&'a RawValue>,
}

fn write_block<S: Sink>(b: &Block<'_>, canon: &mut S) {
    if let Some(t) = b.text.as_ref().or(b.thinking.as_ref()) {
        canon.push_text(t.as_bytes());
    }
    if let Some(n) = &b.name {
        canon.push_text(n.as_bytes());
    }
    if let Some(i) = b.input {
        canon.push_text(i.get().as_bytes());
    }
    if let Some(id) = &b.tool_use_id {
        canon.push_text(id.as_bytes());
    }
    if let Some(c) = &b.content {
        c.write(canon, write_block);
    }
    if let Some(s) = b.source {
        canon.push_text(s.get().as_bytes());
    }
    if b.kind.as_deref() == Some("redacted_thinking") {
        canon.push_text(b"redacted_thinking");
    }
}

#[derive(Deserialize)]
struct ResponsesBody<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    instructions: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    input: Option<OneOrMany<'a, Item<'a>>>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
    #[serde(borrow, default)]
    previous_response_id: Option<Cow<'a, str>>,
    #[serde(default)]
    store: Option<bool>,
    #[serde(borrow, default)]
    prompt_cache_key: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    user: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    safety_identifier: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    service_tier: Option<Cow<'a, str>>,
    #[serde(default, deserialize_with = "present")]
    priority: bool,
}

/// A Responses input item: a message (`type` absent or `message`), a
/// function call, its output, or another item kept by its type.
#[derive(Deserialize)]
struct Item<'a> {
    #[serde(borrow, rename = "type", default)]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<OneOrMany<'a, Part<'a>>>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    arguments: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    call_id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    output: Option<OneOrMany<'a, Part<'a>>>,
}

/// A content part of a Responses message (`input_text`, `output_text`,
/// `input_image`, `input_file`...).
#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    image_url: Option<&'a RawValue>,
    #[serde(borrow, default)]
    file_id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    file_data: Option<Cow<'a, str>>,
}

fn write_part<S: Sink>(p: &Part<'_>, canon: &mut S) {
    if let Some(t) = &p.text {
        canon.push_text(t.as_bytes());
    }
    if let Some(u) = p.image_url {
        canon.push_text(u.get().as_bytes());
    }
    if let Some(f) = p.file_id.as_ref().or(p.file_data.as_ref()) {
        canon.push_text(f.as_bytes());
    }
}

fn write_item<S: Sink>(i: &Item<'_>, canon: &mut S) {
    match i.kind.as_deref() {
        None | Some("message") => {
            canon.push_message(i.role.as_deref().unwrap_or("user").as_bytes());
            if let Some(c) = &i.content {
                c.write(canon, write_part);
            }
        }
        Some("function_call") => {
            canon.push_message(b"assistant");
            for f in [&i.call_id, &i.name, &i.arguments].into_iter().flatten() {
                canon.push_text(f.as_bytes());
            }
        }
        Some("function_call_output") => {
            canon.push_message(b"tool");
            if let Some(id) = &i.call_id {
                canon.push_text(id.as_bytes());
            }
            if let Some(o) = &i.output {
                o.write(canon, write_part);
            }
        }
        Some(other) => {
            canon.push_message(other.as_bytes());
            if let Some(c) = &i.content {
                c.write(canon, write_part);
            }
        }
    }
}

/// A string, or an array of `T` (a content field of either API).
enum OneOrMany<'a, T> {
    One(Cow<'a, str>),
    Many(Vec<T>),
}

impl<T> OneOrMany<'_, T> {
    fn write<S: Sink>(&self, canon: &mut S, each: fn(&T, &mut S)) {
        match self {
            OneOrMany::One(t) => canon.push_text(t.as_bytes()),
            OneOrMany::Many(v) => v.iter().for_each(|x| each(x, canon)),
        }
    }
}

impl<'de: 'a, 'a, T: Deserialize<'de>> Deserialize<'de> for OneOrMany<'a, T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = OneOrMany<'de, T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or an array")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(OneOrMany::One(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(OneOrMany::One(Cow::Owned(v.to_owned())))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(2).min(64));
                while let Some(x) = seq.next_element()? {
                    out.push(x);
                }
                Ok(OneOrMany::Many(out))
            }
        }
        d.deserialize_any(V(PhantomData))
    }
}

#[cfg(test)]
mod tests;
