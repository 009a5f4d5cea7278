//! Side-effect routes: the lifecycle `admit → identify → fingerprint → claim/decide →
//! (reconcile) → forward → record → respond`. The invariants of SPEC section 5 are kept
//! here: the record is durably `executing` before the first byte goes downstream, and
//! durably `committed` with the full answer before the client sees it. A retry of an
//! `outcome_unknown` record is reconciled first (SPEC section 7, [`reconcile`]) and never
//! blindly re-sent. The only retry inside the proxy is of a send that provably never left
//! (connect, DNS, TLS), under the same execution. Two operator decisions are enforced here
//! too: a call only runs on an approval that covers its arguments and has not expired, and
//! nothing more is sent under a cancelled operation (SPEC section 8).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};

use super::{downstream, passthrough, reconcile as lookup, replay, Proxy, Runtime};
use crate::config::{Concurrent, Config, On5xx, Route};
use crate::failpoint;
use crate::metrics::{Metrics, RouteLabels};
use crate::policy::batch;
use crate::policy::classify::Target;
use crate::policy::fingerprint::{
    args_hash, raw_digest, AmbiguousBody, CallScope, RawDigest, RequestParts,
};
use crate::policy::identity::{self, ArgsHash, Correlation, ExecutionId, KeyLookup, TenantScope};
use crate::policy::reconcile::{self, Plan, Verdict};
use crate::policy::state::{Event, State};
use crate::store::{
    now_ms, Claim, Lease, NewRecord, OperationMark, Record, StoreError, StoredResponse,
};
use crate::wire::body::{self, BoxError, NotifyOnEnd, ProxyBody, RequestBody};
use crate::wire::client::{self, HttpClient, SendFailure};
use crate::wire::headers::{ClientAddr, HeaderLookup, EXECUTION_ID, REPLAYED, STATUS};
use crate::wire::problem::{Kind, Problem};
use crate::wire::raw::{RawAnswer, RawRequest};

/// What admission decided, before any work that must outlive the client's connection.
pub enum Admit {
    /// Answered already: a bad or missing key, an unreadable body, or a replay from memory.
    Respond(Response<ProxyBody>),
    /// No key on a route that allows that: forwarded as is, unprotected.
    Unprotected(Request<RequestBody>),
    /// Keyed and read: runs under its execution record ([`run`]).
    Protected(Admitted),
}

/// A keyed side-effect request with its body read and its identity resolved.
pub struct Admitted {
    parts: Parts,
    body: Bytes,
    id: ExecutionId,
    tenant: TenantScope,
    raw: RawDigest,
    /// The key it was identified by (kept on its record); `None` for a sibling's identity.
    key: Option<String>,
}

impl Admitted {
    /// The span every log line of this call is written in: its execution id, and the
    /// operation and tool call it came from (orchestration ids, never argument values).
    pub fn span(&self, id_cfg: &crate::config::IdentityConfig) -> tracing::Span {
        let header = |name: &Option<http::HeaderName>| {
            name.as_ref()
                .and_then(|n| self.parts.headers.get(n))
                .and_then(|v| v.to_str().ok())
                .map(|v| v.trim().to_string())
        };
        tracing::info_span!(
            "call",
            execution_id = %self.id,
            operation_id = header(&id_cfg.operation_from).as_deref(),
            tool_call_id = header(&id_cfg.tool_call_from).as_deref(),
        )
    }

    /// A request whose identity a sibling lifecycle resolved its own way (a webhook
    /// delivery: the event id, scoped to the route), to run under [`run`] like any call.
    pub(super) fn new(
        parts: Parts,
        body: &Bytes,
        id: ExecutionId,
        tenant: TenantScope,
        raw: RawDigest,
    ) -> Admitted {
        let (parts, body) = detach(parts, body);
        Admitted {
            parts,
            body,
            id,
            tenant,
            raw,
            key: None,
        }
    }
}

/// What [`replay_raw`] derived of a keyed request it found no answer in memory for: its key
/// and raw digest, handed on to [`admit`] so that they are not derived twice.
pub struct Looked {
    key: String,
    raw: RawDigest,
}

/// Admit a request classified as a side effect: find its key, read its body, derive its
/// execution id, and answer it from the replay cache when it repeats a delivered call
/// byte for byte (a hit needs no store read and no task of its own). `looked`: the fast
/// path's [`replay_raw`] found the key and looked in memory already.
pub async fn admit(
    proxy: &Proxy,
    rt: &Runtime,
    target: &Target<'_>,
    req: Request<RequestBody>,
    looked: Option<Looked>,
) -> Admit {
    let cfg = &rt.config;
    let route = target.route;
    let (key, looked) = match looked {
        Some(Looked { key, raw }) => (key, Some(raw)),
        None => match find_key(cfg, route, req.headers()) {
            KeyLookup::Found { key, .. } => (key, None),
            KeyLookup::Missing if route.key_required => {
                return Admit::Respond(
                    Problem::new(
                        Kind::KeyMissing,
                        format!(
                            "route `{}/{}` has side effects and needs an {} header{}",
                            target.upstream.name,
                            route.name,
                            cfg.identity.key_header,
                            if cfg.identity.derive_from.is_empty() {
                                String::new()
                            } else {
                                " or the derive_from headers".to_string()
                            }
                        ),
                    )
                    .into_response(),
                );
            }
            KeyLookup::Missing => return Admit::Unprotected(req),
            KeyLookup::Invalid(why) => {
                return Admit::Respond(Problem::new(Kind::KeyInvalid, why).into_response())
            }
        },
    };
    let (parts, incoming) = req.into_parts();
    let body = match read_body(incoming, &parts, cfg.limits.max_body_bytes).await {
        Ok(b) => b,
        Err(resp) => return Admit::Respond(*resp),
    };
    let raw = match looked {
        Some(raw) => raw,
        None => {
            let raw = replay_digest(cfg, target, &key, &map_parts(target, &parts, &body));
            if let Some(resp) = rt.shared.replays.replay(&raw, now_ms()) {
                replayed_from_memory(proxy, rt, target, || {
                    resp.headers()
                        .get(EXECUTION_ID)
                        .map_or(&[][..], |v| v.as_bytes())
                });
                return Admit::Respond(failpoint::on_answer(resp));
            }
            raw
        }
    };
    // identify
    let tenant = identity::tenant_scope(&parts.headers, &cfg.identity.tenant_from);
    let id = identity::execution_id(&tenant, &target.upstream.name, &route.name, &key);
    let (parts, body) = detach(parts, &body);
    Admit::Protected(Admitted {
        parts,
        body,
        id,
        tenant,
        raw,
        key: Some(key),
    })
}

/// What [`replay_raw`] made of a request.
// Returned once and matched at once; boxing the answer would add an allocation per replay.
#[allow(clippy::large_enum_variant)]
pub enum RawReplay {
    /// A byte-for-byte retry of a delivered call, answered from memory.
    Answered(RawAnswer),
    /// Keyed, and not in memory: [`admit`] goes on from here.
    Missed(Looked),
    /// Anything else (no key, a bad key, a body over the limit): [`admit`] judges it.
    Declined,
}

