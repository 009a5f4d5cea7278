//! Reconciliation policy for `outcome_unknown` records (SPEC section 7), without I/O:
//! which way of finding out applies to a route ([`plan`]), the lookup request
//! ([`render`]), what a lookup answer means ([`judge`]), and when a "not found" can be
//! trusted ([`settled`]). The requests themselves are sent by `crate::proxy::reconcile`.
//!
//! Preference order: a downstream that replays keyed requests is simply asked again under
//! the same key; else a configured lookup is queried; else the record waits for an
//! operator. A lookup proves a commit when it finds one, but "not found" only proves
//! anything once the original request can no longer be in progress downstream, hence the
//! `settle` window measured from the last send.

use std::time::Duration;

use serde_json::Value;

use crate::config::{Matcher, ReconcileSpec, Route};
use crate::policy::state::State;
use crate::store::{Record, StoredResponse};

/// How an `outcome_unknown` record of this route can be resolved.
#[derive(Debug, Clone, Copy)]
pub enum Plan<'a> {
    /// The downstream dedups keyed requests and replays the original answer: re-send the
    /// original request under the same injected key and take the answer.
    Resend,
    /// Query the configured lookup.
    Lookup(&'a ReconcileSpec),
    /// Nothing can tell: the record stays `outcome_unknown` until an operator resolves it.
    Operator,
}

impl Plan<'_> {
    /// Label for `idemproxy_reconciliations_total{result}` and logs.
    pub fn name(&self) -> &'static str {
        match self {
            Plan::Resend => "resend",
            Plan::Lookup(_) => "lookup",
            Plan::Operator => "operator",
        }
    }
}

/// SPEC section 7's preference order for one route.
pub fn plan(route: &Route) -> Plan<'_> {
    if route.downstream_key.as_ref().is_some_and(|k| k.replays) {
        Plan::Resend
    } else if let Some(spec) = &route.reconcile {
        Plan::Lookup(spec)
    } else {
        Plan::Operator
    }
}

/// What a lookup answer says about the original request.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// The effect happened; `result` is what was found, to be stored as the record's result.
    Found {
        result: StoredResponse,
        external_id: Option<String>,
        /// How many items the found pointer held (more than one means the downstream has
        /// several effects with this tag: worth an operator's look, but committed all the same).
        matches: usize,
    },
    /// The effect did not happen (subject to [`settled`]).
    NotFound,
    /// The answer proves neither: the record stays `outcome_unknown`.
    Unknown(String),
}

impl Verdict {
    pub fn name(&self) -> &'static str {
        match self {
            Verdict::Found { .. } => "found",
            Verdict::NotFound => "not_found",
            Verdict::Unknown(_) => "unknown",
        }
    }
}

/// A template that cannot be rendered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    #[error("unclosed `{{` at byte {0}")]
    Unclosed(usize),
    #[error("empty placeholder `{{}}` at byte {0}")]
    Empty(usize),
    #[error("unknown placeholder `{{{0}}}`")]
    Unknown(String),
}

/// Placeholder names in a lookup template, in order (`{execution_id}`, `{key}`, path
/// parameters). `}` outside a placeholder is literal.
pub fn placeholders(template: &str) -> Result<Vec<&str>, TemplateError> {
    let mut names = Vec::new();
    let mut rest = template;
    let mut offset = 0;
    while let Some(open) = rest.find('{') {
        let after = &rest[open + 1..];
        let Some(close) = after.find('}') else {
            return Err(TemplateError::Unclosed(offset + open));
        };
        let name = &after[..close];
        if name.is_empty() {
            return Err(TemplateError::Empty(offset + open));
        }
        if name.contains('{') {
            return Err(TemplateError::Unclosed(offset + open));
        }
        names.push(name);
        let consumed = open + 1 + close + 1;
        offset += consumed;
        rest = &rest[consumed..];
    }
    Ok(names)
}

/// Names a template may use on a route whose path template is `route_path`.
pub fn check_template(template: &str, route_path: &str) -> Result<(), TemplateError> {
    let params = placeholders(route_path).unwrap_or_default();
    for name in placeholders(template)? {
        let param = |p: &&str| p.trim_start_matches('*') == name;
        if name != "execution_id" && name != "key" && !params.iter().any(param) {
            return Err(TemplateError::Unknown(name.to_string()));
        }
    }
    Ok(())
}

