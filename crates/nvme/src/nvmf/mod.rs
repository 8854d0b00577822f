//! The NVMe-oF/TCP target.
//!
//! - [`subsystem`]: subsystems, namespaces (claimed bdevs), hosts, listeners.
//! - [`ctrlr`]: controllers (properties, features, keep alive, AER).
//! - [`admin`]: admin commands and log pages; [`io`]: NVM I/O commands.
//! - `conn`: one queue pair per TCP connection, owned by one reactor.
//! - [`rpc`]: the control functions with SPDK's method names and params.
//! - [`stats`]: per-reactor (poll group) counters.
//!
//! Listeners accept on reactor 0 and hand each connection to the next
//! reactor round robin, so a host's queues (one connection each) spread over
//! the reactors; every queue then lives on its reactor with its own bdev
//! channels. The subsystem table is control-plane state behind a mutex.

pub mod admin;
mod conn;
pub mod ctrlr;
pub mod io;
pub mod rpc;
pub mod stats;
pub mod subsystem;

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};
use ustor_bdev::Registry;
use ustor_runtime::{ops, RuntimeHandle};

use crate::coalesce::CoalesceConfig;
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
        }
    }
}

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

struct Listener {
    addr: ListenAddress,
    /// Shared with the accept loop: the socket stays open while either
    /// holds it, so the `shutdown` that stops the loop can never hit a
    /// reused fd number (the loop may be gone already when the runtime
    /// stopped first; another socket of the process may have that number).
    fd: Arc<OwnedFd>,
    refs: usize,
    stop: Arc<AtomicBool>,
}

pub(crate) struct Shared {
    rt: RuntimeHandle,
    registry: Arc<Registry>,
    transport: Mutex<Option<TransportOpts>>,
    subsystems: Mutex<BTreeMap<String, Arc<Subsystem>>>,
    listeners: Mutex<Vec<Listener>>,
    genctr: AtomicU64,
    next_reactor: AtomicUsize,
    connections: AtomicUsize,
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

    fn connection_closed(&self) {
        self.connections.fetch_sub(1, Ordering::AcqRel);
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
                next_reactor: AtomicUsize::new(0),
                connections: AtomicUsize::new(0),
            }),
        }
    }

    /// Connections currently open.
    pub fn connections(&self) -> usize {
        self.shared.connections.load(Ordering::Acquire)
    }

    fn listen(&self, addr: &ListenAddress) -> Result<ListenAddress, NvmfError> {
        let mut ls = lock(&self.shared.listeners);
        if let Some(l) = ls.iter_mut().find(|l| l.addr.same(addr)) {
            l.refs += 1;
            return Ok(l.addr.clone());
        }
        let text = if addr.traddr.contains(':') {
            format!("[{}]:{}", addr.traddr, addr.trsvcid)
        } else {
            format!("{}:{}", addr.traddr, addr.trsvcid)
        };
        let sa: SocketAddr = text
            .parse()
            .map_err(|_| NvmfError::invalid("listen_address", format!("bad address {text}")))?;
        let tcp = TcpListener::bind(sa).map_err(|err| NvmfError::Listen {
            addr: text.clone(),
            err,
        })?;
        let bound = tcp
            .local_addr()
            .map_err(|err| NvmfError::Listen { addr: text, err })?;
        let real = ListenAddress {
            trtype: "TCP".into(),
            adrfam: if bound.is_ipv6() { "IPv6" } else { "IPv4" }.into(),
            traddr: bound.ip().to_string(),
            trsvcid: bound.port().to_string(),
        };
        let fd = Arc::new(OwnedFd::from(tcp));
        let stop = Arc::new(AtomicBool::new(false));
        let (shared, l2, st, fd2) = (self.shared.clone(), real.clone(), stop.clone(), fd.clone());
        self.shared
            .rt
            .spawn_on(0, move || accept_loop(fd2, shared, l2, st))?;
        ls.push(Listener {
            addr: real.clone(),
            fd,
            refs: 1,
            stop,
        });
        Ok(real)
    }

    fn unlisten(&self, addr: &ListenAddress) {
        let mut ls = lock(&self.shared.listeners);
        if let Some(i) = ls.iter().position(|l| l.addr.same(addr)) {
            ls[i].refs -= 1;
            if ls[i].refs == 0 {
                let l = ls.remove(i);
                l.stop.store(true, Ordering::Release);
                // SAFETY: shutdown(2) on a socket `l` keeps open; wakes the
                // pending accept, which then drops its reference.
                unsafe { libc::shutdown(l.fd.as_raw_fd(), libc::SHUT_RDWR) };
            }
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        for l in lock(&self.listeners).drain(..) {
            l.stop.store(true, Ordering::Release);
            // SAFETY: see `unlisten`.
            unsafe { libc::shutdown(l.fd.as_raw_fd(), libc::SHUT_RDWR) };
        }
    }
}

async fn accept_loop(
    listen: Arc<OwnedFd>,
    shared: Arc<Shared>,
    addr: ListenAddress,
    stop: Arc<AtomicBool>,
) {
    let weak = Arc::downgrade(&shared);
    drop(shared);
    loop {
        let accepted = ops::accept(listen.as_raw_fd()).await;
        if stop.load(Ordering::Acquire) {
            break;
        }
        let Some(shared) = weak.upgrade() else { break };
        let client = match accepted {
            // SAFETY: a fresh fd from accept(2), owned by nobody else.
            Ok(c) => unsafe { OwnedFd::from_raw_fd(c) },
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => break,
            Err(e) => {
                tracing::warn!("nvmf: accept failed: {e}");
                ustor_runtime::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = ustor_runtime::net::set_nodelay(client.as_raw_fd());
        shared.connections.fetch_add(1, Ordering::AcqRel);
        let n = shared.rt.num_reactors().max(1);
        let target = shared.next_reactor.fetch_add(1, Ordering::Relaxed) % n;
        let (s, a) = (shared.clone(), addr.clone());
        if shared
            .rt
            .spawn_on(target, move || conn::serve(client, s, a))
            .is_err()
        {
            shared.connection_closed();
        }
    }
}
