//! Several router processes in front of one fleet, as production runs a
//! gateway: N replicas behind an L4 balancer or a Kubernetes Service, each
//! request going to one of them at random (the load generator's
//! `RunConfig::replicas`). What a quality run needs to start them:
//! each prefix-router replica's pair of loopback ports and its `[replicas]`
//! section (the replicas share what they learn), and the front names that
//! run them without sharing. Also what a run measures of them: one replica
//! killed and started again mid-run (its time to `/ready` and its hits
//! right after), and the bytes each replica's stream published.

use crate::fleet::Router;
use serde::{Deserialize, Serialize};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use testkit::workload::{Record, ReplicaGate};

/// The key the bench's replicas authenticate their messages with (the
/// router asks for 16 bytes at least).
pub const SHARED_KEY: &str = "bench-shared-key";

/// A front name ending so runs N prefix-router replicas that share
/// nothing (no `[replicas]` section): each knows only what it sent itself.
/// Without it, N > 1 replicas share.
pub const ALONE_SUFFIX: &str = "@alone";

/// The front that shares, for one that runs alone (`prefix@alone+x.toml`
/// gives `prefix+x.toml`); `None` for a front without [`ALONE_SUFFIX`].
pub fn shared_name(front: &str) -> Option<String> {
    let (name, config) = match front.split_once('+') {
        Some((n, c)) => (n, Some(c)),
        None => (front, None),
    };
    let base = name.strip_suffix(ALONE_SUFFIX)?;
    Some(match config {
        Some(c) => format!("{base}+{c}"),
        None => base.to_string(),
    })
}

/// Tries to find `n` replicas' stream addresses on 127.0.0.1 before giving up.
const PORT_TRIES: usize = 200;

/// `n` stream addresses on 127.0.0.1, one per replica, each port free
/// with the next one (a replica serves catch-up snapshots there), no two
/// pairs overlapping. A port found free may still be taken before the
/// replica binds it: the caller starts again on fresh ports then.
pub fn listen_addrs(n: usize) -> anyhow::Result<Vec<SocketAddr>> {
    let mut out: Vec<SocketAddr> = Vec::with_capacity(n);
    for _ in 0..PORT_TRIES {
        if out.len() == n {
            break;
        }
        let p = testkit::proc::free_port();
        let taken = |q: u16| out.iter().any(|a| a.port() == q || a.port() + 1 == q);
        if p == u16::MAX || taken(p) || taken(p + 1) {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            out.push(SocketAddr::from(([127, 0, 0, 1], p)));
        }
    }
    anyhow::ensure!(
        out.len() == n,
        "found {} of {n} free port pairs on 127.0.0.1",
        out.len()
    );
    Ok(out)
}

/// The `[replicas]` section of the replica listening on `me`, every
/// replica (itself included: it skips itself) its peer.
pub fn section(me: SocketAddr, all: &[SocketAddr]) -> String {
    let peers: Vec<String> = all.iter().map(|a| format!("\"{a}\"")).collect();
    format!(
        "\n[replicas]\nlisten = \"{me}\"\npeers = [{}]\nkey = \"{SHARED_KEY}\"\n",
        peers.join(", ")
    )
}

/// How long after a restarted replica is ready its requests are judged
/// against the other replicas' (the target: within 1 point of theirs).
pub const RESTART_WINDOW_S: f64 = 5.0;
/// Longest a restarted replica may take to answer 200 on `/ready`.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How often `/ready` is asked while a restarted replica catches up.
const READY_POLL: Duration = Duration::from_millis(5);

/// Cached over prompt tokens of some successful requests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Hits {
    pub requests: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub hit_rate: f64,
}

impl Hits {
    /// The successful ones of `records`.
    pub fn of<'a>(records: impl IntoIterator<Item = &'a Record>) -> Hits {
        let mut h = Hits::default();
        for r in records.into_iter().filter(|r| r.ok()) {
            h.requests += 1;
            h.prompt_tokens += r.prompt_tokens;
            h.cached_tokens += r.cached_tokens;
        }
        if h.prompt_tokens > 0 {
            h.hit_rate = h.cached_tokens as f64 / h.prompt_tokens as f64;
        }
        h
    }

    /// Both sets' requests together.
    pub fn plus(&self, o: &Hits) -> Hits {
        let mut h = Hits {
            requests: self.requests + o.requests,
            prompt_tokens: self.prompt_tokens + o.prompt_tokens,
            cached_tokens: self.cached_tokens + o.cached_tokens,
            hit_rate: 0.0,
        };
        if h.prompt_tokens > 0 {
            h.hit_rate = h.cached_tokens as f64 / h.prompt_tokens as f64;
        }
        h
    }
}

