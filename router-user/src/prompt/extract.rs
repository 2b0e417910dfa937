//! Prompt extraction: reads just enough of the JSON body to know the model and
//! the prompt, and writes the prompt's canonical form.
//!
//! The canonical form of a chat is its message sequence, each message as
//! `RS role US text`, so turn N+1 of a conversation has turn N's canonical form
//! as a prefix whatever the JSON's whitespace or key order. Completions and
//! SGLang's `/generate` use the prompt text, or the token ids as little-endian
//! u32s. The body itself is never modified: parsing runs on a scratch copy
//! (simd-json parses in place).

use std::borrow::Cow;
use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use xxhash_rust::xxh3::xxh3_64;

use crate::error::{Kind, RouterError};
use crate::prompt::hash::namespace_seed;

/// Record separator before each message of a chat.
pub(crate) const MESSAGE_START: u8 = 0x1e;
/// Unit separator between a message's role and its text.
pub(crate) const ROLE_END: u8 = 0x1f;

/// The endpoints whose body carries a prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`: `messages`.
    Chat,
    /// `POST /v1/completions`: `prompt`.
    Completions,
    /// SGLang's `POST /generate`: `text` or `input_ids`.
    Generate,
    /// Anthropic's `POST /v1/messages`: `system`, `messages`, `tools`.
    Messages,
    /// OpenAI's `POST /v1/responses`: `instructions`, `input`, `tools`.
    Responses,
}

impl Endpoint {
    pub fn from_path(method: &str, path: &str) -> Option<Endpoint> {
        if method != "POST" {
            return None;
        }
        let path = path.split('?').next().unwrap_or(path);
        match path {
            "/v1/chat/completions" => Some(Endpoint::Chat),
            "/v1/completions" => Some(Endpoint::Completions),
            "/generate" => Some(Endpoint::Generate),
            "/v1/messages" => Some(Endpoint::Messages),
            "/v1/responses" => Some(Endpoint::Responses),
            _ => None,
        }
    }

    /// A conversation of messages (rendered through the chat template).
    pub fn is_chat(self) -> bool {
        matches!(
            self,
            Endpoint::Chat | Endpoint::Messages | Endpoint::Responses
        )
    }
}

/// A request's class (the OpenAI API's `service_tier`): who waits for it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    /// `priority`: a person waiting, ahead of everyone.
    Priority,
    /// `default`, `auto` or none: interactive traffic.
    #[default]
    Default,
    /// `flex`: batch work; only throughput matters, it may wait and be shed.
    Flex,
}

impl Class {
    pub const ALL: [Class; 3] = [Class::Priority, Class::Default, Class::Flex];

    /// The class a `service_tier` value names (`None`: not one the router
    /// knows, which counts as default).
    pub fn of_tier(tier: &[u8]) -> Option<Class> {
        match tier {
            b"priority" => Some(Class::Priority),
            b"default" | b"auto" | b"standard_only" | b"" => Some(Class::Default),
            b"flex" | b"batch" => Some(Class::Flex),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Class::Priority => "priority",
            Class::Default => "default",
            Class::Flex => "flex",
        }
    }
}

/// What routing needs from a request body besides the canonical prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prompt {
    /// The namespace the prompt's block chain starts from (model, adapter, salt).
    pub seed: u64,
    /// A hash of the `user` field, for the session policy.
    pub user: Option<u64>,
}

/// Reusable scratch space for extraction; one per worker thread.
#[derive(Default)]
pub struct Extractor {
    scratch: Vec<u8>,
    buffers: Option<simd_json::Buffers>,
    /// The last request's `cache_salt` (empty: none), for precise mode's
    /// keys, which fold it into the first block as vLLM does.
    salt: Vec<u8>,
    /// The last request's prompt was token ids (its canonical form is them
    /// as little-endian u32s), not text.
    token_ids: bool,
}

impl Extractor {
    /// Whether the last request's prompt was given as token ids.
    pub fn token_ids(&self) -> bool {
        self.token_ids
    }

