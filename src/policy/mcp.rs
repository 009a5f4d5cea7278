//! MCP policy (SPEC section 11): which JSON-RPC messages are side-effecting `tools/call`s,
//! which tool policy applies, the call's key (headers or `params._meta`), its `args_hash`
//! (tool name + canonical `arguments`), and the JSON rewrites the lifecycle needs (the
//! execution id into `params._meta`, a stored response under a retry's id). JSON is read
//! with jiter and rewritten by splicing the members' own bytes, so a replayed `result`
//! is the same JSON text the server sent, not a re-serialised copy.

use std::borrow::Cow;

use crate::config::{Class, IdentityConfig, McpConfig, Route, Unlisted};
use crate::policy::fingerprint::{args_hash as hash_request, AmbiguousBody, RequestParts};
use crate::policy::identity::{self, ArgsHash, KeyLookup};
use crate::wire::headers::HeaderLookup;

/// The `params._meta` member the execution id goes downstream in.
pub const EXECUTION_META: &str = "io.idemproxy/execution_id";

/// An object's members, in order: each name (decoded) with its value's raw JSON bytes.
/// `None` when `json` is not one valid JSON object.
pub fn members(json: &[u8]) -> Option<Vec<(String, &[u8])>> {
    let mut p = jiter::Jiter::new(json);
    let mut out = Vec::new();
    let mut key = p.next_object().ok()?.map(str::to_string);
    while let Some(k) = key {
        let start = p.current_index();
        p.next_skip().ok()?;
        let end = p.current_index();
        out.push((k, trim(&json[start..end])));
        key = p.next_key().ok()?.map(str::to_string);
    }
    p.finish().ok()?;
    Some(out)
}

fn trim(mut b: &[u8]) -> &[u8] {
    while let [first, rest @ ..] = b {
        if matches!(first, b' ' | b'\t' | b'\n' | b'\r' | b':' | b',') {
            b = rest;
        } else {
            break;
        }
    }
    while let [rest @ .., last] = b {
        if last.is_ascii_whitespace() {
            b = rest;
        } else {
            break;
        }
    }
    b
}

fn member<'a>(m: &[(String, &'a [u8])], name: &str) -> Option<&'a [u8]> {
    m.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
}

fn string(raw: &[u8]) -> Option<String> {
    jiter::Jiter::new(raw).next_str().ok().map(str::to_string)
}

/// An object rebuilt from `members` with `set` members replaced in place (or appended),
/// every other member as its own bytes.
pub fn rewrite(members: &[(String, &[u8])], set: &[(&str, &[u8])]) -> Vec<u8> {
    let mut out = Vec::with_capacity(members.iter().map(|(n, v)| n.len() + v.len() + 4).sum());
    out.push(b'{');
    let mut first = true;
    let mut put = |out: &mut Vec<u8>, name: &str, value: &[u8]| {
        if !first {
            out.push(b',');
        }
        first = false;
        out.extend_from_slice(
            serde_json::to_string(name)
                .expect("a string serialises")
                .as_bytes(),
        );
        out.push(b':');
        out.extend_from_slice(value);
    };
    for (n, v) in members {
        let value = set.iter().find(|(s, _)| s == n).map_or(*v, |(_, v)| *v);
        put(&mut out, n, value);
    }
    for (n, v) in set {
        if !members.iter().any(|(m, _)| m == n) {
            put(&mut out, n, v);
        }
    }
    out.push(b'}');
    out
}

/// What a POST body to an MCP endpoint is, as far as the proxy cares.
pub enum Message<'a> {
    /// One `tools/call` request.
    ToolCall(ToolCall<'a>),
    /// A JSON-RPC batch array; the names of the tools its `tools/call` requests call.
    Batch(Vec<String>),
    /// Not one JSON object or array the proxy can read (not JSON, NaN, a repeated member
    /// name in the message or its `params`): which method or tool the server would see is
    /// not knowable, so it is refused rather than passed through unprotected.
    Unreadable,
    /// Anything else (another method, a notification, a response): passed through.
    Other,
}

