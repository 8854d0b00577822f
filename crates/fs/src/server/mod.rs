//! The file service on the reactors: volumes (a region opened as a file
//! system, `fs_create`), their TCP exports (`fs_export`, a listener of the
//! connection layer with a connection cap and a handshake timeout), their
//! counters (`fs_get_stats`) and deletion (`fs_delete`), as plain functions
//! with serde parameter and result types; the RPC layer wraps them.
//!
//! A volume's file system sits behind a mutex: connections on several
//! reactors take it to plan a read or a write, and to run metadata
//! requests and write commits (which persist with msync) on a region in
//! memory (tmpfs) when it is free; the sync pool ([`offload`]) takes it
//! for those on a region that can fault (a device, a disk file) or when a
//! reactor found it busy; never while a payload is on the wire. Payloads go between the
//! socket and the mapped region directly ([`conn`]).

mod conn;
mod offload;
mod xdp;
mod zc;

pub use xdp::XdpStatsInfo;

pub use conn::replay_session;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};
use ustor_net::listener::{Accepted, ConnLimit, Listener, ListenerConfig, Placement, Service};
use ustor_runtime::RuntimeHandle;

use crate::media::{MappedFile, Media};
use crate::serve::Stats;
use crate::{Fs, FsError};

/// Errors of the control-plane functions; `errno` is what the RPC answers.
#[derive(Debug, thiserror::Error)]
pub enum FsServerError {
    #[error("file system {0} already exists")]
    Exists(String),
    #[error("no file system named {0}")]
    NoSuch(String),
    #[error("file system {0} is already exported")]
    AlreadyExported(String),
    #[error("file system {0} has {1} open connections")]
    Busy(String, usize),
    #[error("invalid parameter: {0}")]
    Invalid(String),
    #[error("transport {0} is not supported")]
    Transport(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Fs(#[from] FsError),
}

impl FsServerError {
    pub fn errno(&self) -> i32 {
        match self {
            Self::Exists(_) | Self::AlreadyExported(_) => libc::EEXIST,
            Self::NoSuch(_) => libc::ENODEV,
            Self::Busy(..) => libc::EBUSY,
            Self::Invalid(_) => libc::EINVAL,
            Self::Transport(_) => libc::EOPNOTSUPP,
            Self::Io(e) => e.raw_os_error().unwrap_or(libc::EIO),
            Self::Fs(FsError::BadMagic | FsError::TooSmall(_)) => libc::EINVAL,
            Self::Fs(e) => e.errno(),
        }
    }
}

/// Parameters of `fs_create`: the region file (opened when it holds a file
/// system, created and formatted with `size` bytes when it does not exist).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateParams {
    pub name: String,
    pub path: String,
    #[serde(default)]
    pub size: Option<u64>,
}

fn default_transport() -> String {
    "tcp".into()
}
fn default_max_connections() -> usize {
    64
}

/// Parameters of `fs_export`. The secret comes inline or from a file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportParams {
    pub name: String,
    /// `ip:port` (port 0 picks one), or `ip` for
    /// [`crate::proto::DEFAULT_PORT`].
    pub listen: String,
    #[serde(default = "default_transport")]
    pub transport: String,
    #[serde(default)]
    pub read_only: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_file: Option<String>,
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// The one-copy ablation (RZCFS's comparison): a write's payload is
    /// received into a buffer and copied into the region, as a server
    /// without in-place receive would. Off: the zero-copy path.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub copy_writes: bool,
    /// Read replies of at least [`SEND_ZC_MIN`] bytes leave with
    /// SENDMSG_ZC, straight from the region's pages, when the kernel has
    /// it (probed; a plain send otherwise). Off by default: on loopback
    /// the kernel copies anyway and the notification costs a completion.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub send_zc: bool,
    /// Transport "xdp": poll the receive ring without sleeping (one core
    /// spins; lowest latency).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub busy_poll: bool,
    /// Transport "xdp": where the XDP program runs, "generic" (default,
    /// any interface) or "native" (the driver's hook).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xdp_mode: Option<String>,
    /// Transport "xdp": the MTU the export's frames may use (default
    /// 1500; the interface's must be at least this). Larger frames carry
    /// a 1 MiB payload in fewer of them (up to 3500 on a veth with an XDP
    /// program); a client on a smaller MTU is served at its own size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u32>,
    /// Transport "xdp": after its last frame, the export keeps polling
    /// this many microseconds before it sleeps on the socket (a request
    /// that comes within it costs no wake-up). Default 0: it sleeps
    /// after a fixed count of empty passes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spin_us: Option<u32>,
}

