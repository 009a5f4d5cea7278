//! On-disk layout of the redb store: the two record tables (id → place, place → record)
//! and the indexes that must change with them (status, expiry, operation here; the search
//! indexes in [`search`]), the operation marks, plus the read
//! queries and per-command write steps built on them. The writer thread and the read path
//! both go through here, so index upkeep lives in one place.

use std::fmt;
use std::ops::Bound;

use ::redb::{
    Database, ReadOnlyTable, ReadTransaction, ReadableDatabase, ReadableTable, Table,
    TableDefinition, WriteTransaction,
};

use crate::store::{Claim, ListFilter, OperationMark, Record, StoreError, StoreResult};

pub(super) mod search;

/// Execution id → the record's place in [`RECORD_DATA`]. Ids are hashes, so every claim
/// writes this table at a random place; its entries are small (about 60 bytes), so that
/// write copies one small leaf's worth of neighbours, once per execution.
const RECORD_IDS: TableDefinition<&str, u64> = TableDefinition::new("record_ids");
/// Place → [`Record::to_bytes`]. Places are handed out in claim order, so the records an
/// execution writes again (`committed`, then `result_delivered`) sit beside the other
/// recent ones, in the few last leaves that each batch rewrites anyway. Keyed by id, as
/// before, each of an execution's three writes copied a leaf of its own: 26 KiB written
/// per execution against 11 KiB (docs/PERFORMANCE.md, "Store: group commit and the redb writer").
const RECORD_DATA: TableDefinition<u64, &[u8]> = TableDefinition::new("record_data");
/// The layout before records were stored by place: execution id → record.
/// [`create_all`] moves what a file still holds there into the two tables above and
/// deletes it.
const LEGACY_RECORDS: TableDefinition<&str, &[u8]> = TableDefinition::new("records");
/// Empty, and never read: it takes the legacy table's name with other types, so an older
/// idemproxy that opens a file in the current layout fails on a type mismatch instead of
/// finding no records there and executing again what this one has stored.
const DOWNGRADE_GUARD: TableDefinition<u64, ()> = TableDefinition::new("records");
/// Records [`create_all`] moves per write transaction when a store opens, so the move of
/// a large file never holds more than this many records' pages dirty at once.
pub(super) const MIGRATE_CHUNK: usize = 10_000;
/// (state code, execution id): lists by status and finds `executing` records without a scan.
/// Every state but `result_delivered`: nearly every record ends there, so an entry for it
/// would be one more insert at a random place per execution (17% of the bytes a first
/// execution writes, docs/PERFORMANCE.md), and a list of delivered records walks
/// [`RECORD_IDS`] instead, where they are most of what it holds. Files written before
/// this kept delivered entries; nothing reads them, and gc removes them with their
/// records.
const BY_STATUS: TableDefinition<(u8, &str), ()> = TableDefinition::new("by_status");
/// (expires_at_ms, execution id): gc walks this from the oldest and stops at `now`.
const BY_EXPIRY: TableDefinition<(i64, &str), ()> = TableDefinition::new("by_expiry");
/// (operation id, execution id): `ListFilter.operation` (cancelling an operation).
const BY_OPERATION: TableDefinition<(&str, &str), ()> = TableDefinition::new("by_operation");
/// (external id, execution id): `ListFilter.external_id`, how a webhook event correlated by
/// `to: external_id` (or a job's status answer, by the job's id) finds its call.
const BY_EXTERNAL: TableDefinition<(&str, &str), ()> = TableDefinition::new("by_external_id");
/// (job state code, execution id): `ListFilter.job`, the running jobs the poller reads and
/// `GET /v1/jobs?state=`. Only records that started a job have an entry.
const BY_JOB: TableDefinition<(u8, &str), ()> = TableDefinition::new("by_job");
/// Index name → the last execution id whose entries are built: an index added after a file
/// was written is built when the file opens, [`MIGRATE_CHUNK`] records per transaction,
/// resuming here after a crash. The entry goes once the index is complete.
const INDEX_BUILDS: TableDefinition<&str, &str> = TableDefinition::new("index_builds");
/// The indexes [`INDEX_BUILDS`] builds for files written before them.
const BUILT_AT_OPEN: [&str; 2] = ["by_external_id", "by_job"];
/// Operation id → [`OperationMark::to_bytes`]. Marks are few (one per cancellation), so gc
/// walks the table instead of keeping an expiry index for it.
const OPERATIONS: TableDefinition<&str, &[u8]> = TableDefinition::new("operations");

/// `State::Executing.code()`, as a constant for index keys (checked by a test below).
const EXECUTING: u8 = 3;
/// `State::ResultDelivered.code()`: the state `by_status` does not index.
const DELIVERED: u8 = 5;

