//! `soak --hostile`: the same normal traffic twice through one router, first
//! alone (the clean phase), then beside hostile peers (the hostile phase):
//!
//! - slow readers: a streaming request with a long answer on a socket with a
//!   tiny receive buffer, never read;
//! - slowloris: connections that send one header line a second and never end
//!   the head;
//! - uploaders: bodies declared over `limits.max_body_bytes`, and bodies just
//!   under it that are not JSON;
//! - a trickling backend: a fleet member (drained, so it gets probes only)
//!   whose `/health` answer comes one byte every 0.5 s in the hostile phase;
//! - huge chats (`--large-chats`): one message of `--large-chat-mib` (30
//!   MiB) in a chat, sent again as soon as it is answered. With them the
//!   router runs in precise mode for both phases, with a real tokenizer
//!   (`testkit::tokenizer_fixture`) and the engines' KV events; the engines
//!   tokenize their own way, so the huge chat is theirs to reject as longer
//!   than their context. With `--large-chats-direct` they go straight to
//!   the first engine: the same load on the engines and the machine
//!   without the router, what the router's share is measured against.
//!
//! It reports, per phase, the normal requests' success rate and latency
//! percentiles, the router's RSS over time, how fast the router's health
//! view follows a canary backend whose `/health` flips every 3 s (a frozen
//! health checker shows here), and what the hostile peers got.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;
use testkit::engine_proc::SimEngine;
use testkit::router_proc::{Router, rss_kib};

use super::{Args, Done, Outcome, client, sleep_unless};

/// The canary's `/health` is 200 for this long, then 503 for this long.
const CANARY_HALF: Duration = Duration::from_secs(3);
/// How often the watcher reads `/admin/backends`.
const WATCH_EVERY: Duration = Duration::from_millis(50);
/// How often the router's RSS is sampled.
const RSS_EVERY: Duration = Duration::from_secs(1);
/// Receive buffer asked for a slow reader's socket (the kernel doubles it).
const SLOW_READER_RCVBUF: usize = 4096;
/// Output tokens a slow reader asks for: about 6 MB of SSE (about 207 bytes
/// a token), more than the socket buffers between the router and the reader
/// hold (4 MB at most here), so the router's writes stall.
const SLOW_READER_TOKENS: u32 = 30_000;
/// KV capacity of the soak's engines in 16-token blocks (409,600 tokens):
/// the slow readers' sequences fit in one engine's cache (8 x 30,000), so
/// what they cost is what the router lets them hold, not engine capacity.
const ENGINE_KV_BLOCKS: &str = "25600";
/// Gap between a slowloris connection's header lines.
const SLOWLORIS_EVERY: Duration = Duration::from_secs(1);
/// The trickling backend's gap between bytes.
const TRICKLE_EVERY: Duration = Duration::from_millis(500);
/// Declared length of the uploads over the limit (the default limit is 32 MiB).
const OVER_LIMIT: usize = 64 << 20;
/// How long after the hostile phase the router's RSS is read again.
const SETTLE_AFTER: Duration = Duration::from_secs(5);
/// Bound on an uploader's wait for an answer.
const UPLOAD_TIMEOUT: Duration = Duration::from_secs(30);

/// What the watcher saw at one instant.
struct Sample {
    at: Instant,
    canary_healthy: bool,
    trickler_healthy: bool,
    /// Requests in flight on the engines, as the router counts them.
    in_flight: u64,
}

/// What the hostile peers got.
#[derive(Default)]
struct HostileStats {
    slow_readers_opened: AtomicU64,
    slowloris_opened: AtomicU64,
    slowloris_cut: AtomicU64,
    /// Seconds each cut slowloris connection lived.
    slowloris_lives: Mutex<Vec<f64>>,
    /// Upload outcomes: "413 (declared 64 MiB)" and the like, counted.
    uploads: Mutex<BTreeMap<String, u64>>,
    /// Huge chats' outcomes, counted, and how long each took (s).
    large_chats: Mutex<BTreeMap<String, u64>>,
    large_chat_secs: Mutex<Vec<f64>>,
}

