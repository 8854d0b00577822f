//! The future of a single-buffer read or write ([`BufIo`]): the path most
//! I/O takes (every target's reads and writes, `ustor bench`). Hand-written
//! rather than an `async fn` so that its poll inlines into the caller's
//! own future: an I/O that a driver completes inline (null, malloc) runs
//! from the caller's poll to the driver and back with no call of its own.
//! Whatever the fast path does not cover (a failed check, QoS, a bounce
//! buffer) goes to the generic `async` path.
//!
//! [`IoChannel::rw_now`] is the same fast path without a future: a target
//! that can finish a request on the spot when the driver answers at once
//! (vhost's queue task) calls it and builds a future only for the I/O
//! that has to wait ([`RwWait`]).

use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};

use ustor_runtime::IoBuf;

use crate::channel::{ChannelCore, IoChannel};
use crate::error::BdevError;
use crate::submit::{Started, Submit};
use crate::types::{IoFlags, IoType};

/// The generic path's future for one buffer (an `async fn`'s unnameable
/// type, hence a function pointer that makes it).
pub(crate) type MakeSlow<'a, F> = fn(&'a IoChannel, IoType, u64, u64, IoBuf, u64) -> F;

/// What the fast path makes of a read or write of one buffer.
pub(crate) enum Fast<'a> {
    /// The driver completed it at once (iostat recorded).
    Done(Result<(), BdevError>, IoBuf),
    /// Submitted, or waiting for a table slot: poll it, then record
    /// with the submission tick given.
    Waiting(Submit<&'a ChannelCore, IoBuf>, u64),
    /// Not for the fast path (a failed check, QoS, a bounce): the buffer
    /// back, for the generic path.
    Declined(IoBuf),
}

impl IoChannel {
    /// The fast path up to the driver's answer, stamped `t0` (0: the
    /// clock, read only once the checks pass).
    #[inline(always)]
    pub(crate) fn start_fast(
        &self,
        kind: IoType,
        offset: u64,
        num: u64,
        buf: IoBuf,
        t0: u64,
    ) -> Fast<'_> {
        if !self.fast_path_ok(kind, offset, num, &buf) {
            return Fast::Declined(buf);
        }
        let t0 = if t0 == 0 {
            ustor_runtime::ticks::now()
        } else {
            t0
        };
        let core: &ChannelCore = &self.core;
        match Submit::new(core, kind, offset, num, buf, IoFlags::NONE).start_now() {
            Started::Done(r, buf) => {
                core.done_rw(kind, num, t0, r.is_ok());
                Fast::Done(r, buf)
            }
            Started::Waiting(sub) => Fast::Waiting(sub, t0),
        }
    }

    /// A read (`write` false) or write of one buffer, started now: when
    /// the driver completes it at once (null, malloc), the result and the
    /// buffer, with no future built; else the I/O to await, or the
    /// buffer back when the fast path does not take it (use
    /// [`IoChannel::read`] / [`IoChannel::write`] then, which report why).
    /// `t0` stamps the submission (0: read the clock; see
    /// [`IoChannel::recent_tick`]).
    #[inline]
    pub fn rw_now(
        &self,
        write: bool,
        t0: u64,
        offset_blocks: u64,
        num_blocks: u64,
        buf: IoBuf,
    ) -> RwNow {
        let kind = if write { IoType::Write } else { IoType::Read };
        match self.start_fast(kind, offset_blocks, num_blocks, buf, t0) {
            Fast::Done(r, buf) => RwNow::Done(r, buf),
            Fast::Declined(buf) => RwNow::Declined(buf),
            Fast::Waiting(sub, t0) => RwNow::Waiting(RwWait {
                sub: sub.rebind(self.core.clone()),
                kind,
                num: num_blocks,
                t0,
            }),
        }
    }
}

/// What [`IoChannel::rw_now`] gives.
pub enum RwNow {
    /// Completed: the result and the buffer.
    Done(Result<(), BdevError>, IoBuf),
    /// In flight (or waiting for a table slot): await it.
    Waiting(RwWait),
    /// Not started (a failed check, QoS, an unaligned buffer): the buffer
    /// back.
    Declined(IoBuf),
}

/// A read or write of [`IoChannel::rw_now`] that did not complete at
/// once. It holds its channel, so it may outlive the borrow it was
/// started from; dropped before it completes, its buffer stays with the
/// I/O's slot until the device is done with it.
pub struct RwWait {
    sub: Submit<Rc<ChannelCore>, IoBuf>,
    kind: IoType,
    num: u64,
    t0: u64,
}

impl Future for RwWait {
    type Output = (Result<(), BdevError>, IoBuf);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Poll::Ready((r, buf)) = Pin::new(&mut self.sub).poll(cx) else {
            return Poll::Pending;
        };
        let (kind, num, t0) = (self.kind, self.num, self.t0);
        self.sub.core().done_rw(kind, num, t0, r.is_ok());
        Poll::Ready((r, buf))
    }
}

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
        wait: Option<Submit<&'a ChannelCore, IoBuf>>,
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
            ch.core.done_rw(*this.kind, *this.num, *this.t0, r.is_ok());
            return Poll::Ready((r, buf));
        }
        let Some(buf) = this.buf.take() else {
            panic!("a bdev I/O polled after it completed");
        };
        let (kind, offset, num) = (*this.kind, *this.offset, *this.num);
        match ch.start_fast(kind, offset, num, buf, *this.t0) {
            Fast::Done(r, buf) => Poll::Ready((r, buf)),
            Fast::Declined(buf) => {
                let f = (this.make_slow)(ch, kind, offset, num, buf, *this.t0);
                this.slow.set(Some(f));
                match this.slow.as_pin_mut() {
                    Some(slow) => slow.poll(cx),
                    None => unreachable!("just set"),
                }
            }
            Fast::Waiting(sub, t0) => {
                *this.t0 = t0;
                let sub = this.wait.insert(sub);
                let Poll::Ready((r, buf)) = Pin::new(sub).poll(cx) else {
                    return Poll::Pending;
                };
                *this.wait = None;
                ch.core.done_rw(kind, num, t0, r.is_ok());
                Poll::Ready((r, buf))
            }
        }
    }
}
