//! A queue of jobs run by reused worker tasks on one reactor: the pool
//! every target's request path shares (vhost queues, iSCSI connections,
//! the connection layer's driver).
//!
//! Workers are spawned on demand (at most `max`, or without a bound:
//! [`WorkQueue::unbounded`]) and then kept: a worker parks between jobs,
//! so once the pool is sized the path allocates nothing (a spawn per job
//! would box a future per I/O).
//!
//! **One awake worker at a time.** A job pushed while some worker is
//! already awake (woken and not yet polled, or running a job that has not
//! waited) wakes nobody: that worker takes it when its current job is done.
//! A device that completes inline (null, malloc, a cached block) so runs a
//! whole batch of jobs in one task poll, where waking a worker per job
//! cost a wake, a poll and a park for each (vhost-user-blk at QD32: one
//! wake per request, ~300 of ~2,100 instructions per request). A job that
//! has to wait (its future returns `Pending` inside [`WorkQueue::run`])
//! stops counting as awake and, if jobs remain queued, wakes or spawns a
//! successor at once, so a slow device still gets one worker per job in
//! flight, all submitted in the same reactor pass.
//!
//! The caller owns the worker body (a loop of [`WorkQueue::next`] then
//! [`WorkQueue::run`]); the queue asks it to spawn one by calling the
//! `spawn` closure it is given with the new worker's id.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::task::{Poll, Waker};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    /// Not spawned yet, or parked on the idle list.
    Parked,
    /// Woken or spawned, or running a job that has not waited: it will
    /// look at the queue before it parks.
    Awake,
    /// Inside a job that returned `Pending`.
    Waiting,
}

struct Slot {
    waker: RefCell<Option<Waker>>,
    state: Cell<State>,
    /// On the idle list.
    listed: Cell<bool>,
}

impl Slot {
    fn new() -> Slot {
        Slot {
            waker: RefCell::new(None),
            state: Cell::new(State::Parked),
            listed: Cell::new(false),
        }
    }
}

/// The jobs and workers of one queue (one reactor: no locks).
pub struct WorkQueue<J> {
    jobs: RefCell<VecDeque<J>>,
    /// One per worker spawned (a bounded queue makes all of them at once).
    slots: RefCell<Vec<Slot>>,
    max: usize,
    idle: RefCell<Vec<usize>>,
    spawned: Cell<usize>,
    awake: Cell<usize>,
    closing: Cell<bool>,
}

impl<J> WorkQueue<J> {
    /// A queue of at most `max` workers (at least one); `max` jobs fit
    /// without the queue growing.
    pub fn new(max: usize) -> WorkQueue<J> {
        Self::with_capacity(max, max)
    }

    /// [`WorkQueue::new`] with room for `jobs` queued jobs (a caller that
    /// bounds its jobs in flight: the queue never grows on the data path).
    pub fn with_capacity(max: usize, jobs: usize) -> WorkQueue<J> {
        let max = max.max(1);
        let q = WorkQueue::with_room(max, jobs.max(max));
        q.slots.borrow_mut().resize_with(max, Slot::new);
        q
    }

    /// A queue whose pool grows with the jobs in flight, without a bound
    /// (room made for `room` at first): for a path where a job may wait on
    /// one queued behind it, which a bounded pool could leave unstarted.
    pub fn unbounded(room: usize) -> WorkQueue<J> {
        WorkQueue::with_room(usize::MAX, room)
    }

    fn with_room(max: usize, room: usize) -> WorkQueue<J> {
        WorkQueue {
            jobs: RefCell::new(VecDeque::with_capacity(room)),
            slots: RefCell::new(Vec::with_capacity(room)),
            max,
            idle: RefCell::new(Vec::with_capacity(room)),
            spawned: Cell::new(0),
            awake: Cell::new(0),
            closing: Cell::new(false),
        }
    }

    /// Queues `job`; wakes a parked worker or spawns one (calling `spawn`
    /// with its id) only when no worker is awake to take it.
    #[inline]
    pub fn push(&self, job: J, spawn: impl FnOnce(usize)) {
        self.jobs.borrow_mut().push_back(job);
        if self.awake.get() == 0 {
            self.start_one(spawn);
        }
    }

    /// Spawns `n` workers (at most the maximum) before any job: they park
    /// at once.
    pub fn prespawn(&self, n: usize, mut spawn: impl FnMut(usize)) {
        // Budget: at most `max` rounds.
        while self.spawned.get() < n.min(self.max) {
            spawn(self.add_worker());
        }
    }

    /// Workers spawned so far.
    pub fn spawned(&self) -> usize {
        self.spawned.get()
    }

    /// Jobs queued and not yet taken by a worker.
    pub fn queued(&self) -> usize {
        self.jobs.borrow().len()
    }

