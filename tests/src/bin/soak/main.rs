//! `soak`: minutes of mixed traffic through a real `prefix-router` in front of
//! `sim-engine`s, killing (SIGKILL) and restarting one engine at a time, while
//! printing the router's RSS over time and accounting for every request.
//!
//! A request may be lost only if it was on an engine at the moment that
//! engine was killed (its stream is cut); any other failure is a bug, and the
//! exit status is 1. Run it with the binaries of one profile, e.g.
//! `cargo run --release -p router-tests --bin soak -- --minutes 3`.
//!
//! With `--tls` the clients speak TLS with an API key while the router's
//! certificate and the key are rotated through the files it watches; a
//! request refused or cut by a rotation is a loss like any other.
//!
//! With `--hostile` it runs the hostile-clients comparison instead (see
//! `hostile.rs`): the same normal traffic first alone, then beside slow
//! readers, slowloris clients, oversized uploads, huge chats to a router in
//! precise mode and a trickling backend.

mod hostile;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use prefix_router::http::chunked::ChunkedDecoder;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use testkit::engine_proc::SimEngine;
use testkit::router_proc::Router;

/// Soak test of prefix-router with engine restarts.
#[derive(Parser, Debug)]
struct Args {
    /// How long to run, in minutes.
    #[arg(long, default_value_t = 3.0)]
    minutes: f64,
    /// How long to run, in seconds (overrides --minutes).
    #[arg(long)]
    seconds: Option<f64>,
    /// Engines behind the router.
    #[arg(long, default_value_t = 3)]
    engines: usize,
    /// Concurrent clients, each sending one request at a time.
    #[arg(long, default_value_t = 16)]
    clients: usize,
    /// Seconds between engine kills (one engine at a time, in turn).
    #[arg(long, default_value_t = 30.0)]
    kill_every: f64,
    /// Seconds a killed engine stays down before it restarts.
    #[arg(long, default_value_t = 3.0)]
    down: f64,
    /// Seconds between RSS and progress lines.
    #[arg(long, default_value_t = 10.0)]
    report_every: f64,
    /// Engine time scale (0.1: ten times faster than a GPU).
    #[arg(long, default_value_t = 0.1)]
    time_scale: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Run the hostile-clients comparison (no kills): a clean phase, then a
    /// hostile phase, each `--seconds` long.
    #[arg(long)]
    hostile: bool,
    /// Hostile phase: clients that send a long streaming request and never read.
    #[arg(long, default_value_t = 8)]
    slow_readers: usize,
    /// Hostile phase: connections that send a header line a second, never ending the head.
    #[arg(long, default_value_t = 64)]
    slowloris: usize,
    /// Hostile phase: clients that upload bodies over and near the body limit.
    #[arg(long, default_value_t = 4)]
    uploaders: usize,
    /// Size of the near-limit uploads in MiB (the default body limit is 32).
    #[arg(long, default_value_t = 24)]
    upload_mib: usize,
    /// Pause between one uploader's uploads, in ms.
    #[arg(long, default_value_t = 250)]
    upload_pause_ms: u64,
    /// Hostile phase: clients that send huge chats (one message of
    /// `--large-chat-mib`) to a router in precise mode with a real
    /// tokenizer; 0 leaves precise mode off.
    #[arg(long, default_value_t = 1)]
    large_chats: usize,
    /// Size of a huge chat's message in MiB (the default body limit is 32).
    #[arg(long, default_value_t = 30)]
    large_chat_mib: usize,
    /// The huge chats go straight to the first engine, not through the
    /// router (which still runs in precise mode): what they cost the
    /// engine and the machine alone, the reference for the router's share.
    #[arg(long)]
    large_chats_direct: bool,
    /// `limits.max_in_flight_per_backend` of the router (0: no limit).
    #[arg(long, default_value_t = 0)]
    max_in_flight: u32,
    /// Clients speak TLS to the router and send an API key; every
    /// `--rotate-every` seconds the router's certificate is replaced and
    /// the key rotated (the new key added, the clients moved to it, the
    /// old one removed), all by rewriting files the router watches.
    #[arg(long)]
    tls: bool,
    /// Seconds between rotations with `--tls`.
    #[arg(long, default_value_t = 10.0)]
    rotate_every: f64,
}

