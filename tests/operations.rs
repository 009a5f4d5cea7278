//! Process-level operations: graceful drain on SIGTERM, SIGHUP reload, retention and the
//! offline `records` / `gc` / `resolve` commands against the redb file.

mod common;

use std::time::Duration;

use common::fake_downstream::FakeDownstream;
use common::*;
use http::StatusCode;

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_drains_the_request_in_flight() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ds = FakeDownstream::start().await;
    ds.set_delay(Duration::from_millis(500));
    let proxy = ProxyProc::start(dir.path(), &config(dir.path(), &ds.url()));
    let c = client();
    let url = proxy.url("/mail/send");
    let call =
        tokio::spawn(async move { post(&c, &url, &[("idempotency-key", "k-drain")], "{}").await });
    wait_for_hit(&ds, "/send").await;
    let status = tokio::task::spawn_blocking(move || proxy.terminate())
        .await
        .expect("join");
    assert_eq!(status.code(), Some(0));
    let r = call.await.expect("task");
    assert_eq!(
        r.status,
        StatusCode::CREATED,
        "the in-flight call finished before exit: {r:?}"
    );
    assert_eq!(
        r.header("connection"),
        Some("close"),
        "the last answer on a draining connection says it closes: {r:?}"
    );
    let rows = records(&dir.path().join("idemproxy.yaml"));
    assert!(
        rows.iter()
            .any(|r| r.contains("result_delivered") || r.contains("committed")),
        "{rows:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn sighup_reloads_routes_and_keeps_serving() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ds = FakeDownstream::start().await;
    let yaml = config(dir.path(), &ds.url());
    let proxy = ProxyProc::start(dir.path(), &yaml);
    let c = client();
    let before = send(&c, http::Method::GET, &proxy.url("/mail2/weather"), &[], "").await;
    assert_eq!(before.status, StatusCode::NOT_FOUND);
    // Add a second mount and reload.
    let reloaded = yaml.replace(
        "upstreams:\n",
        &format!(
            "upstreams:\n  - name: mail2\n    url: {}\n    mount: /mail2\n",
            ds.url()
        ),
    );
    std::fs::write(&proxy.config_path, reloaded).expect("write");
    proxy.signal("HUP");
    proxy.wait_for_log("configuration reloaded", Duration::from_secs(5));
    let after = send(
        &c,
        http::Method::GET,
        &proxy.url("/mail2/weather?city=Rome"),
        &[],
        "",
    )
    .await;
    assert_eq!(after.status, StatusCode::OK);
    // A broken file is rejected and the running config stays.
    std::fs::write(&proxy.config_path, "upstreams: [oops").expect("write");
    proxy.signal("HUP");
    proxy.wait_for_log("reload rejected", Duration::from_secs(5));
    let still = send(
        &c,
        http::Method::GET,
        &proxy.url("/mail2/weather?city=Rome"),
        &[],
        "",
    )
    .await;
    assert_eq!(still.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread")]
async fn retention_gc_and_offline_commands() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ds = FakeDownstream::start().await;
    let yaml = config(dir.path(), &ds.url()).replace(
        "      - {{ name: send_keyed".replace("{{", "{").as_str(),
        "      - { name: short, match: { method: POST, path: /echo/short }, retention: 1s }\n      - { name: send_keyed",
    );
    let proxy = ProxyProc::start(dir.path(), &yaml);
    let c = client();
    let keep = post(
        &c,
        &proxy.url("/mail/send"),
        &[("idempotency-key", "k-keep")],
        "{}",
    )
    .await;
    assert_eq!(keep.status, StatusCode::CREATED);
    let short = post(
        &c,
        &proxy.url("/mail/echo/short"),
        &[("idempotency-key", "k-short")],
        "{}",
    )
    .await;
    assert_eq!(short.status, StatusCode::OK, "{short:?}");
    let dropped = post(
        &c,
        &proxy.url("/mail/drop-after-commit/send"),
        &[("idempotency-key", "k-unknown")],
        "{}",
    )
    .await;
    let unknown_id = dropped
        .header("idempotency-execution-id")
        .expect("id")
        .to_string();
    // While the proxy runs, the redb file is locked: offline commands say so.
    let cfg = proxy.config_path.clone();
    let cfg_s = cfg.to_str().expect("utf-8").to_string();
    let locked = cli(&["records", "list", "--config", &cfg_s]);
    assert_eq!(locked.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&locked.stderr).contains("already open"),
        "{}",
        String::from_utf8_lossy(&locked.stderr)
    );
    assert!(
        String::from_utf8_lossy(&locked.stderr).contains("admin API"),
        "points to the admin API: {}",
        String::from_utf8_lossy(&locked.stderr)
    );
    // The one-shot commands log warnings only: their output is not mixed with log lines.
    assert!(
        !String::from_utf8_lossy(&locked.stderr).contains(" INFO "),
        "{}",
        String::from_utf8_lossy(&locked.stderr)
    );
    proxy.terminate();
    assert_eq!(records(&cfg).len(), 3);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let gc = cli(&["gc", "--config", &cfg_s]);
    assert!(
        gc.status.success(),
        "{}",
        String::from_utf8_lossy(&gc.stderr)
    );
    assert!(String::from_utf8_lossy(&gc.stdout).contains("removed 1 records"));
    let rows = records(&cfg);
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert!(!rows.iter().any(|r| r.contains("mail/short")));
    // records show prints the record as JSON; no request body is stored in it.
    let show = cli(&["records", "show", &unknown_id, "--config", &cfg_s]);
    assert!(show.status.success());
    let rec: serde_json::Value = serde_json::from_slice(&show.stdout).expect("json");
    assert_eq!(rec["state"], "outcome_unknown");
    // Operator resolution through the CLI, validated by the state machine.
    let res = cli(&[
        "resolve",
        &unknown_id,
        "--as",
        "committed",
        "--config",
        &cfg_s,
    ]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let again = cli(&[
        "resolve",
        &unknown_id,
        "--as",
        "not-committed",
        "--config",
        &cfg_s,
    ]);
    assert_eq!(
        again.status.code(),
        Some(1),
        "committed cannot be resolved again"
    );
    assert!(String::from_utf8_lossy(&again.stderr).contains("illegal transition"));
    // The resolved record now replays.
    let proxy = ProxyProc::start(dir.path(), &yaml);
    let r = post(
        &c,
        &proxy.url("/mail/drop-after-commit/send"),
        &[("idempotency-key", "k-unknown")],
        "{}",
    )
    .await;
    assert_eq!(r.header("idempotent-replayed"), Some("true"), "{r:?}");
    assert_eq!(ds.hits_on("/drop-after-commit/send"), 1);
}

/// The CPUs in a `Cpus_allowed_list` line of `/proc/.../status` ("0-3,6").
fn cpu_list(status: &str) -> Vec<usize> {
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .expect("Cpus_allowed_list in /proc status");
    let mut cpus = Vec::new();
    for part in line.trim().split(',') {
        match part.split_once('-') {
            Some((a, b)) => cpus.extend(a.parse::<usize>().unwrap()..=b.parse::<usize>().unwrap()),
            None => cpus.push(part.parse().unwrap()),
        }
    }
    cpus
}

/// Each server worker thread's CPUs, once `want` workers exist and `ready` holds for
/// them (a worker pins itself as it starts, just after the listener is announced).
fn worker_cpus(pid: u32, want: usize, ready: impl Fn(&[Vec<usize>]) -> bool) -> Vec<Vec<usize>> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let mut seen = Vec::new();
        for task in std::fs::read_dir(format!("/proc/{pid}/task")).expect("task dir") {
            let task = task.expect("task").path();
            let comm = std::fs::read_to_string(task.join("comm")).unwrap_or_default();
            if comm.trim() == "idemproxy-worke" {
                let status = std::fs::read_to_string(task.join("status")).expect("status");
                seen.push(cpu_list(&status));
            }
        }
        if seen.len() == want && ready(&seen) {
            return seen;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "workers never reached the expected CPUs: {seen:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn workers_are_pinned_one_per_cpu_unless_told_not_to() {
    let own = cpu_list(&std::fs::read_to_string("/proc/self/status").expect("status"));
    assert!(
        own.len() >= 2,
        "this test needs at least two CPUs to tell pinned workers from unpinned ones; it has {own:?}"
    );
    let n = own.len().to_string();
    let dir = tempfile::tempdir().expect("tempdir");
    let yaml = config(dir.path(), "http://127.0.0.1:9");

    // One worker per CPU: worker i on the i-th CPU of the mask, each alone.
    let proxy = ProxyProc::start_with_env(dir.path(), &yaml, &[("IDEMPROXY_WORKERS", &n)]);
    let mut pinned = worker_cpus(proxy.pid(), own.len(), |w| w.iter().all(|c| c.len() == 1));
    proxy.terminate();
    pinned.sort();
    let expected: Vec<Vec<usize>> = own.iter().map(|c| vec![*c]).collect();
    assert_eq!(pinned, expected, "one worker on each CPU");

    // Switched off: every worker may run on every CPU.
    let proxy = ProxyProc::start_with_env(
        dir.path(),
        &yaml,
        &[("IDEMPROXY_WORKERS", &n), ("IDEMPROXY_PIN_WORKERS", "0")],
    );
    let free = worker_cpus(proxy.pid(), own.len(), |_| true);
    proxy.terminate();
    assert!(free.iter().all(|c| *c == own), "unpinned: {free:?}");

    // Fewer workers than CPUs: not pinned, so they are not crowded onto the first CPUs.
    let proxy = ProxyProc::start_with_env(dir.path(), &yaml, &[("IDEMPROXY_WORKERS", "1")]);
    let one = worker_cpus(proxy.pid(), 1, |_| true);
    proxy.terminate();
    assert_eq!(one, vec![own.clone()], "a lone worker is not pinned");
}

/// A reload that changes what only a restart can (the listen address, the store) says so
/// and names what is still in use: the address actually bound, the store actually open,
/// also on a second reload after the first was refused (issue 34, item 7).
#[tokio::test(flavor = "multi_thread")]
async fn sighup_names_the_listener_and_store_still_in_use() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ds = FakeDownstream::start().await;
    let yaml = config(dir.path(), &ds.url());
    let proxy = ProxyProc::start(dir.path(), &yaml);
    let changed = yaml
        .replace("listen: 127.0.0.1:0", "listen: 127.0.0.1:1")
        .replace("/store.redb", "/other.redb");
    assert_ne!(changed, yaml);
    std::fs::write(&proxy.config_path, &changed).expect("write");
    for round in 1..=2 {
        proxy.signal("HUP");
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let count = |needle: &str| {
            proxy
                .stderr_lines()
                .iter()
                .filter(|l| l.contains(needle))
                .count()
        };
        let bound = format!("still listening on {}", proxy.addr);
        while count("configuration reloaded") < round {
            assert!(std::time::Instant::now() < deadline, "no reload");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(count(&bound), round, "{:?}", proxy.stderr_lines());
        assert_eq!(
            count("store changes need a restart; still using redb"),
            round,
            "{:?}",
            proxy.stderr_lines()
        );
    }
    assert!(proxy
        .stderr_lines()
        .iter()
        .any(|l| l.contains("still using redb") && l.contains("/store.redb")));
    let r = post(
        &client(),
        &proxy.url("/mail/send"),
        &[("idempotency-key", "k-hup")],
        "{}",
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
}
