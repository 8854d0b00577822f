//! The future of one submitted I/O ([`Submit`]) and what an I/O carries
//! ([`Payload`]: nothing, one buffer, several).
//!
//! The caller's buffers stay in the future while the I/O is in flight: the
//! slot holds only their iovecs. A future dropped before its I/O completes
//! moves the buffers into the slot (an orphan), which the last completion
//! frees, so a device never writes memory that was given back. Keeping the
//! buffers out of the slot on the normal path saves moving them in and out
//! of the table on every I/O.

use std::future::Future;
use std::ops::Deref;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use ustor_runtime::IoBuf;

use crate::channel::ChannelCore;
use crate::child::{chunk, sub_iov};
use crate::error::BdevError;
use crate::io::{with_table, Bufs, IoHandle, State, MAX_SEGMENTS};
use crate::types::{IoFlags, IoType};

const NONE: u32 = u32::MAX;

/// What an I/O carries, handed back to the caller in its own type.
pub(crate) trait Payload: Sized + Unpin {
    fn total_len(&self) -> u64;
    fn segments(&self) -> usize;
    /// Fills `out` with one iovec per buffer; returns how many.
    fn iovecs(&mut self, out: &mut [libc::iovec; MAX_SEGMENTS]) -> usize;
    /// Every segment lies in the reactor's registered pool.
    fn fixed(&self) -> bool;
    /// Every buffer starts on an address `on` accepts; buffers of a
    /// vectored I/O also hold whole blocks of `bs` and `on` their length.
    fn aligned(&self, on: impl Fn(usize) -> bool, bs: usize) -> bool;
    /// For a slot that keeps the buffers of an orphaned I/O.
    fn into_bufs(self) -> Bufs;
    fn each_mut(&mut self, f: impl FnMut(&mut IoBuf));
}

impl Payload for () {
    fn total_len(&self) -> u64 {
        0
    }
    fn segments(&self) -> usize {
        0
    }
    fn iovecs(&mut self, _: &mut [libc::iovec; MAX_SEGMENTS]) -> usize {
        0
    }
    fn fixed(&self) -> bool {
        false
    }
    fn aligned(&self, _: impl Fn(usize) -> bool, _: usize) -> bool {
        true
    }
    fn into_bufs(self) -> Bufs {
        Bufs::None
    }
    fn each_mut(&mut self, _: impl FnMut(&mut IoBuf)) {}
}

impl Payload for IoBuf {
    #[inline]
    fn total_len(&self) -> u64 {
        self.len() as u64
    }
    #[inline]
    fn segments(&self) -> usize {
        1
    }
    #[inline]
    fn iovecs(&mut self, out: &mut [libc::iovec; MAX_SEGMENTS]) -> usize {
        out[0] = libc::iovec {
            iov_base: self.as_mut_ptr().cast(),
            iov_len: self.len(),
        };
        1
    }
    #[inline]
    fn fixed(&self) -> bool {
        self.is_pooled()
    }
    #[inline]
    fn aligned(&self, on: impl Fn(usize) -> bool, _: usize) -> bool {
        on(self.as_ptr() as usize)
    }
    fn into_bufs(self) -> Bufs {
        Bufs::One(self)
    }
    fn each_mut(&mut self, mut f: impl FnMut(&mut IoBuf)) {
        f(self)
    }
}

impl Payload for Vec<IoBuf> {
    fn total_len(&self) -> u64 {
        self.iter().map(|b| b.len() as u64).sum()
    }
    fn segments(&self) -> usize {
        self.len()
    }
    fn iovecs(&mut self, out: &mut [libc::iovec; MAX_SEGMENTS]) -> usize {
        for (o, b) in out.iter_mut().zip(self.iter_mut()) {
            *o = libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: b.len(),
            };
        }
        self.len().min(MAX_SEGMENTS)
    }
    fn fixed(&self) -> bool {
        false
    }
    fn aligned(&self, on: impl Fn(usize) -> bool, bs: usize) -> bool {
        self.iter()
            .all(|b| on(b.as_ptr() as usize) && on(b.len()) && b.len().is_multiple_of(bs))
    }
    fn into_bufs(self) -> Bufs {
        Bufs::Many(self)
    }
    fn each_mut(&mut self, f: impl FnMut(&mut IoBuf)) {
        self.iter_mut().for_each(f)
    }
}

