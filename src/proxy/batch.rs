//! Independent batches (SPEC section 9.3), a sibling lifecycle of the one execution core:
//! the batch call is a parent execution whose "send" ([`Protocol::perform`]) runs its items
//! in request order, each a call of its own through the same core (claim → send → record →
//! answer → reconcile) under an execution id derived from the parent's and the item key.
//! Every item is durably `executing` before it is sent and `committed` before the next one
//! starts, so a retry after a crash replays the items that finished, reconciles the one
//! that was in flight (section 7) and goes on with the rest: no item's side effect happens
//! twice. The parent's own record holds the approval (of the whole batch's arguments), the
//! item list and, once every item is committed, the combined answer.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Request, Response};
use http_body_util::BodyExt;
use serde_json::{json, Value};

use super::side_effect::{self, Judged, Performed, Protocol, Sibling};
use super::{Proxy, Runtime};
use crate::config::Route;
use crate::metrics::Metrics;
use crate::policy::batch::{self, BatchSpec, Item, Refusal};
use crate::policy::classify::Target;
use crate::policy::fingerprint::{args_hash, RequestParts};
use crate::policy::identity::{self, ArgsHash, ExecutionId, TenantScope};
use crate::policy::state::{Event, State};
use crate::store::record::{Batch, ItemOf};
use crate::store::{Record, StoredResponse};
use crate::wire::body::{self, ProxyBody};
use crate::wire::client::HttpClient;
use crate::wire::headers::{ClientAddr, EXECUTION_ID, STATUS};
use crate::wire::problem::{Kind, Problem};

/// The answer to a batch refused before anything was recorded.
pub(super) fn refused(r: Refusal) -> Response<ProxyBody> {
    let kind = match r {
        Refusal::Invalid(_) => Kind::BatchInvalid,
        Refusal::TooMany { .. } => Kind::BatchTooLarge,
        Refusal::Duplicate { .. } => Kind::BatchDuplicateItem,
    };
    let mut p = Problem::new(kind, r.to_string());
    if let Refusal::Duplicate { first, second, .. } = r {
        p = p.with("items", json!([first, second]));
    }
    p.into_response()
}

/// Everything [`run`] needs of the admitted batch call.
pub(super) struct Call<'a> {
    pub proxy: &'a Arc<Proxy>,
    pub rt: &'a Runtime,
    pub client: &'a HttpClient,
    pub target: &'a Target<'a>,
    pub spec: &'a BatchSpec,
    /// The route each item runs on (`spec.each`).
    pub each: &'a Route,
    pub parts: Parts,
    pub body: Bytes,
    pub id: ExecutionId,
    pub tenant: TenantScope,
    pub args: ArgsHash,
    /// The client's key (kept on the parent's and every item's record, for search).
    pub key: Option<String>,
    pub peer: &'a ClientAddr,
    pub queue: Option<Arc<tokio::sync::Semaphore>>,
}

/// Run an independent batch: the parent through the core, its items inside it.
pub(super) async fn run(call: Call<'_>) -> Response<ProxyBody> {
    let items = match batch::items(call.spec, &call.body) {
        Ok(items) => items,
        Err(r) => return refused(r),
    };
    let ids = items
        .iter()
        .map(|i| identity::item_execution_id(&call.id, &i.key))
        .collect();
    let parent = Parent {
        proxy: call.proxy,
        rt: call.rt,
        client: call.client,
        target: call.target,
        each: call.each,
        headers: item_headers(&call.parts.headers),
        items,
        ids,
        tenant: call.tenant.clone(),
        key: call.key,
        id: call.id.clone(),
        body: call.body.clone(),
        peer: call.peer,
    };
    let sibling = Sibling {
        parts: call.parts,
        body: call.body,
        id: call.id,
        tenant: call.tenant,
        args: call.args,
        proto: &parent,
    };
    side_effect::run_sibling(
        call.proxy,
        call.rt,
        call.client,
        call.target,
        sibling,
        call.peer,
        call.queue,
    )
    .await
}

/// The client's headers as every item's request carries them: the item body is JSON of
/// its own length (the body's framing is set when it is sent).
fn item_headers(headers: &http::HeaderMap) -> http::HeaderMap {
    let mut h = headers.clone();
    h.remove(http::header::CONTENT_LENGTH);
    h.remove(http::header::TRANSFER_ENCODING);
    h.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h
}

/// The parent execution of an independent batch, as the core's [`Protocol`].
struct Parent<'a> {
    proxy: &'a Arc<Proxy>,
    rt: &'a Runtime,
    client: &'a HttpClient,
    target: &'a Target<'a>,
    each: &'a Route,
    headers: http::HeaderMap,
    items: Vec<Item>,
    ids: Vec<ExecutionId>,
    tenant: TenantScope,
    key: Option<String>,
    id: ExecutionId,
    body: Bytes,
    peer: &'a ClientAddr,
}

