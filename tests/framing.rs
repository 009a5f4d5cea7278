//! Response splitting (issue 33): an upstream answer framed twice, by `Content-Length: 3`
//! and by `Transfer-Encoding: chunked`, whose chunked body holds a forged HTTP answer
//! after its first three bytes. A writer that forwards the stale length lets the next
//! request on the client's keep-alive connection read the forged answer. Every client
//! path and writer is driven: the fast path's read-only lane (`wire::h1`), hyper's server
//! over `wire::h1` (fast path off), `Expect: 100-continue` (hyper's server and
//! `Http1Pool`), an `https://` upstream (hyper-util's pooled client), and a side effect's
//! first answer and its replay (from the store, then from memory), on both servers.
//! Each case pipelines a clean request behind the forged one: it must get its own answer.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use tokio_rustls::rustls;

/// What the forged answer's chunked body decodes to: three bytes for the stale
/// `Content-Length: 3`, then a whole HTTP answer.
const PAYLOAD: &str = "abcHTTP/1.1 200 OK\r\nContent-Length: 6\r\nX-Forged: yes\r\n\r\nforged";

fn forged_answer() -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\nContent-Type: text/plain\r\n\r\n{:x}\r\n{PAYLOAD}\r\n0\r\n\r\n",
        PAYLOAD.len()
    )
    .into_bytes()
}

const CLEAN: &[u8] =
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Type: text/plain\r\n\r\nclean";

/// A downstream that answers a path with `forge` in it with [`forged_answer`], anything
/// else with `clean`, and keeps its connections.
fn forging_downstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { return };
            std::thread::spawn(move || serve_forged(stream));
        }
    });
    addr
}

fn serve_forged(mut s: TcpStream) {
    let mut buf = Vec::new();
    loop {
        // One request: its head, then its body by length or chunked to the last chunk.
        let (path, body_end) = loop {
            let mut slots = [httparse::EMPTY_HEADER; 64];
            let mut req = httparse::Request::new(&mut slots);
            if let Ok(httparse::Status::Complete(len)) = req.parse(&buf) {
                let path = req.path.unwrap_or_default().to_string();
                let header = |n: &str| {
                    req.headers
                        .iter()
                        .find(|h| h.name.eq_ignore_ascii_case(n))
                        .map(|h| String::from_utf8_lossy(h.value).to_string())
                };
                let end = if header("transfer-encoding").is_some() {
                    loop {
                        if let Some(i) = buf[len..].windows(5).position(|w| w == b"0\r\n\r\n") {
                            break len + i + 5;
                        }
                        if !fill(&mut s, &mut buf) {
                            return;
                        }
                    }
                } else {
                    len + header("content-length").map_or(0, |v| v.parse().unwrap_or(0))
                };
                break (path, end);
            }
            if !fill(&mut s, &mut buf) {
                return;
            }
        };
        while buf.len() < body_end {
            if !fill(&mut s, &mut buf) {
                return;
            }
        }
        buf.drain(..body_end);
        let answer = if path.contains("forge") {
            forged_answer()
        } else if path.contains("emptychunk") {
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\r\n\r\n".to_vec()
        } else if path.contains("signedlength") {
            b"HTTP/1.1 200 OK\r\nContent-Length: +2\r\n\r\nok".to_vec()
        } else if path.contains("switch") {
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\n"
                .to_vec()
        } else {
            CLEAN.to_vec()
        };
        if s.write_all(&answer).is_err() {
            return;
        }
    }
}

fn fill(s: &mut TcpStream, buf: &mut Vec<u8>) -> bool {
    let mut chunk = [0u8; 8192];
    match s.read(&mut chunk) {
        Ok(0) | Err(_) => false,
        Ok(n) => {
            buf.extend_from_slice(&chunk[..n]);
            true
        }
    }
}

/// Accept TLS and pipe the plaintext to `backend` (as tests/tls.rs). Returns the port.
async fn tls_front(backend: SocketAddr, cert: &rcgen::CertifiedKey) -> u16 {
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
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
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
                let Ok(mut plain) = tokio::net::TcpStream::connect(backend).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
            });
        }
    });
    port
}

