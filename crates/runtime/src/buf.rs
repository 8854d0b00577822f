//! Aligned I/O buffers: a per-reactor pool, preallocated at start and
//! registered with the reactor's io_uring as one fixed buffer, plus heap
//! buffers for code that runs off the reactors.
//!
//! A buffer is owned by value ([`IoBuf`]) and passed to operations by value,
//! so the kernel owns it from submission until its completion is reaped, even
//! when the waiting future is dropped (see `ops`). Exhaustion is never a
//! panic: [`IoBuf::try_alloc`] says `None` and [`IoBuf::alloc`] waits.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::ptr::NonNull;
use std::task::{Context, Poll, Waker};

use crate::reactor;

/// Alignment of every buffer: enough for O_DIRECT on any block device.
pub const BUF_ALIGN: usize = 4096;
const HEAP_CLASS: u8 = u8::MAX;
/// Memory the buffer does not own (guest memory a vhost-user frontend
/// shared): never freed, never a fixed buffer.
const BORROWED_CLASS: u8 = u8::MAX - 1;

/// Size and shape of one reactor's pool.
#[derive(Clone, Debug)]
pub struct BufPoolConfig {
    /// Bytes per reactor (at most 1 GiB: one registered buffer).
    pub mem_bytes: usize,
    /// Buffer sizes; each class gets an equal share of the memory.
    pub classes: Vec<usize>,
}

impl Default for BufPoolConfig {
    fn default() -> Self {
        BufPoolConfig {
            mem_bytes: 64 << 20,
            classes: vec![4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20],
        }
    }
}

struct Class {
    size: usize,
    free: RefCell<Vec<NonNull<u8>>>,
    total: usize,
}

/// One reactor's pool. Lives in the reactor; reached through the thread-local.
pub(crate) struct BufPool {
    base: *mut u8,
    len: usize,
    classes: Vec<Class>,
    waiters: RefCell<VecDeque<Waker>>,
    exhausted: Cell<u64>,
}

impl BufPool {
    pub(crate) fn new(cfg: &BufPoolConfig) -> std::io::Result<BufPool> {
        let mut sizes = cfg.classes.clone();
        sizes.sort_unstable();
        sizes.dedup();
        if sizes.is_empty() || sizes.iter().any(|s| *s == 0 || s % BUF_ALIGN != 0) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "buffer classes must be non-empty multiples of 4096",
            ));
        }
        if cfg.mem_bytes > (1 << 30) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "buffer pool is limited to 1 GiB per reactor",
            ));
        }
        let share = cfg.mem_bytes / sizes.len();
        let counts: Vec<usize> = sizes.iter().map(|s| (share / s).max(2)).collect();
        let len: usize = sizes.iter().zip(&counts).map(|(s, c)| s * c).sum();
        // SAFETY: anonymous private mapping; checked for MAP_FAILED below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let base = base as *mut u8;
        let mut off = 0;
        let mut classes = Vec::with_capacity(sizes.len());
        for (size, count) in sizes.iter().zip(&counts) {
            let mut free = Vec::with_capacity(*count);
            for i in 0..*count {
                // SAFETY: off + i*size + size <= len by construction of `len`.
                let p = unsafe { base.add(off + i * size) };
                free.push(NonNull::new(p).expect("mmap returned null"));
            }
            free.reverse();
            off += size * count;
            classes.push(Class {
                size: *size,
                free: RefCell::new(free),
                total: *count,
            });
        }
        Ok(BufPool {
            base,
            len,
            classes,
            waiters: RefCell::new(VecDeque::with_capacity(1024)),
            exhausted: Cell::new(0),
        })
    }

    /// The region to register with io_uring as fixed buffer 0.
    pub(crate) fn region(&self) -> libc::iovec {
        libc::iovec {
            iov_base: self.base.cast(),
            iov_len: self.len,
        }
    }

    fn take(&self, len: usize) -> Option<IoBuf> {
        for (ci, c) in self.classes.iter().enumerate() {
            if c.size < len {
                continue;
            }
            if let Some(p) = c.free.borrow_mut().pop() {
                return Some(IoBuf {
                    ptr: p,
                    len: len as u32,
                    cap: c.size as u32,
                    class: ci as u8,
                    _not_send: PhantomData,
                });
            }
        }
        self.exhausted.set(self.exhausted.get() + 1);
        None
    }

    fn give(&self, class: u8, p: NonNull<u8>) {
        self.classes[class as usize].free.borrow_mut().push(p);
        let w = self.waiters.borrow_mut().pop_front();
        if let Some(w) = w {
            w.wake();
        }
    }

    pub(crate) fn largest(&self) -> usize {
        self.classes.last().map(|c| c.size).unwrap_or(0)
    }

    /// (class size, free, total) per class, and how often a request found none.
    pub(crate) fn usage(&self) -> PoolUsage {
        let v = self
            .classes
            .iter()
            .map(|c| (c.size, c.free.borrow().len(), c.total))
            .collect();
        (v, self.exhausted.get())
    }
}

