//! Who is in the fleet: the static `backends` of the running configuration
//! plus every discovery source's last good list, and the one function that
//! swaps a new backend list in (`set_backends`), used by reloads and by
//! discovery alike. Writers take `Membership`'s lock, so a reload and a
//! discovery change never interleave their read-modify-swap of the fleet.
//!
//! Swapping a list in: backends that stay keep their slot, counters,
//! pooled connections and index share; new ones take free slots (with a new
//! generation, so no pooled connection or counter of a previous owner
//! carries over) and start unproven, taking no traffic until a health probe
//! passes; removed ones are drained: no new request is routed to them,
//! their in-flight requests finish (they hold an `Arc` to the backend), and
//! they lose their index entries and their pooled connections.
//!
//! A source's change is handed over, not cut: the healthy backends it no
//! longer lists keep serving until as many of the backends it lists that
//! were never probed (new ones) passed a probe (at most as many as it
//! dropped), or [`HANDOVER_LIMIT`] passed. A removal alone, or a listed
//! backend that already failed its probes, holds nothing up. Swapping a source's whole list at once thus
//! never leaves a moment with no backend to serve. The discovery thread
//! ends handovers (`Membership::settle`) at its every tick.
//!
//! Past `fleet::MAX_BACKENDS`, the static list comes first, then the
//! sources' backends that are healthy now, then the others, each in its
//! source's order (the order of a file's lines; DNS answers sorted): a
//! healthy backend is never left out for one not proven. Those left out
//! are counted per source (`/admin/backends`, `/metrics`) and logged once
//! per change.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tracing::{error, info, warn};

use crate::config::{BackendConfig, Config, backend_addr};
use crate::fleet::MAX_BACKENDS;
use crate::fleet::backend::{Backend, Fleet, Health};
use crate::fleet::owners::BackendSet;
use crate::shared::Router;

/// Longest a source's dropped backends keep serving while its new ones
/// wait for a passing probe. A new backend passes its first probe within
/// one `health.interval_ms` (1 s by default) of joining; this bounds the
/// wait for new backends that never pass (a list of dead addresses), so a
/// source's removals take effect within it whatever the new ones do.
pub const HANDOVER_LIMIT: Duration = Duration::from_secs(30);

/// Left-out URLs named per source in `/admin/backends` and the log: enough
/// to find the file or record, not a second copy of a 5,000-line list.
const LEFT_OUT_NAMED: usize = 8;

/// The healthy backends a source no longer lists, serving until its new
/// ones take over.
#[derive(Debug)]
struct Handover {
    leaving: Vec<String>,
    /// The listed backends never probed when it began (new ones; after a
    /// second change before the first was handed over, also those the
    /// first waited for that are still listed).
    waiting: Vec<String>,
    /// Backends of `waiting` that must be healthy to end the handover.
    target: usize,
    /// When it ends anyway ([`HANDOVER_LIMIT`] after it began).
    until: Instant,
}

#[derive(Debug, Default)]
struct Inner {
    /// Each source's last good list, in its order, by source key.
    discovered: BTreeMap<String, Vec<String>>,
    handovers: BTreeMap<String, Handover>,
    /// The backends last left out past `MAX_BACKENDS`, to log a change once.
    left_out: Vec<String>,
}

/// The discovery sources' last good lists and handovers, by source key.
#[derive(Debug, Default)]
pub struct Membership {
    inner: Mutex<Inner>,
}

impl Membership {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A reload: `new` (validated) becomes the running configuration, its
    /// static list joined with what the sources it still names found.
    pub fn apply_config(&self, router: &Router, new: Config) {
        let mut inner = self.lock();
        let keys = new.discovery.keys();
        inner.discovered.retain(|k, _| keys.contains(k));
        inner.handovers.retain(|k, _| keys.contains(k));
        router.metrics.discovery.retain(&keys);
        let list = wanted(router, &new, &mut inner);
        let fleet = set_backends(router, &new, &list);
        router.config.store(Arc::new(new));
        router.fleet.store(Arc::new(fleet));
        router.sync_subscribers();
    }

