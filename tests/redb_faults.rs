//! redb store faults against the real binary (issue 34): the store file deleted while the
//! proxy runs, an empty or corrupt file at startup, and honest health endpoints.

mod common;

use std::time::{Duration, Instant};

use common::fake_downstream::FakeDownstream;
use common::*;
use http::{Method, StatusCode};

async fn start(dir: &std::path::Path, ds: &FakeDownstream) -> ProxyProc {
    ProxyProc::start_with_env(
        dir,
        &admin_config(dir, &ds.url()),
        &[(ADMIN_TOKEN_ENV, ADMIN_TOKEN)],
    )
}

async fn get(c: &TestClient, url: &str) -> Resp {
    send(c, Method::GET, url, &[], "").await
}

/// Deleting the store file under a running proxy: writes kept "succeeding" into the
/// unlinked file and /healthz said ok; after a restart every call ran again. Now the lost
/// file is noticed (a stat per writer batch and every second): side effects are refused
/// with 503 before anything is sent, /readyz says not ready, and the log says why.
#[tokio::test(flavor = "multi_thread")]
async fn a_store_file_deleted_while_running_stops_side_effects() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ds = FakeDownstream::start().await;
    let proxy = start(dir.path(), &ds).await;
    let c = client();
    let ready = get(&c, &proxy.admin_url("/readyz")).await;
    assert_eq!(ready.status, StatusCode::OK, "{ready:?}");
    let first = post(
        &c,
        &proxy.url("/mail/send"),
        &[("idempotency-key", "k-1")],
        "{}",
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");

    std::fs::remove_file(dir.path().join("store.redb")).expect("delete the store file");
    // The watcher notices within a second even with no traffic.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let r = get(&c, &proxy.admin_url("/readyz")).await;
        if r.status == StatusCode::SERVICE_UNAVAILABLE {
            assert!(
                r.json()["reason"]
                    .as_str()
                    .unwrap_or("")
                    .contains("deleted"),
                "{r:?}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "still ready: {r:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Liveness is not readiness: the process is alive.
    let alive = get(&c, &proxy.admin_url("/healthz")).await;
    assert_eq!(alive.status, StatusCode::OK, "{alive:?}");
    proxy.wait_for_log(
        "was deleted while the proxy was running",
        Duration::from_secs(2),
    );

    for i in 0..5 {
        let r = post(
            &c,
            &proxy.url("/mail/send"),
            &[("idempotency-key", &format!("k-after-{i}"))],
            "{}",
        )
        .await;
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{r:?}");
        assert_eq!(
            r.problem_type(),
            "urn:idemproxy:problem:store-unavailable",
            "{r:?}"
        );
    }
    assert_eq!(ds.commits(), 1, "nothing was sent after the file was lost");
}

/// A file replaced by another one (a restore copied over the path) is the same: the
/// proxy holds a file nobody will open again.
#[tokio::test(flavor = "multi_thread")]
async fn a_store_file_replaced_while_running_stops_side_effects() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ds = FakeDownstream::start().await;
    let proxy = start(dir.path(), &ds).await;
    let c = client();
    let path = dir.path().join("store.redb");
    let copy = dir.path().join("copy.redb");
    std::fs::copy(&path, &copy).expect("copy");
    std::fs::rename(&copy, &path).expect("replace");
    // The writer checks before every batch, so even the very next write is refused.
    let r = post(
        &c,
        &proxy.url("/mail/send"),
        &[("idempotency-key", "k-r")],
        "{}",
    )
    .await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{r:?}");
    assert_eq!(ds.commits(), 0);
    let ready = get(&c, &proxy.admin_url("/readyz")).await;
    assert_eq!(ready.status, StatusCode::SERVICE_UNAVAILABLE, "{ready:?}");
}
