//! `[epp]`: the endpoint-picker front. Envoy (or any Gateway API inference
//! gateway) asks over its external-processing protocol which endpoint
//! takes each request, and the router answers with the same routing core
//! the proxy uses (decision 0055).

use std::net::SocketAddr;

use anyhow::bail;
use serde::Deserialize;

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EppConfig {
    /// Where the gRPC `ExternalProcessor` and health services listen
    /// (`None`: no picker; Kubernetes' convention is port 9002).
    pub listen: Option<SocketAddr>,
    /// Threads of the picker's tokio runtime. Each stream costs a routing
    /// step (microseconds) and a copy of the body back to Envoy, so one or
    /// two keep up with thousands of requests a second.
    pub threads: usize,
    /// Endpoints named after the chosen one, for a gateway whose load
    /// balancer reads a list and tries the next when one fails. 0 (the
    /// default): one endpoint, which is what an `ORIGINAL_DST` cluster
    /// reading the header takes (it cannot parse a list).
    pub fallbacks: usize,
    /// The metadata namespace the picked endpoint is written under (the
    /// protocol's default).
    pub destination_namespace: String,
    /// The request metadata namespace the gateway's subset hint is read from.
    pub subset_namespace: String,
}

/// The protocol's header and metadata key for the picked endpoint(s).
pub const DESTINATION_KEY: &str = "x-gateway-destination-endpoint";
/// The metadata key of the endpoints the gateway allows (the subset hint).
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// The metadata key of the endpoint that served, in the response metadata.
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";

impl Default for EppConfig {
    fn default() -> Self {
        EppConfig {
            listen: None,
            threads: 2,
            fallbacks: 0,
            destination_namespace: "envoy.lb".into(),
            subset_namespace: "envoy.lb.subset_hint".into(),
        }
    }
}

impl EppConfig {
    pub fn validate(&self) -> anyhow::Result<()> {
        if !(1..=64).contains(&self.threads) {
            bail!("epp.threads must be between 1 and 64");
        }
        if self.fallbacks > 3 {
            bail!("epp.fallbacks must be at most 3 (a choice ranks at most 4 backends)");
        }
        if self.destination_namespace.is_empty() || self.subset_namespace.is_empty() {
            bail!("epp.destination_namespace and epp.subset_namespace must not be empty");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn the_example_s_picker_is_the_default_and_bad_values_are_refused() {
        let cfg: Config =
            toml::from_str(include_str!("../../prefix-router.example.toml")).expect("example");
        let (e, d) = (&cfg.epp, EppConfig::default());
        assert_eq!(e.listen, None, "off unless set");
        assert_eq!((e.threads, e.fallbacks), (d.threads, d.fallbacks));
        assert_eq!(e.destination_namespace, "envoy.lb");
        assert_eq!(e.subset_namespace, "envoy.lb.subset_hint");
        for bad in [
            "threads = 0",
            "fallbacks = 4",
            "destination_namespace = \"\"",
        ] {
            let text = format!("backends = [\"http://127.0.0.1:1\"]\n[epp]\n{bad}\n");
            let cfg: Config = toml::from_str(&text).expect("parses");
            let err = cfg.validate().expect_err(bad).to_string();
            assert!(err.contains("epp."), "{bad}: {err}");
        }
    }
}
