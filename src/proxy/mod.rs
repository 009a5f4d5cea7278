//! The request lifecycle: classify the request, then either stream it through (read-only)
//! or run it under an execution record (side effect). This module owns the shared state
//! of a running proxy; the phases live in [`side_effect`] and [`passthrough`].

mod batch;
mod downstream;
pub mod jobs;
pub mod mcp;
pub mod passthrough;
mod pending;
pub mod reconcile;
pub mod recovery;
pub mod replay;
pub mod side_effect;
pub mod webhook;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use futures_util::future::Either;
use http::{HeaderMap, Request, Response};
use parking_lot::{Mutex, RwLock};

use crate::config::{Class, Config};
use crate::metrics::{Metrics, ReplayCounters};
use crate::policy::classify::{Classified, RouteRef, Target};
use crate::store::Store;
use crate::wire::body::{ProxyBody, RequestBody};
use crate::wire::client::{self, HttpClient};
use crate::wire::headers::ClientAddr;
use crate::wire::problem::{Kind, Problem};
use crate::wire::raw::{RawOutcome, RawRequest};

/// What a config reload swaps as one unit: the validated config and its clients.
pub struct Runtime {
    pub config: Arc<Config>,
    /// One pooled client per upstream, same order as `config.upstreams`.
    pub clients: Vec<HttpClient>,
    /// What the worker threads' runtimes of this config share.
    pub shared: Shared,
    /// Per upstream, per route (declared, then the two fallbacks): its replay counters,
    /// looked up on the route's first replay.
    replay_counters: Box<[Box<[OnceLock<ReplayCounters>]>]>,
}

impl Runtime {
    pub fn new(config: Config) -> Result<Runtime, client::ClientBuildError> {
        let shared = Shared {
            replays: Arc::new(replay::ReplayCache::new(config.limits.replay_cache_bytes)),
            calls: Arc::from_iter(config.upstreams.iter().map(|u| {
                (0..u.routes.len() + 2)
                    .map(|_| {
                        Arc::new(tokio::sync::Semaphore::new(
                            config.limits.max_calls_in_flight,
                        ))
                    })
                    .collect::<Box<[_]>>()
            })),
        };
        Self::with_clients(Arc::new(config), shared)
    }

    /// Resolves the per-route counters of `metrics` this config's requests bump, once,
    /// before the runtime serves (the proxy does it when it takes a runtime): each route
    /// holds its own handle, so a request adds one to it and looks nothing up.
    fn count_with(&mut self, metrics: &Metrics) {
        for u in &self.config.upstreams {
            let fallbacks = [&u.fallback_side_effect, &u.fallback_read_only];
            for r in u.routes.iter().chain(fallbacks) {
                let labels = Metrics::labels(&u.name, &r.name);
                let _ = r
                    .read_only_total
                    .set(metrics.read_only.get_or_create(&labels).clone());
            }
        }
    }

    /// One read-only request of `target`'s route forwarded: one atomic add.
    #[inline]
    pub fn count_read_only(&self, target: &Target<'_>) {
        if let Some(c) = target.route.read_only_total.get() {
            c.inc();
        }
    }

    /// The same config with clients of its own. A client's connections live on the
    /// runtime that opened them, so each server worker thread gets its own clients: a
    /// shared pool would hand one thread's connection to another and every request would
    /// cross threads twice (see docs/PERFORMANCE.md).
    fn with_clients(
        config: Arc<Config>,
        shared: Shared,
    ) -> Result<Runtime, client::ClientBuildError> {
        let clients = config
            .upstreams
            .iter()
            .map(|u| client::build(config.timeouts.connect, u.ca_file.as_deref()))
            .collect::<Result<_, _>>()?;
        let replay_counters = config
            .upstreams
            .iter()
            .map(|u| (0..u.routes.len() + 2).map(|_| OnceLock::new()).collect())
            .collect();
        Ok(Runtime {
            config,
            clients,
            shared,
            replay_counters,
        })
    }

    /// The turns of `target`'s route (`limits.max_calls_in_flight` per route).
    pub fn turns(&self, target: &Target<'_>) -> &Arc<tokio::sync::Semaphore> {
        let routes = &self.shared.calls[target.upstream_index];
        let slot = match target.route_ref {
            RouteRef::Declared(i) => i,
            RouteRef::FallbackSideEffect => routes.len() - 2,
            RouteRef::FallbackReadOnly => routes.len() - 1,
        };
        &routes[slot]
    }

