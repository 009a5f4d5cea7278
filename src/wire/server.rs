//! The listener: accepts TCP connections and serves HTTP/1.1 and HTTP/2 (auto-detected),
//! handing every request to a service: plain HTTP/1.1 requests through the fast path in
//! [`super::fast`], everything else with hyper. Shutdown stops accepting and drains
//! in-flight connections, bounded by a grace period. (The admin listener, [`serve`], is
//! hyper only.)
//!
//! Connections are served by worker threads, one single-threaded tokio runtime each,
//! and a connection stays on the worker it was handed to: a proxied request then never
//! wakes another thread (with one work-stealing runtime, every request did, twice; see
//! docs/PERFORMANCE.md). The accept loop runs on the caller's runtime and deals
//! connections out in turn. With one worker per CPU the process may use (the default),
//! each worker is pinned to its CPU (`IDEMPROXY_PIN_WORKERS=0` turns this off):
//! left to the scheduler, the workers of a busy two-core machine were off their CPUs for
//! milliseconds at a time, and that was the pass-through's p99 (docs/PERFORMANCE.md,
//! "Threads and build").

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot, watch};

use super::body::ProxyBody;
use super::fast;
use super::headers::ClientAddr;

/// How the listener runs.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// Worker threads serving connections.
    pub workers: usize,
    /// How long shutdown waits for in-flight requests.
    pub grace: Duration,
    /// Pin each worker to a CPU of its own, when there is one worker per CPU.
    pub pin: bool,
    /// The largest HTTP/1 request head read (request line and headers; `limits.max_header_bytes`).
    /// A larger head is answered `431 Request Header Fields Too Large` and the connection
    /// closed. It is also the most a connection's read buffer grows to, and that is why the
    /// default is hyper's smallest: with any larger bound, the first bytes the HTTP/2
    /// detection reads ahead made every connection's 8 KiB buffer double to 16 KiB on its
    /// first request, 8 MB per 1,000 connections (docs/PERFORMANCE.md, "Memory per connection").
    pub max_header_bytes: usize,
    /// Serve plain HTTP/1.1 requests on the fast path ([`super::fast`]); `false` hands
    /// every connection to hyper (`IDEMPROXY_FAST_PATH=0`).
    pub fast_path: bool,
    /// `timeouts.client_header`: the longest wait for a complete request head, from its
    /// first byte or from when the connection went idle; then the connection is closed.
    pub head_timeout: Duration,
    /// `timeouts.client_body`: the longest a request body may go without a byte (408).
    pub body_timeout: Duration,
}

/// `limits.max_header_bytes` by default: 8 KiB, as nginx's longest header line and
/// Apache's longest field. hyper's HTTP/1 server accepts nothing smaller.
pub const DEFAULT_MAX_HEADER_BYTES: usize = 8 * 1024;
/// `timeouts.client_header` by default, as hyper's `header_read_timeout`.
pub const DEFAULT_HEAD_TIMEOUT: Duration = Duration::from_secs(30);
/// `timeouts.client_body` by default, as nginx's `client_body_timeout`.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(60);
/// The largest `limits.max_header_bytes` accepted.
pub const MAX_MAX_HEADER_BYTES: usize = 1024 * 1024;

