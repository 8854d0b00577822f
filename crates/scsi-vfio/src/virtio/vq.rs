//! A split virtqueue in VFIO DMA memory (virtio 1.x, section 2.7): the
//! descriptor table, available and used rings, a free list of
//! descriptors, and polled reaping of the used ring. The device is told
//! not to interrupt (no MSI-X vector, `VIRTQ_AVAIL_F_NO_INTERRUPT`).

use std::sync::atomic::{fence, Ordering};

use ustor_vfio::DmaMem;

const DESC_F_NEXT: u16 = 1;
const DESC_F_WRITE: u16 = 2;
const AVAIL_F_NO_INTERRUPT: u16 = 1;

/// One buffer of a chain: IOVA, length, device-writable.
#[derive(Clone, Copy, Debug)]
pub struct Seg {
    pub iova: u64,
    pub len: u32,
    pub write: bool,
}

/// Byte sizes of the three parts for `size` entries, the used ring page
/// aligned.
pub fn layout(size: u16) -> (usize, usize, usize) {
    let n = size as usize;
    let avail = 16 * n;
    let used = (avail + 6 + 2 * n).div_ceil(4096) * 4096;
    let total = used + (6 + 8 * n).div_ceil(4096) * 4096;
    (avail, used, total)
}

pub struct SplitQueue {
    mem: DmaMem,
    size: u16,
    avail_off: usize,
    used_off: usize,
    free: Vec<u16>,
    avail_idx: u16,
    last_used: u16,
}

impl SplitQueue {
    /// A queue of `size` entries over `mem` (at least `layout(size).2`
    /// zeroed bytes).
    pub fn new(mem: DmaMem, size: u16) -> SplitQueue {
        let (avail_off, used_off, _) = layout(size);
        let q = SplitQueue {
            mem,
            size,
            avail_off,
            used_off,
            free: (0..size).rev().collect(),
            avail_idx: 0,
            last_used: 0,
        };
        q.w16(avail_off, AVAIL_F_NO_INTERRUPT);
        q
    }

    pub fn size(&self) -> u16 {
        self.size
    }

    /// Whether the device interrupts when it returns buffers (the avail
    /// ring's NO_INTERRUPT flag); it interrupts only through a vector.
    pub fn set_interrupt(&self, on: bool) {
        let flags = if on { 0 } else { AVAIL_F_NO_INTERRUPT };
        self.w16(self.avail_off, flags);
    }

    pub fn desc_iova(&self) -> u64 {
        self.mem.iova
    }

    pub fn avail_iova(&self) -> u64 {
        self.mem.iova_at(self.avail_off)
    }

    pub fn used_iova(&self) -> u64 {
        self.mem.iova_at(self.used_off)
    }

    pub fn free_descs(&self) -> usize {
        self.free.len()
    }

    fn ptr<T>(&self, off: usize) -> *mut T {
        debug_assert!(off + std::mem::size_of::<T>() <= self.mem.len);
        // SAFETY: every offset used below is inside the queue's layout,
        // which `new` was given memory for.
        unsafe { self.mem.ptr.add(off).cast() }
    }

    fn w16(&self, off: usize, v: u16) {
        // SAFETY: in bounds (see `ptr`), 2-aligned by the layout; the
        // device reads it concurrently, hence volatile.
        unsafe { std::ptr::write_volatile(self.ptr::<u16>(off), v.to_le()) }
    }

    fn r16(&self, off: usize) -> u16 {
        // SAFETY: as in `w16`; the device writes it concurrently.
        u16::from_le(unsafe { std::ptr::read_volatile(self.ptr::<u16>(off)) })
    }

    fn r32(&self, off: usize) -> u32 {
        // SAFETY: as in `w16`, 4-aligned.
        u32::from_le(unsafe { std::ptr::read_volatile(self.ptr::<u32>(off)) })
    }

    fn write_desc(&self, i: u16, s: Seg, next: Option<u16>) {
        let off = 16 * i as usize;
        let flags = if s.write { DESC_F_WRITE } else { 0 } | next.map_or(0, |_| DESC_F_NEXT);
        // SAFETY: descriptor `i` < size lies in the table; the device only
        // reads it after the avail index that publishes it.
        unsafe {
            std::ptr::write_volatile(self.ptr::<u64>(off), s.iova.to_le());
            std::ptr::write_volatile(self.ptr::<u32>(off + 8), s.len.to_le());
        }
        self.w16(off + 12, flags);
        self.w16(off + 14, next.unwrap_or(0));
    }

    /// Chains `segs` and makes them available; returns the head index, or
    /// `None` when too few descriptors are free.
    pub fn push(&mut self, segs: &[Seg]) -> Option<u16> {
        if segs.is_empty() || segs.len() > self.free.len() {
            return None;
        }
        let ids: Vec<u16> = (0..segs.len()).filter_map(|_| self.free.pop()).collect();
        for (k, s) in segs.iter().enumerate() {
            self.write_desc(ids[k], *s, ids.get(k + 1).copied());
        }
        let head = ids[0];
        let slot = self.avail_off + 4 + 2 * (self.avail_idx % self.size) as usize;
        self.w16(slot, head);
        self.avail_idx = self.avail_idx.wrapping_add(1);
        // The ring entry and descriptors before the index that exposes them.
        fence(Ordering::Release);
        self.w16(self.avail_off + 2, self.avail_idx);
        // The index before the doorbell the caller rings next.
        fence(Ordering::SeqCst);
        Some(head)
    }

    /// The next used chain: (head, bytes written); its descriptors are
    /// free again.
    pub fn pop(&mut self) -> Option<(u16, u32)> {
        if self.r16(self.used_off + 2) == self.last_used {
            return None;
        }
        // The used entry is read after the index that published it.
        fence(Ordering::Acquire);
        let e = self.used_off + 4 + 8 * (self.last_used % self.size) as usize;
        let (id, len) = (self.r32(e), self.r32(e + 4));
        self.last_used = self.last_used.wrapping_add(1);
        let head = (id % self.size as u32) as u16;
        let mut i = head;
        // A chain is never longer than the queue: stop a corrupt loop.
        for _ in 0..self.size {
            self.free.push(i);
            let flags = self.r16(16 * i as usize + 12);
            if flags & DESC_F_NEXT == 0 {
                break;
            }
            i = self.r16(16 * i as usize + 14) % self.size;
        }
        Some((head, len))
    }
}