/// The TLS side of a `--tls` soak: the client configuration, and the key
/// the clients send now.
struct TlsClients {
    cfg: Arc<rustls::ClientConfig>,
    key: Mutex<String>,
}

/// Files the router watches, rewritten by the rotator.
struct TlsFiles {
    ca: testkit::tls::TestCa,
    dir: std::path::PathBuf,
    keys: std::path::PathBuf,
}

impl TlsFiles {
    fn keys(&self, keys: &[&str]) {
        use sha2::Digest;
        let text: String = keys
            .iter()
            .map(|k| {
                let d: String = sha2::Sha256::digest(k.as_bytes())
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect();
                format!("[[keys]]\nname = \"{k}\"\nsha256 = \"{d}\"\n\n")
            })
            .collect();
        testkit::tls::write_atomically(&self.keys, &text);
    }

    /// A new certificate (a new key pair) for `localhost`, by rename.
    fn certificate(&self) -> (std::path::PathBuf, std::path::PathBuf) {
        self.ca
            .issue(&["localhost"], testkit::tls::Validity::Now, false)
            .write(&self.dir, "server")
    }
}

/// Bound on any single request; a request that takes longer is a hang.
const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// How one request ended.
enum Outcome {
    Ok,
    /// The stream was cut after the head; the engine that was answering.
    Truncated(String),
    /// A non-200 status from the router, with its text.
    Status(u16, String),
    /// No answer at all (connect error, reset before the head, timeout).
    NoAnswer(String),
}

struct Done {
    start: Instant,
    end: Instant,
    outcome: Outcome,
}

