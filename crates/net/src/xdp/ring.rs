//! The four single-producer single-consumer rings an AF_XDP socket shares
//! with the kernel (fill, completion, rx, tx), mapped at the offsets
//! `XDP_MMAP_OFFSETS` reports. We produce on fill and tx and consume on rx
//! and completion; the index words are the kernel's, read with acquire and
//! written with release, and the cached copies save a load per call.

use std::sync::atomic::{AtomicU32, Ordering};

use super::XdpError;

/// One mapped ring of `T` (u64 addresses or `libc::xdp_desc`).
pub(crate) struct Ring<T> {
    map: *mut libc::c_void,
    map_len: usize,
    prod: *const AtomicU32,
    cons: *const AtomicU32,
    flags: *const AtomicU32,
    desc: *mut T,
    mask: u32,
    /// Our view of the index we own, and of the one the kernel owns.
    local: u32,
    remote: u32,
}

// SAFETY: the ring's memory is owned by this value (unmapped on drop) and
// only used through `&mut self`; the kernel side synchronises through the
// atomic index words.
unsafe impl<T> Send for Ring<T> {}

impl<T: Copy> Ring<T> {
    /// Maps the ring of `entries` slots at page offset `pgoff` of `fd`.
    pub(crate) fn map(
        fd: libc::c_int,
        off: &libc::xdp_ring_offset,
        entries: u32,
        pgoff: u64,
        producer: bool,
    ) -> Result<Ring<T>, XdpError> {
        let map_len = off.desc as usize + entries as usize * std::mem::size_of::<T>();
        // SAFETY: a fresh shared mapping of the socket's ring; the kernel
        // validates offset and length.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd,
                pgoff as libc::off_t,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(XdpError::sys("mmap of an AF_XDP ring"));
        }
        let at = |o: u64| (map as usize + o as usize) as *mut u8;
        let mut r = Ring {
            map,
            map_len,
            prod: at(off.producer) as *const AtomicU32,
            cons: at(off.consumer) as *const AtomicU32,
            flags: at(off.flags) as *const AtomicU32,
            desc: at(off.desc) as *mut T,
            mask: entries - 1,
            local: 0,
            remote: 0,
        };
        // SAFETY: the index words lie inside the mapping just made.
        unsafe {
            if producer {
                r.local = (*r.prod).load(Ordering::Relaxed);
                r.remote = (*r.cons).load(Ordering::Acquire);
            } else {
                r.local = (*r.cons).load(Ordering::Relaxed);
                r.remote = (*r.prod).load(Ordering::Acquire);
            }
        }
        Ok(r)
    }

    fn size(&self) -> u32 {
        self.mask + 1
    }

    /// Producer side: writes as many of `items` as there is room for and
    /// publishes them; returns how many.
    pub(crate) fn produce(&mut self, items: &[T]) -> usize {
        self.produce_map(items, |it| *it)
    }

    /// [`Ring::produce`] of `f` of each item: the caller's own descriptor
    /// type goes in with no intermediate Vec (one per send before).
    pub(crate) fn produce_map<U>(&mut self, items: &[U], f: impl Fn(&U) -> T) -> usize {
        let mut free = self.size() - self.local.wrapping_sub(self.remote);
        if (free as usize) < items.len() {
            // SAFETY: the consumer word lies inside the mapping.
            self.remote = unsafe { (*self.cons).load(Ordering::Acquire) };
            free = self.size() - self.local.wrapping_sub(self.remote);
        }
        let n = items.len().min(free as usize);
        for (i, it) in items[..n].iter().enumerate() {
            let slot = self.local.wrapping_add(i as u32) & self.mask;
            // SAFETY: `slot` is masked into the ring's `size` entries, and
            // the slot is ours until the producer index passes it.
            unsafe { self.desc.add(slot as usize).write(f(it)) };
        }
        self.local = self.local.wrapping_add(n as u32);
        // SAFETY: as above; release orders the slot writes before it.
        unsafe { (*self.prod).store(self.local, Ordering::Release) };
        n
    }

    /// Producer side: entries the kernel has not consumed yet.
    pub(crate) fn outstanding(&mut self) -> u32 {
        // SAFETY: the consumer word lies inside the mapping.
        self.remote = unsafe { (*self.cons).load(Ordering::Acquire) };
        self.local.wrapping_sub(self.remote)
    }

    /// Consumer side: copies up to `max` ready entries into `out` and
    /// releases their slots; returns how many.
    pub(crate) fn consume(&mut self, out: &mut Vec<T>, max: usize) -> usize {
        self.consume_map(out, max, |t| t)
    }

    /// [`Ring::consume`] into a Vec of `f` of each entry (no intermediate
    /// Vec: a receive allocated one per call, empty passes included).
    pub(crate) fn consume_map<U>(
        &mut self,
        out: &mut Vec<U>,
        max: usize,
        f: impl Fn(T) -> U,
    ) -> usize {
        if self.remote == self.local {
            // SAFETY: the producer word lies inside the mapping.
            self.remote = unsafe { (*self.prod).load(Ordering::Acquire) };
        }
        let n = (self.remote.wrapping_sub(self.local) as usize).min(max);
        for i in 0..n {
            let slot = self.local.wrapping_add(i as u32) & self.mask;
            // SAFETY: masked slot index; the acquire load above ordered the
            // kernel's write of it before this read.
            out.push(f(unsafe { self.desc.add(slot as usize).read() }));
        }
        if n == 0 {
            return 0;
        }
        self.local = self.local.wrapping_add(n as u32);
        // SAFETY: the consumer word lies inside the mapping.
        unsafe { (*self.cons).store(self.local, Ordering::Release) };
        n
    }

    /// The ring's flags word (`XDP_RING_NEED_WAKEUP`).
    pub(crate) fn flags(&self) -> u32 {
        // SAFETY: the flags word lies inside the mapping.
        unsafe { (*self.flags).load(Ordering::Acquire) }
    }
}

impl<T> Drop for Ring<T> {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping `map` made; no reference into
        // it outlives `self`.
        unsafe { libc::munmap(self.map, self.map_len) };
    }
}
