//! The queue's connection life: connect (after the controller's admin
//! queue is up), serve it on the connection driver until it drops (the
//! protocol starts it: ICReq/ICResp, Fabrics Connect, then requeues what
//! the last connection left unfinished), reconnect; or fail everything
//! once the controller failed or refused the queue.

use std::future::{poll_fn, Future};
use std::os::fd::{AsRawFd, OwnedFd};
use std::rc::Rc;
use std::task::Poll;
use std::time::Duration;

use ustor_bdev::BdevError;
use ustor_net::driver::{self, DriverConfig};
use ustor_net::staging::{RecvMode, Rewind};

use ustor_net::recv::connect_blocking;

use super::super::ctrlr::CtrlrState;
use super::super::InitiatorError;
use super::{
    Handshake, Link, Out, Qp, QpState, RxState, HANDSHAKE_TIMEOUT, RECV_BUDGET, STAGE_LEN,
    TERM_WAIT, WAIT_TICK,
};

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
        serve(&qp, fd).await;
        after(&qp, gen).await;
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

/// Opens the queue's TCP connection; on failure asks for a controller
/// reset and waits a while.
async fn connect(qp: &Qp, gen: u64) -> Option<OwnedFd> {
    let addr = qp.ctrlr.addr;
    match ustor_net::timeout(HANDSHAKE_TIMEOUT, connect_blocking(addr)).await {
        Some(Ok(fd)) => return Some(fd),
        Some(Err(e)) => tracing::debug!("nvme: I/O queue {} connect: {e}", qp.qid),
        None => tracing::debug!("nvme: I/O queue {} connect: timed out", qp.qid),
    }
    qp.ctrlr.request_reset(gen);
    idle(qp, WAIT_TICK * 4).await;
    None
}

/// After a connection under `gen` ended: how far it got decides what
/// follows.
async fn after(qp: &Qp, gen: u64) {
    if qp.state.get() == QpState::Closed {
        // Closed while connecting: the next round fails what is left.
        return;
    }
    match qp.hs.get() {
        Handshake::Done => {
            qp.gen.set(gen);
            qp.state.set(QpState::Down);
            qp.ctrlr.request_reset(gen);
        }
        Handshake::Refused(status) => {
            // The controller answered and refused this queue (e.g. a
            // restarted target granting fewer queues): its admin queue is
            // fine, so resetting it would only drop the other queues (and
            // be refused again, in a loop). Fail this queue's I/O and try
            // again after the reconnect delay.
            let e = InitiatorError::Status {
                what: "Connect",
                status,
            };
            if qp.state.get() != QpState::Failed {
                tracing::warn!("nvme: I/O queue {} refused: {e}", qp.qid);
                qp.state.set(QpState::Failed);
                qp.fail_all(BdevError::Io(libc::ENXIO));
            } else {
                tracing::debug!("nvme: I/O queue {} refused: {e}", qp.qid);
            }
            let delay = u64::from(qp.ctrlr.p.reconnect_delay_sec.max(1));
            idle(qp, Duration::from_secs(delay)).await;
        }
        Handshake::IcResp | Handshake::Connect => {
            tracing::debug!("nvme: I/O queue {} lost while connecting", qp.qid);
            qp.ctrlr.request_reset(gen);
            idle(qp, WAIT_TICK * 4).await;
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

/// The driver's shape for one queue: no unit is received (the queue sends
/// its own commands), headers staged with direct receives and rewound
/// before each, the hand-written sender's group size (64 segments: a
/// bigger group would wait longer for LANoT's degree, see docs/nvmf.md).
fn driver_config(qp: &Qp) -> DriverConfig {
    DriverConfig {
        // The send queue's capacity: a capsule and an R2T's data per
        // command, and a termination request.
        max_outstanding: 2 * qp.depth as usize + 8,
        max_outstanding_bytes: u64::MAX,
        max_workers: 1,
        prespawn_workers: 0,
        staging_len: STAGE_LEN,
        rewind: Rewind::Eager,
        recv_mode: RecvMode::Direct,
        recv_budget: Some(RECV_BUDGET),
        max_replies: u32::MAX,
        group_iov: ustor_runtime::ops::MAX_IOV,
        group_arena: ustor_net::group::ARENA_LEN,
        // The queue's own coalescer (Protocol::coalescer).
        coalesce: None,
    }
}

/// Serves one connection until it drops: ICReq/ICResp and the Fabrics
/// Connect (bounded by [`HANDSHAKE_TIMEOUT`]), then commands; returns with
/// no task touching the I/O buffers and every unfinished command kept for
/// resending.
async fn serve(qp: &Rc<Qp>, fd: OwnedFd) {
    let raw = fd.as_raw_fd();
    qp.fd.set(raw);
    qp.hs.set(Handshake::IcResp);
    qp.cntlid.set(qp.ctrlr.cntlid());
    qp.dg.set(Default::default());
    qp.icd_max.set(qp.ctrlr.icd_max());
    qp.rx.set(RxState::IcResp);
    qp.exact.set(false);
    qp.grp_cmds.set(0);
    let conn = driver::start(fd, Link(qp.clone()), driver_config(qp));
    // A termination request to a controller that stopped reading must
    // not hold the queue: the socket is shut down under it.
    conn.set_drain_timeout(Some(TERM_WAIT));
    conn.send(Out::IcReq);
    *qp.conn.borrow_mut() = Some(conn.clone());
    // Returns once its receiver and sender stopped (the socket shut
    // down); a controller that does not finish the handshake in time has
    // its socket shut down under it.
    let mut served = std::pin::pin!(driver::serve(conn));
    let mut limit = std::pin::pin!(ustor_runtime::sleep(HANDSHAKE_TIMEOUT));
    let mut cut = false;
    poll_fn(|cx| {
        if served.as_mut().poll(cx).is_ready() {
            return Poll::Ready(());
        }
        if !cut && qp.hs.get() != Handshake::Done && limit.as_mut().poll(cx).is_ready() {
            tracing::debug!("nvme: I/O queue {} connect: timed out", qp.qid);
            ustor_net::recv::shutdown(raw);
            cut = true;
        }
        Poll::Pending
    })
    .await;
    if qp.state.get() == QpState::Live {
        qp.state.set(QpState::Down);
    }
    // Drops the connection (its socket, its `Rc` to the queue).
    qp.conn.borrow_mut().take();
    qp.fd.set(-1);
    let mut cmds = qp.cmds.borrow_mut();
    for c in cmds.iter_mut() {
        c.err = None;
    }
}
