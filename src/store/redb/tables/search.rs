//! The search indexes (`GET /v1/executions` filters): tool call, key, route and creation
//! time, beside the status, expiry and operation indexes of [`super`], and the listing that
//! walks them. The fields they are keyed by never change once a record is claimed, so an
//! execution's entries are written once, by its claim, and removed with it by gc: an update
//! (the two or three writes every execution makes after its claim) moves none of them.
//! Files written before these indexes get their entries built when they are opened
//! ([`build`]). What each one costs per execution is in docs/STORES.md, "Search".

use std::collections::BTreeMap;
use std::ops::Bound;

use ::redb::{Database, ReadTransaction, ReadableTable, Table, TableDefinition, WriteTransaction};

use super::{
    dangling, ids_in_state, listable, status_indexed, storage, ReadRecords, BY_EXTERNAL, BY_JOB,
    BY_OPERATION, BY_STATUS, RECORD_DATA, RECORD_IDS,
};
use crate::policy::job::JobState;
use crate::store::{JobFilter, ListFilter, Record, StoreResult};

/// (tool call id, execution id): `ListFilter.tool_call`. Only records that have one.
const BY_TOOL_CALL: TableDefinition<(&str, &str), ()> = TableDefinition::new("by_tool_call");
/// (key, execution id): `ListFilter.key`. Only records that have one (claimed by this
/// version or later: older records did not keep their key).
const BY_KEY: TableDefinition<(&str, &str), ()> = TableDefinition::new("by_key");
/// (upstream, route, execution id): `ListFilter.upstream` and `ListFilter.route`, alone or
/// together (one of them alone merges the walks of its routes, [`route_walk`]).
const BY_ROUTE: TableDefinition<(&str, &str, &str), ()> = TableDefinition::new("by_route");
/// (created_at_ms, execution id): `ListFilter.since` / `until`. Claims come in time order,
/// so its entries are appended (into the last leaf, which the batch writes anyway).
const BY_CREATED: TableDefinition<(i64, &str), ()> = TableDefinition::new("by_created");
/// How far [`build`] got: [`BUILD_CURSOR`] (the last execution id indexed, in id order)
/// while it runs, [`BUILD_DONE`] once every record stored before the indexes has entries.
const SEARCH_BUILD: TableDefinition<&str, &str> = TableDefinition::new("search_build");
const BUILD_CURSOR: &str = "cursor";
const BUILD_DONE: &str = "done";

/// The fields the search indexes are keyed by, decoded without the rest of a record.
#[derive(serde::Deserialize)]
struct SearchKeys {
    upstream: String,
    route: String,
    created_at_ms: i64,
    #[serde(default)]
    tool_call_id: Option<String>,
    #[serde(default)]
    key: Option<String>,
}

/// The four search index tables, open in a write transaction.
pub(super) struct SearchTables<'t> {
    by_tool_call: Table<'t, (&'static str, &'static str), ()>,
    by_key: Table<'t, (&'static str, &'static str), ()>,
    by_route: Table<'t, (&'static str, &'static str, &'static str), ()>,
    by_created: Table<'t, (i64, &'static str), ()>,
}

