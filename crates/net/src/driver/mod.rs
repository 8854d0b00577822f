//! The connection driver: runs the receiver, the workers and the sender of
//! one connection for a sans-IO [`Protocol`].
//!
//! The protocol never touches the socket. The driver's receiver asks it
//! what to do with the staged bytes ([`Protocol::apply`] with a
//! [`RecvEvent`]) and performs what it answers ([`Recv`]): stage a header,
//! receive a payload (through staging and copied, or in place with the
//! next headers behind it in one `recvmsg`), skip bytes, hand a job to a
//! worker, queue a reply at once, wait, or close. Workers run
//! [`Protocol::execute`] (the device work) and queue its reply; the sender
//! encodes queued replies into a [`PduGroup`] ([`Protocol::encode`]) and
//! sends it with one `sendmsg`, coalescing with LANoT when configured.
//!
//! Protocol logic is therefore unit-testable without sockets: feed
//! [`Protocol::apply`] a [`Staging`] filled with [`Staging::stage_bytes`]
//! and check the [`Recv`] it answers. See `docs/writing-a-target.md`.
//!
//! Opt-ins for protocols with their own unit accounting (NVMe/TCP):
//! [`Recv::Interim`] queues a reply that answers no unit yet (an R2T: the
//! unit's answer follows later), [`Protocol::backlog`] replaces the
//! driver's in-flight count as LANoT's input, [`Protocol::aborted`] lets a
//! queued job be answered without executing, [`Protocol::on_close`] lets
//! the protocol end units parked on its side, [`Protocol::coalescer`]
//! shares the protocol's coalescer (its statistics), and
//! [`DriverConfig::prespawn_workers`] starts workers before traffic so a
//! burst never spawns (allocates), and [`Protocol::attach`] hands the
//! protocol the driver's [`Conn`] so a unit ended outside the receiver and
//! the workers (NVMe/TCP's Abort of a command awaiting its data) is
//! answered with [`Conn::reply`]. Left at their defaults they change
//! nothing.
//!
//! Opt-ins for clients (the NVMe/TCP initiator), whose units originate
//! locally and whose peer's PDUs complete them: [`start`] hands out the
//! connection before it runs ([`serve`]) so the client can [`Conn::send`]
//! its requests (queued like [`Recv::Interim`]: no budget, no worker);
//! [`Recv::Place`] receives a payload into memory the protocol names
//! ([`Protocol::place`]: a read's own buffers, not a pool buffer); and
//! [`Conn::set_drain_timeout`] bounds how long the sender may take
//! to finish after the receiver stopped (a last PDU such as a
//! termination request to a peer that no longer reads).
//!
//! All tasks of a connection live on one reactor and share [`Conn`] through
//! an `Rc`: no lock, no atomic, no allocation per unit (queues, worker
//! slots, the group and staging are allocated when the driver starts).

mod receiver;
mod sender;
mod workers;

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::rc::Rc;
use std::task::Waker;
use std::time::Duration;

use ustor_runtime::IoBuf;

use crate::coalesce::{CoalesceConfig, Coalescer};
use crate::group::PduGroup;
use crate::recv::Seg;
use crate::staging::{RecvMode, Rewind, Staging};

/// What the receiver tells the protocol (the event of [`Protocol::apply`]).
pub enum RecvEvent {
    /// Ready for the next unit (budgets allow one more).
    Next,
    /// The bytes asked for with [`Recv::Stage`] are staged.
    Staged,
    /// The payload asked for with [`Recv::Payload`] arrived in this buffer.
    Payload(IoBuf),
    /// The bytes asked for with [`Recv::Skip`] were dropped.
    Skipped,
    /// [`Protocol::may_resume`] allowed a parked receiver to go on.
    Resumed,
}

/// How a payload is received.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    /// Through the staging buffer with a greedy receive, then copied once
    /// (payloads up to [`crate::COPY_MAX`]: the receive also brings the
    /// headers and small payloads around it).
    Staging,
    /// Staged bytes copied, the rest received straight into the buffer,
    /// with up to `tail` bytes of what follows (digest, next header) into
    /// the emptied staging buffer in the same `recvmsg`.
    Direct { tail: usize },
}

