//! Per-reactor table of in-flight bdev I/O (SPDK's `spdk_bdev_io` pool).
//!
//! A slot holds what a driver needs (kind, range, iovecs). The caller's
//! buffers stay in the submitting future; when that future is dropped
//! before the I/O completes, the slot takes them (an orphan) until the last
//! completion, so a dropped future never frees memory a device is still
//! writing. The table is preallocated and bounded, its free slots an
//! intrusive list; when it is full, new I/O waits (queue-full is never an
//! error and never allocates).

use std::cell::{Cell, RefCell, UnsafeCell};
use std::collections::VecDeque;
use std::task::Waker;

use ustor_runtime::IoBuf;

use crate::error::BdevError;
use crate::types::{IoFlags, IoType};

/// Most buffer segments in one I/O.
pub const MAX_SEGMENTS: usize = 16;
/// Slots per reactor.
pub const TABLE_SLOTS: usize = 8192;
const NONE: u32 = u32::MAX;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum State {
    Free,
    /// Submitted to a driver (child) or tracking children (parent).
    Active,
    /// Completed; the owning future has not collected it yet.
    Done,
    /// The owning future was dropped; free on completion.
    Orphan,
}

/// Buffers of an orphaned I/O (its future was dropped in flight), kept
/// until the device is done with them.
#[derive(Default)]
pub enum Bufs {
    #[default]
    None,
    One(IoBuf),
    Many(Vec<IoBuf>),
}

pub(crate) struct Slot {
    pub(crate) gen: Cell<u32>,
    pub(crate) state: Cell<State>,
    pub(crate) kind: Cell<IoType>,
    pub(crate) flags: Cell<IoFlags>,
    pub(crate) offset_blocks: Cell<u64>,
    pub(crate) num_blocks: Cell<u64>,
    pub(crate) iovcnt: Cell<u32>,
    pub(crate) iov: UnsafeCell<[libc::iovec; MAX_SEGMENTS]>,
    /// Whether every iovec lies in the reactor's registered pool.
    pub(crate) fixed: Cell<bool>,
    pub(crate) status: Cell<Result<(), BdevError>>,
    pub(crate) parent: Cell<u32>,
    pub(crate) children: Cell<u32>,
    /// A driver turned this I/O into children ([`crate::Children`]): the
    /// last child's completion completes it. Cleared when it does, so
    /// `alloc` need not reset it.
    pub(crate) chained: Cell<bool>,
    pub(crate) waker: Cell<Option<Waker>>,
    /// Only an orphan's (see [`Bufs`]).
    pub(crate) bufs: Cell<Bufs>,
    /// The next free slot while this one is free (`NONE`: the last).
    next_free: Cell<u32>,
    /// Set on hot-remove so completions report `Removed`.
    pub(crate) removed: Cell<*const std::sync::atomic::AtomicBool>,
    /// A child's watcher ([`crate::child::Watch`]); set for every child
    /// when it is filled, never read for other slots.
    pub(crate) watch: Cell<Option<crate::child::Watch>>,
}

pub(crate) struct Table {
    pub(crate) slots: Box<[Slot]>,
    /// The first free slot (`NONE`: the table is full).
    free_head: Cell<u32>,
    /// Futures waiting for a free slot; `waiting` says whether any are, so
    /// a free does not touch the queue when none wait.
    waiters: RefCell<VecDeque<Waker>>,
    waiting: Cell<bool>,
}

/// Owns this thread's table; its destructor clears [`TABLE_PTR`] first so a
/// late lookup (another thread-local's destructor) never sees freed memory.
struct TableOwner(Box<Table>);

impl Drop for TableOwner {
    fn drop(&mut self) {
        TABLE_PTR.with(|p| p.set(std::ptr::null()));
    }
}

thread_local! {
    static TABLE: TableOwner = TableOwner(Box::new(Table::new(TABLE_SLOTS)));
    /// The table's address: a `const` thread-local without a destructor is
    /// one segment-relative load, where the lazily built `TABLE` costs a
    /// call and a state check on each of the several lookups per I/O.
    static TABLE_PTR: Cell<*const Table> = const { Cell::new(std::ptr::null()) };
}

#[inline(always)]
pub(crate) fn with_table<R>(f: impl FnOnce(&Table) -> R) -> R {
    let mut p = TABLE_PTR.with(|p| p.get());
    if p.is_null() {
        p = TABLE.with(|t| &*t.0 as *const Table);
        TABLE_PTR.with(|c| c.set(p));
    }
    // SAFETY: `p` points into `TABLE`'s box, which lives until this thread's
    // `TableOwner` is dropped, and that drop clears `TABLE_PTR` first. The
    // table is only reached from this thread (`Cell`s, `!Sync`).
    f(unsafe { &*p })
}

