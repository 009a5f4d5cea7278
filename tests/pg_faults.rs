//! PostgreSQL faults against the real binary (issue 34): instances whose wall clocks
//! disagree with the database's, and a database that goes away while a call's result is
//! being written. Uses the real server at `IDEMPROXY_TEST_POSTGRES_URL` with a schema of its
//! own per test, never stopping it: an outage is a TCP forwarder (here, in the test) between
//! the proxy and PostgreSQL that is cut and restored. The skewed instances run under
//! libfaketime (Debian package `faketime`, installed by scripts/test.sh).

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::fake_downstream::FakeDownstream;
use common::*;
use http::StatusCode;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

fn yaml(schema: &str, url_env: &str, downstream: &str, lease: &str) -> String {
    format!(
        r#"listen: 127.0.0.1:0
store: {{ backend: postgres, url_env: {url_env}, schema: {schema}, lease: {lease}, retention: 1h }}
upstreams:
  - name: mail
    url: {downstream}
    mount: /mail
    routes:
      - name: send_email
        match: {{ method: POST, path: /send }}
        reconcile: {{ path: "/messages?tag={{execution_id}}", found: {{ status: 200, json_nonempty: /data }}, not_found: {{ status: 200, json_empty: /data }} }}
"#
    )
}

/// Where the test database listens (host and port of `IDEMPROXY_TEST_POSTGRES_URL`).
fn pg_addr(url: &str) -> SocketAddr {
    let base: tokio_postgres::Config = url.parse().expect("test URL parses");
    let port = base.get_ports().first().copied().unwrap_or(5432);
    let host = match base.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        _ => "127.0.0.1".to_string(),
    };
    let host = if host == "localhost" {
        "127.0.0.1".to_string()
    } else {
        host
    };
    format!("{host}:{port}").parse().expect("host:port")
}

/// libfaketime's preload library (Debian's `libfaketime`, pulled in by `faketime`).
fn libfaketime() -> String {
    for dir in [
        "/usr/lib/x86_64-linux-gnu/faketime",
        "/usr/lib/aarch64-linux-gnu/faketime",
        "/usr/lib/faketime",
        "/usr/local/lib/faketime",
    ] {
        let lib = format!("{dir}/libfaketime.so.1");
        if std::path::Path::new(&lib).exists() {
            return lib;
        }
    }
    panic!("libfaketime not found: install Debian's `faketime` (scripts/test.sh does)");
}

/// Start `idemproxy serve` with its wall clock shifted by `offset` (e.g. `+90s`): only
/// `CLOCK_REALTIME` moves, as on a host whose clock is wrong; timers keep working.
fn start_skewed(
    dir: &std::path::Path,
    yaml: &str,
    offset: &str,
    env: &[(&str, &str)],
) -> ProxyProc {
    let lib = libfaketime();
    let mut all: Vec<(&str, &str)> = vec![
        ("LD_PRELOAD", lib.as_str()),
        ("FAKETIME", offset),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
        ("FAKETIME_NO_CACHE", "1"),
    ];
    all.extend_from_slice(env);
    ProxyProc::start_with_env(dir, yaml, &all)
}