/// What the protocol wants the receiver to do next.
pub enum Recv<P: Protocol> {
    /// Have at least `need` bytes staged, each receive asking for at most
    /// `max` staged bytes in all (`max == need`: exact; `usize::MAX`:
    /// greedy, up to the buffer; [`ASK`]: [`Protocol::stage_max`]), then
    /// [`RecvEvent::Staged`].
    Stage { need: usize, max: usize },
    /// Receive `len` bytes into `buf[off..off + len]` (`None`: a pool
    /// buffer of `off + len` bytes, waited for if the pool is empty), then
    /// [`RecvEvent::Payload`].
    Payload {
        buf: Option<IoBuf>,
        off: usize,
        len: usize,
        via: Via,
    },
    /// Drop `n` bytes (staged ones first), then [`RecvEvent::Skipped`].
    Skip(u64),
    /// Hand a job to a worker, then [`RecvEvent::Next`].
    Dispatch(P::Job),
    /// Queue a reply without a worker (a refused request), then
    /// [`RecvEvent::Next`].
    Reply(P::Reply),
    /// Queue a reply that answers no unit (an R2T: the unit is answered
    /// later, by a job or a reply of its own), then [`RecvEvent::Next`].
    /// It takes no budget and is not counted as in flight.
    Interim(P::Reply),
    /// Wait until [`Protocol::may_resume`] holds (rechecked whenever a
    /// reply was sent), then [`RecvEvent::Resumed`].
    Park,
    /// Stop reading; the connection ends once every reply is sent.
    Close,
    /// Client opt-in: receive into the segments [`Protocol::place`] names
    /// (what is staged is copied first), with up to `tail` bytes of what
    /// follows into the emptied staging buffer in the same `recvmsg`,
    /// then [`RecvEvent::Next`] (the protocol knows what it placed).
    Place { tail: usize },
}

/// [`Recv::Stage`]'s `max` that asks [`Protocol::stage_max`] before each
/// receive.
pub const ASK: usize = usize::MAX - 1;

/// Costs the driver reports to the protocol's counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoEvent {
    /// Receives made (`calls`) and staged bytes moved to the buffer's
    /// front (`moved`).
    Received { calls: u64, moved: usize },
    /// Payload bytes copied out of staging.
    Copied { bytes: usize },
    /// A group of `replies` left with `calls` `sendmsg`s.
    Sent { replies: u32, calls: u64 },
}

/// What LANoT sees of a connection whose protocol counts its own units
/// ([`Protocol::backlog`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backlog {
    /// Units that may still join the group being filled (the coalescer's
    /// "others"; [`crate::coalesce::BACKLOG_UNKNOWN`] for "some").
    pub others: u32,
    /// The queue depth the adaptive policy is told at a flush.
    pub depth: u32,
}

/// A protocol served by the driver. All methods run on the connection's
/// reactor; `&self` state lives in `Cell`/`RefCell`.
pub trait Protocol: Sized + 'static {
    /// A complete request for a worker (with its payload).
    type Job: 'static;
    /// A finished unit for the sender.
    type Reply: 'static;

    /// The receive state machine: what to do after `ev`. May peek and
    /// consume `st` (never receive: the driver does).
    fn apply(&self, ev: RecvEvent, st: &mut Staging) -> Recv<Self>;

    /// Payload bytes `job` holds until its reply is sent (the driver's
    /// byte budget).
    fn charge(&self, _job: &Self::Job) -> u64 {
        0
    }

    /// Whether a receiver parked by [`Recv::Park`] may go on.
    fn may_resume(&self) -> bool {
        true
    }

    /// Runs one job (device work) and builds its reply.
    fn execute(&self, job: Self::Job) -> impl Future<Output = Self::Reply>;

    /// Appends `reply` to `g`; gives it back when it does not fit (the
    /// group is sent first, then it is encoded into the emptied group).
    fn encode(&self, reply: Self::Reply, g: &mut PduGroup) -> Result<(), Self::Reply>;

    /// Whether `reply` must leave without waiting for more (coalescing).
    fn urgent(&self, _reply: &Self::Reply) -> bool {
        false
    }

    /// A job a worker took off the queue, before it executes: `Some` when
    /// the protocol aborted it meanwhile (the reply is queued instead and
    /// the job is dropped unexecuted).
    #[inline]
    fn aborted(&self, _job: &Self::Job) -> Option<Self::Reply> {
        None
    }

    /// LANoT's inputs when the protocol counts its own in-flight units
    /// (`None`: the driver's count, units received and not answered minus
    /// those in the group). `queued`: replies not yet in the group;
    /// `interim`: [`Recv::Interim`] replies in the group.
    #[inline]
    fn backlog(&self, _queued: usize, _interim: u32) -> Option<Backlog> {
        None
    }

    /// The protocol's own LANoT coalescer, used instead of one made from
    /// [`DriverConfig::coalesce`] (which is then ignored): its counters and
    /// current degree/timer stay readable by the protocol (per-queue
    /// statistics). Borrowed only while the sender decides a flush.
    #[inline]
    fn coalescer(&self) -> Option<&RefCell<Coalescer>> {
        None
    }

    /// Where a group that asked for a zero-copy send
    /// ([`PduGroup::want_zero_copy`]) is reported once the kernel no longer
    /// reads its memory (its holds, and whether the kernel copied after
    /// all). Asked once per connection; `None` (the default): every group
    /// leaves with a plain `sendmsg`.
    fn zero_copy_done(&self) -> Option<crate::zc::ZcSink> {
        None
    }

    /// The receiver stopped (close, EOF, error): units the protocol holds
    /// parked on its side must now finish, or the connection never ends.
    fn on_close(&self) {}

    /// Client opt-in: the bound of a [`Recv::Stage`] whose `max` is
    /// [`ASK`], asked before each receive (it may change while the
    /// receiver waits: a client's reads submitted meanwhile).
    fn stage_max(&self) -> usize {
        usize::MAX
    }

    /// Client opt-in: the destination of a [`Recv::Place`], written to
    /// `out` (at most `out.len()` segments, their number returned).
    ///
    /// # Safety
    /// The implementation promises that every segment it names is valid
    /// for writes, and written by nobody else, until the receiver next
    /// calls [`Protocol::apply`]; the caller (the receiver) writes only
    /// there and only until then.
    unsafe fn place(&self, _out: &mut [Seg]) -> usize {
        unreachable!("Recv::Place from a protocol without Protocol::place")
    }

    /// Accounting hook.
    fn on_io(&self, _ev: IoEvent) {}

    /// The driver's connection state, handed over once when the driver
    /// starts: a protocol whose units can be answered from outside the
    /// receiver and the workers (NVMe/TCP's Abort of a command awaiting
    /// its data) keeps it (weakly) for [`Conn::reply`].
    fn attach(&self, _conn: &Rc<Conn<Self>>) {}
}

