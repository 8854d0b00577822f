//! A vhost-user-scsi controller: its socket and control thread (the
//! shared [`Endpoint`]), and its targets as SPDK's RPCs change them
//! (`vhost_scsi_controller_add_target` / `_remove_target`), hot-plugged
//! into a running guest through the event queue.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ustor_bdev::{BdevEvent, Registry};
use ustor_runtime::RuntimeHandle;
use ustor_scsi_target::{LuConfig, MAX_UNMAP_DESCRIPTORS};

use super::device::ScsiDevice;
use super::wire::MAX_TARGETS;
use crate::controller::Endpoint;
use crate::VhostError;

/// How long removing a target waits for the queues to stop using it.
const DETACH_TIMEOUT: Duration = Duration::from_secs(10);

/// Makes each unit's serial and NAA identifier unique in the process.
static UNIT_IDS: AtomicU32 = AtomicU32::new(1);

/// What `vhost_create_scsi_controller` asks for.
#[derive(Clone, Debug)]
pub struct ScsiControllerConfig {
    pub name: String,
    pub socket: PathBuf,
    /// Reactors the rings are spread over (ring `i` on `reactors[i % n]`).
    pub reactors: Vec<usize>,
    /// Request queues offered (the frontend's `num_queues` may be fewer).
    pub request_queues: u16,
    /// How long a busy request queue polls after its last command.
    pub poll_window: Duration,
    /// Offer packed virtqueues (VIRTIO_F_RING_PACKED) besides split ones.
    pub packed_ring: bool,
}

/// A running vhost-user-scsi controller.
pub struct ScsiController {
    pub config: ScsiControllerConfig,
    dev: Arc<ScsiDevice>,
    ep: Endpoint,
    /// Serialises target changes (add and remove each check, then act).
    change: Mutex<()>,
}

impl ScsiController {
    /// Binds the socket (replacing a stale one) and starts serving, with
    /// no target yet.
    pub fn create(
        rt: RuntimeHandle,
        config: ScsiControllerConfig,
    ) -> Result<Arc<ScsiController>, VhostError> {
        if config.request_queues == 0 || config.request_queues > 62 {
            return Err(VhostError::Invalid("request queues must be 1..=62".into()));
        }
        if config.reactors.is_empty() {
            return Err(VhostError::Invalid("cpumask selects no reactor".into()));
        }
        let mut dev = ScsiDevice::new(&config.name, config.request_queues, config.poll_window);
        dev.packed_ring = config.packed_ring;
        let dev = Arc::new(dev);
        let ep = Endpoint::start(
            &config.name,
            &config.socket,
            dev.clone(),
            rt,
            config.reactors.clone(),
        )?;
        Ok(Arc::new(ScsiController {
            config,
            dev,
            ep,
            change: Mutex::new(()),
        }))
    }

    pub fn device(&self) -> &Arc<ScsiDevice> {
        &self.dev
    }

    /// Makes `bdev` target `num` (LUN 0); a connected driver is told
    /// through the event queue and scans it.
    pub fn add_target(&self, registry: &Registry, num: u32, bdev: &str) -> Result<(), VhostError> {
        let _g = self.change.lock().unwrap_or_else(|e| e.into_inner());
        if num as usize >= MAX_TARGETS {
            return Err(VhostError::Invalid(format!(
                "scsi_target_num {num} is not below {MAX_TARGETS}"
            )));
        }
        if self.dev.targets()[num as usize].is_some() {
            return Err(VhostError::Exists(format!(
                "{} target {num}",
                self.config.name
            )));
        }
        // A hot-removed bdev takes its target with it (as SPDK): the
        // driver is told on the event queue, the commands in flight end
        // (failed by the bdev layer), then the claim goes. Off the caller's
        // thread: removal waits for the queues.
        let attach_id = self.dev.new_attach_id();
        let dev = Arc::downgrade(&self.dev);
        let name = self.config.name.clone();
        let desc = registry.open(bdev, true, move |ev| {
            if ev != BdevEvent::Remove {
                return;
            }
            let (dev, name) = (dev.clone(), name.clone());
            let _ = std::thread::Builder::new()
                .name("vhost-scsi-remove".into())
                .spawn(move || {
                    let Some(dev) = dev.upgrade() else { return };
                    if let Some(slot) = dev.detach_if(num as u8, attach_id, DETACH_TIMEOUT) {
                        tracing::warn!("vhost-scsi {name}: target {num} removed with its bdev");
                        slot.desc.release_claim();
                    }
                });
        })?;
        desc.claim(&format!("vhost-scsi controller {}", self.config.name))?;
        let thin = desc.info().unmap_reads_zero;
        let id = UNIT_IDS.fetch_add(1, Ordering::Relaxed);
        let mut cfg = LuConfig::disk("ustor vhost-scsi", id, thin);
        cfg.serial = format!("{bdev:.16}");
        if thin {
            // What one UNMAP may carry (the core's limit).
            cfg.limits.max_unmap_descriptors = MAX_UNMAP_DESCRIPTORS as u32;
            cfg.limits.max_unmap_blocks = u32::MAX;
            cfg.limits.unmap_granularity_blocks = 1;
        }
        self.dev
            .attach(num as u8, bdev.to_string(), desc, cfg, attach_id)
            .map_err(|d| {
                d.release_claim();
                VhostError::Exists(format!("{} target {num}", self.config.name))
            })
    }

    /// Removes target `num`: the driver is told it is gone, its commands
    /// in flight finish, then the bdev is released.
    pub fn remove_target(&self, num: u32) -> Result<(), VhostError> {
        let _g = self.change.lock().unwrap_or_else(|e| e.into_inner());
        let missing = || VhostError::NoController(format!("{} target {num}", self.config.name));
        if num as usize >= MAX_TARGETS {
            return Err(missing());
        }
        let slot = self
            .dev
            .detach(num as u8, DETACH_TIMEOUT)
            .ok_or_else(missing)?;
        slot.desc.release_claim();
        Ok(())
    }

    /// `(target number, bdev name)` of each target.
    pub fn targets(&self) -> Vec<(u32, String)> {
        self.dev
            .targets()
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|s| (i as u32, s.bdev.clone())))
            .collect()
    }

    /// Whether a frontend is connected now.
    pub fn connected(&self) -> bool {
        self.ep.connected()
    }

    /// The connected frontend's process ID (SO_PEERCRED), when one is
    /// connected.
    pub fn frontend_pid(&self) -> Option<i32> {
        self.ep.frontend_pid()
    }

    /// Frontends served since creation.
    pub fn connections_served(&self) -> u64 {
        self.ep.connections_served()
    }

    /// Disconnects the frontend (its rings drain first), stops listening,
    /// removes the socket and releases every target's bdev. Idempotent.
    pub fn stop(&self) {
        if self.ep.stop() {
            for s in self.dev.targets().iter().flatten() {
                s.desc.release_claim();
            }
        }
    }
}

impl Drop for ScsiController {
    fn drop(&mut self) {
        self.stop();
    }
}
