//! Every phase of a connection has a deadline (issue 33), configured short here
//! (`timeouts.client_header`, `client_body`, `upstream_body`: 1 s). Each test asserts the
//! outcome (the connection closed, a 408 answered) within a generous bound, never how
//! fast: before the deadlines existed, each of these waited forever.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::time::Duration;

use common::*;

/// Longer than any deadline here by far: a read that waits this long failed the test.
const BOUND: Duration = Duration::from_secs(15);

/// A downstream that answers `/stall...` with a head promising 100 bytes, sends 10 and
/// then nothing more (holding the connection), and anything else with `ok`, after
/// reading the request's head and body (by length, or chunked to its last chunk).
fn stalling_downstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { return };
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                loop {
                    let mut chunk = [0u8; 4096];
                    let (path, end) = loop {
                        let mut slots = [httparse::EMPTY_HEADER; 64];
                        let mut req = httparse::Request::new(&mut slots);
                        if let Ok(httparse::Status::Complete(len)) = req.parse(&buf) {
                            let cl = req
                                .headers
                                .iter()
                                .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                                .and_then(|h| std::str::from_utf8(h.value).ok()?.parse().ok())
                                .unwrap_or(0usize);
                            let chunked = req
                                .headers
                                .iter()
                                .any(|h| h.name.eq_ignore_ascii_case("transfer-encoding"));
                            if !chunked {
                                break (req.path.unwrap_or_default().to_string(), len + cl);
                            }
                            if let Some(i) = buf[len..].windows(5).position(|w| w == b"0\r\n\r\n") {
                                break (req.path.unwrap_or_default().to_string(), len + i + 5);
                            }
                        }
                        match s.read(&mut chunk) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    while buf.len() < end {
                        match s.read(&mut chunk) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    buf.drain(..end);
                    if path.contains("stall") {
                        let _ = s
                            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789");
                        std::thread::sleep(Duration::from_secs(60));
                        return;
                    }
                    if s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    addr
}

fn deadline_config(dir: &Path, downstream: SocketAddr) -> String {
    format!(
        r#"listen: 127.0.0.1:0
admin: {{ listen: 127.0.0.1:0 }}
store: {{ backend: redb, path: {dir}/store.redb, retention: 1h }}
identity: {{ key_header: Idempotency-Key }}
timeouts: {{ client_header: 1s, client_body: 1s, upstream_body: 1s }}
upstreams:
  - name: ro
    url: http://{downstream}
    mount: /ro
    routes:
      - {{ name: any, match: {{ path: "/{{*rest}}" }}, class: read_only }}
  - name: se
    url: http://{downstream}
    mount: /se
    routes:
      - {{ name: send, match: {{ method: POST, path: /send }} }}
"#,
        dir = dir.display()
    )
}

struct Setup {
    _dir: tempfile::TempDir,
    proxy: ProxyProc,
}

fn setup(env: &[(&str, &str)]) -> Setup {
    let dir = tempfile::tempdir().expect("tempdir");
    let ds = stalling_downstream();
    let proxy = ProxyProc::start_with_env(
        dir.path(),
        &deadline_config(dir.path(), ds),
        &[&[("IDEMPROXY_ADMIN_TOKEN", "t0ken")], env].concat(),
    );
    Setup { _dir: dir, proxy }
}

fn open(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(BOUND)).expect("timeout");
    s
}

/// Everything the proxy sends until it closes the connection; a test failure if it is
/// still open after [`BOUND`].
fn until_closed(s: &mut TcpStream, what: &str) -> Vec<u8> {
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match s.read(&mut chunk) {
            Ok(0) => return got,
            Ok(n) => got.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return got,
            Err(e) => panic!(
                "{what}: the connection is still open after {BOUND:?} ({e}); got {:?}",
                String::from_utf8_lossy(&got)
            ),
        }
    }
}

const MODES: [(&str, &[(&str, &str)]); 2] = [
    ("fast path", &[]),
    ("hyper", &[("IDEMPROXY_FAST_PATH", "0")]),
];

#[test]
fn a_connection_that_sends_nothing_is_closed() {
    for (mode, env) in MODES {
        let t = setup(env);
        let mut s = open(t.proxy.addr);
        let got = until_closed(&mut s, mode);
        assert!(
            got.is_empty(),
            "{mode}: {:?}",
            String::from_utf8_lossy(&got)
        );
        let admin = t.proxy.admin_addr.expect("admin listener");
        let mut s = open(admin);
        let got = until_closed(&mut s, "admin");
        assert!(got.is_empty(), "admin: {:?}", String::from_utf8_lossy(&got));
    }
}

