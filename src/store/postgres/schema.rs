//! The PostgreSQL schema the store owns: schema-name validation and versioned migrations.
//! Migrations run once per start, in one transaction held under an advisory lock, so
//! several instances starting together apply each step exactly once.

use deadpool_postgres::Client;

use super::db_error;
use crate::store::{StoreError, StoreResult};

/// PostgreSQL truncates identifiers longer than this (NAMEDATALEN - 1).
const MAX_IDENTIFIER_BYTES: usize = 63;

/// Ordered, append-only: a released step is never edited, only followed by a new one.
/// `{schema}` is replaced by the quoted schema name.
const MIGRATIONS: &[(i32, &str)] = &[
    (
        1,
        r#"
    CREATE TABLE {schema}.records (
        id                  text    PRIMARY KEY,
        version             bigint  NOT NULL CHECK (version > 0),
        state               text    NOT NULL,
        operation_id        text,
        lease_owner         text,
        lease_expires_at_ms bigint,
        expires_at_ms       bigint  NOT NULL,
        created_at_ms       bigint  NOT NULL,
        body                bytea   NOT NULL
    );
    -- (state, id) and (operation_id, id) also serve `list`'s filtered pages in id order.
    CREATE INDEX records_state_idx ON {schema}.records (state, id);
    CREATE INDEX records_expires_idx ON {schema}.records (expires_at_ms);
    CREATE INDEX records_operation_idx ON {schema}.records (operation_id, id);
    "#,
    ),
    (
        2,
        r#"
    -- Marks of cancelled parent operations (SPEC section 8); see store::operation.
    CREATE TABLE {schema}.operations (
        id              text    PRIMARY KEY,
        state           text    NOT NULL
                        CHECK (state IN ('cancelled', 'cancelled_after_side_effect')),
        cancelled_by    text    NOT NULL,
        cancelled_at_ms bigint  NOT NULL,
        updated_at_ms   bigint  NOT NULL,
        expires_at_ms   bigint  NOT NULL
    );
    CREATE INDEX operations_expires_idx ON {schema}.operations (expires_at_ms);
    "#,
    ),
    (
        3,
        r#"
    -- When the record last moved to `executing`, on the database's clock (issue 34): the
    -- settle window of a not-found lookup is measured with it, so instances whose clocks
    -- disagree agree on it. NULL on rows written before this step (their own timestamps
    -- are used then).
    ALTER TABLE {schema}.records ADD COLUMN sent_at_ms bigint;
    "#,
    ),
    (
        4,
        r#"
    -- Search (issue 38): what `list` filters on beside state and operation_id. Written by
    -- the claim only: a record's upstream, route, tool call and key never change. Rows
    -- written before this step get upstream and route from their body (they kept no tool
    -- call nor key); docs/STORES.md, "Search", has the statement to run again for rows an
    -- older instance still claimed during a rolling upgrade.
    ALTER TABLE {schema}.records
        ADD COLUMN upstream     text,
        ADD COLUMN route        text,
        ADD COLUMN tool_call_id text,
        ADD COLUMN idem_key     text;
    UPDATE {schema}.records AS r
        SET upstream = j.b ->> 'upstream', route = j.b ->> 'route',
            tool_call_id = j.b ->> 'tool_call_id', idem_key = j.b ->> 'key'
        FROM (SELECT id, convert_from(body, 'UTF8')::json AS b FROM {schema}.records) AS j
        WHERE r.id = j.id;
    -- Each serves its filter's pages in id order (the cursor's order).
    CREATE INDEX records_tool_call_idx ON {schema}.records (tool_call_id, id)
        WHERE tool_call_id IS NOT NULL;
    CREATE INDEX records_key_idx ON {schema}.records (idem_key, id)
        WHERE idem_key IS NOT NULL;
    CREATE INDEX records_route_idx ON {schema}.records (upstream, route, id);
    CREATE INDEX records_route_name_idx ON {schema}.records (route, id);
    CREATE INDEX records_created_idx ON {schema}.records (created_at_ms, id);
    "#,
    ),
    (
        5,
        r#"
    -- Background jobs and correlation by external id (SPEC section 9): the record's
    -- downstream id when it is indexed (`external_indexed`: a job's id, or any while a webhook
    -- route correlates `to: external_id`) and its job's state, so a webhook event correlated
    -- `to: external_id`, a job's status answer and the job poller find their records by
    -- index. Rows written before this step get them from their body (their jobs' ids).
    ALTER TABLE {schema}.records ADD COLUMN external_id text, ADD COLUMN job_state text;
    -- A body that is not JSON (a damaged row) keeps NULLs, as reads report it anyway.
    CREATE FUNCTION pg_temp.idemproxy_record_json(b bytea) RETURNS jsonb
    LANGUAGE plpgsql AS $$
    BEGIN
        RETURN convert_from(b, 'UTF8')::jsonb;
    EXCEPTION WHEN others THEN
        RETURN NULL;
    END $$;
    UPDATE {schema}.records r SET
        external_id = CASE WHEN s.j -> 'job' IS NOT NULL
            OR coalesce((s.j ->> 'external_indexed')::boolean, false)
            THEN s.j ->> 'external_id' END,
        job_state = s.j -> 'job' ->> 'state'
    FROM (SELECT id, pg_temp.idemproxy_record_json(body) AS j FROM {schema}.records) s
    WHERE r.id = s.id AND (s.j ->> 'external_id' IS NOT NULL OR s.j -> 'job' IS NOT NULL);
    DROP FUNCTION pg_temp.idemproxy_record_json(bytea);
    CREATE INDEX records_external_id_idx ON {schema}.records (external_id, id)
        WHERE external_id IS NOT NULL;
    CREATE INDEX records_job_state_idx ON {schema}.records (job_state, id)
        WHERE job_state IS NOT NULL;
    "#,
    ),
];

