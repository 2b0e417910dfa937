//! `[auth]`: the API keys the traffic port accepts, from a keys file of
//! SHA-256 digests (never keys in clear), each with a name (its label on
//! `/metrics`), and the tenant and class of `[classes]` its requests get.
//! With no keys file, any caller is served, as before.
//!
//! ```toml
//! [[keys]]
//! name = "team-a-prod"          # letters, digits, '.', '_', '-'
//! sha256 = "9f86d0…"            # printf %s "$KEY" | sha256sum
//! tenant = "team-a"             # optional: a [[classes.tenants]] name, or a new tenant
//! class = "priority"            # optional: that tenant's class, when it is new
//! ```

use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;

use anyhow::{Context, bail};
use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::classes::hex32;

/// Keys at most: each is a label value on `/metrics`.
pub const MAX_KEYS: usize = 10_000;
/// A keys file is read up to this many bytes (10,000 keys take about 2 MB).
const MAX_FILE_BYTES: u64 = 4 << 20;

/// `[auth]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// The keys file ("": no keys, any caller is served).
    pub keys_file: String,
    /// Send the caller's `Authorization` and `x-api-key` on to a backend
    /// that has no `api_key_file` of its own (false: engines never see
    /// the callers' keys).
    pub forward_authorization: bool,
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            keys_file: String::new(),
            forward_authorization: true,
        }
    }
}

/// Reads a backend's `api_key_file` into the header line the router sends
/// it (`authorization: Bearer KEY`), the key trimmed of whitespace.
pub fn backend_key_line(url: &str, path: &str) -> anyhow::Result<Vec<u8>> {
    let p = Path::new(path);
    let meta =
        std::fs::metadata(p).with_context(|| format!("backend {url}: api_key_file {path:?}"))?;
    if !meta.is_file() || meta.len() > 64 * 1024 {
        bail!("backend {url}: api_key_file {path:?} is not a regular file of at most 64 KiB");
    }
    let text = std::fs::read(p).with_context(|| format!("reading backend {url}'s api_key_file"))?;
    let key = text.trim_ascii();
    if key.is_empty() || !key.iter().all(|&b| b.is_ascii_graphic()) {
        bail!("backend {url}: api_key_file {path:?} must hold one key of printable characters");
    }
    let mut line = b"authorization: Bearer ".to_vec();
    line.extend_from_slice(key);
    line.extend_from_slice(b"\r\n");
    Ok(line)
}

/// One `[[keys]]` of the keys file.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyEntry {
    pub name: String,
    pub sha256: String,
    #[serde(default)]
    pub tenant: Option<String>,
    #[serde(default)]
    pub class: Option<String>,
}

/// Never prints the digest.
impl std::fmt::Debug for KeyEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyEntry")
            .field("name", &self.name)
            .field("tenant", &self.tenant)
            .field("class", &self.class)
            .finish()
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeysFile {
    #[serde(default)]
    keys: Vec<KeyEntry>,
}

/// The accepted keys: digest to key number, each key's name, and what
/// its callers sent (counted in place, read at each scrape).
#[derive(Default)]
pub struct Keys {
    by_digest: hashbrown::HashMap<[u8; 32], u32>,
    names: Vec<String>,
    counts: Vec<KeyCounts>,
}

/// One key's traffic: requests let in, and the tokens their answers
/// reported (`usage`).
#[derive(Debug, Default)]
pub struct KeyCounts {
    pub requests: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
}

/// Never prints a digest.
impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Keys({} keys)", self.names.len())
    }
}

impl Keys {
    /// The number of the key a caller presented, if it is one of them: one
    /// SHA-256 of the key and one hash lookup.
    pub fn find(&self, key: &[u8]) -> Option<u32> {
        self.by_digest
            .get(&<[u8; 32]>::from(Sha256::digest(key)))
            .copied()
    }

