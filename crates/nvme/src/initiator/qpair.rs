//! One NVMe/TCP I/O queue pair on one reactor.
//!
//! Commands take CIDs from a table preallocated at channel creation (CID =
//! slot index); I/O beyond the queue depth, or issued while the connection
//! is down, waits in a FIFO bounded by the bdev layer's I/O table. The
//! driver task connects (after the controller's admin queue is up), runs the
//! receiver inline and the sender as a task, and on a lost connection waits
//! for both to stop touching the I/O buffers before it requeues every
//! command for the next connection, or fails them once the controller is
//! failed (ctrlr_loss_timeout_sec) or detached.
//!
//! Receive path: headers are staged (many per receive after capsule
//! responses; exactly one after data, so the next payload is not swallowed);
//! C2HData payload is received straight into the I/O's iovecs, together
//! with its digest and the next header in one `recvmsg`. Send path: the
//! LANoT coalescer groups capsules and H2CData PDUs; write data leaves from
//! the I/O's buffers (`PduGroup::push_raw`).

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Poll, Waker};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use ustor_bdev::{BdevError, IoHandle, IoType};
use ustor_net::coalesce::{CoalesceStats, Coalescer};
use ustor_net::recv::{self, Seg};
use ustor_net::PduGroup;
use ustor_runtime::ops;

use super::ctrlr::{connect_queue, send_term_req, Ctrlr, CtrlrState, QueueConn};
use super::InitiatorError;
use crate::wire::*;

/// Most iovecs one receive carries: data segments, a digest, the next header.
const MAX_RECV_IOV: usize = ustor_bdev::io::MAX_SEGMENTS + 2;
const _: () = assert!(MAX_RECV_IOV <= ustor_net::recv::MAX_RECV_IOV);

/// PDUs handled per receiver pass before yielding to the reactor.
const RECV_BUDGET: u32 = 64;
/// Header staging bytes.
const STAGE_LEN: usize = 8192;
/// Data segments one PDU may carry in a group (header, digest besides).
const MAX_PDU_SEGS: usize = ops::MAX_IOV - 3;
/// How often a queue that waits for its controller looks again.
const WAIT_TICK: Duration = Duration::from_millis(5);
/// After a fatal error in the controller's PDUs, how long the sender may
/// take to finish the group it is writing, so the H2CTermReq starts on a
/// PDU boundary; a controller that stopped reading gets none.
const TERM_WAIT: Duration = Duration::from_millis(50);
/// Offset of the CID in a CapsuleResp PDU (FEI of a response for no
/// command).
const RESP_CID_OFF: u32 = CH_LEN as u32 + 12;

/// Per-queue counters, readable from any thread (single writer: the queue's
/// reactor stores with Relaxed, no read-modify-write).
#[derive(Default)]
pub struct QpCounters {
    ios: AtomicU64,
    sendmsg_calls: AtomicU64,
    payload_copy_bytes: AtomicU64,
    connects: AtomicU64,
    requeued: AtomicU64,
    groups: AtomicU64,
    pdus: AtomicU64,
    full_groups: AtomicU64,
    small_groups: AtomicU64,
    timer_expiries: AtomicU64,
    degree: AtomicU64,
    timer_us: AtomicU64,
    raises: AtomicU64,
    lowers: AtomicU64,
}

use ustor_net::bump_relaxed as bump;

/// A snapshot of one I/O queue's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QpStats {
    pub ios: u64,
    pub sendmsg_calls: u64,
    /// Payload bytes that arrived in the header staging buffer and were
    /// copied (0 when every read lands straight in its buffer).
    pub payload_copy_bytes: u64,
    pub connects: u64,
    pub requeued: u64,
    pub coalesce: CoalesceStats,
}

impl QpCounters {
    pub fn snapshot(&self) -> QpStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        QpStats {
            ios: l(&self.ios),
            sendmsg_calls: l(&self.sendmsg_calls),
            payload_copy_bytes: l(&self.payload_copy_bytes),
            connects: l(&self.connects),
            requeued: l(&self.requeued),
            coalesce: CoalesceStats {
                groups: l(&self.groups),
                pdus: l(&self.pdus),
                full_groups: l(&self.full_groups),
                small_groups: l(&self.small_groups),
                timer_expiries: l(&self.timer_expiries),
                raises: l(&self.raises),
                lowers: l(&self.lowers),
                degree: l(&self.degree) as u32,
                timer_us: l(&self.timer_us) as u32,
            },
        }
    }
}

/// Connection state of the queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum QpState {
    /// Waiting for the controller or connecting.
    Down,
    /// Connected: commands flow.
    Live,
    /// The controller failed: I/O fails at once.
    Failed,
    /// The channel was dropped or the controller detached.
    Closed,
}

/// Something for the sender.
#[derive(Clone, Copy, Debug)]
enum Out {
    /// A command capsule (with in-capsule data for small writes).
    Cmd(u16),
    /// Write data the controller asked for with an R2T: [off, end).
    H2C {
        cid: u16,
        ttag: u16,
        off: u32,
        end: u32,
    },
}

/// One command slot (CID = index).
struct Cmd {
    io: Option<IoHandle>,
    kind: IoType,
    slba: u64,
    nlb: u32,
    iov: *const libc::iovec,
    iovcnt: usize,
    len: u32,
    /// Write data sent in the capsule.
    in_capsule: bool,
    err: Option<BdevError>,
    /// DSM range (unmap), sent in the capsule.
    dsm: [u8; 16],
}

