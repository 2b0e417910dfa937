//! Discovery: backends from DNS names (`dns`) and files (`file`) besides
//! the static list. One thread polls every source at its interval, on a
//! small tokio runtime of its own (the resolver is async), never on a
//! worker; each resolution or file read is bounded by
//! `discovery.timeout_ms`, and DNS sources due together resolve
//! concurrently, so a dead server or file system delays no other source by
//! more than that.
//!
//! Each source keeps its last good list. A failure (DNS error or timeout,
//! an unreadable or wholly malformed file) keeps it, logged once per change
//! of the error; an empty answer (NXDOMAIN, no records, a file without
//! backends) replaces it only when it repeats `discovery.empty_after` times
//! in a row. A changed list goes to `membership`, the path reloads take:
//! new backends are probed before they get traffic, removed ones drained
//! once the new ones took over (`Membership::settle`, every tick).

mod dns;
mod file;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use futures::future::join_all;
use hickory_resolver::TokioResolver;
use tracing::{error, info, warn};

use crate::config::discovery::DiscoveryConfig;
use crate::config::ms;
use crate::control::membership::Membership;
use crate::shared::Router;

/// Longest sleep between two looks at the configuration: a reload that
/// adds a source is seen within this.
const TICK: Duration = Duration::from_millis(250);

/// What one poll of a source found.
#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    /// These backends (`http://host:port`), in the source's order: a
    /// file's lines, DNS answers sorted.
    Found(Vec<String>),
    /// None: NXDOMAIN, no records, a file without backend lines.
    Empty,
    /// Nothing usable: the error.
    Failed(String),
}

/// What a source remembers between polls.
#[derive(Debug, Default)]
struct Source {
    next_due: Option<Instant>,
    /// The list the fleet holds from it (`None` before its first answer).
    good: Option<Vec<String>>,
    empty_in_row: u32,
    /// The error last logged, so a failure repeating is logged once.
    error: Option<String>,
    file: file::FileState,
}

/// What [`observe`] says the caller should log.
#[derive(Debug, PartialEq)]
enum Note {
    None,
    /// The list changed.
    Changed,
    /// A new error (or a different one): keeping the last good list.
    Failed,
    /// It answers again after errors.
    Recovered,
    /// The first empty answer of a run: the list is kept until it repeats.
    EmptyHeld,
}

/// Applies one answer to a source's state: the list to swap in, if it
/// changed, and what to log.
fn observe(s: &mut Source, answer: Answer, empty_after: u32) -> (Option<Vec<String>>, Note) {
    let list = match answer {
        Answer::Failed(e) => {
            if s.error.as_ref() == Some(&e) {
                return (None, Note::None);
            }
            s.error = Some(e);
            return (None, Note::Failed);
        }
        Answer::Empty => {
            // An answer: a later failure is news again.
            let recovered = s.error.take().is_some();
            s.empty_in_row += 1;
            let held = s.good.as_ref().is_some_and(|g| !g.is_empty());
            if held && s.empty_in_row < empty_after {
                let note = match (s.empty_in_row, recovered) {
                    (1, _) => Note::EmptyHeld,
                    (_, true) => Note::Recovered,
                    _ => Note::None,
                };
                return (None, note);
            }
            (Vec::new(), recovered)
        }
        Answer::Found(list) => {
            s.empty_in_row = 0;
            (list, s.error.take().is_some())
        }
    };
    let (list, recovered) = list;
    if s.good.as_ref() == Some(&list) {
        let note = if recovered {
            Note::Recovered
        } else {
            Note::None
        };
        return (None, note);
    }
    s.good = Some(list.clone());
    (Some(list), Note::Changed)
}

/// Starts the discovery thread. It idles while no source is configured
/// (a reload may add some).
pub fn spawn(
    router: Arc<Router>,
    membership: Arc<Membership>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name("discovery".into())
        .spawn(move || run(&router, &membership, &rt))
}

fn run(router: &Router, membership: &Membership, rt: &tokio::runtime::Runtime) {
    let mut sources: BTreeMap<String, Source> = BTreeMap::new();
    // The resolver and the settings it was built with.
    let mut resolver: Option<(
        Option<std::net::SocketAddr>,
        u64,
        Result<TokioResolver, String>,
    )> = None;
    loop {
        let cfg = router.config.load_full();
        let d = &cfg.discovery;
        let keys = d.keys();
        sources.retain(|k, _| keys.contains(k));
        // A reload may have dropped a source while it was being polled.
        router.metrics.discovery.retain(&keys);
        let now = Instant::now();
        let due = |s: Option<&Source>| s.and_then(|s| s.next_due).is_none_or(|t| t <= now);
        let dns_due: Vec<_> = d
            .dns
            .iter()
            .filter(|x| due(sources.get(&x.key())))
            .collect();
        if !dns_due.is_empty() {
            // Built again when its settings changed, or when building it
            // failed (an /etc/resolv.conf that was unreadable may be back).
            let fresh = matches!(&resolver, Some((srv, t, Ok(_))) if *srv == d.dns_server && *t == d.timeout_ms);
            if !fresh {
                let r = dns::resolver(d.dns_server, ms(d.timeout_ms));
                resolver = Some((d.dns_server, d.timeout_ms, r));
            }
            let answers = match resolver.as_ref().map(|r| &r.2) {
                Some(Ok(r)) => rt.block_on(join_all(dns_due.iter().map(|src| async move {
                    tokio::time::timeout(ms(d.timeout_ms), dns::resolve(r, src))
                        .await
                        .unwrap_or_else(|_| {
                            Answer::Failed(format!("no answer within {} ms", d.timeout_ms))
                        })
                }))),
                Some(Err(e)) => vec![Answer::Failed(e.clone()); dns_due.len()],
                None => Vec::new(),
            };
            for (src, answer) in dns_due.iter().zip(answers) {
                handle(
                    router,
                    membership,
                    d,
                    &mut sources,
                    &src.key(),
                    answer,
                    src.interval_ms,
                );
            }
        }
        for f in &d.file {
            let key = f.key();
            if !due(sources.get(&key)) {
                continue;
            }
            let state = &mut sources.entry(key.clone()).or_default().file;
            let answer = file::read(&f.path, state, ms(d.timeout_ms));
            handle(
                router,
                membership,
                d,
                &mut sources,
                &key,
                answer,
                f.interval_ms,
            );
        }
        membership.settle(router);
        let next = sources.values().filter_map(|s| s.next_due).min();
        let sleep = next.map_or(TICK, |t| {
            t.saturating_duration_since(Instant::now()).min(TICK)
        });
        std::thread::sleep(sleep);
    }
}

