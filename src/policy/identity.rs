//! Execution identity: who a call belongs to (tenant), what logical action it is (scoped
//! key → `ExecutionId`), and what exactly it asked for (`ArgsHash`). Types, not strings, so
//! a tenant hash can never be passed where an execution id is expected.

use std::borrow::Cow;
use std::fmt;

use serde::{Deserialize, Serialize};

/// Stable, URL-safe id of one logical execution, derived from the scoped key.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ExecutionId(pub String);

/// SHA-256 (lower-case hex) of the canonical request.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ArgsHash(pub String);

/// SHA-256 (lower-case hex) of the tenant credential header values.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TenantScope(pub String);

macro_rules! display_inner {
    ($($t:ty),*) => {$(
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
        impl $t {
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }
    )*};
}
display_inner!(ExecutionId, ArgsHash, TenantScope);

use crate::wire::headers::{visible_ascii, HeaderLookup};
use base64::Engine as _;
use http::HeaderMap;
use sha2::{Digest, Sha256};

use crate::config::{IdentityConfig, Route};

/// Where the idempotency key came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeySource {
    /// The client's own `Idempotency-Key` (or configured) header.
    Client,
    /// Joined from the trusted `derive_from` headers plus tool name and version.
    Derived,
}

/// The result of looking for a key on a side-effect request.
#[derive(Debug, PartialEq, Eq)]
pub enum KeyLookup {
    Found {
        key: String,
        source: KeySource,
    },
    Missing,
    /// The key is present but unusable; the text says why (no key bytes in it).
    Invalid(String),
}

/// Find the logical key of a request (SPEC section 4): the client's key header, else the
/// `derive_from` headers (all of them must be present) joined with the tool identity.
///
/// A client key is 1 to `max_key_bytes` visible ASCII characters (0x21-0x7E), read as an
/// RFC 8941 string when it is quoted (`"abc"` is the key `abc`, as the IETF draft
/// defines the header; `\"` and `\\` are its escapes). A derived key joins its parts
/// unambiguously ([`join_parts`]).
pub fn find_key<H: HeaderLookup + ?Sized>(
    headers: &H,
    id: &IdentityConfig,
    route: &Route,
    max_key_bytes: usize,
) -> KeyLookup {
    let mut values = headers.values(&id.key_header);
    if let Some(v) = values.next() {
        if values.next().is_some() {
            return KeyLookup::Invalid(format!("more than one {} header", id.key_header));
        }
        let what = id.key_header.as_str();
        let Some(v) = visible_ascii(v).map(str::trim) else {
            return not_visible(what);
        };
        let key = match v.strip_prefix('"') {
            Some(quoted) => match sf_string(quoted) {
                Some(k) => Cow::Owned(k),
                None => {
                    return KeyLookup::Invalid(format!(
                        "{what} starts with `\"` but is not a valid RFC 8941 string"
                    ))
                }
            },
            None => Cow::Borrowed(v),
        };
        return check_key(&key, max_key_bytes, KeySource::Client, what);
    }
    if id.derive_from.is_empty() {
        return KeyLookup::Missing;
    }
    let mut parts: Vec<&str> = Vec::with_capacity(id.derive_from.len() + 2);
    for h in &id.derive_from {
        match headers.values(h).next() {
            None => return KeyLookup::Missing,
            Some(v) => match visible_ascii(v).map(str::trim) {
                Some(s) if !s.is_empty() => parts.push(s),
                _ => {
                    return KeyLookup::Invalid(format!("header {h} is empty or not visible ASCII"))
                }
            },
        }
    }
    parts.push(&route.name);
    parts.push(&route.tool_version);
    let key = join_parts(&parts);
    check_key(&key, max_key_bytes, KeySource::Derived, "derived key")
}

