//! DMA memory and the IOVA space of one VFIO container: a bump allocator
//! of IOVAs inside the IOMMU's usable range, and the list of mappings that
//! turns a process address into an IOVA by arithmetic.

use std::cell::{Cell, RefCell};

use crate::{Result, VfioError};

/// Lowest IOVA handed out: page 0 and the legacy low memory stay unmapped,
/// so a zero or small bogus address from a driver faults.
pub(crate) const IOVA_BASE: u64 = 0x1000_0000;
/// Highest IOVA (exclusive): below the x86 MSI window at 0xfee00000, which
/// an IOMMU reserves, and below 4 GiB for HBAs with 32-bit DMA windows.
pub(crate) const IOVA_LIMIT: u64 = 0xfee0_0000;
const IOVA_ALIGN: u64 = 1 << 16;

/// Memory a device can DMA to: `len` bytes at `ptr` in this process, at
/// `iova` on the bus. Zeroed when allocated. Owned by the [`crate::Vfio`]
/// that allocated it: valid (and mapped) as long as that lives.
#[derive(Clone, Copy, Debug)]
pub struct DmaMem {
    pub ptr: *mut u8,
    pub len: usize,
    pub iova: u64,
}

impl DmaMem {
    /// IOVA of byte `off`.
    pub fn iova_at(&self, off: usize) -> u64 {
        self.iova + off as u64
    }

    /// Pointer to byte `off`; `None` past the end.
    pub fn at(&self, off: usize) -> Option<*mut u8> {
        // SAFETY: off < len keeps the pointer inside our own mapping.
        (off < self.len).then(|| unsafe { self.ptr.add(off) })
    }
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Mapping {
    pub vaddr: usize,
    pub len: usize,
    pub iova: u64,
    /// Ours to munmap at the end (allocated by `alloc`), or borrowed.
    pub owned: bool,
}

/// IOVAs of one container.
pub(crate) struct IovaSpace {
    next: Cell<u64>,
    limit: u64,
    pub(crate) maps: RefCell<Vec<Mapping>>,
}

impl IovaSpace {
    pub(crate) fn new(limit: u64) -> IovaSpace {
        IovaSpace {
            next: Cell::new(IOVA_BASE),
            limit: limit.min(IOVA_LIMIT),
            maps: RefCell::new(Vec::new()),
        }
    }

    /// Reserves `len` bytes of IOVA space.
    pub(crate) fn reserve(&self, len: usize) -> Result<u64> {
        let len = (len as u64).div_ceil(IOVA_ALIGN) * IOVA_ALIGN;
        let at = self.next.get();
        if at.checked_add(len).is_none_or(|end| end > self.limit) {
            return Err(VfioError::NoIova(len));
        }
        self.next.set(at + len);
        Ok(at)
    }

    /// The IOVA of `[addr, addr+len)` if one mapping holds all of it.
    pub(crate) fn translate(&self, addr: usize, len: usize) -> Option<u64> {
        let maps = self.maps.borrow();
        maps.iter().find_map(|m| {
            let off = addr.checked_sub(m.vaddr)?;
            (off.checked_add(len)? <= m.len).then_some(m.iova + off as u64)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iovas_stay_in_the_window_and_translate_by_offset() {
        let s = IovaSpace::new(1 << 39);
        let a = s.reserve(4096).unwrap();
        assert_eq!(a, IOVA_BASE);
        let b = s.reserve(100_000).unwrap();
        assert_eq!(b, IOVA_BASE + IOVA_ALIGN);
        assert!(matches!(s.reserve(1 << 40), Err(VfioError::NoIova(_))));
        s.maps.borrow_mut().push(Mapping {
            vaddr: 0x7000_0000,
            len: 0x2000,
            iova: b,
            owned: false,
        });
        assert_eq!(s.translate(0x7000_1000, 0x1000), Some(b + 0x1000));
        assert_eq!(s.translate(0x7000_1000, 0x1001), None);
        assert_eq!(s.translate(0x6fff_f000, 16), None);
        // A small IOMMU (or a 32-bit one) lowers the limit.
        let small = IovaSpace::new(IOVA_BASE + 0x1_0000);
        assert!(small.reserve(0x1_0000).is_ok());
        assert!(small.reserve(1).is_err());
    }
}
