//! Webhook routes end to end (SPEC section 9.1), with the real binary, a real redb file
//! and the fake downstream as the application's receiver, counting what reaches it.
//! Deliveries are signed by the providers' reference libraries (PyPI `standardwebhooks`
//! and `stripe`, through tests/webhook_sign.py in the venv scripts/test.sh prepares).

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

use common::fake_downstream::FakeDownstream;
use common::*;
use http::StatusCode;

const STD_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const STRIPE_SECRET: &str = "whsec_stripe_test_secret_0123456789";
const GH_SECRET: &str = "It's a Secret to Everybody";

fn config(dir: &Path, ds: &str) -> String {
    format!(
        r#"listen: 127.0.0.1:0
admin: {{ listen: 127.0.0.1:0, token_env: {ADMIN_TOKEN_ENV} }}
store: {{ backend: redb, path: {dir}/store.redb, retention: 1h }}
upstreams:
  - name: pay
    url: {ds}
    mount: /pay
    routes:
      - {{ name: charge, match: {{ method: POST, path: /drop-after-commit/send }} }}
      - {{ name: slow_charge, match: {{ method: POST, path: /timeout-after-commit/send }}, timeout: 1s }}
      - {{ name: start_job, match: {{ method: POST, path: /send }}, job: {{ id: /id }} }}
  - name: obs
    url: {ds}
    mount: /obs
    routes:
      - name: start
        match: {{ method: POST, path: /send }}
        job:
          id: /id
          status: {{ method: GET, path: "/jobs/{{job_id}}", state: /status, succeeded: [succeeded, done], failed: [failed] }}
      - {{ name: job_status, match: {{ method: GET, path: "/jobs/{{id}}" }} }}
  - name: polled
    url: {ds}
    mount: /polled
    routes:
      - name: start
        match: {{ method: POST, path: /send }}
        job:
          id: /id
          status: {{ path: "/jobs/{{job_id}}", succeeded: [succeeded], failed: [failed], every: 200ms }}
  - name: std
    url: {ds}
    mount: /std
    routes:
      - name: events
        match: {{ method: POST, path: /send }}
        class: webhook
        webhook:
          event_id: {{ header: webhook-id }}
          verify: {{ scheme: standard_webhooks, secret_env: TEST_STD_SECRET }}
      - name: flaky_events
        match: {{ method: POST, path: /fail-once-before-commit/send }}
        class: webhook
        webhook:
          verify: {{ scheme: standard_webhooks, secret_env: TEST_STD_SECRET, tolerance: 1m }}
  - name: stripe
    url: {ds}
    mount: /stripe
    routes:
      - name: events
        match: {{ method: POST, path: /send }}
        class: webhook
        webhook:
          event_id: {{ json: /id }}
          verify: {{ scheme: stripe, secret_env: TEST_STRIPE_SECRET }}
          correlate:
            - {{ json: /data/object/metadata/execution_id, to: execution_id }}
            - {{ json: /request/idempotency_key, to: execution_id }}
            - {{ json: /data/object/id, to: external_id }}
          outcome:
            status: /type
            succeeded: [payment_intent.succeeded, job.completed]
            failed: [payment_intent.payment_failed, job.failed]
  - name: gh
    url: {ds}
    mount: /gh
    routes:
      - name: events
        match: {{ method: POST, path: /send }}
        class: webhook
        webhook:
          event_id: {{ header: X-GitHub-Delivery }}
          verify: {{ scheme: hmac_sha256, secret_env: TEST_GH_SECRET, header: X-Hub-Signature-256, prefix: "sha256=" }}
"#,
        dir = dir.display()
    )
}

const ENV: [(&str, &str); 4] = [
    (ADMIN_TOKEN_ENV, ADMIN_TOKEN),
    ("TEST_STD_SECRET", STD_SECRET),
    ("TEST_STRIPE_SECRET", STRIPE_SECRET),
    ("TEST_GH_SECRET", GH_SECRET),
];

fn now_s() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64
}