    /// The replay counters of `target`'s route.
    pub fn replay_counters(&self, metrics: &Metrics, target: &Target<'_>) -> &ReplayCounters {
        let routes = &self.replay_counters[target.upstream_index];
        let slot = match target.route_ref {
            RouteRef::Declared(i) => i,
            RouteRef::FallbackSideEffect => routes.len() - 2,
            RouteRef::FallbackReadOnly => routes.len() - 1,
        };
        routes[slot]
            .get_or_init(|| metrics.replay_counters(&target.upstream.name, &target.route.name))
    }
}

/// What the worker threads' runtimes of one loaded config share.
#[derive(Clone)]
pub struct Shared {
    /// Delivered answers ready to replay.
    pub replays: Arc<replay::ReplayCache>,
    /// Turns for keyed side-effect calls past admission (`limits.max_calls_in_flight`),
    /// per upstream, per route (declared, then the two fallbacks): a slow route fills its
    /// own turns and never delays calls to the others.
    pub calls: Arc<[Box<[Arc<tokio::sync::Semaphore>]>]>,
}

/// A running proxy's shared state.
pub struct Proxy {
    runtime: RwLock<Arc<Runtime>>,
    /// Bumped by every reload, so worker threads notice without taking the lock.
    generation: AtomicU64,
    pub store: Arc<dyn Store>,
    /// This instance's lease owner id (unique per process start).
    pub owner: String,
    pub metrics: crate::metrics::Metrics,
}

impl Proxy {
    pub fn new(mut runtime: Runtime, store: Arc<dyn Store>) -> Arc<Proxy> {
        let metrics = crate::metrics::Metrics::new();
        runtime.count_with(&metrics);
        let owner = format!(
            "{}-{}-{}",
            hostname(),
            std::process::id(),
            crate::store::now_ms()
        );
        Arc::new(Proxy {
            runtime: RwLock::new(Arc::new(runtime)),
            generation: AtomicU64::new(0),
            store,
            owner,
            metrics,
        })
    }

    pub fn runtime(&self) -> Arc<Runtime> {
        self.runtime.read().clone()
    }

    /// Swap in a reloaded config; requests in flight finish on the old one.
    pub fn reload(&self, mut runtime: Runtime) {
        runtime.count_with(&self.metrics);
        *self.runtime.write() = Arc::new(runtime);
        // After the swap: a worker that sees the new generation also sees the new runtime.
        self.generation.fetch_add(1, Ordering::Release);
    }

    /// Entry point for a request, on the shared runtime (see [`Worker`] for the listener's).
    pub async fn handle(
        self: Arc<Self>,
        req: Request<RequestBody>,
        peer: ClientAddr,
    ) -> Response<ProxyBody> {
        let rt = self.runtime();
        self.handle_on(rt, req, peer).await
    }

    async fn handle_on(
        self: &Arc<Self>,
        rt: Arc<Runtime>,
        req: Request<RequestBody>,
        peer: ClientAddr,
    ) -> Response<ProxyBody> {
        let cfg = &rt.config;
        // The classification does not borrow the path, so no copy of it is needed.
        match cfg.routes.classify(
            &cfg.upstreams,
            cfg.unmatched,
            req.method(),
            req.uri().path(),
        ) {
            Classified::Matched(target) => self.dispatch(&rt, target, req, None, peer).await,
            other => unrouted(&other, req.method(), req.uri().path()),
        }
    }

    /// A request whose route is known (`looked`: the fast path looked it up in the replay
    /// cache already, see [`side_effect::replay_raw`]).
    async fn dispatch(
        self: &Arc<Self>,
        rt: &Arc<Runtime>,
        target: Target<'_>,
        req: Request<RequestBody>,
        looked: Option<side_effect::Looked>,
        peer: ClientAddr,
    ) -> Response<ProxyBody> {
        if target.upstream.mcp.is_some() {
            // Boxed: the MCP lifecycle's future stays out of every HTTP request's.
            return Box::pin(mcp::handle(self, rt, target, req, peer)).await;
        }
        let client = &rt.clients[target.upstream_index];
        match target.route.class {
            // The one field test a pass-through pays for jobs: routes carrying a
            // `job.status` endpoint are observed (boxed, off every other request's future).
            Class::ReadOnly => {
                rt.count_read_only(&target);
                match &target.route.observes {
                    None => passthrough::forward(rt, client, &target, req, &peer, true).await,
                    Some(watch) => {
                        Box::pin(jobs::observe(self, rt, client, &target, req, &peer, watch)).await
                    }
                }
            }
            // Admission (key, body, replay from memory) and what follows are each smaller
            // than the pass-through's future, and a request's future is as large as its
            // largest branch, so neither needs a box of its own.
            Class::SideEffect => {
                let admitted = side_effect::admit(self, rt, &target, req, looked).await;
                self.side_effect(rt, client, target, admitted, peer).await
            }
            // A sibling admission (signature, event id, correlation), then the same core.
            Class::Webhook => {
                let admitted = Box::pin(webhook::admit(self, rt, &target, req)).await;
                let (upstream, route) = (target.upstream, target.route);
                let answer = self.side_effect(rt, client, target, admitted, peer).await;
                webhook::count(self, &upstream.name, &route.name, &answer);
                answer
            }
        }
    }

