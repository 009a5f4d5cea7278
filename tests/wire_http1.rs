//! The proxy's HTTP/1.1 server side on the wire: raw bytes in, raw bytes out, against the
//! real `idemproxy` binary and the fake downstream.
//!
//! They were written while hyper served every HTTP/1 connection, before the listener's
//! fast path (src/wire/fast.rs) existed, and pin down what hyper did on the edge cases a
//! hand-written server has to get right (keep-alive and close, pipelining, split and
//! chunked bodies, HEAD and bodiless statuses, `Expect`, request smuggling defences,
//! malformed and oversized heads, clients that vanish mid-body, upgrade requests, the
//! HTTP/2 preface). The fast path serves the simple requests and hands the rest to hyper;
//! these tests hold it to hyper's behaviour. Where a test says "hyper's behaviour", that is
//! what the binary did before the fast path; the two answers changed on purpose since say
//! so (a 413 after a buffered body; `gzip, chunked` refused with 501). Each
//! test asserts status, framing, whether the connection stays open, and what reached the
//! downstream; none asserts timing.
//!
//! Every test runs twice (`in_both_modes!` at the end): as `fast_path::NAME` with the
//! fast path on, and as `hyper::NAME` with `IDEMPROXY_FAST_PATH=0`, hyper reading every
//! request; a difference between the two is spelled out where a test allows one.
//! `answers_alike_in_both_modes` sends the same raw cases to both and compares what the
//! client got and what the downstream saw.
//!
//! The config is the standard test config plus an upstream `ro`, mounted at `/ro` on the
//! fake downstream, whose every path and method is read-only (a plain pass-through):
//! `/ro/echo/...` reaches the fake's echo, which answers with what it received.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::path::Path;
use std::time::Duration;

use common::fake_downstream::FakeDownstream;
use common::*;

/// How long any read waits before the test fails instead of hanging.
const TIMEOUT: Duration = Duration::from_secs(10);

/// The standard test config plus an upstream `ro` mounted at `/ro` on the same fake
/// downstream, whose every path and method is read-only: a pass-through for any request.
fn wire_config(dir: &Path, downstream: &str) -> String {
    let mut yaml = config(dir, downstream);
    yaml.push_str(&format!(
        r#"  - name: ro
    url: {downstream}
    mount: /ro
    routes:
      - {{ name: any, match: {{ path: "/{{*rest}}" }}, class: read_only }}
"#
    ));
    yaml
}

struct Setup {
    _dir: tempfile::TempDir,
    ds: FakeDownstream,
    proxy: ProxyProc,
}

/// Which server reads the client's HTTP/1.1: every test runs with both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// The listener's fast path (src/wire/fast.rs), handing to hyper what it does not take.
    Fast,
    /// hyper alone (`IDEMPROXY_FAST_PATH=0`).
    Hyper,
}

impl Mode {
    fn env(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Mode::Fast => &[],
            Mode::Hyper => &[("IDEMPROXY_FAST_PATH", "0")],
        }
    }
}

/// Each test function `name(mode)` as two tests: `fast_path::name` and `hyper::name`.
macro_rules! in_both_modes {
    ($($name:ident),* $(,)?) => {
        mod fast_path {
            $(#[test] fn $name() { super::$name(super::Mode::Fast) })*
        }
        mod hyper {
            $(#[test] fn $name() { super::$name(super::Mode::Hyper) })*
        }
    };
}

fn setup(mode: Mode) -> Setup {
    let dir = tempfile::tempdir().expect("tempdir");
    let ds = FakeDownstream::start_in_thread(SocketAddr::from(([127, 0, 0, 1], 0)))
        .expect("fake downstream starts");
    let proxy =
        ProxyProc::start_with_env(dir.path(), &wire_config(dir.path(), &ds.url()), mode.env());
    Setup {
        _dir: dir,
        ds,
        proxy,
    }
}

/// How a response's body was delimited on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// No body by definition (HEAD, 1xx, 204, 304).
    None,
    Length(usize),
    Chunked,
    /// Neither length nor chunked: the body ran to the connection's end.
    UntilClose,
}

/// One response as it came off the wire.
#[derive(Debug)]
struct Answer {
    /// `1` for `HTTP/1.1`, `0` for `HTTP/1.0`.
    minor: u8,
    status: u16,
    /// Lower-case names, in wire order, one entry per line.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    framing: Framing,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
    fn header_all(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }
    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {self:?}"))
    }
    fn problem_type(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        self.json()["type"].as_str().unwrap_or_default().to_string()
    }
}

/// A raw client connection: exact bytes out, responses parsed by hand.
struct Wire {
    stream: TcpStream,
    /// Bytes read but not yet consumed as part of a response.
    buf: Vec<u8>,
}

impl Wire {
    fn open(addr: SocketAddr) -> Wire {
        let stream = TcpStream::connect(addr).expect("connect to the proxy");
        stream.set_read_timeout(Some(TIMEOUT)).expect("timeout");
        stream.set_nodelay(true).expect("nodelay");
        Wire {
            stream,
            buf: Vec::new(),
        }
    }

    fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).expect("write to the proxy");
    }

    /// Read more bytes into the buffer; `false` at the connection's end.
    fn fill(&mut self) -> bool {
        let mut chunk = [0u8; 16 * 1024];
        match self.stream.read(&mut chunk) {
            Ok(0) => false,
            Ok(n) => {
                self.buf.extend_from_slice(&chunk[..n]);
                true
            }
            Err(e) if e.kind() == ErrorKind::ConnectionReset => false,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                panic!(
                    "nothing more from the proxy within {TIMEOUT:?}; have {:?}",
                    String::from_utf8_lossy(&self.buf)
                )
            }
            Err(e) => panic!("read from the proxy: {e}"),
        }
    }

    fn need(&mut self, n: usize) {
        while self.buf.len() < n {
            assert!(
                self.fill(),
                "connection closed with {} of {n} bytes: {:?}",
                self.buf.len(),
                String::from_utf8_lossy(&self.buf)
            );
        }
    }

    /// One line ending in CRLF, without it.
    fn line(&mut self) -> Vec<u8> {
        loop {
            if let Some(i) = self.buf.windows(2).position(|w| w == b"\r\n") {
                let line = self.buf[..i].to_vec();
                self.buf.drain(..i + 2);
                return line;
            }
            assert!(
                self.fill(),
                "connection closed inside a line: {:?}",
                String::from_utf8_lossy(&self.buf)
            );
        }
    }

    /// Read one response to a request that was not `HEAD`.
    fn answer(&mut self) -> Answer {
        self.read_answer(false)
    }

    /// Read one response; `head`: it answers a `HEAD`, so it has no body.
    fn read_answer(&mut self, head: bool) -> Answer {
        let (minor, status, headers, used) = loop {
            let mut slots = [httparse::EMPTY_HEADER; 64];
            let mut parsed = httparse::Response::new(&mut slots);
            match parsed.parse(&self.buf) {
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
                    break (
                        parsed.version.expect("version"),
                        parsed.code.expect("status"),
                        headers,
                        used,
                    );
                }
                Ok(httparse::Status::Partial) => assert!(
                    self.fill(),
                    "connection closed before a complete response head: {:?}",
                    String::from_utf8_lossy(&self.buf)
                ),
                Err(e) => panic!(
                    "not an HTTP/1 response ({e}): {:?}",
                    String::from_utf8_lossy(&self.buf)
                ),
            }
        };
        self.buf.drain(..used);
        let mut answer = Answer {
            minor,
            status,
            headers,
            body: Vec::new(),
            framing: Framing::None,
        };
        if head || (100..200).contains(&status) || status == 204 || status == 304 {
            return answer;
        }
        let chunked = answer
            .header("transfer-encoding")
            .and_then(|te| te.rsplit(',').next())
            .is_some_and(|last| last.trim().eq_ignore_ascii_case("chunked"));
        if chunked {
            answer.framing = Framing::Chunked;
            loop {
                let line = self.line();
                let line = String::from_utf8(line).expect("chunk size line is text");
                let hex = line.split(';').next().unwrap_or_default().trim();
                let size = usize::from_str_radix(hex, 16)
                    .unwrap_or_else(|e| panic!("bad chunk size {line:?}: {e}"));
                if size == 0 {
                    // Trailers up to the empty line.
                    while !self.line().is_empty() {}
                    break;
                }
                self.need(size + 2);
                answer.body.extend_from_slice(&self.buf[..size]);
                assert_eq!(&self.buf[size..size + 2], b"\r\n", "chunk ends in CRLF");
                self.buf.drain(..size + 2);
            }
        } else if let Some(len) = answer.header("content-length") {
            let len: usize = len.parse().expect("numeric content-length");
            answer.framing = Framing::Length(len);
            self.need(len);
            answer.body = self.buf.drain(..len).collect();
        } else {
            answer.framing = Framing::UntilClose;
            while self.fill() {}
            answer.body = std::mem::take(&mut self.buf);
        }
        answer
    }

    /// Send `request` and read its response.
    fn exchange(&mut self, request: &[u8]) -> Answer {
        self.send(request);
        self.answer()
    }

    /// The server closes the connection with no further byte.
    fn assert_closed(&mut self) {
        assert!(
            self.buf.is_empty(),
            "bytes after the last response: {:?}",
            String::from_utf8_lossy(&self.buf)
        );
        let mut chunk = [0u8; 1024];
        match self.stream.read(&mut chunk) {
            Ok(0) => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
            Ok(n) => panic!(
                "expected the connection closed, got {:?}",
                String::from_utf8_lossy(&chunk[..n])
            ),
            Err(e) => panic!("expected the connection closed within {TIMEOUT:?}: {e}"),
        }
    }

    /// The connection is still usable: another request on it is answered.
    fn assert_open(&mut self) {
        assert!(
            self.buf.is_empty(),
            "bytes after the last response: {:?}",
            String::from_utf8_lossy(&self.buf)
        );
        let a = self.exchange(b"GET /ro/echo/still-open HTTP/1.1\r\nHost: t\r\n\r\n");
        assert_eq!(a.status, 200, "{a:?}");
        assert_eq!(a.json()["path"], "/echo/still-open");
    }

    fn shutdown_write(&mut self) {
        self.stream
            .shutdown(Shutdown::Write)
            .expect("shutdown write");
    }
}