impl Cmd {
    fn empty() -> Cmd {
        Cmd {
            io: None,
            kind: IoType::Read,
            slba: 0,
            nlb: 0,
            iov: std::ptr::null(),
            iovcnt: 0,
            len: 0,
            in_capsule: false,
            err: None,
            dsm: [0; 16],
        }
    }

    /// The iovecs.
    ///
    /// # Safety
    /// Only while the command holds its I/O.
    unsafe fn iovecs(&self) -> &[libc::iovec] {
        if self.iov.is_null() {
            &[]
        } else {
            std::slice::from_raw_parts(self.iov, self.iovcnt)
        }
    }

    /// Receive targets for bytes [off, off + len) of the data.
    ///
    /// # Safety
    /// Only while the command holds its I/O.
    unsafe fn segs(&self, mut off: usize, mut len: usize, out: &mut [Seg; MAX_RECV_IOV]) -> usize {
        let mut n = 0;
        for v in self.iovecs() {
            if len == 0 || n == out.len() {
                break;
            }
            if off >= v.iov_len {
                off -= v.iov_len;
                continue;
            }
            let take = (v.iov_len - off).min(len);
            out[n] = Seg {
                ptr: (v.iov_base as *mut u8).add(off),
                len: take,
            };
            n += 1;
            off = 0;
            len -= take;
        }
        n
    }
}

pub(crate) struct Qp {
    pub ctrlr: Arc<Ctrlr>,
    nsid: u32,
    qid: u16,
    depth: u16,
    fd: Cell<RawFd>,
    state: Cell<QpState>,
    /// Controller generation this queue connected under.
    gen: Cell<u64>,
    dg: Cell<Digests>,
    /// The controller's data alignment (ICResp CPDA) for data we send.
    cpda: Cell<u8>,
    maxh2c: Cell<u32>,
    icd_max: Cell<u32>,
    cmds: RefCell<Box<[Cmd]>>,
    free: RefCell<Vec<u16>>,
    pending: RefCell<VecDeque<IoHandle>>,
    out: RefCell<VecDeque<Out>>,
    /// Commands holding a CID.
    active: Cell<u32>,
    /// Reads among them: while any is in flight, headers are received
    /// exactly, so no read payload lands in the staging buffer.
    reads: Cell<u32>,
    coal: RefCell<Coalescer>,
    sender_w: RefCell<Option<Waker>>,
    driver_w: RefCell<Option<Waker>>,
    sender_running: Cell<bool>,
    pub counters: Arc<QpCounters>,
}

fn wake(w: &RefCell<Option<Waker>>) {
    if let Some(w) = w.borrow_mut().take() {
        w.wake();
    }
}

impl Qp {
    pub fn new(ctrlr: Arc<Ctrlr>, nsid: u32, qid: u16) -> Rc<Qp> {
        let depth = ctrlr.p.io_queue_size;
        let cfg = ctrlr.p.coalesce;
        let counters = Arc::new(QpCounters::default());
        ctrlr.add_qp(counters.clone());
        Rc::new(Qp {
            ctrlr,
            nsid,
            qid,
            depth,
            fd: Cell::new(-1),
            state: Cell::new(QpState::Down),
            gen: Cell::new(0),
            dg: Cell::new(Digests::default()),
            cpda: Cell::new(0),
            maxh2c: Cell::new(4096),
            icd_max: Cell::new(0),
            cmds: RefCell::new((0..depth).map(|_| Cmd::empty()).collect()),
            free: RefCell::new((0..depth).rev().collect()),
            pending: RefCell::new(VecDeque::with_capacity(ustor_bdev::io::TABLE_SLOTS)),
            out: RefCell::new(VecDeque::with_capacity(2 * depth as usize + 8)),
            active: Cell::new(0),
            reads: Cell::new(0),
            coal: RefCell::new(Coalescer::new(cfg)),
            sender_w: RefCell::new(None),
            driver_w: RefCell::new(None),
            sender_running: Cell::new(false),
            counters,
        })
    }

    pub fn outstanding(&self) -> usize {
        self.active.get() as usize + self.pending.borrow().len()
    }

    /// Submits a bdev I/O.
    pub fn submit(&self, io: IoHandle) {
        match self.state.get() {
            QpState::Failed => return io.complete(Err(BdevError::Io(libc::ENXIO))),
            QpState::Closed => return io.complete(Err(BdevError::Removed)),
            _ => {}
        }
        let kind = io.desc().kind;
        match kind {
            IoType::Reset => return io.complete(Ok(())),
            IoType::Read | IoType::Write | IoType::Flush | IoType::WriteZeroes | IoType::Unmap => {}
        }
        if self.state.get() == QpState::Live && self.pending.borrow().is_empty() {
            if let Some(cid) = self.free.borrow_mut().pop() {
                self.start(cid, io);
                return;
            }
        }
        self.pending.borrow_mut().push_back(io);
    }

