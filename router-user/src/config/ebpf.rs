//! `[ebpf]` configuration: whether to load the XDP counters, where, and how.

use serde::Deserialize;

/// Whether the router loads its XDP program.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum EbpfMode {
    /// Load when possible; otherwise warn once and run without the eBPF signal
    /// (not root, a build without the object, an interface refusing XDP).
    #[default]
    Auto,
    /// Refuse to start unless the program loads and attaches everywhere.
    Required,
    /// Never load.
    Off,
}

/// How the program attaches to an interface.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum XdpMode {
    /// Native (driver) XDP, falling back to TC ingress where the driver has
    /// no XDP support (`lo` for one), then to generic XDP.
    #[default]
    Auto,
    /// Native (driver) mode only: fastest; veth and most NIC drivers support it.
    Native,
    /// Generic (SKB) XDP only: works on any interface, but the kernel copies
    /// every packet it sees whole first (decision 0003, TC ingress
    /// where XDP would be generic).
    Skb,
    /// TC ingress only (a classifier on `tcx`, or on a `clsact` qdisc before
    /// kernel 6.6): works on any interface and copies nothing.
    Tc,
}

/// The `[ebpf]` section.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct EbpfConfig {
    /// Default `auto`.
    pub mode: EbpfMode,
    /// Interfaces to attach to. Empty (the default): the interfaces the kernel
    /// routes the backends through (`ip route get <backend>`; `lo` for local
    /// backends), resolved at start and again when backends are added.
    pub interfaces: Vec<String>,
    /// Default `auto`.
    pub xdp_mode: XdpMode,
    /// How often the router reads the counters into its load view, in ms.
    /// 100 ms follows a burst of connections within a tenth of a second at
    /// about 10 us per read for 4 backends (one map lookup each).
    pub refresh_ms: u64,
    /// Resets per second from one backend that count as a failed request
    /// toward passive ejection, each refresh they are seen (0: never). A
    /// backend resetting connections is sick before its health probe says so.
    pub reset_failure_per_sec: u32,
}

impl Default for EbpfConfig {
    fn default() -> Self {
        EbpfConfig {
            mode: EbpfMode::default(),
            interfaces: Vec::new(),
            xdp_mode: XdpMode::default(),
            refresh_ms: 100,
            reset_failure_per_sec: 20,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_lowercase_names() {
        let c: EbpfConfig = toml::from_str("").unwrap();
        assert_eq!(c, EbpfConfig::default());
        assert_eq!(c.mode, EbpfMode::Auto);
        let c: EbpfConfig =
            toml::from_str("mode = \"required\"\ninterfaces = [\"veth0\"]\nxdp_mode = \"skb\"")
                .unwrap();
        assert_eq!(c.mode, EbpfMode::Required);
        assert_eq!(c.interfaces, ["veth0"]);
        assert_eq!(c.xdp_mode, XdpMode::Skb);
        assert!(toml::from_str::<EbpfConfig>("mode = \"Auto\"").is_err());
    }
}
