//! One NVMe/TCP queue pair (connection), owned by one reactor for its life.
//!
//! After ICReq the connection driver (`ustor_net::driver`) runs it as the
//! [`proto::Qp`] protocol; the driver's receiver, workers and sender share
//! the queue's state ([`Conn`]):
//! - the receive state machine ([`recv`], [`proto::Rx`]) tells the driver
//!   what to stage or receive: common header, rest of the header (+
//!   digest), then the payload, received straight into the pool buffer the
//!   bdev writes from; for each command ([`capsule`]) it asks for an R2T
//!   (`Recv::Interim`) for writes whose data was not in the capsule and
//!   matches H2CData PDUs to them by transfer tag (the command slot's
//!   index); it parks the driver's receiver while no [`slots`] entry is
//!   free;
//! - the driver's workers (one per slot, started with the driver) execute
//!   commands ([`exec`]): Fabrics ([`connect`]), admin ([`admin_queue`] for
//!   AER and Abort, `nvmf::admin` for the rest), I/O;
//! - the driver's sender encodes answers ([`send`]) into the PDU Group and
//!   flushes it as the queue's own LANoT coalescer decides.
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

mod admin_queue;
mod capsule;
mod connect;
mod exec;
mod fused;
mod proto;
mod recv;
mod send;
mod slots;

use std::cell::{Cell, RefCell};
use std::os::fd::{AsRawFd, RawFd};
use std::rc::{Rc, Weak};
use std::sync::Arc;

use ustor_bdev::IoChannel;
use ustor_net::coalesce::Coalescer;
use ustor_net::driver;
use ustor_net::{Accepted, ConnGuard};
use ustor_runtime::IoBuf;

use super::ctrlr::{Ctrl, HostIo};
use super::stats::{self, inc};
use super::subsystem::{ListenAddress, Namespace};
use super::{Shared, TransportOpts};
use crate::wire::*;
use proto::{Qp, Rx};
use slots::{Slot, SLOTS};

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
    /// The offending header (at most `MAX_TERM_DATA` bytes) is boxed: a
    /// fatal error is rare, and an inline array would make every `Out`
    /// (moved through the driver's queues per command) ~150 bytes.
    Term {
        fes: u16,
        fei: u32,
        hdr: Box<[u8]>,
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
    /// The socket (owned by the driver while the queue runs).
    fd: RawFd,
    /// Counts the connection against the target's cap while it exists.
    _guard: ConnGuard,
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
    /// The driver running this queue, for replies that answer a command
    /// outside the receiver and the workers (an Abort from another queue).
    driver: RefCell<Weak<driver::Conn<Qp>>>,
    /// Where the receive state machine stands, and the header it holds.
    rx: RefCell<Rx>,
    hdr: RefCell<[u8; MAX_HDR_LEN]>,
    /// Headers are read exactly (a large payload may follow).
    exact: Cell<bool>,
    /// A termination request was encoded: the socket ends once it is sent.
    term_sent: Cell<bool>,
    /// Commands queued or running (not AERs, not those awaiting H2CData).
    executing: Cell<usize>,
    closing: Cell<bool>,
    coal: Rc<RefCell<Coalescer>>,
    /// R2Ts whose data is still due.
    r2t_out: Cell<u32>,
    /// Of those, the R2Ts for more than [`staging::COPY_MAX`] bytes: while
    /// any is due, headers are read exactly, so its data lands in its own
    /// buffer rather than in a greedy receive that would then be copied.
    r2t_big_out: Cell<u32>,
    /// CID of the capsule the receiver holds while it waits for a slot, and
    /// whether an Abort named it meanwhile.
    slot_wait: Cell<Option<u16>>,
    slot_wait_aborted: Cell<bool>,
    /// A fused first command (Compare) whose second has not arrived yet.
    fused_open: RefCell<Option<Rc<fused::Pair>>>,
}

/// Serves one accepted socket until it closes. Nothing is allocated for
/// it (staging, slots, queues) until its ICReq came in time and was good.
pub(crate) async fn serve(acc: Accepted, shared: Arc<Shared>, listen: ListenAddress) {
    let opts = shared.opts();
    let ic = acc
        .handshake(recv::initialize(acc.fd.as_raw_fd(), &opts))
        .await;
    let Some(Ok(ic)) = ic else {
        return;
    };
    let limit = acc.handshake_timeout();
    let Accepted { fd, guard, .. } = acc;
    let conn = Rc::new(Conn::new(fd.as_raw_fd(), guard, shared, listen, opts));
    // Keep-alive starts at Connect: until then the handshake timeout runs.
    ustor_runtime::spawn(connect::connect_watch(Rc::downgrade(&conn), limit));
    conn.dg.set(ic.digests);
    conn.hpda.set(ic.hpda);
    let live: Weak<dyn stats::LiveQueue> = Rc::downgrade(&conn) as Weak<dyn stats::LiveQueue>;
    stats::with(|c| c.live.borrow_mut().push(live));
    // The driver's connection owns the socket: held here until `finish`
    // has unregistered the queue, so a controller's `shutdown_queues` (an
    // RPC thread, another reactor) never reaches a descriptor number that
    // was closed and handed to someone else meanwhile.
    let driven = driver::start(fd, Qp(conn.clone()), proto::driver_config());
    driver::serve(driven.clone()).await;
    conn.finish();
    drop(driven);
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
    fn new(
        fd: RawFd,
        guard: ConnGuard,
        shared: Arc<Shared>,
        listen: ListenAddress,
        opts: TransportOpts,
    ) -> Conn {
        let coal = Rc::new(RefCell::new(Coalescer::new(opts.coalesce)));
        Conn {
            fd,
            _guard: guard,
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
            slots: RefCell::new((0..SLOTS).map(|_| Slot::new()).collect()),
            free: RefCell::new((0..SLOTS as u16).rev().collect()),
            driver: RefCell::new(Weak::new()),
            rx: RefCell::new(Rx::Idle),
            hdr: RefCell::new([0; MAX_HDR_LEN]),
            exact: Cell::new(true),
            term_sent: Cell::new(false),
            executing: Cell::new(0),
            closing: Cell::new(false),
            coal,
            r2t_out: Cell::new(0),
            r2t_big_out: Cell::new(0),
            slot_wait: Cell::new(None),
            slot_wait_aborted: Cell::new(false),
            fused_open: RefCell::new(None),
        }
    }

    fn raw(&self) -> RawFd {
        self.fd
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

    /// Queues a reply for a command answered outside the receiver and the
    /// workers (an Abort from another queue).
    fn push_out(&self, o: Out) {
        if let Some(d) = self.driver.borrow().upgrade() {
            d.reply(o);
        }
    }

    fn term_out(&self, f: Fatal, hdr: &[u8]) -> Out {
        let n = hdr.len().min(MAX_TERM_DATA);
        stats::with(|c| inc(&c.term_sent, 1));
        Out::Term {
            fes: f.fes,
            fei: f.fei,
            hdr: hdr[..n].into(),
        }
    }

    fn cqe(&self, cid: u16, status: Status) -> Cqe {
        let mut c = Cqe::new(cid, status);
        c.sqid = self.qid.get().unwrap_or(0);
        c.sqhd = self.sqhd.get();
        c
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
            admin_queue::unregister(ctrl, qid);
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
    }
}
