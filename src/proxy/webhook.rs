//! Webhook routes (SPEC section 9.1): a sibling of [`side_effect`]'s admission. A delivery
//! is verified (before anything is stored or forwarded), identified by its event id scoped
//! to the route, folded into the call it names (correlation: history, and settling an
//! `outcome_unknown` call), and then run through the one execution core
//! ([`side_effect::run`]: claim → send → record → answer). The route's resolved settings
//! make the core do the webhook things: the receiver gets the delivery's `execution_id` as
//! `Idempotency-Key`, a receiver 5xx is `failed_before_commit` (not stored; the provider's
//! retry is forwarded), a timeout is re-sent under the same key, a concurrent duplicate is
//! `409` + `Retry-After`.

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, StatusCode};

use super::side_effect::{self, Admit, Admitted};
use super::{Proxy, Runtime};
use crate::policy::classify::Target;
use crate::policy::fingerprint::{raw_digest, CallScope, RequestParts};
use crate::policy::identity::{self, ExecutionId};
use crate::policy::job::JobState;
use crate::policy::state::{Event, State};
use crate::policy::webhook::{self, Verdict, WebhookSpec};
use crate::store::record::WebhookEvent;
use crate::store::{now_ms, StoreError, StoredResponse};
use crate::wire::body::RequestBody;
use crate::wire::headers::RECONCILED;
use crate::wire::problem::{Kind, Problem};

/// Admit a delivery to a `class: webhook` route: verify, identify, correlate. What it
/// admits runs under its record like any side effect.
pub async fn admit(
    proxy: &Arc<Proxy>,
    rt: &Runtime,
    target: &Target<'_>,
    req: Request<RequestBody>,
) -> Admit {
    let cfg = &rt.config;
    let (upstream, route) = (&target.upstream.name, &target.route.name);
    let Some(spec) = target.route.webhook.as_deref() else {
        return Admit::Respond(
            Problem::new(Kind::Internal, "webhook route without a webhook block").into_response(),
        );
    };
    let (parts, incoming) = req.into_parts();
    let body = match side_effect::read_body(incoming, &parts, cfg.limits.max_body_bytes).await {
        Ok(b) => b,
        Err(resp) => return Admit::Respond(*resp),
    };
    if let Some(v) = &spec.verify {
        let now_s = now_ms().div_euclid(1000);
        if let Err(why) = webhook::verify(v, &parts.headers, &body, now_s) {
            tracing::warn!(upstream = %upstream, route = %route, scheme = v.scheme.as_str(), reason = %why, "webhook delivery refused: signature not verified");
            proxy.metrics.webhook(upstream, route, "signature_rejected");
            return Admit::Respond(
                Problem::new(
                    Kind::WebhookSignature,
                    format!(
                        "{why} ({} scheme); nothing was recorded or forwarded",
                        v.scheme.as_str()
                    ),
                )
                .into_response(),
            );
        }
    }
    // Parsed only when something reads it (a header event id and no correlation: never).
    let wants_json =
        matches!(spec.event_id, webhook::EventIdFrom::Json(_)) || !spec.correlate.is_empty();
    let json: Option<serde_json::Value> = if wants_json {
        serde_json::from_slice(&body).ok()
    } else {
        None
    };
    let event_id = match webhook::event_id(&spec.event_id, &parts.headers, json.as_ref()) {
        Ok(id) if id.len() <= cfg.limits.max_key_bytes => id,
        Ok(id) => {
            return Admit::Respond(
                Problem::new(
                    Kind::KeyInvalid,
                    format!(
                        "the event id is {} bytes, over limits.max_key_bytes ({})",
                        id.len(),
                        cfg.limits.max_key_bytes
                    ),
                )
                .into_response(),
            )
        }
        Err(why) => {
            return Admit::Respond(
                Problem::new(Kind::KeyMissing, format!("{why}; nothing was forwarded"))
                    .into_response(),
            )
        }
    };
    if let Some(json) = &json {
        if !spec.correlate.is_empty() {
            if let Folded::Executing(named) = correlate(proxy, target, spec, &event_id, json).await
            {
                // Not recorded, not forwarded: the provider redelivers, and by then the
                // call has an outcome of its own (or an unknown one this event settles).
                return Admit::Respond(
                    Problem::new(
                        Kind::InFlight,
                        "the event names a call that is still executing; nothing was recorded or forwarded, redeliver it to have it applied",
                    )
                    .execution(&named)
                    .header(http::header::RETRY_AFTER, http::HeaderValue::from_static("1"))
                    .into_response(),
                );
            }
        }
    }
    // Providers carry no tenant credential: the event id is scoped by upstream and route.
    let tenant = identity::tenant_scope(&parts.headers, &[]);
    let id = identity::execution_id(&tenant, upstream, route, &event_id);
    let raw = {
        let request = RequestParts {
            method: &parts.method,
            upstream,
            route,
            path: &target.rel_path,
            query: parts.uri.query(),
            headers: &parts.headers,
            body: &body,
        };
        let scope = CallScope {
            key: &event_id,
            tenant_from: &[],
        };
        raw_digest(&scope, &request, &target.route.fingerprint)
    };
    tracing::debug!(execution_id = %id, event_id = %event_id, "webhook delivery admitted");
    Admit::Protected(Admitted::new(parts, &body, id, tenant, raw))
}

