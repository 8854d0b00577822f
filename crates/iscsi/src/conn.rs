//! Socket helpers. Login path (allocating, on the reactor's io_uring):
//! exact receives, whole sends, one PDU read. Data path: non-blocking
//! `readv`/`writev` straight between the socket and the command's buffers,
//! with io_uring readiness polls when the socket is not ready. The data
//! path uses synchronous non-blocking calls on purpose: a command's buffer
//! may be handed back to the mid-layer (abort, reset) at any await point,
//! and a synchronous call never leaves the kernel holding a pointer into it.

use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

use ustor_runtime::{ops, IoBuf};

use crate::wire::{Bhs, BHS_LEN};

/// Receives exactly `n` bytes (the connection layer's exact receive, which
/// waits for readiness when the non-blocking socket has nothing yet).
pub async fn recv_exact(fd: RawFd, n: usize) -> io::Result<Vec<u8>> {
    let (r, mut buf) = ustor_net::recv::recv_exact(fd, IoBuf::heap(n), 0, n).await;
    r?;
    Ok(buf.spare_mut()[..n].to_vec())
}

/// Sends all of `data`.
pub async fn send_all(fd: RawFd, data: &[u8]) -> io::Result<()> {
    let mut buf = IoBuf::heap(data.len());
    buf.copy_from_slice(data);
    let mut sent = 0;
    while sent < data.len() {
        let (r, b) = ops::send(fd, buf, sent, data.len()).await;
        buf = b;
        match r {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                wait_ready(fd, libc::POLLOUT as u32).await?
            }
            Err(e) => return Err(e),
            Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
            Ok(k) => sent += k,
        }
    }
    Ok(())
}

/// Reads one PDU without digests: its BHS and its (unpadded) data segment.
pub async fn read_pdu(fd: RawFd) -> io::Result<(Bhs, Vec<u8>)> {
    let h = recv_exact(fd, BHS_LEN).await?;
    let bhs = Bhs::from_slice(&h).map_err(io::Error::other)?;
    let rest = bhs.rest_len(false, false).map_err(io::Error::other)?;
    let mut data = if rest > 0 {
        recv_exact(fd, rest).await?
    } else {
        Vec::new()
    };
    let ahs = bhs.ahs_len();
    data.drain(..ahs.min(data.len()));
    data.truncate(bhs.data_len());
    Ok((bhs, data))
}

/// A PDU on the wire: header plus padded data.
pub fn pdu_bytes(bhs: &Bhs, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(BHS_LEN + crate::wire::pad4(data.len()));
    out.extend_from_slice(&bhs.0);
    out.extend_from_slice(data);
    out.resize(BHS_LEN + crate::wire::pad4(data.len()), 0);
    out
}

/// Runs `fut` for at most `d`; `None` when the time ran out first (the
/// connection layer's one timeout).
pub use ustor_net::timeout as with_timeout;

/// Connects without blocking the reactor: a non-blocking socket, then an
/// io_uring poll for writability bounded by `timeout` (a portal that drops
/// SYNs would otherwise hold the reactor for the kernel's SYN retries).
/// The stream stays non-blocking.
pub async fn connect(portal: &str, timeout: Duration) -> io::Result<std::net::TcpStream> {
    use std::net::ToSocketAddrs;
    let addr = portal
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| io::Error::other(format!("portal `{portal}` resolves to nothing")))?;
    let fd = with_timeout(timeout, ustor_runtime::net::connect(addr))
        .await
        .ok_or_else(|| io::Error::from(io::ErrorKind::TimedOut))??;
    Ok(std::net::TcpStream::from(fd))
}

/// Makes a socket non-blocking (the data path's readv/writev).
pub fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor we own; no pointers.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if fl < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// One non-blocking `readv`: `Ok(None)` = would block, `Ok(Some(0))` = EOF.
///
/// # Safety
/// Every iovec must describe writable memory that stays valid for the call.
pub unsafe fn readv_nb(fd: RawFd, iov: &[libc::iovec]) -> io::Result<Option<usize>> {
    loop {
        // SAFETY: the caller vouches for the iovecs; the count is the slice's.
        let r = unsafe { libc::readv(fd, iov.as_ptr(), iov.len() as libc::c_int) };
        if r >= 0 {
            return Ok(Some(r as usize));
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EAGAIN) => return Ok(None),
            _ => return Err(e),
        }
    }
}

/// One non-blocking `writev` (MSG_NOSIGNAL semantics via sendmsg):
/// `Ok(None)` = would block.
///
/// # Safety
/// Every iovec must describe readable memory that stays valid for the call.
pub unsafe fn writev_nb(fd: RawFd, iov: &[libc::iovec]) -> io::Result<Option<usize>> {
    loop {
        // SAFETY: the caller's iovecs are valid for this call (our contract).
        match unsafe { ustor_runtime::ops::sendmsg_now(fd, iov) } {
            Ok(n) => return Ok(Some(n)),
            Err(e) => match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EAGAIN) => return Ok(None),
                _ => return Err(e),
            },
        }
    }
}

/// Waits (io_uring poll) until `fd` has `events` (POLLIN / POLLOUT).
pub async fn wait_ready(fd: RawFd, events: u32) -> io::Result<()> {
    let (r, _) = ustor_runtime::ops::poll_ready(fd, events).await;
    ustor_runtime::ops::result(r).map(|_| ())
}
