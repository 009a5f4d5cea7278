//! Background duties of a running proxy: on start, records a previous owner left
//! `executing` become `outcome_unknown` (never `failed`, never re-sent); while running,
//! leases of our own executions are renewed, expired leases of dead instances are taken
//! over, and records past retention are swept.

use std::sync::Arc;
use std::time::Duration;

use crate::policy::state::Event;
use crate::store::{now_ms, Store, StoreError};

/// Move every stale `executing` record (lease expired before `before_ms`) to
/// `outcome_unknown`. Returns how many moved. Conflicts mean someone else got there first.
pub async fn recover_stale(store: &dyn Store, before_ms: i64) -> Result<usize, StoreError> {
    let mut moved = 0;
    loop {
        let batch = store.stale_executing(before_ms, 256).await?;
        if batch.is_empty() {
            return Ok(moved);
        }
        let n = batch.len();
        let mut progressed = false;
        for mut r in batch {
            let owner = r
                .lease
                .as_ref()
                .map(|l| l.owner.clone())
                .unwrap_or_default();
            let note = format!("owner {owner} stopped while executing; the request may or may not have reached the downstream");
            if r.apply(Event::LoseOutcome, now_ms(), Some(note)).is_err() {
                continue;
            }
            // A `succeeded` webhook event held while it executed settles it instead.
            if crate::policy::webhook::settle_held(&mut r, now_ms()) {
                tracing::info!(execution_id = %r.id, "stale executing record settled by a webhook event held while it executed");
            }
            match store.update(r).await {
                Ok(r) => {
                    moved += 1;
                    progressed = true;
                    tracing::warn!(execution_id = %r.id, "stale executing record is now outcome_unknown");
                }
                Err(StoreError::Conflict { .. }) => progressed = true,
                Err(e) => return Err(e),
            }
        }
        if n < 256 || !progressed {
            return Ok(moved);
        }
    }
}

/// Renew our leases every third of the lease period; take over expired ones.
pub fn spawn_lease_keeper(
    store: Arc<dyn Store>,
    owner: String,
    lease: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let period = (lease / 3).max(Duration::from_millis(100));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let until = now_ms().saturating_add(lease.as_millis() as i64);
            if let Err(e) = store.renew_leases(&owner, until).await {
                tracing::error!(error = %e, "lease renewal failed");
            }
            if let Err(e) = recover_stale(store.as_ref(), now_ms()).await {
                tracing::error!(error = %e, "stale lease recovery failed");
            }
        }
    })
}

/// Delete records past retention, in bounded batches.
pub async fn sweep(store: &dyn Store) -> Result<u64, StoreError> {
    let mut total = 0;
    loop {
        let n = store.gc(now_ms(), 1000).await?;
        total += n;
        if n < 1000 {
            return Ok(total);
        }
    }
}

pub fn spawn_gc(store: Arc<dyn Store>, every: Duration) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            match sweep(store.as_ref()).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(removed = n, "retention sweep"),
                Err(e) => tracing::error!(error = %e, "retention sweep failed"),
            }
        }
    })
}