/// A request the fast path read whole, looked up in the replay cache as bytes
/// ([`replay::ReplayCache::replay_raw`]) before it becomes an `http::Request`. Its key and
/// raw digest are derived exactly as [`admit`] derives them (the same functions, through
/// [`HeaderLookup`](crate::wire::headers::HeaderLookup)), so what hits here would have hit
/// there; a miss hands them on to `admit`.
pub fn replay_raw(proxy: &Proxy, rt: &Runtime, target: &Target<'_>, req: &RawRequest) -> RawReplay {
    let cfg = &rt.config;
    let KeyLookup::Found { key, .. } = find_key(cfg, target.route, req) else {
        return RawReplay::Declined;
    };
    if req.body.len() > cfg.limits.max_body_bytes {
        return RawReplay::Declined;
    }
    let parts = request_parts(target, &req.method, req.uri.query(), req, &req.body);
    let raw = replay_digest(cfg, target, &key, &parts);
    let Some(mut answer) = rt.shared.replays.replay_raw(&raw, now_ms()) else {
        return RawReplay::Missed(Looked { key, raw });
    };
    replayed_from_memory(proxy, rt, target, || replay::execution_id_of(&answer));
    answer.body = failpoint::on_answer_body(answer.body);
    RawReplay::Answered(answer)
}

/// The 403's detail for a rejected call: the operator's note (who, and the reason they
/// gave) reaches the agent, so it can tell the user why.
fn rejection_detail(r: &Record) -> String {
    let note = r
        .history
        .iter()
        .rev()
        .find(|h| h.to == State::Rejected)
        .and_then(|h| h.note.as_deref());
    match note {
        Some(note) => format!("an operator rejected this call; it will not be sent ({note})"),
        None => "an operator rejected this call; it will not be sent".to_string(),
    }
}

/// The request's idempotency key (`identity::find_key` under this config).
fn find_key<H: HeaderLookup + ?Sized>(cfg: &Config, route: &Route, headers: &H) -> KeyLookup {
    identity::find_key(headers, &cfg.identity, route, cfg.limits.max_key_bytes)
}

/// The digest a byte-for-byte retry is found by in the replay cache: one digest over the
/// key, the tenant headers and the request names both its execution id and its arguments,
/// so nothing else is derived first (`fingerprint::raw_digest`).
fn replay_digest<H: HeaderLookup + ?Sized>(
    cfg: &Config,
    target: &Target<'_>,
    key: &str,
    parts: &RequestParts<'_, H>,
) -> RawDigest {
    let scope = CallScope {
        key,
        tenant_from: &cfg.identity.tenant_from,
    };
    raw_digest(&scope, parts, &target.route.fingerprint)
}

/// Log and count a replay answered from memory (`id` is read only when the log is on).
fn replayed_from_memory<'a>(
    proxy: &Proxy,
    rt: &Runtime,
    target: &Target<'_>,
    id: impl FnOnce() -> &'a [u8],
) {
    tracing::info!(
        execution_id = std::str::from_utf8(id()).unwrap_or(""),
        from = "memory",
        "replayed stored result"
    );
    rt.replay_counters(&proxy.metrics, target).replayed();
}

/// Copies of the request's head and body in allocations of their own. The listener (its
/// fast path as hyper) hands out the path, header values and a body as slices of the
/// connection's read buffer (8 to 16 KiB); a call that waits on the store and the downstream would keep that whole
/// buffer alive, and with 1,000 calls in flight those buffers were the largest part of the
/// proxy's memory. Copying under a kilobyte is cheap next to a durable write.
fn detach(mut parts: Parts, body: &Bytes) -> (Parts, Bytes) {
    let mut headers = http::HeaderMap::with_capacity(parts.headers.len());
    for (name, value) in &parts.headers {
        let mut copy = HeaderValue::from_bytes(value.as_bytes()).unwrap_or_else(|_| value.clone());
        copy.set_sensitive(value.is_sensitive());
        headers.append(name.clone(), copy);
    }
    parts.headers = headers;
    if let Ok(uri) = http::Uri::try_from(parts.uri.to_string()) {
        parts.uri = uri;
    }
    (parts, Bytes::copy_from_slice(body))
}

/// [`request_parts`] of an `http::Request`'s parts.
fn map_parts<'a>(target: &'a Target<'_>, parts: &'a Parts, body: &'a [u8]) -> RequestParts<'a> {
    request_parts(
        target,
        &parts.method,
        parts.uri.query(),
        &parts.headers,
        body,
    )
}

fn request_parts<'a, H: ?Sized>(
    target: &'a Target<'_>,
    method: &'a http::Method,
    query: Option<&'a str>,
    headers: &'a H,
    body: &'a [u8],
) -> RequestParts<'a, H> {
    RequestParts {
        method,
        upstream: &target.upstream.name,
        route: &target.route.name,
        path: &target.rel_path,
        query,
        headers,
        body,
    }
}

/// A side effect forwarded without a key (the route allows it): no record, no replay; the
/// answer says `Idempotency-Status: unprotected`.
pub async fn unprotected(
    proxy: &Proxy,
    rt: &Runtime,
    client: &HttpClient,
    target: &Target<'_>,
    req: Request<RequestBody>,
    peer: &ClientAddr,
) -> Response<ProxyBody> {
    tracing::warn!(upstream = %target.upstream.name, route = %target.route.name, "side effect forwarded without a key (unprotected)");
    proxy
        .metrics
        .unprotected
        .get_or_create(&Metrics::labels(&target.upstream.name, &target.route.name))
        .inc();
    let mut answer = passthrough::forward(rt, client, target, req, peer, false).await;
    // The caller sees that this call was not protected (SPEC section 4).
    answer.headers_mut().insert(
        crate::wire::headers::STATUS,
        HeaderValue::from_static("unprotected"),
    );
    answer
}

/// Run an admitted call under its execution record: fingerprint, claim or decide, and
/// (reconcile,) forward, record, respond.
pub async fn run(
    proxy: &Arc<Proxy>,
    rt: &Runtime,
    client: &HttpClient,
    target: &Target<'_>,
    admitted: Admitted,
    peer: &ClientAddr,
    queue: Option<Arc<tokio::sync::Semaphore>>,
) -> Response<ProxyBody> {
    let Admitted {
        parts,
        body,
        id,
        tenant,
        raw,
        key,
    } = admitted;
    let args = match args_hash(&map_parts(target, &parts, &body), &target.route.fingerprint) {
        Ok(args) => args,
        Err(AmbiguousBody(at)) => {
            return Problem::new(
                Kind::BodyAmbiguous,
                format!(
                    "the JSON body names the member {at} more than once; which value the \
                     downstream would read is not knowable, so nothing was recorded or forwarded"
                ),
            )
            .into_response()
        }
    };
    if let Some(spec) = target.route.batch.as_deref() {
        match spec.each.as_deref() {
            Some(each) => {
                // Boxed: a batch's future holds its items' calls.
                return Box::pin(super::batch::run(super::batch::Call {
                    proxy,
                    rt,
                    client,
                    target,
                    spec,
                    each,
                    parts,
                    body,
                    id,
                    tenant,
                    args,
                    key,
                    peer,
                    queue,
                }))
                .await;
            }
            // Atomic: one execution as any call; only the size is the batch's business.
            None => {
                if let Err(r) = batch::check_size(spec, &body) {
                    return super::batch::refused(r);
                }
            }
        }
    }
    let call = Call {
        proxy,
        rt,
        client,
        target,
        parts,
        body,
        id,
        args,
        raw,
        tenant,
        peer,
        proto: None,
        key,
    };
    run_queued(call, queue).await
}