/// Limits and shape of one connection's driver.
#[derive(Clone, Debug)]
pub struct DriverConfig {
    /// Units received and not yet answered on the wire.
    pub max_outstanding: usize,
    /// Payload bytes ([`Protocol::charge`]) held in flight.
    pub max_outstanding_bytes: u64,
    /// Worker tasks (concurrent device operations), spawned on demand.
    pub max_workers: usize,
    /// Workers spawned when the driver starts (at most `max_workers`), so
    /// that traffic up to that depth never spawns a task.
    pub prespawn_workers: usize,
    pub staging_len: usize,
    pub rewind: Rewind,
    pub recv_mode: RecvMode,
    /// Units received before the receiver yields to other tasks (`None`:
    /// never; receives wait often enough).
    pub recv_budget: Option<u32>,
    /// Replies per group at most.
    pub max_replies: u32,
    /// Segments and header bytes of the group.
    pub group_iov: usize,
    pub group_arena: usize,
    /// LANoT; `None` sends whatever is queued on each sender pass.
    pub coalesce: Option<CoalesceConfig>,
}

impl Default for DriverConfig {
    fn default() -> Self {
        DriverConfig {
            max_outstanding: 256,
            max_outstanding_bytes: 64 << 20,
            max_workers: 128,
            prespawn_workers: 0,
            staging_len: 128 << 10,
            rewind: Rewind::Lazy,
            recv_mode: RecvMode::Ring,
            recv_budget: None,
            max_replies: 64,
            group_iov: crate::group::MAX_GROUP_IOV,
            group_arena: crate::group::ARENA_LEN,
            coalesce: None,
        }
    }
}

/// A reply with the payload budget its request held.
struct Queued<R> {
    reply: R,
    charge: u64,
    /// It answers a unit (false: [`Recv::Interim`]).
    unit: bool,
}

/// State shared by the tasks of one connection.
pub struct Conn<P: Protocol> {
    fd: OwnedFd,
    proto: P,
    cfg: DriverConfig,
    replies: RefCell<VecDeque<Queued<P::Reply>>>,
    workers: workers::Pool<P::Job>,
    /// Received and not yet answered on the wire.
    outstanding: Cell<usize>,
    outstanding_bytes: Cell<u64>,
    receiver: RefCell<Option<Waker>>,
    sender: RefCell<Option<Waker>>,
    /// No more units will be read (close, EOF, error).
    closing: Cell<bool>,
    /// The socket failed: replies can no longer be sent.
    dead: Cell<bool>,
    /// [`Conn::set_drain_timeout`].
    drain: Cell<Option<Duration>>,
}

fn wake(slot: &RefCell<Option<Waker>>) {
    if let Some(w) = slot.borrow_mut().take() {
        w.wake();
    }
}

impl<P: Protocol> Conn<P> {
    pub fn protocol(&self) -> &P {
        &self.proto
    }

    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Units received and not yet answered.
    pub fn outstanding(&self) -> usize {
        self.outstanding.get()
    }

