//! One connection on its reactor: the login (under the listener's login
//! timeout, with small buffers); then, for a new normal session, its
//! registration (ending the session it reinstates first), the LUN table
//! of the node opened on this reactor and the full feature phase
//! ([`crate::session`]); a connection that joins a session (MC/S or
//! connection reinstatement) moves to the session's reactor. A discovery
//! session only answers Text and Logout.

use std::os::fd::AsRawFd;
use std::rc::Rc;
use std::sync::Arc;

use ustor_net::listener::Accepted;
use ustor_scsi_target::{Lun, LunTable};

use crate::exec::Core;
use crate::io::{ConnError, Received, Wire};
use crate::live::ConnInfo;
use crate::login::{Established, Login, LoginFail};
use crate::sess::{Leave, Sess};
use crate::session::Session;
use crate::sessions::SessionCtl;
use crate::target::{NodeEntry, PortalService};
use crate::tx::Tx;

/// MaxRecvDataSegmentLength during login (RFC 7143 §13.12 default).
const LOGIN_DATA: usize = 8192;

type Est = Established<Arc<NodeEntry>>;

/// Serves one admitted connection until it ends.
pub(crate) async fn serve(conn: Accepted, svc: Arc<PortalService>) {
    let fd = conn.fd.as_raw_fd();
    let mut wire = Wire::new(fd, LOGIN_DATA);
    let peer = crate::live::peer_ip(&conn.fd);
    let (est, ctl, replaces) = match conn.handshake(login(&mut wire, &svc, peer)).await {
        Some(Ok(e)) => e,
        Some(Err(e)) => {
            tracing::debug!("iscsi: login ended: {e}");
            return;
        }
        None => return,
    };
    match ctl {
        Some(ctl) if !est.leading => {
            let reactor = ctl.reactor;
            if reactor == ustor_runtime::reactor_id() {
                return join(conn, est, svc, ctl, replaces).await;
            }
            // The session runs on another reactor: the connection goes
            // there (its login left nothing buffered: the initiator sends
            // nothing before the final Login Response).
            let rt = svc.shared.rt.clone();
            if rt
                .spawn_on(reactor, move || join(conn, est, svc, ctl, replaces))
                .is_err()
            {
                tracing::warn!("iscsi: reactor {reactor} gone, connection dropped");
            }
        }
        ctl => lead(conn, est, svc, ctl).await,
    }
}

/// The first connection of a session (or a discovery session).
async fn lead(conn: Accepted, est: Est, svc: Arc<PortalService>, ctl: Option<Arc<SessionCtl>>) {
    let table = match &est.node {
        Some(node) => match open_luns(node, svc.shared.physical_block()) {
            Some(mut t) => {
                t.set_nexus(&nexus_name(&est.initiator, &est.isid));
                Some(t)
            }
            None => {
                if let Some(ctl) = &ctl {
                    svc.shared.sessions.forget(ctl);
                }
                return;
            }
        },
        None => None,
    };
    let qd = est.node.as_ref().map_or(1, |n| n.params.queue_depth);
    let sess = Sess::new(table.unwrap_or_default(), ctl.clone(), est.exp_cmdsn, qd);
    if let Some(ctl) = &ctl {
        let g = svc.shared.sessions.register_local(ctl, &sess);
        *sess.guard.borrow_mut() = Some(g);
    }
    run_conn(conn, est, svc, sess, false).await
}

/// A connection that joins its session here, on the session's reactor
/// (`replaces`: the session was held for it).
async fn join(
    conn: Accepted,
    est: Est,
    svc: Arc<PortalService>,
    ctl: Arc<SessionCtl>,
    replaces: bool,
) {
    let Some(sess) = svc.shared.sessions.local(ctl.tsih).filter(|s| s.open()) else {
        tracing::debug!(
            "iscsi: session {:#x} ended before CID {} joined",
            ctl.tsih,
            est.cid
        );
        ustor_net::recv::shutdown(conn.fd.as_raw_fd());
        return;
    };
    run_conn(conn, est, svc, sess, replaces).await
}

/// The full feature phase of one connection of `sess` (of a normal
/// session when it has a node); `replaces`: the session is held for it
/// (connection reinstatement), let go once it is attached.
async fn run_conn(
    conn: Accepted,
    est: Est,
    svc: Arc<PortalService>,
    sess: Rc<Sess>,
    replaces: bool,
) {
    let normal = est.node.is_some();
    let fd = conn.fd.as_raw_fd();
    let (initiator_addr, target_addr) = crate::live::addrs(&conn.fd);
    let node = est
        .node
        .as_ref()
        .map_or("(discovery)", |n| n.full_name.as_str());
    tracing::info!(
        initiator = %est.initiator,
        node,
        peer = %initiator_addr,
        "iscsi: {} logged in to {node} from {initiator_addr} (TSIH {:#x}, CID {})",
        est.initiator,
        est.tsih,
        est.cid
    );
    let live = svc.shared.live.add(ConnInfo {
        id: 0,
        cid: est.cid,
        tsih: est.tsih,
        initiator_name: est.initiator.clone(),
        initiator_addr,
        target_addr,
        target_node_name: est
            .node
            .as_ref()
            .map_or(String::new(), |n| n.full_name.clone()),
        ops: 0,
        bytes_read: 0,
        bytes_written: 0,
    });
    let (counters, _counted) = live.counters();
    let mut wire = Wire::new(fd, est.params.max_recv_data as usize);
    wire.header_digest = est.params.header_digest;
    wire.data_digest = est.params.data_digest;
    let digests = (wire.header_digest, wire.data_digest);
    let timeout = crate::session::SEND_TIMEOUT;
    let tx = Tx::new(fd, digests, timeout, est.statsn, sess.window.clone());
    let core = Rc::new(Core::new(tx, est.params, sess.clone(), est.cid));
    sess.attach(&core);
    if replaces {
        sess.unhold();
    }
    let mut s = Session::new(wire, core, normal, &*svc, est.initiator.clone());
    s.count_into(counters);
    s.set_pings(svc.shared.pings());
    s.set_drain(svc.shared.drain.watch());
    s.set_peers(svc.shared.sessions.clone(), svc.shared.rt.clone());
    if let Err(e) = s.run().await {
        tracing::debug!("iscsi: connection ended: {e}");
    }
    // The session (when this was its last connection) ends before the
    // connection leaves the list: once a session's connections are gone
    // from iscsi_get_connections, its TSIH is free.
    drop(s);
    drop(sess);
    ustor_net::recv::shutdown(fd);
    drop(conn);
    drop(live);
}

