//! Batches (SPEC section 9.3) against the real binary and the fake downstream, which counts
//! every side effect: an independent batch sends each item once, in order, as an execution
//! of its own; a retry replays what finished and goes on with the rest, also after a
//! SIGKILL while an item was in flight or between two items (redb and PostgreSQL); refusals
//! come before anything is recorded; an approval covers the whole batch; an atomic batch
//! stays one execution.

mod common;

use std::path::Path;
use std::time::Duration;

use common::fake_downstream::FakeDownstream;
use common::*;
use http::StatusCode;
use serde_json::{json, Value};

const LOOKUP: &str = r#"reconcile: { path: "/messages?tag={execution_id}", settle: 300ms, found: { status: 200, json_nonempty: /data }, not_found: { status: 200, json_empty: /data } }"#;

/// `store`: the `store:` block. Routes (all under `/mail`):
/// - `/batch/keyed`: items to `/keyed/send` (the downstream replays keyed requests);
/// - `/batch/lookup`: items to `/send` (no idempotency) with a lookup by the injected key;
/// - `/batch/blind`: items to `/send`, no way to find out an unknown item;
/// - `/batch/approve`: items to `/send`, the batch needs an approval;
/// - `/send`: an atomic batch, sent whole as one execution.
fn config(store: &str, ds: &str) -> String {
    format!(
        r#"listen: 127.0.0.1:0
admin: {{ listen: 127.0.0.1:0, token_env: {ADMIN_TOKEN_ENV} }}
store: {store}
upstreams:
  - name: mail
    url: {ds}
    mount: /mail
    routes:
      - name: send_many
        match: {{ method: POST, path: /batch/keyed }}
        downstream_key: {{ header: Idempotency-Key, replays: true }}
        batch: {{ items: /messages, mode: independent, item_key: /to, max_items: 10, each: {{ method: POST, path: /keyed/send }} }}
      - name: send_many_lookup
        match: {{ method: POST, path: /batch/lookup }}
        {LOOKUP}
        batch: {{ items: /messages, mode: independent, item_key: /to, each: {{ path: /send }} }}
      - name: send_many_slow
        match: {{ method: POST, path: /batch/slow }}
        timeout: 300ms
        {LOOKUP}
        batch: {{ items: /messages, mode: independent, item_key: /to, each: {{ path: /timeout-after-commit/send }} }}
      - name: send_many_blind
        match: {{ method: POST, path: /batch/blind }}
        batch: {{ items: /messages, mode: independent, each: {{ path: /send }} }}
      - name: pay_many
        match: {{ method: POST, path: /batch/approve }}
        approval: {{ required: true, preview: [/memo] }}
        batch: {{ items: /payments, mode: independent, item_key: /id, each: {{ path: /send }} }}
      - name: import
        match: {{ method: POST, path: /send }}
        batch: {{ items: /rows, mode: atomic, max_items: 3 }}
"#
    )
}

fn redb(dir: &Path) -> String {
    format!(
        "{{ backend: redb, path: {}/store.redb, retention: 1h }}",
        dir.display()
    )
}

fn messages(n: usize) -> Value {
    let items: Vec<Value> = (1..=n)
        .map(|i| json!({ "to": format!("user{i}@example.com"), "subject": "hello" }))
        .collect();
    json!({ "messages": items })
}

fn start(dir: &Path, yaml: &str, env: &[(&str, &str)]) -> ProxyProc {
    let mut all = vec![(ADMIN_TOKEN_ENV, ADMIN_TOKEN)];
    all.extend_from_slice(env);
    ProxyProc::start_with_env(dir, yaml, &all)
}

async fn call(c: &TestClient, p: &ProxyProc, path: &str, key: &str, body: &Value) -> Resp {
    post(
        c,
        &p.url(&format!("/mail/batch/{path}")),
        &[("idempotency-key", key)],
        &body.to_string(),
    )
    .await
}

/// The per-item answers of a `200` batch answer.
fn items(r: &Resp) -> Vec<Value> {
    assert_eq!(r.status, StatusCode::OK, "{r:?}");
    r.json()["items"].as_array().expect("items").clone()
}

