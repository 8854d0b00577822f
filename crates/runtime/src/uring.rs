//! The reactor's io_uring: SQE submission, CQE reaping and dispatch.
//!
//! `user_data` = `owner << 48 | token`. Owner 0 is the op slab behind the
//! futures of [`crate::ops`]; owner 1 is the wake-up eventfd read; owners from
//! 2 on are completion handlers that drivers register (a uring bdev channel
//! registers one and uses its own slab index + generation as the token).
//! Completions are copied out of the CQ first and dispatched afterwards, so a
//! handler may submit again without re-entering the ring.

use std::any::Any;
use std::cell::{Cell, RefCell, UnsafeCell};
use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;
use std::rc::Rc;
use std::task::Waker;

use io_uring::{opcode, squeue, types, IoUring};

use crate::buf::BufPool;
use crate::config::RuntimeConfig;
use crate::reactor;

const OWNER_SHIFT: u32 = 48;
const TOKEN_MASK: u64 = (1 << OWNER_SHIFT) - 1;
pub(crate) const OWNER_OPS: u16 = 0;
const OWNER_WAKE: u16 = 1;
const FIRST_HANDLER: u16 = 2;
const REAP_BATCH: usize = 128;
/// Registered-file slots per reactor ring.
const FILE_SLOTS: u32 = 256;

/// Receives the completions of SQEs a driver submitted with [`submit_sqe`].
pub trait CqeHandler {
    fn complete(&self, token: u64, result: i32, flags: u32);
}

/// Owner id of a registered [`CqeHandler`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HandlerId(pub u16);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum OpState {
    Free,
    InFlight,
    Done,
    Orphaned,
    /// A zero-copy send whose future resolved on its first completion: the
    /// slot waits for the notification and then runs `on_notif`.
    Notify,
    /// A zero-copy send's notification arrived before its future saw the
    /// first completion (both in one reap): the result is in `notif`.
    Notified,
}

/// Run with a zero-copy send's notification result.
pub(crate) type NotifFn = Box<dyn FnOnce(i32)>;

/// One in-flight future op. Lives in a boxed slice that never moves, so the
/// iovecs and msghdr inside stay valid while the kernel reads them.
pub(crate) struct OpSlot {
    pub(crate) state: Cell<OpState>,
    pub(crate) result: Cell<i32>,
    pub(crate) flags: Cell<u32>,
    pub(crate) waker: RefCell<Option<Waker>>,
    pub(crate) orphan: RefCell<Option<Box<dyn Any>>>,
    /// A zero-copy send's resources and what to do with them once the
    /// kernel's notification says it no longer reads them.
    pub(crate) on_notif: RefCell<Option<NotifFn>>,
    /// The notification's result (`IORING_NOTIF_USAGE_ZC_COPIED`).
    pub(crate) notif: Cell<i32>,
    pub(crate) iov: UnsafeCell<[libc::iovec; crate::ops::MAX_IOV]>,
    pub(crate) msg: UnsafeCell<libc::msghdr>,
    pub(crate) addr: UnsafeCell<libc::sockaddr_storage>,
    pub(crate) addrlen: UnsafeCell<libc::socklen_t>,
}

pub(crate) struct Ring {
    ring: RefCell<IoUring>,
    handlers: RefCell<Vec<Option<Rc<dyn CqeHandler>>>>,
    pub(crate) slots: Box<[OpSlot]>,
    free: RefCell<Vec<u32>>,
    pub(crate) slot_waiters: RefCell<VecDeque<Waker>>,
    inflight: Cell<u64>,
    eventfd: RawFd,
    wake_buf: Box<UnsafeCell<u64>>,
    wake_armed: Cell<bool>,
    /// A send is queued in the SQ (see [`Ring::sends_queued`]).
    sends: Cell<bool>,
    pub(crate) submits: Cell<u64>,
    pub(crate) cqes: Cell<u64>,
    /// Registered-file slots in use (empty if the kernel has no sparse table).
    files: RefCell<Vec<bool>>,
    /// Whether the kernel has IORING_OP_SENDMSG_ZC (probed once).
    pub(crate) send_zc: bool,
    /// The CQ's head and tail, read without borrowing the ring: an idle
    /// pass sees an empty CQ with two loads, not a CQ borrow and its head
    /// store. Points into the ring's mapping, which lives as long as
    /// `ring` (the same struct).
    cq: io_uring::cqueue::CompletionStatus,
}

