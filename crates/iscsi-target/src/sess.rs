//! One session on its reactor, shared by its connections (MC/S): the
//! command window (ExpCmdSN/MaxCmdSN, session-wide: commands are admitted
//! in CmdSN order whichever connection carries them), the task set, the
//! LUN table (the I_T nexus), and the connections themselves. With
//! ErrorRecoveryLevel 0 (all we offer) a connection that fails ends the
//! session: every connection is closed and every task aborted (session
//! recovery, RFC 7143 §7.1.4.3); one that logs out or is replaced by a
//! login with its CID (connection reinstatement, §6.3.4) leaves alone,
//! its tasks aborted silently.

use std::cell::{Cell, RefCell};
use std::future::poll_fn;
use std::rc::{Rc, Weak};
use std::task::{Poll, Waker};

use ustor_scsi_target::LunTable;

use crate::exec::Core;
use crate::sessions::{LocalGuard, SessionCtl};
use crate::tasks::TaskSet;

/// ExpCmdSN and MaxCmdSN, stamped on every connection's responses.
#[derive(Debug, Default)]
pub struct Window {
    pub exp: Cell<u32>,
    pub max: Cell<u32>,
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

/// A session's state on its reactor.
pub struct Sess {
    pub window: Rc<Window>,
    pub tasks: TaskSet,
    /// Dropped before `guard`: a reinstating session with the same I_T
    /// nexus only starts once this one's reservations are detached.
    pub table: LunTable,
    conns: RefCell<Vec<Weak<Core>>>,
    ending: Cell<bool>,
    next_conn: Cell<u64>,
    /// Woken when ExpCmdSN moves or the session ends.
    order: RefCell<Vec<Waker>>,
    /// Keeps the session for a connection on its way to replace one
    /// (connection reinstatement), even when no connection is left.
    holds: RefCell<Vec<Rc<Sess>>>,
    pub ctl: Option<std::sync::Arc<SessionCtl>>,
    /// Lists the session on its reactor; its drop signals the end.
    pub(crate) guard: RefCell<Option<LocalGuard>>,
}

impl Sess {
    pub fn new(
        table: LunTable,
        ctl: Option<std::sync::Arc<SessionCtl>>,
        exp_cmdsn: u32,
        queue_depth: u32,
    ) -> Rc<Sess> {
        let window = Window {
            exp: Cell::new(exp_cmdsn),
            max: Cell::new(exp_cmdsn.wrapping_add(queue_depth.max(1) - 1)),
        };
        Rc::new(Sess {
            window: Rc::new(window),
            tasks: TaskSet::default(),
            table,
            conns: RefCell::default(),
            ending: Cell::new(false),
            next_conn: Cell::new(0),
            order: RefCell::default(),
            holds: RefCell::default(),
            ctl,
            guard: RefCell::default(),
        })
    }

    /// A serial number for a new connection (its tasks carry it).
    pub fn conn_serial(&self) -> u64 {
        let n = self.next_conn.get();
        self.next_conn.set(n + 1);
        n
    }

    /// Whether the session still takes connections.
    pub fn open(&self) -> bool {
        !self.ending.get()
    }

    pub fn connections(&self) -> usize {
        self.conns.borrow().len()
    }

    /// A connection joins; one with the same CID is replaced first.
    pub fn attach(&self, core: &Rc<Core>) {
        self.close_cid(core.cid, Leave::Replaced);
        self.conns.borrow_mut().push(Rc::downgrade(core));
    }

    /// Closes the connection `cid` (its tasks aborted, nothing more sent
    /// on it); the serials of the connections closed (none: no such CID).
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

    /// Keeps the session for a connection that replaces one of its own
    /// and is on its way here ([`Sess::unhold`] once it is attached).
    pub fn hold(self: &Rc<Self>) {
        self.holds.borrow_mut().push(self.clone());
    }

    pub fn unhold(&self) {
        let held = self.holds.borrow_mut().pop();
        drop(held);
    }

    /// Ends the session: every connection closed, every task aborted.
    pub fn end(&self) {
        self.ending.set(true);
        let held = std::mem::take(&mut *self.holds.borrow_mut());
        drop(held);
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
        self.wake_order();
    }

    /// A connection's end, once its tasks have ended. A failed one ends
    /// the session (ERL 0); once the last one has left the session takes
    /// no more (its registration goes when the last reference does).
    pub fn leave(&self, core: &Core) {
        let how = core.leave.get();
        if how == Leave::Failed && !self.ending.get() {
            self.end();
        }
        self.conns
            .borrow_mut()
            .retain(|w| w.upgrade().is_some_and(|c| c.serial != core.serial));
        if self.conns.borrow().is_empty() && self.holds.borrow().is_empty() {
            self.ending.set(true);
        }
        self.wake_order();
    }

    /// Admits `cmdsn` as the next command: ExpCmdSN moves past it.
    pub fn advance(&self, cmdsn: u32) {
        self.window.exp.set(cmdsn.wrapping_add(1));
        self.wake_order();
    }

    fn wake_order(&self) {
        let w = std::mem::take(&mut *self.order.borrow_mut());
        w.into_iter().for_each(Waker::wake);
    }

    /// Waits until ExpCmdSN reaches `cmdsn` (a command that came on one
    /// connection ahead of one sent before it on another); `false` if the
    /// session ends first.
    pub async fn turn(&self, cmdsn: u32) -> bool {
        poll_fn(|cx| {
            if self.ending.get() {
                return Poll::Ready(false);
            }
            if self.window.exp.get() == cmdsn {
                return Poll::Ready(true);
            }
            self.order.borrow_mut().push(cx.waker().clone());
            Poll::Pending
        })
        .await
    }
}
