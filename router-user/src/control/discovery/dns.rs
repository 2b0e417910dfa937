//! DNS sources: A/AAAA records on a configured port, or SRV records (each
//! target's addresses on the record's port), through `hickory-resolver` on
//! the discovery thread's tokio runtime. Answers are never cached here: each
//! poll asks the server again, whatever the records' TTL.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use futures::future::join_all;
use hickory_resolver::config::{
    ConnectionConfig, LookupIpStrategy, NameServerConfig, ResolverConfig,
};
use hickory_resolver::net::NetError;
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::proto::rr::RData;
use hickory_resolver::{Resolver, TokioResolver};

use super::Answer;
use crate::config::discovery::{DnsRecord, DnsSource};

/// Tries per query to each server: one retry covers a lost UDP datagram
/// within the source's deadline (`discovery.timeout_ms` bounds it all).
const ATTEMPTS: usize = 2;

/// A resolver asking `server`, or the system's servers (`/etc/resolv.conf`,
/// with its search domains and `ndots`) when `None`. Each query waits at
/// most `timeout`.
pub fn resolver(server: Option<SocketAddr>, timeout: Duration) -> Result<TokioResolver, String> {
    let mut builder = match server {
        Some(addr) => {
            let mut udp = ConnectionConfig::udp();
            udp.port = addr.port();
            let mut tcp = ConnectionConfig::tcp();
            tcp.port = addr.port();
            let ns = NameServerConfig::new(addr.ip(), true, vec![udp, tcp]);
            Resolver::builder_with_config(
                ResolverConfig::from_name_servers(vec![ns]),
                TokioRuntimeProvider::default(),
            )
        }
        None => Resolver::builder_tokio().map_err(|e| format!("reading /etc/resolv.conf: {e}"))?,
    };
    let opts = builder.options_mut();
    opts.timeout = timeout;
    opts.attempts = ATTEMPTS;
    // Every poll must see the records as they are now.
    opts.cache_size = 0;
    opts.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
    builder.build().map_err(|e| format!("DNS resolver: {e}"))
}

/// Resolves `src` once: its backends as `http://ip:port`, sorted.
/// NXDOMAIN and "no records" are an empty answer, anything else an error.
pub async fn resolve(resolver: &TokioResolver, src: &DnsSource) -> Answer {
    let targets: Vec<(String, u16)> = match (src.record, src.port) {
        (DnsRecord::A, Some(port)) => vec![(src.name.clone(), port)],
        _ => match resolver.srv_lookup(src.name.as_str()).await {
            Ok(lookup) => lookup
                .answers()
                .iter()
                .filter_map(|r| match &r.data {
                    RData::SRV(srv) => Some((srv.target.to_ascii(), srv.port)),
                    _ => None,
                })
                .collect(),
            Err(e) => return failure(e),
        },
    };
    if targets.is_empty() {
        return Answer::Empty;
    }
    let lookups = join_all(
        targets
            .iter()
            .map(|(host, _)| resolver.lookup_ip(host.as_str())),
    )
    .await;
    let mut urls = Vec::new();
    let mut first_error = None;
    for ((host, port), lookup) in targets.iter().zip(lookups) {
        match lookup {
            Ok(ips) => urls.extend(ips.iter().map(|ip| url(ip, *port))),
            Err(e) if empty(&e) => {}
            Err(e) => {
                first_error.get_or_insert(format!("{host}: {e}"));
            }
        }
    }
    // One SRV target that failed to resolve while others answered: the
    // answer is partial, and keeping the last good list is safer than
    // dropping that target's backends.
    if let Some(e) = first_error {
        return Answer::Failed(e);
    }
    urls.sort();
    urls.dedup();
    if urls.is_empty() {
        Answer::Empty
    } else {
        Answer::Found(urls)
    }
}

/// The backend URL of `ip` on `port` (IPv6 in brackets).
pub fn url(ip: IpAddr, port: u16) -> String {
    format!("http://{}", SocketAddr::new(ip, port))
}

/// The name exists with no such records, or does not exist.
fn empty(e: &NetError) -> bool {
    e.is_nx_domain() || e.is_no_records_found()
}

fn failure(e: NetError) -> Answer {
    if empty(&e) {
        Answer::Empty
    } else {
        Answer::Failed(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_bracket_v6() {
        assert_eq!(
            url("10.0.0.7".parse().unwrap(), 8000),
            "http://10.0.0.7:8000"
        );
        assert_eq!(
            url("fd00::7".parse().unwrap(), 8000),
            "http://[fd00::7]:8000"
        );
    }
}
