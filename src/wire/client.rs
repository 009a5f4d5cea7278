//! The downstream client: one pooled hyper client per upstream, rustls with certificate
//! verification always on (webpki roots plus an optional CA file), HTTP/1.1 and HTTP/2 by
//! ALPN. Also the one place that decides whether a send failure happened before any byte
//! left ([`SendFailure::BeforeSend`]) or after ([`SendFailure::AfterSend`]).

use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

use super::body::ProxyBody;

/// A pooled client for one upstream, with a cap on the requests it has in flight (and so
/// on its connections). Without the cap, 1,000 concurrent clients opened over 1,100
/// upstream connections and their buffers alone put the proxy past 64 MiB.
#[derive(Clone)]
pub struct HttpClient {
    inner: Client<HttpsConnector<HttpConnector>, ProxyBody>,
    permits: Arc<Semaphore>,
}

/// Requests in flight per upstream per server worker thread (each has its own clients).
pub const MAX_IN_FLIGHT: usize = 128;

impl HttpClient {
    /// Sends `req` once a slot is free. The slot is held until the response body has been
    /// read to its end or dropped, since the connection stays busy until then.
    pub async fn request(
        &self,
        req: http::Request<ProxyBody>,
    ) -> Result<http::Response<Held<Incoming>>, hyper_util::client::legacy::Error> {
        // The semaphore is never closed, so acquiring only waits.
        let permit = self.permits.clone().acquire_owned().await.ok();
        let resp = self.inner.request(req).await?;
        Ok(resp.map(|body| Held { body, permit }))
    }
}

/// A response body holding its request's in-flight slot.
#[derive(Debug)]
pub struct Held<B> {
    body: B,
    permit: Option<OwnedSemaphorePermit>,
}

impl<B: Body + Unpin> Body for Held<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        if matches!(polled, Poll::Ready(None)) {
            // Done: the connection can take the next request before this body is dropped.
            self.permit = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
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
    let inner = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(MAX_IN_FLIGHT)
        .build(https);
    Ok(HttpClient {
        inner,
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

pub fn classify(err: &hyper_util::client::legacy::Error) -> SendFailure {
    // hyper-util marks every error raised by the connector (TCP connect, DNS, TLS
    // handshake) as a connect error; only those are provably before the first byte.
    if err.is_connect() {
        SendFailure::BeforeSend
    } else {
        SendFailure::AfterSend
    }
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
}
