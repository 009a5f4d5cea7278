//! Unknown outcomes end to end (SPEC sections 6–7), with the real binary, a real redb file
//! and the fake downstream counting side effects: failure classification, reconcile
//! before replay (re-send to a replaying downstream, lookup found / not found / settle /
//! proves nothing), the background reconciler after a SIGKILL, executor retries of
//! connect failures only, and `idemproxy resolve` against a stopped proxy's store.

mod common;

use std::io::{Read, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use common::fake_downstream::FakeDownstream;
use common::*;
use http::StatusCode;

const LOOKUP: &str = r#"reconcile: { path: "/messages?tag={execution_id}", settle: 300ms, found: { status: 200, json_nonempty: /data }, not_found: { status: 200, json_empty: /data } }"#;

/// `ds`: the fake downstream; `late`: an upstream port nobody listens on yet; `tls`: a
/// port whose server answers a TLS handshake with plain HTTP.
fn config(dir: &Path, ds: &str, late: u16, tls: u16, reconcile_every: &str) -> String {
    format!(
        r#"listen: 127.0.0.1:0
store: {{ backend: redb, path: {dir}/store.redb, retention: 1h, reconcile_interval: {reconcile_every} }}
upstreams:
  - name: mail
    url: {ds}
    mount: /mail
    routes:
      - {{ name: keyed_drop, match: {{ method: POST, path: /keyed/drop-after-commit/send }}, downstream_key: {{ header: Idempotency-Key, replays: true }}, fingerprint: {{ ignore_json: [/client_ts] }} }}
      - {{ name: keyed_slow, match: {{ method: POST, path: /keyed/send }}, downstream_key: {{ header: Idempotency-Key, replays: true }}, timeout: 200ms }}
      - {{ name: drop_lookup, match: {{ method: POST, path: /drop-after-commit/send }}, {LOOKUP} }}
      - {{ name: fail_once, match: {{ method: POST, path: /fail-once-before-commit/send }}, {LOOKUP} }}
      - {{ name: plain, match: {{ method: POST, path: /send }}, {LOOKUP} }}
      - {{ name: truncate, match: {{ method: POST, path: /truncate-after-commit/send }}, retry: {{ attempts: 3, backoff_ms: 10 }} }}
      - name: bad_lookup
        match: {{ method: POST, path: /fail-after-commit/send }}
        reconcile: {{ path: "/nowhere/{{key}}", found: {{ status: 200, json_nonempty: /data }}, not_found: {{ status: 200, json_empty: /data }} }}
  - name: late
    url: http://127.0.0.1:{late}
    mount: /late
    routes:
      - {{ name: send, match: {{ method: POST, path: /send }}, retry: {{ attempts: 6, backoff_ms: 100 }} }}
  - name: tls
    url: https://127.0.0.1:{tls}
    mount: /tls
    routes:
      - {{ name: send, match: {{ method: POST, path: /send }} }}
"#,
        dir = dir.display()
    )
}

/// A TCP server that answers anything (a TLS ClientHello included) with plain HTTP.
fn not_tls_server() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for mut s in l.incoming().map_while(Result::ok) {
            let mut buf = [0u8; 512];
            let _ = s.read(&mut buf);
            let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n");
        }
    });
    port
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

struct Env {
    dir: tempfile::TempDir,
    ds: FakeDownstream,
    late: u16,
    yaml: String,
}

impl Env {
    async fn new(reconcile_every: &str) -> Env {
        let dir = tempfile::tempdir().expect("tempdir");
        let ds = FakeDownstream::start().await;
        let late = free_port();
        let yaml = config(
            dir.path(),
            &ds.url(),
            late,
            not_tls_server(),
            reconcile_every,
        );
        Env {
            dir,
            ds,
            late,
            yaml,
        }
    }

    fn start(&self) -> ProxyProc {
        ProxyProc::start(self.dir.path(), &self.yaml)
    }

    fn config_path(&self) -> String {
        self.dir
            .path()
            .join("idemproxy.yaml")
            .to_str()
            .expect("utf-8")
            .to_string()
    }

    fn show(&self, id: &str) -> serde_json::Value {
        let out = cli(&["records", "show", id, "--config", &self.config_path()]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("records show prints JSON")
    }
}

/// A request whose proxy is about to be killed: the error is expected, not a panic.
async fn post_doomed(c: TestClient, url: String, key: &'static str, body: &'static str) {
    let req = http::Request::post(url)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from_static(
            body.as_bytes(),
        )))
        .expect("request");
    let _ = c.request(req).await;
}

