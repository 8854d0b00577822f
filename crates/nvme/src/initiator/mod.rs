//! The NVMe/TCP initiator: remote namespaces as bdevs (SPDK's `bdev_nvme`).
//!
//! - `ctrlr`: a controller: its admin queue (ICReq/ICResp, Fabrics Connect,
//!   CC.EN/CSTS.RDY, Identify), keep alive, and the reset/reconnect
//!   supervisor that runs on reactor 0.
//! - `qpair`: one I/O queue pair per (bdev, reactor), created lazily by the
//!   bdev's `create_channel` on that reactor: preallocated command table
//!   (CID = index), reads received straight into the I/O's buffers, writes
//!   sent from them (in-capsule up to IOCCSZ, else H2CData on R2T), LANoT
//!   coalescing of outgoing PDUs, requeue across reconnects.
//! - `bdev`: the `Bdev`/`BdevChannel` glue, one bdev per namespace
//!   (`<name>n<nsid>`).
//!
//! Control functions with SPDK's names and param shapes:
//! [`attach_controller`] (`bdev_nvme_attach_controller`),
//! [`detach_controller`] (`bdev_nvme_detach_controller`),
//! [`get_controllers`] (`bdev_nvme_get_controllers`). Call them from a
//! control thread, never from a reactor (they wait for reactor 0).

mod bdev;
mod ctrlr;
mod qpair;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use serde::{Deserialize, Serialize};
use ustor_bdev::Registry;
use ustor_runtime::RuntimeHandle;

use ctrlr::Ctrlr;
pub use ctrlr::CtrlrState;
pub use qpair::QpStats;
use ustor_net::coalesce::{CoalesceConfig, Mode};

/// `bdev_nvme_attach_controller` params (SPDK's names; see SPDK's
/// `python/spdk/rpc/bdev.py`). Unknown SPDK fields are ignored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AttachParams {
    /// Controller name; bdevs are `<name>n<nsid>`.
    pub name: String,
    /// Only "TCP".
    pub trtype: String,
    pub traddr: String,
    #[serde(default)]
    pub adrfam: Option<String>,
    #[serde(default = "default_svcid")]
    pub trsvcid: String,
    pub subnqn: String,
    #[serde(default)]
    pub hostnqn: Option<String>,
    #[serde(default)]
    pub hdgst: bool,
    #[serde(default)]
    pub ddgst: bool,
    /// I/O queues to ask the controller for (one is used per reactor).
    #[serde(default)]
    pub num_io_queues: Option<u16>,
    /// Seconds to keep reconnecting after the controller is lost before
    /// failing its I/O; -1 = forever, 0 = one reset attempt only.
    #[serde(default)]
    pub ctrlr_loss_timeout_sec: i64,
    /// Seconds between reconnect attempts (0: 100 ms).
    #[serde(default)]
    pub reconnect_delay_sec: u32,
    /// Keep alive timeout in ms (SPDK's `keep_alive_timeout_ms` option).
    #[serde(default = "default_kato")]
    pub keep_alive_timeout_ms: u32,
    /// ustor extension: I/O queue depth (commands in flight per queue).
    #[serde(default = "default_qsize")]
    pub io_queue_size: u16,
    /// ustor extension: LANoT coalescing of the initiator's outgoing PDUs.
    #[serde(default = "default_coalesce")]
    pub coalesce: CoalesceConfig,
}

fn default_svcid() -> String {
    "4420".into()
}
fn default_kato() -> u32 {
    10_000
}
fn default_qsize() -> u16 {
    128
}
fn default_coalesce() -> CoalesceConfig {
    CoalesceConfig {
        mode: Mode::Off,
        ..CoalesceConfig::default()
    }
}

/// Default host NQN when the caller gives none.
pub const DEFAULT_HOSTNQN: &str = "nqn.2014-08.io.ustor:host";

