//! `limits.max_calls_in_flight` under a flood of slow executions (issue 34, item 7): a
//! replay of a stored result never queues behind executions, and a slow route's queue
//! never delays another route's calls.

mod common;

use std::time::{Duration, Instant};

use common::fake_downstream::FakeDownstream;
use common::*;
use http::StatusCode;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replays_and_other_routes_do_not_queue_behind_slow_executions() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ds = FakeDownstream::start().await;
    let yaml = config(dir.path(), &ds.url()).replace(
        "max_key_bytes: 64 }",
        "max_key_bytes: 64, max_calls_in_flight: 4 }",
    );
    assert!(yaml.contains("max_calls_in_flight: 4"), "{yaml}");
    let proxy = ProxyProc::start(dir.path(), &yaml);
    let c = client();
    let send = proxy.url("/mail/send");
    let first = post(&c, &send, &[("idempotency-key", "k-replay")], "{}").await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");

    // 200 slow executions (3 s each) on the same route: 4 run, 196 wait for a turn.
    let slow_url = proxy.url("/mail/send?delay_ms=3000");
    let mut slow = Vec::new();
    for i in 0..200 {
        let (c, url) = (c.clone(), slow_url.clone());
        slow.push(tokio::spawn(async move {
            post(
                &c,
                &url,
                &[("idempotency-key", &format!("k-slow-{i}"))],
                "{}",
            )
            .await
        }));
    }
    wait_for_hit(&ds, "/send").await;
    tokio::time::sleep(Duration::from_millis(300)).await;

    // The retry's answer is stored (not yet in memory: an answer is cached on its first
    // replay from the store), so it takes the store path, and still needs no turn.
    let started = Instant::now();
    let replay = tokio::time::timeout(
        Duration::from_secs(10),
        post(&c, &send, &[("idempotency-key", "k-replay")], "{}"),
    )
    .await
    .expect("the replay waited behind the executions");
    let replay_took = started.elapsed();
    assert_eq!(
        replay.header("idempotent-replayed"),
        Some("true"),
        "{replay:?}"
    );
    assert_eq!(replay.body, first.body);

    // Another route has turns of its own.
    let started = Instant::now();
    let other = tokio::time::timeout(
        Duration::from_secs(10),
        post(
            &c,
            &proxy.url("/mail/keyed/send"),
            &[("idempotency-key", "k-other")],
            "{}",
        ),
    )
    .await
    .expect("a call to another route waited behind the slow route's executions");
    let other_took = started.elapsed();
    assert_eq!(other.status, StatusCode::CREATED, "{other:?}");
    eprintln!(
        "with 196 slow executions queued: replay {replay_took:?}, other route {other_took:?}"
    );
    report_fault(
        "200 slow (3 s) executions queued on one route (4 turns)",
        0,
        0,
        None,
        &format!(
            "a replay answered in {} ms, another route's call in {} ms",
            replay_took.as_millis(),
            other_took.as_millis()
        ),
    );
    assert!(replay_took < Duration::from_secs(1), "{replay_took:?}");
    assert!(other_took < Duration::from_secs(1), "{other_took:?}");
    for t in slow {
        t.abort();
    }
}