/// A `tools/call` request's parts, as raw JSON slices of the body.
pub struct ToolCall<'a> {
    /// The JSON-RPC `id`'s own bytes (`null` if absent).
    pub id: &'a [u8],
    pub name: String,
    /// `params._meta`, if any.
    pub meta: Option<&'a [u8]>,
    top: Vec<(String, &'a [u8])>,
    params: Vec<(String, &'a [u8])>,
}

/// Read a POST body sent to an MCP endpoint.
pub fn parse(body: &[u8]) -> Message<'_> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first == Some(&b'[') {
        return match batch_tools(body) {
            Some(names) => Message::Batch(names),
            None => Message::Unreadable,
        };
    }
    one(body)
}

fn one(body: &[u8]) -> Message<'_> {
    let Some(top) = members(body).filter(|m| unique(m)) else {
        return Message::Unreadable;
    };
    if member(&top, "method").and_then(string).as_deref() != Some("tools/call") {
        return Message::Other;
    }
    // A tools/call whose params cannot be read for sure is refused: the server might read
    // a tool the proxy did not.
    let Some(params) = member(&top, "params")
        .and_then(members)
        .filter(|m| unique(m))
    else {
        return Message::Unreadable;
    };
    let Some(name) = member(&params, "name").and_then(string) else {
        return Message::Unreadable;
    };
    Message::ToolCall(ToolCall {
        id: member(&top, "id").unwrap_or(b"null"),
        name,
        meta: member(&params, "_meta"),
        top,
        params,
    })
}

fn unique(members: &[(String, &[u8])]) -> bool {
    let mut names: Vec<&str> = members.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    names.windows(2).all(|w| w[0] != w[1])
}

/// The tools a batch calls; `None` when any element is unreadable (the batch is then
/// refused as a whole).
fn batch_tools(body: &[u8]) -> Option<Vec<String>> {
    let mut p = jiter::Jiter::new(body);
    let mut names = Vec::new();
    let mut next = p.next_array().ok()?;
    while next.is_some() {
        let start = p.current_index();
        p.next_skip().ok()?;
        let raw = trim(&body[start..p.current_index()]);
        match one(raw) {
            Message::ToolCall(call) => names.push(call.name),
            Message::Other => {}
            _ => return None,
        }
        next = p.array_step().ok()?;
    }
    p.finish().ok()?;
    Some(names)
}

/// How a tool is handled.
// Returned once and matched at once; a box would cost an allocation per listed tool call.
#[allow(clippy::large_enum_variant)]
pub enum Tool<'a> {
    ReadOnly,
    /// Runs under an execution record, with this policy (named after the tool).
    SideEffect(Cow<'a, Route>),
    /// Unlisted under `unlisted: reject`.
    Rejected,
    /// Unlisted under `unlisted: by_annotations`: the server's `readOnlyHint` decides
    /// ([`unlisted_side_effect`] if it is not `true`).
    ByAnnotations,
}

/// The policy of the tool `name` (the YAML entry, else `unlisted`).
pub fn classify<'a>(mcp: &'a McpConfig, name: &str) -> Tool<'a> {
    match mcp.tools.iter().find(|t| t.name == name) {
        Some(t) if t.class == Class::ReadOnly => Tool::ReadOnly,
        Some(t) => Tool::SideEffect(Cow::Borrowed(t)),
        None => match mcp.unlisted {
            Unlisted::Reject => Tool::Rejected,
            Unlisted::ByAnnotations => Tool::ByAnnotations,
            Unlisted::SideEffect => Tool::SideEffect(unlisted_side_effect(mcp, name)),
        },
    }
}

/// The policy of an unlisted side-effecting tool: the upstream's `unlisted` route, named
/// after the tool.
pub fn unlisted_side_effect<'a>(mcp: &McpConfig, name: &str) -> Cow<'a, Route> {
    let mut r = mcp.unlisted_route.clone();
    r.name = name.to_string();
    Cow::Owned(r)
}

