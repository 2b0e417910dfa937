//! Stored responses: which backend made each response the Responses API
//! stored. An engine keeps them in its own memory (vLLM does), so a request
//! that continues one (`previous_response_id`) or reads, cancels or deletes
//! one (`/v1/responses/{id}...`) must reach that engine, or it fails: this
//! is a pin, not a guess.
//!
//! Bounded: at most `responses.max_ids` ids, each forgotten `responses.ttl_s`
//! after it was stored (the oldest first when full). Backends are named by
//! their URL's hash, as replicas name them, so the pins survive reloads and
//! are shared with peers.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Longest response id kept (vLLM's are `resp_` and 32 hex digits).
pub const MAX_ID_BYTES: usize = 256;

/// The pins, by response id.
pub struct StoredResponses {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    by_id: HashMap<Arc<str>, Entry>,
    /// Ids in the order they were stored, for expiry and eviction.
    order: VecDeque<(Arc<str>, Instant)>,
    max: usize,
    ttl: Duration,
}

#[derive(Clone, Copy)]
struct Entry {
    backend: u64,
    stored: Instant,
}

impl StoredResponses {
    pub fn new(max: usize, ttl: Duration) -> StoredResponses {
        StoredResponses {
            inner: Mutex::new(Inner {
                max,
                ttl,
                ..Inner::default()
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// New bounds (a reload); the oldest go at the next store if over.
    pub fn set_bounds(&self, max: usize, ttl: Duration) {
        let mut g = self.lock();
        g.max = max;
        g.ttl = ttl;
    }

    /// `backend` (its URL's hash) stored response `id`. An id too long or
    /// not printable is not kept.
    pub fn store(&self, id: &str, backend: u64) {
        if id.is_empty() || id.len() > MAX_ID_BYTES || !id.bytes().all(|b| b.is_ascii_graphic()) {
            return;
        }
        let now = Instant::now();
        let mut g = self.lock();
        if g.max == 0 {
            return;
        }
        g.expire(now);
        // The same ids stored again leave stale places in line: bounded too.
        while g.by_id.len() >= g.max || g.order.len() >= 2 * g.max {
            if !g.pop_oldest() {
                break;
            }
        }
        let id: Arc<str> = Arc::from(id);
        g.by_id.insert(
            id.clone(),
            Entry {
                backend,
                stored: now,
            },
        );
        g.order.push_back((id, now));
    }

    /// The backend (URL hash) that stored `id`, if it is known and fresh.
    pub fn backend_of(&self, id: &str) -> Option<u64> {
        let g = self.lock();
        let e = g.by_id.get(id)?;
        (e.stored.elapsed() < g.ttl).then_some(e.backend)
    }

    /// Ids known.
    pub fn len(&self) -> usize {
        self.lock().by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Inner {
    fn expire(&mut self, now: Instant) {
        while let Some((_, at)) = self.order.front()
            && now.duration_since(*at) >= self.ttl
        {
            self.pop_oldest();
        }
    }

    /// Forgets the oldest id stored (unless it was stored again since).
    fn pop_oldest(&mut self) -> bool {
        let Some((id, at)) = self.order.pop_front() else {
            return false;
        };
        if self.by_id.get(&id).is_some_and(|e| e.stored == at) {
            self.by_id.remove(&id);
        }
        true
    }
}

/// The response id in `/v1/responses/{id}`, `.../cancel` or
/// `.../input_items` (a normalised path, without its query).
pub fn id_in_path(path: &str) -> Option<&str> {
    let path = path.split('?').next().unwrap_or(path);
    let rest = path.strip_prefix("/v1/responses/")?;
    let id = match rest.split_once('/') {
        None => rest,
        Some((id, "cancel" | "input_items")) => id,
        Some(_) => return None,
    };
    (!id.is_empty()).then_some(id)
}

/// Finds a stored response's id in the answer as it streams by: the first
/// `"id"` key with a string value, within the answer's first bytes (the
/// response object's own id in a JSON answer; `response.id` in the
/// `response.created` event that opens a stream).
#[derive(Default)]
pub struct IdScanner {
    head: Vec<u8>,
    found: Option<String>,
    done: bool,
}

/// Bytes of an answer looked at for its id.
const ID_WINDOW: usize = 8192;

impl IdScanner {
    /// Looks at the answer's next bytes; the id when these bytes complete
    /// it (once), so the caller can pin it before they reach the client.
    pub fn feed(&mut self, bytes: &[u8]) -> Option<&str> {
        if self.done {
            return None;
        }
        let room = ID_WINDOW - self.head.len();
        self.head.extend_from_slice(&bytes[..bytes.len().min(room)]);
        if let Some(id) = first_id(&self.head) {
            self.done = true;
            return Some(self.found.insert(id));
        } else if self.head.len() >= ID_WINDOW {
            self.done = true;
        }
        None
    }

    /// The id, once found.
    pub fn id(self) -> Option<String> {
        self.found
    }
}

/// The first `"id": "..."` in `hay` whose string ends inside it.
fn first_id(hay: &[u8]) -> Option<String> {
    for at in memchr::memmem::find_iter(hay, b"\"id\"") {
        let mut i = at + 4;
        while hay.get(i).is_some_and(u8::is_ascii_whitespace) {
            i += 1;
        }
        if hay.get(i) != Some(&b':') {
            continue;
        }
        i += 1;
        while hay.get(i).is_some_and(u8::is_ascii_whitespace) {
            i += 1;
        }
        if hay.get(i) != Some(&b'"') {
            continue;
        }
        let start = i + 1;
        let len = memchr::memchr2(b'"', b'\\', &hay[start..])?;
        if hay[start + len] != b'"' {
            // An escaped id is not one an engine makes.
            return None;
        }
        return std::str::from_utf8(&hay[start..start + len])
            .ok()
            .map(str::to_owned);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_are_kept_bounded_and_expire() {
        let s = StoredResponses::new(3, Duration::from_secs(3600));
        for (i, id) in ["resp_a", "resp_b", "resp_c", "resp_d"].iter().enumerate() {
            s.store(id, i as u64);
        }
        assert_eq!(s.len(), 3);
        assert_eq!(s.backend_of("resp_a"), None, "the oldest went first");
        assert_eq!(s.backend_of("resp_d"), Some(3));
        // Stored again: the newer pin counts, the older place in line does not.
        s.store("resp_b", 9);
        s.store("resp_e", 4);
        assert_eq!(s.backend_of("resp_b"), Some(9));
        s.store("bad id", 1);
        s.store(&"x".repeat(MAX_ID_BYTES + 1), 1);
        assert_eq!(s.backend_of("bad id"), None);
        let short = StoredResponses::new(10, Duration::ZERO);
        short.store("resp_x", 1);
        assert_eq!(short.backend_of("resp_x"), None, "expired at once");
        let none = StoredResponses::new(0, Duration::from_secs(1));
        none.store("resp_x", 1);
        assert!(none.is_empty());
    }

    #[test]
    fn ids_are_read_from_paths() {
        assert_eq!(id_in_path("/v1/responses/resp_1"), Some("resp_1"));
        assert_eq!(id_in_path("/v1/responses/resp_1/cancel"), Some("resp_1"));
        assert_eq!(
            id_in_path("/v1/responses/resp_1/input_items?limit=5"),
            Some("resp_1")
        );
        assert_eq!(id_in_path("/v1/responses/resp_1/other"), None);
        assert_eq!(id_in_path("/v1/responses/"), None);
        assert_eq!(id_in_path("/v1/responses"), None);
    }

    #[test]
    fn the_first_id_of_an_answer_or_a_stream_is_found_across_reads() {
        let json = br#"{"id": "resp_123","object":"response","output":[{"id":"msg_9"}]}"#;
        let mut s = IdScanner::default();
        assert_eq!(s.feed(&json[..9]), None);
        assert_eq!(s.feed(&json[9..]), Some("resp_123"));
        // Once: the later ids are the output's, not the response's.
        assert_eq!(s.feed(json), None);
        let sse = b"event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_77\",\"object\":\"response\"}}\n\n";
        let mut s = IdScanner::default();
        assert_eq!(s.feed(sse), Some("resp_77"));
        let mut s = IdScanner::default();
        assert_eq!(s.feed(br#"{"object":"response","ids":[1],"id":3}"#), None);
    }
}
