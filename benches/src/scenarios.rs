//! The quality bench's rows: a workload, the fleet it runs on, and how it is
//! driven. The named scenarios are shaped like production traffic (people
//! think for seconds between turns, caches smaller than the working set,
//! engines that may not publish their capacity); the lock-step shapes of the
//! first benches stay as extra rows, named after their workload kind.

use serde::{Deserialize, Serialize};
use testkit::engine::block_hash::BLOCK_SIZE;
use testkit::workload::{Api, Scenario, ScenarioKind};

/// Mean think time between a conversation's turns, in simulated seconds:
/// a person reads an answer and types the next question in a few seconds
/// (a support chat's users take 5-30 s; 5 keeps the runs short). Drawn
/// exponentially; scaled with the time scale like everything simulated.
pub const THINK_S: f64 = 5.0;

/// How long a named scenario runs, in real seconds: a conversation of ~10
/// turns at the default think time lasts about 20 s real at time scale 0.25,
/// so 45 s sees every user through two or three conversations.
pub const NAMED_DURATION_S: f64 = 45.0;

/// How a row is driven.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Drive {
    pub engines: usize,
    /// Closed loop: concurrent users, each running conversations back to
    /// back (ignored with `arrivals_per_s`).
    pub users: usize,
    pub duration_s: f64,
    pub seed: u64,
    /// Open loop: new conversations per simulated second (Poisson), scaled
    /// with the time scale; `None` = closed loop.
    #[serde(default)]
    pub arrivals_per_s: Option<f64>,
}

/// One row group of the quality bench.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct QualityScenario {
    /// The row's name (`--scenario NAME`).
    pub name: String,
    /// One line for the report.
    pub about: String,
    pub scenario: Scenario,
    /// Per-engine KV capacity in 16-token blocks.
    pub kv_blocks: usize,
    /// The engines leave `vllm:cache_config_info` out of `/metrics`: the
    /// router is not told their capacity.
    #[serde(default)]
    pub hide_capacity: bool,
    /// Mean think time between turns in simulated seconds (0 = lock-step
    /// users who send their next turn the moment an answer ends).
    #[serde(default)]
    pub think_s: f64,
    pub drive: Drive,
    /// prefix-router's policies run on this row (the peers, when enabled,
    /// run on every row).
    #[serde(default)]
    pub policies: Vec<String>,
    /// A second workload sent to the same fleet at the same time (chats
    /// and a batch on one fleet): its own shape, think time, users or
    /// arrivals; the row's engines, capacity, duration and seed.
    #[serde(default)]
    pub alongside: Option<Box<QualityScenario>>,
    /// The API its conversations (and the second workload's) are sent in
    /// (`--api`; [`crate::apis`]): the same conversations on every API,
    /// which the engines render to the same prompts.
    #[serde(default)]
    pub api: Api,
    /// Engines that cap their running batch, with a timing of their own
    /// (`None`: the bench's timing, a batch cap that never binds).
    #[serde(default)]
    pub capped: Option<CappedEngines>,
    /// Real seconds into the run at which the last engine is killed and
    /// started again on its port, its cache lost.
    #[serde(default)]
    pub engine_restarts_s: Vec<f64>,
}

/// Engines that run at most `max_num_seqs` requests at once (vLLM's flag of
/// that name; the rest wait first come, first served), with short answers:
/// each running request holds its place for a prefill and a few decode
/// steps, so a full batch delays a new request by about one of them.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct CappedEngines {
    pub max_num_seqs: usize,
    /// Prefill tokens per simulated second.
    pub prefill_tps: f64,
    /// One decode step in simulated ms, whatever the batch.
    pub decode_step_ms: f64,
}

impl QualityScenario {
    /// The workload as sent at `time_scale`: think time in real ms.
    pub fn scaled(&self, time_scale: f64) -> Scenario {
        Scenario {
            think_time_ms: self.think_s * 1e3 * time_scale,
            ..self.scenario.clone()
        }
    }

    /// Open-loop arrivals per real second at `time_scale`.
    pub fn rate(&self, time_scale: f64) -> Option<f64> {
        self.drive.arrivals_per_s.map(|r| r / time_scale.max(1e-9))
    }

