//! An export's device: an open, claimed bdev descriptor ([`BdevSource`]),
//! the per-connection view of it on the connection's reactor
//! ([`BdevExportChannel`]), and the mapping of bdev errors to NBD errnos.
//! NBD has no storage seam of its own: the bdev layer is the seam, and
//! protocol tests export an in-memory bdev.

use std::sync::Arc;

use ustor_bdev::{Bdev, BdevError, Desc, IoChannel, IoFlags, IoType};
use ustor_runtime::IoBuf;

use crate::export::{BlockSizes, ExportFeatures};
use crate::wire::{state, BlockDescriptor, NbdErrno};

/// Largest READ/WRITE payload advertised. Payloads up to the pool's largest
/// class use a registered buffer; bigger ones (rare: clients mostly stay at
/// 1 MiB or below) take a heap buffer and the bdev layer splits the I/O.
pub const BDEV_MAX_PAYLOAD: u32 = 32 << 20;

/// Result of a data operation that hands its buffer back.
pub type BufResult = (Result<(), NbdErrno>, IoBuf);

/// Maps a bdev error to the NBD errno the protocol allows.
pub fn nbd_errno(e: BdevError) -> NbdErrno {
    match e {
        BdevError::OutOfRange { .. }
        | BdevError::BadLength { .. }
        | BdevError::TooManySegments(_) => NbdErrno::Inval,
        // Never advertised when unsupported; ENOTSUP is reserved for FAST_ZERO.
        BdevError::NotSupported => NbdErrno::Inval,
        BdevError::ReadOnly => NbdErrno::Perm,
        BdevError::Io(e) if e == libc::ENOSPC || e == libc::EDQUOT || e == libc::EFBIG => {
            NbdErrno::NoSpc
        }
        BdevError::Io(e) if e == libc::ENOMEM => NbdErrno::NoMem,
        BdevError::Io(_)
        | BdevError::Removed
        | BdevError::Miscompare { .. }
        | BdevError::Aborted => NbdErrno::Io,
    }
}

/// An export's bdev: an open, claimed descriptor (the claim is released
/// when the export and its last connection are gone).
pub struct BdevSource {
    desc: Desc,
    /// The driver answers allocation queries (`base:allocation`).
    allocation_map: bool,
}

impl Drop for BdevSource {
    fn drop(&mut self) {
        self.desc.release_claim();
    }
}

impl BdevSource {
    /// Wraps a descriptor the caller opened and claimed.
    pub(crate) fn new(desc: Desc) -> BdevSource {
        let allocation_map = desc.entry().bdev().block_status(0, 1).is_some();
        BdevSource {
            desc,
            allocation_map,
        }
    }

    /// The size now: a resized bdev shows its new size at the next
    /// connect (a connection keeps the size it negotiated).
    pub fn size_bytes(&self) -> u64 {
        self.desc.num_blocks() * u64::from(self.desc.info().block_size)
    }

    pub fn block_sizes(&self) -> BlockSizes {
        let bs = self.desc.info().block_size;
        BlockSizes {
            min: bs,
            preferred: bs.max(4096),
            max_payload: BDEV_MAX_PAYLOAD,
        }
    }

    pub fn features(&self) -> ExportFeatures {
        let info = self.desc.info();
        ExportFeatures {
            read_only: !self.desc.writable(),
            can_flush: info.write_cache && self.desc.io_type_supported(IoType::Flush),
            can_trim: self.desc.io_type_supported(IoType::Unmap),
            // The bdev layer emulates write-zeroes when the driver cannot.
            can_write_zeroes: true,
            fast_zero: self.desc.io_type_supported(IoType::WriteZeroes),
            // NBD_CMD_CACHE is a prefetch: on a bdev whose data is all in
            // memory, success after validating the range is the truth. Other
            // devices could honour it only by reading ahead, which the bdev
            // layer has no operation for, so they do not advertise it.
            can_cache: info.memory_resident,
            // One device cache shared by every channel: a flush on any
            // connection covers writes acknowledged on all of them.
            multi_conn: true,
            has_allocation_map: self.allocation_map,
            rotational: false,
        }
    }