/// How a sibling lifecycle (MCP `tools/call`, `proxy::mcp`) shapes the edges of this
/// execution core: how a downstream answer is judged and stored, and how a stored answer
/// is rendered for its client. Claim, send, record, reconcile and every decision stay
/// here; an HTTP call has no protocol (`None`, the default path, no dynamic call).
pub(super) trait Protocol: Send + Sync {
    /// What a downstream answer is.
    fn judge(&self, parts: &http::response::Parts, body: &Bytes) -> Judged;
    /// The client's answer for a stored response (the first answer, or a replay).
    fn render(
        &self,
        stored: &StoredResponse,
        id: &ExecutionId,
        replayed: bool,
    ) -> Response<ProxyBody>;
    /// The JSON the approval `preview` pointers point into.
    fn preview_source(&self) -> &[u8];
    /// Each piece of a downstream answer as it is read, before the whole answer is judged
    /// (an MCP SSE stream's progress events reach the client while the call runs).
    fn tap(&self, _head: &http::response::Parts, _data: &Bytes) {}
    /// Whether [`Protocol::lookup`] can reconcile an `outcome_unknown` record.
    fn has_lookup(&self) -> bool {
        false
    }
    /// Ask the downstream whether `record`'s effect happened (SPEC section 7), with the
    /// settle window that applies to a "not found".
    fn lookup<'a>(
        &'a self,
        _client: &'a HttpClient,
        _record: &'a Record,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = (Verdict, Duration)> + Send + 'a>> {
        Box::pin(std::future::ready((
            Verdict::Unknown("no lookup".into()),
            Duration::ZERO,
        )))
    }
    /// The orchestration ids the protocol's own message names, for those the request's
    /// headers do not (the parent operation is what cancellation finds), and the key the
    /// call was identified by.
    fn correlation(&self) -> (&Correlation, Option<&str>) {
        (&NO_CORRELATION, None)
    }
    /// What the protocol adds to a new record (a batch's items, an item's parent).
    fn decorate(&self, _record: &mut Record) {}
    /// Run the call some other way than one downstream request, under the record the
    /// core made durably `executing` (an independent batch runs its items, each an
    /// execution of its own). `None`: send the request.
    fn perform(
        &self,
    ) -> Option<std::pin::Pin<Box<dyn std::future::Future<Output = Performed> + Send + '_>>> {
        None
    }
    /// Whether running the call again is always safe, whatever the last attempt did (a
    /// batch whose items keep their own records): an `outcome_unknown` retry runs again
    /// instead of being reconciled.
    fn resumable(&self) -> bool {
        false
    }
}

/// How a [`Protocol::perform`] ended.
pub(super) enum Performed {
    /// Done: this answer is committed on the record.
    Answer(StoredResponse),
    /// Stopped part way: the record moves by `event` (`lose_outcome` or
    /// `fail_before_commit`) for `why`, and the client gets `answer`.
    Stopped {
        event: Event,
        why: String,
        answer: Response<ProxyBody>,
    },
}

/// [`Protocol::correlation`] of a protocol whose messages name no orchestration ids.
static NO_CORRELATION: Correlation = Correlation {
    operation_id: None,
    model_round: None,
    tool_call_id: None,
};

/// A downstream answer as a [`Protocol`] judges it.
pub(super) enum Judged {
    /// An answer to store: committed, or judged by `on_5xx` when `server_error`.
    Answer {
        stored: StoredResponse,
        server_error: bool,
    },
    /// The downstream refused the request before running it (kept for the client).
    Refused(StoredResponse, String),
    /// The answer to the call never came (a stream that ended without it).
    Lost(String),
}

/// A call a sibling lifecycle admitted itself: its identity and `args_hash` derived by
/// its own policy, `body` exactly what goes downstream.
pub(super) struct Sibling<'a> {
    pub parts: Parts,
    pub body: Bytes,
    pub id: ExecutionId,
    pub tenant: TenantScope,
    pub args: ArgsHash,
    pub proto: &'a dyn Protocol,
}

/// Run a sibling lifecycle's call through this core (see [`Protocol`]).
pub(super) async fn run_sibling(
    proxy: &Arc<Proxy>,
    rt: &Runtime,
    client: &HttpClient,
    target: &Target<'_>,
    call: Sibling<'_>,
    peer: &ClientAddr,
    queue: Option<Arc<tokio::sync::Semaphore>>,
) -> Response<ProxyBody> {
    let call = Call {
        proxy,
        rt,
        client,
        target,
        parts: call.parts,
        body: call.body,
        id: call.id,
        args: call.args,
        // Never looked up: a sibling's answers are not kept in the replay cache.
        raw: RawDigest([0; 32]),
        tenant: call.tenant,
        peer,
        proto: Some(call.proto),
        key: None,
    };
    run_queued(call, queue).await
}

async fn run_queued(
    call: Call<'_>,
    queue: Option<Arc<tokio::sync::Semaphore>>,
) -> Response<ProxyBody> {
    // The route's turns are all taken: a stored result is answered without one (a replay
    // never waits behind executions); anything else waits for its turn.
    let _turn = match queue {
        None => None,
        Some(turns) => {
            if let Ok(Some(r)) = call.proxy.store.get(&call.id).await {
                if r.state().has_result() && r.args_hash == call.args {
                    return failpoint::on_answer(call.replay(&r));
                }
            }
            turns.acquire_owned().await.ok()
        }
    };
    failpoint::on_answer(call.run().await)
}

/// Buffer the request body up to the limit; a side effect must be hashed and may be sent
/// again under the same identity, so it cannot be streamed.
pub(super) async fn read_body(
    incoming: RequestBody,
    parts: &Parts,
    limit: usize,
) -> Result<Bytes, Box<Response<ProxyBody>>> {
    let too_large = || {
        Box::new(
            Problem::new(Kind::BodyTooLarge, format!("request body is larger than limits.max_body_bytes ({limit} bytes); nothing was forwarded"))
                .into_response(),
        )
    };
    let declared = parts
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    body::read_all(incoming, limit).await.map_err(|e| match e {
        body::ReadError::TooLarge => too_large(),
        body::ReadError::Body(e) => Box::new(
            Problem::new(
                Kind::of_request_body_error(&*e),
                format!("could not read the request body: {e}"),
            )
            .into_response(),
        ),
    })
}

/// One side-effect request with its identity resolved.
struct Call<'a> {
    proxy: &'a Arc<Proxy>,
    rt: &'a Runtime,
    client: &'a HttpClient,
    target: &'a Target<'a>,
    parts: Parts,
    body: Bytes,
    id: ExecutionId,
    args: ArgsHash,
    /// The request's raw digest, for the replay cache.
    raw: RawDigest,
    tenant: TenantScope,
    peer: &'a ClientAddr,
    /// A sibling lifecycle's edges; `None` for HTTP.
    proto: Option<&'a dyn Protocol>,
    /// The key the call was identified by, when admission found one ([`Admitted::key`]).
    key: Option<String>,
}

/// What to do with an existing record.
enum Decision {
    Respond(Response<ProxyBody>),
    /// Move the record with this event (`Start`) and send.
    Execute(Event),
    /// `outcome_unknown`: find out before anything is sent again (SPEC section 7).
    Reconcile,
    /// The approval no longer covers the call (the text says why): ask for a new one.
    Reapprove(String),
    /// Another attempt owns it; hold this duplicate and look again.
    Wait,
}

/// Where a send stands relative to earlier sends of the same execution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SendMode {
    /// Nothing was sent before, or the earlier attempt is known not to have committed.
    First,
    /// Re-sent under the same key after an unknown outcome: the downstream replays keyed
    /// requests. Failing to reach it leaves the record `outcome_unknown`, never `failed`.
    Resend,
}

/// How one try of a send ended.
enum Sent {
    Answer(http::response::Parts, Bytes),
    Timeout,
    Failed(SendFailure, String),
}

/// What reconciling a retry led to.
enum Step {
    Respond(Response<ProxyBody>),
    /// The record changed under us: read it again.
    Again,
}

