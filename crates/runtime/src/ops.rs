//! io_uring operations as futures that own their resources.
//!
//! An [`Op`] takes its buffers by value and gives them back with the result:
//! `let (res, buf) = ops::read_at(fd, buf, off).await`. If the future is
//! dropped while the kernel still owns the operation, its resources move into
//! the op slot and are released only when the completion arrives (glommio /
//! monoio's rule: a buffer belongs to the kernel from submission to CQE).

use std::future::Future;
use std::io;
use std::os::fd::RawFd;
use std::pin::Pin;
use std::task::{Context, Poll};

use io_uring::{opcode, squeue, types};

use crate::buf::IoBuf;
use crate::reactor;
use crate::uring::{OpSlot, OpState, OWNER_OPS};

/// Most iovecs one vectored op carries (held inside the op slot).
pub const MAX_IOV: usize = 64;

const NO_SLOT: u32 = u32::MAX;

/// An op whose output is (bytes or error, the buffer back).
pub type BufOp<T> = Op<T, (io::Result<usize>, IoBuf)>;

type Build<T> = fn(&mut T, &OpSlot) -> squeue::Entry;

/// A submitted-on-first-poll io_uring operation owning resources `T`; its
/// output is `finish(raw CQE result, resources)`.
pub struct Op<T: 'static, O = (i32, T)> {
    res: Option<T>,
    build: Build<T>,
    finish: fn(i32, T) -> O,
    slot: u32,
}

impl<T: 'static> Op<T> {
    fn new(res: T, build: Build<T>) -> Op<T> {
        Op {
            res: Some(res),
            build,
            finish: |r, t| (r, t),
            slot: NO_SLOT,
        }
    }
}

impl<T: 'static, O> Op<T, O> {
    fn with_finish(res: T, build: Build<T>, finish: fn(i32, T) -> O) -> Op<T, O> {
        Op {
            res: Some(res),
            build,
            finish,
            slot: NO_SLOT,
        }
    }
}

impl<T: 'static, O> Unpin for Op<T, O> {}

impl<T: 'static, O> Future for Op<T, O> {
    type Output = O;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<O> {
        let this = &mut *self;
        reactor::with(|r| {
            if this.slot == NO_SLOT {
                let Some(idx) = r.ring.alloc_slot() else {
                    r.ring
                        .slot_waiters
                        .borrow_mut()
                        .push_back(cx.waker().clone());
                    return Poll::Pending;
                };
                let slot = &r.ring.slots[idx as usize];
                let res = this.res.as_mut().expect("op polled after completion");
                let sqe =
                    (this.build)(res, slot).user_data(((OWNER_OPS as u64) << 48) | idx as u64);
                *slot.waker.borrow_mut() = Some(cx.waker().clone());
                slot.state.set(OpState::InFlight);
                if let Err(e) = r.ring.push(sqe) {
                    r.ring.free_slot(idx);
                    let res = this.res.take().expect("resources present until completion");
                    return Poll::Ready((this.finish)(-e.raw_os_error().unwrap_or(libc::EIO), res));
                }
                this.slot = idx;
                return Poll::Pending;
            }
            let slot = &r.ring.slots[this.slot as usize];
            match slot.state.get() {
                OpState::Done => {
                    let result = slot.result.get();
                    r.ring.free_slot(this.slot);
                    this.slot = NO_SLOT;
                    Poll::Ready((this.finish)(
                        result,
                        this.res.take().expect("resources present until completion"),
                    ))
                }
                _ => {
                    *slot.waker.borrow_mut() = Some(cx.waker().clone());
                    Poll::Pending
                }
            }
        })
    }
}