impl Protocol for Parent<'_> {
    fn judge(&self, _: &http::response::Parts, _: &Bytes) -> Judged {
        // `perform` runs the items; the parent itself never sends.
        Judged::Lost("a batch parent has no downstream answer of its own".into())
    }

    fn render(
        &self,
        stored: &StoredResponse,
        id: &ExecutionId,
        replayed: bool,
    ) -> Response<ProxyBody> {
        if !replayed {
            return side_effect::stored_response(stored, id);
        }
        // Replayed whole: no item was sent for this request.
        let mut stored = stored.clone();
        if let Ok(mut v) = serde_json::from_slice::<Value>(&stored.body) {
            if let Some(items) = v.get_mut("items").and_then(Value::as_array_mut) {
                for item in items {
                    item["replayed"] = Value::Bool(true);
                }
            }
            stored.body = serde_json::to_vec(&v).unwrap_or(stored.body);
        }
        side_effect::stored_response(&stored, id)
    }

    fn preview_source(&self) -> &[u8] {
        &self.body
    }

    fn decorate(&self, record: &mut Record) {
        record.batch = Some(Batch {
            items: self.ids.clone(),
        });
        record.key.clone_from(&self.key);
    }

    fn perform(
        &self,
    ) -> Option<std::pin::Pin<Box<dyn std::future::Future<Output = Performed> + Send + '_>>> {
        Some(Box::pin(self.run_items()))
    }

    fn resumable(&self) -> bool {
        true
    }
}

