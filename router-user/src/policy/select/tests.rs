use super::*;
use proptest::prelude::*;

const P: PrefixParams = PrefixParams {
    epsilon: 0.25,
    slack: 2,
    in_flight_cost_blocks: 2.0,
    min_match_blocks: 1,
    overload_cost_blocks: 64.0,
    safety_factor: 2.0,
    pressure_slack: 0.1,
    move_cost: 1.0,
    sticky_min_blocks: 32,
    hold_private: false,
    shared_in_flight_cost_blocks: 64.0,
    shared_gap: 0,
    // Never full, unless a test says so.
    full_cache_pressure: f64::INFINITY,
    full_cache_epsilon: 1.0,
    full_cache_safety_factor: 2.5,
    full_cache_shared_gap: 14,
    saturated_queue_s: 0.0,
};

/// The defaults' way with conversations and new ones (see `config.rs`):
/// histories held to the safety cap, new conversations kept with their
/// prompt until its engines are `shared_gap` requests over the idlest.
const HOLD: PrefixParams = PrefixParams {
    slack: 3,
    hold_private: true,
    shared_in_flight_cost_blocks: 2.0,
    shared_gap: 6,
    ..P
};

fn fleet(n: usize) -> Vec<BackendLoad> {
    (0..n)
        .map(|i| BackendLoad {
            eligible: true,
            id_hash: mix(i as u64 + 100),
            ..Default::default()
        })
        .collect()
}

fn input(matches: &[u32], blocks: u32, key: u64) -> RouteInput<'_> {
    RouteInput {
        matches,
        blocks,
        cold_key: key,
        session_key: None,
        ticket: 0,
        answered: None,
    }
}

#[test]
fn longest_prefix_wins_when_loads_are_equal() {
    let loads = fleet(4);
    let m = [0, 30, 5, 0];
    let c = select(Policy::Prefix, &input(&m, 40, 1), &loads, &P);
    assert_eq!(c.first(), Some(1));
    assert_eq!(c.decision, Decision::Warm);
    assert_eq!(c.matched_blocks, 30);
}

#[test]
fn an_overloaded_holder_is_passed_over() {
    let mut loads = fleet(4);
    loads[1].in_flight = 20;
    let m = [0, 30, 5, 0];
    let c = select(Policy::Prefix, &input(&m, 40, 1), &loads, &P);
    assert_ne!(c.first(), Some(1));
    assert_eq!(c.decision, Decision::Bounded);
}

#[test]
fn queued_prefill_weighs_against_a_short_match() {
    let mut loads = fleet(2);
    loads[0].queued_prefill_blocks = 500;
    let m = [3, 0];
    let c = select(Policy::Prefix, &input(&m, 10, 1), &loads, &P);
    assert_eq!(c.first(), Some(1));
}

#[test]
fn cold_prompts_with_the_same_key_land_together_and_spread_by_key() {
    let loads = fleet(4);
    let m = [0; 4];
    let a = select(Policy::Prefix, &input(&m, 10, 42), &loads, &P);
    let b = select(Policy::Prefix, &input(&m, 99, 42), &loads, &P);
    assert_eq!(a.first(), b.first());
    assert_eq!(a.decision, Decision::Cold);
    let spread: std::collections::HashSet<_> = (0..64)
        .map(|k| select(Policy::Prefix, &input(&m, 1, k), &loads, &P).first())
        .collect();
    assert_eq!(spread.len(), 4, "keys spread over every backend");
}

#[test]
fn no_eligible_backend_gives_an_empty_choice() {
    let mut loads = fleet(3);
    for l in &mut loads {
        l.eligible = false;
    }
    for policy in [
        Policy::Prefix,
        Policy::RoundRobin,
        Policy::Session,
        Policy::PowerOfTwo,
    ] {
        assert_eq!(select(policy, &input(&[0; 3], 1, 1), &loads, &P).len, 0);
    }
}

#[test]
fn ineligible_backends_are_never_chosen_or_retried() {
    let mut loads = fleet(5);
    loads[2].eligible = false;
    for policy in [
        Policy::Prefix,
        Policy::RoundRobin,
        Policy::LeastRequest,
        Policy::Random,
        Policy::PowerOfTwo,
        Policy::Session,
    ] {
        for t in 0..50 {
            let m = [0, 0, 90, 0, 0];
            let mut i = input(&m, 100, t);
            i.ticket = t;
            let c = select(policy, &i, &loads, &P);
            assert!(
                c.iter().all(|b| b != 2),
                "{policy:?} picked an ineligible backend"
            );
            assert_eq!(c.len, MAX_CANDIDATES);
        }
    }
}

