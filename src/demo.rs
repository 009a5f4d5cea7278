//! `idemproxy demo`: a self-contained demonstration of the article's failure. A real
//! proxy process (this binary, `serve`), the bundled fake downstream, and a scripted
//! agent whose tool call keeps failing at the worst moment. The proxy is killed with
//! SIGKILL twice; the user still gets exactly one email per logical tool call.

#[path = "../fixtures/fake_downstream.rs"]
mod fake_downstream;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use fake_downstream::FakeDownstream;

struct ProxyChild {
    child: Child,
    addr: String,
}

impl ProxyChild {
    fn start(config: &std::path::Path) -> anyhow::Result<ProxyChild> {
        let exe = std::env::current_exe().context("locating the idemproxy binary")?;
        let mut child = Command::new(exe)
            .args(["serve", "--config"])
            .arg(config)
            .env("IDEMPROXY_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("starting the proxy")?;
        let out = child.stdout.take().context("proxy stdout")?;
        let mut line = String::new();
        BufReader::new(out).read_line(&mut line)?;
        let Some(addr) = line.trim().strip_prefix("idemproxy listening on ") else {
            let _ = child.kill();
            bail!("the proxy did not start (printed {line:?})");
        };
        Ok(ProxyChild {
            addr: addr.to_string(),
            child,
        })
    }

    fn sigkill(mut self) -> anyhow::Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }
}

impl Drop for ProxyChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

type DemoClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

/// One tool call as the agent's HTTP client makes it, with its own timeout (the agent
/// "crashing" before the result reaches the model is a timeout here).
async fn tool_call(
    c: &DemoClient,
    addr: &str,
    call_id: &str,
    to: &str,
    timeout: Duration,
) -> Option<(u16, String, Option<String>)> {
    let req = http::Request::post(format!("http://{addr}/mail/send"))
        .header("content-type", "application/json")
        .header("authorization", "Bearer demo-user")
        .header("x-operation-id", "op_77")
        .header("x-model-round", "round_3")
        .header("x-tool-call-id", call_id)
        .body(Full::new(Bytes::from(format!(
            r#"{{"to":"{to}","subject":"Your receipt"}}"#
        ))))
        .ok()?;
    let resp = tokio::time::timeout(timeout, async {
        let resp = c.request(req).await.ok()?;
        let status = resp.status().as_u16();
        let replayed = resp
            .headers()
            .get("idempotent-replayed")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let body = resp.into_body().collect().await.ok()?.to_bytes();
        Some((
            status,
            String::from_utf8_lossy(&body).into_owned(),
            replayed,
        ))
    })
    .await;
    resp.ok().flatten()
}

pub async fn run() -> anyhow::Result<()> {
    let dir = tempfile::tempdir().context("temporary directory")?;
    let ds = FakeDownstream::start_in_thread("127.0.0.1:0".parse().expect("literal address"))?;
    let config = dir.path().join("demo.yaml");
    std::fs::write(
        &config,
        format!(
            "listen: 127.0.0.1:0\nstore: {{ path: {}/demo.redb }}\nidentity:\n  derive_from: [X-Operation-Id, X-Model-Round, X-Tool-Call-Id]\nupstreams:\n  - name: mail\n    url: {}\n    routes:\n      - name: send_email\n        match: {{ method: POST, path: /send }}\n        reconcile: {{ path: \"/messages?tag={{execution_id}}\", found: {{ status: 200, json_nonempty: /data }}, not_found: {{ status: 200, json_empty: /data }} }}\n",
            dir.path().display(),
            ds.url()
        ),
    )?;
    let c: DemoClient = Client::builder(TokioExecutor::new()).build_http();
    println!(
        "idemproxy demo: an agent sends emails through the proxy to a fake mail API ({})\n",
        ds.url()
    );

    println!("1. The mail API is slow (600 ms). The agent's tool call gives up after 200 ms:");
    println!("   the email goes out, but the result never reaches the model.");
    ds.set_delay(Duration::from_millis(600));
    let proxy = ProxyChild::start(&config)?;
    let first = tool_call(
        &c,
        &proxy.addr,
        "call_123",
        "ada@example.com",
        Duration::from_millis(200),
    )
    .await;
    println!(
        "   attempt 1: {}",
        if first.is_none() {
            "timed out (agent crashed)"
        } else {
            "answered"
        }
    );
    tokio::time::sleep(Duration::from_millis(700)).await;
    println!("   emails sent so far: {}", ds.commits());

    println!(
        "\n2. Then the proxy itself is killed with SIGKILL, and restarted on the same redb file."
    );
    proxy.sigkill()?;
    let proxy = ProxyChild::start(&config)?;

    println!("\n3. The workflow retries the same tool call (same operation, round and call id):");
    ds.set_delay(Duration::ZERO);
    match tool_call(
        &c,
        &proxy.addr,
        "call_123",
        "ada@example.com",
        Duration::from_secs(5),
    )
    .await
    {
        Some((status, body, replayed)) => println!(
            "   attempt 2: {status} replayed={} body={body}",
            replayed.as_deref().unwrap_or("false")
        ),
        None => println!("   attempt 2: no answer"),
    }
    println!("   emails sent so far: {}", ds.commits());

    println!("\n4. A second tool call; this time the proxy is SIGKILLed while the mail API is still working.");
    ds.set_delay(Duration::from_millis(500));
    let pending = tool_call(
        &c,
        &proxy.addr,
        "call_124",
        "grace@example.com",
        Duration::from_millis(150),
    )
    .await;
    println!(
        "   attempt 1: {}",
        if pending.is_none() {
            "no answer"
        } else {
            "answered"
        }
    );
    proxy.sigkill()?;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let proxy = ProxyChild::start(&config)?;
    ds.set_delay(Duration::ZERO);
    println!("   the restarted proxy finds the record `executing` -> `outcome_unknown`: it may or may not have been sent;");
    println!("   it reconciles by looking the message up by its tag (the execution id) before sending anything again.");
    let mut attempts = 3;
    for attempt in 2..=4 {
        attempts += 1;
        match tool_call(
            &c,
            &proxy.addr,
            "call_124",
            "grace@example.com",
            Duration::from_secs(5),
        )
        .await
        {
            Some((status, body, replayed)) => {
                println!(
                    "   attempt {attempt}: {status} replayed={} body={body}",
                    replayed.as_deref().unwrap_or("false")
                );
                if status < 300 {
                    break;
                }
            }
            None => println!("   attempt {attempt}: no answer"),
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    drop(proxy);

    let sent = ds.commits();
    println!(
        "\nTwo logical tool calls, {attempts} attempts, two proxy crashes: {sent} emails sent."
    );
    if sent != 2 {
        bail!("expected exactly 2 emails, the mail API saw {sent}");
    }
    println!("Without the proxy every retry would have been another email.");
    Ok(())
}
