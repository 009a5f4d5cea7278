//! The listener's HTTP/1.1 fast path: plain requests served by a loop written out here,
//! everything else handed to hyper on the same connection.
//!
//! hyper's server was about a third of a replay's user time on the benchmark machine;
//! served here, a replay costs 16% fewer instructions, a pass-through POST 14% and a GET
//! 9% (docs/PERFORMANCE.md, "Listener fast path"). The requests an agent's tool loop sends are
//! nearly all simple on the wire, so those are served here, and the rest keep hyper's
//! full treatment:
//!
//! - A request is served here when its head parses (httparse, hyper's own parser, with
//!   hyper's limit of 100 headers) within `limits.max_header_bytes`, it is HTTP/1.1 in
//!   origin form (`/path?query`), its method is not `CONNECT`, it has no
//!   `Transfer-Encoding`, `Upgrade` or `Expect` header, and at most one `Content-Length`
//!   of plain digits up to [`MAX_BODY`]. Its body is read whole before the handler runs
//!   (as nginx's `proxy_request_buffering` does, and as the side-effect path needs anyway).
//! - At the first request that is not (and at an HTTP/2 preface, a malformed or oversized
//!   head, HTTP/1.0, two `Content-Length`s, a chunked body...), the connection is handed to
//!   hyper with every byte read so far put back in front of the socket ([`Rewound`]). hyper
//!   then parses that request itself and answers exactly as it would have from the start
//!   (400, 414, 431, `100 Continue`, streaming, upgrades, HTTP/2), and keeps the connection.
//!   So this loop never answers a request it did not take, malformed ones included.
//! - A request taken here goes to [`Handler::serve`] as its head's bytes and field spans
//!   ([`RawRequest`]); the proxy forwards it as bytes when its route is read-only and its
//!   upstream `http://` (the read-only lane, [`super::raw`]) and otherwise makes an
//!   `http::Request` of it. The answer comes back as either, and is written the same way.
//! - One difference: a body of up to [`MAX_BODY`] is read whole first, so a `413` for one
//!   comes when it has arrived (hyper answers from the `Content-Length` at once, and then
//!   cannot keep the connection).
//! - Answers are framed as hyper frames them: `Content-Length` when the body's length is
//!   known, chunked otherwise, no body for `HEAD`, 204 and 304, an implicit
//!   `content-length: 0`, a cached `date` header, `connection: close` when the connection
//!   ends after the answer. A head and a small body go out in one `write`.
//! - As in hyper: keep-alive, pipelined requests answered in order, `timeouts.client_header`
//!   (30 s) to receive a complete head (idle keep-alive connections are closed after
//!   that), `timeouts.client_body` (60 s) between two pieces of a body (then `408` and
//!   the connection closed), a client that closes its connection while its request is
//!   served cancels the request (side effects run in tasks of their own and finish
//!   anyway), a response body that fails ends the connection without completing the
//!   message.
//! - Shutdown: an idle connection is closed; a request in flight is finished and answered
//!   with `connection: close`; a connection hyper serves is shut down gracefully by hyper.
//!
//! `IDEMPROXY_FAST_PATH=0` hands every connection to hyper from its first byte.

use std::convert::Infallible;
use std::future::Future;
use std::io::{self, Write as _};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{Buf, Bytes, BytesMut};
use futures_util::future::Either;
use futures_util::FutureExt;
use http::header::{self, HeaderMap, HeaderName};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body::Body;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};

use super::body::{ProxyBody, RequestBody};
use super::headers::{has_token, tokens, ClientAddr};
use super::problem::{Kind, Problem};
use super::raw::{Field, Fields, RawAnswer, RawOutcome, RawRequest};

/// The largest request body read whole here; a longer one goes to hyper, which streams it.
pub const MAX_BODY: usize = 64 * 1024;
/// The most request headers, as hyper's default.
const MAX_HEADERS: usize = 100;
/// The HTTP/2 connection preface, which hyper-util's version detection reads first.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// The read buffer's size, as hyper's first read buffer.
const READ_SPACE: usize = 8 * 1024;
/// Response data at least this long is written from its own buffer, not copied.
const COPY_LIMIT: usize = 16 * 1024;
/// Buffered response bytes are written out once they reach this.
const FLUSH_AT: usize = 64 * 1024;

/// What serves a worker's requests.
pub trait Handler: Clone + Send + Sync + 'static {
    type Answer: Future<Output = Response<ProxyBody>> + Send + 'static;
    type Raw: Future<Output = RawOutcome> + Send + 'static;

    /// Serve a request hyper read.
    fn call(&self, req: Request<RequestBody>, peer: ClientAddr) -> Self::Answer;

    /// Serve a request this loop read: by the read-only lane ([`super::raw`]) when its
    /// route allows, else as an `http::Request` ([`RawRequest::into_request`], with
    /// `spare` for its headers).
    fn serve(
        &self,
        req: RawRequest,
        spare: Option<HeaderMap>,
        peer: &ClientAddr,
    ) -> Either<Self::Raw, Self::Answer>;
}

/// What one connection needs from its worker.
pub struct Shared<H> {
    pub handler: H,
    pub hyper: auto::Builder<TokioExecutor>,
    /// hyper's HTTP/1 server alone, configured as `hyper`'s: for a connection handed over
    /// after requests served here.
    pub hyper_h1: hyper::server::conn::http1::Builder,
    pub max_head: usize,
    /// Serve plain requests here; `false` hands every connection to hyper at once.
    pub fast: bool,
    /// Called for every connection handed to hyper (a metric).
    pub on_hand_off: HandOffHook,
    /// How long a complete request head may take (`timeouts.client_header`), counted from
    /// its first byte or from when the connection went idle.
    pub head_timeout: Duration,
    /// How long a request body may go without a byte (`timeouts.client_body`).
    pub body_timeout: Duration,
}