/// Registered buffers count against RLIMIT_MEMLOCK for a process without
/// CAP_IPC_LOCK; the kernel's bare ENOMEM says nothing about that, so say it.
fn memlock_hint(e: io::Error, len: usize) -> io::Error {
    if e.raw_os_error() != Some(libc::ENOMEM) {
        return e;
    }
    io::Error::new(
        e.kind(),
        format!(
            "registering the {} MiB buffer pool with io_uring: {e}; the memory-lock limit \
             is too low: raise it (`ulimit -l`, systemd LimitMEMLOCK=) or grant CAP_IPC_LOCK",
            len >> 20
        ),
    )
}

impl Ring {
    pub(crate) fn new(cfg: &RuntimeConfig, bufs: &BufPool, eventfd: RawFd) -> io::Result<Ring> {
        let entries = cfg.ring_entries.max(8);
        // SINGLE_ISSUER + DEFER_TASKRUN: completions are posted when this
        // thread asks (one enter per loop pass), not by interrupting it.
        let ring = IoUring::builder()
            .setup_cqsize(entries * 2)
            .setup_single_issuer()
            .setup_defer_taskrun()
            .setup_taskrun_flag()
            .setup_submit_all()
            .build(entries)
            .or_else(|_| IoUring::builder().setup_cqsize(entries * 2).build(entries))?;
        let region = bufs.region();
        // SAFETY: the region is the pool's mmap, which outlives the ring (the
        // reactor drops the ring first: field order in `Reactor`).
        unsafe { ring.submitter().register_buffers(&[region]) }
            .map_err(|e| memlock_hint(e, region.iov_len))?;
        // A sparse table for drivers' registered files (saves the fd lookup
        // and reference counting per I/O). Optional: older kernels lack it.
        let files = if ring.submitter().register_files_sparse(FILE_SLOTS).is_ok() {
            vec![false; FILE_SLOTS as usize]
        } else {
            Vec::new()
        };
        let mut probe = io_uring::Probe::new();
        let send_zc = ring.submitter().register_probe(&mut probe).is_ok()
            && probe.is_supported(opcode::SendMsgZc::CODE);
        let n = cfg.max_ops.max(16) as usize;
        let slots: Vec<OpSlot> = (0..n)
            .map(|_| OpSlot {
                state: Cell::new(OpState::Free),
                result: Cell::new(0),
                flags: Cell::new(0),
                waker: RefCell::new(None),
                orphan: RefCell::new(None),
                on_notif: RefCell::new(None),
                notif: Cell::new(0),
                iov: UnsafeCell::new(
                    [libc::iovec {
                        iov_base: std::ptr::null_mut(),
                        iov_len: 0,
                    }; crate::ops::MAX_IOV],
                ),
                // SAFETY: msghdr and sockaddr_storage are plain C structs for
                // which all-zero is a valid value.
                msg: UnsafeCell::new(unsafe { std::mem::zeroed() }),
                addr: UnsafeCell::new(unsafe { std::mem::zeroed() }),
                addrlen: UnsafeCell::new(0),
            })
            .collect();
        let free = (0..n as u32).rev().collect();
        // SAFETY: the status points into the ring's mapping; it is kept in
        // the same `Ring` as the ring and never handed out, so it does not
        // outlive it.
        let cq = unsafe { ring.completion_shared().status() };
        Ok(Ring {
            cq,
            ring: RefCell::new(ring),
            handlers: RefCell::new(Vec::with_capacity(64)),
            slots: slots.into_boxed_slice(),
            free: RefCell::new(free),
            slot_waiters: RefCell::new(VecDeque::with_capacity(1024)),
            inflight: Cell::new(0),
            eventfd,
            wake_buf: Box::new(UnsafeCell::new(0)),
            wake_armed: Cell::new(false),
            sends: Cell::new(false),
            submits: Cell::new(0),
            cqes: Cell::new(0),
            files: RefCell::new(files),
            send_zc,
        })
    }