#[test]
fn round_robin_cycles_over_eligible_backends() {
    let loads = fleet(3);
    let picks: Vec<_> = (0..6)
        .map(|t| {
            let mut i = input(&[0; 3], 1, 1);
            i.ticket = t;
            select(Policy::RoundRobin, &i, &loads, &P).first().unwrap()
        })
        .collect();
    assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
}

#[test]
fn session_policy_is_sticky_per_session() {
    let loads = fleet(8);
    let pick = |s: u64, t: u64| {
        let mut i = input(&[0; 8], 1, t);
        i.session_key = Some(s);
        select(Policy::Session, &i, &loads, &P).first().unwrap()
    };
    for s in 0..20 {
        assert_eq!(pick(s, 1), pick(s, 999));
    }
}

#[test]
fn least_request_picks_the_idlest() {
    let mut loads = fleet(3);
    loads[0].in_flight = 3;
    loads[1].in_flight = 1;
    loads[2].in_flight = 2;
    assert_eq!(
        select(Policy::LeastRequest, &input(&[0; 3], 1, 1), &loads, &P).first(),
        Some(1)
    );
}

#[test]
fn a_long_history_stays_on_its_engine_over_the_balance_bound() {
    // Mean load (6 + 1) / 3: bound floor(1.25 * 2.33) + 2 = 4, cap 6.
    let mut loads = fleet(3);
    loads[0].in_flight = 5;
    loads[1].in_flight = 1;
    // 300 blocks of history on backend 0, which no other engine holds even
    // the start of: two requests over the bound cost 256 blocks,
    // recomputing all of it elsewhere 300 and more.
    let m = [300, 0, 0];
    let c = select(Policy::Prefix, &input(&m, 310, 1), &loads, &P);
    assert_eq!(c.first(), Some(0));
    assert_eq!(c.decision, Decision::Warm);
    // Where another engine under the bound holds the start (the system
    // prompt), the conversation moves there and recomputes its history only.
    let m = [300, 20, 0];
    let c = select(Policy::Prefix, &input(&m, 310, 1), &loads, &P);
    assert_eq!(c.first(), Some(1));
    assert_eq!(c.decision, Decision::Bounded);
}

#[test]
fn a_hot_shared_prefix_gets_a_second_engine() {
    // The shared prompt (100 blocks) is on backend 0 only, which is three
    // requests over the bound: a new conversation (10 blocks of its own)
    // is predicted faster on an idle engine, recomputing the prompt there.
    let mut loads = fleet(3);
    loads[0].in_flight = 8;
    let m = [100, 0, 0];
    let c = select(Policy::Prefix, &input(&m, 110, 1), &loads, &P);
    assert_ne!(c.first(), Some(0));
    assert_eq!(c.decision, Decision::Bounded);
    // Once a second engine holds it, the next conversation goes there.
    let m = [100, 100, 0];
    let c = select(Policy::Prefix, &input(&m, 110, 2), &loads, &P);
    assert_eq!(c.first(), Some(1));
    assert_eq!(c.decision, Decision::Warm);
}

#[test]
fn the_faster_prefill_wins_between_equal_matches() {
    let mut loads = fleet(2);
    loads[0].prefill_rate = 500.0;
    loads[1].prefill_rate = 2000.0;
    let m = [10, 10];
    for key in 0..20 {
        let c = select(Policy::Prefix, &input(&m, 200, key), &loads, &P);
        assert_eq!(c.first(), Some(1));
    }
}

#[test]
fn new_prefixes_skip_a_fuller_cache() {
    let mut loads = fleet(3);
    for l in &mut loads {
        l.capacity_blocks = 1000;
    }
    loads[0].cached_blocks = 900;
    loads[1].cached_blocks = 100;
    loads[2].cached_blocks = 120;
    let m = [0; 3];
    for key in 0..64 {
        let c = select(Policy::Prefix, &input(&m, 50, key), &loads, &P);
        assert_eq!(c.decision, Decision::Cold);
        assert_ne!(c.first(), Some(0), "key {key} went to the full cache");
    }
    // Within the slack, rendezvous decides: both of the emptier two are used.
    let picks: std::collections::HashSet<_> = (0..64)
        .map(|k| select(Policy::Prefix, &input(&m, 50, k), &loads, &P).first())
        .collect();
    assert_eq!(picks.len(), 2);
}