// ---------------------------------------------------------------------------------------
// Request builders

fn get(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: t\r\n\r\n").into_bytes()
}

fn post(path: &str, body: &str) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// The echo's view of a request: (path, body).
fn echoed(a: &Answer) -> (String, String) {
    assert_eq!(a.status, 200, "{a:?}");
    let v = a.json();
    (
        v["path"].as_str().expect("path").to_string(),
        v["body"].as_str().expect("body").to_string(),
    )
}

/// The header names the downstream saw, from an echo answer.
fn echoed_header(a: &Answer, name: &str) -> Option<Vec<String>> {
    a.json()["headers"][name].as_array().map(|vs| {
        vs.iter()
            .map(|v| v.as_str().unwrap_or_default().to_string())
            .collect()
    })
}

/// hyper's own answer to a request it cannot parse: a bare 400, `connection: close`,
/// an empty body, and then the connection is closed.
fn assert_bare_400_and_closed(w: &mut Wire, what: &str) {
    let a = w.answer();
    assert_eq!(a.status, 400, "{what}: {a:?}");
    assert_eq!(a.header("connection"), Some("close"), "{what}: {a:?}");
    assert_eq!(a.framing, Framing::Length(0), "{what}: {a:?}");
    assert!(a.header("date").is_some(), "{what}: {a:?}");
    w.assert_closed();
}

// ---------------------------------------------------------------------------------------
// 1-3: keep-alive, pipelining, split writes

fn keep_alive_serves_requests_one_after_another(mode: Mode) {
    let s = setup(mode);
    let mut w = Wire::open(s.proxy.addr);
    let a = w.exchange(&get("/ro/echo/one"));
    assert_eq!(echoed(&a).0, "/echo/one");
    assert_eq!(a.minor, 1);
    assert_eq!(a.framing, Framing::Length(a.body.len()));
    assert_eq!(a.header("connection"), None, "{a:?}");
    let b = w.exchange(&get("/ro/echo/two"));
    assert_eq!(echoed(&b).0, "/echo/two");
    assert_eq!(s.ds.hits(), 2);
    w.assert_open();
}

fn pipelined_requests_in_one_write_are_answered_in_order(mode: Mode) {
    let s = setup(mode);
    let mut w = Wire::open(s.proxy.addr);
    let mut batch = get("/ro/echo/1");
    batch.extend(post("/ro/echo/2", "second body"));
    // A side effect without a key (`key_required: false`): its body is forwarded too.
    batch.extend(post("/mail/echo/3", "third"));
    batch.extend(get("/ro/echo/4"));
    w.send(&batch);
    let expected = [
        ("/echo/1", ""),
        ("/echo/2", "second body"),
        ("/echo/3", "third"),
        ("/echo/4", ""),
    ];
    for (path, body) in expected {
        let a = w.answer();
        assert_eq!(echoed(&a), (path.to_string(), body.to_string()));
    }
    assert_eq!(s.ds.hits(), 4);
    w.assert_open();
}

fn request_split_across_many_writes_is_served(mode: Mode) {
    let s = setup(mode);
    let mut w = Wire::open(s.proxy.addr);
    let body = "0123456789abcdefghij";
    let head = format!(
        "POST /ro/echo/split HTTP/1.1\r\nHost: t\r\nX-Custom: some value\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    for piece in head.as_bytes().chunks(3) {
        w.send(piece);
        std::thread::sleep(Duration::from_millis(2));
    }
    w.send(&body.as_bytes()[..7]);
    std::thread::sleep(Duration::from_millis(50));
    w.send(&body.as_bytes()[7..]);
    let a = w.answer();
    assert_eq!(echoed(&a), ("/echo/split".to_string(), body.to_string()));
    assert_eq!(
        echoed_header(&a, "x-custom"),
        Some(vec!["some value".into()])
    );
    assert_eq!(s.ds.hits(), 1);
    w.assert_open();
}

// ---------------------------------------------------------------------------------------
// 4-5: closing: `Connection: close`, HTTP/1.0

fn connection_close_is_answered_announced_and_closed(mode: Mode) {
    let s = setup(mode);
    // hyper answers with `connection: close` and then closes; the token is matched
    // case-insensitively and anywhere in a list.
    for header in ["close", "Close", "keep-alive, close"] {
        let mut w = Wire::open(s.proxy.addr);
        let a = w.exchange(
            format!("GET /ro/echo/c HTTP/1.1\r\nHost: t\r\nConnection: {header}\r\n\r\n")
                .as_bytes(),
        );
        assert_eq!(echoed(&a).0, "/echo/c", "{header}");
        assert_eq!(a.header("connection"), Some("close"), "{header}: {a:?}");
        assert_eq!(a.framing, Framing::Length(a.body.len()));
        // The downstream does not see the client's hop-by-hop header.
        assert_eq!(echoed_header(&a, "connection"), None);
        w.assert_closed();
    }
    assert_eq!(s.ds.hits(), 3);
    // A request pipelined behind a `Connection: close` one is never served.
    let mut w = Wire::open(s.proxy.addr);
    let mut batch = b"GET /ro/echo/first HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".to_vec();
    batch.extend(get("/ro/echo/second"));
    w.send(&batch);
    let a = w.answer();
    assert_eq!(echoed(&a).0, "/echo/first");
    w.assert_closed();
    assert_eq!(s.ds.hits(), 4);
    assert_eq!(s.ds.hits_on("/echo/second"), 0);
}