pub fn run(args: &Args, phase_len: Duration) -> anyhow::Result<()> {
    let ts = args.time_scale.to_string();
    let precise = args.large_chats > 0;
    let mut event_ports = Vec::new();
    let engines: Vec<SimEngine> = (0..args.engines)
        .map(|i| {
            let id = format!("e{i}");
            let seed = i.to_string();
            let a = [
                "--id",
                &id,
                "--time-scale",
                &ts,
                "--seed",
                &seed,
                "--kv-blocks",
                ENGINE_KV_BLOCKS,
            ];
            if precise {
                let (e, p, r) = SimEngine::spawn_with_event_ports(&a);
                event_ports.push((p, r));
                e
            } else {
                SimEngine::spawn(&a)
            }
        })
        .collect();
    let tokenizer = std::env::temp_dir().join(format!("soak-tokenizer-{}", std::process::id()));
    if precise {
        testkit::tokenizer_fixture::write(&tokenizer)?;
    }
    let t0 = Instant::now();
    let canary = fake_backend(move |s| canary(s, t0));
    let trickling = Arc::new(AtomicBool::new(false));
    let flag = trickling.clone();
    let trickler = fake_backend(move |s| trickle(s, &flag));
    let (canary_url, trickler_url) = (format!("http://{canary}"), format!("http://{trickler}"));
    let mut urls: Vec<String> = engines.iter().map(SimEngine::url).collect();
    urls.extend([canary_url.clone(), trickler_url.clone()]);
    // Precise mode: the engines in the config with their event streams.
    let (flag_urls, precise_cfg) = if precise {
        let mut entries: Vec<String> = engines
            .iter()
            .zip(&event_ports)
            .map(|(e, (p, r))| {
                format!(
                    "{{ url = \"{}\", kv_events = \"tcp://127.0.0.1:{p}\", kv_events_replay = \"tcp://127.0.0.1:{r}\" }}",
                    e.url()
                )
            })
            .collect();
        entries.extend([format!("{canary_url:?}"), format!("{trickler_url:?}")]);
        (
            Vec::new(),
            format!(
                "backends = [{}]\n[precise]\nenabled = true\ntokenizer_dir = {:?}\n",
                entries.join(", "),
                tokenizer.display().to_string()
            ),
        )
    } else {
        (urls.clone(), String::new())
    };
    let router = Router::spawn(
        &flag_urls,
        &[],
        &format!(
            "{precise_cfg}[health]\ninterval_ms = 200\ntimeout_ms = 500\nrise = 2\nfall = 2\npassive_fall = 3\n\
             [limits]\nmax_in_flight_per_backend = {}\n",
            args.max_in_flight
        ),
    );
    // The fakes get probes, never traffic.
    for u in [&canary_url, &trickler_url] {
        let path = format!(
            "/admin/drain?backend={}",
            u.replace(':', "%3A").replace('/', "%2F")
        );
        let r = testkit::http::request(router.admin, "POST", &path, &[], b"")?;
        anyhow::ensure!(r.status == 200, "draining {u}: {}", r.text());
    }
    let pid = router.child.pid();
    println!(
        "hostile: {:.0} s per phase, {} engines, {} normal clients; hostile phase: {} slow readers, \
         {} slowloris, {} uploaders ({} MiB and a declared {} MiB), {} huge chats ({} MiB, precise mode {}{}), \
         a trickling backend; router pid {pid}",
        phase_len.as_secs_f64(),
        args.engines,
        args.clients,
        args.slow_readers,
        args.slowloris,
        args.uploaders,
        args.upload_mib,
        OVER_LIMIT >> 20,
        args.large_chats,
        args.large_chat_mib,
        if precise { "on" } else { "off" },
        if args.large_chats_direct {
            ", sent straight to an engine"
        } else {
            ""
        },
    );

    let watching = AtomicBool::new(true);
    let samples: Mutex<Vec<Sample>> = Mutex::default();
    let rss: Mutex<Vec<(Instant, u64)>> = Mutex::default();
    let stats = HostileStats::default();
    let addr = router.addr;
    let mut phases = Vec::new();
    std::thread::scope(|scope| {
        let admin = router.admin;
        let (canary_url, trickler_url, watching, samples) =
            (&canary_url, &trickler_url, &watching, &samples);
        scope.spawn(move || watch(admin, canary_url, trickler_url, watching, samples));
        scope.spawn(|| {
            while !sleep_unless_inv(watching, RSS_EVERY) {
                rss.lock()
                    .expect("rss")
                    .push((Instant::now(), rss_kib(pid)));
            }
        });
        for name in ["clean", "hostile"] {
            let hostile = name == "hostile";
            trickling.store(hostile, Relaxed);
            let started = Instant::now();
            let cpu_before = cpu_seconds(pid);
            let results: Mutex<Vec<Done>> = Mutex::default();
            let stop = AtomicBool::new(false);
            std::thread::scope(|phase| {
                for c in 0..args.clients {
                    let seed = args.seed * 1000 + c as u64;
                    let (stop, results) = (&stop, &results);
                    phase.spawn(move || client(addr, seed, stop, results, None));
                }
                if hostile {
                    for i in 0..args.slow_readers {
                        let (stop, stats) = (&stop, &stats);
                        phase.spawn(move || slow_reader(addr, i, stop, stats));
                    }
                    phase.spawn(|| slowloris(addr, args.slowloris, &stop, &stats));
                    for _ in 0..args.uploaders {
                        phase.spawn(|| uploader(addr, args, &stop, &stats));
                    }
                    if precise {
                        let body = Arc::new(large_chat(args.large_chat_mib));
                        let to = if args.large_chats_direct {
                            engines[0].addr
                        } else {
                            addr
                        };
                        for _ in 0..args.large_chats {
                            let body = body.clone();
                            let (stop, stats) = (&stop, &stats);
                            phase.spawn(move || large_chatter(to, &body, stop, stats));
                        }
                    }
                }
                let report = Duration::from_secs_f64(args.report_every);
                let end = started + phase_len;
                while Instant::now() < end {
                    std::thread::sleep(report.min(end.saturating_duration_since(Instant::now())));
                    println!(
                        "hostile: t={:>6.1}s phase={name} rss={} KiB requests={}",
                        t0.elapsed().as_secs_f64(),
                        rss_kib(pid),
                        results.lock().expect("results").len()
                    );
                }
                stop.store(true, Relaxed);
            });
            phases.push((
                name,
                started,
                Instant::now(),
                results.into_inner().expect("results"),
                cpu_seconds(pid) - cpu_before,
            ));
        }
        watching.store(false, Relaxed);
    });

    let samples = samples.into_inner().expect("samples");
    let rss = rss.into_inner().expect("rss");
    let mut summary = Vec::new();
    for (name, from, to, results, cpu) in &phases {
        let ok: Vec<f64> = results
            .iter()
            .filter(|d| matches!(d.outcome, Outcome::Ok))
            .map(|d| (d.end - d.start).as_secs_f64() * 1e3)
            .collect();
        let success = 100.0 * ok.len() as f64 / results.len().max(1) as f64;
        let (p50, p99) = (percentile(&ok, 0.50), percentile(&ok, 0.99));
        let rss_in: Vec<u64> = rss
            .iter()
            .filter(|(at, _)| at >= from && at <= to)
            .map(|&(_, k)| k)
            .collect();
        let rss_max = rss_in.iter().copied().max().unwrap_or(0);
        let rss_last = rss_in.last().copied().unwrap_or(0);
        let (lag_max, lag_median, missed) = canary_lags(&samples, t0, *from, *to);
        // In flight over the phase's second half (slow readers that were cut
        // are gone by then).
        let half = *from + (*to - *from) / 2;
        let in_flight: Vec<f64> = samples
            .iter()
            .filter(|s| s.at >= half && s.at <= *to)
            .map(|s| s.in_flight as f64)
            .collect();
        println!(
            "hostile: phase={name} requests={} ok={} success={success:.3}% p50_ms={p50:.1} p99_ms={p99:.1} \
             router_cpu_s={cpu:.1} rss_max_kib={rss_max} rss_last_kib={rss_last} in_flight_2nd_half_median={:.0} \
             in_flight_2nd_half_max={:.0} canary_lag_ms_median={lag_median:.0} \
             canary_lag_ms_max={lag_max:.0} canary_flips_missed={missed}",
            results.len(),
            ok.len(),
            percentile(&in_flight, 0.5),
            percentile(&in_flight, 1.0),
        );
        let mut failures: BTreeMap<String, u64> = BTreeMap::new();
        for d in results {
            let what = match &d.outcome {
                Outcome::Ok => continue,
                Outcome::Truncated(id) => format!("truncated on {id}"),
                Outcome::Status(s, t) => {
                    format!("status {s}: {}", t.chars().take(120).collect::<String>())
                }
                Outcome::NoAnswer(e) => format!("no answer: {e}"),
            };
            *failures.entry(what).or_default() += 1;
        }
        for (what, n) in failures.iter().take(8) {
            println!("hostile: phase={name} failed {n}x: {what}");
        }
        summary.push((success, p99, rss_max));
    }
    let hostile_from = phases[1].1;
    let trickler_out = samples
        .iter()
        .find(|s| s.at >= hostile_from && !s.trickler_healthy)
        .map(|s| format!("{:.1} s", (s.at - hostile_from).as_secs_f64()))
        .unwrap_or_else(|| "never".into());
    let lives = stats.slowloris_lives.lock().expect("lives").clone();
    println!(
        "hostile: peers: slow_readers opened={}; slowloris opened={} cut={} \
         life_s_median={:.1} life_s_max={:.1}; trickling backend taken out after {trickler_out}",
        stats.slow_readers_opened.load(Relaxed),
        stats.slowloris_opened.load(Relaxed),
        stats.slowloris_cut.load(Relaxed),
        percentile(&lives, 0.5),
        percentile(&lives, 1.0),
    );
    for (what, n) in stats.uploads.lock().expect("uploads").iter() {
        println!("hostile: uploads {n}x: {what}");
    }
    let secs = stats.large_chat_secs.lock().expect("secs").clone();
    for (what, n) in stats.large_chats.lock().expect("large chats").iter() {
        println!(
            "hostile: huge chats {n}x: {what} (s each: median {:.2}, max {:.2})",
            percentile(&secs, 0.5),
            percentile(&secs, 1.0)
        );
    }
    let line: Vec<String> = rss
        .iter()
        .step_by(5)
        .map(|(at, k)| format!("{:.0}s:{}", (*at - t0).as_secs_f64(), k / 1024))
        .collect();
    println!("hostile: rss_mib_over_time {}", line.join(" "));
    // What stays once the hostile peers are gone.
    std::thread::sleep(SETTLE_AFTER);
    let rss_end = rss_kib(pid);
    println!(
        "hostile: done: clean_success={:.3}% hostile_success={:.3}% clean_p99_ms={:.1} hostile_p99_ms={:.1} \
         clean_rss_max_kib={} hostile_rss_max_kib={} rss_{}s_after_kib={rss_end}",
        summary[0].0,
        summary[1].0,
        summary[0].1,
        summary[1].1,
        summary[0].2,
        summary[1].2,
        SETTLE_AFTER.as_secs()
    );
    drop(router);
    drop(engines);
    if precise {
        let _ = std::fs::remove_dir_all(&tokenizer);
    }
    anyhow::ensure!(!phases[0].3.is_empty(), "no traffic went through");
    Ok(())
}