/// When a replica was killed and when it was ready again.
#[derive(Clone, Copy, Debug)]
pub struct RestartTimes {
    /// Since the run's start.
    pub killed_at_s: f64,
    /// From the kill (the new process started at once) to `/ready` 200.
    pub ready_after_s: f64,
}

/// At `at` after `epoch`, unless `done` is set first: takes replica
/// `index` out of `gate` (the balancer sends its share to the others),
/// kills it with SIGKILL, starts it again at once on the same ports and
/// config, and puts it back in `gate` once its admin `/ready` answers 200
/// and its listener accepts (a readiness probe with no period). `None`
/// when the run ended before `at`.
pub fn kill_and_restart_at(
    router: &mut Router,
    gate: &ReplicaGate,
    index: usize,
    epoch: Instant,
    at: Duration,
    done: &AtomicBool,
) -> anyhow::Result<Option<RestartTimes>> {
    let when = epoch + at;
    while Instant::now() < when {
        if done.load(Ordering::Relaxed) || crate::fleet::interrupted() {
            return Ok(None);
        }
        std::thread::sleep(
            when.saturating_duration_since(Instant::now())
                .min(READY_POLL * 4),
        );
    }
    gate.set_up(index, false);
    let killed = Instant::now();
    router.kill_and_restart()?;
    loop {
        if router.is_ready()
            && std::net::TcpStream::connect_timeout(&router.addr, Duration::from_millis(100))
                .is_ok()
        {
            break;
        }
        anyhow::ensure!(
            killed.elapsed() < READY_TIMEOUT && !crate::fleet::interrupted(),
            "the restarted replica was not ready within {READY_TIMEOUT:?}:\n{}",
            router.child.stderr_tail()
        );
        std::thread::sleep(READY_POLL);
    }
    let ready = Instant::now();
    gate.set_up(index, true);
    Ok(Some(RestartTimes {
        killed_at_s: killed.saturating_duration_since(epoch).as_secs_f64(),
        ready_after_s: ready.saturating_duration_since(killed).as_secs_f64(),
    }))
}

/// One replica killed and started again in a run, and how its requests
/// hit right after it was ready.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RestartFigures {
    /// Which replica (0-based) of how many.
    pub replica: usize,
    pub replicas: usize,
    pub killed_at_s: f64,
    /// From the kill to `/ready` answering 200.
    pub ready_after_s: f64,
    /// Requests it served that started in the [`RESTART_WINDOW_S`] after it
    /// was ready (cut short by the run's end).
    pub restarted: Hits,
    /// The other replicas' requests that started in the same window.
    pub others: Hits,
    /// Its own requests in the same length of time before the kill.
    pub before: Hits,
    /// The other replicas' in that time before the kill: how far apart two
    /// sets of replicas' hit rates are over a window this short anyway.
    #[serde(default)]
    pub others_before: Hits,
    /// The window's length in s.
    pub window_s: f64,
    /// Requests drawn for it while it was out, sent to another replica.
    pub rerouted: u64,
    /// Its requests that failed (in flight when it was killed).
    pub failed: u64,
    /// The window's requests beside the same requests in a run of the
    /// same traffic where no replica was killed (`None` until paired).
    #[serde(default)]
    pub paired: Option<Paired>,
}

/// The requests a restarted replica served in its window, and the same
/// requests (by conversation and turn, drawn for the same replica from the
/// same seed) in a control run where nothing was killed: what the restart
/// cost them, without the difference between one replica's share of the
/// traffic and another's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Paired {
    /// In the run with the restart, those that succeeded in both runs.
    pub restarted: Hits,
    /// The same requests in the control run.
    pub unrestarted: Hits,
}

impl Paired {
    /// How many points the restart cost the window's requests.
    pub fn points_behind(&self) -> f64 {
        (self.unrestarted.hit_rate - self.restarted.hit_rate) * 100.0
    }

    /// The sum over several windows (the restarts of one row's runs).
    pub fn pooled<'a>(all: impl IntoIterator<Item = &'a Paired>) -> Option<Paired> {
        let mut p: Option<Paired> = None;
        for x in all {
            let q = p.get_or_insert_with(Paired::default);
            q.restarted = q.restarted.plus(&x.restarted);
            q.unrestarted = q.unrestarted.plus(&x.unrestarted);
        }
        p
    }
}

