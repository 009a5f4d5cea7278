//! The crash matrix (issue #3): every failpoint × every downstream behaviour. In each
//! cell the real proxy binary runs with `IDEMPROXY_FAILPOINT=<point>`, the client sends
//! one side effect, the harness waits for `FAILPOINT <point> reached`, SIGKILLs the proxy
//! there, restarts it on the same redb file without the failpoint, and retries as an agent
//! would (same key, same arguments, backing off, honouring `Retry-After`). Every cell must
//! end with at most one committed side effect (the fake downstream counts them), with the
//! original result where the downstream makes it knowable, and otherwise with an explicit
//! `outcome_unknown` (409 without `Retry-After`: only an operator can decide).
//!
//! The expected end of every cell is written down in [`expect`] and checked exactly.
//!
//! Only compiled with the failpoints: `cargo test --features failpoints --test crash_matrix`
//! (CI runs it that way; a plain `cargo test` skips this file). Deterministic by default
//! (one trial per cell, no delays). `scripts/crash_matrix.sh` runs many randomised trials
//! per cell (random commit delays, kill and restart timing, client backoff) through the
//! environment: `CRASH_MATRIX_TRIALS`, `CRASH_MATRIX_SEED`, `CRASH_MATRIX_JOBS`,
//! `CRASH_MATRIX_REPORT` (a file to write the result table to, as Markdown).
#![cfg(feature = "failpoints")]

mod common;

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::fake_downstream::FakeDownstream;
use common::{client, ProxyProc, Resp, TestClient};
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use idemproxy::failpoint::POINTS;

/// The reconcile lookup the fake downstream offers: messages by tag (= injected key).
const LOOKUP: &str = r#"reconcile: { path: "/messages?tag={execution_id}", settle: 1s, found: { status: 200, json_nonempty: /data }, not_found: { status: 200, json_empty: /data } }"#;
/// Upper bound of the random commit delay; the lookups' `settle` (1 s) must exceed it.
const MAX_DELAY_MS: u64 = 400;

/// One kind of downstream, as the article's "Test downstream behavior too" lists them.
struct Behaviour {
    name: &'static str,
    /// For the report.
    what: &'static str,
    /// Path on the fake downstream (the proxy mounts it under `/ds`).
    path: &'static str,
    /// The route entry in the proxy config.
    route: String,
    /// Each retry changes a field the fingerprint ignores (`/client_ts`).
    changes_ignored_field: bool,
    /// An independent batch (SPEC section 9.3): its items go to this downstream path, each
    /// an execution of its own; the cell counts every item's commits.
    items_to: Option<&'static str>,
}

fn behaviours() -> Vec<Behaviour> {
    let keyed = "downstream_key: { header: Idempotency-Key, replays: true }";
    vec![
        Behaviour {
            name: "keyed_replays",
            what: "honours idempotency keys, returns the original response on replay",
            path: "/keyed/send",
            route: format!("{{ name: keyed, match: {{ method: POST, path: /keyed/send }}, {keyed}, fingerprint: {{ ignore_json: [/client_ts] }} }}"),
            changes_ignored_field: false,
            items_to: None,
        },
        Behaviour {
            name: "keyed_rejects_changed_body",
            what: "rejects a reused key with a changed body (the retry differs in an ignored field)",
            path: "/keyed/send",
            route: String::new(), // same route as keyed_replays
            changes_ignored_field: true,
            items_to: None,
        },
        Behaviour {
            name: "no_idempotency",
            what: "no idempotency support, no lookup",
            path: "/send",
            route: "{ name: plain, match: { method: POST, path: /send } }".into(),
            changes_ignored_field: false,
            items_to: None,
        },
        Behaviour {
            name: "timeout_after_commit_keyed",
            what: "commits, then never answers (proxy timeout 300 ms); honours keys",
            path: "/keyed/timeout-after-commit/send",
            route: format!("{{ name: keyed_timeout, match: {{ method: POST, path: /keyed/timeout-after-commit/send }}, {keyed}, timeout: 300ms }}"),
            changes_ignored_field: false,
            items_to: None,
        },
        Behaviour {
            name: "timeout_after_commit_lookup",
            what: "commits, then never answers (proxy timeout 300 ms); lookup by tag",
            path: "/timeout-after-commit/send",
            route: format!("{{ name: timeout_lookup, match: {{ method: POST, path: /timeout-after-commit/send }}, timeout: 300ms, {LOOKUP} }}"),
            changes_ignored_field: false,
            items_to: None,
        },
        Behaviour {
            name: "500_before_commit",
            what: "first call per key: 500 without committing, then commits (on_5xx: failed_before_commit)",
            path: "/fail-once-before-commit/send",
            route: "{ name: fail_once, match: { method: POST, path: /fail-once-before-commit/send }, on_5xx: failed_before_commit }".into(),
            changes_ignored_field: false,
            items_to: None,
        },
        Behaviour {
            name: "500_after_commit_lookup",
            what: "commits, then answers 500 (on_5xx: outcome_unknown); lookup by tag",
            path: "/fail-after-commit/send",
            route: format!("{{ name: fail_after, match: {{ method: POST, path: /fail-after-commit/send }}, {LOOKUP} }}"),
            changes_ignored_field: false,
            items_to: None,
        },
        Behaviour {
            name: "batch_keyed",
            what: "an independent batch of 2 items, each to a downstream that honours keys",
            path: "/batch/keyed",
            route: format!("{{ name: batch, match: {{ method: POST, path: /batch/keyed }}, {keyed}, batch: {{ items: /messages, mode: independent, item_key: /to, each: {{ path: /keyed/send }} }} }}"),
            changes_ignored_field: false,
            items_to: Some("/keyed/send"),
        },
    ]
}