async fn login(
    wire: &mut Wire,
    svc: &Arc<PortalService>,
    peer: Option<std::net::IpAddr>,
) -> Result<(Est, Option<Arc<SessionCtl>>, bool), ConnError> {
    let mut l = Login::new(svc.tag);
    if let Some(peer) = peer {
        l = l.with_peer(peer);
    }
    // Budget: each round is one request; a login that never ends is cut by
    // the listener's timeout.
    loop {
        let b = match wire.recv().await? {
            Received::Pdu(b) => b,
            Received::BadDataDigest(_) => return Err(ConnError::Protocol("digest in login")),
        };
        let data = wire.data().to_vec();
        let mut a = l.step(&**svc, &b, &data);
        let (mut ctl, mut replaces) = (None, false);
        if let Some(e) = &a.done {
            match admit(svc, e).await {
                Ok(c) => (ctl, replaces) = c,
                Err(f) => a = l.refuse(&b, f),
            }
        }
        a.bhs.set_data_len(a.text.len());
        wire.send(&a.bhs, &a.text).await?;
        if a.failed {
            return Err(ConnError::LoginFailed);
        }
        if let Some(e) = a.done {
            return Ok((e, ctl, replaces));
        }
    }
}

/// Before the final Login Response of a normal session: a new session is
/// registered, after the session it reinstates (same initiator port on
/// the same node, RFC 7143 §6.3.5) has ended; a joining connection takes
/// its place in its session (MaxConnections); `true` with it when it
/// replaces a connection (the session is held for it).
async fn admit(
    svc: &Arc<PortalService>,
    e: &Est,
) -> Result<(Option<Arc<SessionCtl>>, bool), LoginFail> {
    let Some(node) = &e.node else {
        return Ok((None, false));
    };
    let sessions = &svc.shared.sessions;
    let name = node.full_name.as_str();
    if !e.leading {
        let ctl = sessions.joinable(e.tsih, &e.initiator, &e.isid, name, svc.tag)?;
        if ctl.reserve(e.cid)? {
            // Connection reinstatement (RFC 7143 §6.3.4): the login logs
            // the old connection out first, its tasks ended unanswered.
            let cid = e.cid;
            let rt = &svc.shared.rt;
            sessions
                .on_session(rt, &ctl, move |s| async move {
                    s.hold();
                    let gone = s.close_cid(cid, Leave::Replaced);
                    s.tasks.ended(|t| gone.contains(&t.conn)).await;
                })
                .await;
            return Ok((Some(ctl), true));
        }
        return Ok((Some(ctl), false));
    }
    // max_sessions, per node: a login over it is answered "out of
    // resources" before any session it would reinstate is touched.
    let max = svc.shared.max_sessions();
    let reinstates = !svc.shared.duplicated_isid();
    if reinstates {
        sessions.room(name, &e.initiator, &e.isid, max)?;
        for old in sessions.same_nexus(&e.initiator, &e.isid, name) {
            sessions.end(&svc.shared.rt, &old).await;
        }
    }
    let ctl = sessions.add(
        e.tsih,
        &e.initiator,
        e.isid,
        name,
        svc.tag,
        e.params,
        e.cid,
        max,
    )?;
    Ok((Some(ctl), false))
}

/// The I_T nexus of a session: the initiator port name `name,i,0xISID`
/// (RFC 7143 §10.1.1), also its TransportID in PERSISTENT RESERVE IN.
fn nexus_name(initiator: &str, isid: &[u8; 6]) -> String {
    let mut id = 0u64;
    isid.iter().for_each(|b| id = id << 8 | *b as u64);
    format!("{initiator},i,0x{id:012x}")
}

/// The node's LUNs on this reactor's channels: one table per session.
/// `physical` is the physical block size LUNs of smaller blocks report
/// (0: their own block size).
fn open_luns(node: &NodeEntry, physical: u32) -> Option<LunTable> {
    let mut luns = Vec::with_capacity(node.luns.len());
    for l in &node.luns {
        match Lun::open(l.cfg.clone(), &l.desc) {
            Ok(lu) => {
                let lu = lu
                    .with_provisioning_page()
                    .with_shared(l.shared.clone())
                    .with_physical_block(physical);
                luns.push((l.lun_id, lu));
            }
            Err(e) => {
                tracing::warn!(
                    "iscsi: LUN {} ({}) has no channel: {e}",
                    l.lun_id,
                    l.bdev_name
                );
                return None;
            }
        }
    }
    Some(LunTable::from_luns(luns))
}