    /// Client opt-in: queues a locally originated request for the sender,
    /// like [`Recv::Interim`] (no budget, not counted in flight: the
    /// protocol counts its own requests).
    pub fn send(&self, reply: P::Reply) {
        self.queue_reply(reply, 0, false);
    }

    /// Client opt-in: after the receiver stopped, how long the sender may
    /// take to send what is queued before the socket is shut down under
    /// it (default `None`: as long as it takes; the peer's leaving ends
    /// it). Bounds a last PDU to a peer that no longer reads.
    pub fn set_drain_timeout(&self, d: Option<Duration>) {
        self.drain.set(d);
    }

    /// The receiver stopped: nothing more is read.
    pub fn is_closing(&self) -> bool {
        self.closing.get()
    }

    /// Queues a reply that answers a unit the receiver and the workers do
    /// not hold (one the protocol ended on its own, e.g. aborted while it
    /// waited for data). Counts as a unit received and answered.
    pub fn reply(&self, reply: P::Reply) {
        self.outstanding.set(self.outstanding.get() + 1);
        self.queue_reply(reply, 0, true);
    }

    fn queue_reply(&self, reply: P::Reply, charge: u64, unit: bool) {
        self.replies.borrow_mut().push_back(Queued {
            reply,
            charge,
            unit,
        });
        wake(&self.sender);
    }

    fn has_budget(&self) -> bool {
        self.outstanding.get() < self.cfg.max_outstanding
            && self.outstanding_bytes.get() < self.cfg.max_outstanding_bytes
    }

    /// `count` units holding `bytes` of budget were answered (sent, or
    /// dropped with a dead socket).
    fn finished(&self, count: usize, bytes: u64) {
        debug_assert!(count <= self.outstanding.get() && bytes <= self.outstanding_bytes.get());
        self.outstanding.set(self.outstanding.get() - count);
        self.outstanding_bytes
            .set(self.outstanding_bytes.get() - bytes);
        wake(&self.receiver);
        // Only a closing connection's sender waits for the count to reach
        // 0 (the sender calls this itself and rechecks anyway; a wake for
        // every group of a client, whose count stays 0, was a spurious
        // poll per group).
        if self.outstanding.get() == 0 && self.closing.get() {
            wake(&self.sender);
        }
    }
}

/// Runs `proto` on `fd` until the peer goes, the protocol closes, or the
/// socket fails, and every received unit has been answered (or dropped with
/// a dead socket); the socket is shut down then. Allocates the connection's
/// staging, queues and group here, once.
pub async fn run<P: Protocol>(fd: OwnedFd, proto: P, cfg: DriverConfig) {
    serve(start(fd, proto, cfg)).await
}

/// Allocates a connection's queues and worker slots without running it
/// (client opt-in: the protocol's owner keeps the `Rc` to
/// [`Conn::send`]); [`serve`] runs it.
pub fn start<P: Protocol>(fd: OwnedFd, proto: P, cfg: DriverConfig) -> Rc<Conn<P>> {
    Rc::new(Conn {
        fd,
        proto,
        replies: RefCell::new(VecDeque::with_capacity(cfg.max_outstanding)),
        workers: workers::Pool::with_capacity(cfg.max_workers, cfg.max_outstanding),
        outstanding: Cell::new(0),
        outstanding_bytes: Cell::new(0),
        receiver: RefCell::new(None),
        sender: RefCell::new(None),
        closing: Cell::new(false),
        dead: Cell::new(false),
        drain: Cell::new(None),
        cfg,
    })
}

/// Runs a connection made by [`start`] as [`run`] does; when it returns no
/// task of the connection touches the socket or a buffer any more.
pub async fn serve<P: Protocol>(conn: Rc<Conn<P>>) {
    conn.proto.attach(&conn);
    workers::prespawn(&conn);
    let sender = ustor_runtime::spawn(sender::run(conn.clone()));
    let mut st = Staging::new(conn.cfg.staging_len, conn.cfg.rewind);
    receiver::run(&conn, &mut st).await;
    conn.closing.set(true);
    conn.proto.on_close();
    conn.workers.close();
    wake(&conn.sender);
    // The sender returns once every received unit has been answered.
    let mut sender = std::pin::pin!(sender);
    let drained = match conn.drain.get() {
        Some(d) => {
            let done = crate::time::timeout(d, sender.as_mut()).await.is_some();
            if !done {
                // The peer stopped reading: the failed send ends the sender.
                crate::recv::shutdown(conn.raw_fd());
            }
            done
        }
        None => false,
    };
    if !drained {
        sender.await;
    }
    crate::recv::shutdown(conn.raw_fd());
}
