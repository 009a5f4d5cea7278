//! Store tests that every backend runs as they are written here (redb in
//! `store::redb::tests`, PostgreSQL in `store::postgres::tests`): a listing's filters and
//! paging, checked against a plain reading of what each filter means.

use super::{ListFilter, NewRecord, Record, Store};
use crate::policy::identity::{ArgsHash, ExecutionId, TenantScope};
use crate::policy::state::{Event, State};

/// The records [`search`] stores: two upstreams sharing a route name, ids whose order is
/// not their creation order, tool calls and keys shared by some records and missing on
/// others, and every kind of status (delivered ones have no redb status entry).
pub(crate) fn search_records() -> Vec<Record> {
    (0..40)
        .map(|i: i64| {
            let (upstream, route) = match i % 4 {
                0 => ("mail", "send"),
                1 => ("pay", "send"),
                2 => ("pay", "refund"),
                _ => ("mail", "draft"),
            };
            let mut r = Record::new(NewRecord {
                id: ExecutionId(format!("ex_{i:02}")),
                tenant: TenantScope("t".into()),
                upstream: upstream.into(),
                route: route.into(),
                tool_version: "v1".into(),
                operation_id: Some(format!("op_{}", i % 3)),
                args_hash: ArgsHash("ab".into()),
                method: "POST".into(),
                path: "/x".into(),
                query: None,
                path_params: vec![],
                preview: None,
                // Created out of id order: 7 and 40 share no factor.
                now_ms: 10_000 + (i * 7 % 40) * 10,
                expires_at_ms: i64::MAX / 2,
            });
            r.model_round = Some(format!("round_{}", i % 2));
            r.tool_call_id = (i % 5 != 0).then(|| format!("call_{}", i % 6));
            r.key = (i % 7 != 0).then(|| format!("key_{}", i / 2));
            let now = r.created_at_ms;
            match i % 3 {
                0 => {}
                1 => {
                    for e in [Event::Start, Event::Commit, Event::Deliver] {
                        r.apply(e, now, None).expect("legal");
                    }
                }
                _ => r.apply(Event::Start, now, None).expect("legal"),
            }
            r
        })
        .collect()
}

