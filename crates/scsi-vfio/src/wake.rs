//! A wake source for a reactor that sleeps (adaptive or interrupt poll
//! mode): one MSI-X (or MSI) vector of the device routed to an eventfd,
//! and a task on the host's reactor that waits on it with an io_uring
//! poll. When the device posts a completion it interrupts, the poll
//! completes, and the reactor wakes and runs the host's poller, instead
//! of sleeping until its next timer. In poll mode the reactor never sleeps,
//! so no interrupt is set up. Nothing on the I/O path touches this.

use std::cell::Cell;
use std::os::fd::{AsRawFd, OwnedFd};
use std::rc::Rc;

use ustor_runtime::PollMode;
use ustor_vfio::Vfio;

pub struct Wake {
    fd: Rc<OwnedFd>,
    /// `"msix"` or `"msi"`.
    pub kind: &'static str,
    stop: Rc<Cell<bool>>,
    wakes: Rc<Cell<u64>>,
}

impl Wake {
    /// Routes an interrupt of `vfio` to an eventfd and starts the task that
    /// waits on it; `None` in poll mode, off a reactor, or when the device
    /// has no MSI-X or MSI (the driver then polls only).
    pub fn start(vfio: &Vfio) -> Option<Wake> {
        if !ustor_runtime::is_reactor_thread() || ustor_runtime::poll_mode() == PollMode::Poll {
            return None;
        }
        let (fd, kind) = match vfio.irq_eventfd() {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(bdf = vfio.bdf(), "no interrupt, polling only: {e}");
                return None;
            }
        };
        let w = Wake {
            fd: Rc::new(fd),
            kind,
            stop: Rc::new(Cell::new(false)),
            wakes: Rc::new(Cell::new(0)),
        };
        let (fd, stop, wakes) = (w.fd.clone(), w.stop.clone(), w.wakes.clone());
        ustor_runtime::spawn(async move {
            let raw = fd.as_raw_fd();
            while !stop.get() {
                let (r, _) = ustor_runtime::ops::poll_ready(raw, libc::POLLIN as u32).await;
                if r < 0 {
                    tracing::warn!("interrupt eventfd poll failed: {r}");
                    return;
                }
                let mut n = 0u64;
                // SAFETY: an 8-byte read from our own non-blocking eventfd
                // into a u64 (clears its count).
                unsafe { libc::read(raw, (&mut n as *mut u64).cast(), 8) };
                wakes.set(wakes.get() + 1);
            }
        });
        Some(w)
    }

    /// Interrupts seen so far.
    pub fn count(&self) -> u64 {
        self.wakes.get()
    }
}

impl Drop for Wake {
    fn drop(&mut self) {
        self.stop.set(true);
        let one = 1u64;
        // SAFETY: an 8-byte write from a u64 to our own eventfd: it ends the
        // task's poll, and the task (holding the fd) then exits.
        unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }
}
