//! The NVMe-oF/TCP target.
//!
//! - [`subsystem`]: subsystems, namespaces (claimed bdevs), hosts, listeners.
//! - [`ctrlr`]: controllers (properties, features, keep alive, AER).
//! - [`admin`]: admin commands and log pages; [`io`]: NVM I/O commands.
//! - `conn`: one queue pair per TCP connection, owned by one reactor.
//! - [`rpc`]: the control functions with SPDK's method names and params.
//! - [`stats`]: per-reactor (poll group) counters.
//!
//! Listeners (`ustor_net::Listener`) accept on reactor 0 and hand each
//! connection to the next reactor round robin, so a host's queues (one
//! connection each) spread over the reactors; every queue then lives on its
//! reactor with its own bdev channels. The connections of all listeners
//! count against one cap (`max_connections`), and a connection that sends
//! no ICReq within `icreq_timeout_ms` is closed, and so is one with no
//! successful Fabrics Connect within the same time after its ICResp. The
//! subsystem table is
//! control-plane state behind a mutex.

pub mod admin;
mod conn;
pub mod ctrlr;
pub mod io;
pub mod rpc;
pub mod stats;
pub mod subsystem;

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use ustor_bdev::Registry;
use ustor_net::coalesce::CoalesceConfig;
use ustor_net::{Accepted, ConnLimit, ListenerConfig, Placement, Service};
use ustor_runtime::RuntimeHandle;

use crate::wire::{Status, DISCOVERY_NQN};
pub use rpc::*;
pub use subsystem::{ListenAddress, Namespace, SubType, Subsystem};