/// Stores [`search_records`] in `store` (claimed, then updated to their state), and
/// checks every filter alone and several together, each paged three at a time through the
/// cursor, against the records that mean it.
pub(crate) async fn search(store: &dyn Store) {
    let records = search_records();
    for r in &records {
        let mut fresh = r.clone();
        // Claimed as it is created, then moved the way the proxy moves it.
        let history = std::mem::take(&mut fresh.history);
        let state = r.state();
        let mut claimed = Record::new(NewRecord {
            id: fresh.id.clone(),
            tenant: fresh.tenant.clone(),
            upstream: fresh.upstream.clone(),
            route: fresh.route.clone(),
            tool_version: fresh.tool_version.clone(),
            operation_id: fresh.operation_id.clone(),
            args_hash: fresh.args_hash.clone(),
            method: fresh.method.clone(),
            path: fresh.path.clone(),
            query: None,
            path_params: vec![],
            preview: None,
            now_ms: fresh.created_at_ms,
            expires_at_ms: fresh.expires_at_ms,
        });
        claimed.model_round = fresh.model_round.clone();
        claimed.tool_call_id = fresh.tool_call_id.clone();
        claimed.key = fresh.key.clone();
        let mut stored = match store.claim(claimed).await.expect("claim") {
            super::Claim::Claimed(r) => r,
            super::Claim::Existing(r) => panic!("{} exists", r.id),
        };
        for h in history {
            stored.apply(h.event, h.at_ms, None).expect("legal");
            stored = store.update(stored).await.expect("update");
        }
        assert_eq!(stored.state(), state);
    }

    let s = |v: &str| Some(v.to_string());
    let filters = [
        ListFilter::default(),
        ListFilter {
            tool_call: s("call_1"),
            ..ListFilter::default()
        },
        ListFilter {
            tool_call: s("call_none"),
            ..ListFilter::default()
        },
        ListFilter {
            key: s("key_5"),
            ..ListFilter::default()
        },
        ListFilter {
            upstream: s("pay"),
            ..ListFilter::default()
        },
        ListFilter {
            route: s("send"),
            ..ListFilter::default()
        },
        ListFilter {
            upstream: s("mail"),
            route: s("send"),
            ..ListFilter::default()
        },
        ListFilter {
            upstream: s("mail"),
            route: s("refund"),
            ..ListFilter::default()
        },
        ListFilter {
            since: Some(10_100),
            ..ListFilter::default()
        },
        ListFilter {
            until: Some(10_100),
            ..ListFilter::default()
        },
        ListFilter {
            since: Some(10_050),
            until: Some(10_300),
            ..ListFilter::default()
        },
        ListFilter {
            since: Some(10_050),
            until: Some(10_300),
            status: Some(State::ResultDelivered),
            ..ListFilter::default()
        },
        ListFilter {
            status: Some(State::Executing),
            route: s("send"),
            ..ListFilter::default()
        },
        ListFilter {
            status: Some(State::ResultDelivered),
            upstream: s("pay"),
            since: Some(10_100),
            ..ListFilter::default()
        },
        ListFilter {
            operation: s("op_1"),
            tool_call: s("call_1"),
            ..ListFilter::default()
        },
        ListFilter {
            key: s("key_3"),
            upstream: s("mail"),
            ..ListFilter::default()
        },
        ListFilter {
            operation: s("op_2"),
            upstream: s("pay"),
            route: s("refund"),
            until: Some(10_200),
            ..ListFilter::default()
        },
    ];
    for filter in filters {
        // What the filter means, read plainly.
        let want: Vec<&str> = records
            .iter()
            .filter(|r| {
                let eq = |want: &Option<String>, have: Option<&String>| {
                    want.is_none() || want.as_ref() == have
                };
                filter.status.is_none_or(|s| s == r.state())
                    && eq(&filter.operation, r.operation_id.as_ref())
                    && eq(&filter.tool_call, r.tool_call_id.as_ref())
                    && eq(&filter.key, r.key.as_ref())
                    && eq(&filter.upstream, Some(&r.upstream))
                    && eq(&filter.route, Some(&r.route))
                    && filter.since.is_none_or(|t| r.created_at_ms >= t)
                    && filter.until.is_none_or(|t| r.created_at_ms < t)
            })
            .map(|r| r.id.as_str())
            .collect();
        let mut got: Vec<String> = Vec::new();
        let mut after = None;
        for _ in 0..100 {
            let page = store
                .list(&ListFilter {
                    after: after.clone(),
                    limit: 3,
                    ..filter.clone()
                })
                .await
                .expect("list");
            assert!(page.len() <= 3, "{filter:?}");
            let Some(last) = page.last() else { break };
            after = Some(last.id.clone());
            got.extend(page.iter().map(|r| r.id.to_string()));
        }
        assert_eq!(got, want, "{filter:?}");
        let one = store
            .list(&ListFilter {
                limit: 1,
                ..filter.clone()
            })
            .await
            .expect("list");
        assert_eq!(
            one.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
            want.iter().take(1).copied().collect::<Vec<_>>(),
            "{filter:?}"
        );
    }
    // The correlation fields come back as stored.
    let back = store
        .get(&ExecutionId("ex_13".into()))
        .await
        .expect("get")
        .expect("stored");
    assert_eq!(back.model_round.as_deref(), Some("round_1"));
    assert_eq!(back.tool_call_id.as_deref(), Some("call_1"));
    assert_eq!(back.key.as_deref(), Some("key_6"));
}

