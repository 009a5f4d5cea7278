//! Store-side helpers for `benches/run.sh` (a `harness = false` bench: a plain program).
//!
//! ```text
//! store baseline --dir DIR --seconds S     one durable commit per state write, sequentially
//! store prefill --config C --from A --to B records for keys r-(A+1)..r-B, as the proxy stores them
//! store live --config C                    live records and bytes vs the file size
//! ```
//!
//! Every command prints one JSON object on stdout for the report. The baseline is what
//! group commit is measured against: the same store, the same records, but each write
//! waits for its own commit before the next is issued, so every commit holds one write.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::stream::{self, StreamExt};
use http::{HeaderMap, HeaderValue, Method};
use idemproxy::config::{Config, StoreBackend};
use idemproxy::policy::fingerprint::{args_hash, RequestParts};
use idemproxy::policy::identity::{self, ArgsHash, ExecutionId, TenantScope};
use idemproxy::policy::state::Event;
use idemproxy::store::redb::RedbStore;
use idemproxy::store::{now_ms, Claim, NewRecord, Record, Store, StoredResponse};
use serde_json::json;

/// The bench's side-effect route (see the config `run.sh` writes).
const UPSTREAM: &str = "api";
const ROUTE: &str = "send";
const PATH: &str = "/send";

fn main() -> anyhow::Result<()> {
    // `cargo bench` appends `--bench`; nothing here wants it.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let out = match args.first().map(String::as_str) {
        Some("baseline") => rt.block_on(baseline(
            &PathBuf::from(flag(&args, "--dir")?),
            flag(&args, "--seconds")?.parse()?,
        ))?,
        Some("prefill") => rt.block_on(prefill(
            &Config::load(Path::new(&flag(&args, "--config")?))?,
            flag(&args, "--from")?.parse()?,
            flag(&args, "--to")?.parse()?,
        ))?,
        Some("live") => live(&Config::load(Path::new(&flag(&args, "--config")?))?)?,
        _ => anyhow::bail!("usage: store baseline|prefill|live ... (see benches/store.rs)"),
    };
    println!("{out}");
    Ok(())
}

fn flag(args: &[String], name: &str) -> anyhow::Result<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("missing {name}"))
}

fn redb_path(cfg: &Config) -> anyhow::Result<PathBuf> {
    match &cfg.store.backend {
        StoreBackend::Redb { path, .. } => Ok(path.clone()),
        _ => anyhow::bail!("the bench config must use the redb store"),
    }
}

/// The JSON body `benches/wrk/request.lua` sends: same bytes, same args_hash.
fn body(n: usize) -> Vec<u8> {
    let head = r#"{"to":"user@example.com","subject":"bench","text":""#;
    let tail = r#""}"#;
    let pad = n.saturating_sub(head.len() + tail.len());
    format!("{head}{}{tail}", "x".repeat(pad)).into_bytes()
}

/// What the upstream nginx answers on `/send` (see `run.sh`), as the proxy stores it.
fn upstream_answer() -> StoredResponse {
    let body = br#"{"id":"msg_1","status":"queued"}"#.to_vec();
    StoredResponse {
        status: 201,
        headers: vec![
            ("server".into(), b"nginx/1.22.1".to_vec()),
            ("date".into(), b"Thu, 01 Jan 2026 00:00:00 GMT".to_vec()),
            ("content-type".into(), b"application/json".to_vec()),
            ("content-length".into(), body.len().to_string().into_bytes()),
        ],
        body,
    }
}

fn new_record(id: ExecutionId, tenant: TenantScope, args: ArgsHash, now: i64) -> Record {
    Record::new(NewRecord {
        id,
        tenant,
        upstream: UPSTREAM.into(),
        route: ROUTE.into(),
        tool_version: "v1".into(),
        operation_id: None,
        args_hash: args,
        method: "POST".into(),
        path: PATH.into(),
        query: None,
        path_params: vec![],
        preview: None,
        now_ms: now,
        expires_at_ms: now + 86_400_000,
    })
}

/// Sequential executions (claim as `executing`, update to `committed` with the answer),
/// each write awaited before the next: exactly one write per durable commit. Also the raw
/// redb floor: one tiny insert per `Durability::Immediate` transaction.
async fn baseline(dir: &Path, seconds: f64) -> anyhow::Result<serde_json::Value> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join("baseline.redb");
    let _ = std::fs::remove_file(&path);
    let store = RedbStore::open(&path)?;
    let tenant = TenantScope("bench".into());
    let args = ArgsHash("0".repeat(64));
    let mut lat = Vec::new();
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed().as_secs_f64() < seconds {
        n += 1;
        let id = ExecutionId(format!("ex_baseline_{n}"));
        let now = now_ms();
        let mut r = new_record(id, tenant.clone(), args.clone(), now);
        r.apply(Event::Start, now, None)?;
        let t = Instant::now();
        let Claim::Claimed(mut r) = store.claim(r).await? else {
            anyhow::bail!("fresh id already stored");
        };
        lat.push(t.elapsed());
        r.response = Some(upstream_answer());
        r.apply(Event::Commit, now_ms(), None)?;
        let t = Instant::now();
        store.update(r).await?;
        lat.push(t.elapsed());
    }
    let elapsed = start.elapsed().as_secs_f64();
    let stats = store.stats();
    drop(store);
    let raw = raw_commits(dir, seconds.min(5.0))?;
    lat.sort();
    Ok(json!({
        "kind": "baseline",
        "executions": n,
        "executions_per_s": n as f64 / elapsed,
        "commits": stats.commits,
        "writes": stats.writes,
        "writes_per_commit": stats.writes as f64 / stats.commits.max(1) as f64,
        "writes_per_s": stats.writes as f64 / elapsed,
        "write_p50_ms": pct(&lat, 0.50),
        "write_p99_ms": pct(&lat, 0.99),
        "raw_commits_per_s": raw,
    }))
}