    /// The row's name, with its API when that is not the chat (records'
    /// files, progress).
    pub fn label(&self) -> String {
        match self.api {
            Api::Chat => self.name.clone(),
            api => format!("{}.{api}", self.name),
        }
    }
}

/// The support-chat turn shape of the named scenarios: users' turns of
/// ~200 tokens (a question with an order number, a pasted error), answers of
/// 150 tokens, 6-14 turns, the whole history resent each turn.
fn support_chat(prefixes: usize, prefix_tokens: usize) -> Scenario {
    Scenario {
        prefixes,
        prefix_tokens,
        user_tokens: 200,
        max_tokens: 150,
        turns: (6, 14),
        ..Scenario::new(ScenarioKind::Chat)
    }
}

/// The working set of a chat workload in blocks: the shared system prompts
/// plus the histories of the conversations alive at once. A conversation of
/// T turns that is at a uniformly random turn holds on average (T+1)/2
/// turns of history beyond its system prompt.
pub fn chat_working_set_blocks(sc: &Scenario, live_chats: usize) -> usize {
    let prompts = sc.prefixes * sc.prefix_tokens.div_ceil(BLOCK_SIZE);
    let mean_turns = f64::from(sc.turns.0 + sc.turns.1) / 2.0;
    let per_turn = (sc.user_tokens + sc.max_tokens as usize) as f64;
    let history = (mean_turns + 1.0) / 2.0 * per_turn / BLOCK_SIZE as f64;
    prompts + (live_chats as f64 * history).round() as usize
}

/// Caches that each hold about a third of the working set: three engines
/// could hold it all only if nothing were ever kept twice.
fn third_of(sc: &Scenario, live_chats: usize) -> usize {
    chat_working_set_blocks(sc, live_chats).div_ceil(3)
}

fn named(
    name: &str,
    about: &str,
    sc: Scenario,
    users: usize,
    hide_capacity: bool,
) -> QualityScenario {
    QualityScenario {
        name: name.into(),
        about: about.into(),
        kv_blocks: third_of(&sc, users),
        scenario: sc,
        hide_capacity,
        think_s: THINK_S,
        drive: Drive {
            engines: 3,
            users,
            duration_s: NAMED_DURATION_S,
            seed: 1,
            arrivals_per_s: None,
        },
        policies: ["prefix", "round-robin", "least-request"]
            .map(String::from)
            .to_vec(),
        alongside: None,
        api: Api::Chat,
        capped: None,
        engine_restarts_s: Vec::new(),
    }
}

/// The named scenarios, (a) to (d), then an open-loop one.
pub fn named_scenarios() -> Vec<QualityScenario> {
    let pressure = support_chat(6, 1500);
    let mut open = named(
        "open-loop",
        "conversations arriving at random (Poisson) instead of a fixed set of users; 6 system prompts of 1.5k tokens, capacity not published",
        pressure.clone(),
        24,
        true,
    );
    // Little's law: ~24 conversations alive when each lasts ~75 simulated
    // seconds (10 turns of a 5 s think and a ~2.5 s answer).
    open.drive.arrivals_per_s = Some(24.0 / 75.0);
    vec![
        named(
            "pressure-unpublished",
            "(a) 3 engines, 24 chats over 6 system prompts of 1.5k tokens, each cache about a third of the working set, capacity not published",
            pressure.clone(),
            24,
            true,
        ),
        named(
            "pressure-published",
            "(b) as (a), capacity published as vllm:cache_config_info",
            pressure,
            24,
            false,
        ),
        named(
            "think-48",
            "(c) 48 chats over 4 system prompts of 1.5k tokens, think time between turns, capacity not published",
            support_chat(4, 1500),
            48,
            true,
        ),
        named(
            "hot-prompt",
            "(d) one hot 2k-token system prompt shared by 32 concurrent chats, capacity not published: watch p99 and max/mean load",
            support_chat(1, 2000),
            32,
            true,
        ),
        open,
    ]
}

/// The workload of each lock-step row. Chat is shaped like a support
/// chatbot: 4 shared system prompts of 500 tokens, the support-chat turns.
pub fn scenario_for(kind: ScenarioKind) -> Scenario {
    match kind {
        ScenarioKind::Chat => support_chat(4, 500),
        _ => Scenario::new(kind),
    }
}