/// Retry `key` on `url` every 200 ms until a 2xx (returned) or `limit` passes (panics).
async fn retry_until_result(c: &TestClient, url: &str, key: &str, limit: Duration) -> Resp {
    let deadline = Instant::now() + limit;
    loop {
        let r = post(c, url, &[("idempotency-key", key)], r#"{"to":"a@x"}"#).await;
        if r.status.is_success() {
            return r;
        }
        assert!(
            Instant::now() < deadline,
            "no result for {key} within {limit:?}; last answer: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Three instances on one store, one with its clock 90 s ahead of the database's and one
/// 90 s behind, more than the lease (3 s) and the lookup's settle window (60 s, twice the
/// default timeout). Slow calls (2 s downstream) start on each instance and are retried
/// concurrently on the other two. Trusting its own clock, a skewed instance took over a
/// live lease, trusted a "not found" lookup as settled and sent the call again
/// (issue 34, item 1); on the database's clock nothing is taken over or re-sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn instances_with_skewed_clocks_never_send_a_call_twice() {
    let schema = Schema::new("skew");
    let ds = FakeDownstream::start().await;
    ds.set_delay(Duration::from_millis(2000));
    let cfg = yaml(&schema.name, URL_VAR, &ds.url(), "3s");
    let dirs: Vec<_> = (0..3)
        .map(|_| tempfile::tempdir().expect("tempdir"))
        .collect();
    let procs = [
        ProxyProc::start(dirs[0].path(), &cfg),
        start_skewed(dirs[1].path(), &cfg, "+90s", &[]),
        start_skewed(dirs[2].path(), &cfg, "-90s", &[]),
    ];
    // Let every lease keeper run at least once before the calls start.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let c = client();
    let keys = 6;
    let mut firsts = Vec::new();
    for k in 0..keys {
        let url = procs[k % 3].url("/mail/send");
        let c = c.clone();
        firsts.push(tokio::spawn(async move {
            post(
                &c,
                &url,
                &[("idempotency-key", &format!("skew-{k}"))],
                r#"{"to":"a@x"}"#,
            )
            .await
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut retries = Vec::new();
    for k in 0..keys {
        for other in 1..3 {
            let url = procs[(k + other) % 3].url("/mail/send");
            let c = c.clone();
            retries.push(tokio::spawn(async move {
                retry_until_result(&c, &url, &format!("skew-{k}"), Duration::from_secs(20)).await
            }));
        }
    }
    let mut first_answers = Vec::new();
    for t in firsts {
        first_answers.push(t.await.expect("first call"));
    }
    let mut retried = Vec::new();
    for t in retries {
        retried.push(t.await);
    }
    let lost = retried
        .iter()
        .enumerate()
        .filter(|(i, r)| {
            !r.as_ref()
                .is_ok_and(|r| r.body == first_answers[i / 2].body)
        })
        .count();
    report_fault(
        "PostgreSQL: instance clocks ±90 s off the database's",
        ds.commits().saturating_sub(keys),
        lost,
        None,
        "6 slow calls on 3 instances, each retried on the other two",
    );
    // The side effects first: that is what a skewed clock must never double.
    assert_eq!(
        ds.commits(),
        keys,
        "one side effect per call across skewed instances: {:?}",
        ds.messages()
    );
    for (k, r) in first_answers.iter().enumerate() {
        assert_eq!(
            r.status,
            StatusCode::CREATED,
            "first call of skew-{k}: {r:?}"
        );
    }
    for (i, r) in retried.into_iter().enumerate() {
        let k = i / 2;
        let r = r.unwrap_or_else(|e| panic!("retry of skew-{k}: {e}"));
        assert_eq!(
            r.body, first_answers[k].body,
            "a retry of skew-{k} replays the first answer"
        );
    }
}

/// A TCP forwarder to PostgreSQL that can be cut (every connection through it closed, new
/// ones refused), frozen (connections stay open, no byte moves: a server stopped with
/// SIGSTOP) and restored, standing in for a database outage without touching the shared
/// server.
struct Forwarder {
    addr: SocketAddr,
    up: Arc<AtomicBool>,
    frozen: Arc<AtomicBool>,
    cut: watch::Sender<u64>,
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    frozen: Arc<AtomicBool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        while frozen.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

impl Forwarder {
    async fn start(target: SocketAddr) -> Forwarder {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let up = Arc::new(AtomicBool::new(true));
        let frozen = Arc::new(AtomicBool::new(false));
        let (cut, _) = watch::channel(0u64);
        let (accept_up, accept_frozen, accept_cut) = (up.clone(), frozen.clone(), cut.clone());
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                if !accept_up.load(Ordering::SeqCst) {
                    drop(inbound);
                    continue;
                }
                let mut cut_rx = accept_cut.subscribe();
                let frozen = accept_frozen.clone();
                tokio::spawn(async move {
                    let Ok(outbound) = TcpStream::connect(target).await else {
                        return;
                    };
                    let (in_r, in_w) = inbound.into_split();
                    let (out_r, out_w) = outbound.into_split();
                    tokio::select! {
                        _ = pump(in_r, out_w, frozen.clone()) => {}
                        _ = pump(out_r, in_w, frozen) => {}
                        _ = cut_rx.changed() => {}
                    }
                });
            }
        });
        Forwarder {
            addr,
            up,
            frozen,
            cut,
        }
    }

    /// The URL of the test database through this forwarder.
    fn url(&self, direct: &str) -> String {
        let base: tokio_postgres::Config = direct.parse().expect("test URL parses");
        format!(
            "postgres://{}@{}/{}",
            base.get_user().unwrap_or("postgres"),
            self.addr,
            base.get_dbname().unwrap_or("test")
        )
    }

    fn cut(&self) {
        self.up.store(false, Ordering::SeqCst);
        self.cut.send_modify(|g| *g += 1);
    }

    fn freeze(&self, on: bool) {
        self.frozen.store(on, Ordering::SeqCst);
    }

    fn restore(&self) {
        self.up.store(true, Ordering::SeqCst);
    }
}

/// The database goes away 2.5 s into a 3 s downstream call and is back 1.5 s later. The
/// client gets 502 (the answer could not be stored), but the call must not stay
/// `executing` under its live owner's lease: today every retry got `409 in-flight`
/// indefinitely (issue 34, item 2). The answer is kept and written once the store is back,
/// and a retry is answered with it within a few seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_outage_during_the_result_write_does_not_leave_the_call_stuck() {
    let schema = Schema::new("outage");
    let ds = FakeDownstream::start().await;
    ds.set_delay(Duration::from_millis(3000));
    let fwd = Forwarder::start(pg_addr(&schema.url)).await;
    let via = fwd.url(&schema.url);
    let cfg = yaml(&schema.name, "PG_VIA_FORWARDER", &ds.url(), "5s");
    let dir = tempfile::tempdir().expect("tempdir");
    let proxy = ProxyProc::start_with_env(dir.path(), &cfg, &[("PG_VIA_FORWARDER", &via)]);
    let c = client();
    let url = proxy.url("/mail/send");
    let first = tokio::spawn({
        let (c, url) = (c.clone(), url.clone());
        async move {
            post(
                &c,
                &url,
                &[("idempotency-key", "k-outage")],
                r#"{"to":"a@x"}"#,
            )
            .await
        }
    });
    wait_for_hit(&ds, "/send").await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    fwd.cut();
    let r = first.await.expect("first call");
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{r:?}");
    assert_eq!(r.header("idempotency-status"), Some("outcome_unknown"));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    fwd.restore();
    let back = Instant::now();
    let replay = retry_until_result(&c, &url, "k-outage", Duration::from_secs(10)).await;
    let took = back.elapsed();
    eprintln!("retry answered {took:?} after the database came back");
    report_fault(
        "PostgreSQL: connections cut during the result write, back 1.5 s later",
        ds.commits().saturating_sub(1),
        usize::from(replay.header("idempotent-replayed") != Some("true")),
        Some(took),
        "the client got 502; a retry replays the kept answer",
    );
    assert_eq!(replay.status, StatusCode::CREATED, "{replay:?}");
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert_eq!(ds.commits(), 1, "the call was not sent again");
}

/// A database that stops answering (frozen, as under SIGSTOP) for 12 s: a call that
/// already holds a pooled connection hung for the whole freeze (issue 34, item 6). Every
/// store call now has a deadline (5 s), so the call is refused with 503 (nothing sent)
/// well before the freeze ends, `/readyz` says not ready, and after the freeze the
/// proxy works again without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_database_fails_calls_by_the_deadline_not_the_freeze() {
    let schema = Schema::new("freeze");
    let ds = FakeDownstream::start().await;
    let fwd = Forwarder::start(pg_addr(&schema.url)).await;
    let via = fwd.url(&schema.url);
    let cfg = format!(
        "admin: {{ listen: 127.0.0.1:0, token_env: {ADMIN_TOKEN_ENV} }}\n{}",
        yaml(&schema.name, "PG_VIA_FORWARDER", &ds.url(), "3s")
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let proxy = ProxyProc::start_with_env(
        dir.path(),
        &cfg,
        &[("PG_VIA_FORWARDER", &via), (ADMIN_TOKEN_ENV, ADMIN_TOKEN)],
    );
    let c = client();
    let url = proxy.url("/mail/send");
    let warm = post(&c, &url, &[("idempotency-key", "k-warm")], "{}").await;
    assert_eq!(warm.status, StatusCode::CREATED, "{warm:?}");

    fwd.freeze(true);
    let frozen_at = Instant::now();
    // Bounded here so that a hang fails the test (before the fix: no answer for minutes).
    let r = tokio::time::timeout(
        Duration::from_secs(20),
        post(&c, &url, &[("idempotency-key", "k-frozen")], "{}"),
    )
    .await
    .unwrap_or_else(|_| panic!("no answer within 20 s of a 12 s freeze"));
    let took = frozen_at.elapsed();
    eprintln!(
        "a call during the freeze was answered {} after {took:?}",
        r.status
    );
    assert!(took < Duration::from_secs(8), "hung {took:?}: {r:?}");
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{r:?}");
    let ready = send(&c, http::Method::GET, &proxy.admin_url("/readyz"), &[], "").await;
    assert_eq!(ready.status, StatusCode::SERVICE_UNAVAILABLE, "{ready:?}");
    assert_eq!(
        ds.commits(),
        1,
        "nothing was sent while the store was frozen"
    );

    let left = Duration::from_secs(12).saturating_sub(frozen_at.elapsed());
    tokio::time::sleep(left).await;
    fwd.freeze(false);
    let back = Instant::now();
    let r = retry_until_result(&c, &url, "k-frozen", Duration::from_secs(15)).await;
    eprintln!("working again {:?} after the freeze ended", back.elapsed());
    report_fault(
        "PostgreSQL: server frozen 12 s (no byte moves)",
        ds.commits().saturating_sub(2),
        0,
        Some(back.elapsed()),
        &format!(
            "a call during the freeze got 503 after {} ms",
            took.as_millis()
        ),
    );
    assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
    assert_eq!(ds.commits(), 2);
    let ready = send(&c, http::Method::GET, &proxy.admin_url("/readyz"), &[], "").await;
    assert_eq!(ready.status, StatusCode::OK, "{ready:?}");
}
