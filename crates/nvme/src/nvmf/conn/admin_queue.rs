//! The admin commands a queue pair runs itself: Asynchronous Event Requests
//! (parked until an event) and Abort, which reaches the named queue on the
//! reactor that owns it through this reactor's table of I/O queues.

use std::cell::RefCell;
use std::future::poll_fn;
use std::rc::{Rc, Weak};
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};

use super::super::ctrlr::{Ctrl, AEN_NS_CHANGED, MAX_AERS};
use super::{Conn, Out};
use crate::wire::*;

thread_local! {
    /// This reactor's I/O queues by (controller address, qid), so an Abort
    /// sent here from the admin queue's reactor finds its connection.
    static IO_QUEUES: RefCell<Vec<(usize, u16, Weak<Conn>)>> = const { RefCell::new(Vec::new()) };
}

fn ctrl_key(ctrl: &Arc<Ctrl>) -> usize {
    Arc::as_ptr(ctrl) as usize
}

/// Lists I/O queue `qid` of `ctrl` on this reactor (at its Connect).
pub(super) fn register(ctrl: &Arc<Ctrl>, qid: u16, conn: &Rc<Conn>) {
    IO_QUEUES.with(|q| {
        q.borrow_mut()
            .push((ctrl_key(ctrl), qid, Rc::downgrade(conn)))
    });
}

/// Drops queue `qid` of `ctrl` from this reactor's table (it closed).
pub(super) fn unregister(ctrl: &Arc<Ctrl>, qid: u16) {
    let key = ctrl_key(ctrl);
    IO_QUEUES.with(|q| q.borrow_mut().retain(|e| !(e.0 == key && e.1 == qid)));
}

/// Aborts command `cid` of queue `qid` of controller `key` if that queue
/// lives on this reactor; whether it was aborted.
fn abort_here(key: usize, qid: u16, cid: u16) -> bool {
    let conn = IO_QUEUES.with(|q| {
        q.borrow()
            .iter()
            .find(|e| e.0 == key && e.1 == qid)
            .and_then(|e| e.2.upgrade())
    });
    conn.is_some_and(|c| c.abort(cid))
}

/// Abort on queue `sqid` of `ctrl`, run on the reactor that owns it.
pub(super) async fn abort_cmd(conn: &Rc<Conn>, ctrl: &Arc<Ctrl>, sqid: u16, cid: u16) -> bool {
    if sqid == 0 {
        return conn.abort(cid);
    }
    let Some(reactor) = ctrl.queue_reactor(sqid) else {
        return false;
    };
    let key = ctrl_key(ctrl);
    if reactor == ustor_runtime::reactor_id() {
        return abort_here(key, sqid, cid);
    }
    // Control path: one message there, the answer and a wake back.
    type Reply = Mutex<(Option<bool>, Option<Waker>)>;
    let reply: Arc<Reply> = Arc::new(Mutex::new((None, None)));
    let back = reply.clone();
    let sent = conn.shared.rt.send(reactor, move || {
        let r = abort_here(key, sqid, cid);
        let mut g = back.lock().unwrap_or_else(|p| p.into_inner());
        g.0 = Some(r);
        if let Some(w) = g.1.take() {
            w.wake();
        }
    });
    if sent.is_err() {
        return false;
    }
    poll_fn(|cx| {
        let mut g = reply.lock().unwrap_or_else(|p| p.into_inner());
        match g.0 {
            Some(r) => Poll::Ready(r),
            None => {
                g.1 = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    })
    .await
}

/// Parks an AER until an event is posted (or the controller goes away).
pub(super) async fn aer(conn: &Rc<Conn>, ctrl: &Arc<Ctrl>, cid: u16) -> Out {
    {
        let mut a = ctrl.aer.lock().unwrap_or_else(|p| p.into_inner());
        if a.parked >= MAX_AERS {
            return Out::Resp(conn.cqe(cid, Status::AER_LIMIT));
        }
        a.parked += 1;
    }
    // Parked AERs are not "in flight" for the coalescer: nothing is coming.
    conn.executing.set(conn.executing.get() - 1);
    let ev = poll_fn(|cx| {
        let mut a = ctrl.aer.lock().unwrap_or_else(|p| p.into_inner());
        if conn.closing.get() || ctrl.failed.load(std::sync::atomic::Ordering::Acquire) {
            return Poll::Ready(None);
        }
        if let Some(e) = a.events.pop_front() {
            // Reported: masked until the host reads the log (RAE = 0).
            a.ns_masked |= e == AEN_NS_CHANGED;
            return Poll::Ready(Some(e));
        }
        a.waiters.push(cx.waker().clone());
        Poll::Pending
    })
    .await;
    conn.executing.set(conn.executing.get() + 1);
    ctrl.aer.lock().unwrap_or_else(|p| p.into_inner()).parked -= 1;
    match ev {
        Some(e) => {
            let mut c = conn.cqe(cid, Status::SUCCESS);
            c.dw0 = e;
            Out::Resp(c)
        }
        None => Out::Resp(conn.cqe(cid, Status::ABORT_REQUESTED)),
    }
}