/// The smallest read reply sent zero-copy when the export asks for it:
/// below about this size pinning the pages and the second completion cost
/// more than the copy they save (the kernel's MSG_ZEROCOPY guidance).
pub const SEND_ZC_MIN: usize = 16 << 10;

/// Parameters of `fs_delete`, and of `fs_get_stats` (name optional there).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NameParams {
    #[serde(default)]
    pub name: Option<String>,
}

/// One entry of `fs_get_exports`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportInfo {
    pub name: String,
    pub path: String,
    pub size: u64,
    /// The bound address (`None`: created, not exported).
    pub listen: Option<String>,
    pub transport: Option<String>,
    pub read_only: bool,
    pub connections: usize,
}

/// One entry of `fs_get_stats` (`serve::Stats` plus the connection layer's
/// counts). `copied_bytes` counts every payload byte we copied (0 on the
/// zero-copy path); `kernel_copied_bytes` the payload bytes the kernel
/// copied between socket buffers and the region (plain send and receive).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatsInfo {
    pub name: String,
    pub requests: u64,
    pub errors: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub copied_bytes: u64,
    pub kernel_copied_bytes: u64,
    /// Zero-copy sends (SENDMSG_ZC, `send_zc`) whose notification came,
    /// those of them the kernel reported it copied after all (every one
    /// on loopback), and the read payload bytes that left with no copy.
    pub zero_copy_sends: u64,
    pub zero_copy_sends_copied: u64,
    pub zero_copy_bytes: u64,
    pub connections: usize,
    pub connections_accepted: u64,
    pub connections_rejected: u64,
    pub handshake_timeouts: u64,
    pub auth_failures: u64,
    /// The most requests one connection had in flight (received, reply not
    /// yet sent) since the export started.
    pub max_requests_in_flight: u64,
    /// Reads served off the reactor: planned on the sync pool because the
    /// volume was busy (a commit holding it), or with their pages brought
    /// in from the device there first (a region on a block device or a
    /// disk file whose pages were not in memory).
    pub reads_offloaded: u64,
    /// Requests run on the sync pool rather than the reactor (each costs
    /// two thread wake-ups): metadata changes, fsyncs and write commits on
    /// a region that can fault, anything that found the volume busy, and
    /// the reads in `reads_offloaded`.
    pub requests_offloaded: u64,
    /// The raw-Ethernet transport's counters (xdp exports only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xdp: Option<XdpStatsInfo>,
}

/// A file system served from a mapped region.
pub struct Volume {
    pub name: String,
    pub path: PathBuf,
    pub size: u64,
    inner: Mutex<Inner>,
    /// The region's first byte: the mapping never moves while `inner`
    /// holds the file system, and payloads go to and from it directly.
    base: *mut u8,
    /// Pages of the region can be out of memory (a block device, a file
    /// on a disk): a read checks before sending from the reactor.
    may_fault: bool,
}

// SAFETY: `base` points into the mapping `inner` owns; it is only
// dereferenced for ranges the file system planned under the lock (see
// conn.rs), so sharing the pointer between reactors is sound.
unsafe impl Send for Volume {}
// SAFETY: as above; all other state is behind the mutex.
unsafe impl Sync for Volume {}

pub(crate) struct Inner {
    pub fs: Fs,
    pub st: Stats,
}

