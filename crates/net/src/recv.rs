//! Receives that every protocol needs: a vectored receive straight into
//! caller memory ([`recv_at_least`]), one non-blocking receive
//! ([`try_recv`]), exact receives into a buffer owned by value
//! ([`recv_exact`], [`discard`]) for handshakes, readiness through the ring,
//! shutdown, and the client-side connect in blocking mode.
//!
//! The vectored receive is a `recvmsg(MSG_DONTWAIT)` on data already queued
//! and an io_uring poll for readiness when there is none: the runtime's
//! `ops::recv` takes pool buffers by value, while payload must land in
//! memory the caller owns (an I/O's iovecs, whose owner outlives the call),
//! and a synchronous call never leaves the kernel holding a pointer into it
//! after the future is dropped. Data already queued, the common case on a
//! busy connection, is taken at once, without waiting a reactor pass.

use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use ustor_runtime::{ops, IoBuf};

/// Most segments one [`recv_at_least`] carries (data segments, a digest,
/// the next header).
pub const MAX_RECV_IOV: usize = 32;

/// A receive target: `len` bytes at `ptr`.
#[derive(Clone, Copy, Debug)]
pub struct Seg {
    pub ptr: *mut u8,
    pub len: usize,
}

impl Seg {
    /// An empty segment (array filler).
    pub const EMPTY: Seg = Seg {
        ptr: std::ptr::null_mut(),
        len: 0,
    };
}

fn eof() -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the connection")
}

/// Receives into `segs` in order until at least `min` bytes arrived (at
/// most their total); returns the bytes received and the `recvmsg` calls
/// that took. EOF is `UnexpectedEof`.
///
/// # Safety
/// Every segment must be valid for writes for the whole call.
pub async unsafe fn recv_at_least(fd: RawFd, segs: &[Seg], min: usize) -> io::Result<(usize, u64)> {
    assert!(segs.len() <= MAX_RECV_IOV, "too many receive segments");
    let total: usize = segs.iter().map(|s| s.len).sum();
    debug_assert!(min <= total);
    let want = min.clamp(1, total.max(1)).min(total);
    let mut got = 0usize;
    let mut calls = 0u64;
    // Budget: each round gains at least one byte, waits for readiness or
    // returns, so the loop ends after `want` gaining rounds at most.
    while got < want {
        let mut iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; MAX_RECV_IOV];
        let n = unsent_iovecs(segs, got, &mut iov);
        // SAFETY: all-zero is a valid msghdr; iov points at `n` entries
        // into memory the caller keeps valid (this function's contract).
        let r = unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = iov.as_mut_ptr();
            msg.msg_iovlen = n as _;
            libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT)
        };
        calls += 1;
        if r > 0 {
            got += r as usize;
            continue;
        }
        if r == 0 {
            return Err(eof());
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EAGAIN) => readable(fd).await?,
            Some(libc::EINTR) => {}
            _ => return Err(e),
        }
    }
    Ok((got, calls))
}

/// The iovecs of `segs` past their first `skip` bytes.
fn unsent_iovecs(segs: &[Seg], mut skip: usize, iov: &mut [libc::iovec]) -> usize {
    let mut n = 0;
    for s in segs {
        if skip >= s.len {
            skip -= s.len;
            continue;
        }
        iov[n] = libc::iovec {
            // wrapping_add: no dereference here; skip < len keeps it inside.
            iov_base: s.ptr.wrapping_add(skip).cast(),
            iov_len: s.len - skip,
        };
        skip = 0;
        n += 1;
    }
    n
}

/// One non-blocking receive into `seg`: `Ok(None)` when nothing is queued.
///
/// # Safety
/// The segment must be valid for writes.
pub unsafe fn try_recv(fd: RawFd, seg: Seg) -> io::Result<Option<usize>> {
    // SAFETY: the caller guarantees `seg` is writable.
    let r = unsafe { libc::recv(fd, seg.ptr.cast(), seg.len, libc::MSG_DONTWAIT) };
    if r > 0 {
        return Ok(Some(r as usize));
    }
    if r == 0 {
        return Err(eof());
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(None),
        _ => Err(e),
    }
}

/// Waits until `fd` is readable (through the ring).
pub async fn readable(fd: RawFd) -> io::Result<()> {
    let (res, _) = ops::poll_ready(fd, libc::POLLIN as u32).await;
    if res < 0 && res != -libc::EINTR {
        return Err(io::Error::from_raw_os_error(-res));
    }
    Ok(())
}

