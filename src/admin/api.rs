//! The admin HTTP surface (SPEC section 10): routing, authentication, JSON in and out.
//! Decisions themselves live in [`super::actions`]; views in [`super::view`]; every
//! refusal is an [`AdminError`], turned into problem+json in one place.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::actions::{self, ResultSpec};
use super::error::AdminError;
use super::{console, view, Admin};
use crate::config::Scope;
use crate::metrics::Metrics;
use crate::policy::identity::ExecutionId;
use crate::policy::job::JobState;
use crate::policy::state::State;
use crate::store::{JobFilter, ListFilter, Record, Store};
use crate::wire::body::{full, ProxyBody, RequestBody};

/// Largest JSON body an admin call accepts (a resolve result is the only big one).
const MAX_BODY_BYTES: usize = 1024 * 1024;
const DEFAULT_PAGE: usize = 50;
const MAX_PAGE: usize = 500;
/// Records shown with an operation.
const OPERATION_RECORDS: usize = 500;
/// Longest value a listing filter takes (keys are at most `limits.max_key_bytes`, 255 by
/// default; ids are shorter).
const MAX_FILTER_BYTES: usize = 1024;
/// Longest operator name accepted in `by`.
const MAX_BY_CHARS: usize = 128;

/// What a request asks for, once its path is understood.
enum Endpoint {
    Console(&'static str),
    Healthz,
    Readyz,
    Metrics,
    List,
    /// `GET /v1/jobs?state=`: background jobs (SPEC section 9.2).
    Jobs,
    Show(ExecutionId),
    Approve(ExecutionId),
    Reject(ExecutionId),
    Resolve(ExecutionId),
    Operation(String),
    Cancel(String),
}

impl Endpoint {
    /// Static console files and the health probe carry no data: they are served without
    /// the token (a browser cannot send a bearer header when it navigates to `/`).
    fn is_public(&self) -> bool {
        matches!(
            self,
            Endpoint::Console(_) | Endpoint::Healthz | Endpoint::Readyz
        )
    }

    /// The scope a token needs for this endpoint, and what it does (for the 403's text).
    fn needs(&self) -> Option<(Scope, &'static str)> {
        Some(match self {
            Endpoint::Console(_) | Endpoint::Healthz | Endpoint::Readyz => return None,
            Endpoint::Metrics
            | Endpoint::List
            | Endpoint::Jobs
            | Endpoint::Show(_)
            | Endpoint::Operation(_) => (Scope::View, "read executions"),
            Endpoint::Approve(_) => (Scope::Approve, "approve calls"),
            Endpoint::Reject(_) => (Scope::Approve, "reject calls"),
            Endpoint::Resolve(_) => (Scope::Resolve, "resolve unknown outcomes"),
            Endpoint::Cancel(_) => (Scope::Cancel, "cancel operations"),
        })
    }
}

/// Entry point for every request on the admin listener.
pub async fn handle(admin: Arc<Admin>, req: Request<Incoming>) -> Response<ProxyBody> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let routed = route(&method, &path);
    let public = matches!(&routed, Ok(e) if e.is_public());
    // Unknown paths ask for a token too: without one nothing about the API is told.
    let token = admin.tokens.authenticate(req.headers());
    let outcome = match (routed, token) {
        (Ok(endpoint), _) if public => dispatch(&admin, endpoint, "", req).await,
        (_, None) => Err(AdminError::Unauthorized),
        (Err(e), Some(_)) => Err(e),
        (Ok(endpoint), Some(token)) => match endpoint.needs() {
            Some((scope, what)) if !token.allows(scope) => Err(AdminError::Forbidden {
                token: token.name.clone(),
                needs: scope.name(),
                what,
            }),
            _ => dispatch(&admin, endpoint, &token.name, req).await,
        },
    };
    let mut resp = outcome.unwrap_or_else(|e| e.into_problem().into_response());
    tracing::debug!(method = %method, path = %path, status = resp.status().as_u16(), "admin request");
    let h = resp.headers_mut();
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    resp
}