fn config(dir: &Path, ds: &str, behaviours: &[Behaviour]) -> String {
    let mut routes = String::new();
    for b in behaviours.iter().filter(|b| !b.route.is_empty()) {
        let _ = writeln!(routes, "      - {}", b.route);
    }
    format!(
        "listen: 127.0.0.1:0\n\
         store: {{ backend: redb, path: {dir}/store.redb, retention: 1h, reconcile_interval: 250ms }}\n\
         upstreams:\n  - name: ds\n    url: {ds}\n    mount: /ds\n    routes:\n{routes}",
        dir = dir.display()
    )
}

/// How a cell ended, as the agent sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
enum End {
    /// A 2xx: the action's result.
    Result,
    /// 409 `outcome-unknown` without `Retry-After`: waits for an operator.
    Unknown,
    /// Anything else when the agent gave up (always a failure of the cell).
    Other(String),
}

impl End {
    fn label(&self) -> String {
        match self {
            End::Result => "result".into(),
            End::Unknown => "outcome_unknown".into(),
            End::Other(s) => format!("other: {s}"),
        }
    }
}

/// What a cell must end with.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Expect {
    reached: bool,
    end: End,
    commits: usize,
}

/// The expected end of each cell, from what the record and the downstream can know.
fn expect(point: &str, behaviour: &str) -> Expect {
    // Before the request left, the durable record says `executing`, which after a crash
    // can only become `outcome_unknown`: nothing tells "never sent" from "sent".
    let before_send = matches!(point, "after_prepared" | "before_downstream");
    // The downstream has the request; the proxy recorded nothing about its outcome.
    let unrecorded = matches!(point, "in_flight" | "after_remote_commit");
    let timeout = behaviour.starts_with("timeout_after_commit");
    let reached = !(timeout && point == "after_remote_commit"); // no answer ever comes
    let (end, commits) = match behaviour {
        // Knowable: a re-send under the same key, or a lookup, tells what happened (and
        // executes once when nothing did).
        "keyed_replays"
        | "keyed_rejects_changed_body"
        | "timeout_after_commit_keyed"
        | "timeout_after_commit_lookup"
        | "500_after_commit_lookup" => (End::Result, 1),
        // Unknowable once the record says `executing`: explicit outcome_unknown.
        "no_idempotency" if before_send => (End::Unknown, 0),
        "no_idempotency" if unrecorded => (End::Unknown, 1),
        "no_idempotency" => (End::Result, 1),
        // The 500 itself commits nothing; once its `failed_before_commit` is recorded the
        // retry executes (and commits) under the same key.
        "500_before_commit" if before_send || unrecorded => (End::Unknown, 0),
        "500_before_commit" => (End::Result, 1),
        // Each item is reconciled on its own record (re-sent under its key): the batch
        // ends with every item's result, each item once.
        "batch_keyed" => (End::Result, 2),
        other => panic!("no expectation for behaviour {other}"),
    };
    Expect {
        reached,
        end,
        commits,
    }
}

/// splitmix64: reproducible randomness without a dependency.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `0..=max` (0 when not randomising).
    fn upto(&mut self, max: u64) -> u64 {
        if max == 0 {
            0
        } else {
            self.next() % (max + 1)
        }
    }
}

