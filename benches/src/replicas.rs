//! Several router processes in front of one fleet, as production runs a
//! gateway: N replicas behind an L4 balancer or a Kubernetes Service, each
//! request going to one of them at random (the load generator's
//! `RunConfig::replicas`). What a quality run needs to start them:
//! each prefix-router replica's pair of loopback ports and its `[replicas]`
//! section (the replicas share what they learn), and the front names that
//! run them without sharing.

use std::net::{SocketAddr, TcpListener};

/// The key the bench's replicas authenticate their messages with (the
/// router asks for 16 bytes at least).
pub const SHARED_KEY: &str = "bench-shared-key";

/// A front name ending so runs N prefix-router replicas that share
/// nothing (no `[replicas]` section): each knows only what it sent itself.
/// Without it, N > 1 replicas share.
pub const ALONE_SUFFIX: &str = "@alone";

/// The front that shares, for one that runs alone (`prefix@alone+x.toml`
/// gives `prefix+x.toml`); `None` for a front without [`ALONE_SUFFIX`].
pub fn shared_name(front: &str) -> Option<String> {
    let (name, config) = match front.split_once('+') {
        Some((n, c)) => (n, Some(c)),
        None => (front, None),
    };
    let base = name.strip_suffix(ALONE_SUFFIX)?;
    Some(match config {
        Some(c) => format!("{base}+{c}"),
        None => base.to_string(),
    })
}

/// Tries to find `n` replicas' stream addresses on 127.0.0.1 before giving up.
const PORT_TRIES: usize = 200;

/// `n` stream addresses on 127.0.0.1, one per replica, each port free
/// with the next one (a replica serves catch-up snapshots there), no two
/// pairs overlapping. A port found free may still be taken before the
/// replica binds it: the caller starts again on fresh ports then.
pub fn listen_addrs(n: usize) -> anyhow::Result<Vec<SocketAddr>> {
    let mut out: Vec<SocketAddr> = Vec::with_capacity(n);
    for _ in 0..PORT_TRIES {
        if out.len() == n {
            break;
        }
        let p = testkit::proc::free_port();
        let taken = |q: u16| out.iter().any(|a| a.port() == q || a.port() + 1 == q);
        if p == u16::MAX || taken(p) || taken(p + 1) {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            out.push(SocketAddr::from(([127, 0, 0, 1], p)));
        }
    }
    anyhow::ensure!(
        out.len() == n,
        "found {} of {n} free port pairs on 127.0.0.1",
        out.len()
    );
    Ok(out)
}

/// The `[replicas]` section of the replica listening on `me`, every
/// replica (itself included: it skips itself) its peer.
pub fn section(me: SocketAddr, all: &[SocketAddr]) -> String {
    let peers: Vec<String> = all.iter().map(|a| format!("\"{a}\"")).collect();
    format!(
        "\n[replicas]\nlisten = \"{me}\"\npeers = [{}]\nkey = \"{SHARED_KEY}\"\n",
        peers.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_replica_has_its_own_pair_of_ports() {
        let addrs = listen_addrs(4).unwrap();
        let mut ports: Vec<u16> = addrs
            .iter()
            .flat_map(|a| [a.port(), a.port() + 1])
            .collect();
        assert!(addrs.iter().all(|a| a.ip().is_loopback()));
        ports.sort_unstable();
        ports.dedup();
        assert_eq!(ports.len(), 8, "{addrs:?}");
    }

    #[test]
    fn a_section_names_this_replica_and_every_peer() {
        let all: Vec<SocketAddr> = ["127.0.0.1:7100", "127.0.0.1:7102"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        let text = section(all[1], &all);
        let v: toml::Value = toml::from_str(&text).unwrap();
        let r = &v["replicas"];
        assert_eq!(r["listen"].as_str(), Some("127.0.0.1:7102"));
        let peers: Vec<&str> = r["peers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_str().unwrap())
            .collect();
        assert_eq!(peers, ["127.0.0.1:7100", "127.0.0.1:7102"]);
        assert!(r["key"].as_str().unwrap().len() >= 16);
    }

    #[test]
    fn an_alone_front_names_the_front_that_shares() {
        assert_eq!(shared_name("prefix@alone").as_deref(), Some("prefix"));
        assert_eq!(
            shared_name("prefix@precise@alone+t.toml").as_deref(),
            Some("prefix@precise+t.toml")
        );
        assert_eq!(shared_name("prefix"), None);
        assert_eq!(shared_name("sglang-router"), None);
    }
}