/// Headers signed by the reference library of `scheme` (`standard` or `stripe`).
fn signed(scheme: &str, secret: &str, id: &str, ts: i64, body: &str) -> Vec<(String, String)> {
    let python = std::env::var("IDEMPROXY_TEST_PYTHON").unwrap_or_else(|_| {
        concat!(env!("CARGO_MANIFEST_DIR"), "/target/test-venv/bin/python").to_string()
    });
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/webhook_sign.py");
    let mut child = Command::new(&python)
        .args([script, scheme, secret, id, &ts.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot run {python} ({e}); scripts/test.sh creates the venv with tests/requirements.txt")
        });
    {
        use std::io::Write;
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(body.as_bytes())
            .expect("write body");
    }
    let out = child.wait_with_output().expect("signer runs");
    assert!(
        out.status.success(),
        "signer failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&out.stdout).expect("signer prints JSON");
    map.into_iter()
        .map(|(k, v)| (k, v.as_str().expect("string").to_string()))
        .collect()
}

async fn deliver(c: &TestClient, url: &str, headers: &[(String, String)], body: &str) -> Resp {
    let h: Vec<(&str, &str)> = headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    post(c, url, &h, body).await
}

struct Env {
    dir: tempfile::TempDir,
    ds: FakeDownstream,
}

impl Env {
    async fn new() -> Env {
        Env {
            dir: tempfile::tempdir().expect("tempdir"),
            ds: FakeDownstream::start().await,
        }
    }

    fn start(&self) -> ProxyProc {
        ProxyProc::start_with_env(
            self.dir.path(),
            &config(self.dir.path(), &self.ds.url()),
            &ENV,
        )
    }
}

#[tokio::test]
async fn duplicate_deliveries_reach_the_receiver_once_and_replay() {
    let env = Env::new().await;
    let proxy = env.start();
    let c = client();
    let body = r#"{"type":"invoice.paid","data":{"n":1}}"#;
    let headers = signed("standard", STD_SECRET, "msg_dup_1", now_s(), body);
    let first = deliver(&c, &proxy.url("/std/send"), &headers, body).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(first.header("idempotent-replayed"), None);
    let exec = first
        .header("idempotency-execution-id")
        .expect("execution id")
        .to_string();
    // The receiver saw the delivery's execution_id as its idempotency key, once.
    assert_eq!(env.ds.commits_for(&exec), 1);
    let seen = env.ds.last_headers("/send").expect("receiver headers");
    assert!(seen
        .iter()
        .any(|(k, v)| k == "webhook-id" && v == "msg_dup_1"));
    // Two redeliveries, newly signed (the provider signs each attempt): replayed.
    for _ in 0..2 {
        let again = signed("standard", STD_SECRET, "msg_dup_1", now_s(), body);
        let r = deliver(&c, &proxy.url("/std/send"), &again, body).await;
        assert_eq!(r.status, StatusCode::CREATED);
        assert_eq!(r.header("idempotent-replayed"), Some("true"));
        assert_eq!(r.body, first.body);
    }
    assert_eq!(env.ds.hits_on("/send"), 1);
    assert_eq!(env.ds.commits(), 1);
    // Another event is another delivery.
    let other = signed("standard", STD_SECRET, "msg_dup_2", now_s(), body);
    let r = deliver(&c, &proxy.url("/std/send"), &other, body).await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert_eq!(env.ds.commits(), 2);
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let m = send(
        &c,
        http::Method::GET,
        &proxy.admin_url("/metrics"),
        &[("authorization", &auth)],
        "",
    )
    .await;
    let text = String::from_utf8_lossy(&m.body);
    for line in [
        r#"idemproxy_webhooks_total{upstream="std",route="events",result="forwarded"} 2"#,
        r#"idemproxy_webhooks_total{upstream="std",route="events",result="replayed"} 2"#,
    ] {
        assert!(text.contains(line), "missing {line} in\n{text}");
    }
}

#[tokio::test]
async fn a_concurrent_duplicate_gets_409_and_retry_after() {
    let env = Env::new().await;
    let proxy = env.start();
    let c = client();
    let body = r#"{"type":"invoice.paid"}"#;
    let url = proxy.url("/std/send?delay_ms=800");
    let headers = signed("standard", STD_SECRET, "msg_conc", now_s(), body);
    let first = {
        let (c, url, headers) = (c.clone(), url.clone(), headers.clone());
        tokio::spawn(async move { deliver(&c, &url, &headers, body).await })
    };
    wait_for_hit(&env.ds, "/send").await;
    let dup = deliver(&c, &url, &headers, body).await;
    assert_eq!(dup.status, StatusCode::CONFLICT, "{dup:?}");
    assert_eq!(dup.problem_type(), "urn:idemproxy:problem:in-flight");
    assert!(dup.header("retry-after").is_some());
    let first = first.await.expect("first delivery");
    assert_eq!(first.status, StatusCode::CREATED);
    let late = deliver(&c, &url, &headers, body).await;
    assert_eq!(late.header("idempotent-replayed"), Some("true"));
    assert_eq!(env.ds.hits_on("/send"), 1);
}

#[tokio::test]
async fn bad_or_stale_signatures_are_refused_and_nothing_is_recorded() {
    let env = Env::new().await;
    let proxy = env.start();
    let c = client();
    let url = proxy.url("/std/send");
    let body = r#"{"type":"invoice.paid"}"#;
    let wrong_secret = signed(
        "standard",
        "whsec_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
        "msg_bad",
        now_s(),
        body,
    );
    let stale = signed("standard", STD_SECRET, "msg_bad", now_s() - 600, body);
    let future = signed("standard", STD_SECRET, "msg_bad", now_s() + 600, body);
    let good = signed("standard", STD_SECRET, "msg_bad", now_s(), body);
    let tampered = r#"{"type":"invoice.paid","amount":1}"#;
    let unsigned = vec![("webhook-id".to_string(), "msg_bad".to_string())];
    for (headers, body) in [
        (&wrong_secret, body),
        (&stale, body),
        (&future, body),
        (&good, tampered),
        (&unsigned, body),
    ] {
        let r = deliver(&c, &url, headers, body).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{r:?}");
        assert_eq!(r.problem_type(), "urn:idemproxy:problem:webhook-signature");
    }
    // Stripe's scheme with another secret, and a GitHub-style HMAC with a bad digest.
    let ev = r#"{"id":"evt_bad","type":"x"}"#;
    let stripe_bad = signed("stripe", "whsec_other", "evt_bad", now_s(), ev);
    let r = deliver(&c, &proxy.url("/stripe/send"), &stripe_bad, ev).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let gh_bad = vec![
        ("X-GitHub-Delivery".to_string(), "gh_1".to_string()),
        (
            "X-Hub-Signature-256".to_string(),
            format!("sha256={}", "0".repeat(64)),
        ),
    ];
    let r = deliver(&c, &proxy.url("/gh/send"), &gh_bad, "Hello, World!").await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(env.ds.hits(), 0, "nothing was forwarded");
    proxy.terminate();
    let cfg = env.dir.path().join("idemproxy.yaml");
    assert_eq!(records(&cfg), Vec::<String>::new(), "nothing was recorded");
    // A later valid delivery of the same event is forwarded: the refusals left no trace.
    let proxy = env.start();
    let r = deliver(&c, &proxy.url("/std/send"), &good, body).await;
    assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
    assert_eq!(r.header("idempotent-replayed"), None);
    assert_eq!(env.ds.commits(), 1);
    // GitHub's documented example signature is accepted by the hmac_sha256 scheme.
    let gh = vec![
        ("X-GitHub-Delivery".to_string(), "gh_2".to_string()),
        (
            "X-Hub-Signature-256".to_string(),
            "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17".to_string(),
        ),
    ];
    let r = deliver(&c, &proxy.url("/gh/send"), &gh, "Hello, World!").await;
    assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
}

#[tokio::test]
async fn a_receiver_5xx_is_not_stored_and_the_redelivery_is_forwarded() {
    let env = Env::new().await;
    let proxy = env.start();
    let c = client();
    let url = proxy.url("/std/fail-once-before-commit/send");
    let body = r#"{"type":"invoice.paid"}"#;
    let headers = signed("standard", STD_SECRET, "msg_5xx", now_s(), body);
    let r = deliver(&c, &url, &headers, body).await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR, "{r:?}");
    assert_eq!(env.ds.commits(), 0);
    // The provider retries: forwarded again (the 500 was not stored), then stored.
    let again = signed("standard", STD_SECRET, "msg_5xx", now_s(), body);
    let r = deliver(&c, &url, &again, body).await;
    assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
    assert_eq!(r.header("idempotent-replayed"), None);
    let r = deliver(&c, &url, &again, body).await;
    assert_eq!(r.header("idempotent-replayed"), Some("true"));
    assert_eq!(env.ds.hits_on("/fail-once-before-commit/send"), 2);
    assert_eq!(env.ds.commits(), 1);
}

