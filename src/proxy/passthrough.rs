//! Read-only routes: streamed both ways without buffering and without a record.
//! Transient failures (connect errors, resets, 502/503/504) are retried inside the proxy
//! per the route's `retry`, but only for requests without a body: a streamed body cannot
//! be sent twice.
//!
//! A request the listener's fast path read whole, to an `http://` upstream, goes by the
//! read-only lane ([`forward_raw`], [`crate::wire::raw`]): forwarded as bytes, with the
//! same headers, retries, timeouts and problems as [`forward`].

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Body;

use super::downstream;
use super::Runtime;
use crate::config::{Route, Upstream};
use crate::policy::classify::Target;
use crate::wire::body::{self, ProxyBody, RequestBody};
use crate::wire::client::{self, Held, HttpClient, SendError};
use crate::wire::h1::RawHead;
use crate::wire::headers::ClientAddr;
use crate::wire::problem::{Kind, Problem};
use crate::wire::raw::{RawAnswer, RawOutcome, RawRequest};

pub async fn forward(
    rt: &Runtime,
    client: &HttpClient,
    target: &Target<'_>,
    req: Request<RequestBody>,
    peer: &ClientAddr,
    allow_retry: bool,
) -> Response<ProxyBody> {
    let (parts, incoming) = req.into_parts();
    let uri = match downstream::target_uri(target, parts.uri.query()) {
        Ok(u) => u,
        Err(e) => {
            return Problem::new(Kind::BadRequest, format!("cannot build upstream URI: {e}"))
                .into_response()
        }
    };
    let key_header = &rt.config.identity.key_header;
    let route = target.route;
    let bodyless = incoming.is_end_stream();
    let attempts = if allow_retry && bodyless {
        route.retry.attempts.max(1)
    } else {
        1
    };
    // Each attempt sends its own copy; the common single attempt moves the client's map
    // and the URI (copies per request showed in the pass-through profile).
    let headers =
        downstream::into_request_headers(parts.headers, target.upstream, peer, &[key_header]);
    let mut headers = Some(headers);
    let mut uri = Some(uri);
    let mut incoming = Some(incoming);
    let method = parts.method;
    let sent = with_retries(target.upstream, route, attempts, |last| {
        let req_body = match incoming.take() {
            Some(b) if !bodyless => b.boxed(),
            _ => body::empty(),
        };
        let (attempt_uri, attempt_headers) = if last {
            (
                uri.take().expect("only the last attempt takes the URI"),
                headers.take().expect("only the last attempt takes the map"),
            )
        } else {
            (
                uri.clone().expect("present until the last attempt"),
                headers.clone().expect("present until the last attempt"),
            )
        };
        let req = downstream::build(method.clone(), attempt_uri, attempt_headers, req_body);
        client.request(req)
    })
    .await;
    match sent {
        Ok(resp) => {
            let (mut rparts, rbody) = resp.into_parts();
            downstream::response_headers(&mut rparts.headers);
            let rbody = body::StallBody::new(rbody, rt.config.timeouts.upstream_body);
            Response::from_parts(rparts, rbody.boxed())
        }
        Err(problem) => problem,
    }
}

/// Whether `target`'s requests may take the read-only lane: a read-only route of an
/// `http://` upstream that observes no job status (those answers are read on their way
/// back, `proxy::jobs::observe`).
pub fn takes_raw(target: &Target<'_>) -> bool {
    target.route.class == crate::config::Class::ReadOnly
        && target.upstream.scheme == http::uri::Scheme::HTTP
        && target.route.observes.is_none()
}

/// [`forward`] for a request taken as bytes ([`takes_raw`]): the upstream request is
/// written now, and the returned future sends it, with the route's retries, and keeps the
/// answer's head as bytes.
pub fn forward_raw(
    rt: Arc<Runtime>,
    target: &Target<'_>,
    req: RawRequest,
    peer: &ClientAddr,
) -> impl Future<Output = RawOutcome> + Send + 'static {
    let message = downstream::encode_raw(target, &req, peer, &rt.config.identity.key_header);
    let (upstream_index, route_ref) = (target.upstream_index, target.route_ref);
    let attempts = if req.body.is_empty() {
        target.route.retry.attempts.max(1)
    } else {
        1
    };
    let method = req.method;
    async move {
        let (upstream, route) = route_ref.resolve(&rt.config.upstreams, upstream_index);
        let client = &rt.clients[upstream_index];
        let (head, body) = with_retries(upstream, route, attempts, |_| {
            client.send_raw(&upstream.authority, &method, &message)
        })
        .await?;
        let RawHead {
            status,
            bytes,
            mut fields,
        } = head;
        downstream::retain_end_to_end(&bytes, &mut fields);
        Ok(RawAnswer {
            status,
            head: bytes,
            fields,
            body: body::StallBody::new(body, rt.config.timeouts.upstream_body).boxed(),
        })
    }
}

/// The status of an upstream's answer, to tell a transient one, and its `Retry-After`.
trait Answered {
    fn status(&self) -> StatusCode;
    fn retry_after(&self) -> Option<&[u8]>;
}