    /// Queues one SQE; flushes the SQ to the kernel first if it is full.
    pub(crate) fn push(&self, sqe: squeue::Entry) -> io::Result<()> {
        let mut ring = self.ring.borrow_mut();
        // SAFETY: the caller of every push guarantees the buffers the SQE
        // points at stay valid until its CQE is reaped (slot memory, pool
        // buffers held by the op, or a driver's own slab).
        if unsafe { ring.submission().push(&sqe) }.is_err() {
            ring.submit()?;
            self.submits.set(self.submits.get() + 1);
            // SAFETY: as above.
            unsafe { ring.submission().push(&sqe) }
                .map_err(|_| io::Error::from_raw_os_error(libc::EBUSY))?;
        }
        self.inflight.set(self.inflight.get() + 1);
        Ok(())
    }

    pub(crate) fn alloc_slot(&self) -> Option<u32> {
        self.free.borrow_mut().pop()
    }

    pub(crate) fn free_slot(&self, idx: u32) {
        let s = &self.slots[idx as usize];
        s.state.set(OpState::Free);
        *s.waker.borrow_mut() = None;
        self.free.borrow_mut().push(idx);
        let w = self.slot_waiters.borrow_mut().pop_front();
        if let Some(w) = w {
            w.wake();
        }
    }

    fn arm_wake(&self) {
        if self.wake_armed.get() {
            return;
        }
        let sqe = opcode::Read::new(types::Fd(self.eventfd), self.wake_buf.get().cast(), 8)
            .build()
            .user_data((OWNER_WAKE as u64) << OWNER_SHIFT);
        if self.push(sqe).is_ok() {
            self.wake_armed.set(true);
        }
    }

    /// Hands every queued SQE to the kernel now, without waiting or reaping.
    ///
    /// An SQE names its socket or file by descriptor number, and the kernel
    /// resolves the number only when the SQE is submitted. An op whose
    /// future is dropped (a timeout, a task torn down) may still sit in the
    /// SQ while its owner closes the descriptor; if another thread then
    /// gets the same number (an accept, an open), the later submission
    /// would run the op on that file: a receive would take another
    /// connection's bytes. Flushing before the descriptor can close binds
    /// the op to its own file; it then ends with a cancel or the file.
    pub(crate) fn flush(&self) {
        let mut ring = self.ring.borrow_mut();
        if ring.submission().is_empty() {
            return;
        }
        if let Err(e) = ring.submit() {
            if e.raw_os_error() != Some(libc::EINTR) && e.raw_os_error() != Some(libc::EBUSY) {
                tracing::error!("io_uring submit failed: {e}");
            }
        }
        self.sends.set(false);
        self.submits.set(self.submits.get() + 1);
    }

    /// Submits queued SQEs and runs pending task work when there is any, then
    /// dispatches every completion. Returns the number of completions.
    pub(crate) fn submit_and_reap(&self, _block: bool) -> usize {
        // `inflight` counts every SQE pushed until its last CQE is reaped:
        // at zero nothing is queued and no op can have task work, so the
        // pass skips the SQ (a busy reactor whose work is all in memory,
        // such as a vhost queue, is there every pass).
        if self.inflight.get() > 0 {
            let mut ring = self.ring.borrow_mut();
            // One borrow of the SQ for both looks (each borrow loads its
            // head and stores its tail back).
            let sq = ring.submission();
            let (pending, taskrun) = (sq.len(), sq.taskrun());
            drop(sq);
            if pending > 0 || taskrun {
                // With DEFER_TASKRUN completions are posted only by an enter
                // with GETEVENTS; TASKRUN_FLAG tells us when there is such
                // work, so an idle pass with ops in flight costs no syscall.
                // SAFETY: plain io_uring_enter with no argument.
                let r = unsafe {
                    ring.submitter().enter::<libc::sigset_t>(
                        pending as u32,
                        0,
                        libc_enter_getevents(),
                        None,
                    )
                };
                if let Err(e) = r {
                    if e.raw_os_error() != Some(libc::EINTR)
                        && e.raw_os_error() != Some(libc::EBUSY)
                    {
                        tracing::error!("io_uring_enter failed: {e}");
                    }
                }
                self.sends.set(false);
                self.submits.set(self.submits.get() + 1);
            }
        }
        if self.cq.is_empty() {
            return 0;
        }
        self.reap()
    }

