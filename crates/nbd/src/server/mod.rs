//! The NBD server on the ustor runtime: listener, exports, connections,
//! stats, and the control-plane entry points (`nbd_server_start`,
//! `nbd_export_create`, `nbd_export_delete`, `nbd_get_exports`,
//! `nbd_get_stats`) as plain functions with serde parameter/result types.
//!
//! The server runs on the connection layer (`ustor_net`): its listener
//! accepts on reactor 0 under `max_connections` and a handshake timeout and
//! hands connections round-robin to the reactors; each connection then lives
//! on one reactor ([`conn`]), its transmission phase driven by the layer's
//! connection driver with NBD as a sans-IO protocol (`proto`). Exports are
//! bdevs ([`bdev`]); NBD has no storage seam of its own. The export table is
//! control-plane state behind a mutex, touched only by the handshake and by
//! RPCs, never per I/O.

pub mod bdev;
mod conn;
mod proto;
mod stats;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use ustor_bdev::{BdevError, ControlError, Registry};
use ustor_net::listener::{Accepted, ConnLimit, Listener, ListenerConfig, Placement, Service};
use ustor_runtime::{RuntimeHandle, SendError};

pub use bdev::{BdevExportChannel, BdevSource};
pub use conn::{MAX_OUTSTANDING, MAX_OUTSTANDING_BYTES, MAX_WORKERS};
pub use stats::{NbdConnection, NbdStats};
pub use ustor_net::COPY_MAX;

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
    /// Opening or claiming the export's bdev failed (`Claimed` when another
    /// user holds it).
    #[error("bdev: {0}")]
    Bdev(#[from] ControlError),
    #[error("bdev: {0}")]
    BdevIo(#[from] BdevError),
    #[error("runtime unavailable: {0}")]
    Runtime(#[from] SendError),
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

/// One export: its configuration and the bdev behind it.
pub struct ExportEntry {
    pub name: String,
    pub bdev_name: String,
    pub read_only: bool,
    pub description: String,
    pub source: BdevSource,
}

impl ExportEntry {
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
pub(crate) struct Shared {
    rt: RuntimeHandle,
    limits: Limits,
    exports: Mutex<BTreeMap<String, Arc<ExportEntry>>>,
    conns: Arc<ConnLimit>,
    /// Time a client has to finish option haggling.
    handshake_timeout: Mutex<Duration>,
    /// Set by `drain`: requests are answered `ESHUTDOWN`, new connections
    /// closed.
    draining: Arc<AtomicBool>,
}

impl ExportCatalog for Shared {
    type Handle = Arc<ExportEntry>;

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

impl Service for Shared {
    type Fut = std::pin::Pin<Box<dyn std::future::Future<Output = ()>>>;

    fn serve(self: Arc<Self>, conn: Accepted) -> Self::Fut {
        Box::pin(conn::serve(conn, self))
    }

    fn on_accept(&self) {
        stats::bump(|c| stats::inc(&c.connections_accepted, 1));
    }

    fn on_reject(&self) {
        stats::bump(|c| stats::inc(&c.connections_rejected, 1));
    }
}

/// The NBD server. Cheap to share (`Arc` inside); all methods are for
/// control-plane threads (they may block briefly on the export table).
pub struct NbdServer {
    shared: Arc<Shared>,
    listener: Mutex<Option<Listener>>,
}

impl NbdServer {
    pub fn new(rt: RuntimeHandle) -> Self {
        Self::with_limits(rt, Limits::default())
    }

    pub fn with_limits(rt: RuntimeHandle, limits: Limits) -> Self {
        Self {
            shared: Arc::new(Shared {
                rt,
                limits,
                exports: Mutex::new(BTreeMap::new()),
                conns: ConnLimit::new(default_max_connections()),
                handshake_timeout: Mutex::new(ustor_net::listener::DEFAULT_HANDSHAKE_TIMEOUT),
                draining: Arc::new(AtomicBool::new(false)),
            }),
            listener: Mutex::new(None),
        }
    }

    /// `nbd_server_start`: listens and accepts on reactor 0; connections are
    /// placed round-robin on the reactors, at most `max_connections` open.
    pub fn start(&self, params: &ServerStartParams) -> Result<ServerStartResult, NbdServerError> {
        let mut listener = self
            .listener
            .lock()
            .map_err(|_| NbdServerError::NotStarted)?;
        if listener.is_some() {
            return Err(NbdServerError::AlreadyStarted);
        }
        let a = &params.listen_address;
        let addr = ustor_net::listener::socket_addr(&a.traddr, &a.trsvcid)
            .map_err(NbdServerError::BadAddress)?;
        self.shared.conns.set_max(params.max_connections);
        self.shared.draining.store(false, Ordering::SeqCst);
        let mut cfg = ListenerConfig::new("nbd", self.shared.conns.clone());
        cfg.handshake_timeout = *self
            .shared
            .handshake_timeout
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let l = Listener::bind(
            &self.shared.rt,
            addr,
            cfg,
            Arc::new(Placement::default()),
            &self.shared,
        )
        .map_err(NbdServerError::Listen)?;
        let bound = l.local_addr();
        *listener = Some(l);
        Ok(ServerStartResult {
            traddr: bound.ip().to_string(),
            trsvcid: bound.port().to_string(),
        })
    }

    /// Time a client has to finish the handshake (from the next `start`
    /// on; 10 s by default): a connection still haggling then is closed and
    /// counted in `handshakes_failed`.
    pub fn set_handshake_timeout(&self, d: Duration) {
        *self
            .shared
            .handshake_timeout
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = d;
    }

    /// Stops accepting; established connections run on until they close.
    pub fn stop(&self) {
        if let Ok(mut l) = self.listener.lock() {
            if let Some(l) = l.take() {
                l.stop();
            }
        }
    }

    /// Ends the server's service without losing an acknowledged request:
    /// stops accepting; from now on every request is answered with NBD's
    /// `ESHUTDOWN` instead of executed; waits until every request received
    /// before has been answered; then ends reading on every connection, so
    /// each sends its last replies and closes. At most `max_wait` in all;
    /// true when nothing was left in flight and every connection closed.
    pub fn drain(&self, max_wait: Duration) -> Result<bool, NbdServerError> {
        // Before the reactor round-trips below, which order it against
        // the requests each reactor counts in flight.
        self.shared.draining.store(true, Ordering::SeqCst);
        self.stop();
        let end = Instant::now() + max_wait;
        let idle = self.wait_until(end, || {
            Ok(self
                .shared
                .rt
                .call_all(|_| stats::in_flight())?
                .iter()
                .sum::<u64>()
                == 0)
        })?;
        let server = Arc::as_ptr(&self.shared) as usize;
        self.shared
            .rt
            .call_all(move |_| conn::shut_reading(server))?;
        let closed = self.wait_until(end, || Ok(self.shared.conns.open() == 0))?;
        Ok(idle && closed)
    }

    /// Polls `cond` until it holds (true) or `end` passes (false).
    fn wait_until(
        &self,
        end: Instant,
        mut cond: impl FnMut() -> Result<bool, NbdServerError>,
    ) -> Result<bool, NbdServerError> {
        // Budget: bounded by `end`; each round asks every reactor once.
        loop {
            if cond()? {
                return Ok(true);
            }
            if Instant::now() >= end {
                return Ok(false);
            }
            // Requests finish in microseconds to milliseconds; the reactors
            // are asked again shortly rather than notifying the control
            // plane from the I/O path.
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The bound listen address, once started.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.lock().ok()?.as_ref().map(|l| l.local_addr())
    }

    /// `nbd_export_create`: opens `bdev_name` (read-only if asked), claims it
    /// for this export, and publishes the export.
    pub fn export_create(
        &self,
        registry: &Arc<Registry>,
        params: &ExportCreateParams,
    ) -> Result<(), NbdServerError> {
        check_export_params(params)?;
        let desc = registry.open(&params.bdev_name, !params.read_only, |_| {})?;
        if !desc.info().block_size.is_power_of_two() {
            return Err(NbdServerError::InvalidExport(
                "bdev block size is not a power of two",
            ));
        }
        desc.claim(&format!("nbd export {}", params.name))?;
        // From here on the source releases the claim when dropped (on error
        // below, or when the export and its last connection are gone).
        let source = BdevSource::new(desc);
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
        Ok(self.shared.rt.call_all(|_| stats::snapshot())?)
    }

    /// `nbd_get_connections`: the connections in transmission, with their
    /// counters, gathered on each reactor (oldest first).
    pub fn get_connections(&self) -> Result<Vec<NbdConnection>, NbdServerError> {
        let server = Arc::as_ptr(&self.shared) as usize;
        let per = self.shared.rt.call_all(move |r| conn::live(server, r))?;
        let mut all: Vec<NbdConnection> = per.into_iter().flatten().collect();
        all.sort_by_key(|c| c.id);
        Ok(all)
    }

    /// Connections currently open.
    pub fn connections(&self) -> usize {
        self.shared.conns.open()
    }
}

/// Name and description limits of `nbd_export_create`.
fn check_export_params(params: &ExportCreateParams) -> Result<(), NbdServerError> {
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
    Ok(())
}

impl Drop for NbdServer {
    fn drop(&mut self) {
        self.stop();
    }
}
