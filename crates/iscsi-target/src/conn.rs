//! One connection on its reactor: the login (under the listener's login
//! timeout, with small buffers); then, for a new normal session, its
//! registration (ending the session it reinstates first), the LUN table
//! of the node opened on this reactor and the full feature phase
//! ([`crate::session`]); a connection that joins a session (MC/S or
//! connection reinstatement) stays on the reactor the listener placed it
//! on, in the session's part there (made for it if there is none). A
//! discovery session only answers Text and Logout.

use std::os::fd::AsRawFd;
use std::rc::Rc;
use std::sync::Arc;

use ustor_net::listener::Accepted;
use ustor_scsi_target::{Lun, LunTable};

use crate::exec::Core;
use crate::io::{ConnError, Received, Wire};
use crate::live::ConnInfo;
use crate::login::{Established, Login, LoginFail};
use crate::sess::{Leave, Sess, Window};
use crate::session::Session;
use crate::sessions::{SessionCtl, Ticket};
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
    let (est, admitted) = match conn.handshake(login(&mut wire, &svc, peer)).await {
        Some(Ok(e)) => e,
        Some(Err(e)) => {
            tracing::debug!("iscsi: login ended: {e}");
            return;
        }
        None => return,
    };
    match admitted {
        Some((ctl, ticket)) => part(conn, est, svc, ctl, ticket).await,
        None => discovery(conn, est, svc).await,
    }
}

/// A discovery session: one connection, no LUNs.
async fn discovery(conn: Accepted, est: Est, svc: Arc<PortalService>) {
    let window = Window::new(est.exp_cmdsn, 1, false);
    let sess = Sess::new(LunTable::default(), None, window);
    run_conn(conn, est, svc, sess).await
}

/// A connection of a normal session, in the session's part on this
/// reactor: the one there, or a new one (the LUNs opened on this
/// reactor's channels) that takes over the connection's ticket.
async fn part(
    conn: Accepted,
    est: Est,
    svc: Arc<PortalService>,
    ctl: Arc<SessionCtl>,
    ticket: Ticket,
) {
    let sessions = &svc.shared.sessions;
    if let Some(sess) = sessions.locals(ctl.tsih).into_iter().find(|s| s.open()) {
        drop(ticket);
        return run_conn(conn, est, svc, sess).await;
    }
    if ctl.window.ended() {
        tracing::debug!(
            "iscsi: session {:#x} ended before CID {} joined",
            ctl.tsih,
            est.cid
        );
        ustor_net::recv::shutdown(conn.fd.as_raw_fd());
        return;
    }
    let Some(node) = &est.node else {
        return;
    };
    let Some(mut table) = open_luns(node, svc.shared.physical_block()) else {
        return;
    };
    table.set_nexus(&nexus_name(&est.initiator, &est.isid));
    let sess = Sess::new(table, Some(ctl.clone()), ctl.window.clone());
    let g = sessions.register_local(&ctl, &sess, ticket);
    *sess.guard.borrow_mut() = Some(g);
    run_conn(conn, est, svc, sess).await
}

/// The full feature phase of one connection of `sess` (of a normal
/// session when it has a node).
async fn run_conn(conn: Accepted, est: Est, svc: Arc<PortalService>, sess: Rc<Sess>) {
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
        thread_name: format!("reactor_{}", ustor_runtime::reactor_id()),
        ops: 0,
        bytes_read: 0,
        bytes_written: 0,
    });
    let (counters, _counted) = live.counters();
    let mut wire = Wire::streaming(fd, est.params.max_recv_data as usize);
    wire.header_digest = est.params.header_digest;
    wire.data_digest = est.params.data_digest;
    let digests = (wire.header_digest, wire.data_digest);
    let timeout = crate::session::SEND_TIMEOUT;
    let tx = Tx::new(fd, digests, timeout, est.statsn, sess.window.clone());
    let core = Rc::new(Core::new(tx, est.params, sess.clone(), est.cid));
    sess.attach(&core);
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

/// What a finished login admitted: for a normal session, the session
/// and the ticket that keeps it for this connection.
type Admitted = Option<(Arc<SessionCtl>, Ticket)>;

async fn login(
    wire: &mut Wire,
    svc: &Arc<PortalService>,
    peer: Option<std::net::IpAddr>,
) -> Result<(Est, Admitted), ConnError> {
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
        let mut admitted = None;
        if let Some(e) = &a.done {
            match admit(svc, e).await {
                Ok(c) => admitted = c,
                Err(f) => a = l.refuse(&b, f),
            }
        }
        a.bhs.set_data_len(a.text.len());
        wire.send(&a.bhs, &a.text).await?;
        if a.failed {
            return Err(ConnError::LoginFailed);
        }
        if let Some(e) = a.done {
            return Ok((e, admitted));
        }
    }
}

/// Before the final Login Response of a normal session: a new session is
/// registered (under max_sessions), after the session it reinstates (same
/// initiator port on the same node, RFC 7143 §6.3.5) has ended; a joining
/// connection takes its place in its session (MaxConnections), and one
/// that replaces a connection (same CID) has the old one closed first.
async fn admit(svc: &Arc<PortalService>, e: &Est) -> Result<Admitted, LoginFail> {
    let Some(node) = &e.node else {
        return Ok(None);
    };
    let sessions = &svc.shared.sessions;
    let name = node.full_name.as_str();
    if !e.leading {
        let ctl = sessions.joinable(e.tsih, &e.initiator, &e.isid, name, svc.tag)?;
        // Taken before the old connection goes: the session outlives it.
        let ticket = ctl.ticket(sessions)?;
        if ctl.reserve(e.cid)? {
            // Connection reinstatement (RFC 7143 §6.3.4): the login logs
            // the old connection out first, its tasks ended unanswered,
            // whichever reactor it is on.
            let cid = e.cid;
            sessions
                .on_parts(&svc.shared.rt, ctl.tsih, move |s| async move {
                    let gone = s.close_cid(cid, Leave::Replaced);
                    s.tasks.ended(|t| gone.contains(&t.conn)).await;
                })
                .await;
        }
        return Ok(Some((ctl, ticket)));
    }
    // max_sessions, per node: a login over it is answered "out of
    // resources" before any session it would reinstate is touched.
    let max = svc.shared.max_sessions();
    if !svc.shared.duplicated_isid() {
        sessions.room(name, &e.initiator, &e.isid, max)?;
        for old in sessions.same_nexus(&e.initiator, &e.isid, name) {
            sessions.end(&svc.shared.rt, &old).await;
        }
    }
    let several = e.params.max_connections > 1;
    let window = Window::new(e.exp_cmdsn, node.params.queue_depth, several);
    let (ctl, ticket) = sessions.add(
        e.tsih,
        &e.initiator,
        e.isid,
        name,
        svc.tag,
        e.params,
        e.cid,
        max,
        window,
    )?;
    Ok(Some((ctl, ticket)))
}

/// The I_T nexus of a session: the initiator port name `name,i,0xISID`
/// (RFC 7143 §10.1.1), also its TransportID in PERSISTENT RESERVE IN.
pub(crate) fn nexus_name(initiator: &str, isid: &[u8; 6]) -> String {
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