/// Map method and path to an endpoint: 404 for an unknown path, 405 for a known path
/// with the wrong method.
fn route(method: &Method, path: &str) -> Result<Endpoint, AdminError> {
    let segments = path
        .strip_prefix('/')
        .unwrap_or(path)
        .split('/')
        .map(decode_segment)
        .collect::<Result<Vec<String>, AdminError>>()?;
    let parts: Vec<&str> = segments.iter().map(String::as_str).collect();
    let id = |s: &str| ExecutionId(s.to_string());
    let (allow, endpoint) = match parts.as_slice() {
        [""] => ("GET", Endpoint::Console("index.html")),
        ["console.js"] => ("GET", Endpoint::Console("console.js")),
        ["console.css"] => ("GET", Endpoint::Console("console.css")),
        ["favicon.ico"] => ("GET", Endpoint::Console("favicon.ico")),
        ["healthz"] => ("GET", Endpoint::Healthz),
        ["readyz"] => ("GET", Endpoint::Readyz),
        ["metrics"] => ("GET", Endpoint::Metrics),
        ["v1", "executions"] => ("GET", Endpoint::List),
        ["v1", "jobs"] => ("GET", Endpoint::Jobs),
        ["v1", "executions", e] if !e.is_empty() => ("GET", Endpoint::Show(id(e))),
        ["v1", "executions", e, "approve"] if !e.is_empty() => ("POST", Endpoint::Approve(id(e))),
        ["v1", "executions", e, "reject"] if !e.is_empty() => ("POST", Endpoint::Reject(id(e))),
        ["v1", "executions", e, "resolve"] if !e.is_empty() => ("POST", Endpoint::Resolve(id(e))),
        ["v1", "operations", op] if !op.is_empty() => ("GET", Endpoint::Operation(op.to_string())),
        ["v1", "operations", op, "cancel"] if !op.is_empty() => {
            ("POST", Endpoint::Cancel(op.to_string()))
        }
        _ => return Err(AdminError::NoEndpoint(path.to_string())),
    };
    if method.as_str() != allow {
        return Err(AdminError::MethodNotAllowed {
            path: path.to_string(),
            allow,
        });
    }
    Ok(endpoint)
}

fn decode_segment(s: &str) -> Result<String, AdminError> {
    percent_encoding::percent_decode_str(s)
        .decode_utf8()
        .map(|c| c.into_owned())
        .map_err(|_| AdminError::BadRequest("the path is not valid percent-encoded UTF-8".into()))
}

