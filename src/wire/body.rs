//! The one response/request body type the proxy uses, and a body wrapper that reports
//! when the last byte was handed to the connection (for `result_delivered`).

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
