//! Tests of the redb store against a real file: the `Store` contract, group commit, index
//! upkeep, sticky failure, and (with a real child process killed mid-write) that every
//! acknowledged write survives a crash.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::policy::identity::{ArgsHash, TenantScope};
use crate::policy::state::{Event, State};
use crate::store::{Lease, NewRecord};

fn record(id: &str, operation: Option<&str>, expires_at_ms: i64) -> Record {
    Record::new(NewRecord {
        id: ExecutionId(id.into()),
        tenant: TenantScope("t".into()),
        upstream: "mail".into(),
        route: "send_email".into(),
        tool_version: "v1".into(),
        operation_id: operation.map(str::to_string),
        args_hash: ArgsHash("ab".into()),
        method: "POST".into(),
        path: "/send".into(),
        query: None,
        path_params: vec![],
        preview: None,
        now_ms: 1,
        expires_at_ms,
    })
}

fn executing(mut r: Record, owner: Option<(&str, i64)>) -> Record {
    r.apply(Event::Start, 2, None)
        .expect("prepared -> executing");
    r.lease = owner.map(|(owner, expires_at_ms)| Lease {
        owner: owner.into(),
        expires_at_ms,
    });
    r
}

fn id(s: &str) -> ExecutionId {
    ExecutionId(s.into())
}

fn open_temp() -> (tempfile::TempDir, RedbStore) {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = RedbStore::open(&dir.path().join("nested/dir/store.redb")).expect("opens");
    (dir, store)
}

async fn claimed(store: &RedbStore, r: Record) -> Record {
    match store.claim(r).await.expect("claim") {
        Claim::Claimed(r) => r,
        Claim::Existing(r) => panic!("{} already existed", r.id),
    }
}

/// Stores `r` (claim, then one update if it is not in `prepared`), returning it as stored.
async fn insert(store: &RedbStore, r: Record) -> Record {
    let mut first = record(r.id.as_str(), r.operation_id.as_deref(), r.expires_at_ms);
    first = claimed(store, first).await;
    if r.state() == State::Prepared && r.lease.is_none() {
        return first;
    }
    let mut r = r;
    r.version = first.version;
    store.update(r).await.expect("update")
}

/// Holds the writer, runs `n` writes started by `start`, waits until all are queued, then
/// lets the writer go: they all land in one batch.
async fn in_one_batch<T, F>(store: &Arc<RedbStore>, n: usize, start: impl Fn(usize) -> F) -> Vec<T>
where
    F: std::future::Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let hooks = &store.shared.test;
    hooks.paused.store(true, Ordering::SeqCst);
    let before = hooks.submitted.load(Ordering::SeqCst);
    let tasks: Vec<_> = (0..n).map(|i| tokio::spawn(start(i))).collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while hooks.submitted.load(Ordering::SeqCst) < before + n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "writes never queued"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    hooks.paused.store(false, Ordering::SeqCst);
    let mut out = Vec::with_capacity(n);
    for t in tasks {
        out.push(t.await.expect("task"));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_get_update_compare_and_set() {
    let (_dir, store) = open_temp();
    assert!(store.path().ends_with("nested/dir/store.redb"));

    let first = claimed(&store, record("ex_1", None, 100)).await;
    assert_eq!(first.version, 1, "claim stores version 1");
    assert_eq!(
        store.get(&id("ex_1")).await.expect("get"),
        Some(first.clone())
    );
    assert_eq!(store.get(&id("ex_none")).await.expect("get"), None);

    match store.claim(record("ex_1", None, 100)).await.expect("claim") {
        Claim::Existing(r) => assert_eq!(r, first),
        Claim::Claimed(_) => panic!("second claim must see the first"),
    }

    let mut next = first.clone();
    next.apply(Event::Start, 5, None).expect("start");
    let stored = store.update(next.clone()).await.expect("update");
    assert_eq!(stored.version, 2);
    assert_eq!(stored.state(), State::Executing);
    assert_eq!(store.get(&id("ex_1")).await.expect("get"), Some(stored));

    // A writer holding the old version loses and writes nothing.
    let err = store.update(next).await.unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::Conflict {
                expected: 1,
                found: 2,
                ..
            }
        ),
        "{err:?}"
    );
    let err = store
        .update(record("ex_missing", None, 1))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::NotFound(_)), "{err:?}");
    assert_eq!(
        store
            .get(&id("ex_1"))
            .await
            .expect("get")
            .map(|r| r.version),
        Some(2)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_racing_claims_have_one_winner() {
    let (_dir, store) = open_temp();
    let store = Arc::new(store);

    // Unsynchronised: whatever batches the race produces.
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.claim(record("ex_race", None, 100)).await })
        })
        .collect();
    let mut winners = 0;
    for t in tasks {
        match t.await.expect("task").expect("claim") {
            Claim::Claimed(_) => winners += 1,
            Claim::Existing(r) => assert_eq!(r.version, 1),
        }
    }
    assert_eq!(winners, 1);

    // All in one batch: the later claims must see the first one's uncommitted insert.
    let before = store.stats();
    let results = in_one_batch(&store, 50, |_| {
        let store = store.clone();
        async move { store.claim(record("ex_batch", None, 100)).await }
    })
    .await;
    let winners = results
        .into_iter()
        .filter(|r| matches!(r, Ok(Claim::Claimed(_))))
        .count();
    assert_eq!(winners, 1);
    let after = store.stats();
    assert_eq!(after.commits - before.commits, 1, "one batch, one commit");
    assert_eq!(after.writes - before.writes, 50);
}

