//! Background jobs' I/O (SPEC section 9.2): the agent's own status polls observed as they
//! pass through ([`observe`]), the proxy's own polling ([`spawn_poller`]), and the one
//! writer that ends a job on its record ([`end_jobs`]). Whether a job may move is decided by
//! `policy::job` (`advance`, through `end`); what a status answer says, by its
//! `StatusSpec`. Nothing here creates an execution: every update is a compare-and-set on
//! the record that started the job, so two instances ending one job at once leave one
//! move and no error.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body_util::{BodyExt, BodyStream, Limited, StreamBody};
use hyper::body::Frame;

use super::{downstream, passthrough, Proxy, Runtime};
use crate::policy::classify::Target;
use crate::policy::identity::ExecutionId;
use crate::policy::job::{self, EndedBy, JobState, JobWatch, StatusSpec};
use crate::store::{now_ms, JobFilter, ListFilter, Record, StoreError};
use crate::wire::body::{self, BoxError, ProxyBody, RequestBody};
use crate::wire::client::{self, HttpClient};
use crate::wire::headers::ClientAddr;

/// A read-only request to a route that carries `job.status` endpoints (`Route::observes`):
/// forwarded as any pass-through; when it is a status poll and the answer is a 2xx, the
/// answer is read whole (up to `limits.max_response_bytes`; a longer one is passed on
/// unread) before it is answered, and a state in `succeeded` / `failed` ends the job on the
/// record that started it. The answer itself is the upstream's, unchanged.
pub async fn observe(
    proxy: &Proxy,
    rt: &Runtime,
    client: &HttpClient,
    target: &Target<'_>,
    req: Request<RequestBody>,
    peer: &ClientAddr,
    watch: &JobWatch,
) -> Response<ProxyBody> {
    let Some((job_id, watchers)) = watch.matching(req.method(), &target.rel_path) else {
        return passthrough::forward(rt, client, target, req, peer, true).await;
    };
    let answer = passthrough::forward(rt, client, target, req, peer, true).await;
    if !answer.status().is_success() {
        return answer;
    }
    let (parts, b) = answer.into_parts();
    let bytes = match buffer(b, rt.config.limits.max_response_bytes).await {
        Ok(bytes) => bytes,
        Err(unread) => {
            tracing::debug!(job_id = %job_id, "job status answer not observed: longer than limits.max_response_bytes or cut short");
            return Response::from_parts(parts, unread);
        }
    };
    for w in &watchers {
        if let Some((to, result)) = w.status.ended(&bytes) {
            let routes = [w.route.as_str()];
            end_jobs(
                proxy,
                &target.upstream.name,
                &routes,
                &job_id,
                to,
                result,
                EndedBy::ObservedPoll,
            )
            .await;
            break;
        }
    }
    Response::from_parts(parts, body::full(bytes))
}

/// The body read whole when it is at most `max` bytes; otherwise (or when it fails part
/// way) a body that yields what was read and then the rest as it comes (or the error).
async fn buffer(mut b: ProxyBody, max: usize) -> Result<Bytes, ProxyBody> {
    let mut read = BytesMut::new();
    loop {
        match b.frame().await {
            None => return Ok(read.freeze()),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => {
                    read.extend_from_slice(&data);
                    if read.len() > max {
                        let head = futures_util::stream::once(async move {
                            Ok::<_, BoxError>(Frame::data(read.freeze()))
                        });
                        return Err(BodyExt::boxed(StreamBody::new(
                            head.chain(BodyStream::new(b)),
                        )));
                    }
                }
                // Trailers on a status answer: passed on unread.
                Err(trailers) => {
                    let head = futures_util::stream::iter([
                        Ok::<_, BoxError>(Frame::data(read.freeze())),
                        Ok(trailers),
                    ]);
                    return Err(BodyExt::boxed(StreamBody::new(
                        head.chain(BodyStream::new(b)),
                    )));
                }
            },
            Some(Err(e)) => {
                let frames = futures_util::stream::iter([
                    Ok::<_, BoxError>(Frame::data(read.freeze())),
                    Err(e),
                ]);
                return Err(BodyExt::boxed(StreamBody::new(frames)));
            }
        }
    }
}

