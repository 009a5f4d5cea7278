//! Header hygiene for a forward proxy: hop-by-hop headers (RFC 9110 section 7.6.1) never
//! cross the proxy in either direction, and the downstream sees `Host`, `X-Forwarded-*`
//! the way a well-behaved reverse proxy sets them.

use std::net::SocketAddr;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use smallvec::SmallVec;

// The proxy's own response headers, as names over static bytes: inserting a `&str` would
// copy the name into a fresh allocation per map, and every clone of such a name (a replay
// from memory clones its entry's map) would touch that allocation's reference count.
pub const EXECUTION_ID: HeaderName = HeaderName::from_static("idempotency-execution-id");
pub const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
pub const STATUS: HeaderName = HeaderName::from_static("idempotency-status");
/// On a result that came from a reconciliation lookup rather than the original answer.
pub const RECONCILED: HeaderName = HeaderName::from_static("idempotency-reconciled");

/// The hop-by-hop headers (RFC 9110 section 7.6.1 and the common non-standard ones), as
/// [`is_hop_by_hop_name`] tells them (a test holds the two to the same list).
#[cfg(test)]
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Remove hop-by-hop headers, including every header the `Connection` header names, and
/// `Expect: 100-continue` (answered by this proxy's server); a
/// `Transfer-Encoding` takes any `Content-Length` with it (RFC 9112 section 6.3: the
/// coding framed the message, so the length is stale; [`super::framing`]).
pub fn strip_hop_by_hop(h: &mut HeaderMap) {
    // One pass over the names finds what to remove, so only headers that are there cost a
    // hashed removal. Most requests carry none; most responses only `Connection:
    // keep-alive` (nine removals per response showed in the pass-through profile). Nothing
    // here allocates unless a `Connection` header names a header of its own.
    let mut found: SmallVec<[HeaderName; 4]> = SmallVec::new();
    let mut connection = false;
    let mut coded = false;
    let mut expect = false;
    for name in h.keys() {
        if is_hop_by_hop(name) {
            connection |= name == header::CONNECTION;
            coded |= name == header::TRANSFER_ENCODING;
            found.push(name.clone());
        } else if name == header::EXPECT {
            expect = true;
        }
    }
    // `100-continue` was the proxy's server's to answer, and it did: the upstream gets
    // the body without being asked. Other expectations go on (hyper ignores them).
    if expect
        && h.get_all(header::EXPECT)
            .iter()
            .all(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
    {
        found.push(header::EXPECT);
    }
    if coded {
        found.push(header::CONTENT_LENGTH);
    }
    if connection {
        let mut named: SmallVec<[HeaderName; 2]> = SmallVec::new();
        for value in h.get_all(header::CONNECTION) {
            for token in tokens(value.as_bytes()) {
                // Tokens that name a hop-by-hop header (`keep-alive`, `upgrade`) or are
                // `close` are skipped before a name is made of them: a name not known to
                // `http` is an allocation.
                if token.eq_ignore_ascii_case(b"close") || is_hop_by_hop_name(token) {
                    continue;
                }
                if let Ok(name) = HeaderName::from_bytes(token) {
                    named.push(name);
                }
            }
        }
        if !named.is_empty() {
            found.extend(h.keys().filter(|k| named.contains(k)).cloned());
        }
    }
    for name in &found {
        h.remove(name);
    }
}

/// The tokens of a comma-separated header value (`Connection`, `Transfer-Encoding`),
/// trimmed, empty ones skipped.
pub fn tokens(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value
        .split(|b| *b == b',')
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.is_empty())
}

/// Whether a comma-separated header value holds `token`, in any case.
pub fn has_token(value: &[u8], token: &[u8]) -> bool {
    tokens(value).any(|t| t.eq_ignore_ascii_case(token))
}

/// Whether `name` is a hop-by-hop header ([`is_hop_by_hop_name`]).
pub fn is_hop_by_hop(name: &HeaderName) -> bool {
    is_hop_by_hop_name(name.as_str().as_bytes())
}

