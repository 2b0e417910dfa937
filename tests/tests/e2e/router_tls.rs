//! TLS on the traffic listener through real processes: the official openai
//! SDK over HTTPS with a CA made in the test and an API key; certificates
//! that are expired, for another host or from another CA refused; mTLS;
//! garbage and truncated handshakes that no other connection notices; what
//! an idle TLS connection costs. Rotation, backends and the admin token:
//! `router_tls_rotation`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};

use serde_json::json;
use testkit::engine_proc::SimEngine;
use testkit::router_proc::Router;
use testkit::sdk::{self, Script};
use testkit::tls::{self, Issued, TestCa, Validity, write_atomically};

/// A folder of its own for one test's files.
pub(crate) fn dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("router-tls-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("test dir");
    d
}

pub(crate) fn sha256_hex(key: &str) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A keys file of `(name, key, tenant)`.
pub(crate) fn keys_file(path: &Path, keys: &[(&str, &str, &str)]) {
    let mut text = String::new();
    for (name, key, tenant) in keys {
        text.push_str(&format!(
            "[[keys]]\nname = \"{name}\"\nsha256 = \"{}\"\ntenant = \"{tenant}\"\n\n",
            sha256_hex(key)
        ));
    }
    write_atomically(path, &text);
}

pub(crate) fn chat_body() -> Vec<u8> {
    serde_json::to_vec(&json!({
        "model": "sim-llama-8b",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hello over tls"}]
    }))
    .expect("json")
}

/// One HTTPS chat request with `key`: its status, or the error.
pub(crate) fn chat(
    addr: SocketAddr,
    cfg: &Arc<rustls::ClientConfig>,
    key: Option<&str>,
) -> std::io::Result<u16> {
    let auth = key.map(|k| format!("Bearer {k}"));
    let mut headers = vec![("content-type", "application/json")];
    if let Some(a) = &auth {
        headers.push(("authorization", a.as_str()));
    }
    tls::request(
        addr,
        cfg,
        "localhost",
        "POST",
        "/v1/chat/completions",
        &headers,
        &chat_body(),
    )
    .map(|r| r.status)
}

/// The value of the metric line starting with `prefix` (0 when absent).
pub(crate) fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

/// A router with `[tls]` from `server` (and `extra` TOML) in front of one
/// sim-engine; files go to `d`.
pub(crate) fn tls_router(d: &Path, server: &Issued, extra: &str) -> (SimEngine, Router) {
    let engine = SimEngine::spawn(&["--time-scale", "0"]);
    let (cert, key) = server.write(d, "server");
    let cfg = format!(
        "watch_files_ms = 100\n{extra}\n[tls]\ncert = \"{}\"\nkey = \"{}\"\n",
        cert.display(),
        key.display()
    );
    let r = Router::spawn(&[engine.url()], &[], &cfg);
    (engine, r)
}

/// Polls `f` every 50 ms for up to 10 s until it holds.
pub(crate) fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn tls_the_openai_sdk_works_over_https_with_a_key_and_a_wrong_key_gets_401() {
    let Some(py) = sdk::require("tls_the_openai_sdk_works_over_https_with_a_key") else {
        return;
    };
    let d = dir("sdk");
    let ca = TestCa::new("sdk test CA");
    let ca_path = ca.write(&d, "ca");
    let server = ca.issue(&["localhost"], Validity::Now, false);
    let keys = d.join("keys.toml");
    keys_file(&keys, &[("alpha-laptop", "sk-alpha", "alpha")]);
    let (_e, r) = tls_router(
        &d,
        &server,
        &format!("[auth]\nkeys_file = \"{}\"", keys.display()),
    );
    let base = format!("https://localhost:{}", r.addr.port());
    let run = sdk::run(
        &py,
        Script::OpenAiTls,
        &base,
        "sim-llama-8b",
        &[
            "--ca",
            ca_path.to_str().expect("path"),
            "--api-key",
            "sk-alpha",
            "--wrong-key",
            "sk-nope",
        ],
    );
    run.assert_success();
    assert!(
        run.call("chat.completions.stream")["chunks"]
            .as_u64()
            .unwrap_or(0)
            >= 2,
        "{run}"
    );
    assert_eq!(run.call("wrong_key")["status"], 401, "{run}");
    assert_eq!(run.call("wrong_key")["code"], "invalid_api_key", "{run}");
    let m = r.metrics();
    // Chat, stream and the model list were let in with the key; their
    // answers' tokens are counted to it.
    assert!(
        metric(
            &m,
            "prefix_router_api_key_requests_total{key=\"alpha-laptop\"}"
        ) >= 3.0,
        "{m}"
    );
    assert!(
        metric(
            &m,
            "prefix_router_api_key_tokens_total{key=\"alpha-laptop\",kind=\"prompt\"}"
        ) > 0.0,
        "{m}"
    );
    assert!(metric(&m, "prefix_router_unauthorized_total") >= 1.0, "{m}");
    // The key is never written to the log.
    assert!(!r.child.stderr_tail(1 << 20).contains("sk-alpha"));
}