impl Options {
    /// One worker per CPU, unless `IDEMPROXY_WORKERS` says otherwise; workers pinned
    /// unless `IDEMPROXY_PIN_WORKERS` is `0`, `false` or `off`; the HTTP/1.1 fast path on
    /// unless `IDEMPROXY_FAST_PATH` is.
    pub fn from_env(grace: Duration) -> Options {
        let workers = std::env::var("IDEMPROXY_WORKERS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|n| *n > 0)
            .or_else(|| std::thread::available_parallelism().map(|n| n.get()).ok())
            .unwrap_or(1);
        let on = |var: &str| {
            std::env::var(var)
                .map(|v| {
                    !matches!(
                        v.trim().to_ascii_lowercase().as_str(),
                        "0" | "false" | "off"
                    )
                })
                .unwrap_or(true)
        };
        Options {
            workers,
            grace,
            pin: on("IDEMPROXY_PIN_WORKERS"),
            max_header_bytes: DEFAULT_MAX_HEADER_BYTES,
            fast_path: on("IDEMPROXY_FAST_PATH"),
            head_timeout: DEFAULT_HEAD_TIMEOUT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
        }
    }

    /// The CPU for each worker, in order, or `None` to leave them unpinned. Workers are
    /// pinned only when there is exactly one per CPU this process may run on (its affinity
    /// mask, which `taskset` or a container's cpuset narrows): with fewer, pinning would
    /// crowd them, and every other instance on the host, onto the first CPUs; with more,
    /// some would share a CPU they cannot leave. Also `None` when pinning is off or the
    /// mask cannot be read.
    pub fn cpu_plan(&self) -> Option<Vec<core_affinity::CoreId>> {
        if !self.pin {
            return None;
        }
        let workers = self.workers.max(1);
        let cpus = core_affinity::get_core_ids()?;
        if workers != cpus.len() {
            tracing::debug!(
                workers,
                cpus = cpus.len(),
                "server workers are not one per CPU; they are not pinned"
            );
            return None;
        }
        Some(cpus)
    }
}

/// Pins the calling thread, worker `worker`, to its CPU from [`Options::cpu_plan`], if it
/// has one. A refusal (a mask changed since the plan) leaves it unpinned, with a warning.
pub fn pin_current_thread(worker: usize, cpu: Option<core_affinity::CoreId>) {
    let Some(cpu) = cpu else { return };
    if !core_affinity::set_for_current(cpu) {
        tracing::warn!(
            worker,
            cpu = cpu.id,
            "cannot pin a server worker to its CPU; it runs unpinned"
        );
    }
}

/// Serve on the caller's runtime until `shutdown` resolves, then drain for at most
/// `grace`. For listeners whose load does not matter (the admin API). A connection that
/// sends no complete request head within `head_timeout` (from its first byte, or from
/// when it went idle) is closed.
pub async fn serve<H, F>(
    listener: TcpListener,
    handler: H,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
    head_timeout: Duration,
) where
    H: Fn(Request<Incoming>, ClientAddr) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<ProxyBody>> + Send + 'static,
{
    let builder = http_builder(DEFAULT_MAX_HEADER_BYTES, head_timeout);
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(x) => x,
                    Err(e) => {
                        // EMFILE and friends: back off instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                spawn_connection(&builder, &graceful, stream, peer, handler.clone(), head_timeout);
            }
            _ = &mut shutdown => break,
        }
    }
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => tracing::info!("all connections drained"),
        _ = tokio::time::sleep(grace) => tracing::warn!("grace period over; closing remaining connections"),
    }
}

fn http_builder(max_header_bytes: usize, head_timeout: Duration) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .keep_alive(true)
        .header_read_timeout(head_timeout)
        .max_buf_size(max_header_bytes.max(DEFAULT_MAX_HEADER_BYTES))
        .timer(hyper_util::rt::TokioTimer::new());
    // HTTP/2 has no request head to time: a connection whose peer has gone silent is found
    // by a PING after `timeouts.client_header` without a frame, and closed when that PING
    // is not answered as long after (a vanished client must not hold a descriptor).
    builder
        .http2()
        .timer(hyper_util::rt::TokioTimer::new())
        .keep_alive_interval(Some(head_timeout))
        .keep_alive_timeout(head_timeout);
    builder
}

/// [`http_builder`]'s HTTP/1 server on its own, for connections known to be HTTP/1.1.
fn http1_builder(
    max_header_bytes: usize,
    head_timeout: Duration,
) -> hyper::server::conn::http1::Builder {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .keep_alive(true)
        .header_read_timeout(head_timeout)
        .max_buf_size(max_header_bytes.max(DEFAULT_MAX_HEADER_BYTES))
        .timer(hyper_util::rt::TokioTimer::new());
    builder
}

/// Serves one connection as a task on the current runtime, watched for graceful shutdown.
fn spawn_connection<H, F>(
    builder: &auto::Builder<TokioExecutor>,
    graceful: &GracefulShutdown,
    mut stream: tokio::net::TcpStream,
    peer: SocketAddr,
    handler: H,
    head_timeout: Duration,
) where
    H: Fn(Request<Incoming>, ClientAddr) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<ProxyBody>> + Send + 'static,
{
    let peer = ClientAddr::new(peer);
    let svc = hyper::service::service_fn(move |req| {
        let fut = handler(req, peer.clone());
        async move { Ok::<_, Infallible>(fut.await) }
    });
    // Counted for the drain from the start; hyper reads the first bytes again, after
    // they came in time.
    let builder = builder.clone();
    let watcher = graceful.watcher();
    tokio::spawn(async move {
        let mut first = bytes::BytesMut::new();
        if !fast::first_bytes(&mut stream, &mut first, head_timeout).await {
            return;
        }
        let io = TokioIo::new(fast::Rewound::new(first.freeze(), stream));
        let conn = builder.serve_connection_with_upgrades(io, svc);
        let conn = watcher.watch(conn.into_owned());
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "connection ended with error");
        }
    });
}