impl<'t> SearchTables<'t> {
    pub(super) fn open(txn: &'t WriteTransaction) -> StoreResult<SearchTables<'t>> {
        Ok(SearchTables {
            by_tool_call: txn.open_table(BY_TOOL_CALL).map_err(storage)?,
            by_key: txn.open_table(BY_KEY).map_err(storage)?,
            by_route: txn.open_table(BY_ROUTE).map_err(storage)?,
            by_created: txn.open_table(BY_CREATED).map_err(storage)?,
        })
    }

    /// The entries of a record just claimed.
    pub(super) fn insert(&mut self, r: &Record) -> StoreResult<()> {
        self.insert_keys(
            r.id.as_str(),
            &r.upstream,
            &r.route,
            r.created_at_ms,
            r.tool_call_id.as_deref(),
            r.key.as_deref(),
        )
    }

    fn insert_keys(
        &mut self,
        id: &str,
        upstream: &str,
        route: &str,
        created_at_ms: i64,
        tool_call: Option<&str>,
        key: Option<&str>,
    ) -> StoreResult<()> {
        if let Some(t) = tool_call {
            self.by_tool_call.insert((t, id), ()).map_err(storage)?;
        }
        if let Some(k) = key {
            self.by_key.insert((k, id), ()).map_err(storage)?;
        }
        self.by_route
            .insert((upstream, route, id), ())
            .map_err(storage)?;
        self.by_created
            .insert((created_at_ms, id), ())
            .map_err(storage)?;
        Ok(())
    }

    /// The entries of a record being deleted.
    pub(super) fn remove(&mut self, r: &Record) -> StoreResult<()> {
        let id = r.id.as_str();
        if let Some(t) = r.tool_call_id.as_deref() {
            self.by_tool_call.remove((t, id)).map_err(storage)?;
        }
        if let Some(k) = r.key.as_deref() {
            self.by_key.remove((k, id)).map_err(storage)?;
        }
        self.by_route
            .remove((r.upstream.as_str(), r.route.as_str(), id))
            .map_err(storage)?;
        self.by_created
            .remove((r.created_at_ms, id))
            .map_err(storage)?;
        Ok(())
    }
}

/// Gives the records of a file written before the search indexes their entries, `chunk`
/// records per write transaction, each transaction storing how far it got with its entries:
/// a crash part way loses nothing, and the next open goes on after the last record a
/// committed chunk indexed. Runs at open, before the writer starts, so no claim races it
/// (a claim writes its own entries). A file created by this version is marked done at once.
pub(super) fn build(db: &Database, chunk: usize) -> StoreResult<()> {
    let mut indexed = 0u64;
    while let Step::Indexed(n) = build_step(db, chunk)? {
        indexed += n;
    }
    if indexed > 0 {
        tracing::info!(
            records = indexed,
            "built the search indexes for records stored before them"
        );
    }
    Ok(())
}

/// What one [`build_step`] did.
#[derive(Debug, PartialEq, Eq)]
pub(in crate::store::redb) enum Step {
    /// Indexed this many records; more may follow.
    Indexed(u64),
    /// Every record has its entries (now, or already).
    Done,
}

/// One transaction of [`build`]: up to `chunk` records after the stored cursor.
pub(in crate::store::redb) fn build_step(db: &Database, chunk: usize) -> StoreResult<Step> {
    let txn = db.begin_write().map_err(storage)?;
    let step = {
        let mut progress = txn.open_table(SEARCH_BUILD).map_err(storage)?;
        if progress.get(BUILD_DONE).map_err(storage)?.is_some() {
            return Ok(Step::Done);
        }
        let cursor = progress
            .get(BUILD_CURSOR)
            .map_err(storage)?
            .map(|v| v.value().to_string());
        let ids = txn.open_table(RECORD_IDS).map_err(storage)?;
        let data = txn.open_table(RECORD_DATA).map_err(storage)?;
        let mut tables = SearchTables::open(&txn)?;
        let lower = cursor.as_deref().map_or(Bound::Unbounded, Bound::Excluded);
        let mut last = None;
        for entry in ids
            .range::<&str>((lower, Bound::Unbounded))
            .map_err(storage)?
            .take(chunk.max(1))
        {
            let (id, place) = entry.map_err(storage)?;
            let id = id.value();
            let stored = data.get(place.value()).map_err(storage)?;
            let Some(bytes) = stored else {
                return Err(dangling("id", id));
            };
            match serde_json::from_slice::<SearchKeys>(bytes.value()) {
                Ok(k) => tables.insert_keys(
                    id,
                    &k.upstream,
                    &k.route,
                    k.created_at_ms,
                    k.tool_call_id.as_deref(),
                    k.key.as_deref(),
                )?,
                // Listings skip it anyway (`listable`), and gc leaves it alone.
                Err(e) => {
                    tracing::warn!(execution_id = %id, reason = %e, "search index build skips an unreadable record")
                }
            }
            last = Some((id.to_string(), last.map_or(1, |(_, n)| n + 1)));
        }
        match last {
            Some((last, n)) if n == chunk.max(1) as u64 => {
                progress
                    .insert(BUILD_CURSOR, last.as_str())
                    .map_err(storage)?;
                Step::Indexed(n)
            }
            _ => {
                progress.remove(BUILD_CURSOR).map_err(storage)?;
                progress.insert(BUILD_DONE, "1").map_err(storage)?;
                Step::Done
            }
        }
    };
    txn.commit().map_err(storage)?;
    Ok(step)
}

/// Ids in id order after the cursor, from one index walk.
type Ids<'a> = Box<dyn Iterator<Item = StoreResult<String>> + 'a>;

/// Ids of `(value, id)` entries for one value, after `after`, in id order.
fn ids_for<'a, T: ReadableTable<(&'static str, &'static str), ()>>(
    table: &'a T,
    value: &'a str,
    after: Option<&'a str>,
) -> StoreResult<Ids<'a>> {
    let lower = match after {
        Some(a) => Bound::Excluded((value, a)),
        None => Bound::Included((value, "")),
    };
    let range = table
        .range::<(&str, &str)>((lower, Bound::Unbounded))
        .map_err(storage)?;
    Ok(Box::new(range.map_while(move |entry| match entry {
        Ok((key, _)) => {
            let (v, id) = key.value();
            (v == value).then(|| Ok(id.to_string()))
        }
        Err(e) => Some(Err(storage(e))),
    })))
}

