//! Per-request records (JSONL) and the run summary.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// One request as sent and answered.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Record {
    /// Send order (0-based).
    pub seq: u64,
    pub scenario: String,
    /// Closed loop: the user slot; open loop: the session's arrival index.
    pub user: u64,
    pub session: u64,
    /// 1-based request number within the session.
    pub turn: u32,
    /// Requests the session sends in all when no run's end cuts it short
    /// (0 in records written before it was recorded).
    #[serde(default)]
    pub turns: u32,
    /// Which shared prefix (system prompt, template, document, toolset).
    pub prefix_id: u32,
    /// Milliseconds since the run started.
    pub start_ms: f64,
    pub ttft_ms: Option<f64>,
    pub end_ms: f64,
    pub latency_ms: f64,
    /// HTTP status (0 when no response arrived).
    pub status: u16,
    pub error: Option<String>,
    /// As reported by the server's `usage`.
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
    /// Prompt tokens by the simulated engine's tokenizer.
    pub local_prompt_tokens: u64,
    /// Tokens an unbounded single cache would have hit.
    pub ceiling_cached_tokens: u64,
    /// The `x-engine-id` response header, when the server passes it on
    /// (prefix-router does only with `--debug-headers`).
    pub instance: Option<String>,
    /// How prefix-router chose, with `debug_headers` (see `Outcome`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision: Option<String>,
    /// Which of the run's targets (router replicas) it was sent to, when
    /// there were several.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica: Option<u32>,
    /// The `user` it was sent as, when its workload names one for all its
    /// requests (a tenant: `Scenario::user`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

impl Record {
    /// Whether the request succeeded.
    pub fn ok(&self) -> bool {
        self.status == 200 && self.error.is_none()
    }
}

/// Percentiles of a distribution, in ms.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
    pub max: f64,
}

impl Percentiles {
    /// Nearest-rank percentiles of `v` (zeros if empty).
    pub fn of(mut v: Vec<f64>) -> Self {
        if v.is_empty() {
            return Self::default();
        }
        v.sort_by(f64::total_cmp);
        let at = |q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        Self {
            p50: at(0.5),
            p90: at(0.9),
            p99: at(0.99),
            mean: v.iter().sum::<f64>() / v.len() as f64,
            max: v[v.len() - 1],
        }
    }
}

/// What a run achieved.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Summary {
    pub scenario: String,
    pub requests: u64,
    pub ok: u64,
    pub errors: u64,
    /// Wall time of the run in seconds.
    pub duration_s: f64,
    /// Successful requests per second.
    pub throughput_rps: f64,
    pub output_tokens_per_s: f64,
    /// Sums over successful requests, as reported by the server.
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// cached_tokens / prompt_tokens.
    pub hit_rate: f64,
    /// What one engine with an unbounded cache would hit on this trace.
    pub ceiling_hit_rate: f64,
    pub ttft_ms: Percentiles,
    pub latency_ms: Percentiles,
    /// Successful requests per `x-engine-id`, of those that carried one
    /// (empty behind a router that does not pass it on; a harness that
    /// asks the engines fills it from their own counts).
    pub per_instance: BTreeMap<String, u64>,
    /// Busiest instance's requests over the mean (1.0 = perfectly even).
    pub load_max_mean_ratio: f64,
    /// Conversations served: each session's answered turns over the turns
    /// it was to send, summed (a conversation the run's end cut short
    /// counts as that share of one; a session of unknown length as one).
    #[serde(default)]
    pub conversations: f64,
}

impl Summary {
    /// Summarizes `records` of a run that lasted `duration_s`.
    pub fn from_records(scenario: &str, records: &[Record], duration_s: f64) -> Self {
        let ok: Vec<&Record> = records.iter().filter(|r| r.ok()).collect();
        let prompt_tokens: u64 = ok.iter().map(|r| r.prompt_tokens).sum();
        let cached_tokens: u64 = ok.iter().map(|r| r.cached_tokens).sum();
        let local: u64 = ok.iter().map(|r| r.local_prompt_tokens).sum();
        let ceiling: u64 = ok.iter().map(|r| r.ceiling_cached_tokens).sum();
        let mut per_instance = BTreeMap::new();
        for id in ok.iter().filter_map(|r| r.instance.as_ref()) {
            *per_instance.entry(id.clone()).or_insert(0u64) += 1;
        }
        let load_max_mean_ratio = if per_instance.is_empty() {
            0.0
        } else {
            let max = *per_instance.values().max().unwrap_or(&0) as f64;
            let attributed: u64 = per_instance.values().sum();
            max / (attributed as f64 / per_instance.len() as f64)
        };
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        let secs = duration_s.max(1e-9);
        Summary {
            scenario: scenario.to_string(),
            requests: records.len() as u64,
            ok: ok.len() as u64,
            errors: (records.len() - ok.len()) as u64,
            duration_s,
            throughput_rps: ok.len() as f64 / secs,
            output_tokens_per_s: ok.iter().map(|r| r.completion_tokens).sum::<u64>() as f64 / secs,
            prompt_tokens,
            cached_tokens,
            hit_rate: ratio(cached_tokens, prompt_tokens),
            ceiling_hit_rate: ratio(ceiling, local),
            ttft_ms: Percentiles::of(ok.iter().filter_map(|r| r.ttft_ms).collect()),
            latency_ms: Percentiles::of(ok.iter().map(|r| r.latency_ms).collect()),
            per_instance,
            load_max_mean_ratio,
            conversations: conversations(&ok),
        }
    }
}

