//! Many proxy instances on one PostgreSQL store (SPEC section 10, issue 5): the same
//! guarantees as one instance. Uses the real server at `IDEMPROXY_TEST_POSTGRES_URL` and
//! a schema of its own per test; fails loudly when the server is unreachable.

mod common;

use std::time::Duration;

use common::fake_downstream::FakeDownstream;
use common::*;
use http::StatusCode;

fn pg_config(schema: &Schema, downstream: &str, lease: &str) -> String {
    pg_config_with(schema, downstream, lease, true)
}

/// `reconcile: false` leaves unknown outcomes to the operator (no lookup on the route).
fn pg_config_with(schema: &Schema, downstream: &str, lease: &str, reconcile: bool) -> String {
    let yaml = format!(
        r#"listen: 127.0.0.1:0
store: {{ backend: postgres, url_env: {URL_VAR}, schema: {schema}, lease: {lease}, retention: 1h }}
upstreams:
  - name: mail
    url: {downstream}
    mount: /mail
    routes:
      - name: send_email
        match: {{ method: POST, path: /send }}
        reconcile: {{ path: "/messages?tag={{execution_id}}", found: {{ status: 200, json_nonempty: /data }}, not_found: {{ status: 200, json_empty: /data }} }}
      - {{ name: send_wait, match: {{ method: POST, path: /keyed/send }}, concurrent: wait }}
"#,
        schema = schema.name
    );
    if reconcile {
        yaml
    } else {
        yaml.lines()
            .filter(|l| !l.contains("reconcile:"))
            .collect::<Vec<_>>()
            .join("\n")
            + "\n"
    }
}

fn start_instances(n: usize, yaml: &str) -> (Vec<tempfile::TempDir>, Vec<ProxyProc>) {
    let dirs: Vec<_> = (0..n)
        .map(|_| tempfile::tempdir().expect("tempdir"))
        .collect();
    let procs = dirs
        .iter()
        .map(|d| ProxyProc::start(d.path(), yaml))
        .collect();
    (dirs, procs)
}