#[tokio::test]
async fn a_stripe_event_settles_an_unknown_payment_and_its_retry_is_not_resent() {
    let env = Env::new().await;
    let proxy = env.start();
    let c = client();
    let charge = proxy.url("/pay/drop-after-commit/send");
    let key = [("Idempotency-Key", "order-77-charge")];
    let r = post(&c, &charge, &key, r#"{"amount":100}"#).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{r:?}");
    assert_eq!(r.header("idempotency-status"), Some("outcome_unknown"));
    let exec = r
        .header("idempotency-execution-id")
        .expect("execution id")
        .to_string();
    // Without evidence, a retry is not re-sent.
    let r = post(&c, &charge, &key, r#"{"amount":100}"#).await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert_eq!(env.ds.hits_on("/drop-after-commit/send"), 1);
    // Stripe echoes the injected key as request.idempotency_key; the event is delivered
    // twice, signed by stripe-python.
    let event = format!(
        r#"{{"id":"evt_pi_77","object":"event","type":"payment_intent.succeeded","data":{{"object":{{"id":"pi_77","object":"payment_intent","amount":100,"status":"succeeded"}}}},"request":{{"id":"req_1","idempotency_key":"{exec}"}}}}"#
    );
    for _ in 0..2 {
        let headers = signed("stripe", STRIPE_SECRET, "evt_pi_77", now_s(), &event);
        let r = deliver(&c, &proxy.url("/stripe/send"), &headers, &event).await;
        assert!(r.status.is_success(), "{r:?}");
    }
    assert_eq!(
        env.ds.hits_on("/send"),
        1,
        "the receiver saw the event once"
    );
    // The retry of the payment: answered from the evidence, never re-sent.
    let r = post(&c, &charge, &key, r#"{"amount":100}"#).await;
    assert_eq!(r.status, StatusCode::OK, "{r:?}");
    assert_eq!(r.header("idempotency-reconciled"), Some("webhook"));
    assert_eq!(r.header("idempotent-replayed"), Some("true"));
    assert_eq!(r.header("idempotency-webhook-event"), Some("evt_pi_77"));
    assert_eq!(r.json()["id"], "pi_77");
    assert_eq!(env.ds.hits_on("/drop-after-commit/send"), 1);
    proxy.terminate();
    // The record shows the settlement in its history and the event (no body).
    let out = cli(&[
        "records",
        "show",
        &exec,
        "--config",
        env.dir
            .path()
            .join("idemproxy.yaml")
            .to_str()
            .expect("utf-8"),
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("settle_by_webhook"), "{text}");
    assert!(text.contains("evt_pi_77"), "{text}");
    assert!(
        !text.contains("req_1"),
        "the event body is not stored: {text}"
    );
}

#[tokio::test]
async fn an_event_for_a_call_still_executing_is_held_and_settles_it_when_it_times_out() {
    let env = Env::new().await;
    let proxy = env.start();
    let c = client();
    // The downstream commits, then answers after the route's 1s timeout.
    let charge = proxy.url("/pay/timeout-after-commit/send");
    let (call, exec) = call_in_flight(
        &env,
        &c,
        &charge,
        "order-78",
        r#"{"amount":5}"#,
        "/timeout-after-commit/send",
    )
    .await;
    let event = format!(
        r#"{{"id":"evt_pi_78","type":"payment_intent.succeeded","data":{{"object":{{"id":"pi_78","metadata":{{"execution_id":"{exec}"}}}}}}}}"#
    );
    // Delivered while the call is still executing: recorded, forwarded, held.
    let headers = signed("stripe", STRIPE_SECRET, "evt_pi_78", now_s(), &event);
    let early = deliver(&c, &proxy.url("/stripe/send"), &headers, &event).await;
    assert!(early.status.is_success(), "{early:?}");
    assert_eq!(env.ds.hits_on("/send"), 1, "forwarded to the receiver");
    // The call times out: instead of outcome_unknown, the held event settles it, and the
    // caller gets the event's evidence at once.
    let r = call.await.expect("call");
    assert_eq!(r.status, StatusCode::OK, "{r:?}");
    assert_eq!(r.header("idempotency-reconciled"), Some("webhook"));
    assert_eq!(r.header("idempotent-replayed"), None);
    assert_eq!(r.json()["id"], "pi_78");
    // Its retry replays the same answer.
    let r = post(
        &c,
        &charge,
        &[("Idempotency-Key", "order-78")],
        r#"{"amount":5}"#,
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{r:?}");
    assert_eq!(r.header("idempotency-reconciled"), Some("webhook"));
    assert_eq!(r.header("idempotent-replayed"), Some("true"));
    assert_eq!(r.header("idempotency-webhook-event"), Some("evt_pi_78"));
    assert_eq!(r.json()["id"], "pi_78");
    assert_eq!(
        env.ds.hits_on("/timeout-after-commit/send"),
        1,
        "one downstream call in total"
    );
    // A redelivery is replayed, not forwarded again.
    let headers = signed("stripe", STRIPE_SECRET, "evt_pi_78", now_s(), &event);
    let again = deliver(&c, &proxy.url("/stripe/send"), &headers, &event).await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(env.ds.hits_on("/send"), 1);
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let shown = send(
        &c,
        http::Method::GET,
        &proxy.admin_url(&format!("/v1/executions/{exec}")),
        &[("authorization", &auth)],
        "",
    )
    .await;
    let text = String::from_utf8_lossy(&shown.body);
    assert!(
        text.contains("lose_outcome") && text.contains("settle_by_webhook"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn two_postgres_instances_forward_an_event_once_and_settle_across_instances() {
    let schema = Schema::new("hooks");
    let ds = FakeDownstream::start().await;
    let (_dirs, procs) = two_postgres_instances(&schema, &ds);
    let c = client();
    // Ten concurrent deliveries of one event, alternating instances, to a slow receiver.
    let body = r#"{"type":"invoice.paid"}"#;
    let headers = signed("standard", STD_SECRET, "msg_pg_1", now_s(), body);
    let mut tasks = Vec::new();
    for i in 0..10 {
        let (c, url, headers) = (
            c.clone(),
            procs[i % 2].url("/std/send?delay_ms=300"),
            headers.clone(),
        );
        tasks.push(tokio::spawn(async move {
            deliver(&c, &url, &headers, body).await
        }));
    }
    let mut created = 0;
    for t in tasks {
        let r = t.await.expect("delivery");
        match r.status {
            StatusCode::CREATED => created += 1,
            StatusCode::CONFLICT => assert!(r.header("retry-after").is_some()),
            other => panic!("unexpected {other}: {r:?}"),
        }
    }
    assert!(created >= 1);
    assert_eq!(
        ds.hits_on("/send"),
        1,
        "forwarded once across both instances"
    );
    // A payment whose answer was lost on one instance, settled by an event the other
    // received; the retry on the first is answered from the evidence.
    let charge = procs[0].url("/pay/drop-after-commit/send");
    let key = [("Idempotency-Key", "order-pg")];
    let r = post(&c, &charge, &key, "{}").await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{r:?}");
    let exec = r
        .header("idempotency-execution-id")
        .expect("id")
        .to_string();
    let event = format!(
        r#"{{"id":"evt_pg","type":"payment_intent.succeeded","data":{{"object":{{"id":"pi_pg"}}}},"request":{{"idempotency_key":"{exec}"}}}}"#
    );
    let headers = signed("stripe", STRIPE_SECRET, "evt_pg", now_s(), &event);
    let r = deliver(&c, &procs[1].url("/stripe/send"), &headers, &event).await;
    assert!(r.status.is_success(), "{r:?}");
    let r = post(&c, &charge, &key, "{}").await;
    assert_eq!(r.status, StatusCode::OK, "{r:?}");
    assert_eq!(r.header("idempotency-reconciled"), Some("webhook"));
    assert_eq!(ds.hits_on("/drop-after-commit/send"), 1);
    // A job started on one instance, ended by an event the other received that names it
    // only by the job's id (the external-id index of the shared store).
    let started = post(
        &c,
        &procs[0].url("/pay/send"),
        &[("Idempotency-Key", "pg-job")],
        "{}",
    )
    .await;
    assert_eq!(started.status, StatusCode::CREATED, "{started:?}");
    let job_id = started.json()["id"].as_str().expect("job id").to_string();
    let event = format!(
        r#"{{"id":"evt_pg_job","type":"job.failed","data":{{"object":{{"id":"{job_id}","error":"disk full"}}}}}}"#
    );
    let headers = signed("stripe", STRIPE_SECRET, "evt_pg_job", now_s(), &event);
    let r = deliver(&c, &procs[1].url("/stripe/send"), &headers, &event).await;
    assert!(r.status.is_success(), "{r:?}");
    let failed = jobs(&c, &procs[0], "failed").await;
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0]["job"]["result"]["error"], "disk full");
}

async fn jobs(c: &TestClient, proxy: &ProxyProc, state: &str) -> Vec<serde_json::Value> {
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let r = send(
        c,
        http::Method::GET,
        &proxy.admin_url(&format!("/v1/jobs?state={state}")),
        &[("authorization", &auth)],
        "",
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{r:?}");
    assert_eq!(r.json()["complete"], true);
    r.json()["items"].as_array().expect("items").clone()
}

#[tokio::test]
async fn a_job_started_by_a_call_is_completed_by_a_correlated_event() {
    let env = Env::new().await;
    let proxy = env.start();
    let c = client();
    let start = proxy.url("/pay/send");
    let key = [("Idempotency-Key", "report-9")];
    let first = post(&c, &start, &key, r#"{"report":"q3"}"#).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let exec = first
        .header("idempotency-execution-id")
        .expect("id")
        .to_string();
    let job_id = first.json()["id"].as_str().expect("job id").to_string();
    let running = jobs(&c, &proxy, "running").await;
    assert_eq!(running.len(), 1, "{running:?}");
    assert_eq!(running[0]["execution_id"], exec.as_str());
    assert_eq!(running[0]["job"]["id"], job_id.as_str());
    // The job runner's event names the call by the key the proxy injected.
    let event = format!(
        r#"{{"id":"evt_job_9","type":"job.completed","data":{{"object":{{"id":"{job_id}","output":"q3.pdf"}}}},"request":{{"idempotency_key":"{exec}"}}}}"#
    );
    let headers = signed("stripe", STRIPE_SECRET, "evt_job_9", now_s(), &event);
    let r = deliver(&c, &proxy.url("/stripe/send"), &headers, &event).await;
    assert!(r.status.is_success(), "{r:?}");
    assert!(jobs(&c, &proxy, "running").await.is_empty());
    let done = jobs(&c, &proxy, "succeeded").await;
    assert_eq!(done.len(), 1, "{done:?}");
    assert_eq!(done[0]["job"]["result"]["output"], "q3.pdf");
    assert_eq!(done[0]["job"]["event"], "evt_job_9");
    // A late, contradicting event does not reopen or flip the ended job.
    let late = format!(
        r#"{{"id":"evt_job_10","type":"job.failed","data":{{"object":{{"id":"{job_id}"}}}},"request":{{"idempotency_key":"{exec}"}}}}"#
    );
    let headers = signed("stripe", STRIPE_SECRET, "evt_job_10", now_s(), &late);
    let r = deliver(&c, &proxy.url("/stripe/send"), &headers, &late).await;
    assert!(r.status.is_success(), "{r:?}");
    assert_eq!(jobs(&c, &proxy, "succeeded").await.len(), 1);
    assert!(jobs(&c, &proxy, "failed").await.is_empty());
    // A retry of the starting call replays its original answer: no second job.
    let again = post(&c, &start, &key, r#"{"report":"q3"}"#).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, first.body);
    assert_eq!(env.ds.commits_for(&exec), 1);
}

#[tokio::test]
async fn an_event_correlated_by_external_id_ends_the_job_it_names() {
    let env = Env::new().await;
    let proxy = env.start();
    let c = client();
    let first = post(
        &c,
        &proxy.url("/pay/send"),
        &[("Idempotency-Key", "report-11")],
        "{}",
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let job_id = first.json()["id"].as_str().expect("job id").to_string();
    // The event carries no execution id: only the job's id, the record's external id.
    let event = format!(
        r#"{{"id":"evt_job_11","type":"job.completed","data":{{"object":{{"id":"{job_id}","output":"r.csv"}}}}}}"#
    );
    let headers = signed("stripe", STRIPE_SECRET, "evt_job_11", now_s(), &event);
    let r = deliver(&c, &proxy.url("/stripe/send"), &headers, &event).await;
    assert!(r.status.is_success(), "{r:?}");
    let done = jobs(&c, &proxy, "succeeded").await;
    assert_eq!(done.len(), 1, "{done:?}");
    assert_eq!(done[0]["job"]["id"], job_id.as_str());
    assert_eq!(done[0]["job"]["ended_by"], "webhook");
    assert_eq!(done[0]["job"]["result"]["output"], "r.csv");
    // An event naming an external id no call holds is forwarded, uncorrelated.
    let stray = r#"{"id":"evt_stray","type":"job.completed","data":{"object":{"id":"nobody"}}}"#;
    let headers = signed("stripe", STRIPE_SECRET, "evt_stray", now_s(), stray);
    let r = deliver(&c, &proxy.url("/stripe/send"), &headers, stray).await;
    assert!(r.status.is_success(), "{r:?}");
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let m = send(
        &c,
        http::Method::GET,
        &proxy.admin_url("/metrics"),
        &[("authorization", &auth)],
        "",
    )
    .await;
    let text = String::from_utf8_lossy(&m.body);
    for line in [
        r#"idemproxy_webhooks_total{upstream="stripe",route="events",result="correlated"} 1"#,
        r#"idemproxy_webhooks_total{upstream="stripe",route="events",result="uncorrelated"} 1"#,
        r#"idemproxy_jobs_total{upstream="pay",route="start_job",state="running"} 1"#,
        r#"idemproxy_jobs_total{upstream="pay",route="start_job",state="succeeded"} 1"#,
    ] {
        assert!(text.contains(line), "missing {line} in\n{text}");
    }
}

/// The job of `exec` as `GET /v1/executions/{exec}` shows it.
async fn job_of(c: &TestClient, proxy: &ProxyProc, exec: &str) -> serde_json::Value {
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let r = send(
        c,
        http::Method::GET,
        &proxy.admin_url(&format!("/v1/executions/{exec}")),
        &[("authorization", &auth)],
        "",
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{r:?}");
    r.json()["job"].clone()
}

async fn metrics_text(c: &TestClient, proxy: &ProxyProc) -> String {
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let m = send(
        c,
        http::Method::GET,
        &proxy.admin_url("/metrics"),
        &[("authorization", &auth)],
        "",
    )
    .await;
    String::from_utf8_lossy(&m.body).into_owned()
}

#[tokio::test]
async fn a_job_is_completed_by_the_agents_own_status_poll_observed_on_its_way_back() {
    let env = Env::new().await;
    let proxy = env.start();
    let c = client();
    let start = proxy.url("/obs/send");
    let key = [("Idempotency-Key", "export-1")];
    let first = post(&c, &start, &key, r#"{"export":"all"}"#).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let exec = first
        .header("idempotency-execution-id")
        .expect("id")
        .to_string();
    let job_id = first.json()["id"].as_str().expect("job id").to_string();
    let status_url = proxy.url(&format!("/obs/jobs/{job_id}"));
    // The first poll says running: passed through, the job stays running.
    let r = get(&c, &status_url).await;
    assert_eq!(r.status, StatusCode::OK, "{r:?}");
    assert_eq!(r.json()["status"], "running");
    assert_eq!(job_of(&c, &proxy, &exec).await["state"], "running");
    // Another route's GET that is no status poll passes through untouched.
    let r = get(&c, &proxy.url("/obs/messages/none")).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    // The second says succeeded: the agent gets the upstream's answer unchanged, and the
    // job ends with it as its result.
    let r = get(&c, &status_url).await;
    assert_eq!(r.status, StatusCode::OK, "{r:?}");
    assert_eq!(r.json()["status"], "succeeded");
    assert_eq!(r.json()["output"], format!("{job_id}.csv"));
    let job = job_of(&c, &proxy, &exec).await;
    assert_eq!(job["state"], "succeeded", "{job}");
    assert_eq!(job["ended_by"], "observed_poll");
    assert_eq!(job["result"]["output"], format!("{job_id}.csv"));
    assert_eq!(
        env.ds.hits_on(&format!("/jobs/{job_id}")),
        2,
        "observed, never re-sent"
    );
    // A retry of the starting call replays the 202-style answer: no second job.
    let again = post(&c, &start, &key, r#"{"export":"all"}"#).await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, first.body);
    assert_eq!(env.ds.commits_for(&exec), 1);
    let text = metrics_text(&c, &proxy).await;
    for line in [
        r#"idemproxy_jobs_total{upstream="obs",route="start",state="running"} 1"#,
        r#"idemproxy_jobs_total{upstream="obs",route="start",state="succeeded"} 1"#,
    ] {
        assert!(text.contains(line), "missing {line} in\n{text}");
    }
}

#[tokio::test]
async fn a_job_is_completed_by_the_proxys_own_polling() {
    let env = Env::new().await;
    let proxy = env.start();
    let c = client();
    let start = proxy.url("/polled/send");
    let key = [("Idempotency-Key", "export-2")];
    let first = post(&c, &start, &key, "{}").await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let exec = first
        .header("idempotency-execution-id")
        .expect("id")
        .to_string();
    let job_id = first.json()["id"].as_str().expect("job id").to_string();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let job = loop {
        let job = job_of(&c, &proxy, &exec).await;
        if job["state"] != "running" {
            break job;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the job was never polled to its end"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert_eq!(job["state"], "succeeded", "{job}");
    assert_eq!(job["ended_by"], "poll");
    assert_eq!(job["result"]["output"], format!("{job_id}.csv"));
    let status_path = format!("/jobs/{job_id}");
    assert_eq!(env.ds.hits_on(&status_path), 2, "running, then succeeded");
    // An ended job is not polled again; the start call was never re-sent.
    tokio::time::sleep(std::time::Duration::from_millis(700)).await;
    assert_eq!(env.ds.hits_on(&status_path), 2);
    assert_eq!(env.ds.hits_on("/send"), 1);
    let again = post(&c, &start, &key, "{}").await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, first.body);
    assert_eq!(env.ds.hits_on("/send"), 1);
    assert!(jobs(&c, &proxy, "running").await.is_empty());
}

async fn get(c: &TestClient, url: &str) -> Resp {
    send(c, http::Method::GET, url, &[], "").await
}

#[tokio::test(flavor = "multi_thread")]
async fn two_postgres_instances_poll_one_job_and_end_it_once() {
    let schema = Schema::new("jobs");
    let ds = FakeDownstream::start().await;
    let (_dirs, procs) = two_postgres_instances(&schema, &ds);
    let c = client();
    let first = post(
        &c,
        &procs[0].url("/polled/send"),
        &[("Idempotency-Key", "pg-export")],
        "{}",
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let exec = first
        .header("idempotency-execution-id")
        .expect("id")
        .to_string();
    let job_id = first.json()["id"].as_str().expect("job id").to_string();
    // Both instances poll the job (the first answer is running, every later one
    // succeeded); it ends once, whichever instance's write lands first.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let job = job_of(&c, &procs[1], &exec).await;
        if job["state"] == "succeeded" {
            assert_eq!(job["ended_by"], "poll");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never ended: {job}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // Let both instances run a few more ticks: nothing polls an ended job, and the job's
    // end was counted once across the two.
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    let polls = ds.hits_on(&format!("/jobs/{job_id}"));
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    assert_eq!(
        ds.hits_on(&format!("/jobs/{job_id}")),
        polls,
        "an ended job is not polled"
    );
    let ended: u64 = {
        let mut n = 0;
        for p in &procs {
            let text = metrics_text(&c, p).await;
            let line =
                r#"idemproxy_jobs_total{upstream="polled",route="start",state="succeeded"} "#;
            n += text
                .lines()
                .find_map(|l| l.strip_prefix(line))
                .map_or(0, |v| v.trim().parse::<u64>().expect("count"));
        }
        n
    };
    assert_eq!(
        ended, 1,
        "one instance ended the job, the other found it ended"
    );
    assert_eq!(ds.hits_on("/send"), 1);
    let running = jobs(&c, &procs[0], "running").await;
    assert!(running.is_empty(), "{running:?}");
}

#[tokio::test]
async fn a_held_event_settles_a_call_whose_instance_died_while_it_executed() {
    let env = Env::new().await;
    let proxy = env.start();
    let c = client();
    // The downstream takes 3 s; the proxy is killed while the call executes.
    let (call, exec) = call_in_flight(
        &env,
        &c,
        &proxy.url("/pay/drop-after-commit/send?delay_ms=3000"),
        "order-79",
        r#"{"amount":9}"#,
        "/drop-after-commit/send",
    )
    .await;
    let event = format!(
        r#"{{"id":"evt_pi_79","type":"payment_intent.succeeded","data":{{"object":{{"id":"pi_79"}}}},"request":{{"idempotency_key":"{exec}"}}}}"#
    );
    let headers = signed("stripe", STRIPE_SECRET, "evt_pi_79", now_s(), &event);
    let r = deliver(&c, &proxy.url("/stripe/send"), &headers, &event).await;
    assert!(r.status.is_success(), "{r:?}");
    proxy.kill();
    let _ = call.await;
    // The restarted instance finds the call executing under a dead owner: instead of
    // outcome_unknown, the held event settles it; the retry is never re-sent.
    let proxy = env.start();
    let r = post(
        &c,
        &proxy.url("/pay/drop-after-commit/send?delay_ms=3000"),
        &[("Idempotency-Key", "order-79")],
        r#"{"amount":9}"#,
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{r:?}");
    assert_eq!(r.header("idempotency-reconciled"), Some("webhook"));
    assert_eq!(r.json()["id"], "pi_79");
    assert_eq!(env.ds.hits_on("/drop-after-commit/send"), 1);
}

/// Start a side-effect call in the background and wait until the downstream has it: the
/// call's task and the key the proxy injected (its execution id).
async fn call_in_flight(
    env: &Env,
    c: &TestClient,
    url: &str,
    key: &'static str,
    body: &'static str,
    hit: &str,
) -> (tokio::task::JoinHandle<Resp>, String) {
    let call = {
        let (c, url) = (c.clone(), url.to_string());
        tokio::spawn(async move { post(&c, &url, &[("Idempotency-Key", key)], body).await })
    };
    wait_for_hit(&env.ds, hit).await;
    let exec = env
        .ds
        .last_headers(hit)
        .and_then(|h| h.into_iter().find(|(k, _)| k == "idempotency-key"))
        .map(|(_, v)| v)
        .expect("the injected key");
    (call, exec)
}

/// Two proxy instances on the test config, sharing `schema` of the PostgreSQL server.
fn two_postgres_instances(
    schema: &Schema,
    ds: &FakeDownstream,
) -> (Vec<tempfile::TempDir>, Vec<ProxyProc>) {
    let dirs: Vec<_> = (0..2)
        .map(|_| tempfile::tempdir().expect("tempdir"))
        .collect();
    let procs = dirs
        .iter()
        .map(|d| {
            let yaml = config(d.path(), &ds.url()).replace(
                &format!(
                    "store: {{ backend: redb, path: {}/store.redb, retention: 1h }}",
                    d.path().display()
                ),
                &format!(
                    "store: {{ backend: postgres, url_env: IDEMPROXY_TEST_POSTGRES_URL, schema: {}, retention: 1h }}",
                    schema.name
                ),
            );
            assert!(yaml.contains("backend: postgres"));
            ProxyProc::start_with_env(d.path(), &yaml, &ENV)
        })
        .collect();
    (dirs, procs)
}
