//! A controller: what one host's admin queue created with Connect, shared
//! by that host's queue pairs (on any reactor). Holds the properties (CAP,
//! VS, CC, CSTS), features, keep-alive deadline, asynchronous events and
//! the sockets and reactors of its queues (so a KATO expiry, a reset or a
//! shutdown can close them, and Abort can find the queue's reactor). Only
//! admin commands and Connect touch its mutexes; I/O never does.
//!
//! CC.EN 1 -> 0 and CC.SHN are a controller reset / shutdown: the I/O
//! queues' sockets are shut down (each connection then ends on its own
//! reactor once its in-flight commands completed, dropping its buffers),
//! and CSTS only reports the end (RDY = 0, SHST = complete) once no I/O
//! queue is left, so a host that waits for it can connect new I/O queues
//! with the same ids.

use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Waker;

use ustor_runtime::ticks;

use super::subsystem::Subsystem;
use crate::wire::prop;

/// Admin queue depth we accept (Linux asks for 32).
pub const MAX_AQ_DEPTH: u16 = 128;
/// I/O queue depth (CAP.MQES + 1).
pub const MAX_IO_QUEUE_DEPTH: u16 = 128;
/// Outstanding AERs a host may park (Identify AERL + 1).
pub const MAX_AERS: usize = 4;
/// CAP.TO in 500 ms units.
const CAP_TO: u64 = 30;
/// NVMe 1.3.
pub const VERSION: u32 = 0x0001_0300;

/// Asynchronous event config bit: namespace attribute notices.
pub const AEC_NS_ATTR: u32 = 1 << 8;
/// AER completion for "namespace attribute changed": type Notice (2),
/// info 0, log page 04h (changed namespace list).
pub const AEN_NS_CHANGED: u32 = 0x0004_0002;

/// CSTS.RDY.
const CSTS_RDY: u32 = 1;
/// CSTS.SHST: shutdown processing (01b) / complete (10b).
const SHST_MASK: u32 = 3 << 2;
const SHST_PROCESSING: u32 = 1 << 2;
const SHST_COMPLETE: u32 = 2 << 2;

#[derive(Default)]
pub(crate) struct Regs {
    pub cc: u32,
    pub csts: u32,
    /// A reset (CC.EN 1 -> 0) or shutdown is waiting for the I/O queues
    /// to go; CSTS reports its end.
    pub teardown: bool,
}

/// One queue of the controller: its socket (shut down to end it), the
/// reactor that owns it (where an Abort for it runs) and what its host
/// commands moved.
struct QueueRef {
    qid: u16,
    fd: RawFd,
    reactor: usize,
    io: Arc<HostIo>,
}

/// What one queue's host commands moved, for the SMART / Health log.
/// Written only by the queue's own reactor with a load and a store (no
/// read-modify-write, no lock on the I/O path); read from the admin
/// queue's reactor.
#[derive(Default)]
pub(crate) struct HostIo {
    read_cmds: AtomicU64,
    write_cmds: AtomicU64,
    read_bytes: AtomicU64,
    write_bytes: AtomicU64,
}

impl HostIo {
    /// A completed Read or Compare of `bytes` (SMART counts both as reads).
    pub(crate) fn read(&self, bytes: u64) {
        ustor_net::bump_relaxed(&self.read_cmds, 1);
        ustor_net::bump_relaxed(&self.read_bytes, bytes);
    }

    /// A completed Write of `bytes` (Write Zeroes does not count).
    pub(crate) fn write(&self, bytes: u64) {
        ustor_net::bump_relaxed(&self.write_cmds, 1);
        ustor_net::bump_relaxed(&self.write_bytes, bytes);
    }

    fn totals(&self) -> HostIoTotals {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        HostIoTotals {
            read_cmds: l(&self.read_cmds),
            write_cmds: l(&self.write_cmds),
            read_bytes: l(&self.read_bytes),
            write_bytes: l(&self.write_bytes),
        }
    }
}

/// Sums of [`HostIo`] over a controller's queues.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct HostIoTotals {
    pub read_cmds: u64,
    pub write_cmds: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
}

impl HostIoTotals {
    fn add(&mut self, o: HostIoTotals) {
        self.read_cmds += o.read_cmds;
        self.write_cmds += o.write_cmds;
        self.read_bytes += o.read_bytes;
        self.write_bytes += o.write_bytes;
    }
}

pub(crate) struct Features {
    /// Granted I/O queues (submission = completion), 1's based.
    pub num_io_queues: u16,
    pub aec: u32,
    pub vwc: bool,
    /// Error Recovery (05h) TLER, in 100 ms units (stored and reported;
    /// the bdevs have no error recovery to bound).
    pub tler: u16,
    /// Write Atomicity Normal (0Ah) DN bit.
    pub write_atomicity_dn: bool,
}

