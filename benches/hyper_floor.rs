//! The least a hyper server can cost on this machine: a reference for benches/run.sh, not
//! part of the proxy. It runs the way idemproxy's listener does (one single-threaded tokio
//! runtime per worker thread, mimalloc, the release profile) and does nothing else:
//!
//!   hyper_floor static --port P
//!       answers every request with the replay row's answer (201, a small JSON body and
//!       the headers a replay carries), after reading the request body: what a replay
//!       from memory would cost if finding the answer were free.
//!   hyper_floor proxy --port P --upstream HOST:PORT --mount /api
//!       forwards every request to the upstream with the mount stripped and `Host` and
//!       `X-Forwarded-For` set, over one upstream connection per client connection (no
//!       pool, no routing, no header hygiene, no timeouts, no retries, no TLS): what a
//!       hyper pass-through costs with all of idemproxy's policy taken away.
//!   hyper_floor raw --port P --upstream HOST:PORT --mount /api
//!       the same, but the upstream side is a hand-written HTTP/1.1 client run inside the
//!       request's own future (one `write` of head and body, responses read with
//!       httparse, `Content-Length` bodies only, no chunked, no errors handled): what a
//!       pass-through would cost without hyper's client dispatch channel and connection
//!       task. A measurement, not a client.
//!   hyper_floor bare-static --port P
//!       the static answer without hyper's server: a hand-written HTTP/1.1 loop per
//!       connection (httparse for the head, `Content-Length` bodies only, one prepared
//!       answer written with one `write`, no `Date` per second, no timeouts, no errors
//!       answered): what the static row would cost if the server side were nothing but
//!       the socket calls. A measurement, not a server.
//!   hyper_floor bare-proxy --port P --upstream HOST:PORT --mount /api
//!       `raw`'s upstream side behind `bare-static`'s server side: no hyper at all. Each
//!       client connection gets its own upstream connection; request and answer heads are
//!       parsed with httparse and copied with the mount stripped and `Host` and
//!       `X-Forwarded-For` set; `Content-Length` bodies only. A measurement, not a proxy.
//!
//! `IDEMPROXY_WORKERS` sets the worker threads and `IDEMPROXY_PIN_WORKERS=0` leaves them
//! unpinned, as for idemproxy (default: one per CPU, each pinned to its own).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE, HOST};
use http::{Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use idemproxy::wire::server::{pin_current_thread, Options};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const ANSWER: &[u8] = br#"{"id":"msg_1","status":"queued"}"#;

#[derive(Clone)]
enum Mode {
    Static,
    /// Through hyper's client.
    Proxy(Forward),
    /// Through the hand-written client.
    Raw(Forward),
    /// The static answer, served without hyper.
    BareStatic,
    /// Forwarding without hyper on either side.
    BareProxy(Forward),
}

/// Where a proxy mode forwards to.
#[derive(Clone)]
struct Forward {
    upstream: SocketAddr,
    host: HeaderValue,
    mount: Arc<str>,
}

impl Forward {
    /// The request's path and query with the mount taken off.
    fn relative<'a>(&self, uri: &'a Uri) -> &'a str {
        let pq = uri.path_and_query().map_or("/", |p| p.as_str());
        pq.strip_prefix(&*self.mount).unwrap_or(pq)
    }

    /// A new upstream connection, with Nagle off as idemproxy's.
    async fn connect(&self) -> Option<tokio::net::TcpStream> {
        let up = tokio::net::TcpStream::connect(self.upstream).await.ok()?;
        let _ = up.set_nodelay(true);
        Some(up)
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let usage =
        "usage: hyper_floor static|bare-static --port P | proxy|raw|bare-proxy --port P --upstream HOST:PORT --mount /api";
    let port: u16 = arg("--port").and_then(|p| p.parse().ok()).expect(usage);
    let mode = match args.get(1).map(String::as_str) {
        Some("static") => Mode::Static,
        Some("bare-static") => Mode::BareStatic,
        Some(kind @ ("proxy" | "raw" | "bare-proxy")) => {
            let upstream = arg("--upstream").expect(usage);
            let forward = Forward {
                host: HeaderValue::from_str(&upstream).expect("upstream host"),
                upstream: upstream.parse().expect("upstream HOST:PORT"),
                mount: arg("--mount").unwrap_or_default().into(),
            };
            match kind {
                "raw" => Mode::Raw(forward),
                "bare-proxy" => Mode::BareProxy(forward),
                _ => Mode::Proxy(forward),
            }
        }
        _ => panic!("{usage}"),
    };
    // The proxy's own rule for its worker threads, pinning included.
    let options = Options::from_env(Duration::ZERO);
    let workers = options.workers;
    let cpus = options.cpu_plan();
    let listener = std::net::TcpListener::bind(("127.0.0.1", port)).expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    println!("hyper_floor listening on 127.0.0.1:{port}");
    let threads: Vec<_> = (0..workers)
        .map(|i| {
            let listener = listener.try_clone().expect("listener");
            let mode = mode.clone();
            let cpu = cpus.as_ref().and_then(|c| c.get(i).copied());
            std::thread::spawn(move || {
                pin_current_thread(i, cpu);
                worker(listener, mode)
            })
        })
        .collect();
    for t in threads {
        let _ = t.join();
    }
}

