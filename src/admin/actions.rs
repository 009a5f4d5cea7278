//! Operator decisions as functions over the [`Store`], shared by the admin API, the console
//! (through the API) and the CLI. Every change goes through [`Record::apply`] (the state
//! machine decides what is legal) and a compare-and-set update; a conflict means someone
//! else wrote first, so the record is read again and the decision re-checked against what
//! is stored now.

use std::time::Duration;

use serde::Deserialize;

use crate::policy::identity::{ArgsHash, ExecutionId};
use crate::policy::state::{Event, IllegalTransition, State};
use crate::store::{
    now_ms, Approval, ListFilter, OperationMark, OperationState, Record, Store, StoreError,
    StoredResponse,
};

/// Re-reads after a CAS conflict before giving up (each one means another writer won).
const CAS_ATTEMPTS: usize = 8;
/// Records read per page while cancelling an operation.
const CANCEL_PAGE: usize = 200;

/// Why an operator action was not applied.
#[derive(Debug, thiserror::Error)]
pub enum ActionError {
    #[error("no execution record {0}")]
    NotFound(ExecutionId),
    #[error("cannot {action} {id}: it is {state} ({illegal})", state = .illegal.from)]
    WrongState {
        id: ExecutionId,
        illegal: IllegalTransition,
        action: &'static str,
    },
    #[error(
        "the approval names args_hash {given}, but execution {id} has arguments {actual}: \
         the arguments are not the ones you reviewed; review the current preview and approve again"
    )]
    ApprovalMismatch {
        id: ExecutionId,
        given: String,
        actual: ArgsHash,
    },
    #[error("execution {0} kept changing while the decision was applied; try again")]
    Contended(ExecutionId),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl ActionError {
    fn illegal(id: &ExecutionId, e: IllegalTransition, action: &'static str) -> ActionError {
        ActionError::WrongState {
            id: id.clone(),
            illegal: e,
            action,
        }
    }
}

/// Read `id`, let `change` decide and edit, write with compare-and-set; on a conflict,
/// read again and let `change` decide again.
async fn modify(
    store: &dyn Store,
    id: &ExecutionId,
    mut change: impl FnMut(&mut Record) -> Result<(), ActionError>,
) -> Result<Record, ActionError> {
    for _ in 0..CAS_ATTEMPTS {
        let Some(mut record) = store.get(id).await? else {
            return Err(ActionError::NotFound(id.clone()));
        };
        change(&mut record)?;
        match store.update(record).await {
            Ok(stored) => return Ok(stored),
            Err(StoreError::Conflict { .. }) => continue,
            Err(StoreError::NotFound(_)) => return Err(ActionError::NotFound(id.clone())),
            Err(e) => return Err(e.into()),
        }
    }
    Err(ActionError::Contended(id.clone()))
}

/// Approve the execution `id` for exactly the arguments `args_hash` names. `ttl` gives the
/// route's `approval.expires` for the record, if any.
pub async fn approve(
    store: &dyn Store,
    id: &ExecutionId,
    args_hash: &str,
    by: &str,
    ttl: impl Fn(&Record) -> Option<Duration>,
) -> Result<Record, ActionError> {
    let r = modify(store, id, |r| {
        // The binding check comes first: an approval of other arguments is never applied,
        // whatever state the record is in.
        if r.args_hash.as_str() != args_hash {
            return Err(ActionError::ApprovalMismatch {
                id: id.clone(),
                given: args_hash.to_string(),
                actual: r.args_hash.clone(),
            });
        }
        let now = now_ms();
        r.apply(Event::Approve, now, Some(format!("approved by {by}")))
            .map_err(|e| ActionError::illegal(id, e, "approve"))?;
        r.approval = Some(Approval {
            args_hash: r.args_hash.clone(),
            by: by.to_string(),
            at_ms: now,
            expires_at_ms: ttl(r).map(|d| now.saturating_add(d.as_millis() as i64)),
        });
        Ok(())
    })
    .await?;
    tracing::info!(execution_id = %id, by, "approved");
    Ok(r)
}

/// Reject the execution `id`: it will never be sent; retries get 403 `rejected`.
pub async fn reject(
    store: &dyn Store,
    id: &ExecutionId,
    by: &str,
    reason: Option<&str>,
) -> Result<Record, ActionError> {
    let note = match reason {
        Some(why) => format!("rejected by {by}: {why}"),
        None => format!("rejected by {by}"),
    };
    let r = modify(store, id, |r| {
        r.apply(Event::Reject, now_ms(), Some(note.clone()))
            .map_err(|e| ActionError::illegal(id, e, "reject"))
    })
    .await?;
    tracing::info!(execution_id = %id, by, "rejected");
    Ok(r)
}