/// Per-engine KV capacity (16-token blocks) of each lock-step row: less
/// than the scenario's working set over the fleet, more than one session needs.
pub fn kv_blocks_for(kind: ScenarioKind) -> usize {
    match kind {
        // 4 system prompts of 32 blocks; conversations grow to ~300 blocks:
        // an engine holds its share of 24 conversations, not all of them.
        ScenarioKind::Chat => 1536,
        // 4 templates of ~94 blocks: one engine holds two or three.
        ScenarioKind::FewShot => 256,
        // 16 prompts of ~63 blocks: ~1000 blocks in all.
        ScenarioKind::HotPrefix => 384,
        // 4 documents of 600-1250 blocks.
        ScenarioKind::LongDoc => 2048,
        // 2 tool sets of ~94 blocks; loops grow to ~450 blocks.
        ScenarioKind::Agent => 1024,
    }
}

/// The lock-step rows (no think time, capacity published): the shapes of
/// the first benches, kept for comparison with earlier results.
pub fn lockstep_scenarios() -> Vec<QualityScenario> {
    [
        ScenarioKind::Chat,
        ScenarioKind::FewShot,
        ScenarioKind::HotPrefix,
        ScenarioKind::LongDoc,
        ScenarioKind::Agent,
    ]
    .into_iter()
    .map(lockstep)
    .collect()
}

/// One lock-step row. Chat is judged at steady state: long enough for
/// conversations to reach their later turns, where history dominates.
pub fn lockstep(kind: ScenarioKind) -> QualityScenario {
    let (users, duration_s) = if kind == ScenarioKind::Chat {
        (24, 24.0)
    } else {
        (16, 6.0)
    };
    QualityScenario {
        name: kind.name().into(),
        about: format!(
            "{} workload, lock-step users (no think time), capacity published",
            kind.name()
        ),
        scenario: scenario_for(kind),
        kv_blocks: kv_blocks_for(kind),
        hide_capacity: false,
        think_s: 0.0,
        drive: Drive {
            engines: 4,
            users,
            duration_s,
            seed: 1,
            arrivals_per_s: None,
        },
        policies: [
            "prefix",
            "round-robin",
            "least-request",
            "random",
            "power-of-two",
            "session",
        ]
        .map(String::from)
        .to_vec(),
        alongside: None,
        api: Api::Chat,
        capped: None,
        engine_restarts_s: Vec::new(),
    }
}

/// The templated batch's templates: few-shot prompts of 1-1.5k tokens
/// (instructions and worked examples), as an outreach or extraction job
/// fills one per record.
const TEMPLATES: usize = 16;
const TEMPLATE_TOKENS: (usize, usize) = (1000, 1500);

/// How unevenly the templates are used: Zipf's exponent. At 1.1 over 16
/// templates the most used one takes a third of the requests and the four
/// most used two thirds.
const TEMPLATE_ZIPF_S: f64 = 1.1;

/// Templated single-turn requests: a template by Zipf popularity, then a
/// personal part of 50-150 tokens (the record the template is filled with),
/// an answer of 64 tokens.
pub fn templated_batch_workload() -> Scenario {
    Scenario {
        prefixes: TEMPLATES,
        prefix_tokens: TEMPLATE_TOKENS.1,
        prefix_tokens_min: TEMPLATE_TOKENS.0,
        user_tokens: 50,
        user_tokens_max: 150,
        popularity_zipf_s: TEMPLATE_ZIPF_S,
        max_tokens: 64,
        turns: (1, 1),
        ..Scenario::new(ScenarioKind::FewShot)
    }
}

/// What a cache needs to hold a third of the templates: each engine keeps
/// about five of the sixteen, so only a fleet that keeps each template on
/// few engines holds them all.
fn third_of_templates() -> usize {
    let mean_tokens = (TEMPLATE_TOKENS.0 + TEMPLATE_TOKENS.1) / 2;
    (TEMPLATES * mean_tokens.div_ceil(BLOCK_SIZE)).div_ceil(3)
}

