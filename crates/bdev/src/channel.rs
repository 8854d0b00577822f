//! Per-reactor I/O channels and the generic I/O path: range and permission
//! checks, alignment bounce, split on max transfer size and optimal boundary,
//! write-zeroes emulation, and iostat.
//!
//! A channel belongs to one reactor (`!Send`). The futures here own the
//! caller's buffers by value and give them back with the result; once
//! submitted, the buffers live in the I/O's slot (see [`crate::io`]).

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll};

use ustor_runtime::{ticks, IoBuf};

use crate::child::{chunk, sub_iov};
use crate::device::BdevChannel;
use crate::error::BdevError;
use crate::io::{with_table, Bufs, IoHandle, State, MAX_SEGMENTS};
use crate::qos::{QosLocal, QosWait};
use crate::registry::BdevEntry;
use crate::stats::{ChannelStats, IoStat};
use crate::types::{IoFlags, IoType};

const NONE: u32 = u32::MAX;

/// A device's channel on this reactor, shared by every descriptor of the
/// device on this reactor.
pub(crate) struct ChannelCore {
    pub(crate) entry: Arc<BdevEntry>,
    pub(crate) driver: Box<dyn BdevChannel>,
    pub(crate) stats: ChannelStats,
    pub(crate) block_size: u32,
    pub(crate) align: u32,
    pub(crate) max_xfer: u64,
    pub(crate) boundary: u64,
    pub(crate) supported: [bool; IoType::ALL.len()],
    /// The driver honours [`IoFlags::FUA`] itself for this kind.
    fua_native: [bool; IoType::ALL.len()],
    /// The device has a volatile write cache that a flush empties: FUA
    /// without native support means a flush after the I/O.
    volatile: bool,
    /// The driver said EOPNOTSUPP to a native write-zeroes (e.g. a file
    /// system without ZERO_RANGE): emulate from now on.
    zeroes_unsupported: Cell<bool>,
    outstanding: Cell<u64>,
    last_done: Cell<u64>,
    last_latency: Cell<u64>,
    /// The bdev has QoS limits and this reactor holds a share of them
    /// (`qos`): the one test an I/O of an unlimited bdev pays.
    pub(crate) qos_on: Cell<bool>,
    pub(crate) qos: RefCell<Option<Rc<QosLocal>>>,
}

impl ChannelCore {
    pub(crate) fn new(entry: Arc<BdevEntry>, driver: Box<dyn BdevChannel>) -> ChannelCore {
        let b = entry.bdev.clone();
        let info = b.info();
        let mut supported = [false; IoType::ALL.len()];
        let mut fua_native = [false; IoType::ALL.len()];
        for t in IoType::ALL {
            supported[t.index()] = b.io_type_supported(t);
            fua_native[t.index()] = b.fua_supported(t);
        }
        ChannelCore {
            block_size: info.block_size,
            align: info.required_alignment.max(1),
            max_xfer: info.max_transfer_blocks as u64,
            boundary: info.optimal_boundary_blocks as u64,
            volatile: info.write_cache && supported[IoType::Flush.index()],
            supported,
            fua_native,
            entry,
            driver,
            stats: ChannelStats::new(),
            zeroes_unsupported: Cell::new(false),
            outstanding: Cell::new(0),
            last_done: Cell::new(0),
            last_latency: Cell::new(0),
            qos_on: Cell::new(false),
            qos: RefCell::new(None),
        }
    }

    pub(crate) fn snapshot(&self) -> IoStat {
        self.stats.snapshot()
    }
}

impl Drop for ChannelCore {
    fn drop(&mut self) {
        if let Some(q) = self.qos.get_mut().take() {
            q.stop();
        }
    }
}

/// A descriptor's view of a channel: the shared core plus the descriptor's
/// write permission. Cheap to clone (one non-atomic `Rc`).
#[derive(Clone)]
pub struct IoChannel {
    pub(crate) core: Rc<ChannelCore>,
    pub(crate) writable: bool,
}

