//! SCSI bdev channels on reactors other than the host's: the channel
//! forwards each bdev I/O to the host's reactor and the completion comes
//! back the same way, both through the runtime's cross-reactor messages.
//!
//! Per channel there is one [`FwdQueue`] shared by the two reactors: a
//! submission ring (channel → host) and a completion ring (host → channel),
//! both preallocated at channel creation with room for every I/O the
//! channel's reactor can have in flight, so pushing never fails and never
//! allocates. A ring is announced by a *doorbell*: a message that captures
//! nothing (a zero-sized closure, which `send` boxes without allocating)
//! and drains every queue of its reactor. A doorbell is sent only when the
//! ring's `armed` flag goes from false to true, so a burst of I/O costs one
//! message per direction, and the inbox cannot fill with doorbells.
//!
//! What crosses threads is plain data: the bdev I/O's token
//! (`IoHandle::into_token`), its kind, range and iovec pointer (the buffers
//! stay put in the channel reactor's I/O slot until the completion is
//! reaped there), and a `Result<(), BdevError>`.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_queue::ArrayQueue;
use ustor_bdev::io::TABLE_SLOTS;
use ustor_bdev::{BdevChannel, BdevError, IoDesc, IoHandle, IoType};
use ustor_runtime::{PollStatus, RuntimeHandle};

use crate::lun::Hctl;
use crate::mid::host::{BdevIo, IoCaps, Pending};
use crate::mid::{local_host, Device, DeviceState, Host};

/// How often a doorbell that could not be sent (inbox full) is retried.
const RETRY_PERIOD: Duration = Duration::from_millis(1);

/// The iovec array of a forwarded I/O.
#[derive(Clone, Copy)]
struct IovPtr(*const libc::iovec);

// SAFETY: the iovecs and the buffers they name live in the channel
// reactor's bdev I/O slot, which is neither freed nor reused until the
// completion of this I/O is reaped back on that reactor; in between only
// the host's reactor (and its LLD) touches them.
unsafe impl Send for IovPtr {}

/// One forwarded bdev I/O.
struct FwdReq {
    token: u64,
    kind: IoType,
    offset_blocks: u64,
    num_blocks: u64,
    iov: IovPtr,
    iovcnt: usize,
}

/// What a forwarded I/O is sent to: the host, the device and the SCSI
/// bdev's range and capabilities.
#[derive(Clone, Copy)]
pub(crate) struct Target {
    pub(crate) stack: u64,
    pub(crate) host: u32,
    pub(crate) host_reactor: usize,
    pub(crate) hctl: Hctl,
    pub(crate) base_lba: u64,
    pub(crate) caps: IoCaps,
}

/// The two rings between one remote channel and its host.
pub(crate) struct FwdQueue {
    sq: ArrayQueue<FwdReq>,
    cq: ArrayQueue<(u64, Result<(), BdevError>)>,
    sq_armed: AtomicBool,
    cq_armed: AtomicBool,
    /// I/Os forwarded and not yet reaped (written by the channel's reactor
    /// only, so plain loads and stores).
    inflight: AtomicUsize,
    chan_reactor: usize,
    target: Target,
    rt: RuntimeHandle,
    /// A doorbell that could not be sent, retried by the timed poller.
    sq_ring_lost: AtomicBool,
    cq_ring_lost: AtomicBool,
}

impl FwdQueue {
    /// Completes a forwarded I/O (host's reactor): the result goes back to
    /// the channel's reactor.
    pub(crate) fn complete(&self, token: u64, res: Result<(), BdevError>) {
        // Never full: the channel forwards at most `TABLE_SLOTS` I/Os, one
        // entry each.
        let pushed = self.cq.push((token, res)).is_ok();
        debug_assert!(pushed, "forward completion ring overflow");
        self.ring_cq();
    }

