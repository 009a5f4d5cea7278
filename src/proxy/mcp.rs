//! The MCP lifecycle (SPEC section 11): requests to a `protocol: mcp` upstream. A POST whose
//! JSON-RPC message is a `tools/call` of a side-effecting tool runs through the one
//! execution core ([`side_effect::run_sibling`]) with this module's [`Protocol`] edges: the
//! downstream answer is the JSON-RPC response (a JSON body or the response event of an SSE
//! stream), a stored answer is replayed under the retry's own JSON-RPC id, and proxy
//! decisions (RFC 9457 problems) become JSON-RPC errors. Everything else passes through
//! untouched both ways.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use parking_lot::Mutex;
use tokio::sync::mpsc;

use super::side_effect::{self, Judged, Protocol, Sibling};
use super::{passthrough, replay, Proxy, Runtime};
use crate::config::{McpConfig, ToolLookup};
use crate::policy::classify::Target;
use crate::policy::identity::{self, ExecutionId, KeyLookup};
use crate::policy::mcp::{self as policy, Message, Tool};
use crate::policy::reconcile::{self, Verdict};
use crate::store::{Record, StoredResponse};
use crate::wire::body::{self, BoxError, ProxyBody, RequestBody};
use crate::wire::client::HttpClient;
use crate::wire::headers::{ClientAddr, EXECUTION_ID, RECONCILED};
use crate::wire::problem::{Kind, Problem};

const JSON: &str = "application/json";
const SSE: &str = "text/event-stream";

/// A request to an MCP upstream (`target.upstream.mcp` is set).
pub async fn handle(
    proxy: &Arc<Proxy>,
    rt: &Arc<Runtime>,
    target: Target<'_>,
    req: Request<RequestBody>,
    peer: ClientAddr,
) -> Response<ProxyBody> {
    let client = &rt.clients[target.upstream_index];
    let Some(mcp) = target.upstream.mcp.as_ref() else {
        return passthrough::forward(rt, client, &target, req, &peer, false).await;
    };
    if req.method() != Method::POST {
        // GET (the server's SSE stream), DELETE (session end), OPTIONS...: untouched.
        return passthrough::forward(rt, client, &target, req, &peer, false).await;
    }
    let (parts, incoming) = req.into_parts();
    let limit = rt.config.limits.max_body_bytes;
    let body = match body::read_all(incoming, limit).await {
        Ok(b) => b,
        Err(body::ReadError::TooLarge) => {
            return Problem::new(
                Kind::BodyTooLarge,
                format!("request body is larger than limits.max_body_bytes ({limit} bytes); nothing was forwarded"),
            )
            .into_response()
        }
        Err(body::ReadError::Body(e)) => {
            return Problem::new(
                Kind::of_request_body_error(&*e),
                format!("could not read the request body: {e}"),
            )
            .into_response()
        }
    };
    let forward = |parts, body: Bytes| {
        let req = Request::from_parts(parts, RequestBody::read(body));
        passthrough::forward(rt, client, &target, req, &peer, false)
    };
    let routing = |name: &str| {
        parts
            .headers
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).trim().to_string())
    };
    let (said_method, said_name) = (routing("mcp-method"), routing("mcp-name"));
    let tool = match policy::parse(&body) {
        // The 2026-07-28 routing headers must say what the body says: a server that
        // routes on them could otherwise run a call the proxy classified as another.
        Message::Other if said_method.as_deref() == Some("tools/call") => return unreadable(),
        Message::Other => return forward(parts, body).await,
        Message::ToolCall(call)
            if said_method.as_deref().is_some_and(|m| m != "tools/call")
                || said_name.as_deref().is_some_and(|n| n != call.name) =>
        {
            return unreadable()
        }
        Message::Batch(names) => {
            if policy::batch_has_side_effect(mcp, &names) {
                return batch_refused();
            }
            return forward(parts, body).await;
        }
        Message::ToolCall(call) => call.name,
        Message::Unreadable => return unreadable(),
    };
    let class = match policy::classify(mcp, &tool) {
        Tool::ByAnnotations => {
            if read_only_hint(rt, &target, &parts, mcp, &tool, &peer).await {
                Tool::ReadOnly
            } else {
                Tool::SideEffect(policy::unlisted_side_effect(mcp, &tool))
            }
        }
        other => other,
    };
    match class {
        Tool::ReadOnly | Tool::ByAnnotations => forward(parts, body).await,
        Tool::Rejected => {
            let Message::ToolCall(call) = policy::parse(&body) else {
                unreachable!("parsed as a tools/call above")
            };
            let only_sse = policy::wants_only_sse(accept(&parts.headers));
            rejected_tool(call.id, &tool, only_sse)
        }
        Tool::SideEffect(_) => {
            // A side effect must not stop half-way when the client goes (hyper drops the
            // service future): it runs as a task of its own, as HTTP side effects do.
            let owned = target.to_owned_ref();
            let (proxy, rt) = (proxy.clone(), rt.clone());
            // A client that takes SSE gets the server's progress events as they come.
            let (tx, mut rx) = mpsc::unbounded_channel();
            let tx = accepts_sse(&parts.headers).then_some(tx);
            let mut task = tokio::spawn(async move {
                let target = owned.bind(&rt.config.upstreams);
                tool_call(&proxy, &rt, &target, parts, body, &peer, tx).await
            });
            tokio::select! {
                biased;
                Some(Out::Start(id)) = rx.recv() => streamed(id, rx, task),
                done = &mut task => joined(done),
            }
        }
    }
}

