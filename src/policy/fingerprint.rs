//! Canonical request fingerprint (`args_hash`, SPEC §4): a SHA-256 over what a request
//! asked for, insensitive to spelling (JSON key order, whitespace, number form, query and
//! form pair order) but sensitive to every value that could change the downstream effect.

use std::borrow::Cow;

use http::header::CONTENT_TYPE;
use sha2::{Digest, Sha256};

use crate::policy::identity::ArgsHash;
use crate::wire::headers::HeaderLookup;

/// What parts of a request count toward its identity, resolved from route config.
#[derive(Clone, Debug, Default)]
pub struct FingerprintSpec {
    /// RFC 6901 JSON pointers removed from JSON bodies before hashing (e.g. "/client_ts").
    pub ignore_json: Vec<String>,
    /// Lower-case header names whose values count (in the listed order).
    pub headers: Vec<http::HeaderName>,
}

/// The request as the fingerprint sees it; borrowed so the hot path copies nothing. Its
/// headers are a `HeaderMap` or, for [`raw_digest`], any [`HeaderLookup`] (the fast path's
/// raw request).
pub struct RequestParts<'a, H: ?Sized = http::HeaderMap> {
    pub method: &'a http::Method,
    pub upstream: &'a str,
    pub route: &'a str,
    /// Path relative to the upstream mount, without query.
    pub path: &'a str,
    pub query: Option<&'a str>,
    pub headers: &'a H,
    pub body: &'a [u8],
}

/// Domain-separation prefix; bump the version if the encoding below ever changes, since
/// stored hashes from older builds would otherwise be compared against a different scheme.
const DOMAIN: &[u8] = b"idemproxy/args_hash/v1";

/// SHA-256 (lower-case hex) of the canonical encoding of `parts` under `spec`; refused when
/// a JSON body repeats an object member name (the downstream may read the other value).
pub fn args_hash(
    parts: &RequestParts<'_>,
    spec: &FingerprintSpec,
) -> Result<ArgsHash, AmbiguousBody> {
    let mut enc = Encoder::default();
    enc.bytes(DOMAIN);
    enc.bytes(parts.method.as_str().as_bytes());
    enc.bytes(parts.upstream.as_bytes());
    enc.bytes(parts.route.as_bytes());
    enc.bytes(parts.path.as_bytes());
    enc.pairs(parts.query.unwrap_or("").as_bytes());
    encode_body(&mut enc, parts, spec)?;
    enc.count(spec.headers.len());
    for name in &spec.headers {
        enc.bytes(name.as_str().as_bytes());
        // Counting values distinguishes a missing header (0 values) from an empty one
        // (1 value of length 0), and keeps repeated headers in their received order.
        let values: Vec<&http::HeaderValue> = parts.headers.get_all(name).iter().collect();
        enc.count(values.len());
        for v in values {
            enc.bytes(v.as_bytes());
        }
    }
    Ok(ArgsHash(hex::encode(enc.hasher.finalize())))
}

/// A JSON body that names one object member twice: `{"to":"alice","to":"mallory"}`. Which
/// of the two a parser keeps differs between parsers, so no fingerprint or approval
/// preview can be sure it saw what the downstream will execute. The text is the member's
/// JSON pointer (names only, never values).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AmbiguousBody(pub String);

/// Who a call is before its execution id is derived: the idempotency key and the raw
/// values of the tenant headers ([`identity::tenant_scope`](crate::policy::identity::tenant_scope)
/// and [`identity::execution_id`](crate::policy::identity::execution_id) read nothing else
/// beside the upstream and route names).
pub struct CallScope<'a> {
    pub key: &'a str,
    pub tenant_from: &'a [http::HeaderName],
}

/// A digest of the request's exact bytes over everything [`args_hash`] and the execution
/// id read: the key and the tenant headers' raw values, method, names, path, raw query,
/// `Content-Type`, the fingerprinted headers, raw body. Equal raw digests under one `spec`
/// mean the same execution id and equal `args_hash`es, so a retry that repeats its request
/// byte for byte can be matched with one hash, without deriving its id or canonicalising
/// its arguments (see `proxy::replay`). The converse does not hold: a respelled request has
/// another raw digest and must be compared by `args_hash`.
pub fn raw_digest<H: HeaderLookup + ?Sized>(
    scope: &CallScope<'_>,
    parts: &RequestParts<'_, H>,
    spec: &FingerprintSpec,
) -> RawDigest {
    let mut enc = Encoder::default();
    enc.bytes(RAW_DOMAIN);
    enc.bytes(scope.key.as_bytes());
    enc.count(scope.tenant_from.len());
    for name in scope.tenant_from {
        enc.bytes(name.as_str().as_bytes());
        enc.count(parts.headers.values(name).count());
        for v in parts.headers.values(name) {
            enc.bytes(v);
        }
    }
    enc.bytes(parts.method.as_str().as_bytes());
    enc.bytes(parts.upstream.as_bytes());
    enc.bytes(parts.route.as_bytes());
    enc.bytes(parts.path.as_bytes());
    match parts.query {
        None => enc.tag(0),
        Some(q) => {
            enc.tag(1);
            enc.bytes(q.as_bytes());
        }
    }
    for name in std::iter::once(&CONTENT_TYPE).chain(spec.headers.iter()) {
        enc.count(parts.headers.values(name).count());
        for v in parts.headers.values(name) {
            enc.bytes(v);
        }
    }
    enc.bytes(parts.body);
    RawDigest(enc.hasher.finalize().into())
}

/// See [`raw_digest`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RawDigest(pub [u8; 32]);

const RAW_DOMAIN: &[u8] = b"idemproxy/raw_request/v2";

/// Validates a JSON pointer at config load (returns a human message on error).
pub fn validate_pointer(p: &str) -> Result<(), String> {
    parse_pointer(p).map(|_| ())
}

/// Unambiguous framing: every variable-length item is preceded by its length, and every
/// list by its count, so no two different requests can produce the same byte stream.
#[derive(Default)]
struct Encoder {
    hasher: Sha256,
}

impl Encoder {
    fn count(&mut self, n: usize) {
        self.hasher.update((n as u64).to_be_bytes());
    }

    fn bytes(&mut self, b: &[u8]) {
        self.count(b.len());
        self.hasher.update(b);
    }

    fn tag(&mut self, t: u8) {
        self.hasher.update([t]);
    }