/// End the running job `job_id` of every record of `upstream` (on one of `routes`) that
/// started it, as `to` with `result`. Returns how many jobs this call ended; a job another
/// writer ended first (an instance polling too, a webhook) is left as it is.
pub async fn end_jobs(
    proxy: &Proxy,
    upstream: &str,
    routes: &[&str],
    job_id: &str,
    to: JobState,
    result: serde_json::Value,
    by: EndedBy,
) -> usize {
    let found = proxy
        .store
        .list(&ListFilter {
            external_id: Some(job_id.to_string()),
            job: Some(JobFilter::In(JobState::Running)),
            limit: 16,
            ..ListFilter::default()
        })
        .await;
    let records = match found {
        Ok(rs) => rs,
        Err(e) => {
            tracing::warn!(job_id, error = %e, "job status: could not look up the job's record");
            return 0;
        }
    };
    let mut ended = 0;
    for r in records.into_iter().filter(|r| {
        r.upstream == upstream
            && routes.contains(&r.route.as_str())
            && r.job.as_ref().is_some_and(|j| j.id == job_id)
    }) {
        if end_one(proxy, r, to, &result, by).await {
            ended += 1;
        }
    }
    ended
}

/// One record's job, by compare-and-set (re-read on a conflict).
async fn end_one(
    proxy: &Proxy,
    mut r: Record,
    to: JobState,
    result: &serde_json::Value,
    by: EndedBy,
) -> bool {
    let id = r.id.clone();
    for _ in 0..5 {
        let Some(j) = r.job.as_mut() else {
            return false;
        };
        if let Err(why) = job::end(j, to, result.clone(), None, by, now_ms()) {
            tracing::debug!(execution_id = %id, reason = %why, "job status: the job was ended already");
            return false;
        }
        match proxy.store.update(r).await {
            Ok(stored) => {
                tracing::info!(execution_id = %id, state = to.as_str(), by = by.as_str(), "job ended");
                proxy.metrics.job(&stored.upstream, &stored.route, to);
                return true;
            }
            Err(StoreError::Conflict { .. }) => match proxy.store.get(&id).await {
                Ok(Some(current)) => r = current,
                Ok(None) => return false,
                Err(e) => {
                    tracing::warn!(execution_id = %id, error = %e, "job status: could not re-read the record");
                    return false;
                }
            },
            Err(e) => {
                tracing::warn!(execution_id = %id, error = %e, "job status: could not write the job's end; tried again on the next poll");
                return false;
            }
        }
    }
    false
}

/// Poll the status of every running job whose route sets `job.status.every`, each at most
/// once per its `every` (the first time right away). Failures are logged and the job is
/// polled again on a later tick. Several instances may poll the same job: the record's
/// compare-and-set keeps one end.
pub fn spawn_poller(proxy: Arc<Proxy>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut last: HashMap<ExecutionId, Instant> = HashMap::new();
        loop {
            let rt = proxy.runtime();
            let Some(tick) = shortest_every(&rt) else {
                // No route polls (a reload may add one).
                last.clear();
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            };
            if let Err(e) = poll_pass(&proxy, &rt, &mut last).await {
                tracing::warn!(error = %e, "job polling: could not list running jobs; tried again on the next tick");
            }
            tokio::time::sleep(tick).await;
        }
    })
}

fn shortest_every(rt: &Runtime) -> Option<Duration> {
    rt.config
        .upstreams
        .iter()
        .flat_map(|u| u.routes.iter())
        .filter_map(|r| r.job.as_ref()?.status.as_ref()?.every)
        .min()
}