    /// A discovery source's list changed to `urls` (each `http://ip:port`,
    /// in the source's order). Ignored when a reload dropped the source
    /// meanwhile. The healthy backends it drops keep serving until its
    /// list has taken over (see the module's doc).
    pub fn set_source(&self, router: &Router, source: &str, urls: Vec<String>) {
        let mut inner = self.lock();
        let cfg = router.config.load_full();
        if !cfg.discovery.keys().iter().any(|k| k == source) {
            return;
        }
        let fleet = router.fleet.load_full();
        let by_url: HashMap<&str, &Arc<Backend>> =
            fleet.backends.iter().map(|b| (b.url.as_str(), b)).collect();
        let healthy = |u: &String| {
            by_url
                .get(u.as_str())
                .is_some_and(|b| b.health.is_healthy())
        };
        let never_probed = |u: &String| {
            by_url
                .get(u.as_str())
                .is_none_or(|b| b.stats.probes() == (0, 0))
        };
        let before = inner.handovers.remove(source);
        let listed: HashSet<&String> = urls.iter().collect();
        let was_waiting: HashSet<&String> = before.iter().flat_map(|h| h.waiting.iter()).collect();
        // What it listed before, and what it still handed over, in order.
        let mut seen = HashSet::new();
        let leaving: Vec<String> = inner
            .discovered
            .get(source)
            .into_iter()
            .flatten()
            .chain(before.iter().flat_map(|h| h.leaving.iter()))
            .filter(|u| seen.insert(*u) && !listed.contains(u) && healthy(u))
            .cloned()
            .collect();
        let waiting: Vec<String> = urls
            .iter()
            .filter(|u| never_probed(u) || was_waiting.contains(u))
            .cloned()
            .collect();
        let target = leaving.len().min(waiting.len());
        let ready = waiting.iter().filter(|u| healthy(u)).count();
        if cfg.health.interval_ms > 0 && ready < target {
            info!(
                source,
                leaving = leaving.len(),
                ready,
                target,
                "the source's list changed: the backends it dropped serve until its new ones pass a probe"
            );
            let until = before
                .as_ref()
                .map_or_else(|| Instant::now() + HANDOVER_LIMIT, |h| h.until);
            inner.handovers.insert(
                source.to_owned(),
                Handover {
                    leaving,
                    waiting,
                    target,
                    until,
                },
            );
        }
        inner.discovered.insert(source.to_owned(), urls);
        let list = wanted(router, &cfg, &mut inner);
        let fleet = set_backends(router, &cfg, &list);
        router.fleet.store(Arc::new(fleet));
        router.sync_subscribers();
    }

    /// Ends the handovers whose sources' new backends passed enough probes,
    /// or that reached [`HANDOVER_LIMIT`]: their dropped backends leave.
    pub fn settle(&self, router: &Router) {
        let mut inner = self.lock();
        if inner.handovers.is_empty() {
            return;
        }
        let fleet = router.fleet.load_full();
        let now = Instant::now();
        let healthy: HashSet<&str> = fleet
            .backends
            .iter()
            .filter(|b| b.health.is_healthy())
            .map(|b| b.url.as_str())
            .collect();
        let handovers = &mut inner.handovers;
        let before = handovers.len();
        handovers.retain(|source, h| {
            let ready = h
                .waiting
                .iter()
                .filter(|u| healthy.contains(u.as_str()))
                .count();
            let done = ready >= h.target;
            if done || now >= h.until {
                info!(
                    source = source.as_str(),
                    leaving = h.leaving.len(),
                    ready,
                    target = h.target,
                    timed_out = !done,
                    "handover done: the backends the source dropped leave"
                );
                return false;
            }
            true
        });
        if handovers.len() == before {
            return;
        }
        let cfg = router.config.load_full();
        let list = wanted(router, &cfg, &mut inner);
        let fleet = set_backends(router, &cfg, &list);
        router.fleet.store(Arc::new(fleet));
        router.sync_subscribers();
    }
}

