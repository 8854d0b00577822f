//! The request path's view of guest memory: one memory map (the frontend's
//! table as the queue last picked it up) with its regions' guest ranges
//! and host addresses in a small table of its own, so a guest address
//! becomes a host slice with a compare or two. `vm-memory`'s lookup (a
//! binary search behind several layers of trait objects, ~60 instructions
//! a call, and a request made eight: the descriptor table, the status
//! byte's check, the header, each segment's check and the worker's slice
//! of it, the status write, the used entry and the used index) was a fifth
//! of a request's cost. The split ring's fixed-size fields (the avail
//! and used indices, descriptors, used elements, the status byte) are
//! then read and written with aligned atomic loads and stores through a
//! [`HostRange`], not through `vm-memory`'s volatile slices, whose
//! per-access checks and byte copies cost more than the access. Byte
//! runs (vhost-user-scsi's headers, responses and data, blk's split
//! headers) are copied by [`GuestMem::copy_out`] / [`GuestMem::copy_in`]
//! and ranges checked by [`GuestMem::holds`]: one translation inside a
//! region, the map's own calls only across regions.
//!
//! A view holds its map's `Arc`, so every slice it gives stays mapped for
//! as long as the view lives; a map the frontend changed
//! (SET_MEM_TABLE, ADD_MEM_REG, REM_MEM_REG) is a new view, which the
//! queue picks up between passes while requests in flight keep theirs.
//! Everything else (accesses that cross regions, the packed ring,
//! `virtio-queue`'s notification calls) goes through the map itself
//! ([`GuestMem::map`]).

use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use ustor_runtime::IoBuf;
use vm_memory::{
    Bytes, GuestAddress, GuestMemory, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
    Permissions, VolatileSlice,
};

/// A memory map and its translation table (see the module comment).
pub struct GuestMem {
    map: Arc<GuestMemoryMmap>,
    /// The map's regions: (guest start, length, host address).
    regions: Box<[(u64, u64, usize)]>,
}

impl GuestMem {
    pub fn new(map: Arc<GuestMemoryMmap>) -> GuestMem {
        let regions = map
            .iter()
            .map(|r| (r.start_addr().0, r.len(), r.as_ptr() as usize))
            .collect();
        GuestMem { map, regions }
    }

    /// A view of a map built here (tests, fuzz targets).
    pub fn from_map(map: GuestMemoryMmap) -> GuestMem {
        GuestMem::new(Arc::new(map))
    }

    /// The map itself.
    pub fn map(&self) -> &GuestMemoryMmap {
        &self.map
    }

    /// Whether this view is of `map`.
    pub fn is(&self, map: &GuestMemoryMmap) -> bool {
        std::ptr::eq(Arc::as_ptr(&self.map), map)
    }