/// CPU time (user and system, all threads) of process `pid` in seconds,
/// from `/proc/PID/stat` (in USER_HZ ticks, 100 a second on Linux).
fn cpu_seconds(pid: u32) -> f64 {
    const USER_HZ: f64 = 100.0;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces): state is the
    // first, utime the 12th, stime the 13th.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .collect();
    let tick = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (tick(11) + tick(12)) / USER_HZ
}

/// The `q` quantile of `v` (nearest rank), 0 when empty.
fn percentile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((s.len() as f64 * q).ceil() as usize).clamp(1, s.len()) - 1]
}

/// Polls `/admin/backends` every [`WATCH_EVERY`] until `watching` is cleared.
fn watch(
    admin: SocketAddr,
    canary: &str,
    trickler: &str,
    watching: &AtomicBool,
    out: &Mutex<Vec<Sample>>,
) {
    while !sleep_unless_inv(watching, WATCH_EVERY) {
        let Ok(r) = testkit::http::request(admin, "GET", "/admin/backends", &[], b"") else {
            continue;
        };
        if r.status != 200 {
            continue;
        }
        let v = r.json();
        let healthy = |url: &str| {
            v["backends"]
                .as_array()
                .and_then(|bs| bs.iter().find(|b| b["url"] == url))
                .is_some_and(|b| b["healthy"] == true)
        };
        let in_flight = v["backends"]
            .as_array()
            .map(|bs| bs.iter().filter_map(|b| b["in_flight"].as_u64()).sum())
            .unwrap_or(0);
        out.lock().expect("samples").push(Sample {
            at: Instant::now(),
            canary_healthy: healthy(canary),
            trickler_healthy: healthy(trickler),
            in_flight,
        });
    }
}

