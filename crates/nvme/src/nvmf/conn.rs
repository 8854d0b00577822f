//! One NVMe/TCP queue pair (connection), owned by one reactor for its life.
//!
//! Three kinds of task share the connection state:
//! - the *receiver* runs the receive state machine ([`RecvState`]) over a
//!   staging buffer: common header, rest of the header (+ digest), then the
//!   payload, received straight into the pool buffer the bdev writes from;
//!   it sends R2Ts for writes whose data was not in the capsule and matches
//!   H2CData PDUs to them by transfer tag (the command slot's index);
//! - *workers* (spawned on demand, reused, at most one per slot) execute
//!   commands: Fabrics, admin, I/O;
//! - the *sender* moves queued responses into the PDU Group and flushes it
//!   as the LANoT coalescer decides.
//!
//! A malformed PDU gets a C2HTermReq with the fatal error status and the
//! connection closes; a bad command gets an NVMe status and nothing else
//! changes. Other connections never notice.
//!
//! Abort (admin 0x08) reaches the named queue on its reactor (a message
//! when that is another reactor) and aborts a command that has not reached
//! the bdev: waiting for a slot, for a pool buffer, for its R2T's H2CData,
//! or for a worker. It completes with Command Abort Requested; a command
//! already executing is left alone (Abort DW0 bit 0 = 1). H2CData that
//! arrives later for an aborted R2T finds its transfer tag retired and is
//! a fatal PDU error (hosts do not send data for a command they aborted).

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::rc::{Rc, Weak};
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};
use std::time::Duration;

use ustor_bdev::IoChannel;
use ustor_runtime::{ops, spawn, IoBuf};

use super::admin::{self, AdminOut};
use super::ctrlr::{Ctrl, HostIo, AEN_NS_CHANGED, MAX_AERS, MAX_IO_QUEUE_DEPTH};
use super::io as nvm;
use super::stats::{self, inc};
use super::subsystem::{ListenAddress, Namespace};
use super::{Shared, TransportOpts};
use crate::coalesce::{Coalescer, PduGroup};
use crate::sock::{self, Seg};
use crate::wire::*;

/// Command slots per connection; the R2T transfer tag is the slot index.
const SLOTS: usize = MAX_IO_QUEUE_DEPTH as usize + MAX_AERS + 1;
/// Staging buffer for headers (and whatever payload a greedy read brings).
const STAGING_LEN: usize = 128 << 10;
/// Payloads up to this size may be copied out of a greedy read: one
/// `recv` then carries several queued writes (capsules, R2T data), and a
/// copy of up to 32 KiB costs less than the receive syscalls (each taking
/// the socket lock that the sender's softirq also takes) that zero-copy
/// needs per write. Measured twice: 4 KiB in-capsule writes at QD32 under
/// spdk_nvme_perf ran at a quarter of nvmf_tgt's IOPS with 2.00 receives
/// per write; 16 KiB R2T writes at QD128 (`nvmf_initiator_load`) went from
/// 43-98 K to 119-195 K IOPS and from 2 to 0.13-0.22 receives per write
/// when this limit rose from 8 to 32 KiB (docs/nvmf.md, run N). At 64 KiB
/// the copy costs what the receives save. Larger payloads are received
/// straight into their buffer. The same limits as the NBD server's.
const COPY_MAX: usize = 32 << 10;
/// PDUs the receiver handles from staging before it yields to other tasks.
const RECV_BUDGET: usize = 32;

/// The receive state machine (one `set_state`, a counter per state).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RecvState {
    /// Waiting for the 8-byte common header of the next PDU.
    AwaitCh = 0,
    /// Common header checked; waiting for the rest of the header and digest.
    AwaitPsh = 1,
    /// Header complete; receiving padding, data and data digest.
    AwaitPayload = 2,
    /// A fatal error was reported; nothing more is read.
    Quiesced = 3,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    Free,
    /// The receiver is working on it (waiting for a pool buffer, receiving
    /// data): an Abort only marks it.
    Receiving,
    /// R2T sent; H2CData PDUs are filling the buffer.
    AwaitH2C,
    /// Waiting for a worker.
    Queued,
    /// Executing (submitted to the bdev, or an admin command / parked AER).
    Running,
}

struct Slot {
    state: SlotState,
    sqe: Sqe,
    sgl: DataSgl,
    buf: Option<IoBuf>,
    /// Data bytes expected and received so far (R2T transfers).
    len: u32,
    got: u32,
    /// Set when the command already failed in transport (bad data digest).
    failed: Option<Status>,
    /// An Abort arrived while the receiver held the slot.
    aborted: bool,
}

/// A response waiting for the sender.
enum Out {
    Resp(Cqe),
    /// C2HData with the read data; `resp` follows unless SUCCESS is used.
    Data {
        cid: u16,
        buf: IoBuf,
        len: u32,
        resp: Option<Cqe>,
    },
    R2T {
        cid: u16,
        ttag: u16,
        len: u32,
    },
    Term {
        fes: u16,
        fei: u32,
        hdr: [u8; MAX_TERM_DATA],
        len: usize,
    },
}

/// Per-connection namespace table (refreshed when the subsystem's
/// namespace generation moves).
#[derive(Default)]
struct NsCache {
    gen: u64,
    entries: Vec<(u32, Arc<Namespace>, IoChannel)>,
}

pub(crate) struct Conn {
    fd: OwnedFd,
    shared: Arc<Shared>,
    listen: ListenAddress,
    opts: TransportOpts,
    dg: Cell<Digests>,
    /// The host's PDU data alignment (ICReq HPDA): C2HData data starts at
    /// a multiple of `(hpda + 1) * 4` bytes.
    hpda: Cell<u8>,
    qid: Cell<Option<u16>>,
    sqsize: Cell<u16>,
    sqhd: Cell<u16>,
    sqflow_off: Cell<bool>,
    ctrl: RefCell<Option<Arc<Ctrl>>>,
    /// What this queue's host commands moved (the controller's SMART log
    /// reads it from the admin queue's reactor).
    host_io: Arc<HostIo>,
    ns: RefCell<NsCache>,
    slots: RefCell<Vec<Slot>>,
    free: RefCell<Vec<u16>>,
    jobs: RefCell<VecDeque<u16>>,
    idle_workers: RefCell<Vec<Waker>>,
    workers: Cell<usize>,
    out: RefCell<VecDeque<Out>>,
    sender: RefCell<Option<Waker>>,
    receiver: RefCell<Option<Waker>>,
    /// Commands queued or running (not AERs, not those awaiting H2CData).
    executing: Cell<usize>,
    closing: Cell<bool>,
    dead: Cell<bool>,
    coal: Rc<RefCell<Coalescer>>,
    /// R2Ts whose data is still due.
    r2t_out: Cell<u32>,
    /// Of those, the R2Ts for more than [`COPY_MAX`] bytes: while any is
    /// due, headers are read exactly, so its data lands in its own buffer
    /// rather than in a greedy receive that would then be copied.
    r2t_big_out: Cell<u32>,
    /// CID of the capsule the receiver holds while it waits for a slot, and
    /// whether an Abort named it meanwhile.
    slot_wait: Cell<Option<u16>>,
    slot_wait_aborted: Cell<bool>,
}

