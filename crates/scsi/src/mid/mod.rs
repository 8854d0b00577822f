//! The mid-layer: registries of hosts, devices and device-type drivers;
//! scan → register → match → bring-up; error handling; retry rules.
//!
//! A host and its devices live on one reactor (the LLD's). The control
//! plane reaches them through [`ScsiStack`], which keeps a published copy
//! of host and device facts behind a mutex (control path only) and runs
//! everything else on the owning reactor with `RuntimeHandle::block_on`.

pub mod device;
pub(crate) mod eh;
pub mod host;
pub mod retry;
pub mod scan;
pub mod stats;
pub mod upper;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::Serialize;
use ustor_bdev::Registry;
use ustor_runtime::RuntimeHandle;

pub use device::{Device, DeviceInfo, DeviceState};
pub use host::{Host, HostConfig, Outcome};
pub use scan::ScanReport;
pub use stats::HostStats;

use crate::lld::{HostLimits, Lld, TmfResult, TransportError};
use crate::lun::Hctl;

/// Errors of the control operations.
#[derive(Debug, thiserror::Error)]
pub enum ScsiError {
    #[error("no SCSI host {0}")]
    NoHost(u32),
    #[error("no SCSI device `{0}`")]
    NoDevice(String),
    #[error("transport: {0}")]
    Transport(#[from] TransportError),
    #[error("runtime: {0}")]
    Runtime(#[from] ustor_runtime::SendError),
    #[error("invalid parameter `{param}`: {why}")]
    Invalid { param: &'static str, why: String },
    #[error("{0}")]
    Bdev(#[from] ustor_bdev::ControlError),
    #[error("reset failed")]
    ResetFailed,
}

impl ScsiError {
    /// SPDK-style errno for JSON-RPC errors.
    pub fn errno(&self) -> i32 {
        match self {
            ScsiError::NoHost(_) | ScsiError::NoDevice(_) => libc::ENODEV,
            ScsiError::Transport(_) => libc::EIO,
            ScsiError::Runtime(_) => libc::ESHUTDOWN,
            ScsiError::Invalid { .. } => libc::EINVAL,
            ScsiError::Bdev(e) => e.errno(),
            ScsiError::ResetFailed => libc::EIO,
        }
    }
}

/// Published facts of a host (`scsi_get_hosts`).
#[derive(Clone, Debug, Serialize)]
pub struct HostInfo {
    pub host: u32,
    pub reactor: usize,
    pub driver: String,
    pub limits: HostLimits,
    pub config: HostConfig,
    pub info: serde_json::Value,
}

/// A user-defined SCSI bdev's mapping (for overlap checks and listing).
#[derive(Clone, Debug, Serialize)]
pub struct MapRecord {
    pub bdev: String,
    pub device: String,
    pub hctl: Hctl,
    pub offset_blocks: u64,
    pub num_blocks: u64,
}

#[derive(Default)]
pub(crate) struct Inner {
    pub(crate) hosts: BTreeMap<u32, HostInfo>,
    pub(crate) devices: BTreeMap<Hctl, DeviceInfo>,
    pub(crate) maps: Vec<MapRecord>,
    next_host: u32,
    next_disk: u32,
    next_other: u32,
}

pub(crate) struct StackShared {
    pub(crate) id: u64,
    pub(crate) rt: RuntimeHandle,
    pub(crate) bdevs: Arc<Registry>,
    inner: Mutex<Inner>,
}

impl StackShared {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `sda`, `sdb`, … `sdaa` for disks, `sg0`, `sg1`, … for the rest.
    pub(crate) fn alloc_name(&self, disk: bool) -> String {
        let mut g = self.lock();
        if disk {
            let mut n = g.next_disk as usize;
            g.next_disk += 1;
            let mut s = Vec::new();
            loop {
                s.push(b'a' + (n % 26) as u8);
                if n < 26 {
                    break;
                }
                n = n / 26 - 1;
            }
            s.reverse();
            format!("sd{}", String::from_utf8_lossy(&s))
        } else {
            g.next_other += 1;
            format!("sg{}", g.next_other - 1)
        }
    }
}

static NEXT_STACK: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// Hosts owned by this reactor, by (stack id, host number).
    static HOSTS: RefCell<Vec<(u64, Rc<Host>)>> = const { RefCell::new(Vec::new()) };
}

/// This reactor's host `no` of stack `stack`.
pub(crate) fn local_host(stack: u64, no: u32) -> Option<Rc<Host>> {
    HOSTS.with(|h| {
        h.borrow()
            .iter()
            .find(|(s, x)| *s == stack && x.no == no)
            .map(|(_, x)| x.clone())
    })
}

/// Publishes a host's devices to the control-plane copy.
pub(crate) fn publish_devices(host: &Host) {
    let infos: Vec<DeviceInfo> = host.devices.borrow().iter().map(|d| d.info()).collect();
    let mut g = host.shared.lock();
    g.devices.retain(|k, _| k.host != host.no);
    for i in infos {
        let hctl = Hctl {
            host: i.host,
            channel: i.channel,
            target: i.target,
            lun: i.lun,
        };
        g.devices.insert(hctl, i);
    }
}

/// A device left: its upper-level driver releases what it built on it
/// (sd hot-removes its SCSI bdevs).
pub(crate) fn device_gone(host: &Host, d: &Device) {
    let driver = d.info.borrow().driver;
    if let Some(u) = driver.and_then(upper::driver_named) {
        u.remove(host, d);
    }
}

/// The SCSI stack of one ustor instance: hosts, devices, SCSI bdevs.
#[derive(Clone)]
pub struct ScsiStack {
    pub(crate) shared: Arc<StackShared>,
}

impl ScsiStack {
    pub fn new(rt: RuntimeHandle, bdevs: Arc<Registry>) -> ScsiStack {
        ScsiStack {
            shared: Arc::new(StackShared {
                id: NEXT_STACK.fetch_add(1, Ordering::Relaxed),
                rt,
                bdevs,
                inner: Mutex::default(),
            }),
        }
    }

    pub fn bdevs(&self) -> &Arc<Registry> {
        &self.shared.bdevs
    }

    /// Adds a host whose LLD `make` builds on `reactor`, scans it, and
    /// returns its number. Call from a control thread (it blocks).
    pub fn add_host<F>(&self, reactor: usize, cfg: HostConfig, make: F) -> Result<u32, ScsiError>
    where
        F: FnOnce() -> Result<Box<dyn Lld>, TransportError> + Send + 'static,
    {
        let no = {
            let mut g = self.shared.lock();
            g.next_host += 1;
            g.next_host - 1
        };
        let shared = self.shared.clone();
        let stack = self.shared.id;
        let r = self.block_on(reactor, move || async move {
            let lld = make()?;
            let host = Host::new(no, lld, cfg, shared.clone());
            let info = HostInfo {
                host: no,
                reactor,
                driver: host.lld.name().to_string(),
                limits: host.limits,
                config: cfg,
                info: host.lld.info(),
            };
            shared.lock().hosts.insert(no, info);
            let h = host.clone();
            let pid = ustor_runtime::register_poller("scsi_host", move || h.poll());
            host.poller.set(Some(pid));
            let h = host.clone();
            let tid = ustor_runtime::register_timed_poller(
                "scsi_host_timer",
                host.timer_period(),
                move || h.tick(),
            );
            host.timer.set(Some(tid));
            HOSTS.with(|x| x.borrow_mut().push((stack, host.clone())));
            scan::scan_host(&host).await.map(|_| ())
        })?;
        match r {
            Ok(()) => Ok(no),
            Err(e) => {
                let _ = self.remove_host(no);
                Err(ScsiError::Transport(e))
            }
        }
    }

    /// Removes a host and its devices (their SCSI bdevs are hot-removed).
    pub fn remove_host(&self, no: u32) -> Result<(), ScsiError> {
        let stack = self.shared.id;
        self.on_host(no, move |host| async move {
            for p in [host.poller.take(), host.timer.take()]
                .into_iter()
                .flatten()
            {
                ustor_runtime::unregister_poller(p);
            }
            let devs: Vec<Rc<Device>> = host.devices.borrow_mut().drain(..).collect();
            for d in devs {
                d.set_state(DeviceState::Removed);
                device_gone(&host, &d);
            }
            HOSTS.with(|x| x.borrow_mut().retain(|(s, h)| !(*s == stack && h.no == no)));
            let mut g = host.shared.lock();
            g.hosts.remove(&no);
            g.devices.retain(|k, _| k.host != no);
        })
    }

    /// Rescans one host (`scsi_scan_host`).
    pub fn scan_host(&self, no: u32) -> Result<ScanReport, ScsiError> {
        self.on_host(no, |host| async move { scan::scan_host(&host).await })?
            .map_err(ScsiError::Transport)
    }

    /// Every host, with the LLD's `info()` read now on the host's reactor
    /// (it carries live facts such as session state and counters).
    pub fn hosts(&self) -> Vec<HostInfo> {
        let mut hosts: Vec<HostInfo> = self.shared.lock().hosts.values().cloned().collect();
        for h in &mut hosts {
            // A host removed meanwhile keeps the facts it was published with.
            if let Ok(info) = self.on_host(h.host, |host| async move { host.lld.info() }) {
                h.info = info;
            }
        }
        hosts
    }

    pub fn devices(&self) -> Vec<DeviceInfo> {
        self.shared.lock().devices.values().cloned().collect()
    }

    /// A device by H:C:T:L, name (`sda`), serial or VPD 0x83 id.
    pub fn find_device(&self, key: &str) -> Result<DeviceInfo, ScsiError> {
        let g = self.shared.lock();
        let by_hctl = key.parse::<Hctl>().ok();
        g.devices
            .iter()
            .find(|(h, d)| {
                Some(**h) == by_hctl
                    || d.name == key
                    || d.serial.as_deref() == Some(key)
                    || d.ids.iter().any(|i| i == key)
            })
            .map(|(_, d)| d.clone())
            .ok_or_else(|| ScsiError::NoDevice(key.to_string()))
    }

    /// Refreshes the published device facts (last sense, state) from the
    /// owning reactors.
    pub fn refresh(&self) -> Result<(), ScsiError> {
        let nos: Vec<u32> = self.shared.lock().hosts.keys().copied().collect();
        for no in nos {
            self.on_host(no, |h| async move { publish_devices(&h) })?;
        }
        Ok(())
    }

    /// LOGICAL UNIT RESET of one device (`scsi_device_reset`).
    pub fn device_reset(&self, device: &str) -> Result<(), ScsiError> {
        let d = self.find_device(device)?;
        let hctl = Hctl {
            host: d.host,
            channel: d.channel,
            target: d.target,
            lun: d.lun,
        };
        let r = self.on_host(d.host, move |h| async move {
            let nexus = h.device(&hctl).map(|d| d.nexus);
            match nexus {
                Some(n) => eh::device_reset(&h, n).await,
                None => TmfResult::Failed,
            }
        })?;
        (r == TmfResult::Success)
            .then_some(())
            .ok_or(ScsiError::ResetFailed)
    }

    /// Host reset (`scsi_host_reset`).
    pub fn host_reset(&self, no: u32) -> Result<(), ScsiError> {
        let r = self.on_host(no, |h| async move { eh::host_reset(&h).await })?;
        (r == TmfResult::Success)
            .then_some(())
            .ok_or(ScsiError::ResetFailed)
    }

    /// Counters of every host (`scsi_get_stats`).
    pub fn stats(&self) -> Result<Vec<HostStats>, ScsiError> {
        let nos: Vec<u32> = self.shared.lock().hosts.keys().copied().collect();
        nos.into_iter()
            .map(|no| self.on_host(no, move |h| async move { h.stats.snapshot(no) }))
            .collect()
    }

    /// Runs a raw command on a device and returns the outcome (tests,
    /// diagnostics; control path).
    pub fn execute(
        &self,
        device: &str,
        cdb: crate::cdb::Cdb,
        dir: crate::lld::DataDir,
        buf: Vec<u8>,
    ) -> Result<Outcome, ScsiError> {
        let d = self.find_device(device)?;
        let nexus = crate::lld::Nexus {
            channel: d.channel,
            target: d.target,
            lun: d.lun,
        };
        self.on_host(d.host, move |h| async move {
            h.execute(nexus, cdb, dir, buf).await
        })
    }

    /// The reactor that owns host `no`.
    pub fn host_reactor(&self, no: u32) -> Result<usize, ScsiError> {
        self.shared
            .lock()
            .hosts
            .get(&no)
            .map(|h| h.reactor)
            .ok_or(ScsiError::NoHost(no))
    }

    /// Runs `f(host)` on the host's reactor and waits for it.
    pub(crate) fn on_host<R, F, Fut>(&self, no: u32, f: F) -> Result<R, ScsiError>
    where
        R: Send + 'static,
        F: FnOnce(Rc<Host>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = R> + 'static,
    {
        let reactor = self.host_reactor(no)?;
        let stack = self.shared.id;
        self.block_on(reactor, move || async move {
            match local_host(stack, no) {
                Some(h) => Ok(f(h).await),
                None => Err(ScsiError::NoHost(no)),
            }
        })?
    }

    fn block_on<R, F, Fut>(&self, reactor: usize, f: F) -> Result<R, ScsiError>
    where
        R: Send + 'static,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = R> + 'static,
    {
        self.shared
            .rt
            .block_on(reactor, f)
            .map_err(ScsiError::Runtime)
    }
}
