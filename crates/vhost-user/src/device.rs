//! The block device a controller serves: its bdev descriptor, the
//! geometry the config space is built from, and the settings every queue
//! reads (cache mode, poll window, call coalescing) and the per-queue
//! counters the queues keep.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
    /// `vhost_controller_set_coalescing`: `delay_base_us << 32 |
    /// iops_threshold`, read by each queue every stats interval.
    coalescing: AtomicU64,
    /// One per queue, written only by that queue's reactor.
    pub queue_stats: Box<[QueueStats]>,
}

/// Counters of one queue. Each has one writer (the queue's reactor), so
/// it is bumped with a plain load and store: no locked instruction per
/// request. Padded so two queues on two reactors share no cache line.
#[derive(Default, Debug)]
#[repr(align(128))]
pub struct QueueStats {
    /// Requests taken from the avail ring.
    pub requests: AtomicU64,
    /// Requests answered with an error status (or returned unanswerable).
    pub errors: AtomicU64,
    /// Kick eventfd wake-ups (the queue had gone to sleep).
    pub kicks: AtomicU64,
    /// Writes to the call eventfd (interrupts the driver gets).
    pub signals: AtomicU64,
}

impl QueueStats {
    /// Adds one (single writer).
    pub fn bump(c: &AtomicU64) {
        c.store(c.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }
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
            coalescing: AtomicU64::new(0),
            queue_stats: (0..num_queues).map(|_| QueueStats::default()).collect(),
        }
    }

    /// Sets call-eventfd coalescing (SPDK's `delay_base_us`,
    /// `iops_threshold`); queues pick it up within a stats interval.
    pub fn set_coalescing(&self, delay_base_us: u32, iops_threshold: u32) {
        let v = (delay_base_us as u64) << 32 | iops_threshold as u64;
        self.coalescing.store(v, Ordering::Relaxed);
    }

    /// `(delay_base_us, iops_threshold)`.
    pub fn coalescing(&self) -> (u32, u32) {
        let v = self.coalescing.load(Ordering::Relaxed);
        ((v >> 32) as u32, v as u32)
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
