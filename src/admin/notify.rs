//! Approvals reach people (`admin.notify`): a signed POST (Standard Webhooks) to the
//! configured URL when a call starts waiting for an operator: `approval_required` or
//! `outcome_unknown`.
//!
//! The store is the outbox. Every second the notifier lists the records in those states
//! (both stores index them by state) and posts one message for each it has not posted in
//! this process yet, retrying with backoff until the receiver answers 2xx. Nothing is
//! written to say a message went out, so a restart loses nothing: the records still
//! waiting are listed again and their messages posted again, under the same `webhook-id`
//! (`msg_<event>_<execution id>_<n>`, n counting the record's transitions), which is what a
//! Standard Webhooks receiver deduplicates on. Delivery is at least once, as the standard
//! says; several instances sharing a PostgreSQL store each post (same ids).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use http::header::CONTENT_TYPE;
use http::{HeaderValue, Method, Request};
use http_body_util::BodyExt;
use tokio::task::JoinHandle;

use crate::config::{NotifyConfig, NotifyEvent};
use crate::policy::state::State;
use crate::policy::webhook;
use crate::store::{ListFilter, Record, Store};
use crate::wire::body::full;
use crate::wire::client::HttpClient;

/// How often the store is looked at for records newly waiting.
const POLL: Duration = Duration::from_secs(1);
/// Records of one state looked at per poll (the oldest ids first).
const PAGE: usize = 500;
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(300);
/// Tries of one message before this process gives up on it (about two hours with the
/// backoff); a restart posts every message still waiting again.
const MAX_ATTEMPTS: u32 = 30;

/// One message: its id and JSON body.
struct Message {
    id: String,
    body: bytes::Bytes,
}

/// Start the notifier; it runs until the process ends (or the handle is aborted).
pub fn spawn(
    cfg: NotifyConfig,
    secret: Vec<u8>,
    store: Arc<dyn Store>,
    client: HttpClient,
) -> JoinHandle<()> {
    let secret = Arc::new(secret);
    let cfg = Arc::new(cfg);
    tokio::spawn(async move {
        let mut posted: HashSet<String> = HashSet::new();
        loop {
            let mut waiting = HashSet::new();
            for &event in &cfg.events {
                let state = match event {
                    NotifyEvent::ApprovalRequired => State::AwaitingApproval,
                    NotifyEvent::OutcomeUnknown => State::OutcomeUnknown,
                };
                let filter = ListFilter {
                    status: Some(state),
                    limit: PAGE,
                    ..ListFilter::default()
                };
                let records = match store.list(&filter).await {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::warn!(error = %e, "notify: cannot list waiting records");
                        continue;
                    }
                };
                for r in &records {
                    let m = message(event, r);
                    waiting.insert(m.id.clone());
                    if posted.insert(m.id.clone()) {
                        tokio::spawn(deliver(cfg.clone(), secret.clone(), client.clone(), m));
                    }
                }
            }
            // Forget what is no longer waiting: the set stays as small as the queue of
            // calls that need a person.
            posted.retain(|id| waiting.contains(id));
            tokio::time::sleep(POLL).await;
        }
    })
}

/// The message for `record` having entered `event`'s state. No argument values beyond the
/// route's configured approval preview; no request body, no credentials.
fn message(event: NotifyEvent, r: &Record) -> Message {
    let id = format!("msg_{}_{}_{}", event.name(), r.id, r.history.len());
    let body = serde_json::json!({
        "type": event.name(),
        "timestamp": humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        "data": {
            "execution_id": r.id.as_str(),
            "state": r.state().as_str(),
            "upstream": r.upstream,
            "route": r.route,
            "tool_version": r.tool_version,
            "operation_id": r.operation_id,
            "args_hash": r.args_hash.as_str(),
            "preview": r.preview,
            "note": r.note,
            "created_at_ms": r.created_at_ms,
        }
    });
    Message {
        id,
        body: bytes::Bytes::from(body.to_string()),
    }
}

/// Post `m` until the receiver answers 2xx, backing off from 1 s to 5 min between tries
/// (at most [`MAX_ATTEMPTS`]); each try is signed anew (its own `webhook-timestamp`).
async fn deliver(cfg: Arc<NotifyConfig>, secret: Arc<Vec<u8>>, client: HttpClient, m: Message) {
    let mut backoff = FIRST_BACKOFF;
    let mut attempt = 1u32;
    loop {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let signature = webhook::standard_signature(&secret, &m.id, now, &m.body);
        let req = Request::builder()
            .method(Method::POST)
            .uri(cfg.url.clone())
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
            .header("webhook-id", m.id.as_str())
            .header("webhook-timestamp", now.to_string())
            .header("webhook-signature", signature)
            .body(full(m.body.clone()));
        let outcome = match req {
            Ok(req) => match tokio::time::timeout(cfg.timeout, client.request(req)).await {
                Ok(Ok(resp)) => {
                    let status = resp.status();
                    // Read the answer to its end, so the connection can serve the next.
                    let _ = tokio::time::timeout(cfg.timeout, resp.into_body().collect()).await;
                    if status.is_success() {
                        tracing::info!(message = %m.id, attempt, "notification delivered");
                        return;
                    }
                    format!("answered {status}")
                }
                Ok(Err(e)) => crate::wire::client::describe(&e),
                Err(_) => format!("no answer within {:?}", cfg.timeout),
            },
            Err(e) => {
                tracing::error!(message = %m.id, error = %e, "notify: cannot build the request");
                return;
            }
        };
        if attempt >= MAX_ATTEMPTS {
            tracing::error!(message = %m.id, attempt, why = %outcome, "notification given up until the next start");
            return;
        }
        tracing::warn!(message = %m.id, attempt, why = %outcome, retry_in = ?backoff, "notification not delivered");
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
        attempt += 1;
    }
}