impl AttachParams {
    /// Params with SPDK's defaults for a TCP controller.
    pub fn tcp(name: &str, traddr: &str, trsvcid: &str, subnqn: &str) -> AttachParams {
        AttachParams {
            name: name.into(),
            trtype: "TCP".into(),
            traddr: traddr.into(),
            adrfam: None,
            trsvcid: trsvcid.into(),
            subnqn: subnqn.into(),
            hostnqn: None,
            hdgst: false,
            ddgst: false,
            num_io_queues: None,
            ctrlr_loss_timeout_sec: 0,
            reconnect_delay_sec: 0,
            keep_alive_timeout_ms: default_kato(),
            io_queue_size: default_qsize(),
            coalesce: default_coalesce(),
        }
    }
}

/// `bdev_nvme_detach_controller` params.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DetachParams {
    pub name: String,
}

/// `bdev_nvme_get_controllers` params.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GetControllersParams {
    #[serde(default)]
    pub name: Option<String>,
}

/// Transport ID as SPDK reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransportId {
    pub trtype: String,
    pub adrfam: String,
    pub traddr: String,
    pub trsvcid: String,
    pub subnqn: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostId {
    pub nqn: String,
    pub addr: String,
    pub svcid: String,
}

/// One path of a controller (`ctrlrs[]` in SPDK's output).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CtrlrPathInfo {
    /// "enabled", "resetting", "failed", "deleting".
    pub state: String,
    pub cntlid: u16,
    pub trid: TransportId,
    pub host: HostId,
    /// ustor extension: resets done, I/O queue counters.
    pub resets: u64,
    pub io_queues: u32,
}

/// One `bdev_nvme_get_controllers` entry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ControllerInfo {
    pub name: String,
    pub ctrlrs: Vec<CtrlrPathInfo>,
    /// ustor extension: the namespace bdevs.
    pub bdevs: Vec<String>,
}

