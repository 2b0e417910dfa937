//! How far the router trusts each backend's event stream.
//!
//! - **EXACT**: the stream is connected and whole (every sequence number
//!   applied, in order, since the index last forgot the backend): routing
//!   reads the precise index for it.
//! - **DEGRADED**: not connected yet, the connection was lost, or a batch
//!   was lost for good (a gap replay could not fill, a payload that did not
//!   decode): routing reads the approximate index for it. A lost connection
//!   turns EXACT again as soon as a replay fills what was missed; a lost
//!   batch makes the precise index forget the backend, which then turns
//!   EXACT after `recover_ms` of whole stream (what it stores in that time
//!   is indexed; what it held before is only known to the approximate
//!   index, and is mostly evicted by then or stored again).
//!
//! All counters are atomics written by the backend's subscriber thread and
//! read by routing, `/metrics` and `/admin/*`.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU8, AtomicU64, Ordering::Relaxed};

use serde::Serialize;

/// The state routing reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum State {
    Exact,
    Degraded,
}

/// Why a backend is DEGRADED (the last reason).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Reason {
    None = 0,
    Connecting = 1,
    Disconnected = 2,
    Gap = 3,
    DecodeError = 4,
}

impl Reason {
    fn from_u8(v: u8) -> Reason {
        match v {
            1 => Reason::Connecting,
            2 => Reason::Disconnected,
            3 => Reason::Gap,
            4 => Reason::DecodeError,
            _ => Reason::None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Reason::None => "none",
            Reason::Connecting => "connecting",
            Reason::Disconnected => "disconnected",
            Reason::Gap => "gap",
            Reason::DecodeError => "decode-error",
        }
    }
}

/// One backend's stream state and counters.
#[derive(Default)]
pub struct Confidence {
    /// Connected and caught up: every batch since connecting applied.
    whole: AtomicBool,
    /// Why it is not whole (`Connecting` or `Disconnected`).
    link: AtomicU8,
    /// After a lost batch: why, and when it counts as EXACT again (ms since
    /// the router started; 0 = not recovering).
    lost_reason: AtomicU8,
    exact_at_ms: AtomicU64,
    /// Last sequence number applied (-1: none).
    last_seq: AtomicI64,
    /// Publish-to-apply lag of the last batch, in microseconds.
    lag_us: AtomicU64,
    pub batches: AtomicU64,
    pub events: AtomicU64,
    pub gaps: AtomicU64,
    pub unfilled_gaps: AtomicU64,
    pub replays: AtomicU64,
    pub replayed_batches: AtomicU64,
    pub restarts: AtomicU64,
    pub decode_errors: AtomicU64,
    pub skipped_events: AtomicU64,
    pub skipped_fields: AtomicU64,
    pub other_group_events: AtomicU64,
    pub unknown_parents: AtomicU64,
    pub disconnects: AtomicU64,
    pub clears: AtomicU64,
}

/// A snapshot for `/metrics` and `/admin/*`.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Snapshot {
    pub state: State,
    pub reason: &'static str,
    pub last_seq: i64,
    pub lag_ms: f64,
    pub batches: u64,
    pub events: u64,
    pub gaps: u64,
    pub unfilled_gaps: u64,
    pub replays: u64,
    pub replayed_batches: u64,
    pub restarts: u64,
    pub decode_errors: u64,
    pub skipped_events: u64,
    pub skipped_fields: u64,
    pub other_group_events: u64,
    pub unknown_parents: u64,
    pub disconnects: u64,
    pub clears: u64,
}

impl Confidence {
    /// A backend whose stream is not connected yet.
    pub fn new() -> Confidence {
        let c = Confidence::default();
        c.link.store(Reason::Connecting as u8, Relaxed);
        c.last_seq.store(-1, Relaxed);
        c
    }