/// Ids of one route's entries after `after`, in id order.
fn ids_of_route<'a, T: ReadableTable<(&'static str, &'static str, &'static str), ()>>(
    table: &'a T,
    upstream: String,
    route: String,
    after: Option<&'a str>,
) -> StoreResult<Ids<'a>> {
    let range = {
        let lower = match after {
            Some(a) => Bound::Excluded((upstream.as_str(), route.as_str(), a)),
            None => Bound::Included((upstream.as_str(), route.as_str(), "")),
        };
        table
            .range::<(&str, &str, &str)>((lower, Bound::Unbounded))
            .map_err(storage)?
    };
    Ok(Box::new(range.map_while(move |entry| match entry {
        Ok((key, _)) => {
            let (u, r, id) = key.value();
            (u == upstream && r == route).then(|| Ok(id.to_string()))
        }
        Err(e) => Some(Err(storage(e))),
    })))
}

/// The (upstream, route) pairs [`BY_ROUTE`] holds that match `upstream` and `route`, found
/// by seeking from one pair to the next (one B-tree descent per pair, however many records
/// each has).
fn route_pairs<T: ReadableTable<(&'static str, &'static str, &'static str), ()>>(
    table: &T,
    upstream: Option<&str>,
    route: Option<&str>,
) -> StoreResult<Vec<(String, String)>> {
    let mut pairs = Vec::new();
    let mut from = (upstream.unwrap_or("").to_string(), String::new());
    loop {
        let next = table
            .range::<(&str, &str, &str)>((
                Bound::Included((from.0.as_str(), from.1.as_str(), "")),
                Bound::Unbounded,
            ))
            .map_err(storage)?
            .next();
        let Some(entry) = next else { break };
        let (key, _) = entry.map_err(storage)?;
        let (u, r, _) = key.value();
        if upstream.is_some_and(|want| want != u) {
            break;
        }
        if route.is_none_or(|want| want == r) {
            pairs.push((u.to_string(), r.to_string()));
        }
        // The smallest route name after `r` is `r` + NUL.
        from = (u.to_string(), format!("{r}\0"));
    }
    Ok(pairs)
}

/// The walks of several routes merged into one, in id order (an upstream has a handful of
/// routes; each step takes the smallest of their next ids).
fn route_walk<'a, T: ReadableTable<(&'static str, &'static str, &'static str), ()>>(
    table: &'a T,
    upstream: Option<&str>,
    route: Option<&str>,
    after: Option<&'a str>,
) -> StoreResult<Ids<'a>> {
    let mut walks = Vec::new();
    for (u, r) in route_pairs(table, upstream, route)? {
        walks.push(ids_of_route(table, u, r, after)?);
    }
    Ok(merged(walks))
}