/// One thread, one single-threaded runtime, accepting from the shared listener.
fn worker(listener: std::net::TcpListener, mode: Mode) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            let mode = mode.clone();
            tokio::spawn(async move {
                match mode {
                    Mode::Static => {
                        let svc = hyper::service::service_fn(answer);
                        let _ = http1().serve_connection(TokioIo::new(stream), svc).await;
                    }
                    Mode::Proxy(forward) => proxy_connection(stream, forward).await,
                    Mode::Raw(forward) => raw_connection(stream, forward).await,
                    Mode::BareStatic => bare_static_connection(stream).await,
                    Mode::BareProxy(forward) => bare_proxy_connection(stream, forward).await,
                }
            });
        }
    });
}

fn http1() -> hyper::server::conn::http1::Builder {
    let mut b = hyper::server::conn::http1::Builder::new();
    b.timer(TokioTimer::new());
    b
}

async fn answer(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    // Read the body, as a replay must before it can know what it is answering.
    let _ = req.into_body().collect().await;
    let mut resp = Response::new(Full::new(Bytes::from_static(ANSWER)));
    *resp.status_mut() = StatusCode::CREATED;
    let h = resp.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    h.insert(
        "idempotency-execution-id",
        HeaderValue::from_static("ex_rWKbIzm8kUrHeVgxPbR8t4Tb"),
    );
    h.insert("idempotent-replayed", HeaderValue::from_static("true"));
    Ok(resp)
}

/// Serve one client connection over one upstream connection of its own.
async fn proxy_connection(stream: tokio::net::TcpStream, forward: Forward) {
    let Some(up) = forward.connect().await else {
        return;
    };
    let forward = Arc::new(forward);
    let Ok((sender, conn)) = hyper::client::conn::http1::handshake(TokioIo::new(up)).await else {
        return;
    };
    tokio::spawn(conn);
    // hyper serves a connection's requests one at a time, so this lock is never contended.
    let sender = Arc::new(tokio::sync::Mutex::new(sender));
    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
        let sender = sender.clone();
        let forward = forward.clone();
        async move {
            let (mut parts, body) = req.into_parts();
            parts.uri = Uri::try_from(forward.relative(&parts.uri))
                .unwrap_or_else(|_| Uri::from_static("/"));
            parts.headers.insert(HOST, forward.host.clone());
            parts
                .headers
                .insert("x-forwarded-for", HeaderValue::from_static("127.0.0.1"));
            let mut sender = sender.lock().await;
            let resp = match sender.send_request(Request::from_parts(parts, body)).await {
                Ok(resp) => resp.map(|b| b.boxed()),
                Err(_) => {
                    let mut r = Response::new(
                        Full::new(Bytes::new())
                            .map_err(|never: Infallible| match never {})
                            .boxed(),
                    );
                    *r.status_mut() = StatusCode::BAD_GATEWAY;
                    r
                }
            };
            Ok::<_, Infallible>(resp)
        }
    });
    let _ = http1().serve_connection(TokioIo::new(stream), svc).await;
}