/// Callers on current-thread runtimes (the server's worker threads) get their answers
/// through their runtime's mailbox: one batch wakes each runtime once, however many of its
/// callers the batch answers, and every caller gets its own answer.
#[test]
fn one_batch_wakes_each_current_thread_runtime_once() {
    let (_dir, store) = open_temp();
    let store = Arc::new(store);
    let hooks = &store.shared.test;
    hooks.paused.store(true, Ordering::SeqCst);
    let callers: Vec<_> = (0..2)
        .map(|t| {
            let store = store.clone();
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                rt.block_on(async move {
                    let tasks: Vec<_> = (0..20)
                        .map(|i| {
                            let store = store.clone();
                            let id = format!("ex_home_{t}_{i:02}");
                            tokio::spawn(async move {
                                (id.clone(), store.claim(record(&id, None, 100)).await)
                            })
                        })
                        .collect();
                    let mut answers = Vec::new();
                    for task in tasks {
                        answers.push(task.await.expect("task"));
                    }
                    answers
                })
            })
        })
        .collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while hooks.submitted.load(Ordering::SeqCst) < 40 {
        assert!(std::time::Instant::now() < deadline, "claims never queued");
        std::thread::sleep(Duration::from_millis(1));
    }
    hooks.paused.store(false, Ordering::SeqCst);
    for caller in callers {
        let answers = caller.join().expect("caller thread");
        assert_eq!(answers.len(), 20);
        for (id, answer) in answers {
            match answer.expect("claim") {
                Claim::Claimed(r) => assert_eq!(r.id.as_str(), id),
                Claim::Existing(r) => panic!("{id}: found {r:?}"),
            }
        }
    }
    assert_eq!(store.stats().commits, 1, "the 40 claims shared one commit");
    assert_eq!(
        hooks.homes_woken.load(Ordering::SeqCst),
        2,
        "each runtime woken once for its 20 answers"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_updates_share_commits_and_a_conflict_spares_the_batch() {
    let (_dir, store) = open_temp();
    let store = Arc::new(store);
    let mut stored = Vec::new();
    for i in 0..100 {
        stored.push(claimed(&store, record(&format!("ex_{i:03}"), None, 100)).await);
    }
    let before = store.stats();

    // Every tenth update carries a stale version: it alone must fail.
    let results = in_one_batch(&store, 100, |i| {
        let store = store.clone();
        let mut r = stored[i].clone();
        if i % 10 == 0 {
            r.version = 0;
        }
        r.note = Some(format!("update {i}"));
        async move { store.update(r).await }
    })
    .await;
    for (i, result) in results.iter().enumerate() {
        if i % 10 == 0 {
            assert!(
                matches!(result, Err(StoreError::Conflict { .. })),
                "{i}: {result:?}"
            );
        } else {
            assert_eq!(result.as_ref().expect("update").version, 2, "{i}");
        }
    }
    let after = store.stats();
    assert_eq!(after.writes - before.writes, 100);
    assert!(
        after.commits - before.commits < after.writes - before.writes,
        "no batching: {before:?} -> {after:?}"
    );

    // Ungated concurrency batches too (not asserted as a number: timing-dependent).
    let tasks: Vec<_> = (0..100)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .claim(record(&format!("ex_free_{i:03}"), None, 100))
                    .await
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("task").expect("claim");
    }
    let stats = store.stats();
    eprintln!(
        "ungated: {} writes in {} commits",
        stats.writes - after.writes,
        stats.commits - after.commits
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reopen_sees_every_acknowledged_write_and_the_file_is_locked() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    let store = RedbStore::open(&path).expect("opens");

    let err = RedbStore::open(&path)
        .err()
        .expect("second open is refused");
    let msg = err.to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(msg.contains("already open"), "{msg}");

    let mut expected = Vec::new();
    for i in 0..20 {
        let mut r = claimed(&store, record(&format!("ex_{i:02}"), Some("op"), 100)).await;
        if i % 2 == 0 {
            r.apply(Event::Start, 3, None).expect("start");
            r = store.update(r).await.expect("update");
        }
        expected.push(r);
    }
    drop(store);

    let store = RedbStore::open(&path).expect("reopens once the first store is dropped");
    for r in &expected {
        assert_eq!(store.get(&r.id).await.expect("get").as_ref(), Some(r));
    }
    let all = store
        .list(&ListFilter {
            limit: 100,
            ..ListFilter::default()
        })
        .await
        .expect("list");
    assert_eq!(all, expected);
}

/// A file written before records were stored by place (id → record in one table) opens
/// with every record, index entry and list order intact, moved in chunks, and takes new
/// writes after them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_in_the_old_layout_moves_to_the_new_one_when_opened() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    let store = RedbStore::open(&path).expect("opens");
    let mut expected = Vec::new();
    for i in 0..7 {
        let op = (i % 2 == 0).then_some("op_a");
        let mut r = executing(record(&format!("ex_{i:02}"), op, 100 + i), None);
        if i % 3 != 0 {
            r.apply(Event::Commit, 3, None).expect("commit");
        }
        expected.push(insert(&store, r).await);
    }
    drop(store);

    let db = ::redb::Database::open(&path).expect("opens raw");
    tables::rewrite_in_legacy_layout(&db);
    let names = tables::table_names(&db);
    assert!(names.contains(&"records".to_string()), "{names:?}");
    assert!(!names.contains(&"record_ids".to_string()), "{names:?}");
    // Three records per transaction: three transactions, the last one partial.
    tables::create_all(&db, 3).expect("moves");
    assert!(tables::table_names(&db).contains(&"record_data".to_string()));
    // What an older idemproxy does first: open `records` as id → record. It must fail,
    // not find an empty table and execute again what this file has stored.
    type Legacy = ::redb::TableDefinition<'static, &'static str, &'static [u8]>;
    let txn = db.begin_write().expect("begins");
    let err = txn
        .open_table(Legacy::new("records"))
        .expect_err("an older store's open fails");
    assert!(
        matches!(err, ::redb::TableError::TableTypeMismatch { .. }),
        "{err}"
    );
    txn.abort().expect("aborts");
    drop(db);

    let store = RedbStore::open(&path).expect("opens the moved file");
    assert_eq!(
        tables::table_sizes(&store.shared.db().expect("open")),
        [7, 7, 7, 4]
    );
    for r in &expected {
        assert_eq!(store.get(&r.id).await.expect("get").as_ref(), Some(r));
    }
    let all = |filter: ListFilter| {
        let store = &store;
        async move { store.list(&filter).await.expect("list") }
    };
    let listed = all(ListFilter {
        limit: 100,
        ..ListFilter::default()
    })
    .await;
    assert_eq!(listed, expected, "every record, in id order");
    let in_op = all(ListFilter {
        operation: Some("op_a".into()),
        limit: 100,
        ..ListFilter::default()
    })
    .await;
    assert_eq!(in_op.len(), 4);
    let running = all(ListFilter {
        status: Some(State::Executing),
        limit: 100,
        ..ListFilter::default()
    })
    .await;
    assert_eq!(running.len(), 3);

    // A moved record updates in place; a new one goes after the moved ones.
    let mut r = expected[0].clone();
    r.apply(Event::Commit, 5, None).expect("commit");
    let r = store.update(r).await.expect("update a moved record");
    assert_eq!(store.get(&r.id).await.expect("get"), Some(r));
    claimed(&store, record("ex_new", None, 50)).await;
    assert_eq!(
        tables::table_sizes(&store.shared.db().expect("open")),
        [8, 8, 8, 4]
    );
    assert_eq!(
        store.gc(1_000, 100).await.expect("gc"),
        6,
        "all but two executing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_filters_and_pages_with_the_cursor() {
    let (_dir, store) = open_temp();
    let mut want_executing = Vec::new();
    let mut want_op = Vec::new();
    let mut all = Vec::new();
    for i in 0..30 {
        let op = if i % 3 == 0 {
            Some("op_a")
        } else {
            Some("op_b")
        };
        let mut r = record(&format!("ex_{i:02}"), op, 100);
        if i % 2 == 0 {
            r = executing(r, Some(("me", 1_000)));
        }
        let r = insert(&store, r).await;
        if i % 2 == 0 {
            want_executing.push(r.id.clone());
        }
        if i % 3 == 0 {
            want_op.push(r.id.clone());
        }
        all.push(r.id.clone());
    }

    async fn pages(store: &RedbStore, mut filter: ListFilter) -> (Vec<ExecutionId>, usize) {
        let mut ids = Vec::new();
        let mut n = 0;
        loop {
            let page = store.list(&filter).await.expect("list");
            assert!(page.len() <= filter.limit);
            if page.is_empty() {
                return (ids, n);
            }
            n += 1;
            filter.after = page.last().map(|r| r.id.clone());
            ids.extend(page.into_iter().map(|r| r.id));
        }
    }

    let (ids, n) = pages(
        &store,
        ListFilter {
            status: Some(State::Executing),
            limit: 4,
            ..ListFilter::default()
        },
    )
    .await;
    assert_eq!(ids, want_executing);
    assert_eq!(n, 4, "15 records in pages of 4");

    let (ids, _) = pages(
        &store,
        ListFilter {
            operation: Some("op_a".into()),
            limit: 3,
            ..ListFilter::default()
        },
    )
    .await;
    assert_eq!(ids, want_op);

    let (ids, _) = pages(
        &store,
        ListFilter {
            status: Some(State::Prepared),
            operation: Some("op_a".into()),
            limit: 2,
            ..ListFilter::default()
        },
    )
    .await;
    let both: Vec<_> = (0..30)
        .filter(|i| i % 2 != 0 && i % 3 == 0)
        .map(|i| id(&format!("ex_{i:02}")))
        .collect();
    assert_eq!(ids, both);

    let (ids, _) = pages(
        &store,
        ListFilter {
            limit: 7,
            ..ListFilter::default()
        },
    )
    .await;
    assert_eq!(ids, all);

    let none = store.list(&ListFilter::default()).await.expect("list");
    assert!(none.is_empty(), "limit 0 is an empty page");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivered_records_have_no_status_entry_and_are_listed_from_the_records() {
    let (_dir, store) = open_temp();
    let mut delivered = Vec::new();
    for i in 0..12 {
        let op = (i % 2 == 0).then_some("op_a");
        let mut r = executing(record(&format!("ex_{i:02}"), op, 100), None);
        if i % 3 != 0 {
            r.apply(Event::Commit, 3, None).expect("commit");
            r.apply(Event::Deliver, 4, None).expect("deliver");
            delivered.push(r.id.clone());
        }
        insert(&store, r).await;
    }
    // The 4 executing records have status entries, the 8 delivered ones none.
    assert_eq!(
        tables::table_sizes(&store.shared.db().expect("open")),
        [12, 4, 12, 6]
    );

    let mut filter = ListFilter {
        status: Some(State::ResultDelivered),
        limit: 3,
        ..ListFilter::default()
    };
    let mut listed = Vec::new();
    loop {
        let page = store.list(&filter).await.expect("list");
        if page.is_empty() {
            break;
        }
        assert!(page.len() <= 3);
        assert!(page.iter().all(|r| r.state() == State::ResultDelivered));
        filter.after = page.last().map(|r| r.id.clone());
        listed.extend(page.into_iter().map(|r| r.id));
    }
    assert_eq!(
        listed, delivered,
        "every delivered record, in id order, once"
    );

    let in_op = store
        .list(&ListFilter {
            status: Some(State::ResultDelivered),
            operation: Some("op_a".into()),
            limit: 100,
            ..ListFilter::default()
        })
        .await
        .expect("list");
    let want: Vec<_> = [2, 4, 8, 10]
        .iter()
        .map(|i| id(&format!("ex_{i:02}")))
        .collect();
    assert_eq!(in_op.into_iter().map(|r| r.id).collect::<Vec<_>>(), want);

    // gc takes the delivered records (expired) and leaves the executing ones.
    assert_eq!(store.gc(1_000, 100).await.expect("gc"), 8);
    assert_eq!(
        tables::table_sizes(&store.shared.db().expect("open")),
        [4, 4, 4, 2]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_executing_and_lease_renewal() {
    let (_dir, store) = open_temp();
    insert(
        &store,
        executing(record("ex_a", None, 100), Some(("a", 100))),
    )
    .await;
    insert(
        &store,
        executing(record("ex_b", None, 100), Some(("b", 200))),
    )
    .await;
    insert(&store, executing(record("ex_c", None, 100), None)).await;
    insert(
        &store,
        executing(record("ex_d", None, 100), Some(("a", i64::MAX))),
    )
    .await;
    insert(&store, record("ex_e", None, 100)).await;

    let ids = |rs: Vec<Record>| rs.into_iter().map(|r| r.id.0).collect::<Vec<_>>();
    let stale = store.stale_executing(150, 10).await.expect("stale");
    assert_eq!(ids(stale), ["ex_a", "ex_c"]);
    let stale = store.stale_executing(i64::MAX, 10).await.expect("stale");
    assert_eq!(ids(stale), ["ex_a", "ex_b", "ex_c", "ex_d"]);
    let stale = store.stale_executing(i64::MAX, 2).await.expect("stale");
    assert_eq!(stale.len(), 2);

    let before = store.get(&id("ex_a")).await.expect("get").expect("exists");
    assert_eq!(store.renew_leases("a", 500).await.expect("renew"), 2);
    let after = store.get(&id("ex_a")).await.expect("get").expect("exists");
    assert_eq!(after.lease.as_ref().map(|l| l.expires_at_ms), Some(500));
    assert_eq!(
        after.version, before.version,
        "renewal keeps the owner's fencing token"
    );
    let stale = store.stale_executing(150, 10).await.expect("stale");
    assert_eq!(ids(stale), ["ex_c"]);
    assert_eq!(store.renew_leases("nobody", 500).await.expect("renew"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_deletes_only_expired_finished_records_and_their_index_entries() {
    let (_dir, store) = open_temp();
    let mut done = record("ex_done", Some("op"), 10);
    done.apply(Event::Start, 2, None).expect("start");
    done.apply(Event::Commit, 3, None).expect("commit");
    insert(&store, done).await;
    insert(&store, record("ex_at_now", Some("op"), 20)).await;
    insert(
        &store,
        executing(record("ex_running", Some("op"), 10), None),
    )
    .await;
    insert(&store, record("ex_young", Some("op"), 1_000)).await;
    insert(&store, record("ex_old_no_op", None, 5)).await;
    assert_eq!(
        tables::table_sizes(&store.shared.db().expect("open")),
        [5, 5, 5, 4]
    );

    assert_eq!(store.gc(20, 1).await.expect("gc"), 1, "limit is honoured");
    assert_eq!(store.gc(20, 100).await.expect("gc"), 2);
    assert_eq!(store.gc(20, 100).await.expect("gc"), 0);

    for gone in ["ex_done", "ex_at_now", "ex_old_no_op"] {
        assert_eq!(store.get(&id(gone)).await.expect("get"), None, "{gone}");
    }
    for kept in ["ex_running", "ex_young"] {
        assert!(store.get(&id(kept)).await.expect("get").is_some(), "{kept}");
    }
    assert_eq!(
        tables::table_sizes(&store.shared.db().expect("open")),
        [2, 2, 2, 2]
    );
    let by_op = store
        .list(&ListFilter {
            operation: Some("op".into()),
            limit: 10,
            ..ListFilter::default()
        })
        .await
        .expect("list");
    assert_eq!(by_op.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_commit_fails_its_batch_and_writes_resume_once_the_disk_takes_them() {
    let (_dir, store) = open_temp();
    let store = Arc::new(store);
    let kept = claimed(&store, record("ex_kept", None, 100)).await;

    store
        .shared
        .test
        .fail_next_commit
        .store(true, Ordering::SeqCst);
    let results = in_one_batch(&store, 5, |i| {
        let store = store.clone();
        async move {
            store
                .claim(record(&format!("ex_lost_{i}"), None, 100))
                .await
        }
    })
    .await;
    for r in results {
        assert!(matches!(r, Err(StoreError::Backend(_))), "{r:?}");
    }
    for i in 0..5 {
        let lost = store.get(&id(&format!("ex_lost_{i}"))).await.expect("get");
        assert_eq!(lost, None, "nothing of the failed batch is visible");
    }

    // While the disk still refuses writes, every later write is refused too.
    store.shared.test.probe_fails.store(true, Ordering::SeqCst);
    let err = store.update(kept.clone()).await.unwrap_err();
    assert!(err.to_string().contains("store write failed"), "{err}");
    assert!(store.ready().await.is_err(), "not ready while writes fail");
    std::thread::sleep(REOPEN_EVERY);
    assert!(store.gc(i64::MAX, 10).await.is_err());
    assert!(store.renew_leases("x", 1).await.is_err());
    assert!(store.claim(record("ex_new", None, 100)).await.is_err());
    // What was committed before stays readable.
    assert_eq!(store.get(&kept.id).await.expect("get"), Some(kept.clone()));

    // Once the disk takes writes again the store is reopened and writes resume, without
    // a restart; nothing of the failed batch came back.
    store.shared.test.probe_fails.store(false, Ordering::SeqCst);
    std::thread::sleep(REOPEN_EVERY);
    let updated = store.update(kept.clone()).await.expect("writes resume");
    assert_eq!(updated.version, kept.version + 1);
    claimed(&store, record("ex_new", None, 100)).await;
    assert!(store.ready().await.is_ok());
    for i in 0..5 {
        let lost = store.get(&id(&format!("ex_lost_{i}"))).await.expect("get");
        assert_eq!(lost, None, "nothing of the failed batch is visible");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_after_gc_keeps_the_store_working() {
    let (_dir, mut store) = open_temp();
    for i in 0..200 {
        let mut r = record(&format!("ex_{i:03}"), None, if i < 190 { 1 } else { 1_000 });
        r.preview = Some(serde_json::json!({ "pad": "x".repeat(2_000) }));
        insert(&store, r).await;
    }
    assert_eq!(store.gc(10, 1_000).await.expect("gc"), 190);
    let before = std::fs::metadata(store.path()).expect("file").len();
    store.compact().expect("compacts");
    let after = std::fs::metadata(store.path()).expect("file").len();
    assert!(after <= before, "{before} -> {after}");

    // The writer came back.
    claimed(&store, record("ex_after", None, 1_000)).await;
    let all = store
        .list(&ListFilter {
            limit: 100,
            ..ListFilter::default()
        })
        .await
        .expect("list");
    assert_eq!(all.len(), 11);
}

const CRASH_CHILD_ENV: &str = "IDEMPROXY_REDB_CRASH_CHILD";

/// Not a test by itself: the body of the child process `a_killed_process_loses_no_acked_write`
/// starts. It writes until it is killed, printing each id once its claim is acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_child() {
    let Some(path) = std::env::var_os(CRASH_CHILD_ENV) else {
        return;
    };
    let store = Arc::new(RedbStore::open(std::path::Path::new(&path)).expect("child opens"));
    let tasks: Vec<_> = (0..8)
        .map(|task| {
            let store = store.clone();
            tokio::spawn(async move {
                for n in 0..100_000 {
                    let id = format!("ex_{task}_{n:06}");
                    claimed(&store, record(&id, None, 100)).await;
                    println!("acked {id}");
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("task");
    }
}

#[test]
fn a_killed_process_loses_no_acked_write() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("crash.redb");
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "store::redb::tests::crash_child", "--nocapture"])
        .env(CRASH_CHILD_ENV, &path)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("child starts");
    let stdout = child.stdout.take().expect("piped");
    let mut lines = BufReader::new(stdout).lines();
    let mut acked = Vec::new();
    while acked.len() < 300 {
        let Some(line) = lines.next() else { break };
        if let Some(id) = line.expect("child output").strip_prefix("acked ") {
            acked.push(id.to_string());
        }
    }
    // SIGKILL: no destructor, no clean shutdown, writes in flight. The pipe stays open
    // until then so the child cannot stop on its own (a closed stdout would make it panic).
    child.kill().expect("kill");
    child.wait().expect("reap");
    drop(lines);
    assert!(
        acked.len() >= 300,
        "child stopped early after {} acks",
        acked.len()
    );

    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let store = RedbStore::open(&path).expect("reopens after a crash");
    rt.block_on(async {
        for id in &acked {
            let found = store.get(&ExecutionId(id.clone())).await.expect("get");
            assert_eq!(found.map(|r| r.version), Some(1), "{id} was acked but lost");
        }
    });
    let [records, status, expiry, _] = tables::table_sizes(&store.shared.db().expect("open"));
    assert!(records >= acked.len() as u64);
    assert_eq!(
        (records, records),
        (status, expiry),
        "indexes match records"
    );
}

fn mark(op: &str, state: crate::store::OperationState, at: i64, expires: i64) -> OperationMark {
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
async fn operation_marks_merge_forward_survive_reopen_and_expire() {
    use crate::store::OperationState::{Cancelled, CancelledAfterSideEffect};
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    let store = RedbStore::open(&path).expect("opens");
    assert_eq!(store.operation("op_a").await.expect("read"), None);

    let first = store
        .mark_operation(mark("op_a", CancelledAfterSideEffect, 10, 100))
        .await
        .expect("mark");
    assert_eq!(first, mark("op_a", CancelledAfterSideEffect, 10, 100));
    // A later, weaker mark cannot move it back or rename who cancelled first.
    let merged = store
        .mark_operation(mark("op_a", Cancelled, 20, 50))
        .await
        .expect("mark");
    assert_eq!(merged.state, CancelledAfterSideEffect);
    assert_eq!((merged.by.as_str(), merged.cancelled_at_ms), ("by_10", 10));
    assert_eq!((merged.updated_at_ms, merged.expires_at_ms), (20, 100));
    store
        .mark_operation(mark("op_b", Cancelled, 5, 30))
        .await
        .expect("mark");
    // Marks are not records: listings and record tables do not see them.
    assert_eq!(
        tables::table_sizes(&store.shared.db().expect("open")),
        [0, 0, 0, 0]
    );
    drop(store);

    let store = RedbStore::open(&path).expect("reopens");
    assert_eq!(store.operation("op_a").await.expect("read"), Some(merged));
    let up = store
        .mark_operation(mark("op_b", CancelledAfterSideEffect, 40, 30))
        .await
        .expect("mark");
    assert_eq!(
        (up.state, up.by.as_str()),
        (CancelledAfterSideEffect, "by_5")
    );

    // gc: op_b expired at 30, op_a lives until 100; the limit is honoured.
    insert(&store, record("ex_old", None, 5)).await;
    assert_eq!(
        store.gc(30, 1).await.expect("gc"),
        2,
        "one record + one mark"
    );
    assert_eq!(store.operation("op_b").await.expect("read"), None);
    assert!(store.operation("op_a").await.expect("read").is_some());
    assert_eq!(store.gc(99, 10).await.expect("gc"), 0);
    assert_eq!(store.gc(100, 10).await.expect("gc"), 1);
    assert_eq!(store.operation("op_a").await.expect("read"), None);
}

/// One record whose bytes cannot be decoded is left out of a listing (with a warning
/// naming it) instead of failing the whole page (issue 34: the admin listing was a 500).
#[tokio::test]
async fn a_listing_skips_an_unreadable_record() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("store.redb");
    let store = RedbStore::open(&path).expect("opens");
    claimed(&store, record("ex_a", None, 100)).await;
    claimed(&store, record("ex_b", None, 100)).await;
    drop(store);
    {
        let db = ::redb::Database::open(&path).expect("opens raw");
        type Ids = ::redb::TableDefinition<'static, &'static str, u64>;
        type Data = ::redb::TableDefinition<'static, u64, &'static [u8]>;
        let txn = db.begin_write().expect("begins");
        {
            use ::redb::ReadableTable;
            let ids = txn.open_table(Ids::new("record_ids")).expect("ids");
            let place = ids.get("ex_a").expect("reads").expect("present").value();
            let mut data = txn.open_table(Data::new("record_data")).expect("data");
            data.insert(place, b"not json".as_slice())
                .expect("overwrites");
        }
        txn.commit().expect("commits");
    }
    let store = RedbStore::open(&path).expect("opens again");
    assert!(matches!(
        store.get(&id("ex_a")).await,
        Err(StoreError::Corrupt { .. })
    ));
    let listed = store
        .list(&ListFilter {
            limit: 10,
            ..ListFilter::default()
        })
        .await
        .expect("the listing still works");
    assert_eq!(
        listed.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
        ["ex_b"]
    );
}

/// The search filters and paging, as every store runs them (`store::conformance`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn search_filters_and_pages_like_every_store() {
    let (_dir, store) = open_temp();
    crate::store::conformance::search(&store).await;
    // Every record has a route and a creation entry; tool calls and keys where they exist.
    let db = store.shared.db().expect("open");
    let records = crate::store::conformance::search_records();
    let with = |f: fn(&Record) -> bool| records.iter().filter(|r| f(r)).count() as u64;
    assert_eq!(
        tables::search::sizes(&db),
        [
            with(|r| r.tool_call_id.is_some()),
            with(|r| r.key.is_some()),
            40,
            40
        ]
    );
}

/// gc takes a record's search entries with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_removes_the_search_entries() {
    let (_dir, store) = open_temp();
    let mut r = record("ex_a", None, 10);
    r.tool_call_id = Some("call_a".into());
    r.key = Some("key_a".into());
    // Claimed as they are: a record's search fields are fixed by its claim.
    claimed(&store, r).await;
    claimed(&store, record("ex_b", None, 1_000)).await;
    let db = store.shared.db().expect("open");
    assert_eq!(tables::search::sizes(&db), [1, 1, 2, 2]);
    assert_eq!(store.gc(20, 100).await.expect("gc"), 1);
    assert_eq!(tables::search::sizes(&db), [0, 0, 1, 1]);
}

/// A file written before the search indexes gets their entries when it is opened, a chunk
/// per transaction, and a build cut short by a crash goes on where its last chunk ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_from_before_the_search_indexes_becomes_searchable_when_opened() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    let store = RedbStore::open(&path).expect("opens");
    for i in 0..8 {
        let mut r = record(&format!("ex_{i:02}"), None, 100);
        if i % 2 == 1 {
            r.upstream = "pay".into();
        }
        r.created_at_ms = 50 + i;
        claimed(&store, r).await;
    }
    drop(store);

    let db = ::redb::Database::open(&path).expect("opens raw");
    tables::search::forget(&db);
    assert!(!tables::table_names(&db).contains(&"by_route".to_string()));
    // A build that stops after its first chunk (a crash): what it committed stays, and
    // the next open goes on after it.
    use tables::search::{build_step, Step};
    assert_eq!(build_step(&db, 3).expect("builds"), Step::Indexed(3));
    assert!(!tables::search::built(&db));
    assert_eq!(tables::search::sizes(&db), [0, 0, 3, 3]);
    tables::create_all(&db, 3).expect("builds");
    assert!(tables::search::built(&db));
    assert_eq!(tables::search::sizes(&db), [0, 0, 8, 8]);
    drop(db);

    let store = RedbStore::open(&path).expect("opens the built file");
    let pay = store
        .list(&ListFilter {
            upstream: Some("pay".into()),
            limit: 100,
            ..ListFilter::default()
        })
        .await
        .expect("list");
    let ids: Vec<_> = pay.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids, ["ex_01", "ex_03", "ex_05", "ex_07"]);
    let early = store
        .list(&ListFilter {
            until: Some(53),
            limit: 100,
            ..ListFilter::default()
        })
        .await
        .expect("list");
    assert_eq!(early.len(), 3);
}

/// A filtered listing reads the records its index names, not the store: among 2,000
/// records, a page of a rare tool call, key, route or time range decodes about as many
/// records as it returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filtered_listing_reads_what_its_index_names() {
    let (_dir, store) = open_temp();
    let store = Arc::new(store);
    for chunk in 0..20 {
        in_one_batch(&store, 100, |i| {
            let store = store.clone();
            async move {
                let n = chunk * 100 + i;
                let mut r = record(&format!("ex_{n:05}"), None, 10_000);
                r.upstream = format!("up_{}", n % 4);
                r.route = format!("route_{}", n % 40);
                r.tool_call_id = Some(format!("call_{}", n % 1000));
                r.key = Some(format!("key_{n}"));
                r.created_at_ms = 1_000 + n as i64;
                claimed(&store, r).await
            }
        })
        .await;
    }
    let db = store.shared.db().expect("open");
    let snapshot = tables::Snapshot::begin(&db).expect("snapshot");
    let s = |v: &str| Some(v.to_string());
    for (filter, found) in [
        (
            ListFilter {
                tool_call: s("call_7"),
                ..ListFilter::default()
            },
            2,
        ),
        (
            ListFilter {
                key: s("key_77"),
                ..ListFilter::default()
            },
            1,
        ),
        (
            ListFilter {
                upstream: s("up_1"),
                route: s("route_5"),
                ..ListFilter::default()
            },
            50,
        ),
        (
            ListFilter {
                route: s("route_5"),
                ..ListFilter::default()
            },
            50,
        ),
        (
            ListFilter {
                upstream: s("up_2"),
                ..ListFilter::default()
            },
            10,
        ),
        (
            ListFilter {
                since: Some(1_500),
                until: Some(1_530),
                ..ListFilter::default()
            },
            10,
        ),
    ] {
        let filter = ListFilter {
            limit: 10,
            ..filter
        };
        tables::LOADS.with(|n| n.set(0));
        let page = snapshot.list(&filter).expect("list");
        let loads = tables::LOADS.with(|n| n.get());
        assert_eq!(page.len(), found.min(10), "{filter:?}");
        assert_eq!(loads, page.len() as u64, "{filter:?} read {loads} records");
    }
}

/// A committed record that started job `job` (also its external id), in `state`.
fn with_job(id_: &str, job: &str, state: crate::policy::job::JobState) -> Record {
    let mut r = executing(record(id_, None, 100), None);
    r.apply(Event::Commit, 3, None).expect("commit");
    r.external_id = Some(job.into());
    r.external_indexed = true;
    r.job = Some(crate::store::record::Job {
        id: job.into(),
        state,
        result: None,
        event: None,
        ended_by: None,
        started_at_ms: 3,
        updated_at_ms: 3,
    });
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn external_ids_and_jobs_are_indexed_and_built_for_older_files() {
    use crate::policy::job::JobState::{Failed, Running, Succeeded};
    use crate::store::JobFilter;
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    let store = RedbStore::open(&path).expect("opens");
    insert(&store, with_job("ex_a", "job_1", Running)).await;
    insert(&store, with_job("ex_b", "job_2", Running)).await;
    insert(&store, with_job("ex_c", "job_3", Succeeded)).await;
    insert(&store, with_job("ex_0", "job_0", Failed)).await;
    let mut shared = executing(record("ex_d", None, 100), None);
    shared.apply(Event::Commit, 3, None).expect("commit");
    shared.external_id = Some("job_1".into());
    shared.external_indexed = true;
    insert(&store, shared).await;
    // An external id that nothing looks up is kept, not indexed.
    let mut plain = executing(record("ex_e", None, 100), None);
    plain.external_id = Some("job_1".into());
    insert(&store, plain).await;
    fn ids(rs: Vec<Record>) -> Vec<String> {
        rs.into_iter().map(|r| r.id.0).collect()
    }
    async fn check(store: &RedbStore) {
        {
            let list = |f: ListFilter| async move { ids(store.list(&f).await.expect("list")) };
            assert_eq!(
                list(ListFilter {
                    external_id: Some("job_1".into()),
                    limit: 10,
                    ..ListFilter::default()
                })
                .await,
                ["ex_a", "ex_d"]
            );
            assert_eq!(
                list(ListFilter {
                    job: Some(JobFilter::In(Running)),
                    limit: 10,
                    ..ListFilter::default()
                })
                .await,
                ["ex_a", "ex_b"]
            );
            assert_eq!(
                list(ListFilter {
                    job: Some(JobFilter::Any),
                    limit: 10,
                    ..ListFilter::default()
                })
                .await,
                ["ex_0", "ex_a", "ex_b", "ex_c"]
            );
            // One page: the smallest id of any state comes first.
            assert_eq!(
                list(ListFilter {
                    job: Some(JobFilter::Any),
                    limit: 1,
                    ..ListFilter::default()
                })
                .await,
                ["ex_0"]
            );
            // Paged with the cursor across the job states.
            assert_eq!(
                list(ListFilter {
                    job: Some(JobFilter::Any),
                    after: Some(id("ex_a")),
                    limit: 1,
                    ..ListFilter::default()
                })
                .await,
                ["ex_b"]
            );
        }
    }
    check(&store).await;
    assert_eq!(
        tables::job_index_sizes(&store.shared.db().expect("open")),
        [5, 4]
    );
    // A job ends: its entry moves; a record deleted by gc takes its entries along.
    let mut b = store.get(&id("ex_b")).await.expect("get").expect("stored");
    b.job.as_mut().expect("job").state = Failed;
    store.update(b).await.expect("update");
    let failed = store
        .list(&ListFilter {
            job: Some(JobFilter::In(Failed)),
            limit: 10,
            ..ListFilter::default()
        })
        .await
        .expect("list");
    assert_eq!(ids(failed), ["ex_0", "ex_b"]);
    let mut b = store.get(&id("ex_b")).await.expect("get").expect("stored");
    b.job.as_mut().expect("job").state = Running;
    store.update(b).await.expect("update");
    drop(store);

    // A file written before these indexes: built when it opens, two records per
    // transaction, with the same answers.
    let db = ::redb::Database::open(&path).expect("opens raw");
    tables::drop_job_indexes(&db);
    tables::create_all(&db, 2).expect("builds");
    assert_eq!(tables::job_index_sizes(&db), [5, 4]);
    drop(db);
    let store = RedbStore::open(&path).expect("opens");
    check(&store).await;
    assert_eq!(store.gc(1_000, 100).await.expect("gc"), 5, "all but ex_e");
    assert_eq!(
        tables::job_index_sizes(&store.shared.db().expect("open")),
        [0, 0]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_and_external_ids_list_like_every_store() {
    let (_dir, store) = open_temp();
    crate::store::conformance::jobs(&store).await;
}
