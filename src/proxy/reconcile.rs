//! Reconciliation I/O (SPEC section 7): sending a route's lookup for an `outcome_unknown`
//! record, writing what it proved, and the background task that does this proactively
//! for every such record whose route has a lookup, starting right after (re)start. The
//! decisions themselves are in [`crate::policy::reconcile`]; a client's retry goes through
//! the same functions from `side_effect`.

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderValue};
use http_body_util::{BodyExt, Limited};

use super::{downstream, Proxy};
use crate::config::{ReconcileSpec, Route, Upstream};
use crate::policy::reconcile::{self, Verdict};
use crate::policy::state::{Event, State};
use crate::store::{now_ms, ListFilter, Record, Store, StoreError};
use crate::wire::body::{self, BoxError};
use crate::wire::client::{self, HttpClient};
use crate::wire::headers;

/// Send `spec`'s lookup for `record` and judge the answer. `client_headers` are the
/// retrying client's headers as prepared for the downstream (hop-by-hop and the client's
/// key already removed; they carry the credentials the downstream expects), when there is
/// a client; the spec's own headers are set on top. Never fails: trouble is
/// [`Verdict::Unknown`].
pub async fn lookup(
    client: &HttpClient,
    upstream: &Upstream,
    route: &Route,
    spec: &ReconcileSpec,
    record: &Record,
    client_headers: Option<HeaderMap>,
    max_bytes: usize,
) -> Verdict {
    let rel = match reconcile::render(&spec.path, record) {
        Ok(p) => p,
        Err(e) => return Verdict::Unknown(format!("cannot build the lookup path: {e}")),
    };
    let uri = match downstream::uri(upstream, &rel) {
        Ok(u) => u,
        Err(e) => return Verdict::Unknown(format!("cannot build the lookup URI: {e}")),
    };
    let mut h = HeaderMap::new();
    if let Some(src) = client_headers {
        h = src;
        headers::strip_hop_by_hop(&mut h);
        for name in [
            http::header::HOST,
            http::header::CONTENT_LENGTH,
            http::header::CONTENT_TYPE,
            http::header::CONTENT_ENCODING,
            http::header::EXPECT,
        ] {
            h.remove(name);
        }
        // The lookup is not the side effect: it carries no idempotency key.
        if let Some(dk) = &route.downstream_key {
            h.remove(&dk.header);
        }
    }
    if let Ok(v) = HeaderValue::from_str(upstream.authority.as_str()) {
        h.insert(http::header::HOST, v);
    }
    h.insert(
        http::header::ACCEPT,
        HeaderValue::from_static("application/json"),
    );
    for (name, value) in &spec.headers {
        match HeaderValue::from_str(value) {
            Ok(v) => {
                h.insert(name.clone(), v);
            }
            Err(_) => {
                return Verdict::Unknown(format!("reconcile header {name} is not a valid value"))
            }
        }
    }
    let req = downstream::build(spec.method.clone(), uri, h, body::empty());
    let answer = tokio::time::timeout(route.timeout, async {
        let resp = client
            .request(req)
            .await
            .map_err(|e| client::describe(&e))?;
        let (parts, b) = resp.into_parts();
        let bytes = Limited::new(b, max_bytes)
            .collect()
            .await
            .map_err(|e: BoxError| format!("reading the lookup answer failed: {e}"))?
            .to_bytes();
        Ok::<_, String>((parts, bytes))
    })
    .await;
    match answer {
        Err(_) => Verdict::Unknown(format!(
            "the lookup got no answer within {:?}",
            route.timeout
        )),
        Ok(Err(why)) => Verdict::Unknown(format!("the lookup failed: {why}")),
        Ok(Ok((parts, bytes))) => reconcile::judge(
            spec,
            route.external_id.as_deref(),
            parts.status.as_u16(),
            parts
                .headers
                .get(http::header::CONTENT_TYPE)
                .map(HeaderValue::as_bytes),
            &bytes,
        ),
    }
}

/// Move `record` to `committed` with what the lookup found as its result.
pub fn apply_found(record: &mut Record, verdict: Verdict) -> bool {
    let Verdict::Found {
        result,
        external_id,
        matches,
    } = verdict
    else {
        return false;
    };
    let note = if matches > 1 {
        format!("reconciled: the lookup found {matches} effects with this execution's tag; the first is the result")
    } else {
        "reconciled: the lookup found the effect".to_string()
    };
    if record
        .apply(Event::ResolveCommitted, now_ms(), Some(note))
        .is_err()
    {
        return false;
    }
    if external_id.is_some() {
        record.external_id = external_id;
    }
    record.response = Some(result);
    true
}

