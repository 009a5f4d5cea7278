//! The JSON the admin API answers with. Views are built from records here and nowhere
//! else, so what an operator sees (and what is left out of listings, such as stored
//! bodies) is decided in one place.

use base64::Engine as _;
use serde::Serialize;

use super::actions::{CancelReport, OperationStatus};
use crate::policy::state::State;
use crate::store::{Approval, HistoryEntry, Lease, OperationMark, Record, StoredResponse};

/// One record in a listing: enough to decide on it, without the stored answer.
#[derive(Serialize)]
pub struct Summary<'a> {
    pub execution_id: &'a str,
    pub state: State,
    pub upstream: &'a str,
    pub route: &'a str,
    pub tool_version: &'a str,
    pub operation_id: Option<&'a str>,
    /// The orchestration parts the call was identified by (never argument values).
    pub model_round: Option<&'a str>,
    pub tool_call_id: Option<&'a str>,
    /// The idempotency key as the proxy read it (the client's, or derived).
    pub key: Option<&'a str>,
    pub method: &'a str,
    pub path: &'a str,
    pub args_hash: &'a str,
    /// The configured preview values (approval routes only).
    pub preview: Option<&'a serde_json::Value>,
    pub approval: Option<&'a Approval>,
    pub attempts: u32,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    pub note: Option<&'a str>,
    pub external_id: Option<&'a str>,
    pub response_status: Option<u16>,
}

impl<'a> Summary<'a> {
    pub fn of(r: &'a Record) -> Summary<'a> {
        Summary {
            execution_id: r.id.as_str(),
            state: r.state(),
            upstream: &r.upstream,
            route: &r.route,
            tool_version: &r.tool_version,
            operation_id: r.operation_id.as_deref(),
            model_round: r.model_round.as_deref(),
            tool_call_id: r.tool_call_id.as_deref(),
            key: r.key.as_deref(),
            method: &r.method,
            path: &r.path,
            args_hash: r.args_hash.as_str(),
            preview: r.preview.as_ref(),
            approval: r.approval.as_ref(),
            attempts: r.attempts,
            created_at_ms: r.created_at_ms,
            updated_at_ms: r.updated_at_ms,
            note: r.note.as_deref(),
            external_id: r.external_id.as_deref(),
            response_status: r.response.as_ref().map(|s| s.status),
        }
    }
}

/// One record in full (`GET /v1/executions/{id}`).
#[derive(Serialize)]
pub struct Detail<'a> {
    #[serde(flatten)]
    pub summary: Summary<'a>,
    pub tenant: &'a str,
    pub query: Option<&'a str>,
    pub path_params: &'a [(String, String)],
    pub lease: Option<&'a Lease>,
    pub started_at_ms: Option<i64>,
    pub committed_at_ms: Option<i64>,
    pub delivered_at_ms: Option<i64>,
    pub expires_at_ms: i64,
    pub response: Option<ResponseView>,
    pub history: &'a [HistoryEntry],
    /// Webhook events correlated to the call (SPEC section 9.1).
    pub events: &'a [crate::store::record::WebhookEvent],
    /// The background job the call started (SPEC section 9.2).
    pub job: Option<&'a crate::store::record::Job>,
    /// The parent of an independent batch: its items and where they stand (SPEC 9.3).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch: Option<BatchView>,
    /// An item of an independent batch: its parent and place.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub item_of: Option<&'a crate::store::record::ItemOf>,
}

/// A batch's items by state: `committed` (answered, delivered or not), `unknown`
/// (`outcome_unknown` or `executing`), `not_sent` (no record yet, or nothing sent).
#[derive(Serialize)]
pub struct BatchView {
    pub items: Vec<BatchItemView>,
    pub committed: usize,
    pub unknown: usize,
    pub not_sent: usize,
}

#[derive(Serialize)]
pub struct BatchItemView {
    pub index: usize,
    pub execution_id: String,
    /// `None`: the item has no record (the batch stopped before it).
    pub state: Option<State>,
}

impl BatchView {
    /// From the item ids in order and each item's record state, if it has a record.
    pub fn of(items: Vec<(String, Option<State>)>) -> BatchView {
        let (mut committed, mut unknown, mut not_sent) = (0, 0, 0);
        let items = items
            .into_iter()
            .enumerate()
            .map(|(index, (execution_id, state))| {
                match state {
                    Some(s) if s.has_result() => committed += 1,
                    Some(State::OutcomeUnknown | State::Executing) => unknown += 1,
                    _ => not_sent += 1,
                }
                BatchItemView {
                    index,
                    execution_id,
                    state,
                }
            })
            .collect();
        BatchView {
            items,
            committed,
            unknown,
            not_sent,
        }
    }
}