impl IoChannel {
    pub fn block_size(&self) -> u32 {
        self.core.block_size
    }
    /// The size now (a resize shows at once).
    pub fn num_blocks(&self) -> u64 {
        self.core.entry.num_blocks()
    }
    pub fn supports(&self, t: IoType) -> bool {
        self.core.supported[t.index()] || t == IoType::WriteZeroes
    }
    pub fn name(&self) -> &str {
        &self.core.entry.bdev.info().name
    }
    /// I/Os of this channel submitted and not completed.
    pub fn outstanding(&self) -> u64 {
        self.core.outstanding.get()
    }

    /// Reads `num_blocks` at `offset_blocks` into `buf` (`buf.len()` must be
    /// `num_blocks * block_size`).
    pub fn read(
        &self,
        offset_blocks: u64,
        num_blocks: u64,
        buf: IoBuf,
    ) -> impl Future<Output = (Result<(), BdevError>, IoBuf)> + '_ {
        self.io(
            IoType::Read,
            offset_blocks,
            num_blocks,
            buf,
            0,
            IoFlags::NONE,
        )
    }

    pub fn write(
        &self,
        offset_blocks: u64,
        num_blocks: u64,
        buf: IoBuf,
    ) -> impl Future<Output = (Result<(), BdevError>, IoBuf)> + '_ {
        self.io(
            IoType::Write,
            offset_blocks,
            num_blocks,
            buf,
            0,
            IoFlags::NONE,
        )
    }

    /// [`IoChannel::write`] (`write`) or [`IoChannel::read`], stamped as
    /// submitted at tick `t0` (0: read the clock). For a caller that read
    /// the TSC an instant ago, such as a benchmark resubmitting from the
    /// completion it just timed (see [`IoChannel::last_completion`]): one
    /// TSC read per I/O instead of two. The latency then also covers the
    /// caller's work since `t0`.
    pub fn rw_stamped(
        &self,
        write: bool,
        t0: u64,
        offset_blocks: u64,
        num_blocks: u64,
        buf: IoBuf,
    ) -> impl Future<Output = (Result<(), BdevError>, IoBuf)> + '_ {
        let kind = if write { IoType::Write } else { IoType::Read };
        self.io(kind, offset_blocks, num_blocks, buf, t0, IoFlags::NONE)
    }

    /// Scatter-gather read into up to [`MAX_SEGMENTS`] buffers, in order.
    pub fn readv(
        &self,
        offset_blocks: u64,
        num_blocks: u64,
        bufs: Vec<IoBuf>,
    ) -> impl Future<Output = (Result<(), BdevError>, Vec<IoBuf>)> + '_ {
        self.io(
            IoType::Read,
            offset_blocks,
            num_blocks,
            bufs,
            0,
            IoFlags::NONE,
        )
    }

    pub fn writev(
        &self,
        offset_blocks: u64,
        num_blocks: u64,
        bufs: Vec<IoBuf>,
    ) -> impl Future<Output = (Result<(), BdevError>, Vec<IoBuf>)> + '_ {
        self.io(
            IoType::Write,
            offset_blocks,
            num_blocks,
            bufs,
            0,
            IoFlags::NONE,
        )
    }

    pub async fn flush(&self, offset_blocks: u64, num_blocks: u64) -> Result<(), BdevError> {
        self.io(
            IoType::Flush,
            offset_blocks,
            num_blocks,
            (),
            0,
            IoFlags::NONE,
        )
        .await
        .0
    }

    pub async fn unmap(&self, offset_blocks: u64, num_blocks: u64) -> Result<(), BdevError> {
        self.unmap_flagged(offset_blocks, num_blocks, IoFlags::NONE)
            .await
    }

    /// Zeroes a range; emulated with writes of a zero buffer when the driver
    /// has no native support.
    pub async fn write_zeroes(&self, offset_blocks: u64, num_blocks: u64) -> Result<(), BdevError> {
        self.write_zeroes_flagged(offset_blocks, num_blocks, IoFlags::NONE)
            .await
    }

    /// [`IoChannel::write`] with `flags`; with [`IoFlags::FUA`] the data is
    /// durable when this completes (see [`crate::Bdev::fua_supported`]).
    pub async fn write_flagged(
        &self,
        offset_blocks: u64,
        num_blocks: u64,
        buf: IoBuf,
        flags: IoFlags,
    ) -> (Result<(), BdevError>, IoBuf) {
        let (r, buf) = self
            .io(IoType::Write, offset_blocks, num_blocks, buf, 0, flags)
            .await;
        let r = self
            .fua_flush(IoType::Write, flags, r, offset_blocks, num_blocks)
            .await;
        (r, buf)
    }

    /// [`IoChannel::writev`] with `flags` (see [`IoChannel::write_flagged`]).
    pub async fn writev_flagged(
        &self,
        offset_blocks: u64,
        num_blocks: u64,
        bufs: Vec<IoBuf>,
        flags: IoFlags,
    ) -> (Result<(), BdevError>, Vec<IoBuf>) {
        let (r, bufs) = self
            .io(IoType::Write, offset_blocks, num_blocks, bufs, 0, flags)
            .await;
        let r = self
            .fua_flush(IoType::Write, flags, r, offset_blocks, num_blocks)
            .await;
        (r, bufs)
    }

    /// [`IoChannel::unmap`] with `flags` (FUA: the deallocation is durable).
    pub async fn unmap_flagged(
        &self,
        offset_blocks: u64,
        num_blocks: u64,
        flags: IoFlags,
    ) -> Result<(), BdevError> {
        let (r, ()) = self
            .io(IoType::Unmap, offset_blocks, num_blocks, (), 0, flags)
            .await;
        self.fua_flush(IoType::Unmap, flags, r, offset_blocks, num_blocks)
            .await
    }

    /// The one place FUA is emulated: after a successful I/O that asked for
    /// it, on a device with a volatile cache whose driver does not honour
    /// FUA for `kind`, flush the range. Costs a flag test when not asked.
    #[inline]
    async fn fua_flush(
        &self,
        kind: IoType,
        flags: IoFlags,
        r: Result<(), BdevError>,
        offset_blocks: u64,
        num_blocks: u64,
    ) -> Result<(), BdevError> {
        if !flags.fua() || r.is_err() || !self.core.volatile || self.core.fua_native[kind.index()] {
            return r;
        }
        self.flush(offset_blocks, num_blocks).await
    }

    /// [`IoChannel::write_zeroes`] with `flags` (see
    /// [`IoChannel::write_flagged`]).
    pub async fn write_zeroes_flagged(
        &self,
        offset_blocks: u64,
        num_blocks: u64,
        flags: IoFlags,
    ) -> Result<(), BdevError> {
        if self.core.supported[IoType::WriteZeroes.index()] && !self.core.zeroes_unsupported.get() {
            match self
                .io(IoType::WriteZeroes, offset_blocks, num_blocks, (), 0, flags)
                .await
                .0
            {
                Err(BdevError::NotSupported) => self.core.zeroes_unsupported.set(true),
                r => {
                    return self
                        .fua_flush(IoType::WriteZeroes, flags, r, offset_blocks, num_blocks)
                        .await
                }
            }
        }
        let r = self.write_zeroes_emulated(offset_blocks, num_blocks).await;
        // Written without FUA (one flush for the range, not one per chunk).
        if flags.fua() && r.is_ok() && self.core.volatile {
            return self.flush(offset_blocks, num_blocks).await;
        }
        r
    }

    async fn write_zeroes_emulated(
        &self,
        offset_blocks: u64,
        num_blocks: u64,
    ) -> Result<(), BdevError> {
        self.check(IoType::Write, offset_blocks, num_blocks)?;
        let bs = self.core.block_size as u64;
        let chunk_blocks = ((1u64 << 20) / bs).max(1);
        let mut zero = IoBuf::alloc((chunk_blocks.min(num_blocks) * bs) as usize).await;
        zero.fill(0);
        let mut done = 0;
        while done < num_blocks {
            let n = chunk_blocks.min(num_blocks - done);
            zero.set_len((n * bs) as usize);
            let (r, z) = self.write(offset_blocks + done, n, zero).await;
            zero = z;
            r?;
            done += n;
        }
        Ok(())
    }

    /// Waits for this channel's outstanding I/O, then resets the device queue.
    pub async fn reset(&self) -> Result<(), BdevError> {
        self.io(IoType::Reset, 0, 0, (), 0, IoFlags::NONE).await.0
    }

    fn check(&self, kind: IoType, offset_blocks: u64, num_blocks: u64) -> Result<(), BdevError> {
        let c = &self.core;
        if c.entry.is_removed() {
            return Err(BdevError::Removed);
        }
        if !self.writable && !matches!(kind, IoType::Read | IoType::Reset) {
            return Err(BdevError::ReadOnly);
        }
        if kind != IoType::Reset {
            // One relaxed load of the entry's size: a resize shows at once.
            let size_blocks = c.entry.num_blocks();
            let end = offset_blocks.checked_add(num_blocks);
            if end.is_none_or(|e| e > size_blocks) {
                return Err(BdevError::OutOfRange {
                    offset_blocks,
                    num_blocks,
                    size_blocks,
                });
            }
        }
        Ok(())
    }

    /// One I/O of any kind; generic over what it carries so that the
    /// public wrappers return this future itself (one async layer per I/O:
    /// each layer moves the buffer and result once more).
    async fn io<P: Payload>(
        &self,
        kind: IoType,
        offset_blocks: u64,
        num_blocks: u64,
        payload: P,
        t0: u64,
        flags: IoFlags,
    ) -> (Result<(), BdevError>, P) {
        let bufs = payload.into_bufs();
        if let Err(e) = self.check(kind, offset_blocks, num_blocks) {
            return (Err(e), P::from_bufs(bufs));
        }
        if !self.core.supported[kind.index()] {
            return (Err(BdevError::NotSupported), P::from_bufs(bufs));
        }
        if kind.has_data() {
            let want = num_blocks * self.core.block_size as u64;
            if bufs.total_len() != want {
                return (
                    Err(BdevError::BadLength {
                        got: bufs.total_len(),
                        want,
                    }),
                    P::from_bufs(bufs),
                );
            }
            if bufs.segments() > MAX_SEGMENTS {
                let n = bufs.segments();
                return (Err(BdevError::TooManySegments(n)), P::from_bufs(bufs));
            }
            if self.core.qos_on.get() {
                let bytes = num_blocks * self.core.block_size as u64;
                if let Err(e) = self.qos_wait(kind == IoType::Read, bytes).await {
                    return (Err(e), P::from_bufs(bufs));
                }
            }
            if !self.aligned(&bufs) {
                let (r, b) = self
                    .bounced(kind, offset_blocks, num_blocks, bufs, flags)
                    .await;
                return (r, P::from_bufs(b));
            }
        }
        let t0 = if t0 == 0 { ticks::now() } else { t0 };
        let (r, bufs) = Submit::new(&self.core, kind, offset_blocks, num_blocks, bufs, flags).await;
        let bytes = if kind == IoType::Reset {
            0
        } else {
            num_blocks * self.core.block_size as u64
        };
        self.done(kind, bytes, t0, r.is_ok());
        (r, P::from_bufs(bufs))
    }

    /// Waits for this reactor's QoS share to let a read or write of
    /// `bytes` pass (see [`crate::qos`]); a bdev deleted meanwhile fails it.
    async fn qos_wait(&self, read: bool, bytes: u64) -> Result<(), BdevError> {
        let q = self.core.qos.borrow().clone();
        if let Some(q) = q {
            QosWait::new(&q, read, bytes).await;
        }
        if self.core.entry.is_removed() {
            return Err(BdevError::Removed);
        }
        Ok(())
    }

    /// I/Os of this bdev waiting for QoS tokens on this reactor.
    pub fn qos_queued(&self) -> usize {
        self.core.qos_queued()
    }

    fn done(&self, kind: IoType, bytes: u64, t0: u64, ok: bool) {
        let t1 = ticks::now();
        self.core
            .stats
            .record(kind, bytes, t1 - t0, ok, self.core.entry.histograms_on());
        self.core.last_done.set(t1);
        self.core.last_latency.set(t1 - t0);
    }

    /// Tick count when this channel's latest I/O completed, and that I/O's
    /// latency in ticks: lets a caller such as `ustor bench` time its I/O
    /// without reading the clock again.
    pub fn last_completion(&self) -> (u64, u64) {
        (self.core.last_done.get(), self.core.last_latency.get())
    }

    fn aligned(&self, bufs: &Bufs) -> bool {
        let a = self.core.align as usize;
        let bs = self.core.block_size as usize;
        // Alignments are powers of two in practice: a mask, not a division
        // (a 64-bit `div` costs tens of cycles on every I/O).
        let on = |x: usize| {
            if a.is_power_of_two() {
                x & (a - 1) == 0
            } else {
                x.is_multiple_of(a)
            }
        };
        let ok = |b: &IoBuf| on(b.as_ptr() as usize) && on(b.len()) && b.len().is_multiple_of(bs);
        match bufs {
            Bufs::None => true,
            Bufs::One(b) => on(b.as_ptr() as usize),
            Bufs::Many(v) => v.iter().all(ok),
        }
    }

    /// Copies through one aligned buffer; the copy is counted in the stats.
    async fn bounced(
        &self,
        kind: IoType,
        off: u64,
        n: u64,
        mut bufs: Bufs,
        flags: IoFlags,
    ) -> (Result<(), BdevError>, Bufs) {
        let len = bufs.total_len() as usize;
        let mut bounce = IoBuf::alloc(len).await;
        if kind == IoType::Write {
            copy_between(&mut bufs, &mut bounce, true);
        }
        self.core
            .stats
            .bounce_ops
            .set(self.core.stats.bounce_ops.get() + 1);
        self.core
            .stats
            .bounce_bytes
            .set(self.core.stats.bounce_bytes.get() + len as u64);
        let t0 = ticks::now();
        let (r, b) = Submit::new(&self.core, kind, off, n, Bufs::One(bounce), flags).await;
        self.done(kind, len as u64, t0, r.is_ok());
        if r.is_ok() && kind == IoType::Read {
            let mut bounce = one(b);
            copy_between(&mut bufs, &mut bounce, false);
        }
        (r, bufs)
    }
}

