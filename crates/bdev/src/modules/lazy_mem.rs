//! The malloc bdev's memory: an anonymous mapping whose pages are faulted in
//! by the first write to them, 4 KiB at a time, on the reactor that writes.
//!
//! Why: faulting the whole disk in at creation (SPDK's zeroed allocation)
//! made `ustor serve`'s default 1 GiB disk cost ~3 s and 1 GiB of RSS before
//! the first client could connect. Transparent huge pages are the wrong unit
//! for a first write: allocating one may run direct compaction, measured
//! here at 4.4 ms per 2 MiB on a host with fragmented free memory (0.2 ms
//! when huge pages are free), and stalls of 40 ms to over a second were
//! seen mid-I/O. Handing that work to a thread was tried and measured worse:
//! with every core busy polling (an NVMe/TCP target and its initiator on a
//! 2-core host) the thread waited milliseconds for a CPU, and fresh-disk
//! random writes ran at 3-7 K IOPS against nvmf_tgt's 60 K. A 4 KiB page
//! fault costs ~1.5 µs, never compacts, and is paid once per page. So lazy
//! disks are mapped `MADV_NOHUGEPAGE`; disks filled up front (`ustor bench`'s
//! `malloc:SIZE`, which times copies, as bdevperf's hugepage disk does) are
//! mapped `MADV_HUGEPAGE` and populated at creation, off the reactors.
//!
//! A bitmap records which 2 MiB extents have been written: reads of extents
//! never written are answered with zeros without touching the mapping, and
//! unmap and write zeroes skip them (they read as zeros already).

use std::sync::atomic::{AtomicU64, Ordering};

/// Unit of the written-extent bitmap (one transparent huge page on x86-64,
/// the unit a populated disk is faulted in by).
pub(crate) const EXTENT: usize = 2 << 20;

/// Linux 5.14's MADV_POPULATE_WRITE (not in every libc crate release).
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// How much of a byte range has been written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Resident {
    All,
    None,
    Some,
}

pub(crate) struct Mem {
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
    /// One bit per extent, set (Release) by the first write to the extent,
    /// before its data is copied in; an extent whose bit is clear reads as
    /// zeros without the mapping being touched.
    written: Box<[AtomicU64]>,
}

// SAFETY: the mapping is plain memory valid for the bdev's life; concurrent
// access from several reactors is to disjoint or
// initiator-ordered ranges, with raw copies only (no references are formed
// across threads); the bitmap is atomics.
unsafe impl Send for Mem {}
unsafe impl Sync for Mem {}

impl Drop for Mem {
    fn drop(&mut self) {
        // SAFETY: ptr/len come from our mmap.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

impl Mem {
    /// Maps `len` bytes without faulting any of it in: with 4 KiB pages for
    /// a lazy disk, with transparent huge pages advised for one that
    /// [`Mem::populate_all`] fills at once.
    pub(crate) fn map(len: usize, huge: bool) -> std::io::Result<Mem> {
        // SAFETY: anonymous private mapping, checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        // A populated disk: huge pages where the kernel offers them (no
        // hugetlbfs, no reservation), or random 4 KiB I/O over a large disk
        // pays a TLB miss on nearly every copy. A lazy disk: 4 KiB pages
        // even where THP is "always", so a reactor's first write never
        // allocates (or compacts for) a huge page. Advice only.
        let advice = if huge {
            libc::MADV_HUGEPAGE
        } else {
            libc::MADV_NOHUGEPAGE
        };
        // SAFETY: advice on the mapping just made; no memory is accessed.
        unsafe { libc::madvise(p, len, advice) };
        let words = len.div_ceil(EXTENT).div_ceil(64);
        Ok(Mem {
            ptr: p.cast(),
            len,
            written: (0..words).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    fn extents(off: usize, len: usize) -> std::ops::Range<usize> {
        off / EXTENT..(off + len.max(1)).div_ceil(EXTENT)
    }

    fn is_written(&self, e: usize) -> bool {
        self.written[e / 64].load(Ordering::Acquire) & (1 << (e % 64)) != 0
    }

    /// How much of `[off, off+len)` has been written.
    pub(crate) fn resident(&self, off: usize, len: usize) -> Resident {
        let r = Self::extents(off, len);
        let n = r.len();
        let have = r.filter(|e| self.is_written(*e)).count();
        match have {
            h if h == n => Resident::All,
            0 => Resident::None,
            _ => Resident::Some,
        }
    }

    /// Marks the extents of `[off, off+len)` written (a write calls this
    /// before copying in; a plain load first, so a disk already written
    /// costs no read-modify-write).
    pub(crate) fn mark_written(&self, off: usize, len: usize) {
        for e in Self::extents(off, len) {
            let bit = 1 << (e % 64);
            if self.written[e / 64].load(Ordering::Relaxed) & bit == 0 {
                self.written[e / 64].fetch_or(bit, Ordering::Release);
            }
        }
    }

    /// Bytes of the extents written so far (for `driver_specific`): an upper
    /// bound on the RAM the disk holds, which grows by 4 KiB pages.
    pub(crate) fn resident_bytes(&self) -> u64 {
        let n: u32 = self
            .written
            .iter()
            .map(|w| w.load(Ordering::Relaxed).count_ones())
            .sum();
        (n as u64 * EXTENT as u64).min(self.len as u64)
    }

    /// Zeroes `[off, off+len)` where it was written; extents never written
    /// read as zeros already, and touching them would fault them in.
    ///
    /// # Safety
    /// `[off, off+len)` lies inside the mapping.
    pub(crate) unsafe fn zero(&self, off: usize, len: usize) {
        for e in Self::extents(off, len) {
            if !self.is_written(e) {
                continue;
            }
            let s = off.max(e * EXTENT);
            let end = (off + len).min((e + 1) * EXTENT);
            std::ptr::write_bytes(self.ptr.add(s), 0, end - s);
        }
    }

    /// Faults the whole mapping in and marks it written: a disk that is
    /// to be timed without first-touch faults. Not for a reactor (a 1 GiB
    /// disk takes ~0.2-2 s).
    pub(crate) fn populate_all(&self) -> std::io::Result<()> {
        populate_range(self.ptr, self.len)?;
        for w in self.written.iter() {
            w.store(u64::MAX, Ordering::Release);
        }
        Ok(())
    }
}

/// Faults `len` bytes at `p` in for writing.
fn populate_range(p: *mut u8, len: usize) -> std::io::Result<()> {
    // SAFETY: advice on part of a private anonymous mapping we own; the
    // kernel only faults pages in.
    if unsafe { libc::madvise(p.cast(), len, MADV_POPULATE_WRITE) } == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::EINVAL) {
        return Err(err);
    }
    // Older kernel: touch one byte per page (the mapping is zero-filled, so
    // writing zero changes nothing but residency).
    for off in (0..len).step_by(4096) {
        // SAFETY: `off < len`, inside the writable mapping.
        unsafe { std::ptr::write_volatile(p.add(off), 0) };
    }
    Ok(())
}

/// Zeroes the data segments (a read of extents never written).
///
/// # Safety
/// The iovecs are valid for writing.
pub(crate) unsafe fn zero_iov(iov: &[libc::iovec]) {
    for v in iov {
        std::ptr::write_bytes(v.iov_base as *mut u8, 0, v.iov_len);
    }
}