impl Volume {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The lock when it is free now (a reactor never waits for it).
    pub(crate) fn try_lock(&self) -> Option<MutexGuard<'_, Inner>> {
        match self.inner.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    fn open(name: &str, path: &Path, size: Option<u64>) -> Result<Volume, FsServerError> {
        // A block device always exists: it is opened, never formatted here
        // (`ustor fs format DEVICE` does that, on purpose).
        let mut fs = if path.exists() {
            // Recovery touches metadata only; no read-around for it (a
            // no-op on tmpfs, whose pages are all in memory).
            let mut m = MappedFile::open(path)?;
            let r = m.bytes_mut();
            crate::media::readaround(r.as_mut_ptr(), r.len(), false);
            Fs::open(Box::new(m))?
        } else {
            let size = size.ok_or_else(|| {
                FsServerError::Invalid(format!(
                    "{} does not exist and no size was given",
                    path.display()
                ))
            })?;
            Fs::format(Box::new(MappedFile::create(path, size)?))?
        };
        let region = fs.region_mut();
        let (base, len) = (region.as_mut_ptr(), region.len() as u64);
        // Reads and writes stream again (the pool's page-ins of a 1 MiB
        // read want read-ahead).
        crate::media::readaround(base, len as usize, true);
        Ok(Volume {
            name: name.into(),
            path: path.into(),
            size: len,
            inner: Mutex::new(Inner {
                fs,
                st: Stats::default(),
            }),
            base,
            // Asked once the region exists: statfs of a missing path (a
            // region fs_create makes above) answers "may fault".
            may_fault: crate::media::may_fault(path),
        })
    }
}

/// One export's connection service (the listener's [`Service`]).
pub(crate) struct ExportSvc {
    pub vol: Arc<Volume>,
    pub read_only: bool,
    /// [`ExportParams::copy_writes`].
    pub copy_writes: bool,
    /// [`ExportParams::send_zc`].
    pub send_zc: bool,
    pub secret: Vec<u8>,
    pub auth_failures: AtomicU64,
    /// The most requests one connection had received and not yet answered
    /// (its replies not yet handed to the socket): above 1 when a client
    /// pipelines and the server overlaps them.
    pub max_in_flight: AtomicU64,
    /// Reads served off the reactor (`StatsInfo::reads_offloaded`).
    pub reads_offloaded: AtomicU64,
    /// Requests run on the sync pool (`StatsInfo::requests_offloaded`).
    pub offloaded: AtomicU64,
}

impl Service for ExportSvc {
    type Fut = std::pin::Pin<Box<dyn std::future::Future<Output = ()>>>;

    fn serve(self: Arc<Self>, conn: Accepted) -> Self::Fut {
        Box::pin(conn::serve(conn, self))
    }
}

struct Export {
    params: ExportParams,
    /// The bound address, or the interface of an xdp export.
    addr: String,
    svc: Arc<ExportSvc>,
    limit: Arc<ConnLimit>,
    _listener: Option<Listener>,
    xdp: Option<xdp::XdpExport>,
}

struct Entry {
    vol: Arc<Volume>,
    export: Option<Export>,
}

/// The file service: its volumes and exports. Methods are for the control
/// thread (they take the table's lock briefly).
pub struct FsServer {
    rt: RuntimeHandle,
    placement: Arc<Placement>,
    vols: Mutex<BTreeMap<String, Entry>>,
}

impl FsServer {
    pub fn new(rt: RuntimeHandle) -> FsServer {
        FsServer {
            rt,
            placement: Arc::default(),
            vols: Mutex::default(),
        }
    }

    fn table(&self) -> MutexGuard<'_, BTreeMap<String, Entry>> {
        self.vols.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `fs_create`.
    pub fn create(&self, p: &CreateParams) -> Result<(), FsServerError> {
        if p.name.is_empty() || p.name.len() > crate::NAME_MAX {
            return Err(FsServerError::Invalid("name".into()));
        }
        let mut t = self.table();
        if t.contains_key(&p.name) {
            return Err(FsServerError::Exists(p.name.clone()));
        }
        let path = Path::new(&p.path);
        if t.values().any(|e| e.vol.path == path) {
            return Err(FsServerError::Invalid(format!(
                "{} is already open",
                p.path
            )));
        }
        let vol = Volume::open(&p.name, path, p.size)?;
        t.insert(
            p.name.clone(),
            Entry {
                vol: Arc::new(vol),
                export: None,
            },
        );
        Ok(())
    }

