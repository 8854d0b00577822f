//! The malloc bdev's memory: an anonymous mapping populated one 2 MiB
//! extent at a time, on the first write to it, by a populator thread — never
//! by a reactor.
//!
//! Why: faulting the whole disk in at creation (SPDK's zeroed allocation)
//! made `ustor serve`'s default 1 GiB disk cost ~3 s and 1 GiB of RSS before
//! the first client could connect. Left to plain lazy faults, each first
//! write to an extent faults on a reactor, and with THP that fault may run
//! direct compaction: stalls of 40 ms to over a second were seen mid-I/O.
//! So a write that reaches an extent not yet populated is handed to the
//! populator thread (`MADV_POPULATE_WRITE` on the extent), and the reactor
//! copies the data once the extent is in; reads of extents never written
//! are answered with zeros without touching the mapping; unmap and write
//! zeroes skip them (they read as zeros already). Memory is used only as the
//! disk is written, in 2 MiB steps.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};

/// Population unit: one transparent huge page on x86-64.
pub(crate) const EXTENT: usize = 2 << 20;

/// Linux 5.14's MADV_POPULATE_WRITE (not in every libc crate release).
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// How much of a byte range is populated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Resident {
    All,
    None,
    Some,
}

pub(crate) struct Mem {
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
    /// One bit per extent, set (Release) once the extent is faulted in; a
    /// reader that sees it set (Acquire) may touch the extent's memory.
    populated: Box<[AtomicU64]>,
}

// SAFETY: the mapping is plain memory valid for the bdev's life; concurrent
// access from several reactors and the populator is to disjoint or
// initiator-ordered ranges, with raw copies only (no references are formed
// across threads); the bitmap is atomics.
unsafe impl Send for Mem {}
unsafe impl Sync for Mem {}

