//! One session on one reactor, and what its reactors share. A session's
//! connections (MC/S) run on the reactors the listener placed them on:
//! each reactor with connections of the session holds one part ([`Sess`]:
//! its task set, its LUN table on that reactor's channels, its
//! connections), and every part shares the session's [`Window`]
//! (ExpCmdSN/MaxCmdSN in atomics: commands are admitted in CmdSN order
//! whichever connection and reactor carries them) and, in a session that
//! may have several connections, its [`Gate`] (the task attributes'
//! order across parts). With ErrorRecoveryLevel 0 (all we offer) a
//! connection that fails ends the session: every part ends, every
//! connection is closed and every task aborted (session recovery, RFC
//! 7143 §7.1.4.3); one that logs out or is replaced by a login with its
//! CID (connection reinstatement, §6.3.4) leaves alone, its tasks aborted
//! silently.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet};
use std::future::poll_fn;
use std::rc::{Rc, Weak};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use ustor_scsi_target::LunTable;

use crate::exec::Core;
use crate::sessions::{LocalGuard, SessionCtl};
use crate::tasks::TaskSet;

/// A sequence number every reactor of the session reads and writes.
#[derive(Debug, Default)]
pub struct SeqNo(AtomicU32);

impl SeqNo {
    pub fn get(&self) -> u32 {
        self.0.load(Ordering::Acquire)
    }

    pub fn set(&self, v: u32) {
        self.0.store(v, Ordering::Release)
    }
}

/// The session's command window (ExpCmdSN, MaxCmdSN), stamped on every
/// connection's responses, and the commands waiting for their turn.
#[derive(Debug, Default)]
pub struct Window {
    pub exp: SeqNo,
    pub max: SeqNo,
    /// Set when the session ends.
    ended: AtomicBool,
    /// Commands that came ahead of their turn, on any reactor; `waiting`
    /// counts them so that admitting a command takes no lock when none
    /// waits.
    waiting: AtomicUsize,
    order: Mutex<Vec<Waker>>,
    /// Connection serials, unique within the session.
    next_conn: AtomicU64,
    /// The task order across parts (a session that may have several
    /// connections).
    pub gate: Option<Gate>,
}

impl Window {
    /// A session's window from `exp_cmdsn`, `queue_depth` commands wide;
    /// `several`: it may have several connections (a gate orders its
    /// tasks across reactors).
    pub fn new(exp_cmdsn: u32, queue_depth: u32, several: bool) -> Arc<Window> {
        let w = Window {
            gate: several.then(Gate::default),
            ..Window::default()
        };
        w.exp.set(exp_cmdsn);
        w.max.set(exp_cmdsn.wrapping_add(queue_depth.max(1) - 1));
        Arc::new(w)
    }

    /// Admits `cmdsn` as the next command: ExpCmdSN moves past it, if it
    /// is still ExpCmdSN (a CmdSN sent twice is admitted once).
    pub fn advance(&self, cmdsn: u32) -> bool {
        let next = cmdsn.wrapping_add(1);
        let ok = self
            .exp
            .0
            .compare_exchange(cmdsn, next, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if ok {
            self.wake_order();
        }
        ok
    }

    /// One slot of the window is free again (MaxCmdSN moves on).
    pub fn credit(&self) {
        self.max.0.fetch_add(1, Ordering::AcqRel);
    }

    pub fn ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    fn end(&self) {
        self.ended.store(true, Ordering::Release);
        self.wake_order();
    }

    fn lock_order(&self) -> MutexGuard<'_, Vec<Waker>> {
        self.order.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wake_order(&self) {
        // SeqCst pairs with `turn`: a waiter counted before our store of
        // ExpCmdSN is woken here, one counted after it sees the store.
        if self.waiting.load(Ordering::SeqCst) == 0 {
            return;
        }
        let w = std::mem::take(&mut *self.lock_order());
        w.into_iter().for_each(Waker::wake);
    }

    /// Waits until ExpCmdSN reaches `cmdsn` (a command that came on one
    /// connection ahead of one sent before it on another); `false` if the
    /// session ends first.
    pub async fn turn(&self, cmdsn: u32) -> bool {
        /// Counts the waiter while it waits (also when its wait is dropped).
        struct Counted<'a>(&'a AtomicUsize);
        impl Drop for Counted<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let _counted = Counted(&self.waiting);
        poll_fn(|cx| {
            let ready = |w: &Window| {
                if w.ended() {
                    Some(false)
                } else if w.exp.0.load(Ordering::SeqCst) == cmdsn {
                    Some(true)
                } else {
                    None
                }
            };
            if let Some(v) = ready(self) {
                return Poll::Ready(v);
            }
            self.lock_order().push(cx.waker().clone());
            // Checked again once the waker is in: an advance between the
            // first check and the push would otherwise be missed.
            match ready(self) {
                Some(v) => Poll::Ready(v),
                None => Poll::Pending,
            }
        })
        .await
    }

