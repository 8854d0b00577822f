//! The connections past login, for `iscsi_get_connections`: each one
//! registers after its login and leaves when its guard drops. Touched once
//! per connection, never per command. Each connection's command counters
//! live on its reactor (plain `Cell`s in a thread-local list) and are read
//! there when the connections are listed.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::OwnedFd;
use std::rc::Rc;
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
    /// The reactor it runs on (`reactor_N`; SPDK names its poll group's
    /// thread here).
    pub thread_name: String,
    /// SCSI commands answered on this connection (ustor's own field).
    pub ops: u64,
    /// Bytes sent as Data-In, and bytes of the write commands answered.
    pub bytes_read: u64,
    pub bytes_written: u64,
}

/// One connection's command counters; only its reactor touches them.
#[derive(Default)]
pub(crate) struct ConnCounters {
    ops: Cell<u64>,
    bytes_read: Cell<u64>,
    bytes_written: Cell<u64>,
}

impl ConnCounters {
    /// One command answered, with its data bytes in each direction.
    pub(crate) fn note(&self, read: u64, written: u64) {
        let add = |c: &Cell<u64>, n: u64| c.set(c.get().wrapping_add(n));
        add(&self.ops, 1);
        add(&self.bytes_read, read);
        add(&self.bytes_written, written);
    }
}

/// (registry, connection id, counters) of this reactor's connections.
type Counted = (usize, u64, Rc<ConnCounters>);

thread_local! {
    static COUNTERS: RefCell<Vec<Counted>> = const { RefCell::new(Vec::new()) };
}

/// Takes the connection's counters off this reactor's list when dropped.
pub(crate) struct CountGuard(usize, u64);

impl Drop for CountGuard {
    fn drop(&mut self) {
        let me = (self.0, self.1);
        COUNTERS.with(|c| c.borrow_mut().retain(|e| (e.0, e.1) != me));
    }
}

/// `(id, ops, bytes_read, bytes_written)` of this reactor's connections of
/// the registry `live` (its address).
pub(crate) fn counters_here(live: usize) -> Vec<(u64, u64, u64, u64)> {
    COUNTERS.with(|c| {
        c.borrow()
            .iter()
            .filter(|e| e.0 == live)
            .map(|(_, id, k)| (*id, k.ops.get(), k.bytes_read.get(), k.bytes_written.get()))
            .collect()
    })
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

impl LiveGuard {
    /// Lists counters for this connection on the current (its) reactor.
    pub(crate) fn counters(&self) -> (Rc<ConnCounters>, CountGuard) {
        let key = Arc::as_ptr(&self.live) as usize;
        let k = Rc::new(ConnCounters::default());
        COUNTERS.with(|c| c.borrow_mut().push((key, self.id, k.clone())));
        (k, CountGuard(key, self.id))
    }
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
