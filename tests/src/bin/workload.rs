//! `workload`: drive scenario traffic at an OpenAI-compatible server and
//! summarize it. See `workload --help`.

use clap::Parser;
use std::path::PathBuf;
use std::time::Duration;
use testkit::workload::{Api, RunConfig, Scenario, ScenarioKind, run};

/// Scenario traffic against any OpenAI-compatible base URL (router, engine
/// or vLLM), with per-request JSONL records and a summary that includes the
/// trace's hit-rate ceiling (one engine with an unbounded prefix cache).
#[derive(Parser, Debug)]
#[command(name = "workload", version)]
struct Args {
    /// Base URL, e.g. http://127.0.0.1:8000
    #[arg(long)]
    target: String,
    /// Traffic shape.
    #[arg(long, value_enum, default_value = "chat")]
    scenario: ScenarioKind,
    /// The API the conversations are sent in: chat completions; Anthropic
    /// Messages (`system` and `messages`); OpenAI Responses with the whole
    /// conversation each turn (`instructions` and `input`, `store: false`);
    /// or a Responses chain (stored; each later turn sends only what is new,
    /// with `previous_response_id`). The same conversations on every API.
    #[arg(long, value_enum, default_value = "chat")]
    api: Api,
    /// Closed loop: concurrent users (each runs sessions back to back).
    #[arg(long, default_value_t = 8)]
    users: usize,
    /// Open loop: Poisson session arrivals per second (instead of --users).
    #[arg(long)]
    rate: Option<f64>,
    /// Stop after this many requests [default: 100 unless --duration-s is given].
    #[arg(long)]
    requests: Option<u64>,
    /// Stop starting requests after this many seconds.
    #[arg(long)]
    duration_s: Option<f64>,
    /// Seed of all generated content and choices.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Model name [default: the first of GET /v1/models].
    #[arg(long)]
    model: Option<String>,
    /// Non-streaming requests (TTFT = first body byte).
    #[arg(long)]
    no_stream: bool,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 300.0)]
    timeout_s: f64,
    /// Write per-request records as JSONL here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Print the summary as JSON instead of text.
    #[arg(long)]
    json: bool,
    /// Shared prefixes (system prompts, templates, documents, toolsets) [scenario default].
    #[arg(long)]
    prefixes: Option<usize>,
    /// Tokens per shared prefix (long-doc: the largest document) [scenario default].
    #[arg(long)]
    prefix_tokens: Option<usize>,
    /// Tokens per user message [scenario default].
    #[arg(long)]
    user_tokens: Option<usize>,
    /// Requests per session as MIN-MAX or N [scenario default].
    #[arg(long)]
    turns: Option<String>,
    /// max_tokens per request [scenario default].
    #[arg(long)]
    max_tokens: Option<u32>,
    /// Mean think time between turns in ms [default: 0].
    #[arg(long)]
    think_time_ms: Option<f64>,
    /// hot-prefix: share of sessions on the hot prefix [default: 0.8].
    #[arg(long)]
    hot_fraction: Option<f64>,
    /// agent: tokens per tool result [default: 300].
    #[arg(long)]
    tool_tokens: Option<usize>,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let mut sc = Scenario::new(a.scenario);
    if let Some(v) = a.prefixes {
        sc.prefixes = v;
    }
    if let Some(v) = a.prefix_tokens {
        sc.prefix_tokens = v;
    }
    if let Some(v) = a.user_tokens {
        sc.user_tokens = v;
    }
    if let Some(t) = &a.turns {
        let (lo, hi) = t.split_once('-').unwrap_or((t, t));
        sc.turns = (lo.trim().parse()?, hi.trim().parse()?);
    }
    if let Some(v) = a.max_tokens {
        sc.max_tokens = v;
    }
    if let Some(v) = a.think_time_ms {
        sc.think_time_ms = v;
    }
    if let Some(v) = a.hot_fraction {
        sc.hot_fraction = v;
    }
    if let Some(v) = a.tool_tokens {
        sc.tool_tokens = v;
    }
    let mut cfg = RunConfig::new(a.target, sc);
    cfg.api = a.api;
    cfg.users = a.users;
    cfg.rate = a.rate;
    cfg.duration = a.duration_s.map(Duration::from_secs_f64);
    cfg.requests = a.requests.or(if cfg.duration.is_some() {
        None
    } else {
        Some(100)
    });
    cfg.seed = a.seed;
    cfg.model = a.model;
    cfg.stream = !a.no_stream;
    cfg.request_timeout = Duration::from_secs_f64(a.timeout_s);
    cfg.out = a.out;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (_, summary) = rt.block_on(run(cfg))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        print!("{summary}");
    }
    Ok(())
}