    /// `application/x-www-form-urlencoded` pairs (query strings and form bodies), sorted by
    /// name; the sort is stable, so repeated names keep their order (`a=1&a=2` is not
    /// `a=2&a=1`: most servers read a repeated field as a list).
    fn pairs(&mut self, raw: &[u8]) {
        let mut pairs: Vec<(Cow<'_, str>, Cow<'_, str>)> = form_urlencoded::parse(raw).collect();
        pairs.sort_by(|a, b| a.0.cmp(&b.0));
        self.count(pairs.len());
        let mut lossy = false;
        for (name, value) in &pairs {
            lossy |= name.contains('\u{FFFD}') || value.contains('\u{FFFD}');
            self.bytes(name.as_bytes());
            self.bytes(value.as_bytes());
        }
        // form_urlencoded decodes invalid UTF-8 lossily, so "%FF" and "%FE" would both
        // become U+FFFD and collide. When that may have happened, also hash the raw bytes:
        // distinct requests stay distinct, at the price of order mattering in that rare case.
        if lossy {
            self.tag(1);
            self.bytes(raw);
        } else {
            self.tag(0);
        }
    }
}

/// How the body was interpreted; tagged so a raw body can never equal a canonical one.
const BODY_JSON: u8 = b'J';
const BODY_FORM: u8 = b'F';
const BODY_RAW: u8 = b'R';

fn encode_body(
    enc: &mut Encoder,
    parts: &RequestParts<'_>,
    spec: &FingerprintSpec,
) -> Result<(), AmbiguousBody> {
    match body_kind(parts.headers) {
        BodyKind::Json => match canonical_json(parts.body, &spec.ignore_json) {
            Ok(canonical) => {
                enc.tag(BODY_JSON);
                enc.bytes(&canonical);
                return Ok(());
            }
            Err(JsonError::Ambiguous(at)) => return Err(AmbiguousBody(at)),
            // Not valid (I-)JSON: the proxy does not judge payloads, it just hashes bytes.
            Err(JsonError::NotJson) => {}
        },
        BodyKind::Form => {
            enc.tag(BODY_FORM);
            enc.pairs(parts.body);
            return Ok(());
        }
        BodyKind::Other => {}
    }
    enc.tag(BODY_RAW);
    enc.bytes(parts.body);
    Ok(())
}

enum BodyKind {
    Json,
    Form,
    Other,
}

fn body_kind(headers: &http::HeaderMap) -> BodyKind {
    let Some(ct) = headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()) else {
        return BodyKind::Other;
    };
    // Media type essence only: parameters such as charset do not change the payload's
    // meaning for hashing, and type/subtype are case-insensitive (RFC 9110 §8.3.1).
    let essence = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let Some((ty, subtype)) = essence.split_once('/') else {
        return BodyKind::Other;
    };
    if ty.is_empty() {
        BodyKind::Other
    } else if essence == "application/json" || subtype.ends_with("+json") {
        BodyKind::Json
    } else if essence == "application/x-www-form-urlencoded" {
        BodyKind::Form
    } else {
        BodyKind::Other
    }
}

/// Why a body declared JSON has no canonical form.
#[derive(Debug, PartialEq, Eq)]
enum JsonError {
    /// A repeated object member name, at this JSON pointer.
    Ambiguous(String),
    /// Not JSON (syntax, a lone surrogate, nesting deeper than [`MAX_DEPTH`], an exponent
    /// beyond 15 digits): hashed as raw bytes.
    NotJson,
}

/// serde_json's recursion limit, kept so the same bodies stay JSON.
const MAX_DEPTH: usize = 128;

/// A JSON document as sent: members in a list (names checked unique, sorted as RFC 8785
/// sorts them), numbers as their canonical decimal text.
#[derive(Debug)]
enum Node {
    Null,
    Bool(bool),
    Num(String),
    Str(String),
    Arr(Vec<Node>),
    Obj(Vec<(String, Node)>),
}

/// The canonical text of one JSON value (what [`args_hash`] hashes a body as), for keys
/// read out of a body (a batch's item keys); `None` when it is not one JSON value.
pub fn canonical_text(json: &[u8]) -> Option<String> {
    String::from_utf8(canonical_json(json, &[]).ok()?).ok()
}

/// The canonical bytes of `body` with the `ignore` pointer targets removed: RFC 8785 (JCS)
/// except for numbers, which are written by their exact decimal value in JCS's layout
/// ([`canonical_number`]) instead of being rounded to a double first: `9007199254740993`
/// is not `9007199254740992` here, while `1`, `1.0` and `1e0` are still one number.
fn canonical_json(body: &[u8], ignore: &[String]) -> Result<Vec<u8>, JsonError> {
    let mut parser = jiter::Jiter::new(body);
    let peek = parser.peek().map_err(|_| JsonError::NotJson)?;
    let mut doc = parse_node(&mut parser, peek, 0)?;
    parser.finish().map_err(|_| JsonError::NotJson)?;
    remove_pointers(&mut doc, ignore);
    let mut out = Vec::with_capacity(body.len());
    write_node(&doc, &mut out);
    Ok(out)
}

/// One value of the document. A repeated member name's pointer is built on the way out of
/// the error (each level puts its own step in front), so a body without one pays nothing
/// for it.
fn parse_node(
    p: &mut jiter::Jiter<'_>,
    peek: jiter::Peek,
    depth: usize,
) -> Result<Node, JsonError> {
    use jiter::Peek;
    let bad = |_| JsonError::NotJson;
    if depth > MAX_DEPTH {
        return Err(JsonError::NotJson);
    }
    Ok(match peek {
        Peek::Null => {
            p.known_null().map_err(bad)?;
            Node::Null
        }
        Peek::True | Peek::False => Node::Bool(p.known_bool(peek).map_err(bad)?),
        Peek::String => Node::Str(p.known_str().map_err(bad)?.to_owned()),
        Peek::Array => {
            let mut items = Vec::new();
            let mut next = p.known_array().map_err(bad)?;
            while let Some(peek) = next {
                let item = parse_node(p, peek, depth + 1)
                    .map_err(|e| e.within(&items.len().to_string()))?;
                items.push(item);
                next = p.array_step().map_err(bad)?;
            }
            Node::Arr(items)
        }
        Peek::Object => {
            let mut members: Vec<(String, Node)> = Vec::new();
            let mut key = p.known_object().map_err(bad)?.map(str::to_owned);
            while let Some(k) = key {
                let peek = p.peek().map_err(bad)?;
                let value = parse_node(p, peek, depth + 1).map_err(|e| e.within(&k))?;
                members.push((k, value));
                key = p.next_key().map_err(bad)?.map(str::to_owned);
            }
            // RFC 8785 §3.2.3: members sorted by their names' UTF-16 code units. Sorted,
            // a repeated name sits next to itself.
            members.sort_by(|a, b| a.0.encode_utf16().cmp(b.0.encode_utf16()));
            if let Some(w) = members.windows(2).find(|w| w[0].0 == w[1].0) {
                return Err(JsonError::Ambiguous(String::new()).within(&w[0].0));
            }
            Node::Obj(members)
        }
        peek if peek.is_num() => {
            let text = p.known_number_bytes(peek).map_err(bad)?;
            Node::Num(canonical_number(text).ok_or(JsonError::NotJson)?)
        }
        _ => return Err(JsonError::NotJson),
    })
}