/// What [`Shared::on_hand_off`] is.
pub type HandOffHook = Arc<dyn Fn() + Send + Sync>;

/// Serve one connection until it ends. `_alive` is dropped when it does (the worker
/// counts connections by it to drain them); `shutdown` turning true starts the drain.
pub async fn serve<H>(
    stream: TcpStream,
    peer: ClientAddr,
    shared: Arc<Shared<H>>,
    mut shutdown: watch::Receiver<bool>,
    _alive: mpsc::Sender<()>,
) where
    H: Handler,
{
    let mut conn = Conn {
        stream,
        buf: BytesMut::new(),
        out: Vec::new(),
        spare: None,
        draining: false,
        served: false,
    };
    if shared.fast {
        match conn.serve_plain(&peer, &shared, &mut shutdown).await {
            End::Close => return,
            End::HandOff => {}
        }
    }
    // A connection that served a request here is HTTP/1.1: hyper takes it up as such. One
    // that did not may be HTTP/2, which hyper-util detects from the first 24 bytes; it
    // waits for them without a deadline, so they are read here, within the head's.
    let h1 = conn.served;
    if !h1 {
        let first = first_bytes(&mut conn.stream, &mut conn.buf, shared.head_timeout);
        let came = tokio::select! {
            came = first => came,
            // Shutdown closes a connection that has not sent a request yet.
            _ = super::server::stopped(&mut shutdown) => false,
        };
        if !came {
            return;
        }
    }
    let Conn { stream, buf, .. } = conn;
    (shared.on_hand_off)();
    hand_off(stream, buf.freeze(), peer, &shared, shutdown, h1).await;
}

/// Serve the rest of the connection with hyper, `prefix` (bytes already read) first.
async fn hand_off<H>(
    stream: TcpStream,
    prefix: Bytes,
    peer: ClientAddr,
    shared: &Shared<H>,
    mut shutdown: watch::Receiver<bool>,
    h1: bool,
) where
    H: Handler,
{
    let handler = shared.handler.clone();
    let body_timeout = shared.body_timeout;
    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
        let refused = unsupported_coding(req.headers()).or_else(|| bad_host(&req));
        let served = match refused {
            None => Ok(handler.call(
                req.map(|b| RequestBody::streamed(b, body_timeout)),
                peer.clone(),
            )),
            Some(refused) => Err(refused),
        };
        async move {
            Ok::<_, Infallible>(match served {
                Ok(answer) => answer.await,
                Err(refused) => refused,
            })
        }
    });
    let io = TokioIo::new(Rewound { prefix, stream });
    // Serve `conn` to its end, shut down gracefully when shutdown is asked for.
    macro_rules! drive {
        ($conn:expr) => {{
            let conn = $conn;
            tokio::pin!(conn);
            let ended = tokio::select! {
                ended = conn.as_mut() => ended.map_err(|e| e.to_string()),
                _ = super::server::stopped(&mut shutdown) => {
                    conn.as_mut().graceful_shutdown();
                    conn.await.map_err(|e| e.to_string())
                }
            };
            if let Err(e) = ended {
                tracing::debug!(error = %e, "connection ended with error");
            }
        }};
    }
    if h1 {
        // Not through hyper-util's `auto`: it reads for an HTTP/2 preface first even when
        // HTTP/2 is off, and a pipelined head that begins like one (`PRI * HTTP/2.0`) left
        // it waiting for the rest, where hyper answers 400 at once.
        drive!(shared.hyper_h1.serve_connection(io, svc).with_upgrades());
    } else {
        drive!(shared.hyper.serve_connection_with_upgrades(io, svc));
    }
}

/// `501 not-implemented` for a request whose `Transfer-Encoding` names a coding other than
/// `chunked` (RFC 9112 section 6.1). hyper takes the chunked framing off such a body and
/// hands over the still-coded bytes, and the proxy would pass them on as if they were the
/// body itself. (The fast path takes no request with a `Transfer-Encoding` at all.)
fn unsupported_coding(headers: &HeaderMap) -> Option<Response<ProxyBody>> {
    let coding = headers
        .get_all(header::TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| tokens(v.as_bytes()))
        .find(|c| !c.eq_ignore_ascii_case(b"chunked"))?;
    Some(
        Problem::new(
            Kind::NotImplemented,
            format!(
                "the request's transfer coding `{}` is not supported (only `chunked` is); nothing was forwarded",
                String::from_utf8_lossy(coding)
            ),
        )
        .into_response(),
    )
}

/// `400 bad-request` for an HTTP/1.1 request without exactly one valid `Host` (RFC 9112
/// section 3.2; HTTP/1.0 needs none, HTTP/2 has `:authority`). The fast path hands such
/// a request here, so both servers answer it the same.
fn bad_host<B>(req: &Request<B>) -> Option<Response<ProxyBody>> {
    if req.version() != http::Version::HTTP_11 {
        return None;
    }
    let why = super::headers::host_problem(
        req.headers()
            .get_all(header::HOST)
            .iter()
            .map(|v| v.as_bytes()),
    )?;
    Some(Problem::new(Kind::BadRequest, format!("{why}; nothing was forwarded")).into_response())
}

/// What the handler answered: an `http::Response`, or an upstream's answer as bytes.
enum Answer {
    Response(Response<ProxyBody>),
    Raw(RawAnswer),
}

impl Answer {
    fn from_raw(outcome: RawOutcome) -> Answer {
        match outcome {
            Ok(raw) => Answer::Raw(raw),
            Err(resp) => Answer::Response(resp),
        }
    }
}

/// How the plain loop ended.
enum End {
    /// The connection is closed (or to be dropped).
    Close,
    /// hyper serves the rest; the connection's unread bytes are in `buf`.
    HandOff,
}