#[derive(Default)]
pub(crate) struct Aer {
    pub parked: usize,
    pub events: VecDeque<u32>,
    pub waiters: Vec<Waker>,
    /// Changed namespace list (log page 04h) since it was last read.
    pub changed_ns: Vec<u32>,
    /// A namespace notice was reported and the host has not yet cleared
    /// it (Get Log Page 04h with RAE = 0): further notices are masked.
    pub ns_masked: bool,
}

pub struct Ctrl {
    pub cntlid: u16,
    pub subsys: Arc<Subsystem>,
    pub hostnqn: String,
    pub hostid: [u8; 16],
    pub(crate) kato_ms: AtomicU32,
    last_ka: AtomicU64,
    pub(crate) regs: Mutex<Regs>,
    pub(crate) features: Mutex<Features>,
    pub(crate) aer: Mutex<Aer>,
    queues: Mutex<Vec<QueueRef>>,
    /// What the queues that are gone moved (taken after `queues`).
    io_closed: Mutex<HostIoTotals>,
    pub(crate) failed: AtomicBool,
    /// Most I/O queues the transport allows per controller.
    pub max_io_queues: u16,
    /// The listener the admin queue connected through: removing that
    /// listener disconnects the controller (SPDK's behaviour).
    pub listener: super::subsystem::ListenAddress,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Ctrl {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        cntlid: u16,
        subsys: Arc<Subsystem>,
        hostnqn: String,
        hostid: [u8; 16],
        kato_ms: u32,
        max_io_queues: u16,
        vwc: bool,
        listener: super::subsystem::ListenAddress,
    ) -> Ctrl {
        Ctrl {
            cntlid,
            subsys,
            hostnqn,
            hostid,
            kato_ms: AtomicU32::new(kato_ms),
            last_ka: AtomicU64::new(ticks::now()),
            regs: Mutex::new(Regs::default()),
            features: Mutex::new(Features {
                num_io_queues: max_io_queues,
                aec: 0,
                vwc,
                tler: 0,
                write_atomicity_dn: false,
            }),
            aer: Mutex::new(Aer::default()),
            queues: Mutex::new(Vec::new()),
            io_closed: Mutex::new(HostIoTotals::default()),
            failed: AtomicBool::new(false),
            max_io_queues,
            listener,
        }
    }

    pub fn is_discovery(&self) -> bool {
        self.subsys.subtype == super::subsystem::SubType::Discovery
    }

    /// Keep alive (or any admin command): pushes the deadline back.
    pub fn touch(&self) {
        self.last_ka.store(ticks::now(), Ordering::Relaxed);
    }

    /// Whether the keep-alive timeout ran out.
    pub fn kato_expired(&self) -> bool {
        let kato = self.kato_ms.load(Ordering::Relaxed);
        if kato == 0 {
            return false;
        }
        let idle = ticks::now().saturating_sub(self.last_ka.load(Ordering::Relaxed));
        ticks::to_ns(idle) > u64::from(kato) * 1_000_000
    }

    /// Ready for I/O queues: enabled, not being reset or shut down.
    pub fn enabled(&self) -> bool {
        let r = lock(&self.regs);
        r.csts & CSTS_RDY != 0 && !r.teardown && (r.cc >> 14) & 3 == 0
    }

    pub(crate) fn add_queue(&self, qid: u16, fd: RawFd, reactor: usize, io: Arc<HostIo>) -> bool {
        let mut q = lock(&self.queues);
        if q.iter().any(|e| e.qid == qid) || self.failed.load(Ordering::Acquire) {
            return false;
        }
        q.push(QueueRef {
            qid,
            fd,
            reactor,
            io,
        });
        true
    }

    /// Unregisters queue `qid` (its I/O is over): what it moved stays in
    /// the controller's totals.
    pub(crate) fn remove_queue(&self, qid: u16) {
        let mut q = lock(&self.queues);
        let Some(i) = q.iter().position(|e| e.qid == qid) else {
            return;
        };
        let gone = q.swap_remove(i);
        lock(&self.io_closed).add(gone.io.totals());
    }

    /// What the host's commands moved on every queue, live or gone.
    pub(crate) fn host_io(&self) -> HostIoTotals {
        let q = lock(&self.queues);
        let mut t = *lock(&self.io_closed);
        for e in q.iter() {
            t.add(e.io.totals());
        }
        t
    }