/// A compare-and-write's two buffers: the data to compare, then the data
/// to write (two segments, in that order).
impl Payload for (IoBuf, IoBuf) {
    fn total_len(&self) -> u64 {
        (self.0.len() + self.1.len()) as u64
    }
    fn segments(&self) -> usize {
        2
    }
    fn iovecs(&mut self, out: &mut [libc::iovec; MAX_SEGMENTS]) -> usize {
        for (o, b) in out.iter_mut().zip([&mut self.0, &mut self.1]) {
            *o = libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: b.len(),
            };
        }
        2
    }
    fn fixed(&self) -> bool {
        self.0.is_pooled() && self.1.is_pooled()
    }
    fn aligned(&self, on: impl Fn(usize) -> bool, bs: usize) -> bool {
        [&self.0, &self.1]
            .iter()
            .all(|b| on(b.as_ptr() as usize) && on(b.len()) && b.len().is_multiple_of(bs))
    }
    fn into_bufs(self) -> Bufs {
        Bufs::Many(vec![self.0, self.1])
    }
    fn each_mut(&mut self, mut f: impl FnMut(&mut IoBuf)) {
        f(&mut self.0);
        f(&mut self.1);
    }
}

/// Copies between the payload's buffers, in order, and one bounce buffer.
pub(crate) fn copy_between<P: Payload>(p: &mut P, bounce: &mut IoBuf, into_bounce: bool) {
    let mut pos = 0;
    p.each_mut(|b| {
        let n = b.len();
        if into_bounce {
            bounce[pos..pos + n].copy_from_slice(b);
        } else {
            b.copy_from_slice(&bounce[pos..pos + n]);
        }
        pos += n;
    });
}

/// What [`Submit::start_now`] gives.
pub(crate) enum Started<C: Deref<Target = ChannelCore>, P: Payload> {
    Done(Result<(), BdevError>, P),
    Waiting(Submit<C, P>),
}

/// The future of one (possibly split) I/O: owns the slot and the payload,
/// submits children as table slots become free, completes when the last
/// child does.
pub(crate) struct Submit<C: Deref<Target = ChannelCore>, P: Payload> {
    /// The channel the I/O runs on: borrowed (no reference count per
    /// I/O), or an `Rc` once an I/O that did not complete at once is
    /// handed to a caller that owns it ([`Submit::rebind`]).
    core: C,
    kind: IoType,
    flags: IoFlags,
    offset: u64,
    num: u64,
    payload: Option<P>,
    slot: u32,
    split: bool,
    next: u64,
}

impl<C: Deref<Target = ChannelCore>, P: Payload> Submit<C, P> {
    pub(crate) fn new(
        core: C,
        kind: IoType,
        offset: u64,
        num: u64,
        payload: P,
        flags: IoFlags,
    ) -> Submit<C, P> {
        Submit {
            core,
            kind,
            flags,
            offset,
            num,
            payload: Some(payload),
            slot: NONE,
            split: false,
            next: 0,
        }
    }

    /// Blocks in the chunk starting at `start` (relative), by max transfer and
    /// optimal boundary.
    #[inline]
    fn chunk(&self, start: u64) -> u64 {
        let c = &*self.core;
        chunk(
            c.max_xfer,
            c.boundary,
            self.offset + start,
            self.num - start,
        )
    }

    #[inline]
    fn needs_split(&self) -> bool {
        self.core.may_split && self.kind.has_data() && self.num > 0 && self.chunk(0) < self.num
    }

    /// Takes a slot and fills it (one thread-local lookup); returns the
    /// slot's generation for the driver's handle. Without a waker, a full
    /// table just says `None`; with one, the waker is queued for a slot.
    #[inline(always)]
    fn start(&mut self, waker: Option<&Waker>) -> Option<u32> {
        let (kind, flags, offset, num) = (self.kind, self.flags, self.offset, self.num);
        let removed = self.core.entry.removed_flag();
        let payload = &mut self.payload;
        let (idx, gen) = with_table(|t| {
            let idx = match waker {
                Some(w) => t.alloc(w)?,
                None => t.try_alloc()?,
            };
            let s = &t.slots[idx as usize];
            s.kind.set(kind);
            s.flags.set(flags);
            s.offset_blocks.set(offset);
            s.num_blocks.set(num);
            if let Some(p) = payload.as_mut() {
                // SAFETY: the slot is ours (just allocated); nobody else
                // reads its iovecs yet.
                let iov = unsafe { &mut *s.iov.get() };
                s.iovcnt.set(p.iovecs(iov) as u32);
                s.fixed.set(p.fixed());
            }
            s.removed.set(removed);
            // No waker yet: a driver that completes inline (null, malloc)
            // must not wake the task it runs in; `poll` stores the waker
            // only if the I/O is still in flight after submission.
            Some((idx, s.gen.get()))
        })?;
        self.slot = idx;
        self.split = self.needs_split();
        if self.split {
            let st = &self.core.stats;
            st.split_ops.set(st.split_ops.get() + 1);
        }
        Some(gen)
    }

    /// Takes a slot and, unless the I/O splits, hands it to the driver;
    /// false if no slot is free.
    #[inline(always)]
    fn launch(&mut self, waker: Option<&Waker>) -> bool {
        let Some(gen) = self.start(waker) else {
            return false;
        };
        self.core.outstanding.set(self.core.outstanding.get() + 1);
        if !self.split {
            self.core
                .driver
                .submit(IoHandle::from_parts(self.slot, gen));
        }
        true
    }