#[test]
fn explained_scores_agree_with_the_choice() {
    let mut loads = fleet(4);
    loads[0].in_flight = 6;
    loads[1].queued_prefill_blocks = 80;
    loads[2].in_flight = 2;
    let m = [120, 100, 40, 0];
    let i = input(&m, 130, 9);
    let c = select(Policy::Prefix, &i, &loads, &P);
    let scores = prefix_scores(&i, &loads, &P);
    let best = scores
        .iter()
        .filter(|s| !s.capped)
        .min_by(|a, b| a.predicted_ttft_s.total_cmp(&b.predicted_ttft_s))
        .unwrap();
    assert_eq!(c.first(), Some(best.backend));
    assert_eq!(scores.len(), 4);
}

#[test]
fn a_held_history_stays_past_the_balance_bound_up_to_the_safety_cap() {
    // Mean (5 + 1 + 1) / 3 = 2.33: bound floor(1.25 * 2.33) + 3 = 5, safety
    // cap floor(2 * 2.33) + 3 = 7. Backend 1 holds the system prompt too:
    // without holding, the conversation would move there (see above).
    let mut loads = fleet(3);
    loads[0].in_flight = 5;
    loads[1].in_flight = 1;
    let m = [300, 20, 0];
    let c = select(Policy::Prefix, &input(&m, 310, 1), &loads, &HOLD);
    assert_eq!(c.first(), Some(0));
    assert_eq!(c.decision, Decision::Warm);
    // At the safety cap it moves after all: mean 14 / 3, cap 9 + 3 = 12.
    loads[0].in_flight = 12;
    let c = select(Policy::Prefix, &input(&m, 310, 1), &loads, &HOLD);
    assert_eq!(c.first(), Some(1));
    assert_eq!(c.decision, Decision::Bounded);
}

#[test]
fn a_new_conversation_stays_with_its_prompt_until_the_gap() {
    // The prompt (100 blocks) on backends 0 and 1; backend 2 lacks it.
    let mut loads = fleet(3);
    let m = [100, 100, 0];
    // Three more in flight than the idlest: a fluctuation, the prompt's
    // engines keep it (a copy on a third engine costs its prefill and room).
    loads[0].in_flight = 3;
    loads[1].in_flight = 3;
    for key in 0..16 {
        let c = select(Policy::Prefix, &input(&m, 110, key), &loads, &HOLD);
        assert_ne!(c.first(), Some(2), "key {key}");
    }
    // One engine holds a prompt, five more in flight there than on the
    // idlest, under the balance bound (floor(1.25 * 10 / 3) + 3 = 7): still
    // a fluctuation at 24 users on 3 engines, and a copy on another engine
    // would cost more hits than the wait (shared_gap 6, not 4).
    let mut one = fleet(3);
    one[0].in_flight = 6;
    one[1].in_flight = 2;
    one[2].in_flight = 1;
    for key in 0..16 {
        // A chat without an answer: a new conversation, private to no engine.
        let mut i = input(&[100, 0, 0], 110, key);
        i.answered = Some(false);
        let c = select(Policy::Prefix, &i, &one, &HOLD);
        assert_eq!(c.first(), Some(0), "key {key}");
    }
    // Two crowded engines, one idle (the mean-relative bound would let them
    // reach 20 before a third engine got the prompt): the idle one gets it.
    loads[0].in_flight = 8;
    loads[1].in_flight = 8;
    let c = select(Policy::Prefix, &input(&m, 110, 1), &loads, &HOLD);
    assert_eq!(c.first(), Some(2));
    assert_eq!(c.decision, Decision::Bounded);
}

#[test]
fn a_chat_past_its_first_turn_is_held_and_a_first_turn_spreads() {
    // One engine holds 100 blocks; 8 requests in flight there, none
    // elsewhere (safety cap floor(2 * 3) + 3 = 9, the gap's cap 0 + 4).
    // The lead is the same either way: the chat's answers say whether it
    // is a conversation's history or a system prompt.
    let mut loads = fleet(3);
    loads[0].in_flight = 8;
    let m = [100, 0, 0];
    let mut i = input(&m, 110, 1);
    i.answered = Some(true);
    assert_eq!(select(Policy::Prefix, &i, &loads, &HOLD).first(), Some(0));
    i.answered = Some(false);
    assert_ne!(select(Policy::Prefix, &i, &loads, &HOLD).first(), Some(0));
}