/// The tools a `tools/list` result marks `readOnlyHint: true`, every listed tool named,
/// and the next page's cursor.
pub fn tool_hints(result: &serde_json::Value) -> (Vec<(String, bool)>, Option<String>) {
    let tools = result["tools"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    let hints = tools
        .iter()
        .filter_map(|t| {
            let name = t["name"].as_str()?;
            let read_only = t["annotations"]["readOnlyHint"] == serde_json::Value::Bool(true);
            Some((name.to_string(), read_only))
        })
        .collect();
    let next = result["nextCursor"].as_str().map(str::to_string);
    (hints, next)
}

/// Whether any of a batch's tool calls is side-effecting (or refused): such a batch is
/// refused whole.
pub fn batch_has_side_effect(mcp: &McpConfig, names: &[String]) -> bool {
    names
        .iter()
        .any(|n| !matches!(classify(mcp, n), Tool::ReadOnly))
}

/// The call's key (SPEC section 11): the key header or the `derive_from` headers as for
/// HTTP; else the `identity.key_meta` field; else the `identity.derive_from_meta` fields
/// joined with the tool name and version. Never the JSON-RPC id or the session.
pub fn find_key<H: HeaderLookup + ?Sized>(
    headers: &H,
    call: &ToolCall<'_>,
    id: &IdentityConfig,
    route: &Route,
    max_key_bytes: usize,
) -> KeyLookup {
    match identity::find_key(headers, id, route, max_key_bytes) {
        KeyLookup::Missing => {}
        found => return found,
    }
    let meta = call.meta.and_then(members).unwrap_or_default();
    if let Some(field) = &id.key_meta {
        if let Some(raw) = member(&meta, field) {
            return match string(raw) {
                Some(k) => check(k, max_key_bytes, field),
                None => KeyLookup::Invalid(format!("_meta field {field} is not a string")),
            };
        }
    }
    if id.derive_from_meta.is_empty() {
        return KeyLookup::Missing;
    }
    let mut parts = Vec::with_capacity(id.derive_from_meta.len() + 2);
    for field in &id.derive_from_meta {
        let Some(raw) = member(&meta, field) else {
            return KeyLookup::Missing;
        };
        let value = match string(raw) {
            Some(s) => s,
            // A number is read as it was written.
            None if raw
                .first()
                .is_some_and(|b| *b == b'-' || b.is_ascii_digit()) =>
            {
                String::from_utf8_lossy(raw).into_owned()
            }
            None => {
                return KeyLookup::Invalid(format!("_meta field {field} is not a string or number"))
            }
        };
        let value = value.trim().to_string();
        if value.is_empty() || !value.bytes().all(|b| (0x21..0x7f).contains(&b)) {
            return KeyLookup::Invalid(format!(
                "_meta field {field} is empty or not visible ASCII"
            ));
        }
        parts.push(value);
    }
    parts.push(route.name.clone());
    parts.push(route.tool_version.clone());
    let refs: Vec<&str> = parts.iter().map(String::as_str).collect();
    check(identity::join_parts(&refs), max_key_bytes, "derived key")
}

/// The orchestration ids `params._meta` names, read as the headers' defaults read
/// `derive_from`: the parent operation (for cancellation) is the first
/// `identity.derive_from_meta` field, the tool call the last (when there are two or more),
/// the model round the second (when there are three or more).
pub fn correlation(call: &ToolCall<'_>, id: &IdentityConfig) -> identity::Correlation {
    let fields = &id.derive_from_meta;
    let Some(meta) = call.meta.and_then(members) else {
        return identity::Correlation::default();
    };
    let value = |field: Option<&String>| {
        let v = string(member(&meta, field?)?)?;
        let v = v.trim();
        (!v.is_empty() && v.len() <= 255).then(|| v.to_string())
    };
    identity::Correlation {
        operation_id: value(fields.first()),
        model_round: value(fields.get(1).filter(|_| fields.len() > 2)),
        tool_call_id: value(fields.last().filter(|_| fields.len() > 1)),
    }
}

fn check(k: String, max: usize, what: &str) -> KeyLookup {
    if k.is_empty() {
        KeyLookup::Invalid(format!("{what} is empty"))
    } else if k.len() > max {
        KeyLookup::Invalid(format!(
            "{what} is {} bytes, longer than the {max}-byte limit",
            k.len()
        ))
    } else if !k.bytes().all(|b| (0x21..0x7f).contains(&b)) {
        KeyLookup::Invalid(format!(
            "{what} is not a valid key (visible ASCII only, no spaces)"
        ))
    } else {
        KeyLookup::Found {
            key: k,
            source: identity::KeySource::Client,
        }
    }
}

/// `args_hash` of a tool call: the canonical JSON of the message (section 4's encoding,
/// through `fingerprint::args_hash`) without its `id`, `jsonrpc` and `params._meta`, so
/// it covers the method, the tool name and `arguments` (with the tool's `ignore_json`
/// pointers, relative to the arguments, left out). A repeated member name anywhere is
/// refused.
pub fn args_hash(upstream: &str, route: &Route, body: &[u8]) -> Result<ArgsHash, AmbiguousBody> {
    let mut spec = route.fingerprint.clone();
    spec.ignore_json = ["/id", "/jsonrpc", "/params/_meta"]
        .into_iter()
        .map(str::to_string)
        .chain(
            route
                .fingerprint
                .ignore_json
                .iter()
                .map(|p| format!("/params/arguments{p}")),
        )
        .collect();
    let mut headers = http::HeaderMap::new();
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    hash_request(
        &RequestParts {
            method: &http::Method::POST,
            upstream,
            route: &route.name,
            path: "tools/call",
            query: None,
            headers: &headers,
            body,
        },
        &spec,
    )
}

/// The message as sent downstream: `params._meta["io.idemproxy/execution_id"]` set to the
/// execution id, every other member as the client sent it.
pub fn with_execution_id(call: &ToolCall<'_>, execution_id: &str) -> Vec<u8> {
    let value = serde_json::to_vec(execution_id).expect("a string serialises");
    let meta_members = call.meta.and_then(members).unwrap_or_default();
    let meta = rewrite(&meta_members, &[(EXECUTION_META, &value)]);
    let params = rewrite(&call.params, &[("_meta", &meta)]);
    rewrite(&call.top, &[("params", &params)])
}

/// The `arguments` of a tool call (for approval previews; pointers are relative to them).
pub fn arguments<'a>(call: &ToolCall<'a>) -> &'a [u8] {
    member(&call.params, "arguments").unwrap_or(b"{}")
}

