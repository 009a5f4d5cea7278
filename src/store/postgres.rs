//! PostgreSQL store (`store.backend: postgres`): the same [`Store`] contract as redb, shared
//! by any number of proxy instances. Each row holds the record's [`Record::to_bytes`] plus
//! the few columns the queries filter on, written together in every statement.
//!
//! # Design
//!
//! **Client and pool.** `tokio-postgres` with `deadpool-postgres`. Every store operation is
//! one or two fixed statements, so a plain async client with a per-connection prepared
//! statement cache (`prepare_cached`) is all we need; `sqlx` would add a macro and
//! offline-metadata layer and a second runtime abstraction for no gain here. deadpool is
//! the pool built for tokio-postgres: small, no background threads, and wait/create
//! timeouts so a database outage turns into a prompt [`StoreError::Backend`] instead of a
//! hung request. Connections use `NoTls` for now (a database on loopback or a private
//! network); TLS to the database is a later addition in [`PostgresStore::connect`].
//! Every connection runs with `synchronous_commit=on`, so a returned `Ok` means the
//! commit is flushed to the WAL whatever the server default is.
//!
//! **Claim.** `INSERT ... ON CONFLICT (id) DO NOTHING`: one atomic statement. Among any
//! number of concurrent claims of one id, on any number of instances, exactly one inserts
//! a row; the others wait for its commit, insert nothing and then read the winner's row.
//! A claimed record is stored at version 1.
//!
//! **Fencing.** The `version` column is the fencing token. Every update is
//! `UPDATE ... SET version = $2 + 1 ... WHERE id = $1 AND version = $2`, so a write based on
//! an old read changes nothing and comes back as [`StoreError::Conflict`]. When instance A
//! pauses past its lease, B sees the record in [`Store::stale_executing`] and moves it to
//! `outcome_unknown` with the version it read; A's late commit still carries the older
//! version and is refused. `renew_leases` deliberately does not bump the version (the
//! owner's own later commit must still match), so the `lease_expires_at_ms` column, not
//! the copy inside `body`, is authoritative for the lease: reads overlay it on the record,
//! and an owner's update of a still-executing record never moves its lease backwards.
//!
//! **One clock.** Instances' wall clocks may disagree (a skewed host, a bad NTP step).
//! Every time decision two instances must agree on is therefore made with the database's
//! clock, inside the statement (`statement_timestamp()`): a lease is written as "now plus
//! the lease" on that clock, [`Store::stale_executing`] compares with it, and the row keeps
//! when the record last moved to `executing` (`sent_at_ms`) so a reader learns the age of
//! the last send ([`Record::send_age`]) for a lookup's settle window. The trait still speaks
//! in this instance's milliseconds; only their distance from this instance's `now_ms()`
//! (a duration) crosses to the database, and reads come back as durations too (time left
//! on a lease, age of a send). Wall-clock skew between instances therefore changes no
//! decision; what remains assumed is that a process is not paused (GC, SIGSTOP, a frozen
//! VM) for longer than its lease between renewals, and even then fencing (below) keeps a
//! paused owner from committing over a takeover (docs/STORES.md).
//!
//! **Retention sweep.** `DELETE ... WHERE id IN (SELECT id ... FOR UPDATE SKIP LOCKED LIMIT n)`:
//! concurrent sweepers lock disjoint batches, so no row is deleted twice and none is
//! skipped for good (a row locked by another sweeper is either deleted by it or seen by
//! the next pass). `executing` rows are excluded in the inner and the outer condition.
//!
//! **Errors.** A failed statement does not poison the store (unlike redb's sticky I/O
//! error: PostgreSQL rolls the statement back, so the next call may succeed). A commit
//! whose acknowledgement is lost surfaces as an error even if it took effect; callers
//! fail closed on errors, and the lease/`outcome_unknown` path covers that case. Error
//! text carries the operation, SQLSTATE and server message, never a DETAIL line (which
//! can quote row values) and never the connection URL.

mod schema;

use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::{NoTls, Row};

use super::{
    now_ms, Claim, JobFilter, Lease, ListFilter, OperationMark, OperationState, ReadAge, Record,
    SendAge, Store, StoreError, StoreResult,
};
use crate::policy::identity::ExecutionId;
use crate::policy::state::State;

/// The schema used when the configuration does not name one.
pub const DEFAULT_SCHEMA: &str = "idemproxy";

/// Connections per instance. Each request needs a connection only for the duration of
/// one statement, so a small pool serves many concurrent requests.
const POOL_SIZE: usize = 16;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a request waits for a free connection before failing with `Backend`.
const POOL_WAIT_TIMEOUT: Duration = Duration::from_secs(10);
/// Every store call's deadline, on the client (a frozen server cannot enforce its own
/// `statement_timeout`) and on the server (a statement stuck on a lock).
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long `/readyz` waits for the database to answer `SELECT 1`.
const READY_PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// Bounded retries of claim's insert-then-read when the row vanishes in between (gc).
const CLAIM_ATTEMPTS: usize = 3;

/// The database's clock in milliseconds since the epoch, as SQL: every time decision
/// instances must agree on (lease expiry, takeover, the age of the last send) is made
/// with it, in the statement, never with an instance's clock. `statement_timestamp()`
/// is one value for the whole statement (all our statements are single-statement
/// transactions, so it is also the transaction's time).
macro_rules! db_now {
    () => {
        "(extract(epoch from statement_timestamp()) * 1000)::bigint"
    };
}

/// The columns every read selects, in the order [`decode_row`] expects. The lease is read
/// as the time it has left on the database's clock and the last send as its age there:
/// both are durations, which mean the same on every instance whatever its wall clock.
const COLUMNS: &str = concat!(
    "id, version, lease_owner, lease_expires_at_ms - ",
    db_now!(),
    ", body, ",
    db_now!(),
    " - sent_at_ms"
);
/// The columns of an operation mark, in the order [`decode_mark`] expects.
const MARK_COLUMNS: &str = "id, state, cancelled_by, cancelled_at_ms, updated_at_ms, expires_at_ms";

/// Records in PostgreSQL, one row per execution. Cheap to share: clone the `Arc` it sits
/// in; the pool is internally synchronised.
pub struct PostgresStore {
    pool: Pool,
    sql: Sql,
    /// Why the last write failed, until a write succeeds again (readiness).
    write_failure: std::sync::Mutex<Option<String>>,
}

/// Statement texts, qualified with the store's schema once at connect time.
struct Sql {
    table: String,
    claim: String,
    get: String,
    version_of: String,
    update: String,
    stale: String,
    stale_all: String,
    renew: String,
    gc: String,
    mark_operation: String,
    operation: String,
    gc_operations: String,
}

