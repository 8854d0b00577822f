//! One connection on its reactor: the login (under the listener's login
//! timeout, with small buffers), then, for a normal session, the LUN table
//! of the node opened on this reactor and the full feature phase
//! ([`crate::session`]); a discovery session only answers Text and Logout.

use std::os::fd::AsRawFd;
use std::sync::Arc;

use ustor_net::listener::Accepted;
use ustor_scsi_target::{Lun, LunTable};

use crate::io::{ConnError, Received, Wire};
use crate::live::ConnInfo;
use crate::login::{Established, Login};
use crate::session::Session;
use crate::target::{NodeEntry, PortalService};

/// MaxRecvDataSegmentLength during login (RFC 7143 §13.12 default).
const LOGIN_DATA: usize = 8192;

/// Serves one admitted connection until it ends.
pub(crate) async fn serve(conn: Accepted, svc: Arc<PortalService>) {
    let fd = conn.fd.as_raw_fd();
    let mut wire = Wire::new(fd, LOGIN_DATA);
    let peer = crate::live::peer_ip(&conn.fd);
    let est = match conn.handshake(login(&mut wire, &svc, peer)).await {
        Some(Ok(e)) => e,
        Some(Err(e)) => {
            tracing::debug!("iscsi: login ended: {e}");
            return;
        }
        None => return,
    };
    let table = match &est.node {
        Some(node) => match open_luns(node, svc.shared.physical_block()) {
            Some(mut t) => {
                t.set_nexus(&nexus_name(&est.initiator, &est.isid));
                Some(t)
            }
            None => return,
        },
        None => None,
    };
    let (initiator_addr, target_addr) = crate::live::addrs(&conn.fd);
    let node = est
        .node
        .as_ref()
        .map_or("(discovery)", |n| n.full_name.as_str());
    tracing::info!(
        initiator = %est.initiator,
        node,
        peer = %initiator_addr,
        "iscsi: {} logged in to {node} from {initiator_addr}",
        est.initiator
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
    let qd = est.node.as_ref().map_or(1, |n| n.params.queue_depth);
    wire.header_digest = est.params.header_digest;
    wire.data_digest = est.params.data_digest;
    wire.set_max_recv(est.params.max_recv_data as usize);
    let mut s = Session::new(
        wire,
        est.params,
        table,
        &*svc,
        est.initiator.clone(),
        est.statsn,
        est.exp_cmdsn,
        qd,
    );
    s.count_into(counters);
    s.set_pings(svc.shared.pings());
    s.set_drain(svc.shared.drain.watch());
    if let Err(e) = s.run().await {
        tracing::debug!("iscsi: connection ended: {e}");
    }
    ustor_net::recv::shutdown(fd);
    drop(conn);
}

async fn login(
    wire: &mut Wire,
    svc: &Arc<PortalService>,
    peer: Option<std::net::IpAddr>,
) -> Result<Established<Arc<NodeEntry>>, ConnError> {
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
        a.bhs.set_data_len(a.text.len());
        wire.send(&a.bhs, &a.text).await?;
        if a.failed {
            return Err(ConnError::LoginFailed);
        }
        if let Some(e) = a.done {
            return Ok(e);
        }
    }
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