    /// The reactor that owns queue `qid`, if it is connected.
    pub(crate) fn queue_reactor(&self, qid: u16) -> Option<usize> {
        lock(&self.queues)
            .iter()
            .find(|e| e.qid == qid)
            .map(|e| e.reactor)
    }

    /// Shuts down the sockets of the queues `which` selects; each
    /// connection then ends on the reactor that owns it.
    fn shutdown_queues(&self, which: impl Fn(u16) -> bool) {
        for e in lock(&self.queues).iter().filter(|e| which(e.qid)) {
            // SAFETY: shutdown(2) on a socket the queue registered and
            // unregisters before it closes it (under this same mutex).
            unsafe { libc::shutdown(e.fd, libc::SHUT_RDWR) };
        }
    }

    /// Whether any I/O queue is connected.
    pub(crate) fn io_queues_left(&self) -> bool {
        lock(&self.queues).iter().any(|e| e.qid != 0)
    }

    /// Ends a pending reset/shutdown once the last I/O queue is gone:
    /// RDY follows CC.EN again, SHST processing becomes complete.
    fn settle(&self, r: &mut Regs) {
        if !r.teardown || self.io_queues_left() {
            return;
        }
        r.teardown = false;
        r.csts = (r.csts & !CSTS_RDY) | (r.cc & 1);
        if r.csts & SHST_MASK == SHST_PROCESSING {
            r.csts = (r.csts & !SHST_MASK) | SHST_COMPLETE;
        }
    }

    /// Fails the controller: every queue's socket is shut down, which ends
    /// its connection on whatever reactor owns it.
    pub fn fail(&self) {
        self.failed.store(true, Ordering::Release);
        self.shutdown_queues(|_| true);
        let waiters: Vec<Waker> = lock(&self.aer).waiters.drain(..).collect();
        waiters.into_iter().for_each(Waker::wake);
    }

    /// CAP: MQES, CQR, TO, CSS (NVM), MPSMIN/MAX = 4 KiB.
    pub fn cap(&self) -> u64 {
        let mqes = u64::from(MAX_IO_QUEUE_DEPTH - 1);
        mqes | 1 << 16 | CAP_TO << 24 | 1 << 37
    }

    pub fn property_get(&self, offset: u32) -> Option<u64> {
        let mut r = lock(&self.regs);
        self.settle(&mut r);
        Some(match offset {
            prop::CAP => self.cap(),
            prop::VS => u64::from(VERSION),
            prop::CC => u64::from(r.cc),
            prop::CSTS => u64::from(r.csts),
            _ => return None,
        })
    }

    /// Property Set; only CC is writable. EN 0 -> 1 sets RDY (at once, or
    /// when a pending teardown ends); EN 1 -> 0 (reset) and SHN (shutdown,
    /// SHST = processing) disconnect the I/O queues, and CSTS shows the end
    /// once they are gone (nothing to flush that the bdevs do not already
    /// hold).
    pub fn property_set(&self, offset: u32, value: u64) -> bool {
        if offset != prop::CC {
            return false;
        }
        let cc = value as u32;
        let mut r = lock(&self.regs);
        let (was_en, was_shn) = (r.cc & 1 != 0, (r.cc >> 14) & 3 != 0);
        let (en, shn) = (cc & 1 != 0, (cc >> 14) & 3 != 0);
        r.cc = cc;
        let mut teardown = false;
        if shn && !was_shn {
            r.csts = (r.csts & !SHST_MASK) | SHST_PROCESSING;
            teardown = true;
        } else if !shn {
            r.csts &= !SHST_MASK;
        }
        if was_en && !en {
            teardown = true;
        } else if en && !was_en && !r.teardown {
            r.csts |= CSTS_RDY;
        }
        if teardown {
            r.teardown = true;
            self.shutdown_queues(|qid| qid != 0);
        }
        self.settle(&mut r);
        true
    }

    /// Posts an asynchronous event (namespace added or removed).
    pub fn notify_ns_changed(&self, nsid: u32) {
        let enabled = lock(&self.features).aec & AEC_NS_ATTR != 0;
        let mut a = lock(&self.aer);
        if !a.changed_ns.contains(&nsid) && a.changed_ns.len() < 1024 {
            a.changed_ns.push(nsid);
        }
        // One outstanding notice of a type, and none once reported until
        // the host clears it by reading the log with RAE = 0 (NVMe 5.2).
        if enabled && !a.ns_masked && !a.events.contains(&AEN_NS_CHANGED) {
            a.events.push_back(AEN_NS_CHANGED);
        }
        let waiters: Vec<Waker> = a.waiters.drain(..).collect();
        drop(a);
        waiters.into_iter().for_each(Waker::wake);
    }
}
