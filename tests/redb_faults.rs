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
    let deleted = Instant::now();
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
    report_fault(
        "redb: store file deleted while running",
        ds.commits().saturating_sub(1),
        0,
        None,
        &format!(
            "/readyz not ready {} ms after (a stat per probe and per write batch, a watcher every 1 s); side effects 503 until restart",
            deleted.elapsed().as_millis()
        ),
    );
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

/// Runs `idemproxy serve` with `extra` arguments until it exits or prints its listening
/// line (then stops it). Returns the exit status if it exited, and its stderr.
fn run_serve(
    config: &std::path::Path,
    extra: &[&str],
) -> (Option<std::process::ExitStatus>, String) {
    use std::io::{BufRead, BufReader, Read};
    use std::process::{Command, Stdio};
    let mut child = Command::new(BIN)
        .arg("serve")
        .arg("--config")
        .arg(config)
        .args(extra)
        .env(ADMIN_TOKEN_ENV, ADMIN_TOKEN)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn idemproxy");
    let out = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if line.starts_with("idemproxy listening on ") {
                let _ = tx.send(());
            }
        }
    });
    let mut err = child.stderr.take().expect("stderr");
    let stderr = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            break Some(st);
        }
        if rx.try_recv().is_ok() {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        assert!(
            Instant::now() < deadline,
            "serve neither started nor exited"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    (status, stderr.join().expect("stderr reader"))
}

/// A store file truncated to 0 bytes between runs started as a new, empty store without
/// a word, and every retry of a recorded call ran again. Now `serve` refuses it (exit 1,
/// naming the file and the way out); `serve --init-store` creates a store there on purpose.
#[tokio::test(flavor = "multi_thread")]
async fn an_empty_store_file_is_refused_unless_init_store_is_given() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ds = FakeDownstream::start().await;
    let config = dir.path().join("idemproxy.yaml");
    std::fs::write(&config, admin_config(dir.path(), &ds.url())).expect("config");
    let store = dir.path().join("store.redb");
    std::fs::write(&store, b"").expect("empty store file");

    let (status, stderr) = run_serve(&config, &[]);
    report_fault(
        "redb: store file truncated to 0 bytes between runs",
        0,
        0,
        None,
        if status.and_then(|s| s.code()) == Some(1) {
            "serve refuses (exit 1); --init-store creates a store on purpose"
        } else {
            "serve STARTED on the empty file"
        },
    );
    assert_eq!(status.and_then(|s| s.code()), Some(1), "{stderr}");
    assert!(stderr.contains(&store.display().to_string()), "{stderr}");
    assert!(stderr.contains("is empty"), "{stderr}");
    assert!(stderr.contains("--init-store"), "{stderr}");
    assert_eq!(std::fs::metadata(&store).expect("still there").len(), 0);

    let (status, stderr) = run_serve(&config, &["--init-store"]);
    assert_eq!(status, None, "serve --init-store starts: {stderr}");
    assert!(std::fs::metadata(&store).expect("store").len() > 0);
    // Once created, the store opens without the flag.
    let (status, stderr) = run_serve(&config, &[]);
    assert_eq!(status, None, "{stderr}");
}

