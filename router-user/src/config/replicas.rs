//! `[replicas]` configuration: several routers in front of one fleet share
//! what each sent where, what the engines' answers corrected and their
//! work in flight, so each routes as if it had seen all the traffic
//! (`control::replicas`). Off unless `listen` is set.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, bail};
use serde::Deserialize;

/// Shortest shared key accepted: 16 bytes, 128 bits when random.
pub const MIN_KEY_BYTES: usize = 16;

/// The `[replicas]` section.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ReplicasConfig {
    /// Where this replica publishes its stream, `ip:port` (peers subscribe
    /// to it); the next port serves catch-up snapshots. Unset: replicas
    /// share nothing (the default).
    pub listen: Option<SocketAddr>,
    /// Peers' `listen` addresses, `host:port`. Listing every replica's,
    /// this one's included, is fine: a replica recognises itself and skips it.
    pub peers: Vec<String>,
    /// A DNS name whose A/AAAA records are the replicas (a headless Service
    /// of the router's own Deployment), each on `dns_port`.
    pub dns: Option<String>,
    /// The port of the replicas found by `dns` [default: `listen`'s port].
    pub dns_port: Option<u16>,
    /// Files of `host:port` lines (`#` comments), re-read every `refresh_ms`.
    pub files: Vec<PathBuf>,
    /// The key every message is authenticated with (a keyed BLAKE3 MAC);
    /// a message under any other key is dropped and counted. At least 16
    /// bytes; the same on every replica.
    pub key: Option<String>,
    /// A file holding the key (its first line), instead of `key`.
    pub key_file: Option<PathBuf>,
    /// How often the peer list is resolved again (DNS, files). 2 s: a
    /// replica that starts is followed within that.
    pub refresh_ms: u64,
    /// How often this replica publishes its work in flight per backend.
    /// 10 ms: a burst of a few requests is seen by the peers through the
    /// decisions themselves (each counts in flight at once); this corrects
    /// the count as requests end.
    pub load_interval_ms: u64,
    /// A peer silent this long is stalled: its work in flight no longer
    /// counts (what it sent before stays in the index). 1 s: ten missed
    /// heartbeats (one every 100 ms).
    pub stale_ms: u64,
    /// How long a starting replica waits for a peer's snapshot before it
    /// serves on what it has (cold). 3 s.
    pub snapshot_timeout_ms: u64,
}

impl Default for ReplicasConfig {
    fn default() -> Self {
        ReplicasConfig {
            listen: None,
            peers: Vec::new(),
            dns: None,
            dns_port: None,
            files: Vec::new(),
            key: None,
            key_file: None,
            refresh_ms: 2_000,
            load_interval_ms: 10,
            stale_ms: 1_000,
            snapshot_timeout_ms: 3_000,
        }
    }
}

impl ReplicasConfig {
    pub fn enabled(&self) -> bool {
        self.listen.is_some()
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        if !self.enabled() {
            if !self.peers.is_empty() || self.dns.is_some() || !self.files.is_empty() {
                bail!("[replicas] names peers but no `listen`: set replicas.listen to share");
            }
            return Ok(());
        }
        if self.key.is_some() && self.key_file.is_some() {
            bail!("[replicas]: set `key` or `key_file`, not both");
        }
        if self.key.is_none() && self.key_file.is_none() {
            bail!(
                "[replicas] needs a shared `key` (or `key_file`): peers authenticate every message"
            );
        }
        if let Some(k) = &self.key
            && k.len() < MIN_KEY_BYTES
        {
            bail!("replicas.key must be at least {MIN_KEY_BYTES} bytes");
        }
        if self
            .listen
            .is_some_and(|l| l.port() == u16::MAX || l.port() == 0)
        {
            bail!("replicas.listen needs a port below 65535 (the next one serves snapshots)");
        }
        if self.refresh_ms < 100 || self.load_interval_ms == 0 || self.stale_ms < 100 {
            bail!(
                "[replicas]: refresh_ms and stale_ms must be at least 100, load_interval_ms at least 1"
            );
        }
        Ok(())
    }

    /// The shared key's bytes (read from `key_file` when given).
    pub fn key_bytes(&self) -> anyhow::Result<Vec<u8>> {
        let key = match (&self.key, &self.key_file) {
            (Some(k), _) => k.clone(),
            (None, Some(f)) => {
                let text = std::fs::read_to_string(f)
                    .with_context(|| format!("reading replicas.key_file {}", f.display()))?;
                text.lines().next().unwrap_or("").trim().to_owned()
            }
            (None, None) => bail!("[replicas] has no key"),
        };
        if key.len() < MIN_KEY_BYTES {
            bail!("the replicas key must be at least {MIN_KEY_BYTES} bytes");
        }
        Ok(key.into_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_example_config_says_the_defaults_and_its_commented_keys_are_valid() {
        let text = include_str!("../../prefix-router.example.toml");
        let cfg: crate::config::Config = toml::from_str(text).unwrap();
        assert_eq!(cfg.replicas, ReplicasConfig::default());
        assert!(!cfg.replicas.enabled());
        let section: String = text
            .lines()
            .skip_while(|l| !l.starts_with("[replicas]"))
            .skip(1)
            .take_while(|l| !l.starts_with('['))
            .map(|l| l.strip_prefix("# ").unwrap_or(l))
            .filter(|l| l.contains(" = ") && !l.starts_with("key_file"))
            .map(|l| format!("{l}\n"))
            .collect();
        let on: ReplicasConfig = toml::from_str(&section).unwrap();
        on.validate().unwrap();
        assert!(on.enabled() && on.dns.is_some() && !on.peers.is_empty());
    }

    #[test]
    fn sharing_needs_a_long_enough_key_and_peers_need_a_listener() {
        let parse = |s: &str| toml::from_str::<ReplicasConfig>(s).unwrap().validate();
        assert!(parse("listen = \"127.0.0.1:7100\"").is_err());
        assert!(parse("listen = \"127.0.0.1:7100\"\nkey = \"short\"").is_err());
        assert!(parse("peers = [\"10.0.0.1:7100\"]").is_err());
        assert!(parse("listen = \"127.0.0.1:7100\"\nkey = \"sixteen bytes ok\"").is_ok());
    }
}