/// Whether records in state `code` have a `by_status` entry (see [`BY_STATUS`]).
fn status_indexed(code: u8) -> bool {
    code != DELIVERED
}

/// A redb failure of any kind. In the writer this aborts the whole batch.
pub(super) fn storage(e: impl fmt::Display) -> StoreError {
    StoreError::Backend(e.to_string())
}

/// An index names a record that is not there: the file was changed outside this store.
fn dangling(index: &str, id: &str) -> StoreError {
    StoreError::Corrupt {
        id: id.to_string(),
        reason: format!("{index} index entry without a record"),
    }
}

/// What an update needs of the version it replaces: the compare-and-set token and the keys
/// of its index entries. Decoding only these skips the stored response and history, which
/// were a quarter of the writer thread's time spent applying writes.
#[derive(serde::Deserialize)]
struct StoredMeta {
    version: u64,
    state: crate::policy::state::State,
    expires_at_ms: i64,
    #[serde(default)]
    operation_id: Option<String>,
    #[serde(default)]
    external_id: Option<String>,
    #[serde(default)]
    external_indexed: bool,
    #[serde(default)]
    job: Option<JobMeta>,
}

/// The one field of a stored job an index needs.
#[derive(serde::Deserialize)]
struct JobMeta {
    state: crate::policy::job::JobState,
}

impl StoredMeta {
    fn decode(id: &str, bytes: &[u8]) -> StoreResult<StoredMeta> {
        serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt {
            id: id.to_string(),
            reason: e.to_string(),
        })
    }

    fn keys(&self) -> IndexKeys<'_> {
        IndexKeys {
            state: self.state.code(),
            expires_at_ms: self.expires_at_ms,
            operation_id: self.operation_id.as_deref(),
            external_id: self
                .external_id
                .as_deref()
                .filter(|_| self.external_indexed),
            job: self.job.as_ref().map(|j| j.state.code()),
        }
    }
}

/// Where a stored record's index entries are.
struct IndexKeys<'a> {
    state: u8,
    expires_at_ms: i64,
    operation_id: Option<&'a str>,
    external_id: Option<&'a str>,
    job: Option<u8>,
}