fn copy_between(bufs: &mut Bufs, bounce: &mut IoBuf, into_bounce: bool) {
    let mut pos = 0;
    let mut step = |b: &mut IoBuf| {
        let n = b.len();
        if into_bounce {
            bounce[pos..pos + n].copy_from_slice(b);
        } else {
            b.copy_from_slice(&bounce[pos..pos + n]);
        }
        pos += n;
    };
    match bufs {
        Bufs::None => {}
        Bufs::One(b) => step(b),
        Bufs::Many(v) => v.iter_mut().for_each(step),
    }
}

fn one(b: Bufs) -> IoBuf {
    match b {
        Bufs::One(b) => b,
        _ => unreachable!("single-buffer I/O returns its buffer"),
    }
}

/// What an I/O carries (nothing, one buffer, several): held in the slot as
/// [`Bufs`] while in flight and handed back in the caller's own type.
trait Payload: Sized {
    fn into_bufs(self) -> Bufs;
    fn from_bufs(b: Bufs) -> Self;
}

impl Payload for () {
    fn into_bufs(self) -> Bufs {
        Bufs::None
    }
    fn from_bufs(_: Bufs) {}
}

impl Payload for IoBuf {
    #[inline]
    fn into_bufs(self) -> Bufs {
        Bufs::One(self)
    }
    #[inline]
    fn from_bufs(b: Bufs) -> IoBuf {
        one(b)
    }
}

