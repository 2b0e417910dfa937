//! The stored responses: what `previous_response_id`, retrieval, cancel
//! and `input_items` read, in this process's memory only.

use super::{Ctx, Outcome, Status, invalid, not_found};
use crate::engine::api::ApiError;
use crate::engine::conversation::ChatMessage;
use serde_json::{Value, json};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

/// Responses kept for `previous_response_id` and retrieval, the oldest
/// forgotten first past it: a few thousand conversations of agentic
/// length (tens of kilobytes each) stay well under a gigabyte, and a test
/// or a benchmark chains far fewer at once.
pub const STORE_CAPACITY: usize = 4096;

/// A stored response.
struct Entry {
    ctx: Arc<Ctx>,
    outcome: Outcome,
    /// A background response's run, aborted by a cancel.
    task: Option<tokio::task::AbortHandle>,
}

/// The stored responses, in memory, [`STORE_CAPACITY`] at most.
#[derive(Default)]
pub struct Store {
    inner: Mutex<StoreInner>,
}

#[derive(Default)]
struct StoreInner {
    entries: HashMap<String, Entry>,
    /// Ids in the order they were stored, for eviction.
    order: VecDeque<String>,
}

impl Store {
    fn lock(&self) -> std::sync::MutexGuard<'_, StoreInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stores (or replaces) a response; a cancelled one keeps its status.
    pub fn put(&self, ctx: Arc<Ctx>, outcome: Outcome) {
        let mut s = self.lock();
        if let Some(e) = s.entries.get_mut(&ctx.id) {
            if e.outcome.status != Status::Cancelled {
                e.outcome = outcome;
                e.task = None;
            }
            return;
        }
        while s.order.len() >= STORE_CAPACITY {
            if let Some(old) = s.order.pop_front() {
                s.entries.remove(&old);
            }
        }
        s.order.push_back(ctx.id.clone());
        s.entries.insert(
            ctx.id.clone(),
            Entry {
                ctx,
                outcome,
                task: None,
            },
        );
    }

    /// Remembers the run of a stored background response.
    pub fn set_task(&self, id: &str, task: tokio::task::AbortHandle) {
        if let Some(e) = self.lock().entries.get_mut(id) {
            if e.outcome.status == Status::Cancelled {
                task.abort();
            } else {
                e.task = Some(task);
            }
        }
    }

    /// A stored response's chat and output text, for the next turn.
    pub(super) fn chain(&self, id: &str) -> Option<(Vec<ChatMessage<'static>>, Option<String>)> {
        let s = self.lock();
        let e = s.entries.get(id)?;
        Some((e.ctx.messages.clone(), e.outcome.text.clone()))
    }

    /// `GET /v1/responses/{id}`: the response object.
    pub fn retrieve(&self, id: &str) -> Result<Vec<u8>, ApiError> {
        let s = self.lock();
        let e = s.entries.get(id).ok_or_else(|| not_found(id))?;
        let mut o = Vec::with_capacity(2048);
        e.ctx.render(&mut o, &e.outcome);
        Ok(o)
    }

    /// `POST /v1/responses/{id}/cancel`: a queued or running response is
    /// cancelled (its run aborted) and answered; any other is a 400.
    pub fn cancel(&self, id: &str) -> Result<Vec<u8>, ApiError> {
        let mut s = self.lock();
        let e = s.entries.get_mut(id).ok_or_else(|| not_found(id))?;
        if !matches!(e.outcome.status, Status::Queued | Status::InProgress) {
            return Err(invalid(
                "Cannot cancel a synchronous response.",
                "response_id",
            ));
        }
        e.outcome.status = Status::Cancelled;
        if let Some(t) = e.task.take() {
            t.abort();
        }
        let mut o = Vec::with_capacity(2048);
        e.ctx.render(&mut o, &e.outcome);
        Ok(o)
    }

    /// `GET /v1/responses/{id}/input_items`: the request's input items as
    /// a list page, `order` `desc` (the default) or `asc`, at most `limit`
    /// (default 20, 1 to 100) after the item `after`.
    pub fn input_items(&self, id: &str, query: &str) -> Result<Vec<u8>, ApiError> {
        let s = self.lock();
        let e = s.entries.get(id).ok_or_else(|| not_found(id))?;
        let param = |k: &str| {
            query
                .split('&')
                .filter_map(|kv| kv.split_once('='))
                .find(|(key, _)| *key == k)
                .map(|(_, v)| v)
        };
        let limit = param("limit")
            .and_then(|l| l.parse::<usize>().ok())
            .unwrap_or(20)
            .clamp(1, 100);
        let mut items: Vec<&Value> = e.ctx.input_items.iter().collect();
        if param("order") != Some("asc") {
            items.reverse();
        }
        if let Some(after) = param("after")
            && let Some(i) = items.iter().position(|it| it["id"] == after)
        {
            items.drain(..=i);
        }
        let has_more = items.len() > limit;
        items.truncate(limit);
        let body = json!({
            "object": "list",
            "data": items,
            "first_id": items.first().map(|i| &i["id"]),
            "last_id": items.last().map(|i| &i["id"]),
            "has_more": has_more,
        });
        Ok(serde_json::to_vec(&body).unwrap_or_default())
    }
}
