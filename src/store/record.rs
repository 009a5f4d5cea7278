//! The execution record: everything SPEC section 6 says a record holds. Its state can
//! only change through [`Record::apply`], which asks the state machine first.

use base64::Engine as _;
use serde::{Deserialize, Serialize};

use crate::policy::identity::{ArgsHash, ExecutionId, TenantScope};
use crate::policy::state::{transition, Event, IllegalTransition, State};

/// The downstream's answer as stored for replay (hop-by-hop headers already removed).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredResponse {
    pub status: u16,
    /// Header name (lower-case) and raw value bytes, in the order received.
    #[serde(with = "header_list")]
    pub headers: Vec<(String, Vec<u8>)>,
    #[serde(with = "b64")]
    pub body: Vec<u8>,
}

/// An approval bound to exact arguments.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Approval {
    pub args_hash: ArgsHash,
    pub by: String,
    pub at_ms: i64,
    #[serde(default)]
    pub expires_at_ms: Option<i64>,
}

/// Ownership of an `executing` record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub owner: String,
    pub expires_at_ms: i64,
}

/// One state change, kept for audit (`records show`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistoryEntry {
    pub at_ms: i64,
    pub from: State,
    pub event: Event,
    pub to: State,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// A verified webhook event that named this call (SPEC section 9.1): who sent it and
/// what it said; its body only on routes with `store_body: true`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WebhookEvent {
    /// The event id (the provider's).
    pub id: String,
    /// `upstream/route` of the webhook route that received it.
    pub route: String,
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub at_ms: i64,
    /// `succeeded`, `failed` or `other` (the route's `outcome` lists).
    pub verdict: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<serde_json::Value>,
    /// A `succeeded` event that arrived while the call was still `executing`: its evidence
    /// (the event's `data.object`, else the event), held to settle the call the moment it
    /// would become `outcome_unknown` ([`crate::policy::webhook::settle_held`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held: Option<serde_json::Value>,
}

/// A background job started by the call (SPEC section 9.2). Its state moves only through
/// [`crate::policy::job::advance`]; the record's own state and stored answer stay as they are.
/// The parent record of an independent batch: what each item's record is.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Batch {
    /// The item executions, in request order.
    pub items: Vec<ExecutionId>,
}

/// Where an item's record belongs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ItemOf {
    pub parent: ExecutionId,
    pub index: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Job {
    pub id: String,
    pub state: crate::policy::job::JobState,
    /// What ended it: the event's `data.object` (else the event).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<serde_json::Value>,
    /// The event that ended it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event: Option<String>,
    /// What ended it: a webhook, an observed status poll or the proxy's own polling.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_by: Option<crate::policy::job::EndedBy>,
    pub started_at_ms: i64,
    pub updated_at_ms: i64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub id: ExecutionId,
    /// Fencing token: bumped by the store on every `update` (not on lease renewal); updates
    /// are compare-and-set on it.
    pub version: u64,
    state: State,
    pub tenant: TenantScope,
    pub upstream: String,
    pub route: String,
    pub tool_version: String,
    /// Parent operation (from the trusted operation header), for cancellation.
    #[serde(default)]
    pub operation_id: Option<String>,
    /// The model round the call came from (`identity.model_round_from`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_round: Option<String>,
    /// The provider's tool call id (`identity.tool_call_from`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The idempotency key as the proxy read it: the client's key (unquoted), or the key
    /// joined from the `derive_from` headers or `_meta` fields. Ids only, never arguments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    pub args_hash: ArgsHash,
    pub method: String,
    /// Path relative to the mount, and the raw query, as first received.
    pub path: String,
    #[serde(default)]
    pub query: Option<String>,
    /// Template parameters matched from the route path (for reconcile templates).
    #[serde(default)]
    pub path_params: Vec<(String, String)>,
    /// Values picked from the body for approvals (configured pointers only).
    #[serde(default)]
    pub preview: Option<serde_json::Value>,
    #[serde(default)]
    pub approval: Option<Approval>,
    #[serde(default)]
    pub lease: Option<Lease>,
    /// Times the request was sent downstream.
    pub attempts: u32,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    #[serde(default)]
    pub started_at_ms: Option<i64>,
    #[serde(default)]
    pub committed_at_ms: Option<i64>,
    #[serde(default)]
    pub delivered_at_ms: Option<i64>,
    /// Retention: the record may be deleted after this instant.
    pub expires_at_ms: i64,
    /// The downstream's own id for the effect (e.g. `msg_912`), when it returned one.
    #[serde(default)]
    pub external_id: Option<String>,
    /// Whether `external_id` is in the stores' external-id index (`ListFilter.external_id`):
    /// for a call that started a job, and on every route while a webhook route correlates
    /// `to: external_id`. Other external ids are kept but not indexed: the entry would be
    /// one more write at a random place per execution, for a lookup nothing makes.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub external_indexed: bool,
    #[serde(default)]
    pub response: Option<StoredResponse>,
    /// Why the record is where it is (error text without argument values).
    #[serde(default)]
    pub note: Option<String>,
    #[serde(default)]
    pub history: Vec<HistoryEntry>,
    /// Webhook events correlated to this call (SPEC section 9.1), oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub events: Vec<WebhookEvent>,
    /// The background job this call started (SPEC section 9.2), on `job:` routes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<Job>,
    /// The parent of an independent batch (SPEC section 9.3): its items' executions in
    /// request order. Item keys are argument values and are not kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch: Option<Batch>,
    /// An item of an independent batch: the batch's execution and the item's place in it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub item_of: Option<ItemOf>,
    /// The request body as first sent, kept only on routes whose downstream replays keyed
    /// requests: a re-send under the same key must be byte-identical to the original (such
    /// downstreams compare, and reject a reused key with a changed body), even when the
    /// retry differs in `ignore_json` fields. Never logged; deleted with the record.
    #[serde(default, with = "opt_b64", skip_serializing_if = "Option::is_none")]
    pub sent_body: Option<Vec<u8>>,
    /// How long ago the last send began, by a shared store's clock (PostgreSQL's), as of
    /// the moment this copy was read. Not stored in the record: the store fills it in on
    /// every read, so instances whose clocks disagree still agree on a settle window.
    /// `None` (redb, or a row from before the store kept it): use the record's timestamps.
    #[serde(skip)]
    pub send_age: ReadAge,
}