impl Table {
    fn new(n: usize) -> Table {
        let slots: Vec<Slot> = (0..n)
            .map(|_| Slot {
                gen: Cell::new(0),
                state: Cell::new(State::Free),
                kind: Cell::new(IoType::Read),
                flags: Cell::new(IoFlags::NONE),
                offset_blocks: Cell::new(0),
                num_blocks: Cell::new(0),
                iovcnt: Cell::new(0),
                iov: UnsafeCell::new(
                    [libc::iovec {
                        iov_base: std::ptr::null_mut(),
                        iov_len: 0,
                    }; MAX_SEGMENTS],
                ),
                fixed: Cell::new(false),
                status: Cell::new(Ok(())),
                parent: Cell::new(NONE),
                children: Cell::new(0),
                chained: Cell::new(false),
                waker: Cell::new(None),
                bufs: Cell::new(Bufs::None),
                next_free: Cell::new(0),
                removed: Cell::new(std::ptr::null()),
                watch: Cell::new(None),
            })
            .collect();
        // Slot 0 first, then 1, ...: each links to the next.
        for (i, s) in slots.iter().enumerate() {
            s.next_free.set(if i + 1 < n { i as u32 + 1 } else { NONE });
        }
        Table {
            slots: slots.into_boxed_slice(),
            free_head: Cell::new(if n > 0 { 0 } else { NONE }),
            waiters: RefCell::new(VecDeque::with_capacity(1024)),
            waiting: Cell::new(false),
        }
    }

    #[inline]
    pub(crate) fn alloc(&self, waker: &Waker) -> Option<u32> {
        let i = self.try_alloc();
        if i.is_none() {
            self.wait_for_slot(waker);
        }
        i
    }

    // The rare paths of `alloc` and `free` are out of line, so that the
    // per-I/O callers inline the common ones without saving registers.
    #[cold]
    #[inline(never)]
    fn wait_for_slot(&self, waker: &Waker) {
        self.waiters.borrow_mut().push_back(waker.clone());
        self.waiting.set(true);
    }

    /// A slot if one is free now (a driver's child I/O cannot wait).
    #[inline]
    pub(crate) fn try_alloc(&self) -> Option<u32> {
        let i = self.free_head.get();
        // `NONE` (full) is past the end: the bounds check is the test.
        let s = self.slots.get(i as usize)?;
        self.free_head.set(s.next_free.get());
        s.state.set(State::Active);
        s.status.set(Ok(()));
        s.parent.set(NONE);
        s.children.set(0);
        s.iovcnt.set(0);
        s.fixed.set(false);
        Some(i)
    }

    #[inline]
    pub(crate) fn free(&self, i: u32) {
        let s = &self.slots[i as usize];
        s.gen.set(s.gen.get().wrapping_add(1));
        let was = s.state.replace(State::Free);
        let waker = s.waker.take();
        s.next_free.set(self.free_head.get());
        self.free_head.set(i);
        if waker.is_some() || was == State::Orphan || self.waiting.get() {
            self.free_rare(s, waker, was);
        }
    }

    /// What `free` rarely has to do: drop a stale waker or an orphan's
    /// buffers, wake a future waiting for a slot.
    #[cold]
    #[inline(never)]
    fn free_rare(&self, s: &Slot, waker: Option<Waker>, was: State) {
        drop(waker);
        if was == State::Orphan {
            drop(s.bufs.take());
        }
        if !self.waiting.get() {
            return;
        }
        let w = {
            let mut q = self.waiters.borrow_mut();
            let w = q.pop_front();
            self.waiting.set(!q.is_empty());
            w
        };
        if let Some(w) = w {
            w.wake();
        }
    }

    /// A slot finished (driver completion or last child): record status, and
    /// wake the owner, propagate to the parent, or free an orphan.
    #[inline]
    pub(crate) fn finish(&self, i: u32, status: Result<(), BdevError>) {
        let s = &self.slots[i as usize];
        let removed = s.removed.get();
        // SAFETY: `removed` points into the bdev's registry entry, which the
        // channel that submitted this I/O keeps alive until it completes.
        let status = if !removed.is_null()
            && unsafe { &*removed }.load(std::sync::atomic::Ordering::Relaxed)
        {
            Err(BdevError::Removed)
        } else {
            status
        };
        let parent = s.parent.get();
        if parent != NONE {
            // A child: free it, let its watcher see (and maybe replace) its
            // status, and fold that into the parent.
            let watch = s.watch.get();
            self.free(i);
            let status = match watch {
                None => status,
                Some(w) => w.call(parent, status),
            };
            self.child_done(parent, status);
            return;
        }
        match s.state.get() {
            State::Active => {
                s.status.set(status);
                s.state.set(State::Done);
                let w = s.waker.take();
                if let Some(w) = w {
                    w.wake();
                }
            }
            State::Orphan => self.free(i),
            State::Free | State::Done => tracing::error!("bdev I/O slot {i} completed twice"),
        }
    }

    /// One child of `parent` is done (first error wins). After the last: a
    /// chained parent (a driver's I/O) completes in turn; a split parent
    /// wakes its future or, orphaned, is freed.
    pub(crate) fn child_done(&self, parent: u32, status: Result<(), BdevError>) {
        let p = &self.slots[parent as usize];
        if p.status.get().is_ok() {
            p.status.set(status);
        }
        let left = p.children.get() - 1;
        p.children.set(left);
        if left != 0 {
            return;
        }
        if p.chained.get() {
            p.chained.set(false);
            return self.finish(parent, p.status.get());
        }
        match p.state.get() {
            State::Orphan => self.free(parent),
            _ => {
                let w = p.waker.take();
                if let Some(w) = w {
                    w.wake();
                }
            }
        }
    }
}