    /// `fs_export`: starts listening; returns the bound address (for
    /// transport "xdp", the interface as given).
    pub fn export(&self, p: &ExportParams) -> Result<String, FsServerError> {
        if p.transport == "xdp" {
            return self.export_xdp(p).map(|_| p.listen.clone());
        }
        if p.transport != "tcp" {
            return Err(FsServerError::Transport(p.transport.clone()));
        }
        // "ip:port", or "ip" alone for the default port.
        let addr: SocketAddr = p
            .listen
            .parse()
            .or_else(|_| {
                let ip = p.listen.trim_start_matches('[').trim_end_matches(']');
                let ip: std::net::IpAddr = ip.parse()?;
                Ok::<_, std::net::AddrParseError>(SocketAddr::new(ip, crate::proto::DEFAULT_PORT))
            })
            .map_err(|_| FsServerError::Invalid(format!("listen address {}", p.listen)))?;
        let secret = secret_of(p)?;
        let mut t = self.table();
        let e = unexported(&mut t, &p.name)?;
        let svc = new_svc(e, p, secret);
        let limit = ConnLimit::new(p.max_connections.max(1));
        let cfg = ListenerConfig::new("fs", limit.clone());
        let l = Listener::bind(&self.rt, addr, cfg, self.placement.clone(), &svc)?;
        let bound = l.local_addr();
        tracing::info!(name = %p.name, listen = %bound, "fs: exporting {} on {bound}", p.name);
        let mut params = p.clone();
        params.listen = bound.to_string();
        e.export = Some(Export {
            params,
            addr: bound.to_string(),
            svc,
            limit,
            _listener: Some(l),
            xdp: None,
        });
        Ok(bound.to_string())
    }

    /// `fs_export` with transport "xdp": `listen` is `IFNAME[:QUEUE]` in
    /// this process's network namespace.
    fn export_xdp(&self, p: &ExportParams) -> Result<(), FsServerError> {
        let (ifname, queue) = xdp::XdpParams::parse(&p.listen)?;
        let secret = secret_of(p)?;
        let mut t = self.table();
        let e = unexported(&mut t, &p.name)?;
        let svc = new_svc(e, p, secret);
        let xp = xdp::XdpParams {
            ifname,
            queue,
            busy_poll: p.busy_poll,
            native: p.xdp_mode.as_deref() == Some("native"),
            max_sessions: p.max_connections,
            mtu: p.mtu.unwrap_or(1500) as usize,
            spin: std::time::Duration::from_micros(p.spin_us.unwrap_or(0).into()),
        };
        let reactor = self.placement.next(self.rt.num_reactors());
        let x = xdp::start(&self.rt, reactor, svc.clone(), &xp)?;
        tracing::info!(name = %p.name, listen = %p.listen, "fs: exporting {} over xdp on {}", p.name, x.ifname);
        e.export = Some(Export {
            params: p.clone(),
            addr: p.listen.clone(),
            svc,
            limit: ConnLimit::new(p.max_connections.max(1)),
            _listener: None,
            xdp: Some(x),
        });
        Ok(())
    }
}

/// The volume `name`, not exported yet (one export per volume).
fn unexported<'a>(
    t: &'a mut BTreeMap<String, Entry>,
    name: &str,
) -> Result<&'a mut Entry, FsServerError> {
    let e = t
        .get_mut(name)
        .ok_or_else(|| FsServerError::NoSuch(name.to_string()))?;
    if e.export.is_some() {
        return Err(FsServerError::AlreadyExported(name.to_string()));
    }
    Ok(e)
}

fn new_svc(e: &Entry, p: &ExportParams, secret: Vec<u8>) -> Arc<ExportSvc> {
    Arc::new(ExportSvc {
        vol: e.vol.clone(),
        read_only: p.read_only,
        copy_writes: p.copy_writes,
        send_zc: p.send_zc,
        secret,
        auth_failures: AtomicU64::new(0),
        max_in_flight: AtomicU64::new(0),
        reads_offloaded: AtomicU64::new(0),
        offloaded: AtomicU64::new(0),
    })
}

fn secret_of(p: &ExportParams) -> Result<Vec<u8>, FsServerError> {
    Ok(match (&p.secret, &p.secret_file) {
        (Some(s), None) => s.as_bytes().to_vec(),
        (None, Some(f)) => {
            let mut s = std::fs::read(f)?;
            while s.last().is_some_and(|c| c.is_ascii_whitespace()) {
                s.pop();
            }
            s
        }
        (None, None) => Vec::new(),
        (Some(_), Some(_)) => {
            return Err(FsServerError::Invalid(
                "secret and secret_file are exclusive".into(),
            ))
        }
    })
}

