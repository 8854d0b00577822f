//! One timeout for any future on a reactor.

use std::future::Future;
use std::pin::pin;
use std::task::Poll;
use std::time::Duration;

/// Runs `f` for at most `d`; `None` when the time ran out first (the future
/// is dropped then, which is safe for ops that own their buffers).
pub async fn timeout<F: Future>(d: Duration, f: F) -> Option<F::Output> {
    let mut f = pin!(f);
    let mut s = pin!(ustor_runtime::sleep(d));
    std::future::poll_fn(|cx| {
        if let Poll::Ready(v) = f.as_mut().poll(cx) {
            return Poll::Ready(Some(v));
        }
        if s.as_mut().poll(cx).is_ready() {
            return Poll::Ready(None);
        }
        Poll::Pending
    })
    .await
}