/// The templated batch as a row: open-loop Poisson arrivals (a job
/// submitting records as they come), single turn, capacity not published.
/// 6 requests per simulated second keep each engine's prefill about a
/// quarter busy when every template were missed.
fn templated_batch() -> QualityScenario {
    QualityScenario {
        name: "templated-batch".into(),
        about: format!(
            "single-turn requests from {TEMPLATES} few-shot templates of {}-{} tokens, Zipf popularity (s = {TEMPLATE_ZIPF_S}), a personal part of 50-150 tokens each, open-loop arrivals; each cache holds about a third of the templates, capacity not published",
            TEMPLATE_TOKENS.0, TEMPLATE_TOKENS.1
        ),
        scenario: templated_batch_workload(),
        // A third of the templates plus what the requests running at once hold.
        kv_blocks: third_of_templates() + 64,
        hide_capacity: true,
        think_s: 0.0,
        drive: Drive {
            engines: 3,
            users: 0,
            duration_s: NAMED_DURATION_S,
            seed: 1,
            arrivals_per_s: Some(6.0),
        },
        policies: ["prefix", "round-robin", "least-request"]
            .map(String::from)
            .to_vec(),
        alongside: None,
        api: Api::Chat,
        capped: None,
        engine_restarts_s: Vec::new(),
    }
}

/// The cache-pressure rows a deployment of several router replicas is
/// judged on, beyond think-48: its published twin, the templated batch,
/// and chats with a batch on one fleet.
pub fn cache_pressure_extras() -> Vec<QualityScenario> {
    let published = named(
        "think-48-published",
        "as think-48, capacity published as vllm:cache_config_info",
        support_chat(4, 1500),
        48,
        false,
    );
    let chats = support_chat(4, 1500);
    let mut batch = templated_batch();
    // Half the batch's rate beside 24 chats: the batch's templates take
    // about a third of the traffic's new prefill.
    batch.drive.arrivals_per_s = Some(3.0);
    let mut mixed = named(
        "chat-and-batch",
        "24 chats over 4 system prompts of 1.5k tokens with think time, and the templated batch at 3 requests per simulated s, on one fleet; each cache about a third of both working sets, capacity not published",
        chats.clone(),
        24,
        true,
    );
    mixed.kv_blocks = third_of(&chats, 24) + third_of_templates();
    mixed.alongside = Some(Box::new(batch));
    vec![published, templated_batch(), mixed]
}

/// The capped engines of the tail rows: 6 running requests each, 40 us of
/// prefill per uncached token and 100 us per output token, real, at the
/// bench's time scale of 0.25.
pub const CAPPED: CappedEngines = CappedEngines {
    max_num_seqs: 6,
    prefill_tps: 6250.0,
    decode_step_ms: 0.4,
};

/// The chats of the tail rows: 4 system prompts of 1,024 tokens, 6 turns of
/// 160 tokens each answered in 24, and 400 ms (real) to think.
fn capped_chat() -> Scenario {
    Scenario {
        prefixes: 4,
        prefix_tokens: 1024,
        user_tokens: 160,
        max_tokens: 24,
        turns: (6, 6),
        ..Scenario::new(ScenarioKind::Chat)
    }
}

/// Rows whose engines cap their running batch, where the tail is judged
/// against the peers: 48 chats alone, the same with the last engine
/// restarted twice, the chats with an open-loop templated batch, and the
/// chats with a batch surge marked `flex`.
pub fn capped_rows() -> Vec<QualityScenario> {
    let chat = |name: &str, about: &str| {
        let mut r = named(name, about, capped_chat(), 48, true);
        r.kv_blocks = 600;
        r.think_s = 1.6;
        r.capped = Some(CAPPED);
        r
    };
    let alone = chat(
        "capped-chat",
        "3 engines of 6 running requests each (the rest wait), 48 chats over 4 system prompts of 1,024 tokens with 400 ms (real) to think, 600-block caches, capacity not published",
    );
    let mut restart = chat(
        "capped-restart",
        "as capped-chat, the last engine killed and started again (cache lost) 15 and 30 s in",
    );
    restart.engine_restarts_s = vec![15.0, 30.0];
    let mut mixed = chat(
        "capped-chat-and-batch",
        "as capped-chat, with the templated batch at 12 requests per simulated s on the same engines",
    );
    let mut batch = templated_batch();
    batch.drive.arrivals_per_s = Some(12.0);
    batch.scenario.max_tokens = 24;
    mixed.alongside = Some(Box::new(batch));
    vec![alone, restart, mixed, surge()]
}