fn replayed(items: &[Value]) -> Vec<bool> {
    items.iter().map(|i| i["replayed"] == true).collect()
}

/// Commits per recipient, as the downstream saw them.
fn commits_by_recipient(ds: &FakeDownstream) -> std::collections::BTreeMap<String, usize> {
    let mut out = std::collections::BTreeMap::new();
    for m in ds.messages() {
        let to = m.to_json()["request"]["to"]
            .as_str()
            .unwrap_or("?")
            .to_string();
        *out.entry(to).or_insert(0) += 1;
    }
    out
}

fn each_once(ds: &FakeDownstream, n: usize) {
    let by = commits_by_recipient(ds);
    assert_eq!(by.len(), n, "every item reached the downstream: {by:?}");
    assert!(by.values().all(|&c| c == 1), "no item twice: {by:?}");
}

#[tokio::test]
async fn an_independent_batch_sends_each_item_once_and_a_retry_replays_it() {
    let ds = FakeDownstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = start(dir.path(), &config(&redb(dir.path()), &ds.url()), &[]);
    let c = client();
    let body = messages(3);

    let first = items(&call(&c, &proxy, "keyed", "batch-1", &body).await);
    assert_eq!(first.len(), 3);
    assert_eq!(replayed(&first), [false, false, false]);
    each_once(&ds, 3);
    // Each item is an execution of its own, and its id is the key the downstream saw.
    let ids: Vec<&str> = first
        .iter()
        .map(|i| i["execution_id"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids.iter().collect::<std::collections::HashSet<_>>().len(),
        3
    );
    for (item, id) in first.iter().zip(&ids) {
        assert_eq!(item["status"], 201);
        assert_eq!(item["body"]["key"], *id, "injected key is the item's id");
    }
    // In request order.
    assert_eq!(first[2]["body"]["request"]["to"], "user3@example.com");

    let again = call(&c, &proxy, "keyed", "batch-1", &body).await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    let again = items(&again);
    assert_eq!(replayed(&again), [true, true, true]);
    assert_eq!(again[1]["execution_id"], first[1]["execution_id"]);
    assert_eq!(ds.commits(), 3, "a retry sends nothing");

    // The parent record lists its items; each item's record names its parent.
    let parent_id = call(&c, &proxy, "keyed", "batch-1", &body)
        .await
        .header("idempotency-execution-id")
        .map(str::to_string)
        .expect("parent id header");
    let parent = admin_get(&c, &proxy, &format!("/v1/executions/{parent_id}")).await;
    assert_eq!(parent.status, StatusCode::OK, "{parent:?}");
    let view = parent.json();
    assert_eq!(
        view["batch"]["items"].as_array().map(Vec::len),
        Some(3),
        "{view}"
    );
    assert_eq!(view["batch"]["committed"], 3, "{view}");
    let child = admin_get(&c, &proxy, &format!("/v1/executions/{}", ids[0])).await;
    assert_eq!(child.json()["item_of"]["parent"], parent_id.as_str());
    assert_eq!(child.json()["item_of"]["index"], 0);

    // A search by the client's key finds the batch and every item.
    let found = admin_get(&c, &proxy, "/v1/executions?key=batch-1&limit=10").await;
    assert_eq!(
        found.json()["items"].as_array().map(Vec::len),
        Some(4),
        "{found:?}"
    );

    // Changed items under the same key are another call.
    let changed = call(&c, &proxy, "keyed", "batch-1", &messages(4)).await;
    assert_eq!(
        changed.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{changed:?}"
    );
    assert_eq!(changed.problem_type(), "urn:idemproxy:problem:key-mismatch");
    assert_eq!(ds.commits(), 3);
    let metrics = metrics(&c, &proxy).await;
    assert!(
        metrics.contains(
            r#"idemproxy_batch_items_total{upstream="mail",route="send_many",result="sent"} 3"#
        ),
        "{metrics}"
    );
}

#[tokio::test]
async fn bad_batches_are_refused_before_anything_is_recorded() {
    let ds = FakeDownstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = start(dir.path(), &config(&redb(dir.path()), &ds.url()), &[]);
    let c = client();
    let dup = json!({ "messages": [{ "to": "a" }, { "to": "b" }, { "to": "a" }] });
    let r = call(&c, &proxy, "keyed", "k-dup", &dup).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{r:?}");
    assert_eq!(
        r.problem_type(),
        "urn:idemproxy:problem:batch-duplicate-item"
    );
    assert_eq!(r.json()["items"], json!([0, 2]));

    let r = call(&c, &proxy, "keyed", "k-big", &messages(11)).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE, "{r:?}");
    assert_eq!(r.problem_type(), "urn:idemproxy:problem:batch-too-large");

    let r = call(&c, &proxy, "keyed", "k-none", &json!({ "message": {} })).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{r:?}");
    assert_eq!(r.problem_type(), "urn:idemproxy:problem:batch-invalid");

    let no_key = json!({ "messages": [{ "to": "a" }, { "cc": "b" }] });
    let r = call(&c, &proxy, "keyed", "k-nokey", &no_key).await;
    assert_eq!(r.problem_type(), "urn:idemproxy:problem:batch-invalid");

    let rows = json!({ "rows": [1, 2, 3, 4] }).to_string();
    let r = post(
        &c,
        &proxy.url("/mail/send"),
        &[("idempotency-key", "k-rows")],
        &rows,
    )
    .await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE, "{r:?}");

    assert_eq!(ds.hits(), 0, "nothing was sent");
    let all = admin_get(&c, &proxy, "/v1/executions?limit=50").await;
    assert_eq!(all.json()["items"], json!([]), "nothing was recorded");
}