impl Sql {
    fn new(schema: &str) -> Sql {
        let table = format!("{}.records", schema::quote(schema));
        let operations = format!("{}.operations", schema::quote(schema));
        Sql {
            claim: format!(
                "INSERT INTO {table} (id, version, state, operation_id, lease_owner, \
                 lease_expires_at_ms, expires_at_ms, created_at_ms, body, sent_at_ms, \
                 upstream, route, tool_call_id, idem_key, external_id, job_state) \
                 VALUES ($1, $2, $3, $4, $5, $6::bigint + {now}, $7, $8, $9, \
                 CASE WHEN $3::text = 'executing' THEN {now} END, $10, $11, $12, $13, $14, $15) \
                 ON CONFLICT (id) DO NOTHING",
                now = db_now!()
            ),
            get: format!("SELECT {COLUMNS} FROM {table} WHERE id = $1"),
            version_of: format!("SELECT version FROM {table} WHERE id = $1"),
            // The lease only ever moves forward while the same owner keeps executing: the
            // caller's copy may predate a renewal (see the module docs).
            // `$7` is the lease's time left (see `Columns`), `sent_at_ms` moves on every
            // move into `executing`, both on the database's clock.
            update: format!(
                "UPDATE {table} SET version = $3, state = $4::text, operation_id = $5, \
                 lease_owner = $6::text, \
                 lease_expires_at_ms = CASE \
                     WHEN state = 'executing' AND $4::text = 'executing' \
                         AND lease_owner = $6::text \
                     THEN GREATEST(lease_expires_at_ms, $7::bigint + {now}) \
                     ELSE $7::bigint + {now} END, \
                 sent_at_ms = CASE WHEN $4::text = 'executing' AND state <> 'executing' \
                     THEN {now} ELSE sent_at_ms END, \
                 expires_at_ms = $8, created_at_ms = $9, body = $10, \
                 external_id = $11, job_state = $12 \
                 WHERE id = $1 AND version = $2 \
                 RETURNING lease_expires_at_ms - {now}, {now} - sent_at_ms",
                now = db_now!()
            ),
            stale: format!(
                "SELECT {COLUMNS} FROM {table} WHERE state = 'executing' \
                 AND (lease_expires_at_ms IS NULL OR lease_expires_at_ms < $1::bigint + {now}) \
                 ORDER BY lease_expires_at_ms NULLS FIRST, id LIMIT $2",
                now = db_now!()
            ),
            stale_all: format!(
                "SELECT {COLUMNS} FROM {table} WHERE state = 'executing' \
                 ORDER BY lease_expires_at_ms NULLS FIRST, id LIMIT $1"
            ),
            renew: format!(
                "UPDATE {table} \
                 SET lease_expires_at_ms = GREATEST(COALESCE(lease_expires_at_ms, \
                     $2::bigint + {now}), $2::bigint + {now}) \
                 WHERE state = 'executing' AND lease_owner = $1",
                now = db_now!()
            ),
            // The outer condition repeats the inner one so that the delete itself, not
            // only the candidate scan, can never remove an executing or retained row.
            gc: format!(
                "DELETE FROM {table} WHERE id IN ( \
                     SELECT id FROM {table} \
                     WHERE expires_at_ms < $1 AND state <> 'executing' \
                     ORDER BY expires_at_ms LIMIT $2 \
                     FOR UPDATE SKIP LOCKED) \
                 AND expires_at_ms < $1 AND state <> 'executing'"
            ),
            // OperationMark::merge as one atomic statement: the state only moves forward,
            // the first cancellation keeps its author and time, retention only grows.
            mark_operation: format!(
                "INSERT INTO {operations} AS o (id, state, cancelled_by, cancelled_at_ms, \
                 updated_at_ms, expires_at_ms) VALUES ($1, $2, $3, $4, $5, $6) \
                 ON CONFLICT (id) DO UPDATE SET \
                 state = CASE WHEN o.state = 'cancelled_after_side_effect' \
                     OR EXCLUDED.state = 'cancelled_after_side_effect' \
                     THEN 'cancelled_after_side_effect' ELSE 'cancelled' END, \
                 updated_at_ms = GREATEST(o.updated_at_ms, EXCLUDED.updated_at_ms), \
                 expires_at_ms = GREATEST(o.expires_at_ms, EXCLUDED.expires_at_ms) \
                 RETURNING {MARK_COLUMNS}"
            ),
            operation: format!("SELECT {MARK_COLUMNS} FROM {operations} WHERE id = $1"),
            gc_operations: format!(
                "DELETE FROM {operations} WHERE id IN ( \
                     SELECT id FROM {operations} WHERE expires_at_ms < $1 \
                     ORDER BY expires_at_ms LIMIT $2 FOR UPDATE SKIP LOCKED) \
                 AND expires_at_ms < $1"
            ),
            table,
        }
    }

    /// `list`'s conditions are all optional; each combination is its own statement text
    /// (cached per connection) so the planner can use the matching index. The parameters
    /// follow [`list_conditions`]' order, then the limit.
    fn list(&self, filter: &ListFilter) -> String {
        let mut conds = Vec::new();
        let mut n = 0;
        for (cond, _) in list_conditions(filter, &filter.status.map(State::as_str)) {
            n += 1;
            conds.push(format!("{cond} ${n}"));
        }
        let limit = format!("${}", n + 1);
        let where_ = if conds.is_empty() {
            String::new()
        } else {
            format!(" WHERE {}", conds.join(" AND "))
        };
        format!(
            "SELECT {COLUMNS} FROM {}{where_} ORDER BY id LIMIT {limit}",
            self.table
        )
    }
}

