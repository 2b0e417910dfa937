//! The workload scenarios: what each session sends, turn by turn.
//!
//! A [`Corpus`] holds the scenario's shared prefixes (system prompts,
//! few-shot templates, documents, tool sets), generated from the run's seed.
//! A [`Session`] is one conversation (one user's chat, one question or
//! document, one agent task): it yields the messages of each request and
//! takes the engine's answer, which later turns resend.

use super::synth;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;

/// The kind of traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum ScenarioKind {
    /// Multi-turn chats over a few shared system prompts; every turn resends
    /// the whole history including the engine's previous answers.
    Chat,
    /// Few-shot templates shared by many one-off questions.
    FewShot,
    /// One hot system prompt carries most of the traffic (`hot_fraction`),
    /// the rest spread over `prefixes` cold ones.
    HotPrefix,
    /// Question answering over long documents, several questions per document.
    LongDoc,
    /// Agent loops: the context grows by the answer and a tool result each step.
    Agent,
}

impl ScenarioKind {
    /// The CLI name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Chat => "chat",
            Self::FewShot => "few-shot",
            Self::HotPrefix => "hot-prefix",
            Self::LongDoc => "long-doc",
            Self::Agent => "agent",
        }
    }
}

/// A scenario and its parameters. [`Scenario::new`] gives each kind's defaults.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Scenario {
    pub kind: ScenarioKind,
    /// Shared prefixes: system prompts (chat), templates (few-shot), cold
    /// prompts (hot-prefix, plus the hot one), documents (long-doc), tool
    /// sets (agent).
    pub prefixes: usize,
    /// Tokens per shared prefix; long-doc documents get between half and all of it.
    pub prefix_tokens: usize,
    /// Tokens per user message (chat turn, question, agent task).
    pub user_tokens: usize,
    /// Requests per session, drawn uniformly from this inclusive range (chat
    /// turns, questions per document, agent steps).
    pub turns: (u32, u32),
    /// `max_tokens` of every request.
    pub max_tokens: u32,
    /// Mean think time between a session's turns in ms (exponential; 0 = none).
    pub think_time_ms: f64,
    /// hot-prefix: probability that a session uses the hot prefix.
    pub hot_fraction: f64,
    /// agent: tokens per tool result.
    pub tool_tokens: usize,
    /// How popular each shared prefix is: a session takes prefix `i`
    /// (0-based) with weight `1 / (i + 1)^s`, Zipf's law (templates and
    /// system prompts in use are far from equally popular); 0 = uniform.
    /// Not for hot-prefix, which has its own hot share.
    #[serde(default)]
    pub popularity_zipf_s: f64,
    /// few-shot: each template's tokens drawn uniformly from this to
    /// `prefix_tokens`; 0 = every template `prefix_tokens` long.
    #[serde(default)]
    pub prefix_tokens_min: usize,
    /// Each user message's tokens drawn uniformly from `user_tokens` to
    /// this (a personal part of varying length); 0 = exactly `user_tokens`.
    #[serde(default)]
    pub user_tokens_max: usize,
    /// Sent as every request's `service_tier` (`flex`: batch work the
    /// router may hold back while engines are busy); `None`: not sent.
    #[serde(default)]
    pub service_tier: Option<String>,
    /// Sent as every request's `user` in place of the conversation's own
    /// (`session-N`): the tenant the traffic belongs to, as a router's
    /// `[classes.tenants]` finds it; the records carry it as `tenant`.
    /// `None`: each conversation its own user.
    #[serde(default)]
    pub user: Option<String>,
}