/// [`is_hop_by_hop`] for a name as bytes, in any case (a field as it came on the wire, a
/// token of a `Connection` header). Most names have a length no hop-by-hop name has, so
/// most cost one comparison of lengths (a scan of the list compared a dozen strings per
/// header on every request and response).
pub fn is_hop_by_hop_name(name: &[u8]) -> bool {
    let is = |n: &[u8]| name.eq_ignore_ascii_case(n);
    match name.len() {
        2 => is(b"te"),
        7 => is(b"trailer") || is(b"upgrade"),
        10 => is(b"connection") || is(b"keep-alive"),
        16 => is(b"proxy-connection"),
        17 => is(b"transfer-encoding"),
        18 => is(b"proxy-authenticate"),
        19 => is(b"proxy-authorization"),
        _ => false,
    }
}

/// The header names the `Connection` fields among `fields` add to the hop-by-hop ones
/// (not `close`, not a name that is hop-by-hop anyway): [`strip_hop_by_hop`] for fields as
/// bytes.
pub fn connection_named<'h>(
    fields: impl Iterator<Item = (&'h [u8], &'h [u8])>,
) -> SmallVec<[&'h [u8]; 2]> {
    let mut named = SmallVec::new();
    for (name, value) in fields {
        if name.eq_ignore_ascii_case(b"connection") {
            named.extend(
                tokens(value)
                    .filter(|t| !t.eq_ignore_ascii_case(b"close") && !is_hop_by_hop_name(t)),
            );
        }
    }
    named
}

/// Whether a field named `name` goes no further than this hop: hop-by-hop, or named by a
/// `Connection` field (`named`, from [`connection_named`]).
pub fn ends_here(name: &[u8], named: &[&[u8]]) -> bool {
    is_hop_by_hop_name(name) || named.iter().any(|n| n.eq_ignore_ascii_case(name))
}

/// A request's header fields, however they are held: an `http::HeaderMap`, or a head's
/// bytes and the spans of its fields ([`super::raw::RawRequest`]). What policy reads of a
/// request's headers (its key, the tenant headers, the fingerprinted ones) it reads through
/// this, so a request read by either lane gets the same key and the same digests.
pub trait HeaderLookup {
    /// The values of the field `name`, in the order they came.
    fn values<'a>(&'a self, name: &'a HeaderName) -> impl Iterator<Item = &'a [u8]> + 'a;
}

impl HeaderLookup for HeaderMap {
    fn values<'a>(&'a self, name: &'a HeaderName) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.get_all(name).iter().map(HeaderValue::as_bytes)
    }
}

/// Whether a `Host` field value is `uri-host [ ":" port ]` (RFC 9112 section 3.2, RFC
/// 3986 section 3.2.2): a registered name (unreserved, percent-encoded and sub-delims
/// characters), an IPv4 address or a bracketed IP literal, then digits after a colon.
/// Empty is valid (a target without an authority). No user info, path, or blank.
pub fn valid_host(value: &[u8]) -> bool {
    let (host, port) = match value.first() {
        Some(b'[') => match value.iter().position(|b| *b == b']') {
            Some(end) => {
                let literal = &value[1..end];
                if literal.is_empty()
                    || !literal.iter().all(|b| {
                        b.is_ascii_hexdigit() || b":.vV".contains(b) || is_sub_or_unreserved(*b)
                    })
                {
                    return false;
                }
                match &value[end + 1..] {
                    [] => return true,
                    [b':', port @ ..] => (&[][..], Some(port)),
                    _ => return false,
                }
            }
            None => return false,
        },
        _ => match value.iter().rposition(|b| *b == b':') {
            Some(colon) => (&value[..colon], Some(&value[colon + 1..])),
            None => (value, None),
        },
    };
    host.iter().all(|b| is_sub_or_unreserved(*b) || *b == b'%')
        && port.is_none_or(|p| p.iter().all(u8::is_ascii_digit))
}

/// RFC 3986's unreserved and sub-delims characters.
fn is_sub_or_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=".contains(&b)
}