/// Errors of the control functions; `code()` is SPDK-style negative errno.
#[derive(Debug, thiserror::Error)]
pub enum InitiatorError {
    #[error("invalid parameter {param}: {why}")]
    Invalid { param: &'static str, why: String },
    #[error("controller {0} already exists")]
    Exists(String),
    #[error("no controller {0}")]
    NotFound(String),
    #[error("cannot connect to {addr}: {err}")]
    Connect { addr: String, err: std::io::Error },
    #[error("controller refused {what}: status {status:#x}")]
    Status { what: &'static str, status: u16 },
    #[error("protocol error: {0}")]
    Protocol(&'static str),
    #[error("timed out: {0}")]
    Timeout(&'static str),
    #[error("bdev: {0}")]
    Bdev(#[from] ustor_bdev::ControlError),
    /// A message to a reactor was not delivered, or its reply never came
    /// (the runtime stopped).
    #[error("runtime: {0}")]
    Runtime(#[from] ustor_runtime::SendError),
}

impl InitiatorError {
    pub fn code(&self) -> i32 {
        -match self {
            InitiatorError::Invalid { .. } => libc::EINVAL,
            InitiatorError::Exists(_) => libc::EEXIST,
            InitiatorError::NotFound(_) => libc::ENODEV,
            InitiatorError::Connect { err, .. } => err.raw_os_error().unwrap_or(libc::EIO),
            InitiatorError::Status { .. } | InitiatorError::Protocol(_) => libc::EIO,
            InitiatorError::Timeout(_) => libc::ETIMEDOUT,
            InitiatorError::Bdev(e) => e.errno(),
            InitiatorError::Runtime(_) => libc::ESHUTDOWN,
        }
    }

    fn invalid(param: &'static str, why: impl Into<String>) -> InitiatorError {
        InitiatorError::Invalid {
            param,
            why: why.into(),
        }
    }
}

fn table() -> MutexGuard<'static, BTreeMap<String, Arc<Ctrlr>>> {
    static T: OnceLock<Mutex<BTreeMap<String, Arc<Ctrlr>>>> = OnceLock::new();
    T.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// `bdev_nvme_attach_controller`: connects the admin queue, identifies the
/// controller and its active namespaces, registers one bdev per namespace
/// in `registry`; returns the bdev names.
pub fn attach_controller(
    rt: &RuntimeHandle,
    registry: &Arc<Registry>,
    p: &AttachParams,
) -> Result<Vec<String>, InitiatorError> {
    if !p.trtype.eq_ignore_ascii_case("tcp") {
        return Err(InitiatorError::invalid("trtype", "only TCP"));
    }
    if p.name.is_empty() {
        return Err(InitiatorError::invalid("name", "empty"));
    }
    if p.io_queue_size < 2 || p.io_queue_size > 1024 {
        return Err(InitiatorError::invalid("io_queue_size", "2..=1024"));
    }
    if p.ctrlr_loss_timeout_sec < -1 {
        return Err(InitiatorError::invalid("ctrlr_loss_timeout_sec", ">= -1"));
    }
    let addr = ctrlr::resolve(p)?;
    let c = Arc::new(Ctrlr::new(p.clone(), addr));
    {
        let mut t = table();
        if t.contains_key(&p.name) {
            return Err(InitiatorError::Exists(p.name.clone()));
        }
        t.insert(p.name.clone(), c.clone());
    }
    let res = attach_inner(rt, registry, &c);
    if res.is_err() {
        c.stop();
        table().remove(&p.name);
    }
    res
}

fn attach_inner(
    rt: &RuntimeHandle,
    registry: &Arc<Registry>,
    c: &Arc<Ctrlr>,
) -> Result<Vec<String>, InitiatorError> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let c2 = c.clone();
    rt.spawn_on(0, move || ctrlr::supervise(c2, tx))?;
    // The supervisor dropped its sender without answering: reactor 0 stopped.
    let nss = rx
        .recv()
        .map_err(|_| InitiatorError::Runtime(ustor_runtime::SendError::Stopped))??;
    let mut names = Vec::new();
    for ns in nss {
        let b = bdev::NvmeBdev::new(c.clone(), ns);
        let name = b.name().to_string();
        match registry.register(Arc::new(b)) {
            Ok(_) => names.push(name),
            Err(e) => {
                for n in &names {
                    let _ = registry.delete(n);
                }
                return Err(e.into());
            }
        }
    }
    c.set_bdevs(registry.clone(), names.clone());
    Ok(names)
}

/// `bdev_nvme_detach_controller`: unregisters the namespace bdevs (their
/// outstanding I/O fails with `Removed`) and disconnects every queue.
pub fn detach_controller(p: &DetachParams) -> Result<bool, InitiatorError> {
    let c = table()
        .remove(&p.name)
        .ok_or_else(|| InitiatorError::NotFound(p.name.clone()))?;
    c.detach();
    Ok(true)
}

/// `bdev_nvme_get_controllers`.
pub fn get_controllers(p: &GetControllersParams) -> Result<Vec<ControllerInfo>, InitiatorError> {
    let t = table();
    if let Some(n) = &p.name {
        let c = t
            .get(n)
            .ok_or_else(|| InitiatorError::NotFound(n.clone()))?;
        return Ok(vec![c.info()]);
    }
    Ok(t.values().map(|c| c.info()).collect())
}

/// Per-queue counters of a controller's I/O queues (reactor order is not
/// kept); for the benchmark and tests.
pub fn io_queue_stats(name: &str) -> Result<Vec<QpStats>, InitiatorError> {
    let t = table();
    let c = t
        .get(name)
        .ok_or_else(|| InitiatorError::NotFound(name.into()))?;
    Ok(c.qp_stats())
}

/// Saves a controller's attach call for `save_config`.
pub fn config_json() -> Vec<serde_json::Value> {
    table()
        .values()
        .map(|c| serde_json::json!({"method": "bdev_nvme_attach_controller", "params": c.params()}))
        .collect()
}
