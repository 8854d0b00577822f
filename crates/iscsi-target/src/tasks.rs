//! A session's task set: the SCSI commands running at once, on any of its
//! connections (spawned in CmdSN order by the receive loops), each with its mailbox of Data-Out
//! PDUs, its abort flag and its task attribute. SIMPLE tasks start at
//! once unless an earlier ORDERED task is still in the set; an ORDERED
//! task starts when every earlier task has ended; HEAD OF QUEUE starts at
//! once (SAM-5 §8.6). Task management finds tasks here: ABORT TASK by
//! tag, ABORT/CLEAR TASK SET and LUN RESET by LUN, target resets all; the
//! TMF answers only once the aborted tasks have ended. A session whose
//! connections may be on several reactors has a task set per reactor and
//! keeps the attributes' order across them in its gate
//! ([`crate::sess::Gate`]).

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::poll_fn;
use std::rc::Rc;
use std::task::{Poll, Waker};

use ustor_iscsi::wire::Bhs;

use crate::sess::Gate;

/// SAM task attributes as the SCSI Command PDU carries them (ATTR field);
/// the others (untagged, SIMPLE, ACA) run as SIMPLE.
pub mod attr {
    pub const ORDERED: u8 = 2;
    pub const HEAD_OF_QUEUE: u8 = 3;
}

/// One running command.
pub struct Task {
    pub itt: u32,
    pub lun: u64,
    /// The serial of the connection it came on (its allegiance).
    pub conn: u64,
    /// Spawn order (CmdSN order for non-immediate commands).
    n: u64,
    attr: u8,
    /// Takes a slot of the command window (not an immediate command).
    pub windowed: bool,
    /// Its place in the session's gate (a session of several
    /// connections: the order is kept across reactors there).
    pub gate_seq: Option<u64>,
    aborted: Cell<bool>,
    /// Its status is queued: too late to abort, task management no
    /// longer sees it.
    answered: Cell<bool>,
    /// Data-Out PDUs for this task, in arrival order.
    mailbox: RefCell<VecDeque<(Bhs, Vec<u8>)>>,
    waker: RefCell<Option<Waker>>,
}

impl Task {
    /// Whether task management (or the connection's end) aborted it: it
    /// sends nothing more.
    pub fn aborted(&self) -> bool {
        self.aborted.get()
    }

    /// Its status is about to be queued (no await until it is).
    pub fn answer(&self) {
        self.answered.set(true);
    }

    fn wake(&self) {
        if let Some(w) = self.waker.borrow_mut().take() {
            w.wake();
        }
    }

    /// The next Data-Out for this task; `None` once it is aborted.
    pub async fn next_data_out(&self) -> Option<(Bhs, Vec<u8>)> {
        poll_fn(|cx| {
            if self.aborted.get() {
                return Poll::Ready(None);
            }
            if let Some(p) = self.mailbox.borrow_mut().pop_front() {
                return Poll::Ready(Some(p));
            }
            *self.waker.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        })
        .await
    }
}

/// The tasks of one session.
#[derive(Default)]
pub struct TaskSet {
    tasks: RefCell<Vec<Rc<Task>>>,
    next: Cell<u64>,
    /// Woken whenever a task ends.
    waiters: RefCell<Vec<Waker>>,
    /// Ended tasks kept for reuse.
    free: RefCell<Vec<Rc<Task>>>,
}

/// Ended tasks a session keeps for reuse.
const KEPT_TASKS: usize = 256;
/// Data-Out PDUs a new task's mailbox has room for before it grows.
const MAILBOX: usize = 16;

impl TaskSet {
    /// Enters a new task (before it runs, so its Data-Out finds it); an
    /// ended one is reused when there is one.
    pub fn add(
        &self,
        itt: u32,
        lun: u64,
        conn: u64,
        attr: u8,
        windowed: bool,
        gate_seq: Option<u64>,
    ) -> Rc<Task> {
        let n = self.next.get();
        self.next.set(n + 1);
        let fresh = Task {
            itt,
            lun,
            conn,
            n,
            attr,
            windowed,
            gate_seq,
            aborted: Cell::new(false),
            answered: Cell::new(false),
            mailbox: RefCell::default(),
            waker: RefCell::default(),
        };
        let reused = self.free.borrow_mut().pop();
        let t = match reused {
            Some(mut t) => match Rc::get_mut(&mut t) {
                Some(slot) => {
                    // Its (empty) mailbox keeps its capacity.
                    let mailbox = std::mem::take(slot.mailbox.get_mut());
                    *slot = Task {
                        mailbox: RefCell::new(mailbox),
                        ..fresh
                    };
                    t
                }
                None => Rc::new(fresh),
            },
            None => Rc::new(Task {
                // Room for the Data-Out PDUs one greedy receive may bring.
                mailbox: RefCell::new(VecDeque::with_capacity(MAILBOX)),
                ..fresh
            }),
        };
        self.tasks.borrow_mut().push(t.clone());
        t
    }

