//! Integration harness: runs the real `idemproxy` binary on an ephemeral port against the
//! fake downstream in `fixtures/`, and talks to it over real HTTP.
#![allow(dead_code)]

#[path = "../../fixtures/fake_downstream.rs"]
pub mod fake_downstream;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;

pub const BIN: &str = env!("CARGO_BIN_EXE_idemproxy");

/// A proxy process under test.
pub struct ProxyProc {
    child: Child,
    pub addr: SocketAddr,
    /// The admin listener, when the config has an `admin` block.
    pub admin_addr: Option<SocketAddr>,
    pub config_path: PathBuf,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl ProxyProc {
    /// Write `yaml` to `dir/idemproxy.yaml` and start `idemproxy serve` on it. The YAML
    /// should use `listen: 127.0.0.1:0` (and `admin.listen: 127.0.0.1:0`); the bound
    /// addresses are read from stdout.
    pub fn start(dir: &Path, yaml: &str) -> ProxyProc {
        Self::start_with_env(dir, yaml, &[])
    }

    pub fn start_with_env(dir: &Path, yaml: &str, env: &[(&str, &str)]) -> ProxyProc {
        let config_path = dir.join("idemproxy.yaml");
        std::fs::write(&config_path, yaml).expect("write config");
        let mut cmd = Command::new(BIN);
        cmd.arg("serve")
            .arg("--config")
            .arg(&config_path)
            .env("IDEMPROXY_LOG", "idemproxy=debug,info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn idemproxy");
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let err_pipe = child.stderr.take().expect("piped stderr");
        let sink = stderr.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(err_pipe).lines().map_while(Result::ok) {
                sink.lock().expect("stderr lock").push(line);
            }
        });
        let out = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(out).lines();
            let mut admin: Option<SocketAddr> = None;
            while let Some(Ok(line)) = lines.next() {
                // The admin line is printed before the proxy line.
                if let Some(addr) = line.strip_prefix("idemproxy admin listening on ") {
                    admin = Some(addr.trim().parse().expect("printed admin address parses"));
                } else if let Some(addr) = line.strip_prefix("idemproxy listening on ") {
                    let addr: SocketAddr = addr.trim().parse().expect("printed address parses");
                    let _ = tx.send((addr, admin));
                }
            }
        });
        let (addr, admin_addr) = match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(a) => a,
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "idemproxy did not start; stderr:\n{}",
                    stderr.lock().expect("lock").join("\n")
                );
            }
        };
        ProxyProc {
            child,
            addr,
            admin_addr,
            config_path,
            stderr,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// A URL on the admin listener (panics when the config has no `admin` block).
    pub fn admin_url(&self, path: &str) -> String {
        let addr = self
            .admin_addr
            .expect("this proxy was started without an admin block");
        format!("http://{addr}{path}")
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL: no cleanup, no drain, exactly like a crash.
    pub fn kill(mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reap");
    }

    /// Send a signal by name (`HUP`, `STOP`, `CONT`, `TERM`) with kill(1).
    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([format!("-{sig}"), self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(ok.success(), "kill -{sig} failed");
    }

    /// SIGTERM and wait for a clean exit.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        self.signal("TERM");
        let deadline = Instant::now() + Duration::from_secs(40);
        loop {
            if let Some(st) = self.child.try_wait().expect("try_wait") {
                return st;
            }
            assert!(
                Instant::now() < deadline,
                "proxy did not exit after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The captured stderr, still readable after [`ProxyProc::kill`] consumed the process.
    pub fn stderr_handle(&self) -> Arc<Mutex<Vec<String>>> {
        self.stderr.clone()
    }

    pub fn stderr_lines(&self) -> Vec<String> {
        self.stderr.lock().expect("lock").clone()
    }

    /// Wait until a stderr line contains `needle`.
    pub fn wait_for_log(&self, needle: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.stderr_lines().iter().any(|l| l.contains(needle)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!(
            "no log line containing {needle:?}; stderr:\n{}",
            self.stderr_lines().join("\n")
        );
    }
}

impl Drop for ProxyProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Run the CLI with arguments; returns its output.
pub fn cli(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .output()
        .expect("run idemproxy")
}

/// A response as a test sees it.
#[derive(Debug)]
pub struct Resp {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Resp {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {:?}", self.body))
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    pub fn problem_type(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "not a problem: {self:?}"
        );
        self.json()["type"].as_str().unwrap_or_default().to_string()
    }
}

pub type TestClient = Client<HttpConnector, Full<Bytes>>;

pub fn client() -> TestClient {
    Client::builder(TokioExecutor::new()).build_http()
}

pub fn h2_client() -> TestClient {
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http()
}

pub async fn send(
    c: &TestClient,
    method: Method,
    url: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Resp {
    let mut req = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request builds");
    let resp = c.request(req).await.expect("proxy answers");
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.expect("body").to_bytes();
    Resp {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

pub async fn post(c: &TestClient, url: &str, headers: &[(&str, &str)], body: &str) -> Resp {
    let mut h: Vec<(&str, &str)> = vec![("content-type", "application/json")];
    h.extend_from_slice(headers);
    send(c, Method::POST, url, &h, body).await
}

/// The standard test config: a `mail` upstream on the fake downstream, a dead upstream.
pub fn config(dir: &Path, downstream: &str) -> String {
    format!(
        r#"listen: 127.0.0.1:0
store: {{ backend: redb, path: {dir}/store.redb, retention: 1h }}
limits: {{ max_body_bytes: 4096, max_key_bytes: 64 }}
identity:
  key_header: Idempotency-Key
  derive_from: [X-Operation-Id, X-Model-Round, X-Tool-Call-Id]
  tenant_from: [Authorization]
upstreams:
  - name: mail
    url: {downstream}
    mount: /mail
    routes:
      - name: send_email
        match: {{ method: POST, path: /send }}
        tool_version: v1
        fingerprint: {{ ignore_json: [/client_ts] }}
      - {{ name: send_keyed, match: {{ method: POST, path: /keyed/send }}, concurrent: wait }}
      - {{ name: drop, match: {{ method: POST, path: /drop-after-commit/send }} }}
      - {{ name: hang, match: {{ method: POST, path: /timeout-after-commit/send }}, timeout: 500ms }}
      - {{ name: fail_before, match: {{ method: POST, path: /fail-before-commit/send }}, on_5xx: failed_before_commit }}
      - {{ name: fail_after, match: {{ method: POST, path: /fail-after-commit/send }} }}
      - {{ name: echo, match: {{ method: POST, path: "/echo/{{what}}" }}, key_required: false }}
      - {{ name: get_message, match: {{ method: GET, path: "/messages/{{id}}" }}, class: read_only }}
      - {{ name: flaky, match: {{ method: GET, path: /flaky }}, class: read_only, retry: {{ attempts: 3, backoff_ms: 5 }} }}
  - name: dead
    url: http://127.0.0.1:1
    mount: /dead
    routes:
      - {{ name: send, match: {{ method: POST, path: /send }} }}
"#,
        dir = dir.display()
    )
}

/// Run `idemproxy records list` against a stopped proxy's config; returns stdout lines.
pub fn records(config: &Path) -> Vec<String> {
    records_limit(config, 50)
}

/// `records list --limit N`: the table rows without the header.
pub fn records_limit(config: &Path, limit: usize) -> Vec<String> {
    let limit = limit.to_string();
    let out = cli(&[
        "records",
        "list",
        "--limit",
        &limit,
        "--config",
        config.to_str().expect("utf-8 path"),
    ]);
    assert!(
        out.status.success(),
        "records list failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .skip(1)
        .map(str::to_string)
        .collect()
}

/// Wait (at most 5 s) until the fake downstream has received a request on `path`.
pub async fn wait_for_hit(ds: &fake_downstream::FakeDownstream, path: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while ds.hits_on(path) == 0 {
        assert!(
            Instant::now() < deadline,
            "no request reached the downstream on {path}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The admin token tests start the proxy with (in the variable [`ADMIN_TOKEN_ENV`]).
pub const ADMIN_TOKEN: &str = "admin-token-for-tests-0123456789";
pub const ADMIN_TOKEN_ENV: &str = "IDEMPROXY_TEST_ADMIN_TOKEN";

/// A config with an admin listener: `mail` (plain and drop-after-commit sends), `pay`
/// (approval required, preview `/amount` and `/to`) and `quickpay` (approval expiring
/// after 300 ms), all on the fake downstream.
pub fn admin_config(dir: &Path, downstream: &str) -> String {
    format!(
        r#"listen: 127.0.0.1:0
admin: {{ listen: 127.0.0.1:0, token_env: {ADMIN_TOKEN_ENV} }}
store: {{ backend: redb, path: {dir}/store.redb, retention: 1h }}
identity:
  key_header: Idempotency-Key
  derive_from: [X-Operation-Id, X-Model-Round, X-Tool-Call-Id]
  tenant_from: [Authorization]
upstreams:
  - name: mail
    url: {downstream}
    mount: /mail
    routes:
      - {{ name: send_email, match: {{ method: POST, path: /send }} }}
      - {{ name: drop, match: {{ method: POST, path: /drop-after-commit/send }} }}
  - name: pay
    url: {downstream}
    mount: /pay
    routes:
      - name: transfer
        match: {{ method: POST, path: /send }}
        approval: {{ required: true, preview: [/amount, /to] }}
  - name: quickpay
    url: {downstream}
    mount: /quickpay
    routes:
      - name: transfer
        match: {{ method: POST, path: /send }}
        approval: {{ required: true, preview: [/amount], expires: 300ms }}
"#,
        dir = dir.display()
    )
}

/// One trial of a fault test, as a line `scripts/faults.sh` collects into the fault table
/// of docs/RELIABILITY.md: side effects beyond the expected ones (`duplicates`), calls
/// whose result a client could not get afterwards (`lost`), and how long after the fault
/// ended the proxy answered normally again (`recovered`; `None` where only a restart
/// helps or there is nothing to recover from). Printed before the test's own assertions,
/// so a failing trial still reports what it saw.
pub fn report_fault(
    fault: &str,
    duplicates: usize,
    lost: usize,
    recovered: Option<Duration>,
    note: &str,
) {
    let recovered = recovered.map_or("-".to_string(), |d| d.as_millis().to_string());
    eprintln!("FAULT\t{fault}\t{duplicates}\t{lost}\t{recovered}\t{note}");
}

/// The variable PostgreSQL tests read the server's URL from.
pub const URL_VAR: &str = "IDEMPROXY_TEST_POSTGRES_URL";

/// A fresh PostgreSQL schema for one test, dropped when the guard goes away. Fails loudly
/// (never skips) when the server's URL is not set.
pub struct Schema {
    pub name: String,
    pub url: String,
}

impl Schema {
    pub fn new(tag: &str) -> Schema {
        let url = std::env::var(URL_VAR).unwrap_or_else(|_| {
            panic!("{URL_VAR} is not set: these tests need a real PostgreSQL server (e.g. postgres://postgres@127.0.0.1:5432/test)")
        });
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_nanos();
        Schema {
            name: format!("it_{tag}_{}_{}", std::process::id(), nanos % 1_000_000_000),
            url,
        }
    }
}

impl Drop for Schema {
    fn drop(&mut self) {
        let (url, name) = (self.url.clone(), self.name.clone());
        // Runs on its own thread: Drop may happen inside the test's runtime.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                if let Ok((client, conn)) =
                    tokio_postgres::connect(&url, tokio_postgres::NoTls).await
                {
                    tokio::spawn(conn);
                    let _ = client
                        .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE"))
                        .await;
                }
            });
        })
        .join();
    }
}