fn pct(sorted: &[Duration], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i].as_secs_f64() * 1000.0
}

/// Commits per second of plain redb, one 1 KiB insert per durable transaction.
fn raw_commits(dir: &Path, seconds: f64) -> anyhow::Result<f64> {
    use redb::{Database, Durability, TableDefinition};
    const T: TableDefinition<u64, &[u8]> = TableDefinition::new("t");
    let path = dir.join("raw.redb");
    let _ = std::fs::remove_file(&path);
    let db = Database::create(&path)?;
    let value = vec![7u8; 1024];
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed().as_secs_f64() < seconds {
        let mut txn = db.begin_write()?;
        txn.set_durability(Durability::Immediate)?;
        txn.open_table(T)?.insert(n, value.as_slice())?;
        txn.commit()?;
        n += 1;
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    drop(db);
    let _ = std::fs::remove_file(&path);
    Ok(rate)
}

/// Stores delivered records for keys `r-(from+1)..=r-to`, computed with the proxy's own
/// identity and fingerprint code from the bench config, so the proxy replays them. Many
/// claims are in flight at once, so the writer fills whole batches (this is a loader, not
/// a measurement).
async fn prefill(cfg: &Config, from: u64, to: u64) -> anyhow::Result<serde_json::Value> {
    let path = redb_path(cfg)?;
    let store = Arc::new(RedbStore::open(&path)?);
    let upstream = cfg
        .upstreams
        .iter()
        .find(|u| u.name == UPSTREAM)
        .ok_or_else(|| anyhow::anyhow!("no upstream `{UPSTREAM}` in the bench config"))?;
    let route = upstream
        .routes
        .iter()
        .find(|r| r.name == ROUTE)
        .ok_or_else(|| anyhow::anyhow!("no route `{ROUTE}`"))?;
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    let tenant = identity::tenant_scope(&headers, &cfg.identity.tenant_from);
    let body = body(512);
    let args = args_hash(
        &RequestParts {
            method: &Method::POST,
            upstream: UPSTREAM,
            route: ROUTE,
            path: PATH,
            query: None,
            headers: &headers,
            body: &body,
        },
        &route.fingerprint,
    )
    .map_err(|a| anyhow::anyhow!("ambiguous bench body at {}", a.0))?;
    let start = Instant::now();
    let results: Vec<anyhow::Result<()>> = stream::iter(from + 1..=to)
        .map(|i| {
            let store = store.clone();
            let tenant = tenant.clone();
            let args = args.clone();
            async move {
                let id = identity::execution_id(&tenant, UPSTREAM, ROUTE, &format!("r-{i}"));
                let now = now_ms();
                let mut r = new_record(id, tenant, args, now);
                r.apply(Event::Start, now, None)?;
                r.response = Some(upstream_answer());
                r.apply(Event::Commit, now, None)?;
                r.apply(Event::Deliver, now, None)?;
                store.claim(r).await?;
                Ok(())
            }
        })
        .buffer_unordered(2048)
        .collect()
        .await;
    results.into_iter().collect::<anyhow::Result<()>>()?;
    let stats = store.stats();
    // Random ids inserted in batches leave the file about half free pages; compacting
    // here means the proxy starts on a file like one grown by real traffic and compacted.
    let mut store = Arc::try_unwrap(store)
        .map_err(|_| anyhow::anyhow!("prefill tasks still hold the store"))?;
    let grown = std::fs::metadata(&path)?.len();
    store.compact()?;
    Ok(json!({
        "kind": "prefill",
        "records": to - from,
        "seconds": start.elapsed().as_secs_f64(),
        "commits": stats.commits,
        "file_bytes_before_compaction": grown,
        "file_bytes": std::fs::metadata(&path)?.len(),
    }))
}

/// Live data of the (stopped) proxy's store: record count and their stored bytes (each
/// record's id entry and its JSON value with its 8-byte place, their expiry index entries,
/// and the status index entries, which delivered records do not have), against the file
/// size.
fn live(cfg: &Config) -> anyhow::Result<serde_json::Value> {
    use redb::{ReadableDatabase, ReadableTable, TableDefinition};
    const IDS: TableDefinition<&str, u64> = TableDefinition::new("record_ids");
    const DATA: TableDefinition<u64, &[u8]> = TableDefinition::new("record_data");
    const BY_STATUS: TableDefinition<(u8, &str), ()> = TableDefinition::new("by_status");
    let path = redb_path(cfg)?;
    let file_bytes = std::fs::metadata(&path)?.len();
    let db = redb::Database::open(&path)?;
    let txn = db.begin_read()?;
    let ids = txn.open_table(IDS)?;
    let data = txn.open_table(DATA)?;
    let (mut n, mut bytes) = (0u64, 0u64);
    for entry in ids.iter()? {
        let (id, place) = entry?;
        let value = data.get(place.value())?.map_or(0, |v| v.value().len());
        n += 1;
        // The id entry, the record, and its expiry entry (i64, id); no operation ids here.
        bytes += (id.value().len() * 2 + 8 + 8 + value + 8) as u64;
    }
    for entry in txn.open_table(BY_STATUS)?.iter()? {
        let (k, _) = entry?;
        bytes += (1 + k.value().1.len()) as u64;
    }
    Ok(json!({
        "kind": "live",
        "records": n,
        "live_bytes": bytes,
        "file_bytes": file_bytes,
    }))
}