/// What a driver reads of slot `idx`.
#[inline]
pub(crate) fn slot_desc(idx: u32) -> IoDesc {
    with_table(|t| {
        let s = &t.slots[idx as usize];
        IoDesc {
            kind: s.kind.get(),
            offset_blocks: s.offset_blocks.get(),
            num_blocks: s.num_blocks.get(),
            iov: s.iov.get() as *const libc::iovec,
            iovcnt: s.iovcnt.get() as usize,
            fixed: s.fixed.get(),
        }
    })
}

/// A driver's reference to one in-flight I/O. Not `Clone`: completing it
/// consumes it, so an I/O completes exactly once.
#[derive(Debug)]
pub struct IoHandle {
    pub(crate) idx: u32,
    pub(crate) gen: u32,
}

/// What a driver reads from an [`IoHandle`].
#[derive(Clone, Copy, Debug)]
pub struct IoDesc {
    pub kind: IoType,
    pub offset_blocks: u64,
    pub num_blocks: u64,
    /// Points into the I/O's slot; valid until the I/O completes.
    pub iov: *const libc::iovec,
    pub iovcnt: usize,
    /// Every segment lies in the reactor's registered buffer pool.
    pub fixed: bool,
}

impl IoDesc {
    /// The data segments.
    ///
    /// # Safety
    /// Only until the I/O is completed.
    pub unsafe fn iovecs(&self) -> &[libc::iovec] {
        std::slice::from_raw_parts(self.iov, self.iovcnt)
    }

    /// A compare-and-write's data to compare and data to write, each
    /// `len` bytes and contiguous, for a driver that takes two plain
    /// buffers (librbd): the generic layer hands over the caller's two
    /// buffers or one bounce buffer, and a child keeps its parent's
    /// layout. `None` for any other layout.
    ///
    /// # Safety
    /// Only until the I/O is completed.
    pub unsafe fn compare_and_write_halves(&self, len: usize) -> Option<(*mut u8, *mut u8)> {
        match self.iovecs() {
            [a] if a.iov_len == 2 * len => {
                let p = a.iov_base.cast::<u8>();
                Some((p, p.add(len)))
            }
            [a, b] if a.iov_len == len && b.iov_len == len => {
                Some((a.iov_base.cast(), b.iov_base.cast()))
            }
            _ => None,
        }
    }
}

impl IoHandle {
    pub(crate) fn new(idx: u32) -> IoHandle {
        let gen = with_table(|t| t.slots[idx as usize].gen.get());
        IoHandle { idx, gen }
    }

    /// A handle for slot `idx` whose generation the caller just read from
    /// the table (saves a thread-local lookup per I/O).
    pub(crate) fn from_parts(idx: u32, gen: u32) -> IoHandle {
        IoHandle { idx, gen }
    }

    pub fn desc(&self) -> IoDesc {
        slot_desc(self.idx)
    }

    /// The submitter's flags. A driver that says it supports FUA natively
    /// for this kind ([`crate::Bdev::fua_supported`]) honours
    /// [`IoFlags::fua`]; for the others the generic layer flushes.
    #[inline]
    pub fn flags(&self) -> IoFlags {
        with_table(|t| t.slots[self.idx as usize].flags.get())
    }

    /// A 48-bit token for io_uring user_data; see [`IoHandle::from_token`].
    pub fn into_token(self) -> u64 {
        let t = ((self.gen as u64 & 0xffff) << 32) | self.idx as u64;
        std::mem::forget(self);
        t
    }

    /// Rebuilds the handle from a token; `None` if the slot was reused
    /// (a stray completion).
    pub fn from_token(token: u64) -> Option<IoHandle> {
        let idx = token as u32;
        let g = ((token >> 32) & 0xffff) as u32;
        with_table(|t| {
            let s = t.slots.get(idx as usize)?;
            (s.gen.get() & 0xffff == g && s.state.get() != State::Free).then(|| IoHandle {
                idx,
                gen: s.gen.get(),
            })
        })
    }

    /// Completes the I/O.
    #[inline]
    pub fn complete(self, status: Result<(), BdevError>) {
        let (idx, gen) = (self.idx, self.gen);
        std::mem::forget(self);
        with_table(|t| {
            if t.slots[idx as usize].gen.get() != gen {
                tracing::error!("completion of a recycled bdev I/O slot {idx}");
                return;
            }
            t.finish(idx, status)
        });
    }
}

impl Drop for IoHandle {
    fn drop(&mut self) {
        // A driver that drops a handle without completing it would hang the
        // submitter; fail the I/O instead.
        tracing::error!("bdev I/O dropped by its driver without completion");
        let (idx, gen) = (self.idx, self.gen);
        with_table(|t| {
            if t.slots[idx as usize].gen.get() == gen {
                t.finish(idx, Err(BdevError::Io(libc::EIO)))
            }
        });
    }
}
