//! Command-line configuration of `sim-engine`. Defaults model an 8B model in
//! bf16 on one 80 GB GPU under vLLM.

use clap::Parser;

/// Simulated vLLM engine: the OpenAI-compatible API with prefix caching,
/// continuous batching and fault injection, without a GPU.
///
/// Timing: each engine step runs every decoding sequence (one token each) and
/// prefill chunks (FIFO, up to --max-num-batched-tokens) and lasts
/// decode-step-ms + decode-step-per-seq-ms x sequences + prefill tokens /
/// prefill-tps, times --time-scale. With all timing flags at 0 (or
/// --time-scale 0) requests are answered at once (zero-cost mode).
#[derive(Parser, Clone, Debug)]
#[command(name = "sim-engine", version)]
pub struct EngineArgs {
    /// Address to listen on (port 0 picks one; the chosen address is printed
    /// as `listening on ADDR` on stdout once ready).
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub listen: String,
    /// Serve this many engines, each with its own KV cache, on as many
    /// ports of the --listen address (IP:PORT; consecutive from PORT, or
    /// each picked by the OS when PORT is 0), each printing its own
    /// `listening on ADDR` and identified by its address (or `ID-k`), so a
    /// few processes stand for a fleet of hundreds. No KV events.
    #[arg(long, default_value_t = 1)]
    pub ports: u16,
    /// Instance id sent as the `x-engine-id` response header [default: the
    /// listen address].
    #[arg(long)]
    pub id: Option<String>,
    /// Served model name; repeat for several. The first labels metrics.
    #[arg(
        long = "model",
        visible_alias = "served-model-name",
        default_value = "sim-llama-8b"
    )]
    pub models: Vec<String>,
    /// LoRA adapters, as vLLM's `--lora-modules name=path ...`: each is
    /// served under its name (`"model": "name"`), with a prefix cache of its
    /// own, and listed in `/v1/models` with `parent` set to the first
    /// served model name (vLLM's default base).
    #[arg(long, num_args = 1.., value_name = "NAME=PATH")]
    pub lora_modules: Vec<String>,
    /// KV-cache capacity in 16-token blocks (6400 blocks = 102,400 tokens,
    /// about what an 8B model leaves free on an 80 GB GPU).
    #[arg(long, default_value_t = 6400)]
    pub kv_blocks: usize,
    /// Do not publish the KV capacity: leave `vllm:cache_config_info` out of
    /// `/metrics`, as SGLang, llama.cpp and TensorRT-LLM do, so a router
    /// must work with the capacity unknown.
    #[arg(long)]
    pub hide_capacity: bool,
    /// Prefill throughput in tokens per second, shared by all sequences
    /// prefilling in a step (0 = free).
    #[arg(long, default_value_t = 10_000.0)]
    pub prefill_tps: f64,
    /// Fixed time of one engine step (forward pass) in ms.
    #[arg(long, default_value_t = 15.0)]
    pub decode_step_ms: f64,
    /// Extra step time per sequence in the batch, in ms.
    #[arg(long, default_value_t = 0.1)]
    pub decode_step_per_seq_ms: f64,
    /// Maximum running sequences; later requests wait in a queue ordered
    /// by --scheduling-policy.
    #[arg(long, default_value_t = 64)]
    pub max_num_seqs: usize,
    /// Order of the waiting queue, as vLLM's: `fcfs` (arrival; a request
    /// with a nonzero `priority` is refused with 400) or `priority` (the
    /// body's integer `priority`, lower first, then arrival).
    #[arg(long, value_enum, default_value_t = SchedulingPolicy::Fcfs)]
    pub scheduling_policy: SchedulingPolicy,
    /// Token budget of one step (decodes count one each; the rest goes to
    /// prefill chunks), as vLLM's chunked prefill.
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: usize,
    /// Multiplies all simulated time (0.01 runs 100x faster than a GPU).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Output tokens when a request gives no max_tokens.
    #[arg(long, default_value_t = 32)]
    pub default_max_tokens: u32,
    /// Longest prompt + output in tokens [default: the KV-cache capacity].
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Worker threads (1 = a single-threaded runtime).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Seed of the fault-injection draws (answers depend on the prompt only).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Probability of answering an inference request with 500.
    #[arg(long, default_value_t = 0.0)]
    pub fail_rate: f64,
    /// Probability of closing the connection halfway through a response.
    #[arg(long, default_value_t = 0.0)]
    pub drop_mid_stream_rate: f64,
    /// Real (unscaled) ms to wait before the first byte of each inference response.
    #[arg(long, default_value_t = 0)]
    pub stall_first_byte_ms: u64,
    /// Write this JSON literal (e.g. `3.7`, `-5`) in place of every
    /// answer's `cached_tokens`: an engine whose usage cannot be believed.
    #[arg(long, allow_hyphen_values = true)]
    pub bad_cached_tokens: Option<String>,
    /// Refuse connections for the first N ms: the port is bound only after
    /// N ms, so connects fail with ECONNREFUSED. Set at run time through
    /// POST /sim/faults, accepted connections are reset (RST) instead.
    #[arg(long, default_value_t = 0)]
    pub refuse_connections_ms: u64,
    /// Publish vLLM's KV-cache events on a ZMQ PUB socket at 127.0.0.1:PORT
    /// (BlockStored, BlockRemoved, AllBlocksCleared; see `kv_events`) [default: off].
    #[arg(long)]
    pub kv_events_port: Option<u16>,
    /// Port of the replay ROUTER socket [default: --kv-events-port + 1].
    #[arg(long)]
    pub kv_events_replay_port: Option<u16>,
    /// Encoding of events and batches: msgspec's arrays (tag first) or maps
    /// with a `type` key (vLLM after PR 42892).
    #[arg(long, value_enum, default_value_t = super::kv_events::Encoding::Array)]
    pub kv_events_encoding: super::kv_events::Encoding,
    /// Topic frame of every message.
    #[arg(long, default_value = "kv-events")]
    pub kv_events_topic: String,
    /// Batches the replay socket keeps (vLLM's `buffer_steps`).
    #[arg(long, default_value_t = 10_000)]
    pub kv_events_buffer: usize,
    /// Block hashes as 32 raw bytes (as vLLM with a sha256 prefix-caching
    /// hash) instead of u64s.
    #[arg(long)]
    pub kv_events_bytes_hashes: bool,
    /// `data_parallel_rank` of every batch (none by default).
    #[arg(long)]
    pub kv_events_dp_rank: Option<u32>,
    /// Fault: leave the batch with this sequence number out of the live
    /// stream; it stays in the replay buffer, as a message lost on the wire.
    #[arg(long)]
    pub kv_events_drop_seq: Option<u64>,
    /// Tokenize as vLLM does with this model directory's `tokenizer.json`
    /// and the `chat_template` of its `tokenizer_config.json`, instead of
    /// the 4-byte tokenizer and ChatML [default: off].
    #[arg(long)]
    pub tokenizer_dir: Option<std::path::PathBuf>,
}

