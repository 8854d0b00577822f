//! The NBD server on the ustor runtime: listener, exports, connections,
//! stats, and the control-plane entry points (`nbd_server_start`,
//! `nbd_export_create`, `nbd_export_delete`, `nbd_get_exports`,
//! `nbd_get_stats`) as plain functions with serde parameter/result types.
//!
//! Connections are accepted on reactor 0 and handed round-robin to the
//! reactors; each connection then lives on one reactor ([`conn`]). The export
//! table is control-plane state behind a mutex, touched only by the handshake
//! and by RPCs, never per I/O.

pub mod backend;
pub mod bdev;
mod conn;
mod io;
mod stats;

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use ustor_runtime::{ops, RuntimeHandle};

pub use backend::{Channel, ExportSource, MemSource};
pub use bdev::{BdevExportChannel, BdevSource};
pub use conn::{COPY_MAX, MAX_OUTSTANDING, MAX_OUTSTANDING_BYTES, MAX_WORKERS};
pub use stats::NbdStats;

use crate::export::{ExportCatalog, ExportFeatures, ExportInfo};
use crate::negotiation::Limits;

/// Errors of the control-plane functions.
#[derive(Debug, thiserror::Error)]
pub enum NbdServerError {
    #[error("NBD server already started")]
    AlreadyStarted,
    #[error("NBD server not started")]
    NotStarted,
    #[error("invalid listen address {0}")]
    BadAddress(String),
    #[error("cannot listen: {0}")]
    Listen(#[source] std::io::Error),
    #[error("export {0} already exists")]
    ExportExists(String),
    #[error("no export named {0}")]
    NoSuchExport(String),
    #[error("invalid export: {0}")]
    InvalidExport(&'static str),
    #[error("bdev: {0}")]
    Bdev(String),
    #[error("runtime unavailable: {0}")]
    Runtime(String),
}

/// `listen_address` of `nbd_server_start` (SPDK-style transport address).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListenAddress {
    pub traddr: String,
    pub trsvcid: String,
}

/// Parameters of `nbd_server_start`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerStartParams {
    pub listen_address: ListenAddress,
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
}

fn default_max_connections() -> usize {
    256
}

/// Result of `nbd_server_start`: the bound address (port 0 picks one).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerStartResult {
    pub traddr: String,
    pub trsvcid: String,
}

/// Parameters of `nbd_export_create`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportCreateParams {
    pub name: String,
    pub bdev_name: String,
    #[serde(default)]
    pub read_only: bool,
    #[serde(default)]
    pub description: String,
}

/// Parameters of `nbd_export_delete`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportDeleteParams {
    pub name: String,
}

/// One entry of `nbd_get_exports`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportDescription {
    pub name: String,
    pub bdev_name: String,
    pub read_only: bool,
    pub description: String,
    pub size_bytes: u64,
    pub block_size: u32,
}

/// One export: its configuration and the device source behind it.
pub struct ExportEntry<S> {
    pub name: String,
    pub bdev_name: String,
    pub read_only: bool,
    pub description: String,
    pub source: S,
}

impl<S: ExportSource> ExportEntry<S> {
    fn features(&self) -> ExportFeatures {
        let mut f = self.source.features();
        f.read_only |= self.read_only;
        f
    }

    fn info(&self) -> ExportInfo {
        ExportInfo {
            name: self.name.clone(),
            description: self.description.clone(),
            size_bytes: self.source.size_bytes(),
            block_sizes: self.source.block_sizes(),
            features: self.features(),
        }
    }
}

/// State shared by the listener, the connections and the control plane.
pub(crate) struct Shared<S> {
    rt: RuntimeHandle,
    limits: Limits,
    exports: Mutex<BTreeMap<String, Arc<ExportEntry<S>>>>,
    max_connections: AtomicUsize,
    connections: AtomicUsize,
    next_reactor: AtomicUsize,
    stopping: AtomicBool,
}

impl<S> Shared<S> {
    fn connection_closed(&self) {
        self.connections.fetch_sub(1, Ordering::AcqRel);
    }
}

impl<S: ExportSource> ExportCatalog for Shared<S> {
    type Handle = Arc<ExportEntry<S>>;

