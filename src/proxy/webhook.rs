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

use http::{Request, StatusCode};

use super::side_effect::{self, Admit, Admitted};
use super::{Proxy, Runtime};
use crate::policy::classify::Target;
use crate::policy::fingerprint::{raw_digest, CallScope, RequestParts};
use crate::policy::identity::{self, ExecutionId};
use crate::policy::job::{self, EndedBy, JobState};
use crate::policy::state::{Event, State};
use crate::policy::webhook::{self, CorrelateTo, Verdict, WebhookSpec};
use crate::store::record::WebhookEvent;
use crate::store::{now_ms, ListFilter, StoreError};
use crate::wire::body::RequestBody;
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
            correlate(proxy, target, spec, &event_id, json).await;
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

/// Fold a verified event into the call it names: the first `correlate` value that names a
/// stored record (by execution id, or as the only record holding that external id) wins.
/// The event joins that record's `events` (once per event id and route); a `succeeded`
/// event settles an `outcome_unknown` record as `committed` (`SettleByWebhook`, the event as
/// evidence) and is held on an `executing` one to settle it if it would become
/// `outcome_unknown` (`policy::webhook::settle_held`); a job the call started ends. Trouble
/// is logged: the delivery is forwarded and deduplicated whatever the correlation did.
async fn correlate(
    proxy: &Proxy,
    target: &Target<'_>,
    spec: &WebhookSpec,
    event_id: &str,
    json: &serde_json::Value,
) {
    let (upstream, route) = (&target.upstream.name, &target.route.name);
    let label = format!("{upstream}/{route}");
    let (kind, verdict) = webhook::verdict(spec, json);
    for (value, to) in webhook::correlated(spec, json) {
        let id = match to {
            CorrelateTo::ExecutionId => ExecutionId(value.clone()),
            CorrelateTo::ExternalId => {
                let found = proxy
                    .store
                    .list(&ListFilter {
                        external_id: Some(value.clone()),
                        limit: 2,
                        ..ListFilter::default()
                    })
                    .await;
                match found.map(webhook::pick_external) {
                    Ok(Ok(Some(r))) => r.id,
                    Ok(Ok(None)) => continue,
                    Ok(Err(n)) => {
                        tracing::warn!(event_id, external_id = %value, records = n, "webhook correlation: several calls hold this external id; the event names none of them by it");
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(event_id, external_id = %value, error = %e, "webhook correlation: could not look up the external id");
                        return;
                    }
                }
            }
        };
        // A few tries: another writer (a retry's `deliver`, the call's own attempt) may
        // move the record meanwhile.
        for _ in 0..5 {
            let mut r = match proxy.store.get(&id).await {
                Ok(Some(r)) => r,
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(event_id, execution_id = %id, error = %e, "webhook correlation: could not read the record");
                    return;
                }
            };
            if r.events
                .iter()
                .any(|e| e.id == event_id && e.route == label)
            {
                return;
            }
            let now = now_ms();
            // While the call executes its attempt owns the record: the event only joins
            // its history (the attempt's own write takes the events along, see
            // `side_effect`), and a `succeeded` one is held as evidence.
            let executing = r.state() == State::Executing;
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
                held: (executing && verdict == Verdict::Succeeded)
                    .then(|| webhook::evidence_value(json)),
            });
            let ended = match verdict {
                Verdict::Succeeded => Some(JobState::Succeeded),
                Verdict::Failed => Some(JobState::Failed),
                Verdict::Other => None,
            };
            let mut job_ended = None;
            if let (Some(job), Some(to)) = (r.job.as_mut(), ended) {
                let result = webhook::evidence_value(json);
                match job::end(
                    job,
                    to,
                    result,
                    Some(event_id.to_string()),
                    EndedBy::Webhook,
                    now,
                ) {
                    Ok(()) => job_ended = Some(to),
                    Err(why) => {
                        tracing::info!(event_id, execution_id = %id, reason = %why, "webhook event does not move the job")
                    }
                }
            }
            let settles = verdict == Verdict::Succeeded && r.state() == State::OutcomeUnknown;
            if settles {
                r.response = Some(webhook::evidence_answer(
                    &webhook::evidence_value(json),
                    event_id,
                ));
                let note = format!(
                    "settled by webhook event {event_id} ({}) on {label}",
                    kind.as_deref().unwrap_or("no type")
                );
                if let Err(e) = r.apply(Event::SettleByWebhook, now, Some(note)) {
                    tracing::error!(execution_id = %id, error = %e, "webhook settle refused");
                    return;
                }
            }
            match proxy.store.update(r).await {
                Ok(r) => {
                    proxy.metrics.webhook(upstream, route, "correlated");
                    if let Some(to) = job_ended {
                        proxy.metrics.job(&r.upstream, &r.route, to);
                        tracing::info!(event_id, execution_id = %id, state = to.as_str(), "job ended by a webhook event");
                    }
                    if settles {
                        tracing::info!(event_id, execution_id = %id, "outcome unknown: settled as committed by a webhook event");
                        proxy.metrics.reconciled(&r.upstream, &r.route, "webhook");
                    } else if executing {
                        tracing::info!(event_id, execution_id = %id, "webhook event joined a call still executing; held until the call has an outcome");
                    } else {
                        tracing::info!(event_id, execution_id = %id, "webhook event joined the call's history");
                    }
                    return;
                }
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => {
                    tracing::warn!(event_id, execution_id = %id, error = %e, "webhook correlation: could not write the record");
                    return;
                }
            }
        }
    }
    proxy.metrics.webhook(upstream, route, "uncorrelated");
}