/// Serve `endpoint` for the token named `token` (empty for the public endpoints).
async fn dispatch(
    admin: &Admin,
    endpoint: Endpoint,
    token: &str,
    req: Request<Incoming>,
) -> Result<Response<ProxyBody>, AdminError> {
    let store = admin.proxy.store.as_ref();
    match endpoint {
        Endpoint::Console(file) => Ok(console::serve(file)),
        Endpoint::Healthz => Ok(json(StatusCode::OK, &serde_json::json!({ "status": "ok" }))),
        Endpoint::Readyz => readyz(admin).await,
        Endpoint::Metrics => {
            let mut resp = Response::new(full(admin.proxy.metrics.encode()));
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            );
            Ok(resp)
        }
        Endpoint::List => {
            let (records, more) = page(store, list_filter(req.uri().query())?).await?;
            let next = more
                .then(|| records.last().map(|r| r.id.as_str()))
                .flatten();
            Ok(json(
                StatusCode::OK,
                &view::Page {
                    items: records.iter().map(view::Summary::of).collect(),
                    next,
                },
            ))
        }
        Endpoint::Jobs => {
            // Served from the job-state index of either store, a page at a time.
            let (records, more) = page(store, job_filter(req.uri().query())?).await?;
            let next = more
                .then(|| records.last().map(|r| r.id.as_str()))
                .flatten();
            let views: Vec<_> = records
                .iter()
                .filter_map(|r| {
                    r.job.as_ref().map(|job| view::JobView {
                        execution_id: r.id.as_str(),
                        upstream: &r.upstream,
                        route: &r.route,
                        state: r.state(),
                        job,
                    })
                })
                .collect();
            Ok(json(
                StatusCode::OK,
                &serde_json::json!({ "items": views, "next": next, "complete": next.is_none() }),
            ))
        }
        Endpoint::Show(id) => match store.get(&id).await? {
            Some(r) => {
                let mut detail = view::Detail::of(&r);
                if let Some(b) = &r.batch {
                    let mut items = Vec::with_capacity(b.items.len());
                    for item in &b.items {
                        let state = store.get(item).await?.map(|c| c.state());
                        items.push((item.to_string(), state));
                    }
                    detail.batch = Some(view::BatchView::of(items));
                }
                Ok(json(StatusCode::OK, &detail))
            }
            None => Err(actions::ActionError::NotFound(id).into()),
        },
        Endpoint::Approve(id) => {
            let body: ApproveBody = required(read_json(admin, req).await?)?;
            let by = by(token, body.by)?;
            let rt = admin.proxy.runtime();
            let ttl = |r: &Record| approval_ttl(&rt.config, r);
            let r = actions::approve(store, &id, &body.args_hash, &by, ttl).await?;
            let metrics = &admin.proxy.metrics;
            Metrics::count(&metrics.approvals, &r.upstream, &r.route, "approved");
            Ok(json(StatusCode::OK, &view::Detail::of(&r)))
        }
        Endpoint::Reject(id) => {
            let body: RejectBody = read_json(admin, req).await?.unwrap_or_default();
            let by = by(token, body.by)?;
            let reason = body
                .reason
                .map(|r| operator_text("reason", r, 500))
                .transpose()?;
            let r = actions::reject(store, &id, &by, reason.as_deref()).await?;
            let metrics = &admin.proxy.metrics;
            Metrics::count(&metrics.approvals, &r.upstream, &r.route, "rejected");
            Ok(json(StatusCode::OK, &view::Detail::of(&r)))
        }
        Endpoint::Resolve(id) => {
            let body: ResolveBody = required(read_json(admin, req).await?)?;
            let by = by(token, body.by)?;
            let committed = match body.outcome {
                Outcome::Committed => true,
                Outcome::NotCommitted => false,
            };
            let result = match body.result {
                Some(_) if !committed => {
                    return Err(AdminError::BadRequest(
                        "`result` is only stored when resolving as committed".into(),
                    ))
                }
                Some(spec) => Some(spec.into_stored().map_err(AdminError::BadRequest)?),
                None => None,
            };
            let r = actions::resolve(store, &id, committed, result, &by).await?;
            Ok(json(StatusCode::OK, &view::Detail::of(&r)))
        }
        Endpoint::Operation(op) => {
            let status = actions::operation_status(store, &op, OPERATION_RECORDS).await?;
            Ok(json(StatusCode::OK, &view::Operation::of(&op, &status)))
        }
        Endpoint::Cancel(op) => {
            let body: CancelBody = read_json(admin, req).await?.unwrap_or_default();
            let by = by(token, body.by)?;
            let retention = mark_retention(&admin.proxy.runtime().config);
            let report = actions::cancel(store, &op, &by, retention).await?;
            Ok(json(StatusCode::OK, &view::Cancelled::of(&op, &report)))
        }
    }
}