/// `/plain` and `/secure`: read-only pass-throughs to the forging downstream (direct and
/// through TLS); `/plainse` and `/securese`: a keyed side effect `POST /{kind}/send`.
fn forging_config(dir: &Path, plain: SocketAddr, tls_port: u16) -> String {
    let mut yaml = format!(
        "listen: 127.0.0.1:0\nstore: {{ backend: redb, path: {}/store.redb, retention: 1h }}\nidentity: {{ key_header: Idempotency-Key }}\nupstreams:\n",
        dir.display()
    );
    for (name, url, tls) in [
        ("plain", format!("http://{plain}"), ""),
        (
            "secure",
            format!("https://localhost:{tls_port}"),
            "    tls: { ca_file: ca.pem }\n",
        ),
    ] {
        yaml.push_str(&format!(
            "  - name: {name}\n    url: {url}\n    mount: /{name}\n{tls}    routes:\n      - {{ name: any, match: {{ path: \"/{{*rest}}\" }}, class: read_only }}\n  - name: {name}se\n    url: {url}\n    mount: /{name}se\n{tls}    routes:\n      - {{ name: send, match: {{ method: POST, path: \"/{{kind}}/send\" }} }}\n"
        ));
    }
    yaml
}

struct Forging {
    _dir: tempfile::TempDir,
    proxy: ProxyProc,
}

async fn start(env: &[(&str, &str)]) -> Forging {
    let plain = forging_downstream();
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).expect("cert");
    let tls_port = tls_front(plain, &cert).await;
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("ca.pem"), cert.cert.pem()).expect("write ca");
    let proxy = ProxyProc::start_with_env(
        dir.path(),
        &forging_config(dir.path(), plain, tls_port),
        env,
    );
    Forging { _dir: dir, proxy }
}

/// One answer read off a raw connection, 1xx answers skipped: status, lower-case
/// headers, body (chunked, by length, or to the close).
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Read one final answer from `s`, with `buf` holding what was read past the last one.
/// The client side reads as a client would: `Transfer-Encoding` first, then
/// `Content-Length` (so a stale length leaves the rest in `buf` for the next answer).
fn read_answer(s: &mut TcpStream, buf: &mut Vec<u8>) -> Answer {
    loop {
        let (status, headers, used) = loop {
            let mut slots = [httparse::EMPTY_HEADER; 64];
            let mut parsed = httparse::Response::new(&mut slots);
            match parsed.parse(buf) {
                Ok(httparse::Status::Complete(used)) => {
                    let headers = parsed
                        .headers
                        .iter()
                        .map(|h| {
                            (
                                h.name.to_ascii_lowercase(),
                                String::from_utf8_lossy(h.value).into_owned(),
                            )
                        })
                        .collect::<Vec<_>>();
                    break (parsed.code.expect("status"), headers, used);
                }
                Ok(httparse::Status::Partial) => assert!(
                    fill(s, buf),
                    "connection closed before a complete answer head: {:?}",
                    String::from_utf8_lossy(buf)
                ),
                Err(e) => panic!(
                    "not an HTTP/1 answer ({e}): {:?}",
                    String::from_utf8_lossy(buf)
                ),
            }
        };
        buf.drain(..used);
        if (100..200).contains(&status) {
            continue;
        }
        let mut answer = Answer {
            status,
            headers,
            body: Vec::new(),
        };
        let chunked = answer
            .header("transfer-encoding")
            .is_some_and(|te| te.to_ascii_lowercase().ends_with("chunked"));
        if chunked {
            loop {
                let line = loop {
                    if let Some(i) = buf.windows(2).position(|w| w == b"\r\n") {
                        let line = String::from_utf8_lossy(&buf[..i]).to_string();
                        buf.drain(..i + 2);
                        break line;
                    }
                    assert!(fill(s, buf), "closed inside a chunk size line");
                };
                let size = usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16)
                    .unwrap_or_else(|e| panic!("bad chunk size {line:?}: {e}"));
                while buf.len() < size + 2 {
                    assert!(fill(s, buf), "closed inside a chunk");
                }
                if size == 0 {
                    assert_eq!(&buf[..2], b"\r\n", "no trailers expected");
                    buf.drain(..2);
                    break;
                }
                answer.body.extend_from_slice(&buf[..size]);
                buf.drain(..size + 2);
            }
        } else if let Some(len) = answer.header("content-length") {
            let len: usize = len.parse().expect("numeric content-length");
            while buf.len() < len {
                assert!(fill(s, buf), "closed inside a body");
            }
            answer.body = buf.drain(..len).collect();
        } else {
            while fill(s, buf) {}
            answer.body = std::mem::take(buf);
        }
        return answer;
    }
}