/// Stores records with jobs in every state and external ids (indexed or only kept), and
/// checks the `external_id` and `job` filters alone and with others, paged three at a time
/// and as a page of one, against a plain reading; then a job ends and moves between
/// listings (its index entries move with the update).
pub(crate) async fn jobs(store: &dyn Store) {
    use super::record::Job;
    use super::JobFilter;
    use crate::policy::job::JobState;
    let mut records: Vec<Record> = (0..30)
        .map(|i: i64| {
            let mut r = Record::new(NewRecord {
                // Ids out of the order the states cycle in.
                id: ExecutionId(format!("ex_{:02}", i * 7 % 30)),
                tenant: TenantScope("t".into()),
                upstream: if i % 2 == 0 { "mail" } else { "pay" }.into(),
                route: "send".into(),
                tool_version: "v1".into(),
                operation_id: None,
                args_hash: ArgsHash("ab".into()),
                method: "POST".into(),
                path: "/x".into(),
                query: None,
                path_params: vec![],
                preview: None,
                now_ms: 10_000 + i,
                expires_at_ms: i64::MAX / 2,
            });
            for e in [Event::Start, Event::Commit] {
                r.apply(e, 10_000 + i, None).expect("legal");
            }
            if i % 3 == 0 {
                r.apply(Event::Deliver, 10_000 + i, None).expect("legal");
            }
            // Shared external ids; a third of them kept but not indexed.
            r.external_id = Some(format!("ext_{}", i % 4));
            r.external_indexed = i % 3 != 2;
            if i % 5 != 0 {
                r.external_indexed = true;
                r.job = Some(Job {
                    id: format!("job_{i}"),
                    state: JobState::ALL[(i % 3) as usize],
                    result: None,
                    event: None,
                    ended_by: None,
                    started_at_ms: 10_000 + i,
                    updated_at_ms: 10_000 + i,
                });
            }
            r
        })
        .collect();
    for r in &records {
        let mut claimed = r.clone();
        claimed.version = 0;
        let stored = match store.claim(claimed).await.expect("claim") {
            super::Claim::Claimed(r) => r,
            super::Claim::Existing(r) => panic!("{} exists", r.id),
        };
        assert_eq!(stored.state(), r.state());
    }
    records.sort_by(|a, b| a.id.cmp(&b.id));
    let check = |records: Vec<Record>| async move {
        let s = |v: &str| Some(v.to_string());
        let filters = [
            ListFilter {
                external_id: s("ext_1"),
                ..ListFilter::default()
            },
            ListFilter {
                external_id: s("ext_none"),
                ..ListFilter::default()
            },
            ListFilter {
                job: Some(JobFilter::Any),
                ..ListFilter::default()
            },
            ListFilter {
                job: Some(JobFilter::In(JobState::Running)),
                ..ListFilter::default()
            },
            ListFilter {
                job: Some(JobFilter::In(JobState::Failed)),
                upstream: s("pay"),
                ..ListFilter::default()
            },
            ListFilter {
                job: Some(JobFilter::In(JobState::Succeeded)),
                status: Some(State::Committed),
                ..ListFilter::default()
            },
            ListFilter {
                external_id: s("ext_2"),
                job: Some(JobFilter::Any),
                ..ListFilter::default()
            },
        ];
        for filter in filters {
            let want: Vec<&str> = records
                .iter()
                .filter(|r| {
                    filter.status.is_none_or(|s| s == r.state())
                        && filter.upstream.as_ref().is_none_or(|u| *u == r.upstream)
                        && filter
                            .external_id
                            .as_ref()
                            .is_none_or(|e| r.external_indexed && r.external_id.as_ref() == Some(e))
                        && filter.job.is_none_or(|j| match (j, &r.job) {
                            (_, None) => false,
                            (JobFilter::Any, Some(_)) => true,
                            (JobFilter::In(s), Some(job)) => job.state == s,
                        })
                })
                .map(|r| r.id.as_str())
                .collect();
            let mut got: Vec<String> = Vec::new();
            let mut after = None;
            for _ in 0..100 {
                let page = store
                    .list(&ListFilter {
                        after: after.clone(),
                        limit: 3,
                        ..filter.clone()
                    })
                    .await
                    .expect("list");
                let Some(last) = page.last() else { break };
                after = Some(last.id.clone());
                got.extend(page.iter().map(|r| r.id.to_string()));
            }
            assert_eq!(got, want, "{filter:?}");
            let one = store
                .list(&ListFilter {
                    limit: 1,
                    ..filter.clone()
                })
                .await
                .expect("list");
            assert_eq!(
                one.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
                want.iter().take(1).copied().collect::<Vec<_>>(),
                "{filter:?}"
            );
        }
    };
    check(records.clone()).await;
    // Every running job ends: each moves from one listing to the other.
    for r in records.iter_mut() {
        let Some(job) = r.job.as_mut() else { continue };
        if job.state != JobState::Running {
            continue;
        }
        job.state = JobState::Succeeded;
        let mut stored = store.get(&r.id).await.expect("get").expect("stored");
        stored.job.as_mut().expect("job").state = JobState::Succeeded;
        store.update(stored).await.expect("update");
    }
    check(records).await;
}
