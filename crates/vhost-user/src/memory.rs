//! The frontend's memory table: regions shared as file descriptors
//! (SET_MEM_TABLE, or ADD_MEM_REG / REM_MEM_REG with CONFIGURE_MEM_SLOTS),
//! mapped once each, and the translation of the frontend's own virtual
//! addresses (vring addresses) to guest physical ones.
//!
//! A region is checked before it is mapped: page-aligned offset, non-zero
//! size, and inside its file (mapping past a memfd's end would turn a
//! guest's access into SIGBUS in the backend). Queues read the current map
//! through a [`GuestMemoryAtomic`]; an I/O in flight holds its own `Arc`, so
//! a region removed meanwhile stays mapped until that I/O is done.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use vm_memory::{
    FileOffset, GuestAddress, GuestMemoryAtomic, GuestMemoryMmap, GuestRegionMmap, MmapRegion,
};

/// Memory slots offered with CONFIGURE_MEM_SLOTS (QEMU's own limit is 509;
/// libblkio uses a handful).
pub const MAX_SLOTS: usize = 32;

/// One region as the frontend described it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionDesc {
    pub guest_phys_addr: u64,
    pub size: u64,
    /// The frontend's virtual address of the region (vring addresses use it).
    pub user_addr: u64,
    pub mmap_offset: u64,
}

/// Why a region was refused.
#[derive(Debug, thiserror::Error)]
pub enum MemError {
    #[error("region of size 0")]
    Empty,
    #[error("region wraps the address space")]
    Wraps,
    #[error("mmap offset {0:#x} not page aligned")]
    Unaligned(u64),
    #[error("region {off:#x}+{size:#x} beyond its file's {file:#x} bytes")]
    BeyondFile { off: u64, size: u64, file: u64 },
    #[error("region overlaps another")]
    Overlap,
    #[error("no free memory slot (at most {MAX_SLOTS})")]
    NoSlot,
    #[error("no such region")]
    NotFound,
    #[error("mapping the region: {0}")]
    Map(String),
}

/// The mapped table.
pub struct MemTable {
    regions: Vec<(RegionDesc, Arc<GuestRegionMmap>)>,
    atomic: GuestMemoryAtomic<GuestMemoryMmap>,
    /// Bumped (release) after each replacement of the map: a queue loads
    /// this plain counter every pass and reads the map itself (an
    /// `arc-swap` load and an `Arc` clone) only when it moved.
    gen: Arc<AtomicU64>,
}

impl Default for MemTable {
    fn default() -> Self {
        MemTable {
            regions: Vec::new(),
            atomic: GuestMemoryAtomic::new(GuestMemoryMmap::new()),
            gen: Arc::new(AtomicU64::new(0)),
        }
    }
}

impl MemTable {
    /// What the queues read the guest's memory through.
    pub fn atomic(&self) -> GuestMemoryAtomic<GuestMemoryMmap> {
        self.atomic.clone()
    }

    /// The counter bumped after each change of [`Self::atomic`]'s map.
    pub fn generation(&self) -> Arc<AtomicU64> {
        self.gen.clone()
    }

    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }

    pub fn len(&self) -> usize {
        self.regions.len()
    }

    /// Replaces the whole table (SET_MEM_TABLE).
    pub fn set(&mut self, regions: Vec<(RegionDesc, File)>) -> Result<(), MemError> {
        if regions.len() > MAX_SLOTS {
            return Err(MemError::NoSlot);
        }
        let mut new = Vec::with_capacity(regions.len());
        for (d, f) in regions {
            let r = map(&d, f)?;
            if overlaps(&new, &d) {
                return Err(MemError::Overlap);
            }
            new.push((d, r));
        }
        self.regions = new;
        self.publish()
    }

    /// Adds one region (ADD_MEM_REG).
    pub fn add(&mut self, d: RegionDesc, f: File) -> Result<(), MemError> {
        if self.regions.len() == MAX_SLOTS {
            return Err(MemError::NoSlot);
        }
        if overlaps(&self.regions, &d) {
            return Err(MemError::Overlap);
        }
        let r = map(&d, f)?;
        self.regions.push((d, r));
        self.publish()
    }

    /// Removes the region with this guest address, size and user address
    /// (REM_MEM_REG).
    pub fn remove(&mut self, d: &RegionDesc) -> Result<(), MemError> {
        let i = self
            .regions
            .iter()
            .position(|(r, _)| {
                r.guest_phys_addr == d.guest_phys_addr
                    && r.size == d.size
                    && r.user_addr == d.user_addr
            })
            .ok_or(MemError::NotFound)?;
        self.regions.remove(i);
        self.publish()
    }

    /// Drops every region (disconnect, RESET_OWNER).
    pub fn clear(&mut self) {
        self.regions.clear();
        let _ = self.publish();
    }

    /// The guest physical address of the frontend's virtual address `va`
    /// (vring addresses are given in the frontend's address space).
    pub fn va_to_gpa(&self, va: u64) -> Option<u64> {
        self.regions.iter().find_map(|(r, _)| {
            let off = va.checked_sub(r.user_addr)?;
            (off < r.size).then(|| r.guest_phys_addr + off)
        })
    }

    fn publish(&mut self) -> Result<(), MemError> {
        // vm-memory wants its regions in address order.
        self.regions.sort_by_key(|(r, _)| r.guest_phys_addr);
        let regions: Vec<Arc<GuestRegionMmap>> =
            self.regions.iter().map(|(_, r)| r.clone()).collect();
        let mem = if regions.is_empty() {
            GuestMemoryMmap::new()
        } else {
            GuestMemoryMmap::from_arc_regions(regions).map_err(|e| MemError::Map(e.to_string()))?
        };
        self.atomic
            .lock()
            .map_err(|_| MemError::Map("poisoned".into()))?
            .replace(mem);
        self.gen.fetch_add(1, Ordering::Release);
        Ok(())
    }
}