/// [`Record::send_age`]: a measurement taken by a read, not part of the record's value, so
/// two copies of one record compare equal whatever their reads measured.
#[derive(Clone, Copy, Debug, Default)]
pub struct ReadAge(pub Option<SendAge>);

impl PartialEq for ReadAge {
    fn eq(&self, _: &ReadAge) -> bool {
        true
    }
}

/// The age of a record's last send on the store's clock, when it was read: together with
/// this process's monotonic clock, an age that no wall-clock skew between instances moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendAge {
    /// Milliseconds between the last move to `executing` and the read, on the store's clock.
    pub age_ms: i64,
    /// When the read happened, on this process's monotonic clock.
    pub read_at: std::time::Instant,
}

impl SendAge {
    /// The age now.
    pub fn now_ms(&self) -> i64 {
        let since = i64::try_from(self.read_at.elapsed().as_millis()).unwrap_or(i64::MAX);
        self.age_ms.max(0).saturating_add(since)
    }
}

/// Everything needed to create a record; the store assigns nothing but the version.
pub struct NewRecord {
    pub id: ExecutionId,
    pub tenant: TenantScope,
    pub upstream: String,
    pub route: String,
    pub tool_version: String,
    pub operation_id: Option<String>,
    pub args_hash: ArgsHash,
    pub method: String,
    pub path: String,
    pub query: Option<String>,
    pub path_params: Vec<(String, String)>,
    pub preview: Option<serde_json::Value>,
    pub now_ms: i64,
    pub expires_at_ms: i64,
}

impl Record {
    /// A fresh record in `prepared`.
    pub fn new(n: NewRecord) -> Record {
        Record {
            id: n.id,
            version: 0,
            state: State::Prepared,
            tenant: n.tenant,
            upstream: n.upstream,
            route: n.route,
            tool_version: n.tool_version,
            operation_id: n.operation_id,
            model_round: None,
            tool_call_id: None,
            key: None,
            args_hash: n.args_hash,
            method: n.method,
            path: n.path,
            query: n.query,
            path_params: n.path_params,
            preview: n.preview,
            approval: None,
            lease: None,
            attempts: 0,
            created_at_ms: n.now_ms,
            updated_at_ms: n.now_ms,
            started_at_ms: None,
            committed_at_ms: None,
            delivered_at_ms: None,
            expires_at_ms: n.expires_at_ms,
            external_id: None,
            external_indexed: false,
            response: None,
            note: None,
            history: Vec::new(),
            events: Vec::new(),
            job: None,
            batch: None,
            item_of: None,
            sent_body: None,
            send_age: ReadAge(None),
        }
    }

    pub fn state(&self) -> State {
        self.state
    }

    /// The only writer of `state`: validates the move, then updates the bookkeeping that
    /// belongs to it (timestamps, attempts, lease, history).
    pub fn apply(
        &mut self,
        event: Event,
        now_ms: i64,
        note: Option<String>,
    ) -> Result<(), IllegalTransition> {
        let from = self.state;
        let to = transition(from, event)?;
        self.state = to;
        self.updated_at_ms = now_ms;
        match to {
            State::Executing => {
                self.attempts += 1;
                self.started_at_ms.get_or_insert(now_ms);
            }
            State::Committed => {
                self.committed_at_ms = Some(now_ms);
            }
            State::ResultDelivered => {
                self.delivered_at_ms.get_or_insert(now_ms);
            }
            _ => {}
        }
        if to != State::Executing {
            self.lease = None;
        }
        if to == State::AwaitingApproval {
            // Waiting for a decision means no decision covers the call (a lapsed one stays
            // in the history).
            self.approval = None;
        }
        self.note = note.clone();
        self.history.push(HistoryEntry {
            at_ms: now_ms,
            from,
            event,
            to,
            note,
        });
        Ok(())
    }