fn http10_closes_unless_keep_alive_is_asked(mode: Mode) {
    let s = setup(mode);
    // Without `Connection: keep-alive`: an HTTP/1.0 answer, no connection header, closed.
    let mut w = Wire::open(s.proxy.addr);
    let a = w.exchange(b"GET /ro/echo/ten HTTP/1.0\r\nHost: t\r\n\r\n");
    assert_eq!(a.minor, 0, "{a:?}");
    assert_eq!(echoed(&a).0, "/echo/ten");
    assert_eq!(a.header("connection"), None, "{a:?}");
    assert_eq!(a.framing, Framing::Length(a.body.len()));
    w.assert_closed();
    // With it: `connection: keep-alive` in the answer and the connection stays open.
    let mut w = Wire::open(s.proxy.addr);
    let a = w.exchange(b"GET /ro/echo/ka HTTP/1.0\r\nHost: t\r\nConnection: keep-alive\r\n\r\n");
    assert_eq!(a.minor, 0, "{a:?}");
    assert_eq!(echoed(&a).0, "/echo/ka");
    assert_eq!(a.header("connection"), Some("keep-alive"), "{a:?}");
    // The downstream is spoken to in HTTP/1.1 all the same.
    assert_eq!(a.json()["version"], "HTTP/1.1");
    let b = w.exchange(b"GET /ro/echo/ka2 HTTP/1.0\r\nHost: t\r\nConnection: keep-alive\r\n\r\n");
    assert_eq!(echoed(&b).0, "/echo/ka2");
    w.assert_open();
    // An answer of unknown length (chunked from the downstream) cannot be chunked to an
    // HTTP/1.0 client: it runs to the connection's end, keep-alive or not.
    let mut w = Wire::open(s.proxy.addr);
    let a = w.exchange(
        b"GET /ro/stream?chunks=3&size=5 HTTP/1.0\r\nHost: t\r\nConnection: keep-alive\r\n\r\n",
    );
    assert_eq!((a.minor, a.status), (0, 200), "{a:?}");
    assert_eq!(a.framing, Framing::UntilClose, "{a:?}");
    assert_eq!(a.header("transfer-encoding"), None);
    assert_eq!(a.body, b"aaaaabbbbbccccc");
    w.assert_closed();
    // ten, ka, ka2, the still-open probe and the stream.
    assert_eq!(s.ds.hits(), 5);
}

// ---------------------------------------------------------------------------------------
// 6-7: answers without a body; chunked answers

fn head_answer_has_the_length_but_no_body(mode: Mode) {
    let s = setup(mode);
    let mut w = Wire::open(s.proxy.addr);
    // HEAD and a GET behind it in one write: any body byte after the HEAD's head would
    // show up as garbage before the GET's status line.
    let mut batch = b"HEAD /ro/echo/h HTTP/1.1\r\nHost: t\r\n\r\n".to_vec();
    batch.extend(get("/ro/echo/h"));
    w.send(&batch);
    let head = w.read_answer(true);
    assert_eq!(head.status, 200, "{head:?}");
    let len: usize = head
        .header("content-length")
        .expect("HEAD keeps the downstream's Content-Length")
        .parse()
        .expect("numeric");
    assert_eq!(head.header("transfer-encoding"), None);
    let a = w.answer();
    assert_eq!(echoed(&a).0, "/echo/h");
    // The echo of `GET` is one byte shorter than that of `HEAD` (the method's length).
    assert_eq!(
        a.body.len() + 1,
        len,
        "HEAD announced the length its GET would have"
    );
    assert_eq!(s.ds.hits(), 2);
    w.assert_open();
}

fn bodiless_statuses_leave_the_connection_usable(mode: Mode) {
    let s = setup(mode);
    let mut w = Wire::open(s.proxy.addr);
    for status in [204u16, 304] {
        // The fake writes a JSON body for these; neither hop may send one.
        let a = w.exchange(&get(&format!("/ro/echo/s?status={status}")));
        assert_eq!(a.status, status, "{a:?}");
        assert_eq!(a.header("content-length"), None, "{a:?}");
        assert_eq!(a.header("transfer-encoding"), None, "{a:?}");
        assert!(a.header("date").is_some());
        // The next request on the connection parses cleanly: no stray body bytes.
        let b = w.exchange(&get("/ro/echo/after"));
        assert_eq!(echoed(&b).0, "/echo/after", "after {status}");
    }
    assert_eq!(s.ds.hits(), 4);
    w.assert_open();
}

fn chunked_downstream_answer_is_forwarded_chunked(mode: Mode) {
    let s = setup(mode);
    let mut w = Wire::open(s.proxy.addr);
    let a = w.exchange(&get("/ro/stream?chunks=4&size=3"));
    assert_eq!(a.status, 200, "{a:?}");
    assert_eq!(a.framing, Framing::Chunked, "{a:?}");
    assert_eq!(a.header("content-length"), None);
    assert_eq!(a.body, b"aaabbbcccddd");
    assert_eq!(s.ds.hits(), 1);
    w.assert_open();
}

// ---------------------------------------------------------------------------------------
// 8-9: request bodies and smuggling defences

fn chunked_request_body_is_reassembled(mode: Mode) {
    let s = setup(mode);
    let mut w = Wire::open(s.proxy.addr);
    // Chunk extensions are ignored; trailers end the body.
    w.send(
        b"POST /ro/echo/chunked HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n\
          5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n",
    );
    let a = w.answer();
    assert_eq!(
        echoed(&a),
        ("/echo/chunked".to_string(), "hello world".to_string())
    );
    // Streamed to the downstream chunked as well.
    assert_eq!(
        echoed_header(&a, "transfer-encoding"),
        Some(vec!["chunked".into()])
    );
    // A keyed side effect buffers the same body whole.
    let a = w.exchange(
        b"POST /mail/echo/keyed HTTP/1.1\r\nHost: t\r\nIdempotency-Key: k-chunked\r\n\
          Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
    );
    assert_eq!(echoed(&a), ("/echo/keyed".to_string(), "abcde".to_string()));
    assert_eq!(s.ds.hits(), 2);
    w.assert_open();
}

