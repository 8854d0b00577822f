//! What the three kinds of virtio-scsi rings share on their reactor: the
//! split ring itself, the memory map (refreshed when the frontend changes
//! it), returning chains used and signalling the driver, sleeping on the
//! kick eventfd, and the serve loop with adaptive polling (poll the avail
//! index while requests keep coming, sleep on the kick eventfd after the
//! poll window: an idle ring costs no CPU), and the inflight region's
//! tracking (each head marked when taken, cleared once used; a ring
//! started on a killed backend's region serves the marked heads again
//! first).

use std::cell::{Cell, RefCell};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use ustor_runtime::ticks;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};

use super::device::ScsiDevice;
use super::wire::{Chain, ChainError, CHAIN_MAX};
use crate::blk::{self, Desc};
use crate::coalesce::Coalescer;
use crate::eventfd;
use crate::guest::GuestMem;
use crate::inflight::ring::{self, Resubmit, Track};
use crate::packed;
use crate::start::VringStart;
use crate::virtq::Virtq;

/// One ring on its reactor (`!Send`).
pub(crate) struct Ring {
    pub index: usize,
    pub dev: Arc<ScsiDevice>,
    queue: RefCell<Virtq>,
    /// Where a taken chain's descriptors are copied (one more than a
    /// chain may have, so an overlong one is seen as such).
    descs: RefCell<Vec<Desc>>,
    call: Arc<eventfd::CallFd>,
    pub kick: Arc<File>,
    atomic: GuestMemoryAtomic<GuestMemoryMmap>,
    /// Bumped after each change of `atomic`'s map, and the value last
    /// looked at (`u64::MAX`: never): the map is looked up only when it
    /// moved.
    map_gen: Arc<AtomicU64>,
    map_seen: Cell<u64>,
    /// The map requests use and a generation bumped when it changes (a
    /// worker keeps its own `Arc` until the generation moves).
    pub mem: RefCell<Rc<GuestMem>>,
    pub mem_gen: Cell<u64>,
    stop: Arc<AtomicBool>,
    done: mpsc::Sender<(u16, u16)>,
    /// Chains taken and not yet returned used.
    pub inflight: Cell<u32>,
    /// The used ring could not be written: the driver broke the device.
    broken: Cell<bool>,
    /// Inflight tracking (restart without loss) and the order of takes.
    track: Option<Track>,
    counter: Cell<u64>,
    /// What a killed backend had taken: served again before new ones
    /// (from the end of the list).
    resubmit: RefCell<Resubmit>,
    desc_table: u64,
    size: u16,
    /// Call-eventfd coalescing (request queues only).
    coal: Option<RefCell<Coalescer>>,
    /// The ring task sleeps on its kick eventfd (or drains): completions
    /// decide and signal at once (nothing would send a held-back signal).
    parked: Cell<bool>,
    /// Request queues: the notification decision (a full fence and a
    /// read of the driver's field) is made once per pass of the ring task
    /// for what was used since, not once per command.
    batch: bool,
    /// Used entries pushed since the last decision (`batch`).
    unpublished: Cell<u32>,
    /// Signals sent (call-eventfd writes).
    pub signals: Cell<u64>,
}