    /// A key's name (its label on `/metrics` and in logs).
    pub fn name(&self, key: u32) -> &str {
        self.names.get(key as usize).map_or("-", String::as_str)
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// A key's counters (any number past the last counts nowhere).
    pub fn counts(&self, key: u32) -> Option<&KeyCounts> {
        self.counts.get(key as usize)
    }

    /// Carries the counts of the keys `old` has by the same name over to
    /// these (a reload keeps each key's counters rising).
    pub fn carry_from(&self, old: &Keys) {
        for (name, c) in old.names.iter().zip(&old.counts) {
            if let Some(i) = self.names.iter().position(|n| n == name) {
                let to = &self.counts[i];
                for (t, f) in [
                    (&to.requests, &c.requests),
                    (&to.prompt_tokens, &c.prompt_tokens),
                    (&to.completion_tokens, &c.completion_tokens),
                ] {
                    t.fetch_add(f.load(Relaxed), Relaxed);
                }
            }
        }
    }
}

/// Reads and checks a keys file; its entries too, for `[classes]`.
pub fn load(path: &str) -> anyhow::Result<(Keys, Vec<KeyEntry>)> {
    let p = Path::new(path);
    let meta = std::fs::metadata(p).with_context(|| format!("auth.keys_file {path:?}"))?;
    if !meta.is_file() || meta.len() > MAX_FILE_BYTES {
        bail!("auth.keys_file {path:?} is not a regular file of at most {MAX_FILE_BYTES} bytes");
    }
    let text =
        std::fs::read_to_string(p).with_context(|| format!("reading auth.keys_file {path:?}"))?;
    // A parse error quotes the line it failed on: that may be a key a
    // person pasted in clear, so only the position is said.
    let file: KeysFile = toml::from_str(&text).map_err(|e| {
        let at = e
            .span()
            .map(|s| text[..s.start.min(text.len())].lines().count().max(1));
        anyhow::anyhow!(
            "parsing auth.keys_file {path:?}{}: {}",
            at.map(|l| format!(" near line {l}")).unwrap_or_default(),
            e.message()
        )
    })?;
    parse(file.keys)
}

fn parse(entries: Vec<KeyEntry>) -> anyhow::Result<(Keys, Vec<KeyEntry>)> {
    if entries.len() > MAX_KEYS {
        bail!("auth.keys_file: {} keys, at most {MAX_KEYS}", entries.len());
    }
    let mut keys = Keys::default();
    for (i, k) in entries.iter().enumerate() {
        let name_ok = !k.name.is_empty()
            && k.name.len() <= 64
            && k.name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        if !name_ok {
            bail!(
                "auth.keys_file: key name {:?} must be 1 to 64 letters, digits, '.', '_' or '-'",
                k.name
            );
        }
        if entries[..i].iter().any(|o| o.name == k.name) {
            bail!("auth.keys_file: {:?} is named twice", k.name);
        }
        let Some(digest) = hex32(&k.sha256) else {
            bail!(
                "auth.keys_file: key {:?}: sha256 is not 64 hex digits (the SHA-256 of the key: printf %s KEY | sha256sum)",
                k.name
            );
        };
        if k.class.is_some() && k.tenant.is_none() {
            bail!(
                "auth.keys_file: key {:?} has a class but no tenant (a class belongs to a tenant)",
                k.name
            );
        }
        if keys.by_digest.insert(digest, i as u32).is_some() {
            bail!("auth.keys_file: key {:?} is given twice", k.name);
        }
        keys.names.push(k.name.clone());
        keys.counts.push(KeyCounts::default());
    }
    Ok((keys, entries))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, key: &str) -> KeyEntry {
        let d = Sha256::digest(key.as_bytes());
        KeyEntry {
            name: name.into(),
            sha256: d.iter().map(|b| format!("{b:02x}")).collect(),
            tenant: None,
            class: None,
        }
    }

    #[test]
    fn a_key_is_found_by_its_digest_only() {
        let (keys, _) = parse(vec![entry("a", "sk-one"), entry("b", "sk-two")]).unwrap();
        assert_eq!(keys.find(b"sk-two").map(|k| keys.name(k)), Some("b"));
        assert_eq!(keys.find(b"sk-three"), None);
        assert_eq!(keys.find(b""), None);
        assert!(!format!("{keys:?}").contains(&entry("a", "sk-one").sha256));
    }

    #[test]
    fn bad_entries_are_refused_without_echoing_them() {
        let mut clear = entry("a", "x");
        clear.sha256 = "sk-live-in-clear".into();
        let err = parse(vec![clear]).unwrap_err().to_string();
        assert!(!err.contains("sk-live-in-clear"), "{err}");
        assert!(parse(vec![entry("a", "x"), entry("a", "y")]).is_err());
        assert!(parse(vec![entry("a", "x"), entry("b", "x")]).is_err());
        let mut classless = entry("a", "x");
        classless.class = Some("flex".into());
        assert!(parse(vec![classless]).is_err());
    }
}
