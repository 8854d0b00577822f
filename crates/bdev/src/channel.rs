//! Per-reactor I/O channels and the generic I/O path: range and permission
//! checks, alignment bounce, split on max transfer size and optimal boundary,
//! write-zeroes emulation, and iostat.
//!
//! A channel belongs to one reactor (`!Send`). The futures here own the
//! caller's buffers by value and give them back with the result; a future
//! dropped while its I/O is in flight leaves them to the I/O's slot (see
//! `submit`).

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::rc::Rc;
use std::sync::Arc;

use ustor_runtime::{ticks, IoBuf};

use crate::child::chunk;
use crate::device::BdevChannel;
use crate::error::BdevError;
use crate::io::MAX_SEGMENTS;
use crate::qos::{QosLocal, QosWait};
use crate::registry::BdevEntry;
use crate::rw::BufIo;
use crate::stats::{ChannelStats, IoStat};
use crate::submit::{copy_between, Payload, Started, Submit};
use crate::types::{IoFlags, IoType};

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
    /// A max transfer or an optimal boundary is set: an I/O may split.
    pub(crate) may_split: bool,
    /// `align` is a power of two: a mask, not a division, tests it (a
    /// 64-bit `div` costs tens of cycles on every I/O).
    align_pow2: bool,
    pub(crate) supported: [bool; IoType::ALL.len()],
    /// [`crate::Bdev::max_compare_and_write_blocks`].
    pub(crate) max_caw: u64,
    /// [`BdevChannel::completes_in_submit`], asked once.
    in_submit: bool,
    /// The driver honours [`IoFlags::FUA`] itself for this kind.
    fua_native: [bool; IoType::ALL.len()],
    /// The device has a volatile write cache that a flush empties: FUA
    /// without native support means a flush after the I/O.
    volatile: bool,
    /// The driver said EOPNOTSUPP to a native write-zeroes (e.g. a file
    /// system without ZERO_RANGE): emulate from now on.
    zeroes_unsupported: Cell<bool>,
    pub(crate) outstanding: Cell<u64>,
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
            may_split: info.max_transfer_blocks > 0 || info.optimal_boundary_blocks > 0,
            align_pow2: info.required_alignment.max(1).is_power_of_two(),
            volatile: info.write_cache && supported[IoType::Flush.index()],
            max_caw: b.max_compare_and_write_blocks(),
            in_submit: driver.completes_in_submit(),
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

    /// Iostat and the latest completion's timestamps for an I/O of
    /// `bytes` submitted at tick `t0`.
    #[inline(always)]
    pub(crate) fn done(&self, kind: IoType, bytes: u64, t0: u64, ok: bool) {
        let t1 = ticks::now();
        // Saturating: a caller's `t0` (IoChannel::recent_tick) is a
        // reading of this thread's clock, never later than `t1`, but a
        // stamp from elsewhere must not wrap the sums.
        let lat = t1.saturating_sub(t0);
        self.stats
            .record(kind, bytes, lat, ok, self.entry.histograms_on());
        self.last_done.set(t1);
        self.last_latency.set(lat);
    }

    /// [`ChannelCore::done`] of a read or write of `num` blocks.
    #[inline(always)]
    pub(crate) fn done_rw(&self, kind: IoType, num: u64, t0: u64, ok: bool) {
        self.done(kind, num * self.block_size as u64, t0, ok)
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
    /// The driver completes every I/O inside its submit (null, malloc; see
    /// [`BdevChannel::completes_in_submit`]): an I/O started here has
    /// touched its buffer by the time it could be given up. One not yet
    /// started (waiting for a slot) is started only by polling it, and a
    /// split one launches its parts the same way, so a dropped I/O never
    /// touches its buffer afterwards.
    pub fn completes_in_submit(&self) -> bool {
        self.core.in_submit
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
        BufIo::new(
            self,
            IoType::Read,
            offset_blocks,
            num_blocks,
            buf,
            0,
            slow_one,
        )
    }

    pub fn write(
        &self,
        offset_blocks: u64,
        num_blocks: u64,
        buf: IoBuf,
    ) -> impl Future<Output = (Result<(), BdevError>, IoBuf)> + '_ {
        BufIo::new(
            self,
            IoType::Write,
            offset_blocks,
            num_blocks,
            buf,
            0,
            slow_one,
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
        BufIo::new(self, kind, offset_blocks, num_blocks, buf, t0, slow_one)
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

    /// Compares `num_blocks` at `offset_blocks` with `compare` and, only
    /// if every byte matches, writes `write` there, atomically against
    /// every other write to the range (each buffer `num_blocks *
    /// block_size` bytes). A difference fails it with
    /// [`BdevError::Miscompare`] (the first differing byte, where the
    /// device says) and writes nothing. Only bdevs that do it natively
    /// take it ([`IoChannel::supports`]); others say `NotSupported`. It is
    /// never split: a range past the device's max transfer or across its
    /// boundary fails with `Io(EINVAL)`, as does one larger than the
    /// device's own limit ([`IoChannel::max_compare_and_write_blocks`];
    /// librbd: one 512-byte sector).
    pub async fn compare_and_write(
        &self,
        offset_blocks: u64,
        num_blocks: u64,
        compare: IoBuf,
        write: IoBuf,
        flags: IoFlags,
    ) -> (Result<(), BdevError>, IoBuf, IoBuf) {
        let kind = IoType::CompareAndWrite;
        let (r, (compare, write)) = self
            .io(kind, offset_blocks, num_blocks, (compare, write), 0, flags)
            .await;
        let r = self
            .fua_flush(kind, flags, r, offset_blocks, num_blocks)
            .await;
        (r, compare, write)
    }

    /// Most blocks one compare-and-write may cover on this device (0:
    /// none, the device has no native compare-and-write).
    pub fn max_compare_and_write_blocks(&self) -> u64 {
        if self.core.supported[IoType::CompareAndWrite.index()] {
            self.core.max_caw
        } else {
            0
        }
    }

    /// Whether a compare-and-write of the range goes to the driver whole:
    /// within the device's limit and not split (max transfer, boundary).
    fn compare_and_write_fits(&self, offset_blocks: u64, num_blocks: u64) -> bool {
        let c = &self.core;
        num_blocks <= c.max_caw
            && (!c.may_split
                || chunk(c.max_xfer, c.boundary, offset_blocks, num_blocks) == num_blocks)
    }

    /// Waits for this channel's outstanding I/O, then resets the device queue.
    pub async fn reset(&self) -> Result<(), BdevError> {
        self.io(IoType::Reset, 0, 0, (), 0, IoFlags::NONE).await.0
    }

    #[inline]
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
        if let Err(e) = self.check(kind, offset_blocks, num_blocks) {
            return (Err(e), payload);
        }
        if !self.core.supported[kind.index()] {
            return (Err(BdevError::NotSupported), payload);
        }
        if kind.has_data() {
            let want = kind.payload_bytes(num_blocks, self.core.block_size as u64);
            let got = payload.total_len();
            if got != want {
                return (Err(BdevError::BadLength { got, want }), payload);
            }
            if kind == IoType::CompareAndWrite
                && !self.compare_and_write_fits(offset_blocks, num_blocks)
            {
                return (Err(BdevError::Io(libc::EINVAL)), payload);
            }
            if payload.segments() > MAX_SEGMENTS {
                let n = payload.segments();
                return (Err(BdevError::TooManySegments(n)), payload);
            }
            if self.core.qos_on.get() {
                let bytes = num_blocks * self.core.block_size as u64;
                if let Err(e) = self.qos_wait(kind == IoType::Read, bytes).await {
                    return (Err(e), payload);
                }
            }
            if !self.aligned(&payload) {
                return self
                    .bounced(kind, offset_blocks, num_blocks, payload, flags)
                    .await;
            }
        }
        let t0 = if t0 == 0 { ticks::now() } else { t0 };
        let sub = Submit::new(&*self.core, kind, offset_blocks, num_blocks, payload, flags);
        let (r, payload) = match sub.start_now() {
            Started::Done(r, p) => (r, p),
            Started::Waiting(sub) => sub.await,
        };
        let bytes = if kind == IoType::Reset {
            0
        } else {
            num_blocks * self.core.block_size as u64
        };
        self.done(kind, bytes, t0, r.is_ok());
        (r, payload)
    }

    /// Whether a read or write of `buf` may take [`BufIo`]'s fast path:
    /// the checks pass, no QoS, no bounce. Anything else goes the generic
    /// way, which checks again and reports what failed.
    #[inline(always)]
    pub(crate) fn fast_path_ok(&self, kind: IoType, offset: u64, num: u64, buf: &IoBuf) -> bool {
        let c = &self.core;
        self.check(kind, offset, num).is_ok()
            && c.supported[kind.index()]
            && buf.len() as u64 == num * c.block_size as u64
            && !c.qos_on.get()
            && self.aligned(buf)
    }

    /// The latest reading of this reactor's clock the channel knows of:
    /// its latest completion or the start of the reactor's pass,
    /// whichever is later. A target that takes a request off its queue
    /// in this pass can stamp the I/O with it ([`IoChannel::rw_now`],
    /// [`IoChannel::rw_stamped`]) instead of reading the TSC, which costs
    /// tens of ns in a VM; the latency then also covers the target's
    /// work on the request since that reading.
    #[inline]
    pub fn recent_tick(&self) -> u64 {
        self.core.last_done.get().max(ustor_runtime::pass_ticks())
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

    #[inline(always)]
    fn done(&self, kind: IoType, bytes: u64, t0: u64, ok: bool) {
        self.core.done(kind, bytes, t0, ok)
    }

    /// Tick count when this channel's latest I/O completed, and that I/O's
    /// latency in ticks: lets a caller such as `ustor bench` time its I/O
    /// without reading the clock again.
    pub fn last_completion(&self) -> (u64, u64) {
        (self.core.last_done.get(), self.core.last_latency.get())
    }

    fn aligned<P: Payload>(&self, p: &P) -> bool {
        let a = self.core.align as usize;
        let pow2 = self.core.align_pow2;
        let on = |x: usize| {
            if pow2 {
                x & (a - 1) == 0
            } else {
                x.is_multiple_of(a)
            }
        };
        p.aligned(on, self.core.block_size as usize)
    }

    /// Copies through one aligned buffer; the copy is counted in the stats.
    async fn bounced<P: Payload>(
        &self,
        kind: IoType,
        off: u64,
        n: u64,
        mut payload: P,
        flags: IoFlags,
    ) -> (Result<(), BdevError>, P) {
        let len = payload.total_len() as usize;
        let mut bounce = IoBuf::alloc(len).await;
        if kind != IoType::Read {
            copy_between(&mut payload, &mut bounce, true);
        }
        let st = &self.core.stats;
        st.bounce_ops.set(st.bounce_ops.get() + 1);
        st.bounce_bytes.set(st.bounce_bytes.get() + len as u64);
        let t0 = ticks::now();
        let (r, mut bounce) = Submit::new(&*self.core, kind, off, n, bounce, flags).await;
        self.done(kind, len as u64, t0, r.is_ok());
        if r.is_ok() && kind == IoType::Read {
            copy_between(&mut payload, &mut bounce, false);
        }
        (r, payload)
    }
}

/// The generic path of a single-buffer read or write (see [`BufIo`]).
fn slow_one(
    ch: &IoChannel,
    kind: IoType,
    offset_blocks: u64,
    num_blocks: u64,
    buf: IoBuf,
    t0: u64,
) -> impl Future<Output = (Result<(), BdevError>, IoBuf)> + '_ {
    ch.io(kind, offset_blocks, num_blocks, buf, t0, IoFlags::NONE)
}
