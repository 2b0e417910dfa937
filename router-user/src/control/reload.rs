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
    // A chat template that failed or cost too much is tried again.
    if let Some(p) = &router.precise {
        p.tokenizers.reset_templates();
    }
    membership.apply_config(router, new);
    Ok(())
}
