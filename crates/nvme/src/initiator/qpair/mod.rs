//! One NVMe/TCP I/O queue pair on one reactor.
//!
//! Commands take CIDs from a table preallocated at channel creation (CID =
//! slot index); I/O beyond the queue depth, or issued while the connection
//! is down, waits in a FIFO bounded by the bdev layer's I/O table. The
//! queue's task connects (after the controller's admin queue is up) and
//! runs each connection on the connection layer's driver
//! (`ustor_net::driver`, as a client: commands are sent with
//! `Conn::send`, the controller's PDUs complete them); once the driver
//! returned nothing touches the I/O buffers, so every unfinished command is
//! requeued for the next connection, or failed once the controller is
//! failed (ctrlr_loss_timeout_sec) or detached. Each connection starts in
//! the protocol too: the ICReq is the first thing sent, the ICResp the
//! first thing staged, the Fabrics Connect (CID `CONNECT_CID`) follows
//! it, and its response makes the queue live.
//!
//! Receive path (`rx`, `Protocol::apply`): headers are staged (many per
//! receive after capsule responses; exactly one while reads are in flight,
//! so no payload is swallowed); C2HData payload is received straight into
//! the I/O's iovecs (`Recv::Place`), together with its digest and the next
//! header in one `recvmsg`. Send path (`tx`, `Protocol::encode`): the LANoT
//! coalescer groups capsules and H2CData PDUs (answering R2Ts, queued as
//! `Recv::Interim`); write data leaves from the I/O's buffers
//! (`PduGroup::push_raw`).

mod conn;
mod rx;
mod tx;

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::Waker;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use ustor_bdev::{BdevError, IoHandle, IoType};
use ustor_net::coalesce::{CoalesceStats, Coalescer};
use ustor_net::driver;
use ustor_net::recv::Seg;
use ustor_runtime::ops;

use super::ctrlr::Ctrlr;
use crate::wire::*;
pub(crate) use conn::drive;

/// Most iovecs one receive carries: data segments, a digest, the next header.
const MAX_RECV_IOV: usize = ustor_bdev::io::MAX_SEGMENTS + 2;
const _: () = assert!(MAX_RECV_IOV <= ustor_net::recv::MAX_RECV_IOV);

/// PDUs handled per receiver pass before yielding to the reactor.
const RECV_BUDGET: u32 = 64;
/// The header of a fatal PDU quoted in the H2CTermReq, at most.
const TERM_QUOTE: usize = MAX_TERM_DATA;
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
/// The Fabrics Connect's CID: beyond every command slot (CID = index <
/// depth <= u16::MAX).
const CONNECT_CID: u16 = u16::MAX;
/// Bound on a connection's ICReq/ICResp and Fabrics Connect.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
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

/// How far a connection's start got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Handshake {
    /// The ICReq is out; waiting for the ICResp.
    IcResp,
    /// The Fabrics Connect is out; waiting for its response.
    Connect,
    /// Connected: commands flow.
    Done,
    /// The controller refused the Connect (this status).
    Refused(u16),
}

/// Something for the sender.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Out {
    /// The ICReq that starts a connection.
    IcReq,
    /// The Fabrics Connect (after the ICResp settled digests and CPDA).
    Connect,
    /// A command capsule (with in-capsule data for small writes).
    Cmd(u16),
    /// Write data the controller asked for with an R2T: [off, end).
    H2C {
        cid: u16,
        ttag: u16,
        off: u32,
        end: u32,
    },
    /// An H2CTermReq for the fatal error the receiver found (`Qp::term`).
    Term,
}

/// Where the receiver is in the controller's PDU stream.
#[derive(Clone, Copy, Debug)]
enum RxState {
    /// The ICResp is being staged.
    IcResp,
    /// The common header is being staged.
    Common,
    /// The whole header is being staged.
    Header(PduLayout),
    /// A C2HData's padding is being staged (then its data is placed).
    Pad(PduLayout, DataHdr),
    /// A C2HData's data is being placed (then it is finished).
    Data(PduLayout, DataHdr),
    /// A fatal error was queued for the controller: stop.
    Stop,
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
    /// The connection's start (ICReq/ICResp, Fabrics Connect).
    hs: Cell<Handshake>,
    /// The controller the Fabrics Connect names.
    cntlid: Cell<u16>,
    dg: Cell<Digests>,
    /// The controller's data alignment (ICResp CPDA) for data we send.
    cpda: Cell<u8>,
    maxh2c: Cell<u32>,
    icd_max: Cell<u32>,
    cmds: RefCell<Box<[Cmd]>>,
    free: RefCell<Vec<u16>>,
    pending: RefCell<VecDeque<IoHandle>>,
    /// The live connection (commands are sent on it).
    conn: RefCell<Option<Rc<driver::Conn<Link>>>>,
    rx: Cell<RxState>,
    /// The last receive was C2HData: stage the next header exactly.
    exact: Cell<bool>,
    /// The data digest of the C2HData being placed lands here.
    ddgst: Cell<[u8; DIGEST_LEN]>,
    /// The fatal error for the H2CTermReq, with the header it quotes.
    term: RefCell<(Fatal, [u8; TERM_QUOTE], usize)>,
    /// Capsules in the group being filled (LANoT's "others" leave them out).
    grp_cmds: Cell<u32>,
    /// Commands holding a CID.
    active: Cell<u32>,
    /// Reads among them: while any is in flight, headers are received
    /// exactly, so no read payload lands in the staging buffer.
    reads: Cell<u32>,
    coal: RefCell<Coalescer>,
    driver_w: RefCell<Option<Waker>>,
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
            hs: Cell::new(Handshake::IcResp),
            cntlid: Cell::new(0),
            dg: Cell::new(Digests::default()),
            cpda: Cell::new(0),
            maxh2c: Cell::new(4096),
            icd_max: Cell::new(0),
            cmds: RefCell::new((0..depth).map(|_| Cmd::empty()).collect()),
            free: RefCell::new((0..depth).rev().collect()),
            pending: RefCell::new(VecDeque::with_capacity(ustor_bdev::io::TABLE_SLOTS)),
            conn: RefCell::new(None),
            rx: Cell::new(RxState::Common),
            exact: Cell::new(false),
            ddgst: Cell::new([0; DIGEST_LEN]),
            term: RefCell::new((Fatal { fes: 0, fei: 0 }, [0; TERM_QUOTE], 0)),
            grp_cmds: Cell::new(0),
            active: Cell::new(0),
            reads: Cell::new(0),
            coal: RefCell::new(Coalescer::new(cfg)),
            driver_w: RefCell::new(None),
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
            // Not claimed (fused commands are not sent yet).
            IoType::CompareAndWrite => return io.complete(Err(BdevError::NotSupported)),
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
        self.send(Out::Cmd(cid));
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
        debug_assert!(self.conn.borrow().is_none());
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
            ustor_net::recv::shutdown(fd);
        }
        wake(&self.driver_w);
    }

    /// Queues `o` on the live connection (none: the command is sent when
    /// the next connection requeues it).
    fn send(&self, o: Out) {
        if let Some(c) = &*self.conn.borrow() {
            c.send(o);
        }
    }
}

/// The queue as the driver's protocol (an `Rc` to it: the queue outlives
/// its connections).
pub(crate) struct Link(Rc<Qp>);