impl<T: 'static, O> Drop for Op<T, O> {
    fn drop(&mut self) {
        if self.slot == NO_SLOT {
            return;
        }
        let slot = self.slot;
        let res = self.res.take();
        let kept = reactor::try_with(|r| {
            let s = &r.ring.slots[slot as usize];
            match s.state.get() {
                OpState::InFlight => {
                    // Its SQE may not be submitted yet, and whoever dropped
                    // it may close the descriptor next (see `Ring::flush`).
                    r.ring.flush();
                    s.state.set(OpState::Orphaned);
                    *s.waker.borrow_mut() = None;
                    if let Some(res) = res {
                        *s.orphan.borrow_mut() = Some(Box::new(res));
                    }
                }
                OpState::Done => r.ring.free_slot(slot),
                _ => {}
            }
        });
        debug_assert!(kept.is_some(), "op dropped off its reactor");
    }
}

fn finish_buf<A, C>(res: i32, t: (A, IoBuf, C)) -> (io::Result<usize>, IoBuf) {
    (result(res), t.1)
}

fn finish_buf4<A, C, D>(res: i32, t: (A, IoBuf, C, D)) -> (io::Result<usize>, IoBuf) {
    (result(res), t.1)
}

/// Marks the SQE being built as a send ([`crate::uring::Ring::sends_queued`]).
pub(crate) fn note_send() {
    reactor::try_with(|r| r.ring.note_send());
}

/// Converts a raw CQE result into `io::Result`.
pub fn result(res: i32) -> io::Result<usize> {
    if res < 0 {
        Err(io::Error::from_raw_os_error(-res))
    } else {
        Ok(res as usize)
    }
}

/// Converts a direct syscall's return value (-1 and errno on failure).
fn syscall_result(r: isize) -> io::Result<usize> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// Reads `buf.len()` bytes at `offset` into `buf` (fixed-buffer read for pool
/// buffers).
pub fn read_at(fd: RawFd, buf: IoBuf, offset: u64) -> BufOp<(RawFd, IoBuf, u64)> {
    Op::with_finish(
        (fd, buf, offset),
        |(fd, buf, off), _| {
            let len = buf.len() as u32;
            match buf.fixed_index() {
                Some(i) => opcode::ReadFixed::new(types::Fd(*fd), buf.as_mut_ptr(), len, i)
                    .offset(*off)
                    .build(),
                None => opcode::Read::new(types::Fd(*fd), buf.as_mut_ptr(), len)
                    .offset(*off)
                    .build(),
            }
        },
        finish_buf,
    )
}

/// Writes `buf[..len]` at `offset`.
pub fn write_at(fd: RawFd, buf: IoBuf, offset: u64) -> BufOp<(RawFd, IoBuf, u64)> {
    Op::with_finish(
        (fd, buf, offset),
        |(fd, buf, off), _| {
            let len = buf.len() as u32;
            match buf.fixed_index() {
                Some(i) => opcode::WriteFixed::new(types::Fd(*fd), buf.as_ptr(), len, i)
                    .offset(*off)
                    .build(),
                None => opcode::Write::new(types::Fd(*fd), buf.as_ptr(), len)
                    .offset(*off)
                    .build(),
            }
        },
        finish_buf,
    )
}

/// Receives into `buf[start..buf.capacity()]` (bytes beyond `len` included).
pub fn recv(
    fd: RawFd,
    buf: IoBuf,
    start: usize,
    max: usize,
) -> BufOp<(RawFd, IoBuf, usize, usize)> {
    Op::with_finish(
        (fd, buf, start, max),
        |(fd, buf, start, max), _| {
            let cap = buf.capacity();
            let s = (*start).min(cap);
            let n = (*max).min(cap - s);
            // SAFETY: s <= cap, so the pointer stays inside the buffer.
            let p = unsafe { buf.as_mut_ptr().add(s) };
            opcode::Recv::new(types::Fd(*fd), p, n as u32).build()
        },
        finish_buf4,
    )
}