#[tokio::test]
async fn an_atomic_batch_is_one_execution() {
    let ds = FakeDownstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = start(dir.path(), &config(&redb(dir.path()), &ds.url()), &[]);
    let c = client();
    let rows = json!({ "rows": [{ "n": 1 }, { "n": 2 }] });
    let send = |key: &'static str, body: Value| {
        let (c, url) = (c.clone(), proxy.url("/mail/send"));
        async move { post(&c, &url, &[("idempotency-key", key)], &body.to_string()).await }
    };
    let first = send("k-atomic", rows.clone()).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let again = send("k-atomic", rows.clone()).await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(ds.commits(), 1);
}

#[tokio::test]
async fn an_approval_covers_the_whole_batch_and_previews_its_size() {
    let ds = FakeDownstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = start(dir.path(), &config(&redb(dir.path()), &ds.url()), &[]);
    let c = client();
    let body = json!({ "memo": "payroll", "payments": [{ "id": 1, "amount": 5 }, { "id": 2, "amount": 7 }] });
    let asked = call(&c, &proxy, "approve", "k-pay", &body).await;
    assert_eq!(asked.status, StatusCode::PRECONDITION_REQUIRED, "{asked:?}");
    let problem = asked.json();
    assert_eq!(
        problem["preview"],
        json!({ "/memo": "payroll", "items": 2 })
    );
    let (id, hash) = (
        problem["execution_id"].as_str().unwrap().to_string(),
        problem["args_hash"].as_str().unwrap().to_string(),
    );
    assert_eq!(ds.hits(), 0);
    let ok = admin_post(
        &c,
        &proxy,
        &format!("/v1/executions/{id}/approve"),
        json!({ "args_hash": hash, "by": "alice" }),
    )
    .await;
    assert_eq!(ok.status, StatusCode::OK, "{ok:?}");
    let done = items(&call(&c, &proxy, "approve", "k-pay", &body).await);
    assert_eq!(done.len(), 2);
    assert_eq!(ds.commits(), 2);
    // Another batch under the same key is not covered by the approval.
    let more = json!({ "memo": "payroll", "payments": [{ "id": 1, "amount": 5 }, { "id": 2, "amount": 700 }] });
    let r = call(&c, &proxy, "approve", "k-pay", &more).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(ds.commits(), 2);
}

