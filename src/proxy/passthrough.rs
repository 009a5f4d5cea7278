//! Read-only routes: streamed both ways without buffering and without a record.
//! Transient failures (connect errors, resets, 502/503/504) are retried inside the proxy
//! per the route's `retry`, but only for requests without a body: a streamed body cannot
//! be sent twice.

use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Body;

use super::downstream;
use super::Runtime;
use crate::policy::classify::Target;
use crate::wire::body::{self, ProxyBody, RequestBody};
use crate::wire::client::{self, HttpClient};
use crate::wire::headers::ClientAddr;
use crate::wire::problem::{Kind, Problem};

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
    let mut backoff = route.retry.backoff;
    for attempt in 1..=attempts {
        let req_body = match incoming.take() {
            Some(b) if !bodyless => b.boxed(),
            _ => body::empty(),
        };
        let last = attempt == attempts;
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
        let req = downstream::build(parts.method.clone(), attempt_uri, attempt_headers, req_body);
        let outcome = tokio::time::timeout(route.timeout, client.request(req)).await;
        match outcome {
            Ok(Ok(resp)) => {
                let transient = matches!(
                    resp.status(),
                    StatusCode::BAD_GATEWAY
                        | StatusCode::SERVICE_UNAVAILABLE
                        | StatusCode::GATEWAY_TIMEOUT
                );
                if transient && !last {
                    tracing::debug!(upstream = %target.upstream.name, route = %route.name, attempt, status = %resp.status(), "transient status; retrying");
                } else {
                    let (mut rparts, rbody) = resp.into_parts();
                    downstream::response_headers(&mut rparts.headers);
                    return Response::from_parts(rparts, rbody.boxed());
                }
            }
            Ok(Err(e)) => {
                tracing::debug!(upstream = %target.upstream.name, route = %route.name, attempt, error = %client::describe(&e), "upstream request failed");
                if last {
                    return Problem::new(
                        Kind::UpstreamUnavailable,
                        format!(
                            "upstream `{}` failed: {}",
                            target.upstream.name,
                            client::describe(&e)
                        ),
                    )
                    .into_response();
                }
            }
            Err(_) => {
                if last {
                    return Problem::new(
                        Kind::UpstreamTimeout,
                        format!(
                            "upstream `{}` did not answer within {:?}",
                            target.upstream.name, route.timeout
                        ),
                    )
                    .into_response();
                }
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = backoff.saturating_mul(2);
    }
    unreachable!("the last attempt always returns")
}
