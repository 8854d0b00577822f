//! A queue's request workers: tasks spawned on demand (at most one per
//! ring slot) and then reused, each taking requests from the queue's job
//! list. Spawning a task per request would box a future per I/O; a worker
//! is spawned once and parks between requests, so once every worker the
//! queue depth needs exists the data path allocates nothing.

use std::cell::{Cell, RefCell};
use std::task::Waker;

/// A worker's parking place. A worker is on the idle list exactly while
/// `parked` is set, so a spurious poll never lists it twice.
#[derive(Default)]
struct Slot {
    waker: RefCell<Option<Waker>>,
    parked: Cell<bool>,
}

/// The workers of one queue (one reactor: no locks).
pub struct Pool {
    idle: RefCell<Vec<usize>>,
    slots: Box<[Slot]>,
    spawned: Cell<usize>,
}

impl Pool {
    pub fn new(max: usize) -> Pool {
        let max = max.max(1);
        Pool {
            idle: RefCell::new(Vec::with_capacity(max)),
            slots: (0..max).map(|_| Slot::default()).collect(),
            spawned: Cell::new(0),
        }
    }

    /// Wakes an idle worker; else returns the id of a worker to spawn
    /// (when fewer than the maximum exist), else `None` (the next worker
    /// to finish takes the job).
    pub fn dispatch(&self) -> Option<usize> {
        let idle = self.idle.borrow_mut().pop();
        match idle {
            Some(i) => {
                self.unpark(i);
                None
            }
            None if self.spawned.get() < self.slots.len() => {
                let id = self.spawned.get();
                self.spawned.set(id + 1);
                Some(id)
            }
            None => None,
        }
    }

    /// Workers spawned so far.
    pub fn spawned(&self) -> usize {
        self.spawned.get()
    }

    fn unpark(&self, i: usize) {
        let slot = &self.slots[i];
        slot.parked.set(false);
        let w = slot.waker.borrow_mut().take();
        if let Some(w) = w {
            w.wake();
        }
    }

    /// Parks worker `i` until [`Self::dispatch`] or [`Self::wake_all`].
    pub fn park(&self, i: usize, waker: &Waker) {
        let slot = &self.slots[i];
        let mut w = slot.waker.borrow_mut();
        match &*w {
            Some(old) if old.will_wake(waker) => {}
            _ => *w = Some(waker.clone()),
        }
        if !slot.parked.replace(true) {
            self.idle.borrow_mut().push(i);
        }
    }

    /// Worker `i` found a job on its own (polled while parked): off the
    /// idle list, so no job is handed to a busy worker.
    pub fn unpark_self(&self, i: usize) {
        let slot = &self.slots[i];
        if slot.parked.replace(false) {
            let mut idle = self.idle.borrow_mut();
            if let Some(pos) = idle.iter().position(|&w| w == i) {
                idle.swap_remove(pos);
            }
        }
    }

    /// Wakes every parked worker (stop, or the memory map changed).
    pub fn wake_all(&self) {
        loop {
            let Some(i) = self.idle.borrow_mut().pop() else {
                break;
            };
            self.unpark(i);
        }
    }
}
