//! Prometheus metrics under vLLM's names, rendered as text on `GET /metrics`.

use std::fmt::Write;

/// TTFT histogram bucket bounds in seconds (vLLM's).
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// End-to-end latency bucket bounds in seconds (vLLM's).
const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// A cumulative histogram.
#[derive(Clone, Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    /// Records one observation.
    pub fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.count
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cum = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cum += c;
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b}\"}} {cum}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
    }
}

/// Counters of one engine.
#[derive(Clone, Debug)]
pub struct Metrics {
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub requests_success: u64,
    /// Simulated seconds the engine spent stepping (before `--time-scale`:
    /// GPU time in the timing model), all steps.
    pub busy_seconds: f64,
    /// The part of `busy_seconds` spent computing prompt tokens.
    pub prefill_seconds: f64,
    pub ttft: Histogram,
    pub e2e: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            prefix_cache_queries: 0,
            prefix_cache_hits: 0,
            prompt_tokens: 0,
            generation_tokens: 0,
            requests_success: 0,
            busy_seconds: 0.0,
            prefill_seconds: 0.0,
            ttft: Histogram::new(TTFT_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
        }
    }
}

/// Gauges sampled at scrape time.
pub struct Gauges {
    pub running: usize,
    pub waiting: usize,
    /// Share of the KV blocks held by running requests (as vLLM's
    /// `kv_cache_usage_perc`: cached blocks no request holds count as free).
    pub kv_usage: f64,
    /// The KV capacity published as `vllm:cache_config_info`; `None` leaves
    /// it out (`--hide-capacity`), as SGLang and llama.cpp do.
    pub num_blocks: Option<usize>,
}

impl Metrics {
    /// Renders everything in Prometheus text format.
    pub fn render(&self, model: &str, g: &Gauges) -> String {
        let mut o = String::with_capacity(4096);
        let l = format!(
            "model_name=\"{}\"",
            model.replace('\\', "\\\\").replace('"', "\\\"")
        );
        let gauge = |o: &mut String, name: &str, v: f64| {
            let _ = writeln!(o, "# TYPE {name} gauge\n{name}{{{l}}} {v}");
        };
        let counter = |o: &mut String, name: &str, v: u64| {
            let _ = writeln!(o, "# TYPE {name} counter\n{name}{{{l}}} {v}");
        };
        gauge(&mut o, "vllm:num_requests_running", g.running as f64);
        gauge(&mut o, "vllm:num_requests_waiting", g.waiting as f64);
        gauge(&mut o, "vllm:kv_cache_usage_perc", g.kv_usage);
        counter(
            &mut o,
            "vllm:prefix_cache_queries_total",
            self.prefix_cache_queries,
        );
        counter(
            &mut o,
            "vllm:prefix_cache_hits_total",
            self.prefix_cache_hits,
        );
        counter(&mut o, "vllm:prompt_tokens_total", self.prompt_tokens);
        counter(
            &mut o,
            "vllm:generation_tokens_total",
            self.generation_tokens,
        );
        let _ = writeln!(
            o,
            "# TYPE vllm:request_success_total counter\nvllm:request_success_total{{{l},finished_reason=\"length\"}} {}",
            self.requests_success
        );
        // Not vLLM's: the simulated GPU time, what a request costs.
        for (name, v) in [
            ("sim_engine_busy_seconds_total", self.busy_seconds),
            ("sim_engine_prefill_seconds_total", self.prefill_seconds),
        ] {
            let _ = writeln!(o, "# TYPE {name} counter\n{name}{{{l}}} {v}");
        }
        self.ttft
            .render(&mut o, "vllm:time_to_first_token_seconds", &l);
        self.e2e
            .render(&mut o, "vllm:e2e_request_latency_seconds", &l);
        if let Some(blocks) = g.num_blocks {
            let _ = writeln!(
                o,
                "# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{}\",enable_prefix_caching=\"True\",num_gpu_blocks=\"{}\"}} 1.0",
                super::block_hash::BLOCK_SIZE,
                blocks
            );
        }
        o
    }
}
