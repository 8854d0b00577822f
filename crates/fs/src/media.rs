//! The memory a file system lives in, and how a range of it is made durable.
//!
//! On a file mapped shared (any file system that implements msync)
//! persistence is `msync(MS_SYNC)` of the range: there is no real
//! persistent memory on the machines this runs on, so cache-line flushes
//! plus a fence (what a DAX mapping would need) would not make anything
//! durable here. On tmpfs (/dev/shm) the mapped pages are the file: a
//! store is in the file once made and outlives the process (SIGKILL
//! included), and msync there returns without doing anything, so persist
//! is a fence (it keeps the order the callers rely on, data before the
//! metadata pointing to it) and no system call: a 4 KiB write's commit
//! made five. A `Vec<u8>` is volatile memory for tests.
//!
//! The region may also be a block device (a disk partition, a loop or
//! zram device): it is mapped shared through the device's page cache and
//! msync writes the pages back to the device. Such a region (and a file on
//! a disk file system) can have pages that are not in memory: touching
//! one blocks on the device, so the server asks [`resident`] before it
//! sends a read from the reactor and faults pages in off the reactor
//! ([`populate`]) when they are not.

use std::fs::OpenOptions;
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::FileTypeExt;
use std::path::Path;

/// A byte region plus the call that makes a range of it durable.
pub trait Media: Send {
    fn bytes(&self) -> &[u8];
    fn bytes_mut(&mut self) -> &mut [u8];
    /// Returns once `bytes[off..off + len]` survives a crash.
    fn persist(&self, off: usize, len: usize) -> io::Result<()>;
}

impl Media for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
    fn persist(&self, _off: usize, _len: usize) -> io::Result<()> {
        Ok(())
    }
}

/// A region file mapped shared into this process.
pub struct MappedFile {
    map: memmap2::MmapMut,
    /// On tmpfs/ramfs: nothing for msync to write back.
    in_memory: bool,
}

/// Whether `path` is a block device.
pub fn is_block_device(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device())
}

/// Whether pages of a region at `path` can be out of memory (so touching
/// them may block on a device): a block device, or a file on anything but
/// tmpfs/ramfs.
pub fn may_fault(path: &Path) -> bool {
    const TMPFS_MAGIC: u64 = 0x0102_1994;
    const RAMFS_MAGIC: u64 = 0x8584_58f6;
    if is_block_device(path) {
        return true;
    }
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return true;
    };
    // SAFETY: `c` is a NUL-terminated path and `st` a zeroed statfs the
    // call fills; nothing else is touched.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return true;
    }
    // f_type's width differs between targets; the magics are 32-bit.
    let t = st.f_type as u64 & 0xffff_ffff;
    t != TMPFS_MAGIC && t != RAMFS_MAGIC
}

impl MappedFile {
    /// Maps an existing region of its whole length: a file, or a block
    /// device (whose length is where a seek to its end lands).
    pub fn open(path: &Path) -> io::Result<Self> {
        let mut f = OpenOptions::new().read(true).write(true).open(path)?;
        let len = f.seek(SeekFrom::End(0))?;
        let len = usize::try_from(len).map_err(|_| io::Error::other("region too large"))?;
        // SAFETY: the region file belongs to this file service; another
        // process truncating it under us is outside the supported use (as it
        // is for any mmap-based store) and would fault, not corrupt memory
        // safety within the mapping's bounds.
        let map = unsafe { memmap2::MmapOptions::new().len(len).map_mut(&f)? };
        Ok(Self {
            map,
            in_memory: !may_fault(path),
        })
    }

    /// Creates (or resizes) a region file of `size` bytes and maps it. A
    /// block device keeps its size: `size` must not exceed it and the whole
    /// device is the region.
    pub fn create(path: &Path, size: u64) -> io::Result<Self> {
        if is_block_device(path) {
            let m = Self::open(path)?;
            if size > m.map.len() as u64 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "{} holds {} bytes, fewer than {size}",
                        path.display(),
                        m.map.len()
                    ),
                ));
            }
            return Ok(m);
        }
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        f.set_len(size)?;
        drop(f);
        Self::open(path)
    }
}

impl Media for MappedFile {
    fn bytes(&self) -> &[u8] {
        &self.map
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map
    }
    fn persist(&self, off: usize, len: usize) -> io::Result<()> {
        if self.in_memory {
            // The stores are in the file already (see the module doc).
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            return Ok(());
        }
        // memmap2 rounds the range out to whole pages for msync.
        self.map.flush_range(off, len)
    }
}

const PAGE: usize = 4096;

/// The pages covering `ptr..ptr + len`, from a page boundary.
fn pages(ptr: *const u8, len: usize) -> (usize, usize) {
    let start = ptr as usize & !(PAGE - 1);
    let end = (ptr as usize + len).div_ceil(PAGE) * PAGE;
    (start, end)
}

/// Whether every page of `ptr..ptr + len` (inside a mapping of this
/// process) is in memory, so that reading it cannot block on a device.
/// An error answers false (the caller then faults them in off the reactor).
pub fn resident(ptr: *const u8, len: usize) -> bool {
    if len == 0 {
        return true;
    }
    let (mut at, end) = pages(ptr, len);
    let mut vec = [0u8; 64];
    // Budget: 64 pages per call, (len / 256 KiB) + 1 calls.
    while at < end {
        let n = ((end - at) / PAGE).min(vec.len());
        // SAFETY: `at..at + n pages` lies inside the caller's mapping
        // (page-aligned as mincore requires) and `vec` has room for one
        // byte per page; mincore only writes `vec`.
        let r = unsafe { libc::mincore(at as *mut libc::c_void, n * PAGE, vec.as_mut_ptr()) };
        if r != 0 || vec[..n].iter().any(|v| v & 1 == 0) {
            return false;
        }
        at += n * PAGE;
    }
    true
}

/// Turns the kernel's read-around for faults on `ptr..ptr + len` (inside a
/// mapping of this process) off (`on` false) or back on. Start-up recovery
/// touches inodes and indirect blocks scattered over the region; with
/// read-around each touch would read the data around it too, so opening a
/// region on a device would read most of the device. Advice only: an error
/// changes nothing but speed, so it is ignored.
pub fn readaround(ptr: *mut u8, len: usize, on: bool) {
    let advice = if on {
        libc::MADV_NORMAL
    } else {
        libc::MADV_RANDOM
    };
    // SAFETY: the range lies inside the caller's mapping (its start is the
    // page-aligned mapping base); the advice changes no data.
    unsafe { libc::madvise(ptr as *mut libc::c_void, len, advice) };
}

/// Brings the pages of `ptr..ptr + len` (inside a mapping of this process)
/// into memory; blocks while the device reads them. Meant for a thread
/// that may block, before a send from the reactor reads them.
pub fn populate(ptr: *const u8, len: usize) {
    if len == 0 {
        return;
    }
    let (start, end) = pages(ptr, len);
    // SAFETY: the range lies inside the caller's mapping; POPULATE_READ
    // only faults pages in (no data changes).
    let r = unsafe {
        libc::madvise(
            start as *mut libc::c_void,
            end - start,
            libc::MADV_POPULATE_READ,
        )
    };
    if r != 0 {
        // Older kernels: touch one byte per page.
        let mut at = start.max(ptr as usize);
        while at < ptr as usize + len {
            // SAFETY: `at` lies inside the caller's mapping; a volatile
            // read of one byte is the fault.
            unsafe { std::ptr::read_volatile(at as *const u8) };
            at = (at & !(PAGE - 1)) + PAGE;
        }
    }
}