    fn lookup(&self, name: &str) -> Option<(Self::Handle, ExportInfo)> {
        let exports = self.exports.lock().ok()?;
        // The empty name is the default export: the first one by name.
        let entry = if name.is_empty() {
            exports.values().next()
        } else {
            exports.get(name)
        }?;
        Some((entry.clone(), entry.info()))
    }

    fn list(&self, limit: usize, f: &mut dyn FnMut(&str, &str)) {
        if let Ok(exports) = self.exports.lock() {
            for e in exports.values().take(limit) {
                f(&e.name, &e.description);
            }
        }
    }
}

struct Listener {
    fd: RawFd,
    addr: SocketAddr,
}

/// The NBD server. Cheap to share (`Arc` inside); all methods are for
/// control-plane threads (they may block briefly on the export table).
pub struct NbdServer<S: ExportSource> {
    shared: Arc<Shared<S>>,
    listener: Mutex<Option<Listener>>,
}

impl<S: ExportSource> NbdServer<S> {
    pub fn new(rt: RuntimeHandle) -> Self {
        Self::with_limits(rt, Limits::default())
    }

    pub fn with_limits(rt: RuntimeHandle, limits: Limits) -> Self {
        Self {
            shared: Arc::new(Shared {
                rt,
                limits,
                exports: Mutex::new(BTreeMap::new()),
                max_connections: AtomicUsize::new(default_max_connections()),
                connections: AtomicUsize::new(0),
                next_reactor: AtomicUsize::new(0),
                stopping: AtomicBool::new(false),
            }),
            listener: Mutex::new(None),
        }
    }

    /// `nbd_server_start`: listens and accepts on reactor 0.
    pub fn start(&self, params: &ServerStartParams) -> Result<ServerStartResult, NbdServerError> {
        let mut listener = self
            .listener
            .lock()
            .map_err(|_| NbdServerError::NotStarted)?;
        if listener.is_some() {
            return Err(NbdServerError::AlreadyStarted);
        }
        let a = &params.listen_address;
        let text = if a.traddr.contains(':') {
            format!("[{}]:{}", a.traddr, a.trsvcid)
        } else {
            format!("{}:{}", a.traddr, a.trsvcid)
        };
        let addr: SocketAddr = text
            .parse()
            .map_err(|_| NbdServerError::BadAddress(text.clone()))?;
        let tcp = TcpListener::bind(addr).map_err(NbdServerError::Listen)?;
        let bound = tcp.local_addr().map_err(NbdServerError::Listen)?;
        let fd = tcp.into_raw_fd();
        self.shared
            .max_connections
            .store(params.max_connections.max(1), Ordering::Release);
        self.shared.stopping.store(false, Ordering::Release);
        let shared = self.shared.clone();
        if let Err(e) = self.shared.rt.spawn_on(0, move || accept_loop(fd, shared)) {
            // SAFETY: fd came from into_raw_fd above and is not used elsewhere.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
            return Err(NbdServerError::Runtime(e.to_string()));
        }
        *listener = Some(Listener { fd, addr: bound });
        Ok(ServerStartResult {
            traddr: bound.ip().to_string(),
            trsvcid: bound.port().to_string(),
        })
    }

    /// Stops accepting; established connections run on until they close.
    pub fn stop(&self) {
        if let Ok(mut l) = self.listener.lock() {
            if let Some(l) = l.take() {
                self.shared.stopping.store(true, Ordering::Release);
                // Wakes the pending accept, which then closes the socket.
                // SAFETY: shutdown(2) on the listening socket we own.
                unsafe { libc::shutdown(l.fd, libc::SHUT_RDWR) };
            }
        }
    }