    /// A serial number for a new connection (its tasks carry it).
    pub fn conn_serial(&self) -> u64 {
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }
}

/// SAM task order across the parts of a session: every task enters in
/// admission (CmdSN) order; a SIMPLE task starts unless an earlier
/// ORDERED one is still in, an ORDERED one once every earlier task has
/// left. A SIMPLE task takes the lock twice (enter, leave) and skips it
/// to start while no ORDERED task is in.
#[derive(Debug, Default)]
pub struct Gate {
    st: Mutex<GateState>,
    ordered: AtomicUsize,
}

#[derive(Debug, Default)]
struct GateState {
    next: u64,
    live: BTreeMap<u64, bool>,
    ordered: BTreeSet<u64>,
    waiters: Vec<Waker>,
}

impl Gate {
    fn lock(&self) -> MutexGuard<'_, GateState> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new task's place in the order.
    pub fn enter(&self, ordered: bool) -> u64 {
        let mut g = self.lock();
        let seq = g.next;
        g.next += 1;
        g.live.insert(seq, ordered);
        if ordered {
            g.ordered.insert(seq);
            self.ordered.fetch_add(1, Ordering::AcqRel);
        }
        seq
    }

    /// Whether task `seq` may start now; if not, `cx` is woken when a
    /// task leaves.
    pub fn ready(&self, seq: u64, ordered: bool, cx: &Context<'_>) -> bool {
        if !ordered && self.ordered.load(Ordering::Acquire) == 0 {
            return true;
        }
        let mut g = self.lock();
        let ok = if ordered {
            g.live.keys().next().map_or(true, |first| *first >= seq)
        } else {
            g.ordered.iter().next().map_or(true, |first| *first >= seq)
        };
        if !ok {
            g.waiters.push(cx.waker().clone());
        }
        ok
    }

    /// Task `seq` has ended.
    pub fn leave(&self, seq: u64) {
        let w = {
            let mut g = self.lock();
            if g.live.remove(&seq) == Some(true) {
                g.ordered.remove(&seq);
                self.ordered.fetch_sub(1, Ordering::AcqRel);
            }
            std::mem::take(&mut g.waiters)
        };
        w.into_iter().for_each(Waker::wake);
    }
}

/// How a connection leaves its session.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Leave {
    /// It failed (or the session ended): at ERL 0 the session ends.
    #[default]
    Failed,
    /// It logged out (close connection): the session goes on.
    LoggedOut,
    /// A login with its CID replaced it: the session goes on, the CID
    /// belongs to the new connection.
    Replaced,
}

/// A session's part on one reactor.
pub struct Sess {
    pub window: Arc<Window>,
    pub tasks: TaskSet,
    /// Dropped before `guard`: a reinstating session with the same I_T
    /// nexus only starts once this one's reservations are detached.
    pub table: LunTable,
    conns: RefCell<Vec<Weak<Core>>>,
    ending: Cell<bool>,
    pub ctl: Option<Arc<SessionCtl>>,
    /// Lists the part on its reactor and keeps the session registered.
    pub(crate) guard: RefCell<Option<LocalGuard>>,
}

impl Sess {
    pub fn new(table: LunTable, ctl: Option<Arc<SessionCtl>>, window: Arc<Window>) -> Rc<Sess> {
        Rc::new(Sess {
            window,
            tasks: TaskSet::default(),
            table,
            conns: RefCell::default(),
            ending: Cell::new(false),
            ctl,
            guard: RefCell::default(),
        })
    }

