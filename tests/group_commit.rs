//! Group commit keeps the durability contract (issue 6): many concurrent first executions
//! share commits, the proxy is SIGKILLed while they are in flight, and every request that
//! got an answer has a durable record. After a restart each answered key replays its
//! original body without reaching the downstream again.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::fake_downstream::FakeDownstream;
use common::*;
use http::StatusCode;

const REQUESTS: usize = 400;
/// Kill once this many answers are in: well before the last request is answered.
const KILL_AFTER: usize = 120;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_answered_first_execution_is_durable_after_sigkill() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ds = FakeDownstream::start().await;
    // A little downstream latency keeps many executions in flight at once, so their
    // `executing` and `committed` writes queue up behind each other's commits.
    ds.set_delay(Duration::from_millis(5));
    let config = config(dir.path(), &ds.url());
    // JSON logs: the writer's debug line `"writes":N` tells how many writes a commit held.
    let proxy = ProxyProc::start_with_env(dir.path(), &config, &[("IDEMPROXY_LOG_FORMAT", "json")]);
    let url = proxy.url("/mail/send");

    let answered = Arc::new(parking_lot::Mutex::new(HashMap::new()));
    let count = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for i in 0..REQUESTS {
        let (url, answered, count) = (url.clone(), answered.clone(), count.clone());
        tasks.push(tokio::spawn(async move {
            // One connection per request: a killed proxy fails each one on its own.
            let c = client();
            let key = format!("gc-{i}");
            let body = format!(r#"{{"to":"u{i}@x","subject":"s{i}"}}"#);
            let req = post_raw(&c, &url, &key, &body);
            if let Ok(Ok(resp)) = tokio::time::timeout(Duration::from_secs(20), req).await {
                if resp.status == StatusCode::CREATED {
                    answered.lock().insert(key, (body, resp));
                    count.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }
    while count.load(Ordering::SeqCst) < KILL_AFTER {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let log = proxy.stderr_handle();
    proxy.kill();
    let batched = log
        .lock()
        .expect("stderr lock")
        .iter()
        .filter_map(|l| l.split("\"writes\":").nth(1))
        .filter_map(|w| {
            let digits: String = w.chars().take_while(char::is_ascii_digit).collect();
            digits.parse::<usize>().ok()
        })
        .max()
        .unwrap_or(0);
    for t in tasks {
        let _ = t.await;
    }
    let answered = std::mem::take(&mut *answered.lock());
    assert!(
        answered.len() >= KILL_AFTER && answered.len() < REQUESTS,
        "the kill must land mid-run: {} of {REQUESTS} answered",
        answered.len()
    );
    eprintln!(
        "{} of {REQUESTS} answered before SIGKILL; the largest commit held {batched} writes",
        answered.len()
    );
    assert!(
        batched > 1,
        "concurrent writes must have shared a commit (largest batch {batched})"
    );

    // Offline: every answered execution id is stored with its result.
    let cfg_path = dir.path().join("idemproxy.yaml");
    let listed: HashMap<String, String> = records_all(&cfg_path);
    for (key, (_, resp)) in &answered {
        let id = resp
            .header("idempotency-execution-id")
            .expect("answers carry the execution id");
        let state = listed
            .get(id)
            .unwrap_or_else(|| panic!("answered {key} ({id}) has no record after SIGKILL"));
        assert!(
            state == "committed" || state == "result_delivered",
            "answered {key} ({id}) is {state} after SIGKILL"
        );
    }

    // Online: each answered key replays the answer it got, with no new downstream commit.
    let commits_before = ds.commits();
    let proxy = ProxyProc::start(dir.path(), &config);
    let url = proxy.url("/mail/send");
    let c = client();
    for (key, (body, first)) in &answered {
        let again = post_raw(&c, &url, key, body).await.expect("proxy answers");
        assert_eq!(again.status, StatusCode::CREATED, "{key}: {again:?}");
        assert_eq!(again.header("idempotent-replayed"), Some("true"), "{key}");
        assert_eq!(again.body, first.body, "{key} replays its original body");
    }
    assert_eq!(
        ds.commits(),
        commits_before,
        "replays of answered keys reached the downstream"
    );
    for (_, first) in answered.values() {
        let id = first.header("idempotency-execution-id").expect("id");
        assert_eq!(ds.commits_for(id), 1, "{id} committed downstream once");
    }
}

/// A POST that reports a dropped connection instead of panicking (the kill drops many).
async fn post_raw(
    c: &TestClient,
    url: &str,
    key: &str,
    body: &str,
) -> Result<Resp, hyper_util::client::legacy::Error> {
    use http_body_util::BodyExt;
    let req = http::Request::post(url)
        .header("content-type", "application/json")
        .header("authorization", "Bearer tenant-gc")
        .header("idempotency-key", key)
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .expect("request builds");
    let resp = c.request(req).await?;
    let (parts, b) = resp.into_parts();
    let body = match b.collect().await {
        Ok(b) => b.to_bytes(),
        // Headers arrived but the body did not: not an answer the client could use.
        Err(_) => {
            return Ok(Resp {
                status: StatusCode::BAD_GATEWAY,
                headers: parts.headers,
                body: Default::default(),
            })
        }
    };
    Ok(Resp {
        status: parts.status,
        headers: parts.headers,
        body,
    })
}

/// `idemproxy records list` over the whole store: execution id → state.
fn records_all(config: &std::path::Path) -> HashMap<String, String> {
    records_limit(config, 100_000)
        .iter()
        .filter_map(|l| {
            let mut cols = l.split_whitespace();
            Some((cols.next()?.to_string(), cols.next()?.to_string()))
        })
        .collect()
}