/// Ready to take side effects: the store answers and its writes can succeed (a lost or
/// failed redb file, an unreachable database or failing writes answer 503 with why).
/// `/healthz` is liveness only: a store outage must not get a live process restarted.
async fn readyz(admin: &Admin) -> Result<Response<ProxyBody>, AdminError> {
    let store = &admin.proxy.store;
    // A point read proves the store answers; the id never exists.
    let result = match store.get(&ExecutionId("readyz-probe".into())).await {
        Ok(_) => store.ready().await,
        Err(e) => Err(e.to_string()),
    };
    Ok(match result {
        Ok(()) => json(StatusCode::OK, &serde_json::json!({ "status": "ready" })),
        Err(reason) => {
            tracing::warn!(%reason, "not ready: side-effect writes would fail");
            json(
                StatusCode::SERVICE_UNAVAILABLE,
                &serde_json::json!({ "status": "not_ready", "reason": reason }),
            )
        }
    })
}

/// The route's `approval.expires` for a record, from the running config. A route that was
/// removed since has no expiry to apply.
fn approval_ttl(cfg: &crate::config::Config, r: &Record) -> Option<std::time::Duration> {
    cfg.upstreams
        .iter()
        .find(|u| u.name == r.upstream)?
        .routes
        .iter()
        .find(|route| route.name == r.route)?
        .approval
        .as_ref()?
        .expires
}

/// An operation mark is kept as long as the longest retention of any record it covers.
fn mark_retention(cfg: &crate::config::Config) -> std::time::Duration {
    cfg.upstreams
        .iter()
        .flat_map(|u| u.routes.iter().map(|r| r.retention))
        .fold(cfg.store.retention, std::cmp::max)
}

/// `GET /v1/jobs?state=&limit=&after=`: records that started a job (in one state, or any),
/// in execution-id order, paged like `GET /v1/executions`.
fn job_filter(query: Option<&str>) -> Result<ListFilter, AdminError> {
    let mut filter = ListFilter {
        limit: DEFAULT_PAGE,
        job: Some(JobFilter::Any),
        ..ListFilter::default()
    };
    for (k, v) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
        match k.as_ref() {
            "state" => {
                let state = JobState::from_str(&v).map_err(AdminError::BadRequest)?;
                filter.job = Some(JobFilter::In(state));
            }
            "limit" => {
                filter.limit = v
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=MAX_PAGE).contains(n))
                    .ok_or_else(|| {
                        AdminError::BadRequest(format!("limit must be 1..={MAX_PAGE}"))
                    })?
            }
            "after" => filter.after = Some(ExecutionId(v.into_owned())),
            other => {
                return Err(AdminError::BadRequest(format!(
                    "unknown query parameter `{other}` (expected state, limit, after)"
                )))
            }
        }
    }
    Ok(filter)
}

/// The query parameters `GET /v1/executions` takes.
const LIST_PARAMETERS: &str =
    "status, operation, tool_call, key, upstream, route, external_id, since, until, limit, after";

