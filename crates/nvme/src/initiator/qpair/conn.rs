//! The queue's connection life: connect (after the controller's admin
//! queue is up), serve until the connection drops, requeue what it left
//! unfinished, reconnect; or fail everything once the controller failed.

use std::future::{poll_fn, Future};
use std::os::fd::{AsRawFd, OwnedFd};
use std::rc::Rc;
use std::task::Poll;
use std::time::Duration;

use ustor_bdev::BdevError;
use ustor_net::recv;

use super::super::ctrlr::{connect_queue, send_term_req, CtrlrState, QueueConn};
use super::super::InitiatorError;
use super::rx::{receiver, stage, RecvErr};
use super::tx::sender;
use super::{bump, wake, Out, Qp, QpState, TERM_WAIT, WAIT_TICK};

/// Drives the queue: connect, serve, and on loss requeue and reconnect.
pub(crate) async fn drive(qp: Rc<Qp>) {
    loop {
        if qp.state.get() == QpState::Closed || qp.ctrlr.stopping() {
            qp.state.set(QpState::Closed);
            qp.fail_all(BdevError::Removed);
            break;
        }
        if !controller_ready(&qp).await {
            continue;
        }
        let gen = qp.ctrlr.gen();
        let Some(fd) = connect(&qp, gen).await else {
            continue;
        };
        if qp.state.get() == QpState::Closed {
            continue;
        }
        serve(&qp, fd, gen).await;
        if qp.state.get() != QpState::Closed {
            qp.state.set(QpState::Down);
            qp.ctrlr.request_reset(gen);
        }
    }
    qp.ctrlr.remove_qp(&qp.counters);
    qp.ctrlr.free_qid(qp.qid);
}

/// Whether the controller is enabled under a generation this queue has not
/// connected under yet; otherwise waits a while (failing the queue's I/O
/// when the controller failed) and says no.
async fn controller_ready(qp: &Qp) -> bool {
    match qp.ctrlr.state() {
        CtrlrState::Failed => {
            if qp.state.get() != QpState::Failed {
                qp.state.set(QpState::Failed);
                qp.fail_all(BdevError::Io(libc::ENXIO));
            }
            idle(qp, WAIT_TICK * 20).await;
            false
        }
        CtrlrState::Enabled if qp.ctrlr.gen() != qp.gen.get() => true,
        _ => {
            idle(qp, WAIT_TICK).await;
            false
        }
    }
}

/// Connects the queue (TCP, ICReq, Fabrics Connect); on failure waits as
/// the failure asks (and asks for a controller reset when that helps).
async fn connect(qp: &Rc<Qp>, gen: u64) -> Option<OwnedFd> {
    let cntlid = qp.ctrlr.cntlid();
    let conn = ustor_net::timeout(
        Duration::from_secs(5),
        connect_queue(&qp.ctrlr, qp.qid, qp.depth - 1, cntlid),
    )
    .await;
    match conn {
        Some(Ok(QueueConn {
            fd,
            dg,
            maxh2c,
            cpda,
            ..
        })) => {
            qp.dg.set(dg);
            qp.maxh2c.set(maxh2c);
            qp.cpda.set(cpda);
            Some(fd)
        }
        Some(Err(e @ InitiatorError::Status { .. })) => {
            // The controller answered and refused this queue (e.g. a
            // restarted target granting fewer queues): its admin queue is
            // fine, so resetting it would only drop the other queues (and
            // be refused again, in a loop). Fail this queue's I/O and try
            // again after the reconnect delay.
            if qp.state.get() != QpState::Failed {
                tracing::warn!("nvme: I/O queue {} refused: {e}", qp.qid);
                qp.state.set(QpState::Failed);
                qp.fail_all(BdevError::Io(libc::ENXIO));
            } else {
                tracing::debug!("nvme: I/O queue {} refused: {e}", qp.qid);
            }
            let delay = u64::from(qp.ctrlr.p.reconnect_delay_sec.max(1));
            idle(qp, Duration::from_secs(delay)).await;
            None
        }
        other => {
            if let Some(Err(e)) = other {
                tracing::debug!("nvme: I/O queue {} connect: {e}", qp.qid);
            }
            qp.ctrlr.request_reset(gen);
            idle(qp, WAIT_TICK * 4).await;
            None
        }
    }
}

/// Sleeps for `d` or until the queue is closed.
async fn idle(qp: &Qp, d: Duration) {
    let mut s = std::pin::pin!(ustor_runtime::sleep(d));
    poll_fn(|cx| {
        if qp.state.get() == QpState::Closed || s.as_mut().poll(cx).is_ready() {
            return Poll::Ready(());
        }
        *qp.driver_w.borrow_mut() = Some(cx.waker().clone());
        Poll::Pending
    })
    .await
}

/// Serves one connection until it drops; returns with no task touching the
/// I/O buffers and every unfinished command queued for resending.
async fn serve(qp: &Rc<Qp>, fd: OwnedFd, gen: u64) {
    let raw = fd.as_raw_fd();
    qp.fd.set(raw);
    qp.gen.set(gen);
    qp.icd_max.set(qp.ctrlr.icd_max());
    bump(&qp.counters.connects, 1);
    // Resend what the last connection left unfinished (same CIDs).
    {
        let cmds = qp.cmds.borrow();
        let mut out = qp.out.borrow_mut();
        out.clear();
        for (cid, c) in cmds.iter().enumerate() {
            if c.io.is_some() {
                out.push_back(Out::Cmd(cid as u16));
                bump(&qp.counters.requeued, 1);
            }
        }
    }
    qp.state.set(QpState::Live);
    qp.sender_running.set(true);
    ustor_runtime::spawn(sender(qp.clone(), raw));
    qp.start_pending();
    let mut st = stage();
    let r = receiver(qp, raw, &mut st).await;
    if let Err(e) = &r {
        tracing::debug!("nvme: I/O queue {} lost: {e}", qp.qid);
    }
    if qp.state.get() == QpState::Live {
        qp.state.set(QpState::Down);
    }
    if let Err(RecvErr::Fatal { f, hdr, .. }) = r {
        // Tell the controller why. The sender (woken, it sees the queue
        // down) first finishes the group it is writing, so the request
        // starts on a PDU boundary; the offending header is still staged.
        wake(&qp.sender_w);
        let _ = ustor_net::timeout(TERM_WAIT, sender_stopped(qp)).await;
        if !qp.sender_running.get() {
            let n = hdr.min(st.avail());
            send_term_req(raw, f, &st.staged()[..n]);
        }
    }
    recv::shutdown(raw);
    wake(&qp.sender_w);
    // The sender may be in a sendmsg that still reads write buffers.
    sender_stopped(qp).await;
    qp.fd.set(-1);
    drop(fd);
    let mut cmds = qp.cmds.borrow_mut();
    for c in cmds.iter_mut() {
        c.err = None;
    }
}

/// Waits until the sender task has stopped touching the socket and the
/// write buffers.
async fn sender_stopped(qp: &Qp) {
    poll_fn(|cx| {
        if !qp.sender_running.get() {
            return Poll::Ready(());
        }
        *qp.driver_w.borrow_mut() = Some(cx.waker().clone());
        Poll::Pending
    })
    .await
}