    /// The `cache_salt` of the last request extracted (empty: none).
    pub fn salt(&self) -> &[u8] {
        &self.salt
    }

    /// Parses `body` for `endpoint` and writes the canonical prompt to `canon`
    /// (cleared first). Errors are 400s with a message naming the problem.
    pub fn extract(
        &mut self,
        endpoint: Endpoint,
        body: &[u8],
        canon: &mut Vec<u8>,
    ) -> Result<Prompt, RouterError> {
        canon.clear();
        if matches!(endpoint, Endpoint::Messages | Endpoint::Responses) {
            // These have one reader, `prompt::apis` (serde on the body).
            return Err(RouterError::new(
                Kind::Internal,
                "the reference extractor reads chat, completions and /generate bodies",
            ));
        }
        self.scratch.clear();
        self.scratch.extend_from_slice(body);
        let buffers = self
            .buffers
            .get_or_insert_with(|| simd_json::Buffers::new(body.len().max(4096)));
        let parsed: Request<'_> =
            simd_json::serde::from_slice_with_buffers(&mut self.scratch, buffers).map_err(|e| {
                RouterError::new(
                    Kind::InvalidBody,
                    format!("request body is not valid JSON: {e}"),
                )
            })?;
        let model = parsed.model.as_deref().unwrap_or("");
        let adapter = parsed.lora_path.as_deref().unwrap_or("");
        let salt = parsed.cache_salt.as_deref().unwrap_or("");
        self.salt.clear();
        self.salt.extend_from_slice(salt.as_bytes());
        self.token_ids = false;
        let seed = namespace_seed(&[model.as_bytes(), adapter.as_bytes(), salt.as_bytes()]);
        let user = parsed.user.as_deref().map(|u| xxh3_64(u.as_bytes()));
        match endpoint {
            Endpoint::Chat => {
                let messages = parsed.messages.ok_or_else(|| {
                    RouterError::new(
                        Kind::InvalidBody,
                        "'messages' is required for /v1/chat/completions",
                    )
                })?;
                for m in &messages {
                    canon.push(MESSAGE_START);
                    canon.extend_from_slice(m.role.as_bytes());
                    canon.push(ROLE_END);
                    if let Some(content) = &m.content {
                        content.write_canonical(canon);
                    }
                }
            }
            Endpoint::Completions => {
                let prompt = parsed.prompt.ok_or_else(|| {
                    RouterError::new(
                        Kind::InvalidBody,
                        "'prompt' is required for /v1/completions",
                    )
                })?;
                self.token_ids = matches!(prompt, PromptInput::Tokens(_));
                prompt.write_canonical(canon);
            }
            Endpoint::Messages | Endpoint::Responses => {
                return Err(RouterError::new(Kind::Internal, "read by prompt::apis"));
            }
            Endpoint::Generate => match (parsed.text, parsed.input_ids) {
                (Some(text), _) => {
                    self.token_ids = matches!(text, PromptInput::Tokens(_));
                    text.write_canonical(canon)
                }
                (None, Some(ids)) => {
                    self.token_ids = matches!(ids, PromptInput::Tokens(_));
                    ids.write_canonical(canon)
                }
                (None, None) => {
                    return Err(RouterError::new(
                        Kind::InvalidBody,
                        "'text' or 'input_ids' is required for /generate",
                    ));
                }
            },
        }
        Ok(Prompt { seed, user })
    }
}

/// The fields of any prompt-carrying body that routing reads; the rest is skipped.
#[derive(Deserialize)]
struct Request<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(borrow, default)]
    prompt: Option<PromptInput<'a>>,
    #[serde(borrow, default)]
    text: Option<PromptInput<'a>>,
    #[serde(borrow, default)]
    input_ids: Option<PromptInput<'a>>,
    #[serde(borrow, default)]
    user: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    cache_salt: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    lora_path: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow)]
    role: Cow<'a, str>,
    #[serde(borrow, default)]
    content: Option<Content<'a>>,
}