/// One upstream connection and what has been read from it but not yet used.
struct RawUpstream {
    stream: tokio::net::TcpStream,
    buf: bytes::BytesMut,
}

/// Serve one client connection over one upstream connection driven by hand.
async fn raw_connection(stream: tokio::net::TcpStream, forward: Forward) {
    let Some(up) = forward.connect().await else {
        return;
    };
    let forward = Arc::new(forward);
    let up = Arc::new(tokio::sync::Mutex::new(RawUpstream {
        stream: up,
        buf: bytes::BytesMut::with_capacity(8192),
    }));
    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
        let up = up.clone();
        let forward = forward.clone();
        async move {
            let resp = match raw_exchange(&up, req, &forward).await {
                Some(resp) => resp,
                None => {
                    let mut r = Response::new(Full::new(Bytes::new()));
                    *r.status_mut() = StatusCode::BAD_GATEWAY;
                    r
                }
            };
            Ok::<_, Infallible>(resp)
        }
    });
    let _ = http1().serve_connection(TokioIo::new(stream), svc).await;
}

async fn raw_exchange(
    up: &tokio::sync::Mutex<RawUpstream>,
    req: Request<Incoming>,
    forward: &Forward,
) -> Option<Response<Full<Bytes>>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (parts, body) = req.into_parts();
    let body = body.collect().await.ok()?.to_bytes();
    let rel = forward.relative(&parts.uri);
    let mut out = Vec::with_capacity(256 + body.len());
    out.extend_from_slice(parts.method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(rel.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    out.extend_from_slice(forward.host.as_bytes());
    out.extend_from_slice(b"\r\nx-forwarded-for: 127.0.0.1\r\n");
    for (name, value) in &parts.headers {
        if name != HOST {
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(&body);
    let mut up = up.lock().await;
    let up = &mut *up;
    up.stream.write_all(&out).await.ok()?;
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut parsed = httparse::Response::new(&mut headers);
        if let httparse::Status::Complete(head_len) = parsed.parse(&up.buf).ok()? {
            let mut resp = Response::new(Full::new(Bytes::new()));
            *resp.status_mut() = StatusCode::from_u16(parsed.code?).ok()?;
            let mut length = 0usize;
            for h in parsed.headers.iter() {
                if h.name.eq_ignore_ascii_case("content-length") {
                    length = std::str::from_utf8(h.value).ok()?.parse().ok()?;
                }
                resp.headers_mut().append(
                    http::header::HeaderName::from_bytes(h.name.as_bytes()).ok()?,
                    HeaderValue::from_bytes(h.value).ok()?,
                );
            }
            while up.buf.len() < head_len + length {
                if up.stream.read_buf(&mut up.buf).await.ok()? == 0 {
                    return None;
                }
            }
            let mut message = up.buf.split_to(head_len + length).freeze();
            *resp.body_mut() = Full::new(message.split_off(head_len));
            return Some(resp);
        }
        if up.stream.read_buf(&mut up.buf).await.ok()? == 0 {
            return None;
        }
    }
}

/// The static row's answer as one prepared message: the same status, headers and body
/// hyper writes for [`answer`], with a fixed `Date`.
fn bare_answer() -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\n");
    out.extend_from_slice(b"idempotency-execution-id: ex_rWKbIzm8kUrHeVgxPbR8t4Tb\r\n");
    out.extend_from_slice(b"idempotent-replayed: true\r\n");
    out.extend_from_slice(format!("content-length: {}\r\n", ANSWER.len()).as_bytes());
    out.extend_from_slice(b"date: Mon, 07 Dec 2026 00:00:00 GMT\r\n\r\n");
    out.extend_from_slice(ANSWER);
    out
}

/// Serve one connection by hand: read each request whole, write the answer.
async fn bare_static_connection(mut stream: tokio::net::TcpStream) {
    use tokio::io::AsyncWriteExt;
    let answer = bare_answer();
    let mut buf = bytes::BytesMut::with_capacity(8192);
    while bare_message(&mut stream, &mut buf, bare_request_head)
        .await
        .is_some()
    {
        if stream.write_all(&answer).await.is_err() {
            return;
        }
    }
}

/// One HTTP/1.1 message head read from `stream` into `buf`: the head parsed by `parse`
/// (which returns the head's length and the body's `Content-Length`), then the whole
/// message (head and body) split off `buf`. `None` at end of stream or on a bad message.
async fn bare_message(
    stream: &mut tokio::net::TcpStream,
    buf: &mut bytes::BytesMut,
    parse: impl Fn(&[u8]) -> Option<Option<(usize, usize)>>,
) -> Option<(bytes::BytesMut, usize)> {
    use tokio::io::AsyncReadExt;
    loop {
        if let Some((head_len, length)) = parse(buf)? {
            while buf.len() < head_len + length {
                if stream.read_buf(buf).await.ok()? == 0 {
                    return None;
                }
            }
            return Some((buf.split_to(head_len + length), head_len));
        }
        if stream.read_buf(buf).await.ok()? == 0 {
            return None;
        }
    }
}

/// A request head at the start of `b`: `Some(Some((head length, body length)))`, or
/// `Some(None)` while it is not all there, `None` if it is malformed ([`bare_message`]).
fn bare_request_head(b: &[u8]) -> Option<Option<(usize, usize)>> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(b).ok()? {
        httparse::Status::Complete(n) => Some(Some((n, bare_length(req.headers)?))),
        httparse::Status::Partial => Some(None),
    }
}