/// The proxy listener: serve on worker threads until `shutdown` turns true, then drain
/// for at most `grace`. `make_handler` is called once per worker thread, so each can hold
/// state of its own. `on_hand_off` is called for every connection served by hyper rather
/// than the fast path.
pub async fn serve_on_workers<M, H>(
    listener: TcpListener,
    make_handler: M,
    mut shutdown: watch::Receiver<bool>,
    options: Options,
    on_hand_off: fast::HandOffHook,
) where
    M: Fn() -> H,
    H: fast::Handler,
{
    let mut queues = Vec::new();
    let mut finished = Vec::new();
    let cpus = options.cpu_plan();
    for i in 0..options.workers.max(1) {
        let (tx, rx) = mpsc::unbounded_channel();
        let (done_tx, done_rx) = oneshot::channel::<()>();
        let handler = make_handler();
        let stop = shutdown.clone();
        let on_hand_off = on_hand_off.clone();
        let cpu = cpus.as_ref().and_then(|c| c.get(i).copied());
        let spawned = std::thread::Builder::new()
            .name(format!("idemproxy-worker-{i}"))
            .spawn(move || {
                pin_current_thread(i, cpu);
                worker(rx, handler, stop, options, on_hand_off);
                let _ = done_tx.send(());
            });
        match spawned {
            Ok(_) => {
                queues.push(tx);
                finished.push(done_rx);
            }
            Err(e) => tracing::error!(error = %e, "cannot start a server worker thread"),
        }
    }
    if queues.is_empty() {
        tracing::error!("no server worker thread could start; not accepting");
        return;
    }
    let mut next = 0usize;
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(x) => x,
                    Err(e) => {
                        // EMFILE and friends: back off instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                // Leaves this runtime's reactor; the worker registers it with its own.
                let stream = match stream.into_std() {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot hand a connection to a worker");
                        continue;
                    }
                };
                // Round robin; a worker whose thread is gone is skipped.
                let mut conn = Some((stream, peer));
                for _ in 0..queues.len() {
                    let q = &queues[next % queues.len()];
                    next = next.wrapping_add(1);
                    match q.send(conn.take().expect("put back on failure")) {
                        Ok(()) => break,
                        Err(mpsc::error::SendError(c)) => conn = Some(c),
                    }
                }
                if conn.is_some() {
                    tracing::error!("every server worker has stopped; not accepting");
                    break;
                }
            }
            _ = stopped(&mut shutdown) => break,
        }
    }
    drop(listener);
    drop(queues);
    for done in finished {
        let _ = done.await;
    }
}

/// One worker thread: serves the connections it is handed until shutdown, then drains.
fn worker<H>(
    mut conns: mpsc::UnboundedReceiver<(std::net::TcpStream, SocketAddr)>,
    handler: H,
    mut shutdown: watch::Receiver<bool>,
    options: Options,
    on_hand_off: fast::HandOffHook,
) where
    H: fast::Handler,
{
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "cannot start a server worker runtime");
            return;
        }
    };
    rt.block_on(async move {
        let shared = Arc::new(fast::Shared {
            handler,
            hyper: http_builder(options.max_header_bytes, options.head_timeout),
            hyper_h1: http1_builder(options.max_header_bytes, options.head_timeout),
            max_head: options.max_header_bytes,
            fast: options.fast_path,
            on_hand_off,
            head_timeout: options.head_timeout,
            body_timeout: options.body_timeout,
        });
        // Every connection task holds a sender; when all are gone, all have ended.
        let (alive, mut all_ended) = mpsc::channel::<()>(1);
        loop {
            tokio::select! {
                conn = conns.recv() => {
                    let Some((stream, peer)) = conn else { break };
                    let stream = match tokio::net::TcpStream::from_std(stream) {
                        Ok(s) => s,
                        Err(e) => {
                            tracing::warn!(error = %e, "cannot register a connection");
                            continue;
                        }
                    };
                    tokio::spawn(fast::serve(
                        stream,
                        ClientAddr::new(peer),
                        shared.clone(),
                        shutdown.clone(),
                        alive.clone(),
                    ));
                }
                _ = stopped(&mut shutdown) => break,
            }
        }
        // The handler holds this worker's upstream clients; their idle pooled connections
        // are tasks too, and must not count as work to wait for below.
        drop(shared);
        drop(alive);
        let deadline = tokio::time::Instant::now() + options.grace;
        tokio::select! {
            _ = all_ended.recv() => tracing::debug!("worker drained its connections"),
            _ = tokio::time::sleep_until(deadline) => tracing::warn!("grace period over; closing remaining connections"),
        }
        // Side effects run as their own tasks (a client that went away does not stop one
        // half-way); let those finish too, within the same grace period.
        let metrics = tokio::runtime::Handle::current().metrics();
        while metrics.num_alive_tasks() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
}

/// Resolves once shutdown is asked for (or its sender is gone). Returns nothing, so no
/// borrow of the watch value is held across the caller's other awaits.
pub(super) async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}