#[test]
fn a_prompt_stays_whole_on_its_engine_when_the_caches_are_full() {
    // A new conversation on a prompt one engine holds, 8 in flight there
    // and none elsewhere: over `shared_gap` (6) and the balance bound
    // (floor(1.25 * 9 / 3) + 3 = 6), so with room in the caches it copies
    // the prompt to an idle engine.
    let p = PrefixParams {
        full_cache_pressure: 0.9,
        ..HOLD
    };
    let mut loads = fleet(3);
    loads[0].in_flight = 8;
    for l in &mut loads {
        l.capacity_blocks = 1000;
        l.cached_blocks = 500;
    }
    let m = [100, 0, 0];
    let mut i = input(&m, 110, 1);
    i.answered = Some(false);
    let c = select(Policy::Prefix, &i, &loads, &p);
    assert_ne!(c.first(), Some(0));
    assert!(!c.full_cache);
    // Caches full: a copy would evict as much of another prompt, so it
    // waits on the engine holding it, up to the looser bounds
    // (floor(2 * 3) + 3 = 9, the idlest + 14).
    for l in &mut loads {
        l.cached_blocks = 1000;
    }
    let c = select(Policy::Prefix, &i, &loads, &p);
    assert_eq!((c.first(), c.full_cache), (Some(0), true));
    // Past them it spreads all the same.
    loads[0].in_flight = 9;
    assert_ne!(select(Policy::Prefix, &i, &loads, &p).first(), Some(0));
}

/// A conversation's engine (backend 0) with two prefills queued, the others
/// idle, and the move cost of the defaults.
fn a_busy_holder() -> (PrefixParams, Vec<BackendLoad>) {
    let p = PrefixParams {
        move_cost: 0.5,
        ..HOLD
    };
    let mut loads = fleet(3);
    loads[0].in_flight = 2;
    loads[0].queued_prefill_blocks = 230;
    (p, loads)
}

/// A later turn of 313 blocks (the conversation has had an answer).
fn later_turn(matches: &[u32]) -> RouteInput<'_> {
    let mut i = input(matches, 313, 1);
    i.answered = Some(true);
    i
}

#[test]
fn a_history_its_engine_keeps_losing_moves_off_a_queue() {
    // 300 blocks on backend 0, the system prompt (126) on all three.
    let (p, mut loads) = a_busy_holder();
    let i = later_turn(&[300, 126, 126]);
    // Its answers said it kept the histories: it waits for the queue
    // (230 + 13 against 187 to prefill elsewhere plus half the 174 it
    // would strand), and the part another backend holds is the prompt.
    let c = select(Policy::Prefix, &i, &loads, &p);
    assert_eq!(c.first(), Some(0));
    assert_eq!(c.shared_blocks, 126);
    // Its answers said it lost 60% of them by the next turn: the history
    // is likely gone there too, so an idle engine is faster.
    loads[0].private_lost = 0.6;
    let c = select(Policy::Prefix, &i, &loads, &p);
    assert_ne!(c.first(), Some(0));
    assert_eq!(c.matched_blocks, 126);
    // Without the queue it stays: what it still keeps is worth the wait.
    loads[0].queued_prefill_blocks = 0;
    assert_eq!(select(Policy::Prefix, &i, &loads, &p).first(), Some(0));
}

#[test]
fn a_lead_over_a_prompt_some_engine_lacks_is_not_expected_lost() {
    // As above, losing 60%, but no other backend holds the system prompt:
    // the lead is the prompt as well as the history, and a busy engine
    // keeps a prompt it is sent often. The learned loss does not apply, so
    // it waits for its queue rather than copy the prompt elsewhere.
    let (p, mut loads) = a_busy_holder();
    loads[0].private_lost = 0.6;
    let c = select(Policy::Prefix, &later_turn(&[300, 0, 0]), &loads, &p);
    assert_eq!((c.first(), c.shared_blocks), (Some(0), 0));
    // Nor when only some engines hold the prompt: a move crowds them.
    let c = select(Policy::Prefix, &later_turn(&[300, 126, 0]), &loads, &p);
    assert_eq!((c.first(), c.everywhere_blocks), (Some(0), 0));
    // A start every engine holds that is shorter than SHARED_MIN_BLOCKS
    // (a common preamble) does not make the rest a history either.
    let short = SHARED_MIN_BLOCKS - 1;
    let c = select(
        Policy::Prefix,
        &later_turn(&[300, short, short]),
        &loads,
        &p,
    );
    assert_eq!((c.first(), c.everywhere_blocks), (Some(0), short));
}

