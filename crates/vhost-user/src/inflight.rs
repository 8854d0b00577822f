//! Inflight I/O tracking for split rings (vhost-user's INFLIGHT_SHMFD):
//! a shared memory region, created by the backend on GET_INFLIGHT_FD and
//! kept by the frontend, that records which descriptor heads the backend
//! has taken and not yet returned used. A backend killed and started
//! again gets the region back with SET_INFLIGHT_FD and resubmits those
//! heads (in the order they were taken) before it takes new ones, so the
//! guest sees no lost request.
//!
//! Layout (vhost-user spec, "Inflight I/O tracking"; the per-queue size
//! is libvhost-user's, which QEMU's vhost-user-blk expects): per queue a
//! 16-byte header (features u64, version u16, desc_num u16,
//! last_batch_head u16, used_idx u16) then `desc_num` 16-byte entries
//! (inflight u8, padding, next u16, counter u64), the queue's part padded
//! to 64 bytes.
//!
//! Each queue's part is written only by that queue's reactor; the region
//! lives in a shared mapping, so what was stored survives a SIGKILL.
//!
//! Packed rings have the spec's packed layout ([`packed`]); a device that
//! offers packed rings gets a region laid out at the packed stride (each
//! queue's part large enough for either layout), and a region handed back
//! tells its stride by its size. [`ring`] is a ring's side of it (blk
//! and scsi rings of either layout).

pub mod packed;
pub mod ring;

use std::fs::File;
use std::os::fd::FromRawFd;
use std::sync::atomic::{compiler_fence, Ordering};
use std::sync::Arc;

use vm_memory::{Bytes, FileOffset, MmapRegion, VolatileMemory};

const HEADER: usize = 16;
const ENTRY: usize = 16;
const ALIGN: u64 = 64;
const VERSION: u16 = 1;

/// Bytes of one queue's part of the region (split layout).
pub fn queue_region_size(queue_size: u16) -> u64 {
    (ENTRY as u64 * queue_size as u64 + 2).div_ceil(ALIGN) * ALIGN
}

/// Bytes of one queue's part in the packed layout (32-byte header, 32
/// bytes per descriptor), also room for the split one.
pub fn queue_region_size_packed(queue_size: u16) -> u64 {
    (packed::P_HEADER as u64 + packed::P_ENTRY as u64 * queue_size as u64).div_ceil(ALIGN) * ALIGN
}

