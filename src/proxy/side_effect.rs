//! Side-effect routes: the lifecycle `admit → identify → fingerprint → claim/decide →
//! forward → record → respond`. The invariants of SPEC section 5 are kept here: the record
//! is durably `executing` before the first byte goes downstream, and durably `committed`
//! with the full answer before the client sees it. Two operator decisions are enforced
//! here too: a call only runs on an approval that covers its arguments and has not expired,
//! and nothing more is sent under a cancelled operation (SPEC section 8).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;

use super::{downstream, passthrough, Proxy, Runtime};
use crate::config::{Concurrent, On5xx, Route};
use crate::failpoint;
use crate::metrics::{Metrics, RouteLabels};
use crate::policy::classify::Target;
use crate::policy::fingerprint::{args_hash, RequestParts};
use crate::policy::identity::{self, ArgsHash, ExecutionId, KeyLookup, TenantScope};
use crate::policy::state::{Event, State};
use crate::store::{
    now_ms, Claim, Lease, NewRecord, OperationMark, Record, StoreError, StoredResponse,
};
use crate::wire::body::{self, BoxError, NotifyOnEnd, ProxyBody};
use crate::wire::client::{self, HttpClient, SendFailure};
use crate::wire::headers::{EXECUTION_ID, REPLAYED, STATUS};
use crate::wire::problem::{Kind, Problem};

/// Entry for a request classified as a side effect.
pub async fn handle(
    proxy: &Arc<Proxy>,
    rt: &Runtime,
    client: &HttpClient,
    target: &Target<'_>,
    req: Request<Incoming>,
    peer: SocketAddr,
) -> Response<ProxyBody> {
    let cfg = &rt.config;
    let route = target.route;
    // admit: the key decides whether this call is protected at all.
    let key = match identity::find_key(
        req.headers(),
        &cfg.identity,
        route,
        cfg.limits.max_key_bytes,
    ) {
        KeyLookup::Found { key, .. } => key,
        KeyLookup::Missing if route.key_required => {
            return Problem::new(
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
            .into_response();
        }
        KeyLookup::Missing => {
            tracing::warn!(upstream = %target.upstream.name, route = %route.name, "side effect forwarded without a key (unprotected)");
            proxy
                .metrics
                .unprotected
                .get_or_create(&Metrics::labels(&target.upstream.name, &route.name))
                .inc();
            return passthrough::forward(rt, client, target, req, peer, false).await;
        }
        KeyLookup::Invalid(why) => return Problem::new(Kind::KeyInvalid, why).into_response(),
    };
    let (parts, incoming) = req.into_parts();
    let body = match read_body(incoming, &parts, cfg.limits.max_body_bytes).await {
        Ok(b) => b,
        Err(resp) => return *resp,
    };
    // identify + fingerprint
    let tenant = identity::tenant_scope(&parts.headers, &cfg.identity.tenant_from);
    let id = identity::execution_id(&tenant, &target.upstream.name, &route.name, &key);
    let args = args_hash(
        &RequestParts {
            method: &parts.method,
            upstream: &target.upstream.name,
            route: &route.name,
            path: &target.rel_path,
            query: parts.uri.query(),
            headers: &parts.headers,
            body: &body,
        },
        &route.fingerprint,
    );
    let call = Call {
        proxy,
        rt,
        client,
        target,
        parts,
        body,
        id,
        args,
        tenant,
        peer,
    };
    call.run().await
}

/// Buffer the request body up to the limit; a side effect must be hashed and may be sent
/// again under the same identity, so it cannot be streamed.
async fn read_body(
    incoming: Incoming,
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
    match Limited::new(incoming, limit).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e)
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(too_large())
        }
        Err(e) => Err(Box::new(
            Problem::new(
                Kind::BadRequest,
                format!("could not read the request body: {e}"),
            )
            .into_response(),
        )),
    }
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
    tenant: TenantScope,
    peer: SocketAddr,
}