    /// A serial number for a new connection (its tasks carry it).
    pub fn conn_serial(&self) -> u64 {
        self.window.conn_serial()
    }

    /// Whether this part still takes connections.
    pub fn open(&self) -> bool {
        !self.ending.get() && !self.window.ended()
    }

    /// The session's connections, on every reactor.
    pub fn connections(&self) -> usize {
        match &self.ctl {
            Some(c) => c.connections(),
            None => self.conns.borrow().len(),
        }
    }

    /// A connection joins; one with the same CID is replaced first.
    pub fn attach(&self, core: &Rc<Core>) {
        self.close_cid(core.cid, Leave::Replaced);
        self.conns.borrow_mut().push(Rc::downgrade(core));
    }

    /// Closes the connection `cid` if it is on this part (its tasks
    /// aborted, nothing more sent on it); the serials of the connections
    /// closed.
    pub fn close_cid(&self, cid: u16, how: Leave) -> Vec<u64> {
        let old: Vec<Rc<Core>> = self
            .conns
            .borrow()
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|c| c.cid == cid)
            .collect();
        for c in &old {
            self.set_leave(c, how);
            let serial = c.serial;
            self.tasks.abort(|t| t.conn == serial);
            c.tx.close();
        }
        old.iter().map(|c| c.serial).collect()
    }

    /// How connection `c` leaves; one that logs out gives its CID back at
    /// once (before the Logout Response), so a new login may take it.
    pub fn set_leave(&self, c: &Core, how: Leave) {
        c.leave.set(how);
        if let (Some(ctl), Leave::LoggedOut) = (&self.ctl, how) {
            ctl.release(c.cid);
        }
    }

    /// Ends the session on this part: every connection here closed, every
    /// task here aborted (the other parts are told by the caller).
    pub fn end(&self) {
        self.ending.set(true);
        self.window.end();
        self.tasks.abort(|_| true);
        let conns: Vec<Rc<Core>> = self
            .conns
            .borrow()
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for c in conns {
            c.tx.close();
        }
    }

    /// A connection's end, once its tasks have ended. A failed one ends
    /// the session (ERL 0); once a part's last connection has left it
    /// takes no more (its registration goes when the last reference
    /// does).
    pub fn leave(&self, core: &Core) {
        let how = core.leave.get();
        if how == Leave::Failed && !self.ending.get() {
            self.end();
        }
        self.conns
            .borrow_mut()
            .retain(|w| w.upgrade().is_some_and(|c| c.serial != core.serial));
        if self.conns.borrow().is_empty() {
            self.ending.set(true);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Noop;

    impl std::task::Wake for Noop {
        fn wake(self: Arc<Self>) {}
    }

    #[test]
    fn the_gate_keeps_ordered_tasks_in_order() {
        let g = Gate::default();
        let waker = Waker::from(Arc::new(Noop));
        let cx = Context::from_waker(&waker);
        let (s0, o1, s2) = (g.enter(false), g.enter(true), g.enter(false));
        assert!(g.ready(s0, false, &cx));
        assert!(!g.ready(o1, true, &cx), "ORDERED passed an earlier task");
        assert!(!g.ready(s2, false, &cx), "SIMPLE passed an earlier ORDERED");
        g.leave(s0);
        assert!(g.ready(o1, true, &cx));
        assert!(!g.ready(s2, false, &cx));
        g.leave(o1);
        assert!(g.ready(s2, false, &cx));
        let o3 = g.enter(true);
        assert!(!g.ready(o3, true, &cx));
        // A SIMPLE task after an ORDERED one that has left starts at once.
        g.leave(s2);
        assert!(g.ready(o3, true, &cx));
        g.leave(o3);
        let s4 = g.enter(false);
        assert!(g.ready(s4, false, &cx));
    }

    #[test]
    fn the_window_admits_each_cmdsn_once_across_the_wrap() {
        let w = Window::new(u32::MAX, 4, true);
        assert_eq!(w.max.get(), 2);
        assert!(!w.advance(0), "ahead of ExpCmdSN");
        assert!(w.advance(u32::MAX));
        assert!(!w.advance(u32::MAX), "admitted twice");
        assert_eq!(w.exp.get(), 0);
        w.credit();
        assert_eq!(w.max.get(), 3);
        assert!(w.gate.is_some());
    }
}