/// The body of an RFC 8941 sf-string after its opening quote: printable ASCII up to the
/// closing quote, which must end the value; `\"` and `\\` are the only escapes.
fn sf_string(quoted: &str) -> Option<String> {
    let mut out = String::with_capacity(quoted.len());
    let mut chars = quoted.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next()? {
                e @ ('"' | '\\') => out.push(e),
                _ => return None,
            },
            '"' => return chars.next().is_none().then_some(out),
            ' '..='~' => out.push(c),
            _ => return None,
        }
    }
    None
}

/// Joins derived-key parts with `:` so that no two different part lists give one key: in
/// each part `%`, `:` and the space are percent-encoded first (`op:1` becomes `op%3A1`).
/// Parts without them, which is every id the orchestrators we know send, read as before:
/// `op_77:round_3:call_123:send_email:v1`.
pub fn join_parts(parts: &[&str]) -> String {
    let mut key = String::with_capacity(parts.iter().map(|p| p.len() + 1).sum());
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            key.push(':');
        }
        for c in part.chars() {
            match c {
                '%' => key.push_str("%25"),
                ':' => key.push_str("%3A"),
                ' ' => key.push_str("%20"),
                c => key.push(c),
            }
        }
    }
    key
}

fn not_visible(what: &str) -> KeyLookup {
    KeyLookup::Invalid(format!(
        "{what} is not a valid key (visible ASCII only, no spaces)"
    ))
}

fn check_key(k: &str, max: usize, source: KeySource, what: &str) -> KeyLookup {
    match k {
        "" => KeyLookup::Invalid(format!("{what} is empty")),
        k if k.len() > max => KeyLookup::Invalid(format!(
            "{what} is {} bytes, longer than the {max}-byte limit",
            k.len()
        )),
        k if !k.bytes().all(|b| (0x21..0x7f).contains(&b)) => not_visible(what),
        k => KeyLookup::Found {
            key: k.to_string(),
            source,
        },
    }
}

/// SHA-256 of the tenant credential headers: keys are scoped by it, so the same key under
/// another credential is another execution. Missing and empty headers hash differently.
pub fn tenant_scope<H: HeaderLookup + ?Sized>(
    headers: &H,
    tenant_from: &[http::HeaderName],
) -> TenantScope {
    let mut h = Sha256::new();
    for name in tenant_from {
        h.update(name.as_str().as_bytes());
        match headers.values(name).next() {
            Some(v) => {
                h.update([1]);
                h.update((v.len() as u64).to_be_bytes());
                h.update(v);
            }
            None => h.update([0]),
        }
    }
    TenantScope(hex::encode(h.finalize()))
}

/// The stable execution id of a scoped key: `ex_` + 24 URL-safe characters (144 bits of
/// SHA-256 over tenant, upstream, route and key). Same inputs, same id, on every instance.
pub fn execution_id(tenant: &TenantScope, upstream: &str, route: &str, key: &str) -> ExecutionId {
    let mut h = Sha256::new();
    for part in [tenant.as_str(), upstream, route, key] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    let digest = h.finalize();
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&digest[..18]);
    ExecutionId(format!("ex_{b64}"))
}

/// The execution id of item `item_key` of the batch executing as `parent` (SPEC section
/// 9.3): the parent's id (tenant, upstream, route and key are in it) and the item key,
/// length-prefixed like [`execution_id`]. Three parts where a call's id has four, so no
/// client key can name an item's execution: a length-prefixed encoding reads back into
/// exactly one list of parts.
pub fn item_execution_id(parent: &ExecutionId, item_key: &str) -> ExecutionId {
    let mut h = Sha256::new();
    for part in ["batch-item", parent.as_str(), item_key] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    let digest = h.finalize();
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&digest[..18]);
    ExecutionId(format!("ex_{b64}"))
}

/// The parent operation id, from the trusted operation header.
pub fn operation_id(headers: &HeaderMap, id: &IdentityConfig) -> Option<String> {
    trusted(headers, id.operation_from.as_ref())
}

