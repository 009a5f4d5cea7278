//! The request lifecycle: classify the request, then either stream it through (read-only)
//! or run it under an execution record (side effect). This module owns the shared state
//! of a running proxy; the phases live in [`side_effect`] and [`passthrough`].

mod downstream;
pub mod passthrough;
pub mod recovery;
pub mod side_effect;

use std::net::SocketAddr;
use std::sync::Arc;

use http::{Request, Response};
use hyper::body::Incoming;
use parking_lot::RwLock;

use crate::config::{Class, Config};
use crate::policy::classify::Classified;
use crate::store::Store;
use crate::wire::body::ProxyBody;
use crate::wire::client::{self, HttpClient};
use crate::wire::problem::{Kind, Problem};

/// What a config reload swaps as one unit: the validated config and its clients.
pub struct Runtime {
    pub config: Config,
    /// One pooled client per upstream, same order as `config.upstreams`.
    pub clients: Vec<HttpClient>,
}

impl Runtime {
    pub fn new(config: Config) -> Result<Runtime, client::ClientBuildError> {
        let clients = config
            .upstreams
            .iter()
            .map(|u| client::build(config.timeouts.connect, u.ca_file.as_deref()))
            .collect::<Result<_, _>>()?;
        Ok(Runtime { config, clients })
    }
}

/// A running proxy's shared state.
pub struct Proxy {
    runtime: RwLock<Arc<Runtime>>,
    pub store: Arc<dyn Store>,
    /// This instance's lease owner id (unique per process start).
    pub owner: String,
    pub metrics: crate::metrics::Metrics,
}

impl Proxy {
    pub fn new(runtime: Runtime, store: Arc<dyn Store>) -> Arc<Proxy> {
        let owner = format!(
            "{}-{}-{}",
            hostname(),
            std::process::id(),
            crate::store::now_ms()
        );
        Arc::new(Proxy {
            runtime: RwLock::new(Arc::new(runtime)),
            store,
            owner,
            metrics: crate::metrics::Metrics::new(),
        })
    }

    pub fn runtime(&self) -> Arc<Runtime> {
        self.runtime.read().clone()
    }

    /// Swap in a reloaded config; requests in flight finish on the old one.
    pub fn reload(&self, runtime: Runtime) {
        *self.runtime.write() = Arc::new(runtime);
    }

    /// Entry point for every request on the proxy listener.
    pub async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
        peer: SocketAddr,
    ) -> Response<ProxyBody> {
        let rt = self.runtime();
        let cfg = &rt.config;
        let path = req.uri().path().to_string();
        match cfg
            .routes
            .classify(&cfg.upstreams, cfg.unmatched, req.method(), &path)
        {
            Classified::NoUpstream => {
                Problem::new(Kind::NoRoute, format!("no upstream is mounted at {path}"))
                    .into_response()
            }
            Classified::Unmatched { upstream } => Problem::new(
                Kind::RouteUnmatched,
                format!(
                    "no route of upstream `{}` matches {} {path} and `unmatched: reject` is set",
                    upstream.name,
                    req.method()
                ),
            )
            .into_response(),
            Classified::Matched(target) => {
                let client = rt.clients[target.upstream_index].clone();
                match target.route.class {
                    Class::ReadOnly => {
                        passthrough::forward(&rt, &client, &target, req, peer, true).await
                    }
                    Class::SideEffect => {
                        // hyper drops the service future when the client disconnects. A
                        // side effect must not stop half-way (it would sit `executing`
                        // until a restart), so it runs as its own task to completion.
                        let owned = target.to_owned_ref();
                        let proxy = self.clone();
                        let rt = rt.clone();
                        let task = tokio::spawn(async move {
                            let target = owned.bind(&rt.config.upstreams);
                            side_effect::handle(&proxy, &rt, &client, &target, req, peer).await
                        });
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
            }
        }
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
