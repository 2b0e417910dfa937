//! Reloading the configuration without dropping traffic: backends that stay
//! keep their slot, counters, pooled connections and index share; new ones
//! take free slots (with a new generation, so no pooled connection or
//! counter of a previous owner carries over); removed ones finish their
//! in-flight requests (they hold an `Arc` to the backend), lose their index
//! entries and their pooled connections.

use std::sync::Arc;

use anyhow::bail;
use tracing::{info, warn};

use crate::config::{Config, backend_addr};
use crate::route::MAX_BACKENDS;
use crate::route::backend::{Backend, Fleet};
use crate::router::Router;

/// Swaps in `new`. Settings that need a restart (listen address, workers)
/// are kept as they were, with a warning.
pub fn apply(router: &Router, mut new: Config) -> anyhow::Result<()> {
    new.validate()?;
    let old = router.config.load_full();
    if new.listen != old.listen || new.workers != old.workers {
        warn!(
            "listen and workers change only on restart; keeping {} with {} workers",
            old.listen, old.workers
        );
        new.listen = old.listen;
        new.workers = old.workers;
    }
    let fleet = router.fleet.load_full();
    let mut used = [false; MAX_BACKENDS];
    let mut backends = Vec::with_capacity(new.backends.len());
    let mut added = Vec::new();
    for bc in &new.backends {
        if let Some(b) = fleet.backends.iter().find(|b| b.url == bc.url()) {
            used[b.slot] = true;
            backends.push(b.clone());
        } else {
            added.push(bc);
        }
    }
    for bc in added {
        let Some(slot) = (0..MAX_BACKENDS).find(|&s| !used[s] && fleet.by_slot(s).is_none()) else {
            bail!("no free backend slot");
        };
        used[slot] = true;
        let kv = bc.kv_blocks().unwrap_or(new.prefix.kv_blocks);
        router.index.clear_backend(slot);
        router.index.set_capacity(slot, kv);
        backends.push(Arc::new(Backend::new(
            slot,
            bc.url(),
            backend_addr(bc.url())?,
            kv,
        )));
        info!(backend = bc.url(), slot, "backend added");
    }
    for b in &fleet.backends {
        if !used[b.slot] {
            // Workers drop its pooled connections at their next sweep (they
            // watch for fleet swaps) and never pool one again.
            b.health.mark_removed();
            router.index.clear_backend(b.slot);
            info!(backend = %b.url, "backend removed; its in-flight requests finish");
        }
    }
    for b in &backends {
        if let Some(kv) = new
            .backends
            .iter()
            .find(|c| c.url() == b.url)
            .and_then(|c| c.kv_blocks())
        {
            b.feedback.set_known_capacity(kv);
            router.index.set_capacity(b.slot, kv);
        }
    }
    router.retry_budget.set_percent(new.retry.budget_percent);
    router.config.store(Arc::new(new));
    router.fleet.store(Arc::new(Fleet { backends }));
    router.sync_subscribers();
    Ok(())
}
