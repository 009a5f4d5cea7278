//! MCP tool calls (SPEC section 11) against the real binary, with the official MCP Python
//! SDK on both sides: `fixtures/mcp/server.py` is the server (streamable HTTP, one
//! instance answering JSON, one answering SSE) and `fixtures/mcp/driver.py` drives the
//! SDK's streamable HTTP client through the proxy. The SDK lives in `target/mcp-venv`,
//! which `scripts/test.sh` creates from `fixtures/mcp/requirements.txt`; the tests fail
//! (never skip) without it.

mod common;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::fake_downstream::FakeDownstream;
use common::{
    cli, client, post, send, ProxyProc, Resp, Schema, TestClient, ADMIN_TOKEN, ADMIN_TOKEN_ENV,
    URL_VAR,
};
use http::{Method, StatusCode};
use serde_json::{json, Value};

fn venv_python() -> PathBuf {
    let venv = std::env::var_os("IDEMPROXY_MCP_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/target/mcp-venv")));
    let python = venv.join("bin/python");
    assert!(
        python.is_file(),
        "no MCP SDK venv at {}: run scripts/test.sh, or `python3 -m venv target/mcp-venv && \
         target/mcp-venv/bin/pip install -r fixtures/mcp/requirements.txt`",
        venv.display()
    );
    python
}