impl JsonError {
    /// The error as seen from the parent: a repeated member's pointer gets the step
    /// `token` (escaped per RFC 6901) in front.
    fn within(self, token: &str) -> JsonError {
        match self {
            JsonError::Ambiguous(rest) => JsonError::Ambiguous(format!(
                "/{}{rest}",
                token.replace('~', "~0").replace('/', "~1")
            )),
            other => other,
        }
    }
}

fn write_node(node: &Node, out: &mut Vec<u8>) {
    match node {
        Node::Null => out.extend_from_slice(b"null"),
        Node::Bool(true) => out.extend_from_slice(b"true"),
        Node::Bool(false) => out.extend_from_slice(b"false"),
        Node::Num(text) => out.extend_from_slice(text.as_bytes()),
        Node::Str(s) => write_string(s, out),
        Node::Arr(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_node(item, out);
            }
            out.push(b']');
        }
        Node::Obj(members) => {
            out.push(b'{');
            for (i, (name, value)) in members.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_string(name, out);
                out.push(b':');
                write_node(value, out);
            }
            out.push(b'}');
        }
    }
}

/// RFC 8785 §3.2.2.2 strings: serde_json escapes exactly as JCS does (`\"`, `\\`, the
/// short forms `\b \t \n \f \r`, other controls as lower-case `\u00xx`, nothing else).
fn write_string(s: &str, out: &mut Vec<u8>) {
    // Writing to a Vec cannot fail, and a &str always serialises.
    let _ = serde_json::to_writer(&mut *out, s);
}

/// The canonical text of a JSON number by its exact decimal value: the value's shortest
/// digits (no leading or trailing zeros) laid out as ECMAScript's `Number.prototype.toString`
/// lays out a double's digits, which is JCS's layout (`1e+21`, `0.000001`, `1e-7`, `4.5`).
/// For every number that is a double's shortest form (what JavaScript, Python's `repr` and
/// Rust's `{:?}` write) this is exactly JCS's output; others keep their digits. `None` for
/// text that is not a JSON number, or an exponent beyond 15 digits.
fn canonical_number(text: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(text).ok()?;
    let (negative, rest) = match text.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, text),
    };
    let (mantissa, exponent) = match rest.find(['e', 'E']) {
        Some(i) => (&rest[..i], Some(&rest[i + 1..])),
        None => (rest, None),
    };
    let (int, frac) = match mantissa.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (mantissa, None),
    };
    let digits_only = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits_only(int) || (int.len() > 1 && int.starts_with('0')) {
        return None;
    }
    let frac = match frac {
        Some(f) if !digits_only(f) => return None,
        Some(f) => f,
        None => "",
    };
    let mut exp: i64 = match exponent {
        None => 0,
        Some(e) => {
            let digits = e.strip_prefix(['+', '-']).unwrap_or(e);
            if !digits_only(digits) || digits.len() > 15 {
                return None;
            }
            let magnitude: i64 = digits.parse().ok()?;
            if e.starts_with('-') {
                -magnitude
            } else {
                magnitude
            }
        }
    };
    // value = digits × 10^exp, digits without leading or trailing zeros
    let all: String = [int, frac].concat();
    exp -= frac.len() as i64;
    let digits = all.trim_start_matches('0');
    let trimmed = digits.trim_end_matches('0');
    if trimmed.is_empty() {
        return Some("0".to_owned());
    }
    exp += (digits.len() - trimmed.len()) as i64;
    let digits = trimmed;
    let k = digits.len() as i64;
    let n = exp + k; // the decimal point sits after `n` digits
    let mut out = String::with_capacity(digits.len() + 8);
    if negative {
        out.push('-');
    }
    if k <= n && n <= 21 {
        out.push_str(digits);
        out.extend(std::iter::repeat_n('0', (n - k) as usize));
    } else if 0 < n && n <= 21 {
        out.push_str(&digits[..n as usize]);
        out.push('.');
        out.push_str(&digits[n as usize..]);
    } else if -6 < n && n <= 0 {
        out.push_str("0.");
        out.extend(std::iter::repeat_n('0', (-n) as usize));
        out.push_str(digits);
    } else {
        out.push_str(&digits[..1]);
        if k > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push('e');
        out.push(if n > 0 { '+' } else { '-' });
        out.push_str(&(n - 1).abs().to_string());
    }
    Some(out)
}

/// One resolved step into a JSON document.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Step {
    Index(usize),
    Key(String),
}

/// Removes every pointer target, all resolved against the document *as sent*: removing
/// "/arr/0" must not shift what "/arr/1" means, or the result would depend on list order.
fn remove_pointers(doc: &mut Node, pointers: &[String]) {
    let mut paths: Vec<Vec<Step>> = pointers
        .iter()
        // Pointers are validated at config load; a bad one here is skipped, not fatal.
        .filter_map(|p| parse_pointer(p).ok())
        .filter_map(|tokens| resolve(doc, &tokens))
        .collect();
    // Descending order removes deeper paths before their ancestors and higher array
    // indices before lower ones, so each removal leaves the remaining paths valid.
    paths.sort_unstable_by(|a, b| b.cmp(a));
    paths.dedup();
    for path in &paths {
        remove_path(doc, path);
    }
}

fn member<'n>(members: &'n [(String, Node)], name: &str) -> Option<(usize, &'n Node)> {
    members
        .iter()
        .enumerate()
        .find(|(_, (k, _))| k == name)
        .map(|(i, (_, v))| (i, v))
}

/// Maps pointer tokens onto concrete steps of `doc`; `None` if the target does not exist.
fn resolve(doc: &Node, tokens: &[String]) -> Option<Vec<Step>> {
    let mut node = doc;
    let mut steps = Vec::with_capacity(tokens.len());
    for token in tokens {
        match node {
            Node::Obj(members) => {
                node = member(members, token)?.1;
                steps.push(Step::Key(token.clone()));
            }
            Node::Arr(items) => {
                let i = array_index(token)?;
                node = items.get(i)?;
                steps.push(Step::Index(i));
            }
            _ => return None,
        }
    }
    // The empty pointer (whole document) is rejected at load; never remove the root.
    if steps.is_empty() {
        None
    } else {
        Some(steps)
    }
}