impl Call<'_> {
    fn route(&self) -> &Route {
        self.target.route
    }

    fn labels(&self) -> RouteLabels {
        Metrics::labels(&self.target.upstream.name, &self.route().name)
    }

    fn metrics(&self) -> &Metrics {
        &self.proxy.metrics
    }

    async fn run(self) -> Response<ProxyBody> {
        let deadline = tokio::time::Instant::now() + self.rt.config.timeouts.wait;
        let mut pause = Duration::from_millis(5);
        loop {
            let current = match self.proxy.store.get(&self.id).await {
                Ok(r) => r,
                Err(e) => return self.store_failed(e),
            };
            let record = match current {
                Some(r) => r,
                None => match self.proxy.store.claim(self.new_record()).await {
                    Ok(Claim::Claimed(r)) => return self.proceed(r).await,
                    Ok(Claim::Existing(r)) => r,
                    Err(e) => return self.store_failed(e),
                },
            };
            match self.decide(&record) {
                Decision::Respond(resp) => return resp,
                Decision::Execute(event) => {
                    let mut r = record;
                    if let Err(e) = r.apply(event, now_ms(), None) {
                        return Problem::new(Kind::Internal, e.to_string())
                            .execution(&self.id)
                            .into_response();
                    }
                    self.own(&mut r);
                    match self.proxy.store.update(r).await {
                        Ok(r) => return self.proceed(r).await,
                        // Someone else moved it first: look again.
                        Err(StoreError::Conflict { .. }) => continue,
                        Err(e) => return self.store_failed(e),
                    }
                }
                Decision::Reconcile => match self.reconcile(record).await {
                    Step::Respond(resp) => return resp,
                    Step::Again => continue,
                },
                Decision::Reapprove(why) => {
                    let mut r = record;
                    if let Err(e) = r.apply(Event::ApprovalLapsed, now_ms(), Some(why)) {
                        return Problem::new(Kind::Internal, e.to_string())
                            .execution(&self.id)
                            .into_response();
                    }
                    match self.proxy.store.update(r).await {
                        Ok(r) => return self.approval_required(&r),
                        Err(StoreError::Conflict { .. }) => continue,
                        Err(e) => return self.store_failed(e),
                    }
                }
                Decision::Wait => {
                    if tokio::time::Instant::now() >= deadline {
                        return self.in_flight();
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(100));
                }
            }
        }
    }

    fn new_record(&self) -> Record {
        let now = now_ms();
        let route = self.route();
        let mut r = Record::new(NewRecord {
            id: self.id.clone(),
            tenant: self.tenant.clone(),
            upstream: self.target.upstream.name.clone(),
            route: route.name.clone(),
            tool_version: route.tool_version.clone(),
            operation_id: None,
            args_hash: self.args.clone(),
            method: self.parts.method.to_string(),
            path: self.target.rel_path.clone(),
            query: self.parts.uri.query().map(str::to_string),
            path_params: self.target.params.clone(),
            preview: route.approval.as_ref().map(|a| {
                let mut p = preview(self.preview_source(), &a.preview);
                // An approver of a batch sees how many items it carries (SPEC section 9.3).
                if let (Some(b), serde_json::Value::Object(m)) = (&route.batch, &mut p) {
                    let n = batch::count(b, self.preview_source());
                    m.insert("items".into(), n.into());
                }
                p
            }),
            now_ms: now,
            expires_at_ms: now.saturating_add(route.retention.as_millis() as i64),
        });
        // The orchestration parts the call was identified by (SPEC section 10): the
        // trusted headers first, then what the protocol's message names.
        let mut ids = identity::correlation(&self.parts.headers, &self.rt.config.identity);
        let mut key = self.key.clone();
        if let Some((theirs, their_key)) = self.proto.map(|p| p.correlation()) {
            ids.operation_id = ids.operation_id.or_else(|| theirs.operation_id.clone());
            ids.model_round = ids.model_round.or_else(|| theirs.model_round.clone());
            ids.tool_call_id = ids.tool_call_id.or_else(|| theirs.tool_call_id.clone());
            key = key.or_else(|| their_key.map(str::to_string));
        }
        r.operation_id = ids.operation_id;
        r.model_round = ids.model_round;
        r.tool_call_id = ids.tool_call_id;
        r.key = key;
        if let Some(p) = self.proto {
            p.decorate(&mut r);
        }
        let needs_approval = route.approval.as_ref().is_some_and(|a| a.required);
        let event = if needs_approval {
            Event::RequestApproval
        } else {
            Event::Start
        };
        r.apply(event, now, None)
            .expect("prepared accepts both start and request_approval");
        if r.state() == State::Executing {
            self.own(&mut r);
        }
        r
    }

    /// Take ownership of a record about to be sent: our lease and, where a re-send may
    /// follow, the exact body that is going out.
    fn own(&self, r: &mut Record) {
        r.lease = Some(self.lease());
        if self
            .route()
            .downstream_key
            .as_ref()
            .is_some_and(|k| k.replays)
        {
            r.sent_body = Some(self.body.to_vec());
        }
    }

    fn preview_source(&self) -> &[u8] {
        self.proto.map_or(&self.body[..], |p| p.preview_source())
    }

    /// The client's answer for a stored response.
    fn stored_response(&self, stored: &StoredResponse, replayed: bool) -> Response<ProxyBody> {
        match self.proto {
            None => stored_response(stored, &self.id),
            Some(p) => p.render(stored, &self.id, replayed),
        }
    }

    fn lease(&self) -> Lease {
        Lease {
            owner: self.proxy.owner.clone(),
            expires_at_ms: now_ms().saturating_add(self.rt.config.store.lease.as_millis() as i64),
        }
    }

    /// The policy for a record that already exists (SPEC section 6).
    fn decide(&self, r: &Record) -> Decision {
        let decision = self.decide_inner(r);
        if matches!(decision, Decision::Respond(_))
            && matches!(
                r.state(),
                State::Committed
                    | State::ResultDelivered
                    | State::Executing
                    | State::OutcomeUnknown
            )
        {
            self.metrics()
                .duplicates_prevented
                .get_or_create(&self.labels())
                .inc();
        }
        decision
    }

    fn decide_inner(&self, r: &Record) -> Decision {
        if r.args_hash != self.args {
            self.count_refusal("key_mismatch");
            return Decision::Respond(
                Problem::new(
                    Kind::KeyMismatch,
                    "this idempotency key was first used with different arguments; use a new key for a new action",
                )
                .execution(&self.id)
                .with("args_hash", self.args.as_str())
                .into_response(),
            );
        }
        match r.state() {
            State::Committed | State::ResultDelivered => Decision::Respond(self.replay(r)),
            State::Executing => match self.route().concurrent {
                Concurrent::Wait => Decision::Wait,
                Concurrent::Reject => Decision::Respond(self.in_flight()),
            },
            State::OutcomeUnknown => Decision::Reconcile,
            State::Prepared => Decision::Execute(Event::Start),
            State::Approved | State::FailedBeforeCommit => match self.approval_gap(r) {
                None => Decision::Execute(Event::Start),
                Some(why) => Decision::Reapprove(why),
            },
            State::AwaitingApproval => Decision::Respond(self.approval_required(r)),
            State::Rejected => Decision::Respond(
                Problem::new(Kind::Rejected, rejection_detail(r))
                    .execution(&self.id)
                    .into_response(),
            ),
            State::CancelledBeforeCommit => Decision::Respond(
                Problem::new(
                    Kind::Cancelled,
                    "the operation was cancelled before this call was sent",
                )
                .execution(&self.id)
                .into_response(),
            ),
        }
    }

    fn in_flight(&self) -> Response<ProxyBody> {
        self.count_refusal("in_flight");
        Problem::new(
            Kind::InFlight,
            "an attempt with this key is executing; retry later to get its result",
        )
        .execution(&self.id)
        .header(http::header::RETRY_AFTER, HeaderValue::from_static("1"))
        .into_response()
    }

    /// Why the record may not start on a route that requires approval, if it may not: a
    /// call runs only on an unexpired approval of exactly its arguments.
    fn approval_gap(&self, r: &Record) -> Option<String> {
        if !self.route().approval.as_ref().is_some_and(|a| a.required) {
            return None;
        }
        match &r.approval {
            None => Some("no approval is on record for this call".into()),
            Some(a) if a.args_hash != r.args_hash => {
                Some("the approval on record covers other arguments".into())
            }
            Some(a) if a.expires_at_ms.is_some_and(|t| t <= now_ms()) => Some(format!(
                "the approval by {} expired before the call was sent",
                a.by
            )),
            Some(_) => None,
        }
    }

    /// The record is durably claimed (`executing`, or awaiting approval): unless its
    /// operation was cancelled, send it or ask for approval. The mark is read after the
    /// durable write, never before, so a concurrent cancellation either finds this record
    /// in its listing or is found here.
    async fn proceed(&self, r: Record) -> Response<ProxyBody> {
        let mark = match &r.operation_id {
            None => Ok(None),
            Some(op) => self.proxy.store.operation(op).await,
        };
        match (mark, r.state()) {
            (Ok(Some(mark)), _) => self.cancel_unsent(r, mark).await,
            (Ok(None), State::Executing) => {
                failpoint::hit("after_prepared").await;
                // Boxed: a call waiting on its claim holds only what it needs so far.
                Box::pin(self.execute(r, SendMode::First)).await
            }
            (Ok(None), _) => self.approval_required(&r),
            (Err(e), State::Executing) => {
                // Nothing was sent: fail closed without leaving an `executing` record behind.
                let why = format!("could not check whether the operation was cancelled: {e}");
                if let Err(e) = self.transition(r, Event::FailBeforeCommit, Some(why)).await {
                    tracing::error!(execution_id = %self.id, error = %e, "could not record failed_before_commit");
                }
                self.store_failed(e)
            }
            (Err(e), _) => self.store_failed(e),
        }
    }

    /// A call of a cancelled operation that was never sent becomes `cancelled_before_commit`.
    async fn cancel_unsent(&self, mut r: Record, mark: OperationMark) -> Response<ProxyBody> {
        let now = now_ms();
        let note = format!(
            "operation cancelled by {} before the call was sent",
            mark.by
        );
        let moved = if r.state() == State::Executing {
            r.apply(Event::FailBeforeCommit, now, Some(note.clone()))
        } else {
            Ok(())
        }
        .and_then(|()| r.apply(Event::Cancel, now, Some(note)));
        if let Err(e) = moved {
            return Problem::new(Kind::Internal, e.to_string())
                .execution(&self.id)
                .into_response();
        }
        match self.proxy.store.update(r).await {
            Ok(_) => {
                tracing::info!(execution_id = %self.id, "call of a cancelled operation refused before sending");
                Problem::new(
                    Kind::Cancelled,
                    "the operation was cancelled before this call was sent",
                )
                .execution(&self.id)
                .into_response()
            }
            Err(e) => self.store_failed(e),
        }
    }

    fn approval_required(&self, r: &Record) -> Response<ProxyBody> {
        self.count_refusal("approval_required");
        let detail = match r.note.as_deref() {
            Some(why) => {
                format!("this call needs an operator's approval of these exact arguments ({why})")
            }
            None => "this call needs an operator's approval of these exact arguments".into(),
        };
        Problem::new(Kind::ApprovalRequired, detail)
            .execution(&self.id)
            .with("args_hash", r.args_hash.as_str())
            .with(
                "preview",
                r.preview.clone().unwrap_or(serde_json::Value::Null),
            )
            .into_response()
    }

    fn store_failed(&self, e: StoreError) -> Response<ProxyBody> {
        tracing::error!(execution_id = %self.id, error = %e, "store failure");
        Problem::new(
            Kind::StoreUnavailable,
            format!("the execution store failed ({e}); nothing was sent"),
        )
        .execution(&self.id)
        .into_response()
    }

    /// Reconcile a retry of an `outcome_unknown` record (SPEC section 7): re-send under the
    /// same key to a downstream that replays, else ask the lookup, else leave it to an
    /// operator. Nothing is sent again unless that is known to be safe.
    async fn reconcile(&self, record: Record) -> Step {
        let route = self.route();
        let (upstream_name, route_name) = (&self.target.upstream.name, &route.name);
        let plan = if self.proto.is_some_and(|p| p.resumable()) {
            Plan::Resend
        } else {
            reconcile::plan(route)
        };
        match plan {
            Plan::Resend => {
                // A re-send may create the effect if the first attempt never did: not
                // under an operation that was cancelled meanwhile.
                let mark = match &record.operation_id {
                    None => None,
                    Some(op) => match self.proxy.store.operation(op).await {
                        Ok(m) => m,
                        Err(e) => return Step::Respond(self.store_failed(e)),
                    },
                };
                if let Some(mark) = mark {
                    self.count_prevented();
                    return Step::Respond(self.unknown_retry(
                        format!("the operation was cancelled by {}; the earlier attempt may or may not have taken effect and nothing more is sent", mark.by),
                        None,
                    ));
                }
                let mut r = record;
                let note = "re-sent under the same key: the downstream replays keyed requests";
                if let Err(e) = r.apply(Event::Resend, now_ms(), Some(note.into())) {
                    return Step::Respond(self.internal(e.to_string()));
                }
                r.lease = Some(self.lease());
                match self.proxy.store.update(r).await {
                    Ok(r) => {
                        tracing::info!(execution_id = %self.id, "outcome unknown: re-sending under the same key");
                        self.metrics()
                            .reconciled(upstream_name, route_name, "resent");
                        failpoint::hit("after_prepared").await;
                        Step::Respond(Box::pin(self.execute(r, SendMode::Resend)).await)
                    }
                    Err(StoreError::Conflict { .. }) => Step::Again,
                    Err(e) => Step::Respond(self.store_failed(e)),
                }
            }
            // A sibling protocol's own lookup (an MCP `reconcile.tool`) when the route has none.
            plan @ (Plan::Lookup(_) | Plan::Operator)
                if matches!(plan, Plan::Lookup(_))
                    || self.proto.is_some_and(|p| p.has_lookup()) =>
            {
                let (verdict, settle) = match (plan, self.proto) {
                    (Plan::Lookup(spec), _) => {
                        let limit = self.rt.config.limits.max_response_bytes;
                        let headers = downstream::request_headers(
                            &self.parts.headers,
                            self.target.upstream,
                            self.peer,
                            &[&self.rt.config.identity.key_header],
                        );
                        let verdict = lookup::lookup(
                            self.client,
                            self.target.upstream,
                            route,
                            spec,
                            &record,
                            Some(headers),
                            limit,
                        )
                        .await;
                        (verdict, spec.settle)
                    }
                    (_, Some(p)) => p.lookup(self.client, &record).await,
                    (_, None) => unreachable!("guarded above"),
                };
                let result = verdict.name();
                match verdict {
                    found @ Verdict::Found { .. } => {
                        let mut r = record;
                        if !lookup::apply_found(&mut r, found) {
                            return Step::Again;
                        }
                        match self.proxy.store.update(r).await {
                            Ok(r) => {
                                tracing::info!(execution_id = %self.id, "outcome unknown: the lookup found the effect; committed");
                                lookup::found_under_cancelled_operation(
                                    self.proxy.store.as_ref(),
                                    &r,
                                )
                                .await;
                                self.metrics().reconciled(upstream_name, route_name, result);
                                self.count_prevented();
                                Step::Respond(self.replay(&r))
                            }
                            Err(StoreError::Conflict { .. }) => Step::Again,
                            Err(e) => Step::Respond(self.store_failed(e)),
                        }
                    }
                    Verdict::NotFound => match reconcile::settled(&record, settle, now_ms()) {
                        Ok(()) => {
                            let mut r = record;
                            let note = "reconciled: the lookup did not find the effect; it may execute under the same key";
                            if let Err(e) =
                                r.apply(Event::ResolveNotCommitted, now_ms(), Some(note.into()))
                            {
                                return Step::Respond(self.internal(e.to_string()));
                            }
                            // Now `failed_before_commit`: the next turn of the loop starts it
                            // through the same gates as any retry (approval, cancellation).
                            match self.proxy.store.update(r).await {
                                Ok(_) => {
                                    tracing::info!(execution_id = %self.id, "outcome unknown: the lookup did not find the effect; executing");
                                    self.metrics().reconciled(upstream_name, route_name, result);
                                    Step::Again
                                }
                                Err(StoreError::Conflict { .. }) => Step::Again,
                                Err(e) => Step::Respond(self.store_failed(e)),
                            }
                        }
                        Err(left) => {
                            self.metrics()
                                .reconciled(upstream_name, route_name, "unknown");
                            self.count_prevented();
                            Step::Respond(self.unknown_retry(
                                format!("the lookup did not find the effect, but the last attempt may still be in progress downstream (settle window {:?}); it is not re-sent yet", settle),
                                Some(left),
                            ))
                        }
                    },
                    Verdict::Unknown(why) => {
                        tracing::warn!(execution_id = %self.id, reason = %why, "outcome unknown: the lookup proved nothing");
                        self.metrics().reconciled(upstream_name, route_name, result);
                        self.count_prevented();
                        Step::Respond(self.unknown_retry(
                            format!("{why}; the earlier attempt may or may not have taken effect and is not re-sent"),
                            Some(Duration::from_secs(5)),
                        ))
                    }
                }
            }
            Plan::Lookup(_) | Plan::Operator => {
                self.count_prevented();
                Step::Respond(self.unknown_retry(
                    "an earlier attempt may or may not have taken effect, and this route has no way to find out (no replaying downstream key, no reconcile lookup); it stays unknown until an operator resolves it".into(),
                    None,
                ))
            }
        }
    }

    /// A call answered without sending (`idemproxy_refusals_total{result}`).
    fn count_refusal(&self, why: &str) {
        let t = self.target;
        Metrics::count(
            &self.metrics().refusals,
            &t.upstream.name,
            &t.route.name,
            why,
        );
    }

    fn count_prevented(&self) {
        self.metrics()
            .duplicates_prevented
            .get_or_create(&self.labels())
            .inc();
    }

    fn internal(&self, why: String) -> Response<ProxyBody> {
        Problem::new(Kind::Internal, why)
            .execution(&self.id)
            .into_response()
    }

    /// `409` problem `outcome-unknown` for a retry. `Retry-After` is set only when the
    /// proxy expects to learn more (a settle window, a lookup to try again); without it the
    /// record waits for an operator and retrying will not change the answer.
    fn unknown_retry(&self, why: String, retry_after: Option<Duration>) -> Response<ProxyBody> {
        let mut p = Problem::new(Kind::OutcomeUnknownPending, why)
            .execution(&self.id)
            .header(STATUS, HeaderValue::from_static("outcome_unknown"));
        if let Some(d) = retry_after {
            let secs = d.as_millis().div_ceil(1000).max(1);
            p = p.header(http::header::RETRY_AFTER, HeaderValue::from(secs as u64));
        }
        p.into_response()
    }

    /// The downstream request for one try (a fresh one per try: bodies are consumed).
    fn request(&self, body: Bytes) -> Result<Request<ProxyBody>, String> {
        let route = self.route();
        let upstream = self.target.upstream;
        let uri = downstream::target_uri(self.target, self.parts.uri.query())
            .map_err(|e| format!("cannot build upstream URI: {e}"))?;
        let mut headers = downstream::request_headers(
            &self.parts.headers,
            upstream,
            self.peer,
            &[&self.rt.config.identity.key_header],
        );
        if let Some(dk) = &route.downstream_key {
            // `insert` replaces every existing value: the downstream sees exactly one.
            headers.insert(
                dk.header.clone(),
                downstream::header_value(self.id.as_str()),
            );
        }
        Ok(downstream::build(
            self.parts.method.clone(),
            uri,
            headers,
            body::full(body),
        ))
    }

    /// One try: send and read the whole answer within the route's timeout.
    async fn send(&self, req: Request<ProxyBody>) -> Sent {
        let route = self.route();
        let (req, sent) = {
            let (parts, b) = req.into_parts();
            let (b, sent) = failpoint::watch_sent("in_flight", b);
            (Request::from_parts(parts, b), sent)
        };
        let work = tokio::time::timeout(route.timeout, async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|e| (client::classify(&e), client::describe(&e)))?;
            let (rparts, rbody) = resp.into_parts();
            let limit = self.rt.config.limits.max_response_bytes;
            let read = match self.proto {
                None => Limited::new(rbody, limit)
                    .collect()
                    .await
                    .map(|c| c.to_bytes()),
                Some(p) => tapped(&rparts, rbody, limit, p).await,
            };
            let bytes = read.map_err(|e: BoxError| {
                (
                    SendFailure::AfterSend,
                    format!("reading the response failed: {e}"),
                )
            })?;
            Ok::<_, (SendFailure, String)>((rparts, bytes))
        });
        let outcome = match sent {
            None => work.await,
            Some(sent) => {
                // Failpoint `in_flight`: once the request is handed over, stop here (outside
                // the timeout, which would otherwise end the park).
                tokio::pin!(work);
                tokio::select! {
                    biased;
                    r = &mut work => r,
                    Ok(()) = sent => {
                        failpoint::hit("in_flight").await;
                        work.await
                    }
                }
            }
        };
        match outcome {
            Err(_) => Sent::Timeout,
            Ok(Err((failure, why))) => Sent::Failed(failure, why),
            Ok(Ok((parts, bytes))) => Sent::Answer(parts, bytes),
        }
    }

    /// Send the request downstream under a record that is durably `executing`.
    async fn execute(&self, record: Record, mode: SendMode) -> Response<ProxyBody> {
        let route = self.route();
        let upstream = self.target.upstream;
        // A re-send must be byte-identical to what the downstream saw first.
        let body = match (mode, &record.sent_body) {
            (SendMode::Resend, Some(b)) => Bytes::from(b.clone()),
            _ => self.body.clone(),
        };
        tracing::info!(execution_id = %self.id, upstream = %upstream.name, route = %route.name, attempt = record.attempts, resend = mode == SendMode::Resend, "executing");
        if let Some(work) = self.proto.and_then(|p| p.perform()) {
            return match work.await {
                Performed::Answer(stored) => self.finish_committed(record, stored).await,
                Performed::Stopped { event, why, answer } => {
                    tracing::warn!(execution_id = %self.id, reason = %why, event = event.as_str(), "stopped part way");
                    self.record_outcome(record, event, &why).await;
                    answer
                }
            };
        }
        self.metrics().attempts.get_or_create(&self.labels()).inc();
        let started = tokio::time::Instant::now();
        // Executor retries: only a send that provably never left (connect, DNS, TLS) is
        // tried again, under the same execution; anything else is the model's business.
        let tries = route.retry.attempts.max(1);
        let mut backoff = route.retry.backoff;
        let mut tried = 1;
        let sent = loop {
            let req = match self.request(body.clone()) {
                Ok(r) => r,
                Err(why) => break Sent::Failed(SendFailure::BeforeSend, why),
            };
            failpoint::hit("before_downstream").await;
            match self.send(req).await {
                Sent::Failed(SendFailure::BeforeSend, why) if tried < tries => {
                    tracing::debug!(execution_id = %self.id, try_no = tried, reason = %why, "nothing was sent; trying again under the same execution");
                    tokio::time::sleep(backoff).await;
                    backoff = backoff.saturating_mul(2);
                    tried += 1;
                }
                other => break other,
            }
        };
        let elapsed = started.elapsed();
        self.metrics()
            .upstream_duration
            .get_or_create(&self.labels())
            .observe(elapsed.as_secs_f64());
        match sent {
            Sent::Timeout => {
                let why = format!("no complete answer within {:?}", route.timeout);
                self.finish_unknown(record, why, true).await
            }
            Sent::Failed(SendFailure::BeforeSend, why) => match mode {
                SendMode::First => self.finish_failed(record, why, None).await,
                SendMode::Resend => {
                    let why =
                        format!("{why} (re-send; the earlier attempt's outcome is still unknown)");
                    self.finish_unknown(record, why, false).await
                }
            },
            Sent::Failed(SendFailure::AfterSend, why) => {
                self.finish_unknown(record, why, false).await
            }
            Sent::Answer(rparts, bytes) => {
                failpoint::hit("after_remote_commit").await;
                tracing::debug!(execution_id = %self.id, status = %rparts.status, elapsed_ms = elapsed.as_millis() as u64, "downstream answered");
                if mode == SendMode::Resend && rparts.status == StatusCode::CONFLICT {
                    // A downstream that dedups keyed requests answers 409 while the
                    // original request with this key is still being processed.
                    return self.finish_still_in_flight(record).await;
                }
                let status = rparts.status;
                let (stored, server_error) = match self.proto {
                    None => http_answer(&rparts, &bytes),
                    Some(p) => match p.judge(&rparts, &bytes) {
                        Judged::Answer {
                            stored,
                            server_error,
                        } => (stored, server_error),
                        Judged::Refused(stored, why) => {
                            return self.finish_failed(record, why, Some(stored)).await
                        }
                        Judged::Lost(why) => return self.finish_unknown(record, why, false).await,
                    },
                };
                if server_error {
                    match route.on_5xx {
                        On5xx::Committed => self.finish_committed(record, stored).await,
                        On5xx::FailedBeforeCommit => {
                            let why = format!(
                                "downstream answered {status} (on_5xx: failed_before_commit)"
                            );
                            self.finish_failed(record, why, Some(stored)).await
                        }
                        On5xx::OutcomeUnknown => {
                            let why =
                                format!("downstream answered {status} (on_5xx: outcome_unknown)");
                            self.finish_5xx_unknown(record, why, stored).await
                        }
                    }
                } else {
                    self.finish_committed(record, stored).await
                }
            }
        }
    }

    /// A re-send found the original request still in progress downstream: still unknown,
    /// and worth asking again shortly.
    async fn finish_still_in_flight(&self, record: Record) -> Response<ProxyBody> {
        let why = "the downstream reports the original request with this key is still in progress (409 on re-send)".to_string();
        tracing::info!(execution_id = %self.id, "re-send: the original request is still in progress downstream");
        if let Err(e) = self
            .transition(record, Event::LoseOutcome, Some(why.clone()))
            .await
        {
            tracing::error!(execution_id = %self.id, error = %e, "could not record outcome_unknown");
        } else {
            failpoint::hit("after_local_commit").await;
        }
        self.unknown_retry(why, Some(Duration::from_secs(1)))
    }

    /// Write `record` after applying `event`; on a fencing conflict, return what is stored now.
    /// A webhook event that joined the record while this attempt executed (the only other
    /// writer of an executing record, see `proxy::webhook`) is taken along, and a
    /// `succeeded` one held there settles the call instead of leaving it `outcome_unknown`.
    async fn transition(
        &self,
        mut record: Record,
        event: Event,
        note: Option<String>,
    ) -> Result<Record, StoreError> {
        let now = now_ms();
        if let Err(e) = record.apply(event, now, note) {
            return Err(StoreError::Backend(e.to_string()));
        }
        let mut settled = crate::policy::webhook::settle_held(&mut record, now);
        let mut update = self.proxy.store.update(record.clone()).await;
        for _ in 0..3 {
            let Err(StoreError::Conflict { .. }) = &update else {
                break;
            };
            let Ok(Some(current)) = self.proxy.store.get(&self.id).await else {
                break;
            };
            if !super::pending::rebase_on_events(&mut record, &current) {
                break;
            }
            settled |= crate::policy::webhook::settle_held(&mut record, now_ms());
            update = self.proxy.store.update(record.clone()).await;
        }
        let stored = match update {
            Ok(stored) => stored,
            Err(e @ StoreError::Backend(_)) => {
                // Never leave the record `executing` under our live lease (issue 34).
                super::pending::keep_writing(self.proxy.store.clone(), record);
                return Err(e);
            }
            Err(e) => return Err(e),
        };
        if settled {
            tracing::info!(execution_id = %self.id, "outcome unknown: settled as committed by a webhook event held while executing");
            let labels = self.labels();
            self.proxy
                .metrics
                .reconciled(&labels.upstream, &labels.route, "webhook");
        }
        if stored.state() == State::OutcomeUnknown {
            self.metrics()
                .outcome_unknown
                .get_or_create(&self.labels())
                .inc();
        }
        Ok(stored)
    }

    async fn finish_committed(
        &self,
        mut record: Record,
        stored: StoredResponse,
    ) -> Response<ProxyBody> {
        annotate(self.route(), &mut record, &stored);
        record.response = Some(stored.clone());
        match self.transition(record, Event::Commit, None).await {
            Ok(r) => {
                failpoint::hit("after_local_commit").await;
                if r.job.is_some() {
                    self.proxy.metrics.job(
                        &r.upstream,
                        &r.route,
                        crate::policy::job::JobState::Running,
                    );
                }
                self.respond(&r, false)
            }
            Err(StoreError::Conflict { .. }) => self.commit_after_takeover(stored).await,
            Err(e) => {
                // The effect happened but is not recorded yet: the answer is kept and
                // written when the store takes it (`pending`), so a retry replays it; the
                // client must not assume failure.
                tracing::error!(execution_id = %self.id, error = %e, "downstream committed but the record could not be written");
                self.unknown_problem(
                    format!("the downstream answered but the record could not be stored yet ({e}); the answer is kept and stored once the store recovers, so a retry with the same key returns it"),
                    false,
                )
            }
        }
    }

    /// Our lease was taken over while we were executing (fencing). We hold the real
    /// answer: if the record is still undecided, resolve it with that answer; never
    /// overwrite a decision someone else made.
    async fn commit_after_takeover(&self, stored: StoredResponse) -> Response<ProxyBody> {
        let current = match self.proxy.store.get(&self.id).await {
            Ok(Some(r)) => r,
            Ok(None) => {
                return self.unknown_problem("the record vanished while executing".into(), false)
            }
            Err(e) => return self.store_failed(e),
        };
        let state = current.state();
        if state == State::OutcomeUnknown {
            let mut r = current;
            annotate(self.route(), &mut r, &stored);
            r.response = Some(stored);
            let note = Some("late answer from the original attempt".to_string());
            if let Ok(r) = self.transition(r, Event::ResolveCommitted, note).await {
                return self.respond(&r, false);
            }
        } else if state.has_result() {
            return self.replay(&current);
        }
        tracing::error!(execution_id = %self.id, state = %state, "lost the lease while executing; another decision stands");
        self.unknown_problem(
            "this attempt lost ownership of the execution while it ran; see the record".into(),
            false,
        )
    }

    async fn finish_failed(
        &self,
        record: Record,
        why: String,
        downstream: Option<StoredResponse>,
    ) -> Response<ProxyBody> {
        tracing::warn!(execution_id = %self.id, reason = %why, "failed before commit");
        self.record_outcome(record, Event::FailBeforeCommit, &why)
            .await;
        match downstream {
            Some(stored) => {
                let mut resp = self.stored_response(&stored, false);
                resp.headers_mut()
                    .insert(STATUS, HeaderValue::from_static("failed_before_commit"));
                resp
            }
            None => Problem::new(
                Kind::UpstreamUnavailable,
                format!(
                    "{why}; nothing reached the downstream, a retry with the same key may execute"
                ),
            )
            .execution(&self.id)
            .header(STATUS, HeaderValue::from_static("failed_before_commit"))
            .into_response(),
        }
    }

    async fn finish_unknown(
        &self,
        record: Record,
        why: String,
        timeout: bool,
    ) -> Response<ProxyBody> {
        tracing::warn!(execution_id = %self.id, reason = %why, "outcome unknown");
        match self.record_outcome(record, Event::LoseOutcome, &why).await {
            // Settled at once by a webhook event held while it executed: the answer is known.
            Some(settled) if settled.state().has_result() => self.respond(&settled, false),
            _ => self.unknown_problem(why, timeout),
        }
    }

    async fn finish_5xx_unknown(
        &self,
        record: Record,
        why: String,
        stored: StoredResponse,
    ) -> Response<ProxyBody> {
        tracing::warn!(execution_id = %self.id, reason = %why, "outcome unknown");
        if let Some(settled) = self.record_outcome(record, Event::LoseOutcome, &why).await {
            if settled.state().has_result() {
                return self.respond(&settled, false);
            }
        }
        let mut resp = self.stored_response(&stored, false);
        resp.headers_mut()
            .insert(STATUS, HeaderValue::from_static("outcome_unknown"));
        resp
    }

    /// Store how an attempt ended without a committed answer, and return the record as
    /// stored. If that write fails the record stays `executing`, which recovery turns into
    /// `outcome_unknown`: never lost.
    async fn record_outcome(&self, record: Record, event: Event, why: &str) -> Option<Record> {
        match self.transition(record, event, Some(why.to_string())).await {
            Ok(stored) => {
                failpoint::hit("after_local_commit").await;
                Some(stored)
            }
            Err(e) => {
                tracing::error!(execution_id = %self.id, error = %e, event = event.as_str(), "could not record the attempt's outcome");
                None
            }
        }
    }

    fn unknown_problem(&self, why: String, timeout: bool) -> Response<ProxyBody> {
        let kind = if timeout {
            Kind::OutcomeUnknownTimeout
        } else {
            Kind::OutcomeUnknown
        };
        Problem::new(
            kind,
            format!(
                "{why}; the call may or may not have taken effect and will not be re-sent blindly"
            ),
        )
        .execution(&self.id)
        .header(STATUS, HeaderValue::from_static("outcome_unknown"))
        .into_response()
    }

    /// The first answer: the stored response; `result_delivered` once the body is out.
    fn respond(&self, r: &Record, replayed: bool) -> Response<ProxyBody> {
        let Some(stored) = r.response.as_ref() else {
            return Problem::new(Kind::Internal, "committed record has no stored response")
                .execution(&self.id)
                .into_response();
        };
        let mut resp = self.stored_response(stored, replayed);
        if replayed {
            resp.headers_mut()
                .insert(REPLAYED, HeaderValue::from_static("true"));
        }
        if r.state() != State::Committed {
            return resp;
        }
        let store = self.proxy.store.clone();
        // Only a replayed answer is kept in memory (see `proxy::replay`): most first
        // answers are never asked for again.
        let replays = (replayed && self.proto.is_none()).then(|| self.rt.shared.replays.clone());
        let raw = self.raw;
        let record = r.clone();
        resp.map(move |b| {
            NotifyOnEnd::new(b, move || {
                tokio::spawn(async move {
                    failpoint::hit("after_answer").await;
                    let mut record = record;
                    if record.apply(Event::Deliver, now_ms(), None).is_ok() {
                        // Best effort: a conflict means another attempt already marked it.
                        if let Ok(delivered) = store.update(record).await {
                            if let Some(replays) = replays {
                                replays.remember(&delivered, raw);
                            }
                        }
                    }
                });
            })
            .boxed()
        })
    }

    fn replay(&self, r: &Record) -> Response<ProxyBody> {
        tracing::info!(execution_id = %self.id, from = "store", "replayed stored result");
        self.metrics().replays.get_or_create(&self.labels()).inc();
        if self.proto.is_none() {
            self.rt.shared.replays.remember(r, self.raw);
        }
        self.respond(r, true)
    }
}

