//! A chat as the chat template sees it: the one form that the chat-shaped
//! APIs (`/v1/chat/completions`, Anthropic's `/v1/messages`, OpenAI's
//! `/v1/responses`) are turned into before rendering, as vLLM turns Messages
//! and Responses requests into chat messages before its template runs. The
//! same conversation therefore makes the same tokens, and hits the same
//! cached blocks, whichever API carried it.
//!
//! The simulated template is ChatML ([`super::tokenize`]) with two
//! additions where a Qwen-style template puts them: the tools, when a
//! request declares any, in a block at the end of the system message (a
//! system message of their own when the chat has none), and an assistant's
//! tool calls after its text, one `<tool_call>` block each. A tool's answer
//! is a message of role `tool`. With `--tokenizer-dir` the model's own
//! template renders the same conversation, given `tools` and each message's
//! `tool_calls` and `tool_call_id` as vLLM gives them (arguments as
//! objects).

use super::tokenize::{self, Token};
use serde_json::{Value, json};
use std::borrow::Cow;

/// One message of a chat.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatMessage<'a> {
    pub role: Cow<'a, str>,
    /// The text: a string content as given, text parts joined with `\n`
    /// (images and other parts are opaque to the template and dropped).
    pub content: Cow<'a, str>,
    /// An assistant's calls of tools.
    pub tool_calls: Vec<ToolCall>,
    /// A `tool` message's answer to this call.
    pub tool_call_id: Option<String>,
}

/// An assistant's call of a tool.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as JSON text (OpenAI's form; Anthropic's `input`
    /// object is serialized to it).
    pub arguments: String,
}

/// A function the model may call.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// Its JSON schema (OpenAI's `parameters`, Anthropic's `input_schema`).
    pub parameters: Value,
}

/// A chat and the tools it declares.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Conversation<'a> {
    pub messages: Vec<ChatMessage<'a>>,
    pub tools: Vec<Tool>,
}

impl<'a> ChatMessage<'a> {
    /// A message with text only.
    pub fn text(role: impl Into<Cow<'a, str>>, content: impl Into<Cow<'a, str>>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }

    /// The same message owning its text (for the Responses store).
    pub fn into_owned(self) -> ChatMessage<'static> {
        ChatMessage {
            role: Cow::Owned(self.role.into_owned()),
            content: Cow::Owned(self.content.into_owned()),
            tool_calls: self.tool_calls,
            tool_call_id: self.tool_call_id,
        }
    }
}

impl ToolCall {
    /// The arguments as a JSON value (a text that is not JSON stays text).
    fn arguments_value(&self) -> Value {
        serde_json::from_str(&self.arguments)
            .unwrap_or_else(|_| Value::String(self.arguments.clone()))
    }
}

impl Tool {
    /// The tool as chat completions declare it (`{"type":"function",
    /// "function":{...}}`), the form templates are given.
    fn as_function(&self) -> Value {
        let mut f = json!({"name": self.name});
        if let Some(d) = &self.description {
            f["description"] = Value::String(d.clone());
        }
        f["parameters"] = self.parameters.clone();
        json!({"type": "function", "function": f})
    }
}