struct Conn {
    stream: TcpStream,
    /// Bytes read and not yet used: the next request's head, body, and what follows.
    buf: BytesMut,
    /// The answer being written (kept between requests for its capacity).
    out: Vec<u8>,
    /// The last answer's header map, emptied, for the next request's headers (as hyper
    /// reuses it): no allocation, and room for the headers the proxy adds.
    spare: Option<HeaderMap>,
    /// Shutdown was asked for: the request being read or served is the last.
    draining: bool,
    /// A request was answered here: the connection is HTTP/1.1.
    served: bool,
}

/// A request head that the fast path takes, with its body's length.
struct Head {
    method: Method,
    uri: Uri,
    head: Bytes,
    fields: Fields,
    body_len: usize,
    /// The client asked to close the connection after this request.
    close: bool,
}

/// What [`parse`] made of the buffered bytes. Returned once per request and never stored,
/// so the head is not boxed.
#[allow(clippy::large_enum_variant)]
enum Parsed {
    /// A complete head this loop serves (its bytes are consumed).
    Ready(Head),
    /// Not a complete head yet.
    Partial,
    /// hyper's to serve (nothing was consumed).
    HandOff,
}

impl Conn {
    async fn serve_plain<H>(
        &mut self,
        peer: &ClientAddr,
        shared: &Shared<H>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> End
    where
        H: Handler,
    {
        // One timer and one shutdown watch for the connection's life, polled by every
        // wait: setting a timer and a watch up for each request cost about 1,000
        // instructions of a pass-through's 27,000 (docs/PERFORMANCE.md, "Listener fast path").
        let mut head_since = tokio::time::Instant::now();
        let head_timer = tokio::time::sleep_until(head_since + shared.head_timeout);
        tokio::pin!(head_timer);
        let stop = super::server::stopped(shutdown);
        tokio::pin!(stop);
        loop {
            // The head.
            let mut waited = false;
            let head = loop {
                match parse(&mut self.buf, shared.max_head) {
                    Parsed::Ready(head) => break head,
                    Parsed::HandOff => return End::HandOff,
                    Parsed::Partial => {}
                }
                if self.draining && self.buf.is_empty() {
                    return End::Close;
                }
                if !waited {
                    head_since = tokio::time::Instant::now();
                    waited = true;
                }
                self.reserve();
                tokio::select! {
                    biased;
                    read = self.stream.read_buf(&mut self.buf) => match read {
                        Ok(0) | Err(_) => return End::Close,
                        Ok(_) => {}
                    },
                    // The timer runs to the first deadline it was set for and is set again
                    // only then: to the current wait's deadline, or it ends the connection.
                    _ = head_timer.as_mut() => {
                        let deadline = head_since + shared.head_timeout;
                        if deadline <= tokio::time::Instant::now() {
                            tracing::debug!("no complete request head within timeouts.client_header; closing the connection");
                            return End::Close;
                        }
                        head_timer.as_mut().reset(deadline);
                    }
                    _ = &mut stop, if !self.draining => self.draining = true,
                }
            };
            // The body, read whole. If the client stops sending before its end, the request
            // is served with what came and an error after it, as hyper does: the handler
            // answers (400 or 502), and the connection ends.
            let mut close = head.close;
            let mut ended = false;
            while self.buf.len() < head.body_len {
                self.buf.reserve(head.body_len - self.buf.len());
                let read = self.stream.read_buf(&mut self.buf);
                match tokio::time::timeout(shared.body_timeout, read).await {
                    Ok(Ok(0) | Err(_)) => {
                        (close, ended) = (true, true);
                        break;
                    }
                    Ok(Ok(_)) => {}
                    Err(_) => {
                        // The client stopped sending its body: 408, and the connection
                        // ends (what it would send next is the rest of this body).
                        let timed_out = Problem::new(
                            Kind::RequestTimeout,
                            "the client sent no more of the request body within timeouts.client_body; nothing was forwarded",
                        )
                        .into_response();
                        let mut close = true;
                        let is_head = head.method == Method::HEAD;
                        if self
                            .respond(Answer::Response(timed_out), is_head, &mut close)
                            .await
                            .is_ok()
                        {
                            let _ = self.stream.shutdown().await;
                        }
                        return End::Close;
                    }
                }
            }
            let (body, cut) = if ended {
                (self.buf.split().freeze(), Some(head.body_len as u64))
            } else {
                (self.buf.split_to(head.body_len).freeze(), None)
            };
            let is_head = head.method == Method::HEAD;
            let req = RawRequest {
                method: head.method,
                uri: head.uri,
                head: head.head,
                fields: head.fields,
                body,
                cut,
            };
            // The answer. The client's connection is watched meanwhile: at its end the
            // request is dropped (bytes of pipelined requests are kept for later).
            let answer = match shared.handler.serve(req, self.spare.take(), peer) {
                Either::Left(raw) => {
                    Either::Left(raw.map(Answer::from_raw as fn(RawOutcome) -> Answer))
                }
                Either::Right(resp) => {
                    Either::Right(resp.map(Answer::Response as fn(Response<ProxyBody>) -> Answer))
                }
            };
            tokio::pin!(answer);
            let resp = loop {
                let watch = !ended && self.buf.len() < shared.max_head + MAX_BODY;
                self.reserve();
                tokio::select! {
                    biased;
                    resp = answer.as_mut() => break resp,
                    read = self.stream.read_buf(&mut self.buf), if watch => match read {
                        Ok(0) | Err(_) => return End::Close,
                        Ok(_) => {}
                    },
                    _ = &mut stop, if !self.draining => self.draining = true,
                }
            };
            close |= self.draining;
            match self.respond(resp, is_head, &mut close).await {
                Ok(()) if !close => {}
                Ok(()) => {
                    let _ = self.stream.shutdown().await;
                    return End::Close;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "could not write an answer; closing the connection");
                    return End::Close;
                }
            }
            self.served = true;
            if self.out.capacity() > FLUSH_AT {
                self.out = Vec::new();
            }
        }
    }