impl Payload for Vec<IoBuf> {
    fn into_bufs(self) -> Bufs {
        Bufs::Many(self)
    }
    fn from_bufs(b: Bufs) -> Vec<IoBuf> {
        match b {
            Bufs::Many(v) => v,
            _ => unreachable!("vectored I/O returns its buffers"),
        }
    }
}

/// The future of one (possibly split) I/O: owns the slot, submits children
/// as table slots become free, completes when the last child does.
struct Submit<'a> {
    /// Borrowed from the channel the I/O runs on: no reference count per I/O.
    core: &'a ChannelCore,
    kind: IoType,
    flags: IoFlags,
    offset: u64,
    num: u64,
    bufs: Option<Bufs>,
    slot: u32,
    split: bool,
    next: u64,
}

impl<'a> Submit<'a> {
    fn new(
        core: &'a ChannelCore,
        kind: IoType,
        offset: u64,
        num: u64,
        bufs: Bufs,
        flags: IoFlags,
    ) -> Submit<'a> {
        Submit {
            core,
            kind,
            flags,
            offset,
            num,
            bufs: Some(bufs),
            slot: NONE,
            split: false,
            next: 0,
        }
    }

    /// Blocks in the chunk starting at `start` (relative), by max transfer and
    /// optimal boundary.
    #[inline]
    fn chunk(&self, start: u64) -> u64 {
        let c = self.core;
        chunk(
            c.max_xfer,
            c.boundary,
            self.offset + start,
            self.num - start,
        )
    }

    fn needs_split(&self) -> bool {
        self.kind.has_data() && self.num > 0 && self.chunk(0) < self.num
    }

    /// Takes a slot and fills it (one thread-local lookup); returns the
    /// slot's generation for the driver's handle.
    fn start(&mut self, cx: &mut Context<'_>) -> Poll<u32> {
        let (kind, flags, offset, num) = (self.kind, self.flags, self.offset, self.num);
        let removed = self.core.entry.removed_flag();
        let bufs = &mut self.bufs;
        let Some((idx, gen)) = with_table(|t| {
            let idx = t.alloc(cx.waker())?;
            let s = &t.slots[idx as usize];
            let mut bufs = bufs.take().unwrap_or(Bufs::None);
            s.kind.set(kind);
            s.flags.set(flags);
            s.offset_blocks.set(offset);
            s.num_blocks.set(num);
            // SAFETY: the slot is ours (just allocated); nobody else reads iov.
            let iov = unsafe { &mut *s.iov.get() };
            s.iovcnt.set(bufs.iovecs(iov) as u32);
            s.fixed.set(bufs.single_fixed());
            s.removed.set(removed);
            *s.bufs.borrow_mut() = bufs;
            // No waker yet: a driver that completes inline (null, malloc)
            // must not wake the task it runs in; `poll` stores the waker
            // only if the I/O is still in flight after submission.
            Some((idx, s.gen.get()))
        }) else {
            return Poll::Pending;
        };
        self.slot = idx;
        self.split = self.needs_split();
        if self.split {
            self.core
                .stats
                .split_ops
                .set(self.core.stats.split_ops.get() + 1);
        }
        Poll::Ready(gen)
    }

    /// Submits children while slots last; Ready when all are submitted.
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

