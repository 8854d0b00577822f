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

use std::fs::File;
use std::os::fd::FromRawFd;
use std::sync::atomic::{compiler_fence, Ordering};
use std::sync::Arc;

use vm_memory::{Bytes, FileOffset, MmapRegion, VolatileMemory};

const HEADER: usize = 16;
const ENTRY: usize = 16;
const ALIGN: u64 = 64;
const VERSION: u16 = 1;

/// Bytes of one queue's part of the region.
pub fn queue_region_size(queue_size: u16) -> u64 {
    (ENTRY as u64 * queue_size as u64 + 2).div_ceil(ALIGN) * ALIGN
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
}

impl InflightRegion {
    /// GET_INFLIGHT_FD: a fresh zeroed memfd for `num_queues` queues of
    /// `queue_size`; returns the region and the file to hand over.
    pub fn create(num_queues: u16, queue_size: u16) -> Result<(Arc<Self>, File), InflightError> {
        let size = queue_region_size(queue_size) * num_queues as u64;
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
        for q in 0..num_queues {
            r.queue(q).init();
        }
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
        Ok(Arc::new(InflightRegion {
            map,
            queue_size,
            num_queues,
        }))
    }

    pub fn queue_size(&self) -> u16 {
        self.queue_size
    }

    /// Queues the region was laid out for.
    pub fn num_queues(&self) -> u16 {
        self.num_queues
    }

    /// Queue `q`'s part (the caller keeps `q` below `num_queues`).
    pub fn queue(self: &Arc<Self>, q: u16) -> QueueInflight {
        assert!(q < self.num_queues, "queue {q} beyond the region");
        QueueInflight {
            region: self.clone(),
            base: queue_region_size(self.queue_size) as usize * q as usize,
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

    /// Before `head` goes into the used ring.
    pub fn pre_put(&self, head: u16) {
        self.put(12, head);
        compiler_fence(Ordering::SeqCst);
    }

    /// After the used index moved to `used_idx` with `head` in it.
    pub fn post_put(&self, head: u16, used_idx: u16) {
        compiler_fence(Ordering::SeqCst);
        if head < self.size {
            self.put(self.entry(head), 0u8);
        }
        compiler_fence(Ordering::SeqCst);
        self.put(14, used_idx);
    }

    /// At queue start: reconciles the region with the used index in guest
    /// memory (a backend killed between adding to the used ring and
    /// clearing the entry left the last head marked) and lists what to
    /// resubmit.
    pub fn recover(&self, used_idx: u16) -> Recovery {
        if self.get::<u16>(8) == 0 {
            // Never used by a backend: nothing to resubmit.
            self.init();
            self.put(14, used_idx);
            return Recovery {
                resubmit: Vec::new(),
                next_avail: used_idx,
                counter: 1,
            };
        }
        if self.get::<u16>(14) != used_idx {
            let last = self.get::<u16>(12);
            if last < self.size {
                self.put(self.entry(last), 0u8);
            }
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
        let (r, _f) = InflightRegion::create(2, 128).unwrap();
        let q = r.queue(1);
        let rec = q.recover(0);
        assert!(rec.resubmit.is_empty());
        assert_eq!(rec.next_avail, 0);
    }

    #[test]
    fn a_restart_resubmits_what_was_in_flight_in_order() {
        let (r, f) = InflightRegion::create(2, 128).unwrap();
        let q = r.queue(1);
        q.recover(0);
        // Taken 5, 9, 3, 7 in that order; 9 and 7 completed.
        for (c, h) in [(1, 5u16), (2, 9), (3, 3), (4, 7)] {
            q.taken(h, c);
        }
        q.pre_put(9);
        q.post_put(9, 1);
        q.pre_put(7);
        q.post_put(7, 2);
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
        let (r, _f) = InflightRegion::create(1, 64).unwrap();
        let q = r.queue(0);
        q.recover(0);
        q.taken(4, 1);
        q.taken(6, 2);
        q.pre_put(6);
        // Used index moved to 1 in guest memory, then SIGKILL before
        // post_put: 6 is still marked.
        let rec = q.recover(1);
        assert_eq!(rec.resubmit, vec![4]);
        assert_eq!(rec.next_avail, 2);
    }

    #[test]
    fn a_short_file_is_refused() {
        let (_r, f) = InflightRegion::create(1, 64).unwrap();
        assert!(InflightRegion::open(f, 0, 64, 4, 256).is_err());
    }
}
