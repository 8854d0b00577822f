//! The block device a controller serves: its bdev descriptor, the
//! geometry the config space is built from, and the settings every queue
//! reads (cache mode, poll window, call coalescing), the per-queue
//! counters the queues keep, and what the bdev's events change: a resize
//! updates the capacity and tells the frontend (a config-change message on
//! its backend channel), a hot-remove fails every later request.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use ustor_bdev::{BdevEvent, Desc, IoType};

use crate::blk::{BlkGeometry, CONFIG_LEN, SECTOR_SIZE};

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
    /// Offer VIRTIO_F_RING_PACKED (the controller's `packed_ring`).
    pub packed_ring: bool,
    /// `vhost_controller_set_coalescing`: `delay_base_us << 32 |
    /// iops_threshold`, read by each queue every stats interval.
    coalescing: AtomicU64,
    /// One per queue, written only by that queue's reactor.
    pub queue_stats: Box<[QueueStats]>,
    /// The bdev was hot-removed: requests fail with IOERR.
    removed: AtomicBool,
    /// The connected frontend's backend channel (SET_BACKEND_REQ_FD),
    /// where config-change notifications go.
    notifier: Mutex<Option<UnixStream>>,
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
    /// Signals held back by call coalescing (each goes out later with
    /// the completions after it).
    pub held: AtomicU64,
    /// Requests returned used (`requests - completed` are in flight).
    pub completed: AtomicU64,
    /// Requests a killed backend had taken, run again at start
    /// (inflight region).
    pub resubmitted: AtomicU64,
    /// Requests the queue task ran itself when it took them (its inline
    /// slot, [`crate::inline`]), not handed to a worker.
    pub inline: AtomicU64,
    /// Requests taken in passes that took their whole batch first and
    /// read ahead ([`crate::pace`]: requests dear to take, as with the
    /// frontend's vCPU on another core complex).
    pub read_ahead: AtomicU64,
    /// The queue's task is running.
    pub running: AtomicBool,
    /// It runs (or last ran) as a packed ring.
    pub packed: AtomicBool,
}

impl QueueStats {
    /// Adds one (single writer).
    pub fn bump(c: &AtomicU64) {
        Self::add(c, 1);
    }

    /// Adds `n` (single writer).
    pub fn add(c: &AtomicU64, n: u64) {
        c.store(c.load(Ordering::Relaxed) + n, Ordering::Relaxed);
    }

    /// A snapshot (each counter read once; relaxed, so a request taken
    /// during the read may show as taken and not yet completed).
    pub fn snapshot(&self) -> QueueCounters {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        QueueCounters {
            completed: l(&self.completed),
            requests: l(&self.requests),
            errors: l(&self.errors),
            kicks: l(&self.kicks),
            signals: l(&self.signals),
            resubmitted: l(&self.resubmitted),
            inline: l(&self.inline),
            read_ahead: l(&self.read_ahead),
            running: self.running.load(Ordering::Relaxed),
            packed: self.packed.load(Ordering::Relaxed),
        }
    }
}

/// One queue's counters as read by [`QueueStats::snapshot`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueCounters {
    pub requests: u64,
    pub completed: u64,
    pub errors: u64,
    pub kicks: u64,
    pub signals: u64,
    pub resubmitted: u64,
    pub inline: u64,
    pub read_ahead: u64,
    pub running: bool,
    pub packed: bool,
}

impl QueueCounters {
    /// Requests taken and not yet returned used.
    pub fn in_flight(&self) -> u64 {
        self.requests.saturating_sub(self.completed)
    }
}

/// vhost-user's backend-to-frontend message VHOST_USER_BACKEND_CONFIG_CHANGE_MSG.
const CONFIG_CHANGE_MSG: u32 = 2;
/// Header flag: protocol version 1.
const VERSION_1: u32 = 1;

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
            packed_ring: false,
            coalescing: AtomicU64::new(0),
            queue_stats: (0..num_queues).map(|_| QueueStats::default()).collect(),
            removed: AtomicBool::new(false),
            notifier: Mutex::new(None),
        }
    }

    /// The bdev's size in blocks now (it may have been resized).
    pub fn num_blocks(&self) -> u64 {
        self.desc.num_blocks()
    }

    /// The config space now (capacity and cache mode as they are).
    pub fn config(&self) -> [u8; CONFIG_LEN] {
        let g = BlkGeometry {
            num_blocks: self.num_blocks(),
            ..self.geometry.clone()
        };
        g.config(self.writeback.load(Ordering::Relaxed))
    }

    /// Whether the bdev was hot-removed.
    pub fn removed(&self) -> bool {
        self.removed.load(Ordering::Relaxed)
    }

    /// The frontend's backend channel (None when it leaves).
    pub fn set_notifier(&self, s: Option<UnixStream>) {
        *self.notifier.lock().unwrap_or_else(|e| e.into_inner()) = s;
    }

    /// Whether a frontend gave a backend channel.
    pub fn has_notifier(&self) -> bool {
        self.notifier.lock().map(|n| n.is_some()).unwrap_or(false)
    }

    /// The bdev's event (any thread): a resize reaches the frontend as a
    /// config-change notification (it reads the config space again and
    /// tells the guest); a removal fails every later request.
    pub fn on_event(&self, ev: BdevEvent) {
        match ev {
            BdevEvent::Remove => {
                self.removed.store(true, Ordering::Relaxed);
                tracing::warn!(
                    bdev = %self.serial,
                    "vhost-blk: bdev removed; requests fail with IOERR"
                );
            }
            BdevEvent::Resize => {
                let sent = self.notify_config_change();
                tracing::info!(
                    bdev = %self.serial,
                    num_blocks = self.num_blocks(),
                    "vhost-blk: bdev resized; frontend notified: {sent}"
                );
            }
        }
    }

    /// Sends CONFIG_CHANGE_MSG on the backend channel (no reply asked:
    /// REPLY_ACK is not offered). Non-blocking: a frontend that does not
    /// read its channel loses the notification, never stalls the caller.
    pub fn notify_config_change(&self) -> bool {
        let mut hdr = [0u8; 12];
        hdr[0..4].copy_from_slice(&CONFIG_CHANGE_MSG.to_le_bytes());
        hdr[4..8].copy_from_slice(&VERSION_1.to_le_bytes());
        let g = self.notifier.lock().unwrap_or_else(|e| e.into_inner());
        let Some(s) = g.as_ref() else {
            return false;
        };
        let _ = s.set_nonblocking(true);
        matches!((&*s).write(&hdr), Ok(12))
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
        let (o, n) = if bs.is_power_of_two() {
            // Every bdev block size in use: masks and shifts, not four
            // 64-bit divisions (tens of cycles each) per request.
            if (off | bytes) & (bs - 1) != 0 || bytes == 0 {
                return None;
            }
            let sh = bs.trailing_zeros();
            (off >> sh, bytes >> sh)
        } else {
            if off % bs != 0 || bytes % bs != 0 || bytes == 0 {
                return None;
            }
            (off / bs, bytes / bs)
        };
        (o.checked_add(n)? <= self.num_blocks()).then_some((o, n))
    }
}
