//! SCSI bdev channels on reactors other than the host's: the channel
//! forwards each bdev I/O to the host's reactor, and the completion comes
//! back through the bdev layer's remote completion path
//! (`ustor_bdev::remote`), which any driver completing on another reactor
//! or a library's thread uses.
//!
//! Per channel there is one [`FwdQueue`] shared by the two reactors: a
//! submission ring (channel → host), preallocated at channel creation with
//! room for every I/O the channel's reactor can have in flight, so pushing
//! never fails and never allocates, plus the [`Completer`] of the channel's
//! completion ring. The submission ring is announced by a *doorbell*: a
//! message that captures nothing (a zero-sized closure, which `send` boxes
//! without allocating) and drains every queue of the host's reactor; it is
//! sent only when the ring's bell goes armed ([`ustor_runtime::Doorbell`]),
//! so a burst of I/O costs one message per direction, and the inbox cannot
//! fill with doorbells. A doorbell lost to a full inbox notifies the host's
//! reactor, whose untimed `scsi_fwd_retry` poller drains that queue: no
//! timer wakes an idle reactor. Completions work the same way inside
//! `remote`.
//!
//! What crosses threads is plain data: the bdev I/O's token
//! (`IoHandle::into_token`), its kind, range and iovec pointer (the buffers
//! stay put in the channel reactor's I/O slot until the completion is
//! reaped there), and a `Result<(), BdevError>`.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;

use crossbeam_queue::ArrayQueue;
use ustor_bdev::io::TABLE_SLOTS;
use ustor_bdev::remote::{Completer, RemoteCompletions, RemoteIo};
use ustor_bdev::{BdevChannel, BdevError, IoDesc, IoHandle, IoType};
use ustor_runtime::{Doorbell, PollStatus, RuntimeHandle};

use crate::lun::Hctl;
use crate::mid::host::{BdevIo, IoCaps, Pending};
use crate::mid::{local_host, Device, DeviceState, Host};

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
    token: RemoteIo,
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

/// The rings between one remote channel and its host.
pub(crate) struct FwdQueue {
    sq: ArrayQueue<FwdReq>,
    /// Rings the host's reactor; a lost doorbell is drained by its
    /// `scsi_fwd_retry` poller.
    sq_bell: Doorbell,
    /// Completes on the channel's reactor.
    completer: Completer,
    target: Target,
    rt: RuntimeHandle,
}

impl FwdQueue {
    /// Completes a forwarded I/O (host's reactor): the result goes back to
    /// the channel's reactor.
    pub(crate) fn complete(&self, token: RemoteIo, res: Result<(), BdevError>) {
        self.completer.complete(token, res);
    }

    fn ring_sq(&self) {
        self.sq_bell.ring(serve_submissions);
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
    /// This reactor's lost-doorbell poller is registered.
    static RETRY_POLLER: Cell<bool> = const { Cell::new(false) };
}

/// The submission doorbell, on the host's reactor: starts every forwarded
/// I/O waiting in this reactor's queues.
fn serve_submissions() {
    serve_where(|_| true);
}

/// Starts the forwarded I/O of this reactor's queues that `pick` selects;
/// returns how many I/Os it started.
fn serve_where(pick: impl Fn(&FwdQueue) -> bool) -> usize {
    let n = SERVED.with(|s| s.borrow().len());
    let mut started = 0;
    for i in 0..n {
        // Short borrows: starting an I/O may complete it at once.
        let Some((q, host, dev)) = SERVED.with(|s| {
            s.borrow()
                .get(i)
                .filter(|e| pick(&e.q))
                .map(|e| (e.q.clone(), e.host.clone(), e.dev.clone()))
        }) else {
            continue;
        };
        // Disarm before draining: a push after the drain rings again.
        q.sq_bell.disarm();
        while let Some(r) = q.sq.pop() {
            start(&q, host.as_ref(), dev.as_ref(), r);
            started += 1;
        }
    }
    started
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

/// Every loop pass on a host's reactor: drains the queues whose submission
/// doorbell was lost to a full inbox (a relaxed load per queue when none
/// was, which is nearly always).
fn retry_lost() -> PollStatus {
    if serve_where(|q| q.sq_bell.take_lost()) > 0 {
        PollStatus::Busy
    } else {
        PollStatus::Idle
    }
}

fn ensure_retry_poller() {
    if !RETRY_POLLER.with(|r| r.replace(true)) {
        // Not timed: a timed poller bounds every sleep of the reactor.
        ustor_runtime::register_poller("scsi_fwd_retry", retry_lost);
    }
}

/// A SCSI bdev's channel on a reactor other than its host's.
pub(crate) struct RemoteChannel {
    q: Arc<FwdQueue>,
    done: RemoteCompletions,
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
        let done = RemoteCompletions::new(rt.clone(), TABLE_SLOTS);
        let q = Arc::new(FwdQueue {
            sq: ArrayQueue::new(TABLE_SLOTS),
            sq_bell: Doorbell::new(rt.clone(), target.host_reactor),
            completer: done.completer(),
            target,
            rt,
        });
        let hq = q.clone();
        q.rt.send(target.host_reactor, move || {
            let host = local_host(target.stack, target.host);
            let dev = host.as_ref().and_then(|h| h.device(&target.hctl));
            ensure_retry_poller();
            SERVED.with(|s| s.borrow_mut().push(Served { q: hq, host, dev }));
        })
        .map_err(|_| BdevError::Removed)?;
        Ok(RemoteChannel { q, done, max_sg })
    }
}

impl BdevChannel for RemoteChannel {
    fn submit(&self, io: IoHandle) {
        let d = io.desc();
        if d.iovcnt > self.max_sg {
            io.complete(Err(BdevError::TooManySegments(d.iovcnt)));
            return;
        }
        let token = match self.done.send_off(io) {
            Ok(t) => t,
            Err(io) => return io.complete(Err(BdevError::Io(libc::EAGAIN))),
        };
        let req = FwdReq {
            token,
            kind: d.kind,
            offset_blocks: d.offset_blocks,
            num_blocks: d.num_blocks,
            iov: IovPtr(d.iov),
            iovcnt: d.iovcnt,
        };
        if let Err(req) = self.q.sq.push(req) {
            // Cannot happen (one entry per I/O slot of this reactor); fail
            // the I/O rather than lose it.
            self.q.complete(req.token, Err(BdevError::Io(libc::EAGAIN)));
            return;
        }
        self.q.ring_sq();
    }

    fn outstanding(&self) -> usize {
        self.done.outstanding()
    }
}

impl Drop for RemoteChannel {
    fn drop(&mut self) {
        let q = self.q.clone();
        let _ = self.q.rt.send(self.q.target.host_reactor, move || {
            SERVED.with(|s| s.borrow_mut().retain(|e| !Arc::ptr_eq(&e.q, &q)));
        });
    }
}