    fn reap(&self) -> usize {
        let mut total = 0;
        // Uninitialised on purpose: zeroing 2 KiB here ran on every reactor
        // pass (memset was 9% of a busy NVMe/TCP target's CPU). Only the
        // first `n` entries, written below, are ever read.
        let mut batch = [std::mem::MaybeUninit::<(u64, i32, u32)>::uninit(); REAP_BATCH];
        loop {
            let n = {
                let mut ring = self.ring.borrow_mut();
                let mut cq = ring.completion();
                let mut n = 0;
                for cqe in &mut cq {
                    batch[n].write((cqe.user_data(), cqe.result(), cqe.flags()));
                    n += 1;
                    if n == REAP_BATCH {
                        break;
                    }
                }
                n
            };
            for e in &batch[..n] {
                // SAFETY: entries 0..n were written by the loop above.
                let (ud, res, flags) = unsafe { e.assume_init() };
                self.dispatch(ud, res, flags);
            }
            total += n;
            if n < REAP_BATCH {
                break;
            }
        }
        self.cqes.set(self.cqes.get() + total as u64);
        total
    }

    fn dispatch(&self, ud: u64, res: i32, flags: u32) {
        // Multishot completions (CQE_F_MORE) keep the request alive.
        if !io_uring::cqueue::more(flags) {
            self.inflight.set(self.inflight.get().saturating_sub(1));
        }
        let owner = (ud >> OWNER_SHIFT) as u16;
        let token = ud & TOKEN_MASK;
        match owner {
            OWNER_OPS => self.complete_op(token as u32, res, flags),
            OWNER_WAKE => self.wake_armed.set(false),
            _ => {
                let h = self
                    .handlers
                    .borrow()
                    .get((owner - FIRST_HANDLER) as usize)
                    .cloned()
                    .flatten();
                match h {
                    Some(h) => h.complete(token, res, flags),
                    None => tracing::warn!("completion for unregistered handler {owner}"),
                }
            }
        }
    }

    fn complete_op(&self, idx: u32, res: i32, flags: u32) {
        let Some(s) = self.slots.get(idx as usize) else {
            return;
        };
        // A zero-copy send completes twice: the send (CQE_F_MORE: a
        // notification follows) and the notification (CQE_F_NOTIF), after
        // which the kernel no longer reads the memory it was given.
        let notif = io_uring::cqueue::notif(flags);
        match (s.state.get(), notif) {
            (OpState::InFlight, false) => {
                s.result.set(res);
                s.flags.set(flags);
                s.state.set(OpState::Done);
                let w = s.waker.borrow_mut().take();
                if let Some(w) = w {
                    w.wake();
                }
            }
            // The future was dropped: its resources stay here until the
            // kernel is done with them (the notification, if one follows).
            (OpState::Orphaned, _) if io_uring::cqueue::more(flags) => {}
            (OpState::Orphaned, _) => {
                let orphan = s.orphan.borrow_mut().take();
                drop(orphan);
                self.free_slot(idx);
            }
            (OpState::Done, true) => {
                s.notif.set(res);
                s.state.set(OpState::Notified);
            }
            (OpState::Notify, true) => {
                let f = s.on_notif.borrow_mut().take();
                self.free_slot(idx);
                if let Some(f) = f {
                    f(res);
                }
            }
            (st, _) => tracing::error!("stray completion for op slot {idx} ({st:?}, {flags:#x})"),
        }
    }