/// The answer an operator stores when resolving an unknown outcome as committed.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResultSpec {
    pub status: u16,
    /// Header name/value pairs; `content-type: application/json` is added when missing.
    #[serde(default)]
    pub headers: Vec<(String, String)>,
    /// Any JSON value, stored as its JSON text.
    pub body: serde_json::Value,
}

impl ResultSpec {
    pub fn into_stored(self) -> Result<StoredResponse, String> {
        if !(100..=599).contains(&self.status) {
            return Err(format!("status {} is not an HTTP status", self.status));
        }
        let mut headers: Vec<(String, Vec<u8>)> = Vec::with_capacity(self.headers.len() + 1);
        for (n, v) in self.headers {
            let name = http::HeaderName::from_bytes(n.as_bytes())
                .map_err(|_| format!("{n:?} is not a header name"))?;
            http::HeaderValue::from_str(&v)
                .map_err(|_| format!("the value of header {name} is not a valid header value"))?;
            headers.push((name.as_str().to_string(), v.into_bytes()));
        }
        if !headers.iter().any(|(n, _)| n == "content-type") {
            headers.push(("content-type".into(), b"application/json".to_vec()));
        }
        Ok(StoredResponse {
            status: self.status,
            headers,
            body: serde_json::to_vec(&self.body).expect("a JSON value always serializes"),
        })
    }
}

/// An operator's decision on an `outcome_unknown` record. Resolved as committed, the
/// record stores `result` (or a small synthetic answer) and replays it from now on; as
/// not committed, it may run again under the same key.
pub async fn resolve(
    store: &dyn Store,
    id: &ExecutionId,
    committed: bool,
    result: Option<StoredResponse>,
    by: &str,
) -> Result<Record, ActionError> {
    let (event, outcome) = if committed {
        (Event::ResolveCommitted, "committed")
    } else {
        (Event::ResolveNotCommitted, "not committed")
    };
    let note = format!("resolved by {by} as {outcome}");
    let r = modify(store, id, |r| {
        r.apply(event, now_ms(), Some(note.clone()))
            .map_err(|e| ActionError::illegal(id, e, "resolve"))?;
        if committed {
            r.response = Some(result.clone().unwrap_or_else(|| synthetic_result(id)));
        }
        Ok(())
    })
    .await?;
    tracing::info!(execution_id = %id, by, outcome, "resolved");
    if committed {
        // A cancelled operation whose unknown call turns out to have happened is now
        // cancelled after a side effect.
        if let Some(op) = &r.operation_id {
            if let Some(mark) = store.operation(op).await? {
                after_side_effect(store, mark).await?;
            }
        }
    }
    Ok(r)
}

/// Move a cancelled operation's mark to `cancelled_after_side_effect`: one of its calls
/// is known to have committed (also used when a reconciliation finds the effect).
pub async fn after_side_effect(
    store: &dyn Store,
    mark: OperationMark,
) -> Result<OperationMark, StoreError> {
    store
        .mark_operation(OperationMark {
            state: OperationState::CancelledAfterSideEffect,
            updated_at_ms: now_ms(),
            ..mark
        })
        .await
}

fn synthetic_result(id: &ExecutionId) -> StoredResponse {
    StoredResponse {
        status: 200,
        headers: vec![("content-type".into(), b"application/json".to_vec())],
        body: serde_json::to_vec(
            &serde_json::json!({ "resolved": "committed", "execution_id": id.as_str() }),
        )
        .expect("literal JSON serializes"),
    }
}

/// What cancelling an operation did, record by record.
#[derive(Debug, Default)]
pub struct CancelReport {
    pub mark: Option<OperationMark>,
    /// Moved to `cancelled_before_commit` now.
    pub cancelled: Vec<ExecutionId>,
    /// Already committed: left as they are (the side effect happened).
    pub committed: Vec<ExecutionId>,
    /// Sent, outcome not yet known (`executing`, `outcome_unknown`): left as they are;
    /// if one turns out committed, the operation counts as cancelled after a side effect.
    pub in_doubt: Vec<(ExecutionId, State)>,
    /// Already final without an effect (`rejected`, `cancelled_before_commit`).
    pub unchanged: Vec<(ExecutionId, State)>,
}

