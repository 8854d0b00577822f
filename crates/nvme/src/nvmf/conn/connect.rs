//! Fabrics Connect: the admin queue's creates the controller (and starts
//! its keep-alive watch); an I/O queue's joins an enabled controller of the
//! same host. Until Connect succeeds the queue runs under the handshake
//! timeout (`icreq_timeout_ms`) again ([`connect_watch`]).

use std::rc::{Rc, Weak};
use std::sync::Arc;
use std::time::Duration;

use ustor_runtime::{spawn, IoBuf};

use super::super::ctrlr::Ctrl;
use super::super::stats::{self, inc};
use super::super::subsystem::Subsystem;
use super::{admin_queue, Conn, Out};
use crate::wire::*;

fn connect_err(conn: &Conn, cid: u16, s: Status, data: bool, ipo: u16) -> Out {
    let mut c = conn.cqe(cid, s);
    c.dw0 = data as u32 | u32::from(ipo) << 16;
    Out::Resp(c)
}

pub(super) fn connect(conn: &Rc<Conn>, sqe: &Sqe, buf: Option<IoBuf>) -> Out {
    let cid = sqe.cid();
    let cmd = ConnectCmd::parse(sqe);
    if conn.qid.get().is_some() {
        return Out::Resp(conn.cqe(cid, Status::COMMAND_SEQUENCE));
    }
    if cmd.recfmt != 0 {
        return Out::Resp(conn.cqe(cid, Status::CONNECT_INCOMPATIBLE_FORMAT));
    }
    let Some(data) = buf.as_deref().and_then(|b| ConnectData::decode(b).ok()) else {
        return connect_err(conn, cid, Status::CONNECT_INVALID_PARAM, false, 24);
    };
    let Some(subsys) = conn.shared.subsystem(&data.subnqn) else {
        return connect_err(conn, cid, Status::CONNECT_INVALID_PARAM, true, 256);
    };
    if !subsys.host_allowed(&data.hostnqn) || !subsys.listening_on(&conn.listen) {
        return connect_err(conn, cid, Status::CONNECT_INVALID_HOST, true, 512);
    }
    if cmd.qid == 0 {
        connect_admin(conn, cid, &cmd, &data, &subsys)
    } else {
        connect_io(conn, cid, &cmd, &data, &subsys)
    }
}

/// The admin queue's Connect: a new controller.
fn connect_admin(
    conn: &Rc<Conn>,
    cid: u16,
    cmd: &ConnectCmd,
    data: &ConnectData,
    subsys: &Arc<Subsystem>,
) -> Out {
    if cmd.sqsize == 0 || cmd.sqsize >= conn.opts.admin_queue_depth() {
        return connect_err(conn, cid, Status::CONNECT_INVALID_PARAM, false, 44);
    }
    let mut s = subsys.lock();
    let Some(cntlid) = subsys.alloc_cntlid(&mut s) else {
        return Out::Resp(conn.cqe(cid, Status::CONNECT_CTRL_BUSY));
    };
    // KATO rounds up to the 1 s keep-alive granularity.
    let kato = cmd.kato_ms.div_ceil(1000) * 1000;
    let ctrl = Arc::new(Ctrl::new(
        cntlid,
        subsys.clone(),
        data.hostnqn.clone(),
        data.hostid,
        kato,
        conn.opts.max_io_qpairs_per_ctrlr,
        true,
        conn.listen.clone(),
    ));
    s.ctrls.insert(cntlid, Arc::downgrade(&ctrl));
    drop(s);
    ctrl.add_queue(
        0,
        conn.raw(),
        ustor_runtime::reactor_id(),
        conn.host_io.clone(),
    );
    *conn.ctrl.borrow_mut() = Some(ctrl.clone());
    conn.qid.set(Some(0));
    stats::with(|c| {
        inc(&c.admin_qpairs, 1);
        inc(&c.cur_admin, 1);
    });
    let peer = ustor_net::listener::peer_addr(conn.raw());
    let peer = peer.map_or_else(|| "?".into(), |p| p.to_string());
    tracing::info!(
        host = %data.hostnqn,
        subsystem = %subsys.nqn,
        cntlid,
        peer = %peer,
        "nvmf: host {} connected to {} from {peer} (controller {cntlid})",
        data.hostnqn,
        subsys.nqn
    );
    spawn(kato_watch(conn.clone(), ctrl));
    conn.sqsize.set(cmd.sqsize);
    let mut c = conn.cqe(cid, Status::SUCCESS);
    c.dw0 = u32::from(cntlid);
    Out::Resp(c)
}