    fn start(&self, cid: u16, io: IoHandle) {
        let d = io.desc();
        let bs_len = {
            let mut cmds = self.cmds.borrow_mut();
            let c = &mut cmds[cid as usize];
            c.kind = d.kind;
            c.slba = d.offset_blocks;
            c.nlb = d.num_blocks as u32;
            c.iov = d.iov;
            c.iovcnt = d.iovcnt;
            // SAFETY: the I/O's iovecs are valid until it completes.
            c.len = unsafe { d.iovecs() }.iter().map(|v| v.iov_len as u32).sum();
            c.in_capsule =
                d.kind == IoType::Write && c.len <= self.icd_max.get() && d.iovcnt <= MAX_PDU_SEGS;
            c.err = None;
            if d.kind == IoType::Unmap {
                c.dsm[..4].fill(0);
                c.dsm[4..8].copy_from_slice(&(d.num_blocks as u32).to_le_bytes());
                c.dsm[8..16].copy_from_slice(&d.offset_blocks.to_le_bytes());
            }
            c.io = Some(io);
            c.len
        };
        debug_assert!(d.kind != IoType::Read || bs_len > 0);
        self.active.set(self.active.get() + 1);
        if d.kind == IoType::Read {
            self.reads.set(self.reads.get() + 1);
        }
        self.out.borrow_mut().push_back(Out::Cmd(cid));
        wake(&self.sender_w);
    }

    /// Completes command `cid`, then starts waiting I/O on the freed CID.
    fn complete(&self, cid: u16, res: Result<(), BdevError>) {
        let io = {
            let mut cmds = self.cmds.borrow_mut();
            let c = &mut cmds[cid as usize];
            let Some(io) = c.io.take() else { return };
            if c.kind == IoType::Read {
                self.reads.set(self.reads.get() - 1);
            }
            c.iov = std::ptr::null();
            c.iovcnt = 0;
            io
        };
        self.active.set(self.active.get() - 1);
        self.free.borrow_mut().push(cid);
        bump(&self.counters.ios, 1);
        // No borrow is held here: completion may submit again at once.
        io.complete(res);
        self.start_pending();
    }

    fn start_pending(&self) {
        // Budget: at most one start per free CID.
        while self.state.get() == QpState::Live {
            let Some(cid) = self.free.borrow_mut().pop() else {
                return;
            };
            let Some(io) = self.pending.borrow_mut().pop_front() else {
                self.free.borrow_mut().push(cid);
                return;
            };
            self.start(cid, io);
        }
    }

    /// Fails every command and waiting I/O with `e` (no connection is up).
    fn fail_all(&self, e: BdevError) {
        debug_assert!(!self.sender_running.get());
        self.out.borrow_mut().clear();
        for cid in 0..self.depth {
            self.complete(cid, Err(e));
        }
        // Budget: the FIFO is bounded by the bdev layer's I/O table.
        loop {
            let io = self.pending.borrow_mut().pop_front();
            match io {
                Some(io) => io.complete(Err(e)),
                None => break,
            }
        }
    }

    /// The channel is going away: stop the driver (which fails what is left).
    pub fn close(&self) {
        self.state.set(QpState::Closed);
        let fd = self.fd.get();
        if fd >= 0 {
            recv::shutdown(fd);
        }
        wake(&self.sender_w);
        wake(&self.driver_w);
    }
}

/// Drives the queue: connect, serve, and on loss requeue and reconnect.
pub(crate) async fn drive(qp: Rc<Qp>) {
    loop {
        if qp.state.get() == QpState::Closed || qp.ctrlr.stopping() {
            qp.state.set(QpState::Closed);
            qp.fail_all(BdevError::Removed);
            break;
        }
        match qp.ctrlr.state() {
            CtrlrState::Failed => {
                if qp.state.get() != QpState::Failed {
                    qp.state.set(QpState::Failed);
                    qp.fail_all(BdevError::Io(libc::ENXIO));
                }
                idle(&qp, WAIT_TICK * 20).await;
                continue;
            }
            CtrlrState::Enabled if qp.ctrlr.gen() != qp.gen.get() => {}
            _ => {
                idle(&qp, WAIT_TICK).await;
                continue;
            }
        }
        let gen = qp.ctrlr.gen();
        let cntlid = qp.ctrlr.cntlid();
        let conn = super::ctrlr::timeout(
            Duration::from_secs(5),
            connect_queue(&qp.ctrlr, qp.qid, qp.depth - 1, cntlid),
        )
        .await;
        let fd: OwnedFd = match conn {
            Some(Ok(QueueConn {
                fd,
                dg,
                maxh2c,
                cpda,
                ..
            })) => {
                qp.dg.set(dg);
                qp.maxh2c.set(maxh2c);
                qp.cpda.set(cpda);
                fd
            }
            Some(Err(e @ InitiatorError::Status { .. })) => {
                // The controller answered and refused this queue (e.g. a
                // restarted target granting fewer queues): its admin queue
                // is fine, so resetting it would only drop the other queues
                // (and be refused again, in a loop). Fail this queue's I/O
                // and try again after the reconnect delay.
                if qp.state.get() != QpState::Failed {
                    tracing::warn!("nvme: I/O queue {} refused: {e}", qp.qid);
                    qp.state.set(QpState::Failed);
                    qp.fail_all(BdevError::Io(libc::ENXIO));
                } else {
                    tracing::debug!("nvme: I/O queue {} refused: {e}", qp.qid);
                }
                let delay = u64::from(qp.ctrlr.p.reconnect_delay_sec.max(1));
                idle(&qp, Duration::from_secs(delay)).await;
                continue;
            }
            other => {
                if let Some(Err(e)) = other {
                    tracing::debug!("nvme: I/O queue {} connect: {e}", qp.qid);
                }
                qp.ctrlr.request_reset(gen);
                idle(&qp, WAIT_TICK * 4).await;
                continue;
            }
        };
        if qp.state.get() == QpState::Closed {
            continue;
        }
        serve(&qp, fd, gen).await;
        if qp.state.get() != QpState::Closed {
            qp.state.set(QpState::Down);
            qp.ctrlr.request_reset(gen);
        }
    }
    qp.ctrlr.remove_qp(&qp.counters);
    qp.ctrlr.free_qid(qp.qid);
}

