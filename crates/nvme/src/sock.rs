//! Socket helpers for NVMe/TCP queues: the initiator's connect in blocking
//! mode for io_uring sends, and a vectored receive straight into caller
//! memory (the initiator's bdev I/O buffers; the target's pool buffer for a
//! large payload, with the header behind it into its staging buffer).
//!
//! The receive is a `recvmsg(MSG_DONTWAIT)` on data already queued and an
//! io_uring poll for readiness when there is none: the runtime's `ops::recv`
//! takes pool buffers by value, while read data must land in the buffers the
//! bdev layer handed us, whose owner outlives the call (the I/O completes
//! only after the receive returned). Data already queued, the common case
//! on a busy queue, is thus taken at once, without waiting a reactor pass
//! for a ring completion.

use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use ustor_runtime::ops;

/// Most iovecs one receive carries: data segments, a digest, the next header.
pub(crate) const MAX_RECV_IOV: usize = ustor_bdev::io::MAX_SEGMENTS + 2;

fn setopt(fd: RawFd, level: i32, name: i32, v: libc::c_int) {
    // SAFETY: setsockopt with an int option on a socket we own.
    unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

/// Connects a TCP socket to `addr` (`runtime::net::connect`), then back to
/// blocking mode (io_uring sends must not see EAGAIN). TCP_NODELAY: the
/// coalescer does the batching.
pub(crate) async fn connect(addr: SocketAddr) -> io::Result<OwnedFd> {
    let fd = ustor_runtime::net::connect(addr).await?;
    let raw = fd.as_raw_fd();
    // SAFETY: fcntl on our own fd.
    unsafe {
        let fl = libc::fcntl(raw, libc::F_GETFL);
        libc::fcntl(raw, libc::F_SETFL, fl & !libc::O_NONBLOCK);
    }
    setopt(raw, libc::IPPROTO_TCP, libc::TCP_NODELAY, 1);
    Ok(fd)
}

/// A receive target: `len` bytes at `ptr`.
#[derive(Clone, Copy)]
pub(crate) struct Seg {
    pub ptr: *mut u8,
    pub len: usize,
}

/// Receives into `segs` in order until at least `min` bytes arrived (at
/// most their total); returns the bytes received and the `recvmsg` calls
/// that took. EOF is `UnexpectedEof`.
///
/// # Safety
/// Every segment must be valid for writes for the whole call.
pub(crate) async unsafe fn recv_at_least(
    fd: RawFd,
    segs: &[Seg],
    min: usize,
) -> io::Result<(usize, u64)> {
    debug_assert!(segs.len() <= MAX_RECV_IOV);
    let total: usize = segs.iter().map(|s| s.len).sum();
    debug_assert!(min <= total);
    let want = min.clamp(1, total.max(1)).min(total);
    let mut got = 0usize;
    let mut calls = 0u64;
    // Budget: each round gains at least one byte or returns, so the loop
    // ends after `want` rounds at most.
    while got < want {
        let mut iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; MAX_RECV_IOV];
        let mut n = 0;
        let mut skip = got;
        for s in segs {
            if skip >= s.len {
                skip -= s.len;
                continue;
            }
            iov[n] = libc::iovec {
                iov_base: s.ptr.add(skip).cast(),
                iov_len: s.len - skip,
            };
            skip = 0;
            n += 1;
        }
        // SAFETY: all-zero is a valid msghdr; iov points at `n` valid entries.
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = n as _;
        let r = libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT);
        calls += 1;
        if r > 0 {
            got += r as usize;
            continue;
        }
        if r == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EAGAIN) => {
                let (res, _) = ops::poll_ready(fd, libc::POLLIN as u32).await;
                if res < 0 {
                    return Err(io::Error::from_raw_os_error(-res));
                }
            }
            Some(libc::EINTR) => {}
            _ => return Err(e),
        }
    }
    Ok((got, calls))
}

/// One non-blocking receive into `seg`: `Ok(None)` when nothing is queued.
///
/// # Safety
/// The segment must be valid for writes.
pub(crate) unsafe fn try_recv(fd: RawFd, seg: Seg) -> io::Result<Option<usize>> {
    let r = libc::recv(fd, seg.ptr.cast(), seg.len, libc::MSG_DONTWAIT);
    if r > 0 {
        return Ok(Some(r as usize));
    }
    if r == 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(None),
        _ => Err(e),
    }
}

/// Waits until `fd` is readable (through the ring).
pub(crate) async fn readable(fd: RawFd) -> io::Result<()> {
    let (res, _) = ops::poll_ready(fd, libc::POLLIN as u32).await;
    if res < 0 {
        return Err(io::Error::from_raw_os_error(-res));
    }
    Ok(())
}

/// Shuts a socket down so that pending receives and sends on it end.
pub(crate) fn shutdown(fd: RawFd) {
    // SAFETY: shutdown(2) on a socket the caller still owns.
    unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
}
