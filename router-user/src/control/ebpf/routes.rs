//! Which interfaces the backends' packets arrive on: the ones the kernel routes
//! them through. Asked of `ip route get`, once per backend address, at start and
//! when backends change (never on the request path).

use std::net::{IpAddr, SocketAddr};
use std::process::Command;

/// The interfaces the kernel routes `backends` through, without duplicates, in
/// first-seen order. A backend whose route cannot be resolved is left out with a
/// warning: the others still get counters.
pub(crate) fn backend_interfaces(backends: &[SocketAddr]) -> Vec<String> {
    let mut ifaces: Vec<String> = Vec::new();
    let mut seen: Vec<IpAddr> = Vec::new();
    for ip in backends.iter().map(SocketAddr::ip) {
        if seen.contains(&ip) {
            continue;
        }
        seen.push(ip);
        match route_dev(ip) {
            Ok(dev) if !ifaces.contains(&dev) => ifaces.push(dev),
            Ok(_) => {}
            Err(e) => tracing::warn!(%ip, "eBPF: no interface for backend: {e}"),
        }
    }
    ifaces
}

/// `ip -o route get IP` -> the word after `dev` (`lo` for local addresses).
fn route_dev(ip: IpAddr) -> Result<String, String> {
    let out = Command::new("ip")
        .args(["-o", "route", "get", &ip.to_string()])
        .output()
        .map_err(|e| format!("running `ip route get` (iproute2): {e}"))?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).trim().to_owned());
    }
    parse_dev(&String::from_utf8_lossy(&out.stdout))
        .ok_or_else(|| "`ip route get` named no device".to_owned())
}

fn parse_dev(route: &str) -> Option<String> {
    let mut words = route.split_whitespace();
    words.find(|w| *w == "dev")?;
    words.next().map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::parse_dev;

    #[test]
    fn parses_ip_route_get() {
        let local = "local 127.0.0.1 dev lo table local src 127.0.0.1 uid 0 \\    cache <local> ";
        assert_eq!(parse_dev(local).as_deref(), Some("lo"));
        let via = "10.9.0.2 dev veth-c src 10.9.0.1 uid 0 \\    cache ";
        assert_eq!(parse_dev(via).as_deref(), Some("veth-c"));
        assert_eq!(parse_dev("unreachable"), None);
    }
}