/// Sleeps `d`; true once `flag` is cleared (the inverse of `sleep_unless`).
fn sleep_unless_inv(flag: &AtomicBool, d: Duration) -> bool {
    std::thread::sleep(d);
    !flag.load(Relaxed)
}

/// The canary's state at `t`: healthy in even half-periods since `t0`.
fn canary_up(t0: Instant, t: Instant) -> bool {
    ((t - t0).as_millis() / CANARY_HALF.as_millis()).is_multiple_of(2)
}

/// For the canary's flips within `[from, to)`: the largest and median lag
/// (ms) until the router's view matched, and the flips it did not follow
/// before the next one.
fn canary_lags(samples: &[Sample], t0: Instant, from: Instant, to: Instant) -> (f64, f64, usize) {
    let mut lags = Vec::new();
    let mut missed = 0;
    let mut k = 1u32;
    loop {
        let flip = t0 + CANARY_HALF * k;
        k += 1;
        if flip >= to {
            break;
        }
        if flip < from || flip + CANARY_HALF > to {
            continue;
        }
        let want = canary_up(t0, flip + Duration::from_millis(1));
        // A view that already showed `want` had not followed the last flip:
        // a match now would be a coincidence, not a lag.
        if samples
            .iter()
            .rev()
            .find(|s| s.at < flip)
            .is_none_or(|s| s.canary_healthy == want)
        {
            missed += 1;
            continue;
        }
        match samples
            .iter()
            .find(|s| s.at >= flip && s.at < flip + CANARY_HALF && s.canary_healthy == want)
        {
            Some(s) => lags.push((s.at - flip).as_secs_f64() * 1e3),
            None => missed += 1,
        }
    }
    (percentile(&lags, 1.0), percentile(&lags, 0.5), missed)
}

