//! End-to-end behaviour of the core proxy (SPEC sections 4–6): the real binary, a real
//! redb file, the fake downstream counting side effects.

mod common;

use std::time::Duration;

use common::fake_downstream::FakeDownstream;
use common::*;
use http::{Method, StatusCode};

const AUTH_A: (&str, &str) = ("authorization", "Bearer tenant-a");
const AUTH_B: (&str, &str) = ("authorization", "Bearer tenant-b");

async fn setup() -> (tempfile::TempDir, FakeDownstream, ProxyProc) {
    let dir = tempfile::tempdir().expect("tempdir");
    let ds = FakeDownstream::start().await;
    let proxy = ProxyProc::start(dir.path(), &config(dir.path(), &ds.url()));
    (dir, ds, proxy)
}

#[tokio::test(flavor = "multi_thread")]
async fn duplicate_post_replays_with_one_commit() {
    let (_dir, ds, proxy) = setup().await;
    let c = client();
    let url = proxy.url("/mail/send");
    let first = post(
        &c,
        &url,
        &[AUTH_A, ("idempotency-key", "k-1")],
        r#"{"to":"a@x","subject":"hi"}"#,
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(first.header("idempotent-replayed"), None);
    let exec_id = first
        .header("idempotency-execution-id")
        .expect("execution id")
        .to_string();
    for _ in 0..3 {
        let again = post(
            &c,
            &url,
            &[AUTH_A, ("idempotency-key", "k-1")],
            r#"{"to":"a@x","subject":"hi"}"#,
        )
        .await;
        assert_eq!(again.status, StatusCode::CREATED);
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
        assert_eq!(
            again.header("idempotency-execution-id"),
            Some(exec_id.as_str())
        );
        assert_eq!(again.body, first.body, "replay returns the original body");
        assert_eq!(
            again.header("x-request-id"),
            first.header("x-request-id"),
            "stored headers replayed"
        );
    }
    assert_eq!(ds.commits(), 1);
    // The downstream saw exactly one key header, the execution id, not the client's key.
    let seen = ds.last_request("/send").expect("downstream was called");
    assert_eq!(seen.header_values("idempotency-key"), vec![exec_id.clone()]);
}

#[tokio::test(flavor = "multi_thread")]
async fn json_spelling_does_not_change_the_hash_but_values_do() {
    let (_dir, ds, proxy) = setup().await;
    let c = client();
    let url = proxy.url("/mail/send");
    let k = [AUTH_A, ("idempotency-key", "k-json")];
    let a = post(
        &c,
        &url,
        &k,
        r#"{"to":"a@x","amount":1.0,"meta":{"b":2,"a":1},"client_ts":1}"#,
    )
    .await;
    assert_eq!(a.status, StatusCode::CREATED);
    let b = post(
        &c,
        &url,
        &k,
        "{ \"meta\" : {\"a\":1, \"b\":2},\n \"amount\": 1, \"to\":\"a@x\", \"client_ts\": 99 }",
    )
    .await;
    assert_eq!(b.status, StatusCode::CREATED, "{b:?}");
    assert_eq!(b.header("idempotent-replayed"), Some("true"));
    let changed = post(
        &c,
        &url,
        &k,
        r#"{"to":"a@x","amount":2,"meta":{"b":2,"a":1}}"#,
    )
    .await;
    assert_eq!(changed.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(changed.problem_type(), "urn:idemproxy:problem:key-mismatch");
    assert_eq!(
        changed.json()["execution_id"].as_str(),
        a.header("idempotency-execution-id")
    );
    assert_eq!(ds.commits(), 1);
}

/// Replays from memory (`proxy::replay`) answer exactly what the store would: the same
/// answer for the same bytes, and for anything else the store path's verdict.
#[tokio::test(flavor = "multi_thread")]
async fn replays_from_memory_keep_the_store_verdicts() {
    let (_dir, ds, proxy) = setup().await;
    let c = client();
    let url = proxy.url("/mail/send");
    let k = [AUTH_A, ("idempotency-key", "k-mem")];
    let body = r#"{"to":"a@x","amount":1}"#;
    let first = post(&c, &url, &k, body).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let memory = |p: &ProxyProc| {
        p.stderr_lines()
            .iter()
            .filter(|l| l.contains("replayed stored result") && l.contains("memory"))
            .count()
    };
    // A first answer is not kept, however long ago it was delivered: the first retry
    // reads the store, and that replay is what puts the answer in memory.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let retry = post(&c, &url, &k, body).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(
        memory(&proxy),
        0,
        "the first retry is answered from the store"
    );
    // Byte-identical retries after it are answered from memory (once the replayed
    // record is `result_delivered`).
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while memory(&proxy) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "no replay from memory; stderr:\n{}",
            proxy.stderr_lines().join("\n")
        );
        let again = post(&c, &url, &k, body).await;
        assert_eq!(again.status, StatusCode::CREATED);
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
        assert_eq!(again.body, first.body);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let cached = post(&c, &url, &k, body).await;
    assert_eq!(cached.status, StatusCode::CREATED);
    assert_eq!(cached.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        cached.header("idempotency-execution-id"),
        first.header("idempotency-execution-id")
    );
    assert_eq!(cached.header("x-request-id"), first.header("x-request-id"));
    assert_eq!(cached.body, first.body);
    // Memory answers (over HTTP/1.1, as bytes: `side_effect::replay_raw`) what the store
    // answered: the same fields in the same order, but for the date.
    let fields = |r: &Resp| -> Vec<(String, Vec<u8>)> {
        r.headers
            .iter()
            .filter(|(n, _)| *n != "date")
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect()
    };
    assert_eq!(fields(&cached), fields(&retry));
    // Over HTTP/2 (hyper's server, the replay cache's ready header map): the same again,
    // from memory too.
    let from_memory = memory(&proxy);
    let h2 = post(&h2_client(), &url, &k, body).await;
    assert_eq!(h2.status, StatusCode::CREATED);
    assert_eq!(fields(&h2), fields(&retry));
    assert_eq!(h2.body, first.body);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while memory(&proxy) == from_memory {
        assert!(
            std::time::Instant::now() < deadline,
            "the HTTP/2 replay was not answered from memory"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Other arguments under the cached key: still the key-mismatch problem.
    let changed = post(&c, &url, &k, r#"{"to":"a@x","amount":2}"#).await;
    assert_eq!(
        changed.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{changed:?}"
    );
    assert_eq!(changed.problem_type(), "urn:idemproxy:problem:key-mismatch");
    // Respelled, same arguments: other bytes, so the store path, which replays.
    let respelled = post(&c, &url, &k, r#"{ "amount": 1.0, "to": "a@x" }"#).await;
    assert_eq!(respelled.status, StatusCode::CREATED, "{respelled:?}");
    assert_eq!(respelled.header("idempotent-replayed"), Some("true"));
    // A fingerprinted part outside the body (here the tenant) is another execution.
    let other_tenant = post(&c, &url, &[AUTH_B, ("idempotency-key", "k-mem")], body).await;
    assert_eq!(other_tenant.status, StatusCode::CREATED);
    assert_eq!(other_tenant.header("idempotent-replayed"), None);
    assert_eq!(
        ds.commits(),
        2,
        "one execution per tenant, however replayed"
    );
}

/// A kept answer ends with its record's retention: once gc has deleted the record, the
/// same key executes again instead of being replayed from memory.
#[tokio::test(flavor = "multi_thread")]
async fn replays_from_memory_end_with_retention() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ds = FakeDownstream::start().await;
    let yaml = config(dir.path(), &ds.url())
        .replace("retention: 1h }", "retention: 1s, gc_interval: 1s }");
    assert!(yaml.contains("gc_interval: 1s"));
    let proxy = ProxyProc::start(dir.path(), &yaml);
    let c = client();
    let url = proxy.url("/mail/send");
    let k = [AUTH_A, ("idempotency-key", "k-short")];
    let first = post(&c, &url, &k, r#"{"to":"a@x"}"#).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(ds.commits(), 1);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let again = post(&c, &url, &k, r#"{"to":"a@x"}"#).await;
        assert_eq!(again.status, StatusCode::CREATED, "{again:?}");
        if again.header("idempotent-replayed").is_none() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still replayed 10 s after a 1 s retention"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(ds.commits(), 2, "executed again once the record was gone");
}

#[tokio::test(flavor = "multi_thread")]
async fn twenty_concurrent_duplicates_make_one_commit() {
    let (_dir, ds, proxy) = setup().await;
    ds.set_delay(Duration::from_millis(300));
    let c = client();
    let url = proxy.url("/mail/send");
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let (c, url) = (c.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            post(
                &c,
                &url,
                &[AUTH_A, ("idempotency-key", "k-race")],
                r#"{"to":"r@x"}"#,
            )
            .await
        }));
    }
    let mut created = 0;
    let mut in_flight = 0;
    for t in tasks {
        let r = t.await.expect("task");
        match r.status {
            StatusCode::CREATED => created += 1,
            StatusCode::CONFLICT => {
                assert_eq!(r.problem_type(), "urn:idemproxy:problem:in-flight");
                assert_eq!(r.header("retry-after"), Some("1"));
                in_flight += 1;
            }
            other => panic!("unexpected {other}: {r:?}"),
        }
    }
    assert_eq!(created + in_flight, 20);
    assert!(created >= 1);
    assert_eq!(ds.commits(), 1, "exactly one downstream commit");
    let after = post(
        &c,
        &url,
        &[AUTH_A, ("idempotency-key", "k-race")],
        r#"{"to":"r@x"}"#,
    )
    .await;
    assert_eq!(after.header("idempotent-replayed"), Some("true"));
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_wait_holds_duplicates_and_replays() {
    let (_dir, ds, proxy) = setup().await;
    ds.set_delay(Duration::from_millis(300));
    let c = client();
    let url = proxy.url("/mail/keyed/send");
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let (c, url) = (c.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            post(
                &c,
                &url,
                &[AUTH_A, ("idempotency-key", "k-wait")],
                r#"{"to":"w@x"}"#,
            )
            .await
        }));
    }
    let mut bodies = Vec::new();
    for t in tasks {
        let r = t.await.expect("task");
        assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
        bodies.push(r.body);
    }
    assert!(
        bodies.windows(2).all(|w| w[0] == w[1]),
        "every duplicate got the same result"
    );
    assert_eq!(ds.commits(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn same_key_under_two_credentials_is_two_executions() {
    let (_dir, ds, proxy) = setup().await;
    let c = client();
    let url = proxy.url("/mail/send");
    let a = post(
        &c,
        &url,
        &[AUTH_A, ("idempotency-key", "shared")],
        r#"{"to":"a@x"}"#,
    )
    .await;
    let b = post(
        &c,
        &url,
        &[AUTH_B, ("idempotency-key", "shared")],
        r#"{"to":"b@x"}"#,
    )
    .await;
    assert_eq!(a.status, StatusCode::CREATED);
    assert_eq!(
        b.status,
        StatusCode::CREATED,
        "different args under another tenant is not a mismatch"
    );
    assert_eq!(
        b.header("idempotent-replayed"),
        None,
        "no cross-tenant replay"
    );
    assert_ne!(
        a.header("idempotency-execution-id"),
        b.header("idempotency-execution-id")
    );
    assert_ne!(a.body, b.body);
    assert_eq!(ds.commits(), 2);
    let a2 = post(
        &c,
        &url,
        &[AUTH_A, ("idempotency-key", "shared")],
        r#"{"to":"a@x"}"#,
    )
    .await;
    assert_eq!(a2.body, a.body);
}

#[tokio::test(flavor = "multi_thread")]
async fn derived_keys_from_trusted_headers() {
    let (_dir, ds, proxy) = setup().await;
    let c = client();
    let url = proxy.url("/mail/send");
    let call = |call_id: &'static str| {
        [
            AUTH_A,
            ("x-operation-id", "op_77"),
            ("x-model-round", "round_3"),
            ("x-tool-call-id", call_id),
        ]
    };
    let first = post(&c, &url, &call("call_123"), r#"{"to":"a@x"}"#).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = post(&c, &url, &call("call_123"), r#"{"to":"a@x"}"#).await;
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    // A parallel call in the same round is a separate execution.
    let parallel = post(&c, &url, &call("call_124"), r#"{"to":"b@x"}"#).await;
    assert_eq!(parallel.status, StatusCode::CREATED);
    assert_eq!(parallel.header("idempotent-replayed"), None);
    assert_eq!(ds.commits(), 2);
    // Missing one of the derive_from headers and no key: key-missing, nothing sent.
    let partial = post(
        &c,
        &url,
        &[AUTH_A, ("x-operation-id", "op_77")],
        r#"{"to":"a@x"}"#,
    )
    .await;
    assert_eq!(partial.status, StatusCode::BAD_REQUEST);
    assert_eq!(partial.problem_type(), "urn:idemproxy:problem:key-missing");
    assert_eq!(ds.commits(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_keys_and_bodies_are_refused_before_anything_is_sent() {
    let (_dir, ds, proxy) = setup().await;
    let c = client();
    let url = proxy.url("/mail/send");
    let long = "k".repeat(65);
    let r = post(&c, &url, &[("idempotency-key", long.as_str())], "{}").await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.problem_type(), "urn:idemproxy:problem:key-invalid");
    let big = format!(r#"{{"blob":"{}"}}"#, "x".repeat(5000));
    let r = post(&c, &url, &[("idempotency-key", "k-big")], &big).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(r.problem_type(), "urn:idemproxy:problem:body-too-large");
    let r = post(&c, &url, &[], "{}").await;
    assert_eq!(r.problem_type(), "urn:idemproxy:problem:key-missing");
    assert_eq!(ds.hits(), 0, "nothing reached the downstream");
    // The body limit did not burn the key: the same key with a small body executes.
    let ok = post(&c, &url, &[("idempotency-key", "k-big")], "{}").await;
    assert_eq!(ok.status, StatusCode::CREATED);
}

/// A request head larger than `limits.max_header_bytes` (8 KiB by default) is answered
/// `431` and nothing is sent; a config that raises the limit takes the same request.
#[tokio::test(flavor = "multi_thread")]
async fn request_heads_over_the_header_limit_get_431() {
    let (_dir, ds, proxy) = setup().await;
    let trace = "t".repeat(9 * 1024);
    let big_head = [("idempotency-key", "k-head"), ("x-trace", trace.as_str())];
    let r = post(&client(), &proxy.url("/mail/send"), &big_head, "{}").await;
    assert_eq!(r.status, StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
    assert_eq!(ds.hits(), 0, "nothing reached the downstream");
    // The connection was closed; a new one with a small head is served.
    let ok = post(
        &client(),
        &proxy.url("/mail/send"),
        &[("idempotency-key", "k-head")],
        "{}",
    )
    .await;
    assert_eq!(ok.status, StatusCode::CREATED);
    assert_eq!(ds.hits(), 1);

    let dir = tempfile::tempdir().expect("tempdir");
    let yaml = config(dir.path(), &ds.url()).replace(
        "limits: { max_body_bytes: 4096, max_key_bytes: 64 }",
        "limits: { max_body_bytes: 4096, max_key_bytes: 64, max_header_bytes: 32768 }",
    );
    assert!(yaml.contains("max_header_bytes: 32768"));
    let raised = ProxyProc::start(dir.path(), &yaml);
    let r = post(&client(), &raised.url("/mail/send"), &big_head, "{}").await;
    assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
    assert_eq!(ds.hits(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn read_only_routes_pass_through_unrecorded_with_retries() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ds = FakeDownstream::start().await;
    let proxy = ProxyProc::start(dir.path(), &config(dir.path(), &ds.url()));
    let c = client();
    // Commit one message, then read it through the read-only route.
    let sent = post(
        &c,
        &proxy.url("/mail/send"),
        &[("idempotency-key", "k-ro")],
        r#"{"to":"a@x"}"#,
    )
    .await;
    let id = sent.json()["id"].as_str().expect("message id").to_string();
    for _ in 0..3 {
        let got = send(
            &c,
            Method::GET,
            &proxy.url(&format!("/mail/messages/{id}")),
            &[],
            "",
        )
        .await;
        assert_eq!(got.status, StatusCode::OK);
        assert_eq!(got.header("idempotent-replayed"), None);
    }
    // /flaky fails every other call with 503; the proxy retries inside.
    for _ in 0..4 {
        let r = send(&c, Method::GET, &proxy.url("/mail/flaky"), &[], "").await;
        assert_eq!(r.status, StatusCode::OK, "{r:?}");
    }
    // Unmatched GET under the mount is read-only by method.
    let w = send(
        &c,
        Method::GET,
        &proxy.url("/mail/weather?city=Oslo"),
        &[],
        "",
    )
    .await;
    assert_eq!(w.status, StatusCode::OK);
    assert_eq!(ds.commits(), 1);
    proxy.terminate();
    let rows = records(&dir.path().join("idemproxy.yaml"));
    assert_eq!(rows.len(), 1, "only the side effect is recorded: {rows:?}");
    assert!(rows[0].contains("mail/send_email"));
    // `records show` decodes the stored answer as the admin API does.
    let config = dir.path().join("idemproxy.yaml");
    let id = rows[0].split_whitespace().next().expect("id column");
    let out = cli(&[
        "records",
        "show",
        id,
        "--config",
        config.to_str().expect("utf-8"),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rec: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(rec["execution_id"], id);
    assert_eq!(rec["response"]["body_encoding"], "json", "{rec}");
    assert!(rec["response"]["body"]["id"].is_string(), "{rec}");
}

/// The log lines of a call carry its execution id, operation id and tool call id (the
/// orchestration's ids, never argument values).
#[tokio::test(flavor = "multi_thread")]
async fn log_lines_of_a_call_name_its_ids() {
    let (_dir, _ds, proxy) = setup().await;
    let c = client();
    let r = post(
        &c,
        &proxy.url("/mail/send"),
        &[
            AUTH_A,
            ("x-operation-id", "op_logs"),
            ("x-model-round", "round_1"),
            ("x-tool-call-id", "call_logs"),
        ],
        r#"{"to":"secret-recipient@example.com"}"#,
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
    let id = r
        .header("idempotency-execution-id")
        .expect("id")
        .to_string();
    proxy.wait_for_log("executing", Duration::from_secs(5));
    let lines = proxy.stderr_lines();
    let executing = lines
        .iter()
        .find(|l| l.contains("executing") && l.contains(&id))
        .unwrap_or_else(|| panic!("no executing line:\n{}", lines.join("\n")));
    assert!(executing.contains("op_logs"), "{executing}");
    assert!(executing.contains("call_logs"), "{executing}");
    assert!(
        !lines.iter().any(|l| l.contains("secret-recipient")),
        "an argument value reached the log"
    );
}

/// `records list` columns line up whatever the lengths of their values.
#[tokio::test(flavor = "multi_thread")]
async fn records_list_columns_align() {
    let (dir, ds, proxy) = setup().await;
    let c = client();
    for (path, key) in [
        ("/mail/send", "k-a"),
        ("/mail/echo/some-long-resource-name", "k-b"),
        ("/mail/fail-after-commit/send", "k-c"),
    ] {
        post(
            &c,
            &proxy.url(path),
            &[AUTH_A, ("idempotency-key", key)],
            "{}",
        )
        .await;
    }
    assert!(ds.hits() >= 3);
    proxy.terminate();
    let config = dir.path().join("idemproxy.yaml");
    let out = cli(&[
        "records",
        "list",
        "--config",
        config.to_str().expect("utf-8"),
    ]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 4, "{text}");
    let starts = |line: &str| -> Vec<usize> {
        let b = line.as_bytes();
        (0..b.len())
            .filter(|&i| b[i] != b' ' && (i == 0 || b[i - 1] == b' '))
            .collect()
    };
    // Left-aligned columns start where their header does.
    let head = starts(lines[0]);
    for line in &lines[1..] {
        assert_eq!(starts(line)[..3], head[..3], "{text}");
        assert_eq!(
            line.len(),
            lines[0].len(),
            "right-aligned columns end together: {text}"
        );
    }
}

/// Read-only retries honour `429` and `Retry-After` (capped): the proxy waits as long as
/// the upstream asked before trying again, and past the cap hands the answer over.
#[tokio::test(flavor = "multi_thread")]
async fn read_only_retries_honour_429_and_retry_after() {
    let (_dir, ds, proxy) = setup().await;
    let c = client();
    let started = std::time::Instant::now();
    let r = send(
        &c,
        Method::GET,
        &proxy.url("/mail/flaky?fail=1&status=429&retry_after=1"),
        &[],
        "",
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "the 429 was retried: {r:?}");
    assert_eq!(r.json()["call"], 2);
    // Behaviour, not speed: the second try waited for the upstream's second.
    assert!(
        started.elapsed() >= Duration::from_millis(950),
        "retried after {:?}, before the Retry-After",
        started.elapsed()
    );
    assert_eq!(ds.hits_on("/flaky"), 2);
    // Beyond the cap (10 s) the client gets the 429 and its Retry-After, at once.
    let r = send(
        &c,
        Method::GET,
        &proxy.url("/mail/flaky?fail=1&status=429&retry_after=60"),
        &[],
        "",
    )
    .await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{r:?}");
    assert_eq!(r.header("retry-after"), Some("60"));
    assert_eq!(ds.hits_on("/flaky"), 3, "not retried");
}

#[tokio::test(flavor = "multi_thread")]
async fn hop_by_hop_headers_and_forwarding_headers() {
    let (_dir, ds, proxy) = setup().await;
    let c = client();
    let r = post(
        &c,
        &proxy.url("/mail/echo/x?b=2&a=1"),
        &[
            ("idempotency-key", "client-key"),
            ("connection", "x-hop"),
            ("x-hop", "secret"),
            ("x-custom", "kept"),
        ],
        r#"{"a":1}"#,
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{r:?}");
    let echo = r.json();
    let h = &echo["headers"];
    assert!(
        h.get("x-hop").is_none(),
        "connection-named header stripped: {h}"
    );
    assert_eq!(h["x-custom"][0], "kept");
    assert_eq!(h["idempotency-key"].as_array().map(|a| a.len()), Some(1));
    assert_ne!(
        h["idempotency-key"][0], "client-key",
        "the client's key is not forwarded as is"
    );
    assert_eq!(h["host"][0].as_str(), Some(ds.addr().to_string().as_str()));
    assert_eq!(h["x-forwarded-for"][0], "127.0.0.1");
    assert_eq!(h["x-forwarded-proto"][0], "http");
    assert_eq!(echo["query"], "b=2&a=1");
}

#[tokio::test(flavor = "multi_thread")]
async fn http2_clients_are_served() {
    let (_dir, ds, proxy) = setup().await;
    let c = h2_client();
    let r = post(
        &c,
        &proxy.url("/mail/send"),
        &[("idempotency-key", "k-h2")],
        "{}",
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED);
    let again = post(
        &c,
        &proxy.url("/mail/send"),
        &[("idempotency-key", "k-h2")],
        "{}",
    )
    .await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(ds.commits(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn connect_failure_is_failed_before_commit_and_may_run_again() {
    let (_dir, _ds, proxy) = setup().await;
    let c = client();
    let url = proxy.url("/dead/send");
    for _ in 0..2 {
        let r = post(&c, &url, &[("idempotency-key", "k-dead")], "{}").await;
        assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{r:?}");
        assert_eq!(
            r.problem_type(),
            "urn:idemproxy:problem:upstream-unavailable"
        );
        assert_eq!(r.header("idempotency-status"), Some("failed_before_commit"));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn lost_connection_after_send_is_outcome_unknown_and_never_resent() {
    let (_dir, ds, proxy) = setup().await;
    let c = client();
    let url = proxy.url("/mail/drop-after-commit/send");
    let r = post(&c, &url, &[("idempotency-key", "k-drop")], "{}").await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{r:?}");
    assert_eq!(r.problem_type(), "urn:idemproxy:problem:outcome-unknown");
    assert_eq!(r.header("idempotency-status"), Some("outcome_unknown"));
    let retry = post(&c, &url, &[("idempotency-key", "k-drop")], "{}").await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert_eq!(
        retry.problem_type(),
        "urn:idemproxy:problem:outcome-unknown"
    );
    assert_eq!(ds.commits(), 1);
    // Timeout after the downstream committed: 504, and also never re-sent.
    let url = proxy.url("/mail/timeout-after-commit/send");
    let r = post(&c, &url, &[("idempotency-key", "k-hang")], "{}").await;
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT, "{r:?}");
    assert_eq!(r.header("idempotency-status"), Some("outcome_unknown"));
    let retry = post(&c, &url, &[("idempotency-key", "k-hang")], "{}").await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert_eq!(ds.commits(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn on_5xx_policies() {
    let (_dir, ds, proxy) = setup().await;
    let c = client();
    // failed_before_commit: the 500 is passed on and a retry executes again.
    let url = proxy.url("/mail/fail-before-commit/send");
    for _ in 0..2 {
        let r = post(&c, &url, &[("idempotency-key", "k-5xx-a")], "{}").await;
        assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(r.header("idempotency-status"), Some("failed_before_commit"));
    }
    assert_eq!(ds.hits_on("/fail-before-commit/send"), 2);
    // outcome_unknown (default): the 500 is passed on; a retry is not re-sent.
    let url = proxy.url("/mail/fail-after-commit/send");
    let r = post(&c, &url, &[("idempotency-key", "k-5xx-b")], "{}").await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(r.header("idempotency-status"), Some("outcome_unknown"));
    let retry = post(&c, &url, &[("idempotency-key", "k-5xx-b")], "{}").await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert_eq!(ds.hits_on("/fail-after-commit/send"), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn committed_results_survive_sigterm_and_sigkill_restarts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ds = FakeDownstream::start().await;
    let yaml = config(dir.path(), &ds.url());
    let c = client();
    let proxy = ProxyProc::start(dir.path(), &yaml);
    let first = post(
        &c,
        &proxy.url("/mail/send"),
        &[("idempotency-key", "k-durable")],
        r#"{"n":1}"#,
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(proxy.terminate().code(), Some(0), "SIGTERM exits cleanly");

    let proxy = ProxyProc::start(dir.path(), &yaml);
    let again = post(
        &c,
        &proxy.url("/mail/send"),
        &[("idempotency-key", "k-durable")],
        r#"{"n":1}"#,
    )
    .await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, first.body);
    let second = post(
        &c,
        &proxy.url("/mail/send"),
        &[("idempotency-key", "k-durable-2")],
        r#"{"n":2}"#,
    )
    .await;
    assert_eq!(second.status, StatusCode::CREATED);
    proxy.kill();

    let proxy = ProxyProc::start(dir.path(), &yaml);
    for (k, body, want) in [
        ("k-durable", r#"{"n":1}"#, &first.body),
        ("k-durable-2", r#"{"n":2}"#, &second.body),
    ] {
        let r = post(
            &c,
            &proxy.url("/mail/send"),
            &[("idempotency-key", k)],
            body,
        )
        .await;
        assert_eq!(
            r.header("idempotent-replayed"),
            Some("true"),
            "{k} replayed after SIGKILL"
        );
        assert_eq!(&r.body, want);
    }
    assert_eq!(ds.commits(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn sigkill_while_downstream_works_never_sends_twice() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ds = FakeDownstream::start().await;
    ds.set_delay(Duration::from_millis(800));
    let yaml = config(dir.path(), &ds.url());
    let proxy = ProxyProc::start(dir.path(), &yaml);
    let c = client();
    let url = proxy.url("/mail/send");
    let inflight = tokio::spawn({
        let (c, url) = (c.clone(), url.clone());
        async move {
            let req = http::Request::post(url)
                .header("idempotency-key", "k-crash")
                .header("content-type", "application/json")
                .body(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")))
                .expect("request");
            c.request(req).await.map(|r| r.status())
        }
    });
    // Wait until the downstream has the request, then crash the proxy.
    wait_for_hit(&ds, "/send").await;
    proxy.kill();
    assert!(
        inflight.await.expect("task").is_err(),
        "the client lost its connection"
    );
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(ds.commits(), 1, "the downstream finished the first attempt");

    let proxy = ProxyProc::start(dir.path(), &yaml);
    for _ in 0..3 {
        let r = post(
            &c,
            &proxy.url("/mail/send"),
            &[("idempotency-key", "k-crash")],
            "{}",
        )
        .await;
        assert_eq!(r.status, StatusCode::CONFLICT, "{r:?}");
        assert_eq!(r.problem_type(), "urn:idemproxy:problem:outcome-unknown");
    }
    assert_eq!(ds.hits_on("/send"), 1, "never sent a second time");
    proxy.terminate();
    let rows = records(&dir.path().join("idemproxy.yaml"));
    assert!(
        rows.iter().any(|r| r.contains("outcome_unknown")),
        "{rows:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn unknown_paths_get_problems() {
    let (_dir, _ds, proxy) = setup().await;
    let c = client();
    let r = send(&c, Method::GET, &proxy.url("/nowhere"), &[], "").await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.problem_type(), "urn:idemproxy:problem:no-route");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_gives_up_does_not_abort_the_execution() {
    let (_dir, ds, proxy) = setup().await;
    ds.set_delay(Duration::from_millis(400));
    let c = client();
    let url = proxy.url("/mail/send");
    let gave_up = tokio::time::timeout(
        Duration::from_millis(100),
        post(
            &c,
            &url,
            &[("idempotency-key", "k-impatient")],
            r#"{"to":"a@x"}"#,
        ),
    )
    .await;
    assert!(gave_up.is_err(), "the client timed out first");
    tokio::time::sleep(Duration::from_millis(700)).await;
    let retry = post(
        &client(),
        &url,
        &[("idempotency-key", "k-impatient")],
        r#"{"to":"a@x"}"#,
    )
    .await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert_eq!(
        retry.header("idempotent-replayed"),
        Some("true"),
        "the proxy finished and stored the call"
    );
    assert_eq!(ds.commits(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn read_only_bodies_are_streamed_not_buffered() {
    use http_body_util::BodyExt;
    let (_dir, _ds, proxy) = setup().await;
    let c = client();
    // 6 chunks, 150 ms apart: a buffering proxy would deliver nothing for ~750 ms.
    let req = http::Request::get(proxy.url("/mail/stream?chunks=6&interval_ms=150"))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .expect("request");
    let started = std::time::Instant::now();
    let resp = c.request(req).await.expect("response");
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let first = body.frame().await.expect("a frame").expect("ok frame");
    assert!(first.is_data());
    let first_at = started.elapsed();
    let mut frames = 1;
    while let Some(f) = body.frame().await {
        f.expect("ok frame");
        frames += 1;
    }
    let total = started.elapsed();
    assert!(frames >= 6, "chunks arrive as separate frames ({frames})");
    assert!(
        first_at * 3 < total,
        "first chunk at {first_at:?} arrived long before the end at {total:?}"
    );
}