/// `GET /v1/executions`' query as a [`ListFilter`]: each parameter at most once, every
/// value checked; a bad one is a 400 naming it.
fn list_filter(query: Option<&str>) -> Result<ListFilter, AdminError> {
    let mut filter = ListFilter {
        limit: DEFAULT_PAGE,
        ..ListFilter::default()
    };
    let mut seen: Vec<String> = Vec::new();
    for (k, v) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
        let bad = |why: String| AdminError::BadParameter {
            name: k.to_string(),
            why,
        };
        if seen.iter().any(|s| *s == k) {
            return Err(bad("given more than once".into()));
        }
        seen.push(k.to_string());
        let text = |v: &str| -> Result<Option<String>, AdminError> {
            if v.is_empty() || v.len() > MAX_FILTER_BYTES || v.chars().any(char::is_control) {
                return Err(bad(format!(
                    "must be 1..={MAX_FILTER_BYTES} bytes without control characters"
                )));
            }
            Ok(Some(v.to_string()))
        };
        let time = |v: &str| -> Result<Option<i64>, AdminError> {
            let ms = match v.parse::<i64>() {
                Ok(ms) => Some(ms).filter(|t| *t >= 0),
                Err(_) => humantime::parse_rfc3339_weak(v).ok().and_then(|t| {
                    let since = t.duration_since(std::time::UNIX_EPOCH).ok()?;
                    i64::try_from(since.as_millis()).ok()
                }),
            };
            ms.map(Some).ok_or_else(|| {
                bad(
                    "must be milliseconds since the Unix epoch or an RFC 3339 time \
                     (2026-12-07T14:00:00Z)"
                        .into(),
                )
            })
        };
        match k.as_ref() {
            "status" => filter.status = Some(State::from_str(&v).map_err(bad)?),
            "limit" => {
                filter.limit = v
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=MAX_PAGE).contains(n))
                    .ok_or_else(|| bad(format!("must be 1..={MAX_PAGE}")))?
            }
            "after" => filter.after = text(&v)?.map(ExecutionId),
            "operation" => filter.operation = text(&v)?,
            "tool_call" => filter.tool_call = text(&v)?,
            "key" => filter.key = text(&v)?,
            "upstream" => filter.upstream = text(&v)?,
            "route" => filter.route = text(&v)?,
            "external_id" => filter.external_id = text(&v)?,
            "since" => filter.since = time(&v)?,
            "until" => filter.until = time(&v)?,
            _ => return Err(bad(format!("unknown (expected {LIST_PARAMETERS})"))),
        }
    }
    if let (Some(since), Some(until)) = (filter.since, filter.until) {
        if until <= since {
            return Err(AdminError::BadParameter {
                name: "until".into(),
                why: format!("must be after since ({since})"),
            });
        }
    }
    Ok(filter)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ApproveBody {
    /// The args_hash the approver reviewed (from the 428 problem or the listing).
    args_hash: String,
    by: Option<String>,
}