    /// Keeps an ended task (out of the set) for reuse by [`TaskSet::add`].
    pub fn recycle(&self, mut t: Rc<Task>) {
        let mut free = self.free.borrow_mut();
        if free.len() < KEPT_TASKS {
            if let Some(slot) = Rc::get_mut(&mut t) {
                slot.mailbox.get_mut().clear();
                *slot.waker.get_mut() = None;
                free.push(t);
            }
        }
    }

    pub fn len(&self) -> usize {
        self.tasks.borrow().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Hands a Data-Out that came on connection `conn` to its task (data
    /// travels on the connection its command came on); the PDU back when
    /// no such task runs.
    pub fn deliver(&self, itt: u32, conn: u64, pdu: (Bhs, Vec<u8>)) -> Result<(), (Bhs, Vec<u8>)> {
        let tasks = self.tasks.borrow();
        let Some(t) = tasks
            .iter()
            .find(|t| t.itt == itt && t.conn == conn && !t.aborted())
        else {
            return Err(pdu);
        };
        t.mailbox.borrow_mut().push_back(pdu);
        t.wake();
        Ok(())
    }

    /// The task with this tag, if it runs.
    pub fn find(&self, itt: u32) -> Option<Rc<Task>> {
        let tasks = self.tasks.borrow();
        tasks
            .iter()
            .find(|t| t.itt == itt && !t.answered.get())
            .cloned()
    }

    /// Aborts every task `which` selects; returns how many.
    pub fn abort(&self, which: impl Fn(&Task) -> bool) -> usize {
        let tasks = self.tasks.borrow();
        let mut n = 0;
        for t in tasks.iter().filter(|t| !t.answered.get() && which(t)) {
            t.aborted.set(true);
            t.wake();
            n += 1;
        }
        drop(tasks);
        // Tasks waiting to start see the abort too.
        self.wake_all();
        n
    }

    /// Removes an ended task.
    pub fn remove(&self, t: &Rc<Task>) {
        self.tasks.borrow_mut().retain(|x| !Rc::ptr_eq(x, t));
        self.wake_all();
    }

    fn wake_all(&self) {
        let w = std::mem::take(&mut *self.waiters.borrow_mut());
        w.into_iter().for_each(Waker::wake);
    }

    /// Waits until `done` holds, rechecked whenever a task ends or is
    /// aborted.
    async fn until(&self, done: impl Fn(&[Rc<Task>]) -> bool) {
        poll_fn(|cx| {
            if done(&self.tasks.borrow()) {
                return Poll::Ready(());
            }
            self.waiters.borrow_mut().push(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    /// Waits until `t` may start by its task attribute (or is aborted):
    /// by this task set's order, or by the session's `gate` (the order
    /// across its reactors) when it has one.
    pub async fn may_start(&self, t: &Task, gate: Option<&Gate>) {
        if t.attr == attr::HEAD_OF_QUEUE {
            return;
        }
        let ordered = t.attr == attr::ORDERED;
        if let (Some(g), Some(seq)) = (gate, t.gate_seq) {
            // Woken by the gate when a task leaves, by this set when `t`
            // is aborted.
            return poll_fn(|cx| {
                if t.aborted() || g.ready(seq, ordered, cx) {
                    return Poll::Ready(());
                }
                self.waiters.borrow_mut().push(cx.waker().clone());
                Poll::Pending
            })
            .await;
        }
        self.until(|ts| {
            t.aborted()
                || !ts
                    .iter()
                    .any(|o| o.n < t.n && (ordered || o.attr == attr::ORDERED))
        })
        .await
    }

    /// Waits until none of the tasks `which` selects is left.
    pub async fn ended(&self, which: impl Fn(&Task) -> bool) {
        self.until(|ts| !ts.iter().any(|t| which(t))).await
    }
}