/// Why a region could not be made or used.
#[derive(Debug, thiserror::Error)]
pub enum InflightError {
    #[error("inflight region: {0}")]
    Io(#[from] std::io::Error),
    #[error("inflight region: {0}")]
    Map(String),
    #[error("inflight region of {got} bytes, {want} needed")]
    TooSmall { got: u64, want: u64 },
}

/// The mapped region of every queue.
pub struct InflightRegion {
    map: MmapRegion,
    queue_size: u16,
    num_queues: u16,
    /// Bytes per queue part; the packed stride can hold packed rings.
    stride: u64,
}

impl InflightRegion {
    /// GET_INFLIGHT_FD: a fresh zeroed memfd for `num_queues` queues of
    /// `queue_size` (`packed`: at the stride packed rings need); returns
    /// the region and the file to hand over.
    pub fn create(
        num_queues: u16,
        queue_size: u16,
        packed: bool,
    ) -> Result<(Arc<Self>, File), InflightError> {
        let stride = if packed {
            queue_region_size_packed(queue_size)
        } else {
            queue_region_size(queue_size)
        };
        let size = stride * num_queues as u64;
        // SAFETY: memfd_create with a valid C string; the fd is owned by
        // the File right after.
        let fd = unsafe { libc::memfd_create(c"ustor-vhost-inflight".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        // SAFETY: fd is a new descriptor nobody else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(size)?;
        let r = Self::map(file.try_clone()?, 0, size, num_queues, queue_size)?;
        Ok((r, file))
    }

    /// SET_INFLIGHT_FD: maps what the frontend kept.
    pub fn open(
        file: File,
        offset: u64,
        size: u64,
        num_queues: u16,
        queue_size: u16,
    ) -> Result<Arc<Self>, InflightError> {
        let want = queue_region_size(queue_size) * num_queues as u64;
        let have = file.metadata()?.len();
        if size < want || offset.checked_add(size).map_or(true, |end| end > have) {
            return Err(InflightError::TooSmall {
                got: size.min(have.saturating_sub(offset)),
                want,
            });
        }
        Self::map(file, offset, size, num_queues, queue_size)
    }

    fn map(
        file: File,
        offset: u64,
        size: u64,
        num_queues: u16,
        queue_size: u16,
    ) -> Result<Arc<Self>, InflightError> {
        let map = MmapRegion::from_file(FileOffset::new(file, offset), size as usize)
            .map_err(|e| InflightError::Map(e.to_string()))?;
        let packed = queue_region_size_packed(queue_size) * num_queues as u64;
        let stride = if size >= packed {
            queue_region_size_packed(queue_size)
        } else {
            queue_region_size(queue_size)
        };
        Ok(Arc::new(InflightRegion {
            map,
            queue_size,
            num_queues,
            stride,
        }))
    }

    pub fn queue_size(&self) -> u16 {
        self.queue_size
    }

    /// Queues the region was laid out for.
    pub fn num_queues(&self) -> u16 {
        self.num_queues
    }

    /// Bytes of the region (what GET_INFLIGHT_FD reports).
    pub fn size_bytes(&self) -> u64 {
        self.stride * self.num_queues as u64
    }

    /// Whether each queue's part has room for the packed layout.
    pub fn fits_packed(&self) -> bool {
        self.stride >= queue_region_size_packed(self.queue_size)
    }

    /// Queue `q`'s part (the caller keeps `q` below `num_queues`).
    pub fn queue(self: &Arc<Self>, q: u16) -> QueueInflight {
        assert!(q < self.num_queues, "queue {q} beyond the region");
        QueueInflight {
            region: self.clone(),
            base: self.stride as usize * q as usize,
            size: self.queue_size,
        }
    }
}

/// One queue's tracking, used on its reactor.
pub struct QueueInflight {
    region: Arc<InflightRegion>,
    base: usize,
    size: u16,
}

/// What a restarted queue must do first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovery {
    /// Heads taken and never returned used, oldest first: resubmit them.
    pub resubmit: Vec<u16>,
    /// Where taking new chains resumes: the used index plus the heads
    /// still in flight.
    pub next_avail: u16,
    /// The next take's order counter.
    pub counter: u64,
}

impl QueueInflight {
    fn put<T: vm_memory::ByteValued>(&self, off: usize, v: T) {
        let _ = self
            .region
            .map
            .as_volatile_slice()
            .write_obj(v, self.base + off);
    }
    fn get<T: vm_memory::ByteValued + Default>(&self, off: usize) -> T {
        self.region
            .map
            .as_volatile_slice()
            .read_obj(self.base + off)
            .unwrap_or_default()
    }
    fn entry(&self, head: u16) -> usize {
        HEADER + head as usize * ENTRY
    }

    fn init(&self) {
        self.put(8, VERSION);
        self.put(10, self.size);
    }

    /// Whether a backend has used this part (version set).
    fn initialised(&self) -> bool {
        self.get::<u16>(8) != 0
    }

    /// Ring size this part was laid out for.
    pub fn size(&self) -> u16 {
        self.size
    }

    /// A chain with head `head` was taken (`counter` orders takes).
    pub fn taken(&self, head: u16, counter: u64) {
        if head >= self.size {
            return;
        }
        let e = self.entry(head);
        self.put(e + 8, counter);
        compiler_fence(Ordering::SeqCst);
        self.put(e, 1u8);
    }

    /// `head` goes into the used ring with the batch being built: linked
    /// into the last-batch list (its `next` the previous batch head).
    pub fn batch_add(&self, head: u16) {
        if head >= self.size {
            return;
        }
        let prev: u16 = self.get(12);
        self.put(self.entry(head) + 6, prev);
        compiler_fence(Ordering::SeqCst);
        self.put(12, head);
        compiler_fence(Ordering::SeqCst);
    }

    /// After the used index moved to `used_idx` with the batch in it: the
    /// batch's entries are no longer in flight.
    pub fn batch_done(&self, used_idx: u16) {
        compiler_fence(Ordering::SeqCst);
        let n = used_idx.wrapping_sub(self.get::<u16>(14));
        self.clear_last_batch(n);
        compiler_fence(Ordering::SeqCst);
        self.put(14, used_idx);
    }

    /// Clears `n` entries of the last-batch list (bounded by the ring
    /// size: a damaged list cannot loop).
    fn clear_last_batch(&self, n: u16) {
        let mut head: u16 = self.get(12);
        for _ in 0..n.min(self.size) {
            if head >= self.size {
                break;
            }
            self.put(self.entry(head), 0u8);
            head = self.get(self.entry(head) + 6);
        }
    }

