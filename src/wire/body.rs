//! The one response/request body type the proxy uses, and a body wrapper that reports
//! when the last byte was handed to the connection (for `result_delivered`).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
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