fn overlaps(have: &[(RegionDesc, Arc<GuestRegionMmap>)], d: &RegionDesc) -> bool {
    let end = d.guest_phys_addr.saturating_add(d.size);
    have.iter()
        .any(|(r, _)| d.guest_phys_addr < r.guest_phys_addr + r.size && r.guest_phys_addr < end)
}

fn check(d: &RegionDesc, file_len: u64) -> Result<(), MemError> {
    if d.size == 0 {
        return Err(MemError::Empty);
    }
    if d.guest_phys_addr.checked_add(d.size).is_none() || d.user_addr.checked_add(d.size).is_none()
    {
        return Err(MemError::Wraps);
    }
    // SAFETY: sysconf has no memory-safety preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
    if d.mmap_offset % page != 0 {
        return Err(MemError::Unaligned(d.mmap_offset));
    }
    match d.mmap_offset.checked_add(d.size) {
        Some(end) if end <= file_len => Ok(()),
        _ => Err(MemError::BeyondFile {
            off: d.mmap_offset,
            size: d.size,
            file: file_len,
        }),
    }
}

fn file_len(f: &File) -> Result<u64, MemError> {
    // SAFETY: an all-zero stat is a valid value; fstat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: f is an open descriptor and st a valid out pointer.
    if unsafe { libc::fstat(f.as_raw_fd(), &mut st) } != 0 {
        return Err(MemError::Map(std::io::Error::last_os_error().to_string()));
    }
    Ok(st.st_size as u64)
}

fn map(d: &RegionDesc, f: File) -> Result<Arc<GuestRegionMmap>, MemError> {
    check(d, file_len(&f)?)?;
    let size = usize::try_from(d.size).map_err(|_| MemError::Wraps)?;
    let region = MmapRegion::from_file(FileOffset::new(f, d.mmap_offset), size)
        .map_err(|e| MemError::Map(e.to_string()))?;
    let r = GuestRegionMmap::new(region, GuestAddress(d.guest_phys_addr)).ok_or(MemError::Wraps)?;
    Ok(Arc::new(r))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd(len: u64) -> File {
        // SAFETY: a valid NUL-terminated name; the fd is owned by the File.
        let fd = unsafe { libc::memfd_create(c"t".as_ptr(), 0) };
        assert!(fd >= 0);
        use std::os::fd::FromRawFd;
        // SAFETY: fd is ours and open.
        let f = unsafe { File::from_raw_fd(fd) };
        f.set_len(len).unwrap();
        f
    }

    fn desc(gpa: u64, size: u64, off: u64) -> RegionDesc {
        RegionDesc {
            guest_phys_addr: gpa,
            size,
            user_addr: 0x7000_0000_0000u64.wrapping_add(gpa),
            mmap_offset: off,
        }
    }

    #[test]
    fn regions_are_checked_before_mapping() {
        let mut t = MemTable::default();
        assert!(matches!(
            t.add(desc(0, 0, 0), memfd(4096)),
            Err(MemError::Empty)
        ));
        assert!(matches!(
            t.add(desc(0, 4096, 100), memfd(8192)),
            Err(MemError::Unaligned(100))
        ));
        assert!(matches!(
            t.add(desc(0, 8192, 0), memfd(4096)),
            Err(MemError::BeyondFile { .. })
        ));
        assert!(matches!(
            t.add(desc(u64::MAX - 10, 4096, 0), memfd(4096)),
            Err(MemError::Wraps)
        ));
        t.add(desc(0, 8192, 0), memfd(8192)).unwrap();
        assert!(matches!(
            t.add(desc(4096, 8192, 0), memfd(8192)),
            Err(MemError::Overlap)
        ));
        t.add(desc(1 << 20, 4096, 4096), memfd(8192)).unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t.va_to_gpa(0x7000_0000_0000 + 100), Some(100));
        assert_eq!(t.va_to_gpa(0x7000_0000_0000 + 9000), None);
        t.remove(&desc(0, 8192, 0)).unwrap();
        assert!(matches!(
            t.remove(&desc(0, 8192, 0)),
            Err(MemError::NotFound)
        ));
        assert_eq!(t.len(), 1);
    }
}