/// Each session's answered turns over its length, summed.
fn conversations(ok: &[&Record]) -> f64 {
    let mut sessions: BTreeMap<u64, (u32, u32)> = BTreeMap::new();
    for r in ok {
        let s = sessions.entry(r.session).or_insert((0, r.turns));
        s.0 += 1;
    }
    sessions
        .values()
        .map(|&(answered, turns)| {
            if turns == 0 {
                1.0
            } else {
                f64::from(answered.min(turns)) / f64::from(turns)
            }
        })
        .sum()
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = |x: &Percentiles| {
            format!(
                "p50 {:.1}  p90 {:.1}  p99 {:.1}  mean {:.1}",
                x.p50, x.p90, x.p99, x.mean
            )
        };
        writeln!(f, "scenario        {}", self.scenario)?;
        writeln!(
            f,
            "requests        {} ok, {} errors in {:.2} s",
            self.ok, self.errors, self.duration_s
        )?;
        writeln!(
            f,
            "throughput      {:.1} req/s, {:.0} output tok/s",
            self.throughput_rps, self.output_tokens_per_s
        )?;
        writeln!(
            f,
            "prefix cache    hit rate {:.1}% ({} / {} prompt tokens), ceiling {:.1}%",
            self.hit_rate * 100.0,
            self.cached_tokens,
            self.prompt_tokens,
            self.ceiling_hit_rate * 100.0
        )?;
        writeln!(
            f,
            "conversations   {:.1} (a conversation cut short counts as its share answered)",
            self.conversations
        )?;
        writeln!(f, "TTFT ms         {}", p(&self.ttft_ms))?;
        writeln!(f, "latency ms      {}", p(&self.latency_ms))?;
        write!(f, "per instance    ")?;
        for (k, v) in &self.per_instance {
            write!(f, "{k}={v} ")?;
        }
        writeln!(f, "(max/mean {:.2})", self.load_max_mean_ratio)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_nearest_rank() {
        let p = Percentiles::of((1..=100).map(f64::from).collect());
        assert_eq!((p.p50, p.p90, p.p99, p.max), (50.0, 90.0, 99.0, 100.0));
        assert_eq!(Percentiles::of(vec![]).p50, 0.0);
    }

    fn rec(session: u64, turn: u32, turns: u32, instance: Option<&str>) -> Record {
        Record {
            seq: 0,
            scenario: "chat".into(),
            user: 0,
            session,
            turn,
            turns,
            prefix_id: 0,
            start_ms: 0.0,
            ttft_ms: Some(1.0),
            end_ms: 2.0,
            latency_ms: 2.0,
            status: 200,
            error: None,
            prompt_tokens: 100,
            cached_tokens: 50,
            completion_tokens: 10,
            local_prompt_tokens: 100,
            ceiling_cached_tokens: 50,
            instance: instance.map(String::from),
            decision: None,
            replica: None,
            tenant: None,
        }
    }

    #[test]
    fn a_conversation_cut_short_counts_as_its_share_answered() {
        let mut v = vec![rec(1, 1, 2, None), rec(1, 2, 2, None), rec(2, 1, 4, None)];
        let mut failed = rec(2, 2, 4, None);
        failed.status = 503;
        v.push(failed);
        let s = Summary::from_records("chat", &v, 1.0);
        assert_eq!(s.conversations, 1.25);
        assert!(s.per_instance.is_empty(), "no engine named, none made up");
        assert_eq!(s.load_max_mean_ratio, 0.0);
        v.push(rec(3, 1, 0, Some("e0")));
        let s = Summary::from_records("chat", &v, 1.0);
        assert_eq!(s.conversations, 2.25, "a session of unknown length is one");
        assert_eq!(s.per_instance.len(), 1);
        assert_eq!(s.load_max_mean_ratio, 1.0);
    }
}