    /// `[addr, addr + len)` when it lies inside one region (the same
    /// condition as `vm-memory`'s `get_slice`).
    #[inline]
    pub fn slice(&self, addr: GuestAddress, len: usize) -> Option<VolatileSlice<'_>> {
        let host = self.host(addr, len)?;
        // SAFETY: [host, host + len) lies inside a region whose mapping
        // stays alive while self.map does, which is at least the slice's
        // lifetime (it borrows self). Guest memory is shared with the
        // guest and only ever accessed volatilely (VolatileSlice's
        // methods), as vm-memory's slices are.
        Some(unsafe { VolatileSlice::new(host as *mut u8, len) })
    }

    /// A buffer over `[addr, addr + len)` when it lies inside one region,
    /// for the bdev to read or write in place (no copy). The caller holds
    /// this view (an `Rc` of it) until the I/O is done, so the mapping
    /// outlives the buffer.
    pub fn io_buf(&self, addr: GuestAddress, len: u32) -> Option<IoBuf> {
        let host = self.host(addr, len as usize)?;
        let ptr = NonNull::new(host as *mut u8)?;
        // SAFETY: [host, host + len) lies inside a region whose mapping
        // stays alive while self.map does, and the caller keeps this view
        // until the bdev hands the buffer back. Guest memory is shared
        // with the VM, so no Rust reference to it is created here: the
        // bdev layer reads and writes it through raw pointers (iovecs).
        Some(unsafe { IoBuf::borrowed(ptr, len) })
    }

    /// A little-endian u16 at `addr` (2-aligned, in one region), loaded
    /// atomically with `order`: the ring's indices and event fields. The
    /// same access as `vm-memory`'s `load` on a slice, without building
    /// the slice and its checks (an empty ring's poll is this one load).
    #[inline]
    pub fn load_u16(&self, addr: GuestAddress, order: Ordering) -> Option<u16> {
        self.range(addr, 2)?.load_u16(0, order)
    }

    /// A little-endian u16 stored at `addr` (2-aligned, in one region)
    /// atomically with `order`: the used ring's index. False: not guest
    /// memory or unaligned.
    #[inline]
    pub fn store_u16(&self, addr: GuestAddress, v: u16, order: Ordering) -> bool {
        self.range(addr, 2)
            .is_some_and(|r| r.store_u16(0, v, order))
    }

    /// `[addr, addr + len)` translated once, when it lies inside one
    /// region: the loads and stores of a descriptor table or a used
    /// element through it cost a bounds check each.
    #[inline]
    pub fn range(&self, addr: GuestAddress, len: usize) -> Option<HostRange<'_>> {
        let base = self.host(addr, len)?;
        Some(HostRange {
            base,
            len,
            _mem: PhantomData,
        })
    }

    /// Starts fetching the cache line of guest address `addr`; nothing
    /// when it is not guest memory.
    #[inline]
    pub fn prefetch(&self, addr: GuestAddress) {
        if let Some(p) = self.host(addr, 1) {
            prefetch(p);
        }
    }

    /// Copies `buf.len()` bytes from `addr` into `buf`: through one
    /// translation when they lie in one region, else through the map
    /// (which splits them over adjacent regions). False: not all guest
    /// memory.
    #[inline]
    pub fn copy_out(&self, addr: GuestAddress, buf: &mut [u8]) -> bool {
        match self.slice(addr, buf.len()) {
            Some(s) => s.copy_to(buf) == buf.len(),
            None => self.map.read_slice(buf, addr).is_ok(),
        }
    }

    /// Copies `src` to `addr`, as [`Self::copy_out`] in the other direction.
    #[inline]
    pub fn copy_in(&self, addr: GuestAddress, src: &[u8]) -> bool {
        match self.slice(addr, src.len()) {
            Some(s) => {
                // The slice is exactly src's length: all of it is copied.
                s.copy_from(src);
                true
            }
            None => self.map.write_slice(src, addr).is_ok(),
        }
    }

    /// Whether `[addr, addr + len)` is guest memory the device may access
    /// with `perm`: inside one region (mapped read-write from the
    /// frontend's memory table, so any access), or across regions as the
    /// map judges it.
    #[inline]
    pub fn holds(&self, addr: GuestAddress, len: usize, perm: Permissions) -> bool {
        self.slice(addr, len).is_some() || GuestMemory::check_range(&*self.map, addr, len, perm)
    }

    /// The host address of `[addr, addr + len)` when it lies inside one
    /// region.
    #[inline]
    fn host(&self, addr: GuestAddress, len: usize) -> Option<usize> {
        for &(start, size, host) in self.regions.iter() {
            let off = addr.0.wrapping_sub(start);
            if off < size {
                if len as u64 > size - off {
                    return None;
                }
                return Some(host + off as usize);
            }
        }
        None
    }
}

/// A range of guest memory inside one mapped region ([`GuestMem::range`]),
/// read and written by offset with aligned atomic accesses (the guest
/// writes the same memory concurrently; no Rust reference to it is ever
/// made). It borrows the view, so the mapping outlives it.
#[derive(Clone, Copy)]
pub struct HostRange<'a> {
    base: usize,
    len: usize,
    _mem: PhantomData<&'a GuestMem>,
}

