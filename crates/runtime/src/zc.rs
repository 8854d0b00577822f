//! Zero-copy sends: `IORING_OP_SENDMSG_ZC`.
//!
//! The kernel sends straight from the caller's pages (pinned, no copy into
//! socket buffers) and completes twice: once when the send is done (the
//! byte count; `CQE_F_MORE` says a notification follows) and once more, the
//! notification, when the network stack has released the pages (for TCP:
//! once the data is acknowledged). Until then the memory must stay valid
//! and unchanged, so [`sendmsg_zc`] resolves on the first completion (the
//! caller may go on sending) and keeps the resources in the op slot until
//! the notification, then hands them to `on_notif` with what the kernel
//! reported: whether it copied after all (`IORING_NOTIF_USAGE_ZC_COPIED`;
//! loopback and devices without scatter-gather always do).

use std::future::Future;
use std::io;
use std::os::fd::RawFd;
use std::pin::Pin;
use std::task::{Context, Poll};

use io_uring::{opcode, types};

use crate::ops::{result, IoVecs};
use crate::reactor;
use crate::uring::OpState;

/// `IORING_SEND_ZC_REPORT_USAGE` (SQE ioprio): ask the notification to say
/// whether the kernel copied.
const REPORT_USAGE: u16 = 8;
/// `IORING_NOTIF_USAGE_ZC_COPIED`, in the notification's result.
const USAGE_COPIED: i32 = i32::MIN;

/// What the kernel said once it released a zero-copy send's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ZcNotice {
    /// A notification came (false: the send failed before the kernel took
    /// the pages, and nothing was sent zero-copy).
    pub notified: bool,
    /// The kernel copied the data after all (loopback, no SG support), or
    /// nothing went out zero-copy (the kernel reports that as copied too).
    pub copied: bool,
}

/// Whether this reactor's kernel has `IORING_OP_SENDMSG_ZC`.
pub fn send_zc_supported() -> bool {
    reactor::try_with(|r| r.ring.send_zc).unwrap_or(false)
}

/// Callback run with the resources once the kernel released them.
pub type OnNotif<T> = fn(T, ZcNotice);

/// One `sendmsg` with `IORING_OP_SENDMSG_ZC` of the segments `res`
/// describes. Resolves on the send's completion with its byte count;
/// `res` goes to `on_notif` once the kernel no longer reads it (at once,
/// with `notified: false`, when no notification follows). A dropped future
/// keeps `res` alive until then too (without calling `on_notif`).
pub fn sendmsg_zc<T: IoVecs>(fd: RawFd, res: T, on_notif: OnNotif<T>) -> SendZc<T> {
    SendZc {
        fd,
        res: Some(res),
        on_notif,
        slot: u32::MAX,
    }
}

/// The future of [`sendmsg_zc`].
pub struct SendZc<T: IoVecs> {
    fd: RawFd,
    res: Option<T>,
    on_notif: OnNotif<T>,
    slot: u32,
}

impl<T: IoVecs> Unpin for SendZc<T> {}