/// Timing of one trial.
#[derive(Clone, Copy, Debug)]
struct Timing {
    /// Downstream work before committing (`?delay_ms=`).
    delay_ms: u64,
    /// Extra time between reaching the failpoint and SIGKILL.
    kill_after_ms: u64,
    /// Time between SIGKILL and the restart.
    restart_after_ms: u64,
    /// Added to every client backoff.
    jitter_ms: u64,
}

impl Timing {
    fn draw(rng: &mut Rng, random: bool) -> Timing {
        if !random {
            return Timing {
                delay_ms: 0,
                kill_after_ms: 0,
                restart_after_ms: 0,
                jitter_ms: 0,
            };
        }
        Timing {
            delay_ms: rng.upto(MAX_DELAY_MS),
            kill_after_ms: rng.upto(50),
            restart_after_ms: rng.upto(300),
            jitter_ms: rng.upto(100),
        }
    }
}

/// What one trial showed.
#[derive(Debug)]
struct Trial {
    reached: bool,
    end: End,
    commits: usize,
    problems: Vec<String>,
}

async fn send(c: &TestClient, url: &str, key: &str, body: String) -> Result<Resp, String> {
    let req = http::Request::post(url)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let resp = c.request(req).await.map_err(|e| e.to_string())?;
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok(Resp {
        status: parts.status,
        headers: parts.headers,
        body,
    })
}