thread_local! {
    /// This reactor's I/O queues by (controller address, qid), so an Abort
    /// sent here from the admin queue's reactor finds its connection.
    static IO_QUEUES: RefCell<Vec<(usize, u16, Weak<Conn>)>> = const { RefCell::new(Vec::new()) };
}

fn ctrl_key(ctrl: &Arc<Ctrl>) -> usize {
    Arc::as_ptr(ctrl) as usize
}

/// Aborts command `cid` of queue `qid` of controller `key` if that queue
/// lives on this reactor; whether it was aborted.
fn abort_here(key: usize, qid: u16, cid: u16) -> bool {
    let conn = IO_QUEUES.with(|q| {
        q.borrow()
            .iter()
            .find(|e| e.0 == key && e.1 == qid)
            .and_then(|e| e.2.upgrade())
    });
    conn.is_some_and(|c| c.abort(cid))
}

fn wake(slot: &RefCell<Option<Waker>>) {
    if let Some(w) = slot.borrow_mut().take() {
        w.wake();
    }
}

fn set_state(state: &mut RecvState, to: RecvState) {
    *state = to;
    stats::with(|c| inc(&c.recv_states[to as usize], 1));
}

/// Serves one accepted socket until it closes.
pub(crate) async fn serve(fd: OwnedFd, shared: Arc<Shared>, listen: ListenAddress) {
    let opts = shared.opts();
    let coal = Rc::new(RefCell::new(Coalescer::new(opts.coalesce)));
    let conn = Rc::new(Conn {
        fd,
        shared,
        listen,
        opts,
        dg: Cell::new(Digests::default()),
        hpda: Cell::new(0),
        qid: Cell::new(None),
        sqsize: Cell::new(0),
        sqhd: Cell::new(0),
        sqflow_off: Cell::new(false),
        ctrl: RefCell::new(None),
        host_io: Arc::new(HostIo::default()),
        ns: RefCell::new(NsCache::default()),
        slots: RefCell::new(
            (0..SLOTS)
                .map(|_| Slot {
                    state: SlotState::Free,
                    sqe: Sqe::default(),
                    sgl: DataSgl::None,
                    buf: None,
                    len: 0,
                    got: 0,
                    failed: None,
                    aborted: false,
                })
                .collect(),
        ),
        free: RefCell::new((0..SLOTS as u16).rev().collect()),
        jobs: RefCell::new(VecDeque::with_capacity(SLOTS)),
        idle_workers: RefCell::new(Vec::with_capacity(SLOTS)),
        workers: Cell::new(0),
        out: RefCell::new(VecDeque::with_capacity(SLOTS * 2)),
        sender: RefCell::new(None),
        receiver: RefCell::new(None),
        executing: Cell::new(0),
        closing: Cell::new(false),
        dead: Cell::new(false),
        coal,
        r2t_out: Cell::new(0),
        r2t_big_out: Cell::new(0),
        slot_wait: Cell::new(None),
        slot_wait_aborted: Cell::new(false),
    });
    let live: Weak<dyn stats::LiveQueue> = Rc::downgrade(&conn) as Weak<dyn stats::LiveQueue>;
    stats::with(|c| c.live.borrow_mut().push(live));
    let mut staging = Staging::new();
    if let Err(answered) = initialize(&conn, &mut staging).await {
        if answered {
            conn.closing.set(true);
            sender(conn.clone()).await;
        }
        conn.finish();
        return;
    }
    let sender = spawn(sender(conn.clone()));
    receiver(&conn, &mut staging).await;
    conn.closing.set(true);
    for w in conn.idle_workers.borrow_mut().drain(..) {
        w.wake();
    }
    wake(&conn.sender);
    sender.await;
    conn.finish();
}

/// ICReq/ICResp (the host's digests and data alignment). `Err(true)`: a
/// bad ICReq, answered by a queued termination request that quotes it.
async fn initialize(conn: &Rc<Conn>, st: &mut Staging) -> Result<(), bool> {
    let fd = conn.raw();
    st.fill(fd, IC_LEN, IC_LEN).await.map_err(|_| false)?;
    let req = match IcReq::decode(st.peek(IC_LEN)) {
        Ok(r) => r,
        Err(f) => {
            conn.queue_term(f, st.peek(IC_LEN));
            return Err(true);
        }
    };
    debug_assert!(req.hpda <= MAX_PDA);
    st.consume(IC_LEN);
    let dg = req.digests;
    conn.dg.set(dg);
    conn.hpda.set(req.hpda);
    if dg.header && dg.data {
        stats::with(|c| inc(&c.digest_qpairs, 1));
    }
    let resp = IcResp {
        pfv: 0,
        cpda: 0,
        digests: dg,
        maxh2cdata: conn.opts.max_h2c_data,
    };
    let mut b = IoBuf::heap(IC_LEN);
    b.copy_from_slice(&resp.encode());
    ops::send_all(fd, b).await.0.map_err(|_| false)
}

impl stats::LiveQueue for Conn {
    fn qpair_stats(&self) -> stats::QpairStats {
        let ctrl = self.ctrl.borrow();
        stats::QpairStats {
            subnqn: ctrl
                .as_ref()
                .map(|c| c.subsys.nqn.clone())
                .unwrap_or_default(),
            hostnqn: ctrl.as_ref().map(|c| c.hostnqn.clone()).unwrap_or_default(),
            cntlid: ctrl.as_ref().map_or(0, |c| c.cntlid),
            qid: self.qid.get().unwrap_or(0),
            outstanding: self.executing.get() as u64,
            coalesce: self.coal.borrow().stats(),
        }
    }
}

