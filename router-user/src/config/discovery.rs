//! `[discovery]` configuration: where backends come from besides the static
//! `backends` list. DNS names (A/AAAA with a port, or SRV) and files of URLs;
//! the fleet is the union of the static list and every source's last good
//! answer (`control::discovery`).

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::bail;
use serde::Deserialize;

/// Shortest interval a source may be polled at: a DNS server or a file
/// system asked more often than ten times a second gains nothing.
const MIN_INTERVAL_MS: u64 = 100;

/// The `[discovery]` section.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct DiscoveryConfig {
    /// The DNS server the DNS sources ask, `ip:port`. Unset (the default):
    /// the system's, from `/etc/resolv.conf` (its search domains and `ndots`
    /// included, as Kubernetes pods have them).
    pub dns_server: Option<SocketAddr>,
    /// Deadline of one whole resolution of one source (every query it
    /// takes, search domains and SRV targets included), or of one file read.
    /// 2 s: a healthy resolver answers in milliseconds; a dead one (or a
    /// hung file system) must not stall the other sources.
    pub timeout_ms: u64,
    /// An answer with no backends (NXDOMAIN, no records, an empty file)
    /// removes a source's backends only when it repeats this many times in
    /// a row; until then the last good list stays. 3 polls: a DNS server
    /// restarting, a zone being rewritten or a file being rewritten in
    /// place is not a fleet scaled to zero.
    pub empty_after: u32,
    /// Backends the prefix index is sized for beyond the static list, at
    /// `prefix.kv_blocks` each, when any source is configured (the index
    /// table is sized once, at start). 8: memory for 8 more engines
    /// (about 35 MB at the defaults); more backends still work, sharing it.
    pub index_backends: usize,
    /// DNS sources (`[[discovery.dns]]`).
    pub dns: Vec<DnsSource>,
    /// Files of backend URLs (`[[discovery.file]]`).
    pub file: Vec<FileSource>,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        DiscoveryConfig {
            dns_server: None,
            timeout_ms: 2_000,
            empty_after: 3,
            index_backends: 8,
            dns: Vec::new(),
            file: Vec::new(),
        }
    }
}

/// Which records a DNS source reads.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DnsRecord {
    /// A and AAAA records: every address is a backend on the source's `port`.
    #[default]
    A,
    /// SRV records: each target host (its A/AAAA records) on the record's
    /// port. Priority and weight are ignored: every target is a backend.
    Srv,
}

/// One DNS name whose records are backends.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DnsSource {
    /// The name, e.g. `vllm.inference.svc.cluster.local` (a headless
    /// service) or `_http._tcp.vllm.inference.svc.cluster.local` (SRV).
    pub name: String,
    /// `a` (A and AAAA, with `port`) or `srv`.
    #[serde(default)]
    pub record: DnsRecord,
    /// The backends' port, for `record = "a"`; SRV records carry their own.
    pub port: Option<u16>,
    /// How often the name is resolved again, start to start.
    #[serde(default = "dns_interval")]
    pub interval_ms: u64,
}

/// 5 s: Kubernetes DNS answers from the endpoints it watches, so a pod that
/// becomes ready is seen within seconds; an engine takes far longer to start.
fn dns_interval() -> u64 {
    5_000
}

/// One file of backend URLs, one per line, `#` comments.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FileSource {
    pub path: PathBuf,
    /// How often the file is read again and compared with its last text.
    #[serde(default = "file_interval")]
    pub interval_ms: u64,
}

/// 1 s: reading a small local file is cheap, and an operator who edits it
/// sees the change at once.
fn file_interval() -> u64 {
    1_000
}

impl DnsSource {
    /// Its name in logs, metrics and `/admin/backends`.
    pub fn key(&self) -> String {
        match (self.record, self.port) {
            (DnsRecord::A, Some(port)) => format!("dns:{}:{port}", self.name),
            _ => format!("srv:{}", self.name),
        }
    }
}

impl FileSource {
    pub fn key(&self) -> String {
        format!("file:{}", self.path.display())
    }
}

impl DiscoveryConfig {
    /// Whether any source is configured.
    pub fn any(&self) -> bool {
        !self.dns.is_empty() || !self.file.is_empty()
    }

    /// Index blocks to reserve for discovered backends of `kv_blocks` each.
    pub fn index_reserve_blocks(&self, kv_blocks: usize) -> usize {
        if self.any() {
            self.index_backends.saturating_mul(kv_blocks)
        } else {
            0
        }
    }