/// Whether the server's `tools/list` marks `tool` `readOnlyHint: true` (`unlisted:
/// by_annotations`). Fetched with the client's own headers (its session and protocol
/// version) when the tool is not known yet, at most every few seconds; anything that
/// fails reads as "not read-only": an unknown tool is protected.
async fn read_only_hint(
    rt: &Runtime,
    target: &Target<'_>,
    parts: &http::request::Parts,
    mcp: &McpConfig,
    tool: &str,
    peer: &ClientAddr,
) -> bool {
    {
        let hints = mcp.hints.lock();
        if let Some(read_only) = hints.read_only.get(tool) {
            return *read_only;
        }
        if hints
            .fetched_at
            .is_some_and(|t| t.elapsed() < Duration::from_secs(5))
        {
            return false;
        }
    }
    let client = &rt.clients[target.upstream_index];
    let Ok(uri) = super::downstream::target_uri(target, parts.uri.query()) else {
        return false;
    };
    let mut headers = super::downstream::request_headers(
        &parts.headers,
        target.upstream,
        peer,
        &[&rt.config.identity.key_header],
    );
    mcp_headers(&mut headers, "tools/list", None);
    let mut cursor: Option<String> = None;
    let mut found = Vec::new();
    for _page in 0..20 {
        let mut params = serde_json::json!({});
        if let Some(c) = &cursor {
            params["cursor"] = serde_json::Value::String(c.clone());
        }
        let id = b"\"idemproxy-tools-list\"";
        let message = serde_json::json!({
            "jsonrpc": "2.0", "id": "idemproxy-tools-list", "method": "tools/list", "params": params,
        });
        let req = super::downstream::build(
            Method::POST,
            uri.clone(),
            headers.clone(),
            body::full(serde_json::to_vec(&message).expect("JSON serialises")),
        );
        let Some((ct, bytes)) = post(
            client,
            req,
            target.route.timeout,
            rt.config.limits.max_response_bytes,
        )
        .await
        else {
            break;
        };
        let policy::Answer::Response { message, .. } = policy::answer(&ct, &bytes, id) else {
            break;
        };
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(&message) else {
            break;
        };
        let (hints, next) = policy::tool_hints(&v["result"]);
        found.extend(hints);
        match next {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    let mut hints = mcp.hints.lock();
    hints.fetched_at = Some(std::time::Instant::now());
    hints.read_only.extend(found);
    hints.read_only.get(tool).copied().unwrap_or(false)
}

/// The 2026-07-28 routing headers for a request the proxy makes itself on the client's
/// headers: `Mcp-Method`/`Mcp-Name` name it, no `Mcp-Param-*` of the client's call.
fn mcp_headers(headers: &mut http::HeaderMap, method: &'static str, name: Option<&str>) {
    let stale: Vec<http::HeaderName> = headers
        .keys()
        .filter(|n| n.as_str().starts_with("mcp-param-") || n.as_str() == "mcp-name")
        .cloned()
        .collect();
    for n in stale {
        headers.remove(n);
    }
    headers.remove(http::header::CONTENT_LENGTH);
    headers.insert("mcp-method", HeaderValue::from_static(method));
    if let Some(v) = name.and_then(|n| HeaderValue::from_str(n).ok()) {
        headers.insert("mcp-name", v);
    }
    headers.insert(
        http::header::ACCEPT,
        HeaderValue::from_static("application/json, text/event-stream"),
    );
    headers.insert(http::header::CONTENT_TYPE, HeaderValue::from_static(JSON));
}

/// Send a request the proxy makes itself; its answer's content type and body when 2xx.
async fn post(
    client: &HttpClient,
    req: Request<ProxyBody>,
    timeout: Duration,
    limit: usize,
) -> Option<(String, Bytes)> {
    let answer = tokio::time::timeout(timeout, async {
        let resp = client.request(req).await.ok()?;
        let (parts, b) = resp.into_parts();
        if !parts.status.is_success() {
            return None;
        }
        let ct = parts
            .headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or(JSON)
            .to_string();
        let bytes = http_body_util::Limited::new(b, limit)
            .collect()
            .await
            .ok()?
            .to_bytes();
        Some((ct, bytes))
    })
    .await;
    answer.ok().flatten()
}

fn joined(done: Result<Response<ProxyBody>, tokio::task::JoinError>) -> Response<ProxyBody> {
    done.unwrap_or_else(|e| {
        tracing::error!(error = %e, "MCP tool-call task failed");
        Problem::new(
            Kind::Internal,
            "the request handler failed; see the proxy log",
        )
        .into_response()
    })
}

/// What the tap hands the client's answer while the call runs.
enum Out {
    /// Streaming starts (the call's execution id, for the answer's head).
    Start(String),
    /// One SSE event of the server's, as it sent it.
    Data(Bytes),
}

type Task = tokio::task::JoinHandle<Response<ProxyBody>>;

/// Where a streamed first answer stands.
enum Phase {
    /// The server's events, until the call is over.
    Events(mpsc::UnboundedReceiver<Out>, Task),
    /// The call's final answer.
    Final(ProxyBody),
}

async fn next_of(mut body: ProxyBody) -> Option<(Result<Frame<Bytes>, BoxError>, Phase)> {
    match body.frame().await? {
        Ok(f) => Some((Ok(f), Phase::Final(body))),
        Err(e) => Some((Err(e), Phase::Final(body::empty()))),
    }
}

/// The first answer as an SSE stream: the server's events as they come, then the call's
/// final answer (the committed response, or a decision) once the core has recorded it.
fn streamed(
    execution_id: String,
    rx: mpsc::UnboundedReceiver<Out>,
    task: Task,
) -> Response<ProxyBody> {
    let frames = futures_util::stream::unfold(Phase::Events(rx, task), |phase| async move {
        match phase {
            Phase::Events(mut rx, task) => loop {
                match rx.recv().await {
                    Some(Out::Data(b)) => {
                        return Some((Ok(Frame::data(b)), Phase::Events(rx, task)))
                    }
                    Some(Out::Start(_)) => continue,
                    // The call is over (its protocol value, holding the sender, is gone).
                    None => return next_of(final_event(joined(task.await))).await,
                }
            },
            Phase::Final(b) => next_of(b).await,
        }
    });
    let mut resp = Response::new(StreamBody::new(frames).boxed());
    let h = resp.headers_mut();
    h.insert(http::header::CONTENT_TYPE, HeaderValue::from_static(SSE));
    h.insert(
        http::header::CACHE_CONTROL,
        HeaderValue::from_static("no-store"),
    );
    if let Ok(v) = HeaderValue::from_str(&execution_id) {
        h.insert(EXECUTION_ID, v);
    }
    resp
}

/// The call's final answer as the last event of a stream already under way.
fn final_event(resp: Response<ProxyBody>) -> ProxyBody {
    let sse = resp
        .headers()
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(SSE.as_bytes()));
    if resp.status() == StatusCode::OK && sse {
        return resp.into_body();
    }
    // The core's answers are framed as SSE once streaming; this covers a server's own HTTP
    // error stored as the answer, so that a stream never ends without saying so.
    let problem = serde_json::json!({
        "type": "urn:idemproxy:problem:upstream-error",
        "title": "Upstream error",
        "status": resp.status().as_u16(),
        "detail": format!("the MCP server answered HTTP {}", resp.status()),
    });
    let message = policy::error_response(
        b"null",
        -32000,
        "Upstream error",
        &serde_json::to_vec(&problem).expect("JSON serialises"),
    );
    body::full(policy::sse_event(&message))
}

fn accepts_sse(headers: &http::HeaderMap) -> bool {
    accept(headers).any(|v| {
        String::from_utf8_lossy(v).split(',').any(|t| {
            t.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .eq_ignore_ascii_case(SSE)
        })
    })
}

fn accept(headers: &http::HeaderMap) -> impl Iterator<Item = &[u8]> {
    headers
        .get_all(http::header::ACCEPT)
        .iter()
        .map(HeaderValue::as_bytes)
}

/// A side-effecting `tools/call`: identity, `args_hash`, then the execution core.
async fn tool_call(
    proxy: &Arc<Proxy>,
    rt: &Runtime,
    target: &Target<'_>,
    parts: http::request::Parts,
    body: Bytes,
    peer: &ClientAddr,
    stream: Option<mpsc::UnboundedSender<Out>>,
) -> Response<ProxyBody> {
    let cfg = &rt.config;
    let Some(mcp) = target.upstream.mcp.as_ref() else {
        unreachable!("an MCP target")
    };
    let Message::ToolCall(call) = policy::parse(&body) else {
        unreachable!("parsed as a tools/call before")
    };
    let route = match policy::classify(mcp, &call.name) {
        Tool::SideEffect(route) => route,
        // The server's annotations did not say read-only (checked before).
        Tool::ByAnnotations => policy::unlisted_side_effect(mcp, &call.name),
        _ => unreachable!("classified as a side effect before"),
    };
    let only_sse = policy::wants_only_sse(accept(&parts.headers));
    let mut rpc = Rpc {
        request_id: call.id.to_vec(),
        only_sse,
        arguments: policy::arguments(&call).to_vec(),
        tap: None,
        correlation: policy::correlation(&call, &cfg.identity),
        key: None,
        lookup: None,
    };
    // The tool's own target: its records, metrics and turns are the tool's.
    let tool = Target {
        upstream_index: target.upstream_index,
        upstream: target.upstream,
        route_ref: target.route_ref,
        route: &route,
        rel_path: target.rel_path.clone(),
        params: Vec::new(),
    };
    let key = match policy::find_key(
        &parts.headers,
        &call,
        &cfg.identity,
        &route,
        cfg.limits.max_key_bytes,
    ) {
        KeyLookup::Found { key, .. } => key,
        KeyLookup::Missing if route.key_required => {
            let p = Problem::new(
                Kind::KeyMissing,
                format!(
                    "tool `{}` of `{}` has side effects and needs a key: the {} header, the derive_from headers, or the identity.key_meta / derive_from_meta fields of params._meta; nothing was sent",
                    route.name, target.upstream.name, cfg.identity.key_header
                ),
            );
            return rpc.decision(p.into_response()).await;
        }
        KeyLookup::Missing => {
            drop(call);
            let req = Request::from_parts(parts, RequestBody::read(body));
            return side_effect::unprotected(
                proxy,
                rt,
                &rt.clients[tool.upstream_index],
                &tool,
                req,
                peer,
            )
            .await;
        }
        KeyLookup::Invalid(why) => {
            return rpc
                .decision(Problem::new(Kind::KeyInvalid, why).into_response())
                .await
        }
    };
    let args = match policy::args_hash(&target.upstream.name, &route, &body) {
        Ok(a) => a,
        Err(at) => {
            let p = Problem::new(
                Kind::BodyAmbiguous,
                format!(
                    "the JSON-RPC message names the member {} more than once; which value the server would read is not knowable, so nothing was recorded or sent",
                    at.0
                ),
            );
            return rpc.decision(p.into_response()).await;
        }
    };
    // An atomic batch tool (SPEC section 9.3, items relative to `arguments`): one
    // execution, only its size is the batch's business.
    if let Some(b) = route.batch.as_deref() {
        if let Err(r) = crate::policy::batch::check_size(b, &rpc.arguments) {
            return rpc.decision(super::batch::refused(r)).await;
        }
    }
    let tenant = identity::tenant_scope(&parts.headers, &cfg.identity.tenant_from);
    let id = identity::execution_id(&tenant, &target.upstream.name, &route.name, &key);
    rpc.key = Some(key.clone());
    rpc.lookup = mcp
        .lookups
        .iter()
        .find(|(n, _)| *n == route.name)
        .and_then(|(_, spec)| {
            let uri = super::downstream::target_uri(target, parts.uri.query()).ok()?;
            let mut headers = super::downstream::request_headers(
                &parts.headers,
                target.upstream,
                peer,
                &[&cfg.identity.key_header],
            );
            // The lookup is its own tools/call: the 2026-07-28 routing headers name it.
            mcp_headers(&mut headers, "tools/call", Some(&spec.tool));
            Some(Lookup {
                spec: spec.clone(),
                uri,
                headers,
                key: key.clone(),
                timeout: route.timeout,
                limit: cfg.limits.max_response_bytes,
            })
        });
    rpc.tap = stream.map(|tx| Tap {
        tx,
        execution_id: id.to_string(),
        state: Mutex::new(TapState::default()),
    });
    let sent = Bytes::from(policy::with_execution_id(&call, id.as_str()));
    drop(call);
    let mut parts = parts;
    parts.headers.remove(http::header::CONTENT_LENGTH);
    let turns = rt.turns(&tool);
    let (_turn, queue) = match turns.clone().try_acquire_owned() {
        Ok(turn) => (Some(turn), None),
        Err(_) => (None, Some(turns.clone())),
    };
    let client = &rt.clients[tool.upstream_index];
    let sibling = Sibling {
        parts,
        body: sent,
        id,
        tenant,
        args,
        proto: &rpc,
    };
    let resp = side_effect::run_sibling(proxy, rt, client, &tool, sibling, peer, queue).await;
    rpc.decision(resp).await
}

/// The MCP edges of one `tools/call` (see [`Protocol`]).
struct Rpc {
    /// The JSON-RPC id of this request (a replay answers under it).
    request_id: Vec<u8>,
    /// The client's `Accept` takes only `text/event-stream`.
    only_sse: bool,
    /// `params.arguments`, for approval previews.
    arguments: Vec<u8>,
    /// Where the server's SSE events go while the call runs (a client that takes SSE).
    tap: Option<Tap>,
    /// The orchestration ids named in `params._meta`.
    correlation: identity::Correlation,
    /// The key the call was identified by (kept on its record).
    key: Option<String>,
    /// The tool's `reconcile.tool` lookup, ready to send.
    lookup: Option<Lookup>,
}

/// A `reconcile.tool` lookup: a read-only `tools/call` on the same server, with the
/// retry's own headers (its session, if the server keeps sessions, is live).
struct Lookup {
    spec: ToolLookup,
    uri: http::Uri,
    headers: http::HeaderMap,
    key: String,
    timeout: Duration,
    limit: usize,
}

impl Lookup {
    async fn run(&self, client: &HttpClient, record: &Record) -> Verdict {
        let id = format!("\"idemproxy-lookup-{}\"", record.id);
        let arguments = template(&self.spec.arguments, record.id.as_str(), &self.key);
        let arguments = serde_json::to_vec(&arguments).expect("JSON serialises");
        let tool = serde_json::to_vec(&self.spec.tool).expect("JSON serialises");
        let params = policy::rewrite(&[], &[("name", &tool), ("arguments", &arguments)]);
        let message = policy::rewrite(
            &[],
            &[
                ("jsonrpc", b"\"2.0\""),
                ("id", id.as_bytes()),
                ("method", b"\"tools/call\""),
                ("params", &params),
            ],
        );
        let req = super::downstream::build(
            Method::POST,
            self.uri.clone(),
            self.headers.clone(),
            body::full(message),
        );
        let sent = tokio::time::timeout(self.timeout, async {
            let resp = client
                .request(req)
                .await
                .map_err(|e| crate::wire::client::describe(&e))?;
            let (parts, b) = resp.into_parts();
            let bytes = http_body_util::Limited::new(b, self.limit)
                .collect()
                .await
                .map_err(|e| format!("reading the lookup's answer failed: {e}"))?
                .to_bytes();
            Ok::<_, String>((parts, bytes))
        })
        .await;
        let (parts, bytes) = match sent {
            Err(_) => return Verdict::Unknown("the lookup tool did not answer in time".into()),
            Ok(Err(why)) => return Verdict::Unknown(format!("the lookup tool call failed: {why}")),
            Ok(Ok(answer)) => answer,
        };
        if !parts.status.is_success() {
            return Verdict::Unknown(format!(
                "the lookup tool call was answered HTTP {}",
                parts.status
            ));
        }
        let ct = parts
            .headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or(JSON);
        let policy::Answer::Response { message, .. } = policy::answer(ct, &bytes, id.as_bytes())
        else {
            return Verdict::Unknown("the lookup tool's answer held no JSON-RPC response".into());
        };
        let parsed: serde_json::Value = match serde_json::from_slice(&message) {
            Ok(v) => v,
            Err(_) => return Verdict::Unknown("the lookup tool's response is not JSON".into()),
        };
        let result = &parsed["result"];
        if result.is_null() || result["isError"] == serde_json::Value::Bool(true) {
            return Verdict::Unknown(format!(
                "the lookup tool `{}` answered with an error",
                self.spec.tool
            ));
        }
        if reconcile::matches(&self.spec.found, 200, Some(result)) {
            let matches = self
                .spec
                .found
                .json_nonempty
                .as_deref()
                .and_then(|p| result.pointer(p))
                .and_then(|v| v.as_array().map(Vec::len))
                .unwrap_or(1);
            return Verdict::Found {
                result: StoredResponse {
                    status: 200,
                    headers: vec![
                        ("content-type".to_string(), JSON.as_bytes().to_vec()),
                        (RECONCILED.as_str().to_string(), b"lookup".to_vec()),
                    ],
                    body: message,
                },
                external_id: None,
                matches,
            };
        }
        if reconcile::matches(&self.spec.not_found, 200, Some(result)) {
            return Verdict::NotFound;
        }
        Verdict::Unknown(format!(
            "the lookup tool `{}` answered, but neither found nor not_found matched",
            self.spec.tool
        ))
    }
}

/// The lookup's arguments with `{execution_id}` and `{key}` filled in every string.
fn template(v: &serde_json::Value, execution_id: &str, key: &str) -> serde_json::Value {
    use serde_json::Value;
    match v {
        Value::String(s) => Value::String(
            s.replace("{execution_id}", execution_id)
                .replace("{key}", key),
        ),
        Value::Array(a) => Value::Array(a.iter().map(|x| template(x, execution_id, key)).collect()),
        Value::Object(o) => Value::Object(
            o.iter()
                .map(|(k, x)| (k.clone(), template(x, execution_id, key)))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// Splits a downstream SSE stream into events as it is read: every event but the
/// response goes to the client at once; the response is the core's to record and answer.
struct Tap {
    tx: mpsc::UnboundedSender<Out>,
    execution_id: String,
    state: Mutex<TapState>,
}

#[derive(Default)]
struct TapState {
    buf: Vec<u8>,
    started: bool,
}

impl Tap {
    fn feed(&self, data: &[u8]) {
        let mut st = self.state.lock();
        st.buf.extend_from_slice(data);
        while let Some((end, sep)) = event_end(&st.buf) {
            let event: Vec<u8> = st.buf.drain(..end + sep).collect();
            let is_response = policy::sse_events(&event)
                .iter()
                .any(|d| policy::is_response(d));
            if is_response {
                continue;
            }
            if !st.started {
                st.started = true;
                let _ = self.tx.send(Out::Start(self.execution_id.clone()));
            }
            let _ = self.tx.send(Out::Data(Bytes::from(event)));
        }
    }

    fn started(&self) -> bool {
        self.state.lock().started
    }
}

/// Where the first complete SSE event in `buf` ends: its length and its separator's.
fn event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2));
    let crlf = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

impl Rpc {
    /// A proxy decision (an RFC 9457 problem from the core or from admission) as a
    /// JSON-RPC error under the request's id, HTTP 200; any other answer as is.
    async fn decision(&self, resp: Response<ProxyBody>) -> Response<ProxyBody> {
        let is_problem = resp
            .headers()
            .get(http::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes() == b"application/problem+json");
        if !is_problem {
            return resp;
        }
        let (mut parts, b) = resp.into_parts();
        let problem = match b.collect().await {
            Ok(c) => c.to_bytes(),
            Err(_) => Bytes::from_static(b"{}"),
        };
        let (name, title) = match serde_json::from_slice::<serde_json::Value>(&problem) {
            Ok(v) => (
                v["type"]
                    .as_str()
                    .and_then(|t| t.strip_prefix("urn:idemproxy:problem:"))
                    .unwrap_or("internal")
                    .to_string(),
                v["title"].as_str().unwrap_or("idemproxy").to_string(),
            ),
            Err(_) => ("internal".to_string(), "idemproxy".to_string()),
        };
        let message = policy::error_response(
            &self.request_id,
            policy::error_code(&name),
            &title,
            &problem,
        );
        parts.status = StatusCode::OK;
        parts.headers.remove(http::header::CONTENT_LENGTH);
        let (ct, body) = self.framed(message);
        parts
            .headers
            .insert(http::header::CONTENT_TYPE, HeaderValue::from_static(ct));
        Response::from_parts(parts, body::full(body))
    }

    /// A JSON-RPC message as JSON, or as a one-event SSE stream for a client that takes
    /// only that.
    fn framed(&self, message: Vec<u8>) -> (&'static str, Vec<u8>) {
        // Once the server's events are streaming, the answer is the stream's last event.
        if self.only_sse || self.tap.as_ref().is_some_and(Tap::started) {
            (SSE, policy::sse_event(&message))
        } else {
            (JSON, message)
        }
    }
}

impl Protocol for Rpc {
    fn judge(&self, parts: &http::response::Parts, body: &Bytes) -> Judged {
        let raw = || StoredResponse {
            status: parts.status.as_u16(),
            headers: parts
                .headers
                .get(http::header::CONTENT_TYPE)
                .map(|v| vec![("content-type".to_string(), v.as_bytes().to_vec())])
                .unwrap_or_default(),
            body: body.to_vec(),
        };
        if parts.status.is_server_error() {
            return Judged::Answer {
                stored: raw(),
                server_error: true,
            };
        }
        if !parts.status.is_success() {
            return Judged::Refused(
                raw(),
                format!(
                    "the MCP server refused the request (HTTP {}) before running the tool",
                    parts.status
                ),
            );
        }
        let ct = parts
            .headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or(JSON);
        match policy::answer(ct, body, &self.request_id) {
            policy::Answer::Response {
                message,
                internal_error,
            } => Judged::Answer {
                // The final JSON-RPC response only: progress notifications are not kept.
                stored: StoredResponse {
                    status: 200,
                    headers: vec![("content-type".to_string(), JSON.as_bytes().to_vec())],
                    body: message,
                },
                server_error: internal_error,
            },
            policy::Answer::Missing => Judged::Lost(
                "the MCP server's answer ended without the JSON-RPC response to the call".into(),
            ),
        }
    }

    fn render(
        &self,
        stored: &StoredResponse,
        id: &ExecutionId,
        _replayed: bool,
    ) -> Response<ProxyBody> {
        if stored.status != 200 {
            // The server's own HTTP error, as it sent it.
            let (status, headers) = replay::response_head(stored, id);
            let mut resp = Response::new(body::full(Bytes::from(stored.body.clone())));
            *resp.status_mut() = status;
            *resp.headers_mut() = headers;
            return resp;
        }
        let (ct, body) = self.framed(policy::under_id(&stored.body, &self.request_id));
        let mut resp = Response::new(body::full(body));
        let h = resp.headers_mut();
        h.insert(http::header::CONTENT_TYPE, HeaderValue::from_static(ct));
        h.insert(
            http::header::CACHE_CONTROL,
            HeaderValue::from_static("no-store"),
        );
        h.insert(
            EXECUTION_ID,
            HeaderValue::from_str(id.as_str()).unwrap_or(HeaderValue::from_static("")),
        );
        // An answer a reconciliation lookup found says so, as on HTTP routes.
        if let Some((_, v)) = stored
            .headers
            .iter()
            .find(|(n, _)| n == RECONCILED.as_str())
        {
            if let Ok(v) = HeaderValue::from_bytes(v) {
                h.insert(RECONCILED, v);
            }
        }
        resp
    }

    fn preview_source(&self) -> &[u8] {
        &self.arguments
    }

    fn correlation(&self) -> (&identity::Correlation, Option<&str>) {
        (&self.correlation, self.key.as_deref())
    }

    fn has_lookup(&self) -> bool {
        self.lookup.is_some()
    }

    fn lookup<'a>(
        &'a self,
        client: &'a HttpClient,
        record: &'a Record,
    ) -> Pin<Box<dyn Future<Output = (Verdict, Duration)> + Send + 'a>> {
        Box::pin(async move {
            match &self.lookup {
                Some(l) => (l.run(client, record).await, l.spec.settle),
                None => (Verdict::Unknown("no lookup".into()), Duration::ZERO),
            }
        })
    }

    fn tap(&self, head: &http::response::Parts, data: &Bytes) {
        let Some(tap) = &self.tap else { return };
        let sse = head
            .headers
            .get(http::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(SSE.as_bytes()));
        if head.status.is_success() && sse {
            tap.feed(data);
        }
    }
}