/// One pass over the running jobs (the job-state index, a page at a time).
async fn poll_pass(
    proxy: &Proxy,
    rt: &Runtime,
    last: &mut HashMap<ExecutionId, Instant>,
) -> Result<(), StoreError> {
    let mut after = None;
    let mut seen = std::collections::HashSet::new();
    loop {
        let page = proxy
            .store
            .list(&ListFilter {
                job: Some(JobFilter::In(JobState::Running)),
                after: after.clone(),
                limit: 100,
                ..ListFilter::default()
            })
            .await?;
        let full = page.len() == 100;
        after = page.last().map(|r| r.id.clone());
        for r in page {
            seen.insert(r.id.clone());
            let Some((i, up, route_name, spec, every)) = polled(rt, &r) else {
                continue;
            };
            if last.get(&r.id).is_some_and(|at| at.elapsed() < every) {
                continue;
            }
            last.insert(r.id.clone(), Instant::now());
            let Some(j) = &r.job else { continue };
            let job_id = j.id.clone();
            let timeout = up
                .routes
                .iter()
                .find(|x| x.name == route_name)
                .map_or(rt.config.timeouts.request, |x| x.timeout);
            let limit = rt.config.limits.max_response_bytes;
            match fetch(&rt.clients[i], up, &spec, &r, timeout, limit).await {
                Ok(bytes) => {
                    if let Some((to, result)) = spec.ended(&bytes) {
                        let routes = [route_name.as_str()];
                        end_jobs(proxy, &up.name, &routes, &job_id, to, result, EndedBy::Poll)
                            .await;
                    }
                }
                Err(why) => {
                    tracing::warn!(execution_id = %r.id, job_id = %job_id, reason = %why, "job status poll failed; polled again on a later tick")
                }
            }
        }
        if !full {
            break;
        }
    }
    // Jobs that ended (or records gone) are forgotten.
    last.retain(|id, _| seen.contains(id));
    Ok(())
}

/// The upstream (index and config), route name, status spec and period of a record whose
/// route polls its jobs.
fn polled<'a>(
    rt: &'a Runtime,
    r: &Record,
) -> Option<(
    usize,
    &'a crate::config::Upstream,
    String,
    StatusSpec,
    Duration,
)> {
    let (i, up) = rt
        .config
        .upstreams
        .iter()
        .enumerate()
        .find(|(_, u)| u.name == r.upstream)?;
    let route = up.routes.iter().find(|x| x.name == r.route)?;
    let spec = route.job.as_ref()?.status.as_ref()?;
    let every = spec.every?;
    Some((i, up, route.name.clone(), spec.clone(), every))
}

/// GET a job's status: the 2xx answer's body, or why not.
async fn fetch(
    client: &HttpClient,
    up: &crate::config::Upstream,
    spec: &StatusSpec,
    r: &Record,
    timeout: Duration,
    max: usize,
) -> Result<Bytes, String> {
    let job_id = r.job.as_ref().map(|j| j.id.as_str()).unwrap_or_default();
    let rel = spec.render(job_id, &r.path_params)?;
    let uri = downstream::uri(up, &rel).map_err(|e| format!("cannot build the status URI: {e}"))?;
    let mut h = HeaderMap::new();
    if let Ok(v) = HeaderValue::from_str(up.authority.as_str()) {
        h.insert(http::header::HOST, v);
    }
    h.insert(
        http::header::ACCEPT,
        HeaderValue::from_static("application/json"),
    );
    let req = downstream::build(spec.method.clone(), uri, h, body::empty());
    let answer = tokio::time::timeout(timeout, async {
        let resp = client
            .request(req)
            .await
            .map_err(|e| client::describe(&e))?;
        let (parts, b) = resp.into_parts();
        let bytes = Limited::new(b, max)
            .collect()
            .await
            .map_err(|e: BoxError| format!("reading the status answer failed: {e}"))?
            .to_bytes();
        Ok::<_, String>((parts.status, bytes))
    })
    .await
    .map_err(|_| format!("no answer within {timeout:?}"))??;
    match answer {
        (status, bytes) if status.is_success() => Ok(bytes),
        (status, _) => Err(format!("the status endpoint answered {status}")),
    }
}