    /// Every source's key, in the config's order (DNS first).
    pub fn keys(&self) -> Vec<String> {
        let dns = self.dns.iter().map(DnsSource::key);
        dns.chain(self.file.iter().map(FileSource::key)).collect()
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        if self.timeout_ms == 0 {
            bail!("discovery.timeout_ms must be at least 1");
        }
        if self.empty_after == 0 {
            bail!("discovery.empty_after must be at least 1");
        }
        for d in &self.dns {
            if d.name.trim().is_empty() {
                bail!("discovery.dns: a source without a name");
            }
            match (d.record, d.port) {
                (DnsRecord::A, None | Some(0)) => {
                    bail!("discovery.dns {:?}: record = \"a\" needs a port", d.name)
                }
                (DnsRecord::Srv, Some(_)) => bail!(
                    "discovery.dns {:?}: SRV records carry their ports; drop `port`",
                    d.name
                ),
                _ => {}
            }
            if d.interval_ms < MIN_INTERVAL_MS {
                bail!(
                    "discovery.dns {:?}: interval_ms must be at least {MIN_INTERVAL_MS}",
                    d.name
                );
            }
        }
        for f in &self.file {
            if f.path.as_os_str().is_empty() {
                bail!("discovery.file: a source without a path");
            }
            if f.interval_ms < MIN_INTERVAL_MS {
                bail!(
                    "discovery.file {}: interval_ms must be at least {MIN_INTERVAL_MS}",
                    f.path.display()
                );
            }
        }
        let keys = self.keys();
        if let Some(k) = keys
            .iter()
            .enumerate()
            .find_map(|(i, k)| keys[..i].contains(k).then_some(k))
        {
            bail!("discovery: source {k} is listed twice");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> anyhow::Result<DiscoveryConfig> {
        let c: DiscoveryConfig = toml::from_str(text)?;
        c.validate()?;
        Ok(c)
    }

    #[test]
    fn sources_parse_with_defaults() {
        let c = parse(
            "dns_server = \"127.0.0.1:5353\"\n\
             [[dns]]\nname = \"vllm.default.svc.cluster.local\"\nport = 8000\n\
             [[dns]]\nname = \"_http._tcp.vllm\"\nrecord = \"srv\"\ninterval_ms = 2000\n\
             [[file]]\npath = \"/etc/prefix-router/backends.txt\"\n",
        )
        .unwrap();
        assert_eq!(c.dns[0].interval_ms, 5_000);
        assert_eq!(c.dns[1].record, DnsRecord::Srv);
        assert_eq!(c.file[0].interval_ms, 1_000);
        assert_eq!(
            c.keys(),
            [
                "dns:vllm.default.svc.cluster.local:8000",
                "srv:_http._tcp.vllm",
                "file:/etc/prefix-router/backends.txt"
            ]
        );
    }

    #[test]
    fn the_example_config_says_the_defaults_and_its_sources_parse() {
        let text = include_str!("../../prefix-router.example.toml");
        let cfg: crate::config::Config = toml::from_str(text).unwrap();
        assert_eq!(cfg.discovery, DiscoveryConfig::default());
        // The commented sources, uncommented, are valid.
        let sources: String = text
            .lines()
            .skip_while(|l| !l.starts_with("# [[discovery.dns]]"))
            .take_while(|l| !l.starts_with("[admin]"))
            .filter_map(|l| l.strip_prefix("# "))
            .filter(|l| l.starts_with('[') || l.contains(" = "))
            .map(|l| format!("{l}\n"))
            .collect();
        let cfg: crate::config::Config = toml::from_str(&sources).unwrap();
        cfg.validate().unwrap();
        assert_eq!((cfg.discovery.dns.len(), cfg.discovery.file.len()), (2, 1));
    }

    #[test]
    fn bad_sources_are_refused() {
        assert!(
            parse("[[dns]]\nname = \"x\"\n").is_err(),
            "A without a port"
        );
        assert!(parse("[[dns]]\nname = \"x\"\nrecord = \"srv\"\nport = 1\n").is_err());
        assert!(parse("[[dns]]\nname = \"x\"\nport = 1\ninterval_ms = 5\n").is_err());
        assert!(
            parse("[[dns]]\nname = \"x\"\nport = 1\n[[dns]]\nname = \"x\"\nport = 1\n").is_err()
        );
        assert!(parse("[[file]]\npath = \"\"\n").is_err());
        assert!(parse("[[file]]\npath = \"/a\"\nbogus = 1\n").is_err());
        assert!(parse("empty_after = 0\n").is_err());
    }
}