impl Scenario {
    /// The defaults of `kind`.
    pub fn new(kind: ScenarioKind) -> Self {
        // What sets the kinds apart: how many shared prefixes and how long,
        // how long a user message, how many turns, how long an answer.
        let (prefixes, prefix_tokens, user_tokens, turns, max_tokens) = match kind {
            ScenarioKind::Chat => (4, 500, 60, (3, 8), 64),
            ScenarioKind::FewShot => (4, 1500, 30, (1, 1), 32),
            ScenarioKind::HotPrefix => (16, 1000, 40, (1, 1), 32),
            ScenarioKind::LongDoc => (4, 20_000, 30, (2, 5), 64),
            ScenarioKind::Agent => (2, 1500, 100, (4, 12), 96),
        };
        Scenario {
            kind,
            prefixes,
            prefix_tokens,
            user_tokens,
            turns,
            max_tokens,
            think_time_ms: 0.0,
            hot_fraction: 0.8,
            tool_tokens: 300,
            popularity_zipf_s: 0.0,
            prefix_tokens_min: 0,
            user_tokens_max: 0,
            service_tier: None,
            user: None,
        }
    }
}

/// One chat message.
#[derive(Clone, Debug)]
pub struct Msg {
    pub role: &'static str,
    pub content: Arc<str>,
}

/// The shared prefixes of a run.
#[derive(Debug)]
pub struct Corpus {
    pub scenario: Scenario,
    /// For hot-prefix, index 0 is the hot prefix.
    pub prefixes: Vec<Arc<str>>,
}

impl Corpus {
    /// Generates the prefixes of `scenario` from `seed`.
    pub fn new(scenario: &Scenario, seed: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed_c0de);
        let n = match scenario.kind {
            ScenarioKind::HotPrefix => scenario.prefixes + 1,
            _ => scenario.prefixes.max(1),
        };
        let prefixes = (0..n)
            .map(|i| {
                let mut s = match scenario.kind {
                    ScenarioKind::Chat => format!("You are assistant #{i}. Follow these rules.\n"),
                    ScenarioKind::FewShot => format!("Answer like the examples (template {i}).\n"),
                    ScenarioKind::HotPrefix => format!("System prompt {i}.\n"),
                    ScenarioKind::LongDoc => format!("Answer questions using document {i}.\n\n"),
                    ScenarioKind::Agent => format!("You are an agent with toolset {i}. Tools:\n"),
                };
                let tokens = if scenario.kind == ScenarioKind::LongDoc {
                    rng.random_range(scenario.prefix_tokens / 2..=scenario.prefix_tokens)
                } else if scenario.kind == ScenarioKind::FewShot
                    && scenario.prefix_tokens_min > 0
                    && scenario.prefix_tokens_min < scenario.prefix_tokens
                {
                    rng.random_range(scenario.prefix_tokens_min..=scenario.prefix_tokens)
                } else {
                    scenario.prefix_tokens
                };
                if scenario.kind == ScenarioKind::FewShot {
                    while crate::engine::tokenize::count_tokens(&s) < tokens {
                        s.push_str("Q: ");
                        synth::push_text(&mut rng, 20, &mut s);
                        s.push_str("\nA: ");
                        synth::push_text(&mut rng, 40, &mut s);
                        s.push('\n');
                    }
                } else {
                    synth::push_text(&mut rng, tokens, &mut s);
                }
                Arc::from(s)
            })
            .collect();
        Corpus {
            scenario: scenario.clone(),
            prefixes,
        }
    }
}

/// An index in `0..n` drawn with weight `1 / (i + 1)^s` (Zipf's law).
fn zipf_pick(rng: &mut ChaCha8Rng, n: usize, s: f64) -> usize {
    let weight = |i: usize| ((i + 1) as f64).powf(-s);
    let total: f64 = (0..n).map(weight).sum();
    let mut u = rng.random_range(0.0..total);
    for i in 0..n {
        u -= weight(i);
        if u < 0.0 {
            return i;
        }
    }
    n.saturating_sub(1)
}

