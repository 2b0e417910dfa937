//! What the engines say of themselves, read from their `/metrics`: the
//! work each one did (requests, prompt tokens computed, busy time) and how
//! many requests each holds over time. No router's response headers are
//! needed, so every router (ours with any policy, the peers) is measured
//! the same way.

use crate::charts::Series;
use crate::fleet::Engine;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How often the load sampler reads every engine's gauges: often enough
/// for a turn's answer (a few hundred ms scaled) to show, and at 4
/// engines 20 small `GET /metrics` a second, nothing beside the traffic.
pub const LOAD_STEP: Duration = Duration::from_millis(200);

/// An engine's counters at one moment, or their growth over a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Work {
    /// `vllm:request_success_total`: inference requests completed.
    pub requests: u64,
    /// `vllm:prompt_tokens_total`: prompt tokens admitted.
    pub prompt_tokens: u64,
    /// `vllm:prefix_cache_hits_total`: of those, served from the cache.
    pub cached_tokens: u64,
    /// `sim_engine_busy_seconds_total`: simulated GPU seconds stepping
    /// (0 from an engine that does not publish it).
    pub busy_s: f64,
    /// `sim_engine_prefill_seconds_total`: the prefill part of `busy_s`.
    pub prefill_s: f64,
}

impl Work {
    /// Reads the counters from a `/metrics` text (every label set summed).
    pub fn parse(text: &str) -> Work {
        let sum = |name: &str| -> f64 {
            text.lines()
                .filter(|l| {
                    l.strip_prefix(name)
                        .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
                })
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum()
        };
        Work {
            requests: sum("vllm:request_success_total") as u64,
            prompt_tokens: sum("vllm:prompt_tokens_total") as u64,
            cached_tokens: sum("vllm:prefix_cache_hits_total") as u64,
            busy_s: sum("sim_engine_busy_seconds_total"),
            prefill_s: sum("sim_engine_prefill_seconds_total"),
        }
    }

    /// An engine's counters now (zeros when it does not answer).
    pub fn read(e: &Engine) -> Work {
        metrics_text(e.addr).map_or_else(Work::default, |t| Work::parse(&t))
    }

    /// Prompt tokens the engine computed: admitted, not served from cache.
    pub fn computed_tokens(&self) -> u64 {
        self.prompt_tokens.saturating_sub(self.cached_tokens)
    }

    /// What grew from `before` to `self`.
    pub fn since(&self, before: &Work) -> Work {
        Work {
            requests: self.requests.saturating_sub(before.requests),
            prompt_tokens: self.prompt_tokens.saturating_sub(before.prompt_tokens),
            cached_tokens: self.cached_tokens.saturating_sub(before.cached_tokens),
            busy_s: (self.busy_s - before.busy_s).max(0.0),
            prefill_s: (self.prefill_s - before.prefill_s).max(0.0),
        }
    }

    /// Several engines' work as one fleet's.
    pub fn sum(all: &[Work]) -> Work {
        all.iter().fold(Work::default(), |a, w| Work {
            requests: a.requests + w.requests,
            prompt_tokens: a.prompt_tokens + w.prompt_tokens,
            cached_tokens: a.cached_tokens + w.cached_tokens,
            busy_s: a.busy_s + w.busy_s,
            prefill_s: a.prefill_s + w.prefill_s,
        })
    }
}

fn metrics_text(addr: SocketAddr) -> Option<String> {
    let r = testkit::http::request(addr, "GET", "/metrics", &[], b"").ok()?;
    Some(String::from_utf8_lossy(&r.body).into_owned())
}

/// Requests an engine holds (running and waiting) from its `/metrics`.
fn in_flight(text: &str) -> Option<f64> {
    let gauge = |name: &str| -> Option<f64> {
        text.lines()
            .find(|l| l.strip_prefix(name).is_some_and(|r| r.starts_with('{')))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    };
    Some(gauge("vllm:num_requests_running")? + gauge("vllm:num_requests_waiting").unwrap_or(0.0))
}

/// A thread reading every engine's requests in flight each [`LOAD_STEP`]
/// until stopped: one series per engine, named by its id, in seconds
/// since `epoch`.
pub struct LoadSampler {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Series>>,
}

impl LoadSampler {
    pub fn start(engines: &[Engine], epoch: Instant) -> LoadSampler {
        let targets: Vec<(String, SocketAddr)> =
            engines.iter().map(|e| (e.id.clone(), e.addr)).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut series: Series = targets
                .iter()
                .map(|(id, _)| (id.clone(), Vec::new()))
                .collect();
            let mut next = Instant::now();
            while !flag.load(Ordering::Relaxed) {
                for (id, addr) in &targets {
                    if let Some(n) = metrics_text(*addr).as_deref().and_then(in_flight) {
                        let t = epoch.elapsed().as_secs_f64();
                        series.entry(id.clone()).or_default().push((t, n));
                    }
                }
                next += LOAD_STEP;
                let now = Instant::now();
                if next > now {
                    std::thread::sleep(next - now);
                } else {
                    next = now;
                }
            }
            series
        });
        LoadSampler {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops sampling; every engine's series.
    pub fn finish(mut self) -> Series {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default()
    }
}

impl Drop for LoadSampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name=\"m\"} 3
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name=\"m\"} 2
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name=\"m\"} 1000
vllm:prefix_cache_hits_total{model_name=\"m\"} 600
vllm:prefix_cache_queries_total{model_name=\"m\"} 1000
vllm:request_success_total{model_name=\"m\",finished_reason=\"length\"} 7
vllm:request_success_total{model_name=\"m\",finished_reason=\"stop\"} 1
sim_engine_busy_seconds_total{model_name=\"m\"} 2.5
sim_engine_prefill_seconds_total{model_name=\"m\"} 0.5
vllm:time_to_first_token_seconds_count{model_name=\"m\"} 8
";

    #[test]
    fn counters_and_gauges_are_read_by_their_names() {
        let w = Work::parse(TEXT);
        assert_eq!(
            w,
            Work {
                requests: 8,
                prompt_tokens: 1000,
                cached_tokens: 600,
                busy_s: 2.5,
                prefill_s: 0.5,
            }
        );
        assert_eq!(w.computed_tokens(), 400);
        assert_eq!(in_flight(TEXT), Some(5.0));
        assert_eq!(in_flight("nothing"), None);
        let later = Work {
            requests: 10,
            busy_s: 3.0,
            ..w
        };
        let d = later.since(&w);
        assert_eq!((d.requests, d.prompt_tokens, d.busy_s), (2, 0, 0.5));
        assert_eq!(Work::sum(&[w, d]).requests, 10);
    }
}