fn fixture(name: &str) -> String {
    format!("{}/fixtures/mcp/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// A fixture MCP server process (killed on drop).
struct McpServer {
    child: Child,
    port: u16,
}

impl McpServer {
    fn start(mode: &str) -> McpServer {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let mut child = Command::new(venv_python())
            .arg(fixture("server.py"))
            .arg(port.to_string())
            .arg(mode)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the MCP fixture server");
        let out = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if line.starts_with("ready ") {
                    let _ = tx.send(());
                }
            }
        });
        rx.recv_timeout(Duration::from_secs(30))
            .expect("the MCP fixture server did not start");
        McpServer { child, port }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for McpServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn config(dir: &std::path::Path, json: &str, sse: &str, fake: &str) -> String {
    let store = format!(
        "{{ backend: redb, path: {}/store.redb, retention: 1h }}",
        dir.display()
    );
    config_on(&store, json, sse, fake)
}

fn config_on(store: &str, json: &str, sse: &str, fake: &str) -> String {
    format!(
        r#"listen: 127.0.0.1:0
admin: {{ listen: 127.0.0.1:0, token_env: {ADMIN_TOKEN_ENV} }}
store: {store}
identity:
  derive_from_meta: [io.idemproxy/operation_id, io.idemproxy/model_round, io.idemproxy/tool_call_id]
upstreams:
  - name: tools
    url: {json}
    mount: /json
    protocol: mcp
    mcp:
      tools:
        send_email: {{ class: side_effect, tool_version: v1 }}
        search_docs: {{ class: read_only }}
        stats: {{ class: read_only }}
  - name: tools_sse
    url: {sse}
    mount: /sse
    protocol: mcp
    mcp:
      tools:
        search_docs: {{ class: read_only }}
        stats: {{ class: read_only }}
  - name: guarded
    url: {json}
    mount: /guarded
    protocol: mcp
    mcp:
      unlisted: reject
      tools:
        send_email: {{ approval: {{ required: true, preview: [/to] }} }}
        stats: {{ class: read_only }}
  - name: bulk
    url: {json}
    mount: /bulk
    protocol: mcp
    mcp:
      unlisted: reject
      tools:
        send_email:
          approval: {{ required: true, preview: [/subject] }}
          batch: {{ items: /to, mode: atomic, max_items: 2 }}
  - name: recon
    url: {json}
    mount: /recon
    protocol: mcp
    mcp:
      unlisted: reject
      tools:
        slow_commit:
          timeout: 300ms
          reconcile:
            tool: find_email
            arguments: {{ tag: "{{execution_id}}" }}
            found: {{ json_nonempty: /structuredContent/items }}
            not_found: {{ json_empty: /structuredContent/items }}
        find_email: {{ class: read_only }}
        stats: {{ class: read_only }}
  - name: hinted
    url: {json}
    mount: /hinted
    protocol: mcp
    mcp:
      unlisted: by_annotations
  - name: flaky
    url: {fake}
    mount: /flaky
    protocol: mcp
"#
    )
}

struct World {
    _dir: tempfile::TempDir,
    _schema: Option<Schema>,
    json: McpServer,
    sse: McpServer,
    fake: FakeDownstream,
    proxy: ProxyProc,
}

async fn world() -> World {
    world_on(None).await
}

/// The fixtures and a proxy on redb, or on PostgreSQL in `schema`.
async fn world_on(schema: Option<Schema>) -> World {
    let json = McpServer::start("json");
    let sse = McpServer::start("sse");
    let fake = FakeDownstream::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let yaml = match &schema {
        None => config(dir.path(), &json.url(), &sse.url(), &fake.url()),
        Some(s) => config_on(
            &format!(
                "{{ backend: postgres, url_env: {URL_VAR}, schema: {}, retention: 1h }}",
                s.name
            ),
            &json.url(),
            &sse.url(),
            &fake.url(),
        ),
    };
    let proxy = ProxyProc::start_with_env(dir.path(), &yaml, &[(ADMIN_TOKEN_ENV, ADMIN_TOKEN)]);
    World {
        _dir: dir,
        _schema: schema,
        json,
        sse,
        fake,
        proxy,
    }
}

fn tool_call(id: Value, name: &str, arguments: Value, call_id: Option<&str>) -> String {
    let mut params = json!({ "name": name, "arguments": arguments });
    if let Some(call_id) = call_id {
        params["_meta"] = json!({
            "io.idemproxy/operation_id": "op_9",
            "io.idemproxy/model_round": "1",
            "io.idemproxy/tool_call_id": call_id,
        });
    }
    json!({ "jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params }).to_string()
}

async fn rpc(c: &TestClient, url: &str, body: &str) -> Resp {
    post(
        c,
        url,
        &[
            ("accept", "application/json, text/event-stream"),
            ("mcp-protocol-version", "2025-06-18"),
        ],
        body,
    )
    .await
}

async fn executions(c: &TestClient, w: &World, tool: &str) -> u64 {
    let r = rpc(
        c,
        &format!("{}/mcp", w.json.url()),
        &tool_call(json!(1), "stats", json!({}), None),
    )
    .await;
    let text = r.json()["result"]["content"][0]["text"]
        .as_str()
        .expect("stats text")
        .to_string();
    let stats: Value = serde_json::from_str(&text).expect("stats JSON");
    stats["executions"][tool].as_u64().expect("a count")
}

/// The SDK's client through the proxy: retries with new JSON-RPC ids (and new sessions)
/// run once and get the same result under their own id; changed arguments and a missing
/// identity are JSON-RPC errors with nothing executed; read-only tools and `tools/list`
/// pass through; an SSE answer is stored and replayed; `isError: true` is committed; a
/// batch with a side effect is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_sdk_client_gets_exactly_once_tool_calls() {
    let w = world().await;
    let out = tokio::task::spawn_blocking({
        let (proxy, json, sse) = (
            w.proxy.url(""),
            format!("{}/mcp", w.json.url()),
            format!("{}/mcp", w.sse.url()),
        );
        move || {
            Command::new(venv_python())
                .arg(fixture("driver.py"))
                .args([proxy, json, sse])
                .output()
                .expect("run the MCP driver")
        }
    })
    .await
    .expect("driver task");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.lines().last() == Some("ok"),
        "driver failed:\n{stdout}\n{}\nproxy stderr:\n{}",
        String::from_utf8_lossy(&out.stderr),
        w.proxy.stderr_lines().join("\n")
    );
    println!("{stdout}");
}

/// The official TypeScript SDK's client (`fixtures/mcp/ts`, installed by scripts/test.sh)
/// against the Python server through the proxy: a retry runs once, changed arguments are
/// refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_typescript_sdk_client_gets_the_first_result() {
    let modules = fixture("ts/node_modules/@modelcontextprotocol/sdk");
    assert!(
        std::path::Path::new(&modules).is_dir(),
        "no MCP TypeScript SDK at {modules}: run scripts/test.sh (npm ci in fixtures/mcp/ts)"
    );
    let w = world().await;
    let url = w.proxy.url("/json/mcp");
    let out = tokio::task::spawn_blocking(move || {
        Command::new("node")
            .arg(fixture("ts/client.mjs"))
            .arg(url)
            .output()
            .expect("run node")
    })
    .await
    .expect("node task");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.lines().last() == Some("ok"),
        "TypeScript client failed:\n{stdout}\n{}\nproxy stderr:\n{}",
        String::from_utf8_lossy(&out.stderr),
        w.proxy.stderr_lines().join("\n")
    );
    println!("{stdout}");
    assert_eq!(executions(&client(), &w, "send_email").await, 1);
}