/// The fleet's list: the static backends, then each source's (in the
/// config's order, each in its own order, then the backends its handover
/// keeps) not already listed, up to `MAX_BACKENDS`. Past it the healthy
/// ones are kept first (see the module's doc); what is left out is
/// counted per source and logged when it changed.
fn wanted(router: &Router, cfg: &Config, inner: &mut Inner) -> Vec<BackendConfig> {
    let mut list = cfg.backends.clone();
    let mut seen: HashSet<&str> = cfg.backends.iter().map(BackendConfig::url).collect();
    let keys = cfg.discovery.keys();
    // (source's index in `keys`, URL), in order.
    let mut found: Vec<(usize, &str)> = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        let listed = inner.discovered.get(key).into_iter().flatten();
        let leaving = inner
            .handovers
            .get(key)
            .into_iter()
            .flat_map(|h| &h.leaving);
        for url in listed.chain(leaving) {
            if seen.insert(url) {
                found.push((i, url));
            }
        }
    }
    let room = MAX_BACKENDS.saturating_sub(list.len());
    let mut keep = vec![found.len() <= room; found.len()];
    if found.len() > room {
        let fleet = router.fleet.load();
        let healthy: HashSet<&str> = fleet
            .backends
            .iter()
            .filter(|b| b.health.is_healthy())
            .map(|b| b.url.as_str())
            .collect();
        let mut left = room;
        for pass_healthy in [true, false] {
            for (k, (_, url)) in keep.iter_mut().zip(&found) {
                if left > 0 && !*k && (!pass_healthy || healthy.contains(url)) {
                    *k = true;
                    left -= 1;
                }
            }
        }
    }
    let mut left_out: Vec<Vec<&str>> = vec![Vec::new(); keys.len()];
    for (k, (i, url)) in keep.iter().zip(&found) {
        if *k {
            list.push(BackendConfig::Url((*url).to_owned()));
        } else {
            left_out[*i].push(url);
        }
    }
    for (key, out) in keys.iter().zip(&left_out) {
        let handing_over = inner.handovers.get(key).map_or(0, |h| h.leaving.len());
        if out.is_empty() && handing_over == 0 && !router.metrics.discovery.has(key) {
            continue;
        }
        router.metrics.discovery.update(key, |st| {
            st.handing_over = handing_over;
            st.left_out = out.len();
            st.left_out_first = out
                .iter()
                .take(LEFT_OUT_NAMED)
                .map(|u| u.to_string())
                .collect();
        });
    }
    let all: Vec<String> = left_out.iter().flatten().map(|u| u.to_string()).collect();
    if all != inner.left_out {
        for (key, out) in keys.iter().zip(&left_out) {
            if !out.is_empty() {
                let first = &out[..out.len().min(LEFT_OUT_NAMED)];
                error!(
                    source = key.as_str(),
                    left_out = out.len(),
                    first = ?first,
                    "discovered backends left out: the fleet holds at most {MAX_BACKENDS}"
                );
            }
        }
        if all.is_empty() && !inner.left_out.is_empty() {
            info!("every discovered backend is in the fleet again");
        }
        inner.left_out = all;
    }
    list
}