    /// Room for a read: hyper's buffer size at first, and at least a quarter of it free.
    fn reserve(&mut self) {
        if self.buf.capacity() - self.buf.len() < READ_SPACE / 4 {
            self.buf.reserve(READ_SPACE);
        }
    }

    /// Write `resp`, framed for a request with method `HEAD` when `is_head`. `close` says
    /// whether the connection ends after it; an answer's own `Connection: close` sets it.
    async fn respond(&mut self, answer: Answer, is_head: bool, close: &mut bool) -> io::Result<()> {
        self.out.clear();
        let (status, framing, mut body) = match answer {
            Answer::Response(resp) => {
                let (mut parts, body) = resp.into_parts();
                let fields = parts
                    .headers
                    .iter()
                    .map(|(n, v)| (special_name(n), n.as_str().as_bytes(), v.as_bytes()));
                let framing =
                    encode_head(&mut self.out, parts.status, fields, &body, is_head, close);
                let mut spare = std::mem::take(&mut parts.headers);
                spare.clear();
                self.spare = Some(spare);
                (parts.status, framing, body)
            }
            Answer::Raw(raw) => {
                let framing = encode_head(
                    &mut self.out,
                    raw.status,
                    raw.fields().map(|(n, v)| (special(n), n, v)),
                    &raw.body,
                    is_head,
                    close,
                );
                (raw.status, framing, raw.body)
            }
        };
        let framing = match framing {
            Some(framing) => framing,
            None => {
                // hyper's answer to a handler that returns a 1xx status.
                tracing::warn!(%status, "an answer with a 1xx status cannot be sent; answering 500");
                self.out.clear();
                self.out.extend_from_slice(
                    b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\nconnection: close\r\n",
                );
                date_line(&mut self.out);
                self.out.extend_from_slice(b"\r\n");
                *close = true;
                Framing::Empty
            }
        };
        let chunked = match framing {
            Framing::Empty => return self.stream.write_all(&self.out).await,
            Framing::Length(n) => {
                let mut left = n;
                while let Some(data) = self.next_data(&mut body).await? {
                    let Some(rest) = left.checked_sub(data.len() as u64) else {
                        return Err(io::Error::other(
                            "the answer's body is longer than its length",
                        ));
                    };
                    left = rest;
                    self.put(&data).await?;
                }
                if left > 0 {
                    return Err(io::Error::other(
                        "the answer's body ended before its length",
                    ));
                }
                false
            }
            Framing::Chunked => {
                while let Some(data) = self.next_data(&mut body).await? {
                    if data.is_empty() {
                        continue;
                    }
                    let _ = write!(self.out, "{:X}\r\n", data.len());
                    self.put(&data).await?;
                    self.out.extend_from_slice(b"\r\n");
                }
                true
            }
        };
        if chunked {
            // Trailers are not written: the proxy strips `Trailer` from every answer, and
            // hyper writes only the trailer fields an answer declares.
            self.out.extend_from_slice(b"0\r\n\r\n");
        }
        let written = self.stream.write_all(&self.out).await;
        self.out.clear();
        written
    }

    /// The body's next data, or `None` at its end. Trailers end it too. Before waiting for
    /// a body that has nothing ready, what is buffered is written out.
    async fn next_data(&mut self, body: &mut ProxyBody) -> io::Result<Option<Bytes>> {
        let frame = match body.frame().now_or_never() {
            Some(frame) => frame,
            None => {
                self.flush().await?;
                body.frame().await
            }
        };
        match frame {
            None => Ok(None),
            Some(Err(e)) => Err(io::Error::other(e)),
            Some(Ok(frame)) => Ok(frame.into_data().ok()),
        }
    }

    /// Add `data` to the answer: copied behind what is buffered when short, else written
    /// from its own buffer after it.
    async fn put(&mut self, data: &Bytes) -> io::Result<()> {
        if data.len() < COPY_LIMIT {
            self.out.extend_from_slice(data);
            if self.out.len() >= FLUSH_AT {
                self.flush().await?;
            }
            Ok(())
        } else {
            self.flush().await?;
            self.stream.write_all(data).await
        }
    }

    async fn flush(&mut self) -> io::Result<()> {
        if !self.out.is_empty() {
            self.stream.write_all(&self.out).await?;
            self.out.clear();
        }
        Ok(())
    }
}

