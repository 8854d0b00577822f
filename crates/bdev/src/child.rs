//! Child I/O on borrowed iovecs, for virtual bdevs (stripe, mirror,
//! passthru): inside its [`crate::BdevChannel::submit`], a driver built on
//! other bdevs turns the I/O it got into [`Children`] and sends each child
//! to a base bdev's [`IoChannel`] over a byte range of the parent's own
//! buffers. Nothing is copied and nothing allocated: a child is a slot of
//! the per-reactor I/O table whose iovecs point into the parent's, and the
//! parent's buffers stay with the I/O that owns them (its future, or its
//! slot once that future is dropped) until the last child is done. The parent completes when its last child does, with
//! the first error.
//!
//! What the generic path does for a submitter and a child does not get:
//! alignment bounce, write-zeroes emulation, FUA emulation and iostat on the
//! base. So a virtual bdev advertises at least its bases' alignment, claims
//! only the I/O kinds every base supports natively, reports FUA support
//! only where every base has it (the layer above then flushes), and its own
//! iostat counts the I/O. A child larger than the base's max transfer or
//! crossing its boundary is split here.
//!
//! An I/O that lands whole on one base needs no child at all:
//! [`IoHandle::forward`] hands the same slot to the base with the offset
//! changed (a raid0 I/O inside one strip, a split part).

use std::marker::PhantomData;
use std::mem::ManuallyDrop;

use crate::channel::IoChannel;
use crate::error::BdevError;
use crate::io::{with_table, IoHandle, MAX_SEGMENTS};
use crate::types::IoType;

/// A driver's I/O turned into children. Dropping it releases the parent:
/// it completes once every child submitted through it has (at once if all
/// did already). `!Send`: children run on the parent's reactor.
pub struct Children {
    idx: u32,
    _reactor: PhantomData<*const ()>,
}

impl IoHandle {
    /// Turns this I/O into a parent of child I/Os (see [`Children`]).
    pub fn into_children(self) -> Children {
        let idx = self.idx;
        std::mem::forget(self);
        with_table(|t| {
            let s = &t.slots[idx as usize];
            s.chained.set(true);
            // The `Children` value's own hold: a child that completes inline
            // must not complete the parent before the rest are submitted.
            s.children.set(s.children.get() + 1);
        });
        Children {
            idx,
            _reactor: PhantomData,
        }
    }
}

impl IoHandle {
    /// Sends this whole I/O on to `ch`'s bdev at `offset_blocks`: the same
    /// slot, buffers, flags and completion, so no child slot is taken and
    /// nothing is folded back. For a virtual bdev whose I/O lands on one
    /// piece of one base, such as a raid0 I/O inside one strip or a split
    /// part's I/O. The I/O goes the child way instead ([`Children`]) when
    /// the base would have to split it (its max transfer or boundary) or
    /// when its bytes do not match the base's block size. A base that
    /// refuses the range (removed, read-only, out of range) fails it.
    pub fn forward(self, ch: &IoChannel, offset_blocks: u64) {
        let c = &*ch.core;
        let (kind, num, bytes) = with_table(|t| {
            let s = &t.slots[self.idx as usize];
            // SAFETY: the slot is this handle's; its iovecs are only read.
            let iov = unsafe { &*s.iov.get() };
            let bytes: u64 = iov[..s.iovcnt.get() as usize]
                .iter()
                .map(|v| v.iov_len as u64)
                .sum();
            (s.kind.get(), s.num_blocks.get(), bytes)
        });
        let whole = !kind.has_data()
            || (bytes == kind.payload_bytes(num, c.block_size as u64)
                && chunk(c.max_xfer, c.boundary, offset_blocks, num) == num
                && (kind != IoType::CompareAndWrite || num <= c.max_caw));
        if !whole {
            let kids = self.into_children();
            return kids.submit(ch, kind, offset_blocks, num, 0);
        }
        if let Err(e) = check(ch, kind, offset_blocks, num) {
            return self.complete(Err(e));
        }
        let (idx, gen) = (self.idx, self.gen);
        std::mem::forget(self);
        with_table(|t| {
            let s = &t.slots[idx as usize];
            s.offset_blocks.set(offset_blocks);
            // Completion checks the base's removal now, as a child's does.
            s.removed.set(c.entry.removed_flag());
        });
        c.driver.submit(IoHandle::from_parts(idx, gen));
    }
}

