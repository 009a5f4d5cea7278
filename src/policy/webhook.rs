//! Webhook policy (SPEC section 9.1): what a delivery's signature must be, which event it
//! is, and what it says about an earlier call. Pure functions of the request and the
//! route's [`WebhookSpec`]; the lifecycle that uses them is `proxy::webhook`.
//!
//! Signatures are checked with RustCrypto's `hmac` over `sha2` (the hash the fingerprint
//! already uses), and every comparison of a computed MAC with a presented one goes through
//! `Mac::verify_slice`, which compares in constant time (`subtle`).

use std::fmt;
use std::time::Duration;

use base64::Engine;
use hmac::{Hmac, Mac};
use http::{HeaderMap, HeaderName};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// A `class: webhook` route's `webhook:` block, validated.
#[derive(Clone, Debug)]
pub struct WebhookSpec {
    /// Where the event id (the delivery's idempotency key) is read.
    pub event_id: EventIdFrom,
    /// Checked before anything is stored or forwarded; `None`: deliveries are not verified.
    pub verify: Option<Verify>,
    /// Pointers whose value names an earlier call (by its `execution_id` or its stored
    /// `external_id`); the first that names a stored record wins.
    pub correlate: Vec<Correlate>,
    /// What an event says about the correlated call.
    pub outcome: Option<OutcomeSpec>,
    /// Keep the event's JSON body on the correlated record (default: id, type, time only).
    pub store_body: bool,
}

