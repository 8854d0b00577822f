//! The connections past login, for `iscsi_get_connections`: each one
//! registers after its login and leaves when its guard drops. Touched once
//! per connection, never per command.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

use serde::Serialize;

/// One connection as `iscsi_get_connections` shows it (SPDK's fields).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ConnInfo {
    pub id: u64,
    pub cid: u16,
    pub tsih: u16,
    pub initiator_name: String,
    pub initiator_addr: String,
    pub target_addr: String,
    /// Empty for a discovery session.
    pub target_node_name: String,
}

/// The registry of live connections.
#[derive(Default)]
pub(crate) struct Live {
    conns: Mutex<(u64, BTreeMap<u64, ConnInfo>)>,
}

/// Removes its connection from the registry when dropped.
pub(crate) struct LiveGuard {
    live: Arc<Live>,
    id: u64,
}

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.live.lock().1.remove(&self.id);
    }
}

/// The two ends of a socket ("" when the socket no longer has them).
pub(crate) fn addrs(fd: &OwnedFd) -> (String, String) {
    let show = |a: std::io::Result<SocketAddr>| a.map(|a| a.ip().to_string()).unwrap_or_default();
    match fd.try_clone().map(TcpStream::from) {
        Ok(s) => (show(s.peer_addr()), show(s.local_addr())),
        Err(_) => (String::new(), String::new()),
    }
}

/// The initiator's address, for netmasks (`None` if the socket has none).
pub(crate) fn peer_ip(fd: &OwnedFd) -> Option<std::net::IpAddr> {
    let s = TcpStream::from(fd.try_clone().ok()?);
    s.peer_addr().ok().map(|a| a.ip())
}

impl Live {
    fn lock(&self) -> std::sync::MutexGuard<'_, (u64, BTreeMap<u64, ConnInfo>)> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `info` under a fresh id (its `id` is overwritten).
    pub(crate) fn add(self: &Arc<Self>, mut info: ConnInfo) -> LiveGuard {
        let mut g = self.lock();
        let id = g.0;
        g.0 += 1;
        info.id = id;
        g.1.insert(id, info);
        LiveGuard {
            live: self.clone(),
            id,
        }
    }

    /// The live connections, oldest first.
    pub(crate) fn list(&self) -> Vec<ConnInfo> {
        self.lock().1.values().cloned().collect()
    }
}