/// An item that times out (the downstream commits, then never answers) stops the batch:
/// the answer names it and nothing after it is sent; the next retry settles it by the
/// lookup and goes on.
#[tokio::test]
async fn a_timed_out_item_stops_the_batch_and_the_retry_settles_it() {
    let ds = FakeDownstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = start(dir.path(), &config(&redb(dir.path()), &ds.url()), &[]);
    let c = client();
    let body = messages(2);
    let first = call(&c, &proxy, "slow", "k-slow", &body).await;
    assert_eq!(first.status, StatusCode::GATEWAY_TIMEOUT, "{first:?}");
    assert_eq!(
        first.problem_type(),
        "urn:idemproxy:problem:outcome-unknown"
    );
    assert_eq!(first.json()["item"], 0, "{first:?}");
    assert_eq!(first.header("idempotency-status"), Some("outcome_unknown"));
    assert_eq!(
        ds.hits_on("/timeout-after-commit/send"),
        1,
        "item 1 was not sent"
    );
    let mut answer = None;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        let r = call(&c, &proxy, "slow", "k-slow", &body).await;
        if r.status == StatusCode::OK {
            answer = Some(r);
            break;
        }
        assert!(
            r.json()["item"].is_number(),
            "every stop names its item: {r:?}"
        );
    }
    let got = items(&answer.expect("the batch finished"));
    assert_eq!(got.len(), 2);
    each_once(&ds, 2);
    // Each item's answer is what the lookup found: its committed message.
    for item in &got {
        assert_eq!(item["body"]["key"], item["execution_id"], "{item}");
    }
}