impl Future for Submit<'_> {
    type Output = (Result<(), BdevError>, Bufs);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if self.slot == NONE {
            let Poll::Ready(gen) = self.start(cx) else {
                return Poll::Pending;
            };
            self.core.outstanding.set(self.core.outstanding.get() + 1);
            if !self.split {
                self.core
                    .driver
                    .submit(IoHandle::from_parts(self.slot, gen));
            }
        }
        if self.split && self.submit_children(cx).is_pending() {
            return Poll::Pending;
        }
        let idx = self.slot;
        let done = with_table(|t| {
            let s = &t.slots[idx as usize];
            let finished = if self.split {
                s.children.get() == 0
            } else {
                s.state.get() == State::Done
            };
            if !finished {
                *s.waker.borrow_mut() = Some(cx.waker().clone());
                return None;
            }
            let status = s.status.get();
            let bufs = std::mem::replace(&mut *s.bufs.borrow_mut(), Bufs::None);
            t.free(idx);
            Some((status, bufs))
        });
        match done {
            Some(out) => {
                self.slot = NONE;
                self.core.outstanding.set(self.core.outstanding.get() - 1);
                Poll::Ready(out)
            }
            None => Poll::Pending,
        }
    }
}

impl Drop for Submit<'_> {
    fn drop(&mut self) {
        if self.slot == NONE {
            return;
        }
        let idx = self.slot;
        with_table(|t| {
            let s = &t.slots[idx as usize];
            let busy = if self.split {
                s.children.get() > 0
            } else {
                s.state.get() == State::Active
            };
            self.core
                .outstanding
                .set(self.core.outstanding.get().saturating_sub(1));
            if busy {
                // The device still owns the buffers: the slot keeps them and
                // is freed by the last completion.
                s.state.set(State::Orphan);
                *s.waker.borrow_mut() = None;
            } else {
                t.free(idx);
            }
        });
    }
}