/// Accepts connections on a loopback port for the rest of the process and
/// hands each to `serve` on a thread of its own.
fn fake_backend(serve: impl Fn(TcpStream) + Send + Sync + 'static) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind a fake backend");
    let addr = l.local_addr().expect("its address");
    let serve = Arc::new(serve);
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            let serve = serve.clone();
            std::thread::spawn(move || serve(s));
        }
    });
    addr
}

/// Reads a request head; false if the peer closed first.
fn read_head(s: &mut TcpStream) -> bool {
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let mut head = Vec::new();
    let mut tmp = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut tmp) {
            Ok(0) | Err(_) => return false,
            Ok(n) => head.extend_from_slice(&tmp[..n]),
        }
    }
    true
}

fn canary(mut s: TcpStream, t0: Instant) {
    if !read_head(&mut s) {
        return;
    }
    let answer: &[u8] = if canary_up(t0, Instant::now()) {
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
    } else {
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    };
    let _ = s.write_all(answer);
}

/// Answers at once while `trickling` is clear, else one byte every 0.5 s.
fn trickle(mut s: TcpStream, trickling: &AtomicBool) {
    if !read_head(&mut s) {
        return;
    }
    let answer = format!(
        "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\nX-Pad: {}\r\n\r\nok",
        "x".repeat(80)
    );
    if !trickling.load(Relaxed) {
        let _ = s.write_all(answer.as_bytes());
        return;
    }
    for b in answer.bytes() {
        if s.write_all(&[b]).is_err() {
            return;
        }
        std::thread::sleep(TRICKLE_EVERY);
    }
}

/// One slow reader for the whole phase: a long streaming request, never
/// read. (Whether the router cut it cannot be seen without reading: the
/// router's close waits behind the zero window; the engines' in-flight
/// counts show it instead.)
fn slow_reader(addr: SocketAddr, i: usize, stop: &AtomicBool, stats: &HostileStats) {
    let Some(_held) = open_slow_reader(addr, i) else {
        return;
    };
    stats.slow_readers_opened.fetch_add(1, Relaxed);
    while !sleep_unless(stop, Duration::from_secs(1)) {}
}

/// Connects with a tiny receive buffer and sends the long streaming request.
fn open_slow_reader(addr: SocketAddr, i: usize) -> Option<TcpStream> {
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).ok()?;
    let _ = sock.set_recv_buffer_size(SLOW_READER_RCVBUF);
    sock.connect(&addr.into()).ok()?;
    let mut s: TcpStream = sock.into();
    let body = json!({"model": "sim-llama-8b", "stream": true, "max_tokens": SLOW_READER_TOKENS,
                      "messages": [{"role": "user", "content": format!("slow reader {i}: tell me a very long story")}]})
    .to_string();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: soak\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).ok()?;
    s.write_all(body.as_bytes()).ok()?;
    Some(s)
}

