//! The per-reactor executor of `!Send` tasks.
//!
//! Tasks live in a slab; a waker packs (runtime, reactor, task index) into its
//! data word, so cloning and waking on the owning thread costs no allocation
//! and no atomic. A wake from another thread is forwarded through the inbox.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, RawWaker, RawWakerVTable, Waker};

use crate::reactor;

type Task = Pin<Box<dyn Future<Output = ()>>>;

pub(crate) struct Executor {
    tasks: RefCell<Vec<Option<Task>>>,
    live: RefCell<Vec<bool>>,
    queued: RefCell<Vec<bool>>,
    free: RefCell<Vec<u32>>,
    ready: RefCell<VecDeque<u32>>,
    polled: Cell<u64>,
}

impl Executor {
    pub(crate) fn new(capacity: usize) -> Executor {
        Executor {
            tasks: RefCell::new(Vec::with_capacity(capacity)),
            live: RefCell::new(Vec::with_capacity(capacity)),
            queued: RefCell::new(Vec::with_capacity(capacity)),
            free: RefCell::new(Vec::with_capacity(capacity)),
            ready: RefCell::new(VecDeque::with_capacity(capacity)),
            polled: Cell::new(0),
        }
    }

    fn insert(&self, task: Task) -> u32 {
        let idx = match self.free.borrow_mut().pop() {
            Some(i) => {
                self.tasks.borrow_mut()[i as usize] = Some(task);
                i
            }
            None => {
                let mut t = self.tasks.borrow_mut();
                t.push(Some(task));
                self.live.borrow_mut().push(false);
                self.queued.borrow_mut().push(false);
                (t.len() - 1) as u32
            }
        };
        self.live.borrow_mut()[idx as usize] = true;
        idx
    }

    pub(crate) fn schedule(&self, idx: u32) {
        let i = idx as usize;
        let mut q = self.queued.borrow_mut();
        if i >= q.len() || q[i] || !self.live.borrow()[i] {
            return;
        }
        q[i] = true;
        self.ready.borrow_mut().push_back(idx);
    }

    pub(crate) fn has_ready(&self) -> bool {
        !self.ready.borrow().is_empty()
    }

    /// Polls up to `budget` ready tasks; returns how many ran.
    pub(crate) fn run_ready(&self, budget: usize) -> usize {
        let (rt, rid) = reactor::with(|r| (r.runtime.id, r.id));
        let mut n = 0;
        while n < budget {
            let Some(idx) = self.ready.borrow_mut().pop_front() else {
                break;
            };
            self.queued.borrow_mut()[idx as usize] = false;
            // Taken out of the slab while polled so the task may spawn others.
            let Some(mut fut) = self.tasks.borrow_mut()[idx as usize].take() else {
                continue;
            };
            let waker = make_waker(rt, rid as u16, idx);
            let mut cx = Context::from_waker(&waker);
            n += 1;
            // A panicking task is a bug; it is reported and dropped, and the
            // reactor (and every other task on it) keeps running. Release
            // builds abort on panic instead.
            let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                fut.as_mut().poll(&mut cx)
            }));
            let polled = polled.unwrap_or_else(|_| {
                tracing::error!("task {idx} on reactor {rid} panicked; dropped");
                Poll::Ready(())
            });
            match polled {
                Poll::Pending => self.tasks.borrow_mut()[idx as usize] = Some(fut),
                Poll::Ready(()) => {
                    self.live.borrow_mut()[idx as usize] = false;
                    self.free.borrow_mut().push(idx);
                    drop(fut);
                }
            }
        }
        self.polled.set(self.polled.get() + n as u64);
        n
    }

    /// Task polls since the reactor started.
    pub(crate) fn polled(&self) -> u64 {
        self.polled.get()
    }

    pub(crate) fn task_count(&self) -> usize {
        self.live.borrow().iter().filter(|l| **l).count()
    }

    /// Drops every task (reactor shutdown). Futures are dropped one by one,
    /// outside the slab borrow, since their destructors may touch the reactor.
    pub(crate) fn clear(&self) {
        let n = self.tasks.borrow().len();
        for i in 0..n {
            let t = self.tasks.borrow_mut()[i].take();
            self.live.borrow_mut()[i] = false;
            drop(t);
        }
        self.ready.borrow_mut().clear();
    }
}

