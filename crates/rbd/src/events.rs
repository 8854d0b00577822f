//! librbd's event-socket completion mode (`completion: "event"` in
//! `bdev_rbd_create`): librbd queues finished I/O on the image and bumps an
//! eventfd instead of calling back; every reactor with a channel on the
//! image waits for that eventfd (an io_uring poll), and the one it wakes
//! drains the queue with `rbd_poll_io_events`. I/O of its own reactor
//! completes right there (no ring, no message); another reactor's goes
//! home through its `Completer`, as in the callback mode.
//!
//! One image handle means one eventfd for all reactors (several handles
//! would pass the exclusive lock around on writes), so with N reactors
//! each wakeup may serve the others too.

use std::cell::Cell;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::rc::Rc;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use ustor_bdev::remote::RemoteCompletions;

use crate::bdev::{finish, Pending};
use crate::ffi;
use crate::image::Image;

/// How librbd's completions reach the reactors.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CompletionMode {
    /// librbd calls back on its finisher thread, which pushes the result
    /// to the owning reactor's ring (`ustor_bdev::remote`).
    #[default]
    Callback,
    /// librbd bumps an eventfd the reactors poll (this module).
    Event,
}

impl CompletionMode {
    pub fn is_default(&self) -> bool {
        *self == CompletionMode::Callback
    }
}

/// Makes the image's eventfd and tells librbd to use it.
pub(crate) fn enable(handle: ffi::rbd_image_t) -> Result<OwnedFd, i32> {
    // SAFETY: plain syscall; the fd is owned below.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO));
    }
    // SAFETY: a fresh fd nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: an open image and a live eventfd (kept as long as the image).
    let r =
        unsafe { ffi::rbd_set_image_notification(handle, fd.as_raw_fd(), ffi::EVENT_TYPE_EVENTFD) };
    if r < 0 {
        return Err(-r);
    }
    Ok(fd)
}

/// Wakes every reactor waiting on the image's eventfd (a channel is going:
/// its reaper must see `stop`).
pub(crate) fn kick(fd: i32) {
    let one = 1u64;
    // SAFETY: writes 8 bytes from a live u64 to an eventfd.
    unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

/// A channel's reaper task on its reactor, until `stop`.
pub(crate) async fn reap(img: Arc<Image>, rc: Rc<RemoteCompletions>, stop: Rc<Cell<bool>>) {
    let Some(fd) = img.event_fd() else { return };
    const BATCH: usize = 32;
    let mut comps: [ffi::rbd_completion_t; BATCH] = [std::ptr::null_mut(); BATCH];
    while !stop.get() {
        let (res, _) = ustor_runtime::ops::poll_ready(fd, libc::POLLIN as u32).await;
        if res < 0 {
            let e = std::io::Error::from_raw_os_error(-res);
            tracing::error!("rbd event socket: {e}; completions stop");
            return;
        }
        // Reset the counter first: an event after this bumps it again.
        let mut v = 0u64;
        // SAFETY: reads 8 bytes into a live u64 (EAGAIN when another
        // reactor drained it first).
        unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
        loop {
            // SAFETY: an open image; room for BATCH completions.
            let n =
                unsafe { ffi::rbd_poll_io_events(img.handle(), comps.as_mut_ptr(), BATCH as i32) };
            if n <= 0 {
                break;
            }
            for &c in &comps[..n as usize] {
                // SAFETY: a finished completion librbd handed back once;
                // its arg is the Box leaked in `submit`.
                let (p, r) = unsafe {
                    let p = Box::from_raw(ffi::rbd_aio_get_arg(c).cast::<Pending>());
                    let r = ffi::rbd_aio_get_return_value(c);
                    ffi::rbd_aio_release(c);
                    (p, r)
                };
                finish(*p, r, Some(&rc));
            }
            if (n as usize) < BATCH {
                break;
            }
        }
    }
}
