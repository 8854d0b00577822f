//! Completing bdev I/O that finishes somewhere else: on another reactor
//! (a SCSI host's, an NVMe queue pair's) or on a library's own thread
//! (librbd's callbacks). An [`IoHandle`] belongs to the reactor that
//! submitted it and must be completed there; this module carries the
//! completion home without a lock and without allocating per I/O.
//!
//! - [`RemoteCompletions`] lives on the owning reactor (one per driver
//!   channel). [`RemoteCompletions::send_off`] turns an `IoHandle` into a
//!   [`RemoteIo`] (its slot token, `Send`) for the other side.
//! - [`Completer`] (`Send + Sync`, cheap to clone) goes to the other side;
//!   [`Completer::complete`] may be called from any thread.
//!
//! How: a preallocated lock-free ring of (token, result) with room for every
//! I/O the channel may have in flight (pushing never fails or allocates),
//! announced by a *doorbell*: a message with no captures (a zero-sized
//! closure: `RuntimeHandle::send` boxes it without allocating) that reaps
//! every ring of the owner reactor. The doorbell is sent only when the
//! ring's `armed` flag goes from false to true, so a burst costs one message
//! and the inbox never fills with doorbells. A doorbell lost to a full inbox
//! sets the ring's `lost` flag and notifies the owner
//! ([`ustor_runtime::Doorbell`]), whose `bdev_remote_retry` poller (a few
//! loads per loop pass, never a timer) reaps it: an idle reactor sleeps
//! until something comes, instead of waking every millisecond to look for
//! lost doorbells. Per I/O: one ring push and pop (atomics, the one
//! exception to the no-atomic rule, as the I/O crosses threads) and at most
//! one message.

use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crossbeam_queue::ArrayQueue;
use ustor_runtime::{Doorbell, PollStatus, RuntimeHandle};

use crate::error::BdevError;
use crate::io::IoHandle;

/// A bdev I/O handed to another thread: complete it exactly once with
/// [`Completer::complete`] (dropping it strands the I/O).
#[must_use = "a RemoteIo must be completed, or its I/O never finishes"]
#[derive(Debug)]
pub struct RemoteIo(u64);

struct Ring {
    cq: ArrayQueue<(u64, Result<(), BdevError>)>,
    /// Rings the owner; a lost doorbell is reaped by the owner's poller.
    bell: Doorbell,
    /// Sent off and not yet reaped. Written by the owner only (plain load
    /// and store: no read-modify-write).
    inflight: AtomicUsize,
}

thread_local! {
    /// The rings whose I/O belongs to this reactor.
    static OWNED: RefCell<Vec<Arc<Ring>>> = const { RefCell::new(Vec::new()) };
    static POLLER: Cell<bool> = const { Cell::new(false) };
}

/// The owning reactor's end (`!Send`): sends I/O off, reaps completions.
pub struct RemoteCompletions {
    ring: Arc<Ring>,
    _not_send: PhantomData<*const ()>,
}

/// The other side's end: completes I/O from any thread.
#[derive(Clone)]
pub struct Completer(Arc<Ring>);

impl RemoteCompletions {
    /// On the reactor that owns the I/O (a channel's `create_channel`), with
    /// room for `capacity` I/Os in flight at once (use
    /// [`crate::io::TABLE_SLOTS`] when the driver has no smaller bound).
    pub fn new(rt: RuntimeHandle, capacity: usize) -> RemoteCompletions {
        let ring = Arc::new(Ring {
            cq: ArrayQueue::new(capacity.max(1)),
            bell: Doorbell::new(rt, ustor_runtime::reactor_id()),
            inflight: AtomicUsize::new(0),
        });
        OWNED.with(|o| o.borrow_mut().push(ring.clone()));
        if !POLLER.with(|p| p.replace(true)) {
            // Not timed: a timed poller bounds every sleep of the reactor.
            ustor_runtime::register_poller("bdev_remote_retry", retry_lost);
        }
        RemoteCompletions {
            ring,
            _not_send: PhantomData,
        }
    }

    pub fn completer(&self) -> Completer {
        Completer(self.ring.clone())
    }