/// A message's `content`: a string, or an array of parts.
enum Content<'a> {
    Text(Cow<'a, str>),
    Parts(Vec<Part<'a>>),
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    image_url: Option<Url<'a>>,
}

#[derive(Deserialize)]
struct Url<'a> {
    #[serde(borrow)]
    url: Cow<'a, str>,
}

impl Content<'_> {
    fn write_canonical(&self, canon: &mut Vec<u8>) {
        match self {
            Content::Text(t) => canon.extend_from_slice(t.as_bytes()),
            Content::Parts(parts) => {
                for p in parts {
                    if let Some(t) = &p.text {
                        canon.extend_from_slice(t.as_bytes());
                    } else if let Some(u) = &p.image_url {
                        // Images are identified by their URL (often a data: URL):
                        // the same image in the same place is the same prefix.
                        canon.extend_from_slice(u.url.as_bytes());
                    }
                }
            }
        }
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Content<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Content<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or an array of content parts")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Content::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Content::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut parts = Vec::with_capacity(seq.size_hint().unwrap_or(2));
                while let Some(p) = seq.next_element()? {
                    parts.push(p);
                }
                Ok(Content::Parts(parts))
            }
        }
        d.deserialize_any(V)
    }
}

/// A completions `prompt`, `/generate` `text` or `input_ids`: a string, token
/// ids, or a batch of either (a batch is routed by its first prompt: all of it
/// goes to one backend).
enum PromptInput<'a> {
    Text(Cow<'a, str>),
    Tokens(Vec<u32>),
    Empty,
}

impl PromptInput<'_> {
    fn write_canonical(&self, canon: &mut Vec<u8>) {
        match self {
            PromptInput::Text(t) => canon.extend_from_slice(t.as_bytes()),
            PromptInput::Tokens(ids) => {
                for id in ids {
                    canon.extend_from_slice(&id.to_le_bytes());
                }
            }
            PromptInput::Empty => {}
        }
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for PromptInput<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(PromptVisitor { nested: false })
    }
}

struct PromptVisitor {
    /// Inside a batch: only the first element counts.
    nested: bool,
}

impl<'de> Visitor<'de> for PromptVisitor {
    type Value = PromptInput<'de>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string, an array of strings, or an array of token ids")
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(PromptInput::Text(Cow::Borrowed(v)))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(PromptInput::Text(Cow::Owned(v.to_owned())))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let first: Option<Elem<'de>> = seq.next_element()?;
        let out = match first {
            None => PromptInput::Empty,
            Some(Elem::Batch(p)) if !self.nested => p,
            Some(Elem::Batch(_)) => return Err(de::Error::custom("prompt arrays nest too deep")),
            Some(Elem::Token(t)) => {
                let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(256) + 1);
                ids.push(t);
                while let Some(t) = seq.next_element::<u32>()? {
                    ids.push(t);
                }
                return Ok(PromptInput::Tokens(ids));
            }
        };
        // Skip the rest of a batch.
        while seq.next_element::<de::IgnoredAny>()?.is_some() {}
        Ok(out)
    }
}

/// One element of a prompt array: a token id, or a nested prompt (batch).
enum Elem<'a> {
    Token(u32),
    Batch(PromptInput<'a>),
}

impl<'de: 'a, 'a> Deserialize<'de> for Elem<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Elem<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a token id, a string or an array of token ids")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                u32::try_from(v)
                    .map(Elem::Token)
                    .map_err(|_| E::custom("token id out of range"))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                u32::try_from(v)
                    .map(Elem::Token)
                    .map_err(|_| E::custom("token id out of range"))
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                PromptVisitor { nested: true }
                    .visit_borrowed_str(v)
                    .map(Elem::Batch)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Elem::Batch(PromptInput::Text(Cow::Owned(v.to_owned()))))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
                PromptVisitor { nested: true }
                    .visit_seq(seq)
                    .map(Elem::Batch)
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests;