#[test]
fn an_idle_keep_alive_connection_is_closed() {
    for (mode, env) in MODES {
        let t = setup(env);
        let mut s = open(t.proxy.addr);
        s.write_all(b"GET /ro/x HTTP/1.1\r\nHost: t\r\n\r\n")
            .expect("write");
        let got = until_closed(&mut s, mode);
        let text = String::from_utf8_lossy(&got);
        assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{mode}: {text}");
        assert!(text.ends_with("\r\n\r\nok"), "{mode}: {text}");
    }
}

/// An HTTP/2 connection whose peer goes silent (it stops acknowledging the server's
/// pings, as a vanished client would) is closed: the proxy pings after
/// `timeouts.client_header` without a frame and gives up as long after.
#[test]
fn a_silent_http2_peer_is_closed() {
    for (mode, env) in MODES {
        let t = setup(env);
        let mut s = open(t.proxy.addr);
        // The client preface and an empty SETTINGS frame; then nothing, not even the
        // SETTINGS acknowledgement or a PING answer.
        s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
            .expect("write");
        let got = until_closed(&mut s, mode);
        // Frames are 9-byte headers; a PING (type 6) was sent before the connection ended.
        let mut at = 0;
        let mut pinged = false;
        while at + 9 <= got.len() {
            let len = usize::from(got[at]) << 16
                | usize::from(got[at + 1]) << 8
                | usize::from(got[at + 2]);
            pinged |= got[at + 3] == 6;
            at += 9 + len;
        }
        assert!(pinged, "{mode}: no PING before the close: {got:?}");
    }
}

#[test]
fn a_request_head_that_stops_is_closed() {
    for (mode, env) in MODES {
        let t = setup(env);
        let mut s = open(t.proxy.addr);
        s.write_all(b"GET /ro/x HTTP/1.1\r\nHost: t\r\n")
            .expect("write");
        let got = until_closed(&mut s, mode);
        // hyper answers its header timeout with nothing, or a 408 where it can.
        let text = String::from_utf8_lossy(&got);
        assert!(
            got.is_empty() || text.starts_with("HTTP/1.1 408"),
            "{mode}: {text}"
        );
    }
}

/// A request whose `Content-Length` promises 10 bytes and whose body stops after 3.
fn assert_stalled_body_is_408(addr: SocketAddr, head: &str, what: &str) {
    let mut s = open(addr);
    s.write_all(head.as_bytes()).expect("write");
    s.write_all(b"abc").expect("write");
    let got = until_closed(&mut s, what);
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 408 "), "{what}: {text}");
    assert!(text.contains("request-timeout"), "{what}: {text}");
}

#[test]
fn a_request_body_that_stops_is_answered_408() {
    for (mode, env) in MODES {
        let t = setup(env);
        assert_stalled_body_is_408(
            t.proxy.addr,
            "POST /ro/x HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\n",
            &format!("{mode}: read-only"),
        );
        assert_stalled_body_is_408(
            t.proxy.addr,
            "POST /se/send HTTP/1.1\r\nHost: t\r\nIdempotency-Key: k1\r\nContent-Length: 10\r\n\r\n",
            &format!("{mode}: side effect"),
        );
        // Chunked: streamed (read-only) or read whole (side effect) by hyper.
        assert_stalled_body_is_408(
            t.proxy.addr,
            "POST /ro/x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n0a\r\n",
            &format!("{mode}: chunked read-only"),
        );
        assert_stalled_body_is_408(
            t.proxy.addr,
            "POST /se/send HTTP/1.1\r\nHost: t\r\nIdempotency-Key: k2\r\nTransfer-Encoding: chunked\r\n\r\n0a\r\n",
            &format!("{mode}: chunked side effect"),
        );
    }
}

#[test]
fn an_upstream_answer_body_that_stalls_is_cut_off() {
    for (mode, env) in MODES {
        let t = setup(env);
        for request in [
            "GET /ro/stall HTTP/1.1\r\nHost: t\r\n\r\n",
            // By hyper's client (`Http1Pool`): a chunked request body.
            "POST /ro/stall HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        ] {
            let mut s = open(t.proxy.addr);
            s.write_all(request.as_bytes()).expect("write");
            let got = until_closed(&mut s, mode);
            let text = String::from_utf8_lossy(&got);
            assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{mode}: {text}");
            assert!(
                text.ends_with("\r\n\r\n0123456789"),
                "{mode}: the body so far, then the close: {text}"
            );
        }
    }
}

#[test]
fn an_admin_request_body_that_stops_is_answered_408() {
    let t = setup(&[]);
    let admin = t.proxy.admin_addr.expect("admin listener");
    assert_stalled_body_is_408(
        admin,
        "POST /v1/executions/ex_none/approve HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer t0ken\r\nContent-Type: application/json\r\nContent-Length: 10\r\n\r\n",
        "admin",
    );
}
