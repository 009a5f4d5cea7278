//! Durable execution records behind one trait. The proxy talks only to [`Store`]; redb
//! (single instance, embedded) and PostgreSQL (many instances) implement it with the same
//! guarantees: `claim` is one atomic step, every `update` is a compare-and-set on the
//! record's `version` (the fencing token), and a returned `Ok` means the write is durable.
//! Beside the records, a store keeps the marks of cancelled parent operations.

#[cfg(test)]
pub(crate) mod conformance;
pub mod operation;
pub mod postgres;
pub mod record;
pub mod redb;

use async_trait::async_trait;

pub use operation::{OperationMark, OperationState};
pub use record::{
    Approval, HistoryEntry, Lease, NewRecord, ReadAge, Record, SendAge, StoredResponse,
};

use crate::policy::identity::ExecutionId;
use crate::policy::state::State;

/// Result of trying to take ownership of a new execution.
#[derive(Debug)]
pub enum Claim {
    /// No record existed: this one is now stored (durably) and owned by the caller.
    Claimed(Record),
    /// A record with that id already exists; nothing was written.
    Existing(Record),
}

/// Which records a listing returns, in execution-id order after `after`. Every filter given
/// must match; each store walks the index of the most selective one and checks the others
/// on the records it reads (docs/STORES.md, "Search").
#[derive(Clone, Debug, Default)]
pub struct ListFilter {
    pub status: Option<State>,
    pub operation: Option<String>,
    /// Records whose stored `external_id` is this value (a job's id is stored there too).
    /// Indexed in both stores.
    pub external_id: Option<String>,
    /// Records that started a background job (in one state, or any). Indexed in both stores.
    pub job: Option<JobFilter>,
    /// [`Record::tool_call_id`].
    pub tool_call: Option<String>,
    /// [`Record::key`].
    pub key: Option<String>,
    pub upstream: Option<String>,
    pub route: Option<String>,
    /// Created at or after this instant (ms since the epoch).
    pub since: Option<i64>,
    /// Created before this instant (ms since the epoch).
    pub until: Option<i64>,
    /// Exclusive cursor: the last id of the previous page.
    pub after: Option<ExecutionId>,
    /// Page size; 0 returns an empty page.
    pub limit: usize,
}

/// [`ListFilter::job`]: records with a job, in any state or in one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobFilter {
    Any,
    In(crate::policy::job::JobState),
}

impl JobFilter {
    pub fn admits(self, job: Option<&record::Job>) -> bool {
        match (self, job) {
            (_, None) => false,
            (JobFilter::Any, Some(_)) => true,
            (JobFilter::In(s), Some(j)) => j.state == s,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The stored version differs from the one the caller read: someone else wrote first
    /// (another request, an operator, or the instance that took over an expired lease).
    #[error("record {id} changed concurrently (expected version {expected}, found {found})")]
    Conflict {
        id: ExecutionId,
        expected: u64,
        found: u64,
    },
    #[error("no execution record {0}")]
    NotFound(ExecutionId),
    /// A storage failure. For redb, writes stay refused after one until the file can be
    /// written again and is reopened (what is on disk is then read afresh), or for good
    /// when the file was lost, so a half-applied state can never lead to a double execution.
    #[error("store failure: {0}")]
    Backend(String),
    #[error("stored record {id} is unreadable: {reason}")]
    Corrupt { id: String, reason: String },
}

pub type StoreResult<T> = Result<T, StoreError>;

impl ListFilter {
    /// Whether `r` matches every filter but the cursor (each store checks this on the
    /// records its index walk reads).
    pub fn matches(&self, r: &Record) -> bool {
        fn is(want: &Option<String>, have: Option<&str>) -> bool {
            want.as_deref().is_none_or(|w| have == Some(w))
        }
        self.status.is_none_or(|s| r.state() == s)
            && is(&self.operation, r.operation_id.as_deref())
            && is(&self.tool_call, r.tool_call_id.as_deref())
            && is(&self.key, r.key.as_deref())
            && is(&self.upstream, Some(&r.upstream))
            && is(&self.route, Some(&r.route))
            && self.since.is_none_or(|t| r.created_at_ms >= t)
            && self.until.is_none_or(|t| r.created_at_ms < t)
            && self
                .external_id
                .as_deref()
                .is_none_or(|e| r.external_indexed && r.external_id.as_deref() == Some(e))
            && self.job.is_none_or(|j| j.admits(r.job.as_ref()))
    }
}

/// The durable record store. Implementations must make every successful write durable
/// (fsync'd or committed) before returning. A write whose future is dropped after it was
/// submitted may still be applied: callers re-read rather than assume it was not.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Atomically insert `record` unless a record with the same id exists.
    async fn claim(&self, record: Record) -> StoreResult<Claim>;

    /// The current record, if any.
    async fn get(&self, id: &ExecutionId) -> StoreResult<Option<Record>>;

    /// Compare-and-set: store `record` if the stored version equals `record.version`,
    /// bumping the version. Returns the record as stored. A mismatch is
    /// [`StoreError::Conflict`] and writes nothing.
    async fn update(&self, record: Record) -> StoreResult<Record>;

    /// A page of records matching the filter, ordered by execution id.
    async fn list(&self, filter: &ListFilter) -> StoreResult<Vec<Record>>;

    /// Records in `executing` whose lease expired before `now_ms` (all of them when
    /// `now_ms` is `i64::MAX`), at most `limit`.
    async fn stale_executing(&self, now_ms: i64, limit: usize) -> StoreResult<Vec<Record>>;

    /// Extend the lease of every `executing` record owned by `owner` to `until_ms`.
    /// Returns how many were renewed. Does NOT bump `version`: a heartbeat must not make
    /// the owner's own next update a conflict. Takeover goes through `update`.
    async fn renew_leases(&self, owner: &str, until_ms: i64) -> StoreResult<u64>;

    /// Delete up to `limit` records whose retention ended before `now_ms` and that are not
    /// `executing` (an executing record is never deleted under its owner), and up to
    /// `limit` operation marks whose retention ended. Returns how many of both went.
    async fn gc(&self, now_ms: i64, limit: usize) -> StoreResult<u64>;

    /// Store `mark`, merged atomically with the mark already stored for its operation by
    /// [`OperationMark::merge`] (a mark never moves back). Returns the mark as stored.
    async fn mark_operation(&self, mark: OperationMark) -> StoreResult<OperationMark>;

    /// The mark of `operation_id`, if it was ever cancelled (and not yet swept).
    async fn operation(&self, operation_id: &str) -> StoreResult<Option<OperationMark>>;

    /// Whether side-effect writes can succeed now (the admin `/readyz`): `Err` with the
    /// reason while they fail (a failed or lost redb file, an unreachable database, a
    /// write that failed and has not succeeded since). Cheap: a probe, not a write.
    async fn ready(&self) -> Result<(), String>;
}

/// Milliseconds since the Unix epoch: records outlive processes, so they carry wall time.
pub fn now_ms() -> i64 {
    use std::time::{SystemTime, UNIX_EPOCH};
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