/// Take a request head off the front of `buf` if this loop serves it (see the module doc).
fn parse(buf: &mut BytesMut, max_head: usize) -> Parsed {
    let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut slots);
    let len = match req.parse(buf) {
        Ok(httparse::Status::Complete(len)) if len <= max_head => len,
        Ok(httparse::Status::Partial) if buf.len() < max_head => return Parsed::Partial,
        _ => return Parsed::HandOff,
    };
    if req.version != Some(1) {
        return Parsed::HandOff;
    }
    let (Some(method), Some(path)) = (req.method, req.path) else {
        return Parsed::HandOff;
    };
    if !path.starts_with('/') {
        return Parsed::HandOff;
    }
    let Ok(method) = Method::from_bytes(method.as_bytes()) else {
        return Parsed::HandOff;
    };
    if method == Method::CONNECT {
        return Parsed::HandOff;
    }
    // Where each piece lies in `buf`, to take it from the frozen head without a copy.
    let base = buf.as_ptr() as usize;
    let at = |s: &[u8]| {
        let start = s.as_ptr() as usize - base;
        start..start + s.len()
    };
    let path_at = at(path.as_bytes());
    let mut body_len = None;
    let mut close = false;
    let mut host = None;
    let mut fields = Fields::new();
    for h in req.headers.iter() {
        let name = h.name.as_bytes();
        match name.len() {
            // A second `Host` is hyper's to refuse (see `bad_host`).
            4 if name.eq_ignore_ascii_case(b"host") && host.replace(h.value).is_some() => {
                return Parsed::HandOff
            }
            6 if name.eq_ignore_ascii_case(b"expect") => return Parsed::HandOff,
            7 if name.eq_ignore_ascii_case(b"upgrade") => return Parsed::HandOff,
            17 if name.eq_ignore_ascii_case(b"transfer-encoding") => return Parsed::HandOff,
            14 if name.eq_ignore_ascii_case(b"content-length") => {
                let Some(n) = digits(h.value).filter(|n| *n <= MAX_BODY) else {
                    return Parsed::HandOff;
                };
                if body_len.replace(n).is_some() {
                    return Parsed::HandOff;
                }
            }
            10 if name.eq_ignore_ascii_case(b"connection") => close |= has_token(h.value, b"close"),
            _ => {}
        }
        fields.push(Field::new(at(name), at(h.value)));
    }
    if !host.is_some_and(super::headers::valid_host) {
        return Parsed::HandOff;
    }
    let head = buf.split_to(len).freeze();
    let Ok(uri) = Uri::from_maybe_shared(head.slice(path_at)) else {
        put_back(buf, head);
        return Parsed::HandOff;
    };
    Parsed::Ready(Head {
        method,
        uri,
        head,
        fields,
        body_len: body_len.unwrap_or(0),
        close,
    })
}

/// Undo the head's split: `buf` holds every unused byte again, the head first.
fn put_back(buf: &mut BytesMut, head: Bytes) {
    let mut whole = BytesMut::with_capacity(head.len() + buf.len());
    whole.extend_from_slice(&head);
    whole.extend_from_slice(buf);
    *buf = whole;
}

/// A `Content-Length` value of plain digits (what hyper accepts from a single header,
/// less comma lists); `None` for anything else or a number past `usize`.
fn digits(v: &[u8]) -> Option<usize> {
    super::framing::digits(v).and_then(|n| usize::try_from(n).ok())
}

/// How an answer's body goes on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// No body bytes (none, `HEAD`, 204, 304).
    Empty,
    Length(u64),
    Chunked,
}