    /// Opens this reactor's channel (called on the connection's reactor).
    pub fn channel(&self) -> Result<BdevExportChannel, NbdErrno> {
        let ch = self.desc.channel().map_err(nbd_errno)?;
        let info = self.desc.info();
        Ok(BdevExportChannel {
            ch,
            bdev: self.desc.entry().bdev().clone(),
            shift: info.block_size.trailing_zeros(),
            write_cache: info.write_cache,
        })
    }
}

/// A connection's view of the bdev: its reactor's channel. Offsets and
/// lengths are in bytes, already validated against the export (in range,
/// aligned to the block size).
pub struct BdevExportChannel {
    ch: IoChannel,
    bdev: Arc<dyn Bdev>,
    shift: u32,
    write_cache: bool,
}

impl BdevExportChannel {
    fn blocks(&self, bytes: u64) -> u64 {
        bytes >> self.shift
    }

    /// Fills `buf` (its `len()` bytes) from `offset`.
    pub async fn read(&self, offset: u64, buf: IoBuf) -> BufResult {
        let n = self.blocks(buf.len() as u64);
        let (r, buf) = self.ch.read(self.blocks(offset), n, buf).await;
        (r.map_err(nbd_errno), buf)
    }

    /// Writes `buf` at `offset`; durable before completion when `fua`.
    pub async fn write(&self, offset: u64, buf: IoBuf, fua: bool) -> BufResult {
        let n = self.blocks(buf.len() as u64);
        let (r, buf) = self
            .ch
            .write_flagged(self.blocks(offset), n, buf, IoFlags::fua_if(fua))
            .await;
        (r.map_err(nbd_errno), buf)
    }

    pub async fn flush(&self) -> Result<(), NbdErrno> {
        if !self.write_cache {
            return Ok(());
        }
        self.ch
            .flush(0, self.ch.num_blocks())
            .await
            .map_err(nbd_errno)
    }

    pub async fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), NbdErrno> {
        self.ch
            .unmap_flagged(self.blocks(offset), self.blocks(len), IoFlags::fua_if(fua))
            .await
            .map_err(nbd_errno)
    }

    /// Zeroes the range. Bdev write-zeroes never deallocates, so NO_HOLE
    /// holds either way.
    pub async fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<(), NbdErrno> {
        self.ch
            .write_zeroes_flagged(self.blocks(offset), self.blocks(len), IoFlags::fua_if(fua))
            .await
            .map_err(nbd_errno)
    }

    /// Allocation status from `offset` (`base:allocation` flags); fills
    /// `out` and returns how many extents it wrote (at least one). A driver
    /// that cannot tell says "allocated, contents unknown" for the whole
    /// range, which is always correct.
    pub fn block_status(&self, offset: u64, len: u32, out: &mut [BlockDescriptor]) -> usize {
        let whole = BlockDescriptor {
            length: len,
            flags: 0,
        };
        let Some(extents) = self
            .bdev
            .block_status(self.blocks(offset), self.blocks(u64::from(len)).max(1))
        else {
            if let Some(first) = out.first_mut() {
                *first = whole;
            }
            return 1;
        };
        let mut n = 0;
        for (e, o) in extents.iter().zip(out.iter_mut()) {
            let bytes = (e.num_blocks << self.shift).min(u64::from(u32::MAX)) as u32;
            let flags = if e.hole { state::HOLE } else { 0 } | if e.zero { state::ZERO } else { 0 };
            *o = BlockDescriptor {
                length: bytes,
                flags,
            };
            n += 1;
        }
        if n == 0 {
            if let Some(first) = out.first_mut() {
                *first = whole;
            }
            return 1;
        }
        n
    }
}