impl<'a> IndexKeys<'a> {
    fn of(r: &'a Record) -> IndexKeys<'a> {
        IndexKeys {
            state: r.state().code(),
            expires_at_ms: r.expires_at_ms,
            operation_id: r.operation_id.as_deref(),
            external_id: r.external_id.as_deref().filter(|_| r.external_indexed),
            job: r.job.as_ref().map(|j| j.state.code()),
        }
    }
}

/// Creates every table, so read transactions never meet a missing one, and moves the
/// records of a file in the layout by execution id into the current layout, `chunk` records per
/// transaction. A crash part way leaves each record in exactly one of the two layouts,
/// and the next open goes on where this one stopped.
pub(super) fn create_all(db: &Database, chunk: usize) -> StoreResult<()> {
    plan_index_builds(db)?;
    let mut moved = 0u64;
    loop {
        let txn = db.begin_write().map_err(storage)?;
        let mut tables = WriteTables::open(&txn)?;
        // Every table exists from here on: read transactions never meet a missing one, and
        // the write steps open the indexes they need when they need them ([`Lazy`]).
        tables.open_all()?;
        let done = if in_legacy_layout(&txn)? {
            let (n, done) = tables.migrate(&txn, chunk)?;
            moved += n;
            done
        } else {
            true
        };
        drop(tables);
        if done {
            txn.open_table(DOWNGRADE_GUARD).map_err(storage)?;
        }
        txn.commit().map_err(storage)?;
        if done {
            break;
        }
    }
    if moved > 0 {
        tracing::info!(
            records = moved,
            "moved the store's records to the current layout"
        );
    }
    build_indexes(db, chunk)?;
    search::build(db, chunk)
}

/// Notes in [`INDEX_BUILDS`] every index of [`BUILT_AT_OPEN`] the file does not have yet
/// (written by an older idemproxy), in the transaction that creates it, so the build is
/// planned exactly once and a crash part way resumes it.
fn plan_index_builds(db: &Database) -> StoreResult<()> {
    use ::redb::TableHandle;
    let txn = db.begin_write().map_err(storage)?;
    let names: Vec<String> = txn
        .list_tables()
        .map_err(storage)?
        .map(|t| t.name().to_string())
        .collect();
    {
        let mut builds = txn.open_table(INDEX_BUILDS).map_err(storage)?;
        for index in BUILT_AT_OPEN {
            if !names.iter().any(|n| n == index) {
                builds.insert(index, "").map_err(storage)?;
            }
        }
    }
    txn.open_table(BY_EXTERNAL).map_err(storage)?;
    txn.open_table(BY_JOB).map_err(storage)?;
    txn.commit().map_err(storage)
}

/// Builds the entries of every index [`INDEX_BUILDS`] names, `chunk` records per
/// transaction in execution-id order, each transaction moving the cursor with its entries.
fn build_indexes(db: &Database, chunk: usize) -> StoreResult<()> {
    let mut built = 0u64;
    loop {
        let txn = db.begin_write().map_err(storage)?;
        let pending = {
            let builds = txn.open_table(INDEX_BUILDS).map_err(storage)?;
            let first = builds.first().map_err(storage)?;
            first.map(|(k, v)| (k.value().to_string(), v.value().to_string()))
        };
        let Some((index, cursor)) = pending else {
            break;
        };
        let done = {
            let mut tables = WriteTables::open(&txn)?;
            let (n, last) = tables.index_chunk(&index, &cursor, chunk)?;
            built += n;
            let mut builds = txn.open_table(INDEX_BUILDS).map_err(storage)?;
            match &last {
                Some(last) => builds
                    .insert(index.as_str(), last.as_str())
                    .map_err(storage)?,
                None => builds.remove(index.as_str()).map_err(storage)?,
            };
            last.is_none()
        };
        txn.commit().map_err(storage)?;
        if done {
            tracing::info!(index = %index, "built an index this file did not have yet");
        }
    }
    if built > 0 {
        tracing::info!(entries = built, "index entries built at open");
    }
    Ok(())
}

/// Whether the file has a [`LEGACY_RECORDS`] table (which a [`DOWNGRADE_GUARD`] is not).
fn in_legacy_layout(txn: &WriteTransaction) -> StoreResult<bool> {
    use ::redb::{TableError, TableHandle};
    let named = txn
        .list_tables()
        .map_err(storage)?
        .any(|t| t.name() == LEGACY_RECORDS.name());
    if !named {
        return Ok(false);
    }
    match txn.open_table(LEGACY_RECORDS) {
        Ok(_) => Ok(true),
        Err(TableError::TableTypeMismatch { .. }) => Ok(false),
        Err(e) => Err(storage(e)),
    }
}

/// The two tables that hold records: [`RECORD_IDS`] and [`RECORD_DATA`].
struct Records<I, D> {
    ids: I,
    data: D,
}

type ReadRecords = Records<ReadOnlyTable<&'static str, u64>, ReadOnlyTable<u64, &'static [u8]>>;
type WriteRecords<'t> = Records<Table<'t, &'static str, u64>, Table<'t, u64, &'static [u8]>>;

impl<I, D> Records<I, D>
where
    I: ReadableTable<&'static str, u64>,
    D: ReadableTable<u64, &'static [u8]>,
{
    /// Where record `id` is, if it is stored.
    fn place(&self, id: &str) -> StoreResult<Option<u64>> {
        Ok(self.ids.get(id).map_err(storage)?.map(|v| v.value()))
    }

    /// The record at `place`, which [`RECORD_IDS`] gave for `id`.
    fn load_at(&self, id: &str, place: u64) -> StoreResult<Record> {
        #[cfg(test)]
        LOADS.with(|n| n.set(n.get() + 1));
        match self.data.get(place).map_err(storage)? {
            Some(bytes) => Record::from_bytes(id, bytes.value()),
            None => Err(dangling("id", id)),
        }
    }

    fn load(&self, id: &str) -> StoreResult<Option<Record>> {
        Ok(self.load_placed(id)?.map(|(_, record)| record))
    }

    fn load_placed(&self, id: &str) -> StoreResult<Option<(u64, Record)>> {
        match self.place(id)? {
            Some(place) => Ok(Some((place, self.load_at(id, place)?))),
            None => Ok(None),
        }
    }
}

/// A record for a listing: one that cannot be decoded is left out with a warning naming it
/// (`records show` and the admin API still report it by id), so one bad record does not
/// hide all the others from an operator.
pub(super) fn listable(loaded: StoreResult<Record>) -> StoreResult<Option<Record>> {
    match loaded {
        Ok(r) => Ok(Some(r)),
        Err(StoreError::Corrupt { id, reason }) => {
            tracing::warn!(execution_id = %id, %reason, "listing skips an unreadable record");
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Ids in `code` after `after` (exclusive), in id order, lazily.
fn ids_in_state<'t, T: ReadableTable<(u8, &'static str), ()>>(
    by_status: &'t T,
    code: u8,
    after: Option<&str>,
) -> StoreResult<impl Iterator<Item = StoreResult<String>> + 't> {
    let lower = match after {
        Some(a) => Bound::Excluded((code, a)),
        None => Bound::Included((code, "")),
    };
    // (code + 1, "") is the smallest key of the next state.
    let range = by_status
        .range::<(u8, &str)>((lower, Bound::Excluded((code + 1, ""))))
        .map_err(storage)?;
    Ok(range.map(|entry| {
        let (key, _) = entry.map_err(storage)?;
        Ok(key.value().1.to_string())
    }))
}

fn load_mark<T: ReadableTable<&'static str, &'static [u8]>>(
    operations: &T,
    operation_id: &str,
) -> StoreResult<Option<OperationMark>> {
    match operations.get(operation_id).map_err(storage)? {
        Some(bytes) => OperationMark::from_bytes(operation_id, bytes.value()).map(Some),
        None => Ok(None),
    }
}

fn lease_stale(record: &Record, now_ms: i64) -> bool {
    // `i64::MAX` means "all of them", including a lease that runs until `i64::MAX`.
    now_ms == i64::MAX
        || record
            .lease
            .as_ref()
            .is_none_or(|lease| lease.expires_at_ms < now_ms)
}

/// A read snapshot. Every method sees the same committed state.
pub(super) struct Snapshot {
    txn: ReadTransaction,
}

impl Snapshot {
    pub(super) fn begin(db: &Database) -> StoreResult<Snapshot> {
        Ok(Snapshot {
            txn: db.begin_read().map_err(storage)?,
        })
    }

    fn records(&self) -> StoreResult<ReadRecords> {
        Ok(Records {
            ids: self.txn.open_table(RECORD_IDS).map_err(storage)?,
            data: self.txn.open_table(RECORD_DATA).map_err(storage)?,
        })
    }

    pub(super) fn get(&self, id: &str) -> StoreResult<Option<Record>> {
        self.records()?.load(id)
    }

    pub(super) fn list(&self, filter: &ListFilter) -> StoreResult<Vec<Record>> {
        search::list(&self.txn, &self.records()?, filter)
    }

    /// Records stored, and the mean stored size of the first `sample` of them (the id
    /// entry and the record entry, keys and values).
    pub(super) fn size_sample(&self, sample: usize) -> StoreResult<(u64, u64)> {
        use ::redb::ReadableTableMetadata;
        let records = self.records()?;
        let count = records.ids.len().map_err(storage)?;
        let (mut n, mut bytes) = (0u64, 0u64);
        for entry in records.ids.iter().map_err(storage)?.take(sample) {
            let (id, place) = entry.map_err(storage)?;
            let stored = records.data.get(place.value()).map_err(storage)?;
            let len = stored.map_or(0, |v| v.value().len());
            n += 1;
            bytes += (id.value().len() + 2 * 8 + len) as u64;
        }
        Ok((count, bytes.checked_div(n).unwrap_or(0)))
    }

    pub(super) fn operation(&self, operation_id: &str) -> StoreResult<Option<OperationMark>> {
        let operations = self.txn.open_table(OPERATIONS).map_err(storage)?;
        load_mark(&operations, operation_id)
    }

    pub(super) fn stale_executing(&self, now_ms: i64, limit: usize) -> StoreResult<Vec<Record>> {
        let mut out = Vec::new();
        if limit == 0 {
            return Ok(out);
        }
        let records = self.records()?;
        let by_status = self.txn.open_table(BY_STATUS).map_err(storage)?;
        for id in ids_in_state(&by_status, EXECUTING, None)? {
            let id = id?;
            let record = records.load(&id)?.ok_or_else(|| dangling("status", &id))?;
            if lease_stale(&record, now_ms) {
                out.push(record);
                if out.len() >= limit {
                    break;
                }
            }
        }
        Ok(out)
    }
}

/// The tables opened inside one write transaction (the search indexes in [`search`]). Every method either fails with
/// [`StoreError::Backend`] (redb failed: the caller aborts the batch) or checks everything
/// before its first write, so a logical refusal (Conflict, NotFound, Corrupt) writes nothing
/// and the rest of the batch goes on.
pub(super) struct WriteTables<'t> {
    records: WriteRecords<'t>,
    /// The place the next claim takes: one past the last used, so new records go to the
    /// end of [`RECORD_DATA`].
    next_place: u64,
    by_status: Table<'t, (u8, &'static str), ()>,
    by_expiry: Lazy<'t, (i64, &'static str), ()>,
    by_operation: Lazy<'t, (&'static str, &'static str), ()>,
    by_external: Lazy<'t, (&'static str, &'static str), ()>,
    by_job: Lazy<'t, (u8, &'static str), ()>,
    operations: Lazy<'t, &'static str, &'static [u8]>,
    txn: &'t WriteTransaction,
    search: Option<search::SearchTables<'t>>,
}

