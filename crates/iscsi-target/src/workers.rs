//! A connection's command workers: tasks spawned when a command finds every
//! worker busy and then kept, each taking commands from the connection's
//! queue and running them ([`crate::exec::run`]) one after another. After
//! the first commands of a session have sized the pool, starting a command
//! allocates nothing (a spawn per command would box its future). Parking
//! follows `ustor_net`'s driver workers: a worker is on the idle list
//! exactly while it is parked, so a command is never handed to a busy one
//! (an ORDERED command may wait for one queued behind it).

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::poll_fn;
use std::rc::Rc;
use std::task::{Poll, Waker};

use crate::exec::{Command, Core};
use crate::tasks::Task;

type Job = (Rc<Task>, Command);

/// One worker's parking place.
#[derive(Default)]
struct Slot {
    waker: Option<Waker>,
    parked: bool,
}

/// The workers of one connection and their queue.
#[derive(Default)]
pub(crate) struct Workers {
    jobs: RefCell<VecDeque<Job>>,
    slots: RefCell<Vec<Slot>>,
    /// Parked workers, by index into `slots`.
    idle: RefCell<Vec<usize>>,
    closing: Cell<bool>,
}

impl Workers {
    /// Queues a command and hands it to an idle worker, or to a new one.
    pub(crate) fn queue(core: &Rc<Core>, task: Rc<Task>, cmd: Command) {
        let w = &core.workers;
        w.jobs.borrow_mut().push_back((task, cmd));
        let idle = w.idle.borrow_mut().pop();
        match idle {
            Some(i) => w.unpark(i),
            None => {
                let id = {
                    let mut slots = w.slots.borrow_mut();
                    slots.push(Slot::default());
                    slots.len() - 1
                };
                ustor_runtime::spawn(worker(core.clone(), id));
            }
        }
    }

    /// Ends the workers once the queue is empty (the connection ended and
    /// its tasks with it).
    pub(crate) fn close(&self) {
        self.closing.set(true);
        // Budget: each round takes one entry off the idle list.
        loop {
            let Some(i) = self.idle.borrow_mut().pop() else {
                break;
            };
            self.unpark(i);
        }
    }

    fn unpark(&self, i: usize) {
        let w = {
            let mut slots = self.slots.borrow_mut();
            slots[i].parked = false;
            slots[i].waker.take()
        };
        if let Some(w) = w {
            w.wake();
        }
    }

    fn park(&self, i: usize, waker: &Waker) {
        let mut slots = self.slots.borrow_mut();
        slots[i].waker = Some(waker.clone());
        if !std::mem::replace(&mut slots[i].parked, true) {
            self.idle.borrow_mut().push(i);
        }
    }

    /// Worker `i` found work on its own (polled while parked): it leaves
    /// the idle list.
    fn unpark_self(&self, i: usize) {
        let mut slots = self.slots.borrow_mut();
        if std::mem::replace(&mut slots[i].parked, false) {
            slots[i].waker = None;
            let mut idle = self.idle.borrow_mut();
            if let Some(pos) = idle.iter().position(|&w| w == i) {
                idle.swap_remove(pos);
            }
        }
    }
}

async fn worker(core: Rc<Core>, id: usize) {
    // Budget: one command per round; ends when the connection closes.
    loop {
        let job = poll_fn(|cx| {
            let w = &core.workers;
            if let Some(job) = w.jobs.borrow_mut().pop_front() {
                w.unpark_self(id);
                return Poll::Ready(Some(job));
            }
            if w.closing.get() {
                w.unpark_self(id);
                return Poll::Ready(None);
            }
            w.park(id, cx.waker());
            Poll::Pending
        })
        .await;
        let Some((task, cmd)) = job else { break };
        crate::exec::run(&core, task, cmd).await;
    }
}