    /// Serialized form used by every store (JSON: readable with standard tools).
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a record always serializes: all fields are plain data")
    }

    pub fn from_bytes(id: &str, bytes: &[u8]) -> Result<Record, super::StoreError> {
        serde_json::from_slice(bytes).map_err(|e| super::StoreError::Corrupt {
            id: id.to_string(),
            reason: e.to_string(),
        })
    }
}

mod b64 {
    use super::*;
    pub fn serialize<S: serde::Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(v))
    }
    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = String::deserialize(d)?;
        base64::engine::general_purpose::STANDARD
            .decode(s)
            .map_err(serde::de::Error::custom)
    }
}

mod opt_b64 {
    use super::*;
    pub fn serialize<S: serde::Serializer>(v: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(b) => s.serialize_some(&base64::engine::general_purpose::STANDARD.encode(b)),
            None => s.serialize_none(),
        }
    }
    pub fn deserialize<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Vec<u8>>, D::Error> {
        match Option::<String>::deserialize(d)? {
            Some(t) => base64::engine::general_purpose::STANDARD
                .decode(t)
                .map(Some)
                .map_err(serde::de::Error::custom),
            None => Ok(None),
        }
    }
}

/// Header values are bytes; store them as text when they are, base64 otherwise.
mod header_list {
    use super::*;

    #[derive(Serialize, Deserialize)]
    struct H {
        n: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        v: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        b: Option<String>,
    }

    pub fn serialize<S: serde::Serializer>(
        v: &[(String, Vec<u8>)],
        s: S,
    ) -> Result<S::Ok, S::Error> {
        let list: Vec<H> = v
            .iter()
            .map(|(n, val)| match std::str::from_utf8(val) {
                Ok(t) => H {
                    n: n.clone(),
                    v: Some(t.to_string()),
                    b: None,
                },
                Err(_) => H {
                    n: n.clone(),
                    v: None,
                    b: Some(base64::engine::general_purpose::STANDARD.encode(val)),
                },
            })
            .collect();
        list.serialize(s)
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<Vec<(String, Vec<u8>)>, D::Error> {
        let list = Vec::<H>::deserialize(d)?;
        list.into_iter()
            .map(|h| match (h.v, h.b) {
                (Some(t), _) => Ok((h.n, t.into_bytes())),
                (None, Some(b)) => base64::engine::general_purpose::STANDARD
                    .decode(b)
                    .map(|v| (h.n, v))
                    .map_err(serde::de::Error::custom),
                (None, None) => Ok((h.n, Vec::new())),
            })
            .collect()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A `prepared` record for tests elsewhere in the crate too.
    pub(crate) fn sample() -> Record {
        Record::new(NewRecord {
            id: ExecutionId("ex_test".into()),
            tenant: TenantScope("t".into()),
            upstream: "mail".into(),
            route: "send_email".into(),
            tool_version: "v1".into(),
            operation_id: Some("op_1".into()),
            args_hash: ArgsHash("ab".into()),
            method: "POST".into(),
            path: "/send".into(),
            query: None,
            path_params: vec![],
            preview: None,
            now_ms: 1,
            expires_at_ms: 100,
        })
    }

    #[test]
    fn apply_tracks_attempts_and_refuses_illegal_moves() {
        let mut r = sample();
        r.apply(Event::Start, 2, None)
            .expect("prepared -> executing");
        assert_eq!(r.attempts, 1);
        r.apply(Event::Commit, 3, None)
            .expect("executing -> committed");
        let err = r.apply(Event::FailBeforeCommit, 4, None).unwrap_err();
        assert_eq!(err.from, State::Committed);
        assert_eq!(r.state(), State::Committed, "state unchanged after refusal");
        assert_eq!(r.history.len(), 2);
    }

    /// A record stored before the correlation fields decodes with them absent.
    #[test]
    fn a_record_from_before_the_correlation_fields_decodes() {
        let mut v: serde_json::Value = serde_json::from_slice(&sample().to_bytes()).unwrap();
        let obj = v.as_object_mut().expect("an object");
        assert!(!obj.contains_key("key"), "absent fields are not written");
        obj.remove("model_round");
        let back =
            Record::from_bytes("ex_test", &serde_json::to_vec(&v).unwrap()).expect("decodes");
        assert_eq!(
            (back.model_round, back.tool_call_id, back.key),
            (None, None, None)
        );
        let mut r = sample();
        r.model_round = Some("round_3".into());
        r.tool_call_id = Some("call_1".into());
        r.key = Some("k".into());
        assert_eq!(
            Record::from_bytes("ex_test", &r.to_bytes()).expect("decodes"),
            r
        );
    }

    #[test]
    fn round_trips_binary_headers_and_body() {
        let mut r = sample();
        r.response = Some(StoredResponse {
            status: 201,
            headers: vec![
                ("x-a".into(), b"text".to_vec()),
                ("x-b".into(), vec![0xff, 0]),
            ],
            body: vec![0, 1, 2, 255],
        });
        r.sent_body = Some(vec![b'{', 0xfe, b'}']);
        let back = Record::from_bytes("ex_test", &r.to_bytes()).expect("decodes");
        assert_eq!(back, r);
    }
}