/// A table a write transaction opens the first time one of its steps writes it. Most
/// batches are updates (committed, delivered) that touch the records and `by_status`
/// only; opening each of the other indexes in every transaction cost about 500
/// instructions per replayed request in the replay benchmark (docs/PERFORMANCE.md).
struct Lazy<'t, K: ::redb::Key + 'static, V: ::redb::Value + 'static> {
    txn: &'t WriteTransaction,
    def: TableDefinition<'static, K, V>,
    table: Option<Table<'t, K, V>>,
}

impl<'t, K: ::redb::Key + 'static, V: ::redb::Value + 'static> Lazy<'t, K, V> {
    fn new(txn: &'t WriteTransaction, def: TableDefinition<'static, K, V>) -> Self {
        Lazy {
            txn,
            def,
            table: None,
        }
    }

    fn get(&mut self) -> StoreResult<&mut Table<'t, K, V>> {
        if self.table.is_none() {
            self.table = Some(self.txn.open_table(self.def).map_err(storage)?);
        }
        Ok(self.table.as_mut().expect("opened above"))
    }
}

impl<'t> WriteTables<'t> {
    pub(super) fn open(txn: &'t WriteTransaction) -> StoreResult<WriteTables<'t>> {
        let data = txn.open_table(RECORD_DATA).map_err(storage)?;
        let next_place = match data.last().map_err(storage)? {
            Some((place, _)) => place.value() + 1,
            None => 0,
        };
        Ok(WriteTables {
            records: Records {
                ids: txn.open_table(RECORD_IDS).map_err(storage)?,
                data,
            },
            next_place,
            by_status: txn.open_table(BY_STATUS).map_err(storage)?,
            by_expiry: Lazy::new(txn, BY_EXPIRY),
            by_operation: Lazy::new(txn, BY_OPERATION),
            by_external: Lazy::new(txn, BY_EXTERNAL),
            by_job: Lazy::new(txn, BY_JOB),
            operations: Lazy::new(txn, OPERATIONS),
            txn,
            search: None,
        })
    }

    /// Opens (and so creates) every table.
    fn open_all(&mut self) -> StoreResult<()> {
        self.by_expiry.get()?;
        self.by_operation.get()?;
        self.by_external.get()?;
        self.by_job.get()?;
        self.operations.get()?;
        self.search()?;
        Ok(())
    }

    /// The search indexes, opened by the first claim or deletion of the transaction.
    fn search(&mut self) -> StoreResult<&mut search::SearchTables<'t>> {
        if self.search.is_none() {
            self.search = Some(search::SearchTables::open(self.txn)?);
        }
        Ok(self.search.as_mut().expect("opened above"))
    }

