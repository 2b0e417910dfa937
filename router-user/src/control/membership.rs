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

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tracing::{error, info, warn};

use crate::config::{BackendConfig, Config, backend_addr};
use crate::fleet::MAX_BACKENDS;
use crate::fleet::backend::{Backend, Fleet, Health};
use crate::fleet::owners::BackendSet;
use crate::shared::Router;

/// The discovery sources' last good lists, by source key.
#[derive(Debug, Default)]
pub struct Membership {
    discovered: Mutex<BTreeMap<String, Vec<String>>>,
}

impl Membership {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Vec<String>>> {
        self.discovered.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A reload: `new` (validated) becomes the running configuration, its
    /// static list joined with what the sources it still names found.
    pub fn apply_config(&self, router: &Router, new: Config) {
        let mut found = self.lock();
        let keys = new.discovery.keys();
        found.retain(|k, _| keys.contains(k));
        router.metrics.discovery.retain(&keys);
        let fleet = set_backends(router, &new, &wanted(&new, &found));
        router.config.store(Arc::new(new));
        router.fleet.store(Arc::new(fleet));
        router.sync_subscribers();
    }

    /// A discovery source's list changed to `urls` (each `http://ip:port`).
    /// Ignored when a reload dropped the source meanwhile.
    pub fn set_source(&self, router: &Router, source: &str, urls: Vec<String>) {
        let mut found = self.lock();
        let cfg = router.config.load_full();
        if !cfg.discovery.keys().iter().any(|k| k == source) {
            return;
        }
        found.insert(source.to_owned(), urls);
        let fleet = set_backends(router, &cfg, &wanted(&cfg, &found));
        router.fleet.store(Arc::new(fleet));
        router.sync_subscribers();
    }
}

/// The fleet's list: the static backends, then each source's (in the
/// config's order) not already listed, up to `MAX_BACKENDS`.
fn wanted(cfg: &Config, found: &BTreeMap<String, Vec<String>>) -> Vec<BackendConfig> {
    let mut list = cfg.backends.clone();
    let mut left_out = 0;
    for key in cfg.discovery.keys() {
        for url in found.get(&key).into_iter().flatten() {
            if list.iter().any(|b| b.url() == url) {
                continue;
            }
            if list.len() == MAX_BACKENDS {
                left_out += 1;
                continue;
            }
            list.push(BackendConfig::Url(url.clone()));
        }
    }
    if left_out > 0 {
        // Called only when a list changed, so this is logged once per change.
        error!(
            left_out,
            "discovered backends left out: the fleet holds at most {MAX_BACKENDS}"
        );
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
}