#[test]
fn tls_expired_wrong_host_and_untrusted_certificates_are_refused() {
    let d = dir("refused");
    let ca = TestCa::new("refusal CA");
    let server = ca.issue(&["localhost"], Validity::Now, false);
    let (_e, r) = tls_router(&d, &server, "");
    let trusting = tls::client_config(&ca.pem, None);
    assert_eq!(
        chat(r.addr, &trusting, None).expect("a trusted, valid certificate"),
        200
    );

    // Another name than the certificate's.
    let err = tls::request(
        r.addr,
        &trusting,
        "wrong.example",
        "GET",
        "/v1/models",
        &[],
        b"",
    )
    .expect_err("a certificate for another host was accepted");
    assert!(format!("{err}").contains("not valid for name"), "{err}");

    // A CA the client does not trust.
    let other = tls::client_config(&TestCa::new("another CA").pem, None);
    let err = chat(r.addr, &other, None).expect_err("an untrusted certificate was accepted");
    assert!(format!("{err:?}").contains("UnknownIssuer"), "{err:?}");

    // The router's certificate replaced by an expired one: taken up on the
    // file change, and refused by the client.
    ca.issue(&["localhost"], Validity::Expired, false)
        .write(&d, "server");
    eventually("the expired certificate is served", || {
        chat(r.addr, &trusting, None).is_err_and(|e| format!("{e:?}").contains("Expired"))
    });
}

#[test]
fn tls_mtls_wants_a_client_certificate_from_the_configured_ca() {
    let d = dir("mtls");
    let ca = TestCa::new("mtls CA");
    let server = ca.issue(&["localhost"], Validity::Now, false);
    let client_ca = ca.write(&d, "client-ca");
    let (cert, key) = server.write(&d, "server");
    let engine = SimEngine::spawn(&["--time-scale", "0"]);
    let r = Router::spawn(
        &[engine.url()],
        &[],
        &format!(
            "[tls]\ncert = \"{}\"\nkey = \"{}\"\nclient_ca = \"{}\"\n",
            cert.display(),
            key.display(),
            client_ca.display()
        ),
    );
    let without = tls::client_config(&ca.pem, None);
    assert!(
        chat(r.addr, &without, None).is_err(),
        "served without a client certificate"
    );
    let stranger = TestCa::new("stranger CA").issue(&["client-x"], Validity::Now, true);
    let foreign = tls::client_config(&ca.pem, Some(&stranger));
    assert!(
        chat(r.addr, &foreign, None).is_err(),
        "served a client certificate from another CA"
    );
    let mine = ca.issue(&["client-a"], Validity::Now, true);
    let with = tls::client_config(&ca.pem, Some(&mine));
    assert_eq!(
        chat(r.addr, &with, None).expect("a client certificate from the CA"),
        200
    );
    let m = r.metrics();
    assert!(
        metric(&m, "prefix_router_tls_handshakes_total{result=\"failed\"}") >= 2.0,
        "{m}"
    );
}

