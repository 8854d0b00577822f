//! The request path's view of guest memory: one memory map (the frontend's
//! table as the queue last picked it up) with its regions' guest ranges
//! and host addresses in a small table of its own, so a guest address
//! becomes a host slice with a compare or two. `vm-memory`'s lookup (a
//! binary search behind several layers of trait objects, ~60 instructions
//! a call, and a request made eight: the descriptor table, the status
//! byte's check, the header, each segment's check and the worker's slice
//! of it, the status write, the used entry and the used index) was a fifth
//! of a request's cost.
//!
//! A view holds its map's `Arc`, so every slice it gives stays mapped for
//! as long as the view lives; a map the frontend changed
//! (SET_MEM_TABLE, ADD_MEM_REG, REM_MEM_REG) is a new view, which the
//! queue picks up between passes while requests in flight keep theirs.
//! Everything else (accesses that cross regions, the packed ring,
//! `virtio-queue`'s notification calls) goes through the map itself
//! ([`GuestMem::map`]).

use std::sync::Arc;

use vm_memory::{
    GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, VolatileSlice,
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
        for &(start, size, host) in self.regions.iter() {
            let off = addr.0.wrapping_sub(start);
            if off < size {
                if len as u64 > size - off {
                    return None;
                }
                // SAFETY: [off, off + len) lies inside the region, whose
                // mapping (host .. host + size) stays alive while
                // self.map does, which is at least the slice's lifetime
                // (it borrows self). Guest memory is shared with the
                // guest and only ever accessed volatilely
                // (VolatileSlice's methods), as vm-memory's slices are.
                return Some(unsafe { VolatileSlice::new((host + off as usize) as *mut u8, len) });
            }
        }
        None
    }
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
    }
}