    fn ring_cq(&self) {
        if self.cq_armed.swap(true, Ordering::SeqCst) {
            return;
        }
        if self.rt.send(self.chan_reactor, reap_completions).is_err() {
            self.cq_armed.store(false, Ordering::SeqCst);
            self.cq_ring_lost.store(true, Ordering::Relaxed);
        }
    }

    fn ring_sq(&self) {
        if self.sq_armed.swap(true, Ordering::SeqCst) {
            return;
        }
        if self
            .rt
            .send(self.target.host_reactor, serve_submissions)
            .is_err()
        {
            self.sq_armed.store(false, Ordering::SeqCst);
            self.sq_ring_lost.store(true, Ordering::Relaxed);
        }
    }
}

/// A forwarded queue as its host's reactor serves it.
struct Served {
    q: Arc<FwdQueue>,
    host: Option<Rc<Host>>,
    dev: Option<Rc<Device>>,
}

thread_local! {
    /// Host side: queues of remote channels whose host lives here.
    static SERVED: RefCell<Vec<Served>> = const { RefCell::new(Vec::new()) };
    /// Channel side: queues of this reactor's remote channels.
    static WAITING: RefCell<Vec<Arc<FwdQueue>>> = const { RefCell::new(Vec::new()) };
    /// This reactor's doorbell retry poller is registered.
    static RETRY_POLLER: Cell<bool> = const { Cell::new(false) };
}

/// The submission doorbell, on the host's reactor: starts every forwarded
/// I/O waiting in this reactor's queues.
fn serve_submissions() {
    let n = SERVED.with(|s| s.borrow().len());
    for i in 0..n {
        // Short borrows: starting an I/O may complete it at once.
        let Some((q, host, dev)) = SERVED.with(|s| {
            s.borrow()
                .get(i)
                .map(|e| (e.q.clone(), e.host.clone(), e.dev.clone()))
        }) else {
            break;
        };
        // Disarm before draining: a push after the drain rings again.
        q.sq_armed.store(false, Ordering::SeqCst);
        while let Some(r) = q.sq.pop() {
            start(&q, host.as_ref(), dev.as_ref(), r);
        }
    }
}

fn start(q: &Arc<FwdQueue>, host: Option<&Rc<Host>>, dev: Option<&Rc<Device>>, r: FwdReq) {
    let (Some(host), Some(dev)) = (host, dev) else {
        q.complete(r.token, Err(BdevError::Removed));
        return;
    };
    if matches!(dev.state(), DeviceState::Removed) {
        q.complete(r.token, Err(BdevError::Removed));
        return;
    }
    host.submit_bdev(Pending {
        io: BdevIo::Remote {
            q: q.clone(),
            token: r.token,
        },
        desc: IoDesc {
            kind: r.kind,
            offset_blocks: r.offset_blocks,
            num_blocks: r.num_blocks,
            iov: r.iov.0,
            iovcnt: r.iovcnt,
            fixed: false,
        },
        dev: dev.clone(),
        base_lba: q.target.base_lba,
        caps: q.target.caps,
    });
}

/// The completion doorbell, on the channel's reactor: completes every
/// forwarded I/O that came back to this reactor.
fn reap_completions() {
    let n = WAITING.with(|w| w.borrow().len());
    for i in 0..n {
        let Some(q) = WAITING.with(|w| w.borrow().get(i).cloned()) else {
            break;
        };
        q.cq_armed.store(false, Ordering::SeqCst);
        while let Some((token, res)) = q.cq.pop() {
            let left = q.inflight.load(Ordering::Relaxed);
            debug_assert!(left > 0, "forward completion without an I/O");
            q.inflight.store(left.saturating_sub(1), Ordering::Relaxed);
            match IoHandle::from_token(token) {
                Some(io) => io.complete(res),
                None => tracing::error!("forwarded SCSI completion for a recycled I/O slot"),
            }
        }
    }
}