/// Waits until `fd` has room to send (through the ring).
pub async fn writable(fd: RawFd) -> io::Result<()> {
    let (res, _) = ops::poll_ready(fd, libc::POLLOUT as u32).await;
    if res < 0 && res != -libc::EINTR {
        return Err(io::Error::from_raw_os_error(-res));
    }
    Ok(())
}

/// Receives through the ring until `buf[start..end]` is full (handshakes,
/// control paths). A non-blocking socket's `WouldBlock` waits for
/// readiness; EOF is `UnexpectedEof`.
pub async fn recv_exact(
    fd: RawFd,
    mut buf: IoBuf,
    mut start: usize,
    end: usize,
) -> (io::Result<()>, IoBuf) {
    debug_assert!(end <= buf.capacity());
    // Budget: each round gains a byte, waits for readiness or returns.
    while start < end {
        let (res, b) = ops::recv(fd, buf, start, end - start).await;
        buf = b;
        match res {
            Ok(0) => return (Err(eof()), buf),
            Ok(n) => start += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if let Err(e) = readable(fd).await {
                    return (Err(e), buf);
                }
            }
            Err(e) => return (Err(e), buf),
        }
    }
    (Ok(()), buf)
}

/// Reads and drops `n` bytes, using `scratch` as the landing area.
pub async fn discard(fd: RawFd, mut scratch: IoBuf, mut n: u64) -> (io::Result<()>, IoBuf) {
    let cap = scratch.capacity() as u64;
    assert!(cap > 0, "discard needs a scratch buffer");
    while n > 0 {
        let chunk = n.min(cap) as usize;
        let (res, b) = recv_exact(fd, scratch, 0, chunk).await;
        scratch = b;
        if res.is_err() {
            return (res, scratch);
        }
        n -= chunk as u64;
    }
    (Ok(()), scratch)
}

/// Whether a receive on `fd` would not wait: bytes are queued, the peer
/// closed, or the socket has an error (the receive then reports it). One
/// non-blocking peek, nothing taken.
pub fn queued(fd: RawFd) -> bool {
    let mut b = 0u8;
    // SAFETY: a one-byte peek into a local; no pointer outlives the call.
    let r = unsafe {
        libc::recv(
            fd,
            (&mut b as *mut u8).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    r >= 0
        || !matches!(
            io::Error::last_os_error().raw_os_error(),
            Some(libc::EAGAIN)
        )
}

/// Shuts a socket down so that pending receives and sends on it end.
pub fn shutdown(fd: RawFd) {
    // SAFETY: shutdown(2) on a socket the caller still owns.
    unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
}

/// Connects a TCP socket to `addr` (`runtime::net::connect`), then back to
/// blocking mode (io_uring sends must not see EAGAIN), with TCP_NODELAY
/// (the coalescer does the batching).
pub async fn connect_blocking(addr: SocketAddr) -> io::Result<OwnedFd> {
    let fd = ustor_runtime::net::connect(addr).await?;
    let raw = fd.as_raw_fd();
    // SAFETY: fcntl on our own fd, no pointers.
    unsafe {
        let fl = libc::fcntl(raw, libc::F_GETFL);
        libc::fcntl(raw, libc::F_SETFL, fl & !libc::O_NONBLOCK);
    }
    let _ = ustor_runtime::net::set_nodelay(raw);
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsent_iovecs_skip_what_was_received() {
        let mut a = [0u8; 4];
        let mut b = [0u8; 6];
        let segs = [
            Seg {
                ptr: a.as_mut_ptr(),
                len: 4,
            },
            Seg {
                ptr: b.as_mut_ptr(),
                len: 6,
            },
        ];
        let mut iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; MAX_RECV_IOV];
        assert_eq!(unsent_iovecs(&segs, 0, &mut iov), 2);
        assert_eq!((iov[0].iov_len, iov[1].iov_len), (4, 6));
        assert_eq!(unsent_iovecs(&segs, 5, &mut iov), 1);
        assert_eq!(iov[0].iov_len, 5);
        assert_eq!(iov[0].iov_base as usize, b.as_ptr() as usize + 1);
        assert_eq!(unsent_iovecs(&segs, 10, &mut iov), 0);
    }
}