impl Conversation<'_> {
    /// The prompt tokens: the chat rendered with the template, then (when
    /// asked) the generation prompt.
    pub fn tokens(&self, add_generation_prompt: bool) -> Result<Vec<Token>, String> {
        if let Some(model) = tokenize::model() {
            return self.model_tokens(model, add_generation_prompt);
        }
        let mut text = String::new();
        self.render(&mut text);
        if add_generation_prompt {
            text.push_str(tokenize::GENERATION_PROMPT);
        }
        Ok(tokenize::tokenize(&text))
    }

    /// Renders the messages with the simulated template.
    fn render(&self, out: &mut String) {
        let mut rest = &self.messages[..];
        if !self.tools.is_empty() {
            let mut system = String::new();
            if let Some((first, tail)) = rest.split_first()
                && first.role == "system"
            {
                system.push_str(&first.content);
                system.push_str("\n\n");
                rest = tail;
            }
            system.push_str("# Tools\n<tools>\n");
            for t in &self.tools {
                system.push_str(&t.as_function().to_string());
                system.push('\n');
            }
            system.push_str("</tools>");
            tokenize::render_message(out, "system", &system);
        }
        for m in rest {
            if m.tool_calls.is_empty() {
                tokenize::render_message(out, &m.role, &m.content);
                continue;
            }
            let mut content = m.content.to_string();
            for call in &m.tool_calls {
                if !content.is_empty() {
                    content.push('\n');
                }
                let call = json!({"name": call.name, "arguments": call.arguments_value()});
                content.push_str("<tool_call>\n");
                content.push_str(&call.to_string());
                content.push_str("\n</tool_call>");
            }
            tokenize::render_message(out, &m.role, &content);
        }
    }

    /// Renders with the model's own template: messages as vLLM hands them
    /// over (tool call arguments as objects), `tools` only when declared.
    fn model_tokens(
        &self,
        model: &tokenize::Model,
        add_generation_prompt: bool,
    ) -> Result<Vec<Token>, String> {
        let msgs: Vec<minijinja::Value> = self
            .messages
            .iter()
            .map(|m| {
                if m.tool_calls.is_empty() && m.tool_call_id.is_none() {
                    return minijinja::context! { role => &*m.role, content => &*m.content };
                }
                let mut v = json!({"role": &*m.role, "content": &*m.content});
                if !m.tool_calls.is_empty() {
                    v["tool_calls"] = m
                        .tool_calls
                        .iter()
                        .map(|c| {
                            json!({"id": c.id, "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments_value()}})
                        })
                        .collect();
                }
                if let Some(id) = &m.tool_call_id {
                    v["tool_call_id"] = Value::String(id.clone());
                }
                minijinja::Value::from_serialize(&v)
            })
            .collect();
        let tools = (!self.tools.is_empty()).then(|| {
            let t: Vec<Value> = self.tools.iter().map(Tool::as_function).collect();
            minijinja::Value::from_serialize(&t)
        });
        model.render_chat(msgs, tools, add_generation_prompt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool() -> Tool {
        Tool {
            name: "get_weather".into(),
            description: Some("Weather of a city".into()),
            parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
        }
    }

    #[test]
    fn without_tools_it_renders_as_plain_chatml() {
        let c = Conversation {
            messages: vec![
                ChatMessage::text("system", "be brief"),
                ChatMessage::text("user", "hello there"),
            ],
            tools: Vec::new(),
        };
        let want = tokenize::render_chat([("system", "be brief"), ("user", "hello there")]);
        assert_eq!(c.tokens(true).unwrap(), tokenize::tokenize(&want));
    }

    #[test]
    fn tools_join_the_system_message_and_calls_follow_the_text() {
        let mut c = Conversation {
            messages: vec![
                ChatMessage::text("system", "be brief"),
                ChatMessage::text("user", "weather in Paris?"),
                ChatMessage {
                    tool_calls: vec![ToolCall {
                        id: "call_1".into(),
                        name: "get_weather".into(),
                        arguments: r#"{"city": "Paris"}"#.into(),
                    }],
                    ..ChatMessage::text("assistant", "")
                },
            ],
            tools: vec![tool()],
        };
        let mut text = String::new();
        c.render(&mut text);
        assert!(text.starts_with("<|im_start|>system\nbe brief\n\n# Tools\n<tools>\n{"));
        assert_eq!(text.matches("<|im_start|>system").count(), 1);
        let call = text
            .split("<|im_start|>assistant\n<tool_call>\n")
            .nth(1)
            .expect("the call follows the assistant marker");
        assert!(call.ends_with("\n</tool_call><|im_end|>\n"), "{text}");
        assert!(call.contains(r#""name":"get_weather""#), "{text}");
        assert!(call.contains(r#""arguments":{"city":"Paris"}"#), "{text}");
        // Without a system message the tools make one.
        c.messages.remove(0);
        let mut text = String::new();
        c.render(&mut text);
        assert!(text.starts_with("<|im_start|>system\n# Tools\n<tools>\n"));
    }

    #[test]
    fn arguments_render_alike_however_their_json_is_spaced() {
        let call = |args: &str| Conversation {
            messages: vec![ChatMessage {
                tool_calls: vec![ToolCall {
                    id: "c".into(),
                    name: "f".into(),
                    arguments: args.into(),
                }],
                ..ChatMessage::text("assistant", "")
            }],
            tools: Vec::new(),
        };
        assert_eq!(
            call(r#"{"city": "Paris"}"#).tokens(false),
            call(r#"{"city":"Paris"}"#).tokens(false)
        );
    }
}