/// One non-blocking `recv(MSG_DONTWAIT)` into `buf[start..start + max]`
/// (clamped to the capacity), right now on the calling thread. What a
/// receiver that just drained a full socket tries next: while the peer keeps
/// sending, each further batch arrives without waiting a reactor pass for a
/// ring completion, so a busy queue handles (and answers) more per pass.
/// `WouldBlock`: nothing there yet, go on with [`recv`] through the ring.
fn try_recv(fd: RawFd, buf: &mut IoBuf, start: usize, max: usize) -> io::Result<usize> {
    let cap = buf.capacity();
    let s = start.min(cap);
    let n = max.min(cap - s);
    // SAFETY: s + n <= capacity: recv(2) writes only inside the buffer,
    // which the exclusive borrow keeps alive for the call.
    syscall_result(unsafe { libc::recv(fd, buf.as_mut_ptr().add(s).cast(), n, libc::MSG_DONTWAIT) })
}

/// Receives into `buf[start..start + max]` for a staging receiver: when
/// `streaming` (its last receive held more than one message), a direct
/// [`try_recv`] first, so data that has already arrived is taken in this
/// pass; otherwise, or when nothing is there yet, a ring [`recv`]. The
/// buffer leaves `slot` only while the ring owns it. Returns the result and
/// the number of receive calls made (one or two).
pub async fn recv_staged(
    fd: RawFd,
    slot: &mut Option<IoBuf>,
    start: usize,
    max: usize,
    streaming: bool,
) -> (io::Result<usize>, u64) {
    let mut calls = 0;
    if streaming {
        let Some(buf) = slot.as_mut() else {
            return (Err(io::ErrorKind::BrokenPipe.into()), calls);
        };
        calls += 1;
        match try_recv(fd, buf, start, max) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            r => return (r, calls),
        }
    }
    let Some(buf) = slot.take() else {
        return (Err(io::ErrorKind::BrokenPipe.into()), calls);
    };
    let (r, buf) = recv(fd, buf, start, max).await;
    *slot = Some(buf);
    (r, calls + 1)
}

/// Sends `buf[start..end]`.
pub fn send(
    fd: RawFd,
    buf: IoBuf,
    start: usize,
    end: usize,
) -> BufOp<(RawFd, IoBuf, usize, usize)> {
    Op::with_finish(
        (fd, buf, start, end),
        |(fd, buf, start, end), _| {
            let e = (*end).min(buf.len());
            let s = (*start).min(e);
            // SAFETY: s <= e <= len.
            let p = unsafe { buf.as_ptr().add(s) };
            note_send();
            opcode::Send::new(types::Fd(*fd), p, (e - s) as u32)
                .flags(libc::MSG_NOSIGNAL)
                .build()
        },
        finish_buf4,
    )
}

/// Resources a vectored send keeps alive, plus the iovecs into them.
pub trait IoVecs: 'static {
    /// Fills `out` with the segments to send; returns how many.
    fn iovecs(&self, out: &mut [libc::iovec; MAX_IOV]) -> usize;
}

/// Sends all of `buf` (`send` until done); gives the buffer back. A peer
/// that stops accepting data mid-way is `UnexpectedEof`.
pub async fn send_all(fd: RawFd, mut buf: IoBuf) -> (io::Result<()>, IoBuf) {
    let end = buf.len();
    let mut at = 0;
    while at < end {
        let (res, b) = send(fd, buf, at, end).await;
        buf = b;
        match res {
            Ok(0) => {
                let e = io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the connection");
                return (Err(e), buf);
            }
            Ok(n) => at += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return (Err(e), buf),
        }
    }
    (Ok(()), buf)
}

/// One non-blocking `sendmsg` of the segments `res` describes, right now on
/// the calling thread: what a sender tries first, so a socket with room
/// takes the data without waiting a reactor pass for a ring completion
/// (with one send in flight per connection that wait serialised a busy
/// queue to one `sendmsg` per pass). `WouldBlock` or a short count: go on
/// with [`sendmsg`] through the ring, which waits for room.
pub fn try_sendmsg<T: IoVecs>(fd: RawFd, res: &T) -> io::Result<usize> {
    let mut iov = [libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; MAX_IOV];
    let n = res.iovecs(&mut iov);
    // SAFETY: the iovecs point into buffers `res` owns, which the borrow
    // keeps alive for the duration of the call.
    unsafe { sendmsg_now(fd, &iov[..n]) }
}

