//! The commands of the `idemproxy` binary, as library functions: opening the configured
//! store, running the proxy with its background tasks and signals, and the offline
//! operator commands (`records`, `resolve`, `gc`). `main.rs` only parses arguments.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use tokio::net::TcpListener;

use crate::config::{Config, StoreBackend};
use crate::policy::identity::ExecutionId;
use crate::policy::state::State;
use crate::proxy::{recovery, Proxy, Runtime, Worker};
use crate::store::{now_ms, ListFilter, Record, Store, StoredResponse};

/// Open the store the config names. For redb the file is created if missing.
pub async fn open_store(cfg: &Config) -> anyhow::Result<Arc<dyn Store>> {
    match &cfg.store.backend {
        StoreBackend::Redb { path, cache_bytes } => {
            let store = crate::store::redb::RedbStore::open_with_cache(path, *cache_bytes)
                .with_context(|| format!("opening redb store {}", path.display()))?;
            Ok(Arc::new(store))
        }
        StoreBackend::Postgres { url_env, schema } => open_postgres(url_env, schema).await,
    }
}

/// [`open_store`] for `serve`: a redb file is compacted first. redb reuses the pages gc
/// frees, so under steady churn the file stays near its peak live size without help;
/// compaction gives back what a past peak left, and it needs the file to itself (no
/// transaction open), which a running proxy never has. Startup is that moment.
async fn open_store_for_serving(cfg: &Config) -> anyhow::Result<Arc<dyn Store>> {
    match &cfg.store.backend {
        StoreBackend::Redb { path, cache_bytes } => {
            let (store, _) = open_compacted(path.clone(), *cache_bytes, false).await?;
            Ok(Arc::new(store))
        }
        StoreBackend::Postgres { .. } => open_store(cfg).await,
    }
}

/// Opens a redb store, sweeps retention if asked (returning how many records went), then
/// compacts. Blocking work, so it runs off the async threads.
async fn open_compacted(
    path: std::path::PathBuf,
    cache_bytes: usize,
    sweep: bool,
) -> anyhow::Result<(crate::store::redb::RedbStore, u64)> {
    tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let mut store = crate::store::redb::RedbStore::open_with_cache(&path, cache_bytes)
            .with_context(|| format!("opening redb store {}", path.display()))?;
        let removed = if sweep {
            tokio::runtime::Handle::current().block_on(recovery::sweep(&store))?
        } else {
            0
        };
        let before = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        // Compaction reads the whole file even when there is nothing to move (about 7 s
        // per GiB here), so it runs only when the file is over twice what its live records
        // need, taking that as twice their bytes (redb leaves B-tree pages part-full).
        // Small files are not worth a look.
        let need = store.estimated_live_bytes().unwrap_or(0).saturating_mul(2);
        let worth_it = before > 16 << 20 && before > need.saturating_mul(2);
        if !worth_it && !sweep {
            return Ok((store, removed));
        }
        let started = std::time::Instant::now();
        match store.compact() {
            Ok(done) => {
                let after = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
                tracing::info!(
                    file = %path.display(),
                    before_bytes = before,
                    after_bytes = after,
                    compacted = done,
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "store compaction"
                );
            }
            // Not fatal: the store works uncompacted, only larger than it needs to be.
            Err(e) => tracing::warn!(error = %e, "store compaction skipped"),
        }
        Ok((store, removed))
    })
    .await
    .context("store open task failed")?
}

async fn open_postgres(url_env: &str, schema: &str) -> anyhow::Result<Arc<dyn Store>> {
    let url = std::env::var(url_env)
        .with_context(|| format!("store.backend is postgres but the environment variable {url_env} (store.url_env) is not set"))?;
    postgres_store(&url, schema).await
}

async fn postgres_store(url: &str, schema: &str) -> anyhow::Result<Arc<dyn Store>> {
    let store = crate::store::postgres::PostgresStore::connect(url, schema)
        .await
        .with_context(|| format!("connecting to the PostgreSQL store (schema {schema})"))?;
    Ok(Arc::new(store))
}

/// Handle on a running proxy (used by `serve` and by tests that embed the proxy).
pub struct Running {
    pub addr: std::net::SocketAddr,
    /// The admin listener's address, when the config has an `admin` block.
    pub admin_addr: Option<std::net::SocketAddr>,
    pub proxy: Arc<Proxy>,
    shutdown: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    admin_task: Option<tokio::task::JoinHandle<()>>,
}

impl Running {
    /// Stop accepting, drain, and wait for the server tasks.
    pub async fn stop(self) {
        let _ = self.shutdown.send(true);
        let _ = self.task.await;
        if let Some(admin) = self.admin_task {
            let _ = admin.await;
        }
    }
}