    /// Hands `io` to the other side; gives it back when `capacity` I/Os are
    /// already out (the driver completes it with `EAGAIN` or queues it).
    pub fn send_off(&self, io: IoHandle) -> Result<RemoteIo, IoHandle> {
        let n = self.ring.inflight.load(Ordering::Relaxed);
        if n >= self.ring.cq.capacity() {
            return Err(io);
        }
        self.ring.inflight.store(n + 1, Ordering::Relaxed);
        Ok(RemoteIo(io.into_token()))
    }

    /// I/Os sent off and not yet completed here.
    pub fn outstanding(&self) -> usize {
        self.ring.inflight.load(Ordering::Relaxed)
    }

    /// Whether `c` completes into this end (the I/O is this reactor's).
    pub fn owns(&self, c: &Completer) -> bool {
        Arc::ptr_eq(&self.ring, &c.0)
    }

    /// Completes one of this end's own I/Os right here (owner reactor),
    /// skipping the ring: for a driver that reaps its library's
    /// completions on the owner reactor (librbd's event socket). Check
    /// [`Self::owns`] first.
    pub fn complete_here(&self, io: RemoteIo, res: Result<(), BdevError>) {
        let left = self.ring.inflight.load(Ordering::Relaxed);
        self.ring
            .inflight
            .store(left.saturating_sub(1), Ordering::Relaxed);
        match IoHandle::from_token(io.0) {
            Some(io) => io.complete(res),
            None => tracing::error!("local completion for a recycled bdev I/O slot"),
        }
    }

    /// Completes what has come back (also done by the doorbell).
    pub fn reap(&self) -> usize {
        reap(&self.ring)
    }
}

impl Drop for RemoteCompletions {
    fn drop(&mut self) {
        if self.outstanding() > 0 {
            tracing::error!(
                "remote completions dropped with {} I/O outstanding",
                self.outstanding()
            );
        }
        OWNED.with(|o| o.borrow_mut().retain(|r| !Arc::ptr_eq(r, &self.ring)));
    }
}

impl Completer {
    /// Completes `io` on its owning reactor; callable from any thread.
    pub fn complete(&self, io: RemoteIo, res: Result<(), BdevError>) {
        let r = &self.0;
        // Never full: `send_off` lets at most `capacity` I/Os out.
        let pushed = r.cq.push((io.0, res)).is_ok();
        debug_assert!(pushed, "remote completion ring overflow");
        r.bell.ring(reap_owned);
    }
}

/// Completes every I/O waiting in `ring` (owner reactor).
fn reap(ring: &Ring) -> usize {
    // Disarm before draining: a push after the drain rings again.
    ring.bell.disarm();
    let mut n = 0;
    while let Some((token, res)) = ring.cq.pop() {
        let left = ring.inflight.load(Ordering::Relaxed);
        debug_assert!(left > 0, "remote completion without an I/O");
        ring.inflight
            .store(left.saturating_sub(1), Ordering::Relaxed);
        match IoHandle::from_token(token) {
            Some(io) => io.complete(res),
            None => tracing::error!("remote completion for a recycled bdev I/O slot"),
        }
        n += 1;
    }
    n
}

/// The doorbell: reaps every ring of this reactor.
fn reap_owned() {
    let n = OWNED.with(|o| o.borrow().len());
    for i in 0..n {
        // Short borrows: completing an I/O may run code that adds a ring.
        let Some(r) = OWNED.with(|o| o.borrow().get(i).cloned()) else {
            break;
        };
        reap(&r);
    }
}

/// Every loop pass: reaps the rings whose doorbell was lost (a relaxed
/// load per ring when none was, which is nearly always).
fn retry_lost() -> PollStatus {
    let n = OWNED.with(|o| o.borrow().len());
    let mut busy = false;
    for i in 0..n {
        let lost = OWNED.with(|o| o.borrow().get(i).filter(|r| r.bell.take_lost()).cloned());
        // Short borrows: completing an I/O may run code that adds a ring.
        if let Some(r) = lost {
            busy |= reap(&r) > 0;
        }
    }
    if busy {
        PollStatus::Busy
    } else {
        PollStatus::Idle
    }
}