/// What a watcher is called with when one of its children completes: its
/// `ctx` and `tag`, the parent (to send more children to, e.g. a mirror
/// retrying a read on another member) and the child's status; it returns
/// the status the parent gets from this child (e.g. `Ok` for a write a
/// mirror's other members hold). It runs on the reactor, inside the
/// completion path: the same rules as `submit` (no block, lock, alloc).
pub type WatchFn = fn(
    ctx: *const (),
    tag: u32,
    parent: &Children,
    status: Result<(), BdevError>,
) -> Result<(), BdevError>;

/// A watcher of child I/Os ([`Children::submit_watched`]). `ctx` must stay
/// valid until every child submitted with it has completed.
#[derive(Clone, Copy, Debug)]
pub struct Watch {
    pub f: WatchFn,
    pub ctx: *const (),
    pub tag: u32,
}

impl Watch {
    pub(crate) fn call(self, parent: u32, status: Result<(), BdevError>) -> Result<(), BdevError> {
        // The parent still counts this child, so it cannot complete while
        // the watcher adds children; the borrowed handle must not release
        // it (no drop).
        let p = ManuallyDrop::new(Children {
            idx: parent,
            _reactor: PhantomData,
        });
        (self.f)(self.ctx, self.tag, &p, status)
    }
}

impl Children {
    /// The parent I/O's kind, range and iovecs.
    pub fn desc(&self) -> crate::io::IoDesc {
        crate::io::slot_desc(self.idx)
    }

    /// [`Children::submit`] with `watch` called as each child completes.
    pub fn submit_watched(
        &self,
        ch: &IoChannel,
        kind: IoType,
        offset_blocks: u64,
        num_blocks: u64,
        parent_byte_offset: u64,
        watch: Watch,
    ) {
        self.submit_with(
            ch,
            kind,
            offset_blocks,
            num_blocks,
            parent_byte_offset,
            Some(watch),
        )
    }

    /// Sends `kind` on `num_blocks` at `offset_blocks` of `ch`'s bdev. A
    /// data I/O uses the parent's bytes from `parent_byte_offset` on
    /// (`num_blocks` times the base's block size of them); other kinds
    /// ignore it. A child that cannot start (range, permission, removed,
    /// table full) fails the parent instead.
    pub fn submit(
        &self,
        ch: &IoChannel,
        kind: IoType,
        offset_blocks: u64,
        num_blocks: u64,
        parent_byte_offset: u64,
    ) {
        self.submit_with(
            ch,
            kind,
            offset_blocks,
            num_blocks,
            parent_byte_offset,
            None,
        )
    }

    #[inline]
    fn submit_with(
        &self,
        ch: &IoChannel,
        kind: IoType,
        offset_blocks: u64,
        num_blocks: u64,
        parent_byte_offset: u64,
        watch: Option<Watch>,
    ) {
        if let Err(e) = check(ch, kind, offset_blocks, num_blocks) {
            return self.fail(e);
        }
        let c = &*ch.core;
        if !kind.has_data() {
            if let Some((child, gen)) =
                self.child_slot(ch, kind, offset_blocks, num_blocks, 0, watch)
            {
                c.driver.submit(IoHandle::from_parts(child, gen));
            }
            return;
        }
        let bs = c.block_size as u64;
        if kind == IoType::CompareAndWrite {
            return self.submit_compare_and_write(
                ch,
                offset_blocks,
                num_blocks,
                parent_byte_offset,
                watch,
            );
        }
        let mut done = 0;
        while done < num_blocks {
            let off = offset_blocks + done;
            let n = chunk(c.max_xfer, c.boundary, off, num_blocks - done);
            let at = parent_byte_offset + done * bs;
            let Some((child, gen)) = self.child_slot(ch, kind, off, n, at, watch) else {
                return;
            };
            c.driver.submit(IoHandle::from_parts(child, gen));
            done += n;
        }
    }