/// Send `requests` in one write on a fresh connection and read one answer per request.
fn pipelined(proxy: &ProxyProc, requests: &[Vec<u8>]) -> Vec<Answer> {
    let mut s = TcpStream::connect(proxy.addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    s.write_all(&requests.concat()).expect("write");
    let mut buf = Vec::new();
    let answers = requests
        .iter()
        .map(|_| read_answer(&mut s, &mut buf))
        .collect();
    assert!(
        buf.is_empty(),
        "bytes after the last answer: {:?}",
        String::from_utf8_lossy(&buf)
    );
    // Nothing else arrives: whatever is read now is the connection's end or a timeout.
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .expect("timeout");
    let mut rest = [0u8; 256];
    match s.read(&mut rest) {
        Ok(0) | Err(_) => {}
        Ok(n) => panic!(
            "bytes after the last answer: {:?}",
            String::from_utf8_lossy(&rest[..n])
        ),
    }
    answers
}

fn clean_get(mount: &str) -> Vec<u8> {
    format!("GET /{mount}/clean HTTP/1.1\r\nHost: t\r\n\r\n").into_bytes()
}

fn assert_forged_body(a: &Answer, what: &str) {
    assert_eq!(a.status, 200, "{what}: {:?}", a.headers);
    assert_eq!(
        String::from_utf8_lossy(&a.body),
        PAYLOAD,
        "{what}: the whole decoded body, framed by the proxy: {:?}",
        a.headers
    );
    assert!(a.header("x-forged").is_none(), "{what}");
    if let Some(len) = a.header("content-length") {
        assert_eq!(len, PAYLOAD.len().to_string(), "{what}");
    }
}

fn assert_clean(a: &Answer, what: &str) {
    assert_eq!(a.status, 200, "{what}: {:?}", a.headers);
    assert!(
        a.header("x-forged").is_none(),
        "{what}: the pipelined request read the forged answer"
    );
    assert_eq!(a.body, b"clean", "{what}");
}

/// The read-only paths: each request is the forged one and a clean GET behind it.
async fn read_only_paths(env: &[(&str, &str)], label: &str) {
    let f = start(env).await;
    let cases: [(&str, Vec<u8>, &str); 4] = [
        (
            "GET, plain upstream",
            b"GET /plain/forge HTTP/1.1\r\nHost: t\r\n\r\n".to_vec(),
            "plain",
        ),
        (
            "POST with Expect: 100-continue, plain upstream",
            b"POST /plain/forge HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n{}"
                .to_vec(),
            "plain",
        ),
        (
            "chunked request body, plain upstream",
            b"POST /plain/forge HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
                .to_vec(),
            "plain",
        ),
        (
            "GET, https upstream",
            b"GET /secure/forge HTTP/1.1\r\nHost: t\r\n\r\n".to_vec(),
            "secure",
        ),
    ];
    for (what, request, mount) in cases {
        let what = format!("{label}: {what}");
        let answers = pipelined(&f.proxy, &[request, clean_get(mount)]);
        assert_forged_body(&answers[0], &what);
        assert_clean(&answers[1], &what);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_forged_answer_stays_one_answer_on_every_read_only_path() {
    read_only_paths(&[], "fast path").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_forged_answer_stays_one_answer_on_every_read_only_path_with_hyper() {
    read_only_paths(&[("IDEMPROXY_FAST_PATH", "0")], "hyper").await;
}

/// A side effect: the first call stores the answer, the next two replay it (from the
/// store, then from memory); a clean request follows each.
async fn side_effect_paths(env: &[(&str, &str)], label: &str) {
    let f = start(env).await;
    for mount in ["plain", "secure"] {
        let send = format!(
            "POST /{mount}se/forge/send HTTP/1.1\r\nHost: t\r\nIdempotency-Key: k-{mount}\r\nContent-Length: 2\r\n\r\n{{}}"
        )
        .into_bytes();
        for round in [
            "first answer",
            "replay from the store",
            "replay from memory",
        ] {
            let what = format!("{label}: {mount}: {round}");
            let answers = pipelined(&f.proxy, &[send.clone(), clean_get(mount)]);
            assert_forged_body(&answers[0], &what);
            assert_eq!(
                answers[0].header("idempotent-replayed"),
                (round != "first answer").then_some("true"),
                "{what}"
            );
            assert_clean(&answers[1], &what);
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_forged_side_effect_answer_is_stored_and_replayed_as_one_answer() {
    side_effect_paths(&[], "fast path").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_forged_side_effect_answer_is_stored_and_replayed_as_one_answer_with_hyper() {
    side_effect_paths(&[("IDEMPROXY_FAST_PATH", "0")], "hyper").await;
}

/// An upstream that answers `101 Switching Protocols` unasked (the proxy forwards no
/// `Upgrade`): 502 on every client path, as `wire::h1` answered it already, and the
/// client's next request gets its own answer.
async fn unsolicited_switch(env: &[(&str, &str)], label: &str) {
    let f = start(env).await;
    let cases: [(&str, Vec<u8>, &str); 3] = [
        (
            "GET, plain upstream (wire::h1)",
            b"GET /plain/switch HTTP/1.1\r\nHost: t\r\n\r\n".to_vec(),
            "plain",
        ),
        (
            "chunked request body, plain upstream (Http1Pool)",
            b"POST /plain/switch HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
                .to_vec(),
            "plain",
        ),
        (
            "GET, https upstream",
            b"GET /secure/switch HTTP/1.1\r\nHost: t\r\n\r\n".to_vec(),
            "secure",
        ),
    ];
    for (what, request, mount) in cases {
        let what = format!("{label}: {what}");
        let answers = pipelined(&f.proxy, &[request, clean_get(mount)]);
        assert_eq!(answers[0].status, 502, "{what}: {:?}", answers[0].headers);
        assert_clean(&answers[1], &what);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unsolicited_switch_is_a_bad_gateway() {
    unsolicited_switch(&[], "fast path").await;
    unsolicited_switch(&[("IDEMPROXY_FAST_PATH", "0")], "hyper").await;
}

/// A side effect whose answer is malformed in a way hyper's client refuses (an empty
/// chunk-size line, a signed `Content-Length`) is never committed: 502 with the outcome
/// unknown, and a retry is not answered from a record (the request was sent).
#[tokio::test(flavor = "multi_thread")]
async fn a_malformed_side_effect_answer_is_never_committed() {
    for (mode, env) in [
        ("fast path", &[][..]),
        ("hyper", &[("IDEMPROXY_FAST_PATH", "0")][..]),
    ] {
        let f = start(env).await;
        for kind in ["emptychunk", "signedlength"] {
            let what = format!("{mode}: {kind}");
            let send = format!(
                "POST /plainse/{kind}/send HTTP/1.1\r\nHost: t\r\nIdempotency-Key: k-{kind}\r\nContent-Length: 2\r\n\r\n{{}}"
            )
            .into_bytes();
            let answers = pipelined(&f.proxy, std::slice::from_ref(&send));
            assert_eq!(answers[0].status, 502, "{what}: {:?}", answers[0].headers);
            assert_eq!(
                answers[0].header("idempotency-status"),
                Some("outcome_unknown"),
                "{what}"
            );
            let again = pipelined(&f.proxy, &[send]);
            assert_ne!(again[0].status, 200, "{what}: not replayed");
            assert!(again[0].header("idempotent-replayed").is_none(), "{what}");
        }
    }
}

/// HTTP/2 clients: hyper's HTTP/2 server writes the answer, framed by its body (a stale
/// `content-length: 3` over 63 bytes of data is a stream error at best).
#[tokio::test(flavor = "multi_thread")]
async fn a_forged_answer_reaches_an_http2_client_whole() {
    let f = start(&[]).await;
    let c = h2_client();
    for mount in ["plain", "secure"] {
        let r = send(
            &c,
            http::Method::GET,
            &f.proxy.url(&format!("/{mount}/forge")),
            &[],
            "",
        )
        .await;
        assert_eq!(r.status, 200, "{mount}: {r:?}");
        assert_eq!(r.body, PAYLOAD.as_bytes(), "{mount}");
        if let Some(len) = r.header("content-length") {
            assert_eq!(len, PAYLOAD.len().to_string(), "{mount}");
        }
        for round in ["first", "replay"] {
            let r = send(
                &c,
                http::Method::POST,
                &f.proxy.url(&format!("/{mount}se/forge/send")),
                &[("idempotency-key", &format!("k2-{mount}"))],
                "{}",
            )
            .await;
            assert_eq!(r.status, 200, "{mount} {round}: {r:?}");
            assert_eq!(r.body, PAYLOAD.as_bytes(), "{mount} {round}");
        }
    }
}
