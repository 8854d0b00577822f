//! The vhost target: every controller of one ustor instance by name, the
//! socket directory they are created in (`ustor serve -S DIR`), and what
//! SPDK's vhost RPCs ask of it (create, list, delete, coalescing settings,
//! the config dump). The RPC layer maps [`VhostError`] to SPDK's errnos.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ustor_bdev::Registry;
use ustor_runtime::RuntimeHandle;

use crate::device::QueueCounters;
use crate::{BlkController, BlkControllerConfig, VhostError};

/// Queues a controller offers (the frontend picks how many it uses: QEMU's
/// `num-queues`, libblkio's and SPDK's `vq_count`).
pub const DEFAULT_NUM_QUEUES: u16 = 16;
/// SPDK's defaults for `vhost_controller_set_coalescing`.
pub const DEFAULT_DELAY_BASE_US: u32 = 0;
pub const DEFAULT_IOPS_THRESHOLD: u32 = 60_000;
/// `sun_path` holds 108 bytes with its NUL.
const MAX_SOCKET_PATH: usize = 107;

/// What `vhost_create_blk_controller` passes.
#[derive(Clone, Debug, Default)]
pub struct CreateBlk {
    pub ctrlr: String,
    pub dev_name: String,
    /// Hex mask (`0x3`) or core list (`0,2-3`) of the reactors' cores; all
    /// reactors when absent.
    pub cpumask: Option<String>,
    pub readonly: bool,
    /// Offer packed virtqueues (VIRTIO_F_RING_PACKED) as well as split
    /// ones; off by default, as in SPDK (the frontend then uses split).
    pub packed_ring: bool,
}

/// One controller as `vhost_get_controllers` shows it.
#[derive(Clone, Debug)]
pub struct ControllerInfo {
    pub ctrlr: String,
    pub cpumask: String,
    pub socket: PathBuf,
    pub delay_base_us: u32,
    pub iops_threshold: u32,
    pub bdev: String,
    pub readonly: bool,
    pub packed_ring: bool,
    pub connected: bool,
    pub num_queues: u16,
    /// The connected frontend's process ID.
    pub frontend_pid: Option<i32>,
    /// The frontend gave a backend channel (config-change notifications).
    pub notifier: bool,
    /// Every queue's counters since the controller was created.
    pub queues: Vec<QueueCounters>,
    /// The bdev was hot-removed (requests fail with IOERR).
    pub bdev_removed: bool,
    /// Capacity now, in 512-byte sectors.
    pub capacity_sectors: u64,
}

struct Entry {
    ctrl: Arc<BlkController>,
    cpumask: String,
    packed_ring: bool,
    delay_base_us: u32,
    iops_threshold: u32,
}

/// Every vhost controller of the instance.
pub struct VhostTarget {
    pub(crate) rt: RuntimeHandle,
    pub(crate) registry: Arc<Registry>,
    socket_dir: Mutex<PathBuf>,
    ctrls: Mutex<BTreeMap<String, Entry>>,
    /// vhost-user-scsi controllers ([`crate::scsi::target`]); names are
    /// unique across both maps.
    pub(crate) scsi: Mutex<BTreeMap<String, crate::scsi::target::ScsiEntry>>,
}

impl VhostTarget {
    /// Sockets go to the current directory until [`Self::set_socket_dir`]
    /// (SPDK's default too).
    pub fn new(rt: RuntimeHandle, registry: Arc<Registry>) -> VhostTarget {
        VhostTarget {
            rt,
            registry,
            socket_dir: Mutex::new(PathBuf::from(".")),
            ctrls: Mutex::default(),
            scsi: Mutex::default(),
        }
    }

    pub fn set_socket_dir(&self, dir: &Path) {
        *lock(&self.socket_dir) = dir.to_path_buf();
    }

    pub fn socket_dir(&self) -> PathBuf {
        lock(&self.socket_dir).clone()
    }

    /// The reactors whose cores are in `mask` (all when `None`).
    pub(crate) fn reactors(&self, mask: Option<&str>) -> Result<(Vec<usize>, String), VhostError> {
        let n = self.rt.num_reactors();
        let all: Vec<usize> = (0..n).collect();
        let Some(m) = mask else {
            return Ok((all.clone(), core_mask(&self.rt, &all)));
        };
        let cores = ustor_runtime::config::parse_cores(m)
            .map_err(|e| VhostError::Invalid(e.to_string()))?;
        let picked: Vec<usize> = all
            .into_iter()
            .filter(|&r| self.rt.core_of(r).is_some_and(|c| cores.contains(&c)))
            .collect();
        if picked.is_empty() {
            return Err(VhostError::Invalid(format!(
                "cpumask {m} selects none of the reactors' cores"
            )));
        }
        Ok((picked.clone(), core_mask(&self.rt, &picked)))
    }

