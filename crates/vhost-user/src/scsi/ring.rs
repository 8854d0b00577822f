//! What the three kinds of virtio-scsi rings share on their reactor: the
//! split ring itself, the memory map (refreshed when the frontend changes
//! it), returning chains used and signalling the driver, sleeping on the
//! kick eventfd, and the serve loop with adaptive polling (poll the avail
//! index while requests keep coming, sleep on the kick eventfd after the
//! poll window: an idle ring costs no CPU).

use std::cell::{Cell, RefCell};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use ustor_runtime::ticks;
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};

use super::device::ScsiDevice;
use super::wire::{Chain, ChainError};
use crate::vring::{self, VringStart};

/// One ring on its reactor (`!Send`).
pub(crate) struct Ring {
    pub index: usize,
    pub dev: Arc<ScsiDevice>,
    queue: RefCell<Queue>,
    call: Option<Arc<File>>,
    pub kick: Arc<File>,
    atomic: GuestMemoryAtomic<GuestMemoryMmap>,
    /// The map requests use and a generation bumped when it changes (a
    /// worker keeps its own `Arc` until the generation moves).
    pub mem: RefCell<Arc<GuestMemoryMmap>>,
    pub mem_gen: Cell<u64>,
    stop: Arc<AtomicBool>,
    done: mpsc::Sender<(u16, u16)>,
    /// Chains taken and not yet returned used.
    pub inflight: Cell<u32>,
    /// The used ring could not be written: the driver broke the device.
    broken: Cell<bool>,
}

impl Ring {
    /// Sets up the ring `s` describes; on failure the task waits to be
    /// stopped (so the control side gets its answer) and returns `None`.
    pub async fn open(s: VringStart<ScsiDevice>) -> Option<Rc<Ring>> {
        match vring::open_queue(&s) {
            Ok((mut q, mem, _used)) => {
                q.set_next_avail(s.next_avail);
                vring::set_nonblocking(&s.kick);
                Some(Rc::new(Ring {
                    index: s.index as usize,
                    dev: s.dev,
                    queue: RefCell::new(q),
                    call: s.call,
                    kick: s.kick,
                    atomic: s.mem,
                    mem: RefCell::new(mem),
                    mem_gen: Cell::new(0),
                    stop: s.stop,
                    done: s.done,
                    inflight: Cell::new(0),
                    broken: Cell::new(false),
                }))
            }
            Err(e) => {
                tracing::warn!("vhost-scsi: queue not started: {e}");
                while !s.stop.load(Ordering::Acquire) {
                    let fd = s.kick.as_raw_fd();
                    let _ = ustor_runtime::ops::poll_ready(fd, libc::POLLIN as u32).await;
                    vring::drain_eventfd(&s.kick);
                }
                let _ = s.done.send((0, 0));
                None
            }
        }
    }

    pub fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Picks up a memory map the frontend changed; true if it did.
    pub fn refresh_mem(&self) -> bool {
        let g = self.atomic.memory();
        if std::ptr::eq(&*g, Arc::as_ptr(&self.mem.borrow())) {
            return false;
        }
        *self.mem.borrow_mut() = g.into_inner();
        self.mem_gen.set(self.mem_gen.get() + 1);
        true
    }

    /// Takes the next available chain into `chain`: `None` when there is
    /// none (or the device is broken), else whether it is well formed
    /// (`chain.head` is set either way).
    pub fn pop(&self, chain: &mut Chain) -> Option<Result<(), ChainError>> {
        if self.broken.get() {
            return None;
        }
        let mem = self.mem.borrow();
        let c = self.queue.borrow_mut().pop_descriptor_chain(&**mem)?;
        let head = c.head_index();
        let descs = c.map(|d| (d.addr().0, d.len(), d.is_write_only()));
        Some(chain.fill(head, descs, &**mem))
    }

    /// Returns `head` used with `len` bytes written, and signals the
    /// driver if it asked.
    pub fn complete(&self, mem: &GuestMemoryMmap, head: u16, len: u32) {
        let mut q = self.queue.borrow_mut();
        if q.add_used(mem, head, len).is_err() {
            self.broken.set(true);
            return;
        }
        if q.needs_notification(mem).unwrap_or(true) {
            drop(q);
            if let Some(c) = &self.call {
                vring::signal(c);
            }
        }
    }

    /// Asks for kicks and sleeps on the kick eventfd, unless (`check`)
    /// chains arrived meanwhile.
    async fn park(&self, check: bool) {
        let more = {
            let mem = self.mem.borrow();
            self.queue
                .borrow_mut()
                .enable_notification(&**mem)
                .unwrap_or(false)
        };
        if !(check && more) {
            let fd = self.kick.as_raw_fd();
            let _ = ustor_runtime::ops::poll_ready(fd, libc::POLLIN as u32).await;
            vring::drain_eventfd(&self.kick);
        }
        self.refresh_mem();
        let mem = self.mem.borrow();
        let _ = self.queue.borrow_mut().disable_notification(&**mem);
    }

    /// Runs `pass` (which takes what there is and says how much) until
    /// the ring is stopped: polling while busy, then for `window`, then
    /// sleeping on the kick eventfd. `check_avail`: a chain left in the
    /// ring means work (false for the event queue, whose buffers wait for
    /// events).
    pub async fn serve(
        &self,
        window: Duration,
        check_avail: bool,
        mut pass: impl FnMut() -> usize,
    ) {
        let window = ticks::from_duration(window);
        let mut last = ticks::now();
        while !self.stopping() {
            self.refresh_mem();
            let n = pass();
            let now = ticks::now();
            if n > 0 || now.wrapping_sub(last) < window {
                if n > 0 {
                    last = now;
                }
                ustor_runtime::yield_now().await;
                continue;
            }
            self.park(check_avail).await;
            last = ticks::now();
        }
    }

    /// Waits for the chains in flight, then reports where the ring
    /// stopped.
    pub async fn finish(&self) {
        while self.inflight.get() > 0 {
            ustor_runtime::sleep(Duration::from_micros(100)).await;
        }
        let q = self.queue.borrow();
        let _ = self.done.send((q.next_avail(), q.next_used()));
    }
}