impl HostRange<'_> {
    /// The host address of `[off, off + size)` when it lies in the range
    /// and is `size`-aligned.
    #[inline]
    fn at(&self, off: usize, size: usize) -> Option<usize> {
        if off > self.len || self.len - off < size {
            return None;
        }
        let p = self.base + off;
        (p % size == 0).then_some(p)
    }

    /// The little-endian u64 at `off` (relaxed); `None` outside the range
    /// or unaligned.
    #[inline]
    pub fn load_u64(&self, off: usize) -> Option<u64> {
        let p = self.at(off, 8)?;
        // SAFETY: [p, p + 8) lies in the range, inside a mapping the
        // borrowed view keeps alive, and is 8-aligned.
        let v = unsafe { (*(p as *const AtomicU64)).load(Ordering::Relaxed) };
        Some(u64::from_le(v))
    }

    /// The 16 bytes at `off` (a request header; the guest may write it
    /// concurrently, so it is copied, never referenced), at any
    /// alignment, from the aligned 8-byte words that cover them: two or
    /// three loads and shifts, where a volatile byte array is copied
    /// byte by byte (the frontends' headers need not be 8-aligned).
    /// `None` outside the range.
    #[inline]
    pub fn load_16(&self, off: usize) -> Option<[u8; 16]> {
        if off > self.len || self.len - off < 16 {
            return None;
        }
        let p = self.base + off;
        let (a, shift) = (p & !7, (p & 7) as u32 * 8);
        // SAFETY: each word is 8-aligned and holds at least one byte of
        // [p, p + 16), which lies in the range, inside a mapping the
        // borrowed view keeps alive; an aligned word never crosses a
        // page, and mappings are whole pages, so the word is mapped too.
        // Its bytes outside the range are shifted out, never used.
        let word = |i: usize| unsafe {
            u64::from_le((*((a + 8 * i) as *const AtomicU64)).load(Ordering::Relaxed))
        };
        let (lo, hi) = if shift == 0 {
            (word(0), word(1))
        } else {
            let (w0, w1, w2) = (word(0), word(1), word(2));
            (
                w0 >> shift | w1 << (64 - shift),
                w1 >> shift | w2 << (64 - shift),
            )
        };
        let mut out = [0u8; 16];
        out[..8].copy_from_slice(&lo.to_le_bytes());
        out[8..].copy_from_slice(&hi.to_le_bytes());
        Some(out)
    }

    /// The little-endian u16 at `off`, loaded with `order`; `None`
    /// outside the range or unaligned.
    #[inline]
    pub fn load_u16(&self, off: usize, order: Ordering) -> Option<u16> {
        let p = self.at(off, 2)?;
        // SAFETY: as in `load_u64`, 2-aligned.
        let v = unsafe { (*(p as *const AtomicU16)).load(order) };
        Some(u16::from_le(v))
    }

    /// Stores a little-endian u32 at `off` (relaxed); false outside the
    /// range or unaligned.
    #[inline]
    pub fn store_u32(&self, off: usize, v: u32) -> bool {
        let Some(p) = self.at(off, 4) else {
            return false;
        };
        // SAFETY: as in `load_u64`, 4-aligned.
        unsafe { (*(p as *const AtomicU32)).store(v.to_le(), Ordering::Relaxed) };
        true
    }

    /// Stores a little-endian u16 at `off` with `order`; false outside the
    /// range or unaligned.
    #[inline]
    pub fn store_u16(&self, off: usize, v: u16, order: Ordering) -> bool {
        let Some(p) = self.at(off, 2) else {
            return false;
        };
        // SAFETY: as in `load_u64`, 2-aligned.
        unsafe { (*(p as *const AtomicU16)).store(v.to_le(), order) };
        true
    }

    /// Starts fetching the cache line of `off` (a hint: nothing outside
    /// the range is touched, and a prefetch never faults).
    #[inline]
    pub fn prefetch(&self, off: usize) {
        if off < self.len {
            prefetch(self.base + off);
        }
    }

    /// Stores a byte at `off` (relaxed); false outside the range.
    #[inline]
    pub fn store_u8(&self, off: usize, v: u8) -> bool {
        let Some(p) = self.at(off, 1) else {
            return false;
        };
        // SAFETY: as in `load_u64` (a byte is always aligned).
        unsafe { (*(p as *const AtomicU8)).store(v, Ordering::Relaxed) };
        true
    }
}