impl RestartFigures {
    /// The restart of replica `index` of `replicas` at `t`, judged on the
    /// run's `records` (times since the run's start).
    pub fn of(
        records: &[Record],
        t: RestartTimes,
        index: usize,
        replicas: usize,
        rerouted: u64,
    ) -> RestartFigures {
        let ms = |s: f64| s * 1e3;
        let ready = t.killed_at_s + t.ready_after_s;
        let (from, to) = (ms(ready), ms(ready + RESTART_WINDOW_S));
        let end = records.iter().map(|r| r.start_ms).fold(0.0, f64::max);
        let mine = |r: &&Record| r.replica == Some(index as u32);
        let within = |a: f64, b: f64| move |r: &&Record| r.start_ms >= a && r.start_ms < b;
        let before = within(ms(t.killed_at_s - RESTART_WINDOW_S), ms(t.killed_at_s));
        RestartFigures {
            replica: index,
            replicas,
            killed_at_s: t.killed_at_s,
            ready_after_s: t.ready_after_s,
            restarted: Hits::of(records.iter().filter(mine).filter(within(from, to))),
            others: Hits::of(records.iter().filter(|r| !mine(r)).filter(within(from, to))),
            before: Hits::of(records.iter().filter(mine).filter(before)),
            others_before: Hits::of(records.iter().filter(|r| !mine(r)).filter(before)),
            window_s: (to.min(end) - from).max(0.0) / 1e3,
            rerouted,
            failed: records.iter().filter(mine).filter(|r| !r.ok()).count() as u64,
            paired: None,
        }
    }

    /// Pairs the window's requests in `records` (the run with the restart)
    /// with the same conversations' turns in `control`, a run of the same
    /// traffic where nothing was killed.
    pub fn pair(&mut self, records: &[Record], control: &[Record]) {
        let from = (self.killed_at_s + self.ready_after_s) * 1e3;
        let to = from + crate::replicas::RESTART_WINDOW_S * 1e3;
        let key = |r: &Record| (r.session, r.turn);
        let there: std::collections::HashMap<(u64, u32), &Record> = control
            .iter()
            .filter(|r| r.ok())
            .map(|r| (key(r), r))
            .collect();
        let window: Vec<(&Record, &Record)> = records
            .iter()
            .filter(|r| r.ok() && r.replica == Some(self.replica as u32))
            .filter(|r| r.start_ms >= from && r.start_ms < to)
            .filter_map(|r| there.get(&key(r)).map(|c| (r, *c)))
            .collect();
        self.paired = Some(Paired {
            restarted: Hits::of(window.iter().map(|p| p.0)),
            unrestarted: Hits::of(window.iter().map(|p| p.1)),
        });
    }

    /// The others' hit rate less the restarted replica's, in points.
    pub fn points_behind(&self) -> f64 {
        (self.others.hit_rate - self.restarted.hit_rate) * 100.0
    }

    /// The same for the window before the kill.
    pub fn points_behind_before(&self) -> f64 {
        (self.others_before.hit_rate - self.before.hit_rate) * 100.0
    }
}

/// A replica's own stream counters from its `/admin/replicas`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StreamCounters {
    pub messages: u64,
    pub bytes: u64,
    pub outbox_dropped: u64,
    /// Messages it missed of its peers' streams, all peers together.
    pub peer_gaps: u64,
}

impl StreamCounters {
    /// From `/admin/replicas` (`None` without a `[replicas]` section).
    pub fn parse(v: &serde_json::Value) -> Option<StreamCounters> {
        let n = |k: &str| v.get(k).and_then(serde_json::Value::as_u64);
        let gaps = v
            .get("peers")
            .and_then(serde_json::Value::as_object)
            .map_or(0, |p| {
                p.values()
                    .filter_map(|x| x.get("gaps")?.as_u64())
                    .sum::<u64>()
            });
        Some(StreamCounters {
            messages: n("published_messages")?,
            bytes: n("published_bytes")?,
            outbox_dropped: n("outbox_dropped").unwrap_or(0),
            peer_gaps: gaps,
        })
    }

    /// Of `router` now (`None`, said, when it cannot be read).
    pub fn read(router: &Router) -> Option<StreamCounters> {
        match router.replicas() {
            Ok(v) => Self::parse(&v),
            Err(e) => {
                eprintln!("  /admin/replicas of {}: {e:#}", router.admin);
                None
            }
        }
    }