/// One conversation.
#[derive(Debug)]
pub struct Session {
    pub id: u64,
    /// Which shared prefix this conversation uses.
    pub prefix_id: u32,
    /// Requests sent so far.
    pub turn: u32,
    turns: u32,
    kind: ScenarioKind,
    user_tokens: usize,
    user_tokens_max: usize,
    tool_tokens: usize,
    think_ms: f64,
    history: Vec<Msg>,
    rng: ChaCha8Rng,
}

impl Session {
    /// A new session `id` whose choices come from `seed`.
    pub fn new(corpus: &Corpus, id: u64, seed: u64) -> Self {
        let sc = &corpus.scenario;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let prefix_id = match sc.kind {
            ScenarioKind::HotPrefix if rng.random_bool(sc.hot_fraction.clamp(0.0, 1.0)) => 0,
            ScenarioKind::HotPrefix => 1 + rng.random_range(0..corpus.prefixes.len() - 1),
            _ if sc.popularity_zipf_s > 0.0 => {
                zipf_pick(&mut rng, corpus.prefixes.len(), sc.popularity_zipf_s)
            }
            _ => rng.random_range(0..corpus.prefixes.len()),
        } as u32;
        let (lo, hi) = (sc.turns.0.max(1), sc.turns.1.max(sc.turns.0.max(1)));
        let turns = rng.random_range(lo..=hi);
        let system = Msg {
            role: "system",
            content: corpus.prefixes[prefix_id as usize].clone(),
        };
        let mut history = vec![system];
        if sc.kind == ScenarioKind::Agent {
            let mut task = String::from("Task: ");
            synth::push_text(&mut rng, sc.user_tokens, &mut task);
            history.push(Msg {
                role: "user",
                content: task.into(),
            });
        }
        Session {
            id,
            prefix_id,
            turn: 0,
            turns,
            kind: sc.kind,
            user_tokens: sc.user_tokens,
            user_tokens_max: sc.user_tokens_max,
            tool_tokens: sc.tool_tokens,
            think_ms: sc.think_time_ms,
            history,
            rng,
        }
    }

    /// The messages of the next request, or `None` when the session is over.
    pub fn next_messages(&mut self) -> Option<Vec<Msg>> {
        if self.turn >= self.turns {
            return None;
        }
        self.turn += 1;
        let mut user = String::new();
        let user_tokens = if self.user_tokens_max > self.user_tokens {
            self.rng
                .random_range(self.user_tokens..=self.user_tokens_max)
        } else {
            self.user_tokens
        };
        match self.kind {
            ScenarioKind::Chat => {
                synth::push_text(&mut self.rng, user_tokens, &mut user);
                self.history.push(Msg {
                    role: "user",
                    content: user.into(),
                });
                Some(self.history.clone())
            }
            ScenarioKind::FewShot | ScenarioKind::HotPrefix | ScenarioKind::LongDoc => {
                user.push_str("Question: ");
                synth::push_text(&mut self.rng, user_tokens, &mut user);
                Some(vec![
                    self.history[0].clone(),
                    Msg {
                        role: "user",
                        content: user.into(),
                    },
                ])
            }
            ScenarioKind::Agent => Some(self.history.clone()),
        }
    }

    /// Takes the answer to the last request (later turns resend it).
    pub fn record_answer(&mut self, answer: &str) {
        match self.kind {
            ScenarioKind::Chat => self.history.push(Msg {
                role: "assistant",
                content: answer.into(),
            }),
            ScenarioKind::Agent => {
                self.history.push(Msg {
                    role: "assistant",
                    content: answer.into(),
                });
                let mut result = String::from("Tool result:\n");
                synth::push_text(&mut self.rng, self.tool_tokens, &mut result);
                self.history.push(Msg {
                    role: "tool",
                    content: result.into(),
                });
            }
            _ => {}
        }
    }

    /// Requests the session sends in all.
    pub fn turns(&self) -> u32 {
        self.turns
    }

    /// Whether more requests follow.
    pub fn has_more(&self) -> bool {
        self.turn < self.turns
    }