    /// The result and the payload once the I/O (every child) is done;
    /// otherwise `None`, with `waker` stored to hear the completion.
    #[inline(always)]
    fn collect(&mut self, waker: Option<&Waker>) -> Option<(Result<(), BdevError>, P)> {
        let (idx, split) = (self.slot, self.split);
        let status = with_table(|t| {
            let s = &t.slots[idx as usize];
            let finished = if split {
                s.children.get() == 0
            } else {
                s.state.get() == State::Done
            };
            if !finished {
                if let Some(w) = waker {
                    s.waker.set(Some(w.clone()));
                }
                return None;
            }
            let status = s.status.get();
            t.free(idx);
            Some(status)
        })?;
        self.slot = NONE;
        self.core.outstanding.set(self.core.outstanding.get() - 1);
        match self.payload.take() {
            Some(p) => Some((status, p)),
            None => unreachable!("an I/O's payload is handed back once"),
        }
    }

    /// Submits at once and, if the driver completed inline (null, malloc),
    /// gives the result without ever becoming a future; otherwise the
    /// future to await (started, or waiting for a slot or to split).
    #[inline(always)]
    pub(crate) fn start_now(mut self) -> Started<C, P> {
        if !self.launch(None) || self.split {
            return Started::Waiting(self);
        }
        match self.collect(None) {
            Some((r, p)) => {
                // Nothing left to drop (no slot, no payload): skip the
                // destructor's call.
                std::mem::forget(self);
                Started::Done(r, p)
            }
            None => Started::Waiting(self),
        }
    }

    pub(crate) fn core(&self) -> &ChannelCore {
        &self.core
    }

    /// The same I/O, holding its channel as `core` (its slot and payload
    /// move over; this one is left empty, so its drop does nothing).
    pub(crate) fn rebind<D: Deref<Target = ChannelCore>>(mut self, core: D) -> Submit<D, P> {
        Submit {
            core,
            kind: self.kind,
            flags: self.flags,
            offset: self.offset,
            num: self.num,
            payload: self.payload.take(),
            slot: std::mem::replace(&mut self.slot, NONE),
            split: self.split,
            next: self.next,
        }
    }

    /// Submits children while slots last; Ready when all are submitted.
    /// Out of line: most I/O does not split.
    #[inline(never)]
    fn submit_children(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let bs = self.core.block_size as u64;
        while self.next < self.num {
            let n = self.chunk(self.next);
            let Some(child) = with_table(|t| t.alloc(cx.waker())) else {
                return Poll::Pending;
            };
            with_table(|t| {
                let p = &t.slots[self.slot as usize];
                let c = &t.slots[child as usize];
                c.kind.set(self.kind);
                c.flags.set(self.flags);
                c.offset_blocks.set(self.offset + self.next);
                c.num_blocks.set(n);
                c.parent.set(self.slot);
                c.removed.set(p.removed.get());
                // SAFETY: parent and child slots are distinct and owned by us.
                let (piov, ciov) = unsafe { (&*p.iov.get(), &mut *c.iov.get()) };
                let cnt = sub_iov(
                    &piov[..p.iovcnt.get() as usize],
                    self.next * bs,
                    n * bs,
                    ciov,
                );
                c.iovcnt.set(cnt as u32);
                c.fixed.set(p.fixed.get());
                p.children.set(p.children.get() + 1);
            });
            self.next += n;
            self.core.driver.submit(IoHandle::new(child));
        }
        Poll::Ready(())
    }
}

impl<C: Deref<Target = ChannelCore> + Unpin, P: Payload> Future for Submit<C, P> {
    type Output = (Result<(), BdevError>, P);

    #[inline]
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if self.slot == NONE && !self.launch(Some(cx.waker())) {
            return Poll::Pending;
        }
        if self.split && self.submit_children(cx).is_pending() {
            return Poll::Pending;
        }
        match self.collect(Some(cx.waker())) {
            Some(out) => Poll::Ready(out),
            None => Poll::Pending,
        }
    }
}

impl<C: Deref<Target = ChannelCore>, P: Payload> Drop for Submit<C, P> {
    #[inline(always)]
    fn drop(&mut self) {
        if self.slot == NONE {
            return;
        }
        let (idx, split) = (self.slot, self.split);
        let payload = self.payload.take();
        let core = &*self.core;
        with_table(|t| {
            let s = &t.slots[idx as usize];
            let busy = if split {
                s.children.get() > 0
            } else {
                s.state.get() == State::Active
            };
            core.outstanding
                .set(core.outstanding.get().saturating_sub(1));
            if busy {
                // The device still owns the buffers: the slot keeps them and
                // is freed by the last completion.
                s.state.set(State::Orphan);
                s.waker.set(None);
                if let Some(p) = payload {
                    s.bufs.set(p.into_bufs());
                }
            } else {
                t.free(idx);
            }
        });
    }
}