    /// What was counted since `before` (all of it when the counters
    /// started again: the process restarted).
    pub fn since(self, before: Option<StreamCounters>) -> StreamCounters {
        match before {
            Some(b) if b.messages <= self.messages && b.bytes <= self.bytes => StreamCounters {
                messages: self.messages - b.messages,
                bytes: self.bytes - b.bytes,
                outbox_dropped: self.outbox_dropped.saturating_sub(b.outbox_dropped),
                peer_gaps: self.peer_gaps.saturating_sub(b.peer_gaps),
            },
            _ => self,
        }
    }
}

/// What one replica's stream published over a run.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ReplicaTraffic {
    /// Which run of the row (0-based, `--repeats`).
    #[serde(default)]
    pub run: usize,
    /// Which replica (0-based) of how many.
    pub replica: usize,
    pub replicas: usize,
    /// Counted from its restart rather than from the traffic's start.
    #[serde(default)]
    pub restarted: bool,
    pub seconds: f64,
    /// Requests it served in that time (its own decisions).
    pub requests: u64,
    pub messages: u64,
    /// Bytes of its frames, each counted once (every peer receives a copy).
    pub bytes: u64,
    pub outbox_dropped: u64,
    pub peer_gaps: u64,
}

impl ReplicaTraffic {
    pub fn new(
        replica: usize,
        replicas: usize,
        c: StreamCounters,
        seconds: f64,
        requests: u64,
    ) -> Self {
        ReplicaTraffic {
            run: 0,
            replica,
            replicas,
            restarted: false,
            seconds,
            requests,
            messages: c.messages,
            bytes: c.bytes,
            outbox_dropped: c.outbox_dropped,
            peer_gaps: c.peer_gaps,
        }
    }

    pub fn bytes_per_s(&self) -> f64 {
        self.bytes as f64 / self.seconds.max(1e-9)
    }

    pub fn messages_per_s(&self) -> f64 {
        self.messages as f64 / self.seconds.max(1e-9)
    }

    /// Its bytes (load messages included) over the requests it served.
    pub fn bytes_per_request(&self) -> f64 {
        self.bytes as f64 / self.requests.max(1) as f64
    }

