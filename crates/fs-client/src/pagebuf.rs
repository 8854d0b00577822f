//! Page-aligned byte buffers for the data path's large kernel copies.
//!
//! Why: on this project's AMD EPYC machines the kernel's `memcpy` (`rep
//! movsb`) runs 4-8x slower when the destination sits 1 to 31 bytes past
//! the source modulo 4 KiB (measured: 0.93-1.6 ms per MiB against 0.2 ms;
//! bench/RESULTS-fs.md, "Why a 1 MiB write took 2 ms"). A heap `Vec` of a
//! MiB starts 16 bytes into its page (the allocator's chunk header), so
//! FUSE copying a page-aligned user buffer into it hit exactly that case.
//! A buffer that starts on a page keeps source and destination in step.

use std::alloc::Layout;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

const PAGE: usize = 4096;

/// A zero-filled heap buffer that starts on a page boundary.
pub struct PageBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is uniquely owned heap memory, like a Vec<u8>.
unsafe impl Send for PageBuf {}
// SAFETY: shared access only reads, as for a Vec<u8>.
unsafe impl Sync for PageBuf {}

impl PageBuf {
    /// `len` zero bytes (at least one page is allocated).
    pub fn zeroed(len: usize) -> Self {
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self { ptr, len }
    }

    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len.max(1).div_ceil(PAGE) * PAGE, PAGE).expect("buffer size")
    }
}

impl Deref for PageBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` initialised bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for PageBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in Deref; `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PageBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this same layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_on_a_page_and_is_zeroed() {
        for len in [0, 1, 4096, (1 << 20) + 80] {
            let mut b = PageBuf::zeroed(len);
            assert_eq!(b.as_ptr() as usize % PAGE, 0);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0));
            if len > 0 {
                b[len - 1] = 7;
                assert_eq!(b[len - 1], 7);
            }
        }
    }
}
