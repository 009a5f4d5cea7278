//! Building the downstream request from the client's: target URI under the upstream's
//! base path, and headers with hop-by-hop and idempotency headers handled. Shared by the
//! read-only and side-effect paths so both forward identically.

use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Uri};

use crate::config::Upstream;
use crate::policy::classify::Target;
use crate::wire::body::ProxyBody;
use crate::wire::headers::{self, ClientAddr};
use crate::wire::raw::{Fields, RawRequest};

/// The absolute downstream URI for `rel_path_and_query` under `upstream`.
pub fn uri(upstream: &Upstream, rel_path_and_query: &str) -> Result<Uri, http::Error> {
    join(upstream, &[rel_path_and_query])
}

/// The downstream URI of a classified request: the upstream's base path, the path
/// relative to the mount, and the client's query as it came.
pub fn target_uri(target: &Target<'_>, query: Option<&str>) -> Result<Uri, http::Error> {
    match query {
        Some(q) => join(target.upstream, &[&target.rel_path, "?", q]),
        None => join(target.upstream, &[&target.rel_path]),
    }
}

fn join(upstream: &Upstream, parts: &[&str]) -> Result<Uri, http::Error> {
    let mut path = String::with_capacity(
        upstream.base_path.len() + parts.iter().map(|p| p.len()).sum::<usize>(),
    );
    path.push_str(&upstream.base_path);
    parts.iter().for_each(|p| path.push_str(p));
    Uri::builder()
        .scheme(upstream.scheme.clone())
        .authority(upstream.authority.clone())
        .path_and_query(path)
        .build()
}

/// Copy the client's headers for the downstream: hop-by-hop removed, `Host` and
/// `X-Forwarded-*` set, the client's idempotency key removed (the downstream sees only the
/// injected execution id, SPEC section 4).
pub fn request_headers(
    src: &HeaderMap,
    upstream: &Upstream,
    peer: &ClientAddr,
    remove: &[&HeaderName],
) -> HeaderMap {
    into_request_headers(src.clone(), upstream, peer, remove)
}

/// [`request_headers`] on a map the caller no longer needs: no copy of it is made.
pub fn into_request_headers(
    mut h: HeaderMap,
    upstream: &Upstream,
    peer: &ClientAddr,
    remove: &[&HeaderName],
) -> HeaderMap {
    headers::strip_hop_by_hop(&mut h);
    for name in remove {
        h.remove(*name);
    }
    let original_host = h.remove(http::header::HOST);
    headers::set_forwarded(&mut h, &upstream.host, peer, original_host);
    h
}

pub fn build(method: Method, uri: Uri, headers: HeaderMap, body: ProxyBody) -> Request<ProxyBody> {
    let mut req = Request::new(body);
    *req.method_mut() = method;
    *req.uri_mut() = uri;
    *req.headers_mut() = headers;
    req
}

/// The upstream request for a read-only request taken as bytes ([`crate::wire::raw`]):
/// what [`target_uri`], [`into_request_headers`] and the h1 client's encoding make of it
/// as `http` types, written straight from the client's fields. Field names keep the
/// client's case; fields of one name keep their order.
pub fn encode_raw(
    target: &Target<'_>,
    req: &RawRequest,
    peer: &ClientAddr,
    key_header: &HeaderName,
) -> Vec<u8> {
    let upstream = target.upstream;
    let named = headers::connection_named(req.fields());
    let has_host = req.fields().any(|(n, _)| n.eq_ignore_ascii_case(b"host"));
    let mut out = Vec::with_capacity(req.head.len() + req.body.len() + 128);
    out.extend_from_slice(req.method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(upstream.base_path.as_bytes());
    out.extend_from_slice(target.rel_path.as_bytes());
    if let Some(q) = req.uri.query() {
        out.push(b'?');
        out.extend_from_slice(q.as_bytes());
    }
    out.extend_from_slice(b" HTTP/1.1\r\n");
    line(&mut out, b"host", upstream.host.as_bytes());
    let mut original_host = None;
    let mut forwarded_for = None;
    for (name, value) in req.fields() {
        if headers::ends_here(name, &named) {
            continue;
        }
        let is = |n: &[u8]| name.eq_ignore_ascii_case(n);
        if is(b"host") {
            original_host.get_or_insert(value);
        } else if is(b"x-forwarded-for") {
            // As the map's entry: the first value is extended, the others go.
            forwarded_for.get_or_insert(value);
        } else if !(is(key_header.as_str().as_bytes())
            || is(b"content-length")
            || is(b"x-forwarded-proto")
            || (has_host && is(b"x-forwarded-host")))
        {
            line(&mut out, name, value);
        }
    }
    if let Some(host) = original_host {
        line(&mut out, b"x-forwarded-host", host);
    }
    match forwarded_for {
        Some(prev) if !prev.is_empty() => {
            out.extend_from_slice(b"x-forwarded-for: ");
            out.extend_from_slice(prev);
            out.extend_from_slice(b", ");
            out.extend_from_slice(peer.text());
            out.extend_from_slice(b"\r\n");
        }
        _ => line(&mut out, b"x-forwarded-for", peer.text()),
    }
    line(&mut out, b"x-forwarded-proto", b"http");
    if !req.body.is_empty() || matches!(req.method, Method::POST | Method::PUT | Method::PATCH) {
        line(
            &mut out,
            b"content-length",
            itoa::Buffer::new().format(req.body.len()).as_bytes(),
        );
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(&req.body);
    out
}

fn line(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// An upstream's answer fields for the client, as bytes: hop-by-hop ones removed
/// ([`response_headers`] for the read-only lane).
pub fn retain_end_to_end(head: &[u8], fields: &mut Fields) {
    let named = headers::connection_named(fields.iter().map(|f| (f.name(head), f.value(head))));
    fields.retain(|f| !headers::ends_here(f.name(head), &named));
}

/// Response headers for the client: hop-by-hop removed.
pub fn response_headers(h: &mut HeaderMap) {
    headers::strip_hop_by_hop(h);
}

pub fn header_value(s: &str) -> HeaderValue {
    HeaderValue::from_str(s).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
}
