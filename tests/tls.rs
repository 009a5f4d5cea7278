//! Real rustls TLS to a downstream: a TLS terminator with a freshly generated certificate
//! in front of the fake downstream. Verification is on: trusted via `tls.ca_file` it works;
//! without it the handshake fails before any request byte, so the record is
//! `failed_before_commit` and nothing was committed.

mod common;

use std::sync::Arc;

use common::fake_downstream::FakeDownstream;
use common::*;
use http::StatusCode;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls;

/// Accept TLS on 127.0.0.1:0 and pipe the plaintext to `backend`. Returns the port.
async fn tls_front(backend: std::net::SocketAddr, cert: &rcgen::CertifiedKey) -> u16 {
    let certs = vec![cert.cert.der().clone()];
    let key =
        rustls::pki_types::PrivateKeyDer::try_from(cert.key_pair.serialize_der()).expect("key der");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .expect("server config");
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let Ok(mut plain) = TcpStream::connect(backend).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
            });
        }
    });
    port
}

fn tls_config(dir: &std::path::Path, port: u16, ca: Option<&str>) -> String {
    let tls = ca
        .map(|f| format!("    tls: {{ ca_file: {f} }}\n"))
        .unwrap_or_default();
    format!(
        "listen: 127.0.0.1:0\nstore: {{ path: {}/store.redb }}\nupstreams:\n  - name: secure\n    url: https://localhost:{port}\n{tls}    routes:\n      - {{ name: send, match: {{ method: POST, path: /send }} }}\n",
        dir.display()
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn side_effects_over_verified_tls() {
    let ds = FakeDownstream::start().await;
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).expect("cert");
    let port = tls_front(ds.addr(), &cert).await;
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("ca.pem"), cert.cert.pem()).expect("write ca");
    let proxy = ProxyProc::start(dir.path(), &tls_config(dir.path(), port, Some("ca.pem")));
    let c = client();
    let r = post(
        &c,
        &proxy.url("/secure/send"),
        &[("idempotency-key", "k-tls")],
        r#"{"to":"a@x"}"#,
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
    let again = post(
        &c,
        &proxy.url("/secure/send"),
        &[("idempotency-key", "k-tls")],
        r#"{"to":"a@x"}"#,
    )
    .await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(ds.commits(), 1);
    let seen = ds.last_request("/send").expect("downstream hit");
    assert_eq!(
        seen.header_values("host"),
        vec![format!("localhost:{port}")]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_untrusted_certificate_fails_before_commit() {
    let ds = FakeDownstream::start().await;
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).expect("cert");
    let port = tls_front(ds.addr(), &cert).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let proxy = ProxyProc::start(dir.path(), &tls_config(dir.path(), port, None));
    let c = client();
    let r = post(
        &c,
        &proxy.url("/secure/send"),
        &[("idempotency-key", "k-untrusted")],
        "{}",
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{r:?}");
    assert_eq!(
        r.problem_type(),
        "urn:idemproxy:problem:upstream-unavailable"
    );
    assert_eq!(r.header("idempotency-status"), Some("failed_before_commit"));
    assert!(
        r.json()["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("certificate"),
        "{r:?}"
    );
    assert_eq!(ds.hits(), 0, "no request byte reached the downstream");
}