/// A page of `filter`'s records and whether another page follows (one more than asked
/// is read to tell).
async fn page(store: &dyn Store, filter: ListFilter) -> Result<(Vec<Record>, bool), AdminError> {
    let limit = filter.limit;
    let mut records = store
        .list(&ListFilter {
            limit: limit + 1,
            ..filter
        })
        .await?;
    let more = records.len() > limit;
    records.truncate(limit);
    Ok((records, more))
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RejectBody {
    by: Option<String>,
    reason: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum Outcome {
    Committed,
    NotCommitted,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResolveBody {
    #[serde(rename = "as")]
    outcome: Outcome,
    result: Option<ResultSpec>,
    by: Option<String>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct CancelBody {
    by: Option<String>,
}

/// Who a decision is recorded under: the token that made it, and the operator's own name
/// when the request gives one (`alice (token ops)`). The token's name is what the proxy
/// knows; `by` is what the caller says.
fn by(token: &str, given: Option<String>) -> Result<String, AdminError> {
    match given {
        None => Ok(token.to_string()),
        Some(s) => Ok(format!(
            "{} (token {token})",
            operator_text("by", s, MAX_BY_CHARS)?
        )),
    }
}

/// Operator-typed text that ends up in records and log lines: bounded, one line.
fn operator_text(field: &str, s: String, max: usize) -> Result<String, AdminError> {
    let s = s.trim().to_string();
    if s.is_empty() || s.chars().count() > max || s.chars().any(char::is_control) {
        return Err(AdminError::BadRequest(format!(
            "`{field}` must be 1..={max} characters without control characters"
        )));
    }
    Ok(s)
}

/// Read a JSON body of type `T`; `None` when the body is empty.
async fn read_json<T: DeserializeOwned>(
    admin: &Admin,
    req: Request<Incoming>,
) -> Result<Option<T>, AdminError> {
    let body_timeout = admin.proxy.runtime().config.timeouts.client_body;
    let bytes = read_body(req, body_timeout).await?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| AdminError::BadRequest(format!("the body is not the expected JSON: {e}")))
}

fn required<T>(body: Option<T>) -> Result<T, AdminError> {
    body.ok_or_else(|| AdminError::BadRequest("this call needs a JSON body".into()))
}

/// The body, which may go `body_timeout` without a byte (`timeouts.client_body`).
async fn read_body(req: Request<Incoming>, body_timeout: Duration) -> Result<Bytes, AdminError> {
    let body = RequestBody::streamed(req.into_body(), body_timeout);
    match Limited::new(body, MAX_BODY_BYTES).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if crate::wire::body::caused_by::<crate::wire::body::TimedOut>(&*e) => {
            Err(AdminError::RequestTimeout)
        }
        Err(e)
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(AdminError::BodyTooLarge(MAX_BODY_BYTES))
        }
        Err(e) => Err(AdminError::BadRequest(format!(
            "could not read the request body: {e}"
        ))),
    }
}

fn json<T: Serialize>(status: StatusCode, value: &T) -> Response<ProxyBody> {
    let bytes = serde_json::to_vec(value).expect("admin views are plain data and serialize");
    let mut resp = Response::new(full(bytes));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routed(method: Method, path: &str) -> Result<Endpoint, AdminError> {
        route(&method, path)
    }

    #[test]
    fn routes_decode_segments_and_refuse_wrong_methods() {
        assert!(matches!(
            routed(Method::GET, "/"),
            Ok(Endpoint::Console("index.html"))
        ));
        assert!(matches!(
            routed(Method::GET, "/v1/executions/ex_1"),
            Ok(Endpoint::Show(id)) if id.as_str() == "ex_1"
        ));
        assert!(matches!(
            routed(Method::POST, "/v1/operations/op%2F77%20x/cancel"),
            Ok(Endpoint::Cancel(op)) if op == "op/77 x"
        ));
        assert!(matches!(
            routed(Method::GET, "/v1/executions/ex_1/approve"),
            Err(AdminError::MethodNotAllowed { allow: "POST", .. })
        ));
        for missing in [
            "/v1/executions/",
            "/v1/executions//approve",
            "/v2/x",
            "/console.jsx",
        ] {
            assert!(
                matches!(routed(Method::GET, missing), Err(AdminError::NoEndpoint(_))),
                "{missing}"
            );
        }
        assert!(matches!(
            routed(Method::GET, "/v1/executions/%ff"),
            Err(AdminError::BadRequest(_))
        ));
        assert!(routed(Method::GET, "/healthz").is_ok_and(|e| e.is_public()));
        assert!(routed(Method::GET, "/readyz").is_ok_and(|e| e.is_public()));
        assert!(routed(Method::GET, "/metrics").is_ok_and(|e| !e.is_public()));
    }

    #[test]
    fn list_filters_are_validated() {
        let f = list_filter(Some(
            "status=outcome_unknown&limit=7&after=ex_3&operation=op%201",
        ))
        .expect("valid");
        assert_eq!(f.status, Some(State::OutcomeUnknown));
        assert_eq!(f.limit, 7);
        assert_eq!(f.after.as_ref().map(|a| a.as_str()), Some("ex_3"));
        assert_eq!(f.operation.as_deref(), Some("op 1"));
        assert_eq!(list_filter(None).expect("defaults").limit, DEFAULT_PAGE);
        for bad in ["status=done", "limit=0", "limit=501", "limit=x", "sort=id"] {
            assert!(list_filter(Some(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn operator_text_is_bounded_and_one_line() {
        assert_eq!(by("ops", None).expect("default"), "ops");
        assert_eq!(
            by("ops", Some("  alice ".into())).expect("trimmed"),
            "alice (token ops)"
        );
        for bad in ["", "   ", "a\nb", "a\u{7}"] {
            assert!(by("ops", Some(bad.into())).is_err(), "{bad:?}");
        }
        assert!(by("ops", Some("x".repeat(MAX_BY_CHARS + 1))).is_err());
    }
}
