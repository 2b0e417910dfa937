//! `[tls]` and `[backend_tls]`: the certificates of the traffic listener
//! and of the connections to `https://` backends, read from PEM files into
//! rustls configurations (the `ring` provider; decision 0054). Reading them
//! is the configuration's job, so a reload (SIGHUP, a changed file) swaps
//! them with the rest of the configuration: connections already open keep
//! the session they made.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, bail};
use rustls::crypto::ring;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use serde::Deserialize;

/// The PEM files read at most: a certificate chain or a CA bundle is a few
/// KB (the system's whole bundle about 200 KB); more is not a PEM file.
const MAX_PEM_BYTES: u64 = 4 << 20;

/// The only application protocol the listener speaks (ALPN).
pub const ALPN_HTTP11: &[u8] = b"http/1.1";

/// `[tls]`: TLS on the traffic listener. Off (plain HTTP) while `cert` is
/// empty.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    /// The certificate chain, PEM, leaf first.
    pub cert: String,
    /// Its private key, PEM (PKCS#8, PKCS#1 or SEC1).
    pub key: String,
    /// mTLS: a PEM bundle of the CAs whose client certificates are
    /// accepted; a client without one is refused in the handshake ("":
    /// no client certificate asked).
    pub client_ca: String,
}

impl TlsConfig {
    pub fn enabled(&self) -> bool {
        !self.cert.is_empty()
    }
}

/// `[backend_tls]`: how the router connects to `https://` backends
/// (health probes and `/v1/models` reads included).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BackendTlsConfig {
    /// A PEM bundle of the CAs the backends' certificates must chain to
    /// ("": the system's roots). The certificate must name the URL's host
    /// (sent as SNI).
    pub ca: String,
    /// A client certificate chain to present (backends that ask for mTLS).
    pub cert: String,
    /// Its private key.
    pub key: String,
}

/// The `ring` provider: it builds with the C compiler alone (aws-lc-rs
/// wants more of the toolchain), and its suites are TLS 1.2 and 1.3's
/// usual AES-GCM and ChaCha20 with X25519 and the NIST curves. rustls
/// marks it deprecated for lacking post-quantum key exchange; decision
/// 0054 says when that would change the choice.
#[allow(deprecated)]
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(ring::default_provider())
}

/// Reads a PEM file, refusing what is not a regular file of sane size.
fn read_pem(what: &str, path: &str) -> anyhow::Result<Vec<u8>> {
    let p = Path::new(path);
    let meta = std::fs::metadata(p).with_context(|| format!("{what} {path:?}"))?;
    if !meta.is_file() || meta.len() > MAX_PEM_BYTES {
        bail!("{what} {path:?} is not a regular file of at most {MAX_PEM_BYTES} bytes");
    }
    std::fs::read(p).with_context(|| format!("reading {what} {path:?}"))
}

fn certs(what: &str, path: &str) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let pem = read_pem(what, path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("{what} {path:?}: not PEM certificates"))?;
    if certs.is_empty() {
        bail!("{what} {path:?} holds no certificate");
    }
    Ok(certs)
}

fn key(what: &str, path: &str) -> anyhow::Result<PrivateKeyDer<'static>> {
    let pem = read_pem(what, path)?;
    // Never print the key's bytes, whatever went wrong.
    PrivateKeyDer::from_pem_slice(&pem)
        .map_err(|_| anyhow::anyhow!("{what} {path:?} holds no PEM private key"))
}

fn roots(what: &str, path: &str) -> anyhow::Result<RootCertStore> {
    let mut store = RootCertStore::empty();
    for c in certs(what, path)? {
        store
            .add(c)
            .with_context(|| format!("{what} {path:?}: a certificate is not a usable CA"))?;
    }
    Ok(store)
}

/// The listener's rustls configuration: TLS 1.2 and 1.3, ALPN `http/1.1`,
/// client certificates checked against `client_ca` when it is set.
pub fn server_config(t: &TlsConfig) -> anyhow::Result<Arc<ServerConfig>> {
    if t.key.is_empty() {
        bail!("tls.cert is set but tls.key is not");
    }
    let provider = provider();
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .context("TLS versions")?;
    let builder = if t.client_ca.is_empty() {
        builder.with_no_client_auth()
    } else {
        let roots = Arc::new(roots("tls.client_ca", &t.client_ca)?);
        let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider)
            .build()
            .context("tls.client_ca")?;
        builder.with_client_cert_verifier(verifier)
    };
    let mut cfg = builder
        .with_single_cert(certs("tls.cert", &t.cert)?, key("tls.key", &t.key)?)
        .context("tls.cert and tls.key do not make a usable pair")?;
    cfg.alpn_protocols = vec![ALPN_HTTP11.to_vec()];
    Ok(Arc::new(cfg))
}

/// The rustls configuration for connections to `https://` backends.
pub fn client_config(t: &BackendTlsConfig) -> anyhow::Result<Arc<ClientConfig>> {
    let roots = if t.ca.is_empty() {
        let found = rustls_native_certs::load_native_certs();
        let mut store = RootCertStore::empty();
        let (added, _ignored) = store.add_parsable_certificates(found.certs);
        if added == 0 {
            bail!(
                "backend_tls.ca is empty and the system has no CA certificates (install ca-certificates, or set backend_tls.ca)"
            );
        }
        store
    } else {
        roots("backend_tls.ca", &t.ca)?
    };
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .context("TLS versions")?
        .with_root_certificates(roots);
    let mut cfg = match (t.cert.is_empty(), t.key.is_empty()) {
        (true, true) => builder.with_no_client_auth(),
        (false, false) => builder
            .with_client_auth_cert(
                certs("backend_tls.cert", &t.cert)?,
                key("backend_tls.key", &t.key)?,
            )
            .context("backend_tls.cert and backend_tls.key do not make a usable pair")?,
        _ => bail!("backend_tls.cert and backend_tls.key are set together or not at all"),
    };
    cfg.alpn_protocols = vec![ALPN_HTTP11.to_vec()];
    Ok(Arc::new(cfg))
}

/// The files of both sections, for the watcher that reloads on a change.
pub fn files<'a>(t: &'a TlsConfig, b: &'a BackendTlsConfig) -> impl Iterator<Item = &'a str> {
    [&t.cert, &t.key, &t.client_ca, &b.ca, &b.cert, &b.key]
        .into_iter()
        .map(String::as_str)
        .filter(|p| !p.is_empty())
}