/// `n` slowloris connections, one header line a second each; a connection
/// the router answers or closes is replaced by a new one.
fn slowloris(addr: SocketAddr, n: usize, stop: &AtomicBool, stats: &HostileStats) {
    let mut conns: Vec<(TcpStream, Instant)> = Vec::new();
    while !stop.load(Relaxed) {
        while conns.len() < n {
            let Ok(mut s) = TcpStream::connect(addr) else {
                break;
            };
            if s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: soak\r\n")
                .is_err()
                || s.set_nonblocking(true).is_err()
            {
                continue;
            }
            stats.slowloris_opened.fetch_add(1, Relaxed);
            conns.push((s, Instant::now()));
        }
        if sleep_unless(stop, SLOWLORIS_EVERY) {
            break;
        }
        conns.retain_mut(|(s, born)| {
            let mut tmp = [0u8; 1024];
            let cut = match s.read(&mut tmp) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    s.write_all(b"x-slow: 1\r\n").is_err()
                }
                // An answer (408), an end of stream or a reset.
                _ => true,
            };
            if cut {
                stats.slowloris_cut.fetch_add(1, Relaxed);
                stats
                    .slowloris_lives
                    .lock()
                    .expect("lives")
                    .push(born.elapsed().as_secs_f64());
            }
            !cut
        });
    }
}

/// Alternates a body declared over the limit with a near-limit body that is
/// not JSON, pausing between uploads.
fn uploader(addr: SocketAddr, args: &Args, stop: &AtomicBool, stats: &HostileStats) {
    let junk = vec![b'x'; args.upload_mib << 20];
    let mut over = true;
    while !stop.load(Relaxed) {
        let what = if over {
            format!(
                "declared {} MiB: {}",
                OVER_LIMIT >> 20,
                upload(addr, OVER_LIMIT, &junk[..64 * 1024])
            )
        } else {
            format!(
                "{} MiB not JSON: {}",
                args.upload_mib,
                upload(addr, junk.len(), &junk)
            )
        };
        *stats
            .uploads
            .lock()
            .expect("uploads")
            .entry(what)
            .or_default() += 1;
        over = !over;
        if sleep_unless(stop, Duration::from_millis(args.upload_pause_ms)) {
            break;
        }
    }
}

/// Sends a head declaring `declared` bytes and then `body`; the answer's
/// status, or how the exchange ended.
fn upload(addr: SocketAddr, declared: usize, body: &[u8]) -> String {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return "connect failed".into();
    };
    let _ = s.set_read_timeout(Some(UPLOAD_TIMEOUT));
    let _ = s.set_write_timeout(Some(UPLOAD_TIMEOUT));
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: soak\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {declared}\r\n\r\n"
    );
    let sent = s.write_all(head.as_bytes()).and_then(|_| s.write_all(body));
    let mut answer = Vec::new();
    let mut tmp = [0u8; 4096];
    while !answer.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut tmp) {
            Ok(n) if n > 0 => answer.extend_from_slice(&tmp[..n]),
            _ => break,
        }
    }
    let text = String::from_utf8_lossy(&answer);
    match text.strip_prefix("HTTP/1.1 ").and_then(|r| r.get(..3)) {
        Some(status) => status.to_owned(),
        None if sent.is_err() => "closed while sending".into(),
        None => "closed without an answer".into(),
    }
}

/// A chat whose one message is `mib` MiB of the fixture's made-up words.
fn large_chat(mib: usize) -> Vec<u8> {
    let mut text = testkit::tokenizer_fixture::words(1, (mib << 20) / 5);
    while text.len() < mib << 20 {
        text.push_str(&testkit::tokenizer_fixture::words(text.len() as u64, 1000));
    }
    text.truncate(mib << 20);
    json!({"model": "sim-llama-8b", "max_tokens": 8,
           "messages": [{"role": "user", "content": text}]})
    .to_string()
    .into_bytes()
}

/// Sends the huge chat again as soon as each is answered.
fn large_chatter(addr: SocketAddr, body: &[u8], stop: &AtomicBool, stats: &HostileStats) {
    while !stop.load(Relaxed) {
        let t0 = Instant::now();
        let what = match testkit::http::request(
            addr,
            "POST",
            "/v1/chat/completions",
            &[("content-type", "application/json")],
            body,
        ) {
            Ok(r) => {
                let text = r.text();
                let who = if text.contains("maximum context length") {
                    "the engine: longer than its context"
                } else {
                    "other"
                };
                format!("{} ({who})", r.status)
            }
            Err(e) => format!("no answer: {}", e.kind()),
        };
        stats
            .large_chat_secs
            .lock()
            .expect("secs")
            .push(t0.elapsed().as_secs_f64());
        *stats
            .large_chats
            .lock()
            .expect("large chats")
            .entry(what)
            .or_default() += 1;
    }
}