/// Why an HTTP/1.1 request's `Host` fields are refused (RFC 9112 section 3.2: none, more
/// than one, or an invalid value), or `None` if they are fine.
pub fn host_problem<'a>(mut hosts: impl Iterator<Item = &'a [u8]>) -> Option<&'static str> {
    match (hosts.next(), hosts.next()) {
        (None, _) => Some("an HTTP/1.1 request needs a Host header"),
        (Some(_), Some(_)) => Some("the request has more than one Host header"),
        (Some(h), None) if !valid_host(h) => Some("the request's Host header is not a valid host"),
        _ => None,
    }
}

/// `value` as text if it is visible ASCII (tabs allowed), the test `HeaderValue::to_str`
/// makes.
pub fn visible_ascii(value: &[u8]) -> Option<&str> {
    value
        .iter()
        .all(|&b| b == b'\t' || (0x20..0x7f).contains(&b))
        .then(|| std::str::from_utf8(value).ok())
        .flatten()
}

/// A client connection's address, with the text `X-Forwarded-For` gets made once per
/// connection rather than once per request (formatting it showed in the pass-through
/// profile).
#[derive(Clone, Debug)]
pub struct ClientAddr {
    pub addr: SocketAddr,
    text: HeaderValue,
}

impl ClientAddr {
    pub fn new(addr: SocketAddr) -> ClientAddr {
        let text = HeaderValue::from_str(&addr.ip().to_string())
            .unwrap_or_else(|_| HeaderValue::from_static("unknown"));
        ClientAddr { addr, text }
    }

    /// The address as `X-Forwarded-For` carries it.
    pub fn text(&self) -> &[u8] {
        self.text.as_bytes()
    }
}