// Waker data word: runtime id (16 bits) | reactor (16) | task index (32).
fn pack(rt: u16, reactor: u16, task: u32) -> *const () {
    (((rt as u64) << 48) | ((reactor as u64) << 32) | task as u64) as usize as *const ()
}

fn unpack(p: *const ()) -> (u16, u16, u32) {
    let v = p as usize as u64;
    ((v >> 48) as u16, (v >> 32) as u16, v as u32)
}

static VTABLE: RawWakerVTable = RawWakerVTable::new(clone_raw, wake_raw, wake_raw, drop_raw);

fn clone_raw(p: *const ()) -> RawWaker {
    RawWaker::new(p, &VTABLE)
}

fn wake_raw(p: *const ()) {
    let (rt, rid, task) = unpack(p);
    let local = reactor::try_with(|r| {
        if r.runtime.id == rt && r.id == rid as usize {
            r.exec.schedule(task);
            true
        } else {
            false
        }
    });
    if local != Some(true) {
        crate::msg::wake_remote(rt, rid as usize, task);
    }
}

fn drop_raw(_: *const ()) {}

pub(crate) fn make_waker(rt: u16, reactor: u16, task: u32) -> Waker {
    // SAFETY: the vtable functions only interpret the data word as integers;
    // they never dereference it, so any value is sound on any thread.
    unsafe { Waker::from_raw(RawWaker::new(pack(rt, reactor, task), &VTABLE)) }
}

struct JoinState<T> {
    result: Option<T>,
    waker: Option<Waker>,
}

/// Awaits the output of a task started by [`spawn`].
pub struct JoinHandle<T> {
    state: Rc<RefCell<JoinState<T>>>,
}

impl<T> Future for JoinHandle<T> {
    type Output = T;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let mut s = self.state.borrow_mut();
        match s.result.take() {
            Some(v) => Poll::Ready(v),
            None => {
                s.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

/// Starts a task on the current reactor. Panics off a reactor thread.
pub fn spawn<T: 'static>(fut: impl Future<Output = T> + 'static) -> JoinHandle<T> {
    let state = Rc::new(RefCell::new(JoinState {
        result: None,
        waker: None,
    }));
    let st = state.clone();
    let task: Task = Box::pin(async move {
        let v = fut.await;
        let mut s = st.borrow_mut();
        s.result = Some(v);
        if let Some(w) = s.waker.take() {
            w.wake();
        }
    });
    reactor::with(|r| {
        let idx = r.exec.insert(task);
        r.exec.schedule(idx);
    });
    JoinHandle { state }
}

/// Yields to the other tasks of this reactor once.
pub fn yield_now() -> YieldNow {
    YieldNow { yielded: false }
}

pub struct YieldNow {
    yielded: bool,
}

/// Yields while other tasks of this reactor are ready, at most `max`
/// times: a task about to send a batch that the tasks running in this
/// pass may still add to lets them run first, so the batch leaves once
/// per pass (as a poll loop flushes each socket once per iteration), not
/// once per task. Ready at once off a reactor or with nothing else ready.
pub fn yield_while_busy(max: u32) -> YieldWhileBusy {
    YieldWhileBusy { left: max }
}

pub struct YieldWhileBusy {
    left: u32,
}

impl Future for YieldWhileBusy {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let busy = reactor::try_with(|r| r.exec.has_ready()).unwrap_or(false);
        if self.left == 0 || !busy {
            return Poll::Ready(());
        }
        self.left -= 1;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

impl Future for YieldNow {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.yielded {
            return Poll::Ready(());
        }
        self.yielded = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}