proptest! {
    /// The prefix policy never sends a request to a backend at or over the
    /// safety cap while some backend is under it.
    #[test]
    fn the_load_bound_always_holds(loads_in in proptest::collection::vec((0u32..50, 0u32..1000, any::<bool>()), 1..40),
                                   matches in proptest::collection::vec(0u32..100, 40),
                                   key in any::<u64>()) {
        let loads: Vec<BackendLoad> = loads_in.iter().enumerate().map(|(i, &(f, q, e))| BackendLoad {
            eligible: e, in_flight: f, queued_prefill_blocks: q, id_hash: mix(i as u64), ..Default::default()
        }).collect();
        for p in [P, HOLD] {
            let c = select(Policy::Prefix, &input(&matches[..loads.len()], 100, key), &loads, &p);
            let eligible: Vec<_> = loads.iter().filter(|l| l.eligible).collect();
            if eligible.is_empty() {
                prop_assert_eq!(c.len, 0);
            } else {
                let total: u64 = eligible.iter().map(|l| u64::from(l.in_flight)).sum();
                let cap = (p.safety_factor * ((total + 1) as f64 / eligible.len() as f64)).floor() as u64 + u64::from(p.slack);
                let chosen = &loads[c.first().unwrap()];
                prop_assert!(chosen.eligible);
                let someone_under = eligible.iter().any(|l| u64::from(l.in_flight) < cap);
                if someone_under {
                    prop_assert!(u64::from(chosen.in_flight) < cap, "chose load {} with cap {}", chosen.in_flight, cap);
                }
            }
        }
    }
}

#[test]
fn a_saturated_fleet_keeps_a_prompt_where_it_is_whatever_the_queues() {
    // A template one engine holds (80 of 90 blocks), every engine with
    // prefill queued, the holder's queue 400 blocks longer than the others'.
    let p = PrefixParams {
        saturated_queue_s: 0.25,
        ..HOLD
    };
    let mut loads = fleet(3);
    for l in &mut loads {
        l.prefill_rate = 1000.0;
        l.queued_prefill_blocks = 300;
        l.in_flight = 10;
    }
    loads[0].queued_prefill_blocks = 700;
    let m = [80, 0, 0];
    let mut i = input(&m, 90, 1);
    i.answered = Some(false);
    // 300 blocks queued at 1,000 a second is 0.3 s: saturated. The holder
    // adds 10 blocks of work, the others 90: it stays.
    let c = select(Policy::Prefix, &i, &loads, &p);
    assert_eq!((c.first(), c.saturated), (Some(0), true));
    // Under 0.25 s queued somewhere: predicted TTFT decides again, and the
    // 400 queued blocks outweigh the 80 the template would cost elsewhere.
    loads[2].queued_prefill_blocks = 200;
    let c = select(Policy::Prefix, &i, &loads, &p);
    assert!(!c.saturated);
    assert_ne!(c.first(), Some(0));
    // Saturated, the bounds still hold: past the safety cap it moves.
    loads[2].queued_prefill_blocks = 300;
    loads[0].in_flight = 40;
    let c = select(Policy::Prefix, &i, &loads, &p);
    assert!(c.saturated);
    assert_ne!(c.first(), Some(0));
}

#[test]
fn saturated_ties_go_to_one_engine_per_prompt() {
    // Every engine holds the system prompt and has a queue: each new
    // conversation on it adds the same work anywhere, so its start's
    // rendezvous picks the engine, the same one whatever the queues.
    let p = PrefixParams {
        saturated_queue_s: 0.25,
        ..HOLD
    };
    let mut loads = fleet(3);
    for (b, l) in loads.iter_mut().enumerate() {
        l.prefill_rate = 1000.0;
        l.queued_prefill_blocks = 300 + 100 * b as u32;
        l.in_flight = 10;
    }
    let m = [64, 64, 64];
    let mut i = input(&m, 74, 7);
    i.answered = Some(false);
    let first = select(Policy::Prefix, &i, &loads, &p).first();
    loads.reverse();
    let ids: Vec<u64> = loads.iter().map(|l| l.id_hash).collect();
    let again = select(Policy::Prefix, &i, &loads, &p).first().unwrap();
    let before = fleet(3);
    assert_eq!(
        before.iter().position(|l| l.id_hash == ids[again]),
        first,
        "the same engine whichever queue is shorter"
    );
}