    /// Its bytes per second were the whole fleet serving 1,000 requests/s
    /// spread evenly over its replicas: bytes per request x 1,000 / N. The
    /// load messages, a larger part of the bytes at this run's lower
    /// rate, are scaled too, so this overstates it.
    pub fn bytes_per_s_at_1000_rps(&self) -> f64 {
        self.bytes_per_request() * 1_000.0 / self.replicas.max(1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_replica_has_its_own_pair_of_ports() {
        let addrs = listen_addrs(4).unwrap();
        let mut ports: Vec<u16> = addrs
            .iter()
            .flat_map(|a| [a.port(), a.port() + 1])
            .collect();
        assert!(addrs.iter().all(|a| a.ip().is_loopback()));
        ports.sort_unstable();
        ports.dedup();
        assert_eq!(ports.len(), 8, "{addrs:?}");
    }

    #[test]
    fn a_section_names_this_replica_and_every_peer() {
        let all: Vec<SocketAddr> = ["127.0.0.1:7100", "127.0.0.1:7102"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        let text = section(all[1], &all);
        let v: toml::Value = toml::from_str(&text).unwrap();
        let r = &v["replicas"];
        assert_eq!(r["listen"].as_str(), Some("127.0.0.1:7102"));
        let peers: Vec<&str> = r["peers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_str().unwrap())
            .collect();
        assert_eq!(peers, ["127.0.0.1:7100", "127.0.0.1:7102"]);
        assert!(r["key"].as_str().unwrap().len() >= 16);
    }

    fn record(replica: u32, start_ms: f64, prompt: u64, cached: u64) -> Record {
        Record {
            seq: 0,
            scenario: "t".into(),
            user: 0,
            session: 0,
            turn: 1,
            turns: 1,
            prefix_id: 0,
            start_ms,
            ttft_ms: Some(1.0),
            end_ms: start_ms + 10.0,
            latency_ms: 10.0,
            status: 200,
            error: None,
            prompt_tokens: prompt,
            cached_tokens: cached,
            completion_tokens: 1,
            local_prompt_tokens: prompt,
            ceiling_cached_tokens: cached,
            instance: None,
            decision: None,
            replica: Some(replica),
            tenant: None,
        }
    }

    #[test]
    fn a_restart_is_judged_on_the_window_after_it_is_ready() {
        let mut failed = record(1, 9_900.0, 100, 0);
        failed.status = 0;
        let records = vec![
            record(1, 6_000.0, 100, 90),  // before the kill
            failed,                       // in flight at the kill
            record(1, 10_600.0, 100, 50), // its window
            record(0, 10_700.0, 100, 80), // the others' window
            record(1, 14_000.0, 100, 70),
            record(0, 15_600.0, 100, 60), // past the window
            record(0, 16_000.0, 100, 0),
        ];
        let t = RestartTimes {
            killed_at_s: 10.0,
            ready_after_s: 0.5,
        };
        let f = RestartFigures::of(&records, t, 1, 2, 3);
        assert_eq!((f.restarted.requests, f.restarted.hit_rate), (2, 0.6));
        assert_eq!((f.others.requests, f.others.hit_rate), (1, 0.8));
        assert_eq!((f.before.requests, f.before.hit_rate), (1, 0.9));
        assert_eq!(f.others_before.requests, 0);
        assert!((f.points_behind() - 20.0).abs() < 1e-9);
        assert_eq!((f.failed, f.rerouted), (1, 3));
        assert_eq!(f.window_s, 5.0);
    }

    #[test]
    fn a_restart_is_paired_with_the_same_turns_of_a_run_without_it() {
        let at = |session: u64, turn: u32, r: Record| Record { session, turn, ..r };
        let records = vec![
            at(1, 2, record(1, 10_600.0, 100, 50)),
            at(2, 1, record(1, 11_000.0, 100, 10)), // failed in the control
            at(3, 1, record(0, 11_000.0, 100, 90)), // another replica's
            at(4, 1, record(1, 20_000.0, 100, 0)),  // past the window
        ];
        let mut failed = at(2, 1, record(1, 11_500.0, 100, 0));
        failed.status = 0;
        let control = vec![
            at(1, 2, record(1, 10_200.0, 100, 70)),
            failed,
            at(3, 1, record(0, 11_000.0, 100, 90)),
            at(4, 1, record(1, 19_000.0, 100, 90)),
        ];
        let t = RestartTimes {
            killed_at_s: 10.0,
            ready_after_s: 0.5,
        };
        let mut f = RestartFigures::of(&records, t, 1, 2, 0);
        f.pair(&records, &control);
        let p = f.paired.unwrap();
        assert_eq!((p.restarted.requests, p.restarted.hit_rate), (1, 0.5));
        assert_eq!((p.unrestarted.requests, p.unrestarted.hit_rate), (1, 0.7));
        assert!((p.points_behind() - 20.0).abs() < 1e-9);
        let two = Paired::pooled([&p, &p]).unwrap();
        assert_eq!(two.restarted.requests, 2);
        assert!((two.points_behind() - 20.0).abs() < 1e-9);
        assert_eq!(Paired::pooled([]), None);
    }

    #[test]
    fn stream_counters_are_read_from_admin_replicas_and_subtracted() {
        let v = serde_json::json!({
            "published_messages": 10, "published_bytes": 1000, "outbox_dropped": 0,
            "peers": {"a": {"gaps": 2}, "b": {"gaps": 1}},
        });
        let end = StreamCounters::parse(&v).unwrap();
        assert_eq!(end.peer_gaps, 3);
        let start = StreamCounters {
            messages: 4,
            bytes: 400,
            outbox_dropped: 0,
            peer_gaps: 1,
        };
        let d = end.since(Some(start));
        assert_eq!((d.messages, d.bytes, d.peer_gaps), (6, 600, 2));
        // Counters that went back: the process restarted, all of it counts.
        let big = StreamCounters {
            bytes: 5_000,
            ..start
        };
        assert_eq!(end.since(Some(big)), end);
        assert_eq!(StreamCounters::parse(&serde_json::Value::Null), None);
        let t = ReplicaTraffic::new(0, 2, d, 2.0, 3);
        assert_eq!((t.bytes_per_s(), t.bytes_per_request()), (300.0, 200.0));
        assert_eq!(t.bytes_per_s_at_1000_rps(), 100_000.0);
    }

    #[test]
    fn an_alone_front_names_the_front_that_shares() {
        assert_eq!(shared_name("prefix@alone").as_deref(), Some("prefix"));
        assert_eq!(
            shared_name("prefix@precise@alone+t.toml").as_deref(),
            Some("prefix@precise+t.toml")
        );
        assert_eq!(shared_name("prefix"), None);
        assert_eq!(shared_name("sglang-router"), None);
    }
}