/// One non-blocking `sendmsg(MSG_DONTWAIT | MSG_NOSIGNAL)` of `iov` on the
/// calling thread (see [`try_sendmsg`]); for senders that build their own
/// iovecs.
///
/// # Safety
/// Every iovec must describe readable memory that stays valid for the call.
pub unsafe fn sendmsg_now(fd: RawFd, iov: &[libc::iovec]) -> io::Result<usize> {
    // SAFETY: an all-zero msghdr is valid (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = iov.len() as _;
    // SAFETY: plain sendmsg(2), which only reads the iovecs and the memory
    // they point to, valid for the call per this function's contract.
    syscall_result(unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) })
}

/// Sends the segments `res` describes with one `sendmsg` (header + data).
pub fn sendmsg<T: IoVecs>(fd: RawFd, res: T) -> Op<(RawFd, T), (io::Result<usize>, T)> {
    Op::with_finish(
        (fd, res),
        |(fd, res), slot| {
            // SAFETY: the slot's iov/msg cells are used only by the op that owns
            // the slot, and live in a boxed slice that never moves.
            let (iov, msg) = unsafe { (&mut *slot.iov.get(), &mut *slot.msg.get()) };
            let n = res.iovecs(iov);
            *msg = unsafe { std::mem::zeroed() };
            msg.msg_iov = iov.as_mut_ptr();
            msg.msg_iovlen = n as _;
            note_send();
            opcode::SendMsg::new(types::Fd(*fd), msg)
                .flags(libc::MSG_NOSIGNAL as u32)
                .build()
        },
        |r, (_, t)| (result(r), t),
    )
}

/// Accepts a connection on a listening socket; result is the new fd.
pub fn accept(fd: RawFd) -> Op<RawFd, io::Result<RawFd>> {
    Op::with_finish(
        fd,
        |fd, slot| {
            // SAFETY: slot-owned address storage, see `sendmsg`.
            let (addr, len) = unsafe { (&mut *slot.addr.get(), &mut *slot.addrlen.get()) };
            *len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            opcode::Accept::new(
                types::Fd(*fd),
                (addr as *mut libc::sockaddr_storage).cast(),
                len,
            )
            .flags(libc::SOCK_CLOEXEC)
            .build()
        },
        |r, _| result(r).map(|fd| fd as RawFd),
    )
}

/// fsync (or fdatasync) of a file.
pub fn fsync(fd: RawFd, datasync: bool) -> Op<RawFd> {
    if datasync {
        Op::new(fd, |fd, _| {
            opcode::Fsync::new(types::Fd(*fd))
                .flags(types::FsyncFlags::DATASYNC)
                .build()
        })
    } else {
        Op::new(fd, |fd, _| opcode::Fsync::new(types::Fd(*fd)).build())
    }
}

/// fallocate(fd, mode, offset, len).
pub fn fallocate(fd: RawFd, mode: i32, offset: u64, len: u64) -> Op<(RawFd, i32, u64, u64)> {
    Op::new((fd, mode, offset, len), |(fd, mode, off, len), _| {
        opcode::Fallocate::new(types::Fd(*fd), *len)
            .offset(*off)
            .mode(*mode)
            .build()
    })
}

/// Waits until `fd` is ready for `events` (POLLIN/POLLOUT).
pub fn poll_ready(fd: RawFd, events: u32) -> Op<(RawFd, u32)> {
    Op::new((fd, events), |(fd, ev), _| {
        opcode::PollAdd::new(types::Fd(*fd), *ev).build()
    })
}

/// A no-op round trip through the ring (tests, benchmarks of the ring).
pub fn nop() -> Op<()> {
    Op::new((), |_, _| opcode::Nop::new().build())
}