    /// `record` comes with version 1 and `bytes` is its encoding (made by the caller, off
    /// this thread).
    pub(super) fn claim(&mut self, record: Record, bytes: &[u8]) -> StoreResult<Claim> {
        let id = record.id.as_str();
        if let Some(existing) = self.records.load(id)? {
            return Ok(Claim::Existing(existing));
        }
        let place = self.new_place(id)?;
        self.put(place, None, &record, bytes)?;
        Ok(Claim::Claimed(record))
    }

    /// Compare-and-set against `expected`; `record` already carries the next version and
    /// `bytes` is its encoding. Only the stored version's token and index keys are decoded.
    pub(super) fn update(
        &mut self,
        record: Record,
        expected: u64,
        bytes: &[u8],
    ) -> StoreResult<Record> {
        let id = record.id.clone();
        let Some(place) = self.records.place(id.as_str())? else {
            return Err(StoreError::NotFound(id));
        };
        let stored = match self.records.data.get(place).map_err(storage)? {
            Some(v) => StoredMeta::decode(id.as_str(), v.value())?,
            None => return Err(dangling("id", id.as_str())),
        };
        if stored.version != expected {
            return Err(StoreError::Conflict {
                id,
                expected,
                found: stored.version,
            });
        }
        self.put(place, Some(stored.keys()), &record, bytes)?;
        Ok(record)
    }

