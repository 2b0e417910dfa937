//! Fault injection: knobs settable by flags and at run time via
//! `POST /sim/faults`, and a seeded generator so runs are reproducible.

use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// Current fault knobs.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Faults {
    /// Probability of a 500 answer.
    pub fail_rate: f64,
    /// Probability of closing the connection halfway through a response.
    pub drop_mid_stream_rate: f64,
    /// Real ms to wait before the first response byte.
    pub stall_first_byte_ms: u64,
    /// Accepted connections are reset until this instant.
    #[serde(skip)]
    pub refuse_until: Option<Instant>,
    /// Remaining ms of refusal (reported only).
    pub refuse_connections_ms: u64,
    /// KV events: the batch with this sequence number is left out of the
    /// live stream (kept for replay); once.
    pub kv_events_drop_seq: Option<u64>,
    /// KV events: the batch with this sequence number is lost for good (not
    /// sent, not kept for replay); once.
    pub kv_events_lose_seq: Option<u64>,
    /// KV events: restart as a new engine at the publisher's next turn
    /// (cache emptied silently, sequence back at 0, replay buffer gone).
    pub kv_events_restart: bool,
    /// Written in place of every answer's `cached_tokens` (a JSON literal
    /// such as `3.7` or `-5`: an engine whose usage cannot be believed).
    pub bad_cached_tokens: Option<String>,
    /// KV events: both sockets are closed until this instant.
    #[serde(skip)]
    pub kv_events_pause_until: Option<Instant>,
}

/// Body of `POST /sim/faults`: absent fields stay as they are.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultUpdate {
    pub fail_rate: Option<f64>,
    pub drop_mid_stream_rate: Option<f64>,
    pub stall_first_byte_ms: Option<u64>,
    pub refuse_connections_ms: Option<u64>,
    pub kv_events_drop_seq: Option<u64>,
    pub kv_events_lose_seq: Option<u64>,
    pub kv_events_restart: Option<bool>,
    /// `cached_tokens` written as this literal ("": the true count again).
    pub bad_cached_tokens: Option<String>,
    /// Closes the KV event sockets for this many ms (the stream dies).
    pub kv_events_pause_ms: Option<u64>,
}

impl Faults {
    /// Applies an update received at `now`.
    pub fn apply(&mut self, u: &FaultUpdate, now: Instant) {
        if let Some(v) = u.fail_rate {
            self.fail_rate = v;
        }
        if let Some(v) = u.drop_mid_stream_rate {
            self.drop_mid_stream_rate = v;
        }
        if let Some(v) = u.stall_first_byte_ms {
            self.stall_first_byte_ms = v;
        }
        if let Some(v) = u.refuse_connections_ms {
            self.refuse_until = (v > 0).then(|| now + Duration::from_millis(v));
        }
        if u.kv_events_drop_seq.is_some() {
            self.kv_events_drop_seq = u.kv_events_drop_seq;
        }
        if u.kv_events_lose_seq.is_some() {
            self.kv_events_lose_seq = u.kv_events_lose_seq;
        }
        if let Some(v) = u.kv_events_restart {
            self.kv_events_restart = v;
        }
        if let Some(v) = &u.bad_cached_tokens {
            self.bad_cached_tokens = (!v.is_empty()).then(|| v.clone());
        }
        if let Some(v) = u.kv_events_pause_ms {
            self.kv_events_pause_until = (v > 0).then(|| now + Duration::from_millis(v));
        }
    }

    /// Whether connections accepted at `now` are to be reset.
    pub fn refusing(&self, now: Instant) -> bool {
        self.refuse_until.is_some_and(|t| now < t)
    }

    /// A snapshot for reporting, with the remaining refusal time.
    pub fn report(&self, now: Instant) -> Faults {
        let mut f = self.clone();
        f.refuse_connections_ms = self
            .refuse_until
            .map(|t| t.saturating_duration_since(now).as_millis() as u64)
            .unwrap_or(0);
        f
    }
}

/// A small seeded generator (splitmix64) for fault draws.
#[derive(Clone, Debug)]
pub struct Dice(u64);

impl Dice {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// True with probability `p` (never draws when `p <= 0`).
    pub fn roll(&mut self, p: f64) -> bool {
        if p <= 0.0 {
            return false;
        }
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((z >> 11) as f64 / (1u64 << 53) as f64) < p
    }
}