/// Start the proxy listener and background tasks on an opened store.
pub async fn start(cfg: Config, store: Arc<dyn Store>) -> anyhow::Result<Running> {
    let listen = cfg.listen;
    // Refuse to start without the token before anything is bound or recovered.
    let admin = match &cfg.admin {
        Some(a) => Some((a.listen, crate::admin::Tokens::from_env(&a.tokens)?)),
        None => None,
    };
    let notify = match cfg.admin.as_ref().and_then(|a| a.notify.clone()) {
        Some(n) => {
            let secret = crate::admin::auth::notify_secret(&n.secret_env)?;
            let client = crate::wire::client::build(cfg.timeouts.connect, None)
                .context("building the notification client")?;
            Some((n, secret, client))
        }
        None => None,
    };
    let lease = cfg.store.lease;
    let gc_every = cfg.store.gc_interval;
    let reconcile_every = cfg.store.reconcile_interval;
    // Read once at start, like `listen`: a reload does not change the listener.
    let max_header_bytes = cfg.limits.max_header_bytes;
    let (head_timeout, body_timeout) = (cfg.timeouts.client_header, cfg.timeouts.client_body);
    let exclusive = matches!(cfg.store.backend, StoreBackend::Redb { .. });
    // A redb file is locked by one process: every `executing` record in it belongs to a
    // previous run that died, whatever its lease says. A shared store waits for leases.
    let before = if exclusive { i64::MAX } else { now_ms() };
    let moved = recovery::recover_stale(store.as_ref(), before)
        .await
        .context("recovering stale executions")?;
    if moved > 0 {
        tracing::warn!(
            count = moved,
            "executions left by a stopped instance are now outcome_unknown"
        );
    }
    let runtime = Runtime::new(cfg).context("building upstream clients")?;
    let proxy = Proxy::new(runtime, store.clone());
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding the proxy listener {listen}"))?;
    let addr = listener.local_addr()?;
    let (tx, rx) = tokio::sync::watch::channel(false);
    let (admin_addr, admin_task) = match admin {
        Some((admin_listen, token)) => {
            let (addr, task) = crate::admin::spawn(admin_listen, token, proxy.clone(), rx.clone())
                .await
                .with_context(|| format!("binding the admin listener {admin_listen}"))?;
            (Some(addr), Some(task))
        }
        None => (None, None),
    };
    let keeper = recovery::spawn_lease_keeper(store.clone(), proxy.owner.clone(), lease);
    let gc = recovery::spawn_gc(store.clone(), gc_every);
    // First pass right away: what a crashed predecessor left unknown is looked up now,
    // not when its client happens to retry.
    let reconciler = crate::proxy::reconcile::spawn(proxy.clone(), reconcile_every);
    // Running jobs of routes with `job.status.every` are polled (idle when none does).
    let job_poller = crate::proxy::jobs::spawn_poller(proxy.clone());
    // Calls waiting for a person are announced (admin.notify); the store is the outbox.
    let notifier = notify
        .map(|(n, secret, client)| crate::admin::notify::spawn(n, secret, store.clone(), client));
    let p = proxy.clone();
    let options = crate::wire::server::Options {
        max_header_bytes,
        head_timeout,
        body_timeout,
        ..crate::wire::server::Options::from_env(Duration::from_secs(30))
    };
    let hyper_connections = proxy.metrics.hyper_connections.clone();
    let on_hand_off: crate::wire::fast::HandOffHook = Arc::new(move || {
        hyper_connections.inc();
    });
    let task = tokio::spawn(async move {
        // Each worker thread's handler (see `Worker`'s `Handler` impl).
        let make_handler = move || Worker::new(p.clone());
        crate::wire::server::serve_on_workers(listener, make_handler, rx, options, on_hand_off)
            .await;
        keeper.abort();
        gc.abort();
        reconciler.abort();
        job_poller.abort();
        if let Some(n) = notifier {
            n.abort();
        }
    });
    tracing::info!(%addr, "proxy listening");
    Ok(Running {
        addr,
        admin_addr,
        proxy,
        shutdown: tx,
        task,
        admin_task,
    })
}

/// How `serve` was asked to start.
#[derive(Clone, Copy, Debug, Default)]
pub struct ServeOptions {
    /// `--init-store`: a new redb store may be created in place of an empty file (see
    /// [`crate::store::redb::RedbStore::open_with_cache`]).
    pub init_store: bool,
}

/// `idemproxy serve`: run until SIGTERM/SIGINT (drain) with SIGHUP reloading the config.
pub async fn serve(cfg: Config) -> anyhow::Result<()> {
    serve_with(cfg, ServeOptions::default()).await
}