/// A batch killed at `failpoint` (SIGKILL), restarted on the same store and retried: every
/// item reaches the downstream exactly once; the items that finished before the crash are
/// replayed.
#[cfg(feature = "failpoints")]
async fn killed_and_resumed(
    store: &str,
    dir: &Path,
    route: &str,
    failpoint: &str,
    done_before: usize,
) {
    let ds = FakeDownstream::start().await;
    let yaml = config(store, &ds.url());
    let c = client();
    let body = messages(6);
    let proxy = start(dir, &yaml, &[("IDEMPROXY_FAILPOINT", failpoint)]);
    let name = failpoint.split('@').next().unwrap();
    let req = {
        let (c, url, body) = (
            c.clone(),
            proxy.url(&format!("/mail/batch/{route}")),
            body.to_string(),
        );
        tokio::spawn(async move { post(&c, &url, &[("idempotency-key", "k-six")], &body).await })
    };
    proxy.wait_for_log(
        &format!("FAILPOINT {name} reached"),
        Duration::from_secs(20),
    );
    proxy.kill();
    req.abort();
    let before = ds.commits();
    assert!(
        before >= done_before,
        "{before} items reached the downstream before the crash"
    );

    let proxy = start(dir, &yaml, &[]);
    let mut answer = None;
    for _ in 0..100 {
        let r = call(&c, &proxy, route, "k-six", &body).await;
        if r.status == StatusCode::OK {
            answer = Some(r);
            break;
        }
        // Meanwhile 409: the item in flight is reconciled before anything is re-sent (the
        // problem names it), or, on a shared store, the dead instance's lease on the batch
        // has not expired yet (in flight).
        assert_eq!(r.status, StatusCode::CONFLICT, "{r:?}");
        assert!(
            r.json()["item"].is_number() || r.problem_type() == "urn:idemproxy:problem:in-flight",
            "the problem names the item: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let answer = answer.expect("the batch finished after the restart");
    let got = items(&answer);
    assert_eq!(got.len(), 6);
    each_once(&ds, 6);
    let flags = replayed(&got);
    assert!(
        flags[..done_before].iter().all(|r| *r),
        "items that finished before the crash are replayed: {flags:?}"
    );
    assert!(
        flags[done_before + 1..].iter().all(|r| !*r),
        "items after the crash are sent now: {flags:?}"
    );
    // And once more: nothing is sent again.
    let again = items(&call(&c, &proxy, route, "k-six", &body).await);
    assert!(replayed(&again).iter().all(|r| *r));
    assert_eq!(ds.commits(), 6);
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_while_item_4_is_in_flight_a_keyed_downstream_settles_it() {
    let dir = tempfile::tempdir().unwrap();
    killed_and_resumed(&redb(dir.path()), dir.path(), "keyed", "in_flight@4", 3).await;
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_while_item_4_is_in_flight_the_lookup_settles_it() {
    let dir = tempfile::tempdir().unwrap();
    killed_and_resumed(&redb(dir.path()), dir.path(), "lookup", "in_flight@4", 3).await;
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_between_items_the_retry_goes_on_with_the_next() {
    let dir = tempfile::tempdir().unwrap();
    killed_and_resumed(
        &redb(dir.path()),
        dir.path(),
        "lookup",
        "after_local_commit@3",
        3,
    )
    .await;
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_killed_while_item_4_is_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let schema = Schema::new("batch");
    let store = format!(
        "{{ backend: postgres, url_env: {URL_VAR}, schema: {}, lease: 2s, retention: 1h }}",
        schema.name
    );
    killed_and_resumed(&store, dir.path(), "keyed", "in_flight@4", 3).await;
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_killed_between_items() {
    let dir = tempfile::tempdir().unwrap();
    let schema = Schema::new("batch2");
    let store = format!(
        "{{ backend: postgres, url_env: {URL_VAR}, schema: {}, lease: 2s, retention: 1h }}",
        schema.name
    );
    killed_and_resumed(&store, dir.path(), "lookup", "after_local_commit@3", 3).await;
}

/// An item whose outcome nobody can find out stops the batch with `409` naming it, and
/// nothing after it is sent, until an operator settles the item.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_item_holds_the_batch_until_it_is_settled() {
    let ds = FakeDownstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = config(&redb(dir.path()), &ds.url());
    let c = client();
    let body = messages(3);
    let proxy = start(dir.path(), &yaml, &[("IDEMPROXY_FAILPOINT", "in_flight@2")]);
    let req = {
        let (c, url, body) = (c.clone(), proxy.url("/mail/batch/blind"), body.to_string());
        tokio::spawn(async move { post(&c, &url, &[("idempotency-key", "k-blind")], &body).await })
    };
    proxy.wait_for_log("FAILPOINT in_flight reached", Duration::from_secs(20));
    proxy.kill();
    req.abort();
    let proxy = start(dir.path(), &yaml, &[]);
    let r = call(&c, &proxy, "blind", "k-blind", &body).await;
    assert_eq!(r.status, StatusCode::CONFLICT, "{r:?}");
    assert_eq!(r.problem_type(), "urn:idemproxy:problem:outcome-unknown");
    let p = r.json();
    assert_eq!(p["item"], 1, "{p}");
    let item_id = p["item_execution_id"]
        .as_str()
        .expect("item id")
        .to_string();
    assert_ne!(p["execution_id"], p["item_execution_id"]);
    assert_eq!(
        r.header("retry-after"),
        None,
        "only an operator can settle it"
    );
    assert_eq!(ds.commits(), 2, "item 3 was not sent");

    // The operator finds the item took effect; the retry goes on with item 3.
    let settled = admin_post(
        &c,
        &proxy,
        &format!("/v1/executions/{item_id}/resolve"),
        json!({ "as": "committed", "by": "oncall" }),
    )
    .await;
    assert_eq!(settled.status, StatusCode::OK, "{settled:?}");
    let done = call(&c, &proxy, "blind", "k-blind", &body).await;
    let got = items(&done);
    assert_eq!(replayed(&got), [true, true, false]);
    assert_eq!(ds.commits(), 3);
}

async fn admin_get(c: &TestClient, p: &ProxyProc, path: &str) -> Resp {
    let auth = format!("Bearer {ADMIN_TOKEN}");
    send(
        c,
        http::Method::GET,
        &p.admin_url(path),
        &[("authorization", &auth)],
        "",
    )
    .await
}

async fn admin_post(c: &TestClient, p: &ProxyProc, path: &str, body: Value) -> Resp {
    let auth = format!("Bearer {ADMIN_TOKEN}");
    post(
        c,
        &p.admin_url(path),
        &[("authorization", &auth)],
        &body.to_string(),
    )
    .await
}

async fn metrics(c: &TestClient, p: &ProxyProc) -> String {
    let r = admin_get(c, p, "/metrics").await;
    String::from_utf8_lossy(&r.body).into_owned()
}