#[test]
fn tls_garbage_and_truncated_handshakes_do_not_disturb_other_connections() {
    use std::io::{Read, Write};
    let d = dir("garbage");
    let ca = TestCa::new("garbage CA");
    let server = ca.issue(&["localhost"], Validity::Now, false);
    let (_e, r) = tls_router(&d, &server, "[timeouts]\nclient_header_ms = 1000");
    let cfg = tls::client_config(&ca.pem, None);
    // A real ClientHello's first bytes.
    let hello = {
        let name = rustls::pki_types::ServerName::try_from("localhost").expect("name");
        let mut c = rustls::ClientConnection::new(cfg.clone(), name).expect("conn");
        let mut out = Vec::new();
        c.write_tls(&mut out).expect("hello");
        out
    };
    let stop = Arc::new(AtomicBool::new(false));
    let attackers: Vec<_> = (0..3)
        .map(|kind| {
            let (stop, hello, addr) = (stop.clone(), hello.clone(), r.addr);
            std::thread::spawn(move || {
                let mut n = 0u32;
                let mut held = Vec::new();
                while !stop.load(Relaxed) {
                    let Ok(mut s) = testkit::http::connect(addr) else {
                        continue;
                    };
                    let bytes: Vec<u8> = match kind {
                        // Not TLS at all.
                        0 => b"GET / HTTP/1.1\r\nHost: x\r\n\r\n\x00\xff\x16\x03".to_vec(),
                        // A hello cut in the middle, then a close.
                        1 => hello[..hello.len() / 2].to_vec(),
                        // A hello cut short and left hanging (held open).
                        _ => hello[..10].to_vec(),
                    };
                    let _ = s.write_all(&bytes);
                    if kind == 2 {
                        held.push(s);
                        held.truncate(50);
                        std::thread::sleep(Duration::from_millis(20));
                    } else {
                        let _ = s.shutdown(std::net::Shutdown::Write);
                        let _ = s.read(&mut [0u8; 256]);
                    }
                    n += 1;
                }
                n
            })
        })
        .collect();
    let mut worst = Duration::ZERO;
    for _ in 0..60 {
        let t = Instant::now();
        assert_eq!(
            chat(r.addr, &cfg, None).expect("a good client during the attack"),
            200
        );
        worst = worst.max(t.elapsed());
    }
    stop.store(true, Relaxed);
    let bad: u32 = attackers
        .into_iter()
        .map(|a| a.join().expect("attacker"))
        .sum();
    assert!(bad >= 30, "only {bad} malformed handshakes were made");
    assert!(
        worst < Duration::from_secs(2),
        "a good request took {worst:?}"
    );
    let m = r.metrics();
    assert!(
        metric(&m, "prefix_router_tls_handshakes_total{result=\"failed\"}") >= 20.0,
        "{m}"
    );
}

#[test]
fn tls_idle_connections_cost_tens_of_kilobytes_each() {
    let d = dir("memory");
    let ca = TestCa::new("memory CA");
    let server = ca.issue(&["localhost"], Validity::Now, false);
    let (_e, r) = tls_router(&d, &server, "");
    let cfg = tls::client_config(&ca.pem, None);
    // Warm: one request, so every worker's lazy state exists.
    assert_eq!(chat(r.addr, &cfg, None).expect("warm"), 200);
    let before = r.rss_kib();
    const N: usize = 400;
    let held: Vec<_> = (0..N)
        .map(|_| tls::stream(r.addr, &cfg, "localhost").expect("handshake"))
        .collect();
    // The server's side of the last handshakes settles.
    std::thread::sleep(Duration::from_millis(300));
    let per_conn = (r.rss_kib().saturating_sub(before)) as f64 / N as f64;
    eprintln!("{N} idle TLS connections: {per_conn:.1} KiB each");
    assert!(per_conn < 64.0, "{per_conn:.1} KiB per idle TLS connection");
    drop(held);
}