/// One answer of source `key`: state, logs, metrics, and the fleet when
/// its list changed.
fn handle(
    router: &Router,
    membership: &Membership,
    d: &DiscoveryConfig,
    sources: &mut BTreeMap<String, Source>,
    key: &str,
    answer: Answer,
    interval_ms: u64,
) {
    let s = sources.entry(key.to_owned()).or_default();
    s.next_due = Some(Instant::now() + ms(interval_ms));
    let failed = match &answer {
        Answer::Failed(e) => Some(e.clone()),
        _ => None,
    };
    let (list, note) = observe(s, answer, d.empty_after);
    let kept = s.good.as_ref().map_or(0, Vec::len);
    match (&note, &failed) {
        (Note::Failed, Some(e)) => {
            error!(source = key, error = %e, backends = kept, "discovery failed; keeping its last good backends")
        }
        (Note::Recovered, _) => info!(source = key, backends = kept, "discovery answers again"),
        (Note::EmptyHeld, _) => warn!(
            source = key,
            backends = kept,
            repeats = d.empty_after,
            "discovery found no backends; keeping the last ones until that repeats"
        ),
        _ => {}
    }
    let now = unix_now();
    let empty_in_row = s.empty_in_row;
    router.metrics.discovery.update(key, |st| {
        st.failing = failed.is_some();
        st.empty_in_row = empty_in_row;
        match &failed {
            Some(e) => {
                st.errors += 1;
                st.last_error = Some(e.clone());
                st.last_error_unix = Some(now);
            }
            None => st.last_success_unix = Some(now),
        }
        st.backends = kept;
    });
    if let Some(list) = list {
        if note == Note::Changed {
            info!(
                source = key,
                backends = list.len(),
                "discovery: the source's backends changed"
            );
        }
        membership.set_source(router, key, list);
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(urls: &[&str]) -> Answer {
        Answer::Found(urls.iter().map(|u| u.to_string()).collect())
    }

    #[test]
    fn changes_apply_once_and_failures_keep_the_list() {
        let mut s = Source::default();
        let (l, n) = observe(&mut s, found(&["http://a:1"]), 3);
        assert_eq!((l.unwrap().len(), n), (1, Note::Changed));
        assert_eq!(
            observe(&mut s, found(&["http://a:1"]), 3),
            (None, Note::None)
        );
        // An error is logged once while it repeats, again when it changes.
        let err = |e: &str| Answer::Failed(e.into());
        assert_eq!(observe(&mut s, err("timeout"), 3), (None, Note::Failed));
        assert_eq!(observe(&mut s, err("timeout"), 3), (None, Note::None));
        assert_eq!(observe(&mut s, err("SERVFAIL"), 3), (None, Note::Failed));
        assert_eq!(
            s.good.as_ref().unwrap().len(),
            1,
            "the last good list stays"
        );
        assert_eq!(
            observe(&mut s, found(&["http://a:1"]), 3),
            (None, Note::Recovered)
        );
        let (l, n) = observe(&mut s, found(&["http://a:1", "http://b:1"]), 3);
        assert_eq!((l.unwrap().len(), n), (2, Note::Changed));
    }

    #[test]
    fn empty_answers_remove_only_when_they_repeat() {
        let mut s = Source::default();
        observe(&mut s, found(&["http://a:1"]), 3);
        assert_eq!(observe(&mut s, Answer::Empty, 3), (None, Note::EmptyHeld));
        assert_eq!(observe(&mut s, Answer::Empty, 3), (None, Note::None));
        // A good answer in between starts the count again.
        observe(&mut s, found(&["http://a:1"]), 3);
        assert_eq!(observe(&mut s, Answer::Empty, 3), (None, Note::EmptyHeld));
        assert_eq!(observe(&mut s, Answer::Empty, 3), (None, Note::None));
        assert_eq!(
            observe(&mut s, Answer::Empty, 3),
            (Some(vec![]), Note::Changed)
        );
        assert_eq!(observe(&mut s, Answer::Empty, 3), (None, Note::None));
        // A source empty from the start holds nothing to keep.
        let mut fresh = Source::default();
        assert_eq!(
            observe(&mut fresh, Answer::Empty, 3),
            (Some(vec![]), Note::Changed)
        );
    }
}
