//! The listener: accepts TCP connections and serves HTTP/1.1 and HTTP/2 (auto-detected)
//! with hyper, handing every request to a service. Shutdown stops accepting and drains
//! in-flight connections, bounded by a grace period.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;

use super::body::ProxyBody;

/// Serve until `shutdown` resolves, then drain for at most `grace`.
pub async fn serve<H, F>(
    listener: TcpListener,
    handler: H,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) where
    H: Fn(Request<Incoming>, SocketAddr) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<ProxyBody>> + Send + 'static,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .keep_alive(true)
        .timer(hyper_util::rt::TokioTimer::new());
    builder.http2().timer(hyper_util::rt::TokioTimer::new());
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
                let h = handler.clone();
                let svc = hyper::service::service_fn(move |req| {
                    let fut = h(req, peer);
                    async move { Ok::<_, Infallible>(fut.await) }
                });
                let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), svc);
                let conn = graceful.watch(conn.into_owned());
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!(error = %e, "connection ended with error");
                    }
                });
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