/// Read a downstream answer whole (up to `limit`), showing each piece to `proto` first.
async fn tapped<B>(
    head: &http::response::Parts,
    body: B,
    limit: usize,
    proto: &dyn Protocol,
) -> Result<Bytes, BoxError>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let mut body = Limited::new(body, limit);
    let mut all = bytes::BytesMut::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            proto.tap(head, &data);
            all.extend_from_slice(&data);
        }
    }
    Ok(all.freeze())
}

/// A plain HTTP answer as it is stored: its status, its headers but those that framed or
/// routed this one exchange, its body; and whether it is a server error (`on_5xx`).
pub(super) fn http_answer(rparts: &http::response::Parts, bytes: &Bytes) -> (StoredResponse, bool) {
    let server_error = rparts.status.is_server_error();
    let mut rheaders = rparts.headers.clone();
    downstream::stored_headers(&mut rheaders);
    let stored = StoredResponse {
        status: rparts.status.as_u16(),
        headers: rheaders
            .iter()
            .map(|(n, v)| (n.as_str().to_string(), v.as_bytes().to_vec()))
            .collect(),
        body: bytes.to_vec(),
    };
    (stored, server_error)
}

pub(super) fn stored_response(stored: &StoredResponse, id: &ExecutionId) -> Response<ProxyBody> {
    let (status, headers) = replay::response_head(stored, id);
    let mut resp = Response::new(body::full(Bytes::from(stored.body.clone())));
    *resp.status_mut() = status;
    *resp.headers_mut() = headers;
    resp
}

