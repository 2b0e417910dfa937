//! The renderings of a response: the `response` object (in vLLM's field
//! order, `id` first) and the events of its stream.

use super::{Ctx, Outcome, Status};
use crate::engine::api::Responder;
use std::io::Write;

impl Ctx {
    /// The `response` object: `status`, the output text (none yet: an empty
    /// `output`) and the usage (none yet: null).
    pub fn render(&self, o: &mut Vec<u8>, outcome: &Outcome) {
        let e = &self.echo;
        let incomplete = if outcome.status == Status::Incomplete {
            r#"{"reason":"max_output_tokens"}"#
        } else {
            "null"
        };
        let _ = write!(
            o,
            r#"{{"id":"{}","object":"response","created_at":{},"incomplete_details":{incomplete},"instructions":{},"metadata":{},"model":{},"output":"#,
            self.id, self.created_at, e.instructions, e.metadata, e.model
        );
        match &outcome.text {
            None => o.extend_from_slice(b"[]"),
            Some(t) => {
                o.push(b'[');
                self.message_item(o, t, "completed", true);
                o.push(b']');
            }
        }
        let _ = write!(
            o,
            r#","parallel_tool_calls":{},"temperature":{},"tool_choice":{},"tools":{},"top_p":{},"background":{},"max_output_tokens":{},"max_tool_calls":null,"previous_response_id":{},"prompt":null,"reasoning":{},"service_tier":{},"status":"{}","store":{},"text":{},"top_logprobs":null,"truncation":{},"usage":"#,
            e.parallel_tool_calls,
            e.temperature,
            e.tool_choice,
            e.tools,
            e.top_p,
            self.background,
            self.max_output_tokens,
            e.previous_response_id,
            e.reasoning,
            e.service_tier,
            outcome.status.as_str(),
            self.store,
            e.text,
            e.truncation,
        );
        match &outcome.usage {
            None => o.extend_from_slice(b"null"),
            Some(u) => {
                let _ = write!(
                    o,
                    r#"{{"input_tokens":{i},"input_tokens_details":{{"cached_tokens":{c}}},"output_tokens":{out},"output_tokens_details":{{"reasoning_tokens":0}},"total_tokens":{t}}}"#,
                    i = u.input,
                    c = u.cached,
                    out = u.output,
                    t = u.input + u.output as usize
                );
            }
        }
        let _ = write!(
            o,
            r#","user":{},"presence_penalty":0.0,"frequency_penalty":0.0}}"#,
            e.user
        );
    }

    /// The output message item with its text (`done`: with the part's
    /// text; an added item has no parts yet).
    fn message_item(&self, o: &mut Vec<u8>, text: &str, status: &str, done: bool) {
        let _ = write!(
            o,
            r#"{{"id":"{}","type":"message","role":"assistant","status":"{status}","content":["#,
            self.item_id
        );
        if done {
            let _ = write!(
                o,
                r#"{{"type":"output_text","text":"{text}","annotations":[],"logprobs":null}}"#
            );
        }
        o.extend_from_slice(b"]}");
    }
}

/// One SSE event: `event: TYPE`, then the data object, whose `type` and
/// `sequence_number` come first and `fields` (JSON members) after.
fn event(kind: &str, seq: u32, fields: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut e = Vec::with_capacity(256);
    let _ = write!(
        e,
        "event: {kind}\ndata: {{\"type\":\"{kind}\",\"sequence_number\":{seq},"
    );
    fields(&mut e);
    e.extend_from_slice(b"}\n\n");
    e
}

impl Responder<'_> {
    fn ctx(&self) -> &Ctx {
        self.ctx.expect("a Responses answer has its context")
    }

    /// The finished response's outcome.
    pub(crate) fn responses_outcome(&self, cached: u32) -> Outcome {
        Outcome::finished(
            self.digest,
            self.prompt_tokens,
            self.max_tokens,
            self.cached(cached),
        )
    }

    /// The whole non-streaming answer.
    pub(crate) fn responses_body(&self, cached: u32) -> Vec<u8> {
        let mut o = Vec::with_capacity(2048);
        self.ctx().render(&mut o, &self.responses_outcome(cached));
        o
    }

    /// `response.created`, `response.in_progress`, the message's
    /// `response.output_item.added` and `response.content_part.added`
    /// (sequence numbers 0 to 3).
    pub(crate) fn responses_start_events(&self, events: &mut Vec<Vec<u8>>) {
        let ctx = self.ctx();
        let started = Outcome {
            status: Status::InProgress,
            text: None,
            usage: None,
        };
        for (seq, kind) in ["response.created", "response.in_progress"]
            .into_iter()
            .enumerate()
        {
            events.push(event(kind, seq as u32, |e| {
                e.extend_from_slice(b"\"response\":");
                ctx.render(e, &started);
            }));
        }
        events.push(event("response.output_item.added", 2, |e| {
            e.extend_from_slice(b"\"output_index\":0,\"item\":");
            ctx.message_item(e, "", "in_progress", false);
        }));
        events.push(event("response.content_part.added", 3, |e| {
            let _ = write!(
                e,
                r#""item_id":"{}","output_index":0,"content_index":0,"part":{{"type":"output_text","text":"","annotations":[],"logprobs":[]}}"#,
                ctx.item_id
            );
        }));
    }

    /// Token `i`'s `response.output_text.delta` (sequence number `4 + i`).
    pub(crate) fn responses_delta_event(&self, i: u32) -> Vec<u8> {
        let ctx = self.ctx();
        event("response.output_text.delta", 4 + i, |e| {
            let _ = write!(
                e,
                r#""item_id":"{}","output_index":0,"content_index":0,"delta":"{}","logprobs":[]"#,
                ctx.item_id,
                self.text(i, i + 1)
            );
        })
    }

    /// `response.output_text.done`, `response.content_part.done`,
    /// `response.output_item.done` and `response.completed`.
    pub(crate) fn responses_final_events(&self, events: &mut Vec<Vec<u8>>, cached: u32) {
        let ctx = self.ctx();
        let seq = 4 + self.max_tokens;
        let text = self.text(0, self.max_tokens);
        events.push(event("response.output_text.done", seq, |e| {
            let _ = write!(
                e,
                r#""item_id":"{}","output_index":0,"content_index":0,"text":"{text}","logprobs":[]"#,
                ctx.item_id
            );
        }));
        events.push(event("response.content_part.done", seq + 1, |e| {
            let _ = write!(
                e,
                r#""item_id":"{}","output_index":0,"content_index":0,"part":{{"type":"output_text","text":"{text}","annotations":[],"logprobs":null}}"#,
                ctx.item_id
            );
        }));
        events.push(event("response.output_item.done", seq + 2, |e| {
            e.extend_from_slice(b"\"output_index\":0,\"item\":");
            ctx.message_item(e, &text, "completed", true);
        }));
        events.push(event("response.completed", seq + 3, |e| {
            e.extend_from_slice(b"\"response\":");
            e.extend_from_slice(&self.responses_body(cached));
        }));
    }
}