impl Conn {
    fn raw(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    fn limits(&self) -> RecvLimits {
        RecvLimits {
            max_incapsule: if self.qid.get() == Some(0) || self.qid.get().is_none() {
                // Connect data (1 KiB) and admin data fit the admin capsule.
                self.opts.in_capsule_data_size.max(8192)
            } else {
                self.opts.in_capsule_data_size
            },
            max_data_pdu: self.opts.max_h2c_data,
        }
    }

    fn push_out(&self, o: Out) {
        self.out.borrow_mut().push_back(o);
        wake(&self.sender);
    }

    fn queue_term(&self, f: Fatal, hdr: &[u8]) {
        let mut h = [0u8; MAX_TERM_DATA];
        let n = hdr.len().min(MAX_TERM_DATA);
        h[..n].copy_from_slice(&hdr[..n]);
        stats::with(|c| inc(&c.term_sent, 1));
        self.push_out(Out::Term {
            fes: f.fes,
            fei: f.fei,
            hdr: h,
            len: n,
        });
    }

    fn cqe(&self, cid: u16, status: Status) -> Cqe {
        let mut c = Cqe::new(cid, status);
        c.sqid = self.qid.get().unwrap_or(0);
        c.sqhd = self.sqhd.get();
        c
    }

    fn alloc_slot(&self) -> Option<u16> {
        self.free.borrow_mut().pop()
    }

    fn free_slot(&self, i: u16) {
        let mut s = self.slots.borrow_mut();
        let slot = &mut s[i as usize];
        slot.state = SlotState::Free;
        slot.buf = None;
        slot.failed = None;
        slot.aborted = false;
        drop(s);
        self.free.borrow_mut().push(i);
        wake(&self.receiver);
    }

    /// Starts idle workers up to `n` (at most one per slot) when an I/O
    /// queue connects: its peak concurrency is its queue depth, and growing
    /// the pool on demand would allocate in the middle of traffic whenever a
    /// burst first reaches a new peak (a greedy receive queues several
    /// commands in one pass).
    fn prespawn_workers(self: &Rc<Self>, n: usize) {
        while self.workers.get() < n.min(SLOTS) {
            self.workers.set(self.workers.get() + 1);
            spawn(worker(self.clone()));
        }
    }

    fn queue_job(self: &Rc<Self>, i: u16) {
        self.slots.borrow_mut()[i as usize].state = SlotState::Queued;
        self.executing.set(self.executing.get() + 1);
        self.jobs.borrow_mut().push_back(i);
        let idle = self.idle_workers.borrow_mut().pop();
        match idle {
            Some(w) => w.wake(),
            None if self.workers.get() < SLOTS => {
                self.workers.set(self.workers.get() + 1);
                spawn(worker(self.clone()));
            }
            None => {}
        }
    }

    /// Completes slot `i`'s command with Command Abort Requested and frees
    /// the slot (its buffer goes back to the pool).
    fn complete_aborted(&self, i: u16) {
        let cid = {
            let mut s = self.slots.borrow_mut();
            s[i as usize].buf = None;
            s[i as usize].sqe.cid()
        };
        let c = self.cqe(cid, Status::ABORT_REQUESTED);
        self.free_slot(i);
        stats::with(|c| inc(&c.aborted, 1));
        self.push_out(Out::Resp(c));
    }

    /// An R2T of `len` bytes needs no more data (all in, or aborted).
    fn r2t_settled(&self, len: u32) {
        self.r2t_out.set(self.r2t_out.get() - 1);
        if len as usize > COPY_MAX {
            self.r2t_big_out.set(self.r2t_big_out.get() - 1);
        }
    }

    /// Abort of command `cid`: true if it had not reached the bdev (it is
    /// completed with Command Abort Requested now, or by the receiver as
    /// soon as it has consumed the command's data).
    fn abort(&self, cid: u16) -> bool {
        if self.slot_wait.get() == Some(cid) {
            self.slot_wait_aborted.set(true);
            return true;
        }
        let mut s = self.slots.borrow_mut();
        let Some(i) = s
            .iter()
            .position(|x| x.state != SlotState::Free && x.sqe.cid() == cid)
        else {
            return false;
        };
        match s[i].state {
            SlotState::Receiving => {
                s[i].aborted = true;
                true
            }
            SlotState::AwaitH2C => {
                let len = s[i].len;
                drop(s);
                self.r2t_settled(len);
                self.complete_aborted(i as u16);
                true
            }
            SlotState::Queued => {
                drop(s);
                self.jobs.borrow_mut().retain(|&j| j != i as u16);
                self.executing.set(self.executing.get() - 1);
                self.complete_aborted(i as u16);
                true
            }
            SlotState::Running | SlotState::Free => false,
        }
    }

    /// Namespace `nsid`'s channel on this reactor.
    fn channel(&self, nsid: u32) -> Option<IoChannel> {
        let ctrl = self.ctrl.borrow();
        let subsys = &ctrl.as_ref()?.subsys;
        let gen = subsys.ns_generation();
        let mut cache = self.ns.borrow_mut();
        if cache.gen != gen {
            // Namespace added or removed: rebuild (control-rate event).
            cache.entries = subsys
                .namespaces()
                .into_iter()
                .filter_map(|ns| {
                    let ch = ns.desc.channel().ok()?;
                    Some((ns.nsid, ns, ch))
                })
                .collect();
            cache.gen = gen;
        }
        cache
            .entries
            .iter()
            .find(|e| e.0 == nsid)
            .map(|e| e.2.clone())
    }

    fn finish(&self) {
        let ctrl = self.ctrl.borrow_mut().take();
        let admin = self.qid.get() == Some(0);
        if let (Some(ctrl), Some(qid)) = (&ctrl, self.qid.get()) {
            let key = ctrl_key(ctrl);
            IO_QUEUES.with(|q| q.borrow_mut().retain(|e| !(e.0 == key && e.1 == qid)));
        }
        if let Some(ctrl) = ctrl {
            ctrl.remove_queue(self.qid.get().unwrap_or(0));
            if admin {
                // The admin queue owns the controller: its I/O queues go too.
                ctrl.fail();
                ctrl.subsys.lock().ctrls.remove(&ctrl.cntlid);
            }
        }
        stats::with(|c| {
            match self.qid.get() {
                Some(0) => c.cur_admin.set(c.cur_admin.get().saturating_sub(1)),
                Some(_) => c.cur_io.set(c.cur_io.get().saturating_sub(1)),
                None => {}
            }
            let mut co = c.coalesce_closed.get();
            co.add(&self.coal.borrow().stats());
            c.coalesce_closed.set(co);
            // From now on its counters are in `coalesce_closed`: stop
            // listing it as live, or a snapshot taken before the last
            // reference goes would count it twice.
            let me = self as *const Conn as *const ();
            c.live
                .borrow_mut()
                .retain(|w| w.as_ptr() as *const () != me);
        });
        self.shared.connection_closed();
    }
}

/// Bytes read from the socket and not yet consumed.
struct Staging {
    buf: Option<IoBuf>,
    start: usize,
    end: usize,
    /// The last PDU carried a large payload, or an R2T for one is due:
    /// read headers exactly, so the next large payload lands in its own
    /// buffer instead of being staged and copied.
    exact: bool,
    /// PDUs started from the bytes of the latest receive. More than one:
    /// the host is streaming, so the next receive tries the socket directly
    /// before queueing a ring receive; one (QD1) goes straight to the ring,
    /// with no failed syscall before the response is sent.
    pdus_per_recv: u32,
}

impl Staging {
    fn new() -> Staging {
        Staging {
            buf: Some(IoBuf::heap(STAGING_LEN)),
            start: 0,
            end: 0,
            exact: true,
            pdus_per_recv: 0,
        }
    }

    fn avail(&self) -> usize {
        self.end - self.start
    }

    fn bytes(&mut self) -> &mut [u8] {
        self.buf.as_mut().map_or(&mut [], |b| b.spare_mut())
    }

    fn peek(&mut self, n: usize) -> &[u8] {
        let s = self.start;
        &self.bytes()[s..s + n]
    }