    /// Does not bump `version`: the owner still holds the record it read, and its next
    /// compare-and-set (commit, failure) must not lose to its own heartbeat. A takeover by
    /// another owner goes through `update`, which does bump it, and then the lease here no
    /// longer names `owner`.
    pub(super) fn renew_leases(&mut self, owner: &str, until_ms: i64) -> StoreResult<u64> {
        // Collected first: executing records are few, and the status index must not be
        // borrowed while records change.
        let ids =
            ids_in_state(&self.by_status, EXECUTING, None)?.collect::<StoreResult<Vec<_>>>()?;
        let mut renewed = Vec::new();
        for id in ids {
            match self.records.load_placed(&id) {
                Ok(Some((place, mut record))) => {
                    let Some(lease) = record.lease.as_mut() else {
                        continue;
                    };
                    if lease.owner == owner {
                        lease.expires_at_ms = until_ms;
                        renewed.push((place, record));
                    }
                }
                Ok(None) => return Err(dangling("status", &id)),
                // One unreadable record must not stop the owner's other leases from being
                // renewed (they would be taken over as stale).
                Err(e @ StoreError::Corrupt { .. }) => {
                    tracing::warn!(error = %e, "skipping unreadable record in lease renewal");
                }
                Err(e) => return Err(e),
            }
        }
        for (place, record) in &renewed {
            // Only the lease changed: no index moves.
            self.records
                .data
                .insert(place, record.to_bytes().as_slice())
                .map_err(storage)?;
        }
        Ok(renewed.len() as u64)
    }