/// Sleeps for `d` or until the queue is closed.
async fn idle(qp: &Qp, d: Duration) {
    let mut s = std::pin::pin!(ustor_runtime::sleep(d));
    poll_fn(|cx| {
        if qp.state.get() == QpState::Closed || s.as_mut().poll(cx).is_ready() {
            return Poll::Ready(());
        }
        *qp.driver_w.borrow_mut() = Some(cx.waker().clone());
        Poll::Pending
    })
    .await
}

/// Serves one connection until it drops; returns with no task touching the
/// I/O buffers and every unfinished command queued for resending.
async fn serve(qp: &Rc<Qp>, fd: OwnedFd, gen: u64) {
    let raw = fd.as_raw_fd();
    qp.fd.set(raw);
    qp.gen.set(gen);
    qp.icd_max.set(qp.ctrlr.icd_max());
    bump(&qp.counters.connects, 1);
    // Resend what the last connection left unfinished (same CIDs).
    {
        let cmds = qp.cmds.borrow();
        let mut out = qp.out.borrow_mut();
        out.clear();
        for (cid, c) in cmds.iter().enumerate() {
            if c.io.is_some() {
                out.push_back(Out::Cmd(cid as u16));
                bump(&qp.counters.requeued, 1);
            }
        }
    }
    qp.state.set(QpState::Live);
    qp.sender_running.set(true);
    ustor_runtime::spawn(sender(qp.clone(), raw));
    qp.start_pending();
    let mut st = Stage {
        buf: Box::new([0u8; STAGE_LEN]),
        pos: 0,
        have: 0,
    };
    let r = receiver(qp, raw, &mut st).await;
    if let Err(e) = &r {
        tracing::debug!("nvme: I/O queue {} lost: {e}", qp.qid);
    }
    if qp.state.get() == QpState::Live {
        qp.state.set(QpState::Down);
    }
    if let Err(RecvErr::Fatal { f, hdr, .. }) = r {
        // Tell the controller why. The sender (woken, it sees the queue
        // down) first finishes the group it is writing, so the request
        // starts on a PDU boundary; the offending header is still staged.
        wake(&qp.sender_w);
        let _ = super::ctrlr::timeout(TERM_WAIT, sender_stopped(qp)).await;
        if !qp.sender_running.get() {
            let n = hdr.min(st.avail());
            send_term_req(raw, f, &st.buf[st.pos..st.pos + n]);
        }
    }
    recv::shutdown(raw);
    wake(&qp.sender_w);
    // The sender may be in a sendmsg that still reads write buffers.
    sender_stopped(qp).await;
    qp.fd.set(-1);
    drop(fd);
    let mut cmds = qp.cmds.borrow_mut();
    for c in cmds.iter_mut() {
        c.err = None;
    }
}

/// Waits until the sender task has stopped touching the socket and the
/// write buffers.
async fn sender_stopped(qp: &Qp) {
    poll_fn(|cx| {
        if !qp.sender_running.get() {
            return Poll::Ready(());
        }
        *qp.driver_w.borrow_mut() = Some(cx.waker().clone());
        Poll::Pending
    })
    .await
}

#[derive(Debug, thiserror::Error)]
enum RecvErr {
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("protocol: {0}")]
    Proto(&'static str),
    /// A fatal error in a controller PDU whose first `hdr` header bytes
    /// are still staged (at `Stage::pos`): reported in an H2CTermReq.
    #[error("protocol: {what} ({f})")]
    Fatal {
        what: &'static str,
        f: Fatal,
        hdr: usize,
    },
    #[error("controller terminated the connection (fes {0:#x})")]
    Term(u16),
}

/// Staged header bytes: `buf[pos..have]` are received and not yet consumed.
struct Stage {
    buf: Box<[u8; STAGE_LEN]>,
    pos: usize,
    have: usize,
}