/// 64 random bytes written into the middle of a store file: redb panicked ("entered
/// unreachable code") and `serve` died with a backtrace. Now the file's integrity is
/// checked at open (redb verifies every page's checksum of the committed trees): `serve`
/// exits 1 with an error naming the file when the bytes hit a page in use, never panics,
/// and where they hit a free page every recorded call still replays.
#[tokio::test(flavor = "multi_thread")]
async fn a_corrupt_store_file_is_an_error_naming_it_not_a_panic() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ds = FakeDownstream::start().await;
    let proxy = start(dir.path(), &ds).await;
    let c = client();
    for i in 0..200 {
        let r = post(
            &c,
            &proxy.url("/mail/send"),
            &[("idempotency-key", &format!("k-{i}"))],
            &format!(r#"{{"n":{i},"pad":"{}"}}"#, "x".repeat(200)),
        )
        .await;
        assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
    }
    let config = proxy.config_path.clone();
    assert!(proxy.terminate().success());
    let store = dir.path().join("store.redb");
    let original = std::fs::read(&store).expect("read store");
    let len = original.len();
    // Deterministic "random" bytes (xorshift), so a failure reproduces.
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut scribble = |bytes: &mut Vec<u8>, at: usize| {
        for b in &mut bytes[at..at + 64] {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
    };

    // The middle of the file, as in the issue. Where those bytes fall on a page in use,
    // the open must refuse; where they fall on a free page (redb leaves some; where
    // depends on how the writes were batched), nothing recorded is harmed, and every
    // call must still replay.
    let mut bytes = original.clone();
    scribble(&mut bytes, len / 2);
    std::fs::write(&store, &bytes).expect("corrupt the store");
    let (status, stderr) = run_serve(&config, &[]);
    let middle = match (status.and_then(|s| s.code()), stderr.contains("panicked")) {
        (_, true) => "PANICKED",
        (Some(1), false) if stderr.contains(&store.display().to_string()) => {
            "serve refuses (exit 1) naming the file"
        }
        (None, false) => "bytes fell on a free page: serve starts and every call replays",
        _ => "serve failed without naming the file",
    };
    assert!(!stderr.contains("panicked"), "{stderr}");
    if status.is_none() {
        let proxy = start(dir.path(), &ds).await;
        for i in 0..200 {
            let r = post(
                &c,
                &proxy.url("/mail/send"),
                &[("idempotency-key", &format!("k-{i}"))],
                &format!(r#"{{"n":{i},"pad":"{}"}}"#, "x".repeat(200)),
            )
            .await;
            assert_eq!(r.header("idempotent-replayed"), Some("true"), "{r:?}");
        }
        assert!(proxy.terminate().success());
    } else {
        assert_eq!(status.and_then(|s| s.code()), Some(1), "{stderr}");
        assert!(stderr.contains(&store.display().to_string()), "{stderr}");
    }

    // 64 bytes at each eighth of the file: some land on pages in use.
    let mut bytes = original;
    for k in 1..8 {
        scribble(&mut bytes, len * k / 8);
    }
    std::fs::write(&store, &bytes).expect("corrupt the store");
    let (status, stderr) = run_serve(&config, &[]);
    let spread = match (status.and_then(|s| s.code()), stderr.contains("panicked")) {
        (_, true) => "PANICKED",
        (Some(1), false) if stderr.contains(&store.display().to_string()) => {
            "refuses (exit 1) naming the file"
        }
        (None, _) => "STARTED",
        _ => "failed without naming the file",
    };
    report_fault(
        "redb: 64 random bytes in the middle of the file (then at 7 places)",
        ds.commits().saturating_sub(200),
        0,
        None,
        &format!("middle: {middle}; 7 places: {spread}"),
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(status.and_then(|s| s.code()), Some(1), "{stderr}");
    assert!(stderr.contains(&store.display().to_string()), "{stderr}");
    eprintln!("refused: {}", stderr.lines().last().unwrap_or(""));
    assert_eq!(ds.commits(), 200);
}

/// A small tmpfs mounted for one test, unmounted when dropped.
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    /// Needs root (mount); CI runs the tests as root. Panics, never skips, without it.
    fn mount(size: &str) -> Tmpfs {
        let dir = tempfile::tempdir().expect("tempdir");
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .status()
            .expect("run mount");
        assert!(
            ok.success(),
            "mounting a tmpfs failed: this test needs root (CI runs as root)"
        );
        Tmpfs { dir }
    }

    fn path(&self) -> &std::path::Path {
        self.dir.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

/// Fills the file system holding `dir` with `filler` until a write fails.
fn fill(filler: &std::path::Path) {
    use std::io::Write;
    let mut f = std::fs::File::create(filler).expect("filler");
    let chunk = vec![0xA5u8; 64 << 10];
    while f.write_all(&chunk).is_ok() {}
    let _ = f.sync_all();
}

/// The disk holding the store fills up (needs root: a 8 MiB tmpfs is mounted for it; CI
/// runs as root). Today one failed commit made every later write fail until a restart,
/// and /healthz stayed green. Now: while the disk is full, side effects are refused with
/// 503 and /readyz is not ready; once space is freed, the store is reopened and writes
/// resume without a restart, and nothing already recorded runs again.
#[tokio::test(flavor = "multi_thread")]
async fn a_full_disk_refuses_side_effects_and_recovers_once_space_is_freed() {
    let disk = Tmpfs::mount("8m");
    let ds = FakeDownstream::start().await;
    let proxy = start(disk.path(), &ds).await;
    let c = client();
    let url = proxy.url("/mail/send");
    let body = format!(r#"{{"pad":"{}"}}"#, "y".repeat(3000));
    let first = post(&c, &url, &[("idempotency-key", "k-before")], &body).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");

    let filler = disk.path().join("filler");
    fill(&filler);
    // Writes fail as soon as a commit needs a page the disk no longer has.
    let mut refused = None;
    for i in 0..200 {
        let r = post(
            &c,
            &url,
            &[("idempotency-key", &format!("k-full-{i}"))],
            &body,
        )
        .await;
        if r.status == StatusCode::SERVICE_UNAVAILABLE {
            refused = Some(i);
            break;
        }
        assert!(r.status.is_success() || r.status.is_server_error(), "{r:?}");
    }
    let refused = refused.expect("a full disk refused no write");
    // Asserted after the recovery below, which is what today's code lacks most.
    let ready_while_full = get(&c, &proxy.admin_url("/readyz")).await;
    let commits_while_full = ds.commits();

    std::fs::remove_file(&filler).expect("free the space");
    let freed = Instant::now();
    let again = loop {
        let r = post(&c, &url, &[("idempotency-key", "k-after")], &body).await;
        if r.status == StatusCode::CREATED {
            break r;
        }
        assert!(
            freed.elapsed() < Duration::from_secs(10),
            "writes did not resume after space was freed: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!(
        "disk full after {refused} calls; writes resumed {:?} after space was freed",
        freed.elapsed()
    );
    report_fault(
        "redb: disk full (8 MiB tmpfs), then space freed",
        ds.commits().saturating_sub(commits_while_full + 1),
        0,
        Some(freed.elapsed()),
        "side effects 503 while full; writes resume without a restart",
    );
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(ds.commits(), commits_while_full + 1);
    assert_eq!(
        ready_while_full.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{ready_while_full:?}"
    );
    let ready = get(&c, &proxy.admin_url("/readyz")).await;
    assert_eq!(ready.status, StatusCode::OK, "{ready:?}");
    // What was recorded before the disk filled is still there: a retry replays it.
    let replay = post(&c, &url, &[("idempotency-key", "k-before")], &body).await;
    assert_eq!(
        replay.header("idempotent-replayed"),
        Some("true"),
        "{replay:?}"
    );
    assert_eq!(ds.commits(), commits_while_full + 1);
}
