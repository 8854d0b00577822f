//! A ring's eventfds: the call eventfd the ring signals (swapped in place
//! when the frontend hands a new one) and the kick eventfd it parks on,
//! with the few raw calls on them (write, drain, non-blocking).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};

/// A ring's call eventfd. The frontend may hand a new one while the ring
/// runs (SET_VRING_CALL: QEMU does whenever the guest masks or unmasks
/// the queue's interrupt vector, its vCPU waiting for the answer), so it
/// is swapped in place, not by restarting the ring (which would wait for
/// the requests in flight); the ring signals whichever fd is current.
/// The lock is taken once per signal, beside a write(2).
#[derive(Debug, Default)]
pub struct CallFd(Mutex<Option<Arc<File>>>);

impl CallFd {
    pub fn set(&self, f: Option<Arc<File>>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = f;
    }

    /// Signals the current fd; false when there is none.
    pub fn signal(&self) -> bool {
        match &*self.0.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(f) => {
                signal(f);
                true
            }
            None => false,
        }
    }
}

pub(crate) fn signal(f: &File) {
    let one = 1u64;
    // SAFETY: writes 8 bytes from a valid u64 to an eventfd we hold open.
    let _ = unsafe { libc::write(f.as_raw_fd(), (&one as *const u64).cast(), 8) };
}

/// Wakes a queue task parked on its kick eventfd (used to stop it).
pub fn kick(f: &File) {
    signal(f)
}

pub(crate) fn drain_eventfd(f: &File) {
    let mut v = 0u64;
    // SAFETY: reads at most 8 bytes into a valid u64; the fd is non-blocking.
    let _ = unsafe { libc::read(f.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
}

pub(crate) fn set_nonblocking(f: &File) {
    let fd = f.as_raw_fd();
    // SAFETY: fcntl on a descriptor we hold open; no pointers involved.
    unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        if fl >= 0 {
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
    }
}
