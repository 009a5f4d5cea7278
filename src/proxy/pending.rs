//! Outcomes the store refused: an attempt's end (its committed answer, `failed_before_commit`
//! or `outcome_unknown`) whose write failed with a storage error (PostgreSQL unreachable,
//! redb's disk full). The record would otherwise stay `executing` under a lease its live
//! owner keeps renewing, and every retry would be told `in-flight` for as long as the process
//! runs (issue 34). Instead the answer is kept in memory and written again, with backoff,
//! until the store takes it: after an outage the retry replays the real answer within a
//! moment of the store coming back.
//!
//! If the version moved meanwhile (another instance took the lease over, an operator
//! decided, or our own earlier write took effect although its acknowledgement was lost),
//! the stored decision stands, except that an `outcome_unknown` record is resolved with the
//! committed answer we hold, as a late answer after a takeover is. If the process stops
//! before the write lands, the lease runs out and the record becomes `outcome_unknown`.

use std::sync::Arc;
use std::time::Duration;

use crate::policy::state::{Event, State};
use crate::store::{now_ms, Record, Store, StoreError};

const FIRST_PAUSE: Duration = Duration::from_millis(100);
const MAX_PAUSE: Duration = Duration::from_secs(1);

/// Write `record` (the attempt's outcome, already applied to it) in the background until
/// the store accepts it or a stored decision makes it moot.
pub fn keep_writing(store: Arc<dyn Store>, record: Record) {
    tracing::error!(execution_id = %record.id, state = %record.state(), "the attempt's outcome could not be stored; it is kept and written again until the store takes it");
    tokio::spawn(write_until_stored(store, record));
}

async fn write_until_stored(store: Arc<dyn Store>, mut record: Record) {
    let id = record.id.clone();
    let mut pause = FIRST_PAUSE;
    let mut tries = 1u32;
    loop {
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(MAX_PAUSE);
        tries += 1;
        match store.update(record.clone()).await {
            Ok(stored) => {
                tracing::warn!(execution_id = %id, state = %stored.state(), tries, "the attempt's outcome is stored now");
                return;
            }
            Err(StoreError::Conflict { .. }) => match store.get(&id).await {
                Ok(Some(current)) if rebase_on_events(&mut record, &current) => {
                    crate::policy::webhook::settle_held(&mut record, now_ms());
                }
                Ok(Some(current)) => match resolve_with(current, &record) {
                    Some(next) => record = next,
                    None => return,
                },
                Ok(None) => {
                    tracing::error!(execution_id = %id, "the record vanished while its outcome waited to be stored");
                    return;
                }
                Err(e) => tracing::debug!(execution_id = %id, error = %e, "store still failing"),
            },
            Err(StoreError::NotFound(_)) => {
                tracing::error!(execution_id = %id, "the record vanished while its outcome waited to be stored");
                return;
            }
            Err(e) => tracing::debug!(execution_id = %id, error = %e, tries, "store still failing"),
        }
    }
}

/// `ours` (this attempt's outcome, applied to the copy it read) lost its compare-and-set to
/// `current`: if `current` is the same attempt still `executing` (same attempt count; no
/// takeover, which leaves `executing`, and no re-send, which counts an attempt), the only
/// writer that can have moved it is a webhook event joining its history
/// (`proxy::webhook`). Then `ours` takes those events and `current`'s version, and may be
/// written again. Returns whether it was rebased.
pub(super) fn rebase_on_events(ours: &mut Record, current: &Record) -> bool {
    if current.state() != State::Executing
        || current.attempts != ours.attempts
        || current.version <= ours.version
        || current.events.len() <= ours.events.len()
    {
        return false;
    }
    ours.events = current.events.clone();
    ours.version = current.version;
    true
}

/// The version moved: what to write instead, if anything. Our own write may have taken
/// effect (same state stored: done); an `outcome_unknown` is resolved with a committed answer
/// we hold; any other decision stands.
fn resolve_with(current: Record, ours: &Record) -> Option<Record> {
    let id = current.id.clone();
    if current.state() == ours.state() && current.attempts == ours.attempts {
        tracing::warn!(execution_id = %id, state = %current.state(), "the attempt's outcome is stored now");
        return None;
    }
    if current.state() == State::OutcomeUnknown && ours.state() == State::Committed {
        let mut r = current;
        r.response = ours.response.clone();
        r.external_id = ours.external_id.clone();
        r.external_indexed = ours.external_indexed;
        r.job = ours.job.clone();
        let note = Some(
            "late answer from the original attempt, kept while the store was failing".to_string(),
        );
        if r.apply(Event::ResolveCommitted, now_ms(), note).is_ok() {
            return Some(r);
        }
        return None;
    }
    tracing::warn!(execution_id = %id, state = %current.state(), "another decision was stored while this attempt's outcome waited; it stands");
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::record::WebhookEvent;

    fn event() -> WebhookEvent {
        WebhookEvent {
            id: "evt_1".into(),
            route: "stripe/events".into(),
            kind: None,
            at_ms: 3,
            verdict: "other".into(),
            body: None,
            held: None,
        }
    }

    #[test]
    fn only_events_on_the_same_attempt_still_executing_are_taken_along() {
        let mut read = crate::store::record::tests::sample();
        read.apply(Event::Start, 2, None).expect("start");
        read.version = 2;
        // What a webhook wrote meanwhile: one more event, one more version.
        let mut current = read.clone();
        current.events.push(event());
        current.version = 3;
        let mut ours = read.clone();
        ours.apply(Event::Commit, 4, None).expect("commit");
        assert!(rebase_on_events(&mut ours, &current));
        assert_eq!((ours.version, ours.events.len()), (3, 1));
        assert_eq!(ours.state(), State::Committed);
        // A takeover (no longer executing) or a re-send (another attempt) stands.
        let mut taken = current.clone();
        taken.apply(Event::LoseOutcome, 5, None).expect("lose");
        let mut ours = read.clone();
        ours.apply(Event::Commit, 4, None).expect("commit");
        assert!(!rebase_on_events(&mut ours, &taken));
        let mut resent = current.clone();
        resent.attempts += 1;
        assert!(!rebase_on_events(&mut ours, &resent));
        // Nothing new on the record: a conflict of another kind.
        let mut same = read.clone();
        same.version = 3;
        assert!(!rebase_on_events(&mut ours, &same));
    }
}
