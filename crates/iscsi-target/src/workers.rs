//! A connection's command workers: tasks of the connection's
//! [`WorkQueue`], each taking commands from it and running them
//! ([`crate::exec::run`]) one after another. A command that arrives while a
//! worker is awake wakes nobody; one that waits hands the queue to another
//! worker, so every command in flight runs at once. The pool has no bound:
//! a command may wait for one queued behind it (an ORDERED command, or a
//! task management function waiting for a queued task while the running
//! ones wait for Data-Out), which a bounded pool could leave unstarted.
//! After the first commands of a session have sized the pool, starting a
//! command allocates nothing (a spawn per command would box its future).
//!
//! Commands that complete inline run back to back in one worker, so a
//! response must not hold the worker until it is sent: a command that
//! ends while the session has others leaves its response to the
//! connection's flusher task ([`flush_later`]), which runs once the worker
//! waits or its batch is done and, after the other tasks ready on the
//! reactor, sends every response queued by then in one send.

use std::cell::{Cell, RefCell};
use std::future::poll_fn;
use std::pin::pin;
use std::rc::Rc;
use std::task::{Poll, Waker};

use ustor_runtime::WorkQueue;

use crate::exec::{Command, Core};
use crate::tasks::Task;

/// A command and its task, queued for a worker.
pub(crate) type Job = (Rc<Task>, Command);

/// Workers made room for at first (the pool grows past it).
const ROOM: usize = 64;

/// At most this many reactor rounds the flusher waits for other
/// responses to join its send.
const FLUSH_YIELDS: u32 = 8;

/// The command queue of a new connection.
pub(crate) fn queue() -> WorkQueue<Job> {
    WorkQueue::unbounded(ROOM)
}

/// A connection's deferred flush: whether one is owed, and the flusher
/// task waiting for one.
#[derive(Default)]
pub(crate) struct Flusher {
    owed: Cell<bool>,
    started: Cell<bool>,
    waker: RefCell<Option<Waker>>,
}

impl Flusher {
    fn kick(&self) {
        if let Some(w) = self.waker.borrow_mut().take() {
            w.wake();
        }
    }
}

/// Queues a command for the connection's workers.
pub(crate) fn push(core: &Rc<Core>, task: Rc<Task>, cmd: Command) {
    if !core.flusher.started.replace(true) {
        ustor_runtime::spawn(flusher(core.clone()));
    }
    core.workers.push((task, cmd), |id| spawn(core.clone(), id));
}

/// Has the flusher send what is queued once this worker waits or its
/// batch is done.
pub(crate) fn flush_later(core: &Core) {
    if !core.flusher.owed.replace(true) {
        core.flusher.kick();
    }
}

/// Ends the workers and the flusher once the queue is empty.
pub(crate) fn close(core: &Core) {
    core.workers.close();
    core.flusher.kick();
}

fn spawn(core: Rc<Core>, id: usize) {
    ustor_runtime::spawn(worker(core, id));
}

async fn worker(core: Rc<Core>, id: usize) {
    // Budget: one command per round; ends when the connection closes.
    while let Some((task, cmd)) = core.workers.next(id).await {
        let body = pin!(crate::exec::run(&core, task, cmd));
        core.workers.run(id, body, |i| spawn(core.clone(), i)).await;
    }
}

async fn flusher(core: Rc<Core>) {
    let f = &core.flusher;
    // Budget: one flush per round; ends when the connection closes.
    loop {
        poll_fn(|cx| {
            if f.owed.get() || core.workers.is_closing() {
                return Poll::Ready(());
            }
            *f.waker.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        })
        .await;
        if f.owed.get() {
            // The rest of the batch (and other connections' commands)
            // queue their responses first: one send for all of them.
            ustor_runtime::yield_while_busy(FLUSH_YIELDS).await;
            f.owed.set(false);
            if let Err(e) = core.tx.flush().await {
                tracing::debug!("iscsi: responses not sent: {e}");
            }
        }
        if core.workers.is_closing() && !f.owed.get() {
            break;
        }
    }
}