    /// Worker `id`'s wait for its next job; `None` once the queue is
    /// closed and empty (the worker then returns).
    pub fn next(&self, id: usize) -> impl Future<Output = Option<J>> + '_ {
        poll_fn(move |cx| {
            if let Some(job) = self.jobs.borrow_mut().pop_front() {
                self.set_awake(id);
                return Poll::Ready(Some(job));
            }
            self.set_parked(id);
            if self.closing.get() {
                return Poll::Ready(None);
            }
            let slots = self.slots.borrow();
            let slot = &slots[id];
            let mut w = slot.waker.borrow_mut();
            match &*w {
                Some(old) if old.will_wake(cx.waker()) => {}
                _ => *w = Some(cx.waker().clone()),
            }
            drop(w);
            if !slot.listed.replace(true) {
                self.idle.borrow_mut().push(id);
            }
            drop(slots);
            Poll::Pending
        })
    }

    /// Runs worker `id`'s job `fut`. The first time it waits, the worker
    /// stops counting as awake and a successor is started if jobs remain
    /// (`spawn` as in [`WorkQueue::push`]); when it is done the worker
    /// counts as awake again (it goes back to [`WorkQueue::next`]).
    ///
    /// The job is pinned by the caller (`pin!` where it is made), not
    /// taken by value: a command's future is kilobytes (its whole
    /// execution's state), and moving it into this one and again into
    /// its own pin was a memcpy of that size per job.
    pub async fn run<F: Future>(
        &self,
        id: usize,
        mut fut: Pin<&mut F>,
        spawn: impl Fn(usize),
    ) -> F::Output {
        poll_fn(|cx| match fut.as_mut().poll(cx) {
            Poll::Ready(v) => {
                if self.state(id) == State::Waiting {
                    self.set_awake(id);
                }
                Poll::Ready(v)
            }
            Poll::Pending => {
                if self.state(id) == State::Awake {
                    self.slots.borrow()[id].state.set(State::Waiting);
                    self.awake.set(self.awake.get() - 1);
                    if self.awake.get() == 0 && !self.jobs.borrow().is_empty() {
                        self.start_one(&spawn);
                    }
                }
                Poll::Pending
            }
        })
        .await
    }

    /// Wakes every parked worker (for instance so it drops state it
    /// keeps between jobs); they park again if nothing is queued.
    pub fn wake_all(&self) {
        // Budget: each round takes one entry off the idle list.
        loop {
            let Some(i) = self.idle.borrow_mut().pop() else {
                break;
            };
            self.slots.borrow()[i].listed.set(false);
            self.set_awake(i);
            self.wake(i);
        }
    }

    /// Workers end once the queue is empty; parked ones are woken to end.
    pub fn close(&self) {
        self.closing.set(true);
        self.wake_all();
    }

    /// Whether [`WorkQueue::close`] was called.
    pub fn is_closing(&self) -> bool {
        self.closing.get()
    }

    /// Starts a worker for a queued job: a parked one, else a new one
    /// while fewer than the maximum exist, else none (the next worker to
    /// finish its job takes it).
    fn start_one(&self, spawn: impl FnOnce(usize)) {
        let parked = self.idle.borrow_mut().pop();
        if let Some(i) = parked {
            self.slots.borrow()[i].listed.set(false);
            self.set_awake(i);
            self.wake(i);
        } else if self.spawned.get() < self.max {
            spawn(self.add_worker());
        }
    }

    /// A new worker's id, counted awake (its slot made if it has none).
    fn add_worker(&self) -> usize {
        let id = self.spawned.get();
        self.spawned.set(id + 1);
        let mut slots = self.slots.borrow_mut();
        if slots.len() <= id {
            slots.push(Slot::new());
        }
        drop(slots);
        self.set_awake(id);
        id
    }

    fn state(&self, id: usize) -> State {
        self.slots.borrow()[id].state.get()
    }

    fn wake(&self, i: usize) {
        let w = self.slots.borrow()[i].waker.borrow_mut().take();
        if let Some(w) = w {
            w.wake();
        }
    }

    fn set_awake(&self, id: usize) {
        let slots = self.slots.borrow();
        let slot = &slots[id];
        if slot.state.replace(State::Awake) != State::Awake {
            self.awake.set(self.awake.get() + 1);
        }
        // A worker that found a job on its own (a spurious poll while
        // parked) leaves the idle list: no job is handed to a busy one.
        if slot.listed.replace(false) {
            let mut idle = self.idle.borrow_mut();
            if let Some(pos) = idle.iter().position(|&w| w == id) {
                idle.swap_remove(pos);
            }
        }
    }

    fn set_parked(&self, id: usize) {
        if self.slots.borrow()[id].state.replace(State::Parked) == State::Awake {
            self.awake.set(self.awake.get() - 1);
        }
    }
}