impl Stage {
    fn avail(&self) -> usize {
        self.have - self.pos
    }
    fn consume(&mut self, n: usize) {
        self.pos += n;
        if self.pos == self.have {
            self.pos = 0;
            self.have = 0;
        }
    }
    /// Makes at least `need` bytes available, receiving at most `max()`
    /// more (exact after data PDUs and while reads are in flight, so a read
    /// payload is not staged). `max` is asked again after every wait: a
    /// read may have been submitted meanwhile.
    async fn fill(
        &mut self,
        fd: RawFd,
        need: usize,
        max: impl Fn() -> usize,
    ) -> Result<(), RecvErr> {
        // Budget: each round gains a byte, waits for readiness, or fails.
        while self.avail() < need {
            if self.pos > 0 {
                // Header bytes only (a few dozen): keep them at the front.
                self.buf.copy_within(self.pos..self.have, 0);
                self.have -= self.pos;
                self.pos = 0;
            }
            let want = need - self.avail();
            let room = (STAGE_LEN - self.have).min(max().saturating_sub(self.avail()).max(want));
            let seg = Seg {
                ptr: self.buf[self.have..].as_mut_ptr(),
                len: room,
            };
            // SAFETY: the segment lies inside our own staging buffer.
            match unsafe { recv::try_recv(fd, seg) }? {
                Some(n) => self.have += n,
                None => recv::readable(fd).await?,
            }
        }
        Ok(())
    }
}

/// Receives the controller's PDUs until the connection drops or fails. A
/// header stays staged until it has been checked, so a fatal error can
/// quote it in the H2CTermReq.
async fn receiver(qp: &Rc<Qp>, fd: RawFd, st: &mut Stage) -> Result<(), RecvErr> {
    let dg = qp.dg.get();
    let hdr_exact = DATA_HLEN + dg.hdgst_len();
    let lim = RecvLimits {
        max_incapsule: 0,
        max_data_pdu: qp.ctrlr.mdts_bytes().max(1 << 20),
    };
    let mut exact = false;
    loop {
        for _ in 0..RECV_BUDGET {
            if qp.state.get() != QpState::Live {
                return Ok(());
            }
            let max = || {
                if exact || qp.reads.get() > 0 {
                    hdr_exact
                } else {
                    STAGE_LEN
                }
            };
            st.fill(fd, CH_LEN, max).await?;
            let ch = CommonHeader::decode(&st.buf[st.pos..st.have])
                .ok_or(RecvErr::Proto("short header"))?;
            let l = check_header(&ch, dg, true, &lim).map_err(|f| RecvErr::Fatal {
                what: "bad header",
                f,
                hdr: CH_LEN,
            })?;
            let fatal = |(f, what)| RecvErr::Fatal {
                what,
                f,
                hdr: l.hlen,
            };
            let hdr_need = if l.ty == PduType::C2HTermReq {
                l.plen
            } else {
                l.header_total
            };
            if hdr_need > STAGE_LEN {
                return Err(RecvErr::Proto("header too long"));
            }
            st.fill(fd, hdr_need, || max().max(hdr_need)).await?;
            let hdr = &st.buf[st.pos..st.pos + l.header_total];
            if dg.header && !header_digest_ok(hdr, l.hlen) {
                let f = Fatal {
                    fes: fes::HEADER_DIGEST_ERROR,
                    fei: 0,
                };
                return Err(fatal((f, "header digest")));
            }
            exact = false;
            // Each handler checks the header before it is consumed.
            match l.ty {
                PduType::CapsuleResp => {
                    let cqe = Cqe::decode(&hdr[CH_LEN..]).ok_or(RecvErr::Proto("short CQE"))?;
                    on_response(qp, cqe).map_err(fatal)?;
                    st.consume(l.header_total);
                }
                PduType::R2T => {
                    let h = DataHdr::decode(hdr).ok_or(RecvErr::Proto("short R2T"))?;
                    on_r2t(qp, h).map_err(fatal)?;
                    st.consume(l.header_total);
                }
                PduType::C2HData => {
                    let h = DataHdr::decode(hdr).ok_or(RecvErr::Proto("short C2HData"))?;
                    c2h_check(qp, &l, &h).map_err(fatal)?;
                    st.consume(l.header_total);
                    c2h_data(qp, fd, st, &l, h, hdr_exact).await?;
                    exact = true;
                }
                PduType::C2HTermReq => {
                    let t = TermReq::decode(hdr).map(|t| t.fes).unwrap_or(0);
                    return Err(RecvErr::Term(t));
                }
                // check_header admits nothing else from a controller.
                _ => {
                    let f = Fatal {
                        fes: fes::PDU_SEQUENCE_ERROR,
                        fei: ch_off::PDU_TYPE,
                    };
                    return Err(fatal((f, "unexpected PDU")));
                }
            }
        }
        ustor_runtime::yield_now().await;
    }
}

fn status_err(s: Status) -> BdevError {
    match (s.sct(), s.sc()) {
        (0, 0x80) => BdevError::OutOfRange {
            offset_blocks: 0,
            num_blocks: 0,
            size_blocks: 0,
        },
        (0, 0x0b) => BdevError::Removed,
        (0, 0x01) | (0, 0x02) => BdevError::NotSupported,
        (2, 0x85) => BdevError::Miscompare,
        (0, 0x07) => BdevError::Aborted,
        _ => BdevError::Io(libc::EIO),
    }
}

