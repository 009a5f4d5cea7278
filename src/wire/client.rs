//! The downstream client: one client per upstream per server worker thread, rustls with
//! certificate verification always on (webpki roots plus an optional CA file), HTTP/1.1
//! and HTTP/2 by ALPN. Also the one place that decides whether a send failure happened
//! before any byte left ([`SendFailure::BeforeSend`]) or after ([`SendFailure::AfterSend`]).
//!
//! `https://` upstreams go through hyper-util's pooled client (TLS, ALPN, HTTP/2).
//! `http://` upstreams (a sidecar, a service on the same network) go through [`h1`], a
//! hand-written HTTP/1.1 exchange driven in the request's own task, for every request
//! [`h1::fits`] (known body length up to 64 KiB, no `Expect`, no upgrade), and through
//! [`Http1Pool`], this client's own connections over `hyper::client::conn`, for the rest.
//! The pooled client's checkout, SipHashed pool keys, lazy connect future and per-response
//! return task were about 11k of a pass-through's 43k instructions (docs/PERFORMANCE.md,
//! "Upstream clients"); hyper's connection task and dispatch another 9k.

use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http::uri::{Authority, PathAndQuery, Scheme};
use http::Uri;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

use super::body::{BoxError, ProxyBody};
use super::h1;

/// A client for one upstream, with a cap on the requests it has in flight (and so on its
/// connections). Without the cap, 1,000 concurrent clients opened over 1,100 upstream
/// connections and their buffers alone put the proxy past 64 MiB.
#[derive(Clone)]
pub struct HttpClient {
    tls: Client<HttpsConnector<HttpConnector>, ProxyBody>,
    /// `http://` requests [`h1::fits`] takes: most of them.
    direct: Arc<h1::Pool>,
    /// The other `http://` requests: streamed or large bodies, `Expect`.
    plain: Arc<Http1Pool>,
    permits: Arc<Semaphore>,
}

/// Requests in flight per upstream per server worker thread (each has its own clients).
pub const MAX_IN_FLIGHT: usize = 128;
/// How long an idle connection is kept for reuse.
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

impl HttpClient {
    /// Sends `req` (absolute URI) once a slot is free. The slot is held until the response
    /// body has been read to its end or dropped, since the connection stays busy until then.
    pub async fn request(
        &self,
        req: http::Request<ProxyBody>,
    ) -> Result<http::Response<Held>, SendError> {
        // The semaphore is never closed, so acquiring only waits.
        let permit = self.permits.clone().acquire_owned().await.ok();
        if req.uri().scheme() == Some(&Scheme::HTTP) {
            if h1::fits(&req) {
                let resp = self.direct.send(req).await?;
                return Ok(resp.map(|body| Held {
                    body: HeldBody::Direct(body),
                    permit,
                }));
            }
            // Boxed, as the rare case: the common request's future stays small (every
            // request's future is as large as its largest branch).
            let (resp, conn) = Box::pin(self.plain.send(req)).await?;
            unsolicited_switch(resp.status())?;
            return Ok(resp.map(|body| Held {
                body: HeldBody::Hyper {
                    body,
                    conn: Some(conn),
                },
                permit,
            }));
        }
        let resp = self.tls.request(req).await.map_err(SendError::pooled)?;
        unsolicited_switch(resp.status())?;
        Ok(resp.map(|body| Held {
            body: HeldBody::Hyper { body, conn: None },
            permit,
        }))
    }
}

impl HttpClient {
    /// Send `message` (a request's head and body, [`super::raw`]) to the `http://`
    /// upstream at `authority` and read its answer's head; the body, like
    /// [`HttpClient::request`]'s, holds the request's in-flight slot.
    pub async fn send_raw(
        &self,
        authority: &Authority,
        method: &http::Method,
        message: &[u8],
    ) -> Result<(h1::RawHead, Held), SendError> {
        let permit = self.permits.clone().acquire_owned().await.ok();
        let (head, body) = self.direct.send_raw(authority, method, message).await?;
        Ok((
            head,
            Held {
                body: HeldBody::Direct(body),
                permit,
            },
        ))
    }
}

/// A `101 Switching Protocols` answer is an error after send: the proxy forwards no
/// `Upgrade`, so no upstream may switch (as [`h1`] refuses it), and the connection it came
/// on is dropped with the answer.
fn unsolicited_switch(status: http::StatusCode) -> Result<(), SendError> {
    if status == http::StatusCode::SWITCHING_PROTOCOLS {
        return Err(SendError::after(
            "unexpected status 101",
            "the upstream switched protocols, which the proxy never asks for",
        ));
    }
    Ok(())
}