impl Answered for Response<Held> {
    fn status(&self) -> StatusCode {
        Response::status(self)
    }
    fn retry_after(&self) -> Option<&[u8]> {
        self.headers()
            .get(http::header::RETRY_AFTER)
            .map(|v| v.as_bytes())
    }
}

impl Answered for (RawHead, Held) {
    fn status(&self) -> StatusCode {
        self.0.status
    }
    fn retry_after(&self) -> Option<&[u8]> {
        crate::wire::raw::pairs(&self.0.bytes, &self.0.fields)
            .find(|(name, _)| name.eq_ignore_ascii_case(b"retry-after"))
            .map(|(_, value)| value)
    }
}

/// The longest `Retry-After` a read-only retry waits for; a longer one ends the retries
/// and the answer (429 or 503 with its `Retry-After`) goes to the client, whose own
/// retry policy can wait that long.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(10);

/// How long an answer asks to be waited for before the next try: its `Retry-After`, as
/// delay-seconds or an HTTP date (RFC 9110 §10.2.3); `None` without one (or a bad one).
fn retry_after(value: Option<&[u8]>) -> Option<Duration> {
    let text = std::str::from_utf8(value?).ok()?.trim();
    if let Ok(secs) = text.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(text).ok()?;
    Some(
        at.duration_since(std::time::SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

/// Send up to `attempts` times: `send(last)` sends once. Connect errors, resets and
/// 429/502/503/504 are tried again after the route's backoff (doubling), or after the
/// answer's `Retry-After` when that is longer (up to [`MAX_RETRY_AFTER`]; past it the
/// answer is the answer), while attempts are left; the last attempt's answer is the
/// answer. Each attempt has the route's timeout.
/// A failure is answered with a problem: `502 upstream-unavailable` or `504
/// upstream-timeout`.
async fn with_retries<A, F, S>(
    upstream: &Upstream,
    route: &Route,
    attempts: u32,
    mut send: F,
) -> Result<A, Response<ProxyBody>>
where
    A: Answered,
    F: FnMut(bool) -> S,
    S: Future<Output = Result<A, SendError>>,
{
    let mut backoff = route.retry.backoff;
    for attempt in 1..=attempts {
        let last = attempt == attempts;
        match tokio::time::timeout(route.timeout, send(last)).await {
            Ok(Ok(answer)) => {
                let transient = matches!(
                    answer.status(),
                    StatusCode::TOO_MANY_REQUESTS
                        | StatusCode::BAD_GATEWAY
                        | StatusCode::SERVICE_UNAVAILABLE
                        | StatusCode::GATEWAY_TIMEOUT
                );
                if !transient || last {
                    return Ok(answer);
                }
                // The upstream says when to come back: wait that long (never less than
                // the backoff), unless it is longer than the proxy will hold a request.
                match retry_after(answer.retry_after()) {
                    Some(wait) if wait > MAX_RETRY_AFTER => {
                        tracing::debug!(upstream = %upstream.name, route = %route.name, attempt, status = %answer.status(), ?wait, "Retry-After beyond the cap; answering");
                        return Ok(answer);
                    }
                    Some(wait) => backoff = backoff.max(wait),
                    None => {}
                }
                tracing::debug!(upstream = %upstream.name, route = %route.name, attempt, status = %answer.status(), "transient status; retrying");
            }
            Ok(Err(e)) => {
                tracing::debug!(upstream = %upstream.name, route = %route.name, attempt, error = %client::describe(&e), "upstream request failed");
                if last {
                    return Err(Problem::new(
                        Kind::of_send_error(&e),
                        format!(
                            "upstream `{}` failed: {}",
                            upstream.name,
                            client::describe(&e)
                        ),
                    )
                    .into_response());
                }
            }
            Err(_) => {
                if last {
                    return Err(Problem::new(
                        Kind::UpstreamTimeout,
                        format!(
                            "upstream `{}` did not answer within {:?}",
                            upstream.name, route.timeout
                        ),
                    )
                    .into_response());
                }
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = backoff.saturating_mul(2);
    }
    unreachable!("the last attempt always returns")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_reads_seconds_and_dates() {
        assert_eq!(retry_after(Some(b"3")), Some(Duration::from_secs(3)));
        assert_eq!(retry_after(Some(b" 0 ")), Some(Duration::ZERO));
        assert_eq!(retry_after(None), None);
        assert_eq!(retry_after(Some(b"soon")), None);
        assert_eq!(retry_after(Some(b"-1")), None);
        // A date in the past is "now"; one in the future is the time left.
        assert_eq!(
            retry_after(Some(b"Sun, 06 Nov 1994 08:49:37 GMT")),
            Some(Duration::ZERO)
        );
        let later = httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(30));
        let wait = retry_after(Some(later.as_bytes())).expect("a date");
        assert!(
            wait > Duration::from_secs(25) && wait <= Duration::from_secs(30),
            "{wait:?}"
        );
    }
}