/// Re-sends doorbells lost to a full inbox (rare), on either side.
fn retry_lost() -> PollStatus {
    let mut n = 0;
    SERVED.with(|s| {
        for e in s.borrow().iter() {
            if e.q.cq_ring_lost.swap(false, Ordering::Relaxed) {
                e.q.ring_cq();
                n += 1;
            }
        }
    });
    WAITING.with(|w| {
        for q in w.borrow().iter() {
            if q.sq_ring_lost.swap(false, Ordering::Relaxed) {
                q.ring_sq();
                n += 1;
            }
        }
    });
    if n > 0 {
        PollStatus::Busy
    } else {
        PollStatus::Idle
    }
}

fn ensure_retry_poller() {
    if !RETRY_POLLER.with(|r| r.replace(true)) {
        ustor_runtime::register_timed_poller("scsi_fwd_retry", RETRY_PERIOD, retry_lost);
    }
}

/// A SCSI bdev's channel on a reactor other than its host's.
pub(crate) struct RemoteChannel {
    q: Arc<FwdQueue>,
    max_sg: usize,
}

impl RemoteChannel {
    /// Creates the queue pair and registers it on both reactors (the host
    /// side by a message, which the host's reactor runs before any doorbell
    /// of this channel: one producer's messages stay in order).
    pub(crate) fn new(
        rt: RuntimeHandle,
        target: Target,
        max_sg: usize,
    ) -> Result<RemoteChannel, BdevError> {
        let q = Arc::new(FwdQueue {
            sq: ArrayQueue::new(TABLE_SLOTS),
            cq: ArrayQueue::new(TABLE_SLOTS),
            sq_armed: AtomicBool::new(false),
            cq_armed: AtomicBool::new(false),
            inflight: AtomicUsize::new(0),
            chan_reactor: ustor_runtime::reactor_id(),
            target,
            rt,
            sq_ring_lost: AtomicBool::new(false),
            cq_ring_lost: AtomicBool::new(false),
        });
        let hq = q.clone();
        q.rt.send(target.host_reactor, move || {
            let host = local_host(target.stack, target.host);
            let dev = host.as_ref().and_then(|h| h.device(&target.hctl));
            ensure_retry_poller();
            SERVED.with(|s| s.borrow_mut().push(Served { q: hq, host, dev }));
        })
        .map_err(|_| BdevError::Removed)?;
        ensure_retry_poller();
        WAITING.with(|w| w.borrow_mut().push(q.clone()));
        Ok(RemoteChannel { q, max_sg })
    }
}

impl BdevChannel for RemoteChannel {
    fn submit(&self, io: IoHandle) {
        let d = io.desc();
        if d.iovcnt > self.max_sg {
            io.complete(Err(BdevError::TooManySegments(d.iovcnt)));
            return;
        }
        let req = FwdReq {
            token: io.into_token(),
            kind: d.kind,
            offset_blocks: d.offset_blocks,
            num_blocks: d.num_blocks,
            iov: IovPtr(d.iov),
            iovcnt: d.iovcnt,
        };
        if let Err(req) = self.q.sq.push(req) {
            // Cannot happen (one entry per I/O slot of this reactor); fail
            // the I/O rather than lose it.
            if let Some(io) = IoHandle::from_token(req.token) {
                io.complete(Err(BdevError::Io(libc::EAGAIN)));
            }
            return;
        }
        let n = self.q.inflight.load(Ordering::Relaxed);
        self.q.inflight.store(n + 1, Ordering::Relaxed);
        self.q.ring_sq();
    }

    fn outstanding(&self) -> usize {
        self.q.inflight.load(Ordering::Relaxed)
    }
}

impl Drop for RemoteChannel {
    fn drop(&mut self) {
        WAITING.with(|w| w.borrow_mut().retain(|q| !Arc::ptr_eq(q, &self.q)));
        let q = self.q.clone();
        let _ = self.q.rt.send(self.q.target.host_reactor, move || {
            SERVED.with(|s| s.borrow_mut().retain(|e| !Arc::ptr_eq(&e.q, &q)));
        });
    }
}