    /// At queue start: reconciles the region with the used index in guest
    /// memory (a backend killed between adding to the used ring and
    /// clearing the entry left the last head marked) and lists what to
    /// resubmit.
    pub fn recover(&self, used_idx: u16) -> Recovery {
        if !self.initialised() {
            // Never used by a backend: nothing to resubmit.
            self.init();
            self.put(14, used_idx);
            return Recovery {
                resubmit: Vec::new(),
                next_avail: used_idx,
                counter: 1,
            };
        }
        let stored = self.get::<u16>(14);
        if stored != used_idx {
            // Killed between moving the used index and clearing the
            // batch: the batch is the last `used_idx - stored` links.
            self.clear_last_batch(used_idx.wrapping_sub(stored));
            compiler_fence(Ordering::SeqCst);
            self.put(14, used_idx);
        }
        let mut heads: Vec<(u64, u16)> = (0..self.size)
            .filter(|&h| self.get::<u8>(self.entry(h)) == 1)
            .map(|h| (self.get::<u64>(self.entry(h) + 8), h))
            .collect();
        heads.sort_unstable();
        let counter = heads.last().map(|h| h.0 + 1).unwrap_or(1);
        Recovery {
            next_avail: used_idx.wrapping_add(heads.len() as u16),
            resubmit: heads.into_iter().map(|h| h.1).collect(),
            counter,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_follow_libvhost_user() {
        assert_eq!(queue_region_size(128), 2112);
        assert_eq!(queue_region_size(256), 4160);
        assert!(queue_region_size(1) >= (HEADER + ENTRY) as u64);
    }

    #[test]
    fn a_fresh_region_resubmits_nothing() {
        let (r, _f) = InflightRegion::create(2, 128, false).unwrap();
        let q = r.queue(1);
        let rec = q.recover(0);
        assert!(rec.resubmit.is_empty());
        assert_eq!(rec.next_avail, 0);
    }

    #[test]
    fn a_restart_resubmits_what_was_in_flight_in_order() {
        let (r, f) = InflightRegion::create(2, 128, false).unwrap();
        let q = r.queue(1);
        q.recover(0);
        // Taken 5, 9, 3, 7 in that order; 9 and 7 completed.
        for (c, h) in [(1, 5u16), (2, 9), (3, 3), (4, 7)] {
            q.taken(h, c);
        }
        q.batch_add(9);
        q.batch_done(1);
        q.batch_add(7);
        q.batch_done(2);
        // The process dies; the frontend hands the file to a new one.
        let size = queue_region_size(128) * 2;
        drop(q);
        drop(r);
        let r2 = InflightRegion::open(f, 0, size, 2, 128).unwrap();
        let rec = r2.queue(1).recover(2);
        assert_eq!(rec.resubmit, vec![5, 3]);
        assert_eq!(rec.next_avail, 4);
        assert_eq!(rec.counter, 4);
        // Queue 0 was never touched.
        assert!(r2.queue(0).recover(0).resubmit.is_empty());
    }

    #[test]
    fn killed_between_used_ring_and_region_forgets_the_last_head() {
        let (r, _f) = InflightRegion::create(1, 64, false).unwrap();
        let q = r.queue(0);
        q.recover(0);
        q.taken(4, 1);
        q.taken(6, 2);
        q.batch_add(6);
        // Used index moved to 1 in guest memory, then SIGKILL before
        // batch_done: 6 is still marked.
        let rec = q.recover(1);
        assert_eq!(rec.resubmit, vec![4]);
        assert_eq!(rec.next_avail, 2);
    }

    #[test]
    fn killed_after_publishing_a_batch_forgets_the_whole_batch() {
        let (r, _f) = InflightRegion::create(1, 64, false).unwrap();
        let q = r.queue(0);
        q.recover(0);
        for (c, h) in [(1, 10u16), (2, 11), (3, 12), (4, 13), (5, 14)] {
            q.taken(h, c);
        }
        // A first batch of one, done.
        q.batch_add(12);
        q.batch_done(1);
        // A batch of three pushed and published (used index 4 in guest
        // memory), then SIGKILL before batch_done.
        for h in [14, 10, 13] {
            q.batch_add(h);
        }
        let rec = q.recover(4);
        assert_eq!(rec.resubmit, vec![11]);
        assert_eq!(rec.next_avail, 5);
        // A batch pushed but not published: all of it is resubmitted.
        q.batch_add(11);
        let rec = q.recover(4);
        assert_eq!(rec.resubmit, vec![11]);
    }

    #[test]
    fn a_short_file_is_refused() {
        let (_r, f) = InflightRegion::create(1, 64, false).unwrap();
        assert!(InflightRegion::open(f, 0, 64, 4, 256).is_err());
    }
}