/// Write the answer's head into `out`, as hyper's HTTP/1.1 server would for this request,
/// and say how its body is framed. `None` for a 1xx status, which hyper refuses too.
fn encode_head<'f>(
    out: &mut Vec<u8>,
    status: StatusCode,
    fields: impl Iterator<Item = (Special, &'f [u8], &'f [u8])>,
    body: &ProxyBody,
    is_head: bool,
    close: &mut bool,
) -> Option<Framing> {
    if status.is_informational() {
        return None;
    }
    let no_length = status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED;
    let no_body = no_length || is_head;
    // `None`: no body at all; `Some(None)`: a body of unknown length.
    let length = if body.is_end_stream() {
        None
    } else {
        Some(body.size_hint().exact())
    };
    if status == StatusCode::OK {
        out.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
    } else {
        out.extend_from_slice(b"HTTP/1.1 ");
        out.extend_from_slice(status.as_str().as_bytes());
        out.push(b' ');
        out.extend_from_slice(status.canonical_reason().unwrap_or("<none>").as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    let mut framing = None;
    let mut wrote_date = false;
    let mut wrote_close = false;
    for (kind, name, value) in fields {
        match kind {
            Special::ContentLength => {
                if framing.is_some() {
                    continue;
                }
                match length {
                    Some(Some(n)) => {
                        length_line(out, n);
                        framing = Some(Framing::Length(n));
                    }
                    Some(None) => {
                        // A body that does not know its length, under a header that does.
                        if let Some(n) = digits(value) {
                            line(out, b"content-length", value);
                            framing = Some(Framing::Length(n as u64));
                        }
                    }
                    // No body: the header stands only in answer to `HEAD`.
                    None if is_head => {
                        line(out, b"content-length", value);
                        framing = Some(Framing::Empty);
                    }
                    None => {}
                }
                continue;
            }
            // Framing is this writer's; the proxy strips both from answers anyway.
            Special::Framing => continue,
            Special::Connection if has_token(value, b"close") => {
                *close = true;
                wrote_close = true;
            }
            Special::Date => wrote_date = true,
            _ => {}
        }
        line(out, name, value);
    }
    let framing = match (framing, length) {
        (Some(f), _) => f,
        (None, Some(None)) if no_body => Framing::Empty,
        (None, Some(None)) => {
            out.extend_from_slice(b"transfer-encoding: chunked\r\n");
            Framing::Chunked
        }
        (None, None | Some(Some(0))) => {
            if !no_body {
                out.extend_from_slice(b"content-length: 0\r\n");
            }
            Framing::Empty
        }
        (None, Some(Some(n))) => {
            if no_length {
                Framing::Empty
            } else {
                length_line(out, n);
                Framing::Length(n)
            }
        }
    };
    if *close && !wrote_close {
        out.extend_from_slice(b"connection: close\r\n");
    }
    if !wrote_date {
        date_line(out);
    }
    out.extend_from_slice(b"\r\n");
    Some(if no_body { Framing::Empty } else { framing })
}

/// The answer fields [`encode_head`] looks at.
enum Special {
    ContentLength,
    /// `Transfer-Encoding` and `Trailer`: framing is the writer's own.
    Framing,
    Connection,
    Date,
    Other,
}

/// What a field named `name` is to [`encode_head`]; by comparing names made once, for an
/// `http` answer (as bytes, the comparisons cost 130 instructions of a replay).
fn special_name(name: &HeaderName) -> Special {
    match *name {
        header::DATE => Special::Date,
        header::TRAILER | header::TRANSFER_ENCODING => Special::Framing,
        header::CONNECTION => Special::Connection,
        header::CONTENT_LENGTH => Special::ContentLength,
        _ => Special::Other,
    }
}

/// What a field named `name` (any case) is to [`encode_head`].
fn special(name: &[u8]) -> Special {
    match name.len() {
        4 if name.eq_ignore_ascii_case(b"date") => Special::Date,
        7 if name.eq_ignore_ascii_case(b"trailer") => Special::Framing,
        10 if name.eq_ignore_ascii_case(b"connection") => Special::Connection,
        14 if name.eq_ignore_ascii_case(b"content-length") => Special::ContentLength,
        17 if name.eq_ignore_ascii_case(b"transfer-encoding") => Special::Framing,
        _ => Special::Other,
    }
}

fn line(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

fn length_line(out: &mut Vec<u8>, n: u64) {
    line(
        out,
        b"content-length",
        itoa::Buffer::new().format(n).as_bytes(),
    );
}

/// `date: <IMF-fixdate>\r\n`, formatted once a second per thread (as hyper caches it).
fn date_line(out: &mut Vec<u8>) {
    thread_local! {
        static DATE: std::cell::RefCell<(u64, String)> = const { std::cell::RefCell::new((u64::MAX, String::new())) };
    }
    let now = SystemTime::now();
    let secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    DATE.with(|date| {
        let mut date = date.borrow_mut();
        if date.0 != secs {
            *date = (secs, httpdate::fmt_http_date(now));
        }
        line(out, b"date", date.1.as_bytes());
    });
}

/// Read a connection's first bytes into `buf` for hyper (which reads them again), within
/// `within`: enough for hyper-util's HTTP/2 detection to decide (the preface, or a byte
/// that is not it), which waits for them without a deadline of its own. `false`: the
/// connection ended, or sent too little in time, and is to be dropped.
pub(super) async fn first_bytes(
    stream: &mut TcpStream,
    buf: &mut BytesMut,
    within: Duration,
) -> bool {
    let read = async {
        while buf.len() < H2_PREFACE.len() && H2_PREFACE.starts_with(buf) {
            match stream.read_buf(buf).await {
                Ok(0) | Err(_) => return false,
                Ok(_) => {}
            }
        }
        true
    };
    match tokio::time::timeout(within, read).await {
        Ok(read) => read,
        Err(_) => {
            tracing::debug!("no request within timeouts.client_header; closing the connection");
            false
        }
    }
}

/// A socket with bytes already read from it put back in front, for hyper to read again.
pub(super) struct Rewound {
    prefix: Bytes,
    stream: TcpStream,
}

impl Rewound {
    pub(super) fn new(prefix: Bytes, stream: TcpStream) -> Rewound {
        Rewound { prefix, stream }
    }
}

impl AsyncRead for Rewound {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.prefix.is_empty() {
            return Pin::new(&mut this.stream).poll_read(cx, buf);
        }
        let n = this.prefix.len().min(buf.remaining());
        buf.put_slice(&this.prefix[..n]);
        this.prefix.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Rewound {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::body;

    fn parsed(bytes: &[u8]) -> (Parsed, BytesMut) {
        let mut buf = BytesMut::from(bytes);
        let p = parse(&mut buf, 8 * 1024);
        (p, buf)
    }

    fn hands_off(bytes: &[u8]) {
        let (p, buf) = parsed(bytes);
        assert!(
            matches!(p, Parsed::HandOff),
            "{:?}",
            String::from_utf8_lossy(bytes)
        );
        assert_eq!(&buf[..], bytes, "a hand-off consumes nothing");
    }

    #[test]
    fn takes_plain_requests_and_leaves_what_follows() {
        let (p, buf) = parsed(
            b"POST /a/b?c=d HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nX-Two: 1\r\nx-two: 2\r\n\r\nhelloGET /",
        );
        let Parsed::Ready(head) = p else {
            panic!("not taken")
        };
        assert_eq!(head.method, Method::POST);
        assert_eq!(head.uri, "/a/b?c=d");
        assert_eq!(head.body_len, 5);
        assert!(!head.close);
        let fields: Vec<_> = crate::wire::raw::pairs(&head.head, &head.fields).collect();
        assert_eq!(
            fields,
            [
                (&b"Host"[..], &b"x"[..]),
                (b"Content-Length", b"5"),
                (b"X-Two", b"1"),
                (b"x-two", b"2")
            ]
        );
        assert_eq!(&buf[..], b"helloGET /");
    }

    #[test]
    fn waits_for_a_whole_head() {
        assert!(matches!(
            parsed(b"GET / HTTP/1.1\r\nHost:").0,
            Parsed::Partial
        ));
        assert!(matches!(parsed(b"").0, Parsed::Partial));
        // A partial head as long as the limit is hyper's to refuse (431).
        let mut long = b"GET / HTTP/1.1\r\nx: ".to_vec();
        long.resize(8 * 1024, b'a');
        hands_off(&long);
    }

    #[test]
    fn notes_connection_close() {
        let (p, _) = parsed(b"GET / HTTP/1.1\r\nHost: h\r\nConnection: keep-alive, Close\r\n\r\n");
        let Parsed::Ready(head) = p else {
            panic!("not taken")
        };
        assert!(head.close);
    }

    #[test]
    fn hands_everything_else_to_hyper() {
        for bytes in [
            &b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"[..],
            b"GET / HTTP/1.0\r\n\r\n",
            b"GET http://example.com/ HTTP/1.1\r\n\r\n",
            b"OPTIONS * HTTP/1.1\r\n\r\n",
            b"CONNECT example.com:443 HTTP/1.1\r\n\r\n",
            b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc",
            b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
            b"POST / HTTP/1.1\r\nContent-Length: +3\r\n\r\nabc",
            b"POST / HTTP/1.1\r\nContent-Length: 3, 3\r\n\r\nabc",
            b"POST / HTTP/1.1\r\nContent-Length: 65537\r\n\r\n",
            b"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n",
            b"GET / HTTP/1.1\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
            b"HELLO\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost : x\r\n\r\n",
            b"GET / HTTP/1.1\r\nx: a\0b\r\n\r\n",
            b"GET / HTTP/1.1\r\nx: a\r\n folded\r\n\r\n",
            // httparse takes `<` in a path, `Uri` does not: the head is put back.
            b"GET /a<b HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\n\r\n",
            // No `Host`, two, or an invalid one: hyper's to refuse (400).
            b"GET / HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: a\r\nhost: a\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: a b/c@d\r\n\r\n",
        ] {
            hands_off(bytes);
        }
        let mut many = b"GET / HTTP/1.1\r\n".to_vec();
        for i in 0..=MAX_HEADERS {
            many.extend_from_slice(format!("x-{i}: y\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        hands_off(&many);
    }

    fn head_of(resp: Response<ProxyBody>, is_head: bool, close: bool) -> (String, Framing, bool) {
        let (parts, body) = resp.into_parts();
        let mut out = Vec::new();
        let mut close = close;
        let fields = parts
            .headers
            .iter()
            .map(|(n, v)| (special_name(n), n.as_str().as_bytes(), v.as_bytes()));
        let framing = encode_head(&mut out, parts.status, fields, &body, is_head, &mut close)
            .expect("encodes");
        // The same fields as bytes (an answer of the read-only lane) are written the same.
        let (mut as_bytes, mut close_as_bytes) = (Vec::new(), close);
        let fields = parts.headers.iter().map(|(n, v)| {
            let name = n.as_str().as_bytes();
            (special(name), name, v.as_bytes())
        });
        let framing_as_bytes = encode_head(
            &mut as_bytes,
            parts.status,
            fields,
            &body,
            is_head,
            &mut close_as_bytes,
        );
        assert_eq!(framing_as_bytes, Some(framing));
        assert_eq!(close_as_bytes, close);
        let without_date = |b: &[u8]| {
            let t = String::from_utf8_lossy(b).to_string();
            t.lines()
                .filter(|l| !l.starts_with("date: "))
                .collect::<Vec<_>>()
                .join("\n")
        };
        assert_eq!(without_date(&as_bytes), without_date(&out));
        let text = String::from_utf8(out).expect("ASCII");
        // The date varies; check it is there and drop it.
        let (before, after) = text.split_once("date: ").expect("a date header");
        let (_, rest) = after.split_once("\r\n").expect("ends");
        (format!("{before}{rest}"), framing, close)
    }

    fn with(status: u16, headers: &[(&str, &str)], body: ProxyBody) -> Response<ProxyBody> {
        let mut resp = Response::new(body);
        *resp.status_mut() = StatusCode::from_u16(status).expect("status");
        for (k, v) in headers {
            resp.headers_mut().append(
                http::HeaderName::from_bytes(k.as_bytes()).expect("name"),
                http::HeaderValue::from_str(v).expect("value"),
            );
        }
        resp
    }

    fn unknown_length() -> ProxyBody {
        let chunks = futures_util::stream::iter(vec![Ok::<_, body::BoxError>(
            http_body::Frame::data(Bytes::from_static(b"abc")),
        )]);
        http_body_util::StreamBody::new(chunks).boxed()
    }

    #[test]
    fn frames_answers_as_hyper_does() {
        let (h, f, _) = head_of(
            with(200, &[("x-a", "1")], body::full("hello")),
            false,
            false,
        );
        assert_eq!(h, "HTTP/1.1 200 OK\r\nx-a: 1\r\ncontent-length: 5\r\n\r\n");
        assert_eq!(f, Framing::Length(5));

        // A length header is written once, from the body's own length.
        let (h, f, _) = head_of(
            with(201, &[("content-length", "5")], body::full("hello")),
            false,
            false,
        );
        assert_eq!(h, "HTTP/1.1 201 Created\r\ncontent-length: 5\r\n\r\n");
        assert_eq!(f, Framing::Length(5));

        let (h, f, _) = head_of(with(200, &[], unknown_length()), false, false);
        assert_eq!(h, "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n");
        assert_eq!(f, Framing::Chunked);

        let (h, f, _) = head_of(with(404, &[], body::empty()), false, false);
        assert_eq!(h, "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n");
        assert_eq!(f, Framing::Empty);

        for status in [204, 304] {
            let (h, f, _) = head_of(with(status, &[], body::full("x")), false, false);
            assert!(!h.contains("content-length"), "{h}");
            assert_eq!(f, Framing::Empty);
        }

        // HEAD: the upstream's length stands, nothing follows.
        let (h, f, _) = head_of(
            with(200, &[("content-length", "42")], body::empty()),
            true,
            false,
        );
        assert_eq!(h, "HTTP/1.1 200 OK\r\ncontent-length: 42\r\n\r\n");
        assert_eq!(f, Framing::Empty);
        let (h, f, _) = head_of(with(200, &[], body::full("hello")), true, false);
        assert_eq!(h, "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n");
        assert_eq!(f, Framing::Empty);
        let (h, _, _) = head_of(with(200, &[], body::empty()), true, false);
        assert_eq!(h, "HTTP/1.1 200 OK\r\n\r\n");
    }

    #[test]
    fn says_when_the_connection_closes() {
        let (h, _, close) = head_of(with(200, &[], body::empty()), false, true);
        assert_eq!(
            h,
            "HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
        );
        assert!(close);
        let (h, _, close) = head_of(
            with(200, &[("connection", "close")], body::empty()),
            false,
            false,
        );
        assert_eq!(
            h,
            "HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
        );
        assert!(close);
    }

    #[test]
    fn refuses_1xx_answers() {
        let mut close = false;
        let fields = std::iter::empty();
        let early = StatusCode::EARLY_HINTS;
        assert!(encode_head(
            &mut Vec::new(),
            early,
            fields,
            &body::empty(),
            false,
            &mut close
        )
        .is_none());
    }

    #[test]
    fn reads_lengths() {
        assert_eq!(digits(b"0"), Some(0));
        assert_eq!(digits(b"0012"), Some(12));
        for bad in [
            &b""[..],
            b"+1",
            b"-1",
            b"1 ",
            b"0x10",
            b"1,1",
            b"99999999999999999999",
        ] {
            assert_eq!(digits(bad), None, "{bad:?}");
        }
    }

    #[tokio::test]
    async fn rewound_reads_the_prefix_first() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let client = tokio::spawn(async move {
            let mut s = TcpStream::connect(addr).await.expect("connect");
            s.write_all(b" world").await.expect("write");
        });
        let (stream, _) = listener.accept().await.expect("accept");
        client.await.expect("client");
        let mut io = Rewound {
            prefix: Bytes::from_static(b"hello"),
            stream,
        };
        let mut all = Vec::new();
        io.read_to_end(&mut all).await.expect("read");
        assert_eq!(all, b"hello world");
    }

    // -----------------------------------------------------------------------------------
    // Property: what the writer frames parses back strictly, its length the body's.

    /// The body of a generated answer: whole (known length), none, or a stream whose
    /// length is not known.
    #[derive(Debug, Clone, Copy)]
    enum Generated {
        Full(usize),
        Empty,
        Stream(usize),
    }

    fn generated(kind: Generated) -> ProxyBody {
        match kind {
            Generated::Full(n) => body::full(vec![b'x'; n]),
            Generated::Empty => body::empty(),
            Generated::Stream(n) => {
                let frames: Vec<Result<http_body::Frame<Bytes>, body::BoxError>> =
                    vec![Ok(http_body::Frame::data(Bytes::from(vec![b'y'; n])))];
                http_body_util::StreamBody::new(futures_util::stream::iter(frames)).boxed()
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256),
            ..Default::default()
        })]

        #[test]
        fn written_heads_parse_back_with_one_framing(
            status in proptest::sample::select(vec![200u16, 201, 204, 304, 404, 500]),
            is_head in proptest::bool::ANY,
            length in proptest::sample::select(vec![None, Some("3"), Some("0"), Some("+5"), Some("7, 7")]),
            coded in proptest::bool::ANY,
            kind in proptest::sample::select(vec![
                Generated::Full(0), Generated::Full(5), Generated::Full(300),
                Generated::Empty, Generated::Stream(5),
            ]),
        ) {
            let mut resp = Response::new(generated(kind));
            *resp.status_mut() = StatusCode::from_u16(status).expect("status");
            if let Some(v) = length {
                resp.headers_mut().insert(header::CONTENT_LENGTH, v.parse().expect("value"));
            }
            if coded {
                resp.headers_mut().insert(header::TRANSFER_ENCODING, "chunked".parse().expect("value"));
            }
            resp.headers_mut().insert("x-a", "1".parse().expect("value"));
            let (parts, body) = resp.into_parts();
            let mut out = Vec::new();
            let mut close = false;
            let fields = parts
                .headers
                .iter()
                .map(|(n, v)| (special_name(n), n.as_str().as_bytes(), v.as_bytes()));
            let framing = encode_head(&mut out, parts.status, fields, &body, is_head, &mut close)
                .expect("not 1xx");
            let mut slots = [httparse::EMPTY_HEADER; 16];
            let mut parsed = httparse::Response::new(&mut slots);
            let used = parsed.parse(&out).expect("parses");
            proptest::prop_assert_eq!(used, httparse::Status::Complete(out.len()));
            let values = |name: &str| -> Vec<String> {
                parsed
                    .headers
                    .iter()
                    .filter(|h| h.name.eq_ignore_ascii_case(name))
                    .map(|h| String::from_utf8_lossy(h.value).into_owned())
                    .collect()
            };
            let lengths = values("content-length");
            let codings = values("transfer-encoding");
            let text = String::from_utf8_lossy(&out).into_owned();
            proptest::prop_assert!(lengths.len() <= 1, "{}", text);
            proptest::prop_assert!(lengths.is_empty() || codings.is_empty(), "{}", text);
            proptest::prop_assert_eq!(values("x-a"), vec!["1".to_string()]);
            let bodiless = is_head || status == 204 || status == 304;
            let known = match kind {
                Generated::Full(n) => Some(n as u64),
                Generated::Empty => Some(0),
                Generated::Stream(_) => None,
            };
            match framing {
                Framing::Empty => proptest::prop_assert!(
                    bodiless || known == Some(0),
                    "{}", text
                ),
                Framing::Length(n) => {
                    proptest::prop_assert!(!bodiless, "{}", text);
                    proptest::prop_assert_eq!(lengths.clone(), vec![n.to_string()], "{}", text);
                    if let Some(k) = known {
                        proptest::prop_assert_eq!(n, k, "{}", text);
                    }
                }
                Framing::Chunked => {
                    proptest::prop_assert!(!bodiless, "{}", text);
                    proptest::prop_assert_eq!(codings.clone(), vec!["chunked".to_string()], "{}", text);
                }
            }
            // A body with a known length is never framed by a header's stale value.
            if let (Some(k), false) = (known, bodiless) {
                if k > 0 {
                    proptest::prop_assert_eq!(lengths, vec![k.to_string()], "{}", text);
                }
            }
        }
    }
}