fn content_length_with_transfer_encoding_uses_chunked_and_closes(mode: Mode) {
    let s = setup(mode);
    let mut w = Wire::open(s.proxy.addr);
    // If the 5-byte Content-Length were used, "0\r\n\r\n" and more would be read as the
    // next request. hyper frames by the chunked coding, forwards one request without the
    // Content-Length, answers it with `connection: close` and closes.
    w.send(
        b"POST /ro/echo/clte HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\
          Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    );
    let a = w.answer();
    assert_eq!(echoed(&a), ("/echo/clte".to_string(), "hello".to_string()));
    assert_eq!(a.header("connection"), Some("close"), "{a:?}");
    assert_eq!(echoed_header(&a, "content-length"), None);
    w.assert_closed();
    assert_eq!(s.ds.hits(), 1);
}

fn conflicting_or_malformed_content_lengths_are_rejected(mode: Mode) {
    let s = setup(mode);
    let bad = [
        "Content-Length: 5\r\nContent-Length: 6",
        "Content-Length: 5, 5",
        "Content-Length: 5, 6",
        "Content-Length: +5",
        "Content-Length: -1",
        "Content-Length: 0x10",
        "Content-Length: 5a",
        "Content-Length: ",
        "Content-Length: 99999999999999999999999",
    ];
    for header in bad {
        let mut w = Wire::open(s.proxy.addr);
        w.send(
            format!("POST /ro/echo/cl HTTP/1.1\r\nHost: t\r\n{header}\r\n\r\nhello!").as_bytes(),
        );
        assert_bare_400_and_closed(&mut w, header);
    }
    assert_eq!(s.ds.hits(), 0, "nothing reached the downstream");
    // Two identical Content-Length lines are one length (RFC 9112 section 6.3): hyper
    // serves the request, forwards one Content-Length and keeps the connection.
    let mut w = Wire::open(s.proxy.addr);
    let a = w.exchange(
        b"POST /ro/echo/same HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello",
    );
    assert_eq!(echoed(&a), ("/echo/same".to_string(), "hello".to_string()));
    assert_eq!(echoed_header(&a, "content-length"), Some(vec!["5".into()]));
    // Whitespace around the value is allowed.
    let a =
        w.exchange(b"POST /ro/echo/ows HTTP/1.1\r\nHost: t\r\nContent-Length:  5 \r\n\r\nhello");
    assert_eq!(echoed(&a), ("/echo/ows".to_string(), "hello".to_string()));
    assert_eq!(s.ds.hits(), 2);
    w.assert_open();
}

fn transfer_codings_other_than_a_final_chunked_are_rejected(mode: Mode) {
    let s = setup(mode);
    let bad: [(&str, &str); 5] = [
        (
            "HTTP/1.1",
            "Transfer-Encoding: identity\r\nContent-Length: 5",
        ),
        ("HTTP/1.1", "Transfer-Encoding: identity"),
        ("HTTP/1.1", "Transfer-Encoding: chunked, gzip"),
        ("HTTP/1.1", "Transfer-Encoding: gzip"),
        // HTTP/1.0 has no chunked coding.
        ("HTTP/1.0", "Transfer-Encoding: chunked"),
    ];
    for (version, header) in bad {
        let mut w = Wire::open(s.proxy.addr);
        w.send(
            format!(
                "POST /ro/echo/te {version}\r\nHost: t\r\n{header}\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
            )
            .as_bytes(),
        );
        assert_bare_400_and_closed(&mut w, header);
    }
    assert_eq!(s.ds.hits(), 0, "nothing reached the downstream");
    // A final chunked, in any case and even twice over, is framed as chunked and served
    // once; the connection stays usable.
    let good = [
        "Transfer-Encoding: CHUNKED",
        "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked",
    ];
    let mut w = Wire::open(s.proxy.addr);
    for header in good {
        let a = w.exchange(
            format!(
                "POST /ro/echo/te HTTP/1.1\r\nHost: t\r\n{header}\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
            )
            .as_bytes(),
        );
        assert_eq!(
            echoed(&a),
            ("/echo/te".to_string(), "hello".to_string()),
            "{header}"
        );
    }
    assert_eq!(s.ds.hits(), 2);
    // `gzip, chunked` is refused (501, see the test below) before its body is read, and
    // hyper then closes the connection: the bytes after the last chunk are never read as
    // a request, and the refused one was not forwarded.
    let a = w.exchange(
        b"POST /ro/echo/te HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip, chunked\r\n\r\n\
          5\r\nhello\r\n0\r\n\r\nGET /ro/echo/smuggled HTTP/1.1\r\nHost: t\r\n\r\n",
    );
    assert_eq!(a.status, 501, "{a:?}");
    w.assert_closed();
    assert_eq!(
        s.ds.hits_on("/echo/te"),
        2,
        "the refused request was not forwarded"
    );
    assert_eq!(s.ds.hits_on("/echo/smuggled"), 0);
}

/// RFC 9112 section 6.1: a coding the server does not apply must not be lost. hyper takes
/// the chunked framing off `Transfer-Encoding: gzip, chunked` and hands over the gzipped
/// bytes; forwarded, they would reach the downstream as if they were the plain body. The
/// proxy refuses such a request: `501 not-implemented`, nothing forwarded, on read-only and
/// side-effect routes alike; plain `chunked` (any case, repeated) is still served.
fn transfer_codings_before_chunked_are_refused_not_dropped(mode: Mode) {
    let s = setup(mode);
    for (path, te) in [
        ("/ro/echo/gz", "gzip, chunked"),
        ("/ro/echo/gz", "deflate,chunked"),
        ("/mail/echo/gz", "gzip, chunked"),
    ] {
        let mut w = Wire::open(s.proxy.addr);
        let a = w.exchange(
            format!(
                "POST {path} HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: {te}\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
            )
            .as_bytes(),
        );
        assert_eq!(a.status, 501, "{te}: {a:?}");
        assert_eq!(a.problem_type(), "urn:idemproxy:problem:not-implemented");
    }
    assert_eq!(
        s.ds.hits_on("/echo/gz"),
        0,
        "nothing reached the downstream"
    );
}

fn malformed_chunked_body_fails_the_request_and_closes(mode: Mode) {
    let s = setup(mode);
    // Read-only: the body is streamed, so the failure shows up on the upstream request
    // (whose head may have gone): the client's fault all the same, 400 bad-request (it
    // was 502 upstream-unavailable before issue 33), then the connection closes.
    let mut w = Wire::open(s.proxy.addr);
    w.send(
        b"POST /ro/echo/badchunk HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
    );
    let a = w.answer();
    assert_eq!(a.status, 400, "{a:?}");
    assert_eq!(a.problem_type(), "urn:idemproxy:problem:bad-request");
    w.assert_closed();
    // Whatever reached the downstream, no body did.
    if let Some(seen) = s.ds.last_request("/echo/badchunk") {
        assert!(seen.body.is_empty(), "{seen:?}");
    }
    // A keyed side effect reads its body first: 400, nothing sent downstream.
    let mut w = Wire::open(s.proxy.addr);
    w.send(
        b"POST /mail/send HTTP/1.1\r\nHost: t\r\nIdempotency-Key: k-bad\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
    );
    let a = w.answer();
    assert_eq!(a.status, 400, "{a:?}");
    assert_eq!(a.problem_type(), "urn:idemproxy:problem:bad-request");
    w.assert_closed();
    assert_eq!(s.ds.hits_on("/send"), 0);
    assert_eq!(s.ds.commits(), 0);
}

// ---------------------------------------------------------------------------------------
// 10: Expect: 100-continue

fn expect_100_continue_is_answered_before_the_body(mode: Mode) {
    let s = setup(mode);
    let mut w = Wire::open(s.proxy.addr);
    for (path, seen) in [
        // Read-only: streamed.
        ("/ro/echo/expect", "/echo/expect"),
        // Unprotected side effect: streamed too.
        ("/mail/echo/expect", "/echo/expect"),
    ] {
        w.send(
            format!("POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
                .as_bytes(),
        );
        let cont = w.answer();
        assert_eq!(cont.status, 100, "{cont:?}");
        assert!(cont.headers.is_empty(), "{cont:?}");
        w.send(b"hello");
        let a = w.answer();
        assert_eq!(
            echoed(&a),
            (seen.to_string(), "hello".to_string()),
            "{path}"
        );
        // The proxy answered the expectation; the downstream is not asked again.
        assert_eq!(echoed_header(&a, "expect"), None, "{path}");
    }
    // A keyed side effect buffers the body: the 100 comes when it starts reading.
    w.send(
        b"POST /mail/send HTTP/1.1\r\nHost: t\r\nIdempotency-Key: k-expect\r\nContent-Type: application/json\r\n\
          Content-Length: 12\r\nExpect: 100-continue\r\n\r\n",
    );
    let cont = w.answer();
    assert_eq!(cont.status, 100, "{cont:?}");
    w.send(br#"{"to":"a@x"}"#);
    let a = w.answer();
    assert_eq!(a.status, 201, "{a:?}");
    assert_eq!(s.ds.commits(), 1);
    // An expectation other than 100-continue is ignored and forwarded.
    let a = w.exchange(
        b"POST /ro/echo/other HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: something\r\n\r\nhello",
    );
    assert_eq!(echoed(&a), ("/echo/other".to_string(), "hello".to_string()));
    assert_eq!(echoed_header(&a, "expect"), Some(vec!["something".into()]));
    w.assert_open();
}

// ---------------------------------------------------------------------------------------
// 11: HTTP/2 prior knowledge

fn http2_preface_is_answered_with_settings(mode: Mode) {
    let s = setup(mode);
    let mut w = Wire::open(s.proxy.addr);
    let mut preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    // An empty SETTINGS frame: length 0, type 4, flags 0, stream 0.
    preface.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
    w.send(&preface);
    w.need(9);
    let frame = &w.buf[..9];
    assert_eq!(frame[3], 0x4, "first frame is SETTINGS: {frame:02x?}");
    assert_eq!(frame[4] & 0x1, 0, "not an ACK: {frame:02x?}");
    assert_eq!(&frame[5..9], &[0, 0, 0, 0], "on stream 0");
    assert_eq!(s.ds.hits(), 0);
}

// ---------------------------------------------------------------------------------------
// 12: malformed and unusual request heads

fn malformed_heads_get_a_bare_400_and_close(mode: Mode) {
    let s = setup(mode);
    let bad: [(&str, &[u8]); 13] = [
        ("garbage line", b"HELLO\r\n\r\n"),
        ("HTTP/0.9 request line", b"GET /ro/echo\r\n\r\n"),
        (
            "HTTP/2.0 in a request line",
            b"GET /ro/echo HTTP/2.0\r\nHost: t\r\n\r\n",
        ),
        ("HTTP/1.2", b"GET /ro/echo HTTP/1.2\r\nHost: t\r\n\r\n"),
        (
            "space in target",
            b"GET /ro/echo x HTTP/1.1\r\nHost: t\r\n\r\n",
        ),
        (
            "target without slash",
            b"GET ro/echo HTTP/1.1\r\nHost: t\r\n\r\n",
        ),
        (
            "header without colon",
            b"GET /ro/echo HTTP/1.1\r\nHost: t\r\nNoColonHere\r\n\r\n",
        ),
        (
            "space before colon",
            b"GET /ro/echo HTTP/1.1\r\nHost : t\r\n\r\n",
        ),
        (
            "obs-fold",
            b"GET /ro/echo HTTP/1.1\r\nHost: t\r\nX-A: one\r\n two\r\n\r\n",
        ),
        (
            "NUL in value",
            b"GET /ro/echo HTTP/1.1\r\nHost: t\r\nX-A: a\0b\r\n\r\n",
        ),
        (
            "DEL in value",
            b"GET /ro/echo HTTP/1.1\r\nHost: t\r\nX-A: a\x7fb\r\n\r\n",
        ),
        (
            "CR alone in value",
            b"GET /ro/echo HTTP/1.1\r\nHost: t\r\nX-A: a\rb\r\n\r\n",
        ),
        (
            "empty header name",
            b"GET /ro/echo HTTP/1.1\r\nHost: t\r\n: v\r\n\r\n",
        ),
    ];
    for (what, bytes) in bad {
        let mut w = Wire::open(s.proxy.addr);
        w.send(bytes);
        assert_bare_400_and_closed(&mut w, what);
    }
    assert_eq!(s.ds.hits(), 0, "nothing reached the downstream");
}

fn lenient_heads_hyper_accepts(mode: Mode) {
    let s = setup(mode);
    let mut w = Wire::open(s.proxy.addr);
    // Bare LF line endings.
    let a = w.exchange(b"GET /ro/echo/lf HTTP/1.1\nHost: t\n\n");
    assert_eq!(echoed(&a).0, "/echo/lf");
    // Empty lines before the request line are skipped.
    let a = w.exchange(b"\r\n\r\nGET /ro/echo/crlf HTTP/1.1\r\nHost: t\r\n\r\n");
    assert_eq!(echoed(&a).0, "/echo/crlf");
    // A tab inside a value, and obs-text (UTF-8) bytes.
    let a = w.exchange(
        "GET /ro/echo/v HTTP/1.1\r\nHost: t\r\nX-Tab: a\tb\r\nX-Utf8: caf\u{e9}\r\n\r\n".as_bytes(),
    );
    assert_eq!(echoed_header(&a, "x-tab"), Some(vec!["a\tb".into()]));
    assert_eq!(echoed_header(&a, "x-utf8"), Some(vec!["caf\u{e9}".into()]));
    // Methods are case-sensitive tokens: `get` is forwarded as `get`.
    let a = w.exchange(b"get /ro/echo/lower HTTP/1.1\r\nHost: t\r\n\r\n");
    assert_eq!(a.json()["method"], "get");
    // TRACE goes through to a read-only route like any method.
    let a = w.exchange(b"TRACE /ro/echo/trace HTTP/1.1\r\nHost: t\r\n\r\n");
    assert_eq!(a.json()["method"], "TRACE");
    // A GET may carry a body; it is read (and forwarded), so the next request parses.
    let a =
        w.exchange(b"GET /ro/echo/getbody HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello");
    assert_eq!(
        echoed(&a),
        ("/echo/getbody".to_string(), "hello".to_string())
    );
    assert_eq!(s.ds.hits(), 6);
    w.assert_open();
}

fn absolute_form_target_is_routed_by_its_path(mode: Mode) {
    let s = setup(mode);
    let mut w = Wire::open(s.proxy.addr);
    let a =
        w.exchange(b"GET http://example.com/ro/echo/abs?q=1 HTTP/1.1\r\nHost: example.com\r\n\r\n");
    assert_eq!(echoed(&a).0, "/echo/abs");
    assert_eq!(a.json()["query"], "q=1");
    // The downstream gets its own Host; the client's goes to X-Forwarded-Host.
    assert_eq!(
        echoed_header(&a, "x-forwarded-host"),
        Some(vec!["example.com".into()])
    );
    assert_eq!(s.ds.hits(), 1);
    w.assert_open();
}

fn asterisk_and_authority_forms_get_the_no_route_problem(mode: Mode) {
    let s = setup(mode);
    let mut w = Wire::open(s.proxy.addr);
    // `OPTIONS *` and `CONNECT host:port` reach the proxy's handler (hyper parses both),
    // match no mount, and get the 404 problem; the connection stays open (a CONNECT that
    // is not answered 2xx is not tunnelled).
    for req in [
        &b"OPTIONS * HTTP/1.1\r\nHost: t\r\n\r\n"[..],
        &b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n"[..],
    ] {
        let a = w.exchange(req);
        assert_eq!(a.status, 404, "{a:?}");
        assert_eq!(a.problem_type(), "urn:idemproxy:problem:no-route");
        assert_eq!(a.header("connection"), None);
    }
    assert_eq!(s.ds.hits(), 0);
    w.assert_open();
}

// ---------------------------------------------------------------------------------------
// 13: head size limit

fn oversized_head_gets_431_and_close(mode: Mode) {
    let s = setup(mode);
    let mut w = Wire::open(s.proxy.addr);
    w.send(
        format!(
            "GET /ro/echo HTTP/1.1\r\nHost: t\r\nX-Big: {}\r\n\r\n",
            "a".repeat(9000)
        )
        .as_bytes(),
    );
    let a = w.answer();
    assert_eq!(a.status, 431, "{a:?}");
    assert_eq!(a.header("connection"), Some("close"));
    assert_eq!(a.framing, Framing::Length(0));
    w.assert_closed();
    assert_eq!(s.ds.hits(), 0);
    // Just under the 8 KiB limit: served, the header forwarded whole.
    let mut w = Wire::open(s.proxy.addr);
    let big = "b".repeat(7 * 1024);
    let a = w.exchange(
        format!("GET /ro/echo/under HTTP/1.1\r\nHost: t\r\nX-Big: {big}\r\n\r\n").as_bytes(),
    );
    assert_eq!(echoed(&a).0, "/echo/under");
    assert_eq!(echoed_header(&a, "x-big"), Some(vec![big]));
    assert_eq!(s.ds.hits(), 1);
    w.assert_open();
}

// ---------------------------------------------------------------------------------------
// 14: large bodies

fn large_body_is_streamed_to_a_read_only_route(mode: Mode) {
    let s = setup(mode);
    let mut w = Wire::open(s.proxy.addr);
    let body: String = (0..100_000)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    let a = w.exchange(&post("/ro/echo/large", &body));
    let v = a.json();
    assert_eq!(v["body_len"], 100_000);
    assert_eq!(v["body"].as_str(), Some(body.as_str()));
    assert_eq!(s.ds.hits(), 1);
    w.assert_open();
}

fn keyed_side_effect_body_over_the_limit_is_413(mode: Mode) {
    let s = setup(mode);
    // Declared and sent whole (5000 > max_body_bytes 4096): the problem, nothing sent
    // downstream. hyper drains the unread body it already holds and keeps the connection.
    let mut w = Wire::open(s.proxy.addr);
    let mut req = b"POST /mail/send HTTP/1.1\r\nHost: t\r\nIdempotency-Key: k-413\r\nContent-Length: 5000\r\n\r\n".to_vec();
    req.extend(std::iter::repeat_n(b'a', 5000));
    let a = w.exchange(&req);
    assert_eq!(a.status, 413, "{a:?}");
    assert_eq!(a.problem_type(), "urn:idemproxy:problem:body-too-large");
    assert_eq!(a.header("connection"), None);
    w.assert_open();
    // Chunked, no length declared: found out while reading, same answer.
    let mut w = Wire::open(s.proxy.addr);
    let a = w.exchange(
        format!(
            "POST /mail/send HTTP/1.1\r\nHost: t\r\nIdempotency-Key: k-413c\r\nTransfer-Encoding: chunked\r\n\r\n1388\r\n{}\r\n0\r\n\r\n",
            "a".repeat(5000)
        )
        .as_bytes(),
    );
    assert_eq!(a.status, 413, "{a:?}");
    assert_eq!(a.problem_type(), "urn:idemproxy:problem:body-too-large");
    // Declared too large, the body sent in two parts: a body of up to 64 KiB is read
    // whole by the fast path before its request is served (src/wire/fast.rs), so the
    // answer comes once it has all arrived, and the connection stays open; hyper answers
    // from the Content-Length at once and closes (the one difference on purpose).
    let mut w = Wire::open(s.proxy.addr);
    w.send(b"POST /mail/send HTTP/1.1\r\nHost: t\r\nIdempotency-Key: k-413e\r\nContent-Length: 5000\r\n\r\naaaaaaaaaa");
    if mode == Mode::Fast {
        std::thread::sleep(Duration::from_millis(50));
        w.send(&[b'a'; 4990]);
        let a = w.answer();
        assert_eq!(a.status, 413, "{a:?}");
        w.assert_open();
    } else {
        let a = w.answer();
        assert_eq!(a.status, 413, "{a:?}");
        w.assert_closed();
    }
    // Declared longer than 64 KiB and not yet sent: hyper's, answered at once from the
    // Content-Length, and the connection closed, since the body never came to be drained.
    let mut w = Wire::open(s.proxy.addr);
    w.send(b"POST /mail/send HTTP/1.1\r\nHost: t\r\nIdempotency-Key: k-413f\r\nContent-Length: 100000\r\n\r\naaaaaaaaaa");
    let a = w.answer();
    assert_eq!(a.status, 413, "{a:?}");
    w.assert_closed();
    assert_eq!(s.ds.hits_on("/send"), 0, "nothing reached the downstream");
    assert_eq!(s.ds.commits(), 0);
}

// ---------------------------------------------------------------------------------------
// 15: a client that goes away mid-body

fn client_gone_mid_body_sends_nothing_downstream(mode: Mode) {
    let s = setup(mode);
    // The write side shut after 10 of 100 bytes: the body ends early, the request fails
    // before anything is sent downstream, the answer is a problem and the connection
    // closes. A keyed side effect reads the body itself: 400 bad-request.
    let mut w = Wire::open(s.proxy.addr);
    w.send(b"POST /mail/send HTTP/1.1\r\nHost: t\r\nIdempotency-Key: k-half\r\nContent-Length: 100\r\n\r\n{\"to\":\"a\"");
    w.shutdown_write();
    let a = w.answer();
    assert_eq!(a.status, 400, "{a:?}");
    assert_eq!(a.problem_type(), "urn:idemproxy:problem:bad-request");
    w.assert_closed();
    // Read-only and unprotected bodies this small are read whole by the upstream client
    // before it sends: that read fails, the client's fault, 400 bad-request on both
    // servers (502 upstream-unavailable before issue 33).
    for path in ["/ro/echo/half", "/mail/echo/half"] {
        let mut w = Wire::open(s.proxy.addr);
        w.send(
            format!("POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n0123456789")
                .as_bytes(),
        );
        w.shutdown_write();
        let a = w.answer();
        assert_eq!(a.status, 400, "{path}: {a:?}");
        assert_eq!(a.problem_type(), "urn:idemproxy:problem:bad-request");
        w.assert_closed();
    }
    // The same, the socket simply dropped.
    let mut w = Wire::open(s.proxy.addr);
    w.send(b"POST /mail/send HTTP/1.1\r\nHost: t\r\nIdempotency-Key: k-gone\r\nContent-Length: 100\r\n\r\n{\"to\":\"a\"");
    drop(w);
    let mut w = Wire::open(s.proxy.addr);
    w.send(b"POST /ro/echo/gone HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n0123456789");
    drop(w);
    // The proxy is still serving, on a new connection.
    let mut w = Wire::open(s.proxy.addr);
    let a = w.exchange(&get("/ro/echo/alive"));
    assert_eq!(echoed(&a).0, "/echo/alive");
    let a = w.exchange(b"POST /mail/send HTTP/1.1\r\nHost: t\r\nIdempotency-Key: k-after\r\nContent-Length: 10\r\n\r\n{\"to\":\"a\"}");
    assert_eq!(a.status, 201, "{a:?}");
    assert_eq!(s.ds.commits(), 1, "only the complete call committed");
    assert_eq!(s.ds.hits_on("/send"), 1);
    assert_eq!(s.ds.hits_on("/echo/half"), 0);
    // The dropped read-only request may still be in flight; whatever of it reached the
    // downstream, its body did not.
    if let Some(seen) = s.ds.last_request("/echo/gone") {
        assert!(seen.body.len() < 100, "{seen:?}");
    }
}

// ---------------------------------------------------------------------------------------
// 16: upgrades

fn upgrade_requests_are_served_as_plain_http1(mode: Mode) {
    let s = setup(mode);
    let mut w = Wire::open(s.proxy.addr);
    // A websocket upgrade to a read-only route: forwarded without the hop-by-hop
    // `Connection`/`Upgrade` headers, answered 200 (no 101), the connection kept as HTTP/1.
    let a = w.exchange(b"GET /ro/echo/ws HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n");
    assert_eq!(echoed(&a).0, "/echo/ws");
    assert_eq!(echoed_header(&a, "upgrade"), None);
    assert_eq!(echoed_header(&a, "connection"), None);
    assert_eq!(a.header("upgrade"), None);
    // An h2c upgrade is not taken up either: the answer is HTTP/1.1.
    let a = w.exchange(b"GET /ro/echo/h2c HTTP/1.1\r\nHost: t\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n");
    assert_eq!((a.minor, a.status), (1, 200), "{a:?}");
    assert_eq!(echoed_header(&a, "upgrade"), None);
    assert_eq!(
        echoed_header(&a, "http2-settings"),
        None,
        "named by Connection"
    );
    assert_eq!(s.ds.hits(), 2);
    w.assert_open();
}

// ---------------------------------------------------------------------------------------
// 17-19: Date, Host, idle connections

fn answers_carry_a_date(mode: Mode) {
    let s = setup(mode);
    let mut w = Wire::open(s.proxy.addr);
    let pass = w.exchange(&get("/ro/echo/date"));
    let problem = w.exchange(&get("/nothing/here"));
    assert_eq!(problem.status, 404);
    assert_eq!(problem.problem_type(), "urn:idemproxy:problem:no-route");
    for a in [&pass, &problem] {
        let date = a.header("date").unwrap_or_else(|| panic!("no date: {a:?}"));
        // IMF-fixdate: `Sun, 06 Nov 1994 08:49:37 GMT`.
        assert_eq!(date.len(), 29, "{date:?}");
        assert!(date.ends_with(" GMT"), "{date:?}");
        assert_eq!(a.header_all("date").len(), 1, "{a:?}");
    }
    w.assert_open();
}

fn host_must_be_one_valid_host(mode: Mode) {
    let s = setup(mode);
    let mut w = Wire::open(s.proxy.addr);
    // RFC 9112 section 3.2: an HTTP/1.1 request without a Host, with two, or with an
    // invalid one is answered 400 and not forwarded (hyper alone served all three; so did
    // the proxy before issue 33, with `x-forwarded-host` set from them). The connection
    // stays usable.
    for request in [
        &b"GET /ro/echo/nohost HTTP/1.1\r\n\r\n"[..],
        b"GET /ro/echo/twohosts HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        b"GET /ro/echo/twohosts HTTP/1.1\r\nHost: a\r\nHost: a\r\n\r\n",
        b"GET /ro/echo/badhost HTTP/1.1\r\nHost: a b/c@d\r\n\r\n",
        b"GET /ro/echo/badhost HTTP/1.1\r\nHost: user@h\r\n\r\n",
    ] {
        let a = w.exchange(request);
        assert_eq!(a.status, 400, "{}: {a:?}", String::from_utf8_lossy(request));
        assert_eq!(a.problem_type(), "urn:idemproxy:problem:bad-request");
    }
    assert_eq!(s.ds.hits(), 0, "nothing was forwarded");
    // HTTP/1.0 needs no Host; the downstream always gets its own.
    let a = w.exchange(b"GET /ro/echo/nohost HTTP/1.0\r\nConnection: keep-alive\r\n\r\n");
    assert_eq!(echoed(&a).0, "/echo/nohost");
    assert_eq!(echoed_header(&a, "x-forwarded-host"), None);
    assert_eq!(
        echoed_header(&a, "host"),
        Some(vec![s.ds.addr().to_string()])
    );
    w.assert_open();
}

fn idle_keep_alive_connection_is_still_served(mode: Mode) {
    let s = setup(mode);
    let mut w = Wire::open(s.proxy.addr);
    let a = w.exchange(&get("/ro/echo/before"));
    assert_eq!(echoed(&a).0, "/echo/before");
    std::thread::sleep(Duration::from_secs(2));
    let a = w.exchange(&get("/ro/echo/after-idle"));
    assert_eq!(echoed(&a).0, "/echo/after-idle");
    // Idle before the first request, too.
    let mut fresh = Wire::open(s.proxy.addr);
    std::thread::sleep(Duration::from_secs(2));
    let a = fresh.exchange(&get("/ro/echo/first-after-idle"));
    assert_eq!(echoed(&a).0, "/echo/first-after-idle");
    assert_eq!(s.ds.hits(), 3);
}

// ---------------------------------------------------------------------------------------
// The read-only lane (src/wire/raw.rs): a plain request to a read-only route is forwarded
// as bytes. What the downstream sees is what the map path sent (the unit test
// `proxy::downstream::tests::the_read_only_lane_forwards_what_the_map_path_forwards`
// compares the two); this checks it end to end.

fn read_only_lane_forwards_end_to_end_headers_only(mode: Mode) {
    let s = setup(mode);
    let mut w = Wire::open(s.proxy.addr);
    let a = w.exchange(
        b"POST /ro/echo/lane?q=1 HTTP/1.1\r\nHost: front:8080\r\nConnection: keep-alive, X-Hop\r\nX-Hop: secret\r\nKeep-Alive: timeout=5\r\nProxy-Authorization: Basic eA==\r\nIdempotency-Key: client-key\r\nX-Forwarded-For: 192.0.2.7\r\nX-Forwarded-Proto: https\r\nX-Custom: One\r\nx-custom: two\r\nContent-Length: 5\r\n\r\nhello",
    );
    assert_eq!(echoed(&a), ("/echo/lane".to_string(), "hello".to_string()));
    for gone in [
        "x-hop",
        "keep-alive",
        "proxy-authorization",
        "idempotency-key",
        "connection",
    ] {
        assert_eq!(
            echoed_header(&a, gone),
            None,
            "{gone} reached the downstream"
        );
    }
    let seen = |name| echoed_header(&a, name).unwrap_or_default();
    assert_eq!(seen("x-custom"), ["One", "two"]);
    assert_eq!(seen("x-forwarded-for"), ["192.0.2.7, 127.0.0.1"]);
    assert_eq!(seen("x-forwarded-proto"), ["http"]);
    assert_eq!(seen("x-forwarded-host"), ["front:8080"]);
    assert_eq!(seen("host"), [s.ds.addr().to_string()]);
    assert_eq!(seen("content-length"), ["5"]);
    assert_eq!(a.json()["query"], "q=1");
    // The answer is framed by the proxy, hop-by-hop fields of the downstream's dropped.
    assert_eq!(a.framing, Framing::Length(a.body.len()));
    assert_eq!(a.header("connection"), None);
    assert!(a.header("date").is_some());
    assert_eq!(s.ds.hits(), 1);
    w.assert_open();
}

// ---------------------------------------------------------------------------------------
// The differential: the same raw cases against both servers

/// What a client got on one connection, normalised for comparison: each answer's status,
/// its headers in wire order without `date` (and the fake's `x-request-id`), its framing and its body (a problem body as
/// its `type` and `status` only: its detail quotes the error of whichever reader failed),
/// then whether the connection was left open.
fn observed(addr: SocketAddr, request: &[u8], answers: usize, head: bool) -> String {
    let mut w = Wire::open(addr);
    w.send(request);
    let mut out = String::new();
    for _ in 0..answers {
        let a = w.read_answer(head);
        // `x-request-id` is the fake downstream's counter of requests.
        let headers: Vec<_> = a
            .headers
            .iter()
            .filter(|(n, _)| n != "date" && n != "x-request-id")
            .collect();
        let body = if a.header("content-type") == Some("application/problem+json") {
            let p = a.json();
            format!("problem {} {}", p["type"], p["status"])
        } else {
            String::from_utf8_lossy(&a.body).into_owned()
        };
        out.push_str(&format!(
            "HTTP/1.{} {} {:?} {:?}\n{body}\n",
            a.minor, a.status, headers, a.framing
        ));
    }
    assert!(
        w.buf.is_empty(),
        "bytes after the last answer: {:?}",
        String::from_utf8_lossy(&w.buf)
    );
    w.stream
        .set_read_timeout(Some(Duration::from_millis(300)))
        .expect("timeout");
    let mut rest = [0u8; 512];
    out.push_str(match w.stream.read(&mut rest) {
        Ok(0) => "closed",
        Err(e) if e.kind() == ErrorKind::ConnectionReset => "closed",
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => "open",
        Ok(n) => panic!(
            "unexpected bytes: {:?}",
            String::from_utf8_lossy(&rest[..n])
        ),
        Err(e) => panic!("read: {e}"),
    });
    out
}

/// Raw cases (request bytes, answers expected, whether they answer `HEAD`) sent to the
/// proxy with the fast path and to one without, both in front of the same downstream:
/// the client must get the same answers (the echo's body is what the downstream saw of
/// the request) and the downstream the same number of requests.
#[test]
fn answers_alike_in_both_modes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ds = FakeDownstream::start_in_thread(SocketAddr::from(([127, 0, 0, 1], 0)))
        .expect("fake downstream starts");
    let start = |mode: Mode| {
        let sub = dir.path().join(format!("{mode:?}"));
        std::fs::create_dir_all(&sub).expect("dir");
        ProxyProc::start_with_env(&sub, &wire_config(&sub, &ds.url()), mode.env())
    };
    let (fast, hyper) = (start(Mode::Fast), start(Mode::Hyper));
    let big = format!(
        "POST /ro/echo/big HTTP/1.1\r\nHost: t\r\nContent-Length: 70000\r\n\r\n{}",
        "b".repeat(70000)
    );
    let cases: Vec<(&[u8], usize, bool)> = vec![
        (b"GET /ro/echo/a?x=1 HTTP/1.1\r\nHost: t\r\nX-A: 1\r\nx-a: 2\r\n\r\n", 1, false),
        (b"POST /ro/echo/p HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello", 1, false),
        (b"GET /ro/echo/1 HTTP/1.1\r\nHost: t\r\n\r\nGET /ro/echo/2 HTTP/1.1\r\nHost: t\r\n\r\n", 2, false),
        (b"HEAD /ro/echo/h HTTP/1.1\r\nHost: t\r\n\r\n", 1, true),
        (b"GET /ro/echo/s?status=204 HTTP/1.1\r\nHost: t\r\n\r\n", 1, false),
        (b"GET /ro/echo/c HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n", 1, false),
        (b"GET /ro/echo/k HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", 1, false),
        (b"GET /ro/echo/ten HTTP/1.0\r\n\r\n", 1, false),
        (b"POST /ro/echo/ch HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 1, false),
        (b"POST /ro/echo/clte HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 1, false),
        (b"POST /ro/echo/cl2 HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc", 1, false),
        (b"POST /ro/echo/cl2 HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", 1, false),
        (b"POST /ro/echo/plus HTTP/1.1\r\nHost: t\r\nContent-Length: +3\r\n\r\nabc", 1, false),
        (b"POST /ro/echo/gz HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", 1, false),
        (b"POST /ro/echo/badchunk HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n", 1, false),
        (b"POST /ro/echo/x HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\nhello", 2, false),
        (b"GET /ro/echo/ws HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n", 1, false),
        (b"GET /ro/echo/nohost HTTP/1.1\r\n\r\n", 1, false),
        (b"GET /ro/echo/twohosts HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 1, false),
        (b"GET /ro/echo/badhost HTTP/1.1\r\nHost: a b/c@d\r\n\r\n", 1, false),
        (b"GET /ro/echo HTTP/1.1\r\nHost : t\r\n\r\n", 1, false),
        (b"GET http://example.com/ro/echo/abs HTTP/1.1\r\nHost: example.com\r\n\r\n", 1, false),
        (b"OPTIONS * HTTP/1.1\r\nHost: t\r\n\r\n", 1, false),
        (b"GET /ro/echo/1 HTTP/1.1\r\nHost: t\r\n\r\nGARBAGE\r\n\r\n", 2, false),
        // A second head that starts like the HTTP/2 preface: refused at once on both
        // (the fast path's hand-off waited for the rest of a preface, with no deadline,
        // before issue 33).
        (b"GET /ro/echo/1 HTTP/1.1\r\nHost: t\r\n\r\nPRI * HTTP/2.0\r\n\r\n", 2, false),
        (b"GET /ro/echo/1 HTTP/1.1\r\nHost: t\r\n\r\nPRI * HTTP/1.1\r\nHost: t\r\n\r\n", 2, false),
        (b"GET /ro/echo/hop HTTP/1.1\r\nHost: t\r\nConnection: X-Hop\r\nX-Hop: 1\r\nKeep-Alive: 5\r\nTE: trailers\r\n\r\n", 1, false),
        // A keyed side effect (the echo route, so the answer is what the downstream saw),
        // its replay, a keyed chunked one, and a keyed call to a route requiring a key.
        (b"POST /mail/echo/keyed HTTP/1.1\r\nHost: t\r\nIdempotency-Key: k-diff\r\nContent-Type: application/json\r\nContent-Length: 12\r\n\r\n{\"to\":\"a@x\"}", 1, false),
        (b"POST /mail/echo/keyed HTTP/1.1\r\nHost: t\r\nIdempotency-Key: k-diff\r\nContent-Type: application/json\r\nContent-Length: 12\r\n\r\n{\"to\":\"a@x\"}", 1, false),
        (b"POST /mail/echo/keyed HTTP/1.1\r\nHost: t\r\nIdempotency-Key: k-diff2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", 1, false),
        (b"POST /mail/send HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\n{}", 1, false),
        (big.as_bytes(), 1, false),
    ];
    for (request, answers, head) in cases {
        let what = String::from_utf8_lossy(&request[..request.len().min(120)]).into_owned();
        let before = ds.hits();
        let by_fast = observed(fast.addr, request, answers, head);
        let fast_hits = ds.hits() - before;
        let before = ds.hits();
        let by_hyper = observed(hyper.addr, request, answers, head);
        let hyper_hits = ds.hits() - before;
        assert_eq!(by_fast, by_hyper, "{what}");
        assert_eq!(fast_hits, hyper_hits, "downstream requests: {what}");
    }
    let mut oversized = b"GET /ro/echo HTTP/1.1\r\nHost: t\r\nx: ".to_vec();
    oversized.resize(9000, b'a');
    oversized.extend_from_slice(b"\r\n\r\n");
    assert_eq!(
        observed(fast.addr, &oversized, 1, false),
        observed(hyper.addr, &oversized, 1, false),
        "oversized head"
    );
}

in_both_modes!(
    keep_alive_serves_requests_one_after_another,
    pipelined_requests_in_one_write_are_answered_in_order,
    request_split_across_many_writes_is_served,
    connection_close_is_answered_announced_and_closed,
    http10_closes_unless_keep_alive_is_asked,
    head_answer_has_the_length_but_no_body,
    bodiless_statuses_leave_the_connection_usable,
    chunked_downstream_answer_is_forwarded_chunked,
    chunked_request_body_is_reassembled,
    content_length_with_transfer_encoding_uses_chunked_and_closes,
    conflicting_or_malformed_content_lengths_are_rejected,
    transfer_codings_other_than_a_final_chunked_are_rejected,
    transfer_codings_before_chunked_are_refused_not_dropped,
    malformed_chunked_body_fails_the_request_and_closes,
    expect_100_continue_is_answered_before_the_body,
    http2_preface_is_answered_with_settings,
    malformed_heads_get_a_bare_400_and_close,
    lenient_heads_hyper_accepts,
    absolute_form_target_is_routed_by_its_path,
    asterisk_and_authority_forms_get_the_no_route_problem,
    oversized_head_gets_431_and_close,
    large_body_is_streamed_to_a_read_only_route,
    keyed_side_effect_body_over_the_limit_is_413,
    client_gone_mid_body_sends_nothing_downstream,
    upgrade_requests_are_served_as_plain_http1,
    answers_carry_a_date,
    host_must_be_one_valid_host,
    idle_keep_alive_connection_is_still_served,
    read_only_lane_forwards_end_to_end_headers_only,
);