/// Set the headers a downstream expects from a proxy: `Host` is the upstream's authority
/// (APIs route on it), the original host goes to `X-Forwarded-Host`, the client address is
/// appended to `X-Forwarded-For`.
pub fn set_forwarded(
    h: &mut HeaderMap,
    upstream_host: &HeaderValue,
    client: &ClientAddr,
    original_host: Option<HeaderValue>,
) {
    if let Some(host) = original_host {
        h.insert(HeaderName::from_static("x-forwarded-host"), host);
    }
    h.insert(header::HOST, upstream_host.clone());
    let xff = HeaderName::from_static("x-forwarded-for");
    match h.entry(xff) {
        header::Entry::Occupied(mut prev) if !prev.get().is_empty() => {
            let joined = [prev.get().as_bytes(), b", ", client.text.as_bytes()].concat();
            if let Ok(v) = HeaderValue::from_bytes(&joined) {
                prev.insert(v);
            }
        }
        header::Entry::Occupied(mut prev) => {
            prev.insert(client.text.clone());
        }
        header::Entry::Vacant(slot) => {
            slot.insert(client.text.clone());
        }
    }
    h.insert(
        HeaderName::from_static("x-forwarded-proto"),
        HeaderValue::from_static("http"),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_trimmed_and_matched_in_any_case() {
        let all: Vec<&[u8]> = tokens(b" keep-alive,,Close ,x").collect();
        assert_eq!(all, [&b"keep-alive"[..], b"Close", b"x"]);
        assert!(has_token(b"keep-alive, close", b"close"));
        assert!(has_token(b"CLOSE", b"close"));
        assert!(!has_token(b"closed", b"close"));
    }

    #[test]
    fn strips_hop_by_hop_and_connection_named() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-secret-hop"),
        );
        h.insert("x-secret-hop", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert("x-keep", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-keep"));
    }

    #[test]
    fn a_transfer_encoding_takes_the_content_length_with_it() {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("3"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert("x-keep", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        let mut only_length = HeaderMap::new();
        only_length.insert(header::CONTENT_LENGTH, HeaderValue::from_static("3"));
        strip_hop_by_hop(&mut only_length);
        assert_eq!(only_length["content-length"], "3");
    }

    #[test]
    fn hosts_are_checked_as_rfc_9112_asks() {
        for ok in [
            "",
            "example.com",
            "example.com:8080",
            "127.0.0.1:1",
            "[::1]",
            "[::1]:443",
            "a-b_c~d.%41",
            "xn--bcher-kva.example",
        ] {
            assert!(valid_host(ok.as_bytes()), "{ok}");
        }
        for bad in [
            "a b/c@d",
            "user@host",
            "host/path",
            "host:port",
            "[::1",
            "[::1]x",
            "[]",
            "host?",
            "ho\tst",
        ] {
            assert!(!valid_host(bad.as_bytes()), "{bad}");
        }
        assert!(host_problem([].into_iter()).is_some());
        assert!(host_problem([&b"a"[..], b"a"].into_iter()).is_some());
        assert!(host_problem([&b"a b/c@d"[..]].into_iter()).is_some());
        assert!(host_problem([&b"a:1"[..]].into_iter()).is_none());
    }

    #[test]
    fn forwarded_headers_append() {
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-for", HeaderValue::from_static("10.0.0.1"));
        set_forwarded(
            &mut h,
            &HeaderValue::from_static("api.example.com"),
            &ClientAddr::new("127.0.0.9:5".parse().expect("addr")),
            Some(HeaderValue::from_static("proxy:8080")),
        );
        assert_eq!(h["x-forwarded-for"], "10.0.0.1, 127.0.0.9");
        assert_eq!(h["host"], "api.example.com");
        assert_eq!(h["x-forwarded-host"], "proxy:8080");
    }

    #[test]
    fn client_addresses_are_written_as_text() {
        for ip in [
            "0.0.0.0",
            "127.0.0.1",
            "255.255.255.255",
            "::1",
            "2001:db8:85a3::8a2e:370:7334",
            "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
        ] {
            let addr = std::net::SocketAddr::new(ip.parse().expect("ip"), 9);
            let mut h = HeaderMap::new();
            set_forwarded(
                &mut h,
                &HeaderValue::from_static("up"),
                &ClientAddr::new(addr),
                None,
            );
            assert_eq!(h["x-forwarded-for"], ip);
        }
    }

    #[test]
    fn the_name_match_and_the_list_agree() {
        for n in HOP_BY_HOP {
            assert!(is_hop_by_hop(&HeaderName::from_static(n)), "{n}");
            assert!(is_hop_by_hop_name(n.to_ascii_uppercase().as_bytes()), "{n}");
        }
        for n in ["x-keep", "content-type", "host", "tee"] {
            assert!(!is_hop_by_hop(&HeaderName::from_static(n)), "{n}");
            assert!(!is_hop_by_hop_name(n.as_bytes()), "{n}");
        }
    }

    /// `headers` after stripping, as `name: value` lines sorted by name (a stable sort: a
    /// repeated header's values stay in their order).
    fn stripped(headers: &[(&'static str, &'static str)]) -> Vec<String> {
        let mut h = HeaderMap::new();
        for (n, v) in headers {
            h.append(*n, HeaderValue::from_static(v));
        }
        strip_hop_by_hop(&mut h);
        let mut left: Vec<String> = h
            .iter()
            .map(|(n, v)| format!("{n}: {}", v.to_str().expect("ascii")))
            .collect();
        left.sort_by(|a, b| a.split(':').next().cmp(&b.split(':').next()));
        left
    }

    #[test]
    fn strips_only_what_is_there_and_keeps_the_rest() {
        assert_eq!(
            stripped(&[
                ("connection", "keep-alive"),
                ("content-type", "application/json"),
                ("set-cookie", "a=1"),
                ("set-cookie", "b=2"),
            ]),
            [
                "content-type: application/json",
                "set-cookie: a=1",
                "set-cookie: b=2"
            ]
        );
        assert_eq!(
            stripped(&[
                ("upgrade", "websocket"),
                ("connection", "Upgrade, X-A ,x-b, close"),
                ("x-a", "1"),
                ("x-b", "1"),
                ("x-c", "1"),
            ]),
            ["x-c: 1"]
        );
        assert_eq!(stripped(&[("x-c", "1")]), ["x-c: 1"]);
    }
}