    /// A side-effect request after admission (key, fingerprint, replay; see
    /// [`side_effect::admit`]): its answer, or the call under its record (or unprotected)
    /// as a task of its own.
    async fn side_effect(
        self: &Arc<Self>,
        rt: &Arc<Runtime>,
        client: &HttpClient,
        target: Target<'_>,
        admitted: side_effect::Admit,
        peer: ClientAddr,
    ) -> Response<ProxyBody> {
        let admitted = match admitted {
            side_effect::Admit::Respond(resp) => return resp,
            other => other,
        };
        // A bounded number of calls go on to the store and the downstream
        // at once: past that they wait here, holding nothing but their
        // connection, instead of each holding a task, its records and a
        // place in the writer's queue (1,000 concurrent first executions
        // took over 140 MiB). The writer's batches stay full at the bound.
        // A call whose turn is not free at once waits in its task, where a stored result
        // is looked up first: a replay never queues behind executions.
        let (turn, queue) = match &admitted {
            side_effect::Admit::Protected(_) => {
                let turns = rt.turns(&target);
                match turns.clone().try_acquire_owned() {
                    Ok(turn) => (Some(turn), None),
                    Err(_) => (None, Some(turns.clone())),
                }
            }
            _ => (None, None),
        };
        let client = client.clone();
        // hyper drops the service future when the client disconnects. A
        // side effect must not stop half-way (it would sit `executing`
        // until a restart), so it runs as its own task to completion.
        let owned = target.to_owned_ref();
        let proxy = self.clone();
        let rt = rt.clone();
        let span = match &admitted {
            side_effect::Admit::Protected(call) => call.span(&rt.config.identity),
            _ => tracing::Span::none(),
        };
        let task = tokio::spawn(tracing::Instrument::instrument(
            async move {
                let _turn = turn;
                let target = owned.bind(&rt.config.upstreams);
                match admitted {
                    side_effect::Admit::Protected(call) => {
                        side_effect::run(&proxy, &rt, &client, &target, call, &peer, queue).await
                    }
                    side_effect::Admit::Unprotected(req) => {
                        side_effect::unprotected(&proxy, &rt, &client, &target, req, &peer).await
                    }
                    side_effect::Admit::Respond(resp) => resp,
                }
            },
            span,
        ));
        match task.await {
            Ok(resp) => resp,
            Err(e) => {
                tracing::error!(error = %e, "side-effect task failed");
                Problem::new(
                    Kind::Internal,
                    "the request handler failed; see the proxy log",
                )
                .into_response()
            }
        }
    }
}

/// The answer to a request no route takes: `404 no-route`, `404 route-unmatched`, or `400
/// bad-request` for a path with no normal form.
fn unrouted(classified: &Classified<'_>, method: &http::Method, path: &str) -> Response<ProxyBody> {
    match classified {
        Classified::Unmatched { upstream } => Problem::new(
            Kind::RouteUnmatched,
            format!(
                "no route of upstream `{}` matches {method} {path} and `unmatched: reject` is set",
                upstream.name,
            ),
        ),
        Classified::BadPath(bad) => Problem::new(
            Kind::BadRequest,
            format!("{}; nothing was forwarded", bad.0),
        ),
        _ => Problem::new(Kind::NoRoute, format!("no upstream is mounted at {path}")),
    }
    .into_response()
}

/// One server worker thread's handle on the proxy: the current config with this thread's
/// own upstream clients, rebuilt when a reload bumps the generation. Only its thread uses
/// it, so its lock is never contended and its reference counts stay in that core's cache.
pub struct Worker {
    proxy: Arc<Proxy>,
    local: Mutex<Option<(u64, Arc<Runtime>)>>,
}

