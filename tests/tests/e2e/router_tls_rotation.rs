//! Rotation and the other sides of TLS and keys through real processes:
//! keys and certificates rotated under traffic without a lost request (a
//! connection opened before serving after); `https://` backends with their
//! own key and a client certificate, and one whose certificate names
//! another host; the admin token, and no open admin port without one.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use testkit::engine_proc::SimEngine;
use testkit::router_proc::Router;
use testkit::tls::{self, TestCa, Validity};

use crate::router_tls::{
    chat, chat_body, dir, eventually, keys_file, metric, sha256_hex, tls_router,
};

#[test]
fn tls_keys_and_certificates_rotate_under_traffic_without_a_lost_request() {
    let d = dir("rotate");
    let ca = TestCa::new("rotation CA");
    let server = ca.issue(&["localhost"], Validity::Now, false);
    let keys = d.join("keys.toml");
    keys_file(&keys, &[("old", "sk-old", "team")]);
    let (_e, r) = tls_router(
        &d,
        &server,
        &format!("[auth]\nkeys_file = \"{}\"", keys.display()),
    );
    let cfg = tls::client_config(&ca.pem, None);
    assert_eq!(chat(r.addr, &cfg, Some("sk-old")).expect("old key"), 200);

    // Two clients send without pause, each with the key it is told.
    let stop = Arc::new(AtomicBool::new(false));
    let use_new = Arc::new(AtomicBool::new(false));
    let (sent, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let clients: Vec<_> = (0..2)
        .map(|_| {
            let (stop, use_new, sent, failed, cfg) = (
                stop.clone(),
                use_new.clone(),
                sent.clone(),
                failed.clone(),
                cfg.clone(),
            );
            let addr = r.addr;
            std::thread::spawn(move || {
                let mut errors = Vec::new();
                while !stop.load(Relaxed) {
                    let key = if use_new.load(Relaxed) {
                        "sk-new"
                    } else {
                        "sk-old"
                    };
                    sent.fetch_add(1, Relaxed);
                    match chat(addr, &cfg, Some(key)) {
                        Ok(200) => {}
                        other => {
                            failed.fetch_add(1, Relaxed);
                            errors.push(format!("{key}: {other:?}"));
                        }
                    }
                }
                errors
            })
        })
        .collect();
    let probe = tls::client_config(&ca.pem, None);
    // A kept-alive connection opened before the rotations.
    let mut kept = tls::stream(r.addr, &cfg, "localhost").expect("kept-alive connection");
    let kept_chat = |s: &mut _, key: &str| {
        let auth = format!("Bearer {key}");
        testkit::http::request_on(
            s,
            "localhost",
            "POST",
            "/v1/chat/completions",
            &[
                ("connection", "keep-alive"),
                ("content-type", "application/json"),
                ("authorization", &auth),
            ],
            &chat_body(),
        )
        .map(|(r, _)| r.status)
    };
    assert_eq!(
        kept_chat(&mut kept, "sk-old").expect("kept-alive, before"),
        200
    );
    // The new key joins; the clients move to it; the old key leaves.
    keys_file(
        &keys,
        &[("old", "sk-old", "team"), ("new", "sk-new", "team")],
    );
    eventually("the new key is accepted", || {
        chat(r.addr, &probe, Some("sk-new")).is_ok_and(|s| s == 200)
    });
    use_new.store(true, Relaxed);
    std::thread::sleep(Duration::from_millis(300));
    keys_file(&keys, &[("new", "sk-new", "team")]);
    eventually("the old key is refused", || {
        chat(r.addr, &probe, Some("sk-old")).is_ok_and(|s| s == 401)
    });
    // A new certificate (a new key pair) replaces the old by a rename.
    let fresh = ca.issue(&["localhost"], Validity::Now, false);
    let fresh_der = rustls::pki_types::pem::PemObject::from_pem_slice(fresh.cert_pem.as_bytes())
        .map(|c: rustls::pki_types::CertificateDer<'static>| c.to_vec())
        .expect("cert");
    fresh.write(&d, "server");
    eventually("the new certificate is served", || {
        served_cert(r.addr, &probe).is_some_and(|c| c == fresh_der)
    });
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Relaxed);
    // The connection opened before both rotations still serves, in the
    // session it made with the old certificate.
    assert_eq!(
        kept_chat(&mut kept, "sk-new").expect("kept-alive, after"),
        200
    );
    let errors: Vec<String> = clients
        .into_iter()
        .flat_map(|c| c.join().expect("client"))
        .collect();
    let sent = sent.load(Relaxed);
    assert!(
        sent >= 20,
        "only {sent} requests were sent during the rotations"
    );
    assert!(
        errors.is_empty(),
        "{} of {sent} requests lost: {errors:?}",
        errors.len()
    );
    let m = r.metrics();
    assert!(
        metric(&m, "prefix_router_api_key_requests_total{key=\"new\"}") >= 1.0,
        "{m}"
    );
}

/// The leaf certificate a new connection to `addr` is shown.
fn served_cert(addr: SocketAddr, cfg: &Arc<rustls::ClientConfig>) -> Option<Vec<u8>> {
    let name = rustls::pki_types::ServerName::try_from("localhost").ok()?;
    let mut conn = rustls::ClientConnection::new(cfg.clone(), name).ok()?;
    let mut sock = testkit::http::connect(addr).ok()?;
    while conn.is_handshaking() {
        conn.complete_io(&mut sock).ok()?;
    }
    Some(conn.peer_certificates()?.first()?.to_vec())
}

#[test]
fn tls_backends_over_https_with_their_own_key_and_a_client_certificate() {
    let d = dir("backend");
    let ca = TestCa::new("backend CA");
    // The "engine": a router with TLS, mTLS and its own key, in front of a
    // sim-engine, as an HTTPS inference server with --api-key would be.
    let server = ca.issue(&["localhost"], Validity::Now, false);
    let (cert, key) = server.write(&d, "engine");
    let ca_path = ca.write(&d, "ca");
    let engine_keys = d.join("engine-keys.toml");
    keys_file(&engine_keys, &[("router", "sk-engine", "router")]);
    let sim = SimEngine::spawn(&["--time-scale", "0"]);
    let front = Router::spawn(
        &[sim.url()],
        &[],
        &format!(
            "[tls]\ncert = \"{}\"\nkey = \"{}\"\nclient_ca = \"{}\"\n[auth]\nkeys_file = \"{}\"\n",
            cert.display(),
            key.display(),
            ca_path.display(),
            engine_keys.display()
        ),
    );
    let (client_cert, client_key) = ca
        .issue(&["router"], Validity::Now, true)
        .write(&d, "client");
    let engine_key = d.join("engine.key");
    std::fs::write(&engine_key, "sk-engine\n").expect("key file");
    let user_keys = d.join("user-keys.toml");
    keys_file(&user_keys, &[("user", "sk-user", "users")]);
    let https = format!("https://localhost:{}", front.addr.port());
    let r = Router::spawn(
        &[],
        &[],
        &format!(
            "backends = [{{ url = \"{https}\", api_key_file = \"{}\" }}]\n[health]\npath = \"/v1/models\"\ninterval_ms = 200\n[backend_tls]\nca = \"{}\"\ncert = \"{}\"\nkey = \"{}\"\n[auth]\nkeys_file = \"{}\"\n",
            engine_key.display(),
            ca_path.display(),
            client_cert.display(),
            client_key.display(),
            user_keys.display()
        ),
    );
    // The probe over TLS passes; the model list is read over TLS.
    assert!(
        r.wait_backend(&https, Duration::from_secs(10), |b| b["healthy"] == true),
        "{:?}",
        r.backends()
    );
    let models = |k: &str| {
        testkit::http::request(r.addr, "GET", "/v1/models", &[("authorization", k)], b"")
            .expect("models")
    };
    eventually("the backend's models are read over TLS", || {
        models("Bearer sk-user").text().contains("sim-llama-8b")
    });
    // The caller's key is the router's; the engine gets its own.
    let post = |k: &str| {
        testkit::http::request(
            r.addr,
            "POST",
            "/v1/chat/completions",
            &[("content-type", "application/json"), ("authorization", k)],
            &chat_body(),
        )
        .expect("chat")
    };
    let ok = post("Bearer sk-user");
    assert_eq!(ok.status, 200, "{}", ok.text());
    assert_eq!(
        post("Bearer sk-engine").status,
        401,
        "the engine's key is not a caller's"
    );
    // Straight to the engine, the user's key is refused.
    let direct = tls::client_config(&ca.pem, Some(&ca.issue(&["x"], Validity::Now, true)));
    assert_eq!(
        chat(front.addr, &direct, Some("sk-user")).expect("direct"),
        401
    );

    // A backend whose certificate does not name the URL's host is refused.
    let wrong = Router::spawn(
        &[],
        &[],
        &format!(
            "backends = [\"https://127.0.0.1:{}\"]\n[health]\npath = \"/v1/models\"\ninterval_ms = 200\n[backend_tls]\nca = \"{}\"\ncert = \"{}\"\nkey = \"{}\"\n",
            front.addr.port(),
            ca_path.display(),
            client_cert.display(),
            client_key.display()
        ),
    );
    let url = format!("https://127.0.0.1:{}", front.addr.port());
    assert!(
        wrong.wait_backend(&url, Duration::from_secs(10), |b| b["healthy"] == false),
        "{:?}",
        wrong.backends()
    );
    let refused = testkit::http::request(
        wrong.addr,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        &chat_body(),
    )
    .expect("chat");
    assert!(refused.status >= 500, "{}", refused.text());
}

#[test]
fn admin_token_guards_the_admin_paths_and_an_open_admin_port_is_refused() {
    let engine = SimEngine::spawn(&["--time-scale", "0"]);
    let r = Router::spawn(
        &[engine.url()],
        &[],
        &format!(
            "[admin]\ntoken_sha256 = \"{}\"\n",
            sha256_hex("admin-secret")
        ),
    );
    let get = |path: &str, auth: Option<&str>| {
        let h: Vec<(&str, &str)> = auth.map(|a| ("authorization", a)).into_iter().collect();
        testkit::http::request(r.admin, "GET", path, &h, b"").expect("admin")
    };
    assert_eq!(get("/health", None).status, 200);
    assert_eq!(get("/admin/backends", None).status, 401);
    assert_eq!(get("/admin/backends", Some("Bearer wrong")).status, 401);
    assert_eq!(
        get("/admin/backends", Some("Bearer admin-secret")).status,
        200
    );
    let post = |path: &str, auth: &str| {
        testkit::http::request(r.admin, "POST", path, &[("authorization", auth)], b"")
            .expect("admin")
            .status
    };
    assert_eq!(post("/admin/reload", "Bearer nope"), 401);
    assert_eq!(post("/admin/reload", "Bearer admin-secret"), 200);
    assert_eq!(
        post(
            &format!("/admin/drain?backend={}", engine.url()),
            "Bearer nope"
        ),
        401
    );

    // On an address others reach, no token is no start.
    let port = testkit::proc::free_port();
    let err = Router::try_spawn(
        &[engine.url()],
        &["--admin-listen", &format!("0.0.0.0:{port}")],
        "",
    )
    .err()
    .expect("an unauthenticated admin listener on 0.0.0.0 started");
    assert!(err.contains("not a loopback address"), "{err}");
}