    /// The bound listen address, once started.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.lock().ok()?.as_ref().map(|l| l.addr)
    }

    /// `nbd_export_create` with the device already opened by the caller
    /// (the bdev layer claims the bdev and passes its source here).
    pub fn export_create(
        &self,
        params: &ExportCreateParams,
        source: S,
    ) -> Result<(), NbdServerError> {
        if params.name.len() > crate::wire::MAX_STRING_LEN || params.name.contains('\0') {
            return Err(NbdServerError::InvalidExport(
                "name longer than 4096 bytes or with NUL",
            ));
        }
        if params.description.len() > crate::wire::MAX_STRING_LEN {
            return Err(NbdServerError::InvalidExport(
                "description longer than 4096 bytes",
            ));
        }
        if !source.block_sizes().is_valid() {
            return Err(NbdServerError::InvalidExport(
                "device block sizes break the NBD size rules",
            ));
        }
        let mut exports = self
            .shared
            .exports
            .lock()
            .map_err(|_| NbdServerError::NotStarted)?;
        if exports.contains_key(&params.name) {
            return Err(NbdServerError::ExportExists(params.name.clone()));
        }
        let entry = ExportEntry {
            name: params.name.clone(),
            bdev_name: params.bdev_name.clone(),
            read_only: params.read_only,
            description: params.description.clone(),
            source,
        };
        exports.insert(params.name.clone(), Arc::new(entry));
        Ok(())
    }

    /// `nbd_export_delete`: new connections no longer see the export;
    /// connections already serving it keep their channel until they close.
    pub fn export_delete(&self, params: &ExportDeleteParams) -> Result<(), NbdServerError> {
        let mut exports = self
            .shared
            .exports
            .lock()
            .map_err(|_| NbdServerError::NotStarted)?;
        exports
            .remove(&params.name)
            .map(|_| ())
            .ok_or_else(|| NbdServerError::NoSuchExport(params.name.clone()))
    }

    /// `nbd_get_exports`.
    pub fn get_exports(&self) -> Vec<ExportDescription> {
        let Ok(exports) = self.shared.exports.lock() else {
            return Vec::new();
        };
        exports
            .values()
            .map(|e| ExportDescription {
                name: e.name.clone(),
                bdev_name: e.bdev_name.clone(),
                read_only: e.read_only,
                description: e.description.clone(),
                size_bytes: e.source.size_bytes(),
                block_size: e.source.block_sizes().min,
            })
            .collect()
    }

    /// `nbd_get_stats`: counters summed over reactors.
    pub fn get_stats(&self) -> Result<NbdStats, NbdServerError> {
        let mut total = NbdStats::default();
        for s in &self.get_stats_per_reactor()? {
            total.add(s);
        }
        Ok(total)
    }

    /// Each reactor's own counters, indexed by reactor (where connections
    /// landed, and what each reactor served).
    pub fn get_stats_per_reactor(&self) -> Result<Vec<NbdStats>, NbdServerError> {
        self.shared
            .rt
            .call_all(|_| stats::snapshot())
            .map_err(|e| NbdServerError::Runtime(e.to_string()))
    }

    /// Connections currently open.
    pub fn connections(&self) -> usize {
        self.shared.connections.load(Ordering::Acquire)
    }
}

impl<S: ExportSource> Drop for NbdServer<S> {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Accepts connections until the server stops; runs on reactor 0.
async fn accept_loop<S: ExportSource>(fd: RawFd, shared: Arc<Shared<S>>) {
    // SAFETY: the listener fd is owned by this loop from here on.
    let listen = unsafe { OwnedFd::from_raw_fd(fd) };
    loop {
        let accepted = ops::accept(listen.as_raw_fd()).await;
        if shared.stopping.load(Ordering::Acquire) {
            break;
        }
        let client = match accepted {
            // SAFETY: a fresh fd from accept(2), owned by nobody else.
            Ok(c) => unsafe { OwnedFd::from_raw_fd(c) },
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => break,
            Err(e) => {
                tracing::warn!("nbd: accept failed: {e}");
                // Out of fds and the like: back off instead of spinning.
                ustor_runtime::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        let max = shared.max_connections.load(Ordering::Acquire);
        if shared.connections.fetch_add(1, Ordering::AcqRel) >= max {
            shared.connections.fetch_sub(1, Ordering::AcqRel);
            stats::bump(|c| stats::inc(&c.connections_rejected, 1));
            continue;
        }
        stats::bump(|c| stats::inc(&c.connections_accepted, 1));
        let _ = ustor_runtime::net::set_nodelay(client.as_raw_fd());
        let n = shared.rt.num_reactors().max(1);
        let target = shared.next_reactor.fetch_add(1, Ordering::Relaxed) % n;
        let s = shared.clone();
        if shared
            .rt
            .spawn_on(target, move || conn::serve(client, s))
            .is_err()
        {
            // The message, and the fd inside it, was dropped (so closed).
            shared.connections.fetch_sub(1, Ordering::AcqRel);
        }
    }
}