/// How a downstream answer to a `tools/call` reads.
#[derive(Debug, PartialEq, Eq)]
pub enum Answer {
    /// The final JSON-RPC response (its own bytes); `internal_error`: an error response
    /// with code -32603, judged like a 5xx.
    Response {
        message: Vec<u8>,
        internal_error: bool,
    },
    /// No response to the call in the answer (a stream that ended early).
    Missing,
}

/// Find the JSON-RPC response to the request `id` in a downstream answer: the body itself
/// (`application/json`), or the event carrying it in an SSE stream.
pub fn answer(content_type: &str, body: &[u8], id: &[u8]) -> Answer {
    let found = if content_type
        .split(';')
        .next()
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("text/event-stream"))
    {
        let events = sse_events(body);
        // A re-send carries the first attempt's id: its response is the stream's last.
        let last = events.iter().rposition(|d| is_response(d));
        match events.iter().position(|d| is_response_to(d, id)).or(last) {
            Some(i) => events.into_iter().nth(i),
            None => None,
        }
    } else if is_response(body) {
        Some(body.to_vec())
    } else {
        None
    };
    match found {
        None => Answer::Missing,
        Some(message) => {
            let internal_error = members(&message)
                .and_then(|m| {
                    member(&m, "error")
                        .and_then(members)
                        .map(|e| member(&e, "code").is_some_and(|c| c == b"-32603"))
                })
                .unwrap_or(false);
            Answer::Response {
                message,
                internal_error,
            }
        }
    }
}

/// Whether a JSON-RPC message is a response (has `result` or `error`).
pub fn is_response(message: &[u8]) -> bool {
    members(message)
        .is_some_and(|m| member(&m, "result").is_some() || member(&m, "error").is_some())
}