#[tokio::test(flavor = "multi_thread")]
async fn fifty_duplicates_across_three_instances_commit_once() {
    let schema = Schema::new("dup");
    let ds = FakeDownstream::start().await;
    ds.set_delay(Duration::from_millis(300));
    let (_dirs, procs) = start_instances(3, &pg_config(&schema, &ds.url(), "5s"));
    let c = client();
    let mut tasks = Vec::new();
    for i in 0..50 {
        let url = procs[i % 3].url("/mail/send");
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            post(
                &c,
                &url,
                &[("idempotency-key", "k-shared")],
                r#"{"to":"a@x"}"#,
            )
            .await
        }));
    }
    let (mut created, mut in_flight) = (0, 0);
    for t in tasks {
        let r = t.await.expect("task");
        match r.status {
            StatusCode::CREATED => created += 1,
            StatusCode::CONFLICT => {
                assert_eq!(r.problem_type(), "urn:idemproxy:problem:in-flight");
                in_flight += 1;
            }
            other => panic!("unexpected {other}: {r:?}"),
        }
    }
    assert_eq!(created + in_flight, 50);
    assert_eq!(
        ds.commits(),
        1,
        "one downstream commit across three instances"
    );
    // Every instance now replays the one stored result.
    let mut bodies = Vec::new();
    for p in &procs {
        let r = post(
            &c,
            &p.url("/mail/send"),
            &[("idempotency-key", "k-shared")],
            r#"{"to":"a@x"}"#,
        )
        .await;
        assert_eq!(r.header("idempotent-replayed"), Some("true"));
        bodies.push(r.body);
    }
    assert!(bodies.windows(2).all(|w| w[0] == w[1]));
    assert_eq!(ds.commits(), 1);
    // The offline commands work against the shared store while the instances run.
    let cfg = procs[0].config_path.clone();
    let rows = records(&cfg);
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert!(rows[0].contains("mail/send_email"), "{rows:?}");
    let gc = cli(&["gc", "--config", cfg.to_str().expect("utf-8")]);
    assert!(
        gc.status.success(),
        "{}",
        String::from_utf8_lossy(&gc.stderr)
    );
    assert!(String::from_utf8_lossy(&gc.stdout).contains("removed 0 records"));
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_wait_across_instances_replays_the_winner() {
    let schema = Schema::new("wait");
    let ds = FakeDownstream::start().await;
    ds.set_delay(Duration::from_millis(300));
    let (_dirs, procs) = start_instances(3, &pg_config(&schema, &ds.url(), "5s"));
    let c = client();
    let mut tasks = Vec::new();
    for i in 0..15 {
        let url = procs[i % 3].url("/mail/keyed/send");
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            post(
                &c,
                &url,
                &[("idempotency-key", "k-wait")],
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
    assert!(bodies.windows(2).all(|w| w[0] == w[1]));
    assert_eq!(ds.commits(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_instance_killed_mid_execution_is_taken_over_without_a_second_commit() {
    let schema = Schema::new("kill");
    let ds = FakeDownstream::start().await;
    ds.set_delay(Duration::from_millis(600));
    let (_dirs, mut procs) = start_instances(2, &pg_config(&schema, &ds.url(), "1s"));
    let c = client();
    let victim_url = procs[0].url("/mail/send");
    let inflight = tokio::spawn({
        let c = c.clone();
        async move {
            tokio::time::timeout(
                Duration::from_secs(5),
                post(&c, &victim_url, &[("idempotency-key", "k-kill")], "{}"),
            )
            .await
        }
    });
    wait_for_hit(&ds, "/send").await;
    procs.remove(0).kill();
    let _ = inflight.await;
    // While the dead owner's lease runs, the survivor answers in-flight, never re-sends.
    let survivor = &procs[0];
    let early = post(
        &c,
        &survivor.url("/mail/send"),
        &[("idempotency-key", "k-kill")],
        "{}",
    )
    .await;
    // Under load the 1 s lease may already have run out, in which case the survivor has
    // taken over and answers with the reconciled result; it never sends again either way.
    assert!(
        early.status == StatusCode::CONFLICT || early.header("idempotent-replayed") == Some("true"),
        "{early:?}"
    );
    assert_eq!(
        ds.hits_on("/send"),
        1,
        "no second send while the lease runs"
    );
    // After the lease expires the survivor takes the record over as outcome_unknown and
    // reconciles it by lookup: the message is found, so its result is stored and replayed.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let late = post(
        &c,
        &survivor.url("/mail/send"),
        &[("idempotency-key", "k-kill")],
        "{}",
    )
    .await;
    assert!(late.status.is_success(), "{late:?}");
    assert_eq!(late.header("idempotent-replayed"), Some("true"));
    let found = late.json();
    let committed = ds.messages();
    assert_eq!(
        found["id"].as_str(),
        Some(committed[0].id.as_str()),
        "the found message is the one committed"
    );
    assert_eq!(ds.hits_on("/send"), 1, "no second send");
    assert_eq!(ds.commits(), 1);
}

/// Fencing: an instance paused (SIGSTOP) past its lease, whose record another instance
/// took over and decided, must not commit over that decision when it resumes.
#[tokio::test(flavor = "multi_thread")]
async fn a_paused_instance_cannot_commit_over_another_instances_decision() {
    let schema = Schema::new("fence");
    let ds = FakeDownstream::start().await;
    ds.set_delay(Duration::from_millis(1500));
    let yaml = pg_config_with(&schema, &ds.url(), "1s", false);
    let (dirs, procs) = start_instances(2, &yaml);
    let (a, b) = (&procs[0], &procs[1]);
    let c = client();
    let a_url = a.url("/mail/send");
    let a_call = tokio::spawn({
        let c = c.clone();
        async move { post(&c, &a_url, &[("idempotency-key", "k-fence")], "{}").await }
    });
    wait_for_hit(&ds, "/send").await;
    a.signal("STOP");
    // A's lease (1 s) expires while it is frozen; B's lease keeper marks the record.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let r = post(
        &c,
        &b.url("/mail/send"),
        &[("idempotency-key", "k-fence")],
        "{}",
    )
    .await;
    assert_eq!(r.problem_type(), "urn:idemproxy:problem:outcome-unknown");
    let id = r
        .header("idempotency-execution-id")
        .expect("id")
        .to_string();
    // An operator decides it was not committed; B executes it again under the same key.
    let cfg = dirs[1].path().join("idemproxy.yaml");
    let out = cli(&[
        "resolve",
        &id,
        "--as",
        "not-committed",
        "--config",
        cfg.to_str().expect("utf-8"),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    ds.set_delay(Duration::ZERO);
    let b_result = post(
        &c,
        &b.url("/mail/send"),
        &[("idempotency-key", "k-fence")],
        "{}",
    )
    .await;
    assert_eq!(b_result.status, StatusCode::CREATED, "{b_result:?}");
    // A wakes up, gets its (late) downstream answer and must be fenced off.
    a.signal("CONT");
    let a_result = a_call.await.expect("task");
    // A's own late answer (the first message) is never stored nor served: A answers with
    // the record as decided (B's result, replayed) instead.
    let first_id = ds
        .messages()
        .first()
        .map(|m| m.id.clone())
        .expect("A's send committed downstream");
    assert!(
        !String::from_utf8_lossy(&a_result.body).contains(&format!("\"{first_id}\"")),
        "{a_result:?}"
    );
    assert_eq!(a_result.body, b_result.body);
    assert_eq!(a_result.header("idempotent-replayed"), Some("true"));
    for p in &procs {
        let r = post(
            &c,
            &p.url("/mail/send"),
            &[("idempotency-key", "k-fence")],
            "{}",
        )
        .await;
        assert_eq!(r.header("idempotent-replayed"), Some("true"));
        assert_eq!(
            r.body, b_result.body,
            "the stored result is B's decision, not A's late answer"
        );
    }
}