/// Several id walks merged into one in id order: each step takes the smallest of their next
/// ids (the walks are few: an upstream's routes, the job states). An error goes out at once.
fn merged<'a, I>(mut walks: Vec<I>) -> Ids<'a>
where
    I: Iterator<Item = StoreResult<String>> + 'a,
{
    let mut heads: Vec<Option<String>> = Vec::with_capacity(walks.len());
    let mut failed = None;
    for walk in &mut walks {
        match walk.next().transpose() {
            Ok(head) => heads.push(head),
            Err(e) => {
                failed.get_or_insert(e);
                heads.push(None);
            }
        }
    }
    Box::new(std::iter::from_fn(move || {
        if let Some(e) = failed.take() {
            return Some(Err(e));
        }
        let (i, _) = heads
            .iter()
            .enumerate()
            .filter_map(|(i, h)| h.as_ref().map(|id| (i, id)))
            .min_by(|a, b| a.1.cmp(b.1))?;
        let next = match walks[i].next().transpose() {
            Ok(next) => next,
            Err(e) => return Some(Err(e)),
        };
        std::mem::replace(&mut heads[i], next).map(Ok)
    }))
}

/// Ids of the records with a job in one of `filter`'s states, after `after`, merged from
/// the job-state ranges in id order.
fn job_walk<'a, T: ReadableTable<(u8, &'static str), ()>>(
    table: &'a T,
    filter: JobFilter,
    after: Option<&'a str>,
) -> StoreResult<Ids<'a>> {
    let codes: Vec<u8> = match filter {
        JobFilter::Any => JobState::ALL.iter().map(|s| s.code()).collect(),
        JobFilter::In(s) => vec![s.code()],
    };
    let mut walks = Vec::new();
    for code in codes {
        walks.push(ids_in_state(table, code, after)?);
    }
    Ok(merged(walks))
}

/// The first `filter.limit` matching ids after the cursor among the records created in
/// `[since, until)`: [`BY_CREATED`] is in time order, so the walk reads every entry of the
/// range (keys only, about 40 bytes each) and keeps the smallest ids. A record is read only
/// when its id would enter the page and a filter needs it (a status the index cannot tell).
fn created_page(
    txn: &ReadTransaction,
    records: &ReadRecords,
    filter: &ListFilter,
) -> StoreResult<Vec<Record>> {
    let by_created = txn.open_table(BY_CREATED).map_err(storage)?;
    let since = filter.since.unwrap_or(i64::MIN);
    let upper = match filter.until {
        Some(u) => Bound::Excluded((u, "")),
        None => Bound::Unbounded,
    };
    let after = filter.after.as_ref().map(|a| a.as_str());
    // The page so far, by id: its last id is the one a smaller one replaces.
    let mut page: BTreeMap<String, Option<Record>> = BTreeMap::new();
    for entry in by_created
        .range::<(i64, &str)>((Bound::Included((since, "")), upper))
        .map_err(storage)?
    {
        let (key, _) = entry.map_err(storage)?;
        let id = key.value().1;
        if after.is_some_and(|a| id <= a) {
            continue;
        }
        if page.len() >= filter.limit
            && page
                .last_key_value()
                .is_some_and(|(top, _)| id >= top.as_str())
        {
            continue;
        }
        let record = if filter.status.is_some() {
            let loaded = records
                .load(id)
                .and_then(|r| r.ok_or_else(|| dangling("created", id)));
            match listable(loaded)? {
                Some(r) if filter.matches(&r) => Some(r),
                _ => continue,
            }
        } else {
            None
        };
        page.insert(id.to_string(), record);
        if page.len() > filter.limit {
            page.pop_last();
        }
    }
    let mut out = Vec::with_capacity(page.len());
    for (id, record) in page {
        let record = match record {
            Some(r) => r,
            None => {
                let loaded = records
                    .load(&id)
                    .and_then(|r| r.ok_or_else(|| dangling("created", &id)));
                match listable(loaded)? {
                    Some(r) => r,
                    None => continue,
                }
            }
        };
        out.push(record);
    }
    Ok(out)
}