    fn consume(&mut self, n: usize) {
        debug_assert!(n <= self.avail());
        self.start += n;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// Receives until `need` bytes are staged. In exact mode a receive asks
    /// for at most `exact_max` staged bytes in all.
    async fn fill(&mut self, fd: RawFd, need: usize, exact_max: usize) -> io::Result<()> {
        debug_assert!(need <= STAGING_LEN && need <= exact_max.max(need));
        while self.avail() < need {
            if self.start + need > STAGING_LEN {
                // Moves only a partial header (< `need` bytes).
                let (s, e) = (self.start, self.end);
                self.bytes().copy_within(s..e, 0);
                self.end -= s;
                self.start = 0;
            }
            let max = if self.exact {
                exact_max.max(need) - self.avail()
            } else {
                STAGING_LEN - self.end
            };
            // A streaming host: take what has arrived now, in this pass, so
            // a busy queue answers many commands per pass (and per
            // `sendmsg`) as SPDK's drain-until-EAGAIN does; an idle one
            // (QD1) goes straight to the ring and pays no failed syscall.
            let streaming = std::mem::take(&mut self.pdus_per_recv) > 1;
            let (res, calls) = ops::recv_staged(fd, &mut self.buf, self.end, max, streaming).await;
            stats::with(|c| inc(&c.recv_calls, calls));
            match res {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => self.end += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Receives `len` bytes into `buf[off..off + len]`: staged bytes first
    /// (copied once, counted), the rest straight from the socket, in one
    /// `recvmsg` (while data is queued) that also brings up to `tail` bytes
    /// of what follows (digest, next headers) into the emptied staging
    /// buffer, saving the next receive.
    async fn payload(
        &mut self,
        fd: RawFd,
        mut buf: IoBuf,
        off: usize,
        len: usize,
        tail: usize,
    ) -> (io::Result<()>, IoBuf) {
        let n = len.min(self.avail());
        if n > 0 {
            let s = self.start;
            let src = &self
                .buf
                .as_ref()
                .map_or(&[][..], |b| &b.spare_ref()[s..s + n]);
            buf.spare_mut()[off..off + n].copy_from_slice(src);
            self.consume(n);
            stats::with(|c| {
                inc(&c.payload_copies, 1);
                inc(&c.payload_copied_bytes, n as u64);
            });
        }
        let rest = len - n;
        if rest == 0 {
            return (Ok(()), buf);
        }
        // The staged bytes are all consumed: what follows the payload goes
        // to the start of the staging buffer.
        debug_assert_eq!(self.avail(), 0);
        self.start = 0;
        self.end = 0;
        let tail = tail.min(STAGING_LEN);
        let Some(st) = self.buf.as_mut() else {
            return (Err(io::ErrorKind::BrokenPipe.into()), buf);
        };
        let segs = [
            // SAFETY: off + len <= capacity (the caller's range), so the
            // segment lies inside `buf`.
            Seg {
                ptr: unsafe { buf.as_mut_ptr().add(off + n) },
                len: rest,
            },
            Seg {
                ptr: st.as_mut_ptr(),
                len: tail,
            },
        ];
        let nseg = if tail > 0 { 2 } else { 1 };
        // SAFETY: both segments are memory this task owns (`buf` by value,
        // the staging buffer through `self`) for the whole call; the
        // receive is a synchronous recvmsg, so nothing writes to them after
        // it returns or its future is dropped.
        match unsafe { sock::recv_at_least(fd, &segs[..nseg], rest) }.await {
            Ok((got, calls)) => {
                stats::with(|c| inc(&c.recv_calls, calls));
                self.end = got - rest;
                (Ok(()), buf)
            }
            Err(e) => (Err(e), buf),
        }
    }

    /// Drops `n` bytes (padding, refused data).
    async fn skip(&mut self, fd: RawFd, mut n: usize) -> io::Result<()> {
        while n > 0 {
            let k = n.min(STAGING_LEN / 2);
            self.fill(fd, k, k).await?;
            self.consume(k);
            n -= k;
        }
        Ok(())
    }
}

trait SpareRef {
    fn spare_ref(&self) -> &[u8];
}

impl SpareRef for IoBuf {
    fn spare_ref(&self) -> &[u8] {
        // SAFETY: the buffer is valid for `capacity` bytes and we only read.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.capacity()) }
    }
}

/// Reads PDUs until EOF, a fatal error or Disconnect.
async fn receiver(conn: &Rc<Conn>, st: &mut Staging) {
    let fd = conn.raw();
    let mut state = RecvState::AwaitCh;
    let mut budget = RECV_BUDGET;
    let mut hdr = [0u8; MAX_HDR_LEN];
    loop {
        if conn.closing.get() || conn.dead.get() {
            return;
        }
        set_state(&mut state, RecvState::AwaitCh);
        budget -= 1;
        if budget == 0 {
            budget = RECV_BUDGET;
            ustor_runtime::yield_now().await;
        }
        // Exact mode reads at most a capsule header (+ digest): all of a
        // capsule's, or an H2CData header and the first few bytes of its
        // data (copied), never a large payload.
        st.exact |= conn.r2t_big_out.get() > 0;
        let exact = CAPSULE_CMD_HLEN + conn.dg.get().hdgst_len();
        if st.fill(fd, CH_LEN, exact).await.is_err() {
            return;
        }
        let ch = CommonHeader::decode(st.peek(CH_LEN)).expect("8 bytes staged");
        st.pdus_per_recv += 1;
        let layout = match check_header(&ch, conn.dg.get(), false, &conn.limits()) {
            Ok(l) => l,
            Err(f) => {
                let n = st.avail().min(CH_LEN);
                let h = st.peek(n).to_vec();
                return fatal(conn, &mut state, f, &h);
            }
        };
        set_state(&mut state, RecvState::AwaitPsh);
        let ht = layout.header_total;
        if st.fill(fd, ht, ht).await.is_err() {
            return;
        }
        hdr[..ht].copy_from_slice(st.peek(ht));
        st.consume(ht);
        if ht > layout.hlen && !header_digest_ok(&hdr[..ht], layout.hlen) {
            stats::with(|c| inc(&c.digest_errors, 1));
            let f = Fatal {
                fes: fes::HEADER_DIGEST_ERROR,
                fei: 0,
            };
            return fatal(conn, &mut state, f, &hdr[..layout.hlen]);
        }
        // This PDU's data, or the next one's, may be large: keep what
        // follows out of the staging buffer.
        st.exact = layout.data_len > COPY_MAX || conn.r2t_big_out.get() > 0;
        if layout.data_len > 0 {
            set_state(&mut state, RecvState::AwaitPayload);
        }
        let r = match layout.ty {
            PduType::CapsuleCmd => capsule(conn, st, &layout, &hdr).await,
            PduType::H2CData => h2c_data(conn, st, &layout, &hdr).await,
            PduType::H2CTermReq => {
                let t = TermReq::decode(&hdr);
                tracing::debug!("nvmf: host terminated the connection: {t:?}");
                stats::with(|c| inc(&c.term_recv, 1));
                return;
            }
            // check_header admits nothing else from a host.
            _ => Err(Some(Fatal::header(ch_off::PDU_TYPE))),
        };
        match r {
            Ok(()) => {}
            Err(None) => return,
            Err(Some(f)) => return fatal(conn, &mut state, f, &hdr[..layout.hlen]),
        }
    }
}

fn fatal(conn: &Conn, state: &mut RecvState, f: Fatal, hdr: &[u8]) {
    set_state(state, RecvState::Quiesced);
    tracing::debug!("nvmf: fatal transport error {f}");
    conn.queue_term(f, hdr);
}

type RecvResult = Result<(), Option<Fatal>>;

/// Receives `len` bytes of a PDU's data (after `pad`) into `buf[off..]`,
/// then its digest; returns whether the digest matched.
async fn pdu_data(
    conn: &Conn,
    st: &mut Staging,
    l: &PduLayout,
    buf: IoBuf,
    off: usize,
) -> (Result<bool, Option<Fatal>>, IoBuf) {
    let fd = conn.raw();
    if st.skip(fd, l.pad()).await.is_err() {
        return (Err(None), buf);
    }
    // What may follow the data in the same receive: everything (a greedy
    // staging read) unless a large payload may come next, then just the
    // digest and one capsule header.
    let tail = if st.exact {
        l.ddgst as usize * DIGEST_LEN + CAPSULE_CMD_HLEN + conn.dg.get().hdgst_len()
    } else {
        STAGING_LEN
    };
    let (r, buf) = st.payload(fd, buf, off, l.data_len, tail).await;
    if r.is_err() {
        return (Err(None), buf);
    }
    if !l.ddgst {
        return (Ok(true), buf);
    }
    if st.fill(fd, DIGEST_LEN, DIGEST_LEN).await.is_err() {
        return (Err(None), buf);
    }
    let want = le32(st.peek(DIGEST_LEN), 0);
    st.consume(DIGEST_LEN);
    let got = crc(&buf.spare_ref()[off..off + l.data_len]);
    if got != want {
        stats::with(|c| inc(&c.digest_errors, 1));
    }
    (Ok(got == want), buf)
}

/// Waits for a free command slot (backpressure on a host beyond its depth).
async fn slot(conn: &Conn) -> Option<u16> {
    poll_fn(|cx| {
        if conn.closing.get() || conn.dead.get() {
            return Poll::Ready(None);
        }
        match conn.alloc_slot() {
            Some(i) => Poll::Ready(Some(i)),
            None => {
                *conn.receiver.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    })
    .await
}

/// Data direction of a command: 1 = host to controller, 2 = controller to host.
fn direction(sqe: &Sqe) -> u8 {
    if sqe.opcode() == crate::wire::admin::FABRICS {
        sqe.fctype() & 3
    } else {
        sqe.opcode() & 3
    }
}

async fn capsule(conn: &Rc<Conn>, st: &mut Staging, l: &PduLayout, hdr: &[u8]) -> RecvResult {
    let sqe = Sqe::from_slice(&hdr[CH_LEN..]).ok_or(Some(Fatal::header(ch_off::HLEN)))?;
    stats::with(|c| inc(&c.commands, 1));
    let fd = conn.raw();
    conn.slot_wait.set(Some(sqe.cid()));
    let i = slot(conn).await;
    conn.slot_wait.set(None);
    let aborted = conn.slot_wait_aborted.replace(false);
    let Some(i) = i else {
        return Err(None);
    };
    let sq = conn.sqsize.get().max(1);
    conn.sqhd.set((conn.sqhd.get() + 1) % (sq + 1));
    let max = conn.opts.max_io_size;
    let fail = |s: Status| {
        let c = conn.cqe(sqe.cid(), s);
        conn.free_slot(i);
        stats::with(|c| inc(&c.errors, 1));
        conn.push_out(Out::Resp(c));
    };
    let sgl = if sqe.psdt() == 0 {
        Err(Status::INVALID_FIELD)
    } else {
        parse_data_sgl(&sqe.sgl(), l.data_len as u32, max)
    };
    let sgl = match sgl {
        Ok(s) => s,
        Err(s) => {
            // Refused: drop whatever data the capsule carried.
            let rest = l.plen - l.header_total;
            if st.skip(fd, rest).await.is_err() {
                return Err(None);
            }
            fail(s);
            return Ok(());
        }
    };
    {
        let mut s = conn.slots.borrow_mut();
        let slot = &mut s[i as usize];
        slot.sqe = sqe;
        slot.sgl = sgl;
        slot.failed = None;
        slot.aborted = aborted;
        slot.got = 0;
        slot.len = sgl.len();
        slot.state = SlotState::Receiving;
    }
    let aborted = || conn.slots.borrow()[i as usize].aborted;
    if l.data_len > 0 {
        let mut buf = IoBuf::alloc(l.data_len).await;
        buf.set_len(l.data_len);
        let (r, mut buf) = pdu_data(conn, st, l, buf, 0).await;
        let ok = r?;
        if aborted() {
            conn.complete_aborted(i);
            return Ok(());
        }
        if !ok {
            fail(Status::TRANSIENT_TRANSPORT);
            return Ok(());
        }
        if let DataSgl::InCapsule { offset, len } = sgl {
            if offset != 0 {
                // Data at an offset: move it to the front (rare; Linux uses 0).
                let (o, n) = (offset as usize, len as usize);
                buf.copy_within(o..o + n, 0);
            }
            buf.set_len(len as usize);
        }
        conn.slots.borrow_mut()[i as usize].buf = Some(buf);
        conn.queue_job(i);
        return Ok(());
    }
    match sgl {
        DataSgl::Transport { len } if direction(&sqe) & 1 != 0 => {
            // Host-to-controller data not in the capsule: ask for it.
            let mut buf = IoBuf::alloc(len as usize).await;
            if aborted() {
                conn.complete_aborted(i);
                return Ok(());
            }
            buf.set_len(len as usize);
            {
                let mut s = conn.slots.borrow_mut();
                s[i as usize].buf = Some(buf);
                s[i as usize].state = SlotState::AwaitH2C;
            }
            stats::with(|c| inc(&c.r2ts, 1));
            conn.r2t_out.set(conn.r2t_out.get() + 1);
            if len as usize > COPY_MAX {
                conn.r2t_big_out.set(conn.r2t_big_out.get() + 1);
            }
            conn.push_out(Out::R2T {
                cid: sqe.cid(),
                ttag: i,
                len,
            });
        }
        _ if aborted() => conn.complete_aborted(i),
        _ => conn.queue_job(i),
    }
    Ok(())
}

async fn h2c_data(conn: &Rc<Conn>, st: &mut Staging, l: &PduLayout, hdr: &[u8]) -> RecvResult {
    let h = DataHdr::decode(hdr).ok_or(Some(Fatal::header(ch_off::HLEN)))?;
    stats::with(|c| inc(&c.h2c, 1));
    let i = h.ttag as usize;
    // Transfer tag, command and offset are checked before any data is read.
    let (buf, expect_off, total) = {
        let mut s = conn.slots.borrow_mut();
        let Some(slot) = s.get_mut(i).filter(|s| s.state == SlotState::AwaitH2C) else {
            return Err(Some(Fatal::header(10)));
        };
        if slot.sqe.cid() != h.cccid {
            return Err(Some(Fatal::header(8)));
        }
        if h.length as usize != l.data_len {
            return Err(Some(Fatal::header(16)));
        }
        if h.offset != slot.got || u64::from(h.offset) + u64::from(h.length) > u64::from(slot.len) {
            return Err(Some(Fatal {
                fes: fes::DATA_OUT_OF_RANGE,
                fei: 12,
            }));
        }
        // The receiver holds the buffer while the data comes in: an Abort
        // meanwhile only marks the slot.
        slot.state = SlotState::Receiving;
        (slot.buf.take(), slot.got, slot.len)
    };
    let Some(buf) = buf else {
        return Err(None);
    };
    let (r, buf) = pdu_data(conn, st, l, buf, expect_off as usize).await;
    let ok = r?;
    let got = expect_off + h.length;
    let (done, aborted) = {
        let mut s = conn.slots.borrow_mut();
        let slot = &mut s[i];
        slot.buf = Some(buf);
        slot.got = got;
        slot.state = SlotState::AwaitH2C;
        if !ok {
            slot.failed = Some(Status::TRANSIENT_TRANSPORT);
        }
        (got == total, slot.aborted)
    };
    if aborted || done {
        conn.r2t_settled(total);
    }
    if aborted {
        conn.complete_aborted(i as u16);
    } else if done {
        conn.queue_job(i as u16);
    } else if l.flags & flags::LAST_PDU != 0 {
        // The host says it is done before the R2T's data is in.
        return Err(Some(Fatal {
            fes: fes::PDU_SEQUENCE_ERROR,
            fei: ch_off::FLAGS,
        }));
    }
    Ok(())
}

async fn worker(conn: Rc<Conn>) {
    loop {
        let job = poll_fn(|cx| {
            if let Some(j) = conn.jobs.borrow_mut().pop_front() {
                return Poll::Ready(Some(j));
            }
            if conn.closing.get() {
                return Poll::Ready(None);
            }
            conn.idle_workers.borrow_mut().push(cx.waker().clone());
            Poll::Pending
        })
        .await;
        let Some(i) = job else { break };
        let (sqe, sgl, buf, failed) = {
            let mut s = conn.slots.borrow_mut();
            let slot = &mut s[i as usize];
            slot.state = SlotState::Running;
            (slot.sqe, slot.sgl, slot.buf.take(), slot.failed)
        };
        let out = match failed {
            Some(st) => Out::Resp(conn.cqe(sqe.cid(), st)),
            None => execute(&conn, i, &sqe, sgl, buf).await,
        };
        conn.free_slot(i);
        conn.executing.set(conn.executing.get() - 1);
        if let Out::Resp(c) = &out {
            if !c.status().is_success() {
                stats::with(|c| inc(&c.errors, 1));
            }
        }
        conn.push_out(out);
    }
    conn.workers.set(conn.workers.get() - 1);
}

fn admin_out(conn: &Conn, sqe: &Sqe, sgl: DataSgl, o: AdminOut) -> Out {
    let mut c = conn.cqe(sqe.cid(), o.status());
    c.dw0 = o.dw0;
    c.dw1 = o.dw1;
    match o.data {
        Some(d) if o.status().is_success() => {
            let want = match sgl {
                DataSgl::Transport { len } => len as usize,
                _ => 0,
            };
            let n = want.min(d.len());
            if n == 0 {
                return Out::Resp(c);
            }
            let mut buf = IoBuf::heap(n);
            buf.copy_from_slice(&d[..n]);
            Out::Data {
                cid: sqe.cid(),
                buf,
                len: n as u32,
                resp: Some(c),
            }
        }
        _ => Out::Resp(c),
    }
}

async fn execute(conn: &Rc<Conn>, i: u16, sqe: &Sqe, sgl: DataSgl, buf: Option<IoBuf>) -> Out {
    let cid = sqe.cid();
    if sqe.opcode() == crate::wire::admin::FABRICS {
        match sqe.fctype() {
            fctype::CONNECT => return connect(conn, sqe, buf),
            fctype::DISCONNECT => {
                conn.closing.set(true);
                wake(&conn.receiver);
                return Out::Resp(conn.cqe(cid, Status::SUCCESS));
            }
            _ => {}
        }
    }
    // Identify Controller reports FUSES = 0: no fused operation is
    // supported, so a command marked as part of one (FUSE != 00b) is not
    // run on its own (NVMe 1.4 4.2: a fused operation is atomic); it gets
    // Invalid Field in Command, as Linux nvmet answers.
    if sqe.fuse() != 0 {
        return Out::Resp(conn.cqe(cid, Status::INVALID_FIELD));
    }
    let Some(qid) = conn.qid.get() else {
        return Out::Resp(conn.cqe(cid, Status::COMMAND_SEQUENCE));
    };
    let Some(ctrl) = conn.ctrl.borrow().clone() else {
        return Out::Resp(conn.cqe(cid, Status::COMMAND_SEQUENCE));
    };
    if qid == 0 {
        if sqe.opcode() == crate::wire::admin::ASYNC_EVENT_REQUEST {
            return aer(conn, &ctrl, cid).await;
        }
        if sqe.opcode() == crate::wire::admin::ABORT {
            ctrl.touch();
            let (sqid, acid) = (sqe.cdw(10) as u16, (sqe.cdw(10) >> 16) as u16);
            let done = abort_cmd(conn, &ctrl, sqid, acid).await;
            let mut c = conn.cqe(cid, Status::SUCCESS);
            // DW0 bit 0: 0 = aborted, 1 = not aborted.
            c.dw0 = u32::from(!done);
            return Out::Resp(c);
        }
        let facts = admin::TransportFacts {
            in_capsule_data_size: conn.opts.in_capsule_data_size,
            mdts: (conn.opts.max_io_size / 4096).max(1).ilog2() as u8,
        };
        let o = admin::execute(&ctrl, sqe, facts, &*conn.shared);
        return admin_out(conn, sqe, sgl, o);
    }
    if sqe.opcode() == crate::wire::admin::FABRICS {
        return Out::Resp(conn.cqe(cid, Status::INVALID_OPCODE));
    }
    let _ = i;
    let Some(ch) = conn.channel(sqe.nsid()) else {
        return Out::Resp(conn.cqe(cid, Status::INVALID_NAMESPACE));
    };
    stats::with(|c| inc(&c.pending_io, 1));
    let done = nvm::execute(sqe, &ch, sgl, buf, conn.opts.max_io_size).await;
    stats::with(|c| c.pending_io.set(c.pending_io.get() - 1));
    match done.data {
        Some((buf, len)) if done.status.is_success() => {
            stats::with(|c| {
                inc(&c.reads, 1);
                inc(&c.bytes_read, u64::from(len));
            });
            conn.host_io.read(u64::from(len));
            // SUCCESS in the C2HData instead of a CapsuleResp: only when the
            // host gave up SQ flow control (it then needs no SQHD) and the
            // transport allows it (SPDK's c2h_success).
            let success = conn.opts.c2h_success && conn.sqflow_off.get();
            let resp = (!success).then(|| conn.cqe(cid, Status::SUCCESS));
            Out::Data {
                cid,
                buf,
                len,
                resp,
            }
        }
        _ => {
            if done.status.is_success() {
                match sqe.opcode() {
                    crate::wire::io::WRITE => {
                        stats::with(|c| {
                            inc(&c.writes, 1);
                            inc(&c.bytes_written, u64::from(sgl.len()));
                        });
                        conn.host_io.write(u64::from(sgl.len()));
                    }
                    // SMART counts the blocks a Compare read as reads.
                    crate::wire::io::COMPARE => conn.host_io.read(u64::from(sgl.len())),
                    _ => {}
                }
            }
            Out::Resp(conn.cqe(cid, done.status))
        }
    }
}

/// Abort on queue `sqid` of `ctrl`, run on the reactor that owns it.
async fn abort_cmd(conn: &Rc<Conn>, ctrl: &Arc<Ctrl>, sqid: u16, cid: u16) -> bool {
    if sqid == 0 {
        return conn.abort(cid);
    }
    let Some(reactor) = ctrl.queue_reactor(sqid) else {
        return false;
    };
    let key = ctrl_key(ctrl);
    if reactor == ustor_runtime::reactor_id() {
        return abort_here(key, sqid, cid);
    }
    // Control path: one message there, the answer and a wake back.
    type Reply = Mutex<(Option<bool>, Option<Waker>)>;
    let reply: Arc<Reply> = Arc::new(Mutex::new((None, None)));
    let back = reply.clone();
    let sent = conn.shared.rt.send(reactor, move || {
        let r = abort_here(key, sqid, cid);
        let mut g = back.lock().unwrap_or_else(|p| p.into_inner());
        g.0 = Some(r);
        if let Some(w) = g.1.take() {
            w.wake();
        }
    });
    if sent.is_err() {
        return false;
    }
    poll_fn(|cx| {
        let mut g = reply.lock().unwrap_or_else(|p| p.into_inner());
        match g.0 {
            Some(r) => Poll::Ready(r),
            None => {
                g.1 = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    })
    .await
}

/// Parks an AER until an event is posted (or the controller goes away).
async fn aer(conn: &Rc<Conn>, ctrl: &Arc<Ctrl>, cid: u16) -> Out {
    {
        let mut a = ctrl.aer.lock().unwrap_or_else(|p| p.into_inner());
        if a.parked >= MAX_AERS {
            return Out::Resp(conn.cqe(cid, Status::AER_LIMIT));
        }
        a.parked += 1;
    }
    // Parked AERs are not "in flight" for the coalescer: nothing is coming.
    conn.executing.set(conn.executing.get() - 1);
    let ev = poll_fn(|cx| {
        let mut a = ctrl.aer.lock().unwrap_or_else(|p| p.into_inner());
        if conn.closing.get() || ctrl.failed.load(std::sync::atomic::Ordering::Acquire) {
            return Poll::Ready(None);
        }
        if let Some(e) = a.events.pop_front() {
            // Reported: masked until the host reads the log (RAE = 0).
            a.ns_masked |= e == AEN_NS_CHANGED;
            return Poll::Ready(Some(e));
        }
        a.waiters.push(cx.waker().clone());
        Poll::Pending
    })
    .await;
    conn.executing.set(conn.executing.get() + 1);
    ctrl.aer.lock().unwrap_or_else(|p| p.into_inner()).parked -= 1;
    match ev {
        Some(e) => {
            let mut c = conn.cqe(cid, Status::SUCCESS);
            c.dw0 = e;
            Out::Resp(c)
        }
        None => Out::Resp(conn.cqe(cid, Status::ABORT_REQUESTED)),
    }
}

fn connect_err(conn: &Conn, cid: u16, s: Status, data: bool, ipo: u16) -> Out {
    let mut c = conn.cqe(cid, s);
    c.dw0 = data as u32 | u32::from(ipo) << 16;
    Out::Resp(c)
}

fn connect(conn: &Rc<Conn>, sqe: &Sqe, buf: Option<IoBuf>) -> Out {
    let cid = sqe.cid();
    let cmd = ConnectCmd::parse(sqe);
    if conn.qid.get().is_some() {
        return Out::Resp(conn.cqe(cid, Status::COMMAND_SEQUENCE));
    }
    if cmd.recfmt != 0 {
        return Out::Resp(conn.cqe(cid, Status::CONNECT_INCOMPATIBLE_FORMAT));
    }
    let Some(data) = buf.as_deref().and_then(|b| ConnectData::decode(b).ok()) else {
        return connect_err(conn, cid, Status::CONNECT_INVALID_PARAM, false, 24);
    };
    let Some(subsys) = conn.shared.subsystem(&data.subnqn) else {
        return connect_err(conn, cid, Status::CONNECT_INVALID_PARAM, true, 256);
    };
    if !subsys.host_allowed(&data.hostnqn) || !subsys.listening_on(&conn.listen) {
        return connect_err(conn, cid, Status::CONNECT_INVALID_HOST, true, 512);
    }
    if cmd.qid == 0 {
        if cmd.sqsize == 0 || cmd.sqsize >= conn.opts.admin_queue_depth() {
            return connect_err(conn, cid, Status::CONNECT_INVALID_PARAM, false, 44);
        }
        let mut s = subsys.lock();
        let Some(cntlid) = subsys.alloc_cntlid(&mut s) else {
            return Out::Resp(conn.cqe(cid, Status::CONNECT_CTRL_BUSY));
        };
        // KATO rounds up to the 1 s keep-alive granularity.
        let kato = cmd.kato_ms.div_ceil(1000) * 1000;
        let ctrl = Arc::new(Ctrl::new(
            cntlid,
            subsys.clone(),
            data.hostnqn.clone(),
            data.hostid,
            kato,
            conn.opts.max_io_qpairs_per_ctrlr,
            true,
            conn.listen.clone(),
        ));
        s.ctrls.insert(cntlid, Arc::downgrade(&ctrl));
        drop(s);
        ctrl.add_queue(
            0,
            conn.raw(),
            ustor_runtime::reactor_id(),
            conn.host_io.clone(),
        );
        *conn.ctrl.borrow_mut() = Some(ctrl.clone());
        conn.qid.set(Some(0));
        stats::with(|c| {
            inc(&c.admin_qpairs, 1);
            inc(&c.cur_admin, 1);
        });
        spawn(kato_watch(conn.clone(), ctrl));
        conn.sqsize.set(cmd.sqsize);
        let mut c = conn.cqe(cid, Status::SUCCESS);
        c.dw0 = u32::from(cntlid);
        return Out::Resp(c);
    }
    let Some(ctrl) = subsys.ctrl(data.cntlid) else {
        return connect_err(conn, cid, Status::CONNECT_INVALID_PARAM, true, 16);
    };
    if ctrl.hostnqn != data.hostnqn {
        return connect_err(conn, cid, Status::CONNECT_INVALID_HOST, true, 512);
    }
    if !ctrl.enabled() {
        return Out::Resp(conn.cqe(cid, Status::COMMAND_SEQUENCE));
    }
    let granted = ctrl
        .features
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .num_io_queues;
    if cmd.qid > granted {
        return connect_err(conn, cid, Status::CONNECT_INVALID_PARAM, false, 42);
    }
    if cmd.sqsize == 0 || cmd.sqsize >= conn.opts.io_queue_depth() {
        return connect_err(conn, cid, Status::CONNECT_INVALID_PARAM, false, 44);
    }
    let reactor = ustor_runtime::reactor_id();
    if !ctrl.add_queue(cmd.qid, conn.raw(), reactor, conn.host_io.clone()) {
        return connect_err(conn, cid, Status::CONNECT_INVALID_PARAM, false, 42);
    }
    IO_QUEUES.with(|q| {
        q.borrow_mut()
            .push((ctrl_key(&ctrl), cmd.qid, Rc::downgrade(conn)))
    });
    conn.qid.set(Some(cmd.qid));
    conn.sqsize.set(cmd.sqsize);
    conn.prespawn_workers(cmd.sqsize as usize + 1);
    conn.sqflow_off
        .set(cmd.cattr & ConnectCmd::CATTR_DISABLE_SQFLOW != 0);
    *conn.ctrl.borrow_mut() = Some(ctrl.clone());
    stats::with(|c| {
        inc(&c.io_qpairs, 1);
        inc(&c.cur_io, 1);
    });
    let mut c = conn.cqe(cid, Status::SUCCESS);
    c.dw0 = u32::from(ctrl.cntlid);
    Out::Resp(c)
}

/// Enforces KATO: fails the controller when no admin command arrived in
/// time.
async fn kato_watch(conn: Rc<Conn>, ctrl: Arc<Ctrl>) {
    loop {
        ustor_runtime::sleep(Duration::from_millis(100)).await;
        if conn.closing.get() || conn.dead.get() {
            return;
        }
        if ctrl.kato_expired() {
            tracing::info!(
                "nvmf: controller {} of {} missed its keep alive; failing it",
                ctrl.cntlid,
                ctrl.subsys.nqn
            );
            ctrl.fail();
            return;
        }
    }
}

/// Moves one response into the group; false if it does not fit. C2HData
/// data starts at the PDO the host's `hpda` asks for; the zero padding
/// joins the header in the arena (HPDA 0: none).
fn encode(g: &mut PduGroup, o: &mut Option<Out>, dg: Digests, hpda: u8) -> bool {
    let mut h = [0u8; MAX_PADDED_HDR];
    let hd = dg.hdgst_len();
    let fits = match o.as_ref() {
        Some(Out::Resp(_)) | Some(Out::R2T { .. }) => g.fits(DATA_HLEN + hd, 1, 0),
        Some(Out::Data { .. }) => {
            let pad = data_pdo(DATA_HLEN + hd, hpda) - (DATA_HLEN + hd);
            g.fits(2 * (DATA_HLEN + hd) + pad + DIGEST_LEN, 3, 1)
        }
        Some(Out::Term { len, .. }) => g.fits(TERM_HLEN + len, 1, 0),
        None => return true,
    };
    if !fits {
        return false;
    }
    match o.take() {
        Some(Out::Resp(c)) => {
            let n = encode_capsule_resp(&mut h, &c, dg);
            g.push_bytes(&h[..n]);
            g.end_pdu(false);
        }
        Some(Out::R2T { cid, ttag, len }) => {
            let d = DataHdr {
                cccid: cid,
                ttag,
                offset: 0,
                length: len,
            };
            let n = encode_data_hdr(&mut h, PduType::R2T, &d, 0, dg);
            g.push_bytes(&h[..n]);
            // Not urgent: like a response, an R2T waits only while other
            // commands are in flight (the sender counts the ones awaiting
            // their data), so R2Ts of a busy queue leave together and the
            // host's H2CData follow together.
            g.end_pdu(false);
        }
        Some(Out::Data {
            cid,
            buf,
            len,
            resp,
        }) => {
            let d = DataHdr {
                cccid: cid,
                ttag: 0,
                offset: 0,
                length: len,
            };
            let fl = flags::LAST_PDU | if resp.is_none() { flags::SUCCESS } else { 0 };
            let n = encode_data_hdr_pda(&mut h, PduType::C2HData, &d, fl, dg, hpda);
            g.push_bytes(&h[..n]);
            let digest = dg.data.then(|| crc(&buf[..len as usize]));
            g.push_data(buf, 0, len as usize);
            if let Some(dd) = digest {
                g.push_bytes(&dd.to_le_bytes());
            }
            stats::with(|c| inc(&c.c2h, 1));
            if let Some(c) = resp {
                let n = encode_capsule_resp(&mut h, &c, dg);
                g.push_bytes(&h[..n]);
            }
            g.end_pdu(false);
        }
        Some(Out::Term { fes, fei, hdr, len }) => {
            let mut t = [0u8; TERM_HLEN + MAX_TERM_DATA];
            let n = encode_term_req(
                &mut t,
                PduType::C2HTermReq,
                TermReq { fes, fei },
                &hdr[..len],
            );
            g.push_bytes(&t[..n]);
            g.end_pdu(true);
        }
        None => {}
    }
    true
}

/// Sends queued responses through the coalescer.
async fn sender(conn: Rc<Conn>) {
    let fd = conn.raw();
    let mut group = PduGroup::new();
    let mut pending: Option<Out> = None;
    let mut deadline: Option<u64> = None;
    let mut term = false;
    // R2Ts in `group`: their commands await data, but not because of
    // anything else in flight.
    let mut r2ts_in_group = 0u32;
    loop {
        // Wait for something to send, the timer, or the end.
        let timer_fired = {
            let mut sleep = deadline.map(ustor_runtime::sleep_until);
            poll_fn(|cx| {
                let idle = conn.closing.get() && conn.executing.get() == 0;
                if pending.is_some() || !conn.out.borrow().is_empty() || (idle && group.is_empty())
                {
                    return Poll::Ready(false);
                }
                if let Some(s) = sleep.as_mut() {
                    if Pin::new(s).poll(cx).is_ready() {
                        return Poll::Ready(true);
                    }
                } else if idle {
                    return Poll::Ready(false);
                }
                *conn.sender.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            })
            .await
        };
        // Fill the group from the queue.
        loop {
            if pending.is_none() {
                pending = conn.out.borrow_mut().pop_front();
            }
            let Some(o) = pending.as_ref() else { break };
            term |= matches!(o, Out::Term { .. });
            let r2t = matches!(o, Out::R2T { .. });
            if !encode(&mut group, &mut pending, conn.dg.get(), conn.hpda.get()) {
                break;
            }
            r2ts_in_group += u32::from(r2t);
        }
        if group.is_empty() {
            if conn.closing.get() && conn.executing.get() == 0 && pending.is_none() {
                // Everything is answered (a Disconnect's response
                // included): end the connection here rather than when the
                // host closes it, so the receiver's pending receive ends
                // and the queue id is free at once. After EOF or a fatal
                // error this is a no-op.
                // SAFETY: shutdown(2) on our own socket, still open.
                unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
                return;
            }
            continue;
        }
        // Commands still executing, or awaiting the data of an R2T already
        // sent, may join the group; how many the host has in flight beyond
        // them is not visible here.
        let others = if conn.executing.get() > 0
            || !conn.out.borrow().is_empty()
            || conn.r2t_out.get() > r2ts_in_group
        {
            crate::coalesce::BACKLOG_UNKNOWN
        } else {
            0
        };
        // A pending item did not fit (out of iovecs or arena): the group is
        // as full as it gets.
        let Some(why) = conn.coal.borrow().flush_reason(
            &group,
            pending.is_some(),
            timer_fired,
            others,
            group.urgent() || term,
            &mut deadline,
        ) else {
            continue;
        };
        let pdus = group.pdus();
        // What the adaptive policy may know of the queue's depth: commands
        // executing, awaiting data, or answered but not yet in a group.
        let depth = conn.executing.get()
            + conn.r2t_out.get().saturating_sub(r2ts_in_group) as usize
            + conn.out.borrow().len();
        conn.coal
            .borrow_mut()
            .on_flush(why, pdus, u32::try_from(depth).unwrap_or(u32::MAX));
        r2ts_in_group = 0;
        group = flush(&conn, fd, group).await;
        if term {
            conn.dead.set(true);
            conn.closing.set(true);
            wake(&conn.receiver);
            // SAFETY: shutdown(2) on our own socket; the peer sees EOF.
            unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
        }
    }
}

async fn flush(conn: &Conn, fd: RawFd, mut group: PduGroup) -> PduGroup {
    if conn.dead.get() {
        group.clear();
        return group;
    }
    let mut calls = 0;
    let (r, group) = group.send_all(fd, &mut calls).await;
    stats::with(|c| inc(&c.sendmsg_calls, calls));
    if r.is_err() {
        conn.dead.set(true);
        conn.closing.set(true);
        wake(&conn.receiver);
    }
    group
}
