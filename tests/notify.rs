//! Approvals reach people (issue 38, SPEC section 10): `admin.notify` posts a signed
//! Standard Webhooks message when a call starts waiting for approval or becomes unknown,
//! retries until the receiver takes it, and a restart does not lose it. Signatures are
//! checked with the reference library (PyPI `standardwebhooks`, tests/notify_verify.py).

mod common;

use std::io::Write;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::fake_downstream::FakeDownstream;
use common::*;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use parking_lot::Mutex;
use serde_json::{json, Value};

const SECRET: &str = "whsec_bm90aWZ5LXNlY3JldC0wMTIzNDU2Nzg5YWJjZA==";
const TENANT: (&str, &str) = ("authorization", "Bearer tenant-a");

/// One request the receiver got: its headers and body.
type Received = (Vec<(String, String)>, String);

/// What the receiver saw, and how many requests it still refuses with 503.
#[derive(Default)]
struct Inbox {
    messages: Mutex<Vec<Received>>,
    refuse: AtomicUsize,
}

impl Inbox {
    fn ids(&self) -> Vec<String> {
        self.messages
            .lock()
            .iter()
            .filter_map(|(h, _)| {
                h.iter()
                    .find(|(k, _)| k == "webhook-id")
                    .map(|(_, v)| v.clone())
            })
            .collect()
    }
}

/// A receiver on its own runtime thread: records every POST, answers 503 while `refuse`
/// is above zero, else 204.
fn receiver(inbox: Arc<Inbox>) -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    listener.set_nonblocking(true).expect("nonblocking");
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let inbox = inbox.clone();
                tokio::spawn(async move {
                    let service =
                        hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                            let inbox = inbox.clone();
                            async move {
                                let headers = req
                                    .headers()
                                    .iter()
                                    .map(|(k, v)| {
                                        (k.to_string(), v.to_str().unwrap_or("").to_string())
                                    })
                                    .collect();
                                let body = req
                                    .into_body()
                                    .collect()
                                    .await
                                    .map(|b| b.to_bytes())
                                    .unwrap_or_default();
                                inbox
                                    .messages
                                    .lock()
                                    .push((headers, String::from_utf8_lossy(&body).into_owned()));
                                let refused = inbox
                                    .refuse
                                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                                        n.checked_sub(1)
                                    })
                                    .is_ok();
                                let status = if refused {
                                    StatusCode::SERVICE_UNAVAILABLE
                                } else {
                                    StatusCode::NO_CONTENT
                                };
                                let mut resp = Response::new(Full::new(Bytes::new()));
                                *resp.status_mut() = status;
                                Ok::<_, std::convert::Infallible>(resp)
                            }
                        });
                    let io = hyper_util::rt::TokioIo::new(stream);
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(io, service)
                        .await;
                });
            }
        });
    });
    addr
}