/// A response body holding its request's in-flight slot and, for [`Http1Pool`], its
/// connection, which goes back to the pool once the body has been read to its end.
pub struct Held {
    body: HeldBody,
    permit: Option<OwnedSemaphorePermit>,
}

enum HeldBody {
    /// Read in this task by [`h1`], which returns its own connection.
    Direct(h1::RawBody),
    /// From a hyper connection task.
    Hyper {
        body: Incoming,
        conn: Option<Pooled>,
    },
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held").finish_non_exhaustive()
    }
}

impl Body for Held {
    type Data = bytes::Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = match &mut self.body {
            HeldBody::Direct(body) => Pin::new(body).poll_frame(cx),
            HeldBody::Hyper { body, .. } => Pin::new(body)
                .poll_frame(cx)
                .map_err(|e| Box::new(e) as BoxError),
        };
        if matches!(polled, Poll::Ready(None)) {
            // Done: the connection can take the next request before this body is dropped.
            self.permit = None;
            self.give_back();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        match &self.body {
            HeldBody::Direct(body) => body.is_end_stream(),
            HeldBody::Hyper { body, .. } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.body {
            HeldBody::Direct(body) => body.size_hint(),
            HeldBody::Hyper { body, .. } => body.size_hint(),
        }
    }
}

impl Held {
    /// Return a hyper connection if its response was read to the end; one dropped
    /// half-way is never reused (hyper closes it).
    fn give_back(&mut self) {
        if let HeldBody::Hyper { body, conn } = &mut self.body {
            if body.is_end_stream() {
                if let Some(conn) = conn.take() {
                    conn.pool.put(conn.authority, conn.sender);
                }
            }
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        // hyper stops polling a body once it reports its end, so the last frame is
        // usually seen here rather than as `Ready(None)`.
        self.give_back();
    }
}

/// A connection lent to one response.
struct Pooled {
    pool: Arc<Http1Pool>,
    authority: Authority,
    sender: http1::SendRequest<ProxyBody>,
}

/// A kept connection, since when it has been idle.
struct Idle {
    authority: Authority,
    sender: http1::SendRequest<ProxyBody>,
    since: Instant,
}

/// HTTP/1.1 connections to `http://` upstreams, kept for reuse, most recently used
/// first. One per [`HttpClient`], so a worker thread's requests use that thread's
/// connections and their tasks never cross threads.
pub struct Http1Pool {
    /// In the order they were given back, so the longest idle are at the front.
    idle: parking_lot::Mutex<Vec<Idle>>,
    connect_timeout: Duration,
}

impl Http1Pool {
    fn new(connect_timeout: Duration) -> Http1Pool {
        Http1Pool {
            idle: parking_lot::Mutex::new(Vec::new()),
            connect_timeout,
        }
    }

    async fn send(
        self: &Arc<Self>,
        mut req: http::Request<ProxyBody>,
    ) -> Result<(http::Response<Incoming>, Pooled), SendError> {
        let authority = origin_form(&mut req)?;
        loop {
            let (mut sender, reused) = match self.checkout(&authority).await {
                Some(s) => (s, true),
                None => (self.connect(&authority).await?, false),
            };
            match sender.try_send_request(req).await {
                Ok(resp) => {
                    let conn = Pooled {
                        pool: self.clone(),
                        authority,
                        sender,
                    };
                    return Ok((resp, conn));
                }
                Err(mut e) => match e.take_message() {
                    // A kept connection the upstream closed while it was idle: nothing of
                    // the request was written, so it goes out on another connection.
                    Some(back) if reused => req = back,
                    Some(_) => {
                        return Err(SendError::before(
                            "the new connection refused the request",
                            e.into_error(),
                        ))
                    }
                    None => {
                        return Err(SendError::after(
                            "the connection failed after the request was sent",
                            e.into_error(),
                        ))
                    }
                },
            }
        }
    }

    /// An idle connection to `authority` that is ready for a request, if any is left.
    async fn checkout(&self, authority: &Authority) -> Option<http1::SendRequest<ProxyBody>> {
        loop {
            let mut candidate = {
                let mut idle = self.idle.lock();
                let now = Instant::now();
                let expired = idle.partition_point(|c| now.duration_since(c.since) >= IDLE_TIMEOUT);
                idle.drain(..expired);
                let at = idle.iter().rposition(|c| c.authority == *authority)?;
                idle.remove(at).sender
            };
            // Returned the moment its last body ended, a connection may still be finishing
            // that message: wait for it, or drop it if it closed meanwhile.
            if !candidate.is_closed() && (candidate.is_ready() || candidate.ready().await.is_ok()) {
                return Some(candidate);
            }
        }
    }

