//! The proxy's body types: [`ProxyBody`] for everything it sends, [`RequestBody`] for the
//! requests it serves, and a body wrapper that reports when the last byte was handed to
//! the connection (for `result_delivered`).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{combinators::BoxBody, BodyExt, Empty, Full};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type ProxyBody = BoxBody<Bytes, BoxError>;

pub fn full(b: impl Into<Bytes>) -> ProxyBody {
    Full::new(b.into()).map_err(|never| match never {}).boxed()
}

pub fn empty() -> ProxyBody {
    Empty::<Bytes>::new()
        .map_err(|never| match never {})
        .boxed()
}

/// A request body as the listener hands it over: read whole by the HTTP/1.1 fast path
/// ([`super::fast`]), or streamed by hyper (every other request).
#[derive(Debug)]
pub enum RequestBody {
    /// The whole body, already read; `None` when it is empty.
    Read(Option<Bytes>),
    /// A body whose client ended its connection before the declared length: the bytes
    /// that came, then an error, as hyper's body reports a connection that ends early.
    Cut {
        data: Option<Bytes>,
        declared: u64,
        failed: bool,
    },
    /// hyper's streamed body.
    /// hyper's stream, with the longest wait for its next frame
    /// (`timeouts.client_body`): past it the body fails with [`TimedOut`].
    Streamed(hyper::body::Incoming, Stall),
}

impl RequestBody {
    /// A body read whole.
    pub fn read(data: Bytes) -> RequestBody {
        RequestBody::Read(Some(data).filter(|d| !d.is_empty()))
    }

    /// The `data` that came of a body declared `declared` bytes long.
    pub fn cut(data: Bytes, declared: u64) -> RequestBody {
        RequestBody::Cut {
            data: Some(data).filter(|d| !d.is_empty()),
            declared,
            failed: false,
        }
    }
}

impl RequestBody {
    /// hyper's stream of a request body, which fails with [`TimedOut`] when no frame
    /// comes for `stall`.
    pub fn streamed(incoming: hyper::body::Incoming, stall: Duration) -> RequestBody {
        RequestBody::Streamed(incoming, Stall::new(stall))
    }
}

/// A request body that the client framed wrongly (a malformed chunk, a connection that
/// ended inside it): the client's fault, answered 400, where an upstream's is 502.
#[derive(Debug)]
pub struct ClientBody(pub BoxError);

impl std::fmt::Display for ClientBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the request body could not be read: {}", self.0)
    }
}

impl std::error::Error for ClientBody {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

/// Whether `e`, or an error it wraps, is an `E`.
pub fn caused_by<E: std::error::Error + 'static>(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut e = Some(e);
    while let Some(err) = e {
        if err.is::<E>() {
            return true;
        }
        e = err.source();
    }
    false
}

/// A body (or anything read in pieces) that went too long without progress.
#[derive(Debug)]
pub struct TimedOut(pub &'static str);

impl std::fmt::Display for TimedOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for TimedOut {}

/// A deadline for progress: armed when a poll finds nothing ready, cleared by the next
/// frame. The timer is made the first time a wait happens (a body already buffered never
/// makes one) and reset after that.
#[derive(Debug)]
pub struct Stall {
    limit: Duration,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    armed: bool,
}

impl Stall {
    pub fn new(limit: Duration) -> Stall {
        Stall {
            limit,
            timer: None,
            armed: false,
        }
    }

    /// After an inner poll: `polled` went through unless it is pending past the deadline,
    /// which fails it with [`TimedOut`] (`what`).
    #[inline]
    pub fn check<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<Option<Result<T, BoxError>>>,
        what: &'static str,
    ) -> Poll<Option<Result<T, BoxError>>> {
        if polled.is_ready() {
            self.armed = false;
            return polled;
        }
        self.pending(cx, what)
    }

    /// The inner poll was pending: arm the deadline if it is not, and fail once it passes.
    /// Apart from [`Stall::check`] so the ready path, every frame of every body, stays a
    /// flag store (no timer, no clock read).
    #[cold]
    fn pending<T>(
        &mut self,
        cx: &mut Context<'_>,
        what: &'static str,
    ) -> Poll<Option<Result<T, BoxError>>> {
        if !self.armed {
            let deadline = tokio::time::Instant::now() + self.limit;
            match self.timer.as_mut() {
                Some(t) => t.as_mut().reset(deadline),
                None => self.timer = Some(Box::pin(tokio::time::sleep_until(deadline))),
            }
            self.armed = true;
        }
        let timer = self.timer.as_mut().expect("armed above");
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.armed = false;
                Poll::Ready(Some(Err(Box::new(TimedOut(what)))))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

/// A body whose next frame may not take longer than a [`Stall`] allows (an upstream
/// answer's body on a read-only route: `timeouts.upstream_body`).
pub struct StallBody<B> {
    inner: B,
    stall: Stall,
}

impl<B> StallBody<B> {
    pub fn new(inner: B, limit: Duration) -> StallBody<B> {
        StallBody {
            inner,
            stall: Stall::new(limit),
        }
    }
}

impl<B> Body for StallBody<B>
where
    B: Body<Data = Bytes, Error = BoxError> + Unpin,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        this.stall.check(
            cx,
            polled,
            "the upstream sent no more of the answer's body within timeouts.upstream_body",
        )
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            RequestBody::Read(data) => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            RequestBody::Cut { data, failed, .. } => Poll::Ready(match data.take() {
                Some(d) => Some(Ok(Frame::data(d))),
                None if *failed => None,
                None => {
                    *failed = true;
                    Some(Err(Box::new(ClientBody(
                        "the client closed its connection before the end of the request body"
                            .into(),
                    ))))
                }
            }),
            RequestBody::Streamed(incoming, stall) => {
                let polled = Pin::new(incoming)
                    .poll_frame(cx)
                    .map_err(|e| Box::new(ClientBody(Box::new(e))) as BoxError);
                stall.check(
                    cx,
                    polled,
                    "the client sent no more of the request body within timeouts.client_body",
                )
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RequestBody::Read(data) => data.is_none(),
            RequestBody::Cut { failed, .. } => *failed,
            RequestBody::Streamed(incoming, _) => incoming.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RequestBody::Read(data) => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            // What the head declared, as hyper's body says.
            RequestBody::Cut { declared, .. } => SizeHint::with_exact(*declared),
            RequestBody::Streamed(incoming, _) => incoming.size_hint(),
        }
    }
}