/// A reconciliation found `record`'s effect: if its operation was cancelled meanwhile, the
/// operation is now cancelled after a side effect (as when an operator resolves it).
pub async fn found_under_cancelled_operation(store: &dyn Store, record: &Record) {
    let Some(op) = &record.operation_id else {
        return;
    };
    let marked = match store.operation(op).await {
        Ok(Some(mark)) => crate::admin::actions::after_side_effect(store, mark)
            .await
            .map(|_| ()),
        Ok(None) => Ok(()),
        Err(e) => Err(e),
    };
    if let Err(e) = marked {
        tracing::error!(execution_id = %record.id, error = %e, "could not mark the cancelled operation as cancelled after a side effect");
    }
}

/// Look up (route, upstream index) of a stored record in the running config.
fn route_of<'a>(
    rt: &'a super::Runtime,
    record: &Record,
) -> Option<(usize, &'a Upstream, &'a Route)> {
    let (i, up) = rt
        .config
        .upstreams
        .iter()
        .enumerate()
        .find(|(_, u)| u.name == record.upstream)?;
    let route = up
        .routes
        .iter()
        .chain([&up.fallback_side_effect])
        .find(|r| r.name == record.route)?;
    Some((i, up, route))
}

/// What one background pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Pass {
    pub found: usize,
    pub not_found: usize,
    pub unknown: usize,
}

/// Reconcile every `outcome_unknown` record whose route has a lookup (at most `budget`
/// lookups). Found → `committed`; not found (settled) → `failed_before_commit`, so the
/// client's next retry executes under the same key; anything else stays.
pub async fn pass(proxy: &Proxy, budget: usize) -> Result<Pass, StoreError> {
    let rt = proxy.runtime();
    let store: &dyn Store = proxy.store.as_ref();
    let mut done = Pass::default();
    let mut after = None;
    let mut looked = 0;
    loop {
        let page = store
            .list(&ListFilter {
                status: Some(State::OutcomeUnknown),
                after: after.clone(),
                limit: 100,
                ..ListFilter::default()
            })
            .await?;
        let Some(last) = page.last() else {
            return Ok(done);
        };
        after = Some(last.id.clone());
        let full = page.len() == 100;
        for record in page {
            // A batch's parent has nothing to look up: its items are reconciled on their own
            // records, and the parent goes on when its client retries.
            if record.batch.is_some() {
                continue;
            }
            let Some((i, up, route)) = route_of(&rt, &record) else {
                continue;
            };
            let Some(spec) = &route.reconcile else {
                continue;
            };
            if looked >= budget {
                return Ok(done);
            }
            looked += 1;
            let limit = rt.config.limits.max_response_bytes;
            let verdict = lookup(&rt.clients[i], up, route, spec, &record, None, limit).await;
            let result = verdict.name();
            let mut r = record;
            let changed = match verdict {
                found @ Verdict::Found { .. } => apply_found(&mut r, found),
                Verdict::NotFound => {
                    match reconcile::settled(&r, spec.settle, now_ms()) {
                        Ok(()) => r
                            .apply(
                                Event::ResolveNotCommitted,
                                now_ms(),
                                Some("reconciled: the lookup did not find the effect; the next retry executes under the same key".into()),
                            )
                            .is_ok(),
                        Err(_) => false,
                    }
                }
                Verdict::Unknown(why) => {
                    tracing::debug!(execution_id = %r.id, reason = %why, "background lookup proved nothing");
                    false
                }
            };
            if !changed {
                done.unknown += 1;
                proxy.metrics.reconciled(&r.upstream, &r.route, "unknown");
                continue;
            }
            match store.update(r).await {
                Ok(r) => {
                    tracing::info!(execution_id = %r.id, upstream = %r.upstream, route = %r.route, result, state = %r.state(), "reconciled in the background");
                    proxy.metrics.reconciled(&r.upstream, &r.route, result);
                    if r.state() == State::Committed {
                        found_under_cancelled_operation(store, &r).await;
                        done.found += 1;
                    } else {
                        done.not_found += 1;
                    }
                }
                // A client's retry (or another instance) got there first.
                Err(StoreError::Conflict { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        if !full {
            return Ok(done);
        }
    }
}

/// Run [`pass`] every `every`, the first time right away (records left by a crashed
/// instance are reconciled without waiting for their client).
pub fn spawn(proxy: Arc<Proxy>, every: Duration) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            match pass(&proxy, 1000).await {
                Ok(p) if p.found + p.not_found > 0 => {
                    tracing::info!(
                        found = p.found,
                        not_found = p.not_found,
                        still_unknown = p.unknown,
                        "background reconciliation pass"
                    )
                }
                Ok(_) => {}
                Err(e) => tracing::error!(error = %e, "background reconciliation failed"),
            }
        }
    })
}