/// How a delivery ended, for `idemproxy_webhooks_total{result}`: a replayed answer, or a
/// forwarded one (whatever the receiver said).
pub fn count(
    proxy: &Proxy,
    upstream: &str,
    route: &str,
    answer: &http::Response<crate::wire::body::ProxyBody>,
) {
    let result = if answer
        .headers()
        .contains_key(crate::wire::headers::REPLAYED)
    {
        "replayed"
    } else if answer
        .headers()
        .contains_key(crate::wire::headers::EXECUTION_ID)
        && answer.status() != StatusCode::CONFLICT
    {
        "forwarded"
    } else {
        return;
    };
    proxy.metrics.webhook(upstream, route, result);
}

/// What folding an event into the call it names came to.
enum Folded {
    /// Recorded, already there, not correlated, or not writable (logged): go on.
    Done,
    /// The named call is still `executing`: its attempt owns the record (a write here
    /// would fence it out), so the delivery is refused for the provider to redeliver.
    Executing(ExecutionId),
}

/// Fold a verified event into the call it names: the first `correlate` pointer whose value
/// is a stored execution wins. The event joins that record's `events` (once per event id
/// and route); a `succeeded` event settles an `outcome_unknown` record as `committed`
/// (`SettleByWebhook`, the event as evidence).
async fn correlate(
    proxy: &Proxy,
    target: &Target<'_>,
    spec: &WebhookSpec,
    event_id: &str,
    json: &serde_json::Value,
) -> Folded {
    let (upstream, route) = (&target.upstream.name, &target.route.name);
    let label = format!("{upstream}/{route}");
    let (kind, verdict) = webhook::verdict(spec, json);
    for candidate in webhook::correlated(spec, json) {
        let id = ExecutionId(candidate.to_string());
        // A few tries: another writer (a retry's `deliver`) may move the record meanwhile.
        for _ in 0..5 {
            let mut r = match proxy.store.get(&id).await {
                Ok(Some(r)) => r,
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(event_id, execution_id = %id, error = %e, "webhook correlation: could not read the record");
                    return Folded::Done;
                }
            };
            if r.events
                .iter()
                .any(|e| e.id == event_id && e.route == label)
            {
                return Folded::Done;
            }
            if r.state() == State::Executing {
                tracing::info!(event_id, execution_id = %id, "webhook event names a call still executing; the delivery is refused for a redelivery");
                return Folded::Executing(id);
            }
            let now = now_ms();
            r.events.push(WebhookEvent {
                id: event_id.to_string(),
                route: label.clone(),
                kind: kind.clone(),
                at_ms: now,
                verdict: match verdict {
                    Verdict::Succeeded => "succeeded",
                    Verdict::Failed => "failed",
                    Verdict::Other => "other",
                }
                .into(),
                body: spec.store_body.then(|| json.clone()),
                held: None,
            });
            let ended = match verdict {
                Verdict::Succeeded => Some(JobState::Succeeded),
                Verdict::Failed => Some(JobState::Failed),
                Verdict::Other => None,
            };
            if let (Some(job), Some(to)) = (r.job.as_mut(), ended) {
                match crate::policy::job::advance(job.state, to) {
                    Ok(state) => {
                        job.state = state;
                        job.result = Some(webhook::evidence_value(json));
                        job.event = Some(event_id.to_string());
                        job.updated_at_ms = now;
                    }
                    Err(why) => {
                        tracing::info!(event_id, execution_id = %id, reason = %why, "webhook event does not move the job")
                    }
                }
            }
            let settles = verdict == Verdict::Succeeded && r.state() == State::OutcomeUnknown;
            if settles {
                r.response = Some(evidence(json, event_id));
                let note = format!(
                    "settled by webhook event {event_id} ({}) on {label}",
                    kind.as_deref().unwrap_or("no type")
                );
                if let Err(e) = r.apply(Event::SettleByWebhook, now, Some(note)) {
                    tracing::error!(execution_id = %id, error = %e, "webhook settle refused");
                    return Folded::Done;
                }
            }
            match proxy.store.update(r).await {
                Ok(_) => {
                    proxy.metrics.webhook(upstream, route, "correlated");
                    if settles {
                        tracing::info!(event_id, execution_id = %id, "outcome unknown: settled as committed by a webhook event");
                        proxy.metrics.reconciled(upstream, route, "webhook");
                    } else {
                        tracing::info!(event_id, execution_id = %id, "webhook event joined the call's history");
                    }
                    return Folded::Done;
                }
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => {
                    tracing::warn!(event_id, execution_id = %id, error = %e, "webhook correlation: could not write the record");
                    return Folded::Done;
                }
            }
        }
    }
    proxy.metrics.webhook(upstream, route, "uncorrelated");
    Folded::Done
}

/// The stored answer of a call settled by an event: `200` JSON, the event's `data.object`
/// (else the event), marked `Idempotency-Reconciled: webhook` and naming the event.
fn evidence(json: &serde_json::Value, event_id: &str) -> StoredResponse {
    StoredResponse {
        status: 200,
        headers: vec![
            ("content-type".into(), b"application/json".to_vec()),
            (RECONCILED.as_str().into(), b"webhook".to_vec()),
            (
                "idempotency-webhook-event".into(),
                event_id.as_bytes().to_vec(),
            ),
        ],
        body: Bytes::from(webhook::evidence_body(json)).to_vec(),
    }
}