impl Drop for Mem {
    fn drop(&mut self) {
        // SAFETY: ptr/len come from our mmap.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

impl Mem {
    /// Maps `len` bytes (THP advised) without faulting any of it in.
    pub(crate) fn map(len: usize) -> std::io::Result<Mem> {
        // SAFETY: anonymous private mapping, checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        // Transparent huge pages where the kernel offers them (no
        // hugetlbfs, no reservation): random 4 KiB I/O over a large disk
        // otherwise pays a TLB miss on nearly every copy. Advice only.
        // SAFETY: advice on the mapping just made; no memory is accessed.
        unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
        let words = len.div_ceil(EXTENT).div_ceil(64);
        Ok(Mem {
            ptr: p.cast(),
            len,
            populated: (0..words).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    fn extents(off: usize, len: usize) -> std::ops::Range<usize> {
        off / EXTENT..(off + len.max(1)).div_ceil(EXTENT)
    }

    fn is_populated(&self, e: usize) -> bool {
        self.populated[e / 64].load(Ordering::Acquire) & (1 << (e % 64)) != 0
    }

    /// How much of `[off, off+len)` is populated.
    pub(crate) fn resident(&self, off: usize, len: usize) -> Resident {
        let r = Self::extents(off, len);
        let n = r.len();
        let have = r.filter(|e| self.is_populated(*e)).count();
        match have {
            h if h == n => Resident::All,
            0 => Resident::None,
            _ => Resident::Some,
        }
    }

    /// Bytes populated so far (for `driver_specific`).
    pub(crate) fn resident_bytes(&self) -> u64 {
        let n: u32 = self
            .populated
            .iter()
            .map(|w| w.load(Ordering::Relaxed).count_ones())
            .sum();
        (n as u64 * EXTENT as u64).min(self.len as u64)
    }

    /// Zeroes `[off, off+len)` where it is populated; extents never written
    /// read as zeros already, and touching them would fault them in.
    ///
    /// # Safety
    /// `[off, off+len)` lies inside the mapping.
    pub(crate) unsafe fn zero(&self, off: usize, len: usize) {
        for e in Self::extents(off, len) {
            if !self.is_populated(e) {
                continue;
            }
            let s = off.max(e * EXTENT);
            let end = (off + len).min((e + 1) * EXTENT);
            std::ptr::write_bytes(self.ptr.add(s), 0, end - s);
        }
    }

    /// Faults in every extent of `[off, off+len)` not yet populated. Runs on
    /// the populator thread (or on a thread that is not a reactor).
    pub(crate) fn populate(&self, off: usize, len: usize) -> std::io::Result<()> {
        for e in Self::extents(off, len) {
            if self.is_populated(e) {
                continue;
            }
            let s = e * EXTENT;
            let n = EXTENT.min(self.len - s);
            // SAFETY: [s, s+n) lies inside our mapping.
            populate_range(unsafe { self.ptr.add(s) }, n)?;
            self.populated[e / 64].fetch_or(1 << (e % 64), Ordering::Release);
        }
        Ok(())
    }
}

/// Faults `len` bytes at `p` in for writing.
fn populate_range(p: *mut u8, len: usize) -> std::io::Result<()> {
    // SAFETY: advice on part of a private anonymous mapping we own; the
    // kernel only faults pages in.
    if unsafe { libc::madvise(p.cast(), len, MADV_POPULATE_WRITE) } == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::EINVAL) {
        return Err(err);
    }
    // Older kernel: touch one byte per page (the mapping is zero-filled, so
    // writing zero changes nothing but residency).
    for off in (0..len).step_by(4096) {
        // SAFETY: `off < len`, inside the writable mapping.
        unsafe { std::ptr::write_volatile(p.add(off), 0) };
    }
    Ok(())
}

/// Zeroes the data segments (a read of extents never written).
///
/// # Safety
/// The iovecs are valid for writing.
pub(crate) unsafe fn zero_iov(iov: &[libc::iovec]) {
    for v in iov {
        std::ptr::write_bytes(v.iov_base as *mut u8, 0, v.iov_len);
    }
}

/// One population request's answer, from the populator to a reactor task.
#[derive(Default)]
struct Done {
    state: Mutex<(Option<std::io::Result<()>>, Option<Waker>)>,
}

/// Waits for a population request (a reactor task awaits it; the wake
/// comes from the populator thread through the reactor's inbox).
pub(crate) struct Populated(Arc<Done>);

impl Future for Populated {
    type Output = std::io::Result<()>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut s = self.0.state.lock().unwrap_or_else(|e| e.into_inner());
        match s.0.take() {
            Some(r) => Poll::Ready(r),
            None => {
                s.1 = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

struct Job {
    mem: Arc<Mem>,
    off: usize,
    len: usize,
    done: Arc<Done>,
}

/// The process's populator thread, started on the first request. One
/// thread for every malloc bdev: population is rare (once per extent) and
/// page-fault bound, so more threads would only contend in the kernel.
fn populator() -> &'static Mutex<mpsc::Sender<Job>> {
    static TX: OnceLock<Mutex<mpsc::Sender<Job>>> = OnceLock::new();
    TX.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("ustor-populate".into())
            .spawn(move || {
                leave_the_reactors_core();
                for j in rx {
                    let r = j.mem.populate(j.off, j.len);
                    if let Err(e) = &r {
                        tracing::error!(bytes = j.len, error = %e, "malloc: populating RAM failed");
                    }
                    let mut s = j.done.state.lock().unwrap_or_else(|e| e.into_inner());
                    s.0 = Some(r);
                    if let Some(w) = s.1.take() {
                        w.wake();
                    }
                }
            })
            .expect("spawning the malloc populator thread");
        Mutex::new(tx)
    })
}

/// Widens the calling thread's CPU affinity to the process's (the main
/// thread's): the populator is started by the first write that needs it,
/// on a reactor pinned to one core, and would otherwise inherit that pin and
/// compete with the very reactor waiting for it (measured: 4 ms per 2 MiB
/// extent instead of 0.5 ms, NVMe/TCP randwrite at 250 IOPS on a fresh disk).
fn leave_the_reactors_core() {
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: a zeroed cpu_set_t is the empty set; sched_getaffinity fills
    // it for the thread-group leader (pid), sched_setaffinity applies it to
    // this thread; both are given the set's true size.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(libc::getpid(), size, &mut set) == 0 {
            libc::sched_setaffinity(0, size, &set);
        }
    }
}

/// Asks the populator thread to fault `[off, off+len)` of `mem` in.
pub(crate) fn request(mem: Arc<Mem>, off: usize, len: usize) -> Populated {
    let done = Arc::new(Done::default());
    let job = Job {
        mem,
        off,
        len,
        done: done.clone(),
    };
    let tx = populator().lock().unwrap_or_else(|e| e.into_inner());
    if let Err(mpsc::SendError(j)) = tx.send(job) {
        // The thread is gone (it never exits while the sender lives, so
        // this is unreachable in practice); populate here rather than hang.
        *done.state.lock().unwrap_or_else(|e| e.into_inner()) =
            (Some(j.mem.populate(j.off, j.len)), None);
    }
    Populated(done)
}
