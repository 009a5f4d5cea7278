//! Building the downstream request from the client's: target URI under the upstream's
//! base path, and headers with hop-by-hop and idempotency headers handled. Shared by the
//! read-only and side-effect paths so both forward identically.

use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Uri};

use crate::config::Upstream;
use crate::policy::classify::Target;
use crate::wire::body::ProxyBody;
use crate::wire::headers::{self, ClientAddr};

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

/// Response headers for the client: hop-by-hop removed.
pub fn response_headers(h: &mut HeaderMap) {
    headers::strip_hop_by_hop(h);
}

pub fn header_value(s: &str) -> HeaderValue {
    HeaderValue::from_str(s).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
}