/// The newest schema version this build knows.
pub(super) fn latest_version() -> i32 {
    MIGRATIONS.last().map(|(v, _)| *v).unwrap_or(0)
}

/// Accepts what an operator would type unquoted: lower-case ASCII letters, digits and
/// `_`, not starting with a digit, at most 63 bytes, and not in the reserved `pg_` space.
/// The name is still always quoted in SQL; the rule keeps it unambiguous in `psql`.
pub(super) fn validate_schema_name(name: &str) -> StoreResult<()> {
    let bad = |why: &str| {
        Err(StoreError::Backend(format!(
            "invalid schema name {name:?}: {why}"
        )))
    };
    let Some(first) = name.chars().next() else {
        return bad("empty");
    };
    if name.len() > MAX_IDENTIFIER_BYTES {
        return bad("longer than 63 bytes");
    }
    if !(first.is_ascii_lowercase() || first == '_') {
        return bad("must start with a lower-case letter or `_`");
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        return bad("only lower-case ASCII letters, digits and `_` are allowed");
    }
    if name.starts_with("pg_") {
        return bad("the `pg_` prefix is reserved by PostgreSQL");
    }
    Ok(())
}

/// `name` quoted as an identifier. Only called on validated names, which contain no `"`.
pub(super) fn quote(name: &str) -> String {
    format!("\"{name}\"")
}

/// Create the schema if missing and apply every migration newer than the stored version.
/// Refuses a database whose schema is newer than this build (an older binary must not
/// write rows whose meaning it does not know).
pub(super) async fn migrate(client: &mut Client, schema: &str) -> StoreResult<()> {
    migrate_to(client, schema, latest_version()).await
}

/// [`migrate`] up to `latest` only (tests make a database an older build left).
pub(super) async fn migrate_to(client: &mut Client, schema: &str, latest: i32) -> StoreResult<()> {
    let q = quote(schema);
    let tx = client
        .transaction()
        .await
        .map_err(|e| db_error("begin migration", &e))?;
    // Another instance may hold the migration lock for longer than the store's statement
    // timeout (a long migration): this transaction waits for it.
    tx.batch_execute("SET LOCAL statement_timeout = 0")
        .await
        .map_err(|e| db_error("begin migration", &e))?;
    // Serialises concurrent starts; released by COMMIT/ROLLBACK. Keyed by schema so
    // unrelated schemas (e.g. parallel tests) do not wait on each other.
    tx.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
        &[&format!("idemproxy.migrate:{schema}")],
    )
    .await
    .map_err(|e| db_error("take migration lock", &e))?;
    // Checked first: CREATE SCHEMA IF NOT EXISTS still needs CREATE on the database, which
    // a least-privilege role given a pre-made schema does not have.
    let exists = tx
        .query_opt("SELECT 1 FROM pg_namespace WHERE nspname = $1", &[&schema])
        .await
        .map_err(|e| db_error("look up schema", &e))?
        .is_some();
    if !exists {
        tx.batch_execute(&format!("CREATE SCHEMA {q}"))
            .await
            .map_err(|e| db_error("create schema", &e))?;
    }
    tx.batch_execute(&format!(
        "CREATE TABLE IF NOT EXISTS {q}.schema_migrations (
             version    integer     PRIMARY KEY,
             applied_at timestamptz NOT NULL DEFAULT now()
         )"
    ))
    .await
    .map_err(|e| db_error("create schema_migrations", &e))?;
    let current: i32 = tx
        .query_one(
            &format!("SELECT COALESCE(MAX(version), 0) FROM {q}.schema_migrations"),
            &[],
        )
        .await
        .map_err(|e| db_error("read schema version", &e))?
        .try_get(0)
        .map_err(|e| db_error("read schema version", &e))?;
    if current > latest {
        return Err(StoreError::Backend(format!(
            "postgres schema {schema:?} is at version {current}, newer than this idemproxy \
             supports ({latest}); upgrade idemproxy"
        )));
    }
    for (version, sql) in MIGRATIONS
        .iter()
        .filter(|(v, _)| *v > current && *v <= latest)
    {
        tx.batch_execute(&sql.replace("{schema}", &q))
            .await
            .map_err(|e| db_error(&format!("apply migration {version}"), &e))?;
        tx.execute(
            &format!("INSERT INTO {q}.schema_migrations (version) VALUES ($1)"),
            &[version],
        )
        .await
        .map_err(|e| db_error(&format!("record migration {version}"), &e))?;
    }
    tx.commit()
        .await
        .map_err(|e| db_error("commit migration", &e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_names_are_plain_identifiers() {
        for ok in ["idemproxy", "_x", "a1_b2", &"a".repeat(63)] {
            assert!(validate_schema_name(ok).is_ok(), "{ok} should be accepted");
        }
        for bad in [
            "",
            "1abc",
            "Idemproxy",
            "a-b",
            "a b",
            "a\"b",
            "a;drop",
            "pg_temp",
            "é",
            &"a".repeat(64),
        ] {
            assert!(
                validate_schema_name(bad).is_err(),
                "{bad:?} should be refused"
            );
        }
    }

    #[test]
    fn migrations_are_strictly_increasing_from_one() {
        let versions: Vec<i32> = MIGRATIONS.iter().map(|(v, _)| *v).collect();
        let expected: Vec<i32> = (1..=versions.len() as i32).collect();
        assert_eq!(versions, expected);
    }
}
