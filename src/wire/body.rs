//! The proxy's body types: [`ProxyBody`] for everything it sends, [`RequestBody`] for the
//! requests it serves, and a body wrapper that reports when the last byte was handed to
//! the connection (for `result_delivered`).

use std::pin::Pin;
use std::task::{Context, Poll};

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
    Streamed(hyper::body::Incoming),
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

impl From<hyper::body::Incoming> for RequestBody {
    fn from(incoming: hyper::body::Incoming) -> Self {
        RequestBody::Streamed(incoming)
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
                    Some(Err(
                        "the client closed its connection before the end of the request body"
                            .into(),
                    ))
                }
            }),
            RequestBody::Streamed(incoming) => Pin::new(incoming)
                .poll_frame(cx)
                .map_err(|e| Box::new(e) as BoxError),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RequestBody::Read(data) => data.is_none(),
            RequestBody::Cut { failed, .. } => *failed,
            RequestBody::Streamed(incoming) => incoming.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RequestBody::Read(data) => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            // What the head declared, as hyper's body says.
            RequestBody::Cut { declared, .. } => SizeHint::with_exact(*declared),
            RequestBody::Streamed(incoming) => incoming.size_hint(),
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