fn body_for(attempt: u64, b: &Behaviour) -> String {
    if b.items_to.is_some() {
        return r#"{"messages":[{"to":"a@example.com","subject":"crash matrix"},{"to":"b@example.com","subject":"crash matrix"}]}"#.into();
    }
    let ts = if b.changes_ignored_field { attempt } else { 0 };
    format!(r#"{{"to":"agent@example.com","subject":"crash matrix","client_ts":{ts}}}"#)
}

fn problem_type(r: &Resp) -> String {
    serde_json::from_slice::<serde_json::Value>(&r.body)
        .ok()
        .and_then(|v| v["type"].as_str().map(str::to_string))
        .unwrap_or_default()
}

async fn sleep_ms(ms: u64) {
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

/// One cell, one trial: crash at `point`, restart, retry like an agent, check.
async fn trial(
    ds: &FakeDownstream,
    b: &Behaviour,
    all: &[Behaviour],
    point: &'static str,
    key: &str,
    t: Timing,
) -> Trial {
    let dir = tempfile::tempdir().expect("tempdir");
    let yaml = config(dir.path(), &ds.url(), all);
    let c = client();
    let sent_to = b.items_to.unwrap_or(b.path);
    let hits_before = ds.hits_on(sent_to);
    let proxy = ProxyProc::start_with_env(dir.path(), &yaml, &[("IDEMPROXY_FAILPOINT", point)]);
    let path = format!("/ds{}?delay_ms={}&hold_ms=3000", b.path, t.delay_ms);
    let url = proxy.url(&path);
    let first = tokio::spawn({
        let (c, url, key, body) = (c.clone(), url.clone(), key.to_string(), body_for(0, b));
        async move { send(&c, &url, &key, body).await }
    });
    let line = format!("FAILPOINT {point} reached");
    let seen = |p: &ProxyProc| p.stderr_lines().iter().any(|l| l.contains(&line));
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut reached = false;
    while Instant::now() < deadline {
        if seen(&proxy) {
            reached = true;
            break;
        }
        if first.is_finished() {
            // The answer may race the announcement (after_answer): look once more.
            sleep_ms(100).await;
            reached = seen(&proxy);
            break;
        }
        sleep_ms(2).await;
    }
    if reached && point == "in_flight" {
        // Parked with the request handed to the connection: let it reach the downstream,
        // so the cell really is "the downstream has it, the proxy died".
        let until = Instant::now() + Duration::from_secs(5);
        while ds.hits_on(sent_to) == hits_before && Instant::now() < until {
            sleep_ms(2).await;
        }
    }
    sleep_ms(t.kill_after_ms).await;
    proxy.kill();
    let first_answer = first.await.ok().and_then(Result::ok);
    sleep_ms(t.restart_after_ms).await;

    // The agent retries: same key, same arguments.
    let proxy = ProxyProc::start(dir.path(), &yaml);
    let url = proxy.url(&path);
    let mut problems = Vec::new();
    let mut exec_id = first_answer
        .as_ref()
        .and_then(|r| r.header("idempotency-execution-id").map(str::to_string));
    let mut backoff = 50;
    let mut end = End::Other("no answer".into());
    let mut last: Option<Resp> = None;
    let give_up = Instant::now() + Duration::from_secs(20);
    for attempt in 1..=25u64 {
        let r = match send(&c, &url, key, body_for(attempt, b)).await {
            Ok(r) => r,
            Err(e) => {
                end = End::Other(format!("transport: {e}"));
                sleep_ms(backoff).await;
                continue;
            }
        };
        if exec_id.is_none() {
            exec_id = r.header("idempotency-execution-id").map(str::to_string);
        }
        let retry_after = r.header("retry-after").and_then(|v| v.parse::<u64>().ok());
        let kind = problem_type(&r);
        let status = r.status;
        last = Some(r);
        if status.is_success() {
            end = End::Result;
            break;
        }
        if status == StatusCode::CONFLICT
            && kind.ends_with(":outcome-unknown")
            && retry_after.is_none()
        {
            end = End::Unknown;
            break;
        }
        end = End::Other(format!("{status} {kind}"));
        if Instant::now() > give_up {
            break;
        }
        let wait = match retry_after {
            Some(s) => (s * 1000).min(1500),
            None => backoff,
        };
        sleep_ms(wait + t.jitter_ms / 2).await;
        backoff = (backoff * 2).min(800);
    }
    // Let any commit still on its way land before counting.
    sleep_ms(t.delay_ms + 150).await;
    drop(proxy);

    let Some(id) = exec_id else {
        problems.push("no answer carried an execution id".into());
        return Trial {
            reached,
            end,
            commits: ds.commits_for(key),
            problems,
        };
    };
    if b.items_to.is_some() {
        // A batch: every item's commits (under each item's own key), and each item's
        // answer must be its committed effect.
        let got: serde_json::Value = last
            .as_ref()
            .and_then(|r| serde_json::from_slice(&r.body).ok())
            .unwrap_or_default();
        let mut commits = 0;
        for item in got["items"].as_array().into_iter().flatten() {
            let item_id = item["execution_id"].as_str().unwrap_or_default();
            commits += ds.commits_for(item_id);
            match ds.messages_tagged(item_id).first() {
                Some(m) if m.to_json() == item["body"] => {}
                _ => problems.push(format!("item answer is not its committed effect: {item}")),
            }
        }
        return Trial {
            reached,
            end,
            commits,
            problems,
        };
    }
    let commits = ds.commits_for(&id);
    if end == End::Result {
        let got: serde_json::Value = last
            .as_ref()
            .and_then(|r| serde_json::from_slice(&r.body).ok())
            .unwrap_or_default();
        match ds.messages_tagged(&id).first() {
            Some(m) if m.to_json() == got => {}
            Some(m) => problems.push(format!(
                "result is not the committed effect: got {got}, committed {}",
                m.to_json()
            )),
            None => problems.push(format!("a result ({got}) but no committed effect")),
        }
        if let (Some(first), Some(final_)) = (&first_answer, &last) {
            if first.status.is_success() && first.body != final_.body {
                problems.push("the retry's result differs from the first answer".into());
            }
        }
    }
    Trial {
        reached,
        end,
        commits,
        problems,
    }
}

/// Totals of one cell over its trials.
#[derive(Default)]
struct CellReport {
    trials: usize,
    reached: usize,
    duplicates: usize,
    results: usize,
    unknown: usize,
    failures: Vec<String>,
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn every_failpoint_against_every_downstream_behaviour() {
    let trials = env_u64("CRASH_MATRIX_TRIALS", 1).max(1) as usize;
    let random = std::env::var("CRASH_MATRIX_TRIALS").is_ok();
    let seed = env_u64("CRASH_MATRIX_SEED", 20_260_101);
    let jobs = env_u64("CRASH_MATRIX_JOBS", 6).max(1) as usize;
    let all = behaviours();
    let started = Instant::now();

    // (cell index, trial) jobs, interleaved so slow cells spread over the workers.
    let cells: Vec<(usize, &'static str)> = (0..all.len())
        .flat_map(|b| POINTS.iter().map(move |p| (b, *p)))
        .collect();
    let queue: Mutex<VecDeque<(usize, usize)>> = Mutex::new(
        (0..trials)
            .flat_map(|t| (0..cells.len()).map(move |c| (c, t)))
            .collect(),
    );
    let reports: Mutex<Vec<CellReport>> =
        Mutex::new((0..cells.len()).map(|_| CellReport::default()).collect());

    std::thread::scope(|s| {
        for worker in 0..jobs {
            let (queue, reports, cells, all) = (&queue, &reports, &cells, &all);
            s.spawn(move || {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .expect("runtime");
                let ds = FakeDownstream::start_in_thread(([127, 0, 0, 1], 0).into())
                    .expect("fake downstream");
                loop {
                    let Some((ci, t)) = queue.lock().expect("queue").pop_front() else {
                        break;
                    };
                    let (bi, point) = cells[ci];
                    let b = &all[bi];
                    let mut rng = Rng::new(seed ^ ((ci as u64) << 32) ^ t as u64);
                    let timing = Timing::draw(&mut rng, random);
                    let key = format!("cm-{seed:x}-{ci}-{t}-{worker}");
                    let got = rt.block_on(trial(&ds, b, all, point, &key, timing));
                    let want = expect(point, b.name);
                    let mut failures = got.problems.clone();
                    // One side effect per item: a batch of n items commits n times.
                    let allowed = if b.items_to.is_some() {
                        want.commits
                    } else {
                        1
                    };
                    if got.commits > allowed {
                        failures.push(format!("{} commits: a duplicate side effect", got.commits));
                    }
                    if got.commits != want.commits {
                        failures.push(format!(
                            "{} commits, expected {}",
                            got.commits, want.commits
                        ));
                    }
                    if got.end != want.end {
                        failures.push(format!("ended {:?}, expected {:?}", got.end, want.end));
                    }
                    if got.reached != want.reached {
                        failures.push(format!(
                            "failpoint reached: {}, expected {}",
                            got.reached, want.reached
                        ));
                    }
                    let mut reports = reports.lock().expect("reports");
                    let r = &mut reports[ci];
                    r.trials += 1;
                    r.reached += usize::from(got.reached);
                    r.duplicates += got.commits.saturating_sub(allowed);
                    match got.end {
                        End::Result => r.results += 1,
                        End::Unknown => r.unknown += 1,
                        End::Other(_) => {}
                    }
                    for f in failures {
                        r.failures.push(format!("trial {t} ({timing:?}): {f}"));
                    }
                }
            });
        }
    });

    let reports = reports.into_inner().expect("reports");
    let mut table = String::new();
    let _ = writeln!(
        table,
        "| downstream behaviour | failpoint | trials | reached | duplicates | final state | expected | failures |"
    );
    let _ = writeln!(table, "|---|---|---:|---:|---:|---|---|---:|");
    let mut failed = Vec::new();
    let mut total_dups = 0;
    for ((bi, point), r) in cells.iter().zip(&reports) {
        let b = &all[*bi];
        let want = expect(point, b.name);
        let finals = match (r.results, r.unknown) {
            (n, 0) => format!("result ×{n}"),
            (0, n) => format!("outcome_unknown ×{n}"),
            (a, u) => format!("result ×{a}, outcome_unknown ×{u}"),
        };
        let others = r.trials - r.results - r.unknown;
        let finals = if others > 0 {
            format!("{finals}, other ×{others}")
        } else {
            finals
        };
        total_dups += r.duplicates;
        let _ = writeln!(
            table,
            "| {} | {} | {} | {} | {} | {} | {}, {} commit{} | {} |",
            b.name,
            point,
            r.trials,
            r.reached,
            r.duplicates,
            finals,
            want.end.label(),
            want.commits,
            if want.commits == 1 { "" } else { "s" },
            r.failures.len()
        );
        for f in &r.failures {
            failed.push(format!("{} × {}: {f}", b.name, point));
        }
    }
    let summary = format!(
        "{} cells × {} trials = {} runs in {:.0?} (seed {seed}, {jobs} jobs): {} duplicates, {} failed checks",
        cells.len(),
        trials,
        cells.len() * trials,
        started.elapsed(),
        total_dups,
        failed.len()
    );
    println!("{table}\n{summary}");
    if let Ok(path) = std::env::var("CRASH_MATRIX_REPORT") {
        let mut doc = String::new();
        let _ = writeln!(doc, "{summary}\n");
        let _ = writeln!(doc, "{table}");
        let _ = writeln!(doc, "Downstream behaviours:\n");
        for b in &all {
            let _ = writeln!(doc, "- `{}`: {} (fake path `{}`)", b.name, b.what, b.path);
        }
        std::fs::write(&path, doc).expect("write CRASH_MATRIX_REPORT");
    }
    assert!(
        failed.is_empty(),
        "{} failed checks:\n{}",
        failed.len(),
        failed.join("\n")
    );
}