/// A fatal error in a controller PDU header: what to report, and why.
type PduErr = (Fatal, &'static str);

fn on_response(qp: &Qp, cqe: Cqe) -> Result<(), PduErr> {
    let cid = cqe.cid;
    let err = {
        let cmds = qp.cmds.borrow();
        match cmds.get(cid as usize) {
            Some(c) if c.io.is_some() => c.err,
            _ => return Err((Fatal::header(RESP_CID_OFF), "response for no command")),
        }
    };
    let s = cqe.status();
    let res = if !s.is_success() {
        Err(status_err(s))
    } else {
        err.map_or(Ok(()), Err)
    };
    qp.complete(cid, res);
    Ok(())
}

fn on_r2t(qp: &Qp, h: DataHdr) -> Result<(), PduErr> {
    {
        let cmds = qp.cmds.borrow();
        // CCCID must name a write whose data is not in its capsule.
        let Some(c) = cmds
            .get(h.cccid as usize)
            .filter(|c| c.io.is_some() && c.kind == IoType::Write && !c.in_capsule)
        else {
            return Err((Fatal::header(8), "R2T for no R2T write"));
        };
        if h.length == 0 {
            return Err((Fatal::header(16), "R2T of no data"));
        }
        let end = u64::from(h.offset) + u64::from(h.length);
        if end > u64::from(c.len) {
            let f = Fatal {
                fes: fes::DATA_OUT_OF_RANGE,
                fei: 12,
            };
            return Err((f, "R2T out of range"));
        }
    }
    qp.out.borrow_mut().push_back(Out::H2C {
        cid: h.cccid,
        ttag: h.ttag,
        off: h.offset,
        end: h.offset + h.length,
    });
    wake(&qp.sender_w);
    Ok(())
}

/// Checks a C2HData header (before any of its data is read): flags, DATAL
/// against the PDU's length, a read command, and the range.
fn c2h_check(qp: &Qp, l: &PduLayout, h: &DataHdr) -> Result<(), PduErr> {
    if l.flags & flags::SUCCESS != 0 && l.flags & flags::LAST_PDU == 0 {
        return Err((Fatal::header(ch_off::FLAGS), "SUCCESS without LAST_PDU"));
    }
    if h.length as usize != l.data_len {
        return Err((Fatal::header(16), "C2HData DATAL differs from its PDU"));
    }
    let cmds = qp.cmds.borrow();
    let Some(c) = cmds
        .get(h.cccid as usize)
        .filter(|c| c.io.is_some() && c.kind == IoType::Read)
    else {
        return Err((Fatal::header(8), "C2HData for no read"));
    };
    if h.offset as usize + l.data_len > c.len as usize {
        let f = Fatal {
            fes: fes::DATA_OUT_OF_RANGE,
            fei: 12,
        };
        return Err((f, "C2HData out of range"));
    }
    Ok(())
}

/// Receives one C2HData payload (checked by [`c2h_check`], header
/// consumed) straight into the command's buffers, with its digest and
/// (opportunistically) the next header.
async fn c2h_data(
    qp: &Qp,
    fd: RawFd,
    st: &mut Stage,
    l: &PduLayout,
    h: DataHdr,
    hdr_exact: usize,
) -> Result<(), RecvErr> {
    let pad = l.pad();
    if pad > 0 {
        // We ask for HPDA 0, but a PDO past the header is still valid:
        // drop the padding, staged or not (never reading into the data).
        st.fill(fd, pad, || pad).await?;
        st.consume(pad);
    }
    let cid = h.cccid;
    let off = h.offset as usize;
    let len = l.data_len;
    let mut segs = [Seg {
        ptr: std::ptr::null_mut(),
        len: 0,
    }; MAX_RECV_IOV];
    let nseg = {
        let cmds = qp.cmds.borrow();
        let c = &cmds[cid as usize];
        debug_assert!(c.io.is_some() && c.kind == IoType::Read && off + len <= c.len as usize);
        // SAFETY: the command holds its I/O (checked by c2h_check): the
        // iovecs are valid, and the I/O completes only after this receive
        // returned.
        unsafe { c.segs(off, len, &mut segs) }
    };
    // Payload bytes that arrived with the header are copied (counted).
    let mut staged = st.avail().min(len);
    if staged > 0 {
        let mut src = st.pos;
        let mut left = staged;
        for s in segs[..nseg].iter_mut() {
            let n = left.min(s.len);
            // SAFETY: s is a valid destination of s.len bytes; the source
            // lies inside the staging buffer.
            unsafe { std::ptr::copy_nonoverlapping(st.buf[src..].as_ptr(), s.ptr, n) };
            s.ptr = unsafe { s.ptr.add(n) };
            s.len -= n;
            src += n;
            left -= n;
            if left == 0 {
                break;
            }
        }
        st.consume(staged);
        bump(&qp.counters.payload_copy_bytes, staged as u64);
    }
    let mut ddgst = [0u8; DIGEST_LEN];
    let dlen = if l.ddgst { DIGEST_LEN } else { 0 };
    // The digest may also be staged already.
    let dstaged = st.avail().min(dlen);
    ddgst[..dstaged].copy_from_slice(&st.buf[st.pos..st.pos + dstaged]);
    st.consume(dstaged);
    staged += dstaged;
    let mut all = [Seg {
        ptr: std::ptr::null_mut(),
        len: 0,
    }; MAX_RECV_IOV];
    let mut n = 0;
    for s in segs[..nseg].iter().filter(|s| s.len > 0) {
        all[n] = *s;
        n += 1;
    }
    if dlen > dstaged {
        all[n] = Seg {
            ptr: ddgst[dstaged..].as_mut_ptr(),
            len: dlen - dstaged,
        };
        n += 1;
    }
    let must = len + dlen - staged;
    let mut next = 0;
    if st.avail() == 0 && must > 0 {
        // Room for the next header right behind the data: one recvmsg
        // carries this payload and the next PDU's header.
        st.pos = 0;
        st.have = 0;
        all[n] = Seg {
            ptr: st.buf.as_mut_ptr(),
            len: hdr_exact,
        };
        n += 1;
        next = hdr_exact;
    }
    if must > 0 {
        // SAFETY: the data segments are the I/O's buffers (valid until it
        // completes, which is after this call); the rest are ours.
        let (got, _) = unsafe { recv::recv_at_least(fd, &all[..n], must) }.await?;
        if next > 0 {
            st.have = got - must;
        }
    }
    let mut res = Ok(());
    if l.ddgst {
        let want = u32::from_le_bytes(ddgst);
        let mut c = 0u32;
        let mut first = true;
        let cmds = qp.cmds.borrow();
        let mut segs2 = [Seg {
            ptr: std::ptr::null_mut(),
            len: 0,
        }; MAX_RECV_IOV];
        // SAFETY: as above; the data is complete now.
        let k = unsafe { cmds[cid as usize].segs(off, len, &mut segs2) };
        for s in &segs2[..k] {
            // SAFETY: received bytes of the I/O's buffer.
            let b = unsafe { std::slice::from_raw_parts(s.ptr, s.len) };
            c = if first { crc(b) } else { crc_append(c, b) };
            first = false;
        }
        if c != want {
            res = Err(BdevError::Io(libc::EIO));
            qp.cmds.borrow_mut()[cid as usize].err = Some(BdevError::Io(libc::EIO));
        }
    }
    if l.flags & flags::SUCCESS != 0 {
        // LAST_PDU too: c2h_check.
        qp.complete(cid, res);
    }
    Ok(())
}

/// Encodes queued commands and data into `g`; false when the front item
/// did not fit (the group is full).
fn encode(qp: &Qp, g: &mut PduGroup, cmds_in_group: &mut u32) -> bool {
    let dg = qp.dg.get();
    let Some(item) = qp.out.borrow().front().copied() else {
        return true;
    };
    let cpda = qp.cpda.get();
    let cmds = qp.cmds.borrow();
    let mut h = [0u8; MAX_PADDED_HDR];
    match item {
        Out::Cmd(cid) => {
            let c = &cmds[cid as usize];
            if c.io.is_none() {
                qp.out.borrow_mut().pop_front();
                return true;
            }
            let mut sqe = Sqe::default();
            sqe.set_cid(cid).set_nsid(qp.nsid).set_sgl_psdt();
            let mut icd = 0usize;
            match c.kind {
                IoType::Read => {
                    sqe.set_opcode(io::READ)
                        .set_slba(c.slba)
                        .set_cdw(12, c.nlb - 1);
                    sqe.set_sgl(SglDesc::transport(c.len));
                }
                IoType::Write => {
                    sqe.set_opcode(io::WRITE)
                        .set_slba(c.slba)
                        .set_cdw(12, c.nlb - 1);
                    if c.in_capsule {
                        sqe.set_sgl(SglDesc::in_capsule(c.len));
                        icd = c.len as usize;
                    } else {
                        sqe.set_sgl(SglDesc::transport(c.len));
                    }
                }
                IoType::Flush => {
                    sqe.set_opcode(io::FLUSH);
                }
                IoType::WriteZeroes => {
                    sqe.set_opcode(io::WRITE_ZEROES)
                        .set_slba(c.slba)
                        .set_cdw(12, c.nlb - 1);
                }
                IoType::Unmap => {
                    // DSM, one range, attribute deallocate.
                    sqe.set_opcode(io::DSM).set_cdw(10, 0).set_cdw(11, 1 << 2);
                    sqe.set_sgl(SglDesc::in_capsule(16));
                    icd = 16;
                }
                IoType::Reset => unreachable!("completed at submit"),
            }
            let nseg = if c.kind == IoType::Write && icd > 0 {
                c.iovcnt
            } else {
                0
            };
            // Header with digest, padding up to the data (CPDA 0: none).
            let hl = if icd > 0 {
                data_pdo(CAPSULE_CMD_HLEN + DIGEST_LEN, cpda)
            } else {
                CAPSULE_CMD_HLEN + DIGEST_LEN
            };
            if !g.fits(hl + icd.min(16) + DIGEST_LEN, 3, nseg) {
                return false;
            }
            let n = encode_capsule_cmd_pda(&mut h, &sqe, dg, icd, cpda);
            g.push_bytes(&h[..n]);
            if c.kind == IoType::Unmap {
                g.push_bytes(&c.dsm);
                if dg.data {
                    g.push_bytes(&crc(&c.dsm).to_le_bytes());
                }
            } else if icd > 0 {
                let mut d = 0u32;
                // SAFETY: the command holds its I/O, whose buffers stay
                // valid and unchanged until it completes — after the
                // controller answered, so after this group was sent.
                for (i, v) in unsafe { c.iovecs() }.iter().enumerate() {
                    unsafe { g.push_raw(v.iov_base as *const u8, v.iov_len) };
                    if dg.data {
                        let b = unsafe {
                            std::slice::from_raw_parts(v.iov_base as *const u8, v.iov_len)
                        };
                        d = if i == 0 { crc(b) } else { crc_append(d, b) };
                    }
                }
                if dg.data {
                    g.push_bytes(&d.to_le_bytes());
                }
            }
            g.end_pdu(false);
            *cmds_in_group += 1;
            qp.out.borrow_mut().pop_front();
            true
        }
        Out::H2C {
            cid,
            ttag,
            off,
            end,
        } => {
            let c = &cmds[cid as usize];
            if c.io.is_none() {
                qp.out.borrow_mut().pop_front();
                return true;
            }
            let chunk = (end - off).min(qp.maxh2c.get());
            let mut segs = [Seg {
                ptr: std::ptr::null_mut(),
                len: 0,
            }; MAX_RECV_IOV];
            // SAFETY: the command holds its I/O.
            let k = unsafe { c.segs(off as usize, chunk as usize, &mut segs) }.min(MAX_PDU_SEGS);
            let chunk: usize = segs[..k].iter().map(|s| s.len).sum();
            if !g.fits(data_pdo(DATA_HLEN + DIGEST_LEN, cpda) + DIGEST_LEN, 2, k) {
                return false;
            }
            let last = off as usize + chunk == end as usize;
            let dh = DataHdr {
                cccid: cid,
                ttag,
                offset: off,
                length: chunk as u32,
            };
            let fl = if last { flags::LAST_PDU } else { 0 };
            let n = encode_data_hdr_pda(&mut h, PduType::H2CData, &dh, fl, dg, cpda);
            g.push_bytes(&h[..n]);
            let mut d = 0u32;
            for (i, s) in segs[..k].iter().enumerate() {
                // SAFETY: as for in-capsule data above.
                unsafe { g.push_raw(s.ptr, s.len) };
                if dg.data {
                    let b = unsafe { std::slice::from_raw_parts(s.ptr as *const u8, s.len) };
                    d = if i == 0 { crc(b) } else { crc_append(d, b) };
                }
            }
            if dg.data {
                g.push_bytes(&d.to_le_bytes());
            }
            // The controller waits for this data: do not hold it back.
            g.end_pdu(true);
            let mut out = qp.out.borrow_mut();
            if last {
                out.pop_front();
            } else if let Some(Out::H2C { off: o, .. }) = out.front_mut() {
                *o += chunk as u32;
            }
            true
        }
    }
}

/// Sends queued capsules and data through the coalescer.
async fn sender(qp: Rc<Qp>, fd: RawFd) {
    let mut group = PduGroup::new();
    let mut deadline: Option<u64> = None;
    loop {
        let timer_fired = {
            let mut sleep = deadline.map(ustor_runtime::sleep_until);
            poll_fn(|cx| {
                if qp.state.get() != QpState::Live || !qp.out.borrow().is_empty() {
                    return Poll::Ready(false);
                }
                if let Some(s) = sleep.as_mut() {
                    if Pin::new(s).poll(cx).is_ready() {
                        return Poll::Ready(true);
                    }
                }
                *qp.sender_w.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            })
            .await
        };
        if qp.state.get() != QpState::Live {
            break;
        }
        let mut cmds_in_group = 0;
        let mut full = false;
        // Budget: the queue holds at most 2 * depth items and each pass
        // either encodes one or stops.
        for _ in 0..(4 * qp.depth as usize + 8) {
            if qp.out.borrow().is_empty() {
                break;
            }
            if !encode(&qp, &mut group, &mut cmds_in_group) {
                full = true;
                break;
            }
        }
        if group.is_empty() {
            continue;
        }
        // Others in flight: commands already sent may complete and make the
        // application submit more, which could join this group.
        let others = qp.active.get().saturating_sub(cmds_in_group);
        let Some(why) = qp.coal.borrow().flush_reason(
            &group,
            full,
            timer_fired,
            others,
            group.urgent(),
            &mut deadline,
        ) else {
            continue;
        };
        let pdus = group.pdus();
        qp.coal.borrow_mut().on_flush(why, pdus, others);
        record(&qp);
        group = match flush(&qp, fd, group).await {
            Some(g) => g,
            None => break,
        };
    }
    qp.sender_running.set(false);
    wake(&qp.driver_w);
}

fn record(qp: &Qp) {
    let s = qp.coal.borrow().stats();
    let c = &qp.counters;
    c.groups.store(s.groups, Ordering::Relaxed);
    c.pdus.store(s.pdus, Ordering::Relaxed);
    c.full_groups.store(s.full_groups, Ordering::Relaxed);
    c.small_groups.store(s.small_groups, Ordering::Relaxed);
    c.timer_expiries.store(s.timer_expiries, Ordering::Relaxed);
    c.degree.store(u64::from(s.degree), Ordering::Relaxed);
    c.timer_us.store(u64::from(s.timer_us), Ordering::Relaxed);
    c.raises.store(s.raises, Ordering::Relaxed);
    c.lowers.store(s.lowers, Ordering::Relaxed);
}

/// Sends the whole group; `None` when the connection failed.
async fn flush(qp: &Qp, fd: RawFd, group: PduGroup) -> Option<PduGroup> {
    let mut calls = 0;
    let (r, group) = group.send_all(fd, &mut calls).await;
    bump(&qp.counters.sendmsg_calls, calls);
    if r.is_err() {
        if qp.state.get() == QpState::Live {
            qp.state.set(QpState::Down);
        }
        recv::shutdown(fd);
        return None;
    }
    Some(group)
}
