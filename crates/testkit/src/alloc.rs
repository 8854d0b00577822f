//! A counting global allocator for the tests that prove a data path
//! allocates nothing once warmed up: the test installs it with
//! `#[global_allocator]`, opens a window around the measured I/O, and
//! asserts the count is zero. Counting is on any thread while the window is
//! open, so an allocation on a reactor, a library thread or the test's own
//! thread all count.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The system allocator, counting allocations (and reallocations) made
/// while its window is open.
pub struct CountingAlloc {
    window: AtomicBool,
    allocs: AtomicU64,
}

impl CountingAlloc {
    pub const fn new() -> CountingAlloc {
        CountingAlloc {
            window: AtomicBool::new(false),
            allocs: AtomicU64::new(0),
        }
    }

    /// Opens (true) or closes the counting window.
    pub fn set_window(&self, open: bool) {
        self.window.store(open, Ordering::SeqCst);
    }

    /// Sets the count back to zero.
    pub fn reset(&self) {
        self.allocs.store(0, Ordering::SeqCst);
    }

    /// Allocations counted so far.
    pub fn allocations(&self) -> u64 {
        self.allocs.load(Ordering::SeqCst)
    }

    fn count(&self) {
        if self.window.load(Ordering::Relaxed) {
            self.allocs.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Default for CountingAlloc {
    fn default() -> Self {
        CountingAlloc::new()
    }
}

// SAFETY: forwards every call to the system allocator unchanged; it only
// counts, with atomics that never allocate.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        self.count();
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        self.count();
        System.realloc(p, l, n)
    }
}
