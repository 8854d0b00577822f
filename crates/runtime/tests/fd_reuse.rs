//! A dropped op must never run on a descriptor number that was closed and
//! reused meanwhile. An SQE names its file by number and the kernel looks
//! the number up at submission; a receive queued, dropped and its socket
//! closed in one reactor pass once went in at the next `io_uring_enter`
//! and took the bytes of whichever connection got the number next (tests
//! running side by side in one process lost a Fabrics Connect this way).

use std::future::Future;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::pin::pin;
use std::task::{Context, Waker};

use ustor_runtime::{ops, IoBuf, PollMode, Runtime, RuntimeConfig};

fn socketpair() -> (OwnedFd, OwnedFd) {
    let mut fds = [0i32; 2];
    // SAFETY: socketpair(2) writes two descriptors into `fds`.
    let r = unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, fds.as_mut_ptr()) };
    assert_eq!(r, 0, "socketpair: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors are new and owned by nobody else.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

/// Bytes queued on `fd` (peeked, not taken).
fn queued(fd: &OwnedFd) -> isize {
    let mut b = [0u8; 64];
    // SAFETY: a non-blocking peek into a local buffer.
    unsafe {
        libc::recv(
            fd.as_raw_fd(),
            b.as_mut_ptr().cast(),
            b.len(),
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    }
}

#[test]
fn a_dropped_receive_never_reads_the_next_owner_of_its_descriptor() {
    for mode in [PollMode::Interrupt, PollMode::Adaptive, PollMode::Poll] {
        let r = Runtime::start(RuntimeConfig {
            cores: vec![0],
            pin: false,
            poll_mode: mode,
            bufs: ustor_runtime::BufPoolConfig {
                mem_bytes: 1 << 20,
                classes: vec![4096],
            },
            ..Default::default()
        })
        .expect("runtime");
        // All in one message: nothing enters the ring between the push and
        // the reuse, as when a task is torn down and its socket closed.
        let (new_owner, _peer) = r
            .handle()
            .call(0, || {
                let (old, _old_peer) = socketpair();
                let n = old.as_raw_fd();
                {
                    let mut recv = pin!(ops::recv(n, IoBuf::heap(4096), 0, 4096));
                    let mut cx = Context::from_waker(Waker::noop());
                    assert!(
                        recv.as_mut().poll(&mut cx).is_pending(),
                        "nothing to read yet"
                    );
                }
                drop(old);
                // The next socket takes the freed number (dup2 makes sure of
                // it whatever other threads opened meanwhile).
                let (a, b) = socketpair();
                let reused = if a.as_raw_fd() == n {
                    a
                } else {
                    // SAFETY: dup2 onto the number this closure just freed.
                    assert_eq!(unsafe { libc::dup2(a.as_raw_fd(), n) }, n);
                    drop(a);
                    // SAFETY: `n` now names the new socket; nothing else owns it.
                    unsafe { OwnedFd::from_raw_fd(n) }
                };
                // SAFETY: a send of a local buffer.
                let sent = unsafe { libc::send(b.as_raw_fd(), b"hello".as_ptr().cast(), 5, 0) };
                assert_eq!(sent, 5);
                (reused, b)
            })
            .unwrap();
        // Two round trips: the reactor has entered the ring since the drop.
        r.handle().call(0, || ()).unwrap();
        r.handle().call(0, || ()).unwrap();
        assert_eq!(
            queued(&new_owner),
            5,
            "mode {mode}: the dropped receive took the new socket's bytes"
        );
        drop(r);
        assert_eq!(queued(&new_owner), 5, "mode {mode}: after shutdown");
    }
}