/// One `correlate` entry: a pointer into the event and what its value names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Correlate {
    pub json: String,
    pub to: CorrelateTo,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CorrelateTo {
    /// The key the proxy injected downstream (Stripe echoes it as `request.idempotency_key`).
    ExecutionId,
    /// The record's stored `external_id` (the downstream's own id, or the job's id). When
    /// several records hold the value the event is ambiguous for this pointer and names
    /// none of them (see [`pick_external`]).
    ExternalId,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventIdFrom {
    Header(HeaderName),
    /// A JSON pointer into the body (Stripe: `/id`).
    Json(String),
}

/// How deliveries are signed, with the secret read from the environment at load.
#[derive(Clone)]
pub struct Verify {
    pub scheme: Scheme,
    /// The key; `Err`: why there is none (the variable was unset when the config was
    /// loaded): every delivery is then refused, never let through unverified.
    pub secret: Result<Vec<u8>, String>,
    /// How far the signed timestamp may be from this instance's clock, both directions
    /// (not used by `hmac_sha256`, which signs no timestamp).
    pub tolerance: Duration,
}

impl fmt::Debug for Verify {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Verify")
            .field("scheme", &self.scheme)
            .field("secret", &"<redacted>")
            .field("tolerance", &self.tolerance)
            .finish()
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scheme {
    /// Standard Webhooks: `webhook-id`, `webhook-timestamp`, `webhook-signature: v1,<b64> ...`
    /// over `{id}.{timestamp}.{body}`; the secret is `whsec_` + base64 (decoded at load).
    StandardWebhooks,
    /// Stripe: `Stripe-Signature: t=<ts>,v1=<hex>[,v1=...]` over `{t}.{body}`, raw secret.
    Stripe,
    /// HMAC-SHA256 of the raw body in one header, e.g. GitHub's `X-Hub-Signature-256: sha256=<hex>`.
    HmacSha256 {
        header: HeaderName,
        encoding: Encoding,
        prefix: String,
    },
}

impl Scheme {
    pub fn as_str(&self) -> &'static str {
        match self {
            Scheme::StandardWebhooks => "standard_webhooks",
            Scheme::Stripe => "stripe",
            Scheme::HmacSha256 { .. } => "hmac_sha256",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encoding {
    Hex,
    Base64,
}

#[derive(Clone, Debug)]
pub struct OutcomeSpec {
    /// Pointer to the event's type (default `/type`).
    pub status: String,
    pub succeeded: Vec<String>,
    pub failed: Vec<String>,
}

/// What an event says about the call it names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Succeeded,
    Failed,
    /// Neither list names the type (or no `outcome` is configured): history only.
    Other,
}

/// The secret of a scheme from the value of its `secret_env` variable.
pub fn secret(scheme: &Scheme, value: &str) -> Result<Vec<u8>, String> {
    match scheme {
        Scheme::StandardWebhooks => {
            // Padded or not, as the reference library reads it.
            let b64 = value.strip_prefix("whsec_").unwrap_or(value);
            base64::engine::general_purpose::STANDARD_NO_PAD
                .decode(b64.trim().trim_end_matches('='))
                .map_err(|e| format!("a Standard Webhooks secret is `whsec_` + base64 ({e})"))
        }
        Scheme::Stripe | Scheme::HmacSha256 { .. } => Ok(value.as_bytes().to_vec()),
    }
}

/// Why a delivery's signature was refused (said in the 401; never names the secret).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("the {0} header is missing")]
    Missing(&'static str),
    #[error("the {0} header is malformed")]
    Malformed(&'static str),
    #[error("the signed timestamp is {0}s away from this proxy's clock (tolerance {1}s)")]
    Stale(i64, u64),
    #[error("no signature matches the body")]
    Mismatch,
    #[error("this proxy has no secret for the route (its secret_env was not set when the config was loaded)")]
    NoSecret,
}

/// Check a delivery's signature against the raw body, at `now_s` (Unix seconds).
pub fn verify(
    v: &Verify,
    headers: &HeaderMap,
    body: &[u8],
    now_s: i64,
) -> Result<(), SignatureError> {
    let secret = v.secret.as_deref().map_err(|_| SignatureError::NoSecret)?;
    match &v.scheme {
        Scheme::StandardWebhooks => {
            let id = text(headers, "webhook-id")?;
            let ts = text(headers, "webhook-timestamp")?;
            let t: i64 = ts
                .parse()
                .map_err(|_| SignatureError::Malformed("webhook-timestamp"))?;
            fresh(t, now_s, v.tolerance)?;
            let sigs = text(headers, "webhook-signature")?;
            let mac = keyed(secret, &[id.as_bytes(), b".", ts.as_bytes(), b".", body]);
            // Space-separated `version,signature` pairs: any `v1` one may match.
            let matched = sigs
                .split(' ')
                .filter_map(|s| s.split_once(','))
                .filter(|(ver, _)| *ver == "v1")
                .filter_map(|(_, sig)| base64::engine::general_purpose::STANDARD.decode(sig).ok())
                .any(|sig| mac.clone().verify_slice(&sig).is_ok());
            matched.then_some(()).ok_or(SignatureError::Mismatch)
        }
        Scheme::Stripe => {
            let header = text(headers, "stripe-signature")?;
            let mut t = None;
            let mut v1 = Vec::new();
            for item in header.split(',') {
                match item.trim().split_once('=') {
                    Some(("t", value)) => t = Some(value),
                    Some(("v1", value)) => v1.push(value),
                    _ => {}
                }
            }
            let ts = t.ok_or(SignatureError::Malformed("Stripe-Signature"))?;
            let when: i64 = ts
                .parse()
                .map_err(|_| SignatureError::Malformed("Stripe-Signature"))?;
            if v1.is_empty() {
                return Err(SignatureError::Malformed("Stripe-Signature"));
            }
            fresh(when, now_s, v.tolerance)?;
            let mac = keyed(secret, &[ts.as_bytes(), b".", body]);
            let matched = v1
                .iter()
                .filter_map(|sig| hex::decode(sig).ok())
                .any(|sig| mac.clone().verify_slice(&sig).is_ok());
            matched.then_some(()).ok_or(SignatureError::Mismatch)
        }
        Scheme::HmacSha256 {
            header,
            encoding,
            prefix,
        } => {
            let value = headers
                .get(header)
                .ok_or(SignatureError::Missing("signature"))?
                .to_str()
                .map_err(|_| SignatureError::Malformed("signature"))?;
            let sig = value
                .strip_prefix(prefix.as_str())
                .ok_or(SignatureError::Malformed("signature"))?;
            let sig = match encoding {
                Encoding::Hex => hex::decode(sig.trim()).ok(),
                Encoding::Base64 => base64::engine::general_purpose::STANDARD
                    .decode(sig.trim())
                    .ok(),
            }
            .ok_or(SignatureError::Malformed("signature"))?;
            keyed(secret, &[body])
                .verify_slice(&sig)
                .map_err(|_| SignatureError::Mismatch)
        }
    }
}

fn text<'a>(headers: &'a HeaderMap, name: &'static str) -> Result<&'a str, SignatureError> {
    headers
        .get(name)
        .ok_or(SignatureError::Missing(name))?
        .to_str()
        .map_err(|_| SignatureError::Malformed(name))
}

fn fresh(t: i64, now_s: i64, tolerance: Duration) -> Result<(), SignatureError> {
    let off = now_s.saturating_sub(t);
    if off.unsigned_abs() > tolerance.as_secs() {
        return Err(SignatureError::Stale(off, tolerance.as_secs()));
    }
    Ok(())
}

/// A Standard Webhooks `webhook-signature` value for a message the proxy sends itself
/// (`admin::notify`): `v1,` + base64 of HMAC-SHA256 over `{id}.{timestamp}.{body}`, the
/// same MAC [`verify`] checks on deliveries it receives.
pub fn standard_signature(secret: &[u8], id: &str, timestamp: u64, body: &[u8]) -> String {
    let ts = timestamp.to_string();
    let mac = keyed(secret, &[id.as_bytes(), b".", ts.as_bytes(), b".", body]);
    format!(
        "v1,{}",
        base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
    )
}

fn keyed(secret: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC takes a key of any length");
    for p in parts {
        mac.update(p);
    }
    mac
}

/// The delivery's event id, from its header or its JSON body (`json`: the parsed body).
pub fn event_id(
    from: &EventIdFrom,
    headers: &HeaderMap,
    json: Option<&serde_json::Value>,
) -> Result<String, String> {
    match from {
        EventIdFrom::Header(name) => match headers.get(name).map(|v| v.to_str()) {
            Some(Ok(v)) if !v.trim().is_empty() => Ok(v.trim().to_string()),
            Some(_) => Err(format!(
                "the event id header {name} is not a readable value"
            )),
            None => Err(format!("the event id header {name} is missing")),
        },
        EventIdFrom::Json(pointer) => match json.and_then(|j| j.pointer(pointer)) {
            Some(serde_json::Value::String(s)) if !s.is_empty() => Ok(s.clone()),
            Some(serde_json::Value::Number(n)) => Ok(n.to_string()),
            _ => Err(format!(
                "the event has no string or number at {pointer} to take as its id"
            )),
        },
    }
}

/// The values the `correlate` pointers find in the event, in the configured order, with
/// what each names. Numbers are taken as their digits (numeric downstream ids).
pub fn correlated(spec: &WebhookSpec, json: &serde_json::Value) -> Vec<(String, CorrelateTo)> {
    spec.correlate
        .iter()
        .filter_map(|c| {
            let v = match json.pointer(&c.json)? {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Number(n) if c.to == CorrelateTo::ExternalId => n.to_string(),
                _ => return None,
            };
            (!v.is_empty() && v.len() <= 255).then_some((v, c.to))
        })
        .collect()
}

/// Of the records whose `external_id` is the event's value, the one the event names: the
/// only one. Several records holding one external id (a downstream that returns the same
/// object id from two calls, or two upstreams whose ids collide) make the value ambiguous:
/// settling or ending a job on a guess could mark the wrong call, so none is named and the
/// next `correlate` pointer is tried (the event is still forwarded and deduplicated).
pub fn pick_external<T>(mut found: Vec<T>) -> Result<Option<T>, usize> {
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop()),
        n => Err(n),
    }
}

/// A record that would become `outcome_unknown` (`LoseOutcome` applied) and holds a
/// `succeeded` event that arrived while it was executing is settled by that event at once
/// (SPEC section 9.1): `SettleByWebhook`, through the one transition function, with the
/// event's evidence as the stored answer. Returns whether it settled.
pub fn settle_held(r: &mut crate::store::Record, now_ms: i64) -> bool {
    use crate::policy::state::{Event, State};
    if r.state() != State::OutcomeUnknown {
        return false;
    }
    let Some((event_id, route, evidence)) = r
        .events
        .iter()
        .find_map(|e| Some((e.id.clone(), e.route.clone(), e.held.clone()?)))
    else {
        return false;
    };
    let note = format!(
        "settled by webhook event {event_id} on {route}, which arrived while the call was executing"
    );
    if r.apply(Event::SettleByWebhook, now_ms, Some(note)).is_err() {
        return false;
    }
    r.response = Some(evidence_answer(&evidence, &event_id));
    true
}

/// The stored answer of a call settled by an event: `200` JSON, the event's `data.object`
/// (else the event) as `evidence`, marked `Idempotency-Reconciled: webhook` and naming the
/// event.
pub fn evidence_answer(
    evidence: &serde_json::Value,
    event_id: &str,
) -> crate::store::StoredResponse {
    crate::store::StoredResponse {
        status: 200,
        headers: vec![
            ("content-type".into(), b"application/json".to_vec()),
            (
                crate::wire::headers::RECONCILED.as_str().into(),
                b"webhook".to_vec(),
            ),
            (
                "idempotency-webhook-event".into(),
                event_id.as_bytes().to_vec(),
            ),
        ],
        body: serde_json::to_vec(evidence).expect("a JSON value serializes"),
    }
}

/// The event's type and what it says about the correlated call.
pub fn verdict(spec: &WebhookSpec, json: &serde_json::Value) -> (Option<String>, Verdict) {
    let pointer = spec.outcome.as_ref().map_or("/type", |o| o.status.as_str());
    let kind = json
        .pointer(pointer)
        .and_then(|v| v.as_str())
        .map(str::to_string);
    let verdict = match (&spec.outcome, &kind) {
        (Some(o), Some(k)) if o.succeeded.iter().any(|s| s == k) => Verdict::Succeeded,
        (Some(o), Some(k)) if o.failed.iter().any(|s| s == k) => Verdict::Failed,
        _ => Verdict::Other,
    };
    (kind, verdict)
}

/// The answer a retry of a call settled by a webhook gets: the event's `data.object` when
/// it has one, else the whole event, as JSON.
pub fn evidence_body(json: &serde_json::Value) -> Vec<u8> {
    serde_json::to_vec(evidence_of(json)).expect("a JSON value serializes")
}

/// [`evidence_body`] as a value (a job's result).
pub fn evidence_value(json: &serde_json::Value) -> serde_json::Value {
    evidence_of(json).clone()
}

fn evidence_of(json: &serde_json::Value) -> &serde_json::Value {
    json.pointer("/data/object").unwrap_or(json)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sign(secret: &[u8], parts: &[&[u8]]) -> Vec<u8> {
        keyed(secret, parts).finalize().into_bytes().to_vec()
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(*n, v.parse().unwrap());
        }
        h
    }

    fn standard() -> Verify {
        let secret = secret(
            &Scheme::StandardWebhooks,
            "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        );
        Verify {
            scheme: Scheme::StandardWebhooks,
            secret,
            tolerance: Duration::from_secs(300),
        }
    }

    #[test]
    fn standard_webhooks_accepts_any_matching_v1_and_refuses_the_rest() {
        let v = standard();
        let body = br#"{"test": 2432232314}"#;
        let sig = base64::engine::general_purpose::STANDARD.encode(sign(
            v.secret.as_deref().unwrap(),
            &[
                b"msg_p5jXN8AQM9LWM0D4loKWxJek",
                b".",
                b"1614265330",
                b".",
                body,
            ],
        ));
        // The Standard Webhooks spec's own example signature for this secret and payload.
        assert_eq!(sig, "g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
        let good = format!("v1,bad v2,{sig} v1,{sig}");
        let h = headers(&[
            ("webhook-id", "msg_p5jXN8AQM9LWM0D4loKWxJek"),
            ("webhook-timestamp", "1614265330"),
            ("webhook-signature", &good),
        ]);
        assert_eq!(verify(&v, &h, body, 1614265330 + 299), Ok(()));
        assert_eq!(
            verify(&v, &h, body, 1614265330 + 301),
            Err(SignatureError::Stale(301, 300))
        );
        assert_eq!(
            verify(&v, &h, body, 1614265330 - 301),
            Err(SignatureError::Stale(-301, 300))
        );
        assert_eq!(
            verify(&v, &h, b"{\"test\": 2432232315}", 1614265330),
            Err(SignatureError::Mismatch)
        );
        let only_v2 = headers(&[
            ("webhook-id", "msg_p5jXN8AQM9LWM0D4loKWxJek"),
            ("webhook-timestamp", "1614265330"),
            ("webhook-signature", &format!("v2,{sig}")),
        ]);
        assert_eq!(
            verify(&v, &only_v2, body, 1614265330),
            Err(SignatureError::Mismatch)
        );
        let h = headers(&[("webhook-id", "x"), ("webhook-timestamp", "1")]);
        assert_eq!(
            verify(&v, &h, body, 1),
            Err(SignatureError::Missing("webhook-signature"))
        );
    }

    #[test]
    fn stripe_signs_the_timestamp_and_body_in_hex() {
        let v = Verify {
            scheme: Scheme::Stripe,
            secret: Ok(b"whsec_test".to_vec()),
            tolerance: Duration::from_secs(300),
        };
        let body = br#"{"id":"evt_1"}"#;
        let sig = hex::encode(sign(b"whsec_test", &[b"1700000000", b".", body]));
        let h = headers(&[(
            "stripe-signature",
            &format!("t=1700000000,v1=00ff,v1={sig},v0=abc"),
        )]);
        assert_eq!(verify(&v, &h, body, 1700000010), Ok(()));
        assert_eq!(
            verify(&v, &h, b"{}", 1700000010),
            Err(SignatureError::Mismatch)
        );
        assert!(matches!(
            verify(&v, &h, body, 1700000400),
            Err(SignatureError::Stale(400, 300))
        ));
        let h = headers(&[("stripe-signature", "v1=00")]);
        assert_eq!(
            verify(&v, &h, body, 0),
            Err(SignatureError::Malformed("Stripe-Signature"))
        );
    }

    #[test]
    fn plain_hmac_reads_its_header_with_a_prefix() {
        let v = Verify {
            scheme: Scheme::HmacSha256 {
                header: HeaderName::from_static("x-hub-signature-256"),
                encoding: Encoding::Hex,
                prefix: "sha256=".into(),
            },
            secret: Ok(b"It's a Secret to Everybody".to_vec()),
            tolerance: Duration::from_secs(300),
        };
        // GitHub's documented example.
        let h = headers(&[(
            "x-hub-signature-256",
            "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17",
        )]);
        assert_eq!(verify(&v, &h, b"Hello, World!", 0), Ok(()));
        assert_eq!(
            verify(&v, &h, b"Hello, World?", 0),
            Err(SignatureError::Mismatch)
        );
        let h = headers(&[("x-hub-signature-256", "757107ea")]);
        assert_eq!(
            verify(&v, &h, b"Hello, World!", 0),
            Err(SignatureError::Malformed("signature"))
        );
        let unset = Verify {
            secret: Err("HOOK_SECRET is not set".into()),
            ..v
        };
        let h = headers(&[(
            "x-hub-signature-256",
            "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17",
        )]);
        assert_eq!(
            verify(&unset, &h, b"Hello, World!", 0),
            Err(SignatureError::NoSecret)
        );
    }

    #[test]
    fn a_held_succeeded_event_settles_a_call_that_would_become_unknown() {
        use crate::policy::state::{Event, State};
        use crate::store::record::WebhookEvent;
        let event = |held: Option<serde_json::Value>| WebhookEvent {
            id: "evt_1".into(),
            route: "stripe/events".into(),
            kind: Some("payment_intent.succeeded".into()),
            at_ms: 3,
            verdict: "succeeded".into(),
            body: None,
            held,
        };
        let mut r = crate::store::record::tests::sample();
        r.apply(Event::Start, 2, None).expect("start");
        // Only an event held while executing settles, and only an unknown outcome.
        r.events.push(event(None));
        r.apply(Event::LoseOutcome, 4, None).expect("lose");
        assert!(!settle_held(&mut r, 5));
        assert_eq!(r.state(), State::OutcomeUnknown);
        r.events
            .push(event(Some(serde_json::json!({"id": "pi_1"}))));
        assert!(settle_held(&mut r, 5));
        assert_eq!(r.state(), State::Committed);
        let answer = r.response.as_ref().expect("the evidence is the answer");
        assert_eq!(answer.status, 200);
        assert_eq!(answer.body, br#"{"id":"pi_1"}"#.to_vec());
        assert!(answer
            .headers
            .iter()
            .any(|(n, v)| n == "idempotency-reconciled" && v == b"webhook"));
        let events: Vec<_> = r.history.iter().map(|h| h.event).collect();
        assert_eq!(
            events,
            [Event::Start, Event::LoseOutcome, Event::SettleByWebhook]
        );
        // A committed call is left as it is.
        assert!(!settle_held(&mut r, 6));
    }

    #[test]
    fn event_ids_verdicts_and_evidence() {
        let spec = WebhookSpec {
            event_id: EventIdFrom::Json("/id".into()),
            verify: None,
            correlate: vec![
                Correlate {
                    json: "/data/object/metadata/execution_id".into(),
                    to: CorrelateTo::ExecutionId,
                },
                Correlate {
                    json: "/request/idempotency_key".into(),
                    to: CorrelateTo::ExecutionId,
                },
                Correlate {
                    json: "/data/object/amount".into(),
                    to: CorrelateTo::ExternalId,
                },
            ],
            outcome: Some(OutcomeSpec {
                status: "/type".into(),
                succeeded: vec!["payment_intent.succeeded".into()],
                failed: vec!["payment_intent.payment_failed".into()],
            }),
            store_body: false,
        };
        let ev = serde_json::json!({
            "id": "evt_1", "type": "payment_intent.succeeded",
            "data": { "object": { "id": "pi_1", "amount": 100 } },
            "request": { "idempotency_key": "exec_abc" }
        });
        assert_eq!(
            event_id(&spec.event_id, &HeaderMap::new(), Some(&ev)),
            Ok("evt_1".into())
        );
        assert!(event_id(&spec.event_id, &HeaderMap::new(), None).is_err());
        assert_eq!(
            correlated(&spec, &ev),
            vec![
                ("exec_abc".to_string(), CorrelateTo::ExecutionId),
                ("100".to_string(), CorrelateTo::ExternalId)
            ]
        );
        assert_eq!(pick_external(Vec::<u8>::new()), Ok(None));
        assert_eq!(pick_external(vec![1]), Ok(Some(1)));
        assert_eq!(pick_external(vec![1, 2]), Err(2));
        assert_eq!(
            verdict(&spec, &ev),
            (Some("payment_intent.succeeded".into()), Verdict::Succeeded)
        );
        assert_eq!(
            evidence_body(&ev),
            br#"{"amount":100,"id":"pi_1"}"#.to_vec()
        );
        let h = headers(&[("webhook-id", " msg_1 ")]);
        let from = EventIdFrom::Header(HeaderName::from_static("webhook-id"));
        assert_eq!(event_id(&from, &h, None), Ok("msg_1".into()));
    }
}