impl Drop for BufPool {
    fn drop(&mut self) {
        // SAFETY: base/len come from our own successful mmap.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// An aligned buffer owned by value: from the reactor's registered pool, or
/// from the heap (off-reactor code, tests, oversized requests).
///
/// `!Send`: a pool buffer must go back to the pool of the reactor it came from.
pub struct IoBuf {
    ptr: NonNull<u8>,
    len: u32,
    cap: u32,
    class: u8,
    _not_send: PhantomData<*mut u8>,
}

impl IoBuf {
    /// A pool buffer of `len` bytes from the current reactor, or `None` when the
    /// pool is exhausted or `len` exceeds the largest class.
    pub fn try_alloc(len: usize) -> Option<IoBuf> {
        reactor::try_with(|r| r.bufs.take(len)).flatten()
    }

    /// A pool buffer of `len` bytes, waiting for one to be freed if needed.
    /// Requests larger than the largest class, or made off a reactor, get a
    /// heap buffer (counted as an allocation; the bdev layer splits large I/O).
    pub fn alloc(len: usize) -> BufAlloc {
        BufAlloc { len, queued: false }
    }

    /// A zero-filled heap buffer aligned to [`BUF_ALIGN`].
    pub fn heap(len: usize) -> IoBuf {
        let cap = len.max(1).div_ceil(BUF_ALIGN) * BUF_ALIGN;
        let layout = std::alloc::Layout::from_size_align(cap, BUF_ALIGN)
            .expect("buffer size overflows a Layout");
        // SAFETY: layout has non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        IoBuf {
            ptr,
            len: len as u32,
            cap: cap as u32,
            class: HEAP_CLASS,
            _not_send: PhantomData,
        }
    }

    /// A buffer over `len` bytes at `ptr` that it does not own: dropping it
    /// frees nothing. This is how a target hands memory it does not allocate
    /// (a VM's memory, shared by a vhost-user frontend) to the bdev layer
    /// without a copy.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes until the
    /// buffer (and every I/O it is part of) is dropped, and nothing else may
    /// create Rust references to those bytes meanwhile.
    pub unsafe fn borrowed(ptr: NonNull<u8>, len: u32) -> IoBuf {
        IoBuf {
            ptr,
            len,
            cap: len,
            class: BORROWED_CLASS,
            _not_send: PhantomData,
        }
    }

    pub fn len(&self) -> usize {
        self.len as usize
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn capacity(&self) -> usize {
        self.cap as usize
    }
    /// Sets the valid length (bytes beyond it are kept, not cleared).
    pub fn set_len(&mut self, len: usize) {
        assert!(
            len <= self.cap as usize,
            "IoBuf::set_len {len} beyond capacity {}",
            self.cap
        );
        self.len = len as u32;
    }
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    /// Index of the io_uring fixed buffer that holds this buffer, if any.
    pub fn fixed_index(&self) -> Option<u16> {
        self.is_pooled().then_some(0)
    }
    pub fn is_pooled(&self) -> bool {
        self.class != HEAP_CLASS && self.class != BORROWED_CLASS
    }
    /// Whether this buffer is someone else's memory ([`IoBuf::borrowed`]):
    /// never a scratch buffer to fill with other data.
    pub fn is_borrowed(&self) -> bool {
        self.class == BORROWED_CLASS
    }
    /// The whole capacity as a slice (for receiving past `len`).
    pub fn spare_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for cap bytes for the life of self, uniquely owned.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap as usize) }
    }
}

impl std::ops::Deref for IoBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for cap >= len bytes and owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len as usize) }
    }
}

impl std::ops::DerefMut for IoBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in Deref; &mut self guarantees uniqueness.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len as usize) }
    }
}

impl std::fmt::Debug for IoBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "IoBuf(len={}, cap={}, pooled={})",
            self.len,
            self.cap,
            self.is_pooled()
        )
    }
}

impl Drop for IoBuf {
    fn drop(&mut self) {
        if self.class == BORROWED_CLASS {
            return;
        }
        if self.class == HEAP_CLASS {
            let layout = std::alloc::Layout::from_size_align(self.cap as usize, BUF_ALIGN)
                .expect("layout was valid at allocation");
            // SAFETY: allocated in `heap` with this exact layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
            return;
        }
        // Off its reactor (the reactor already exited) the pool memory is gone
        // with it; there is nothing to return.
        let _ = reactor::try_with(|r| r.bufs.give(self.class, self.ptr));
    }
}

/// Future of [`IoBuf::alloc`].
pub struct BufAlloc {
    len: usize,
    queued: bool,
}

impl Future for BufAlloc {
    type Output = IoBuf;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<IoBuf> {
        let len = self.len;
        let got = reactor::try_with(|r| {
            if len > r.bufs.largest() {
                return Some(Some(IoBuf::heap(len)));
            }
            match r.bufs.take(len) {
                Some(b) => Some(Some(b)),
                None => {
                    r.bufs.waiters.borrow_mut().push_back(cx.waker().clone());
                    Some(None)
                }
            }
        });
        match got {
            None => Poll::Ready(IoBuf::heap(len)),
            Some(Some(Some(b))) => Poll::Ready(b),
            Some(Some(None)) | Some(None) => {
                self.queued = true;
                Poll::Pending
            }
        }
    }
}

/// (size, free, total) per class, and how often a request found none.
pub type PoolUsage = (Vec<(usize, usize, usize)>, u64);

/// Per-class usage of the current reactor's pool: (size, free, total), and the
/// number of requests that found the pool exhausted.
pub fn pool_usage() -> Option<PoolUsage> {
    reactor::try_with(|r| r.bufs.usage())
}

/// The current reactor's registered pool region (for drivers that register
/// it with a ring of their own, e.g. an SQPOLL or IOPOLL ring).
pub fn pool_region() -> Option<libc::iovec> {
    reactor::try_with(|r| r.bufs.region())
}