    pub(super) fn gc(&mut self, now_ms: i64, limit: usize) -> StoreResult<u64> {
        let mut doomed = Vec::new();
        for entry in self.by_expiry.get()?.iter().map_err(storage)? {
            if doomed.len() >= limit {
                break;
            }
            let (key, _) = entry.map_err(storage)?;
            let (expires_at_ms, id) = key.value();
            if expires_at_ms > now_ms {
                break;
            }
            // An executing record is never deleted under its owner, whatever its retention.
            if self
                .by_status
                .get((EXECUTING, id))
                .map_err(storage)?
                .is_some()
            {
                continue;
            }
            match self.records.load_placed(id) {
                Ok(Some(placed)) => doomed.push(placed),
                Ok(None) => return Err(dangling("expiry", id)),
                // Without the record its index keys are unknown; leave it for an operator
                // rather than half-delete it.
                Err(e @ StoreError::Corrupt { .. }) => {
                    tracing::warn!(error = %e, "gc skips an unreadable record");
                }
                Err(e) => return Err(e),
            }
        }
        for (place, record) in &doomed {
            self.delete(*place, record)?;
        }
        let mut marks = Vec::new();
        for entry in self.operations.get()?.iter().map_err(storage)? {
            if marks.len() >= limit {
                break;
            }
            let (key, bytes) = entry.map_err(storage)?;
            match OperationMark::from_bytes(key.value(), bytes.value()) {
                Ok(mark) if mark.expires_at_ms <= now_ms => marks.push(mark.operation_id),
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "gc skips an unreadable operation mark"),
            }
        }
        for op in &marks {
            self.operations
                .get()?
                .remove(op.as_str())
                .map_err(storage)?;
        }
        Ok((doomed.len() + marks.len()) as u64)
    }

    pub(super) fn mark_operation(&mut self, mark: OperationMark) -> StoreResult<OperationMark> {
        let merged = match load_mark(self.operations.get()?, &mark.operation_id)? {
            Some(stored) => stored.merge(mark),
            None => mark,
        };
        self.operations
            .get()?
            .insert(merged.operation_id.as_str(), merged.to_bytes().as_slice())
            .map_err(storage)?;
        Ok(merged)
    }

    /// Moves up to `limit` records from [`LEGACY_RECORDS`] into the current layout (their
    /// index entries, keyed by id, stay as they are), and deletes the table once it is
    /// empty. Returns how many moved and whether that was the last of them.
    fn migrate(&mut self, txn: &WriteTransaction, limit: usize) -> StoreResult<(u64, bool)> {
        use ::redb::ReadableTableMetadata;
        let mut legacy = txn.open_table(LEGACY_RECORDS).map_err(storage)?;
        let mut moved = 0u64;
        while moved < limit as u64 {
            let Some((id, bytes)) = legacy.pop_first().map_err(storage)? else {
                break;
            };
            let place = self.new_place(id.value())?;
            self.records
                .data
                .insert(place, bytes.value())
                .map_err(storage)?;
            moved += 1;
        }
        let empty = legacy.is_empty().map_err(storage)?;
        drop(legacy);
        if empty {
            txn.delete_table(LEGACY_RECORDS).map_err(storage)?;
        }
        Ok((moved, empty))
    }

    /// The next place in [`RECORD_DATA`], taken for record `id` (its [`RECORD_IDS`] entry).
    fn new_place(&mut self, id: &str) -> StoreResult<u64> {
        let place = self.next_place;
        self.records.ids.insert(id, place).map_err(storage)?;
        self.next_place += 1;
        Ok(place)
    }

    /// Writes `new` (encoded as `bytes`) at `place` and moves its index entries from where
    /// `old` had them.
    fn put(
        &mut self,
        place: u64,
        old: Option<IndexKeys<'_>>,
        new: &Record,
        bytes: &[u8],
    ) -> StoreResult<()> {
        let id = new.id.as_str();
        self.records.data.insert(place, bytes).map_err(storage)?;

        let code = new.state().code();
        if old.as_ref().map(|o| o.state) != Some(code) {
            if let Some(old) = &old {
                self.by_status.remove((old.state, id)).map_err(storage)?;
            }
            if status_indexed(code) {
                self.by_status.insert((code, id), ()).map_err(storage)?;
            }
        }
        if old.as_ref().map(|o| o.expires_at_ms) != Some(new.expires_at_ms) {
            if let Some(old) = &old {
                self.by_expiry
                    .get()?
                    .remove((old.expires_at_ms, id))
                    .map_err(storage)?;
            }
            self.by_expiry
                .get()?
                .insert((new.expires_at_ms, id), ())
                .map_err(storage)?;
        }
        if old.is_none() {
            // Keyed by what a claim fixes for good: an update never moves them.
            self.search()?.insert(new)?;
        }
        let old_op = old.as_ref().and_then(|o| o.operation_id);
        let new_op = new.operation_id.as_deref();
        if old.is_none() || old_op != new_op {
            if let Some(op) = old_op {
                self.by_operation.get()?.remove((op, id)).map_err(storage)?;
            }
            if let Some(op) = new_op {
                self.by_operation
                    .get()?
                    .insert((op, id), ())
                    .map_err(storage)?;
            }
        }
        let new_keys = IndexKeys::of(new);
        self.move_job_entries(id, old.as_ref(), &new_keys)
    }

    /// The external-id and job entries of record `id` from `old` (none for a new record) to
    /// `new`. Both are absent for most records, so this writes nothing for them.
    fn move_job_entries(
        &mut self,
        id: &str,
        old: Option<&IndexKeys<'_>>,
        new: &IndexKeys<'_>,
    ) -> StoreResult<()> {
        let old_ext = old.and_then(|o| o.external_id);
        if old_ext != new.external_id {
            if let Some(e) = old_ext {
                self.by_external.get()?.remove((e, id)).map_err(storage)?;
            }
            if let Some(e) = new.external_id {
                self.by_external
                    .get()?
                    .insert((e, id), ())
                    .map_err(storage)?;
            }
        }
        let old_job = old.and_then(|o| o.job);
        if old_job != new.job {
            if let Some(code) = old_job {
                self.by_job.get()?.remove((code, id)).map_err(storage)?;
            }
            if let Some(code) = new.job {
                self.by_job.get()?.insert((code, id), ()).map_err(storage)?;
            }
        }
        Ok(())
    }

    /// Builds `index`'s entries for up to `limit` records after `cursor` (execution-id
    /// order). Returns how many records were read and the last id (`None`: the build is done).
    fn index_chunk(
        &mut self,
        index: &str,
        cursor: &str,
        limit: usize,
    ) -> StoreResult<(u64, Option<String>)> {
        let lower = if cursor.is_empty() {
            Bound::Unbounded
        } else {
            Bound::Excluded(cursor)
        };
        let mut batch = Vec::new();
        for entry in self
            .records
            .ids
            .range::<&str>((lower, Bound::Unbounded))
            .map_err(storage)?
        {
            let (id, place) = entry.map_err(storage)?;
            batch.push((id.value().to_string(), place.value()));
            if batch.len() > limit {
                break;
            }
        }
        let more = batch.len() > limit;
        batch.truncate(limit);
        for (id, place) in &batch {
            let meta = match self.records.data.get(*place).map_err(storage)? {
                Some(v) => StoredMeta::decode(id, v.value()),
                None => Err(dangling("id", id)),
            };
            let meta = match meta {
                Ok(m) => m,
                Err(e @ StoreError::Corrupt { .. }) => {
                    tracing::warn!(error = %e, "index build skips an unreadable record");
                    continue;
                }
                Err(e) => return Err(e),
            };
            let keys = meta.keys();
            let wanted = IndexKeys {
                external_id: keys.external_id.filter(|_| index == "by_external_id"),
                job: keys.job.filter(|_| index == "by_job"),
                ..keys
            };
            let none = IndexKeys {
                external_id: None,
                job: None,
                ..meta.keys()
            };
            self.move_job_entries(id, Some(&none), &wanted)?;
        }
        let last = if more {
            batch.last().map(|(id, _)| id.clone())
        } else {
            None
        };
        Ok((batch.len() as u64, last))
    }

    fn delete(&mut self, place: u64, record: &Record) -> StoreResult<()> {
        let id = record.id.as_str();
        self.records.ids.remove(id).map_err(storage)?;
        self.records.data.remove(place).map_err(storage)?;
        self.by_status
            .remove((record.state().code(), id))
            .map_err(storage)?;
        self.by_expiry
            .get()?
            .remove((record.expires_at_ms, id))
            .map_err(storage)?;
        if let Some(op) = record.operation_id.as_deref() {
            self.by_operation.get()?.remove((op, id)).map_err(storage)?;
        }
        if let Some(e) = IndexKeys::of(record).external_id {
            self.by_external.get()?.remove((e, id)).map_err(storage)?;
        }
        if let Some(job) = &record.job {
            self.by_job
                .get()?
                .remove((job.state.code(), id))
                .map_err(storage)?;
        }
        self.search()?.remove(record)
    }
}