/// [`bare_request_head`] for a response head.
fn bare_response_head(b: &[u8]) -> Option<Option<(usize, usize)>> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut resp = httparse::Response::new(&mut headers);
    match resp.parse(b).ok()? {
        httparse::Status::Complete(n) => Some(Some((n, bare_length(resp.headers)?))),
        httparse::Status::Partial => Some(None),
    }
}

/// The `Content-Length` among `headers` (0 without one); `None` if it is not a number.
fn bare_length(headers: &[httparse::Header<'_>]) -> Option<usize> {
    match headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("content-length"))
    {
        Some(h) => std::str::from_utf8(h.value).ok()?.parse().ok(),
        None => Some(0),
    }
}

/// Forward one client connection's requests over one upstream connection, by hand.
async fn bare_proxy_connection(mut client: tokio::net::TcpStream, forward: Forward) {
    use tokio::io::AsyncWriteExt;
    let Some(mut up) = forward.connect().await else {
        return;
    };
    let mut from_client = bytes::BytesMut::with_capacity(8192);
    let mut from_up = bytes::BytesMut::with_capacity(8192);
    let mut out = Vec::with_capacity(2048);
    loop {
        let Some((message, head_len)) =
            bare_message(&mut client, &mut from_client, bare_request_head).await
        else {
            return;
        };
        // Parse the head again where it now lives, to copy it with its target rewritten.
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut req = httparse::Request::new(&mut headers);
        if req.parse(&message).is_err() {
            return;
        }
        let path = req.path.unwrap_or("/");
        out.clear();
        out.extend_from_slice(req.method.unwrap_or("GET").as_bytes());
        out.push(b' ');
        out.extend_from_slice(
            path.strip_prefix(&*forward.mount)
                .unwrap_or(path)
                .as_bytes(),
        );
        out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
        out.extend_from_slice(forward.host.as_bytes());
        out.extend_from_slice(b"\r\nx-forwarded-for: 127.0.0.1\r\n");
        for h in req.headers.iter() {
            if !h.name.eq_ignore_ascii_case("host") {
                out.extend_from_slice(h.name.as_bytes());
                out.extend_from_slice(b": ");
                out.extend_from_slice(h.value);
                out.extend_from_slice(b"\r\n");
            }
        }
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(&message[head_len..]);
        if up.write_all(&out).await.is_err() {
            return;
        }
        let Some((answer, _)) = bare_message(&mut up, &mut from_up, bare_response_head).await
        else {
            return;
        };
        if client.write_all(&answer).await.is_err() {
            return;
        }
    }
}