    /// The socket of controller `ctrlr`: `<socket dir>/<ctrlr>`, for a
    /// name that is one path component and a path `sun_path` holds.
    pub(crate) fn socket_for(&self, ctrlr: &str) -> Result<PathBuf, VhostError> {
        if ctrlr.is_empty() || ctrlr.contains('/') || ctrlr == "." || ctrlr == ".." {
            return Err(VhostError::Invalid(format!(
                "bad controller name `{ctrlr}`"
            )));
        }
        let socket = self.socket_dir().join(ctrlr);
        if socket.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(VhostError::Invalid(format!(
                "socket path {} is longer than {MAX_SOCKET_PATH} bytes",
                socket.display()
            )));
        }
        Ok(socket)
    }

    /// Creates a vhost-user-blk controller with its socket
    /// `<socket dir>/<ctrlr>`.
    pub fn create_blk(&self, p: &CreateBlk) -> Result<(), VhostError> {
        let socket = self.socket_for(&p.ctrlr)?;
        let (reactors, cpumask) = self.reactors(p.cpumask.as_deref())?;
        let mut ctrls = lock(&self.ctrls);
        if ctrls.contains_key(&p.ctrlr) || lock(&self.scsi).contains_key(&p.ctrlr) {
            return Err(VhostError::Exists(p.ctrlr.clone()));
        }
        let ctrl = BlkController::create(
            &self.registry,
            self.rt.clone(),
            BlkControllerConfig {
                name: p.ctrlr.clone(),
                socket,
                bdev: p.dev_name.clone(),
                reactors,
                read_only: p.readonly,
                num_queues: DEFAULT_NUM_QUEUES,
                poll_window: Duration::from_micros(50),
                packed_ring: p.packed_ring,
            },
        )?;
        ctrl.device()
            .set_coalescing(DEFAULT_DELAY_BASE_US, DEFAULT_IOPS_THRESHOLD);
        ctrls.insert(
            p.ctrlr.clone(),
            Entry {
                ctrl,
                cpumask,
                packed_ring: p.packed_ring,
                delay_base_us: DEFAULT_DELAY_BASE_US,
                iops_threshold: DEFAULT_IOPS_THRESHOLD,
            },
        );
        Ok(())
    }

    /// Disconnects the frontend (its requests finish first), removes the
    /// socket and releases the bdev.
    pub fn delete(&self, ctrlr: &str) -> Result<(), VhostError> {
        let Some(e) = lock(&self.ctrls).remove(ctrlr) else {
            return self.delete_scsi(ctrlr);
        };
        e.ctrl.stop();
        Ok(())
    }

    /// `vhost_controller_set_coalescing`: SPDK's rule, a delay needs a
    /// positive IOPS threshold.
    pub fn set_coalescing(
        &self,
        ctrlr: &str,
        delay_base_us: u32,
        iops_threshold: u32,
    ) -> Result<(), VhostError> {
        if delay_base_us > 0 && iops_threshold == 0 {
            return Err(VhostError::Invalid(
                "iops_threshold must be > 0 when delay_base_us is set".into(),
            ));
        }
        let mut ctrls = lock(&self.ctrls);
        let Some(e) = ctrls.get_mut(ctrlr) else {
            return self.set_scsi_coalescing(ctrlr, delay_base_us, iops_threshold);
        };
        e.delay_base_us = delay_base_us;
        e.iops_threshold = iops_threshold;
        e.ctrl
            .device()
            .set_coalescing(delay_base_us, iops_threshold);
        Ok(())
    }

    /// All blk controllers, or the one named (none when it names a scsi
    /// controller: see [`Self::scsi_controllers`]).
    pub fn controllers(&self, name: Option<&str>) -> Result<Vec<ControllerInfo>, VhostError> {
        let ctrls = lock(&self.ctrls);
        if let Some(n) = name {
            if !ctrls.contains_key(n) && !lock(&self.scsi).contains_key(n) {
                return Err(VhostError::NoController(n.to_string()));
            }
        }
        Ok(ctrls
            .iter()
            .filter(|(k, _)| match name {
                None => true,
                Some(n) => n == k.as_str(),
            })
            .map(|(k, e)| {
                let c = &e.ctrl.config;
                let dev = e.ctrl.device();
                ControllerInfo {
                    ctrlr: k.clone(),
                    cpumask: e.cpumask.clone(),
                    socket: c.socket.clone(),
                    delay_base_us: e.delay_base_us,
                    iops_threshold: e.iops_threshold,
                    bdev: c.bdev.clone(),
                    readonly: c.read_only,
                    packed_ring: e.packed_ring,
                    connected: e.ctrl.connected(),
                    num_queues: c.num_queues,
                    frontend_pid: e.ctrl.frontend_pid(),
                    notifier: dev.has_notifier(),
                    queues: dev.queue_stats.iter().map(|q| q.snapshot()).collect(),
                    bdev_removed: dev.removed(),
                    capacity_sectors: dev.num_blocks() * dev.geometry.block_size as u64 / 512,
                }
            })
            .collect())
    }

    /// Frontends connected now.
    pub fn connections(&self) -> usize {
        lock(&self.ctrls)
            .values()
            .filter(|e| e.ctrl.connected())
            .count()
            + self.scsi_connections()
    }

    /// Stops every controller (shutdown): each frontend is disconnected
    /// after its rings' requests finish. The controllers stay listed (the
    /// config dump at exit still shows them).
    pub fn stop_all(&self) {
        let all: Vec<Arc<BlkController>> =
            lock(&self.ctrls).values().map(|e| e.ctrl.clone()).collect();
        for c in all {
            c.stop();
        }
        self.stop_scsi();
    }

    /// Waits until no frontend is connected, until `deadline` at most.
    pub fn wait_idle(&self, deadline: Instant) -> bool {
        loop {
            if self.connections() == 0 {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The hex mask of the cores `reactors` run on.
fn core_mask(rt: &RuntimeHandle, reactors: &[usize]) -> String {
    let m = reactors
        .iter()
        .filter_map(|&r| rt.core_of(r))
        .filter(|&c| c < 128)
        .fold(0u128, |m, c| m | (1u128 << c));
    format!("{m:#x}")
}