/// A prefetch of the line holding host address `p`: a hint the CPU may
/// drop, which changes no memory and never faults.
#[inline]
fn prefetch(p: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch instruction reads no data into a register, writes
    // no memory and does not fault on any address.
    unsafe {
        std::arch::asm!("prefetcht0 byte ptr [{0}]", in(reg) p, options(nostack, preserves_flags, readonly));
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

impl std::ops::Deref for GuestMem {
    type Target = GuestMemoryMmap;

    fn deref(&self) -> &GuestMemoryMmap {
        &self.map
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::Bytes;

    #[test]
    fn slices_are_the_maps_own() {
        let map = GuestMemoryMmap::<()>::from_ranges(&[
            (GuestAddress(0), 0x1000),
            (GuestAddress(0x1000), 0x1000),
            (GuestAddress(0x10_0000), 0x2000),
        ])
        .unwrap();
        let m = GuestMem::from_map(map);
        for (addr, len) in [
            (0u64, 1usize),
            (0xfff, 1),
            (0xfff, 2),
            (0x1000, 0x1000),
            (0x1000, 0x1001),
            (0x2000, 1),
            (0x10_0000, 0x2000),
            (0x10_1fff, 1),
            (0x10_1fff, 2),
            (0x10_2000, 0),
            (u64::MAX, 1),
        ] {
            let a = GuestAddress(addr);
            let ours = m.slice(a, len).map(|s| s.ptr_guard().as_ptr() as usize);
            let theirs = m.map().get_slice(a, len).ok();
            let theirs = theirs.map(|s| s.ptr_guard().as_ptr() as usize);
            assert_eq!(ours, theirs, "{addr:#x}+{len:#x}");
        }
        m.write_obj(0xabcdu16, GuestAddress(0x10_0010)).unwrap();
        let s = m.slice(GuestAddress(0x10_0010), 2).unwrap();
        assert_eq!(Bytes::<usize>::read_obj::<u16>(&s, 0).unwrap(), 0xabcd);
        let at = |a| m.load_u16(GuestAddress(a), Ordering::Acquire);
        assert_eq!(at(0x10_0010), Some(0xabcd));
        // Unaligned, straddling the end of a region, outside every one.
        assert_eq!(at(0x10_0011), None);
        assert_eq!(at(0xfff), None);
        assert_eq!(at(0x10_1fff), None);
        assert_eq!(at(0x3000), None);
        assert_eq!(at(0x10_1ffe), Some(0));
    }

    #[test]
    fn sixteen_bytes_load_whole_at_every_alignment() {
        let map = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x1000)]).unwrap();
        let pattern: Vec<u8> = (0..0x1000u32).map(|i| (i * 7 + i / 256) as u8).collect();
        map.write_slice(&pattern, GuestAddress(0)).unwrap();
        let m = GuestMem::from_map(map);
        // Every offset within a word, at the start and at the very end of
        // the region (the covering words end exactly on its last byte).
        for at in (0..24).chain(0x1000 - 24..=0x1000 - 16) {
            let r = m.range(GuestAddress(at as u64), 16).unwrap();
            assert_eq!(
                r.load_16(0).unwrap()[..],
                pattern[at..at + 16],
                "at {at:#x}"
            );
        }
        let r = m.range(GuestAddress(3), 20).unwrap();
        assert_eq!(r.load_16(4).unwrap()[..], pattern[7..23]);
        assert_eq!(r.load_16(5), None, "past the range");
    }

    #[test]
    fn ranges_check_bounds_and_alignment() {
        let map = GuestMemoryMmap::<()>::from_ranges(&[
            (GuestAddress(0), 0x1000),
            (GuestAddress(0x10_0000), 0x2000),
        ])
        .unwrap();
        let m = GuestMem::from_map(map);
        // Across a region's end, or outside every region.
        assert!(m.range(GuestAddress(0xff8), 16).is_none());
        assert!(m.range(GuestAddress(0x2000), 1).is_none());
        let r = m.range(GuestAddress(0x10_0000), 16).unwrap();
        assert!(r.store_u32(4, 0x1234_5678));
        assert_eq!(r.load_u64(0), Some(0x1234_5678_0000_0000));
        assert!(r.store_u16(14, 0xbeef, Ordering::Release));
        assert!(r.store_u8(15, 7));
        let v: u16 = m.read_obj(GuestAddress(0x10_000e)).unwrap();
        assert_eq!(v, 0x07ef);
        // Unaligned, or past the range's end.
        assert!(!r.store_u32(2, 1));
        assert!(!r.store_u16(15, 1, Ordering::Relaxed));
        assert!(!r.store_u8(16, 1));
        assert_eq!(r.load_u64(4), None);
        assert_eq!(r.load_u64(16), None);
        assert_eq!(r.load_u16(usize::MAX, Ordering::Relaxed), None);
        // Bytes at any alignment, within the range only.
        assert_eq!(r.load_16(0).map(|b| b[14..].to_vec()), Some(vec![0xef, 7]));
        assert_eq!(r.load_16(1), None);
        assert_eq!(r.load_16(usize::MAX), None);
        assert!(m.store_u16(GuestAddress(0x10_0100), 0xabcd, Ordering::Release));
        assert_eq!(
            m.load_u16(GuestAddress(0x10_0100), Ordering::Acquire),
            Some(0xabcd)
        );
        assert!(!m.store_u16(GuestAddress(0x10_0101), 1, Ordering::Release));
    }
}