    /// Back to a new backend's state (its slot was given to another).
    pub fn reset(&self) {
        self.whole.store(false, Relaxed);
        self.link.store(Reason::Connecting as u8, Relaxed);
        self.exact_at_ms.store(0, Relaxed);
        self.last_seq.store(-1, Relaxed);
        self.lag_us.store(0, Relaxed);
        for c in [
            &self.batches,
            &self.events,
            &self.gaps,
            &self.unfilled_gaps,
            &self.replays,
            &self.replayed_batches,
            &self.restarts,
            &self.decode_errors,
            &self.skipped_events,
            &self.skipped_fields,
            &self.other_group_events,
            &self.unknown_parents,
            &self.disconnects,
            &self.clears,
        ] {
            c.store(0, Relaxed);
        }
    }

    /// EXACT or DEGRADED at `now_ms`.
    #[inline]
    pub fn state(&self, now_ms: u64) -> State {
        self.state_reason(now_ms).0
    }

    fn state_reason(&self, now_ms: u64) -> (State, Reason) {
        if !self.whole.load(Relaxed) {
            return (State::Degraded, Reason::from_u8(self.link.load(Relaxed)));
        }
        let at = self.exact_at_ms.load(Relaxed);
        if at != 0 && now_ms < at {
            return (
                State::Degraded,
                Reason::from_u8(self.lost_reason.load(Relaxed)),
            );
        }
        (State::Exact, Reason::None)
    }

    /// Connected and caught up.
    pub fn whole(&self) {
        self.whole.store(true, Relaxed);
    }

    /// The connection is gone: DEGRADED until a replay fills what is missed.
    pub fn disconnected(&self) {
        self.link.store(Reason::Disconnected as u8, Relaxed);
        if self.whole.swap(false, Relaxed) {
            self.disconnects.fetch_add(1, Relaxed);
        }
    }

    /// A batch was lost for good (the index forgot the backend): DEGRADED
    /// until `exact_at_ms`.
    pub fn lost(&self, reason: Reason, exact_at_ms: u64) {
        self.lost_reason.store(reason as u8, Relaxed);
        self.exact_at_ms.store(exact_at_ms.max(1), Relaxed);
    }

    /// A batch was applied.
    pub fn applied(&self, seq: u64, lag_us: u64, events: usize) {
        self.last_seq.store(seq as i64, Relaxed);
        self.lag_us.store(lag_us, Relaxed);
        self.batches.fetch_add(1, Relaxed);
        self.events.fetch_add(events as u64, Relaxed);
    }

    pub fn snapshot(&self, now_ms: u64) -> Snapshot {
        let (state, reason) = self.state_reason(now_ms);
        let l = |a: &AtomicU64| a.load(Relaxed);
        Snapshot {
            state,
            reason: reason.name(),
            last_seq: self.last_seq.load(Relaxed),
            lag_ms: self.lag_us.load(Relaxed) as f64 / 1e3,
            batches: l(&self.batches),
            events: l(&self.events),
            gaps: l(&self.gaps),
            unfilled_gaps: l(&self.unfilled_gaps),
            replays: l(&self.replays),
            replayed_batches: l(&self.replayed_batches),
            restarts: l(&self.restarts),
            decode_errors: l(&self.decode_errors),
            skipped_events: l(&self.skipped_events),
            skipped_fields: l(&self.skipped_fields),
            other_group_events: l(&self.other_group_events),
            unknown_parents: l(&self.unknown_parents),
            disconnects: l(&self.disconnects),
            clears: l(&self.clears),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lost_batches_recover_after_their_time_and_disconnects_at_once() {
        let c = Confidence::new();
        assert_eq!(c.state(0), State::Degraded);
        c.whole();
        assert_eq!(c.state(0), State::Exact);
        c.disconnected();
        assert_eq!(c.snapshot(0).reason, "disconnected");
        c.whole();
        assert_eq!(c.state(0), State::Exact);
        c.lost(Reason::Gap, 100);
        c.whole();
        assert_eq!(c.state(99), State::Degraded, "whole, but still recovering");
        assert_eq!(c.state(100), State::Exact);
        assert_eq!(c.snapshot(100).disconnects, 1);
    }
}
