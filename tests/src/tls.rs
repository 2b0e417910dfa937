//! Certificates made in the test (a CA, server and client certificates
//! from it, expired ones, ones for the wrong host), written as PEM files
//! for `[tls]` and `[backend_tls]`, and a blocking HTTPS client over
//! rustls.
//!
//! ```no_run
//! use testkit::tls::{TestCa, Validity};
//! let ca = TestCa::new("test CA");
//! let dir = std::env::temp_dir();
//! let server = ca.issue(&["localhost", "127.0.0.1"], Validity::Now, false);
//! let (cert, key) = server.write(&dir, "server");
//! ```

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::http::{Response, connect, request_on};

/// A certificate authority made for one test.
pub struct TestCa {
    cert: rcgen::Certificate,
    key: KeyPair,
    /// The CA's certificate, PEM.
    pub pem: String,
}

/// When a certificate is valid.
#[derive(Clone, Copy, Debug)]
pub enum Validity {
    /// From yesterday for a year.
    Now,
    /// It ended yesterday.
    Expired,
}

/// A certificate and its key, PEM.
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

impl Issued {
    /// Writes `dir/stem.crt` and `dir/stem.key`; returns their paths.
    pub fn write(&self, dir: &Path, stem: &str) -> (PathBuf, PathBuf) {
        let (c, k) = (
            dir.join(format!("{stem}.crt")),
            dir.join(format!("{stem}.key")),
        );
        write_atomically(&c, &self.cert_pem);
        write_atomically(&k, &self.key_pem);
        (c, k)
    }
}

/// Writes a file as certificate tools do: a temporary file renamed over
/// the old one, so a reader never sees half of it.
pub fn write_atomically(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).expect("write PEM");
    std::fs::rename(&tmp, path).expect("rename PEM");
}

/// Midnight (UTC) `n` days from today.
macro_rules! days {
    ($n:expr) => {{
        let (y, m, d) = ymd($n);
        rcgen::date_time_ymd(y, m, d)
    }};
}

/// The civil date `n` days from today (UTC).
fn ymd(n: i64) -> (i32, u8, u8) {
    let today = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs() as i64
        / 86_400;
    // Days since 1970 to a civil date (H. Hinnant's `civil_from_days`).
    let z = today + n + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u8;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u8;
    let y = (yoe + era * 400 + i64::from(m <= 2)) as i32;
    (y, m, d)
}

impl TestCa {
    pub fn new(name: &str) -> TestCa {
        let key = KeyPair::generate().expect("CA key");
        let mut p = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, name);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        p.not_before = days!(-2);
        p.not_after = days!(365);
        let cert = p.self_signed(&key).expect("self-signed CA");
        let pem = cert.pem();
        TestCa { cert, key, pem }
    }

    /// A certificate for `names` (DNS names or IP addresses), for a server
    /// or (`client`) a client.
    pub fn issue(&self, names: &[&str], valid: Validity, client: bool) -> Issued {
        let key = KeyPair::generate().expect("key");
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        let mut p = CertificateParams::new(names.clone()).expect("params");
        p.distinguished_name.push(
            DnType::CommonName,
            names.first().cloned().unwrap_or_default(),
        );
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![if client {
            ExtendedKeyUsagePurpose::ClientAuth
        } else {
            ExtendedKeyUsagePurpose::ServerAuth
        }];
        (p.not_before, p.not_after) = match valid {
            Validity::Now => (days!(-1), days!(365)),
            Validity::Expired => (days!(-30), days!(-1)),
        };
        let cert = p.signed_by(&key, &self.cert, &self.key).expect("sign");
        Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }

    /// Writes the CA's certificate to `dir/stem.crt`.
    pub fn write(&self, dir: &Path, stem: &str) -> PathBuf {
        let p = dir.join(format!("{stem}.crt"));
        write_atomically(&p, &self.pem);
        p
    }
}

/// A rustls client trusting `ca_pem` only, presenting `client` when given.
pub fn client_config(ca_pem: &str, client: Option<&Issued>) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c.expect("CA PEM")).expect("CA");
    }
    #[allow(deprecated)]
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let b = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots);
    let mut cfg = match client {
        None => b.with_no_client_auth(),
        Some(c) => {
            let chain = CertificateDer::pem_slice_iter(c.cert_pem.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .expect("client cert");
            let key = PrivateKeyDer::from_pem_slice(c.key_pem.as_bytes()).expect("client key");
            b.with_client_auth_cert(chain, key).expect("client auth")
        }
    };
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(cfg)
}

/// One HTTPS request (`connection: close`) to `addr`, checking the
/// server's certificate against `name`. A refused handshake is an error
/// of kind `InvalidData` naming why.
pub fn request(
    addr: SocketAddr,
    cfg: &Arc<rustls::ClientConfig>,
    name: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<Response> {
    let mut s = stream(addr, cfg, name)?;
    request_on(&mut s, name, method, path, headers, body).map(|(r, _)| r)
}

/// A TLS connection to `addr` with its handshake done (so a refused
/// certificate fails here).
pub fn stream(
    addr: SocketAddr,
    cfg: &Arc<rustls::ClientConfig>,
    name: &str,
) -> std::io::Result<impl Read + Write + use<>> {
    let server = ServerName::try_from(name.to_owned())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let conn = rustls::ClientConnection::new(cfg.clone(), server).map_err(std::io::Error::other)?;
    let mut s = rustls::StreamOwned::new(conn, connect(addr)?);
    while s.conn.is_handshaking() {
        s.conn.complete_io(&mut s.sock)?;
    }
    Ok(s)
}