fn notify_config(dir: &std::path::Path, downstream: &str, receiver: SocketAddr) -> String {
    admin_config(dir, downstream).replace(
        &format!("admin: {{ listen: 127.0.0.1:0, token_env: {ADMIN_TOKEN_ENV} }}"),
        &format!(
            "admin:\n  listen: 127.0.0.1:0\n  token_env: {ADMIN_TOKEN_ENV}\n  notify: {{ url: \"http://{receiver}/hooks/idemproxy\", secret_env: T_NOTIFY, timeout: 2s }}"
        ),
    )
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(
            Instant::now() < deadline,
            "{what} did not happen within 20 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Every message verifies with the reference library under the configured secret.
fn verify_all(inbox: &Inbox) {
    let python = std::env::var("IDEMPROXY_TEST_PYTHON").unwrap_or_else(|_| {
        concat!(env!("CARGO_MANIFEST_DIR"), "/target/test-venv/bin/python").to_string()
    });
    let messages: Vec<Value> = inbox
        .messages
        .lock()
        .iter()
        .map(|(h, b)| {
            let headers: serde_json::Map<String, Value> = h
                .iter()
                .map(|(k, v)| (k.clone(), Value::String(v.clone())))
                .collect();
            json!({ "headers": headers, "body": b })
        })
        .collect();
    let mut child = Command::new(&python)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/notify_verify.py"
        ))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {python} ({e}); scripts/test.sh creates the venv"));
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(
            json!({ "secret": SECRET, "messages": messages })
                .to_string()
                .as_bytes(),
        )
        .expect("write");
    let out = child.wait_with_output().expect("verify");
    assert!(
        out.status.success(),
        "signatures did not verify:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn waiting_calls_are_announced_signed_retried_and_survive_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ds = FakeDownstream::start().await;
    let inbox = Arc::new(Inbox::default());
    inbox.refuse.store(1, Ordering::SeqCst);
    let addr = receiver(inbox.clone());
    let yaml = notify_config(dir.path(), &ds.url(), addr);
    let env = [(ADMIN_TOKEN_ENV, ADMIN_TOKEN), ("T_NOTIFY", SECRET)];
    let proxy = ProxyProc::start_with_env(dir.path(), &yaml, &env);
    let c = client();

    // A payment that needs approval, and an email whose outcome is lost.
    let held = post(
        &c,
        &proxy.url("/pay/send"),
        &[
            TENANT,
            ("idempotency-key", "k-n1"),
            ("x-operation-id", "op_n"),
        ],
        r#"{"to":"acct_B","amount":700}"#,
    )
    .await;
    assert_eq!(held.status, StatusCode::PRECONDITION_REQUIRED, "{held:?}");
    let held_id = held.json()["execution_id"]
        .as_str()
        .expect("id")
        .to_string();
    let lost = post(
        &c,
        &proxy.url("/mail/drop-after-commit/send"),
        &[TENANT, ("idempotency-key", "k-n2")],
        r#"{"to":"ops@example.com"}"#,
    )
    .await;
    assert_eq!(lost.header("idempotency-status"), Some("outcome_unknown"));
    let lost_id = lost
        .header("idempotency-execution-id")
        .expect("id")
        .to_string();

    // Both announced; the first try was refused (503) and retried, so three posts, two ids.
    wait_until("two deliveries", || {
        let ids = inbox.ids();
        ids.iter()
            .any(|i| i.contains(&held_id) && i.starts_with("msg_approval_required_"))
            && ids
                .iter()
                .any(|i| i.contains(&lost_id) && i.starts_with("msg_outcome_unknown_"))
            && inbox.messages.lock().len() >= 3
    });
    let bodies: Vec<Value> = inbox
        .messages
        .lock()
        .iter()
        .map(|(_, b)| serde_json::from_str(b).expect("JSON"))
        .collect();
    let approval = bodies
        .iter()
        .find(|b| b["type"] == "approval_required")
        .expect("approval message");
    assert_eq!(approval["data"]["execution_id"], held_id.as_str());
    assert_eq!(approval["data"]["operation_id"], "op_n");
    assert_eq!(approval["data"]["preview"]["/amount"], 700, "{approval}");
    assert!(approval["data"]["args_hash"].is_string());
    verify_all(&inbox);

    // Durable: a message the receiver would not take is posted again after a SIGKILL.
    inbox.refuse.store(usize::MAX, Ordering::SeqCst);
    let held2 = post(
        &c,
        &proxy.url("/pay/send"),
        &[TENANT, ("idempotency-key", "k-n3")],
        r#"{"to":"acct_C","amount":9}"#,
    )
    .await;
    let held2_id = held2.json()["execution_id"]
        .as_str()
        .expect("id")
        .to_string();
    wait_until("a refused try", || {
        inbox.ids().iter().any(|i| i.contains(&held2_id))
    });
    proxy.kill();
    inbox.refuse.store(0, Ordering::SeqCst);
    let before = inbox.messages.lock().len();
    let proxy = ProxyProc::start_with_env(dir.path(), &yaml, &env);
    wait_until("the message posted again after the restart", || {
        inbox.messages.lock()[before..].iter().any(|(h, _)| {
            h.iter()
                .any(|(k, v)| k == "webhook-id" && v.contains(&held2_id))
        })
    });
    // Same webhook-id before and after: a receiver deduplicates on it.
    let ids = inbox.ids();
    let for_held2: std::collections::HashSet<&String> =
        ids.iter().filter(|i| i.contains(&held2_id)).collect();
    assert_eq!(for_held2.len(), 1, "{ids:?}");
    verify_all(&inbox);
    drop(proxy);
}

#[test]
fn an_unset_or_malformed_notify_secret_is_a_config_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let yaml = notify_config(
        dir.path(),
        "http://127.0.0.1:1",
        "127.0.0.1:1".parse().expect("addr"),
    );
    let config = dir.path().join("idemproxy.yaml");
    std::fs::write(&config, yaml).expect("write");
    for value in [None, Some("not-a-whsec-secret")] {
        let mut cmd = Command::new(BIN);
        cmd.args(["serve", "--config"])
            .arg(&config)
            .env(ADMIN_TOKEN_ENV, ADMIN_TOKEN);
        match value {
            None => cmd.env_remove("T_NOTIFY"),
            Some(v) => cmd.env("T_NOTIFY", v),
        };
        let out = cmd.output().expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains("T_NOTIFY"), "{err}");
    }
}
