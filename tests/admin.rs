//! The operator surface end to end (SPEC sections 8 and 10): the real binary with an admin
//! listener, a real redb file and the fake downstream counting side effects. Covers
//! authentication, every admin endpoint, approvals bound to (execution_id, args_hash),
//! rejection, approval expiry, cancellation before and after a commit, metrics after a
//! replay, and that no secret reaches a log line.

mod common;

use std::time::{Duration, Instant};

use common::fake_downstream::FakeDownstream;
use common::*;
use http::{Method, StatusCode};
use serde_json::{json, Value};

const TENANT: (&str, &str) = ("authorization", "Bearer tenant-a");

async fn setup() -> (tempfile::TempDir, FakeDownstream, ProxyProc) {
    setup_with_env(&[]).await
}

async fn setup_with_env(env: &[(&str, &str)]) -> (tempfile::TempDir, FakeDownstream, ProxyProc) {
    let dir = tempfile::tempdir().expect("tempdir");
    let ds = FakeDownstream::start().await;
    let mut all = vec![(ADMIN_TOKEN_ENV, ADMIN_TOKEN)];
    all.extend_from_slice(env);
    let proxy = ProxyProc::start_with_env(dir.path(), &admin_config(dir.path(), &ds.url()), &all);
    (dir, ds, proxy)
}

fn bearer() -> String {
    format!("Bearer {ADMIN_TOKEN}")
}

async fn admin_get(c: &TestClient, p: &ProxyProc, path: &str) -> Resp {
    let auth = bearer();
    send(
        c,
        Method::GET,
        &p.admin_url(path),
        &[("authorization", &auth)],
        "",
    )
    .await
}

async fn admin_post(c: &TestClient, p: &ProxyProc, path: &str, body: Value) -> Resp {
    let auth = bearer();
    post(
        c,
        &p.admin_url(path),
        &[("authorization", &auth)],
        &body.to_string(),
    )
    .await
}

/// A call on an approval route: `(response, execution_id, args_hash)`.
async fn pay(c: &TestClient, p: &ProxyProc, mount: &str, key: &str, body: Value) -> Resp {
    post(
        c,
        &p.url(&format!("/{mount}/send")),
        &[TENANT, ("idempotency-key", key)],
        &body.to_string(),
    )
    .await
}

fn approval_of(r: &Resp) -> (String, String) {
    assert_eq!(r.status, StatusCode::PRECONDITION_REQUIRED, "{r:?}");
    assert_eq!(r.problem_type(), "urn:idemproxy:problem:approval-required");
    let v = r.json();
    let id = v["execution_id"]
        .as_str()
        .expect("execution_id")
        .to_string();
    let hash = v["args_hash"].as_str().expect("args_hash").to_string();
    (id, hash)
}

async fn state_of(c: &TestClient, p: &ProxyProc, id: &str) -> String {
    let r = admin_get(c, p, &format!("/v1/executions/{id}")).await;
    assert_eq!(r.status, StatusCode::OK, "{r:?}");
    r.json()["state"].as_str().expect("state").to_string()
}