fn is_response_to(message: &[u8], id: &[u8]) -> bool {
    let Some(m) = members(message) else {
        return false;
    };
    let has_outcome = member(&m, "result").is_some() || member(&m, "error").is_some();
    has_outcome && member(&m, "id").is_some_and(|got| same_json(got, id))
}

fn same_json(a: &[u8], b: &[u8]) -> bool {
    a == b
        || matches!(
            (
                serde_json::from_slice::<serde_json::Value>(a),
                serde_json::from_slice::<serde_json::Value>(b),
            ),
            (Ok(x), Ok(y)) if x == y
        )
}

/// The `data` of each event of an SSE stream (multi-line data joined with `\n`).
pub fn sse_events(body: &[u8]) -> Vec<Vec<u8>> {
    let mut events = Vec::new();
    let mut data: Option<Vec<u8>> = None;
    let text = body;
    for line in text.split(|b| *b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            if let Some(d) = data.take() {
                events.push(d);
            }
            continue;
        }
        if let Some(rest) = line.strip_prefix(b"data:") {
            let rest = rest.strip_prefix(b" ").unwrap_or(rest);
            match &mut data {
                Some(d) => {
                    d.push(b'\n');
                    d.extend_from_slice(rest);
                }
                None => data = Some(rest.to_vec()),
            }
        }
    }
    if let Some(d) = data {
        events.push(d);
    }
    events
}

/// A stored response under another request's `id` (a replay answers the retry's id).
pub fn under_id(message: &[u8], id: &[u8]) -> Vec<u8> {
    match members(message) {
        Some(m) => rewrite(&m, &[("id", id)]),
        None => message.to_vec(),
    }
}

/// Whether an `Accept` header takes only `text/event-stream` (a replay is then sent as a
/// one-event SSE stream); a missing header takes JSON.
pub fn wants_only_sse<'h>(accept: impl Iterator<Item = &'h [u8]>) -> bool {
    let mut sse = false;
    for value in accept {
        for item in String::from_utf8_lossy(value).split(',') {
            let t = item.split(';').next().unwrap_or("").trim();
            if t.eq_ignore_ascii_case("text/event-stream") {
                sse = true;
            } else if !t.is_empty() {
                return false;
            }
        }
    }
    sse
}

/// One JSON-RPC message as an SSE stream of one event.
pub fn sse_event(message: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(message.len() + 24);
    out.extend_from_slice(b"event: message\ndata: ");
    out.extend_from_slice(message);
    out.extend_from_slice(b"\n\n");
    out
}

/// The JSON-RPC error code of a proxy decision (problem type name), in -32000..-32099.
pub fn error_code(problem: &str) -> i64 {
    match problem {
        "key-missing" => -32001,
        "key-invalid" => -32002,
        "key-mismatch" => -32003,
        "in-flight" => -32004,
        "outcome-unknown" => -32005,
        "approval-required" => -32006,
        "rejected" => -32007,
        "cancelled" => -32008,
        "store-unavailable" => -32009,
        "body-ambiguous" => -32010,
        "body-too-large" => -32011,
        "upstream-unavailable" | "upstream-timeout" => -32012,
        "response-too-large" => -32013,
        "tool-rejected" => -32014,
        "batch-invalid" | "batch-too-large" | "batch-duplicate-item" => -32015,
        _ => -32000,
    }
}