    async fn connect(
        &self,
        authority: &Authority,
    ) -> Result<http1::SendRequest<ProxyBody>, SendError> {
        let stream = connect_tcp(authority, self.connect_timeout).await?;
        let (sender, conn) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| SendError::before("HTTP/1.1 handshake failed", e))?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "upstream connection ended with error");
            }
        });
        Ok(sender)
    }

    fn put(&self, authority: Authority, sender: http1::SendRequest<ProxyBody>) {
        if sender.is_closed() {
            return;
        }
        let mut idle = self.idle.lock();
        if idle.len() < MAX_IN_FLIGHT {
            idle.push(Idle {
                authority,
                sender,
                since: Instant::now(),
            });
        }
    }
}

/// A TCP connection to `authority` (port 80 by default) with Nagle off.
pub(super) async fn connect_tcp(
    authority: &Authority,
    timeout: Duration,
) -> Result<tokio::net::TcpStream, SendError> {
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let port = authority.port_u16().unwrap_or(80);
    let stream =
        match tokio::time::timeout(timeout, tokio::net::TcpStream::connect((host, port))).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(SendError::before("tcp connect error", e)),
            Err(_) => {
                return Err(SendError::before(
                    "tcp connect error",
                    std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"),
                ))
            }
        };
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// Turns an absolute request URI into the origin form an HTTP/1.1 request line carries,
/// with `Host` set from it when the caller set none. Returns the authority to connect to.
fn origin_form(req: &mut http::Request<ProxyBody>) -> Result<Authority, SendError> {
    let Some(authority) = req.uri().authority().cloned() else {
        return Err(SendError::before(
            "request URI has no host",
            std::io::Error::new(std::io::ErrorKind::InvalidInput, req.uri().to_string()),
        ));
    };
    if !req.headers().contains_key(http::header::HOST) {
        if let Ok(v) = http::HeaderValue::from_str(authority.as_str()) {
            req.headers_mut().insert(http::header::HOST, v);
        }
    }
    let path = req
        .uri()
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    *req.uri_mut() = Uri::from(path);
    Ok(authority)
}

/// A failed send, with when it failed relative to the request leaving the proxy.
#[derive(Debug)]
pub struct SendError {
    failure: SendFailure,
    what: &'static str,
    source: BoxError,
}

impl SendError {
    pub(super) fn before(what: &'static str, source: impl Into<BoxError>) -> SendError {
        SendError {
            failure: SendFailure::BeforeSend,
            what,
            source: source.into(),
        }
    }

    pub(super) fn after(what: &'static str, source: impl Into<BoxError>) -> SendError {
        SendError {
            failure: SendFailure::AfterSend,
            what,
            source: source.into(),
        }
    }

    /// hyper-util marks every error raised by the connector (TCP connect, DNS, TLS
    /// handshake) as a connect error; only those are provably before the first byte.
    fn pooled(err: hyper_util::client::legacy::Error) -> SendError {
        let failure = if err.is_connect() {
            SendFailure::BeforeSend
        } else {
            SendFailure::AfterSend
        };
        SendError {
            failure,
            what: "client error",
            source: Box::new(err),
        }
    }
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.what)
    }
}

impl std::error::Error for SendError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClientBuildError {
    #[error("cannot read CA file {path}: {reason}")]
    CaFile { path: String, reason: String },
    #[error("TLS setup failed: {0}")]
    Tls(String),
}

/// Build a pooled client. `ca_file` adds trusted roots (PEM) beside the webpki set.
pub fn build(
    connect_timeout: Duration,
    ca_file: Option<&Path>,
) -> Result<HttpClient, ClientBuildError> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = ca_file {
        let certs = CertificateDer::pem_file_iter(path)
            .and_then(|it| it.collect::<Result<Vec<_>, _>>())
            .map_err(|e| ClientBuildError::CaFile {
                path: path.display().to_string(),
                reason: e.to_string(),
            })?;
        if certs.is_empty() {
            return Err(ClientBuildError::CaFile {
                path: path.display().to_string(),
                reason: "no PEM certificates in it".into(),
            });
        }
        for c in certs {
            roots.add(c).map_err(|e| ClientBuildError::CaFile {
                path: path.display().to_string(),
                reason: e.to_string(),
            })?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ClientBuildError::Tls(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(connect_timeout));
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_all_versions()
        .wrap_connector(http);
    let tls = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(IDLE_TIMEOUT)
        .pool_max_idle_per_host(MAX_IN_FLIGHT)
        .build(https);
    Ok(HttpClient {
        tls,
        direct: Arc::new(h1::Pool::new(connect_timeout, IDLE_TIMEOUT, MAX_IN_FLIGHT)),
        plain: Arc::new(Http1Pool::new(connect_timeout)),
        permits: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
    })
}

/// When a send failed, relative to the request leaving the proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendFailure {
    /// Connect, DNS or TLS handshake failed: no request byte reached the downstream.
    BeforeSend,
    /// The request may have been (partly) delivered: reset, EOF, timeout, body error.
    AfterSend,
}