/// One kill: which engine, and when. The engine died somewhere between `from`
/// (just before SIGKILL was sent) and `to` (once it was reaped): a request the
/// router cut short can end before the killer thread notes the time, so a
/// single instant taken after the kill would call it a loss with no kill.
struct Kill {
    id: String,
    from: Instant,
    to: Instant,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let run_for = Duration::from_secs_f64(args.seconds.unwrap_or(args.minutes * 60.0));
    if args.hostile {
        return hostile::run(&args, run_for);
    }
    let ts = args.time_scale.to_string();
    let ports: Vec<u16> = (0..args.engines)
        .map(|_| testkit::proc::free_port())
        .collect();
    let spawn_engine = |i: usize| {
        SimEngine::spawn(&[
            "--listen",
            &format!("127.0.0.1:{}", ports[i]),
            "--id",
            &format!("e{i}"),
            "--time-scale",
            &ts,
            "--seed",
            &i.to_string(),
        ])
    };
    let engines: Vec<Mutex<Option<SimEngine>>> = (0..args.engines)
        .map(|i| Mutex::new(Some(spawn_engine(i))))
        .collect();
    let urls: Vec<String> = ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect();
    let mut config =
        "[health]\ninterval_ms = 200\ntimeout_ms = 500\nrise = 2\nfall = 2\npassive_fall = 3\n"
            .to_string();
    let tls_files = args.tls.then(|| {
        let dir = std::env::temp_dir().join(format!("soak-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("soak TLS dir");
        let files = TlsFiles {
            ca: testkit::tls::TestCa::new("soak CA"),
            keys: dir.join("keys.toml"),
            dir,
        };
        files.keys(&["sk-soak-0"]);
        let (cert, key) = files.certificate();
        config = format!(
            "watch_files_ms = 100\n{config}[tls]\ncert = \"{}\"\nkey = \"{}\"\n[auth]\nkeys_file = \"{}\"\n",
            cert.display(),
            key.display(),
            files.keys.display()
        );
        files
    });
    let tls_clients = tls_files.as_ref().map(|f| TlsClients {
        cfg: testkit::tls::client_config(&f.ca.pem, None),
        key: Mutex::new("sk-soak-0".into()),
    });
    // Debug headers: outcomes are attributed to the engine that answered.
    let router = Router::spawn(&urls, &["--debug-headers"], &config);
    let pid = router.child.pid();
    println!(
        "soak: {:.0} s, {} engines, {} clients, a kill every {} s ({} s down); router pid {pid} on {}",
        run_for.as_secs_f64(),
        args.engines,
        args.clients,
        args.kill_every,
        args.down,
        router.addr
    );

    let started = Instant::now();
    let deadline = started + run_for;
    let stop = Arc::new(AtomicBool::new(false));
    let results: Arc<Mutex<Vec<Done>>> = Arc::default();
    let kills: Arc<Mutex<Vec<Kill>>> = Arc::default();

    let rotations = std::sync::atomic::AtomicU64::new(0);
    let samples = std::thread::scope(|scope| {
        for c in 0..args.clients {
            let (stop, results) = (stop.clone(), results.clone());
            let addr = router.addr;
            let seed = args.seed * 1000 + c as u64;
            let tls = tls_clients.as_ref();
            scope.spawn(move || client(addr, seed, &stop, &results, tls));
        }
        // The rotator: a new key and a new certificate, in turn.
        if let (Some(files), Some(clients)) = (&tls_files, &tls_clients) {
            let (stop, rotations) = (stop.clone(), &rotations);
            let every = Duration::from_secs_f64(args.rotate_every);
            scope.spawn(move || {
                // The router reads a changed file within 100 ms; a second
                // leaves room for a loaded machine.
                let settle = Duration::from_secs(1);
                for n in 1.. {
                    if sleep_unless(&stop, every) {
                        return;
                    }
                    let (old, new) = (format!("sk-soak-{}", n - 1), format!("sk-soak-{n}"));
                    files.keys(&[&old, &new]);
                    if sleep_unless(&stop, settle) {
                        return;
                    }
                    *clients.key.lock().expect("key") = new.clone();
                    if sleep_unless(&stop, settle) {
                        return;
                    }
                    files.keys(&[&new]);
                    files.certificate();
                    rotations.fetch_add(1, Relaxed);
                }
            });
        }
        // The killer: one engine at a time, in turn.
        let (stop_k, kills_k, engines) = (stop.clone(), kills.clone(), &engines);
        let spawn_engine = &spawn_engine;
        let (kill_every, down) = (
            Duration::from_secs_f64(args.kill_every),
            Duration::from_secs_f64(args.down),
        );
        scope.spawn(move || {
            let mut next = 0;
            loop {
                if sleep_unless(&stop_k, kill_every) {
                    return;
                }
                let i = next % engines.len();
                next += 1;
                let mut slot = engines[i].lock().expect("engine slot");
                if let Some(mut e) = slot.take() {
                    let from = Instant::now();
                    let _ = e.child.child.kill();
                    let _ = e.child.child.wait();
                    kills_k.lock().expect("kills").push(Kill {
                        id: format!("e{i}"),
                        from,
                        to: Instant::now(),
                    });
                }
                drop(slot);
                let interrupted = sleep_unless(&stop_k, down);
                *engines[i].lock().expect("engine slot") = Some(spawn_engine(i));
                if interrupted {
                    return;
                }
            }
        });
        // The reporter, on this thread.
        let report = Duration::from_secs_f64(args.report_every);
        let mut samples = Vec::new();
        while Instant::now() < deadline {
            std::thread::sleep(report.min(deadline.saturating_duration_since(Instant::now())));
            let rss = testkit::router_proc::rss_kib(pid);
            let t = started.elapsed().as_secs_f64();
            let done = results.lock().expect("results").len();
            println!(
                "soak: t={t:>6.1}s rss={rss} KiB requests={done} kills={} rotations={}",
                kills.lock().expect("kills").len(),
                rotations.load(Relaxed)
            );
            samples.push(rss);
        }
        stop.store(true, Relaxed);
        samples
    });

    // Accounting.
    let rss_end = testkit::router_proc::rss_kib(pid);
    let results = results.lock().expect("results");
    let kills = kills.lock().expect("kills");
    let at_a_kill = |d: &Done, id: Option<&str>| {
        kills
            .iter()
            .any(|k| k.to >= d.start && k.from <= d.end && id.is_none_or(|id| id == k.id))
    };
    let settle = Duration::from_secs_f64(args.down) + Duration::from_secs(1);
    let near_a_kill = |d: &Done| {
        kills
            .iter()
            .any(|k| d.end >= k.from && d.start <= k.to + settle)
    };
    let (mut ok, mut on_killed, mut other) = (0u64, 0u64, 0u64);
    for d in results.iter() {
        match &d.outcome {
            Outcome::Ok => ok += 1,
            Outcome::Truncated(id) if at_a_kill(d, Some(id)) => on_killed += 1,
            // The head had not fully arrived when the engine died: a 502
            // from the router, or a cut before the head.
            Outcome::Status(502, _) | Outcome::NoAnswer(_) if at_a_kill(d, None) => on_killed += 1,
            // A request written whole to an engine that was dying (or still
            // in its accept queue while it restarted) and closed without an
            // answer: the router never sends such a request twice, so it is
            // a 502 even if it started just after the kill.
            Outcome::Status(502, t) if t.contains("without answering") && near_a_kill(d) => {
                on_killed += 1
            }
            o => {
                other += 1;
                if other <= 10 {
                    let what = match o {
                        Outcome::Truncated(id) => format!("truncated on {id}, no kill then"),
                        Outcome::Status(s, t) => format!("status {s}: {t}"),
                        Outcome::NoAnswer(e) => format!("no answer: {e}"),
                        Outcome::Ok => unreachable!(),
                    };
                    println!(
                        "soak: LOST at t={:.1}s: {what}",
                        d.start.duration_since(started).as_secs_f64()
                    );
                }
            }
        }
    }
    let total = results.len() as u64;
    let rss_first = samples.first().copied().unwrap_or(0);
    let rss_max = samples.iter().copied().max().unwrap_or(0);
    println!(
        "soak: done: requests={total} ok={ok} lost_on_killed_engine={on_killed} lost_other={other} kills={} \
         rotations={} rss_first_kib={rss_first} rss_max_kib={rss_max} rss_end_kib={rss_end}",
        kills.len(),
        rotations.load(Relaxed)
    );
    drop(router);
    drop(engines);
    if other > 0 {
        anyhow::bail!("{other} requests were lost that were not on a killed engine");
    }
    Ok(())
}

/// Sleeps `d` in small steps; true if `stop` was set meanwhile.
fn sleep_unless(stop: &AtomicBool, d: Duration) -> bool {
    let until = Instant::now() + d;
    while Instant::now() < until {
        if stop.load(Relaxed) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20).min(until - Instant::now()));
    }
    stop.load(Relaxed)
}