impl PostgresStore {
    /// Connect to `url` (a libpq-style URL or key=value string, usually read from the
    /// environment variable named by `store.url_env`), create `schema` if missing and
    /// migrate it to the current version. Fails if the database is unreachable, the
    /// schema name is not a plain identifier, or the schema is newer than this build.
    pub async fn connect(url: &str, schema: &str) -> StoreResult<PostgresStore> {
        schema::validate_schema_name(schema)?;
        // Never echo the URL: it may carry a password.
        let mut config: tokio_postgres::Config = url
            .parse()
            .map_err(|e| db_error("parse the postgres URL", &e))?;
        let ours = format!(
            "-c synchronous_commit=on -c statement_timeout={}",
            STATEMENT_TIMEOUT.as_millis()
        );
        let options = match config.get_options() {
            Some(o) if !o.is_empty() => format!("{o} {ours}"),
            _ => ours,
        };
        // A dead peer (a host gone, a partition) is noticed on idle pooled connections too.
        config.keepalives(true);
        config.keepalives_idle(Duration::from_secs(10));
        config.options(options);
        if config.get_application_name().is_none() {
            config.application_name("idemproxy");
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        let manager = Manager::from_config(
            config,
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(POOL_SIZE)
            .wait_timeout(Some(POOL_WAIT_TIMEOUT))
            .create_timeout(Some(CONNECT_TIMEOUT))
            .runtime(Runtime::Tokio1)
            .build()
            .map_err(|e| StoreError::Backend(format!("postgres pool: {e}")))?;
        let store = PostgresStore {
            pool,
            sql: Sql::new(schema),
            write_failure: std::sync::Mutex::new(None),
        };
        let mut client = store.client("connect").await?;
        schema::migrate(&mut client, schema).await?;
        Ok(store)
    }

    async fn client(&self, context: &str) -> StoreResult<deadpool_postgres::Client> {
        self.pool.get().await.map_err(|e| match e {
            deadpool_postgres::PoolError::Backend(e) => db_error(context, &e),
            other => StoreError::Backend(format!("postgres {context}: {other}")),
        })
    }

    async fn fetch(&self, id: &ExecutionId) -> StoreResult<Option<Record>> {
        let client = self.client("get").await?;
        let stmt = client
            .prepare_cached(&self.sql.get)
            .await
            .map_err(|e| db_error("get", &e))?;
        let row = client
            .query_opt(&stmt, &[&id.0])
            .await
            .map_err(|e| db_error("get", &e))?;
        row.as_ref().map(decode_row).transpose()
    }

    async fn query_records(
        &self,
        context: &str,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> StoreResult<Vec<Record>> {
        let client = self.client(context).await?;
        let stmt = client
            .prepare_cached(sql)
            .await
            .map_err(|e| db_error(context, &e))?;
        let rows = client
            .query(&stmt, params)
            .await
            .map_err(|e| db_error(context, &e))?;
        rows.iter().map(decode_row).collect()
    }
}

/// The statements behind [`Store`]; the trait methods give each one its deadline.
impl PostgresStore {
    async fn claim_now(&self, mut record: Record) -> StoreResult<Claim> {
        record.version = 1;
        let cols = Columns::of(&record);
        let body = record.to_bytes();
        let version = db_version(record.version)?;
        for _ in 0..CLAIM_ATTEMPTS {
            let client = self.client("claim").await?;
            let stmt = client
                .prepare_cached(&self.sql.claim)
                .await
                .map_err(|e| db_error("claim", &e))?;
            let inserted = client
                .execute(
                    &stmt,
                    &[
                        &record.id.0,
                        &version,
                        &cols.state,
                        &cols.operation_id,
                        &cols.lease_owner,
                        &cols.lease_left_ms,
                        &cols.expires_at_ms,
                        &cols.created_at_ms,
                        &body,
                        // The search columns: fixed by the claim, never updated.
                        &record.upstream,
                        &record.route,
                        &record.tool_call_id,
                        &record.key,
                        // Written by every update too (a job moves, an external id appears).
                        &cols.external_id,
                        &cols.job_state,
                    ],
                )
                .await
                .map_err(|e| db_error("claim", &e))?;
            drop(client);
            if inserted == 1 {
                return Ok(Claim::Claimed(record));
            }
            // Someone else holds the id. The winner's insert is committed (ON CONFLICT
            // waited for it), so this fresh statement sees its row, unless gc removed it
            // in between, in which case claiming again is correct.
            if let Some(existing) = self.fetch(&record.id).await? {
                return Ok(Claim::Existing(existing));
            }
        }
        Err(StoreError::Backend(format!(
            "postgres claim {}: the existing record kept disappearing",
            record.id
        )))
    }

    async fn get_now(&self, id: &ExecutionId) -> StoreResult<Option<Record>> {
        self.fetch(id).await
    }

    async fn update_now(&self, mut record: Record) -> StoreResult<Record> {
        let expected = record.version;
        let next = expected
            .checked_add(1)
            .ok_or_else(|| StoreError::Backend(format!("record {} version overflow", record.id)))?;
        record.version = next;
        let cols = Columns::of(&record);
        let body = record.to_bytes();
        let (expected_db, next_db) = (db_version(expected)?, db_version(next)?);
        let client = self.client("update").await?;
        let stmt = client
            .prepare_cached(&self.sql.update)
            .await
            .map_err(|e| db_error("update", &e))?;
        let row = client
            .query_opt(
                &stmt,
                &[
                    &record.id.0,
                    &expected_db,
                    &next_db,
                    &cols.state,
                    &cols.operation_id,
                    &cols.lease_owner,
                    &cols.lease_left_ms,
                    &cols.expires_at_ms,
                    &cols.created_at_ms,
                    &body,
                    &cols.external_id,
                    &cols.job_state,
                ],
            )
            .await
            .map_err(|e| db_error("update", &e))?;
        if let Some(row) = row {
            let lease_left: Option<i64> = row.try_get(0).map_err(|e| db_error("update", &e))?;
            let send_age: Option<i64> = row.try_get(1).map_err(|e| db_error("update", &e))?;
            if let (Some(lease), Some(left)) = (record.lease.as_mut(), lease_left) {
                lease.expires_at_ms = now_ms().saturating_add(left);
            }
            record.send_age = read_age(send_age);
            return Ok(record);
        }
        // Nothing matched: tell a stale version from a missing record. A fresh statement
        // sees the write that beat us.
        let stmt = client
            .prepare_cached(&self.sql.version_of)
            .await
            .map_err(|e| db_error("update", &e))?;
        let found = client
            .query_opt(&stmt, &[&record.id.0])
            .await
            .map_err(|e| db_error("update", &e))?;
        match found {
            None => Err(StoreError::NotFound(record.id)),
            Some(row) => {
                let found: i64 = row.try_get(0).map_err(|e| db_error("update", &e))?;
                Err(StoreError::Conflict {
                    found: stored_version(&record.id.0, found)?,
                    id: record.id,
                    expected,
                })
            }
        }
    }

    async fn list_now(&self, filter: &ListFilter) -> StoreResult<Vec<Record>> {
        let sql = self.sql.list(filter);
        let limit = db_limit(filter.limit);
        let status = filter.status.map(State::as_str);
        let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> =
            list_conditions(filter, &status)
                .into_iter()
                .map(|(_, p)| p)
                .collect();
        params.push(&limit);
        let client = self.client("list").await?;
        let stmt = client
            .prepare_cached(&sql)
            .await
            .map_err(|e| db_error("list", &e))?;
        let rows = client
            .query(&stmt, &params)
            .await
            .map_err(|e| db_error("list", &e))?;
        // One unreadable row is left out with a warning, not the whole page.
        let mut out = Vec::with_capacity(rows.len());
        for row in &rows {
            match decode_row(row) {
                Ok(r) => out.push(r),
                Err(StoreError::Corrupt { id, reason }) => {
                    tracing::warn!(execution_id = %id, %reason, "listing skips an unreadable record");
                }
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    async fn stale_executing_now(&self, now_ms: i64, limit: usize) -> StoreResult<Vec<Record>> {
        let limit = db_limit(limit);
        if now_ms == i64::MAX {
            self.query_records("stale_executing", &self.sql.stale_all, &[&limit])
                .await
        } else {
            // Only how far `now_ms` lies from this instance's clock counts: the database's
            // clock decides which leases expired.
            let from_now = now_ms.saturating_sub(super::now_ms());
            self.query_records("stale_executing", &self.sql.stale, &[&from_now, &limit])
                .await
        }
    }

    async fn renew_leases_now(&self, owner: &str, until_ms: i64) -> StoreResult<u64> {
        let client = self.client("renew_leases").await?;
        let stmt = client
            .prepare_cached(&self.sql.renew)
            .await
            .map_err(|e| db_error("renew_leases", &e))?;
        let from_now = until_ms.saturating_sub(now_ms());
        client
            .execute(&stmt, &[&owner, &from_now])
            .await
            .map_err(|e| db_error("renew_leases", &e))
    }

    async fn gc_now(&self, now_ms: i64, limit: usize) -> StoreResult<u64> {
        let limit = db_limit(limit);
        let client = self.client("gc").await?;
        let mut removed = 0;
        for sql in [&self.sql.gc, &self.sql.gc_operations] {
            let stmt = client
                .prepare_cached(sql)
                .await
                .map_err(|e| db_error("gc", &e))?;
            removed += client
                .execute(&stmt, &[&now_ms, &limit])
                .await
                .map_err(|e| db_error("gc", &e))?;
        }
        Ok(removed)
    }

    async fn mark_operation_now(&self, mark: OperationMark) -> StoreResult<OperationMark> {
        let client = self.client("mark_operation").await?;
        let stmt = client
            .prepare_cached(&self.sql.mark_operation)
            .await
            .map_err(|e| db_error("mark_operation", &e))?;
        let row = client
            .query_one(
                &stmt,
                &[
                    &mark.operation_id,
                    &mark.state.as_str(),
                    &mark.by,
                    &mark.cancelled_at_ms,
                    &mark.updated_at_ms,
                    &mark.expires_at_ms,
                ],
            )
            .await
            .map_err(|e| db_error("mark_operation", &e))?;
        decode_mark(&row)
    }

    async fn operation_now(&self, operation_id: &str) -> StoreResult<Option<OperationMark>> {
        let client = self.client("operation").await?;
        let stmt = client
            .prepare_cached(&self.sql.operation)
            .await
            .map_err(|e| db_error("operation", &e))?;
        let row = client
            .query_opt(&stmt, &[&operation_id])
            .await
            .map_err(|e| db_error("operation", &e))?;
        row.as_ref().map(decode_mark).transpose()
    }
}

#[async_trait]
impl Store for PostgresStore {
    async fn claim(&self, record: Record) -> StoreResult<Claim> {
        let result = deadline("claim", self.claim_now(record)).await;
        self.note_write(result)
    }

    async fn get(&self, id: &ExecutionId) -> StoreResult<Option<Record>> {
        deadline("get", self.get_now(id)).await
    }

    async fn update(&self, record: Record) -> StoreResult<Record> {
        let result = deadline("update", self.update_now(record)).await;
        self.note_write(result)
    }

    async fn list(&self, filter: &ListFilter) -> StoreResult<Vec<Record>> {
        deadline("list", self.list_now(filter)).await
    }

    async fn stale_executing(&self, now_ms: i64, limit: usize) -> StoreResult<Vec<Record>> {
        deadline("stale_executing", self.stale_executing_now(now_ms, limit)).await
    }

    async fn renew_leases(&self, owner: &str, until_ms: i64) -> StoreResult<u64> {
        let result = deadline("renew_leases", self.renew_leases_now(owner, until_ms)).await;
        self.note_write(result)
    }

    async fn gc(&self, now_ms: i64, limit: usize) -> StoreResult<u64> {
        deadline("gc", self.gc_now(now_ms, limit)).await
    }

    async fn mark_operation(&self, mark: OperationMark) -> StoreResult<OperationMark> {
        let result = deadline("mark_operation", self.mark_operation_now(mark)).await;
        self.note_write(result)
    }

    async fn operation(&self, operation_id: &str) -> StoreResult<Option<OperationMark>> {
        deadline("operation", self.operation_now(operation_id)).await
    }

    /// Not ready while the last write failed (until one succeeds: the lease keeper writes
    /// every third of a lease) or while the database does not answer a probe in time.
    async fn ready(&self) -> Result<(), String> {
        if let Some(why) = self.write_failure.lock().map_err(|_| "poisoned")?.clone() {
            return Err(format!("the last write failed: {why}"));
        }
        let probe = async {
            let client = self.client("ready").await?;
            client
                .simple_query("SELECT 1")
                .await
                .map_err(|e| db_error("ready", &e))?;
            Ok::<(), StoreError>(())
        };
        match tokio::time::timeout(READY_PROBE_TIMEOUT, probe).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!(
                "postgres ready: no answer within {READY_PROBE_TIMEOUT:?}"
            )),
        }
    }
}

/// `op` with the store's deadline: a database that stops answering (frozen, a network
/// partition that drops packets) turns into a prompt [`StoreError::Backend`] instead of a
/// call that hangs as long as the fault lasts. A write cut off this way may still take
/// effect; callers re-read rather than assume it did not (see [`Store`]).
async fn deadline<T>(
    op: &str,
    call: impl std::future::Future<Output = StoreResult<T>>,
) -> StoreResult<T> {
    match tokio::time::timeout(STATEMENT_TIMEOUT, call).await {
        Ok(result) => result,
        Err(_) => Err(StoreError::Backend(format!(
            "postgres {op}: no answer within {STATEMENT_TIMEOUT:?}"
        ))),
    }
}

impl PostgresStore {
    /// Remembers whether the last write reached the database, for [`Store::ready`].
    fn note_write<T>(&self, result: StoreResult<T>) -> StoreResult<T> {
        let failure = match &result {
            Err(StoreError::Backend(why)) => Some(why.clone()),
            _ => None,
        };
        if let Ok(mut last) = self.write_failure.lock() {
            *last = failure;
        }
        result
    }
}

/// A row (selected as [`MARK_COLUMNS`]) as an operation mark.
fn decode_mark(row: &Row) -> StoreResult<OperationMark> {
    let id: String = row.try_get(0).map_err(|e| db_error("read mark", &e))?;
    let corrupt = |reason: String| StoreError::Corrupt {
        id: id.clone(),
        reason,
    };
    let state: String = row.try_get(1).map_err(|e| corrupt(e.to_string()))?;
    Ok(OperationMark {
        state: OperationState::parse(&state)
            .ok_or_else(|| corrupt(format!("unknown operation state {state:?}")))?,
        by: row.try_get(2).map_err(|e| corrupt(e.to_string()))?,
        cancelled_at_ms: row.try_get(3).map_err(|e| corrupt(e.to_string()))?,
        updated_at_ms: row.try_get(4).map_err(|e| corrupt(e.to_string()))?,
        expires_at_ms: row.try_get(5).map_err(|e| corrupt(e.to_string()))?,
        operation_id: id,
    })
}

/// The denormalised columns, always derived from the record being written.
/// The conditions of a listing, each with its parameter, in one fixed order (the
/// statement text is cached per combination).
/// `status` is `filter.status` by name (the parameter is text).
fn list_conditions<'f>(
    filter: &'f ListFilter,
    status: &'f Option<&'static str>,
) -> Vec<(&'static str, &'f (dyn tokio_postgres::types::ToSql + Sync))> {
    let mut out: Vec<(&'static str, &'f (dyn tokio_postgres::types::ToSql + Sync))> = Vec::new();
    if let Some(s) = status {
        out.push(("state =", s));
    }
    let text = [
        ("operation_id =", &filter.operation),
        ("tool_call_id =", &filter.tool_call),
        ("idem_key =", &filter.key),
        ("upstream =", &filter.upstream),
        ("route =", &filter.route),
    ];
    for (cond, value) in text {
        if let Some(v) = value {
            out.push((cond, v));
        }
    }
    if let Some(t) = &filter.since {
        out.push(("created_at_ms >=", t));
    }
    if let Some(t) = &filter.until {
        out.push(("created_at_ms <", t));
    }
    if let Some(e) = &filter.external_id {
        out.push(("external_id =", e));
    }
    match filter.job {
        None => {}
        // Any state: every row with a job (`<> ''` is never true of NULL).
        Some(JobFilter::Any) => out.push(("job_state <>", &NO_JOB_STATE)),
        Some(JobFilter::In(s)) => out.push(("job_state =", &JOB_STATE_NAMES[s.code() as usize])),
    }
    if let Some(a) = &filter.after {
        out.push(("id >", &a.0));
    }
    out
}

/// `JobState::as_str` by `JobState::code`, as statics a listing's parameters can borrow.
static JOB_STATE_NAMES: [&str; 3] = ["running", "succeeded", "failed"];
static NO_JOB_STATE: &str = "";

struct Columns<'a> {
    state: &'static str,
    operation_id: Option<&'a str>,
    lease_owner: Option<&'a str>,
    /// The lease's time left by this instance's clock: the statement adds the database's
    /// clock to it, so the stored expiry is on the one clock all instances share.
    lease_left_ms: Option<i64>,
    expires_at_ms: i64,
    created_at_ms: i64,
    external_id: Option<&'a str>,
    job_state: Option<&'static str>,
}

impl<'a> Columns<'a> {
    fn of(r: &'a Record) -> Columns<'a> {
        Columns {
            state: r.state().as_str(),
            operation_id: r.operation_id.as_deref(),
            lease_owner: r.lease.as_ref().map(|l| l.owner.as_str()),
            lease_left_ms: r
                .lease
                .as_ref()
                .map(|l| l.expires_at_ms.saturating_sub(now_ms())),
            expires_at_ms: r.expires_at_ms,
            created_at_ms: r.created_at_ms,
            external_id: r.external_id.as_deref().filter(|_| r.external_indexed),
            job_state: r.job.as_ref().map(|j| j.state.as_str()),
        }
    }
}

/// A row (selected as [`COLUMNS`]) as a record. The `version` and lease columns win over
/// the copies inside `body`: they are what the CAS and the lease renewal write.
fn decode_row(row: &Row) -> StoreResult<Record> {
    let id: String = row.try_get(0).map_err(|e| db_error("read row", &e))?;
    let corrupt = |reason: String| StoreError::Corrupt {
        id: id.clone(),
        reason,
    };
    let version: i64 = row.try_get(1).map_err(|e| corrupt(e.to_string()))?;
    let owner: Option<String> = row.try_get(2).map_err(|e| corrupt(e.to_string()))?;
    let lease_left: Option<i64> = row.try_get(3).map_err(|e| corrupt(e.to_string()))?;
    let body: &[u8] = row.try_get(4).map_err(|e| corrupt(e.to_string()))?;
    let send_age: Option<i64> = row.try_get(5).map_err(|e| corrupt(e.to_string()))?;
    let mut record = Record::from_bytes(&id, body)?;
    if record.id.0 != id {
        return Err(corrupt(format!("body belongs to {}", record.id)));
    }
    record.version = stored_version(&id, version)?;
    record.send_age = read_age(send_age);
    // The expiry on this instance's clock: now plus what the database says is left.
    record.lease = match (owner, lease_left) {
        (Some(owner), Some(left)) => Some(Lease {
            owner,
            expires_at_ms: now_ms().saturating_add(left),
        }),
        (None, None) => None,
        _ => return Err(corrupt("lease owner and expiry disagree".into())),
    };
    Ok(record)
}

/// The age of the last send as read (`None`: the row predates `sent_at_ms`, or was never sent).
fn read_age(age_ms: Option<i64>) -> ReadAge {
    ReadAge(age_ms.map(|age_ms| SendAge {
        age_ms,
        read_at: std::time::Instant::now(),
    }))
}

fn db_version(v: u64) -> StoreResult<i64> {
    i64::try_from(v).map_err(|_| StoreError::Backend(format!("version {v} exceeds bigint")))
}

fn stored_version(id: &str, v: i64) -> StoreResult<u64> {
    u64::try_from(v).map_err(|_| StoreError::Corrupt {
        id: id.to_string(),
        reason: format!("negative version {v}"),
    })
}

fn db_limit(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

/// A driver error as [`StoreError::Backend`]: operation, SQLSTATE and message only. The
/// server's DETAIL can quote row contents (a failing row, a duplicate key), so it is left
/// out, and so is anything that could echo the connection string.
pub(super) fn db_error(context: &str, e: &tokio_postgres::Error) -> StoreError {
    if let Some(db) = e.as_db_error() {
        return StoreError::Backend(format!(
            "postgres {context}: {} {}: {}",
            db.severity(),
            db.code().code(),
            db.message()
        ));
    }
    let mut text = format!("postgres {context}: {e}");
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    StoreError::Backend(text)
}

/// These run against a real PostgreSQL server named by `IDEMPROXY_TEST_POSTGRES_URL`; each
/// test works in its own freshly created schema and drops it afterwards.
#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    use super::*;
    use crate::policy::identity::{ArgsHash, TenantScope};
    use crate::policy::state::Event;
    use crate::store::NewRecord;

    const URL_VAR: &str = "IDEMPROXY_TEST_POSTGRES_URL";
    const NOW: i64 = 1_000_000;

    fn url() -> String {
        match std::env::var(URL_VAR) {
            Ok(url) if !url.is_empty() => url,
            _ => panic!(
                "{URL_VAR} is not set: the PostgreSQL store tests need a real server \
                 (e.g. {URL_VAR}=postgres://postgres@127.0.0.1:5432/test); they never skip"
            ),
        }
    }

    fn unique_schema() -> String {
        use std::hash::{BuildHasher, Hasher};
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
        h.write_u32(std::process::id());
        h.write_i64(crate::store::now_ms());
        format!("idemproxy_test_{:016x}", h.finish())
    }

    async fn raw_client(url: &str) -> tokio_postgres::Client {
        let (client, conn) = tokio_postgres::connect(url, NoTls)
            .await
            .expect("test database reachable");
        tokio::spawn(conn);
        client
    }

    /// Runs `body(url, schema)` on a fresh schema and drops the schema afterwards, also
    /// when the body panics (the panic is re-raised after cleanup).
    async fn with_schema<F, Fut>(body: F)
    where
        F: FnOnce(String, String) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let url = url();
        let schema = unique_schema();
        let outcome = tokio::spawn(body(url.clone(), schema.clone())).await;
        raw_client(&url)
            .await
            .batch_execute(&format!(
                "DROP SCHEMA IF EXISTS {} CASCADE",
                schema::quote(&schema)
            ))
            .await
            .expect("drop the test schema");
        if let Err(e) = outcome {
            match e.try_into_panic() {
                Ok(panic) => std::panic::resume_unwind(panic),
                Err(e) => panic!("test body did not finish: {e}"),
            }
        }
    }

    async fn store(url: &str, schema: &str) -> PostgresStore {
        PostgresStore::connect(url, schema)
            .await
            .expect("connect and migrate")
    }

    fn record(id: &str, operation: &str, expires_at_ms: i64) -> Record {
        Record::new(NewRecord {
            id: ExecutionId(id.into()),
            tenant: TenantScope("tenant".into()),
            upstream: "mail".into(),
            route: "send_email".into(),
            tool_version: "v1".into(),
            operation_id: Some(operation.into()),
            args_hash: ArgsHash("ab".into()),
            method: "POST".into(),
            path: "/send".into(),
            query: None,
            path_params: vec![],
            preview: None,
            now_ms: NOW,
            expires_at_ms,
        })
    }

    /// Leases cross to the database as "time left" and come back the same way (see the
    /// module docs), so a lease read back may differ from the one written by the few
    /// milliseconds the round trip took: compare records with that tolerance.
    fn assert_same(a: &Record, b: &Record) {
        let at = |r: &Record| r.lease.as_ref().map(|l| l.expires_at_ms);
        match (at(a), at(b)) {
            (Some(x), Some(y)) => assert!((x - y).abs() < 1000, "leases {x} and {y} differ"),
            (x, y) => assert_eq!(x, y),
        }
        let strip = |r: &Record| {
            let mut r = r.clone();
            if let Some(l) = r.lease.as_mut() {
                l.expires_at_ms = 0;
            }
            r
        };
        assert_eq!(strip(a), strip(b));
    }

    fn assert_near(at: Option<i64>, want: i64) {
        let at = at.expect("a lease");
        assert!(
            (at - want).abs() < 1000,
            "lease at {at}, expected about {want}"
        );
    }

    fn start(mut r: Record, owner: &str, lease_until: i64) -> Record {
        r.apply(Event::Start, NOW, None)
            .expect("start is legal here");
        r.lease = Some(Lease {
            owner: owner.into(),
            expires_at_ms: lease_until,
        });
        r
    }

    fn claimed(c: Claim) -> Record {
        match c {
            Claim::Claimed(r) => r,
            Claim::Existing(r) => panic!("expected a fresh claim, found {} existing", r.id),
        }
    }

    fn id(s: &str) -> ExecutionId {
        ExecutionId(s.into())
    }

    #[tokio::test]
    async fn claim_get_update_and_cas_conflict() {
        with_schema(|url, schema| async move {
            let s = store(&url, &schema).await;
            let first = claimed(
                s.claim(record("ex_1", "op_1", NOW + 100))
                    .await
                    .expect("claim"),
            );
            assert_eq!(first.version, 1, "a claimed record is stored at version 1");

            let again = s
                .claim(record("ex_1", "op_1", NOW + 100))
                .await
                .expect("claim");
            match again {
                Claim::Existing(r) => assert_eq!(r, first),
                Claim::Claimed(_) => panic!("second claim of one id must not succeed"),
            }
            assert_eq!(s.get(&id("ex_1")).await.expect("get"), Some(first.clone()));
            assert_eq!(s.get(&id("ex_none")).await.expect("get"), None);

            let running = s
                .update(start(first.clone(), "a", NOW + 50))
                .await
                .expect("CAS on the current version");
            assert_eq!(running.version, 2);
            assert_same(
                &s.get(&id("ex_1")).await.expect("get").expect("present"),
                &running,
            );

            // A writer still holding version 1 is refused and writes nothing.
            let mut stale = first.clone();
            stale.note = Some("late".into());
            match s.update(stale).await {
                Err(StoreError::Conflict {
                    id: cid,
                    expected,
                    found,
                }) => {
                    assert_eq!((cid.0.as_str(), expected, found), ("ex_1", 1, 2));
                }
                other => panic!("expected Conflict, got {other:?}"),
            }
            assert_same(
                &s.get(&id("ex_1")).await.expect("get").expect("present"),
                &running,
            );

            let mut ghost = record("ex_ghost", "op_1", NOW);
            ghost.version = 1;
            assert!(matches!(
                s.update(ghost).await,
                Err(StoreError::NotFound(g)) if g.0 == "ex_ghost"
            ));

            // The filter columns follow the record on every write.
            let row = raw_client(&url)
                .await
                .query_one(
                    &format!(
                        "SELECT version, state, operation_id, lease_owner, lease_expires_at_ms, \
                         expires_at_ms, created_at_ms FROM {}.records WHERE id = 'ex_1'",
                        schema::quote(&schema)
                    ),
                    &[],
                )
                .await
                .expect("row");
            let cols: (
                i64,
                String,
                Option<String>,
                Option<String>,
                Option<i64>,
                i64,
                i64,
            ) = (
                row.get(0),
                row.get(1),
                row.get(2),
                row.get(3),
                row.get(4),
                row.get(5),
                row.get(6),
            );
            // The lease column is on the database's clock: NOW + 50 by this process's
            // clock, which is the database server's clock here (same machine).
            assert_near(cols.4, NOW + 50);
            assert_eq!(
                (cols.0, cols.1, cols.2, cols.3, cols.5, cols.6),
                (
                    2,
                    "executing".into(),
                    Some("op_1".into()),
                    Some("a".into()),
                    NOW + 100,
                    NOW
                )
            );
        })
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_claims_across_three_instances_execute_once() {
        with_schema(|url, schema| async move {
            // Migrate first so the three "proxies" start on an existing schema; the
            // concurrent-migration case has its own test.
            drop(store(&url, &schema).await);
            let mut instances = Vec::new();
            for _ in 0..3 {
                instances.push(Arc::new(store(&url, &schema).await));
            }
            let mut tasks = Vec::new();
            for i in 0..50 {
                let s = Arc::clone(&instances[i % 3]);
                let owner = format!("instance_{}", i % 3);
                tasks.push(tokio::spawn(async move {
                    let r = start(record("ex_dup", "op_1", NOW + 100), &owner, NOW + 50);
                    s.claim(r).await.expect("claim")
                }));
            }
            let mut winners = Vec::new();
            let mut existing = Vec::new();
            for t in tasks {
                match t.await.expect("claim task") {
                    Claim::Claimed(r) => winners.push(r),
                    Claim::Existing(r) => existing.push(r),
                }
            }
            assert_eq!(winners.len(), 1, "exactly one claim wins");
            assert_eq!(existing.len(), 49);
            let winner = &winners[0];
            // Every loser sees the winner's record.
            for r in &existing {
                assert_same(r, winner);
            }
        })
        .await;
    }

    #[tokio::test]
    async fn late_commit_after_lease_takeover_is_fenced() {
        with_schema(|url, schema| async move {
            let a = store(&url, &schema).await;
            let b = store(&url, &schema).await;
            let mine = claimed(
                a.claim(start(
                    record("ex_f", "op_1", NOW + 100_000),
                    "a",
                    NOW + 10_000,
                ))
                .await
                .expect("claim"),
            );

            // A pauses; its lease runs out; B, the sweeper, takes the decision.
            let stale = b.stale_executing(NOW + 11_000, 10).await.expect("stale");
            assert_eq!(stale.len(), 1);
            let mut taken = stale[0].clone();
            assert_eq!(taken.version, mine.version);
            taken
                .apply(Event::LoseOutcome, NOW + 11, Some("lease expired".into()))
                .expect("executing -> outcome_unknown");
            let decided = b.update(taken).await.expect("B's CAS wins");

            // A resumes and tries to commit with the version it read before pausing.
            let mut late = mine.clone();
            late.apply(Event::Commit, NOW + 12, None)
                .expect("executing -> committed in A's memory");
            match a.update(late).await {
                Err(StoreError::Conflict {
                    expected, found, ..
                }) => assert_eq!((expected, found), (mine.version, decided.version)),
                other => panic!("A's late commit must be fenced, got {other:?}"),
            }
            // A's renewal can no longer resurrect the lease either.
            assert_eq!(a.renew_leases("a", NOW + 100_000).await.expect("renew"), 0);
            let now = a.get(&id("ex_f")).await.expect("get").expect("present");
            assert_eq!(now.state(), State::OutcomeUnknown);
            assert_eq!(now.lease, None);
            assert_eq!(now, decided);
        })
        .await;
    }

    #[tokio::test]
    async fn stale_executing_finds_expired_and_unleased_records() {
        with_schema(|url, schema| async move {
            let s = store(&url, &schema).await;
            let far = NOW + 10_000;
            s.claim(start(record("ex_expired", "op", far), "a", NOW - 2_000))
                .await
                .expect("claim");
            s.claim(start(record("ex_live", "op", far), "a", NOW + 5_000))
                .await
                .expect("claim");
            let mut unleased = start(record("ex_unleased", "op", far), "a", 0);
            unleased.lease = None;
            s.claim(unleased).await.expect("claim");
            s.claim(record("ex_prepared", "op", far))
                .await
                .expect("claim");

            let ids = |v: Vec<Record>| v.into_iter().map(|r| r.id.0).collect::<Vec<_>>();
            assert_eq!(
                ids(s.stale_executing(NOW, 10).await.expect("stale")),
                ["ex_unleased", "ex_expired"],
                "no lease first, then oldest lease"
            );
            assert_eq!(
                ids(s.stale_executing(NOW, 1).await.expect("stale")),
                ["ex_unleased"]
            );
            let mut all = ids(s.stale_executing(i64::MAX, 10).await.expect("stale"));
            all.sort();
            assert_eq!(all, ["ex_expired", "ex_live", "ex_unleased"]);
        })
        .await;
    }

    #[tokio::test]
    async fn renew_leases_extends_only_the_owners_executing_records() {
        with_schema(|url, schema| async move {
            let s = store(&url, &schema).await;
            let far = NOW + 10_000;
            let a1 = claimed(
                s.claim(start(record("ex_a1", "op", far), "a", NOW + 5_000))
                    .await
                    .expect("claim"),
            );
            s.claim(start(record("ex_a2", "op", far), "a", NOW + 5_000))
                .await
                .expect("claim");
            s.claim(start(record("ex_b1", "op", far), "b", NOW + 5_000))
                .await
                .expect("claim");

            assert_eq!(s.renew_leases("a", NOW + 100_000).await.expect("renew"), 2);
            assert_eq!(
                s.renew_leases("nobody", NOW + 100_000)
                    .await
                    .expect("renew"),
                0
            );
            let stale = s.stale_executing(NOW + 50_000, 10).await.expect("stale");
            assert_eq!(
                stale.iter().map(|r| r.id.0.as_str()).collect::<Vec<_>>(),
                ["ex_b1"]
            );
            // A renewal never moves a lease backwards.
            assert_eq!(s.renew_leases("a", NOW + 20_000).await.expect("renew"), 2);

            let renewed = s.get(&id("ex_a1")).await.expect("get").expect("present");
            assert_eq!(renewed.version, a1.version, "renewal is not a decision");
            assert_near(
                renewed.lease.as_ref().map(|l| l.expires_at_ms),
                NOW + 100_000,
            );

            // The owner's copy predates the renewal; writing it keeps the later lease.
            let mut own = a1.clone();
            own.external_id = Some("msg_1".into());
            let written = s.update(own).await.expect("owner's CAS still matches");
            assert_near(
                written.lease.as_ref().map(|l| l.expires_at_ms),
                NOW + 100_000,
            );
            assert_same(
                &s.get(&id("ex_a1")).await.expect("get").expect("present"),
                &written,
            );

            // Once committed the record has no lease and is not renewed.
            let mut done = written;
            done.apply(Event::Commit, NOW + 30, None)
                .expect("executing -> committed");
            let done = s.update(done).await.expect("commit");
            assert_eq!(done.lease, None);
            assert_eq!(s.renew_leases("a", NOW + 200_000).await.expect("renew"), 1);
        })
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn gc_from_two_instances_deletes_each_expired_row_once() {
        with_schema(|url, schema| async move {
            let a = Arc::new(store(&url, &schema).await);
            let b = Arc::new(store(&url, &schema).await);
            let expired = 60;
            for i in 0..expired {
                let mut r = record(&format!("ex_old_{i:03}"), "op", NOW - 1 - i as i64);
                if i % 3 == 0 {
                    r.apply(Event::Cancel, NOW - 5, None).expect("cancel");
                }
                a.claim(r).await.expect("claim");
            }
            for i in 0..5 {
                a.claim(start(
                    record(&format!("ex_run_{i}"), "op", NOW - 100),
                    "a",
                    NOW - 1,
                ))
                .await
                .expect("claim");
            }
            for i in 0..10 {
                a.claim(record(&format!("ex_keep_{i}"), "op", NOW + 1))
                    .await
                    .expect("claim");
            }

            let sweep = |s: Arc<PostgresStore>| async move {
                let mut total = 0;
                loop {
                    let n = s.gc(NOW, 7).await.expect("gc");
                    if n == 0 {
                        return total;
                    }
                    total += n;
                }
            };
            let (da, db) = tokio::join!(
                tokio::spawn(sweep(Arc::clone(&a))),
                tokio::spawn(sweep(Arc::clone(&b)))
            );
            let (da, db) = (da.expect("sweeper a"), db.expect("sweeper b"));
            // A sweeper may stop early on rows the other has locked; a final pass finds
            // nothing left either way.
            let rest = a.gc(NOW, 1000).await.expect("gc");
            assert_eq!(
                da + db + rest,
                expired,
                "each expired row deleted exactly once"
            );
            assert_eq!(rest, 0);

            let left = a
                .list(&ListFilter {
                    limit: 1000,
                    ..ListFilter::default()
                })
                .await
                .expect("list");
            let mut names: Vec<_> = left.iter().map(|r| r.id.0.clone()).collect();
            names.sort();
            let mut want: Vec<String> = (0..5)
                .map(|i| format!("ex_run_{i}"))
                .chain((0..10).map(|i| format!("ex_keep_{i}")))
                .collect();
            want.sort();
            assert_eq!(names, want, "executing and retained records survive");
        })
        .await;
    }

    #[tokio::test]
    async fn external_ids_and_jobs_are_indexed_and_backfilled_by_migration_5() {
        use crate::policy::job::JobState;
        use crate::store::JobFilter;
        with_schema(|url, schema| async move {
            let s = store(&url, &schema).await;
            let job = |id_: &str, job: &str, state: JobState| {
                let mut r = start(record(id_, "op", NOW + 100), "me", NOW + 10_000);
                r.apply(Event::Commit, NOW, None).expect("commit");
                r.lease = None;
                r.external_id = Some(job.into());
                r.external_indexed = true;
                r.job = Some(crate::store::record::Job {
                    id: job.into(),
                    state,
                    result: None,
                    event: None,
                    ended_by: None,
                    started_at_ms: NOW,
                    updated_at_ms: NOW,
                });
                r
            };
            for r in [
                job("ex_a", "job_1", JobState::Running),
                job("ex_b", "job_2", JobState::Running),
                job("ex_c", "job_1", JobState::Succeeded),
                {
                    // An external id nothing looks up: kept, not indexed.
                    let mut plain = record("ex_d", "op", NOW + 100);
                    plain.external_id = Some("job_1".into());
                    plain
                },
            ] {
                s.claim(r).await.expect("claim");
            }
            let ids = |v: Vec<Record>| v.into_iter().map(|r| r.id.0).collect::<Vec<_>>();
            let check = |s: PostgresStore| async move {
                let by_ext = s
                    .list(&ListFilter {
                        external_id: Some("job_1".into()),
                        limit: 10,
                        ..ListFilter::default()
                    })
                    .await
                    .expect("list");
                assert_eq!(ids(by_ext), ["ex_a", "ex_c"]);
                let running = s
                    .list(&ListFilter {
                        job: Some(JobFilter::In(JobState::Running)),
                        limit: 10,
                        ..ListFilter::default()
                    })
                    .await
                    .expect("list");
                assert_eq!(ids(running), ["ex_a", "ex_b"]);
                let any = s
                    .list(&ListFilter {
                        job: Some(JobFilter::Any),
                        after: Some(id("ex_a")),
                        limit: 10,
                        ..ListFilter::default()
                    })
                    .await
                    .expect("list");
                assert_eq!(ids(any), ["ex_b", "ex_c"]);
                s
            };
            let s = check(s).await;
            // A job that ends moves in the index with the row.
            let mut b = s.get(&id("ex_b")).await.expect("get").expect("row");
            b.job.as_mut().expect("job").state = JobState::Failed;
            s.update(b).await.expect("update");
            let failed = s
                .list(&ListFilter {
                    job: Some(JobFilter::In(JobState::Failed)),
                    limit: 10,
                    ..ListFilter::default()
                })
                .await
                .expect("list");
            assert_eq!(ids(failed), ["ex_b"]);
            let mut b = s.get(&id("ex_b")).await.expect("get").expect("row");
            b.job.as_mut().expect("job").state = JobState::Running;
            s.update(b).await.expect("update");
            drop(s);
            // Rows written before migration 5 get their columns from their bodies.
            let q = schema::quote(&schema);
            raw_client(&url)
                .await
                .batch_execute(&format!(
                    "ALTER TABLE {q}.records DROP COLUMN external_id, DROP COLUMN job_state; \
                     DELETE FROM {q}.schema_migrations WHERE version = 5"
                ))
                .await
                .expect("back to version 4");
            check(store(&url, &schema).await).await;
        })
        .await;
    }

    #[tokio::test]
    async fn list_pages_in_id_order_with_filters() {
        with_schema(|url, schema| async move {
            let s = store(&url, &schema).await;
            for i in 0..25 {
                let op = if i % 2 == 0 { "op_even" } else { "op_odd" };
                let mut r = record(&format!("ex_{i:02}"), op, NOW + 100);
                if i % 5 == 0 {
                    r.apply(Event::Cancel, NOW, None).expect("cancel");
                }
                s.claim(r).await.expect("claim");
            }
            let page = |after: Option<&str>, limit: usize| ListFilter {
                after: after.map(id),
                limit,
                ..ListFilter::default()
            };

            let mut seen = Vec::new();
            let mut after: Option<String> = None;
            loop {
                let got = s.list(&page(after.as_deref(), 10)).await.expect("list");
                if got.is_empty() {
                    break;
                }
                assert!(got.len() <= 10);
                after = got.last().map(|r| r.id.0.clone());
                seen.extend(got.into_iter().map(|r| r.id.0));
            }
            let all: Vec<String> = (0..25).map(|i| format!("ex_{i:02}")).collect();
            assert_eq!(seen, all, "pages cover every record once, in id order");

            let ids = |v: Vec<Record>| v.into_iter().map(|r| r.id.0).collect::<Vec<_>>();
            let cancelled = ListFilter {
                status: Some(State::CancelledBeforeCommit),
                limit: 100,
                ..ListFilter::default()
            };
            assert_eq!(
                ids(s.list(&cancelled).await.expect("list")),
                ["ex_00", "ex_05", "ex_10", "ex_15", "ex_20"]
            );
            let odd_cancelled = ListFilter {
                operation: Some("op_odd".into()),
                after: Some(id("ex_05")),
                ..cancelled.clone()
            };
            assert_eq!(ids(s.list(&odd_cancelled).await.expect("list")), ["ex_15"]);
            let odd = ListFilter {
                operation: Some("op_odd".into()),
                limit: 3,
                ..ListFilter::default()
            };
            assert_eq!(
                ids(s.list(&odd).await.expect("list")),
                ["ex_01", "ex_03", "ex_05"]
            );
            assert!(s.list(&page(None, 0)).await.expect("list").is_empty());
        })
        .await;
    }

    /// The search filters and paging, as every store runs them (`store::conformance`).
    #[tokio::test]
    async fn search_filters_and_pages_like_every_store() {
        with_schema(|url, schema| async move {
            let s = store(&url, &schema).await;
            crate::store::conformance::search(&s).await;
        })
        .await;
    }

    #[tokio::test]
    async fn jobs_and_external_ids_list_like_every_store() {
        with_schema(|url, schema| async move {
            let s = store(&url, &schema).await;
            crate::store::conformance::jobs(&s).await;
        })
        .await;
    }

    /// Each search filter is answered through its index, not a scan of the table: the
    /// plans of `list`'s own statements over 20,000 rows.
    #[tokio::test]
    async fn search_filters_use_their_indexes() {
        with_schema(|url, schema| async move {
            let s = store(&url, &schema).await;
            let q = schema::quote(&schema);
            let client = raw_client(&url).await;
            let body = record("ex_x", "op", NOW).to_bytes();
            client
                .execute(
                    &format!(
                        "INSERT INTO {q}.records (id, version, state, operation_id, expires_at_ms, \
                         created_at_ms, body, upstream, route, tool_call_id, idem_key) \
                         SELECT 'ex_' || lpad(i::text, 6, '0'), 1, 'result_delivered', \
                         'op_' || (i % 500), 1, 1000000 + i, $1, 'up_' || (i % 4), \
                         'route_' || (i % 40), 'call_' || i, 'key_' || i \
                         FROM generate_series(1, 20000) AS i"
                    ),
                    &[&body],
                )
                .await
                .expect("insert rows");
            client
                .batch_execute(&format!("ANALYZE {q}.records"))
                .await
                .expect("analyze");
            let text = |v: &str| Some(v.to_string());
            for (filter, index) in [
                (
                    ListFilter {
                        tool_call: text("call_77"),
                        ..ListFilter::default()
                    },
                    "records_tool_call_idx",
                ),
                (
                    ListFilter {
                        key: text("key_77"),
                        ..ListFilter::default()
                    },
                    "records_key_idx",
                ),
                (
                    ListFilter {
                        upstream: text("up_1"),
                        route: text("route_5"),
                        ..ListFilter::default()
                    },
                    "records_route_idx",
                ),
                (
                    ListFilter {
                        route: text("route_5"),
                        ..ListFilter::default()
                    },
                    "records_route_name_idx",
                ),
                (
                    ListFilter {
                        since: Some(1_000_100),
                        until: Some(1_000_200),
                        ..ListFilter::default()
                    },
                    "records_created_idx",
                ),
            ] {
                let filter = ListFilter {
                    limit: 50,
                    ..filter
                };
                let sql = format!("EXPLAIN {}", s.sql.list(&filter));
                let status = filter.status.map(State::as_str);
                let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> =
                    list_conditions(&filter, &status)
                        .into_iter()
                        .map(|(_, p)| p)
                        .collect();
                let limit = db_limit(filter.limit);
                params.push(&limit);
                let plan: Vec<String> = client
                    .query(&sql, &params)
                    .await
                    .expect("explain")
                    .iter()
                    .map(|r| r.get::<_, String>(0))
                    .collect();
                let plan = plan.join("\n");
                assert!(
                    plan.contains(index),
                    "{filter:?} does not use {index}:\n{plan}"
                );
                assert!(!plan.contains("Seq Scan"), "{filter:?} scans:\n{plan}");
            }
        })
        .await;
    }

    /// Rows an older build wrote (schema version 3) get their upstream and route from
    /// their body when migration 4 runs, and are found by them.
    #[tokio::test]
    async fn migration_4_makes_older_rows_searchable() {
        with_schema(|url, schema| async move {
            let q = schema::quote(&schema);
            let store3 = store(&url, &schema).await;
            let mut client = store3.client("test").await.expect("client");
            // What version 3 left: the schema up to it, then a row of that layout.
            client
                .batch_execute(&format!("DROP SCHEMA {q} CASCADE"))
                .await
                .expect("drop");
            schema::migrate_to(&mut client, &schema, 3)
                .await
                .expect("migrate to 3");
            let mut old = record("ex_old", "op", NOW + 100);
            old.upstream = "pay".into();
            old.route = "refund".into();
            client
                .execute(
                    &format!(
                        "INSERT INTO {q}.records (id, version, state, operation_id, \
                         expires_at_ms, created_at_ms, body) \
                         VALUES ($1, 1, 'prepared', 'op', $2, $3, $4)"
                    ),
                    &[
                        &old.id.0,
                        &old.expires_at_ms,
                        &old.created_at_ms,
                        &old.to_bytes(),
                    ],
                )
                .await
                .expect("insert an old row");
            drop(client);
            drop(store3);
            let s = store(&url, &schema).await;
            for filter in [
                ListFilter {
                    upstream: Some("pay".into()),
                    route: Some("refund".into()),
                    ..ListFilter::default()
                },
                ListFilter {
                    route: Some("refund".into()),
                    ..ListFilter::default()
                },
                ListFilter {
                    upstream: Some("pay".into()),
                    ..ListFilter::default()
                },
            ] {
                let found = s
                    .list(&ListFilter {
                        limit: 10,
                        ..filter.clone()
                    })
                    .await
                    .expect("list");
                let ids: Vec<_> = found.iter().map(|r| r.id.0.as_str()).collect();
                assert_eq!(ids, ["ex_old"], "{filter:?}");
            }
        })
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_starts_migrate_once() {
        with_schema(|url, schema| async move {
            let starts: Vec<_> = (0..4)
                .map(|_| {
                    let (url, schema) = (url.clone(), schema.clone());
                    tokio::spawn(async move { PostgresStore::connect(&url, &schema).await })
                })
                .collect();
            for s in starts {
                s.await.expect("connect task").expect("concurrent connect");
            }
            store(&url, &schema).await; // and again, on an up-to-date schema

            let client = raw_client(&url).await;
            let q = schema::quote(&schema);
            let versions: Vec<i32> = client
                .query(
                    &format!("SELECT version FROM {q}.schema_migrations ORDER BY version"),
                    &[],
                )
                .await
                .expect("migrations")
                .iter()
                .map(|r| r.get(0))
                .collect();
            let want: Vec<i32> = (1..=schema::latest_version()).collect();
            assert_eq!(versions, want, "each migration applied exactly once");

            // A schema from a newer build is refused rather than written to.
            client
                .batch_execute(&format!(
                    "INSERT INTO {q}.schema_migrations (version) VALUES (9999)"
                ))
                .await
                .expect("fake a newer schema");
            match PostgresStore::connect(&url, &schema).await {
                Err(StoreError::Backend(msg)) => assert!(msg.contains("newer"), "{msg}"),
                Err(other) => panic!("unexpected error {other}"),
                Ok(_) => panic!("a newer schema must be refused"),
            }
        })
        .await;
    }

    #[tokio::test]
    async fn pooled_connections_commit_synchronously() {
        with_schema(|url, schema| async move {
            let s = store(&url, &schema).await;
            let client = s.client("test").await.expect("pooled connection");
            let row = client
                .query_one(
                    "SELECT current_setting('synchronous_commit'), \
                     current_setting('application_name')",
                    &[],
                )
                .await
                .expect("settings");
            let (sync, app): (String, String) = (row.get(0), row.get(1));
            assert_eq!((sync.as_str(), app.as_str()), ("on", "idemproxy"));

            // Options in the URL are kept, but cannot switch durability off.
            let sep = if url.contains('?') { '&' } else { '?' };
            let weakened = format!("{url}{sep}options=-c%20synchronous_commit%3Doff");
            let s = store(&weakened, &schema).await;
            let client = s.client("test").await.expect("pooled connection");
            let sync: String = client
                .query_one("SELECT current_setting('synchronous_commit')", &[])
                .await
                .expect("setting")
                .get(0);
            assert_eq!(sync, "on");
        })
        .await;
    }

    #[tokio::test]
    async fn unreadable_rows_are_reported_not_panicked_on() {
        with_schema(|url, schema| async move {
            let s = store(&url, &schema).await;
            s.claim(record("ex_bad", "op", NOW + 100))
                .await
                .expect("claim");
            raw_client(&url)
                .await
                .batch_execute(&format!(
                    "UPDATE {}.records SET body = '\\x00ff'::bytea WHERE id = 'ex_bad'",
                    schema::quote(&schema)
                ))
                .await
                .expect("corrupt the row");
            match s.get(&id("ex_bad")).await {
                Err(StoreError::Corrupt { id, .. }) => assert_eq!(id, "ex_bad"),
                other => panic!("expected Corrupt, got {other:?}"),
            }
            // A listing leaves the unreadable row out instead of failing whole.
            s.claim(record("ex_good", "op", NOW + 100))
                .await
                .expect("claim");
            let listed = s
                .list(&ListFilter {
                    limit: 10,
                    ..ListFilter::default()
                })
                .await
                .expect("list");
            assert_eq!(
                listed.iter().map(|r| r.id.0.as_str()).collect::<Vec<_>>(),
                ["ex_good"]
            );
        })
        .await;
    }

    fn mark(op: &str, state: OperationState, at: i64, expires: i64) -> OperationMark {
        OperationMark {
            operation_id: op.into(),
            state,
            by: format!("by_{at}"),
            cancelled_at_ms: at,
            updated_at_ms: at,
            expires_at_ms: expires,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn operation_marks_merge_forward_across_instances_and_expire() {
        use OperationState::{Cancelled, CancelledAfterSideEffect};
        with_schema(|url, schema| async move {
            let a = Arc::new(store(&url, &schema).await);
            let b = Arc::new(store(&url, &schema).await);
            assert_eq!(a.operation("op_a").await.expect("read"), None);

            // Racing first marks from two instances: one row, the stronger state wins.
            let (x, y) = tokio::join!(
                tokio::spawn({
                    let a = Arc::clone(&a);
                    async move { a.mark_operation(mark("op_a", Cancelled, 10, 100)).await }
                }),
                tokio::spawn({
                    let b = Arc::clone(&b);
                    async move {
                        b.mark_operation(mark("op_a", CancelledAfterSideEffect, 10, 100))
                            .await
                    }
                })
            );
            x.expect("task").expect("mark");
            y.expect("task").expect("mark");
            let stored = b.operation("op_a").await.expect("read").expect("present");
            assert_eq!(stored.state, CancelledAfterSideEffect);

            // A later, weaker mark cannot move it back or rename who cancelled first.
            let merged = a
                .mark_operation(mark("op_a", Cancelled, 20, 50))
                .await
                .expect("mark");
            assert_eq!(merged.state, CancelledAfterSideEffect);
            assert_eq!((merged.by.as_str(), merged.cancelled_at_ms), ("by_10", 10));
            assert_eq!((merged.updated_at_ms, merged.expires_at_ms), (20, 100));
            assert_eq!(
                b.operation("op_a").await.expect("read"),
                Some(merged.clone())
            );

            let up = a
                .mark_operation(mark("op_b", Cancelled, 5, 30))
                .await
                .expect("mark");
            assert_eq!(up.state, Cancelled);
            let up = b
                .mark_operation(mark("op_b", CancelledAfterSideEffect, 40, 30))
                .await
                .expect("mark");
            assert_eq!(
                (up.state, up.by.as_str()),
                (CancelledAfterSideEffect, "by_5")
            );

            // gc sweeps expired marks beside records: op_b expired at 30, op_a lives on.
            a.claim(record("ex_old", "op", 5)).await.expect("claim");
            assert_eq!(a.gc(31, 10).await.expect("gc"), 2, "one record + one mark");
            assert_eq!(a.operation("op_b").await.expect("read"), None);
            assert_eq!(a.operation("op_a").await.expect("read"), Some(merged));
            assert_eq!(a.gc(101, 10).await.expect("gc"), 1);
            assert_eq!(a.operation("op_a").await.expect("read"), None);
        })
        .await;
    }

    #[tokio::test]
    async fn connect_refuses_a_bad_schema_name_before_touching_the_network() {
        // Port 1 is never a PostgreSQL server: success here would mean no validation.
        let err = PostgresStore::connect("postgres://nobody@127.0.0.1:1/x", "drop table;")
            .await
            .err()
            .expect("refused");
        assert!(err.to_string().contains("invalid schema name"), "{err}");
    }

    #[tokio::test]
    async fn errors_do_not_echo_the_connection_url() {
        let err = PostgresStore::connect("postgres://u:s3cret@127.0.0.1:1/x", "idemproxy")
            .await
            .err()
            .expect("nothing listens on port 1");
        let text = err.to_string();
        assert!(matches!(err, StoreError::Backend(_)), "{text}");
        assert!(!text.contains("s3cret"), "{text}");
    }
}