impl Worker {
    pub fn new(proxy: Arc<Proxy>) -> Arc<Worker> {
        Arc::new(Worker {
            proxy,
            local: Mutex::new(None),
        })
    }

    fn runtime(&self) -> Arc<Runtime> {
        let generation = self.proxy.generation.load(Ordering::Acquire);
        let mut local = self.local.lock();
        if let Some((g, rt)) = local.as_ref() {
            if *g == generation {
                return rt.clone();
            }
        }
        let shared = self.proxy.runtime();
        let rt = match Runtime::with_clients(shared.config.clone(), shared.shared.clone()) {
            Ok(rt) => Arc::new(rt),
            Err(e) => {
                // The same config built its clients once already; if this thread cannot,
                // it still serves, through the shared clients.
                tracing::warn!(error = %e, "worker could not build its own upstream clients");
                shared
            }
        };
        *local = Some((generation, rt.clone()));
        rt
    }

    pub async fn handle(
        self: Arc<Self>,
        req: Request<RequestBody>,
        peer: ClientAddr,
    ) -> Response<ProxyBody> {
        let rt = self.runtime();
        self.proxy.handle_on(rt, req, peer).await
    }
}

/// The listener's handler: every request by [`Worker::handle`], and those the fast path
/// read whole to a read-only route of an `http://` upstream by the read-only lane
/// ([`passthrough::forward_raw`]). Boxed per request: a connection keeps room for its
/// handler's future for its whole life otherwise, and the request lifecycle's future is
/// about 6.5 KiB (6.5 MB of 1,000 idle keep-alive connections, in heaptrack); a box lives
/// only while its request does.
impl crate::wire::fast::Handler for Arc<Worker> {
    type Answer = Pin<Box<dyn Future<Output = Response<ProxyBody>> + Send>>;
    type Raw = Pin<Box<dyn Future<Output = RawOutcome> + Send>>;

    fn call(&self, req: Request<RequestBody>, peer: ClientAddr) -> Self::Answer {
        Box::pin(self.clone().handle(req, peer))
    }

    fn serve(
        &self,
        req: RawRequest,
        spare: Option<HeaderMap>,
        peer: &ClientAddr,
    ) -> Either<Self::Raw, Self::Answer> {
        // Classified once, here: the route decides the lane, and the usual way goes on
        // with the same target.
        let rt = self.runtime();
        let cfg = &rt.config;
        let target =
            match cfg
                .routes
                .classify(&cfg.upstreams, cfg.unmatched, &req.method, req.uri.path())
            {
                Classified::Matched(target) => target,
                other => {
                    let answer = unrouted(&other, &req.method, req.uri.path());
                    return Either::Right(Box::pin(std::future::ready(answer)));
                }
            };
        let mut looked = None;
        // An MCP upstream's requests all go the usual way, to `mcp::handle`.
        if req.cut.is_none() && target.upstream.mcp.is_none() {
            if passthrough::takes_raw(&target) {
                rt.count_read_only(&target);
                return Either::Left(Box::pin(passthrough::forward_raw(
                    rt.clone(),
                    &target,
                    req,
                    peer,
                )));
            }
            // A byte-for-byte retry of a delivered call, answered from memory as bytes.
            if target.route.class == Class::SideEffect {
                match side_effect::replay_raw(&self.proxy, &rt, &target, &req) {
                    side_effect::RawReplay::Answered(answer) => {
                        return Either::Left(Box::pin(std::future::ready(Ok(answer))))
                    }
                    side_effect::RawReplay::Missed(keyed) => looked = Some(keyed),
                    side_effect::RawReplay::Declined => {}
                }
            }
        }
        let target = target.into_owned();
        let Some(req) = req.into_request(spare) else {
            // Not reached: httparse, which read the head, admits exactly the bytes `http`
            // does.
            let refused = Problem::new(Kind::BadRequest, "the request's head is not valid HTTP");
            return Either::Right(Box::pin(std::future::ready(refused.into_response())));
        };
        let proxy = self.proxy.clone();
        let peer = peer.clone();
        Either::Right(Box::pin(async move {
            let target = target.into_bound(&rt.config.upstreams);
            proxy.dispatch(&rt, target, req, looked, peer).await
        }))
    }
}

fn hostname() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "idemproxy".into())
}