impl Parent<'_> {
    fn count(&self, result: &str) {
        Metrics::count(
            &self.proxy.metrics.batch_items,
            &self.target.upstream.name,
            &self.target.route.name,
            result,
        );
    }

    /// Every item in order, each under its own record; the first that does not end
    /// committed stops the batch (the items after it are not sent).
    async fn run_items(&self) -> Performed {
        let mut answers = Vec::with_capacity(self.items.len());
        for (item, id) in self.items.iter().zip(&self.ids) {
            match self.run_item(item, id).await {
                Ok(answer) => {
                    self.count(if answer["replayed"] == Value::Bool(true) {
                        "replayed"
                    } else {
                        "sent"
                    });
                    answers.push(answer);
                }
                Err(stopped) => {
                    self.count("stopped");
                    return stopped;
                }
            }
        }
        let body =
            serde_json::to_vec(&json!({ "items": answers })).expect("JSON values always serialize");
        Performed::Answer(StoredResponse {
            status: 200,
            headers: vec![("content-type".into(), b"application/json".to_vec())],
            body,
        })
    }

    async fn run_item(&self, item: &Item, id: &ExecutionId) -> Result<Value, Performed> {
        let each = self.each;
        let mut req = Request::new(());
        *req.method_mut() = each.method.clone().unwrap_or(http::Method::POST);
        *req.uri_mut() = each.path.parse().expect("checked as a literal path");
        *req.headers_mut() = self.headers.clone();
        let (parts, ()) = req.into_parts();
        let args = args_hash(
            &RequestParts {
                method: &parts.method,
                upstream: &self.target.upstream.name,
                route: &each.name,
                path: &each.path,
                query: None,
                headers: &parts.headers,
                body: &item.body,
            },
            &each.fingerprint,
        )
        .map_err(|e| {
            self.stop(
                item,
                id,
                Event::FailBeforeCommit,
                format!("the item names {} twice", e.0),
                None,
            )
        })?;
        let target = Target {
            upstream_index: self.target.upstream_index,
            upstream: self.target.upstream,
            route_ref: self.target.route_ref,
            route: each,
            rel_path: each.path.clone(),
            params: Vec::new(),
        };
        let proto = ItemCall {
            of: ItemOf {
                parent: self.id.clone(),
                index: item.index,
            },
            body: Bytes::from(item.body.clone()),
            key: self.key.clone(),
            answer: Mutex::new(None),
        };
        let sibling = Sibling {
            parts,
            body: proto.body.clone(),
            id: id.clone(),
            tenant: self.tenant.clone(),
            args,
            proto: &proto,
        };
        // Boxed: the item's future is the core's own, inside the parent's.
        let resp = Box::pin(side_effect::run_sibling(
            self.proxy,
            self.rt,
            self.client,
            &target,
            sibling,
            self.peer,
            None,
        ))
        .await;
        let status_note = resp.headers().get(STATUS).cloned();
        let (head, b) = resp.into_parts();
        // Read to the end: that is what marks a first answer delivered on its record.
        let bytes = b.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
        let answered = proto.answer.lock().expect("not poisoned").take();
        match (answered, status_note) {
            (Some((stored, replayed)), None) => Ok(json!({
                "status": stored.status,
                "body": answer_body(&stored.body),
                "execution_id": id.as_str(),
                "replayed": replayed,
            })),
            _ => {
                let event = match self.proxy.store.get(id).await {
                    Ok(Some(r))
                        if !matches!(r.state(), State::OutcomeUnknown | State::Executing) =>
                    {
                        Event::FailBeforeCommit
                    }
                    // Unknown, still running elsewhere, or unreadable: the batch's outcome
                    // is not known either.
                    _ => Event::LoseOutcome,
                };
                let why = format!(
                    "item {} did not commit (answer {})",
                    item.index, head.status
                );
                Err(self.stop(item, id, event, why, Some((head, bytes))))
            }
        }
    }

    /// The parent's answer when the batch stops at `item`: the item's own answer, as a
    /// problem naming the item (its index and execution id) under the parent's id.
    fn stop(
        &self,
        item: &Item,
        id: &ExecutionId,
        event: Event,
        why: String,
        answer: Option<(http::response::Parts, Bytes)>,
    ) -> Performed {
        let problem = answer.as_ref().and_then(|(head, bytes)| {
            let is_problem = head
                .headers
                .get(http::header::CONTENT_TYPE)
                .is_some_and(|v| v.as_bytes().starts_with(b"application/problem+json"));
            is_problem
                .then(|| serde_json::from_slice::<serde_json::Map<String, Value>>(bytes).ok())
                .flatten()
        });
        let mut resp = match (problem, answer) {
            (Some(mut p), Some((mut head, _))) => {
                let detail = p
                    .get("detail")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string();
                p.insert(
                    "detail".into(),
                    Value::String(format!("batch item {}: {detail}", item.index)),
                );
                p.insert("execution_id".into(), Value::String(self.id.to_string()));
                p.insert("item".into(), json!(item.index));
                p.insert("item_execution_id".into(), Value::String(id.to_string()));
                let bytes = serde_json::to_vec(&p).expect("JSON values always serialize");
                head.headers.remove(http::header::CONTENT_LENGTH);
                Response::from_parts(head, body::full(bytes))
            }
            (_, head) => {
                let kind = if event == Event::LoseOutcome {
                    Kind::OutcomeUnknown
                } else {
                    Kind::UpstreamUnavailable
                };
                let mut p = Problem::new(
                    kind,
                    format!(
                        "batch item {}: {why}; the items before it are committed, the items after it were not sent; a retry with the same key goes on from this item",
                        item.index
                    ),
                )
                .with("item", item.index)
                .with("item_execution_id", id.to_string());
                if let Some((head, _)) = &head {
                    p = p.with("item_status", head.status.as_u16());
                }
                p.into_response()
            }
        };
        if let Ok(v) = HeaderValue::from_str(self.id.as_str()) {
            resp.headers_mut().insert(EXECUTION_ID, v);
        }
        Performed::Stopped {
            event,
            why,
            answer: resp,
        }
    }
}

/// An item's answer body in the batch answer: JSON when it is JSON, else text.
fn answer_body(body: &[u8]) -> Value {
    serde_json::from_slice(body)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(body).into_owned()))
}

/// One item of a batch, as the core's [`Protocol`]: a plain HTTP call whose stored answer
/// (first or replayed) is kept for the batch's answer.
struct ItemCall {
    of: ItemOf,
    body: Bytes,
    /// The batch's key: a search by key finds the batch and every item (the item key is
    /// an argument value and is not kept).
    key: Option<String>,
    answer: Mutex<Option<(StoredResponse, bool)>>,
}

impl Protocol for ItemCall {
    fn judge(&self, parts: &http::response::Parts, bytes: &Bytes) -> Judged {
        let (stored, server_error) = side_effect::http_answer(parts, bytes);
        Judged::Answer {
            stored,
            server_error,
        }
    }

    fn render(
        &self,
        stored: &StoredResponse,
        id: &ExecutionId,
        replayed: bool,
    ) -> Response<ProxyBody> {
        *self.answer.lock().expect("not poisoned") = Some((stored.clone(), replayed));
        side_effect::stored_response(stored, id)
    }

    fn preview_source(&self) -> &[u8] {
        &self.body
    }

    fn decorate(&self, record: &mut Record) {
        record.item_of = Some(self.of.clone());
        record.key.clone_from(&self.key);
    }
}