    /// A compare-and-write child: only the parent's whole payload (compare
    /// data, then write data) in one piece, since its two halves cannot be
    /// cut to a sub-range and a split one would not be atomic. Anything
    /// else fails the parent (`Io(EINVAL)`) before a child starts, so a
    /// compare-and-write spread over several bases writes nothing.
    #[cold]
    fn submit_compare_and_write(
        &self,
        ch: &IoChannel,
        offset_blocks: u64,
        num_blocks: u64,
        parent_byte_offset: u64,
        watch: Option<Watch>,
    ) {
        let c = &*ch.core;
        let kind = IoType::CompareAndWrite;
        let want = kind.payload_bytes(num_blocks, c.block_size as u64);
        let have: u64 = with_table(|t| {
            let p = &t.slots[self.idx as usize];
            // SAFETY: the parent's iovecs are only read (see `child_slot`).
            let iov = unsafe { &*p.iov.get() };
            iov[..p.iovcnt.get() as usize]
                .iter()
                .map(|v| v.iov_len as u64)
                .sum()
        });
        let one_piece = num_blocks <= c.max_caw
            && chunk(c.max_xfer, c.boundary, offset_blocks, num_blocks) == num_blocks;
        if parent_byte_offset != 0 || have != want || !one_piece {
            return self.fail(BdevError::Io(libc::EINVAL));
        }
        if let Some((child, gen)) = self.child_slot(ch, kind, offset_blocks, num_blocks, 0, watch) {
            c.driver.submit(IoHandle::from_parts(child, gen));
        }
    }

    /// Fails the parent with `e` (unless a child failed first) without a
    /// child, e.g. for a range the driver itself refuses.
    pub fn fail(&self, e: BdevError) {
        with_table(|t| {
            let p = &t.slots[self.idx as usize];
            if p.status.get().is_ok() {
                p.status.set(Err(e));
            }
        });
    }

    /// Takes and fills a slot for one child; `None` (parent failed) when
    /// the table is full or the bytes do not fit the base's alignment.
    fn child_slot(
        &self,
        ch: &IoChannel,
        kind: IoType,
        offset_blocks: u64,
        n: u64,
        at: u64,
        watch: Option<Watch>,
    ) -> Option<(u32, u32)> {
        let c = &*ch.core;
        let r = with_table(|t| {
            let child = t.try_alloc().ok_or(BdevError::Io(libc::EAGAIN))?;
            let p = &t.slots[self.idx as usize];
            let s = &t.slots[child as usize];
            s.kind.set(kind);
            s.flags.set(p.flags.get());
            s.offset_blocks.set(offset_blocks);
            s.num_blocks.set(n);
            s.removed.set(c.entry.removed_flag());
            s.parent.set(self.idx);
            s.watch.set(watch);
            if kind.has_data() {
                let len = kind.payload_bytes(n, c.block_size as u64);
                // SAFETY: parent and child are distinct slots of this
                // reactor's table; the parent's iovecs are not written while
                // it has a driver (only read here).
                let (piov, ciov) = unsafe { (&*p.iov.get(), &mut *s.iov.get()) };
                let cnt = sub_iov(&piov[..p.iovcnt.get() as usize], at, len, ciov);
                s.iovcnt.set(cnt as u32);
                s.fixed.set(p.fixed.get());
                if let Err(e) = fits(&ciov[..cnt], len, c.align) {
                    t.free(child);
                    return Err(e);
                }
            }
            p.children.set(p.children.get() + 1);
            Ok((child, s.gen.get()))
        });
        r.map_err(|e| self.fail(e)).ok()
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        with_table(|t| t.child_done(self.idx, Ok(())));
    }
}

