//! The operator console in a real browser: Debian's headless Chromium, driven by
//! `tests/browser/console.mjs` (playwright-core, no bundled browser). An operator signs in,
//! sees the pending call with its preview, approves it by clicking, and the agent's retry
//! then executes exactly once. This test fails, never skips, when Chromium, node or the
//! browser driver cannot be had: install them with `apt-get install -y chromium nodejs npm`
//! (the driver comes from `tests/browser/package-lock.json` through `npm ci`).
//!
//! `IDEMPROXY_UPDATE_SCREENSHOT=1` writes the console's picture to `docs/console.png`.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::fake_downstream::FakeDownstream;
use common::*;
use http::StatusCode;
use serde_json::json;

const CHROMIUM: &str = "/usr/bin/chromium";
const TENANT: (&str, &str) = ("authorization", "Bearer tenant-console");

fn browser_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser")
}

/// The browser driver from the lockfile; installed with `npm ci` when missing.
fn ensure_driver() {
    let dir = browser_dir();
    if dir
        .join("node_modules/playwright-core/package.json")
        .exists()
    {
        return;
    }
    let out = Command::new("npm")
        .args(["ci", "--no-audit", "--no-fund"])
        .current_dir(&dir)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run npm ({e}): install node and npm (apt-get install -y nodejs npm)")
        });
    assert!(
        out.status.success(),
        "npm ci in {} failed:\n{}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn approving_in_the_console_lets_the_retry_execute_once() {
    assert!(
        Path::new(CHROMIUM).exists(),
        "{CHROMIUM} is missing: the console test needs Debian's chromium (apt-get install -y chromium)"
    );
    ensure_driver();

    let dir = tempfile::tempdir().expect("tempdir");
    let ds = FakeDownstream::start().await;
    // Plus a route whose calls start background jobs, their status observed.
    let yaml = format!(
        "{}  - name: reports\n    url: {}\n    mount: /reports\n    routes:\n      - name: export\n        match: {{ method: POST, path: /send }}\n        job: {{ id: /id, status: {{ path: \"/jobs/{{job_id}}\", succeeded: [succeeded], failed: [failed] }} }}\n      - name: send_many\n        match: {{ method: POST, path: /batch }}\n        batch: {{ items: /messages, mode: independent, item_key: /to, each: {{ path: /send }} }}\n",
        admin_config(dir.path(), &ds.url()),
        ds.url()
    );
    let proxy = ProxyProc::start_with_env(dir.path(), &yaml, &[(ADMIN_TOKEN_ENV, ADMIN_TOKEN)]);
    let c = client();

    // What an operator would find: two held payments, one unknown outcome, some traffic.
    let transfer = json!({ "to": "acct_A-1042", "amount": 50, "currency": "EUR" }).to_string();
    let pay_url = proxy.url("/pay/send");
    let op = ("x-operation-id", "op_console");
    let held = post(
        &c,
        &pay_url,
        &[TENANT, ("idempotency-key", "k-console"), op],
        &transfer,
    )
    .await;
    assert_eq!(held.status, StatusCode::PRECONDITION_REQUIRED, "{held:?}");
    let id = held.json()["execution_id"]
        .as_str()
        .expect("id")
        .to_string();
    let other = json!({ "to": "acct_Z-7", "amount": 1200, "currency": "EUR" }).to_string();
    let r = post(
        &c,
        &pay_url,
        &[TENANT, ("idempotency-key", "k-console-2"), op],
        &other,
    )
    .await;
    assert_eq!(r.status, StatusCode::PRECONDITION_REQUIRED);
    let r = post(
        &c,
        &proxy.url("/mail/drop-after-commit/send"),
        &[TENANT, ("idempotency-key", "k-lost")],
        r#"{"to":"ops@example.com"}"#,
    )
    .await;
    assert_eq!(r.header("idempotency-status"), Some("outcome_unknown"));
    let mut mail_id = String::new();
    for _ in 0..2 {
        let r = post(
            &c,
            &proxy.url("/mail/send"),
            &[TENANT, ("idempotency-key", "k-mail"), op],
            r#"{"to":"a@example.com"}"#,
        )
        .await;
        assert_eq!(r.status, StatusCode::CREATED);
        mail_id = r
            .header("idempotency-execution-id")
            .expect("id")
            .to_string();
    }
    assert_eq!(ds.commits_for(&id), 0);
    // A job, ended by the agent's second status poll (observed through the proxy).
    let started = post(
        &c,
        &proxy.url("/reports/send"),
        &[TENANT, ("idempotency-key", "k-job")],
        "{}",
    )
    .await;
    assert_eq!(started.status, StatusCode::CREATED, "{started:?}");
    let job_exec = started
        .header("idempotency-execution-id")
        .expect("id")
        .to_string();
    let job_id = started.json()["id"].as_str().expect("job id").to_string();
    for _ in 0..2 {
        let r = send(
            &c,
            http::Method::GET,
            &proxy.url(&format!("/reports/jobs/{job_id}")),
            &[TENANT],
            "",
        )
        .await;
        assert_eq!(r.status, StatusCode::OK, "{r:?}");
    }

    // A batch of two items, for its record page (docs/BATCHES.md).
    let batch = post(
        &c,
        &proxy.url("/reports/batch"),
        &[TENANT, ("idempotency-key", "k-batch")],
        r#"{"messages":[{"to":"a@example.com"},{"to":"b@example.com"}]}"#,
    )
    .await;
    assert_eq!(batch.status, StatusCode::OK, "{batch:?}");
    let batch_id = batch
        .header("idempotency-execution-id")
        .expect("id")
        .to_string();

    let screenshot = if std::env::var_os("IDEMPROXY_UPDATE_SCREENSHOT").is_some() {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/console.png")
    } else {
        Path::new(env!("CARGO_TARGET_TMPDIR")).join("console.png")
    };
    let run = tokio::process::Command::new("node")
        .arg("console.mjs")
        .current_dir(browser_dir())
        .env("ADMIN_URL", proxy.admin_url(""))
        .env("ADMIN_TOKEN", ADMIN_TOKEN)
        .env("EXECUTION_ID", &id)
        .env("EXPECT_PREVIEW", "acct_A-1042")
        .env("OPERATION_ID", "op_console")
        .env("ANSWERED_ID", &mail_id)
        .env("JOB_EXECUTION_ID", &job_exec)
        .env("JOB_ID", &job_id)
        .env("BATCH_ID", &batch_id)
        .env("CHROMIUM", CHROMIUM)
        .env("SCREENSHOT", &screenshot)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the browser test finished within 120 s")
        .expect("node runs (apt-get install -y nodejs)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "console test failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("console test passed"), "{stdout}");
    assert!(
        screenshot.exists(),
        "screenshot written to {}",
        screenshot.display()
    );

    // The agent retries: the approved call runs once, later retries replay it.
    let ran = post(
        &c,
        &pay_url,
        &[TENANT, ("idempotency-key", "k-console")],
        &transfer,
    )
    .await;
    assert_eq!(ran.status, StatusCode::CREATED, "{ran:?}");
    assert_eq!(ran.header("idempotent-replayed"), None);
    let again = post(
        &c,
        &pay_url,
        &[TENANT, ("idempotency-key", "k-console")],
        &transfer,
    )
    .await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        ds.commits_for(&id),
        1,
        "exactly one side effect for the approved call"
    );
    // The other held payment was not touched by approving this one.
    let still = post(
        &c,
        &pay_url,
        &[TENANT, ("idempotency-key", "k-console-2")],
        &other,
    )
    .await;
    assert_eq!(still.status, StatusCode::PRECONDITION_REQUIRED);
}