    /// A think time drawn before the next turn.
    pub fn think_time(&mut self) -> Duration {
        if self.think_ms <= 0.0 {
            return Duration::ZERO;
        }
        let u: f64 = self.rng.random_range(f64::EPSILON..1.0);
        Duration::from_secs_f64(-u.ln() * self.think_ms / 1e3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_history_grows_with_answers_and_is_seeded() {
        let corpus = Corpus::new(&Scenario::new(ScenarioKind::Chat), 3);
        let mut a = Session::new(&corpus, 1, 42);
        let mut b = Session::new(&corpus, 1, 42);
        let m1 = a.next_messages().unwrap();
        assert_eq!(m1.len(), 2);
        a.record_answer("foo ");
        let m2 = a.next_messages().unwrap();
        assert_eq!(m2.len(), 4);
        assert_eq!(&*m2[2].content, "foo ");
        assert_eq!(b.next_messages().unwrap()[1].content, m1[1].content);
    }

    #[test]
    fn think_time_is_exponential_with_its_mean() {
        let sc = Scenario {
            think_time_ms: 400.0,
            ..Scenario::new(ScenarioKind::Chat)
        };
        let corpus = Corpus::new(&sc, 3);
        let mut s = Session::new(&corpus, 1, 9);
        let draws: Vec<f64> = (0..4000)
            .map(|_| s.think_time().as_secs_f64() * 1e3)
            .collect();
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        assert!((370.0..430.0).contains(&mean), "mean {mean}");
        // Exponential: about e^-1 of the draws exceed the mean.
        let above = draws.iter().filter(|&&d| d > 400.0).count() as f64 / draws.len() as f64;
        assert!((0.33..0.41).contains(&above), "{above}");
        let mut lockstep = Session::new(&Corpus::new(&Scenario::new(ScenarioKind::Chat), 3), 1, 9);
        assert_eq!(lockstep.think_time(), Duration::ZERO);
    }

    #[test]
    fn zipf_popularity_favours_the_first_templates_and_lengths_vary() {
        let sc = Scenario {
            prefixes: 16,
            prefix_tokens: 1500,
            prefix_tokens_min: 1000,
            user_tokens: 50,
            user_tokens_max: 150,
            popularity_zipf_s: 1.1,
            ..Scenario::new(ScenarioKind::FewShot)
        };
        let corpus = Corpus::new(&sc, 3);
        let lens: Vec<usize> = corpus
            .prefixes
            .iter()
            .map(|p| crate::engine::tokenize::count_tokens(p))
            .collect();
        assert!(lens.iter().all(|&n| (1000..1600).contains(&n)), "{lens:?}");
        assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() > 100);
        let mut counts = [0usize; 16];
        let mut personal = Vec::new();
        for i in 0..4000 {
            let mut s = Session::new(&corpus, i, i);
            counts[s.prefix_id as usize] += 1;
            let m = s.next_messages().unwrap();
            personal.push(crate::engine::tokenize::count_tokens(&m[1].content));
            assert!(s.next_messages().is_none(), "single turn");
        }
        // Weight 1 of a total of about 3.0 for s = 1.1 over 16.
        let first = counts[0] as f64 / 4000.0;
        assert!((0.29..0.37).contains(&first), "{counts:?}");
        assert!(
            counts[0] > 3 * counts[3] && counts[3] > counts[15],
            "{counts:?}"
        );
        let (lo, hi) = (
            *personal.iter().min().unwrap(),
            *personal.iter().max().unwrap(),
        );
        assert!(lo >= 50 && hi <= 160 && hi - lo > 60, "{lo}..{hi}");
    }

    #[test]
    fn hot_prefix_is_mostly_hot() {
        let corpus = Corpus::new(&Scenario::new(ScenarioKind::HotPrefix), 3);
        let hot = (0..1000)
            .filter(|&i| Session::new(&corpus, i, i).prefix_id == 0)
            .count();
        assert!((700..900).contains(&hot), "{hot}");
    }
}