/// The number of entries in the external-id and job indexes, for tests.
#[cfg(test)]
pub(super) fn job_index_sizes(db: &Database) -> [u64; 2] {
    use ::redb::ReadableTableMetadata;
    let txn = db.begin_read().expect("test reads its own database");
    [
        txn.open_table(BY_EXTERNAL).expect("table exists").len(),
        txn.open_table(BY_JOB).expect("table exists").len(),
    ]
    .map(|n| n.expect("len reads"))
}

/// Deletes the external-id and job indexes, as a file written before them lacks them.
#[cfg(test)]
pub(super) fn drop_job_indexes(db: &Database) {
    let txn = db.begin_write().expect("test writes its own database");
    txn.delete_table(BY_EXTERNAL).expect("deletes");
    txn.delete_table(BY_JOB).expect("deletes");
    txn.delete_table(INDEX_BUILDS).expect("deletes");
    txn.commit().expect("commits");
}

#[cfg(test)]
thread_local! {
    /// Records decoded on this thread (tests count what a listing reads).
    pub(super) static LOADS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// The number of entries in each table (records, status, expiry, operation), for tests
/// that check the indexes stay in step with the records.
#[cfg(test)]
pub(super) fn table_sizes(db: &Database) -> [u64; 4] {
    use ::redb::ReadableTableMetadata;
    let txn = db.begin_read().expect("test reads its own database");
    let ids = txn.open_table(RECORD_IDS).expect("table exists");
    let data = txn.open_table(RECORD_DATA).expect("table exists");
    assert_eq!(ids.len().ok(), data.len().ok(), "one id entry per record");
    [
        ids.len(),
        txn.open_table(BY_STATUS).expect("table exists").len(),
        txn.open_table(BY_EXPIRY).expect("table exists").len(),
        txn.open_table(BY_OPERATION).expect("table exists").len(),
    ]
    .map(|n| n.expect("len reads"))
}

/// Rewrites the file as an older store (layout by execution id) would have written it:
/// [`LEGACY_RECORDS`], keyed by id, and no [`RECORD_IDS`] or [`RECORD_DATA`].
#[cfg(test)]
pub(super) fn rewrite_in_legacy_layout(db: &Database) {
    let txn = db.begin_write().expect("test writes its own database");
    txn.delete_table(DOWNGRADE_GUARD).expect("deletes");
    {
        let ids = txn.open_table(RECORD_IDS).expect("table exists");
        let data = txn.open_table(RECORD_DATA).expect("table exists");
        let mut legacy = txn.open_table(LEGACY_RECORDS).expect("table opens");
        for entry in ids.iter().expect("iterates") {
            let (id, place) = entry.expect("reads");
            let bytes = data.get(place.value()).expect("reads").expect("stored");
            legacy.insert(id.value(), bytes.value()).expect("inserts");
        }
    }
    txn.delete_table(RECORD_IDS).expect("deletes");
    txn.delete_table(RECORD_DATA).expect("deletes");
    txn.commit().expect("commits");
}

/// The names of the file's tables.
#[cfg(test)]
pub(super) fn table_names(db: &Database) -> Vec<String> {
    use ::redb::TableHandle;
    let txn = db.begin_read().expect("test reads its own database");
    let names = txn.list_tables().expect("lists");
    names.map(|t| t.name().to_string()).collect()
}

#[cfg(test)]
#[test]
fn index_codes_match_the_state_machine() {
    use crate::policy::state::State;
    assert_eq!(State::Executing.code(), EXECUTING);
    assert_eq!(State::ResultDelivered.code(), DELIVERED);
}
