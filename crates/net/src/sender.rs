//! The send loop every protocol's sender ends in: a [`PduGroup`] leaves with
//! a direct non-blocking `sendmsg` (no wait for a ring completion when the
//! socket has room, the common case), and through the ring only when the
//! socket is full (the ring waits for room).

use std::io;
use std::os::fd::RawFd;

use ustor_runtime::ops;

use crate::group::{PduGroup, MAX_GROUP_IOV};

/// One direct non-blocking `sendmsg` of everything not yet sent in `g`;
/// returns the bytes sent (`WouldBlock` when the socket is full).
pub fn try_send(fd: RawFd, g: &PduGroup) -> io::Result<usize> {
    let mut iov = [libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; MAX_GROUP_IOV];
    let n = g.fill_iovecs(&mut iov);
    debug_assert!(n > 0, "send of an empty group");
    // SAFETY: the iovecs point into memory the group owns (or holds by
    // contract, `push_raw`), alive for the call.
    unsafe { ops::sendmsg_now(fd, &iov[..n]) }
}

/// Sends the whole group and returns it cleared: a direct non-blocking
/// `sendmsg` first, the ring (which waits for room) only when the socket is
/// full or took part. `calls` counts the `sendmsg`s made. An error (or a
/// peer that stops taking data) means the connection is gone.
pub async fn send_all(fd: RawFd, mut g: PduGroup, calls: &mut u64) -> (io::Result<()>, PduGroup) {
    let mut direct = true;
    // Budget: each round sends at least one byte, waits for room, or ends
    // the loop.
    let r = loop {
        let was_direct = std::mem::take(&mut direct);
        let res = if was_direct {
            try_send(fd, &g)
        } else {
            let (res, back) = ops::sendmsg(fd, g).await;
            g = back;
            res
        };
        *calls += 1;
        match res {
            Ok(0) => break Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                if g.advance(n) {
                    break Ok(());
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            // A non-blocking socket: the ring says EAGAIN instead of
            // waiting, so wait for room here.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && !was_direct => {
                if let Err(e) = crate::recv::writable(fd).await {
                    break Err(e);
                }
                direct = true;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => break Err(e),
        }
    };
    g.clear();
    (r, g)
}