    /// Whether SQEs wait in the SQ for the next `io_uring_enter`.
    pub(crate) fn has_queued(&self) -> bool {
        !self.ring.borrow_mut().submission().is_empty()
    }

    /// Notes that the SQE just queued is a send.
    pub(crate) fn note_send(&self) {
        self.sends.set(true);
    }

    /// Whether a send waits in the SQ for the next `io_uring_enter`. A
    /// send to a socket with room completes inside the enter that submits
    /// it (its CQE is posted before the enter would wait), so an enter that
    /// carries one and then waits returns at once: a wait that is not one.
    /// The reactor submits such a pass's SQEs without waiting, reaps the
    /// send in the same pass, and waits in the next (`Reactor::run`).
    pub(crate) fn sends_queued(&self) -> bool {
        self.sends.get()
    }

    /// Whether completions wait in the CQ (reaping them needs no syscall).
    pub(crate) fn has_completions(&self) -> bool {
        !self.cq.is_empty()
    }

    /// Whether nothing is in flight but the wake-up read, nothing is
    /// queued and no completion waits: a sleep could only end by a wake
    /// from another thread or a timeout.
    pub(crate) fn idle(&self) -> bool {
        self.inflight.get() == u64::from(self.wake_armed.get())
            && self.cq.is_empty()
            && !self.has_queued()
    }

    /// Blocks until at least one completion or `timeout_ns`.
    pub(crate) fn wait(&self, timeout_ns: Option<u64>) {
        self.arm_wake();
        self.sends.set(false);
        let ring = self.ring.borrow();
        let ts;
        let r = match timeout_ns {
            Some(ns) => {
                ts = types::Timespec::new()
                    .sec(ns / 1_000_000_000)
                    .nsec((ns % 1_000_000_000) as u32);
                let args = types::SubmitArgs::new().timespec(&ts);
                ring.submitter().submit_with_args(1, &args)
            }
            None => ring.submitter().submit_and_wait(1),
        };
        if let Err(e) = r {
            if !matches!(
                e.raw_os_error(),
                Some(libc::ETIME) | Some(libc::EINTR) | Some(libc::EBUSY)
            ) {
                tracing::error!("io_uring wait failed: {e}");
            }
        }
    }

    /// Cancels everything in flight and reaps until the kernel has returned
    /// every buffer (bounded to 2 s), so no memory is freed under the kernel.
    pub(crate) fn cancel_all_and_drain(&self) {
        let cancel = opcode::AsyncCancel2::new(types::CancelBuilder::any())
            .build()
            .user_data(u64::MAX >> 16);
        let _ = self.push(cancel);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while self.inflight.get() > 0 && std::time::Instant::now() < deadline {
            self.submit_and_reap(false);
            if self.inflight.get() > 0 {
                self.wait(Some(10_000_000));
            }
        }
    }

    pub(crate) fn register_handler(&self, h: Rc<dyn CqeHandler>) -> HandlerId {
        let mut hs = self.handlers.borrow_mut();
        if let Some(i) = hs.iter().position(|x| x.is_none()) {
            hs[i] = Some(h);
            return HandlerId(i as u16 + FIRST_HANDLER);
        }
        hs.push(Some(h));
        HandlerId((hs.len() - 1) as u16 + FIRST_HANDLER)
    }

    pub(crate) fn unregister_handler(&self, id: HandlerId) {
        if let Some(x) = self
            .handlers
            .borrow_mut()
            .get_mut((id.0 - FIRST_HANDLER) as usize)
        {
            *x = None;
        }
    }

    fn register_file(&self, fd: RawFd) -> Option<u32> {
        let mut files = self.files.borrow_mut();
        let idx = files.iter().position(|used| !used)?;
        let ring = self.ring.borrow();
        ring.submitter()
            .register_files_update(idx as u32, &[fd])
            .ok()?;
        files[idx] = true;
        Some(idx as u32)
    }

