//! Requests and answers as bytes: the read-only lane of the HTTP/1.1 fast path.
//!
//! A plain request the fast path takes ([`super::fast`]) arrives as its head's bytes and
//! where each header field lies in them. When its route is read-only and its upstream is
//! `http://`, the proxy forwards it as bytes: the upstream request is written straight
//! from these fields ([`crate::proxy::downstream::encode_raw`]), the upstream's answer head
//! is kept as its bytes and fields ([`super::h1`]), and the fast path writes the answer
//! from them. Neither side becomes a `HeaderMap`: building, hashing, editing and dropping
//! the four maps of a request and its answer, and the upstream URI, were about a quarter
//! of a pass-through's instructions (24.8k per GET before, 18.8k after;
//! docs/PERFORMANCE.md, "Read-only byte lane"). Every other request becomes an
//! `http::Request` ([`RawRequest::into_request`]) and takes the usual way.

use std::ops::Range;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, StatusCode, Uri, Version};
use smallvec::SmallVec;

use super::body::{ProxyBody, RequestBody};
use super::headers::HeaderLookup;

/// Where a header field's name and value lie in a head's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Field {
    name: (u32, u32),
    value: (u32, u32),
}

impl Field {
    /// Heads are at most a few hundred KiB (`limits.max_header_bytes`), so offsets fit.
    pub fn new(name: Range<usize>, value: Range<usize>) -> Field {
        Field {
            name: (name.start as u32, name.end as u32),
            value: (value.start as u32, value.end as u32),
        }
    }

    pub fn name<'h>(&self, head: &'h [u8]) -> &'h [u8] {
        &head[self.name.0 as usize..self.name.1 as usize]
    }

    pub fn value<'h>(&self, head: &'h [u8]) -> &'h [u8] {
        &head[self.value.0 as usize..self.value.1 as usize]
    }

    pub fn value_range(&self) -> Range<usize> {
        self.value.0 as usize..self.value.1 as usize
    }
}

/// A head's fields, in the order they came. Most heads have fewer than 16.
pub type Fields = SmallVec<[Field; 16]>;

/// `fields` as (name, value) bytes of `head`, in order.
pub fn pairs<'h, 'f>(
    head: &'h [u8],
    fields: &'f [Field],
) -> impl Iterator<Item = (&'h [u8], &'h [u8])> + use<'h, 'f> {
    fields.iter().map(move |f| (f.name(head), f.value(head)))
}

/// A request the fast path read whole: an HTTP/1.1 request in origin form with a body of
/// known length (see [`super::fast`] for what it takes).
pub struct RawRequest {
    pub method: Method,
    /// The request target (origin form), validated as `http` validates it.
    pub uri: Uri,
    /// The head's bytes, request line included.
    pub head: Bytes,
    pub fields: Fields,
    pub body: Bytes,
    /// The client ended its connection before the body's declared length: `body` holds
    /// what came. Such a request is never forwarded as bytes.
    pub cut: Option<u64>,
}

/// Room in a request's header map for the headers the proxy adds before forwarding it
/// (`Host`, `X-Forwarded-*`), so that they do not make it grow.
const ADDED_HEADERS: usize = 4;

impl RawRequest {
    /// The fields as (name, value) bytes, in the order they came.
    pub fn fields(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        pairs(&self.head, &self.fields)
    }

    /// The request as `http` types, for every path but the read-only lane. `None` only if
    /// a field is not a valid `http` header, which the fast path's parser (httparse,
    /// admitting exactly the bytes `http` does) does not let through.
    /// Its headers go into `spare` when there is one: the last answer's header map,
    /// emptied (as hyper reuses it), so no allocation, and room for the headers the proxy
    /// adds.
    pub fn into_request(self, spare: Option<HeaderMap>) -> Option<Request<RequestBody>> {
        let mut headers = spare.unwrap_or_default();
        headers.reserve(self.fields.len() + ADDED_HEADERS);
        for f in &self.fields {
            let name = HeaderName::from_bytes(f.name(&self.head)).ok()?;
            let value = HeaderValue::from_maybe_shared(self.head.slice(f.value_range())).ok()?;
            headers.append(name, value);
        }
        let body = match self.cut {
            Some(declared) => RequestBody::cut(self.body, declared),
            None => RequestBody::read(self.body),
        };
        let mut req = Request::new(body);
        *req.method_mut() = self.method;
        *req.uri_mut() = self.uri;
        *req.version_mut() = Version::HTTP_11;
        *req.headers_mut() = headers;
        Some(req)
    }
}

/// Header names are matched without regard to case, as `HeaderMap` matches them (its
/// names are lower case; a head's are as the client wrote them).
impl HeaderLookup for RawRequest {
    fn values<'a>(&'a self, name: &'a HeaderName) -> impl Iterator<Item = &'a [u8]> + 'a {
        let name = name.as_str().as_bytes();
        self.fields()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v)
    }
}

/// An upstream's answer forwarded as bytes: its status, its head's bytes and the fields of
/// it that go to the client (end-to-end ones; the fast path frames the body itself, so
/// `Content-Length` and `Transfer-Encoding` are not copied), and its body.
pub struct RawAnswer {
    pub status: StatusCode,
    pub head: Bytes,
    pub fields: Fields,
    pub body: ProxyBody,
}

impl RawAnswer {
    pub fn fields(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        pairs(&self.head, &self.fields)
    }
}

/// What the read-only lane makes of a request: the answer as bytes, or an answer of the
/// proxy's own (a problem, when the upstream failed).
pub type RawOutcome = Result<RawAnswer, http::Response<ProxyBody>>;

/// Where the fields httparse found in `head` lie in it (for tests).
#[cfg(test)]
pub fn spans(head: &[u8], headers: &[httparse::Header<'_>]) -> Fields {
    let base = head.as_ptr() as usize;
    let at = |s: &[u8]| {
        let start = s.as_ptr() as usize - base;
        start..start + s.len()
    };
    headers
        .iter()
        .map(|h| Field::new(at(h.name.as_bytes()), at(h.value)))
        .collect()
}

/// A request head and its fields, parsed as the fast path parses them (for tests of the
/// code that reads [`RawRequest`]s).
#[cfg(test)]
pub fn request(head: &'static [u8], body: &'static [u8]) -> RawRequest {
    let mut slots = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut slots);
    assert!(req.parse(head).expect("a valid head").is_complete());
    let fields = spans(head, req.headers);
    RawRequest {
        method: Method::from_bytes(req.method.expect("method").as_bytes()).expect("method"),
        uri: Uri::from_static(req.path.expect("path")),
        head: Bytes::from_static(head),
        fields,
        body: Bytes::from_static(body),
        cut: None,
    }
}
