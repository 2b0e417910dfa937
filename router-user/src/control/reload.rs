//! Reloading the configuration without dropping traffic: the new static
//! list (joined with what discovery found) is swapped in by
//! `membership`, the same path discovery takes, so backends that stay keep
//! everything, new ones are probed before they get traffic, and removed
//! ones are drained.

use tracing::warn;

use crate::config::Config;
use crate::control::membership::Membership;
use crate::shared::Router;

/// Swaps in `new`. Settings that need a restart (listen address, workers)
/// are kept as they were, with a warning.
pub fn apply(router: &Router, membership: &Membership, mut new: Config) -> anyhow::Result<()> {
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
    router.retry_budget.set_percent(new.retry.budget_percent);
    router.stored.set_bounds(
        new.routes.responses_max_ids,
        std::time::Duration::from_secs(new.routes.responses_ttl_s),
    );
    // Each API key's counters keep rising across the swap.
    if let (Some(new), Some(old)) = (&new.loaded.keys, &old.loaded.keys) {
        new.carry_from(old);
    }
    // A chat template that failed or cost too much is tried again.
    if let Some(p) = &router.precise {
        p.tokenizers.reset_templates();
    }
    membership.apply_config(router, new);
    Ok(())
}

/// What identifies a file's content cheaply: its inode, size and time of
/// change (a certificate replaced by a rename, as cert-manager and
/// certbot do, changes the inode; one written in place, the time).
fn stamp(path: &str) -> Option<(u64, u64, i64, i64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some((m.ino(), m.size(), m.ctime(), m.ctime_nsec()))
}

/// Watches the files the configuration names (certificates, keys, the
/// keys file) and reloads, as SIGHUP does, when one changes: every
/// `watch_files_ms`, one `stat` per file, on a thread of its own. A
/// reload that fails (a certificate half written) keeps the running
/// configuration and is tried again at the next change.
pub fn spawn_watch(
    router: std::sync::Arc<Router>,
    reload: std::sync::Arc<dyn Fn() -> anyhow::Result<()> + Send + Sync>,
) -> anyhow::Result<()> {
    let stamps = |cfg: &Config| -> Vec<_> {
        cfg.watched_files()
            .iter()
            .map(|f| (f.clone(), stamp(f)))
            .collect()
    };
    let mut seen = stamps(&router.config.load());
    std::thread::Builder::new()
        .name("file-watch".into())
        .spawn(move || {
            loop {
                let every = router.config.load().watch_files_ms;
                std::thread::sleep(crate::config::ms(if every == 0 { 1_000 } else { every }));
                if every == 0 {
                    continue;
                }
                let now = stamps(&router.config.load());
                if now == seen {
                    continue;
                }
                let changed: Vec<&str> = now
                    .iter()
                    .filter(|n| !seen.contains(n))
                    .map(|(f, _)| f.as_str())
                    .collect();
                match reload() {
                    Ok(()) => tracing::info!(?changed, "a watched file changed; configuration reloaded"),
                    Err(e) => tracing::error!(?changed, error = %format!("{e:#}"), "a watched file changed; reload failed, keeping the running configuration"),
                }
                // The files as the running configuration names them; one
                // that failed is tried again at its next change.
                seen = stamps(&router.config.load());
            }
        })?;
    Ok(())
}