/// One client: requests one after another until `stop`, mixing shared system
/// prompts (prefix reuse), streaming and not, short and longer outputs.
fn client(
    addr: SocketAddr,
    seed: u64,
    stop: &AtomicBool,
    results: &Mutex<Vec<Done>>,
    tls: Option<&TlsClients>,
) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    while !stop.load(Relaxed) {
        let system = format!(
            "You are assistant number {}. {}",
            rng.random_range(0..12),
            "Answer briefly and precisely. ".repeat(20)
        );
        let user = format!("question {} from client {seed}", rng.random::<u32>());
        let stream = rng.random_bool(0.5);
        let body = json!({
            "model": "sim-llama-8b",
            "stream": stream,
            "max_tokens": rng.random_range(8..64),
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        })
        .to_string();
        let start = Instant::now();
        let outcome = one_request(addr, body.as_bytes(), tls);
        results.lock().expect("results").push(Done {
            start,
            end: Instant::now(),
            outcome,
        });
    }
}

/// A connection to the router: plain, or TLS.
trait Conn: Read + Write {}
impl<T: Read + Write> Conn for T {}

/// Sends one request (`connection: close`) and reads its answer to the
/// end; over TLS with the clients' current key when `tls` is given.
fn one_request(addr: SocketAddr, body: &[u8], tls: Option<&TlsClients>) -> Outcome {
    let tcp = match TcpStream::connect_timeout(&addr, IO_TIMEOUT) {
        Ok(s) => s,
        Err(e) => return Outcome::NoAnswer(format!("connect: {e}")),
    };
    let _ = tcp.set_read_timeout(Some(IO_TIMEOUT));
    let _ = tcp.set_write_timeout(Some(IO_TIMEOUT));
    let mut auth = String::new();
    let mut s: Box<dyn Conn> = match tls {
        None => Box::new(tcp),
        Some(t) => {
            auth = format!("authorization: Bearer {}\r\n", t.key.lock().expect("key"));
            let name = rustls::pki_types::ServerName::try_from("localhost").expect("name");
            match rustls::ClientConnection::new(t.cfg.clone(), name) {
                Ok(c) => Box::new(rustls::StreamOwned::new(c, tcp)),
                Err(e) => return Outcome::NoAnswer(format!("tls: {e}")),
            }
        }
    };
    let mut req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: soak\r\nconnection: close\r\n{auth}content-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(body);
    if let Err(e) = s.write_all(&req).and_then(|()| s.flush()) {
        return Outcome::NoAnswer(format!("write: {e}"));
    }
    let mut buf = Vec::new();
    let mut tmp = [0u8; 16 * 1024];
    let mut head: Option<(u16, String, bool, Option<usize>, usize)> = None;
    loop {
        if head.is_none() {
            let mut hs = [httparse::EMPTY_HEADER; 32];
            let mut r = httparse::Response::new(&mut hs);
            match r.parse(&buf) {
                Ok(httparse::Status::Complete(n)) => {
                    let get = |name: &str| {
                        r.headers
                            .iter()
                            .find(|h| h.name.eq_ignore_ascii_case(name))
                            .map(|h| String::from_utf8_lossy(h.value).into_owned())
                    };
                    let chunked = get("transfer-encoding").is_some_and(|v| v.contains("chunked"));
                    let len = get("content-length").and_then(|v| v.parse().ok());
                    let id = get("x-engine-id").unwrap_or_default();
                    head = Some((r.code.unwrap_or(0), id, chunked, len, n));
                }
                Ok(httparse::Status::Partial) => {}
                Err(e) => return Outcome::NoAnswer(format!("bad head: {e}")),
            }
        }
        if let Some((status, _, chunked, len, n)) = &head {
            let body = &buf[*n..];
            let complete = if *chunked {
                let mut dec = ChunkedDecoder::new();
                dec.feed(body, None).is_ok_and(|_| dec.is_done())
            } else {
                len.is_some_and(|l| body.len() >= l)
            };
            if complete {
                return if *status == 200 {
                    Outcome::Ok
                } else {
                    Outcome::Status(*status, String::from_utf8_lossy(body).into_owned())
                };
            }
        }
        match s.read(&mut tmp) {
            Ok(n) if n > 0 => buf.extend_from_slice(&tmp[..n]),
            Ok(_) => {
                return match head {
                    Some((_, id, ..)) => Outcome::Truncated(id),
                    None => Outcome::NoAnswer("closed before the head".into()),
                };
            }
            Err(e) => {
                return match head {
                    Some((_, id, ..)) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                        Outcome::Truncated(id)
                    }
                    _ => Outcome::NoAnswer(format!("read: {e}")),
                };
            }
        }
    }
}