/// Cancel operation `op` (SPEC section 8): the mark goes first, so the proxy sends nothing
/// new under it from then on; then every record of the operation not yet sent becomes
/// `cancelled_before_commit`. Committed records stay committed, and the operation is
/// marked `cancelled_after_side_effect` instead. `retention` bounds how long the mark is kept.
pub async fn cancel(
    store: &dyn Store,
    op: &str,
    by: &str,
    retention: Duration,
) -> Result<CancelReport, ActionError> {
    let now = now_ms();
    let mut mark = store
        .mark_operation(OperationMark {
            operation_id: op.to_string(),
            state: OperationState::Cancelled,
            by: by.to_string(),
            cancelled_at_ms: now,
            updated_at_ms: now,
            expires_at_ms: now.saturating_add(retention.as_millis() as i64),
        })
        .await?;
    let mut report = CancelReport::default();
    let mut after = None;
    loop {
        let page = store
            .list(&ListFilter {
                operation: Some(op.to_string()),
                after: after.clone(),
                limit: CANCEL_PAGE,
                ..ListFilter::default()
            })
            .await?;
        let full = page.len() == CANCEL_PAGE;
        after = page.last().map(|r| r.id.clone());
        for r in page {
            cancel_one(store, r, by, &mut report).await?;
        }
        if !full {
            break;
        }
    }
    if !report.committed.is_empty() && mark.state == OperationState::Cancelled {
        mark = after_side_effect(store, mark).await?;
    }
    tracing::info!(
        operation_id = op,
        by,
        cancelled = report.cancelled.len(),
        committed = report.committed.len(),
        in_doubt = report.in_doubt.len(),
        state = mark.state.as_str(),
        "operation cancelled"
    );
    report.mark = Some(mark);
    Ok(report)
}

async fn cancel_one(
    store: &dyn Store,
    mut r: Record,
    by: &str,
    report: &mut CancelReport,
) -> Result<(), ActionError> {
    for _ in 0..CAS_ATTEMPTS {
        let id = r.id.clone();
        match r.state() {
            State::Committed | State::ResultDelivered => {
                report.committed.push(id);
                return Ok(());
            }
            s @ (State::Executing | State::OutcomeUnknown) => {
                report.in_doubt.push((id, s));
                return Ok(());
            }
            s @ (State::Rejected | State::CancelledBeforeCommit) => {
                report.unchanged.push((id, s));
                return Ok(());
            }
            State::Prepared
            | State::AwaitingApproval
            | State::Approved
            | State::FailedBeforeCommit => {}
        }
        let note = format!("operation cancelled by {by}");
        r.apply(Event::Cancel, now_ms(), Some(note))
            .map_err(|e| ActionError::illegal(&id, e, "cancel"))?;
        match store.update(r).await {
            Ok(_) => {
                report.cancelled.push(id);
                return Ok(());
            }
            // Someone moved it (a retry started it, an operator decided): look again.
            Err(StoreError::Conflict { .. }) => match store.get(&id).await? {
                Some(fresh) => r = fresh,
                None => return Ok(()),
            },
            Err(StoreError::NotFound(_)) => return Ok(()),
            Err(e) => return Err(e.into()),
        }
    }
    Err(ActionError::Contended(r.id))
}

/// An operation as the admin API shows it: its mark (if cancelled) and its records.
pub struct OperationStatus {
    pub mark: Option<OperationMark>,
    pub records: Vec<Record>,
    /// More records exist than were read.
    pub truncated: bool,
}

/// Read operation `op`. A `cancelled` mark whose operation has a committed record (one
/// that was in doubt at cancel time and then committed, e.g. by reconciliation) is moved
/// to `cancelled_after_side_effect` here, so what is shown is never behind the records.
pub async fn operation_status(
    store: &dyn Store,
    op: &str,
    limit: usize,
) -> Result<OperationStatus, ActionError> {
    let mut mark = store.operation(op).await?;
    let mut records = store
        .list(&ListFilter {
            operation: Some(op.to_string()),
            limit: limit.saturating_add(1),
            ..ListFilter::default()
        })
        .await?;
    let truncated = records.len() > limit;
    records.truncate(limit);
    // The operation's timeline: calls in the order they were made.
    records.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
    if let Some(m) = mark.clone() {
        if m.state == OperationState::Cancelled && records.iter().any(|r| r.state().has_result()) {
            mark = Some(after_side_effect(store, m).await?);
        }
    }
    Ok(OperationStatus {
        mark,
        records,
        truncated,
    })
}
