//! The driver's workers: tasks spawned on demand (at most
//! `DriverConfig::max_workers`, the first `prespawn_workers` at start) and
//! then reused, each taking jobs from the
//! connection's queue, running [`Protocol::execute`] and queueing the
//! reply. Requests therefore complete and are answered out of order.

use std::cell::{Cell, RefCell};
use std::future::poll_fn;
use std::rc::Rc;
use std::task::{Poll, Waker};

use super::{Conn, Protocol};

/// A worker's parking place. A worker is on the idle list exactly while
/// `parked` is set, so spurious polls (a device that completes inline wakes
/// its task while it is being polled) never enter it twice.
#[derive(Default)]
struct Slot {
    waker: RefCell<Option<Waker>>,
    parked: Cell<bool>,
}

/// The connection's workers.
pub(super) struct Pool {
    /// Parked workers, by index into `slots`.
    idle: RefCell<Vec<usize>>,
    slots: Box<[Slot]>,
    spawned: Cell<usize>,
}

impl Pool {
    pub(super) fn new(max: usize) -> Pool {
        let max = max.max(1);
        Pool {
            idle: RefCell::new(Vec::with_capacity(max)),
            slots: (0..max).map(|_| Slot::default()).collect(),
            spawned: Cell::new(0),
        }
    }

    /// Wakes worker `i`, already taken off the idle list.
    fn unpark(&self, i: usize) {
        let slot = &self.slots[i];
        debug_assert!(slot.parked.get());
        slot.parked.set(false);
        let w = slot.waker.borrow_mut().take();
        if let Some(w) = w {
            w.wake();
        }
    }

    /// Parks worker `i` (idempotent).
    fn park(&self, i: usize, waker: &Waker) {
        let slot = &self.slots[i];
        *slot.waker.borrow_mut() = Some(waker.clone());
        if !slot.parked.replace(true) {
            self.idle.borrow_mut().push(i);
        }
    }

    /// Worker `i` found a job on its own (a spurious poll while parked):
    /// it leaves the idle list so no job is handed to a busy worker.
    fn unpark_self(&self, i: usize) {
        let slot = &self.slots[i];
        if slot.parked.replace(false) {
            *slot.waker.borrow_mut() = None;
            let mut idle = self.idle.borrow_mut();
            if let Some(pos) = idle.iter().position(|&w| w == i) {
                idle.swap_remove(pos);
            }
        }
    }

    pub(super) fn wake_all(&self) {
        // Budget: each round removes one entry from the idle list.
        loop {
            let Some(i) = self.idle.borrow_mut().pop() else {
                break;
            };
            self.unpark(i);
        }
    }
}

/// Queues `job` and hands it to an idle worker, or a new one while fewer
/// than the maximum run (else the next worker to finish takes it).
pub(super) fn queue_job<P: Protocol>(conn: &Rc<Conn<P>>, job: P::Job, charge: u64) {
    conn.jobs.borrow_mut().push_back((job, charge));
    let pool = &conn.workers;
    let idle = pool.idle.borrow_mut().pop();
    match idle {
        Some(i) => pool.unpark(i),
        None if pool.spawned.get() < pool.slots.len() => {
            let id = pool.spawned.get();
            pool.spawned.set(id + 1);
            ustor_runtime::spawn(worker(conn.clone(), id));
        }
        None => {}
    }
}

/// Spawns the configured workers before the first unit; they park at once.
pub(super) fn prespawn<P: Protocol>(conn: &Rc<Conn<P>>) {
    let pool = &conn.workers;
    let n = conn.cfg.prespawn_workers.min(pool.slots.len());
    // Budget: `n` rounds.
    for id in 0..n {
        ustor_runtime::spawn(worker(conn.clone(), id));
    }
    pool.spawned.set(n);
}

async fn worker<P: Protocol>(conn: Rc<Conn<P>>, id: usize) {
    loop {
        let job = poll_fn(|cx| {
            if let Some(job) = conn.jobs.borrow_mut().pop_front() {
                conn.workers.unpark_self(id);
                return Poll::Ready(Some(job));
            }
            if conn.closing.get() {
                conn.workers.unpark_self(id);
                return Poll::Ready(None);
            }
            conn.workers.park(id, cx.waker());
            Poll::Pending
        })
        .await;
        let Some((job, charge)) = job else { break };
        let reply = match conn.proto.aborted(&job) {
            Some(r) => r,
            None => conn.proto.execute(job).await,
        };
        conn.queue_reply(reply, charge, true);
    }
}
