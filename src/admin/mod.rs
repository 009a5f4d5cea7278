//! The operator surface (SPEC sections 8 and 10) on its own listener: the admin API
//! (executions, approvals, resolutions, operation cancellation), the operator console,
//! Prometheus `/metrics` and `/healthz`. Everything but `/healthz` and the console's static
//! files needs the bearer token; see docs/OPERATIONS.md.
//!
//! - [`auth`]: the token, compared in constant time;
//! - [`actions`]: operator decisions over the store (shared with the CLI);
//! - `api`: routing and JSON; `view`: what records look like to an operator;
//! - `error`: every refusal and its one problem+json mapping;
//! - `console`: the embedded page.

pub mod actions;
mod api;
pub mod auth;
mod console;
mod error;
pub mod notify;
pub mod view;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use auth::{Token, TokenError, Tokens};

use crate::proxy::Proxy;

/// What every admin request handler shares.
pub struct Admin {
    proxy: Arc<Proxy>,
    tokens: Tokens,
}

/// Bind the admin listener on `listen` and serve it until `shutdown` turns true.
pub async fn spawn(
    listen: SocketAddr,
    tokens: Tokens,
    proxy: Arc<Proxy>,
    mut shutdown: watch::Receiver<bool>,
) -> std::io::Result<(SocketAddr, JoinHandle<()>)> {
    let listener = TcpListener::bind(listen).await?;
    let addr = listener.local_addr()?;
    let head_timeout = proxy.runtime().config.timeouts.client_header;
    let admin = Arc::new(Admin { proxy, tokens });
    let task = tokio::spawn(async move {
        let handler = move |req, _peer| api::handle(admin.clone(), req);
        let stop = async move {
            let _ = shutdown.wait_for(|stop| *stop).await;
        };
        crate::wire::server::serve(
            listener,
            handler,
            stop,
            Duration::from_secs(5),
            head_timeout,
        )
        .await;
    });
    tracing::info!(%addr, "admin listening");
    Ok((addr, task))
}