/// The chats of the tail rows with a batch surge marked `service_tier:
/// "flex"`: the templated batch at 17.5 requests per simulated s (70 a
/// real second), above what the capped engines can serve, so every queue
/// fills with batch work unless the router holds it back
/// (`[classes]`; run it with and without, e.g. `prefix+classes.toml`).
pub fn surge() -> QualityScenario {
    let mut r = named(
        "capped-surge",
        "as capped-chat, with a batch surge marked service_tier flex (the templated batch at 17.5 requests per simulated s, above what the fleet serves)",
        capped_chat(),
        48,
        true,
    );
    r.kv_blocks = 600;
    r.think_s = 1.6;
    r.capped = Some(CAPPED);
    let mut batch = templated_batch();
    batch.drive.arrivals_per_s = Some(17.5);
    batch.scenario.max_tokens = 24;
    batch.scenario.service_tier = Some("flex".into());
    r.alongside = Some(Box::new(batch));
    r
}

/// The body's `user` of the tenant rows' small and big tenant:
/// `benches/configs/tenants.toml` names a tenant for each. The small
/// tenant's traffic is the row's own workload, the big one's the second.
pub const SMALL_TENANT: &str = "tenant-small";
pub const BIG_TENANT: &str = "tenant-big";

/// The config that names the two tenants, from the repository's root.
pub const TENANTS_CONFIG: &str = "benches/configs/tenants.toml";

/// The small tenant's templated requests per simulated s (SMALL_RATE x 4
/// a real second at the bench's time scale); the big tenant sends
/// [`BIG_OVER_SMALL`] times as many.
pub const SMALL_RATE: f64 = 3.5;
pub const BIG_OVER_SMALL: f64 = 10.0;

/// Each tenant request's own part, in tokens (a document or a record to
/// work on after the template): never cached, so each request costs the
/// engine 16-32 ms (real) of prefill and three engines serve about 110 of
/// them a real second: the big tenant alone sends 140.
const TENANT_OWN_TOKENS: (usize, usize) = (400, 800);

/// Blocks per engine in the tenant rows: room for both tenants' templates
/// and what a minute of requests' own parts pass through, so no template
/// leaves a cache and the rows measure the engines' seats, not their
/// memory.
const TENANT_KV_BLOCKS: usize = 65_536;

/// One tenant's traffic: the templated batch (single-turn requests from
/// 16 few-shot templates of its own) with an own part of 400-800 tokens,
/// answered in 24 tokens, at `rate` per simulated s, each request sent
/// as `user`.
fn tenant_traffic(user: &str, rate: f64) -> QualityScenario {
    let mut t = templated_batch();
    t.drive.arrivals_per_s = Some(rate);
    t.scenario.max_tokens = 24;
    t.scenario.user_tokens = TENANT_OWN_TOKENS.0;
    t.scenario.user_tokens_max = TENANT_OWN_TOKENS.1;
    t.scenario.user = Some(user.into());
    t
}

/// Two tenants of the default class on the capped engines: the small one
/// alone (`capped-tenant-alone`), and beside a big one sending 10 times
/// as much, together above what the fleet serves (`capped-tenants`). Each
/// tenant fills its own 16 templates (another seed); the caches hold
/// every template on both rows. Run with and without
/// `benches/configs/tenants.toml`, which names the two tenants.
pub fn tenant_rows() -> Vec<QualityScenario> {
    let row = |name: &str, about: String, alongside: Option<QualityScenario>| {
        let mut r = tenant_traffic(SMALL_TENANT, SMALL_RATE);
        r.name = name.into();
        r.about = about;
        r.kv_blocks = TENANT_KV_BLOCKS;
        r.capped = Some(CAPPED);
        r.alongside = alongside.map(Box::new);
        r.policies = vec!["prefix".into(), format!("prefix+{TENANTS_CONFIG}")];
        r
    };
    let big = SMALL_RATE * BIG_OVER_SMALL;
    vec![
        row(
            "capped-tenant-alone",
            format!(
                "3 engines of 6 running requests each, a small tenant's templated requests (user {SMALL_TENANT}) with a part of their own of 400-800 tokens, at {SMALL_RATE} per simulated s, answered in 24 tokens, open loop; caches that hold every template"
            ),
            None,
        ),
        row(
            "capped-tenants",
            format!(
                "as capped-tenant-alone, with a big tenant (user {BIG_TENANT}, templates of its own) at {big} per simulated s beside it, above what the fleet serves"
            ),
            Some(tenant_traffic(BIG_TENANT, big)),
        ),
    ]
}