fn remove_path(doc: &mut Node, path: &[Step]) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    let mut node = doc;
    for step in parents {
        let next = match (node, step) {
            (Node::Obj(members), Step::Key(k)) => members
                .iter_mut()
                .find(|(name, _)| name == k)
                .map(|m| &mut m.1),
            (Node::Arr(items), Step::Index(i)) => items.get_mut(*i),
            _ => None,
        };
        match next {
            Some(n) => node = n,
            None => return,
        }
    }
    match (node, last) {
        (Node::Obj(members), Step::Key(k)) => {
            if let Some((i, _)) = member(members, k) {
                members.remove(i);
            }
        }
        (Node::Arr(items), Step::Index(i)) if *i < items.len() => {
            items.remove(*i);
        }
        _ => {}
    }
}

/// RFC 6901 array index: "0" or a decimal without leading zeros. "-" (past the end) and
/// anything else name no existing element.
fn array_index(token: &str) -> Option<usize> {
    let digits_only = !token.is_empty() && token.bytes().all(|b| b.is_ascii_digit());
    if !digits_only || (token.len() > 1 && token.starts_with('0')) {
        return None;
    }
    token.parse().ok()
}

/// Splits an RFC 6901 pointer into unescaped reference tokens.
fn parse_pointer(p: &str) -> Result<Vec<String>, String> {
    if p.is_empty() {
        return Err("empty JSON pointer would ignore the whole body".to_owned());
    }
    let Some(rest) = p.strip_prefix('/') else {
        return Err(format!("JSON pointer {p:?} must start with '/'"));
    };
    rest.split('/')
        .map(|raw| {
            let mut token = String::with_capacity(raw.len());
            let mut chars = raw.chars();
            while let Some(c) = chars.next() {
                if c != '~' {
                    token.push(c);
                    continue;
                }
                match chars.next() {
                    Some('0') => token.push('~'),
                    Some('1') => token.push('/'),
                    _ => {
                        return Err(format!(
                            "JSON pointer {p:?}: '~' must be followed by '0' or '1'"
                        ))
                    }
                }
            }
            Ok(token)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderMap, HeaderName, HeaderValue, Method};

    fn jcs(input: &str) -> String {
        let out = canonical_json(input.as_bytes(), &[]).expect("valid JSON");
        String::from_utf8(out).expect("JCS emits UTF-8")
    }

    fn jcs_ignoring(input: &str, ignore: &[&str]) -> String {
        let ignore: Vec<String> = ignore.iter().map(|s| s.to_string()).collect();
        let out = canonical_json(input.as_bytes(), &ignore).expect("valid JSON");
        String::from_utf8(out).expect("JCS emits UTF-8")
    }

    /// A request builder with defaults, so each test states only what it varies.
    struct Req {
        method: Method,
        upstream: &'static str,
        route: &'static str,
        path: &'static str,
        query: Option<&'static str>,
        headers: HeaderMap,
        body: Vec<u8>,
    }

    impl Req {
        fn json(body: &str) -> Self {
            let mut r = Req::raw(body.as_bytes());
            r.header("content-type", "application/json");
            r
        }

        fn raw(body: &[u8]) -> Self {
            Req {
                method: Method::POST,
                upstream: "mail",
                route: "send_email",
                path: "/send",
                query: None,
                headers: HeaderMap::new(),
                body: body.to_vec(),
            }
        }

        fn header(&mut self, name: &'static str, value: &str) -> &mut Self {
            self.headers.append(
                HeaderName::from_static(name),
                HeaderValue::from_str(value).expect("test header"),
            );
            self
        }

        fn parts(&self) -> RequestParts<'_> {
            RequestParts {
                method: &self.method,
                upstream: self.upstream,
                route: self.route,
                path: self.path,
                query: self.query,
                headers: &self.headers,
                body: &self.body,
            }
        }

        fn hash(&self, spec: &FingerprintSpec) -> String {
            args_hash(&self.parts(), spec).expect("unambiguous").0
        }

        fn h(&self) -> String {
            self.hash(&FingerprintSpec::default())
        }

        fn raw_digest(&self, spec: &FingerprintSpec) -> RawDigest {
            self.raw_digest_as("k1", spec)
        }

        fn raw_digest_as(&self, key: &str, spec: &FingerprintSpec) -> RawDigest {
            let scope = CallScope {
                key,
                tenant_from: &[http::header::AUTHORIZATION],
            };
            raw_digest(&scope, &self.parts(), spec)
        }
    }

    #[test]
    fn raw_digest_covers_every_input_of_args_hash_and_the_execution_id() {
        let spec = FingerprintSpec {
            ignore_json: vec![],
            headers: vec![HeaderName::from_static("x-account")],
        };
        let base = || {
            let mut r = Req::json(r#"{"to":"a@example.com","n":1}"#);
            r.header("x-account", "acct_1");
            r
        };
        let d = base().raw_digest(&spec);
        assert_eq!(d, base().raw_digest(&spec), "deterministic");
        let mut variants: Vec<Req> = Vec::new();
        let mut v = base();
        v.body = br#"{"to":"a@example.com","n":2}"#.to_vec();
        variants.push(v);
        let mut v = base();
        v.method = Method::PUT;
        variants.push(v);
        let mut v = base();
        v.path = "/send2";
        variants.push(v);
        let mut v = base();
        v.query = Some("");
        variants.push(v);
        let mut v = base();
        v.route = "other";
        variants.push(v);
        let mut v = base();
        v.upstream = "other";
        variants.push(v);
        let mut v = base();
        v.headers.insert(
            HeaderName::from_static("x-account"),
            HeaderValue::from_static("acct_2"),
        );
        variants.push(v);
        let mut v = base();
        v.headers
            .insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        variants.push(v);
        // The execution id's inputs: a tenant header (present, then with another value).
        let mut v = base();
        v.header("authorization", "Bearer a");
        variants.push(v);
        let mut v = base();
        v.header("authorization", "Bearer b");
        let other_tenant = v.raw_digest(&spec);
        variants.push(v);
        for (i, v) in variants.iter().enumerate() {
            assert_ne!(
                v.raw_digest(&spec),
                d,
                "variant {i} must change the raw digest"
            );
        }
        let mut v = base();
        v.header("authorization", "Bearer a");
        assert_ne!(v.raw_digest(&spec), other_tenant, "tenants differ");
        assert_ne!(base().raw_digest_as("k2", &spec), d, "the key changes it");
        // A header outside the fingerprint changes neither.
        let mut v = base();
        v.header("x-trace", "t1");
        assert_eq!(v.raw_digest(&spec), d);
        // Respelled JSON: same arguments, other bytes. The raw digest is only a shortcut.
        let mut v = base();
        v.body = br#"{ "n": 1, "to": "a@example.com" }"#.to_vec();
        assert_ne!(v.raw_digest(&spec), d);
        assert_eq!(v.hash(&spec), base().hash(&spec));
    }

    fn ignoring(pointers: &[&str]) -> FingerprintSpec {
        FingerprintSpec {
            ignore_json: pointers.iter().map(|s| s.to_string()).collect(),
            headers: vec![],
        }
    }

    // ---- RFC 8785 vectors (numbers by exact value: those that do not round) ----

    /// RFC 8785 Appendix B: each double written as its shortest round-trip decimal
    /// (Rust's `{:?}`) canonicalises to JCS's text, and JCS's text is a fixed point. The
    /// one vector where Rust's shortest digits differ from JavaScript's (a tie between two
    /// shortest forms) is only checked as a fixed point.
    #[test]
    fn rfc8785_appendix_b_numbers() {
        let vectors: &[(u64, &str)] = &[
            (0x0000000000000000, "0"),
            (0x8000000000000000, "0"),
            (0x0000000000000001, "5e-324"),
            (0x8000000000000001, "-5e-324"),
            (0x7fefffffffffffff, "1.7976931348623157e+308"),
            (0xffefffffffffffff, "-1.7976931348623157e+308"),
            (0x4340000000000000, "9007199254740992"),
            (0xc340000000000000, "-9007199254740992"),
            (0x4430000000000000, "295147905179352830000"),
            (0x44b52d02c7e14af5, "9.999999999999997e+22"),
            (0x44b52d02c7e14af6, "1e+23"),
            (0x44b52d02c7e14af7, "1.0000000000000001e+23"),
            (0x444b1ae4d6e2ef4e, "999999999999999700000"),
            (0x444b1ae4d6e2ef4f, "999999999999999900000"),
            (0x444b1ae4d6e2ef50, "1e+21"),
            (0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"),
            (0x3eb0c6f7a0b5ed8d, "0.000001"),
            (0x41b3de4355555553, "333333333.3333332"),
            (0x41b3de4355555554, "333333333.33333325"),
            (0x41b3de4355555555, "333333333.3333333"),
            (0x41b3de4355555556, "333333333.3333334"),
            (0x41b3de4355555557, "333333333.33333343"),
            (0xbecbf647612f3696, "-0.0000033333333333333333"),
            (0x43143ff3c1cb0959, "1424953923781206.2"),
        ];
        for &(bits, expected) in vectors {
            assert_eq!(jcs(&format!("[{expected}]")), format!("[{expected}]"));
            if bits == 0x43143ff3c1cb0959 {
                continue; // Rust writes 1424953923781206.3, JavaScript ...206.2
            }
            let text = format!("[{:?}]", f64::from_bits(bits));
            assert_eq!(
                jcs(&text),
                format!("[{expected}]"),
                "bits {bits:016x} ({text})"
            );
        }
    }

    /// Number spellings from the RFC text and the brief, as a client would write them.
    #[test]
    fn rfc8785_number_spellings() {
        let vectors: &[(&str, &str)] = &[
            ("0", "0"),
            ("-0", "0"),
            ("-0.0", "0"),
            ("1e21", "1e+21"),
            ("1e-7", "1e-7"),
            ("0.000001", "0.000001"),
            ("5e-324", "5e-324"),
            ("1.7976931348623157e308", "1.7976931348623157e+308"),
            ("9007199254740992", "9007199254740992"),
            ("4.50", "4.5"),
            ("2e-3", "0.002"),
            ("1E30", "1e+30"),
            ("0.000000000000000000000000001", "1e-27"),
            ("-1.0", "-1"),
            ("1.0", "1"),
            ("1e0", "1"),
            ("100E-2", "1"),
            ("1e20", "100000000000000000000"),
            ("0.1e1", "1"),
            ("-12.50e-1", "-1.25"),
            ("1234567e-13", "1.234567e-7"),
            ("123e-9", "1.23e-7"),
            ("123e-8", "0.00000123"),
            ("1e400", "1e+400"),
            // Where JCS rounds to a double first, the exact value is kept (SPEC section 4,
            // docs/IDENTITY.md): 64-bit ids are everywhere and must not collide.
            ("333333333.33333329", "333333333.33333329"),
            ("12345678901234567890", "12345678901234567890"),
            ("-9223372036854775808", "-9223372036854775808"),
            ("9007199254740993", "9007199254740993"),
            (
                "123456789012345678901234567890",
                "1.2345678901234567890123456789e+29",
            ),
            ("1.0000000000000000000001", "1.0000000000000000000001"),
        ];
        for &(input, expected) in vectors {
            assert_eq!(
                jcs(&format!("[{input}]")),
                format!("[{expected}]"),
                "{input}"
            );
        }
    }

    /// Guards the `float_roundtrip` dependency: these decimals are known to be parsed one
    /// ULP off by serde_json's default (fast, approximate) float parser.
    #[test]
    fn float_parse_is_exact() {
        for text in [
            "1014.5449131979983",
            "117.63331139400017",
            "1.5777777777770001",
        ] {
            assert_eq!(jcs(&format!("[{text}]")), format!("[{text}]"));
        }
    }

    /// RFC 8785 §3.2.2 example (string escaping, literals, numbers) and sorted members. Its
    /// `333333333.33333329` is written as the double it rounds to: by exact value it is
    /// another number (see `rfc8785_number_spellings`).
    #[test]
    fn rfc8785_section_3_2_2_example() {
        let input = r#"{
          "numbers": [333333333.3333333, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
          "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
          "literals": [null, true, false]
        }"#;
        let expected = "{\"literals\":[null,true,false],\
            \"numbers\":[333333333.3333333,1e+30,4.5,0.002,1e-27],\
            \"string\":\"\u{20ac}$\\u000f\\nA'B\\\"\\\\\\\\\\\"/\"}";
        assert_eq!(jcs(input), expected);
    }

    /// RFC 8785 §3.2.3: members sorted by UTF-16 code units, not UTF-8 bytes or chars
    /// (U+1F600 is the surrogate pair D83D DE00, so it sorts before U+FB33).
    #[test]
    fn rfc8785_section_3_2_3_sorting() {
        let input = r#"{
          "\u20ac": "Euro Sign",
          "\r": "Carriage Return",
          "\ufb33": "Hebrew Letter Dalet With Dagesh",
          "1": "One",
          "\ud83d\ude00": "Emoji: Grinning Face",
          "\u0080": "Control",
          "\u00f6": "Latin Small Letter O With Diaeresis"
        }"#;
        let expected = "{\"\\r\":\"Carriage Return\",\"1\":\"One\",\"\u{80}\":\"Control\",\
            \"\u{f6}\":\"Latin Small Letter O With Diaeresis\",\"\u{20ac}\":\"Euro Sign\",\
            \"\u{1f600}\":\"Emoji: Grinning Face\",\
            \"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"}";
        assert_eq!(jcs(input), expected);
    }

    /// The reference implementation's `weird.json`: "</script>" and U+007F stay verbatim.
    #[test]
    fn rfc8785_reference_weird_json() {
        let input = r#"{
          "\u20ac": "Euro Sign",
          "\r": "Carriage Return",
          "\u000a": "Newline",
          "1": "One",
          "\u0080": "Control\u007f",
          "\ud83d\ude02": "Smiley",
          "\u00f6": "Latin Small Letter O With Diaeresis",
          "\ufb33": "Hebrew Letter Dalet With Dagesh",
          "</script>": "Browser Challenge"
        }"#;
        let expected = "{\"\\n\":\"Newline\",\"\\r\":\"Carriage Return\",\"1\":\"One\",\
            \"</script>\":\"Browser Challenge\",\"\u{80}\":\"Control\u{7f}\",\
            \"\u{f6}\":\"Latin Small Letter O With Diaeresis\",\"\u{20ac}\":\"Euro Sign\",\
            \"\u{1f602}\":\"Smiley\",\"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"}";
        assert_eq!(jcs(input), expected);
    }

    #[test]
    fn control_characters_use_short_or_lowercase_escapes() {
        assert_eq!(
            jcs(r#"["\u0008\u0009\u000C\u001F\u0000\u001b"]"#),
            r#"["\b\t\f\u001f\u0000\u001b"]"#
        );
    }

    #[test]
    fn nested_structures_canonicalise() {
        assert_eq!(
            jcs(r#" { "b" : [ { "z":1, "y" : [ ] } ], "a":{ } } "#),
            r#"{"a":{},"b":[{"y":[],"z":1}]}"#
        );
    }

    #[test]
    fn a_repeated_member_is_named_by_its_pointer() {
        for (body, at) in [
            (r#"{"to":"a","to":"b"}"#, "/to"),
            (r#"{"a":[{"b":1},{"x":{"t/o":1,"t/o":2}}]}"#, "/a/1/x/t~1o"),
            (r#"[0,{"~":1,"\u007e":2}]"#, "/1/~0"),
        ] {
            assert_eq!(
                canonical_json(body.as_bytes(), &[]),
                Err(JsonError::Ambiguous(at.to_string())),
                "{body}"
            );
        }
    }

    #[test]
    fn json_that_jcs_cannot_represent_is_not_canonicalised() {
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        for bad in [
            "",
            "{",
            "[1e9999999999999999]",
            r#"["\ud800"]"#,
            "{\"a\":1} x",
            "[NaN]",
            "[01]",
            "[1.]",
            "[.5]",
            "[-]",
            "[1e]",
            "[+1]",
            &deep,
        ] {
            assert_eq!(
                canonical_json(bad.as_bytes(), &[]),
                Err(JsonError::NotJson),
                "{bad:?}"
            );
        }
        // Beyond a double's range is still a number: compared by its exact value.
        assert_eq!(jcs("[1e400]"), "[1e+400]");
    }

    // ---- args_hash behaviour ----

    #[test]
    fn hash_is_lowercase_sha256_hex() {
        let h = Req::json("{}").h();
        assert_eq!(h.len(), 64);
        assert!(h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')));
    }

    #[test]
    fn json_spelling_does_not_change_hash() {
        let base = Req::json(r#"{"to":"a@b.c","n":1,"opts":{"x":true,"y":null}}"#).h();
        for same in [
            r#"{"opts":{"y":null,"x":true},"n":1,"to":"a@b.c"}"#,
            "{ \"to\" : \"a@b.c\" ,\n\t\"n\" : 1.0, \"opts\":{\"x\":true,\"y\":null} }",
            r#"{"to":"a@b.c","n":1e0,"opts":{"x":true,"y":null}}"#,
            r#"{"to":"a\u0040b.c","n":10E-1,"opts":{"x":true,"y":null}}"#,
        ] {
            assert_eq!(Req::json(same).h(), base, "{same}");
        }
    }

    #[test]
    fn changed_json_value_changes_hash() {
        let base = Req::json(r#"{"to":"a@b.c","n":1}"#).h();
        for other in [
            r#"{"to":"a@b.d","n":1}"#,
            r#"{"to":"a@b.c","n":2}"#,
            r#"{"to":"a@b.c","n":"1"}"#,
            r#"{"to":"a@b.c","n":1,"extra":null}"#,
            r#"{"to":"a@b.c"}"#,
            r#"[{"to":"a@b.c","n":1}]"#,
        ] {
            assert_ne!(Req::json(other).h(), base, "{other}");
        }
    }

    #[test]
    fn json_content_type_variants() {
        let body = r#"{"b":1,"a":2}"#;
        let reordered = r#"{"a":2,"b":1}"#;
        for ct in [
            "application/json",
            "Application/JSON; charset=utf-8",
            "application/problem+json",
            "application/vnd.api+json ; ext=x",
        ] {
            let mut a = Req::raw(body.as_bytes());
            a.header("content-type", ct);
            let mut b = Req::raw(reordered.as_bytes());
            b.header("content-type", ct);
            assert_eq!(a.h(), b.h(), "{ct}");
        }
        // Not JSON by content type: raw bytes, so key order matters.
        for ct in ["text/plain", "application/jsonx", "text/json-ish"] {
            let mut a = Req::raw(body.as_bytes());
            a.header("content-type", ct);
            let mut b = Req::raw(reordered.as_bytes());
            b.header("content-type", ct);
            assert_ne!(a.h(), b.h(), "{ct}");
        }
        assert_ne!(
            Req::raw(body.as_bytes()).h(),
            Req::raw(reordered.as_bytes()).h()
        );
    }

    #[test]
    fn invalid_json_is_hashed_raw() {
        let a = Req::json(r#"{"a":1"#);
        assert_eq!(a.h(), Req::json(r#"{"a":1"#).h());
        assert_ne!(a.h(), Req::json(r#"{"a": 1"#).h());
        // Out-of-range numbers are not silently collapsed to one value.
        assert_ne!(Req::json("[1e400]").h(), Req::json("[1e401]").h());
    }

    #[test]
    fn canonical_and_raw_bodies_never_collide() {
        let text = r#"{"a":1}"#;
        let mut plain = Req::raw(text.as_bytes());
        plain.header("content-type", "text/plain");
        assert_ne!(Req::json(text).h(), plain.h());
    }

    #[test]
    fn ignore_json_removes_fields() {
        let spec = ignoring(&["/client_ts"]);
        let a = Req::json(r#"{"to":"x","client_ts":1700000000}"#).hash(&spec);
        let b = Req::json(r#"{"client_ts":1800000000,"to":"x"}"#).hash(&spec);
        let c = Req::json(r#"{"to":"x"}"#).hash(&spec);
        assert_eq!(a, b);
        assert_eq!(a, c);
        assert_ne!(a, Req::json(r#"{"to":"y","client_ts":1}"#).hash(&spec));
        // Without the pointer the field counts.
        assert_ne!(
            Req::json(r#"{"to":"x","client_ts":1}"#).h(),
            Req::json(r#"{"to":"x","client_ts":2}"#).h()
        );
    }

    #[test]
    fn ignore_json_pointer_forms() {
        assert_eq!(
            jcs_ignoring(
                r#"{"a/b":1,"m~n":2,"a":{"b":3},"k":4}"#,
                &["/a~1b", "/m~0n"]
            ),
            r#"{"a":{"b":3},"k":4}"#
        );
        assert_eq!(
            jcs_ignoring(r#"{"arr":[10,20,30],"x":1}"#, &["/arr/0"]),
            r#"{"arr":[20,30],"x":1}"#
        );
        assert_eq!(
            jcs_ignoring(
                r#"{"items":[{"id":1,"ts":5},{"id":2,"ts":6}]}"#,
                &["/items/1/ts"]
            ),
            r#"{"items":[{"id":1,"ts":5},{"id":2}]}"#
        );
        assert_eq!(jcs_ignoring(r#"{"":1,"a":2}"#, &["/"]), r#"{"a":2}"#);
        // Array pointers address the document as sent, whatever their listed order.
        for order in [["/arr/0", "/arr/2"], ["/arr/2", "/arr/0"]] {
            assert_eq!(
                jcs_ignoring(r#"{"arr":["a","b","c","d"]}"#, &order),
                r#"{"arr":["b","d"]}"#
            );
        }
        // An ancestor and a descendant together: the ancestor goes.
        assert_eq!(
            jcs_ignoring(r#"{"a":{"b":1},"c":2}"#, &["/a/b", "/a"]),
            r#"{"c":2}"#
        );
        // Duplicates remove once.
        assert_eq!(
            jcs_ignoring(r#"{"arr":[1,2,3]}"#, &["/arr/0", "/arr/0"]),
            r#"{"arr":[2,3]}"#
        );
    }

    #[test]
    fn ignore_json_missing_targets_are_fine() {
        let doc = r#"{"a":[1,2],"b":{"c":3},"s":"str"}"#;
        let untouched = jcs(doc);
        for p in [
            "/zz", "/a/2", "/a/-", "/a/01", "/a/x", "/b/c/d", "/s/0", "/a/0/x",
        ] {
            assert_eq!(jcs_ignoring(doc, &[p]), untouched, "{p}");
        }
        // A root array works too.
        assert_eq!(jcs_ignoring("[1,2,3]", &["/1"]), "[1,3]");
    }

    #[test]
    fn validate_pointer_rules() {
        for ok in ["/client_ts", "/a~1b", "/m~0n", "/arr/0", "/", "//", "/a/-"] {
            assert!(validate_pointer(ok).is_ok(), "{ok}");
        }
        for bad in ["", "client_ts", "/a~", "/a~2", "/~x"] {
            let err = validate_pointer(bad).expect_err(bad);
            assert!(!err.is_empty());
        }
    }

    #[test]
    fn query_order_does_not_matter_but_values_do() {
        let with = |q: &'static str| {
            let mut r = Req::raw(b"");
            r.method = Method::GET;
            r.query = Some(q);
            r.h()
        };
        assert_eq!(with("a=1&b=2&a=0"), with("b=2&a=1&a=0"));
        // Repeated names keep their order: most servers read them as a list.
        assert_ne!(with("a=1&a=2"), with("a=2&a=1"));
        assert_ne!(with("a=1&b=2&a=0"), with("b=2&a=0&a=1"));
        assert_eq!(with("x=hello%20world"), with("x=hello+world"));
        assert_eq!(with("a=1&&b=2"), with("b=2&a=1"));
        assert_ne!(with("a=1&b=2"), with("a=2&b=1"));
        assert_ne!(with("a=1"), with("a=1&a=1"));
        assert_ne!(with("a=%2526"), with("a=%26"));
        // Lossy UTF-8 decoding must not make different bytes collide.
        assert_ne!(with("a=%FF"), with("a=%FE"));
        assert_eq!(with(""), {
            let mut r = Req::raw(b"");
            r.method = Method::GET;
            r.h()
        });
    }

    #[test]
    fn form_body_pair_order_does_not_matter() {
        let form = |body: &str| {
            let mut r = Req::raw(body.as_bytes());
            r.header(
                "content-type",
                "application/x-www-form-urlencoded; charset=UTF-8",
            );
            r.h()
        };
        assert_eq!(form("to=a%40b.c&subject=hi"), form("subject=hi&to=a@b.c"));
        assert_ne!(form("to=a%40b.c&subject=hi"), form("to=a%40b.c&subject=ho"));
        // A form body is not the same as the same pairs in the query string.
        let mut q = Req::raw(b"");
        q.query = Some("to=a%40b.c&subject=hi");
        assert_ne!(form("to=a%40b.c&subject=hi"), q.h());
    }

    #[test]
    fn listed_headers_count_unlisted_do_not() {
        let spec = FingerprintSpec {
            ignore_json: vec![],
            headers: vec![HeaderName::from_static("x-account")],
        };
        let mut a = Req::json("{}");
        a.header("x-account", "acme").header("x-trace", "1");
        let mut b = Req::json("{}");
        b.header("x-account", "acme").header("x-trace", "2");
        let mut c = Req::json("{}");
        c.header("x-account", "other").header("x-trace", "1");
        assert_eq!(a.hash(&spec), b.hash(&spec));
        assert_ne!(a.hash(&spec), c.hash(&spec));

        let mut empty = Req::json("{}");
        empty.header("x-account", "");
        let missing = Req::json("{}");
        assert_ne!(empty.hash(&spec), missing.hash(&spec));

        // Repeated values count, in order.
        let mut twice = Req::json("{}");
        twice
            .header("x-account", "acme")
            .header("x-account", "acme");
        assert_ne!(twice.hash(&spec), a.hash(&spec));
    }

    #[test]
    fn method_upstream_route_path_each_count() {
        let base = Req::json("{}");
        let h = base.h();
        let mut r = Req::json("{}");
        r.method = Method::PUT;
        assert_ne!(r.h(), h);
        let mut r = Req::json("{}");
        r.upstream = "mail2";
        assert_ne!(r.h(), h);
        let mut r = Req::json("{}");
        r.route = "send_email2";
        assert_ne!(r.h(), h);
        let mut r = Req::json("{}");
        r.path = "/send/";
        assert_ne!(r.h(), h);
        // Length prefixes: moving bytes between adjacent fields changes the hash.
        let mut a = Req::json("{}");
        a.upstream = "ab";
        a.route = "c";
        let mut b = Req::json("{}");
        b.upstream = "a";
        b.route = "bc";
        assert_ne!(a.h(), b.h());
        assert_eq!(Req::json("{}").h(), h, "deterministic");
    }

    // ---- properties: spelling never changes the canonical form, a value always does ----

    mod properties {
        use super::super::canonical_json;
        use proptest::prelude::*;

        /// A JSON value by meaning: numbers as (sign, digits, exponent), members unique.
        #[derive(Clone, Debug)]
        enum J {
            Null,
            Bool(bool),
            Num { neg: bool, digits: String, exp: i32 },
            Str(String),
            Arr(Vec<J>),
            Obj(Vec<(String, J)>),
        }

        fn number() -> impl Strategy<Value = J> {
            (any::<bool>(), "[1-9][0-9]{0,24}", -30i32..30).prop_map(|(neg, digits, exp)| J::Num {
                neg,
                digits,
                exp,
            })
        }

        fn value() -> impl Strategy<Value = J> {
            let leaf = prop_oneof![
                Just(J::Null),
                any::<bool>().prop_map(J::Bool),
                number(),
                "[a-z\\u{e9}\\\\\"\\n ]{0,6}".prop_map(J::Str),
            ];
            leaf.prop_recursive(4, 32, 5, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..5).prop_map(J::Arr),
                    prop::collection::btree_map("[a-z]{1,3}", inner, 0..5)
                        .prop_map(|m| J::Obj(m.into_iter().collect())),
                ]
            })
        }

        /// One way of writing a number: `digits` × 10^`exp`, moved, padded and signed as
        /// `style` says. Every style has the same exact value.
        fn spell_number(neg: bool, digits: &str, exp: i32, style: u8) -> String {
            let sign = if neg { "-" } else { "" };
            let k = digits.len() as i32;
            match style % 5 {
                0 => format!("{sign}{digits}e{exp}"),
                1 => format!("{sign}{digits}00E{}", exp - 2),
                2 => format!("{sign}{}.{}0e+{}", &digits[..1], &digits[1..], exp + k - 1)
                    .replace("e+-", "e-"),
                3 if (0..8).contains(&exp) => format!("{sign}{digits}{}", "0".repeat(exp as usize)),
                4 if (-8..0).contains(&exp) && (-exp) < k => {
                    let point = (k + exp) as usize;
                    format!("{sign}{}.{}000", &digits[..point], &digits[point..])
                }
                _ => format!("{sign}0.{digits}e{}", exp + k),
            }
        }

        /// Writes `j` with member order rotated, whitespace and number spelling chosen by
        /// `seed`: the same value, spelt differently for every seed.
        fn spell(j: &J, seed: u64, out: &mut String) {
            let ws = [" ", "", "\n", "\t "][(seed % 4) as usize];
            match j {
                J::Null => out.push_str("null"),
                J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
                J::Num { neg, digits, exp } => {
                    out.push_str(&spell_number(*neg, digits, *exp, (seed % 7) as u8))
                }
                J::Str(s) => out.push_str(&serde_json::to_string(s).expect("string")),
                J::Arr(items) => {
                    out.push('[');
                    for (i, item) in items.iter().enumerate() {
                        if i > 0 {
                            out.push(',');
                        }
                        out.push_str(ws);
                        spell(item, seed.rotate_left(i as u32 + 3), out);
                    }
                    out.push(']');
                }
                J::Obj(members) => {
                    out.push('{');
                    let n = members.len().max(1);
                    for i in 0..members.len() {
                        let (name, value) = &members[(i + seed as usize) % n];
                        if i > 0 {
                            out.push(',');
                        }
                        out.push_str(ws);
                        out.push_str(&serde_json::to_string(name).expect("name"));
                        out.push(':');
                        out.push_str(ws);
                        spell(value, seed.rotate_left(i as u32 + 7), out);
                    }
                    out.push('}');
                }
            }
        }

        fn text(j: &J, seed: u64) -> String {
            let mut s = String::new();
            spell(j, seed, &mut s);
            s
        }

        /// `digits` + 1, as decimal text.
        fn plus_one(digits: &str) -> String {
            let mut d: Vec<u8> = digits.bytes().collect();
            for i in (0..d.len()).rev() {
                if d[i] == b'9' {
                    d[i] = b'0';
                } else {
                    d[i] += 1;
                    return String::from_utf8(d).expect("ascii");
                }
            }
            format!("1{}", String::from_utf8(d).expect("ascii"))
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

            #[test]
            fn respelling_never_changes_the_canonical_form(j in value(), a: u64, b: u64) {
                let (x, y) = (text(&j, a), text(&j, b));
                let cx = canonical_json(x.as_bytes(), &[]).expect("valid");
                let cy = canonical_json(y.as_bytes(), &[]).expect("valid");
                prop_assert_eq!(cx, cy, "{} / {}", x, y);
            }

            #[test]
            fn a_number_one_unit_apart_always_changes_it(
                j in value(),
                (neg, digits, exp) in (any::<bool>(), "[1-9][0-9]{0,24}", -30i32..30),
                seed: u64,
            ) {
                let doc = |digits: String| J::Obj(vec![
                    ("n".into(), J::Num { neg, digits, exp }),
                    ("rest".into(), j.clone()),
                ]);
                let a = text(&doc(digits.clone()), seed);
                let b = text(&doc(plus_one(&digits)), seed);
                let ca = canonical_json(a.as_bytes(), &[]).expect("valid");
                let cb = canonical_json(b.as_bytes(), &[]).expect("valid");
                prop_assert_ne!(ca, cb, "{} / {}", a, b);
            }
        }
    }
}
