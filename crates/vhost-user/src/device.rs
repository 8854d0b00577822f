//! The block device a controller serves: its bdev descriptor, the
//! geometry the config space is built from, and the settings every queue
//! reads (cache mode, poll window).

use std::sync::atomic::AtomicBool;
use std::time::Duration;

use ustor_bdev::{Desc, IoType};

use crate::blk::{BlkGeometry, SECTOR_SIZE};

/// Shared (`Arc`) by the control thread and every queue's reactor.
pub struct BlkDevice {
    pub desc: Desc,
    pub geometry: BlkGeometry,
    /// GET_ID's answer (the bdev's name, truncated to 20 bytes).
    pub serial: String,
    pub read_only: bool,
    /// Write-back cache mode (CONFIG_WCE); write-through flushes each write.
    pub writeback: AtomicBool,
    /// How long a queue keeps polling its avail index after the last request
    /// before it sleeps on the kick eventfd.
    pub poll_window: Duration,
}

impl BlkDevice {
    pub fn new(desc: Desc, num_queues: u16, read_only: bool) -> BlkDevice {
        let info = desc.info().clone();
        let geometry = BlkGeometry {
            block_size: info.block_size,
            num_blocks: info.num_blocks,
            num_queues,
            read_only,
            flush: true,
            discard: desc.io_type_supported(IoType::Unmap),
            // The bdev layer emulates write-zeroes with writes when the
            // driver lacks it.
            write_zeroes: true,
            opt_io_blocks: info.optimal_boundary_blocks,
        };
        BlkDevice {
            serial: info.name.chars().take(crate::blk::ID_LEN).collect(),
            desc,
            geometry,
            read_only,
            writeback: AtomicBool::new(true),
            poll_window: Duration::from_micros(50),
        }
    }

    /// The bdev range of `bytes` at 512-byte `sector`: `None` when it is
    /// not whole blocks, empty, or beyond the device.
    pub fn blocks(&self, sector: u64, bytes: u64) -> Option<(u64, u64)> {
        let bs = self.geometry.block_size as u64;
        let off = sector.checked_mul(SECTOR_SIZE)?;
        if off % bs != 0 || bytes % bs != 0 || bytes == 0 {
            return None;
        }
        let (o, n) = (off / bs, bytes / bs);
        (o.checked_add(n)? <= self.geometry.num_blocks).then_some((o, n))
    }
}