/// An I/O queue's Connect: joins the host's controller.
fn connect_io(
    conn: &Rc<Conn>,
    cid: u16,
    cmd: &ConnectCmd,
    data: &ConnectData,
    subsys: &Arc<Subsystem>,
) -> Out {
    let Some(ctrl) = subsys.ctrl(data.cntlid) else {
        return connect_err(conn, cid, Status::CONNECT_INVALID_PARAM, true, 16);
    };
    if ctrl.hostnqn != data.hostnqn {
        return connect_err(conn, cid, Status::CONNECT_INVALID_HOST, true, 512);
    }
    if !ctrl.enabled() {
        return Out::Resp(conn.cqe(cid, Status::COMMAND_SEQUENCE));
    }
    let granted = ctrl
        .features
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .num_io_queues;
    if cmd.qid > granted {
        return connect_err(conn, cid, Status::CONNECT_INVALID_PARAM, false, 42);
    }
    if cmd.sqsize == 0 || cmd.sqsize >= conn.opts.io_queue_depth() {
        return connect_err(conn, cid, Status::CONNECT_INVALID_PARAM, false, 44);
    }
    let reactor = ustor_runtime::reactor_id();
    if !ctrl.add_queue(cmd.qid, conn.raw(), reactor, conn.host_io.clone()) {
        return connect_err(conn, cid, Status::CONNECT_INVALID_PARAM, false, 42);
    }
    admin_queue::register(&ctrl, cmd.qid, conn);
    conn.qid.set(Some(cmd.qid));
    conn.sqsize.set(cmd.sqsize);
    conn.sqflow_off
        .set(cmd.cattr & ConnectCmd::CATTR_DISABLE_SQFLOW != 0);
    *conn.ctrl.borrow_mut() = Some(ctrl.clone());
    stats::with(|c| {
        inc(&c.io_qpairs, 1);
        inc(&c.cur_io, 1);
    });
    let mut c = conn.cqe(cid, Status::SUCCESS);
    c.dw0 = u32::from(ctrl.cntlid);
    Out::Resp(c)
}

/// Enforces KATO: fails the controller when no admin command arrived in
/// time.
async fn kato_watch(conn: Rc<Conn>, ctrl: Arc<Ctrl>) {
    loop {
        ustor_runtime::sleep(Duration::from_millis(100)).await;
        if conn.closing.get() {
            return;
        }
        if ctrl.kato_expired() {
            tracing::info!(
                "nvmf: controller {} of {} missed its keep alive; failing it",
                ctrl.cntlid,
                ctrl.subsys.nqn
            );
            ctrl.fail();
            return;
        }
    }
}

/// Closes a queue whose host sent its ICReq but no successful Fabrics
/// Connect within `limit` (the handshake timeout, `icreq_timeout_ms`):
/// keep-alive only starts at Connect, so nothing else would ever end it.
/// Holds the queue weakly, so a queue that closed meanwhile is freed (and
/// uncounted) at once.
pub(super) async fn connect_watch(conn: Weak<Conn>, limit: Duration) {
    ustor_runtime::sleep(limit).await;
    let Some(conn) = conn.upgrade() else {
        return;
    };
    // `closing` is set before the driver drops the socket, so the
    // descriptor is still this queue's when it is not.
    if conn.qid.get().is_some() || conn.closing.get() {
        return;
    }
    tracing::info!(
        "nvmf: no Fabrics Connect within {} ms of ICReq; closing",
        limit.as_millis()
    );
    ustor_net::recv::shutdown(conn.raw());
}