/// The orchestration parts a call was identified by, kept on its record so an operator can
/// find it again (SPEC section 10): ids the orchestrator sent, never argument values.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Correlation {
    /// `identity.operation_from`.
    pub operation_id: Option<String>,
    /// `identity.model_round_from`.
    pub model_round: Option<String>,
    /// `identity.tool_call_from`.
    pub tool_call_id: Option<String>,
}

/// The [`Correlation`] the trusted headers name; each part is a visible-ASCII value of at
/// most 255 bytes, else absent.
pub fn correlation(headers: &HeaderMap, id: &IdentityConfig) -> Correlation {
    Correlation {
        operation_id: trusted(headers, id.operation_from.as_ref()),
        model_round: trusted(headers, id.model_round_from.as_ref()),
        tool_call_id: trusted(headers, id.tool_call_from.as_ref()),
    }
}

/// The value of one trusted orchestration header: trimmed, 1 to 255 bytes.
fn trusted(headers: &HeaderMap, name: Option<&http::HeaderName>) -> Option<String> {
    let v = headers.get(name?)?.to_str().ok()?.trim();
    (!v.is_empty() && v.len() <= 255).then(|| v.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::from_yaml;
    use http::{HeaderName, HeaderValue};
    use std::path::Path;

    fn cfg() -> crate::config::Config {
        from_yaml(
            "identity: { derive_from: [X-Operation-Id, X-Model-Round, X-Tool-Call-Id] }\nupstreams:\n  - name: mail\n    url: http://127.0.0.1:1\n    routes:\n      - { name: send_email, tool_version: v1, match: { method: POST, path: /send } }\n",
            Path::new("t.yaml"),
        )
        .expect("valid")
    }

    #[test]
    fn derives_the_article_key() {
        let c = cfg();
        let mut h = HeaderMap::new();
        h.insert("x-operation-id", HeaderValue::from_static("op_77"));
        h.insert("x-model-round", HeaderValue::from_static("round_3"));
        h.insert("x-tool-call-id", HeaderValue::from_static("call_123"));
        let got = find_key(&h, &c.identity, &c.upstreams[0].routes[0], 255);
        assert_eq!(
            got,
            KeyLookup::Found {
                key: "op_77:round_3:call_123:send_email:v1".into(),
                source: KeySource::Derived
            }
        );
        h.remove("x-model-round");
        assert_eq!(
            find_key(&h, &c.identity, &c.upstreams[0].routes[0], 255),
            KeyLookup::Missing
        );
        assert_eq!(operation_id(&h, &c.identity).as_deref(), Some("op_77"));
    }

    /// Operation, model round and tool call default to their `derive_from` headers, and a
    /// configured header wins over the default.
    #[test]
    fn correlation_reads_the_orchestration_headers() {
        let c = cfg();
        let mut h = HeaderMap::new();
        h.insert("x-operation-id", HeaderValue::from_static("op_77"));
        h.insert("x-model-round", HeaderValue::from_static(" round_3 "));
        h.insert("x-tool-call-id", HeaderValue::from_static("call_123"));
        h.insert("x-round", HeaderValue::from_static("r9"));
        assert_eq!(
            correlation(&h, &c.identity),
            Correlation {
                operation_id: Some("op_77".into()),
                model_round: Some("round_3".into()),
                tool_call_id: Some("call_123".into()),
            }
        );
        let other = from_yaml(
            "identity: { derive_from: [X-Operation-Id, X-Tool-Call-Id], model_round_from: X-Round }\nupstreams:\n  - { name: m, url: http://127.0.0.1:1, routes: [] }\n",
            Path::new("t.yaml"),
        )
        .expect("valid");
        let got = correlation(&h, &other.identity);
        assert_eq!(got.model_round.as_deref(), Some("r9"));
        assert_eq!(got.tool_call_id.as_deref(), Some("call_123"));
        let none = from_yaml(
            "identity: { derive_from: [X-Operation-Id] }\nupstreams:\n  - { name: m, url: http://127.0.0.1:1, routes: [] }\n",
            Path::new("t.yaml"),
        )
        .expect("valid");
        let got = correlation(&h, &none.identity);
        assert_eq!((got.model_round, got.tool_call_id), (None, None));
    }

    #[test]
    fn client_key_wins_and_is_checked() {
        let c = cfg();
        let r = &c.upstreams[0].routes[0];
        let mut h = HeaderMap::new();
        h.insert("idempotency-key", HeaderValue::from_static("k1"));
        h.insert("x-operation-id", HeaderValue::from_static("op"));
        assert!(matches!(
            find_key(&h, &c.identity, r, 255),
            KeyLookup::Found {
                source: KeySource::Client,
                ..
            }
        ));
        h.insert(
            "idempotency-key",
            HeaderValue::from_str(&"a".repeat(256)).expect("ascii"),
        );
        assert!(matches!(
            find_key(&h, &c.identity, r, 255),
            KeyLookup::Invalid(_)
        ));
        h.insert(
            "idempotency-key",
            HeaderValue::from_bytes(b"caf\xc3\xa9").expect("obs-text allowed by http"),
        );
        assert!(matches!(
            find_key(&h, &c.identity, r, 255),
            KeyLookup::Invalid(_)
        ));
        h.insert("idempotency-key", HeaderValue::from_static(""));
        assert!(matches!(
            find_key(&h, &c.identity, r, 255),
            KeyLookup::Invalid(_)
        ));
    }

    #[test]
    fn ids_are_stable_url_safe_and_scoped() {
        let t1 = tenant_scope(&HeaderMap::new(), &[http::header::AUTHORIZATION]);
        let mut h = HeaderMap::new();
        h.insert("authorization", HeaderValue::from_static("Bearer a"));
        let t2 = tenant_scope(&h, &[http::header::AUTHORIZATION]);
        assert_ne!(t1, t2);
        let a = execution_id(&t2, "mail", "send_email", "k");
        assert_eq!(a, execution_id(&t2, "mail", "send_email", "k"));
        assert_ne!(a, execution_id(&t1, "mail", "send_email", "k"));
        assert_ne!(a, execution_id(&t2, "mail", "other", "k"));
        assert_eq!(a.as_str().len(), 27);
        assert!(a.as_str()[3..]
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'));
    }

    /// A request the fast path read as bytes gets the same key, tenant scope and raw
    /// digest as the same request as an `http::Request` (the replay lane answers from
    /// memory only what `admit` would).
    #[test]
    fn a_raw_request_reads_as_its_header_map() {
        use crate::policy::fingerprint::{raw_digest, CallScope, FingerprintSpec, RequestParts};
        let c = cfg();
        let r = &c.upstreams[0].routes[0];
        let tenant_from = [
            http::header::AUTHORIZATION,
            HeaderName::from_static("x-org"),
        ];
        let spec = FingerprintSpec {
            ignore_json: vec![],
            headers: vec![HeaderName::from_static("x-account")],
        };
        let heads: [&'static [u8]; 7] = [
            b"POST /send?b=1 HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k1\r\nAuthorization: Bearer a\r\nContent-Type: application/json\r\nX-Account: 7\r\nx-account: 8\r\n\r\n",
            b"POST /send HTTP/1.1\r\nidempotency-key:   k1  \r\nAUTHORIZATION: Bearer a\r\nX-Org:\r\n\r\n",
            b"POST /send HTTP/1.1\r\nIdempotency-Key: k1\r\nIdempotency-Key: k2\r\n\r\n",
            b"POST /send HTTP/1.1\r\nIdempotency-Key: k\xc3\xa9\r\n\r\n",
            b"POST /send HTTP/1.1\r\nIdempotency-Key: \r\n\r\n",
            b"POST /send HTTP/1.1\r\nX-Operation-Id: op\r\nX-Model-Round: 3\r\nX-Tool-Call-Id: c\r\n\r\n",
            b"POST /send HTTP/1.1\r\nX-Operation-Id: op\r\nX-Model-Round: \xff\r\nX-Tool-Call-Id: c\r\n\r\n",
        ];
        fn parts<'a, H: ?Sized>(
            req: &'a crate::wire::raw::RawRequest,
            headers: &'a H,
        ) -> RequestParts<'a, H> {
            RequestParts {
                method: &req.method,
                upstream: "mail",
                route: "send_email",
                path: "/send",
                query: req.uri.query(),
                headers,
                body: &req.body,
            }
        }
        for head in heads {
            let raw = crate::wire::raw::request(head, b"{}");
            let map = crate::wire::raw::request(head, b"{}")
                .into_request(None)
                .expect("valid");
            let label = String::from_utf8_lossy(head);
            assert_eq!(
                find_key(&raw, &c.identity, r, 255),
                find_key(map.headers(), &c.identity, r, 255),
                "{label}"
            );
            assert_eq!(
                tenant_scope(&raw, &tenant_from),
                tenant_scope(map.headers(), &tenant_from),
                "{label}"
            );
            let scope = CallScope {
                key: "k",
                tenant_from: &tenant_from,
            };
            assert_eq!(
                raw_digest(&scope, &parts(&raw, &raw), &spec),
                raw_digest(&scope, &parts(&raw, map.headers()), &spec),
                "{label}"
            );
        }
    }

    #[test]
    fn derived_parts_join_unambiguously() {
        assert_eq!(
            join_parts(&["op_77", "round_3", "call_123", "send_email", "v1"]),
            "op_77:round_3:call_123:send_email:v1"
        );
        assert_ne!(
            join_parts(&["op:1", "2:3", "c"]),
            join_parts(&["op", "1:2:3", "c"])
        );
        assert_eq!(join_parts(&["a%3Ab", "c d"]), "a%253Ab:c%20d");
    }

    #[test]
    fn quoted_keys_are_rfc8941_strings() {
        let c = cfg();
        let r = &c.upstreams[0].routes[0];
        let key = |v: &'static [u8]| {
            let mut h = HeaderMap::new();
            h.insert(
                "idempotency-key",
                HeaderValue::from_bytes(v).expect("header"),
            );
            find_key(&h, &c.identity, r, 16)
        };
        let found = |k: &str| KeyLookup::Found {
            key: k.into(),
            source: KeySource::Client,
        };
        assert_eq!(key(b"\"abc\""), found("abc"));
        assert_eq!(key(b"abc"), found("abc"));
        assert_eq!(key(b"\"a\\\"b\\\\c\""), found("a\"b\\c"));
        // The limit counts the key, not its quotes.
        assert_eq!(key(b"\"0123456789abcdef\""), found("0123456789abcdef"));
        for bad in [
            &b"a b"[..],
            b"\"a b\"",
            b"\"abc",
            b"\"a\"b\"",
            b"\"a\\x\"",
            b"\"\"",
            b"a\tb",
            b"0123456789abcdefg",
        ] {
            assert!(
                matches!(key(bad), KeyLookup::Invalid(_)),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    mod properties {
        use super::super::join_parts;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

            /// Two different header tuples never derive the same key (a small alphabet
            /// heavy in `:` and `%` makes near-collisions likely).
            #[test]
            fn different_tuples_never_share_a_key(
                a in prop::collection::vec("[ab:%3A ]{0,5}", 1..5),
                b in prop::collection::vec("[ab:%3A ]{0,5}", 1..5),
            ) {
                let ja = join_parts(&a.iter().map(String::as_str).collect::<Vec<_>>());
                let jb = join_parts(&b.iter().map(String::as_str).collect::<Vec<_>>());
                prop_assert_eq!(a == b, ja == jb, "{:?} / {:?} -> {} / {}", a, b, ja, jb);
            }
        }
    }
}