/// Why [`read_all`] gave up.
#[derive(Debug)]
pub enum ReadError<E> {
    /// The body's data went past the limit; what was read is dropped.
    TooLarge,
    Body(E),
}

impl ReadError<BoxError> {
    /// The body's own error, or one saying the limit was passed.
    pub fn into_boxed(self) -> BoxError {
        match self {
            ReadError::TooLarge => "the body is longer than the limit".into(),
            ReadError::Body(e) => e,
        }
    }
}

/// All of `body`'s data, at most `limit` bytes, as one `Bytes`; trailers are dropped.
/// A body of one chunk (hyper hands a small request body over as one) comes back as that
/// chunk: no copy and no queue, where `http_body_util`'s `collect` allocates a queue for
/// every body and copies whenever there is more than one chunk.
pub async fn read_all<B>(mut body: B, limit: usize) -> Result<Bytes, ReadError<B::Error>>
where
    B: Body<Data = Bytes> + Unpin,
{
    let mut first = Bytes::new();
    let mut joined: Option<BytesMut> = None;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.map_err(ReadError::Body)?.into_data() else {
            continue;
        };
        let len = joined.as_ref().map_or(first.len(), |b| b.len()) + data.len();
        if len > limit {
            return Err(ReadError::TooLarge);
        }
        if let Some(buf) = joined.as_mut() {
            buf.extend_from_slice(&data);
        } else if first.is_empty() {
            first = data;
        } else if !data.is_empty() {
            // Room for what the body says is still to come, within the limit.
            let rest = body.size_hint().lower() as usize;
            let mut buf = BytesMut::with_capacity(len.saturating_add(rest).min(limit));
            buf.extend_from_slice(&first);
            buf.extend_from_slice(&data);
            joined = Some(buf);
        }
    }
    Ok(joined.map_or(first, BytesMut::freeze))
}

/// A body that runs `on_end` once its last frame has been taken by hyper. If the client
/// goes away first the body is dropped unfinished and `on_end` never runs.
pub struct NotifyOnEnd<B> {
    inner: B,
    on_end: Option<Box<dyn FnOnce() + Send + Sync>>,
}

impl<B> NotifyOnEnd<B> {
    pub fn new(inner: B, on_end: impl FnOnce() + Send + Sync + 'static) -> Self {
        NotifyOnEnd {
            inner,
            on_end: Some(Box::new(on_end)),
        }
    }
}

impl<B: Body + Unpin> Body for NotifyOnEnd<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        let finished = matches!(polled, Poll::Ready(None))
            || (matches!(polled, Poll::Ready(Some(Ok(_)))) && self.inner.is_end_stream());
        if finished {
            if let Some(f) = self.on_end.take() {
                f();
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::stream;
    use http_body_util::StreamBody;

    fn chunks(
        parts: &[&'static str],
    ) -> StreamBody<impl futures_util::Stream<Item = Result<Frame<Bytes>, BoxError>> + Unpin> {
        let frames: Vec<Result<Frame<Bytes>, BoxError>> = parts
            .iter()
            .map(|p| Ok(Frame::data(Bytes::from_static(p.as_bytes()))))
            .chain(std::iter::once(Ok(Frame::trailers(http::HeaderMap::new()))))
            .collect();
        StreamBody::new(stream::iter(frames))
    }

    #[tokio::test]
    async fn read_all_joins_chunks_in_order_and_drops_trailers() {
        assert_eq!(read_all(chunks(&[]), 10).await.unwrap(), Bytes::new());
        assert_eq!(read_all(chunks(&["abc"]), 10).await.unwrap(), "abc");
        assert_eq!(
            read_all(chunks(&["ab", "", "cd", "e"]), 10).await.unwrap(),
            "abcde"
        );
    }

    #[tokio::test]
    async fn read_all_stops_past_the_limit() {
        assert!(read_all(chunks(&["abcde"]), 5).await.is_ok());
        assert!(matches!(
            read_all(chunks(&["abc", "def"]), 5).await,
            Err(ReadError::TooLarge)
        ));
        assert!(matches!(
            read_all(chunks(&["abcdef"]), 5).await,
            Err(ReadError::TooLarge)
        ));
    }

    #[tokio::test]
    async fn read_all_passes_body_errors_on() {
        let frames: Vec<Result<Frame<Bytes>, BoxError>> =
            vec![Ok(Frame::data(Bytes::from_static(b"a"))), Err("cut".into())];
        let body = StreamBody::new(stream::iter(frames));
        match read_all(body, 10).await {
            Err(ReadError::Body(e)) => assert_eq!(e.to_string(), "cut"),
            other => panic!("expected the body's error, got {other:?}"),
        }
    }
}