/// The lookup's path and query (relative to the upstream) for `record`: `{execution_id}`
/// and `{key}` are the execution id (which is also the injected downstream key's value),
/// other names are the route's path parameters. Values are percent-encoded, so nothing a
/// client put in a path can add query parameters or path segments to the lookup.
pub fn render(template: &str, record: &Record) -> Result<String, TemplateError> {
    let mut out = String::with_capacity(template.len() + 32);
    let mut rest = template;
    // Validates the whole template first, so a bad one never yields a partial path.
    placeholders(template)?;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        let close = after
            .find('}')
            .expect("placeholders() accepted the template");
        let name = &after[..close];
        let value = match name {
            "execution_id" | "key" => record.id.as_str().to_string(),
            _ => record
                .path_params
                .iter()
                .find(|(k, _)| k == name || k.trim_start_matches('*') == name)
                .map(|(_, v)| percent_decode(v))
                .ok_or_else(|| TemplateError::Unknown(name.to_string()))?,
        };
        out.push_str(&percent_encode(&value));
        rest = &after[close + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Percent-encode everything but RFC 3986 unreserved characters.
pub fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Decode `%XX` (path parameters arrive as raw URL text); invalid escapes stay literal.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok());
            if let Some(b) = hex {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Is a JSON value "non-empty"? Arrays, objects and strings by length; `null` is empty;
/// numbers and booleans are values, hence non-empty.
fn is_nonempty(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
        Value::String(s) => !s.is_empty(),
        Value::Bool(_) | Value::Number(_) => true,
    }
}

/// Does one matcher accept the answer? Every condition it sets must hold. A pointer that
/// is absent satisfies neither `json_nonempty` nor `json_empty`: an error body without the
/// list must not read as "nothing found".
pub fn matches(m: &Matcher, status: u16, json: Option<&Value>) -> bool {
    if m.status.is_some_and(|s| s != status) {
        return false;
    }
    if let Some(p) = &m.json_nonempty {
        match json.and_then(|j| j.pointer(p)) {
            Some(v) if is_nonempty(v) => {}
            _ => return false,
        }
    }
    if let Some(p) = &m.json_empty {
        match json.and_then(|j| j.pointer(p)) {
            Some(v) if !is_nonempty(v) => {}
            _ => return false,
        }
    }
    // A matcher without any condition would accept everything; config refuses it, and
    // here it accepts nothing rather than everything.
    m.status.is_some() || m.json_nonempty.is_some() || m.json_empty.is_some()
}

/// Judge a lookup answer. `route_external_id` is the route's pointer to the downstream id,
/// used when the spec has none of its own.
pub fn judge(
    spec: &ReconcileSpec,
    route_external_id: Option<&str>,
    status: u16,
    content_type: Option<&[u8]>,
    body: &[u8],
) -> Verdict {
    let json: Option<Value> = serde_json::from_slice(body).ok();
    let found = matches(&spec.found, status, json.as_ref());
    let not_found = matches(&spec.not_found, status, json.as_ref());
    match (found, not_found) {
        (true, true) => Verdict::Unknown(format!(
            "the lookup answer ({status}) matches both `found` and `not_found`"
        )),
        (false, false) => Verdict::Unknown(format!(
            "the lookup answer ({status}) matches neither `found` nor `not_found`"
        )),
        (false, true) => Verdict::NotFound,
        (true, false) => {
            // What was found: the first item of the found list, or the whole answer.
            let (item, matches) = match (&spec.found.json_nonempty, &json) {
                (Some(p), Some(j)) => match j.pointer(p) {
                    Some(Value::Array(items)) => (items.first().cloned(), items.len()),
                    Some(v) => (Some(v.clone()), 1),
                    None => (None, 1),
                },
                _ => (None, 1),
            };
            let (body, content_type) = match &item {
                Some(v) => (
                    serde_json::to_vec(v).expect("JSON values always serialize"),
                    b"application/json".to_vec(),
                ),
                None => (
                    body.to_vec(),
                    content_type
                        .map(<[u8]>::to_vec)
                        .unwrap_or_else(|| b"application/octet-stream".to_vec()),
                ),
            };
            let pointer = spec.external_id.as_deref().or(route_external_id);
            let external_id = pointer.and_then(|p| {
                item.as_ref()
                    .and_then(|v| id_at(v, p))
                    .or_else(|| json.as_ref().and_then(|v| id_at(v, p)))
            });
            Verdict::Found {
                result: StoredResponse {
                    status,
                    headers: vec![
                        ("content-type".into(), content_type),
                        (
                            crate::wire::headers::RECONCILED.as_str().into(),
                            b"lookup".to_vec(),
                        ),
                    ],
                    body,
                },
                external_id,
                matches,
            }
        }
    }
}

fn id_at(v: &Value, pointer: &str) -> Option<String> {
    match v.pointer(pointer)? {
        Value::String(s) if !s.is_empty() => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// When the record was last sent downstream (its last move to `executing`).
pub fn last_send_ms(record: &Record) -> i64 {
    record
        .history
        .iter()
        .rev()
        .find(|h| h.to == State::Executing)
        .map(|h| h.at_ms)
        .or(record.started_at_ms)
        .unwrap_or(record.updated_at_ms)
}

/// `Ok` when a "not found" can be trusted: the last send is older than `settle`, so the
/// original request can no longer be in progress downstream. Otherwise how long is left.
///
/// A shared store (PostgreSQL) measures the age of the last send on its own clock
/// ([`Record::send_age`](crate::store::Record)): instances whose wall clocks disagree then
/// still agree on the window. Only without it (redb: one process, one clock) is `now_ms`
/// compared with the record's timestamps.
pub fn settled(record: &Record, settle: Duration, now_ms: i64) -> Result<(), Duration> {
    let since = match record.send_age.0 {
        Some(age) => age.now_ms(),
        None => now_ms.saturating_sub(last_send_ms(record)).max(0),
    };
    let settle_ms = i64::try_from(settle.as_millis()).unwrap_or(i64::MAX);
    if since >= settle_ms {
        Ok(())
    } else {
        Err(Duration::from_millis(
            u64::try_from(settle_ms - since).unwrap_or(0),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DownstreamKey;
    use crate::policy::identity::{ArgsHash, ExecutionId, TenantScope};
    use crate::policy::state::Event;
    use crate::store::NewRecord;
    use serde_json::json;

    fn record(params: &[(&str, &str)]) -> Record {
        Record::new(NewRecord {
            id: ExecutionId("ex_AbC-9_z".into()),
            tenant: TenantScope("t".into()),
            upstream: "mail".into(),
            route: "send".into(),
            tool_version: "v1".into(),
            operation_id: None,
            args_hash: ArgsHash("00".into()),
            method: "POST".into(),
            path: "/send".into(),
            query: None,
            path_params: params
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            preview: None,
            now_ms: 1_000,
            expires_at_ms: 10_000,
        })
    }

    fn spec(found: Matcher, not_found: Matcher) -> ReconcileSpec {
        ReconcileSpec {
            method: http::Method::GET,
            path: "/messages?tag={key}".into(),
            headers: vec![],
            found,
            not_found,
            external_id: None,
            settle: Duration::from_secs(1),
        }
    }

    fn list_spec() -> ReconcileSpec {
        spec(
            Matcher {
                status: Some(200),
                json_nonempty: Some("/data".into()),
                json_empty: None,
            },
            Matcher {
                status: Some(200),
                json_nonempty: None,
                json_empty: Some("/data".into()),
            },
        )
    }

    /// A side-effect route as the config makes it, with the downstream key and the lookup
    /// under test.
    fn route(replays: Option<bool>, reconcile: Option<ReconcileSpec>) -> Route {
        let cfg = crate::config::from_yaml(
            "upstreams:\n  - name: mail\n    url: http://127.0.0.1:1\n    routes:\n      - { name: send, match: { method: POST, path: /send } }\n",
            std::path::Path::new("t.yaml"),
        )
        .expect("valid");
        let mut r = cfg.upstreams[0].routes[0].clone();
        r.downstream_key = replays.map(|replays| DownstreamKey {
            header: http::HeaderName::from_static("idempotency-key"),
            replays,
        });
        r.reconcile = reconcile;
        r
    }

    #[test]
    fn plan_follows_the_preference_order() {
        assert!(matches!(
            plan(&route(Some(true), Some(list_spec()))),
            Plan::Resend
        ));
        assert!(matches!(
            plan(&route(Some(false), Some(list_spec()))),
            Plan::Lookup(_)
        ));
        assert!(matches!(
            plan(&route(None, Some(list_spec()))),
            Plan::Lookup(_)
        ));
        assert!(matches!(plan(&route(Some(false), None)), Plan::Operator));
        assert!(matches!(plan(&route(None, None)), Plan::Operator));
    }

    #[test]
    fn templates_substitute_and_encode() {
        let r = record(&[("user", "a b&c=d"), ("rest", "x%2Fy/z")]);
        assert_eq!(
            render("/messages?tag={execution_id}", &r).unwrap(),
            "/messages?tag=ex_AbC-9_z"
        );
        assert_eq!(
            render("/u/{user}/m?k={key}&p={rest}", &r).unwrap(),
            "/u/a%20b%26c%3Dd/m?k=ex_AbC-9_z&p=x%2Fy%2Fz"
        );
        assert_eq!(render("/plain}", &r).unwrap(), "/plain}");
        assert_eq!(
            render("/u/{nope}", &r),
            Err(TemplateError::Unknown("nope".into()))
        );
        assert_eq!(render("/u/{user", &r), Err(TemplateError::Unclosed(3)));
        assert_eq!(render("/u/{}", &r), Err(TemplateError::Empty(3)));
    }

    #[test]
    fn templates_are_checked_against_the_route_path() {
        assert_eq!(placeholders("/a/{x}/b?{key}").unwrap(), vec!["x", "key"]);
        assert!(check_template("/m?tag={key}&e={execution_id}", "/send").is_ok());
        assert!(check_template("/m/{id}", "/orders/{id}/pay").is_ok());
        assert!(check_template("/m/{path}", "/files/{*path}").is_ok());
        assert_eq!(
            check_template("/m/{id}", "/send"),
            Err(TemplateError::Unknown("id".into()))
        );
        assert!(check_template("/m/{id", "/send").is_err());
    }

    #[test]
    fn percent_decoding_keeps_bad_escapes() {
        assert_eq!(percent_decode("a%20b"), "a b");
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%zz%4"), "%zz%4");
        assert_eq!(percent_decode("%41%"), "A%");
    }

    #[test]
    fn matchers_on_status_and_pointers() {
        let m = Matcher {
            status: Some(200),
            json_nonempty: Some("/data".into()),
            json_empty: None,
        };
        let full = json!({"data": [{"id": "msg_1"}]});
        assert!(matches(&m, 200, Some(&full)));
        assert!(!matches(&m, 201, Some(&full)), "status must match");
        assert!(!matches(&m, 200, Some(&json!({"data": []}))));
        assert!(!matches(&m, 200, Some(&json!({"other": [1]}))), "absent");
        assert!(!matches(&m, 200, None), "not JSON");
        for (v, nonempty) in [
            (json!({"d": {}}), false),
            (json!({"d": {"a": 1}}), true),
            (json!({"d": ""}), false),
            (json!({"d": "x"}), true),
            (json!({"d": null}), false),
            (json!({"d": 0}), true),
            (json!({"d": false}), true),
        ] {
            let ne = Matcher {
                json_nonempty: Some("/d".into()),
                ..Matcher::default()
            };
            let e = Matcher {
                json_empty: Some("/d".into()),
                ..Matcher::default()
            };
            assert_eq!(matches(&ne, 200, Some(&v)), nonempty, "{v}");
            assert_eq!(matches(&e, 200, Some(&v)), !nonempty, "{v}");
        }
        let status_only = Matcher {
            status: Some(404),
            ..Matcher::default()
        };
        assert!(matches(&status_only, 404, None));
        assert!(
            !matches(&Matcher::default(), 200, Some(&full)),
            "empty matcher"
        );
    }

    #[test]
    fn found_stores_the_found_item_and_its_id() {
        let body = br#"{"object":"list","data":[{"id":"msg_7","ok":true}]}"#;
        let v = judge(
            &list_spec(),
            Some("/id"),
            200,
            Some(b"application/json"),
            body,
        );
        let Verdict::Found {
            result,
            external_id,
            matches,
        } = v
        else {
            panic!("expected found, got {v:?}");
        };
        assert_eq!(external_id.as_deref(), Some("msg_7"));
        assert_eq!(matches, 1);
        assert_eq!(result.status, 200);
        let item: Value = serde_json::from_slice(&result.body).unwrap();
        assert_eq!(item, json!({"id":"msg_7","ok":true}));
        assert!(result
            .headers
            .iter()
            .any(|(n, v)| n == "content-type" && v == b"application/json"));
        assert!(result
            .headers
            .iter()
            .any(|(n, v)| n == crate::wire::headers::RECONCILED.as_str() && v == b"lookup"));
    }

    #[test]
    fn found_without_a_pointer_keeps_the_whole_answer() {
        let s = spec(
            Matcher {
                status: Some(200),
                ..Matcher::default()
            },
            Matcher {
                status: Some(404),
                ..Matcher::default()
            },
        );
        let body = br#"{"payment":{"ref":"p_1"}}"#;
        let mut s2 = s.clone();
        s2.external_id = Some("/payment/ref".into());
        match judge(&s2, Some("/id"), 200, Some(b"application/json"), body) {
            Verdict::Found {
                result,
                external_id,
                ..
            } => {
                assert_eq!(result.body, body.to_vec());
                assert_eq!(external_id.as_deref(), Some("p_1"));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(judge(&s, None, 404, None, b"nope"), Verdict::NotFound);
        assert!(matches!(
            judge(&s, None, 500, None, b""),
            Verdict::Unknown(_)
        ));
    }

    #[test]
    fn not_found_ambiguous_and_errors() {
        let s = list_spec();
        assert_eq!(
            judge(&s, None, 200, None, br#"{"data":[]}"#),
            Verdict::NotFound
        );
        assert!(matches!(
            judge(&s, None, 200, None, br#"{"error":"x"}"#),
            Verdict::Unknown(_)
        ));
        assert!(matches!(
            judge(&s, None, 503, None, br#"{"data":[]}"#),
            Verdict::Unknown(_)
        ));
        assert!(matches!(
            judge(&s, None, 200, None, b"<html>"),
            Verdict::Unknown(_)
        ));
        // Misconfiguration where both match: never guess.
        let both = spec(
            Matcher {
                status: Some(200),
                ..Matcher::default()
            },
            Matcher {
                status: Some(200),
                ..Matcher::default()
            },
        );
        assert!(matches!(
            judge(&both, None, 200, None, b"{}"),
            Verdict::Unknown(_)
        ));
        // Several effects with the tag: found (committed), and counted.
        match judge(
            &s,
            Some("/id"),
            200,
            None,
            br#"{"data":[{"id":"a"},{"id":"b"}]}"#,
        ) {
            Verdict::Found {
                matches,
                external_id,
                ..
            } => {
                assert_eq!(matches, 2);
                assert_eq!(external_id.as_deref(), Some("a"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn not_found_is_trusted_only_after_the_settle_window() {
        let mut r = record(&[]);
        r.apply(Event::Start, 5_000, None).unwrap();
        r.apply(Event::LoseOutcome, 9_000, None).unwrap();
        assert_eq!(last_send_ms(&r), 5_000);
        let settle = Duration::from_secs(2);
        assert_eq!(settled(&r, settle, 6_500), Err(Duration::from_millis(500)));
        assert_eq!(settled(&r, settle, 7_000), Ok(()));
        // A later re-send restarts the window.
        r.apply(Event::Resend, 10_000, None).unwrap();
        r.apply(Event::LoseOutcome, 10_100, None).unwrap();
        assert_eq!(last_send_ms(&r), 10_000);
        assert!(settled(&r, settle, 11_000).is_err());
        // Clock skew backwards never makes it "settled early".
        assert!(settled(&r, settle, 0).is_err());
    }
}
