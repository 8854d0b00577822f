//! The future of a single-buffer read or write ([`BufIo`]): the path most
//! I/O takes (every target's reads and writes, `ustor bench`). Hand-written
//! rather than an `async fn` so that its poll inlines into the caller's
//! own future: an I/O that a driver completes inline (null, malloc) runs
//! from the caller's poll to the driver and back with no call of its own.
//! Whatever the fast path does not cover (a failed check, QoS, a bounce
//! buffer) goes to the generic `async` path.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use ustor_runtime::IoBuf;

use crate::channel::IoChannel;
use crate::error::BdevError;
use crate::submit::{Started, Submit};
use crate::types::{IoFlags, IoType};

/// The generic path's future for one buffer (an `async fn`'s unnameable
/// type, hence a function pointer that makes it).
pub(crate) type MakeSlow<'a, F> = fn(&'a IoChannel, IoType, u64, u64, IoBuf, u64) -> F;

pin_project_lite::pin_project! {
    /// A read or write of one buffer in flight (see the module docs).
    pub(crate) struct BufIo<'a, F> {
        ch: &'a IoChannel,
        kind: IoType,
        offset: u64,
        num: u64,
        // Submission tick (0: read the clock when submitting).
        t0: u64,
        buf: Option<IoBuf>,
        wait: Option<Submit<'a, IoBuf>>,
        #[pin]
        slow: Option<F>,
        make_slow: MakeSlow<'a, F>,
    }
}

impl<'a, F> BufIo<'a, F>
where
    F: Future<Output = (Result<(), BdevError>, IoBuf)>,
{
    pub(crate) fn new(
        ch: &'a IoChannel,
        kind: IoType,
        offset: u64,
        num: u64,
        buf: IoBuf,
        t0: u64,
        make_slow: MakeSlow<'a, F>,
    ) -> BufIo<'a, F> {
        BufIo {
            ch,
            kind,
            offset,
            num,
            t0,
            buf: Some(buf),
            wait: None,
            slow: None,
            make_slow,
        }
    }
}

impl<F> Future for BufIo<'_, F>
where
    F: Future<Output = (Result<(), BdevError>, IoBuf)>,
{
    type Output = (Result<(), BdevError>, IoBuf);

    #[inline(always)]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let ch: &IoChannel = this.ch;
        if let Some(slow) = this.slow.as_mut().as_pin_mut() {
            return slow.poll(cx);
        }
        if let Some(sub) = this.wait.as_mut() {
            let Poll::Ready((r, buf)) = Pin::new(sub).poll(cx) else {
                return Poll::Pending;
            };
            *this.wait = None;
            ch.done_rw(*this.kind, *this.num, *this.t0, r.is_ok());
            return Poll::Ready((r, buf));
        }
        let Some(buf) = this.buf.take() else {
            panic!("a bdev I/O polled after it completed");
        };
        let (kind, offset, num) = (*this.kind, *this.offset, *this.num);
        if !ch.fast_path_ok(kind, offset, num, &buf) {
            let f = (this.make_slow)(ch, kind, offset, num, buf, *this.t0);
            this.slow.set(Some(f));
            return match this.slow.as_pin_mut() {
                Some(slow) => slow.poll(cx),
                None => unreachable!("just set"),
            };
        }
        if *this.t0 == 0 {
            *this.t0 = ustor_runtime::ticks::now();
        }
        let sub = Submit::new(&ch.core, kind, offset, num, buf, IoFlags::NONE);
        match sub.start_now() {
            Started::Done(r, buf) => {
                ch.done_rw(kind, num, *this.t0, r.is_ok());
                Poll::Ready((r, buf))
            }
            Started::Waiting(sub) => {
                let sub = this.wait.insert(sub);
                let Poll::Ready((r, buf)) = Pin::new(sub).poll(cx) else {
                    return Poll::Pending;
                };
                *this.wait = None;
                ch.done_rw(kind, num, *this.t0, r.is_ok());
                Poll::Ready((r, buf))
            }
        }
    }
}