/// The checks of the generic path that a child needs.
fn check(
    ch: &IoChannel,
    kind: IoType,
    offset_blocks: u64,
    num_blocks: u64,
) -> Result<(), BdevError> {
    let c = &*ch.core;
    if c.entry.is_removed() {
        return Err(BdevError::Removed);
    }
    if !ch.writable && !matches!(kind, IoType::Read | IoType::Reset) {
        return Err(BdevError::ReadOnly);
    }
    if !c.supported[kind.index()] {
        return Err(BdevError::NotSupported);
    }
    let size_blocks = c.entry.num_blocks();
    if kind != IoType::Reset
        && offset_blocks
            .checked_add(num_blocks)
            .is_none_or(|e| e > size_blocks)
    {
        return Err(BdevError::OutOfRange {
            offset_blocks,
            num_blocks,
            size_blocks,
        });
    }
    Ok(())
}

/// Blocks of the next piece from `offset`, by the base's max transfer and
/// optimal boundary (as the generic path splits).
#[inline]
pub(crate) fn chunk(max_xfer: u64, boundary: u64, offset: u64, left: u64) -> u64 {
    let mut n = left;
    if max_xfer > 0 {
        n = n.min(max_xfer);
    }
    if boundary > 0 {
        n = n.min(boundary - offset % boundary);
    }
    n
}

/// The child's iovecs hold exactly `len` bytes, each segment on the base's
/// alignment.
fn fits(iov: &[libc::iovec], len: u64, align: u32) -> Result<(), BdevError> {
    let got: u64 = iov.iter().map(|v| v.iov_len as u64).sum();
    if got != len {
        return Err(BdevError::BadLength { got, want: len });
    }
    let a = align as usize;
    let on = |x: usize| a <= 1 || x.is_multiple_of(a);
    if !iov.iter().all(|v| on(v.iov_base as usize) && on(v.iov_len)) {
        return Err(BdevError::Io(libc::EINVAL));
    }
    Ok(())
}

/// Iovecs covering bytes [start, start+len) of `src`.
pub(crate) fn sub_iov(
    src: &[libc::iovec],
    start: u64,
    len: u64,
    out: &mut [libc::iovec; MAX_SEGMENTS],
) -> usize {
    let (mut pos, mut n, end) = (0u64, 0usize, start + len);
    for v in src {
        let (a, b) = (pos, pos + v.iov_len as u64);
        pos = b;
        if b <= start || a >= end {
            continue;
        }
        let s = start.max(a);
        let e = end.min(b);
        // SAFETY: s - a < iov_len, so the pointer stays inside the segment.
        let base = unsafe { (v.iov_base as *mut u8).add((s - a) as usize) };
        out[n] = libc::iovec {
            iov_base: base.cast(),
            iov_len: (e - s) as usize,
        };
        n += 1;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// sub_iov against a byte-by-byte reference model.
        #[test]
        fn sub_iov_matches_flat_model(lens in proptest::collection::vec(1usize..64, 1..8), a in 0usize..512, l in 0usize..512) {
            let total: usize = lens.iter().sum();
            let start = a % total;
            let len = l % (total - start + 1);
            let mut backing: Vec<Vec<u8>> = Vec::new();
            let mut k = 0u8;
            for n in &lens {
                backing.push((0..*n).map(|_| { k = k.wrapping_add(1); k }).collect());
            }
            let flat: Vec<u8> = backing.iter().flatten().copied().collect();
            let src: Vec<libc::iovec> = backing.iter_mut().map(|v| libc::iovec { iov_base: v.as_mut_ptr().cast(), iov_len: v.len() }).collect();
            let mut out = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; MAX_SEGMENTS];
            let n = sub_iov(&src, start as u64, len as u64, &mut out);
            let mut got = Vec::new();
            for v in &out[..n] {
                got.extend_from_slice(unsafe { std::slice::from_raw_parts(v.iov_base as *const u8, v.iov_len) });
            }
            prop_assert_eq!(&got[..], &flat[start..start + len]);
        }
    }
}