impl FsServer {
    /// `fs_delete`: stops the export and closes the region. Refused while
    /// connections are open (their replies still point into the region).
    pub fn delete(&self, name: &str) -> Result<(), FsServerError> {
        let mut t = self.table();
        let e = t
            .get(name)
            .ok_or_else(|| FsServerError::NoSuch(name.into()))?;
        if let Some(x) = &e.export {
            let open = x.limit.open();
            if open > 0 {
                return Err(FsServerError::Busy(name.into(), open));
            }
        }
        t.remove(name);
        Ok(())
    }

    /// `fs_get_exports`.
    pub fn exports(&self) -> Vec<ExportInfo> {
        self.table()
            .values()
            .map(|e| ExportInfo {
                name: e.vol.name.clone(),
                path: e.vol.path.display().to_string(),
                size: e.vol.size,
                listen: e.export.as_ref().map(|x| x.addr.clone()),
                transport: e.export.as_ref().map(|x| x.params.transport.clone()),
                read_only: e.export.as_ref().is_some_and(|x| x.params.read_only),
                connections: e.export.as_ref().map_or(0, |x| x.limit.open()),
            })
            .collect()
    }

    /// `fs_get_stats` (all volumes, or the one named).
    pub fn stats(&self, name: Option<&str>) -> Result<Vec<StatsInfo>, FsServerError> {
        let t = self.table();
        if let Some(n) = name {
            if !t.contains_key(n) {
                return Err(FsServerError::NoSuch(n.into()));
            }
        }
        Ok(t.values()
            .filter(|e| name.map_or(true, |n| n == e.vol.name))
            .map(|e| {
                let st = e.vol.lock().st;
                let ls = e.export.as_ref().map(|x| x.limit.stats());
                let auth = e.export.as_ref().map_or(0, |x| {
                    x.svc
                        .auth_failures
                        .load(std::sync::atomic::Ordering::Relaxed)
                });
                StatsInfo {
                    name: e.vol.name.clone(),
                    requests: st.requests,
                    errors: st.errors,
                    bytes_read: st.bytes_read,
                    bytes_written: st.bytes_written,
                    copied_bytes: st.copied_bytes,
                    kernel_copied_bytes: st.kernel_copied_bytes,
                    zero_copy_sends: st.zero_copy_sends,
                    zero_copy_sends_copied: st.zero_copy_sends_copied,
                    zero_copy_bytes: st.zero_copy_bytes,
                    connections: e.export.as_ref().map_or(0, |x| x.limit.open()),
                    connections_accepted: ls.map_or(0, |s| s.accepted),
                    connections_rejected: ls.map_or(0, |s| s.rejected),
                    handshake_timeouts: ls.map_or(0, |s| s.handshake_timeouts),
                    auth_failures: auth,
                    max_requests_in_flight: e.export.as_ref().map_or(0, |x| {
                        x.svc
                            .max_in_flight
                            .load(std::sync::atomic::Ordering::Relaxed)
                    }),
                    reads_offloaded: e.export.as_ref().map_or(0, |x| {
                        x.svc
                            .reads_offloaded
                            .load(std::sync::atomic::Ordering::Relaxed)
                    }),
                    requests_offloaded: e.export.as_ref().map_or(0, |x| {
                        x.svc.offloaded.load(std::sync::atomic::Ordering::Relaxed)
                    }),
                    xdp: e
                        .export
                        .as_ref()
                        .and_then(|x| x.xdp.as_ref())
                        .map(|x| x.counters.info()),
                }
            })
            .collect())
    }

    /// The calls that recreate every volume and export (save_config).
    pub fn config_calls(&self) -> Vec<(&'static str, serde_json::Value)> {
        let mut v = Vec::new();
        for e in self.table().values() {
            let c = CreateParams {
                name: e.vol.name.clone(),
                path: e.vol.path.display().to_string(),
                size: Some(e.vol.size),
            };
            v.push(("fs_create", serde_json::to_value(c).unwrap_or_default()));
            if let Some(x) = &e.export {
                let p = serde_json::to_value(&x.params).unwrap_or_default();
                v.push(("fs_export", p));
            }
        }
        v
    }

    /// Stops every export (the process is ending).
    pub fn stop(&self) {
        for e in self.table().values_mut() {
            e.export = None;
        }
    }
}