impl<T: IoVecs> SendZc<T> {
    /// Builds and pushes the SQE; `Err` with the submission's errno.
    fn submit(&mut self, cx: &Context<'_>) -> Option<Result<(), i32>> {
        reactor::with(|r| {
            let Some(idx) = r.ring.alloc_slot() else {
                r.ring
                    .slot_waiters
                    .borrow_mut()
                    .push_back(cx.waker().clone());
                return None;
            };
            let slot = &r.ring.slots[idx as usize];
            let res = self
                .res
                .as_ref()
                .expect("resources present until completion");
            // SAFETY: the slot's iov/msg cells belong to the op owning the
            // slot, in a boxed slice that never moves; the slot is held
            // until the notification, so they outlive the kernel's use.
            let (iov, msg) = unsafe { (&mut *slot.iov.get(), &mut *slot.msg.get()) };
            let n = res.iovecs(iov);
            // SAFETY: an all-zero msghdr is valid (no name, no control).
            *msg = unsafe { std::mem::zeroed() };
            msg.msg_iov = iov.as_mut_ptr();
            msg.msg_iovlen = n as _;
            let sqe = opcode::SendMsgZc::new(types::Fd(self.fd), msg)
                .ioprio(REPORT_USAGE)
                .flags(libc::MSG_NOSIGNAL as u32)
                .build()
                .user_data(((crate::uring::OWNER_OPS as u64) << 48) | idx as u64);
            *slot.waker.borrow_mut() = Some(cx.waker().clone());
            slot.state.set(OpState::InFlight);
            if let Err(e) = r.ring.push(sqe) {
                r.ring.free_slot(idx);
                return Some(Err(-e.raw_os_error().unwrap_or(libc::EIO)));
            }
            r.ring.note_send();
            self.slot = idx;
            Some(Ok(()))
        })
    }
}

impl<T: IoVecs> Future for SendZc<T> {
    type Output = io::Result<usize>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.slot == u32::MAX {
            return match this.submit(cx) {
                None | Some(Ok(())) => Poll::Pending,
                Some(Err(e)) => {
                    let res = this.res.take().expect("resources present");
                    (this.on_notif)(res, ZcNotice::default_failed());
                    Poll::Ready(result(e))
                }
            };
        }
        let idx = this.slot;
        let done = reactor::with(|r| {
            let s = &r.ring.slots[idx as usize];
            match s.state.get() {
                OpState::Done | OpState::Notified => {
                    let st = s.state.get();
                    let (res, flags) = (s.result.get(), s.flags.get());
                    let t = this.res.take().expect("resources present until completion");
                    let f = this.on_notif;
                    if st == OpState::Notified {
                        let n = s.notif.get();
                        r.ring.free_slot(idx);
                        Some((res, Some((t, f, Some(n)))))
                    } else if io_uring::cqueue::more(flags) {
                        // The kernel still reads `t`: the slot keeps it.
                        *s.on_notif.borrow_mut() = Some(Box::new(move |n| f(t, notice(n))));
                        s.state.set(OpState::Notify);
                        Some((res, None))
                    } else {
                        r.ring.free_slot(idx);
                        Some((res, Some((t, f, None))))
                    }
                }
                _ => {
                    *s.waker.borrow_mut() = Some(cx.waker().clone());
                    None
                }
            }
        });
        let Some((res, now)) = done else {
            return Poll::Pending;
        };
        this.slot = u32::MAX;
        // Run outside the reactor borrow: the callback may do anything.
        if let Some((t, f, n)) = now {
            f(t, n.map_or(ZcNotice::default_failed(), notice));
        }
        Poll::Ready(result(res))
    }
}

impl ZcNotice {
    fn default_failed() -> ZcNotice {
        ZcNotice {
            notified: false,
            copied: false,
        }
    }
}

fn notice(n: i32) -> ZcNotice {
    ZcNotice {
        notified: true,
        copied: n & USAGE_COPIED != 0,
    }
}

impl<T: IoVecs> Drop for SendZc<T> {
    fn drop(&mut self) {
        if self.slot == u32::MAX {
            return;
        }
        let (slot, res) = (self.slot, self.res.take());
        let kept = reactor::try_with(|r| {
            let s = &r.ring.slots[slot as usize];
            let st = s.state.get();
            let pending_notif = st == OpState::Done && io_uring::cqueue::more(s.flags.get());
            if st == OpState::InFlight || pending_notif {
                s.state.set(OpState::Orphaned);
                *s.waker.borrow_mut() = None;
                if let Some(res) = res {
                    *s.orphan.borrow_mut() = Some(Box::new(res));
                }
            } else {
                r.ring.free_slot(slot);
            }
        });
        debug_assert!(kept.is_some(), "op dropped off its reactor");
    }
}
