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
//! Lease expiry is compared with the caller's wall clock (`now_ms`), so instances need
//! roughly synchronised clocks; skew only shifts *when* a lease counts as expired, never
//! lets two writers commit, because the CAS decides.
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

use super::{Claim, Lease, ListFilter, Record, Store, StoreError, StoreResult};
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
/// Bounded retries of claim's insert-then-read when the row vanishes in between (gc).
const CLAIM_ATTEMPTS: usize = 3;

/// The columns every read selects, in the order [`decode_row`] expects.
const COLUMNS: &str = "id, version, lease_owner, lease_expires_at_ms, body";

/// Records in PostgreSQL, one row per execution. Cheap to share: clone the `Arc` it sits
/// in; the pool is internally synchronised.
pub struct PostgresStore {
    pool: Pool,
    sql: Sql,
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
}

impl Sql {
    fn new(schema: &str) -> Sql {
        let table = format!("{}.records", schema::quote(schema));
        Sql {
            claim: format!(
                "INSERT INTO {table} (id, version, state, operation_id, lease_owner, \
                 lease_expires_at_ms, expires_at_ms, created_at_ms, body) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
                 ON CONFLICT (id) DO NOTHING"
            ),
            get: format!("SELECT {COLUMNS} FROM {table} WHERE id = $1"),
            version_of: format!("SELECT version FROM {table} WHERE id = $1"),
            // The lease only ever moves forward while the same owner keeps executing: the
            // caller's copy may predate a renewal (see the module docs).
            update: format!(
                "UPDATE {table} SET version = $3, state = $4::text, operation_id = $5, \
                 lease_owner = $6::text, \
                 lease_expires_at_ms = CASE \
                     WHEN state = 'executing' AND $4::text = 'executing' \
                         AND lease_owner = $6::text \
                     THEN GREATEST(lease_expires_at_ms, $7::bigint) ELSE $7::bigint END, \
                 expires_at_ms = $8, created_at_ms = $9, body = $10 \
                 WHERE id = $1 AND version = $2 \
                 RETURNING lease_expires_at_ms"
            ),
            stale: format!(
                "SELECT {COLUMNS} FROM {table} WHERE state = 'executing' \
                 AND (lease_expires_at_ms IS NULL OR lease_expires_at_ms < $1) \
                 ORDER BY lease_expires_at_ms NULLS FIRST, id LIMIT $2"
            ),
            stale_all: format!(
                "SELECT {COLUMNS} FROM {table} WHERE state = 'executing' \
                 ORDER BY lease_expires_at_ms NULLS FIRST, id LIMIT $1"
            ),
            renew: format!(
                "UPDATE {table} \
                 SET lease_expires_at_ms = GREATEST(COALESCE(lease_expires_at_ms, $2), $2) \
                 WHERE state = 'executing' AND lease_owner = $1"
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
            table,
        }
    }

    /// `list` has four optional conditions; each combination is its own statement text
    /// (cached per connection) so the planner can use the matching index.
    fn list(&self, filter: &ListFilter) -> String {
        let mut conds = Vec::new();
        let mut n = 0;
        let mut param = || {
            n += 1;
            format!("${n}")
        };
        if filter.status.is_some() {
            conds.push(format!("state = {}", param()));
        }
        if filter.operation.is_some() {
            conds.push(format!("operation_id = {}", param()));
        }
        if filter.after.is_some() {
            conds.push(format!("id > {}", param()));
        }
        let limit = param();
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
        let options = match config.get_options() {
            Some(o) if !o.is_empty() => format!("{o} -c synchronous_commit=on"),
            _ => "-c synchronous_commit=on".to_string(),
        };
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

#[async_trait]
impl Store for PostgresStore {
    async fn claim(&self, mut record: Record) -> StoreResult<Claim> {
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
                        &cols.lease_expires_at_ms,
                        &cols.expires_at_ms,
                        &cols.created_at_ms,
                        &body,
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

    async fn get(&self, id: &ExecutionId) -> StoreResult<Option<Record>> {
        self.fetch(id).await
    }

    async fn update(&self, mut record: Record) -> StoreResult<Record> {
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
                    &cols.lease_expires_at_ms,
                    &cols.expires_at_ms,
                    &cols.created_at_ms,
                    &body,
                ],
            )
            .await
            .map_err(|e| db_error("update", &e))?;
        if let Some(row) = row {
            let lease_expires: Option<i64> = row.try_get(0).map_err(|e| db_error("update", &e))?;
            if let (Some(lease), Some(at)) = (record.lease.as_mut(), lease_expires) {
                lease.expires_at_ms = at;
            }
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

    async fn list(&self, filter: &ListFilter) -> StoreResult<Vec<Record>> {
        let sql = self.sql.list(filter);
        let status = filter.status.map(State::as_str);
        let after = filter.after.as_ref().map(|a| a.0.as_str());
        let limit = db_limit(filter.limit);
        let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = Vec::new();
        if let Some(s) = &status {
            params.push(s);
        }
        if let Some(o) = &filter.operation {
            params.push(o);
        }
        if let Some(a) = &after {
            params.push(a);
        }
        params.push(&limit);
        self.query_records("list", &sql, &params).await
    }

    async fn stale_executing(&self, now_ms: i64, limit: usize) -> StoreResult<Vec<Record>> {
        let limit = db_limit(limit);
        if now_ms == i64::MAX {
            self.query_records("stale_executing", &self.sql.stale_all, &[&limit])
                .await
        } else {
            self.query_records("stale_executing", &self.sql.stale, &[&now_ms, &limit])
                .await
        }
    }

    async fn renew_leases(&self, owner: &str, until_ms: i64) -> StoreResult<u64> {
        let client = self.client("renew_leases").await?;
        let stmt = client
            .prepare_cached(&self.sql.renew)
            .await
            .map_err(|e| db_error("renew_leases", &e))?;
        client
            .execute(&stmt, &[&owner, &until_ms])
            .await
            .map_err(|e| db_error("renew_leases", &e))
    }

    async fn gc(&self, now_ms: i64, limit: usize) -> StoreResult<u64> {
        let limit = db_limit(limit);
        let client = self.client("gc").await?;
        let stmt = client
            .prepare_cached(&self.sql.gc)
            .await
            .map_err(|e| db_error("gc", &e))?;
        client
            .execute(&stmt, &[&now_ms, &limit])
            .await
            .map_err(|e| db_error("gc", &e))
    }
}

/// The denormalised columns, always derived from the record being written.
struct Columns<'a> {
    state: &'static str,
    operation_id: Option<&'a str>,
    lease_owner: Option<&'a str>,
    lease_expires_at_ms: Option<i64>,
    expires_at_ms: i64,
    created_at_ms: i64,
}

impl<'a> Columns<'a> {
    fn of(r: &'a Record) -> Columns<'a> {
        Columns {
            state: r.state().as_str(),
            operation_id: r.operation_id.as_deref(),
            lease_owner: r.lease.as_ref().map(|l| l.owner.as_str()),
            lease_expires_at_ms: r.lease.as_ref().map(|l| l.expires_at_ms),
            expires_at_ms: r.expires_at_ms,
            created_at_ms: r.created_at_ms,
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
    let lease_at: Option<i64> = row.try_get(3).map_err(|e| corrupt(e.to_string()))?;
    let body: &[u8] = row.try_get(4).map_err(|e| corrupt(e.to_string()))?;
    let mut record = Record::from_bytes(&id, body)?;
    if record.id.0 != id {
        return Err(corrupt(format!("body belongs to {}", record.id)));
    }
    record.version = stored_version(&id, version)?;
    record.lease = match (owner, lease_at) {
        (Some(owner), Some(expires_at_ms)) => Some(Lease {
            owner,
            expires_at_ms,
        }),
        (None, None) => None,
        _ => return Err(corrupt("lease owner and expiry disagree".into())),
    };
    Ok(record)
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