/// Errors of the control functions; `code()` gives SPDK's JSON-RPC code.
#[derive(Debug, thiserror::Error)]
pub enum NvmfError {
    #[error("transport {0} already exists")]
    TransportExists(String),
    #[error("transport {0} not created (nvmf_create_transport)")]
    NoTransport(String),
    #[error("subsystem {0} already exists")]
    SubsystemExists(String),
    #[error("no subsystem {0}")]
    NoSubsystem(String),
    #[error("invalid parameter {param}: {why}")]
    Invalid { param: &'static str, why: String },
    #[error("namespace {0} already exists")]
    NsExists(u32),
    #[error("no namespace {0}")]
    NoNamespace(u32),
    #[error("bdev: {0}")]
    Bdev(#[from] ustor_bdev::ControlError),
    #[error("cannot listen on {addr}: {err}")]
    Listen { addr: String, err: std::io::Error },
    /// A message to a reactor was not delivered (the runtime stopped).
    #[error("runtime: {0}")]
    Runtime(#[from] ustor_runtime::SendError),
    #[error("NVMe status {0}")]
    Nvme(Status),
}

impl NvmfError {
    /// Negative errno as SPDK reports it in JSON-RPC errors.
    pub fn code(&self) -> i32 {
        -match self {
            NvmfError::TransportExists(_)
            | NvmfError::SubsystemExists(_)
            | NvmfError::NsExists(_) => libc::EEXIST,
            NvmfError::NoTransport(_) | NvmfError::NoSubsystem(_) | NvmfError::NoNamespace(_) => {
                libc::ENODEV
            }
            NvmfError::Invalid { .. } => libc::EINVAL,
            NvmfError::Bdev(e) => e.errno(),
            NvmfError::Listen { err, .. } => err.raw_os_error().unwrap_or(libc::EIO),
            NvmfError::Runtime(_) | NvmfError::Nvme(_) => libc::EIO,
        }
    }

    pub(crate) fn invalid(param: &'static str, why: impl Into<String>) -> NvmfError {
        NvmfError::Invalid {
            param,
            why: why.into(),
        }
    }
}

/// Transport options (`nvmf_create_transport`, SPDK's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct TransportOpts {
    /// Most entries of an I/O queue (Connect SQSIZE + 1), up to
    /// [`ctrlr::MAX_IO_QUEUE_DEPTH`].
    pub max_queue_depth: u16,
    pub max_io_qpairs_per_ctrlr: u16,
    pub in_capsule_data_size: u32,
    pub max_io_size: u32,
    /// MAXH2CDATA advertised in ICResp (SPDK's io_unit_size plays this role).
    #[serde(rename = "io_unit_size")]
    pub max_h2c_data: u32,
    /// Most entries of the admin queue (Connect SQSIZE + 1), up to
    /// [`ctrlr::MAX_AQ_DEPTH`].
    pub max_aq_depth: u16,
    /// Send C2HData with SUCCESS (no CapsuleResp) when the host disabled SQ
    /// flow control; when false a CapsuleResp always follows the data.
    pub c2h_success: bool,
    /// ustor extension: LANoT coalescing of outgoing PDUs.
    pub coalesce: CoalesceConfig,
    /// ustor extension: most connections (queue pairs, admin and I/O) open
    /// at once over all listeners; one more is closed as it is accepted.
    pub max_connections: u32,
    /// ustor extension: milliseconds a new connection has to complete its
    /// ICReq/ICResp exchange before it is closed, and then again to
    /// complete a Fabrics Connect (keep-alive starts only there).
    pub icreq_timeout_ms: u32,
}

impl Default for TransportOpts {
    fn default() -> Self {
        TransportOpts {
            max_queue_depth: ctrlr::MAX_IO_QUEUE_DEPTH,
            max_io_qpairs_per_ctrlr: 127,
            in_capsule_data_size: 8192,
            max_io_size: 131072,
            max_h2c_data: 131072,
            max_aq_depth: ctrlr::MAX_AQ_DEPTH,
            c2h_success: true,
            coalesce: CoalesceConfig::default(),
            max_connections: DEFAULT_MAX_CONNECTIONS,
            icreq_timeout_ms: ustor_net::listener::DEFAULT_HANDSHAKE_TIMEOUT.as_millis() as u32,
        }
    }
}

/// Default connection cap: room for many hosts with a queue per core each.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 1024;

impl TransportOpts {
    /// The I/O queue depth a Connect may ask for: the option within the
    /// connection's preallocated command slots, and at least 2 (SQSIZE 1).
    pub fn io_queue_depth(&self) -> u16 {
        self.max_queue_depth.clamp(2, ctrlr::MAX_IO_QUEUE_DEPTH)
    }

    /// The admin queue depth a Connect may ask for, likewise bounded.
    pub fn admin_queue_depth(&self) -> u16 {
        self.max_aq_depth.clamp(2, ctrlr::MAX_AQ_DEPTH)
    }
}

/// One listening address, shared by the subsystems that listen on it.
struct Listener {
    addr: ListenAddress,
    /// Stops accepting when dropped.
    _listener: ustor_net::Listener,
    /// The accept loop holds it weakly: dropping it ends the loop.
    _service: Arc<ConnService>,
    refs: usize,
}

/// Serves the connections one listener accepts (NVMe/TCP on them).
struct ConnService {
    shared: Weak<Shared>,
    /// The address asked for, until the bound one is known (port 0 asks
    /// for any port: no host can connect there before `bound` is set).
    asked: ListenAddress,
    bound: OnceLock<ListenAddress>,
}

impl Service for ConnService {
    type Fut = Pin<Box<dyn Future<Output = ()>>>;

    fn serve(self: Arc<Self>, c: Accepted) -> Self::Fut {
        // Once per connection, on its reactor.
        Box::pin(async move {
            if let Some(shared) = self.shared.upgrade() {
                let addr = self.bound.get().unwrap_or(&self.asked).clone();
                conn::serve(c, shared, addr).await;
            }
        })
    }
}

pub(crate) struct Shared {
    rt: RuntimeHandle,
    registry: Arc<Registry>,
    transport: Mutex<Option<TransportOpts>>,
    subsystems: Mutex<BTreeMap<String, Arc<Subsystem>>>,
    listeners: Mutex<Vec<Listener>>,
    genctr: AtomicU64,
    /// Round-robin placement of accepted connections on the reactors.
    placement: Arc<Placement>,
    /// The connection count and cap of all listeners.
    limit: Arc<ConnLimit>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    fn opts(&self) -> TransportOpts {
        lock(&self.transport).unwrap_or_default()
    }

    fn subsystem(&self, nqn: &str) -> Option<Arc<Subsystem>> {
        lock(&self.subsystems).get(nqn).cloned()
    }

    fn changed(&self) {
        self.genctr.fetch_add(1, Ordering::AcqRel);
    }
}

impl admin::DiscoverySource for Shared {
    fn entries(&self, hostnqn: &str) -> Vec<(Arc<Subsystem>, ListenAddress)> {
        let subs: Vec<Arc<Subsystem>> = lock(&self.subsystems).values().cloned().collect();
        let mut out = Vec::new();
        for s in subs {
            if s.subtype != SubType::Nvme || !s.host_allowed(hostnqn) {
                continue;
            }
            let ls = s.lock().listeners.clone();
            for l in ls {
                out.push((s.clone(), l));
            }
        }
        out
    }

    fn genctr(&self) -> u64 {
        self.genctr.load(Ordering::Acquire)
    }
}

/// The NVMe-oF target. Cheap to clone; every method is for control-plane
/// threads (tests, the RPC server), never for reactors.
#[derive(Clone)]
pub struct Target {
    shared: Arc<Shared>,
}

impl Target {
    /// A target with the discovery subsystem and no transport yet.
    pub fn new(rt: RuntimeHandle, registry: Arc<Registry>) -> Target {
        let disc = Subsystem::new(
            DISCOVERY_NQN.into(),
            SubType::Discovery,
            String::new(),
            String::new(),
            true,
            0,
            1,
            0xffef,
        );
        let mut subs = BTreeMap::new();
        subs.insert(DISCOVERY_NQN.to_string(), Arc::new(disc));
        Target {
            shared: Arc::new(Shared {
                rt,
                registry,
                transport: Mutex::new(None),
                subsystems: Mutex::new(subs),
                listeners: Mutex::new(Vec::new()),
                genctr: AtomicU64::new(1),
                placement: Arc::new(Placement::default()),
                limit: ConnLimit::new(DEFAULT_MAX_CONNECTIONS as usize),
            }),
        }
    }

    /// Connections currently open.
    pub fn connections(&self) -> usize {
        self.shared.limit.open()
    }

    /// Waits (blocking, control thread) until no connection is open or
    /// `max_wait` passed, on the connection limit's close condition; true
    /// when none is open.
    pub fn wait_idle(&self, max_wait: std::time::Duration) -> bool {
        self.shared.limit.wait_idle(max_wait)
    }

    fn listen(&self, addr: &ListenAddress) -> Result<ListenAddress, NvmfError> {
        let mut ls = lock(&self.shared.listeners);
        if let Some(l) = ls.iter_mut().find(|l| l.addr.same(addr)) {
            l.refs += 1;
            return Ok(l.addr.clone());
        }
        let sa = ustor_net::listener::socket_addr(&addr.traddr, &addr.trsvcid)
            .map_err(|text| NvmfError::invalid("listen_address", format!("bad address {text}")))?;
        let opts = self.shared.opts();
        let mut cfg = ListenerConfig::new("nvmf", self.shared.limit.clone());
        cfg.handshake_timeout = Duration::from_millis(u64::from(opts.icreq_timeout_ms));
        let service = Arc::new(ConnService {
            shared: Arc::downgrade(&self.shared),
            asked: addr.clone(),
            bound: OnceLock::new(),
        });
        let l = ustor_net::Listener::bind(
            &self.shared.rt,
            sa,
            cfg,
            self.shared.placement.clone(),
            &service,
        )
        .map_err(|err| NvmfError::Listen {
            addr: sa.to_string(),
            err,
        })?;
        let bound = l.local_addr();
        let real = ListenAddress {
            trtype: "TCP".into(),
            adrfam: if bound.is_ipv6() { "IPv6" } else { "IPv4" }.into(),
            traddr: bound.ip().to_string(),
            trsvcid: bound.port().to_string(),
        };
        let _ = service.bound.set(real.clone());
        ls.push(Listener {
            addr: real.clone(),
            _listener: l,
            _service: service,
            refs: 1,
        });
        Ok(real)
    }

    fn unlisten(&self, addr: &ListenAddress) {
        let mut ls = lock(&self.shared.listeners);
        if let Some(i) = ls.iter().position(|l| l.addr.same(addr)) {
            ls[i].refs -= 1;
            if ls[i].refs == 0 {
                // Dropping it stops its accept loop.
                ls.remove(i);
            }
        }
    }
}