pub fn classify(err: &SendError) -> SendFailure {
    err.failure
}

/// Error text without the request (it may carry arguments): the source chain only.
pub fn describe(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut src = err.source();
    while let Some(s) = src {
        out.push_str(": ");
        out.push_str(&s.to_string());
        src = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// Serve each connection with `f` on a plain TCP listener; returns the port.
    fn server(f: fn(std::net::TcpStream)) -> u16 {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        std::thread::spawn(move || {
            for s in l.incoming().map_while(Result::ok) {
                f(s);
            }
        });
        port
    }

    async fn failure(url: String) -> SendFailure {
        let c = build(Duration::from_secs(2), None).expect("client");
        let req = http::Request::post(url)
            .body(crate::wire::body::full("{}"))
            .expect("request");
        let err = c.request(req).await.expect_err("must fail");
        classify(&err)
    }

    #[tokio::test]
    async fn connect_refused_and_tls_failures_are_before_send() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0")
            .expect("bind")
            .local_addr()
            .expect("addr")
            .port();
        assert_eq!(
            failure(format!("http://127.0.0.1:{closed}/")).await,
            SendFailure::BeforeSend
        );
        let plain = server(|mut s| {
            let mut buf = [0u8; 512];
            let _ = s.read(&mut buf);
            let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
        });
        assert_eq!(
            failure(format!("https://127.0.0.1:{plain}/")).await,
            SendFailure::BeforeSend,
            "a failed TLS handshake sent no request byte"
        );
    }

    #[tokio::test]
    async fn losing_the_connection_after_sending_is_after_send() {
        let eof = server(|mut s| {
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            // read the request, answer nothing
        });
        assert_eq!(
            failure(format!("http://127.0.0.1:{eof}/")).await,
            SendFailure::AfterSend
        );
        let garbage = server(|mut s| {
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            let _ = s.write_all(b"NOT HTTP AT ALL\r\n\r\n");
        });
        assert_eq!(
            failure(format!("http://127.0.0.1:{garbage}/")).await,
            SendFailure::AfterSend
        );
    }

    /// Reads one request head (these tests send no bodies) and answers `200 ok`.
    fn answer_one(s: &mut std::net::TcpStream) -> bool {
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            match s.read(&mut byte) {
                Ok(1) => head.push(byte[0]),
                _ => return false,
            }
        }
        s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            .is_ok()
    }

    async fn get_ok(c: &HttpClient, port: u16) {
        let req = http::Request::get(format!("http://127.0.0.1:{port}/x"))
            .body(crate::wire::body::empty())
            .expect("request");
        let resp = c.request(req).await.expect("answered");
        assert_eq!(resp.status(), 200);
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .expect("body")
            .to_bytes();
        assert_eq!(&body[..], b"ok");
    }

    #[tokio::test]
    async fn plain_upstream_connections_are_kept_and_reused() {
        static ACCEPTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let port = server(|mut s| {
            ACCEPTED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            std::thread::spawn(move || while answer_one(&mut s) {});
        });
        let c = build(Duration::from_secs(2), None).expect("client");
        for _ in 0..5 {
            get_ok(&c, port).await;
        }
        assert_eq!(
            ACCEPTED.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "five requests in turn share one connection"
        );
    }

    #[tokio::test]
    async fn a_kept_connection_the_upstream_closed_is_replaced_without_an_error() {
        static ACCEPTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        // Answers one request per connection, then closes it without saying so.
        let port = server(|mut s| {
            ACCEPTED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            answer_one(&mut s);
        });
        let c = build(Duration::from_secs(2), None).expect("client");
        for _ in 0..3 {
            get_ok(&c, port).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(ACCEPTED.load(std::sync::atomic::Ordering::SeqCst), 3);
    }
}
