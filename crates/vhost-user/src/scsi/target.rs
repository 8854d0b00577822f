//! The vhost target's vhost-user-scsi controllers: what SPDK's
//! `vhost_create_scsi_controller`, `vhost_scsi_controller_add_target` and
//! `_remove_target` ask of it, and their part of listing, deleting and
//! stopping controllers.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use super::{ScsiController, ScsiControllerConfig};
use crate::target::{VhostTarget, DEFAULT_DELAY_BASE_US, DEFAULT_IOPS_THRESHOLD};
use crate::VhostError;

/// Request queues a controller offers (QEMU's `num_queues` picks how many
/// it uses).
pub const DEFAULT_REQUEST_QUEUES: u16 = 16;

pub(crate) struct ScsiEntry {
    ctrl: Arc<ScsiController>,
    cpumask: String,
    delay_base_us: u32,
    iops_threshold: u32,
}

/// One scsi controller as `vhost_get_controllers` shows it.
#[derive(Clone, Debug)]
pub struct ScsiControllerInfo {
    pub ctrlr: String,
    pub cpumask: String,
    pub socket: PathBuf,
    pub delay_base_us: u32,
    pub iops_threshold: u32,
    /// `(scsi_target_num, bdev name)`.
    pub targets: Vec<(u32, String)>,
    pub connected: bool,
    pub num_queues: u16,
    /// Rings running now, and how many of them packed.
    pub rings_running: (u32, u32),
    /// Commands running at the targets now.
    pub in_flight: u64,
    /// The connected frontend's process ID.
    pub frontend_pid: Option<i32>,
    /// Commands served again from the inflight region since creation.
    pub resubmitted: u64,
    /// Packed rings offered (ours: SPDK's scsi controllers have none).
    pub packed_ring: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl VhostTarget {
    /// `vhost_create_scsi_controller`: a controller with no target yet,
    /// its socket `<socket dir>/<ctrlr>`; `packed_ring` offers packed
    /// virtqueues besides split ones.
    pub fn create_scsi(
        &self,
        ctrlr: &str,
        cpumask: Option<&str>,
        packed_ring: bool,
    ) -> Result<(), VhostError> {
        let socket = self.socket_for(ctrlr)?;
        let (reactors, cpumask) = self.reactors(cpumask)?;
        if self.controllers(Some(ctrlr)).is_ok() {
            return Err(VhostError::Exists(ctrlr.to_string()));
        }
        let mut scsi = lock(&self.scsi);
        if scsi.contains_key(ctrlr) {
            return Err(VhostError::Exists(ctrlr.to_string()));
        }
        let ctrl = ScsiController::create(
            self.rt.clone(),
            ScsiControllerConfig {
                name: ctrlr.to_string(),
                socket,
                reactors,
                request_queues: DEFAULT_REQUEST_QUEUES,
                poll_window: Duration::from_micros(50),
                packed_ring,
            },
        )?;
        ctrl.device()
            .set_coalescing(DEFAULT_DELAY_BASE_US, DEFAULT_IOPS_THRESHOLD);
        scsi.insert(
            ctrlr.to_string(),
            ScsiEntry {
                ctrl,
                cpumask,
                delay_base_us: DEFAULT_DELAY_BASE_US,
                iops_threshold: DEFAULT_IOPS_THRESHOLD,
            },
        );
        Ok(())
    }

    fn scsi_ctrl(&self, ctrlr: &str) -> Result<Arc<ScsiController>, VhostError> {
        lock(&self.scsi)
            .get(ctrlr)
            .map(|e| e.ctrl.clone())
            .ok_or_else(|| VhostError::NoController(ctrlr.to_string()))
    }

    /// `vhost_scsi_controller_add_target`: `bdev` as target `num`, LUN 0.
    pub fn scsi_add_target(&self, ctrlr: &str, num: u32, bdev: &str) -> Result<(), VhostError> {
        self.scsi_ctrl(ctrlr)?.add_target(&self.registry, num, bdev)
    }

    /// `vhost_scsi_controller_remove_target`.
    pub fn scsi_remove_target(&self, ctrlr: &str, num: u32) -> Result<(), VhostError> {
        self.scsi_ctrl(ctrlr)?.remove_target(num)
    }

    /// The scsi controllers, or the one named (none when it names a blk
    /// controller).
    pub fn scsi_controllers(&self, name: Option<&str>) -> Vec<ScsiControllerInfo> {
        lock(&self.scsi)
            .iter()
            .filter(|(k, _)| match name {
                None => true,
                Some(n) => n == k.as_str(),
            })
            .map(|(k, e)| ScsiControllerInfo {
                ctrlr: k.clone(),
                cpumask: e.cpumask.clone(),
                socket: e.ctrl.config.socket.clone(),
                packed_ring: e.ctrl.config.packed_ring,
                delay_base_us: e.delay_base_us,
                iops_threshold: e.iops_threshold,
                targets: e.ctrl.targets(),
                connected: e.ctrl.connected(),
                num_queues: e.ctrl.config.request_queues + 2,
                rings_running: e.ctrl.device().rings_running(),
                in_flight: e.ctrl.device().all_commands_in_flight(),
                frontend_pid: e.ctrl.frontend_pid(),
                resubmitted: e.ctrl.device().resubmitted(),
            })
            .collect()
    }

    pub(crate) fn delete_scsi(&self, ctrlr: &str) -> Result<(), VhostError> {
        let e = lock(&self.scsi)
            .remove(ctrlr)
            .ok_or_else(|| VhostError::NoController(ctrlr.to_string()))?;
        e.ctrl.stop();
        Ok(())
    }

    /// SPDK's rule on the request queues (as blk's, `crate::coalesce`);
    /// kept for the listing and save_config.
    pub(crate) fn set_scsi_coalescing(
        &self,
        ctrlr: &str,
        delay_base_us: u32,
        iops_threshold: u32,
    ) -> Result<(), VhostError> {
        let mut scsi = lock(&self.scsi);
        let e = scsi
            .get_mut(ctrlr)
            .ok_or_else(|| VhostError::NoController(ctrlr.to_string()))?;
        e.delay_base_us = delay_base_us;
        e.iops_threshold = iops_threshold;
        e.ctrl
            .device()
            .set_coalescing(delay_base_us, iops_threshold);
        Ok(())
    }

    pub(crate) fn scsi_connections(&self) -> usize {
        lock(&self.scsi)
            .values()
            .filter(|e| e.ctrl.connected())
            .count()
    }

    pub(crate) fn stop_scsi(&self) {
        let all: Vec<Arc<ScsiController>> =
            lock(&self.scsi).values().map(|e| e.ctrl.clone()).collect();
        for c in all {
            c.stop();
        }
    }
}