/// A JSON-RPC error response carrying an RFC 9457 problem as `error.data`.
pub fn error_response(id: &[u8], code: i64, message: &str, problem: &[u8]) -> Vec<u8> {
    let code = code.to_string();
    let message = serde_json::to_vec(message).expect("a string serialises");
    let error = rewrite(
        &[],
        &[
            ("code", code.as_bytes()),
            ("message", &message),
            ("data", problem),
        ],
    );
    rewrite(
        &[],
        &[("jsonrpc", b"\"2.0\""), ("id", id), ("error", &error)],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const CALL: &[u8] = br#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"send","arguments":{"to":"a","n":1.0},"_meta":{"progressToken":3,"op":"x"}}}"#;

    #[test]
    fn parses_a_tool_call_and_rewrites_meta() {
        let Message::ToolCall(call) = parse(CALL) else {
            panic!("a tools/call")
        };
        assert_eq!(call.name, "send");
        assert_eq!(call.id, b"7");
        let sent = with_execution_id(&call, "ex1");
        let v: serde_json::Value = serde_json::from_slice(&sent).unwrap();
        assert_eq!(v["params"]["_meta"][EXECUTION_META], "ex1");
        assert_eq!(v["params"]["_meta"]["progressToken"], 3);
        assert_eq!(v["params"]["arguments"]["to"], "a");
        assert_eq!(v["id"], 7);
    }

    /// `_meta` names operation, model round and tool call as `derive_from_meta` orders them.
    #[test]
    fn correlation_from_meta() {
        let body = br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"send","_meta":{"o":"op_1","r":"round_2","c":" call_3 "}}}"#;
        let Message::ToolCall(call) = parse(body) else {
            panic!("a tools/call")
        };
        let yaml = |fields: &str| {
            crate::config::from_yaml(
                &format!("identity: {{ derive_from_meta: [{fields}] }}\nupstreams:\n  - {{ name: m, url: http://127.0.0.1:1, routes: [] }}\n"),
                std::path::Path::new("t.yaml"),
            )
            .expect("valid")
            .identity
        };
        let all = correlation(&call, &yaml("o, r, c"));
        assert_eq!(all.operation_id.as_deref(), Some("op_1"));
        assert_eq!(all.model_round.as_deref(), Some("round_2"));
        assert_eq!(all.tool_call_id.as_deref(), Some("call_3"));
        let two = correlation(&call, &yaml("o, c"));
        assert_eq!(
            (two.model_round, two.tool_call_id.as_deref()),
            (None, Some("call_3"))
        );
        assert_eq!(correlation(&call, &yaml("o")).tool_call_id, None);
    }

    #[test]
    fn other_messages_and_batches() {
        assert!(matches!(
            parse(br#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#),
            Message::Other
        ));
        assert!(matches!(parse(b"not json"), Message::Unreadable));
        // A repeated name could make the server read another method or tool.
        assert!(matches!(
            parse(br#"{"jsonrpc":"2.0","id":1,"method":"tools/list","method":"tools/call","params":{"name":"x"}}"#),
            Message::Unreadable
        ));
        assert!(matches!(
            parse(br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"read","name":"write"}}"#),
            Message::Unreadable
        ));
        assert!(matches!(
            parse(br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x","arguments":{"n":NaN}}}"#),
            Message::Unreadable
        ));
        let Message::Batch(names) = parse(
            br#"[{"jsonrpc":"2.0","method":"notifications/initialized"}, {"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"x"}}]"#,
        ) else {
            panic!("a batch")
        };
        assert_eq!(names, vec!["x".to_string()]);
    }

    #[test]
    fn finds_the_response_in_sse_and_replays_under_another_id() {
        let sse = b"event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{}}\n\nevent: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{\"isError\":true,\"content\":[]}}\n\n";
        let Answer::Response {
            message,
            internal_error,
        } = answer("text/event-stream", sse, b"7")
        else {
            panic!("found")
        };
        assert!(!internal_error);
        assert_eq!(
            under_id(&message, b"\"r2\""),
            br#"{"jsonrpc":"2.0","id":"r2","result":{"isError":true,"content":[]}}"#.to_vec()
        );
        assert_eq!(
            answer("text/event-stream", b"event: message\n", b"7"),
            Answer::Missing
        );
        let Answer::Response { internal_error, .. } = answer(
            "application/json",
            br#"{"jsonrpc":"2.0","id":7,"error":{"code":-32603,"message":"x"}}"#,
            b"7",
        ) else {
            panic!("found")
        };
        assert!(internal_error);
    }

    #[test]
    fn accept_only_sse() {
        assert!(wants_only_sse([&b"text/event-stream"[..]].into_iter()));
        assert!(!wants_only_sse(
            [&b"application/json, text/event-stream"[..]].into_iter()
        ));
        assert!(!wants_only_sse(std::iter::empty()));
    }
}