/// The name that stands for [`capped_rows`] in `--scenario`.
pub const CAPPED_SET: &str = "capped";

/// The rows a run of several router replicas reports by default
/// (`--scenario cache-pressure`): chats with think time with and without
/// published capacity, the templated batch, chats with a batch.
pub const CACHE_PRESSURE: [&str; 4] = [
    "think-48",
    "think-48-published",
    "templated-batch",
    "chat-and-batch",
];

/// The name that stands for [`CACHE_PRESSURE`] in `--scenario`.
pub const CACHE_PRESSURE_SET: &str = "cache-pressure";

/// The rows a full run goes through: the named ones, then the lock-step
/// ones. The extra cache-pressure rows run when named.
pub fn default_rows() -> Vec<QualityScenario> {
    let mut v = named_scenarios();
    v.extend(lockstep_scenarios());
    v
}

/// Every row by name.
pub fn all() -> Vec<QualityScenario> {
    let mut v = named_scenarios();
    v.extend(cache_pressure_extras());
    v.extend(capped_rows());
    v.extend(tenant_rows());
    v.extend(lockstep_scenarios());
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caches_hold_about_a_third_of_the_working_set() {
        let a = &named_scenarios()[0];
        let ws = chat_working_set_blocks(&a.scenario, a.drive.users);
        // 6 x 94 prompt blocks + 24 chats x 5.5 turns x 350 tokens / 16.
        assert_eq!(ws, 6 * 94 + 2888);
        assert_eq!(a.kv_blocks, ws.div_ceil(3));
        assert!(a.hide_capacity);
        // The longest conversation still fits one engine.
        let longest = (1500 + 14 * 350) / BLOCK_SIZE;
        assert!(longest < a.kv_blocks);
    }

    #[test]
    fn names_are_unique_and_think_time_scales() {
        let all = all();
        let mut names: Vec<_> = all.iter().map(|s| s.name.clone()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), all.len());
        let a = &all[0];
        assert_eq!(a.scaled(0.25).think_time_ms, THINK_S * 250.0);
        let open = all.iter().find(|s| s.name == "open-loop").unwrap();
        assert!((open.rate(0.25).unwrap() - 4.0 * 24.0 / 75.0).abs() < 1e-9);
        for n in CACHE_PRESSURE {
            assert!(all.iter().any(|s| s.name == n), "{n}");
        }
    }

    #[test]
    fn the_templated_batch_fits_a_third_of_its_templates_per_engine() {
        let all = all();
        let batch = all.iter().find(|s| s.name == "templated-batch").unwrap();
        assert_eq!(batch.scenario.turns, (1, 1));
        assert!(batch.drive.arrivals_per_s.is_some() && batch.think_s == 0.0);
        // 16 templates of 79 blocks on average: 422 blocks a third.
        assert_eq!(third_of_templates(), 422);
        assert!(batch.kv_blocks < 16 * 1000 / BLOCK_SIZE / 2);
        let mixed = all.iter().find(|s| s.name == "chat-and-batch").unwrap();
        let side = mixed.alongside.as_deref().unwrap();
        assert_eq!(side.scenario.kind, ScenarioKind::FewShot);
        assert_eq!(mixed.scenario.kind, ScenarioKind::Chat);
        assert!(mixed.kv_blocks > batch.kv_blocks);
        let published = all.iter().find(|s| s.name == "think-48-published").unwrap();
        let think = all.iter().find(|s| s.name == "think-48").unwrap();
        assert!(!published.hide_capacity && think.hide_capacity);
        assert_eq!(published.kv_blocks, think.kv_blocks);
    }
}
