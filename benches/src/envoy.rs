//! Envoy in the benches: in front of the engines round-robin (the
//! gateway without a picker), or with prefix-router as its endpoint picker
//! (`deploy/envoy.yaml` as the e2e tests run it, through
//! `testkit::envoy_proc::bootstrap`). The binary is the one `cargo xtask
//! setup` installs (`testkit::envoy_proc::binary`).

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;

use anyhow::Context;

use crate::fleet::Child;

/// `prefix-bench quality` front: Envoy round-robin over the engines.
pub const ROUND_ROBIN: &str = "envoy-round-robin";
/// A policy name ending so runs behind Envoy, the router as its picker.
pub const PICKER_SUFFIX: &str = "@envoy";

/// A running Envoy, stopped on drop; its bootstrap removed.
pub struct Envoy {
    pub addr: SocketAddr,
    pub child: Child,
    config: PathBuf,
}

impl Envoy {
    /// Envoy with prefix-router's picker on 127.0.0.1:`epp_port`;
    /// requests without a pick (never, while the picker is up) would go to
    /// `fail_open`.
    pub fn with_picker(
        epp_port: u16,
        fail_open: SocketAddr,
        threads: usize,
    ) -> anyhow::Result<Envoy> {
        let addr = local(testkit::proc::free_port())?;
        let admin = local(testkit::proc::free_port())?;
        let text = testkit::envoy_proc::bootstrap(
            addr,
            admin,
            epp_port,
            &fail_open.to_string(),
            &testkit::envoy_proc::Options::default(),
        );
        Envoy::start(addr, &text, threads)
    }

    /// Envoy round-robin over `engines`, nothing else in the path.
    pub fn round_robin(engines: &[SocketAddr], threads: usize) -> anyhow::Result<Envoy> {
        let addr = local(testkit::proc::free_port())?;
        let admin = local(testkit::proc::free_port())?;
        let mut hosts = String::new();
        for e in engines {
            writeln!(
                hosts,
                "        - endpoint: {{address: {{socket_address: {{address: {}, port_value: {}}}}}}}",
                e.ip(),
                e.port()
            )?;
        }
        let text = format!(
            r#"admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin_port}}}}}
static_resources:
  listeners:
  - name: inference
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: inference
          stream_idle_timeout: 300s
          route_config:
            virtual_hosts:
            - name: inference
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: engines, timeout: 300s}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: engines
    type: STATIC
    lb_policy: ROUND_ROBIN
    connect_timeout: 2s
    load_assignment:
      cluster_name: engines
      endpoints:
      - lb_endpoints:
{hosts}"#,
            admin_port = admin.port(),
            port = addr.port(),
        );
        Envoy::start(addr, &text, threads)
    }

    fn start(addr: SocketAddr, bootstrap: &str, threads: usize) -> anyhow::Result<Envoy> {
        let bin = testkit::envoy_proc::binary().map_err(anyhow::Error::msg)?;
        let config = std::env::temp_dir().join(format!(
            "prefix-bench-envoy-{}-{}.yaml",
            std::process::id(),
            addr.port()
        ));
        std::fs::write(&config, bootstrap).with_context(|| format!("{}", config.display()))?;
        let mut cmd = Command::new(bin);
        cmd.arg("-c")
            .arg(&config)
            .args(["--concurrency", &threads.max(1).to_string()])
            .args(["--log-level", "error", "--disable-hot-restart"]);
        let mut child = Child::spawn(cmd, "envoy")?;
        child.wait_port(addr)?;
        Ok(Envoy {
            addr,
            child,
            config,
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.config);
    }
}

fn local(port: u16) -> anyhow::Result<SocketAddr> {
    Ok(format!("127.0.0.1:{port}").parse()?)
}