/// The record of `id` once its `result_delivered` mark has landed (or after 10 s). The mark
/// is written after the answer's body went out, by a task of its own, so a test that reads
/// the record right after the answer races it.
async fn once_delivered(c: &TestClient, p: &ProxyProc, id: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = admin_get(c, p, &format!("/v1/executions/{id}"))
            .await
            .json();
        if r["state"] == "result_delivered" || Instant::now() > deadline {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_endpoint_but_healthz_needs_the_token() {
    let (_dir, _ds, proxy) = setup().await;
    let c = client();
    let health = send(&c, Method::GET, &proxy.admin_url("/healthz"), &[], "").await;
    assert_eq!(health.status, StatusCode::OK, "{health:?}");
    assert_eq!(health.json()["status"], "ok");

    let protected = [
        (Method::GET, "/v1/executions"),
        (Method::GET, "/v1/executions/ex_x"),
        (Method::POST, "/v1/executions/ex_x/approve"),
        (Method::POST, "/v1/executions/ex_x/reject"),
        (Method::POST, "/v1/executions/ex_x/resolve"),
        (Method::GET, "/v1/operations/op_x"),
        (Method::POST, "/v1/operations/op_x/cancel"),
        (Method::GET, "/metrics"),
        (Method::GET, "/no/such/endpoint"),
    ];
    let wrong = format!("Bearer {ADMIN_TOKEN}x");
    let basic = format!("Basic {ADMIN_TOKEN}");
    let short = format!("Bearer {}", &ADMIN_TOKEN[..ADMIN_TOKEN.len() - 1]);
    for (method, path) in &protected {
        for auth in [
            None,
            Some(wrong.as_str()),
            Some(basic.as_str()),
            Some(short.as_str()),
        ] {
            let headers: Vec<(&str, &str)> =
                auth.map(|a| ("authorization", a)).into_iter().collect();
            let r = send(&c, method.clone(), &proxy.admin_url(path), &headers, "{}").await;
            assert_eq!(
                r.status,
                StatusCode::UNAUTHORIZED,
                "{method} {path} {auth:?}: {r:?}"
            );
            assert_eq!(r.problem_type(), "urn:idemproxy:problem:unauthorized");
            assert_eq!(
                r.header("www-authenticate"),
                Some("Bearer realm=\"idemproxy-admin\"")
            );
        }
    }
    let ok = admin_get(&c, &proxy, "/v1/executions").await;
    assert_eq!(ok.status, StatusCode::OK, "{ok:?}");
    assert_eq!(ok.json(), json!({ "items": [], "next": null }));
    let metrics = admin_get(&c, &proxy, "/metrics").await;
    assert_eq!(metrics.status, StatusCode::OK);

    // With the token: unknown paths are 404, known paths with the wrong method 405.
    let missing = admin_get(&c, &proxy, "/no/such/endpoint").await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    assert_eq!(missing.problem_type(), "urn:idemproxy:problem:not-found");
    let auth = bearer();
    let wrong_method = send(
        &c,
        Method::DELETE,
        &proxy.admin_url("/v1/executions"),
        &[("authorization", &auth)],
        "",
    )
    .await;
    assert_eq!(wrong_method.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(wrong_method.header("allow"), Some("GET"));

    // The console's static files carry no data and load without the token.
    let page = send(&c, Method::GET, &proxy.admin_url("/"), &[], "").await;
    assert_eq!(page.status, StatusCode::OK);
    assert_eq!(
        page.header("content-type"),
        Some("text/html; charset=utf-8")
    );
    assert!(page
        .header("content-security-policy")
        .is_some_and(|p| p.contains("script-src 'self'")));
    assert!(String::from_utf8_lossy(&page.body).contains("console.js"));
    for asset in ["/console.js", "/console.css"] {
        let r = send(&c, Method::GET, &proxy.admin_url(asset), &[], "").await;
        assert_eq!(r.status, StatusCode::OK, "{asset}");
    }
    // The proxy listener does not serve the admin API.
    let on_proxy = send(&c, Method::GET, &proxy.url("/v1/executions"), &[], "").await;
    assert_eq!(on_proxy.status, StatusCode::NOT_FOUND);
}

#[test]
fn refuses_to_start_without_the_token_variable() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("idemproxy.yaml");
    std::fs::write(&config, admin_config(dir.path(), "http://127.0.0.1:1")).expect("write");
    for value in [None, Some("")] {
        let mut cmd = std::process::Command::new(BIN);
        cmd.args(["serve", "--config"]).arg(&config);
        match value {
            None => cmd.env_remove(ADMIN_TOKEN_ENV),
            Some(v) => cmd.env(ADMIN_TOKEN_ENV, v),
        };
        let out = cmd.output().expect("run idemproxy");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "started without a token: {stderr}");
        assert_eq!(
            out.status.code(),
            Some(2),
            "a config error exits 2: {stderr}"
        );
        assert!(
            stderr.contains(ADMIN_TOKEN_ENV),
            "message names the variable: {stderr}"
        );
        assert!(
            !String::from_utf8_lossy(&out.stdout).contains("listening"),
            "nothing was served"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_approval_binds_the_execution_and_its_exact_arguments() {
    let (_dir, ds, proxy) = setup().await;
    let c = client();
    let fifty = json!({ "to": "acct_A", "amount": 50, "memo": "rent" });
    let first = pay(&c, &proxy, "pay", "k-pay", fifty.clone()).await;
    let (id, hash) = approval_of(&first);
    assert_eq!(
        first.json()["preview"],
        json!({ "/amount": 50, "/to": "acct_A" })
    );
    assert_eq!(ds.commits(), 0, "nothing is sent before approval");

    // The same call again is asked again, with the same identity.
    let again = pay(&c, &proxy, "pay", "k-pay", fifty.clone()).await;
    assert_eq!(approval_of(&again), (id.clone(), hash.clone()));

    // Pending approvals are listed with their preview.
    let pending = admin_get(&c, &proxy, "/v1/executions?status=awaiting_approval").await;
    let items = pending.json()["items"].clone();
    assert_eq!(items.as_array().map(Vec::len), Some(1), "{items}");
    assert_eq!(items[0]["execution_id"], id.as_str());
    assert_eq!(items[0]["args_hash"], hash.as_str());
    assert_eq!(items[0]["preview"]["/amount"], 50);

    // An approval must name both: a body without args_hash, or with another, changes nothing.
    let approve = format!("/v1/executions/{id}/approve");
    let no_hash = admin_post(&c, &proxy, &approve, json!({ "by": "alice" })).await;
    assert_eq!(no_hash.status, StatusCode::BAD_REQUEST, "{no_hash:?}");
    let other = admin_post(
        &c,
        &proxy,
        &approve,
        json!({ "args_hash": "00ff", "by": "alice" }),
    )
    .await;
    assert_eq!(other.status, StatusCode::CONFLICT, "{other:?}");
    assert_eq!(
        other.problem_type(),
        "urn:idemproxy:problem:approval-mismatch"
    );
    assert_eq!(other.json()["args_hash"], hash.as_str());
    assert_eq!(state_of(&c, &proxy, &id).await, "awaiting_approval");

    // The model changes the amount: under the same key it is a different call (422) ...
    let five_hundred = json!({ "to": "acct_A", "amount": 500, "memo": "rent" });
    let changed = pay(&c, &proxy, "pay", "k-pay", five_hundred.clone()).await;
    assert_eq!(
        changed.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{changed:?}"
    );
    assert_eq!(changed.problem_type(), "urn:idemproxy:problem:key-mismatch");
    // ... and under a new key it is a new execution that needs its own approval.
    let (id_500, hash_500) =
        approval_of(&pay(&c, &proxy, "pay", "k-pay-2", five_hundred.clone()).await);
    assert_ne!(id_500, id);
    assert_ne!(hash_500, hash);

    let ok = admin_post(
        &c,
        &proxy,
        &approve,
        json!({ "args_hash": hash, "by": "alice" }),
    )
    .await;
    assert_eq!(ok.status, StatusCode::OK, "{ok:?}");
    assert_eq!(ok.json()["state"], "approved");
    assert_eq!(ok.json()["approval"]["by"], "alice (token admin)");
    assert_eq!(ok.json()["approval"]["args_hash"], hash.as_str());
    // The approval of one execution never lets another one through.
    assert_eq!(
        approval_of(&pay(&c, &proxy, "pay", "k-pay-2", five_hundred.clone()).await).0,
        id_500
    );
    assert_eq!(ds.commits(), 0);
    // Changed arguments still cannot ride on the approved execution.
    let sneaky = pay(&c, &proxy, "pay", "k-pay", five_hundred).await;
    assert_eq!(sneaky.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(ds.commits(), 0);

    // The approved call runs once; every retry after that is a replay.
    let run = pay(&c, &proxy, "pay", "k-pay", fifty.clone()).await;
    assert_eq!(run.status, StatusCode::CREATED, "{run:?}");
    assert_eq!(run.header("idempotent-replayed"), None);
    for _ in 0..3 {
        let replay = pay(&c, &proxy, "pay", "k-pay", fifty.clone()).await;
        assert_eq!(replay.status, StatusCode::CREATED);
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
        assert_eq!(replay.body, run.body);
    }
    assert_eq!(ds.commits(), 1);
    let sent = ds.messages();
    assert_eq!(
        sent[0].request["amount"], 50,
        "the approved arguments were sent"
    );

    // A decision on a call that already ran is refused and changes nothing.
    let late = admin_post(&c, &proxy, &approve, json!({ "args_hash": hash })).await;
    assert_eq!(late.status, StatusCode::CONFLICT, "{late:?}");
    assert_eq!(late.problem_type(), "urn:idemproxy:problem:conflict");
    let unknown = admin_post(
        &c,
        &proxy,
        "/v1/executions/ex_nope/approve",
        json!({ "args_hash": hash }),
    )
    .await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_rejected_call_is_never_sent() {
    let (_dir, ds, proxy) = setup().await;
    let c = client();
    let body = json!({ "to": "acct_B", "amount": 9000 });
    let (id, hash) = approval_of(&pay(&c, &proxy, "pay", "k-rej", body.clone()).await);
    let r = admin_post(
        &c,
        &proxy,
        &format!("/v1/executions/{id}/reject"),
        json!({ "by": "bob", "reason": "amount too high" }),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{r:?}");
    assert_eq!(r.json()["state"], "rejected");
    assert_eq!(
        r.json()["note"],
        "rejected by bob (token admin): amount too high"
    );
    for _ in 0..2 {
        let retry = pay(&c, &proxy, "pay", "k-rej", body.clone()).await;
        assert_eq!(retry.status, StatusCode::FORBIDDEN, "{retry:?}");
        assert_eq!(retry.problem_type(), "urn:idemproxy:problem:rejected");
        assert_eq!(retry.json()["execution_id"], id.as_str());
        // The reason reaches the agent, so it can tell the user why.
        let detail = retry.json()["detail"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(detail.contains("amount too high"), "{detail}");
    }
    let approve = admin_post(
        &c,
        &proxy,
        &format!("/v1/executions/{id}/approve"),
        json!({ "args_hash": hash }),
    )
    .await;
    assert_eq!(
        approve.status,
        StatusCode::CONFLICT,
        "a rejection is final: {approve:?}"
    );
    assert_eq!(approve.json()["state"], "rejected");
    // An empty body is allowed for reject; the decision is recorded under the token's name.
    let (id2, _) = approval_of(&pay(&c, &proxy, "pay", "k-rej-2", body).await);
    let auth = bearer();
    let empty = post(
        &c,
        &proxy.admin_url(&format!("/v1/executions/{id2}/reject")),
        &[("authorization", &auth)],
        "",
    )
    .await;
    assert_eq!(empty.status, StatusCode::OK, "{empty:?}");
    assert_eq!(empty.json()["note"], "rejected by admin");
    assert_eq!(ds.commits(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_expired_approval_must_be_given_again() {
    let (_dir, ds, proxy) = setup().await;
    let c = client();
    let body = json!({ "to": "acct_C", "amount": 5 });
    let (id, hash) = approval_of(&pay(&c, &proxy, "quickpay", "k-exp", body.clone()).await);
    let approve = format!("/v1/executions/{id}/approve");
    let ok = admin_post(
        &c,
        &proxy,
        &approve,
        json!({ "args_hash": hash, "by": "carol" }),
    )
    .await;
    assert_eq!(ok.status, StatusCode::OK, "{ok:?}");
    let expires = ok.json()["approval"]["expires_at_ms"]
        .as_i64()
        .expect("expiry set");
    let at = ok.json()["approval"]["at_ms"].as_i64().expect("at");
    assert_eq!(expires - at, 300, "approval.expires from the route");
    tokio::time::sleep(Duration::from_millis(450)).await;

    let stale = pay(&c, &proxy, "quickpay", "k-exp", body.clone()).await;
    assert_eq!(approval_of(&stale), (id.clone(), hash.clone()));
    let detail = stale.json()["detail"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(detail.contains("expired"), "{detail}");
    assert_eq!(ds.commits(), 0, "nothing is sent on an expired approval");
    let record = admin_get(&c, &proxy, &format!("/v1/executions/{id}"))
        .await
        .json();
    assert_eq!(record["state"], "awaiting_approval");
    assert_eq!(record["approval"], Value::Null);
    let events: Vec<&str> = record["history"]
        .as_array()
        .expect("history")
        .iter()
        .filter_map(|h| h["event"].as_str())
        .collect();
    assert_eq!(events, ["request_approval", "approve", "approval_lapsed"]);

    let again = admin_post(
        &c,
        &proxy,
        &approve,
        json!({ "args_hash": hash, "by": "carol" }),
    )
    .await;
    assert_eq!(again.status, StatusCode::OK, "{again:?}");
    let run = pay(&c, &proxy, "quickpay", "k-exp", body).await;
    assert_eq!(run.status, StatusCode::CREATED, "{run:?}");
    assert_eq!(ds.commits(), 1);
}

fn op_headers<'a>(op: &'a str, call: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![
        TENANT,
        ("x-operation-id", op),
        ("x-model-round", "r1"),
        ("x-tool-call-id", call),
    ]
}

#[tokio::test(flavor = "multi_thread")]
async fn cancelling_before_anything_committed_stops_every_pending_call() {
    let (_dir, ds, proxy) = setup().await;
    let c = client();
    let pay_url = proxy.url("/pay/send");
    let mut ids = Vec::new();
    for call in ["call_1", "call_2"] {
        let r = post(
            &c,
            &pay_url,
            &op_headers("op_stop", call),
            r#"{"to":"x","amount":1}"#,
        )
        .await;
        ids.push(approval_of(&r).0);
    }
    let r = admin_post(
        &c,
        &proxy,
        "/v1/operations/op_stop/cancel",
        json!({ "by": "dave" }),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{r:?}");
    let v = r.json();
    assert_eq!(v["state"], "cancelled");
    let mut cancelled: Vec<String> = v["cancelled"]
        .as_array()
        .expect("cancelled")
        .iter()
        .filter_map(|x| x.as_str().map(str::to_string))
        .collect();
    cancelled.sort();
    let mut want = ids.clone();
    want.sort();
    assert_eq!(cancelled, want);
    assert_eq!(v["committed"], json!([]));

    // Retries of the cancelled calls, and new calls of the operation, are refused unsent.
    let retry = post(
        &c,
        &pay_url,
        &op_headers("op_stop", "call_1"),
        r#"{"to":"x","amount":1}"#,
    )
    .await;
    assert_eq!(retry.status, StatusCode::CONFLICT, "{retry:?}");
    assert_eq!(retry.problem_type(), "urn:idemproxy:problem:cancelled");
    let late = post(
        &c,
        &proxy.url("/mail/send"),
        &op_headers("op_stop", "call_3"),
        r#"{"to":"y"}"#,
    )
    .await;
    assert_eq!(late.status, StatusCode::CONFLICT, "{late:?}");
    assert_eq!(late.problem_type(), "urn:idemproxy:problem:cancelled");
    let late_id = late.json()["execution_id"]
        .as_str()
        .expect("id")
        .to_string();
    assert_eq!(
        state_of(&c, &proxy, &late_id).await,
        "cancelled_before_commit"
    );
    // Other operations are not affected.
    let other = post(
        &c,
        &proxy.url("/mail/send"),
        &op_headers("op_other", "call_1"),
        r#"{"to":"z"}"#,
    )
    .await;
    assert_eq!(other.status, StatusCode::CREATED, "{other:?}");
    assert_eq!(ds.commits(), 1);

    let op = admin_get(&c, &proxy, "/v1/operations/op_stop").await;
    assert_eq!(op.status, StatusCode::OK);
    let op = op.json();
    assert_eq!(op["state"], "cancelled");
    assert_eq!(op["mark"]["by"], "dave (token admin)");
    let states: Vec<&str> = op["executions"]
        .as_array()
        .expect("executions")
        .iter()
        .filter_map(|e| e["state"].as_str())
        .collect();
    assert_eq!(states, ["cancelled_before_commit"; 3]);
    let active = admin_get(&c, &proxy, "/v1/operations/op_other")
        .await
        .json();
    assert_eq!(active["state"], "active");
}

#[tokio::test(flavor = "multi_thread")]
async fn cancelling_after_a_commit_keeps_the_commit_and_marks_the_operation() {
    let (_dir, ds, proxy) = setup().await;
    let c = client();
    let sent = post(
        &c,
        &proxy.url("/mail/send"),
        &op_headers("op_late", "call_1"),
        r#"{"to":"a@x"}"#,
    )
    .await;
    assert_eq!(sent.status, StatusCode::CREATED, "{sent:?}");
    let sent_id = sent
        .header("idempotency-execution-id")
        .expect("id")
        .to_string();
    let pending = post(
        &c,
        &proxy.url("/pay/send"),
        &op_headers("op_late", "call_2"),
        r#"{"to":"b","amount":2}"#,
    )
    .await;
    let (pending_id, _) = approval_of(&pending);
    // Taken once the first answer's delivery mark is in, so the snapshot does not race it.
    let before = once_delivered(&c, &proxy, &sent_id).await;

    let r = admin_post(&c, &proxy, "/v1/operations/op_late/cancel", json!({})).await;
    assert_eq!(r.status, StatusCode::OK, "{r:?}");
    let v = r.json();
    assert_eq!(v["state"], "cancelled_after_side_effect");
    assert_eq!(v["committed"], json!([sent_id]));
    assert_eq!(v["cancelled"], json!([pending_id]));

    // The committed record is untouched: same state, same stored answer, same history.
    let after = admin_get(&c, &proxy, &format!("/v1/executions/{sent_id}"))
        .await
        .json();
    assert_eq!(after, before);
    assert!(matches!(
        after["state"].as_str(),
        Some("committed" | "result_delivered")
    ));
    // Its retry still gets the original answer; nothing is sent again.
    let replay = post(
        &c,
        &proxy.url("/mail/send"),
        &op_headers("op_late", "call_1"),
        r#"{"to":"a@x"}"#,
    )
    .await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.body, sent.body);
    assert_eq!(ds.commits(), 1);
    assert_eq!(
        state_of(&c, &proxy, &pending_id).await,
        "cancelled_before_commit"
    );
    let op = admin_get(&c, &proxy, "/v1/operations/op_late").await.json();
    assert_eq!(op["state"], "cancelled_after_side_effect");
    // Cancelling again is harmless and never moves the mark back.
    let again = admin_post(&c, &proxy, "/v1/operations/op_late/cancel", json!({}))
        .await
        .json();
    assert_eq!(again["state"], "cancelled_after_side_effect");
    assert_eq!(again["cancelled"], json!([]));
}

#[tokio::test(flavor = "multi_thread")]
async fn listing_pages_with_a_cursor_and_shows_one_record_in_full() {
    let (_dir, _ds, proxy) = setup().await;
    let c = client();
    for i in 0..5 {
        let r = post(
            &c,
            &proxy.url("/mail/send"),
            &[TENANT, ("idempotency-key", &format!("k-list-{i}"))],
            r#"{"to":"l@x"}"#,
        )
        .await;
        assert_eq!(r.status, StatusCode::CREATED);
    }
    let mut seen = Vec::new();
    let mut path = "/v1/executions?limit=2".to_string();
    loop {
        let page = admin_get(&c, &proxy, &path).await;
        assert_eq!(page.status, StatusCode::OK, "{page:?}");
        let v = page.json();
        let items = v["items"].as_array().expect("items").clone();
        assert!(items.len() <= 2);
        seen.extend(
            items
                .iter()
                .filter_map(|i| i["execution_id"].as_str().map(str::to_string)),
        );
        match v["next"].as_str() {
            Some(next) => {
                assert_eq!(items.len(), 2, "a page with a cursor is full");
                path = format!("/v1/executions?limit=2&after={next}");
            }
            None => break,
        }
    }
    assert_eq!(seen.len(), 5, "{seen:?}");
    let mut sorted = seen.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted, seen, "in id order, each once");

    let one = admin_get(&c, &proxy, &format!("/v1/executions/{}", seen[0])).await;
    assert_eq!(one.status, StatusCode::OK);
    let v = one.json();
    assert_eq!(v["execution_id"], seen[0].as_str());
    assert_eq!(v["upstream"], "mail");
    assert_eq!(v["response"]["status"], 201);
    assert_eq!(v["response"]["body_encoding"], "json");
    assert_eq!(v["response"]["body"]["ok"], true);
    assert!(v["history"].as_array().is_some_and(|h| !h.is_empty()));
    let listed = admin_get(&c, &proxy, "/v1/executions?limit=1").await.json();
    assert!(
        listed["items"][0].get("response").is_none(),
        "listings leave stored bodies out"
    );

    for bad in [
        "/v1/executions?status=done",
        "/v1/executions?limit=0",
        "/v1/executions?limit=100000",
        "/v1/executions?colour=red",
    ] {
        let r = admin_get(&c, &proxy, bad).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{bad}: {r:?}");
        assert_eq!(r.problem_type(), "urn:idemproxy:problem:bad-request");
    }
    let missing = admin_get(&c, &proxy, "/v1/executions/ex_missing").await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    assert_eq!(missing.json()["execution_id"], "ex_missing");
}

/// `GET /v1/executions` finds calls by the orchestration ids and the key they came with,
/// by upstream, route and creation time, pages through a filter with the cursor, and
/// refuses a bad parameter with a problem naming it. The record shows its correlation.
#[tokio::test(flavor = "multi_thread")]
async fn executions_are_found_by_tool_call_key_route_and_time() {
    let (_dir, _ds, proxy) = setup().await;
    let c = client();
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_millis() as i64
    };
    let t0 = now();
    let mut ids = std::collections::BTreeMap::new();
    for (name, round, call) in [("a", "r1", "call_a"), ("b", "r2", "call_b")] {
        let mut h = op_headers("op_find", call);
        h[2] = ("x-model-round", round);
        let r = post(&c, &proxy.url("/mail/send"), &h, r#"{"to":"f@x"}"#).await;
        assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
        ids.insert(
            name,
            r.header("idempotency-execution-id")
                .expect("id")
                .to_string(),
        );
    }
    let keyed = post(
        &c,
        &proxy.url("/mail/send"),
        &[TENANT, ("idempotency-key", "client-key-1")],
        r#"{"to":"k@x"}"#,
    )
    .await;
    assert_eq!(keyed.status, StatusCode::CREATED, "{keyed:?}");
    ids.insert(
        "c",
        keyed
            .header("idempotency-execution-id")
            .expect("id")
            .to_string(),
    );
    let held = post(
        &c,
        &proxy.url("/pay/send"),
        &op_headers("op_find", "call_d"),
        r#"{"to":"x","amount":1}"#,
    )
    .await;
    ids.insert("d", approval_of(&held).0);
    let t1 = now() + 1;

    let found = |query: String| {
        let (c, proxy) = (&c, &proxy);
        async move {
            let r = admin_get(c, proxy, &format!("/v1/executions?{query}")).await;
            assert_eq!(r.status, StatusCode::OK, "{query}: {r:?}");
            let v = r.json();
            let mut got: Vec<String> = v["items"]
                .as_array()
                .expect("items")
                .iter()
                .map(|i| i["execution_id"].as_str().expect("id").to_string())
                .collect();
            got.sort();
            got
        }
    };
    let want = |names: &[&str]| {
        let mut v: Vec<String> = names.iter().map(|n| ids[n].clone()).collect();
        v.sort();
        v
    };
    for (query, names) in [
        ("tool_call=call_b".to_string(), &["b"][..]),
        ("key=client-key-1".to_string(), &["c"]),
        ("operation=op_find&upstream=mail".to_string(), &["a", "b"]),
        ("upstream=pay".to_string(), &["d"]),
        ("route=transfer".to_string(), &["d"]),
        (
            "upstream=mail&route=send_email".to_string(),
            &["a", "b", "c"],
        ),
        (
            "route=send_email&status=result_delivered&tool_call=call_a".to_string(),
            &["a"],
        ),
        (format!("since={t0}&until={t1}"), &["a", "b", "c", "d"]),
        (format!("since={t1}"), &[]),
        // RFC 3339 too: everything was made after 2001, nothing before.
        (
            "since=2001-01-01T00:00:00Z".to_string(),
            &["a", "b", "c", "d"],
        ),
        ("until=2001-01-01T00:00:00Z".to_string(), &[]),
        (format!("until={t0}&upstream=mail"), &[]),
        ("tool_call=call_zzz".to_string(), &[]),
    ] {
        assert_eq!(found(query.clone()).await, want(names), "{query}");
    }

    // A filtered listing pages with the cursor like any other.
    let mut seen = Vec::new();
    let mut path = "/v1/executions?upstream=mail&limit=1".to_string();
    for _ in 0..10 {
        let v = admin_get(&c, &proxy, &path).await.json();
        seen.extend(
            v["items"]
                .as_array()
                .expect("items")
                .iter()
                .map(|i| i["execution_id"].as_str().expect("id").to_string()),
        );
        match v["next"].as_str() {
            Some(next) => path = format!("/v1/executions?upstream=mail&limit=1&after={next}"),
            None => break,
        }
    }
    assert_eq!(seen, want(&["a", "b", "c"]), "in id order, each once");

    let b = admin_get(&c, &proxy, &format!("/v1/executions/{}", ids["b"]))
        .await
        .json();
    assert_eq!(b["operation_id"], "op_find");
    assert_eq!(b["model_round"], "r2");
    assert_eq!(b["tool_call_id"], "call_b");
    assert!(
        b["key"]
            .as_str()
            .is_some_and(|k| k.starts_with("op_find:r2:call_b:send_email:")),
        "{b}"
    );
    let c_rec = admin_get(&c, &proxy, &format!("/v1/executions/{}", ids["c"]))
        .await
        .json();
    assert_eq!(c_rec["key"], "client-key-1");
    assert!(c_rec.get("tool_call_id").is_some_and(Value::is_null));

    for (query, parameter) in [
        ("since=yesterday", "since"),
        ("until=-5", "until"),
        ("since=20&until=10", "until"),
        ("tool_call=", "tool_call"),
        ("key=a&key=b", "key"),
        ("status=done", "status"),
        ("colour=red", "colour"),
        ("limit=0", "limit"),
    ] {
        let r = admin_get(&c, &proxy, &format!("/v1/executions?{query}")).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{query}: {r:?}");
        assert_eq!(r.problem_type(), "urn:idemproxy:problem:bad-request");
        assert_eq!(r.json()["parameter"], parameter, "{query}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unknown_outcome_is_resolved_through_the_api() {
    let (_dir, ds, proxy) = setup().await;
    let c = client();
    let drop_url = proxy.url("/mail/drop-after-commit/send");
    let mut ids = Vec::new();
    for key in ["k-u1", "k-u2"] {
        let r = post(
            &c,
            &drop_url,
            &[TENANT, ("idempotency-key", key)],
            r#"{"to":"u@x"}"#,
        )
        .await;
        assert_eq!(
            r.header("idempotency-status"),
            Some("outcome_unknown"),
            "{r:?}"
        );
        ids.push(
            r.header("idempotency-execution-id")
                .expect("id")
                .to_string(),
        );
    }
    assert_eq!(ds.commits(), 2);
    let metrics = admin_get(&c, &proxy, "/metrics").await;
    let text = String::from_utf8_lossy(&metrics.body).to_string();
    let line = "idemproxy_outcome_unknown_total{upstream=\"mail\",route=\"drop\"} 2";
    assert!(
        text.lines().any(|l| l == line),
        "missing {line:?} in\n{text}"
    );
    let listed = admin_get(&c, &proxy, "/v1/executions?status=outcome_unknown")
        .await
        .json();
    assert_eq!(listed["items"].as_array().map(Vec::len), Some(2));

    let resolve = |id: &str| format!("/v1/executions/{id}/resolve");
    let bad = admin_post(&c, &proxy, &resolve(&ids[0]), json!({ "as": "maybe" })).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{bad:?}");
    let r = admin_post(
        &c,
        &proxy,
        &resolve(&ids[0]),
        json!({ "as": "committed", "by": "erin", "result": { "status": 201, "body": { "id": "msg_found" } } }),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{r:?}");
    assert_eq!(r.json()["state"], "committed");
    let replay = post(
        &c,
        &drop_url,
        &[TENANT, ("idempotency-key", "k-u1")],
        r#"{"to":"u@x"}"#,
    )
    .await;
    assert_eq!(replay.status, StatusCode::CREATED, "{replay:?}");
    assert_eq!(replay.json(), json!({ "id": "msg_found" }));
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));

    let not = admin_post(
        &c,
        &proxy,
        &resolve(&ids[1]),
        json!({ "as": "not_committed" }),
    )
    .await;
    assert_eq!(not.status, StatusCode::OK, "{not:?}");
    assert_eq!(not.json()["state"], "failed_before_commit");
    // The replay's delivery mark must be in before the record is decided again (a loaded
    // machine can run this test first).
    once_delivered(&c, &proxy, &ids[0]).await;
    // A decided record cannot be decided again.
    let twice = admin_post(
        &c,
        &proxy,
        &resolve(&ids[0]),
        json!({ "as": "not_committed" }),
    )
    .await;
    assert_eq!(twice.status, StatusCode::CONFLICT, "{twice:?}");
    assert_eq!(twice.json()["state"], "result_delivered");
    assert_eq!(ds.commits(), 2, "resolving sends nothing");
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_count_a_replay() {
    let (_dir, _ds, proxy) = setup().await;
    let c = client();
    for _ in 0..2 {
        let r = post(
            &c,
            &proxy.url("/mail/send"),
            &[TENANT, ("idempotency-key", "k-m")],
            r#"{"to":"m@x"}"#,
        )
        .await;
        assert_eq!(r.status, StatusCode::CREATED);
    }
    let m = admin_get(&c, &proxy, "/metrics").await;
    assert_eq!(m.status, StatusCode::OK);
    assert!(m
        .header("content-type")
        .is_some_and(|t| t.starts_with("application/openmetrics-text")));
    let text = String::from_utf8_lossy(&m.body).to_string();
    for line in [
        "idemproxy_replays_total{upstream=\"mail\",route=\"send_email\"} 1",
        "idemproxy_attempts_total{upstream=\"mail\",route=\"send_email\"} 1",
        "idemproxy_duplicates_prevented_total{upstream=\"mail\",route=\"send_email\"} 1",
        "idemproxy_upstream_duration_seconds_count{upstream=\"mail\",route=\"send_email\"} 1",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in\n{text}"
        );
    }
}

/// Read-only requests are counted by route, on the listener's fast path and on hyper's.
#[tokio::test(flavor = "multi_thread")]
async fn metrics_count_read_only_requests() {
    for fast in ["1", "0"] {
        let (_dir, _ds, proxy) = setup_with_env(&[("IDEMPROXY_FAST_PATH", fast)]).await;
        let c = client();
        for _ in 0..3 {
            let r = send(&c, Method::GET, &proxy.url("/mail/messages"), &[TENANT], "").await;
            assert!(r.status.is_success() || r.status.is_client_error(), "{r:?}");
        }
        let text =
            String::from_utf8_lossy(&admin_get(&c, &proxy, "/metrics").await.body).to_string();
        let line = "idemproxy_read_only_total{upstream=\"mail\",route=\"unmatched_read\"} 3";
        assert!(
            text.lines().any(|l| l == line),
            "fast path {fast}: missing {line:?} in\n{text}"
        );
    }
}

/// Refusals (key mismatch, approval required) and approvals are counted by route.
#[tokio::test(flavor = "multi_thread")]
async fn metrics_count_refusals_and_approvals() {
    let (_dir, _ds, proxy) = setup().await;
    let c = client();
    let send = |body: &'static str| {
        let c = c.clone();
        let url = proxy.url("/mail/send");
        async move { post(&c, &url, &[TENANT, ("idempotency-key", "k-r")], body).await }
    };
    assert_eq!(send(r#"{"to":"a"}"#).await.status, StatusCode::CREATED);
    assert_eq!(
        send(r#"{"to":"b"}"#).await.status,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    let body = json!({ "to": "acct_B", "amount": 5 });
    let (id, hash) = approval_of(&pay(&c, &proxy, "pay", "k-ap", body.clone()).await);
    approval_of(&pay(&c, &proxy, "pay", "k-ap", body).await);
    let ok = admin_post(
        &c,
        &proxy,
        &format!("/v1/executions/{id}/approve"),
        json!({ "args_hash": hash }),
    )
    .await;
    assert_eq!(ok.status, StatusCode::OK, "{ok:?}");
    let text = String::from_utf8_lossy(&admin_get(&c, &proxy, "/metrics").await.body).to_string();
    for line in [
        "idemproxy_refusals_total{upstream=\"mail\",route=\"send_email\",result=\"key_mismatch\"} 1",
        "idemproxy_refusals_total{upstream=\"pay\",route=\"transfer\",result=\"approval_required\"} 2",
        "idemproxy_approvals_total{upstream=\"pay\",route=\"transfer\",result=\"approved\"} 1",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in\n{text}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn no_secret_reaches_a_log_line() {
    const BODY_SECRET: &str = "sk_live_BODYSECRET_4242";
    const TENANT_SECRET: &str = "tenant-CREDSECRET-9191";
    const PREVIEW_SECRET: &str = "acct_PREVIEWSECRET_77";
    const QUERY_SECRET: &str = "QUERYSECRET_5150";
    let (_dir, ds, proxy) =
        setup_with_env(&[("IDEMPROXY_LOG", "debug"), ("IDEMPROXY_LOG_FORMAT", "json")]).await;
    let c = client();
    let tenant = format!("Bearer {TENANT_SECRET}");
    let body = json!({ "to": "s@x", "api_key": BODY_SECRET, "note": BODY_SECRET }).to_string();
    for _ in 0..2 {
        let r = post(
            &c,
            &proxy.url("/mail/send"),
            &[("authorization", &tenant), ("idempotency-key", "k-secret")],
            &body,
        )
        .await;
        assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
    }
    let r = post(
        &c,
        &proxy.url("/mail/drop-after-commit/send"),
        &[
            ("authorization", &tenant),
            ("idempotency-key", "k-secret-2"),
        ],
        &body,
    )
    .await;
    assert_eq!(r.header("idempotency-status"), Some("outcome_unknown"));
    let pay_body = json!({ "to": PREVIEW_SECRET, "amount": 1, "card": BODY_SECRET }).to_string();
    let pay_url = proxy.url("/pay/send");
    let held = post(
        &c,
        &pay_url,
        &[
            ("authorization", &tenant),
            ("idempotency-key", "k-secret-3"),
        ],
        &pay_body,
    )
    .await;
    let (id, hash) = approval_of(&held);
    let ok = admin_post(
        &c,
        &proxy,
        &format!("/v1/executions/{id}/approve"),
        json!({ "args_hash": hash }),
    )
    .await;
    assert_eq!(ok.status, StatusCode::OK);
    let run = post(
        &c,
        &pay_url,
        &[
            ("authorization", &tenant),
            ("idempotency-key", "k-secret-3"),
        ],
        &pay_body,
    )
    .await;
    assert_eq!(run.status, StatusCode::CREATED);
    // Argument values in query strings, on a read-only and on a side-effect route.
    let read = send(
        &c,
        Method::GET,
        &proxy.url(&format!("/mail/messages?tag={QUERY_SECRET}")),
        &[("authorization", &tenant)],
        "",
    )
    .await;
    assert_eq!(read.status, StatusCode::OK, "{read:?}");
    let query = post(
        &c,
        &proxy.url(&format!("/mail/send?trace={QUERY_SECRET}")),
        &[
            ("authorization", &tenant),
            ("idempotency-key", "k-secret-4"),
        ],
        &body,
    )
    .await;
    assert_eq!(query.status, StatusCode::CREATED, "{query:?}");
    let wrong_admin = format!("Bearer {ADMIN_TOKEN}-wrong");
    let refused = send(
        &c,
        Method::GET,
        &proxy.admin_url("/v1/executions"),
        &[("authorization", &wrong_admin)],
        "",
    )
    .await;
    assert_eq!(refused.status, StatusCode::UNAUTHORIZED);
    let _ = admin_get(&c, &proxy, &format!("/v1/executions/{id}")).await;
    assert_eq!(ds.commits(), 4);

    proxy.wait_for_log("executing", Duration::from_secs(5));
    // Give the delivery writes and the admin request logs a moment to land.
    let deadline = Instant::now() + Duration::from_millis(300);
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let lines = proxy.stderr_lines();
    assert!(lines.len() > 10, "debug logging produced lines: {lines:?}");
    assert!(
        lines.iter().any(|l| l.contains("\"level\":\"DEBUG\"")),
        "debug lines are on: {lines:?}"
    );
    for line in &lines {
        let parsed: Result<Value, _> = serde_json::from_str(line);
        assert!(parsed.is_ok(), "not a JSON log line: {line}");
        for secret in [
            BODY_SECRET,
            TENANT_SECRET,
            PREVIEW_SECRET,
            QUERY_SECRET,
            ADMIN_TOKEN,
        ] {
            assert!(!line.contains(secret), "secret {secret:?} logged: {line}");
        }
    }
}

/// The listener serves plain HTTP/1.1 requests on its fast path (src/wire/fast.rs); only
/// the connections it cannot serve go to hyper, and `/metrics` counts them. This is what
/// shows the fast path is in use at all: everything else behaves the same either way.
#[tokio::test(flavor = "multi_thread")]
async fn plain_requests_stay_on_the_fast_path_and_hand_offs_are_counted() {
    let (_dir, ds, proxy) = setup().await;
    let admin = client();
    let sent = |c: TestClient, prefix: &'static str| {
        let url = proxy.url("/mail/send");
        async move {
            for i in 0..3 {
                let key = format!("{prefix}-{i}");
                let r = post(&c, &url, &[("idempotency-key", &key), TENANT], "{}").await;
                assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
            }
        }
    };
    let counted = |m: Resp| {
        String::from_utf8_lossy(&m.body)
            .lines()
            .find_map(|l| l.strip_prefix("idemproxy_hyper_connections_total "))
            .map(|n| n.trim().to_string())
    };
    sent(client(), "k-fast").await;
    let m = admin_get(&admin, &proxy, "/metrics").await;
    assert_eq!(counted(m).as_deref(), Some("0"));
    // HTTP/2 with prior knowledge is hyper's: one connection, counted once.
    sent(h2_client(), "k-h2").await;
    let m = admin_get(&admin, &proxy, "/metrics").await;
    assert_eq!(counted(m).as_deref(), Some("1"));
    assert_eq!(ds.commits(), 6);
}

/// Scoped tokens (SPEC section 10): each endpoint needs its scope, a token without it gets
/// 403 `forbidden` and changes nothing, and every decision records the token's name.
#[tokio::test(flavor = "multi_thread")]
async fn scoped_tokens_do_only_what_they_may() {
    const VIEW: &str = "viewer-token-for-tests-0123456789";
    const STOP: &str = "stop-button-token-for-tests-01234";
    const APPROVER: &str = "approver-token-for-tests-01234567";
    let dir = tempfile::tempdir().expect("tempdir");
    let ds = FakeDownstream::start().await;
    let yaml = admin_config(dir.path(), &ds.url()).replace(
        &format!("admin: {{ listen: 127.0.0.1:0, token_env: {ADMIN_TOKEN_ENV} }}"),
        "admin:\n  listen: 127.0.0.1:0\n  tokens:\n    - { name: viewer, token_env: T_VIEW, scopes: [view] }\n    - { name: stop, token_env: T_STOP, scopes: [cancel] }\n    - { name: approver, token_env: T_APPROVE, scopes: [view, approve] }",
    );
    let proxy = ProxyProc::start_with_env(
        dir.path(),
        &yaml,
        &[("T_VIEW", VIEW), ("T_STOP", STOP), ("T_APPROVE", APPROVER)],
    );
    let c = client();
    let as_ = |token: &'static str| format!("Bearer {token}");
    let call = |path: String, token: &'static str, body: Value| {
        let c = c.clone();
        let url = proxy.admin_url(&path);
        let auth = as_(token);
        async move {
            post(
                &c,
                &url,
                &[("authorization", auth.as_str())],
                &body.to_string(),
            )
            .await
        }
    };

    let get = |path: String, token: &'static str| {
        let c = c.clone();
        let url = proxy.admin_url(&path);
        let auth = as_(token);
        async move {
            send(
                &c,
                Method::GET,
                &url,
                &[("authorization", auth.as_str())],
                "",
            )
            .await
        }
    };
    let body = json!({ "to": "acct_B", "amount": 10 });
    let (id, hash) = approval_of(
        &post(
            &c,
            &proxy.url("/pay/send"),
            &[
                TENANT,
                ("idempotency-key", "k-scope"),
                ("x-operation-id", "op_scope"),
            ],
            &body.to_string(),
        )
        .await,
    );

    // The viewer reads, and can do nothing else.
    let seen = get(format!("/v1/executions/{id}"), VIEW).await;
    assert_eq!(seen.status, StatusCode::OK, "{seen:?}");
    for (path, what) in [
        (format!("/v1/executions/{id}/approve"), "approve"),
        (format!("/v1/executions/{id}/reject"), "approve"),
        (format!("/v1/executions/{id}/resolve"), "resolve"),
        ("/v1/operations/op_scope/cancel".to_string(), "cancel"),
    ] {
        let r = call(
            path.clone(),
            VIEW,
            json!({ "args_hash": hash, "as": "committed" }),
        )
        .await;
        assert_eq!(r.status, StatusCode::FORBIDDEN, "{path}: {r:?}");
        assert_eq!(r.problem_type(), "urn:idemproxy:problem:forbidden");
        assert_eq!(r.json()["scope"], what, "{path}");
    }
    // The Stop-button token cannot approve or even read.
    let r = call(
        format!("/v1/executions/{id}/approve"),
        STOP,
        json!({ "args_hash": hash }),
    )
    .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN, "{r:?}");
    let r = get("/v1/executions".into(), STOP).await;
    assert_eq!(r.status, StatusCode::FORBIDDEN, "{r:?}");
    // Nothing changed: still waiting, nothing sent.
    let after = get(format!("/v1/executions/{id}"), VIEW).await;
    assert_eq!(seen.json()["state"], "awaiting_approval");
    assert_eq!(after.json()["state"], "awaiting_approval", "{after:?}");
    assert_eq!(after.json()["history"], seen.json()["history"]);
    assert_eq!(ds.commits(), 0);

    // The approver approves; the record names the token.
    let ok = call(
        format!("/v1/executions/{id}/approve"),
        APPROVER,
        json!({ "args_hash": hash, "by": "alice" }),
    )
    .await;
    assert_eq!(ok.status, StatusCode::OK, "{ok:?}");
    assert_eq!(ok.json()["approval"]["by"], "alice (token approver)");
    // The Stop button cancels the operation; the mark names its token.
    let stop = call("/v1/operations/op_scope/cancel".into(), STOP, json!({})).await;
    assert_eq!(stop.status, StatusCode::OK, "{stop:?}");
    let op = get("/v1/operations/op_scope".into(), APPROVER).await;
    assert_eq!(op.json()["mark"]["by"], "stop", "{op:?}");
    // The single `token_env` token of other configs is gone here: unknown tokens are 401.
    let r = call(
        format!("/v1/executions/{id}/approve"),
        "admin-token-for-tests-0123456789",
        json!({}),
    )
    .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{r:?}");
}