/// The wire as a plain HTTP client sees it: the session header passes through, the
/// downstream gets the execution id as `Idempotency-Key` and in `params._meta`, an
/// approval round-trips through the admin API, an unlisted tool under `unlisted: reject`
/// is refused, and a connection dropped after the tool committed is `outcome_unknown`
/// and never re-sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wire_approval_reject_and_dropped_connection() {
    wire(world().await).await;
}

/// The same on the PostgreSQL store (`IDEMPROXY_TEST_POSTGRES_URL`, a schema of its own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wire_on_postgres() {
    wire(world_on(Some(Schema::new("mcp"))).await).await;
}

async fn wire(w: World) {
    let c = client();

    // initialize through the proxy: the session id comes back untouched.
    let init = rpc(
        &c,
        &w.proxy.url("/sse/mcp"),
        &json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "raw", "version": "1"}}})
        .to_string(),
    )
    .await;
    assert_eq!(init.status, StatusCode::OK, "{init:?}");
    assert!(init.header("mcp-session-id").is_some(), "{init:?}");

    // Approval: the first call is held with a JSON-RPC error carrying args_hash and preview.
    let url = w.proxy.url("/guarded/mcp");
    let args = json!({ "to": "zed@example.com", "subject": "wire" });
    let held = rpc(
        &c,
        &url,
        &tool_call(json!("a1"), "send_email", args.clone(), Some("call_9")),
    )
    .await;
    assert_eq!(held.status, StatusCode::OK, "{held:?}");
    let held = held.json();
    assert_eq!(held["id"], "a1");
    assert_eq!(held["error"]["code"], -32006, "{held}");
    let data = &held["error"]["data"];
    assert_eq!(data["type"], "urn:idemproxy:problem:approval-required");
    assert_eq!(data["preview"]["/to"], "zed@example.com", "{held}");
    let (id, hash) = (
        data["execution_id"]
            .as_str()
            .expect("execution_id")
            .to_string(),
        data["args_hash"].as_str().expect("args_hash").to_string(),
    );
    assert_eq!(executions(&c, &w, "send_email").await, 0);
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let ok = post(
        &c,
        &w.proxy.admin_url(&format!("/v1/executions/{id}/approve")),
        &[("authorization", &auth)],
        &json!({ "args_hash": hash, "by": "alice" }).to_string(),
    )
    .await;
    assert_eq!(ok.status, StatusCode::OK, "{ok:?}");

    // A batch tool (atomic, items in `arguments`): the approver sees how many items it
    // carries; more than max_items is a JSON-RPC error before anything is recorded.
    let bulk = w.proxy.url("/bulk/mcp");
    let two = json!({ "to": ["a@example.com", "b@example.com"], "subject": "bulk" });
    let held = rpc(
        &c,
        &bulk,
        &tool_call(json!("b1"), "send_email", two, Some("call_b1")),
    )
    .await;
    let held = held.json();
    assert_eq!(held["error"]["code"], -32006, "{held}");
    assert_eq!(
        held["error"]["data"]["preview"],
        json!({ "/subject": "bulk", "items": 2 }),
        "{held}"
    );
    let three =
        json!({ "to": ["a@example.com", "b@example.com", "c@example.com"], "subject": "bulk" });
    let big = rpc(
        &c,
        &bulk,
        &tool_call(json!("b2"), "send_email", three, Some("call_b2")),
    )
    .await;
    let big = big.json();
    assert_eq!(big["id"], "b2", "{big}");
    assert_eq!(big["error"]["code"], -32015, "{big}");
    assert_eq!(
        big["error"]["data"]["type"],
        "urn:idemproxy:problem:batch-too-large"
    );

    let ran = rpc(
        &c,
        &url,
        &tool_call(json!(2), "send_email", args.clone(), Some("call_9")),
    )
    .await;
    assert_eq!(ran.json()["id"], 2, "{ran:?}");
    assert_eq!(
        ran.json()["result"]["structuredContent"]["to"],
        "zed@example.com",
        "{ran:?}"
    );
    assert_eq!(ran.header("idempotency-execution-id"), Some(id.as_str()));
    let again = rpc(
        &c,
        &url,
        &tool_call(json!(3), "send_email", args, Some("call_9")),
    )
    .await;
    assert_eq!(
        again.header("idempotent-replayed"),
        Some("true"),
        "{again:?}"
    );
    assert_eq!(again.json()["result"], ran.json()["result"]);
    assert_eq!(again.json()["id"], 3);
    assert_eq!(executions(&c, &w, "send_email").await, 1);

    // A repeated member name could make the server read a call the proxy did not see:
    // refused, nothing sent.
    let sneaky = rpc(
        &c,
        &url,
        r#"{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"stats","name":"send_email","arguments":{"to":"x","subject":"y"}}}"#,
    )
    .await;
    assert_eq!(sneaky.status, StatusCode::BAD_REQUEST, "{sneaky:?}");
    assert_eq!(sneaky.json()["error"]["code"], -32700, "{sneaky:?}");
    // So could routing headers that name another tool than the body.
    let body = tool_call(json!(6), "stats", json!({}), None);
    let routed = post(
        &c,
        &url,
        &[
            ("accept", "application/json, text/event-stream"),
            ("mcp-protocol-version", "2026-07-28"),
            ("mcp-method", "tools/call"),
            ("mcp-name", "send_email"),
        ],
        &body,
    )
    .await;
    assert_eq!(routed.status, StatusCode::BAD_REQUEST, "{routed:?}");
    assert_eq!(executions(&c, &w, "send_email").await, 1);

    // unlisted: reject.
    let refused = rpc(
        &c,
        &url,
        &tool_call(json!(4), "fail_email", json!({"to": "x"}), Some("call_10")),
    )
    .await;
    assert_eq!(refused.json()["error"]["code"], -32014, "{refused:?}");
    assert_eq!(executions(&c, &w, "fail_email").await, 0);

    // The downstream key, and a connection dropped after the effect committed.
    let url = w.proxy.url("/flaky/drop-after-commit/send");
    let body = tool_call(json!(5), "transfer", json!({"amount": 5}), Some("call_11"));
    let lost = rpc(&c, &url, &body).await;
    assert_eq!(lost.status, StatusCode::OK, "{lost:?}");
    let lost = lost.json();
    assert_eq!(lost["error"]["code"], -32005, "{lost}");
    let id = lost["error"]["data"]["execution_id"]
        .as_str()
        .expect("id")
        .to_string();
    let seen = w
        .fake
        .last_request("/drop-after-commit/send")
        .expect("the fake saw the call");
    assert_eq!(seen.header_values("idempotency-key"), vec![id.clone()]);
    let sent: Value = serde_json::from_slice(&seen.body).expect("JSON body");
    assert_eq!(
        sent["params"]["_meta"]["io.idemproxy/execution_id"],
        id.as_str()
    );
    assert_eq!(
        sent["params"]["_meta"]["io.idemproxy/tool_call_id"],
        "call_11"
    );
    assert_eq!(sent["params"]["arguments"]["amount"], 5);
    let retry = rpc(
        &c,
        &url,
        &tool_call(json!(6), "transfer", json!({"amount": 5}), Some("call_11")),
    )
    .await;
    assert_eq!(retry.json()["error"]["code"], -32005, "{retry:?}");
    assert_eq!(retry.json()["id"], 6);
    assert_eq!(w.fake.commits(), 1, "never re-sent blindly");

    // unlisted: by_annotations: the server's readOnlyHint makes search_docs read-only
    // (passed through, no record); send_email has no hint and is protected.
    let url = w.proxy.url("/hinted/mcp");
    let read = rpc(
        &c,
        &url,
        &tool_call(json!(20), "search_docs", json!({"query": "q"}), None),
    )
    .await;
    assert_eq!(read.status, StatusCode::OK, "{read:?}");
    assert!(read.json()["result"].is_object(), "{read:?}");
    assert_eq!(read.header("idempotency-execution-id"), None, "{read:?}");
    let keyless = rpc(
        &c,
        &url,
        &tool_call(
            json!(21),
            "send_email",
            json!({"to": "h", "subject": "s"}),
            None,
        ),
    )
    .await;
    assert_eq!(keyless.json()["error"]["code"], -32001, "{keyless:?}");

    // reconcile.tool: the answer never came (timeout), the retry asks the lookup tool,
    // which finds the effect: committed with the lookup's result, executed once.
    let url = w.proxy.url("/recon/mcp");
    let body = tool_call(
        json!(8),
        "slow_commit",
        json!({"to": "gus"}),
        Some("call_13"),
    );
    let lost = rpc(&c, &url, &body).await;
    assert_eq!(lost.json()["error"]["code"], -32005, "{lost:?}");
    let id = lost.json()["error"]["data"]["execution_id"]
        .as_str()
        .expect("id")
        .to_string();
    let found = rpc(
        &c,
        &url,
        &tool_call(
            json!(9),
            "slow_commit",
            json!({"to": "gus"}),
            Some("call_13"),
        ),
    )
    .await;
    let v = found.json();
    assert_eq!(v["id"], 9, "{v}");
    assert_eq!(
        v["result"]["structuredContent"]["items"],
        json!([id]),
        "{v}"
    );
    assert_eq!(found.header("idempotent-replayed"), Some("true"));
    assert_eq!(found.header("idempotency-reconciled"), Some("lookup"));
    assert_eq!(executions(&c, &w, "slow_commit").await, 1);

    // The record keeps what params._meta named and the derived key, and is found by them.
    let bearer = format!("Bearer {ADMIN_TOKEN}");
    let listed = send(
        &c,
        http::Method::GET,
        &w.proxy.admin_url("/v1/executions?tool_call=call_13"),
        &[("authorization", &bearer)],
        "",
    )
    .await
    .json();
    assert_eq!(
        listed["items"].as_array().map(Vec::len),
        Some(1),
        "{listed}"
    );
    let item = &listed["items"][0];
    assert_eq!(item["execution_id"], id.as_str(), "{item}");
    assert_eq!(item["operation_id"], "op_9", "{item}");
    assert_eq!(item["model_round"], "1", "{item}");
    assert!(
        item["key"]
            .as_str()
            .is_some_and(|k| k.starts_with("op_9:1:call_13:slow_commit:")),
        "{item}"
    );

    // Cancelling the operation named in params._meta stops its calls before sending.
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let cancel = post(
        &c,
        &w.proxy.admin_url("/v1/operations/op_9/cancel"),
        &[("authorization", &auth)],
        &json!({ "by": "dave" }).to_string(),
    )
    .await;
    assert_eq!(cancel.status, StatusCode::OK, "{cancel:?}");
    let hits = w.fake.hits();
    let stopped = rpc(
        &c,
        &w.proxy.url("/flaky/send"),
        &tool_call(json!(7), "transfer", json!({"amount": 7}), Some("call_12")),
    )
    .await;
    assert_eq!(stopped.json()["error"]["code"], -32008, "{stopped:?}");
    assert_eq!(
        stopped.json()["error"]["data"]["type"],
        "urn:idemproxy:problem:cancelled"
    );
    assert_eq!(
        w.fake.hits(),
        hits,
        "nothing sent under a cancelled operation"
    );

    // Metrics name the tool as the route.
    let metrics = send(
        &c,
        Method::GET,
        &w.proxy.admin_url("/metrics"),
        &[("authorization", &auth)],
        "",
    )
    .await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(
        text.lines()
            .any(|l| l.contains("upstream=\"guarded\"") && l.contains("route=\"send_email\"")),
        "{text}"
    );

    // GET and DELETE on the endpoint pass through (the fake answers them itself).
    let get = send(&c, Method::GET, &w.proxy.url("/flaky/healthz"), &[], "").await;
    assert_eq!(get.status, StatusCode::OK, "{get:?}");
}