/// A JSON-RPC batch with a side-effecting `tools/call`: refused whole, nothing sent.
fn batch_refused() -> Response<ProxyBody> {
    refused(
        "batch-refused",
        -32600,
        "Batch with a side-effecting tool call",
        "a JSON-RPC batch containing a side-effecting tools/call cannot be protected; send each call as its own request; nothing was sent",
    )
}

/// A POST body the proxy cannot read for sure (not JSON, a repeated member name): refused,
/// nothing sent, since the server might read a side-effecting call in it.
fn unreadable() -> Response<ProxyBody> {
    refused(
        "body-ambiguous",
        -32700,
        "Unreadable JSON-RPC message",
        "the body is not one JSON-RPC message the proxy can read unambiguously (not JSON, a member name repeated in the message or its params, or Mcp-Method / Mcp-Name headers that name another call); nothing was sent",
    )
}

/// A message refused before anything is sent: HTTP 400 with one JSON-RPC error (`id:
/// null`, `code`) whose `data` is the RFC 9457 problem `name`.
fn refused(name: &str, code: i64, title: &str, detail: &str) -> Response<ProxyBody> {
    let problem = serde_json::json!({
        "type": format!("urn:idemproxy:problem:{name}"),
        "title": title,
        "status": 400,
        "detail": detail,
    });
    let message = policy::error_response(
        b"null",
        code,
        title,
        &serde_json::to_vec(&problem).expect("JSON serialises"),
    );
    let mut resp = Response::new(body::full(message));
    *resp.status_mut() = StatusCode::BAD_REQUEST;
    resp.headers_mut()
        .insert(http::header::CONTENT_TYPE, HeaderValue::from_static(JSON));
    resp
}