fn exec_id(r: &Resp) -> String {
    r.header("idempotency-execution-id")
        .expect("execution id on every side-effect answer")
        .to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_truncated_answer_is_outcome_unknown_and_not_retried_inside() {
    let env = Env::new("1h").await;
    let proxy = env.start();
    let c = client();
    let url = proxy.url("/mail/truncate-after-commit/send");
    let r = post(&c, &url, &[("idempotency-key", "k-trunc")], "{}").await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{r:?}");
    assert_eq!(r.problem_type(), "urn:idemproxy:problem:outcome-unknown");
    assert_eq!(r.header("idempotency-status"), Some("outcome_unknown"));
    // `retry` on a side effect covers connect failures only: nothing was re-sent.
    assert_eq!(env.ds.hits_on("/truncate-after-commit/send"), 1);
    let again = post(&c, &url, &[("idempotency-key", "k-trunc")], "{}").await;
    assert_eq!(again.status, StatusCode::CONFLICT);
    assert_eq!(
        again.problem_type(),
        "urn:idemproxy:problem:outcome-unknown"
    );
    assert_eq!(
        again.header("retry-after"),
        None,
        "no way to find out: waiting will not help"
    );
    assert_eq!(env.ds.commits(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tls_handshake_failure_is_failed_before_commit() {
    let env = Env::new("1h").await;
    let proxy = env.start();
    let r = post(
        &client(),
        &proxy.url("/tls/send"),
        &[("idempotency-key", "k-tls")],
        "{}",
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{r:?}");
    assert_eq!(
        r.problem_type(),
        "urn:idemproxy:problem:upstream-unavailable"
    );
    assert_eq!(r.header("idempotency-status"), Some("failed_before_commit"));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replaying_downstream_is_asked_again_with_the_original_bytes() {
    let env = Env::new("1h").await;
    let proxy = env.start();
    let c = client();
    let url = proxy.url("/mail/keyed/drop-after-commit/send");
    let key = [("idempotency-key", "k-resend")];
    let first = post(&c, &url, &key, r#"{"to":"a@x","client_ts":1}"#).await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY, "{first:?}");
    assert_eq!(first.header("idempotency-status"), Some("outcome_unknown"));
    let sent_first = env
        .ds
        .last_request("/keyed/drop-after-commit/send")
        .expect("sent");
    // The agent's retry differs in an ignored field: same execution, and the downstream
    // (which rejects a reused key with a changed body) must see the original bytes.
    let retry = post(&c, &url, &key, r#"{"client_ts":2,"to":"a@x"}"#).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    let msgs = env.ds.messages();
    assert_eq!(msgs.len(), 1, "one side effect");
    assert_eq!(retry.json(), msgs[0].to_json(), "the original result");
    assert_eq!(
        retry.header("idempotent-replayed"),
        Some("true"),
        "replayed by the downstream"
    );
    let resent = env
        .ds
        .last_request("/keyed/drop-after-commit/send")
        .expect("re-sent");
    assert_eq!(resent.body, sent_first.body, "byte-identical re-send");
    assert_eq!(
        resent.header_values("idempotency-key"),
        vec![exec_id(&first)],
        "the same injected key"
    );
    // From now on the proxy answers from its own record.
    let third = post(&c, &url, &key, r#"{"to":"a@x","client_ts":3}"#).await;
    assert_eq!(third.body, retry.body);
    assert_eq!(env.ds.hits_on("/keyed/drop-after-commit/send"), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_resend_while_the_original_is_still_working_stays_unknown() {
    let env = Env::new("1h").await;
    env.ds.set_delay(Duration::from_millis(700));
    let proxy = env.start();
    let c = client();
    let url = proxy.url("/mail/keyed/send");
    let key = [("idempotency-key", "k-slow")];
    let first = post(&c, &url, &key, "{}").await;
    assert_eq!(first.status, StatusCode::GATEWAY_TIMEOUT, "{first:?}");
    let busy = post(&c, &url, &key, "{}").await;
    assert_eq!(busy.status, StatusCode::CONFLICT, "{busy:?}");
    assert_eq!(busy.problem_type(), "urn:idemproxy:problem:outcome-unknown");
    assert_eq!(busy.header("retry-after"), Some("1"));
    tokio::time::sleep(Duration::from_millis(800)).await;
    let done = post(&c, &url, &key, "{}").await;
    assert_eq!(done.status, StatusCode::CREATED, "{done:?}");
    assert_eq!(env.ds.commits(), 1);
    assert_eq!(done.json(), env.ds.messages()[0].to_json());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lookup_that_finds_the_effect_commits_what_it_found() {
    let env = Env::new("1h").await;
    let proxy = env.start();
    let c = client();
    let url = proxy.url("/mail/drop-after-commit/send");
    let key = [
        ("idempotency-key", "k-found"),
        ("authorization", "Bearer t"),
    ];
    let first = post(&c, &url, &key, r#"{"to":"f@x"}"#).await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY);
    let retry = post(&c, &url, &key, r#"{"to":"f@x"}"#).await;
    assert_eq!(retry.status, StatusCode::OK, "{retry:?}");
    assert_eq!(retry.header("idempotency-reconciled"), Some("lookup"));
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    let msg = env.ds.messages().pop().expect("committed once");
    assert_eq!(retry.json(), msg.to_json(), "the found item is the result");
    let lookup = env.ds.last_request("/messages").expect("looked up");
    assert_eq!(
        lookup.query.as_deref(),
        Some(format!("tag={}", exec_id(&first)).as_str())
    );
    assert_eq!(
        lookup.header_values("authorization"),
        vec!["Bearer t"],
        "client credentials"
    );
    assert!(lookup.header_values("idempotency-key").is_empty());
    let again = post(&c, &url, &key, r#"{"to":"f@x"}"#).await;
    assert_eq!(again.body, retry.body);
    assert_eq!(env.ds.hits_on("/messages"), 1, "looked up once");
    assert_eq!(env.ds.commits(), 1);
    proxy.terminate();
    let rec = env.show(&exec_id(&first));
    assert_eq!(rec["external_id"], msg.id.as_str());
    assert!(
        matches!(
            rec["state"].as_str(),
            Some("committed" | "result_delivered")
        ),
        "{rec}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn not_found_waits_for_the_settle_window_then_executes_under_the_same_key() {
    let env = Env::new("1h").await;
    let proxy = env.start();
    let c = client();
    let url = proxy.url("/mail/fail-once-before-commit/send");
    let key = [("idempotency-key", "k-notfound")];
    let first = post(&c, &url, &key, "{}").await;
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(first.header("idempotency-status"), Some("outcome_unknown"));
    let early = post(&c, &url, &key, "{}").await;
    assert_eq!(early.status, StatusCode::CONFLICT, "{early:?}");
    assert_eq!(early.header("retry-after"), Some("1"));
    assert_eq!(
        env.ds.hits_on("/fail-once-before-commit/send"),
        1,
        "not re-sent early"
    );
    tokio::time::sleep(Duration::from_millis(350)).await;
    let done = post(&c, &url, &key, "{}").await;
    assert_eq!(done.status, StatusCode::CREATED, "{done:?}");
    assert_eq!(done.header("idempotent-replayed"), None);
    let sent = env
        .ds
        .last_request("/fail-once-before-commit/send")
        .expect("sent");
    assert_eq!(sent.header_values("idempotency-key"), vec![exec_id(&first)]);
    assert_eq!(env.ds.commits(), 1);
    assert_eq!(env.ds.hits_on("/messages"), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lookup_that_proves_nothing_leaves_the_record_unknown() {
    let env = Env::new("1h").await;
    let proxy = env.start();
    let c = client();
    let url = proxy.url("/mail/fail-after-commit/send");
    let key = [("idempotency-key", "k-bad-lookup")];
    let first = post(&c, &url, &key, "{}").await;
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    for _ in 0..2 {
        let r = post(&c, &url, &key, "{}").await;
        assert_eq!(r.status, StatusCode::CONFLICT, "{r:?}");
        assert_eq!(r.problem_type(), "urn:idemproxy:problem:outcome-unknown");
        assert!(r.json()["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("matches neither"));
        assert_eq!(r.header("retry-after"), Some("5"));
    }
    assert_eq!(env.ds.hits_on("/fail-after-commit/send"), 1);
    assert_eq!(env.ds.commits(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn connect_failures_are_retried_under_the_same_execution() {
    let env = Env::new("1h").await;
    let proxy = env.start();
    let c = client();
    let url = proxy.url("/late/send");
    let pending = tokio::spawn(async move {
        post(&c, &url, &[("idempotency-key", "k-late")], r#"{"n":1}"#).await
    });
    // The downstream comes up while the proxy is between connect attempts.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let late = FakeDownstream::start_on(([127, 0, 0, 1], env.late).into())
        .await
        .expect("the reserved port is free again");
    let r = pending.await.expect("task");
    assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
    assert_eq!(late.commits(), 1);
    proxy.terminate();
    let rec = env.show(&exec_id(&r));
    assert_eq!(rec["attempts"], 1, "one execution, however many connects");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_background_reconciler_resolves_what_a_crash_left_unknown() {
    let env = Env::new("100ms").await;
    env.ds.set_delay(Duration::from_millis(400));
    let proxy = env.start();
    let c = client();
    let url = proxy.url("/mail/send");
    let inflight = tokio::spawn(post_doomed(c.clone(), url, "k-bg", r#"{"to":"b@x"}"#));
    let deadline = Instant::now() + Duration::from_secs(5);
    while env.ds.hits_on("/send") == 0 {
        assert!(Instant::now() < deadline, "never reached the downstream");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    proxy.kill();
    let _ = inflight.await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(env.ds.commits(), 1, "the downstream finished anyway");

    // No client retries: the restarted proxy finds out by itself.
    let proxy = env.start();
    proxy.wait_for_log("reconciled in the background", Duration::from_secs(10));
    proxy.terminate();
    let msg = env.ds.messages().pop().expect("one message");
    let rows = records(Path::new(&env.config_path()));
    assert_eq!(rows.len(), 1, "{rows:?}");
    let id = rows[0]
        .split_whitespace()
        .next()
        .expect("id column")
        .to_string();
    let rec = env.show(&id);
    assert_eq!(rec["state"], "committed", "{rec}");
    assert_eq!(rec["external_id"], msg.id.as_str());

    let proxy = env.start();
    let r = post(
        &c,
        &proxy.url("/mail/send"),
        &[("idempotency-key", "k-bg")],
        r#"{"to":"b@x"}"#,
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{r:?}");
    assert_eq!(r.json(), msg.to_json());
    assert_eq!(env.ds.hits_on("/send"), 1, "never sent twice");
}

#[tokio::test(flavor = "multi_thread")]
async fn resolve_on_a_stopped_proxys_store_is_checked_by_the_state_machine() {
    let env = Env::new("1h").await;
    let c = client();
    let proxy = env.start();
    let url = proxy.url("/mail/truncate-after-commit/send");
    let a = post(&c, &url, &[("idempotency-key", "k-op-a")], "{}").await;
    let b = post(&c, &url, &[("idempotency-key", "k-op-b")], "{}").await;
    assert_eq!(
        (a.status, b.status),
        (StatusCode::BAD_GATEWAY, StatusCode::BAD_GATEWAY)
    );
    // A third one is left `executing` by a crash mid-request.
    env.ds.set_delay(Duration::from_millis(300));
    let crashed = tokio::spawn(post_doomed(c.clone(), url.clone(), "k-op-c", "{}"));
    let deadline = Instant::now() + Duration::from_secs(5);
    while env.ds.hits_on("/truncate-after-commit/send") < 3 {
        assert!(Instant::now() < deadline, "third request never arrived");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    proxy.kill();
    let _ = crashed.await;
    env.ds.set_delay(Duration::ZERO);

    let cfg = env.config_path();
    let result = env.dir.path().join("result.json");
    std::fs::write(
        &result,
        r#"{"status":201,"body":{"id":"msg_by_operator","ok":true}}"#,
    )
    .expect("write result");
    let rows = records(Path::new(&cfg));
    let id_of = |wanted: &str| {
        rows.iter()
            .find(|r| r.contains(wanted))
            .and_then(|r| r.split_whitespace().next())
            .map(str::to_string)
    };
    assert!(id_of("executing").is_some(), "{rows:?}");
    let c_id = id_of("executing").expect("executing record");
    let run = |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend(["--config", cfg.as_str()]);
        cli(&all)
    };
    // committed with the operator's result
    let out = run(&[
        "resolve",
        &exec_id(&a),
        "--as",
        "committed",
        "--result",
        result.to_str().expect("utf-8"),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("is now committed"));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("1 execution(s) left executing"),
        "the CLI recovers stale records first, as `serve` would"
    );
    // resolving twice is an illegal transition, not an overwrite
    let again = run(&["resolve", &exec_id(&a), "--as", "not-committed"]);
    assert_eq!(again.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("illegal transition"),
        "{again:?}"
    );
    // not committed: the next retry may execute
    let out = run(&["resolve", &exec_id(&b), "--as", "not-committed"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // the crashed one, now `outcome_unknown`, resolves with the default result
    let out = run(&["resolve", &c_id, "--as", "committed"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let missing = run(&["resolve", "ex_nope", "--as", "committed"]);
    assert_eq!(missing.status.code(), Some(1));
    let rec = env.show(&exec_id(&a));
    assert!(
        rec["note"]
            .as_str()
            .unwrap_or_default()
            .contains("resolved by cli:"),
        "{rec}"
    );

    let proxy = env.start();
    let url = proxy.url("/mail/truncate-after-commit/send");
    let ra = post(&c, &url, &[("idempotency-key", "k-op-a")], "{}").await;
    assert_eq!(ra.status, StatusCode::CREATED);
    assert_eq!(ra.header("idempotent-replayed"), Some("true"));
    assert_eq!(ra.json()["id"], "msg_by_operator");
    let before = env.ds.hits_on("/truncate-after-commit/send");
    let rb = post(&c, &url, &[("idempotency-key", "k-op-b")], "{}").await;
    assert_eq!(rb.status, StatusCode::BAD_GATEWAY, "executed again: {rb:?}");
    assert_eq!(env.ds.hits_on("/truncate-after-commit/send"), before + 1);
    let rc = post(&c, &url, &[("idempotency-key", "k-op-c")], "{}").await;
    assert_eq!(rc.status, StatusCode::OK, "default operator result: {rc:?}");
    assert_eq!(rc.json()["resolved"], "committed");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cancelled_operation_gets_no_re_send_and_a_found_effect_marks_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ds = FakeDownstream::start().await;
    let yaml = format!(
        r#"listen: 127.0.0.1:0
admin: {{ listen: 127.0.0.1:0, token_env: {ADMIN_TOKEN_ENV} }}
store: {{ backend: redb, path: {dir}/store.redb, retention: 1h, reconcile_interval: 1h }}
identity: {{ derive_from: [X-Operation-Id, X-Tool-Call-Id] }}
upstreams:
  - name: mail
    url: {ds}
    mount: /mail
    routes:
      - {{ name: keyed_drop, match: {{ method: POST, path: /keyed/drop-after-commit/send }}, downstream_key: {{ header: Idempotency-Key, replays: true }} }}
      - {{ name: drop_lookup, match: {{ method: POST, path: /drop-after-commit/send }}, {LOOKUP} }}
"#,
        dir = dir.path().display(),
        ds = ds.url()
    );
    let proxy = ProxyProc::start_with_env(dir.path(), &yaml, &[(ADMIN_TOKEN_ENV, ADMIN_TOKEN)]);
    let c = client();
    let call = |id: &'static str| [("x-operation-id", "op_c"), ("x-tool-call-id", id)];
    let resend_url = proxy.url("/mail/keyed/drop-after-commit/send");
    let lookup_url = proxy.url("/mail/drop-after-commit/send");
    let a = post(&c, &resend_url, &call("call_a"), "{}").await;
    let b = post(&c, &lookup_url, &call("call_b"), "{}").await;
    assert_eq!(a.header("idempotency-status"), Some("outcome_unknown"));
    assert_eq!(b.header("idempotency-status"), Some("outcome_unknown"));
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let cancel = post(
        &c,
        &proxy.admin_url("/v1/operations/op_c/cancel"),
        &[("authorization", &auth)],
        r#"{"by":"erin"}"#,
    )
    .await;
    assert_eq!(cancel.status, StatusCode::OK, "{cancel:?}");
    assert_eq!(cancel.json()["state"], "cancelled");

    // A re-send could create the effect now: refused, left to an operator.
    let ra = post(&c, &resend_url, &call("call_a"), "{}").await;
    assert_eq!(ra.status, StatusCode::CONFLICT, "{ra:?}");
    assert_eq!(ra.problem_type(), "urn:idemproxy:problem:outcome-unknown");
    assert_eq!(ra.header("retry-after"), None);
    assert!(ra.json()["detail"]
        .as_str()
        .unwrap_or_default()
        .contains("cancelled"));
    assert_eq!(ds.hits_on("/keyed/drop-after-commit/send"), 1);
    // A lookup only reads: it finds the effect, so the operation was cancelled after one.
    let rb = post(&c, &lookup_url, &call("call_b"), "{}").await;
    assert_eq!(rb.status, StatusCode::OK, "{rb:?}");
    let op = send(
        &c,
        http::Method::GET,
        &proxy.admin_url("/v1/operations/op_c"),
        &[("authorization", &auth)],
        "",
    )
    .await;
    assert_eq!(op.json()["state"], "cancelled_after_side_effect", "{op:?}");
    assert_eq!(ds.commits(), 2);
}