#[test]
fn check_prints_the_tool_table_and_names_bad_tool_keys() {
    let dir = tempfile::tempdir().expect("tempdir");
    let good = dir.path().join("good.yaml");
    std::fs::write(
        &good,
        config(
            dir.path(),
            "http://127.0.0.1:9",
            "http://127.0.0.1:9",
            "http://127.0.0.1:9",
        ),
    )
    .expect("write");
    let out = cli(&["check", "--config", good.to_str().expect("utf-8")]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("MCP guarded at /guarded"), "{text}");
    assert!(
        text.lines()
            .any(|l| l.contains("send_email") && l.contains("approval")),
        "{text}"
    );
    assert!(text.contains("(unlisted)               reject"), "{text}");
    assert!(text.contains("reconcile=tool:find_email"), "{text}");

    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        "upstreams:\n  - name: t\n    url: http://127.0.0.1:9\n    protocol: mcp\n    mcp:\n      unlisted: by_tool_names\n      tools:\n        send_email: { class: sometimes, match: { path: / } }\n",
    )
    .expect("write");
    let out = cli(&["check", "--config", bad.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.yaml"), "{err}");
    assert!(err.contains("upstreams[0].mcp.unlisted"), "{err}");
    assert!(
        err.contains("upstreams[0].mcp.tools.send_email.match"),
        "{err}"
    );
}