/// Values at the configured pointers, for an approver to see (never logged).
fn preview(body: &[u8], pointers: &[String]) -> serde_json::Value {
    let parsed: Option<serde_json::Value> = serde_json::from_slice(body).ok();
    let mut out = serde_json::Map::new();
    for p in pointers {
        let v = parsed
            .as_ref()
            .and_then(|j| j.pointer(p))
            .cloned()
            .unwrap_or(serde_json::Value::Null);
        out.insert(p.clone(), v);
    }
    serde_json::Value::Object(out)
}

/// What a committed answer names: the downstream's own id and, on `job:` routes, the
/// background job a successful answer started (SPEC section 9.2; its id is the external id).
fn annotate(route: &Route, record: &mut Record, stored: &StoredResponse) {
    record.external_id = route
        .external_id
        .as_deref()
        .and_then(|p| external_id(stored, p));
    record.external_indexed = route.index_external_id && record.external_id.is_some();
    let Some(spec) = &route.job else { return };
    if !(200..300).contains(&stored.status) {
        return;
    }
    if let Some(id) = crate::policy::job::job_id(spec, &stored.body) {
        let now = now_ms();
        record.external_id = Some(id.clone());
        record.external_indexed = true;
        record.job = Some(crate::store::record::Job {
            id,
            state: crate::policy::job::JobState::Running,
            result: None,
            event: None,
            ended_by: None,
            started_at_ms: now,
            updated_at_ms: now,
        });
    }
}

fn external_id(stored: &StoredResponse, pointer: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(&stored.body).ok()?;
    match v.pointer(pointer)? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}