    fn unregister_file(&self, idx: u32) {
        let mut files = self.files.borrow_mut();
        if let Some(used) = files.get_mut(idx as usize) {
            let ring = self.ring.borrow();
            let _ = ring.submitter().register_files_update(idx, &[-1]);
            *used = false;
        }
    }

    pub(crate) fn inflight(&self) -> u64 {
        self.inflight.get()
    }
}

fn libc_enter_getevents() -> u32 {
    // IORING_ENTER_GETEVENTS from <linux/io_uring.h>.
    1
}

/// Whether the current reactor has SQEs queued for its next
/// `io_uring_enter` (false off a reactor). A sender that finds some can
/// queue its send as one more SQE instead of making a `sendmsg` of its
/// own: the enter the reactor makes anyway carries both, and a send to a
/// socket with room completes inside it.
pub fn sq_pending() -> bool {
    reactor::try_with(|r| r.ring.has_queued()).unwrap_or(false)
}

/// Whether the caller runs on a reactor (and so may queue ring ops).
pub fn on_reactor() -> bool {
    reactor::try_with(|_| ()).is_some()
}

/// Registers a completion handler on the current reactor's ring.
pub fn register_cqe_handler(h: Rc<dyn CqeHandler>) -> HandlerId {
    reactor::with(|r| r.ring.register_handler(h))
}

/// Registers `fd` in the current reactor's ring file table; SQEs may then
/// name it as `types::Fixed(index)`. `None` when the table is full or the
/// kernel has none (use the plain fd then).
pub fn register_file(fd: RawFd) -> Option<u32> {
    reactor::try_with(|r| r.ring.register_file(fd)).flatten()
}

/// Frees a registered-file slot (its SQEs must have completed). A no-op
/// after the reactor exited.
pub fn unregister_file(index: u32) {
    let _ = reactor::try_with(|r| r.ring.unregister_file(index));
}

/// Removes a handler. Its in-flight SQEs must have completed first. A no-op
/// after the reactor exited.
pub fn unregister_cqe_handler(id: HandlerId) {
    let _ = reactor::try_with(|r| r.ring.unregister_handler(id));
}

/// Queues `sqe` on the current reactor's ring; its completion goes to
/// `handler` with `token` (48 bits).
///
/// # Safety
/// Every buffer, iovec and fd the SQE refers to must stay valid until the
/// handler receives the completion.
pub unsafe fn submit_sqe(sqe: squeue::Entry, handler: HandlerId, token: u64) -> io::Result<()> {
    debug_assert!(token <= TOKEN_MASK);
    let ud = ((handler.0 as u64) << OWNER_SHIFT) | (token & TOKEN_MASK);
    reactor::with(|r| r.ring.push(sqe.user_data(ud)))
}

/// Whether the running kernel's io_uring accepts `setup` flags such as
/// IOPOLL on `fd`: used by drivers to detect and report fallbacks.
pub fn probe_ring(entries: u32, iopoll: bool, sqpoll: Option<u32>) -> io::Result<IoUring> {
    let mut b = IoUring::builder();
    if iopoll {
        b.setup_iopoll();
    }
    if let Some(idle) = sqpoll {
        b.setup_sqpoll(idle);
    }
    b.build(entries)
}

#[cfg(test)]
mod tests {
    use super::memlock_hint;
    use std::io;

    #[test]
    fn enomem_from_buffer_registration_names_the_memlock_limit() {
        let e = memlock_hint(io::Error::from_raw_os_error(libc::ENOMEM), 64 << 20);
        let msg = e.to_string();
        assert!(msg.contains("64 MiB buffer pool"), "{msg}");
        assert!(
            msg.contains("CAP_IPC_LOCK") && msg.contains("ulimit -l"),
            "{msg}"
        );
        let other = memlock_hint(io::Error::from_raw_os_error(libc::EINVAL), 64 << 20);
        assert_eq!(other.raw_os_error(), Some(libc::EINVAL));
    }
}