impl<'a> Detail<'a> {
    pub fn of(r: &'a Record) -> Detail<'a> {
        Detail {
            summary: Summary::of(r),
            tenant: r.tenant.as_str(),
            query: r.query.as_deref(),
            path_params: &r.path_params,
            lease: r.lease.as_ref(),
            started_at_ms: r.started_at_ms,
            committed_at_ms: r.committed_at_ms,
            delivered_at_ms: r.delivered_at_ms,
            expires_at_ms: r.expires_at_ms,
            response: r.response.as_ref().map(ResponseView::of),
            history: &r.history,
            events: &r.events,
            job: r.job.as_ref(),
            batch: None,
            item_of: r.item_of.as_ref(),
        }
    }
}

/// A stored answer: the body as JSON when it is JSON, as text when it is UTF-8, else base64.
#[derive(Serialize)]
pub struct ResponseView {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body_encoding: &'static str,
    pub body: serde_json::Value,
}

impl ResponseView {
    fn of(s: &StoredResponse) -> ResponseView {
        let headers = s
            .headers
            .iter()
            .map(|(n, v)| (n.clone(), String::from_utf8_lossy(v).into_owned()))
            .collect();
        let (body_encoding, body) = if let Ok(v) = serde_json::from_slice(&s.body) {
            ("json", v)
        } else if let Ok(t) = std::str::from_utf8(&s.body) {
            ("text", serde_json::Value::String(t.to_string()))
        } else {
            (
                "base64",
                serde_json::Value::String(
                    base64::engine::general_purpose::STANDARD.encode(&s.body),
                ),
            )
        };
        ResponseView {
            status: s.status,
            headers,
            body_encoding,
            body,
        }
    }
}

/// A page of a listing; `next` is the cursor for `after=` when more records follow.
#[derive(Serialize)]
pub struct Page<'a> {
    pub items: Vec<Summary<'a>>,
    pub next: Option<&'a str>,
}

/// `POST /v1/operations/{op}/cancel`.
#[derive(Serialize)]
pub struct Cancelled<'a> {
    pub operation_id: &'a str,
    pub state: &'static str,
    pub mark: Option<&'a OperationMark>,
    pub cancelled: Vec<&'a str>,
    pub committed: Vec<&'a str>,
    pub in_doubt: Vec<Pair<'a>>,
    pub unchanged: Vec<Pair<'a>>,
}

#[derive(Serialize)]
pub struct Pair<'a> {
    pub execution_id: &'a str,
    pub state: State,
}

impl<'a> Cancelled<'a> {
    pub fn of(op: &'a str, r: &'a CancelReport) -> Cancelled<'a> {
        let pairs = |v: &'a [(crate::policy::identity::ExecutionId, State)]| {
            v.iter()
                .map(|(id, state)| Pair {
                    execution_id: id.as_str(),
                    state: *state,
                })
                .collect()
        };
        Cancelled {
            operation_id: op,
            state: r.mark.as_ref().map_or("cancelled", |m| m.state.as_str()),
            mark: r.mark.as_ref(),
            cancelled: r.cancelled.iter().map(|id| id.as_str()).collect(),
            committed: r.committed.iter().map(|id| id.as_str()).collect(),
            in_doubt: pairs(&r.in_doubt),
            unchanged: pairs(&r.unchanged),
        }
    }
}

/// `GET /v1/operations/{op}`: `state` is `active` until the operation is cancelled.
#[derive(Serialize)]
pub struct Operation<'a> {
    pub operation_id: &'a str,
    pub state: &'static str,
    pub mark: Option<&'a OperationMark>,
    pub executions: Vec<Summary<'a>>,
    pub truncated: bool,
}

impl<'a> Operation<'a> {
    pub fn of(op: &'a str, s: &'a OperationStatus) -> Operation<'a> {
        Operation {
            operation_id: op,
            state: s.mark.as_ref().map_or("active", |m| m.state.as_str()),
            mark: s.mark.as_ref(),
            executions: s.records.iter().map(Summary::of).collect(),
            truncated: s.truncated,
        }
    }
}

/// One job in `GET /v1/jobs`: the call that started it and the job.
#[derive(Serialize)]
pub struct JobView<'a> {
    pub execution_id: &'a str,
    pub upstream: &'a str,
    pub route: &'a str,
    pub state: State,
    pub job: &'a crate::store::record::Job,
}