/// [`serve`] with options.
pub async fn serve_with(cfg: Config, options: ServeOptions) -> anyhow::Result<()> {
    if let (true, StoreBackend::Redb { path, .. }) = (options.init_store, &cfg.store.backend) {
        crate::store::redb::RedbStore::discard_empty(path)?;
    }
    use tokio::signal::unix::{signal, SignalKind};
    let source = cfg.source.clone();
    // Handlers first: a SIGHUP or SIGTERM sent as soon as the "listening" line appears
    // must reach us, not the default action (which would kill the process).
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    let store = open_store_for_serving(&cfg).await?;
    // What a reload cannot change: the listener as configured at start and as bound, and
    // the store that is open.
    let started = Started {
        listen: cfg.listen,
        store: cfg.store.backend.clone(),
    };
    let running = start(cfg, store).await?;
    // The admin line comes first: a reader that waits for the proxy line has both.
    if let Some(admin) = running.admin_addr {
        println!("idemproxy admin listening on {admin}");
    }
    println!("idemproxy listening on {}", running.addr);
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            _ = hup.recv() => reload(&running.proxy, &source, &started, running.addr),
        }
    }
    tracing::info!("shutting down: draining in-flight requests");
    running.stop().await;
    Ok(())
}

/// What `serve` started with that only a restart changes.
struct Started {
    listen: std::net::SocketAddr,
    store: StoreBackend,
}

/// The store a config names, for a log line (never a URL: only the variable's name).
fn describe_store(b: &StoreBackend) -> String {
    match b {
        StoreBackend::Redb { path, .. } => format!("redb {}", path.display()),
        StoreBackend::Postgres { url_env, schema } => {
            format!("postgres (url_env {url_env}, schema {schema})")
        }
    }
}

/// SIGHUP: routes, limits and identity change live; listen address, store and
/// `limits.max_header_bytes` need a restart. Compared with what was started, not with
/// the last reload: a change refused once is refused (and named) again.
fn reload(proxy: &Proxy, source: &std::path::Path, started: &Started, bound: std::net::SocketAddr) {
    match Config::load(source) {
        Ok(cfg) => {
            let old = proxy.runtime();
            if cfg.listen != started.listen {
                tracing::warn!(
                    requested = %cfg.listen,
                    "listen address changes need a restart; still listening on {bound}"
                );
            }
            if cfg.store.backend != started.store {
                tracing::warn!(
                    requested = %describe_store(&cfg.store.backend),
                    "store changes need a restart; still using {}",
                    describe_store(&started.store)
                );
            }
            if cfg.limits.max_header_bytes != old.config.limits.max_header_bytes {
                tracing::warn!(
                    "limits.max_header_bytes changes need a restart; keeping {}",
                    old.config.limits.max_header_bytes
                );
            }
            let admin_of = |c: &Config| c.admin.as_ref().map(|a| (a.listen, a.tokens.clone()));
            if admin_of(&cfg) != admin_of(&old.config) {
                tracing::warn!(
                    "admin listener and token changes need a restart; keeping the running ones"
                );
            }
            match Runtime::new(cfg) {
                Ok(rt) => {
                    proxy.reload(rt);
                    tracing::info!(file = %source.display(), "configuration reloaded");
                }
                Err(e) => tracing::error!(error = %e, "reload rejected"),
            }
        }
        Err(e) => tracing::error!(error = %e, "reload rejected; keeping the running configuration"),
    }
}

/// `idemproxy records list`.
pub async fn records_list(
    cfg: &Config,
    status: Option<State>,
    limit: usize,
) -> anyhow::Result<Vec<Record>> {
    let store = open_store(cfg).await?;
    Ok(store
        .list(&ListFilter {
            status,
            limit,
            ..ListFilter::default()
        })
        .await?)
}

/// `idemproxy records show`.
pub async fn records_show(cfg: &Config, id: &str) -> anyhow::Result<Record> {
    let store = open_store(cfg).await?;
    match store.get(&ExecutionId(id.to_string())).await? {
        Some(r) => Ok(r),
        None => bail!("no execution record {id}"),
    }
}

/// `idemproxy resolve ID --as committed|not-committed`: an operator's decision on an
/// `outcome_unknown` record, the same decision as the admin API's.
pub async fn resolve(
    store: &dyn Store,
    id: &str,
    committed: bool,
    result: Option<StoredResponse>,
    by: &str,
) -> anyhow::Result<Record> {
    let id = ExecutionId(id.to_string());
    Ok(crate::admin::actions::resolve(store, &id, committed, result, by).await?)
}

/// `idemproxy gc`. Offline, a redb file is also compacted after the sweep, so an operator
/// can give a past peak's space back without waiting for the next start.
pub async fn gc(cfg: &Config) -> anyhow::Result<u64> {
    if let StoreBackend::Redb { path, cache_bytes } = &cfg.store.backend {
        let (_, removed) = open_compacted(path.clone(), *cache_bytes, true).await?;
        return Ok(removed);
    }
    let store = open_store(cfg).await?;
    Ok(recovery::sweep(store.as_ref()).await?)
}
