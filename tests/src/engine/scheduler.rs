//! The scheduler task: runs engine steps back to back in simulated time.
//!
//! Step deadlines are absolute (`previous end + duration x time-scale`), so
//! timer granularity (about 1 ms) never accumulates: a step that ends late
//! makes the following ones run without sleeping until the schedule is met.
//! After an idle period the schedule restarts from the current instant.

use super::core::Engine;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// Runs forever, stepping whenever `engine` has work; `wake` is notified on
/// every submission.
pub async fn run(engine: Arc<Mutex<Engine>>, wake: Arc<Notify>, time_scale: f64) {
    let mut last_end: Option<Instant> = None;
    loop {
        let plan = engine.lock().expect("engine lock").plan_step();
        let Some(plan) = plan else {
            last_end = None;
            wake.notified().await;
            continue;
        };
        let start = last_end.unwrap_or_else(Instant::now);
        let end = start + Duration::from_secs_f64((plan.dur_s * time_scale).max(0.0));
        if end > Instant::now() {
            tokio::time::sleep_until(end.into()).await;
        } else {
            tokio::task::yield_now().await;
        }
        engine.lock().expect("engine lock").apply_step(&plan, end);
        last_end = Some(end);
    }
}