impl Ring {
    /// Sets up the ring `s` describes; on failure the task waits to be
    /// stopped (so the control side gets its answer) and returns `None`.
    pub async fn open(mut s: VringStart<ScsiDevice>) -> Option<Rc<Ring>> {
        match Virtq::open(&s) {
            Ok((mut q, mem, used)) => {
                let inflight = s.inflight.take();
                let mut rec = ring::recover(s.index, s.desc, inflight, &mut q, mem.map(), used);
                // Served from the end of the list: oldest last.
                match &mut rec.again {
                    Resubmit::Split(v) => v.reverse(),
                    Resubmit::Packed(v) => v.reverse(),
                }
                eventfd::set_nonblocking(&s.kick);
                s.dev.add_resubmitted(rec.again.len() as u64);
                s.dev.set_ring_state(s.index as usize, q.is_packed());
                Some(Rc::new(Ring {
                    index: s.index as usize,
                    dev: s.dev,
                    queue: RefCell::new(q),
                    descs: RefCell::new(vec![Desc::default(); CHAIN_MAX + 1]),
                    call: s.call,
                    kick: s.kick,
                    atomic: s.mem,
                    map_gen: s.mem_gen,
                    map_seen: Cell::new(u64::MAX),
                    mem: RefCell::new(mem),
                    mem_gen: Cell::new(0),
                    stop: s.stop,
                    done: s.done,
                    inflight: Cell::new(0),
                    broken: Cell::new(false),
                    track: rec.track,
                    counter: Cell::new(rec.counter),
                    resubmit: RefCell::new(rec.again),
                    desc_table: s.desc,
                    size: s.size,
                    coal: (s.index >= 2)
                        .then(|| RefCell::new(Coalescer::new(ticks::hz(), ticks::now()))),
                    parked: Cell::new(false),
                    batch: s.index >= 2,
                    unpublished: Cell::new(0),
                    signals: Cell::new(0),
                }))
            }
            Err(e) => {
                tracing::warn!("vhost-scsi: queue not started: {e}");
                while !s.stop.load(Ordering::Acquire) {
                    let fd = s.kick.as_raw_fd();
                    let _ = ustor_runtime::ops::poll_ready(fd, libc::POLLIN as u32).await;
                    eventfd::drain_eventfd(&s.kick);
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
        // Acquire: a generation seen moved means the new map is what
        // `memory()` returns (the control side bumps it after the swap).
        let gen = self.map_gen.load(Ordering::Acquire);
        if gen == self.map_seen.replace(gen) {
            return false;
        }
        let g = self.atomic.memory();
        if self.mem.borrow().is(&g) {
            return false;
        }
        *self.mem.borrow_mut() = Rc::new(GuestMem::new(g.into_inner()));
        self.mem_gen.set(self.mem_gen.get() + 1);
        true
    }

    /// Takes the next available chain into `chain` (first the heads a
    /// killed backend had taken): `None` when there is none (or the
    /// device is broken), else whether it is well formed (`chain.head` is
    /// set either way).
    pub fn pop(&self, chain: &mut Chain) -> Option<Result<(), ChainError>> {
        self.pop_in_pass(chain, &mut false)
    }

    /// [`Self::pop`] reading the driver's available index at most once
    /// while `looked` is false ([`Virtq::pop_in_pass`]).
    pub fn pop_in_pass(
        &self,
        chain: &mut Chain,
        looked: &mut bool,
    ) -> Option<Result<(), ChainError>> {
        if self.broken.get() {
            return None;
        }
        let mem = self.mem.borrow();
        if let Some(r) = self.pop_again(&mem, chain) {
            return Some(r);
        }
        let mut descs = self.descs.borrow_mut();
        let t = self
            .queue
            .borrow_mut()
            .pop_in_pass(&mem, &mut descs, looked)?;
        if let Some(tr) = &self.track {
            tr.taken(&self.queue.borrow(), mem.map(), t.head, &self.counter);
        }
        let d = descs[..t.descs].iter().map(|d| (d.addr, d.len, d.write));
        Some(chain.fill(t.head, d, &**mem))
    }

    /// The next chain a killed backend had taken, if any: read again by
    /// head from the descriptor table (its avail slot may have been
    /// reused), or from the descriptors the region copied (packed).
    /// Called before every pop, so it must not allocate (the descriptor
    /// list is the ring's own).
    fn pop_again(&self, mem: &GuestMem, chain: &mut Chain) -> Option<Result<(), ChainError>> {
        let mut descs = self.descs.borrow_mut();
        let (head, k) = match &mut *self.resubmit.borrow_mut() {
            Resubmit::Split(heads) => {
                let head = heads.pop()?;
                let table = vm_memory::GuestAddress(self.desc_table);
                (
                    head,
                    blk::read_chain(mem, table, self.size, head, &mut descs),
                )
            }
            Resubmit::Packed(chains) => {
                let c = chains.pop()?;
                (c.id, packed::chain_descs(mem.map(), &c.descs, &mut descs))
            }
        };
        let d = descs[..k].iter().map(|d| (d.addr, d.len, d.write));
        Some(chain.fill(head, d, mem))
    }

    /// Returns `head` used with `len` bytes written (visible to the driver
    /// at once), and signals the driver if it asked: now, or for a request
    /// queue's polling task at the end of its pass ([`Self::publish`]).
    pub fn complete(&self, mem: &GuestMem, head: u16, len: u32) {
        let mut q = self.queue.borrow_mut();
        if let Some(t) = &self.track {
            t.before_used(&q, head);
        }
        if !q.add_used(mem, head, len) {
            self.broken.set(true);
            return;
        }
        if let Some(t) = &self.track {
            t.after_used(&q, head);
        }
        drop(q);
        self.unpublished.set(self.unpublished.get() + 1);
        if !self.batch || self.parked.get() {
            self.publish(mem);
        }
    }

    /// One notification decision for the entries used since the last:
    /// signals the driver if it asked (now, or later when coalescing
    /// holds the signal back).
    fn publish(&self, mem: &GuestMem) {
        if self.unpublished.replace(0) == 0 {
            return;
        }
        if !self.queue.borrow_mut().needs_notification(mem) {
            return;
        }
        let now_ok = self.parked.get()
            || match &self.coal {
                Some(c) => c.borrow_mut().used(ustor_runtime::pass_ticks()),
                None => true,
            };
        if now_ok {
            self.signal();
        } else {
            self.dev.held.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn signal(&self) {
        if self.call.signal() {
            self.signals.set(self.signals.get() + 1);
        }
    }

    /// Once per pass: counts what was taken, the rate check, and a
    /// held-back signal that is due. True while one is held back.
    fn coalesce_tick(&self, taken: usize) -> bool {
        let Some(c) = &self.coal else { return false };
        let now = ustor_runtime::pass_ticks();
        let mut c = c.borrow_mut();
        c.taken(taken as u64);
        c.check(now, self.dev.coalescing());
        if c.due(now) {
            drop(c);
            self.signal();
            return false;
        }
        c.pending()
    }

    /// Asks for kicks and sleeps on the kick eventfd, unless (`check`)
    /// chains arrived meanwhile.
    async fn park(&self, check: bool) {
        // Completions from here on decide at once.
        self.parked.set(true);
        self.publish(&self.mem.borrow());
        let more = {
            let mem = self.mem.borrow();
            self.queue.borrow_mut().enable_notification(&mem)
        };
        if !(check && more) {
            let fd = self.kick.as_raw_fd();
            let _ = ustor_runtime::ops::poll_ready(fd, libc::POLLIN as u32).await;
            eventfd::drain_eventfd(&self.kick);
        }
        self.parked.set(false);
        self.refresh_mem();
        let mem = self.mem.borrow();
        self.queue.borrow_mut().disable_notification(&mem);
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
        let mut last = ustor_runtime::pass_ticks();
        while !self.stopping() {
            self.refresh_mem();
            let n = pass();
            self.publish(&self.mem.borrow());
            // A held-back signal keeps the ring polling until it is due
            // (a sleeping ring could not send it).
            let held = self.coalesce_tick(n);
            // The reactor's clock of this pass: the window is microseconds
            // or more, and a TSC read costs tens of ns in a VM.
            let now = ustor_runtime::pass_ticks();
            if n > 0 || held || now.saturating_sub(last) < window {
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
        self.parked.set(true);
        self.publish(&self.mem.borrow());
        while self.inflight.get() > 0 {
            ustor_runtime::sleep(Duration::from_micros(100)).await;
        }
        if let Some(c) = &self.coal {
            if c.borrow_mut().flush(ticks::now()) {
                self.signal();
            }
        }
        self.dev.clear_ring_state(self.index);
        let _ = self.done.send(self.queue.borrow().indices());
    }
}