/// How the waiting queue is ordered (vLLM's `--scheduling-policy`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SchedulingPolicy {
    /// First come, first served.
    #[default]
    Fcfs,
    /// By the request's `priority` (lower first), then arrival.
    Priority,
}

impl EngineArgs {
    /// Every name a request may give in `model`: the served model names,
    /// then the LoRA adapters' names.
    pub fn served_names(&self) -> Vec<String> {
        let mut names = self.models.clone();
        names.extend(self.lora_adapters().into_iter().map(|(n, _)| n));
        names
    }

    /// The LoRA adapters as `(name, path)`; an item without `=` is its own path.
    pub fn lora_adapters(&self) -> Vec<(String, String)> {
        self.lora_modules
            .iter()
            .map(|m| match m.split_once('=') {
                Some((n, p)) => (n.to_owned(), p.to_owned()),
                None => (m.clone(), m.clone()),
            })
            .collect()
    }

    /// True when no simulated time passes: requests are answered at once.
    pub fn zero_cost(&self) -> bool {
        self.time_scale == 0.0
            || (self.prefill_tps == 0.0
                && self.decode_step_ms == 0.0
                && self.decode_step_per_seq_ms == 0.0)
    }

    /// The longest sequence accepted, in tokens.
    pub fn max_model_len(&self) -> usize {
        self.max_model_len
            .unwrap_or(self.kv_blocks * super::block_hash::BLOCK_SIZE)
    }
}
