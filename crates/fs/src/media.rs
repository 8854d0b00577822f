//! The memory a file system lives in, and how a range of it is made durable.
//!
//! On a file mapped shared (a file under /dev/shm, or any file system that
//! implements msync) persistence is `msync(MS_SYNC)` of the range: there is
//! no real persistent memory on the machines this runs on, so cache-line
//! flushes plus a fence (what a DAX mapping would need) would not make
//! anything durable here. A `Vec<u8>` is volatile memory for tests.

use std::fs::OpenOptions;
use std::io;
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
}

impl MappedFile {
    /// Maps an existing region file of its whole length.
    pub fn open(path: &Path) -> io::Result<Self> {
        let f = OpenOptions::new().read(true).write(true).open(path)?;
        // SAFETY: the region file belongs to this file service; another
        // process truncating it under us is outside the supported use (as it
        // is for any mmap-based store) and would fault, not corrupt memory
        // safety within the mapping's bounds.
        let map = unsafe { memmap2::MmapMut::map_mut(&f)? };
        Ok(Self { map })
    }

    /// Creates (or resizes) a region file of `size` bytes and maps it.
    pub fn create(path: &Path, size: u64) -> io::Result<Self> {
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
        // memmap2 rounds the range out to whole pages for msync.
        self.map.flush_range(off, len)
    }
}
