//! Workers: each takes a queued slot, executes its command (Fabrics, admin
//! or NVM I/O against the namespace's bdev channel) and queues the answer
//! for the sender.

use std::rc::Rc;

use ustor_runtime::IoBuf;

use super::super::admin::{self, AdminOut};
use super::super::ctrlr::Ctrl;
use super::super::io as nvm;
use super::super::stats::{self, inc};
use super::slots::SlotState;
use super::{admin_queue, connect, Conn, Out};
use crate::wire::*;

/// Runs slot `i`'s command (a driver job) and frees the slot; its answer
/// goes to the sender.
pub(super) async fn run(conn: Rc<Conn>, i: u16) -> Out {
    let (sqe, sgl, buf, failed, pair) = {
        let mut s = conn.slots.borrow_mut();
        let slot = &mut s[i as usize];
        slot.set_state(SlotState::Running);
        let pair = slot.fused.clone();
        (slot.sqe, slot.sgl, slot.buf.take(), slot.failed, pair)
    };
    let out = match (failed, pair) {
        (Some(st), _) => Out::Resp(conn.cqe(sqe.cid(), st)),
        (None, Some(p)) => super::fused::execute(&conn, p, &sqe, buf).await,
        (None, None) => execute(&conn, &sqe, sgl, buf).await,
    };
    conn.free_slot(i);
    conn.executing.set(conn.executing.get() - 1);
    if let Out::Resp(c) = &out {
        if !c.status().is_success() {
            stats::with(|c| inc(&c.errors, 1));
        }
    }
    out
}

fn admin_out(conn: &Conn, sqe: &Sqe, sgl: DataSgl, o: AdminOut) -> Out {
    let mut c = conn.cqe(sqe.cid(), o.status());
    c.dw0 = o.dw0;
    c.dw1 = o.dw1;
    match o.data {
        Some(d) if o.status().is_success() => {
            let want = match sgl {
                DataSgl::Transport { len } => len as usize,
                _ => 0,
            };
            let n = want.min(d.len());
            if n == 0 {
                return Out::Resp(c);
            }
            let mut buf = IoBuf::heap(n);
            buf.copy_from_slice(&d[..n]);
            Out::Data {
                cid: sqe.cid(),
                buf,
                len: n as u32,
                resp: Some(c),
            }
        }
        _ => Out::Resp(c),
    }
}

async fn execute(conn: &Rc<Conn>, sqe: &Sqe, sgl: DataSgl, buf: Option<IoBuf>) -> Out {
    let cid = sqe.cid();
    if sqe.opcode() == crate::wire::admin::FABRICS {
        match sqe.fctype() {
            fctype::CONNECT => return connect::connect(conn, sqe, buf),
            fctype::DISCONNECT => {
                // The socket ends once this is answered (`Qp::sent`).
                conn.closing.set(true);
                return Out::Resp(conn.cqe(cid, Status::SUCCESS));
            }
            _ => {}
        }
    }
    // Fused Compare + Write halves were paired at arrival and run in
    // `fused`; any other fused command was refused there. A half is never
    // run on its own (a fused operation is atomic).
    if sqe.fuse() != 0 {
        return Out::Resp(conn.cqe(cid, Status::INVALID_FIELD));
    }
    let Some(qid) = conn.qid.get() else {
        return Out::Resp(conn.cqe(cid, Status::COMMAND_SEQUENCE));
    };
    let Some(ctrl) = conn.ctrl.borrow().clone() else {
        return Out::Resp(conn.cqe(cid, Status::COMMAND_SEQUENCE));
    };
    if qid == 0 {
        return execute_admin(conn, &ctrl, sqe, sgl).await;
    }
    if sqe.opcode() == crate::wire::admin::FABRICS {
        return Out::Resp(conn.cqe(cid, Status::INVALID_OPCODE));
    }
    execute_io(conn, sqe, sgl, buf).await
}

/// An admin command: AER and Abort here (they wait, or reach other
/// queues), the rest in `nvmf::admin`.
async fn execute_admin(
    conn: &Rc<Conn>,
    ctrl: &std::sync::Arc<Ctrl>,
    sqe: &Sqe,
    sgl: DataSgl,
) -> Out {
    let cid = sqe.cid();
    if sqe.opcode() == crate::wire::admin::ASYNC_EVENT_REQUEST {
        return admin_queue::aer(conn, ctrl, cid).await;
    }
    if sqe.opcode() == crate::wire::admin::ABORT {
        ctrl.touch();
        let (sqid, acid) = (sqe.cdw(10) as u16, (sqe.cdw(10) >> 16) as u16);
        let done = admin_queue::abort_cmd(conn, ctrl, sqid, acid).await;
        let mut c = conn.cqe(cid, Status::SUCCESS);
        // DW0 bit 0: 0 = aborted, 1 = not aborted.
        c.dw0 = u32::from(!done);
        return Out::Resp(c);
    }
    let facts = admin::TransportFacts {
        in_capsule_data_size: conn.opts.in_capsule_data_size,
        mdts: (conn.opts.max_io_size / 4096).max(1).ilog2() as u8,
    };
    let o = admin::execute(ctrl, sqe, facts, &*conn.shared);
    admin_out(conn, sqe, sgl, o)
}

/// An NVM command against the namespace's channel on this reactor.
async fn execute_io(conn: &Rc<Conn>, sqe: &Sqe, sgl: DataSgl, buf: Option<IoBuf>) -> Out {
    let cid = sqe.cid();
    let Some(ch) = conn.channel(sqe.nsid()) else {
        return Out::Resp(conn.cqe(cid, Status::INVALID_NAMESPACE));
    };
    stats::with(|c| inc(&c.pending_io, 1));
    let done = nvm::execute(sqe, &ch, sgl, buf, conn.opts.max_io_size).await;
    stats::with(|c| c.pending_io.set(c.pending_io.get() - 1));
    match done.data {
        Some((buf, len)) if done.status.is_success() => {
            stats::with(|c| {
                inc(&c.reads, 1);
                inc(&c.bytes_read, u64::from(len));
            });
            conn.host_io.read(u64::from(len));
            // SUCCESS in the C2HData instead of a CapsuleResp: only when the
            // host gave up SQ flow control (it then needs no SQHD) and the
            // transport allows it (SPDK's c2h_success).
            let success = conn.opts.c2h_success && conn.sqflow_off.get();
            let resp = (!success).then(|| conn.cqe(cid, Status::SUCCESS));
            Out::Data {
                cid,
                buf,
                len,
                resp,
            }
        }
        _ => {
            if done.status.is_success() {
                count_done(conn, sqe, sgl);
            }
            Out::Resp(conn.cqe(cid, done.status))
        }
    }
}

/// Counts a successful command that sent no data back.
fn count_done(conn: &Conn, sqe: &Sqe, sgl: DataSgl) {
    match sqe.opcode() {
        crate::wire::io::WRITE => {
            stats::with(|c| {
                inc(&c.writes, 1);
                inc(&c.bytes_written, u64::from(sgl.len()));
            });
            conn.host_io.write(u64::from(sgl.len()));
        }
        // SMART counts the blocks a Compare read as reads.
        crate::wire::io::COMPARE => conn.host_io.read(u64::from(sgl.len())),
        _ => {}
    }
}