/// A page of `filter` in execution-id order. Walks one index, the one that narrows the
/// most as a rule: an exact id (external id, tool call, key, operation), then a job state, a route, a status the
/// status index holds, an upstream or a route name alone, a time range; with none of
/// them, every id. The other filters are checked on the records the walk reads.
pub(super) fn list(
    txn: &ReadTransaction,
    records: &ReadRecords,
    filter: &ListFilter,
) -> StoreResult<Vec<Record>> {
    let mut out = Vec::new();
    if filter.limit == 0 {
        return Ok(out);
    }
    let after = filter.after.as_ref().map(|a| a.as_str());
    let by_tool_call = txn.open_table(BY_TOOL_CALL).map_err(storage)?;
    let by_key = txn.open_table(BY_KEY).map_err(storage)?;
    let by_operation = txn.open_table(BY_OPERATION).map_err(storage)?;
    let by_route = txn.open_table(BY_ROUTE).map_err(storage)?;
    let by_status = txn.open_table(BY_STATUS).map_err(storage)?;
    let by_external = txn.open_table(BY_EXTERNAL).map_err(storage)?;
    let by_job = txn.open_table(BY_JOB).map_err(storage)?;
    let indexed_status = filter.status.filter(|s| status_indexed(s.code()));
    let (index, ids): (&str, Ids<'_>) = if let Some(e) = filter.external_id.as_deref() {
        ("external id", ids_for(&by_external, e, after)?)
    } else if let Some(t) = filter.tool_call.as_deref() {
        ("tool call", ids_for(&by_tool_call, t, after)?)
    } else if let Some(k) = filter.key.as_deref() {
        ("key", ids_for(&by_key, k, after)?)
    } else if let Some(op) = filter.operation.as_deref() {
        ("operation", ids_for(&by_operation, op, after)?)
    } else if let Some(j) = filter.job {
        ("job", job_walk(&by_job, j, after)?)
    } else if let (Some(u), Some(r)) = (&filter.upstream, &filter.route) {
        (
            "route",
            ids_of_route(&by_route, u.clone(), r.clone(), after)?,
        )
    } else if let Some(state) = indexed_status {
        (
            "status",
            Box::new(ids_in_state(&by_status, state.code(), after)?),
        )
    } else if filter.upstream.is_some() || filter.route.is_some() {
        let (u, r) = (filter.upstream.as_deref(), filter.route.as_deref());
        ("route", route_walk(&by_route, u, r, after)?)
    } else if filter.since.is_some() || filter.until.is_some() {
        return created_page(txn, records, filter);
    } else {
        // Every record (a status `result_delivered` is most of them: it has no index).
        let lower = after.map_or(Bound::Unbounded, Bound::Excluded);
        let range = records
            .ids
            .range::<&str>((lower, Bound::Unbounded))
            .map_err(storage)?;
        (
            "id",
            Box::new(range.map(|e| e.map(|(id, _)| id.value().to_string()).map_err(storage))),
        )
    };
    for id in ids {
        let id = id?;
        let loaded = records
            .load(&id)
            .and_then(|r| r.ok_or_else(|| dangling(index, &id)));
        let Some(record) = listable(loaded)? else {
            continue;
        };
        if filter.matches(&record) {
            out.push(record);
            if out.len() >= filter.limit {
                break;
            }
        }
    }
    Ok(out)
}

/// Entries in each search index (tool call, key, route, created), for tests.
#[cfg(test)]
pub(in crate::store::redb) fn sizes(db: &Database) -> [u64; 4] {
    use ::redb::{ReadableDatabase, ReadableTableMetadata};
    let txn = db.begin_read().expect("test reads its own database");
    [
        txn.open_table(BY_TOOL_CALL).expect("table exists").len(),
        txn.open_table(BY_KEY).expect("table exists").len(),
        txn.open_table(BY_ROUTE).expect("table exists").len(),
        txn.open_table(BY_CREATED).expect("table exists").len(),
    ]
    .map(|n| n.expect("len reads"))
}

/// Makes the file look as if written before the search indexes: no entries, no progress.
#[cfg(test)]
pub(in crate::store::redb) fn forget(db: &Database) {
    let txn = db.begin_write().expect("test writes its own database");
    for name in [
        "by_tool_call",
        "by_key",
        "by_route",
        "by_created",
        "search_build",
    ] {
        txn.delete_table(::redb::TableDefinition::<(), ()>::new(name))
            .expect("deletes");
    }
    txn.commit().expect("commits");
}

/// Whether the build marked the file done.
#[cfg(test)]
pub(in crate::store::redb) fn built(db: &Database) -> bool {
    use ::redb::ReadableDatabase;
    let txn = db.begin_read().expect("test reads its own database");
    let t = txn.open_table(SEARCH_BUILD).expect("table exists");
    t.get(BUILD_DONE).expect("reads").is_some()
}