/// What to do with an existing record.
enum Decision {
    Respond(Response<ProxyBody>),
    /// Move the record with this event and send (Start, or Resend to a replaying downstream).
    Execute(Event),
    /// The approval no longer covers the call (the text says why): ask for a new one.
    Reapprove(String),
    /// Another attempt owns it; hold this duplicate and look again.
    Wait,
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
                    r.lease = Some(self.lease());
                    match self.proxy.store.update(r).await {
                        Ok(r) if event == Event::Start => return self.proceed(r).await,
                        Ok(r) => return self.execute(r).await,
                        // Someone else moved it first: look again.
                        Err(StoreError::Conflict { .. }) => continue,
                        Err(e) => return self.store_failed(e),
                    }
                }
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
            operation_id: identity::operation_id(&self.parts.headers, &self.rt.config.identity),
            args_hash: self.args.clone(),
            method: self.parts.method.to_string(),
            path: self.target.rel_path.clone(),
            query: self.parts.uri.query().map(str::to_string),
            path_params: self.target.params.clone(),
            preview: route
                .approval
                .as_ref()
                .map(|a| preview(&self.body, &a.preview)),
            now_ms: now,
            expires_at_ms: now.saturating_add(route.retention.as_millis() as i64),
        });
        let needs_approval = route.approval.as_ref().is_some_and(|a| a.required);
        let event = if needs_approval {
            Event::RequestApproval
        } else {
            Event::Start
        };
        r.apply(event, now, None)
            .expect("prepared accepts both start and request_approval");
        if r.state() == State::Executing {
            r.lease = Some(self.lease());
        }
        r
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
            State::OutcomeUnknown => Decision::Respond(
                Problem::new(
                    Kind::OutcomeUnknownPending,
                    "an earlier attempt may or may not have taken effect; it is not re-sent until reconciled or resolved by an operator",
                )
                .execution(&self.id)
                .header(STATUS, HeaderValue::from_static("outcome_unknown"))
                .into_response(),
            ),
            State::Prepared => Decision::Execute(Event::Start),
            State::Approved | State::FailedBeforeCommit => match self.approval_gap(r) {
                None => Decision::Execute(Event::Start),
                Some(why) => Decision::Reapprove(why),
            },
            State::AwaitingApproval => Decision::Respond(self.approval_required(r)),
            State::Rejected => Decision::Respond(
                Problem::new(Kind::Rejected, "an operator rejected this call; it will not be sent")
                    .execution(&self.id)
                    .into_response(),
            ),
            State::CancelledBeforeCommit => Decision::Respond(
                Problem::new(Kind::Cancelled, "the operation was cancelled before this call was sent")
                    .execution(&self.id)
                    .into_response(),
            ),
        }
    }

    fn in_flight(&self) -> Response<ProxyBody> {
        Problem::new(
            Kind::InFlight,
            "an attempt with this key is executing; retry later to get its result",
        )
        .execution(&self.id)
        .header("retry-after", HeaderValue::from_static("1"))
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
            (Ok(None), State::Executing) => self.execute(r).await,
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

    /// Send the request downstream under a record that is durably `executing`.
    async fn execute(&self, record: Record) -> Response<ProxyBody> {
        failpoint::hit("before_downstream").await;
        let route = self.route();
        let upstream = self.target.upstream;
        let rel = downstream::rel_with_query(self.target, self.parts.uri.query());
        let uri = match downstream::uri(upstream, &rel) {
            Ok(u) => u,
            Err(e) => {
                return self
                    .finish_failed(record, format!("cannot build upstream URI: {e}"), None)
                    .await
            }
        };
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
        let req = downstream::build(
            self.parts.method.clone(),
            uri,
            headers,
            body::full(self.body.clone()),
        );
        tracing::info!(execution_id = %self.id, upstream = %upstream.name, route = %route.name, attempt = record.attempts, "executing");
        self.metrics().attempts.get_or_create(&self.labels()).inc();
        let started = tokio::time::Instant::now();
        let sent = tokio::time::timeout(route.timeout, async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|e| (client::classify(&e), client::describe(&e)))?;
            failpoint::hit("in_flight").await;
            let (rparts, rbody) = resp.into_parts();
            let limit = self.rt.config.limits.max_response_bytes;
            let bytes = Limited::new(rbody, limit)
                .collect()
                .await
                .map_err(|e: BoxError| {
                    (
                        SendFailure::AfterSend,
                        format!("reading the response failed: {e}"),
                    )
                })?
                .to_bytes();
            Ok::<_, (SendFailure, String)>((rparts, bytes))
        })
        .await;
        let elapsed = started.elapsed();
        self.metrics()
            .upstream_duration
            .get_or_create(&self.labels())
            .observe(elapsed.as_secs_f64());
        match sent {
            Err(_) => {
                let why = format!("no complete answer within {:?}", route.timeout);
                self.finish_unknown(record, why, true).await
            }
            Ok(Err((SendFailure::BeforeSend, why))) => self.finish_failed(record, why, None).await,
            Ok(Err((SendFailure::AfterSend, why))) => self.finish_unknown(record, why, false).await,
            Ok(Ok((rparts, bytes))) => {
                failpoint::hit("after_remote_commit").await;
                tracing::debug!(execution_id = %self.id, status = %rparts.status, elapsed_ms = elapsed.as_millis() as u64, "downstream answered");
                let mut rheaders = rparts.headers;
                downstream::response_headers(&mut rheaders);
                let stored = StoredResponse {
                    status: rparts.status.as_u16(),
                    headers: rheaders
                        .iter()
                        .map(|(n, v)| (n.as_str().to_string(), v.as_bytes().to_vec()))
                        .collect(),
                    body: bytes.to_vec(),
                };
                if rparts.status.is_server_error() {
                    match route.on_5xx {
                        On5xx::Committed => self.finish_committed(record, stored).await,
                        On5xx::FailedBeforeCommit => {
                            let why = format!(
                                "downstream answered {} (on_5xx: failed_before_commit)",
                                rparts.status
                            );
                            self.finish_failed(record, why, Some(stored)).await
                        }
                        On5xx::OutcomeUnknown => {
                            let why = format!(
                                "downstream answered {} (on_5xx: outcome_unknown)",
                                rparts.status
                            );
                            self.finish_5xx_unknown(record, why, stored).await
                        }
                    }
                } else {
                    self.finish_committed(record, stored).await
                }
            }
        }
    }

    /// Write `record` after applying `event`; on a fencing conflict, return what is stored now.
    async fn transition(
        &self,
        mut record: Record,
        event: Event,
        note: Option<String>,
    ) -> Result<Record, StoreError> {
        if let Err(e) = record.apply(event, now_ms(), note) {
            return Err(StoreError::Backend(e.to_string()));
        }
        let stored = self.proxy.store.update(record).await?;
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
        record.external_id = self
            .route()
            .external_id
            .as_deref()
            .and_then(|p| external_id(&stored, p));
        record.response = Some(stored.clone());
        match self.transition(record.clone(), Event::Commit, None).await {
            Ok(r) => {
                failpoint::hit("after_local_commit").await;
                self.respond(&r, false)
            }
            Err(StoreError::Conflict { .. }) => self.commit_after_takeover(stored).await,
            Err(e) => {
                // The effect happened but is not recorded: the record stays `executing` and
                // becomes `outcome_unknown` on recovery; the client must not assume failure.
                tracing::error!(execution_id = %self.id, error = %e, "downstream committed but the record could not be written");
                self.unknown_problem(
                    format!("the downstream answered but the record could not be stored: {e}"),
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
            r.external_id = self
                .route()
                .external_id
                .as_deref()
                .and_then(|p| external_id(&stored, p));
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
        if let Err(e) = self
            .transition(record, Event::FailBeforeCommit, Some(why.clone()))
            .await
        {
            tracing::error!(execution_id = %self.id, error = %e, "could not record failed_before_commit");
        }
        match downstream {
            Some(stored) => {
                let mut resp = stored_response(&stored, &self.id);
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
        if let Err(e) = self
            .transition(record, Event::LoseOutcome, Some(why.clone()))
            .await
        {
            tracing::error!(execution_id = %self.id, error = %e, "could not record outcome_unknown");
        }
        self.unknown_problem(why, timeout)
    }

    async fn finish_5xx_unknown(
        &self,
        record: Record,
        why: String,
        stored: StoredResponse,
    ) -> Response<ProxyBody> {
        tracing::warn!(execution_id = %self.id, reason = %why, "outcome unknown");
        if let Err(e) = self.transition(record, Event::LoseOutcome, Some(why)).await {
            tracing::error!(execution_id = %self.id, error = %e, "could not record outcome_unknown");
        }
        let mut resp = stored_response(&stored, &self.id);
        resp.headers_mut()
            .insert(STATUS, HeaderValue::from_static("outcome_unknown"));
        resp
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
        let mut resp = stored_response(stored, &self.id);
        if replayed {
            resp.headers_mut()
                .insert(REPLAYED, HeaderValue::from_static("true"));
        }
        if r.state() != State::Committed {
            return resp;
        }
        let store = self.proxy.store.clone();
        let record = r.clone();
        resp.map(move |b| {
            NotifyOnEnd::new(b, move || {
                tokio::spawn(async move {
                    failpoint::hit("after_answer").await;
                    let mut record = record;
                    if record.apply(Event::Deliver, now_ms(), None).is_ok() {
                        // Best effort: a conflict means another attempt already marked it.
                        let _ = store.update(record).await;
                    }
                });
            })
            .boxed()
        })
    }

    fn replay(&self, r: &Record) -> Response<ProxyBody> {
        tracing::info!(execution_id = %self.id, "replayed stored result");
        self.metrics().replays.get_or_create(&self.labels()).inc();
        self.respond(r, true)
    }
}

fn stored_response(stored: &StoredResponse, id: &ExecutionId) -> Response<ProxyBody> {
    let mut resp = Response::new(
        Full::new(Bytes::from(stored.body.clone()))
            .map_err(|n| match n {})
            .boxed(),
    );
    *resp.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::BAD_GATEWAY);
    let h = resp.headers_mut();
    for (n, v) in &stored.headers {
        if let (Ok(n), Ok(v)) = (
            http::HeaderName::from_bytes(n.as_bytes()),
            HeaderValue::from_bytes(v),
        ) {
            h.append(n, v);
        }
    }
    h.insert(EXECUTION_ID, downstream::header_value(id.as_str()));
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

fn external_id(stored: &StoredResponse, pointer: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(&stored.body).ok()?;
    match v.pointer(pointer)? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}