/// The fleet `wanted` makes from the running one (see the module's doc):
/// index shares and capacities set, removed backends marked. The caller
/// stores it. A backend whose URL does not resolve is left out, logged.
pub fn set_backends(router: &Router, cfg: &Config, wanted: &[BackendConfig]) -> Fleet {
    let fleet = router.fleet.load_full();
    // Slots kept, and slots the running fleet holds (a removed backend's
    // stays taken until it is gone: it drains).
    let mut used = BackendSet::default();
    let running = fleet.slot_set();
    let mut backends = Vec::with_capacity(wanted.len());
    let mut added = Vec::new();
    for bc in wanted {
        if let Some(b) = fleet.backends.iter().find(|b| b.url == bc.url()) {
            used.insert(b.slot);
            backends.push(b.clone());
        } else {
            added.push(bc);
        }
    }
    for bc in added {
        let Some(slot) = (0..MAX_BACKENDS).find(|&s| !used.contains(s) && !running.contains(s))
        else {
            error!(backend = bc.url(), "no free backend slot; not added");
            continue;
        };
        let addr = match backend_addr(bc.url()) {
            Ok(a) => a,
            Err(e) => {
                error!(backend = bc.url(), error = %format!("{e:#}"), "backend not added");
                continue;
            }
        };
        used.insert(slot);
        let kv = bc.kv_blocks().unwrap_or(cfg.prefix.kv_blocks);
        router.index.clear_backend(slot);
        router.index.set_capacity(slot, kv);
        let mut b = Backend::new(slot, bc.url(), addr, kv);
        // With active checks off nothing would ever prove it.
        if cfg.health.interval_ms > 0 {
            b.health = Health::unproven();
        }
        backends.push(Arc::new(b));
        info!(
            backend = bc.url(),
            slot, "backend added; it takes traffic once a health probe passes"
        );
    }
    for b in &fleet.backends {
        if !used.contains(b.slot) {
            // Workers drop its pooled connections at their next sweep (they
            // watch for fleet swaps) and never pool one again.
            b.health.mark_removed();
            router.index.clear_backend(b.slot);
            info!(backend = %b.url, "backend removed; its in-flight requests finish");
        }
    }
    for b in &backends {
        if let Some(kv) = wanted
            .iter()
            .find(|c| c.url() == b.url)
            .and_then(|c| c.kv_blocks())
        {
            b.feedback.set_known_capacity(kv);
            router.index.set_capacity(b.slot, kv);
        }
    }
    if backends.is_empty() && !fleet.backends.is_empty() {
        warn!("the fleet is empty: requests get 503 until a backend is found");
    }
    Fleet { backends }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(backends: &[&str]) -> Config {
        let mut text = format!("backends = {backends:?}\n");
        text.push_str("[[discovery.file]]\npath = \"/nonexistent/backends.txt\"\n");
        toml::from_str(&text).unwrap()
    }

    fn urls(router: &Router) -> Vec<String> {
        let fleet = router.fleet.load();
        fleet.backends.iter().map(|b| b.url.clone()).collect()
    }

    #[test]
    fn sources_join_the_static_list_and_new_backends_wait_for_a_probe() {
        let (a, b, c) = (
            "http://127.0.0.1:9001",
            "http://127.0.0.1:9002",
            "http://127.0.0.1:9003",
        );
        let router = Router::new(config(&[a])).unwrap();
        let m = Membership::default();
        let src = "file:/nonexistent/backends.txt";
        m.set_source(&router, src, vec![a.into(), b.into()]);
        assert_eq!(urls(&router), [a, b], "a URL in both is one backend");
        let fleet = router.fleet.load_full();
        let (old, new) = (&fleet.backends[0], &fleet.backends[1]);
        assert!(old.health.is_up() && !old.health.is_unproven());
        assert!(!new.health.is_up() && new.health.is_unproven());
        assert!(!new.has_room(0), "no traffic before a probe passed");
        // One passed probe is enough for a new backend, whatever `rise`.
        assert_eq!(
            new.health.observe_probe(true, 5, 2),
            Some(crate::fleet::backend::Flip::Up)
        );
        assert!(new.has_room(0) && !new.health.is_unproven());

        // A source the running config does not name changes nothing.
        m.set_source(&router, "file:/elsewhere", vec![c.into()]);
        assert_eq!(urls(&router), [a, b]);

        // The source no longer lists `a`: the static list still does.
        m.set_source(&router, src, vec![b.into()]);
        assert_eq!(urls(&router), [a, b]);
        // A reload without `a` keeps what the source found; `a` is drained.
        m.apply_config(&router, config(&[c]));
        assert_eq!(urls(&router), [b, c]);
        assert!(old.health.is_removed());
        assert!(
            Arc::ptr_eq(&router.fleet.load().backends[0], new),
            "b keeps its state"
        );
        // A reload that drops the source drops its backends.
        let mut plain = config(&[c]);
        plain.discovery.file.clear();
        m.apply_config(&router, plain);
        assert_eq!(urls(&router), [c]);
        assert!(new.health.is_removed());
    }

    #[test]
    fn a_source_past_the_fleet_limit_fills_it_and_the_rest_waits() {
        let router = Router::new(config(&["http://127.0.0.1:9000"])).unwrap();
        let m = Membership::default();
        let many: Vec<String> = (1..=MAX_BACKENDS + 6)
            .map(|i| format!("http://127.0.0.1:{}", 9000 + i))
            .collect();
        m.set_source(&router, "file:/nonexistent/backends.txt", many);
        let fleet = router.fleet.load();
        assert_eq!(fleet.backends.len(), MAX_BACKENDS);
        assert_eq!(
            fleet.backends[0].url, "http://127.0.0.1:9000",
            "the static list first"
        );
        let mut slots: Vec<_> = fleet.backends.iter().map(|b| b.slot).collect();
        slots.sort_unstable();
        slots.dedup();
        assert_eq!(slots.len(), MAX_BACKENDS, "one slot each");
    }

    fn sorted(router: &Router) -> Vec<String> {
        let mut u = urls(router);
        u.sort();
        u
    }

    /// The backend with `url` passes (or fails) a probe.
    fn probed(router: &Router, url: &str, passed: bool) {
        let fleet = router.fleet.load();
        let b = fleet.backends.iter().find(|b| b.url == url).unwrap();
        b.stats.probed(passed);
        b.health.observe_probe(passed, 1, 1);
    }

    fn proven(router: &Router, url: &str) {
        probed(router, url, true);
    }

    #[test]
    fn a_swapped_list_keeps_the_old_backends_until_the_new_ones_passed_a_probe() {
        let router = Router::new(config(&[])).unwrap();
        let m = Membership::default();
        let src = "file:/nonexistent/backends.txt";
        let u = |p: u16| format!("http://127.0.0.1:{p}");
        m.set_source(&router, src, vec![u(1), u(2)]);
        // New backends start unproven: nothing to hand over yet.
        m.set_source(&router, src, vec![u(1), u(2), u(9)]);
        m.set_source(&router, src, vec![u(1), u(2)]);
        assert_eq!(urls(&router), [u(1), u(2)]);
        proven(&router, &u(1));
        proven(&router, &u(2));
        let old = router.fleet.load_full();

        m.set_source(&router, src, vec![u(3), u(4)]);
        assert_eq!(
            sorted(&router),
            [u(1), u(2), u(3), u(4)],
            "the old ones serve"
        );
        assert!(old.backends.iter().all(|b| !b.health.is_removed()));
        let state = || {
            let snap = router.metrics.discovery.snapshot();
            snap.into_iter().find(|(k, _)| k == src).unwrap().1
        };
        assert_eq!(state().handing_over, 2);
        m.settle(&router);
        proven(&router, &u(3));
        m.settle(&router);
        assert_eq!(
            urls(&router).len(),
            4,
            "one new backend of two is not enough"
        );
        // Swapped again meanwhile: what serves now still serves.
        m.set_source(&router, src, vec![u(4), u(5)]);
        assert_eq!(sorted(&router), [u(1), u(2), u(3), u(4), u(5)]);
        proven(&router, &u(4));
        m.settle(&router);
        assert_eq!(urls(&router).len(), 5);
        proven(&router, &u(5));
        m.settle(&router);
        assert_eq!(sorted(&router), [u(4), u(5)], "handed over");
        assert!(old.backends.iter().all(|b| b.health.is_removed()));
        assert_eq!(state().handing_over, 0);

        // A removal alone holds nothing up, nor does a listed backend that
        // failed its probes; an empty list confirmed empties at once.
        m.set_source(&router, src, vec![u(4)]);
        assert_eq!(sorted(&router), [u(4)]);
        m.set_source(&router, src, vec![u(4), u(5), u(6)]);
        probed(&router, &u(5), true);
        probed(&router, &u(6), false);
        m.set_source(&router, src, vec![u(4), u(6)]);
        assert_eq!(sorted(&router), [u(4), u(6)]);
        m.set_source(&router, src, vec![]);
        assert!(urls(&router).is_empty());
    }

    #[test]
    fn past_the_limit_healthy_backends_stay_and_the_rest_follow_the_sources_order() {
        let router = Router::new(config(&[])).unwrap();
        let m = Membership::default();
        let src = "file:/nonexistent/backends.txt";
        let live = "http://127.0.0.2:8000".to_owned();
        m.set_source(&router, src, vec![live.clone()]);
        proven(&router, &live);
        // A list that grows past the limit, the live one far down it, and
        // URLs that sort before every other.
        let mut many: Vec<String> = (0..2 * MAX_BACKENDS)
            .map(|i| format!("http://127.0.0.{}:{}", 10 + i / 1000, 1000 + i % 1000))
            .collect();
        many.insert(1500, live.clone());
        m.set_source(&router, src, many.clone());
        let got = urls(&router);
        assert_eq!(got.len(), MAX_BACKENDS);
        assert!(got.contains(&live), "a healthy backend is never left out");
        assert!(
            many[..MAX_BACKENDS - 1].iter().all(|u| got.contains(u)),
            "the rest in the source's order"
        );
        let snap = router.metrics.discovery.snapshot();
        let st = &snap.iter().find(|(k, _)| k == src).unwrap().1;
        assert_eq!(st.left_out, many.len() - MAX_BACKENDS);
        assert_eq!(st.left_out_first[0], many[MAX_BACKENDS - 1]);
        assert_eq!(st.left_out_first.len(), LEFT_OUT_NAMED);
    }
}
