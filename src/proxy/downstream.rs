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
    let named = headers::connection_named(crate::wire::raw::pairs(head, fields));
    fields.retain(|f| !headers::ends_here(f.name(head), &named));
}

/// Response headers for the client: hop-by-hop removed.
pub fn response_headers(h: &mut HeaderMap) {
    headers::strip_hop_by_hop(h);
}

/// Response headers to store with a result: hop-by-hop removed, and the framing fields
/// too ([`crate::wire::framing`]): whichever writer replays it frames the stored body.
pub fn stored_headers(h: &mut HeaderMap) {
    headers::strip_hop_by_hop(h);
    h.remove(http::header::CONTENT_LENGTH);
}

pub fn header_value(s: &str) -> HeaderValue {
    HeaderValue::from_str(s).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::from_yaml;
    use crate::policy::classify::Classified;
    use crate::wire::raw;
    use std::path::Path;

    const YAML: &str = r#"
identity: { key_header: Idempotency-Key }
upstreams:
  - name: api
    url: http://127.0.0.1:9001/v2
    mount: /api
    routes:
      - { name: search, match: { method: POST, path: /search }, class: read_only }
      - { name: get, match: { method: GET, path: "/items/{id}" }, class: read_only }
"#;

    /// A message's request line and its fields as (lower-case name, value), sorted: what
    /// an upstream makes of it whatever the order of names.
    fn fields_of(message: &[u8]) -> (String, Vec<(String, String)>, Vec<u8>) {
        let mut slots = [httparse::EMPTY_HEADER; 64];
        let mut req = httparse::Request::new(&mut slots);
        let len = match req.parse(message).expect("a valid message") {
            httparse::Status::Complete(len) => len,
            httparse::Status::Partial => panic!("a partial message"),
        };
        let line = format!(
            "{} {}",
            req.method.expect("method"),
            req.path.expect("path")
        );
        let mut fields: Vec<_> = req
            .headers
            .iter()
            .map(|h| {
                (
                    h.name.to_ascii_lowercase(),
                    String::from_utf8(h.value.to_vec()).expect("text"),
                )
            })
            .collect();
        // Values of one name keep their order: sort by name only (stable).
        fields.sort_by(|a, b| a.0.cmp(&b.0));
        (line, fields, message[len..].to_vec())
    }

    /// The upstream request the map path makes of `head` (target URI, headers, and the
    /// h1 client's framing), as (line, sorted fields, body).
    fn by_map(
        cfg: &crate::config::Config,
        target: &Target<'_>,
        req: RawRequest,
        peer: &ClientAddr,
    ) -> (String, Vec<(String, String)>, Vec<u8>) {
        let body = req.body.clone();
        let req = req.into_request(None).expect("valid");
        let uri = target_uri(target, req.uri().query()).expect("uri");
        let method = req.method().clone();
        let h = into_request_headers(
            req.into_parts().0.headers,
            target.upstream,
            peer,
            &[&cfg.identity.key_header],
        );
        let mut fields: Vec<(String, String)> = h
            .iter()
            .filter(|(n, _)| {
                // The h1 client writes its own framing and no `Connection`.
                !matches!(
                    n.as_str(),
                    "content-length" | "transfer-encoding" | "connection"
                )
            })
            .map(|(n, v)| (n.to_string(), v.to_str().expect("text").to_string()))
            .collect();
        if !body.is_empty() || matches!(method, Method::POST | Method::PUT | Method::PATCH) {
            fields.push(("content-length".into(), body.len().to_string()));
        }
        fields.sort_by(|a, b| a.0.cmp(&b.0));
        let line = format!("{method} {}", uri.path_and_query().expect("path"));
        (line, fields, body.to_vec())
    }

    #[test]
    fn the_read_only_lane_forwards_what_the_map_path_forwards() {
        let cfg = from_yaml(YAML, Path::new("t.yaml")).expect("valid");
        let peer = ClientAddr::new("10.1.2.3:5555".parse().expect("addr"));
        let cases: [(&'static [u8], &'static [u8]); 9] = [
            (b"GET /api/items/7?x=1&y=%20 HTTP/1.1\r\nHost: proxy:8080\r\n\r\n", b""),
            (
                b"POST /api/search HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\nContent-Length: 7\r\nIdempotency-Key: k1\r\n\r\n",
                b"{\"a\":1}",
            ),
            // Hop-by-hop fields, and one a `Connection` field names, stop here.
            (
                b"GET /api/items/1 HTTP/1.1\r\nHost: p\r\nConnection: keep-alive, X-Secret, close\r\nX-Secret: s\r\nx-secret: t\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\nProxy-Authorization: Basic x\r\nProxy-Connection: keep-alive\r\nTrailer: x\r\nX-Keep: 1\r\n\r\n",
                b"",
            ),
            // An `X-Forwarded-For` is extended (its first value; the map keeps one).
            (
                b"GET /api/items/1 HTTP/1.1\r\nHost: p\r\nX-Forwarded-For: 192.0.2.1\r\nX-Forwarded-For: 192.0.2.2\r\n\r\n",
                b"",
            ),
            (b"GET /api/items/1 HTTP/1.1\r\nHost: p\r\nX-Forwarded-For: \r\n\r\n", b""),
            // The client's `X-Forwarded-Host` and `-Proto` are replaced...
            (
                b"GET /api/items/1 HTTP/1.1\r\nHost: p\r\nX-Forwarded-Host: evil\r\nX-Forwarded-Proto: https\r\n\r\n",
                b"",
            ),
            // ...but `X-Forwarded-Host` stays when there is no `Host` to put there.
            (b"GET /api/items/1 HTTP/1.1\r\nX-Forwarded-Host: front\r\n\r\n", b""),
            // Two `Host`s: the first is the original host.
            (b"GET /api/items/1 HTTP/1.1\r\nHost: a\r\nHOST: b\r\nAccept: */*\r\nAccept: x/y\r\n\r\n", b""),
            // A `POST` without a body still says so.
            (b"POST /api/search HTTP/1.1\r\nHost: p\r\nContent-Length: 0\r\n\r\n", b""),
        ];
        for (head, body) in cases {
            let req = raw::request(head, body);
            let target = match cfg.routes.classify(
                &cfg.upstreams,
                cfg.unmatched,
                &req.method,
                req.uri.path(),
            ) {
                Classified::Matched(t) => t,
                other => panic!("{other:?}"),
            };
            let message = encode_raw(&target, &req, &peer, &cfg.identity.key_header);
            let expected = by_map(&cfg, &target, raw::request(head, body), &peer);
            assert_eq!(
                fields_of(&message),
                expected,
                "{}",
                String::from_utf8_lossy(head)
            );
        }
    }

    #[test]
    fn answers_lose_hop_by_hop_fields_as_the_map_path_does() {
        let head: &[u8] = b"HTTP/1.1 200 OK\r\nConnection: keep-alive, X-Hop\r\nX-Hop: 1\r\nKeep-Alive: timeout=5\r\nTransfer-Encoding: chunked\r\nContent-Type: text/plain\r\nDate: x\r\nX-End: 2\r\n\r\n";
        let mut slots = [httparse::EMPTY_HEADER; 16];
        let mut resp = httparse::Response::new(&mut slots);
        assert!(resp.parse(head).expect("valid").is_complete());
        let mut fields = raw::spans(head, resp.headers);
        let mut map = HeaderMap::new();
        for f in &fields {
            map.append(
                HeaderName::from_bytes(f.name(head)).expect("name"),
                HeaderValue::from_bytes(f.value(head)).expect("value"),
            );
        }
        retain_end_to_end(head, &mut fields);
        response_headers(&mut map);
        let kept: Vec<String> = fields
            .iter()
            .map(|f| String::from_utf8_lossy(f.name(head)).to_ascii_lowercase())
            .collect();
        // The map's order after removals is its own; what is kept is the same.
        let mut by_map: Vec<String> = map.keys().map(|k| k.to_string()).collect();
        by_map.sort();
        assert_eq!(kept, ["content-type", "date", "x-end"]);
        assert_eq!(kept, by_map);
    }
}