/// A `tools/call` of an unlisted tool under `unlisted: reject`.
fn rejected_tool(id: &[u8], tool: &str, only_sse: bool) -> Response<ProxyBody> {
    let problem = serde_json::json!({
        "type": "urn:idemproxy:problem:tool-rejected",
        "title": "Tool not allowed",
        "status": 403,
        "detail": format!("tool `{tool}` is not listed and this upstream has `unlisted: reject`; nothing was sent"),
    });
    let message = policy::error_response(
        id,
        policy::error_code("tool-rejected"),
        "Tool not allowed",
        &serde_json::to_vec(&problem).expect("JSON serialises"),
    );
    let rpc = Rpc {
        request_id: id.to_vec(),
        only_sse,
        arguments: Vec::new(),
        tap: None,
        correlation: identity::Correlation::default(),
        key: None,
        lookup: None,
    };
    let (ct, body) = rpc.framed(message);
    let mut resp = Response::new(body::full(body));
    resp.headers_mut()
        .insert(http::header::CONTENT_TYPE, HeaderValue::from_static(ct));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rpc() -> Rpc {
        Rpc {
            request_id: b"7".to_vec(),
            only_sse: false,
            arguments: Vec::new(),
            tap: None,
            correlation: identity::Correlation::default(),
            key: None,
            lookup: None,
        }
    }

    fn head(status: u16, ct: &str) -> http::response::Parts {
        let (mut parts, ()) = Response::new(()).into_parts();
        parts.status = StatusCode::from_u16(status).unwrap();
        parts.headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_str(ct).unwrap(),
        );
        parts
    }

    fn judged(status: u16, ct: &str, body: &'static str) -> Judged {
        rpc().judge(&head(status, ct), &Bytes::from_static(body.as_bytes()))
    }

    #[test]
    fn judges_downstream_answers() {
        let ok = judged(
            200,
            JSON,
            r#"{"jsonrpc":"2.0","id":7,"result":{"isError":true}}"#,
        );
        assert!(
            matches!(ok, Judged::Answer { server_error: false, ref stored } if stored.status == 200)
        );
        // A JSON-RPC internal error is judged by on_5xx; other errors are committed.
        let internal = judged(
            200,
            JSON,
            r#"{"jsonrpc":"2.0","id":7,"error":{"code":-32603,"message":"x"}}"#,
        );
        assert!(matches!(
            internal,
            Judged::Answer {
                server_error: true,
                ..
            }
        ));
        let invalid = judged(
            200,
            JSON,
            r#"{"jsonrpc":"2.0","id":7,"error":{"code":-32602,"message":"x"}}"#,
        );
        assert!(matches!(
            invalid,
            Judged::Answer {
                server_error: false,
                ..
            }
        ));
        // A stream that ended before the response: lost, never committed.
        let cut = judged(
            200,
            SSE,
            "event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\"}\n\n",
        );
        assert!(matches!(cut, Judged::Lost(_)));
        assert!(matches!(judged(404, JSON, "{}"), Judged::Refused(..)));
        assert!(matches!(
            judged(503, "text/plain", "down"),
            Judged::Answer {
                server_error: true,
                ..
            }
        ));
    }

    #[test]
    fn the_tap_forwards_every_event_but_the_response() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let tap = Tap {
            tx,
            execution_id: "ex_1".into(),
            state: Mutex::new(TapState::default()),
        };
        let stream = "id: 1\ndata: \n\nevent: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{}}\r\n\r\nevent: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{}}\n\n";
        // Fed in pieces that cut events (and a CRLF separator) in half.
        for piece in stream.as_bytes().chunks(7) {
            tap.feed(piece);
        }
        assert!(tap.started());
        assert!(matches!(rx.try_recv(), Ok(Out::Start(id)) if id == "ex_1"));
        let mut events = Vec::new();
        while let Ok(Out::Data(b)) = rx.try_recv() {
            events.push(String::from_utf8(b.to_vec()).unwrap());
        }
        assert_eq!(events.len(), 2, "{events:?}");
        assert!(events[1].contains("notifications/progress"));
        assert!(events.iter().all(|e| !e.contains("\"result\"")));
    }
}
