//! Exports backed by bdevs: the [`ExportSource`]/[`Channel`] implementation
//! over `ustor-bdev` descriptors and per-reactor channels, and
//! `nbd_export_create` in its bdev form (open + claim).

use std::sync::Arc;

use ustor_bdev::{BdevError, Desc, IoChannel, IoType, Registry};
use ustor_runtime::IoBuf;

use super::backend::{BufResult, Channel, ExportSource};
use super::{ExportCreateParams, NbdServer, NbdServerError};
use crate::export::{BlockSizes, ExportFeatures};
use crate::wire::NbdErrno;

/// Largest READ/WRITE payload advertised. Payloads up to the pool's largest
/// class use a registered buffer; bigger ones (rare: clients mostly stay at
/// 1 MiB or below) take a heap buffer and the bdev layer splits the I/O.
pub const BDEV_MAX_PAYLOAD: u32 = 32 << 20;

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
        BdevError::Io(_) | BdevError::Removed | BdevError::Miscompare | BdevError::Aborted => {
            NbdErrno::Io
        }
    }
}

/// An export's bdev: an open, claimed descriptor.
pub struct BdevSource {
    desc: Desc,
}

impl Drop for BdevSource {
    fn drop(&mut self) {
        self.desc.release_claim();
    }
}

/// A connection's view of the bdev: its reactor's channel.
pub struct BdevExportChannel {
    ch: IoChannel,
    shift: u32,
    write_cache: bool,
}

impl BdevExportChannel {
    fn blocks(&self, bytes: u64) -> u64 {
        bytes >> self.shift
    }
}

impl Channel for BdevExportChannel {
    async fn read(&self, offset: u64, buf: IoBuf) -> BufResult {
        let n = self.blocks(buf.len() as u64);
        let (r, buf) = self.ch.read(self.blocks(offset), n, buf).await;
        (r.map_err(nbd_errno), buf)
    }

    async fn write(&self, offset: u64, buf: IoBuf, fua: bool) -> BufResult {
        let n = self.blocks(buf.len() as u64);
        let (r, buf) = self.ch.write(self.blocks(offset), n, buf).await;
        if r.is_ok() && fua && self.write_cache {
            // FUA as write + flush: the bdev layer has no FUA bit.
            return (self.flush().await, buf);
        }
        (r.map_err(nbd_errno), buf)
    }

    async fn flush(&self) -> Result<(), NbdErrno> {
        if !self.write_cache {
            return Ok(());
        }
        self.ch
            .flush(0, self.ch.num_blocks())
            .await
            .map_err(nbd_errno)
    }

    async fn trim(&self, offset: u64, len: u64) -> Result<(), NbdErrno> {
        self.ch
            .unmap(self.blocks(offset), self.blocks(len))
            .await
            .map_err(nbd_errno)
    }

    async fn write_zeroes(&self, offset: u64, len: u64, _no_hole: bool) -> Result<(), NbdErrno> {
        // Bdev write-zeroes never deallocates, so NO_HOLE holds either way.
        self.ch
            .write_zeroes(self.blocks(offset), self.blocks(len))
            .await
            .map_err(nbd_errno)
    }
}

impl ExportSource for BdevSource {
    type Channel = BdevExportChannel;

    fn size_bytes(&self) -> u64 {
        self.desc.info().size_bytes()
    }

    fn block_sizes(&self) -> BlockSizes {
        let bs = self.desc.info().block_size;
        BlockSizes {
            min: bs,
            preferred: bs.max(4096),
            max_payload: BDEV_MAX_PAYLOAD,
        }
    }

    fn features(&self) -> ExportFeatures {
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
            has_allocation_map: false,
            rotational: false,
        }
    }

    fn channel(&self) -> Result<BdevExportChannel, NbdErrno> {
        let ch = self.desc.channel().map_err(nbd_errno)?;
        let info = self.desc.info();
        Ok(BdevExportChannel {
            ch,
            shift: info.block_size.trailing_zeros(),
            write_cache: info.write_cache,
        })
    }
}

impl NbdServer<BdevSource> {
    /// `nbd_export_create`: opens `bdev_name` (read-only if asked), claims it
    /// for this export, and publishes the export.
    pub fn export_create_bdev(
        &self,
        registry: &Arc<Registry>,
        params: &ExportCreateParams,
    ) -> Result<(), NbdServerError> {
        let desc = registry
            .open(&params.bdev_name, !params.read_only, |_| {})
            .map_err(|e| NbdServerError::Bdev(e.to_string()))?;
        if !desc.info().block_size.is_power_of_two() {
            return Err(NbdServerError::InvalidExport(
                "bdev block size is not a power of two",
            ));
        }
        desc.claim(&format!("nbd export {}", params.name))
            .map_err(|e| NbdServerError::Bdev(e.to_string()))?;
        // From here on the source releases the claim when dropped (on error
        // below, or when the export and its last connection are gone).
        self.export_create(params, BdevSource { desc })
    }
}
