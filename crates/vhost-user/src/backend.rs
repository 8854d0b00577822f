//! The vhost-user control state of one connected frontend: what the
//! messages set (features, memory table, ring addresses, eventfds) and
//! when a ring starts and stops on its reactor.
//!
//! `vhost`'s `BackendReqHandler` decodes each message and calls these
//! methods; they run on the controller's control thread, never on a
//! reactor. A ring runs once it has memory, addresses, a kick eventfd and
//! is enabled (or, without VHOST_USER_F_PROTOCOL_FEATURES, once kicked);
//! changing any of those stops it first, and GET_VRING_BASE stops it and
//! answers where it stopped.
//!
//! The handling is the same for every device type: what differs (feature
//! bits, config space, what runs a ring) comes from [`VhostDevice`],
//! implemented by [`BlkDevice`] and by the SCSI device ([`crate::scsi`]).

use std::fs::File;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use ustor_runtime::RuntimeHandle;
use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserConfigFlags, VhostUserInflight,
    VhostUserLog, VhostUserMemoryRegion, VhostUserProtocolFeatures, VhostUserShMemConfig,
    VhostUserSharedMsg, VhostUserSingleMemoryRegion, VhostUserVringAddrFlags, VhostUserVringState,
};
use vhost::vhost_user::{
    Error as VuError, GpuBackend, Result as VuResult, VhostUserBackendReqHandlerMut,
};
use vhost::VhostUserMemoryRegionBase;

use crate::blk::feature;
use crate::device::BlkDevice;
use crate::eventfd;
use crate::inflight::InflightRegion;
use crate::memory::{MemTable, RegionDesc, MAX_SLOTS};
use crate::start::VringStart;
use crate::vring;

/// What a device type supplies to the shared message handling.
pub trait VhostDevice: Send + Sync + Sized + 'static {
    /// Rings offered (GET_QUEUE_NUM); rings beyond are refused.
    fn num_queues(&self) -> u16;
    /// Device feature bits (with the vhost-user and ring bits).
    fn features(&self) -> u64;
    fn protocol_features(&self) -> VhostUserProtocolFeatures;
    /// The device's config space now (GET_CONFIG answers slices of it).
    fn config(&self) -> Vec<u8>;
    /// SET_CONFIG with the features the driver acked; false: refused.
    fn set_config(&self, acked: u64, offset: u32, buf: &[u8]) -> bool;
    /// The frontend's backend channel (SET_BACKEND_REQ_FD), or its end;
    /// for devices that offer BACKEND_REQ.
    fn set_notifier(&self, _ch: Option<std::os::unix::net::UnixStream>) {}
    /// Serves one ring on the calling reactor until it is stopped, then
    /// reports its indices through `start.done`.
    fn run_queue(start: VringStart<Self>) -> impl Future<Output = ()> + 'static;
}

impl VhostDevice for BlkDevice {
    fn num_queues(&self) -> u16 {
        self.geometry.num_queues
    }
    fn features(&self) -> u64 {
        let packed = if self.packed_ring {
            feature::RING_PACKED
        } else {
            0
        };
        self.geometry.features() | packed
    }
    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::RESET_DEVICE
            | VhostUserProtocolFeatures::INFLIGHT_SHMFD
            // The backend channel, for config-change notifications
            // (resize); taken by `notify`, not the `vhost` crate.
            | VhostUserProtocolFeatures::BACKEND_REQ
    }
    fn config(&self) -> Vec<u8> {
        // The capacity now (a resize changes it), not the geometry's.
        BlkDevice::config(self).to_vec()
    }
    fn set_config(&self, acked: u64, offset: u32, buf: &[u8]) -> bool {
        // Only the cache mode is writable (CONFIG_WCE).
        if offset == 32 && buf.len() == 1 && acked & feature::CONFIG_WCE != 0 {
            self.writeback.store(buf[0] != 0, Ordering::Relaxed);
            return true;
        }
        false
    }
    fn set_notifier(&self, ch: Option<std::os::unix::net::UnixStream>) {
        BlkDevice::set_notifier(self, ch)
    }
    fn run_queue(start: VringStart<Self>) -> impl Future<Output = ()> + 'static {
        vring::run(start)
    }
}

/// Longest queue the frontend may ask for.
pub const QUEUE_SIZE_MAX: u16 = 1024;
/// How long a stopping ring may take to finish its requests in flight.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Default)]
struct VringCtl {
    size: u16,
    /// Frontend virtual addresses (translated when the ring starts).
    addrs: Option<(u64, u64, u64)>,
    /// SET_VRING_BASE's value, or where the ring last stopped (packed:
    /// both sides with their wrap counters, `avail | used << 16`).
    base: u32,
    kick: Option<Arc<File>>,
    /// Shared with the running ring, which signals whatever it holds.
    call: Arc<eventfd::CallFd>,
    enabled: bool,
    running: Option<Running>,
}

struct Running {
    stop: Arc<AtomicBool>,
    kick: Arc<File>,
    done: mpsc::Receiver<(u16, u16)>,
}

/// One frontend connection's state.
pub struct Backend<D: VhostDevice> {
    dev: Arc<D>,
    rt: RuntimeHandle,
    reactors: Vec<usize>,
    acked: u64,
    protocol: u64,
    mem: MemTable,
    vrings: Vec<VringCtl>,
    /// The inflight region (GET_INFLIGHT_FD / SET_INFLIGHT_FD), when the
    /// frontend uses one.
    inflight: Option<Arc<InflightRegion>>,
}

/// The vhost-user-blk handler.
pub type BlkBackend = Backend<BlkDevice>;

fn internal(why: &'static str) -> VuError {
    VuError::InvalidOperation(why)
}

impl<D: VhostDevice> Backend<D> {
    pub fn new(dev: Arc<D>, rt: RuntimeHandle, reactors: Vec<usize>) -> Backend<D> {
        let n = dev.num_queues() as usize;
        Backend {
            dev,
            rt,
            reactors,
            acked: 0,
            protocol: 0,
            mem: MemTable::default(),
            vrings: (0..n).map(|_| VringCtl::default()).collect(),
            inflight: None,
        }
    }

    fn vring(&mut self, index: u32) -> VuResult<&mut VringCtl> {
        self.vrings
            .get_mut(index as usize)
            .ok_or(VuError::InvalidParam)
    }

    fn protocol_features_acked(&self) -> bool {
        self.acked & feature::PROTOCOL_FEATURES != 0
    }

    fn packed(&self) -> bool {
        self.acked & feature::RING_PACKED != 0
    }

    /// Starts ring `i` when it has everything it needs and is not running.
    fn maybe_start(&mut self, i: usize) -> VuResult<()> {
        let pf = self.protocol_features_acked();
        let v = &self.vrings[i];
        if v.running.is_some() || self.mem.is_empty() || v.size == 0 {
            return Ok(());
        }
        let (Some(kick), Some((d, a, u))) = (v.kick.clone(), v.addrs) else {
            return Ok(());
        };
        if pf && !v.enabled {
            return Ok(());
        }
        let tr = |va| self.mem.va_to_gpa(va).ok_or(VuError::InvalidParam);
        let (desc, avail, used) = (tr(d)?, tr(a)?, tr(u)?);
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel();
        let start = VringStart {
            index: i as u16,
            size: v.size,
            desc,
            avail,
            used,
            base: v.base,
            packed: self.packed(),
            event_idx: self.acked & feature::EVENT_IDX != 0,
            kick: kick.clone(),
            call: v.call.clone(),
            mem: self.mem.atomic(),
            mem_gen: self.mem.generation(),
            dev: self.dev.clone(),
            stop: stop.clone(),
            done: tx,
            inflight: self
                .inflight
                .as_ref()
                // A ring beyond the region (or of another size) runs
                // untracked rather than trusting the frontend; a packed
                // ring needs a region with room for the packed layout.
                .filter(|r| r.queue_size() == v.size && (i as u16) < r.num_queues())
                .filter(|r| !self.packed() || r.fits_packed())
                .map(|r| r.queue(i as u16)),
        };
        let reactor = self.reactors[i % self.reactors.len()];
        self.rt
            .spawn_on(reactor, move || D::run_queue(start))
            .map_err(|_| internal("reactor gone"))?;
        self.vrings[i].running = Some(Running {
            stop,
            kick,
            done: rx,
        });
        Ok(())
    }

    /// Stops ring `i` (waiting for its requests in flight) and keeps where
    /// it stopped as its base.
    fn stop(&mut self, i: usize) -> VuResult<()> {
        let Some(r) = self.vrings[i].running.take() else {
            return Ok(());
        };
        r.stop.store(true, Ordering::Release);
        eventfd::kick(&r.kick);
        let (avail, used) = r
            .done
            .recv_timeout(STOP_TIMEOUT)
            .map_err(|_| internal("ring did not stop"))?;
        // A packed ring reports both sides (vhost-user: bits 0-15 the
        // available side, 16-31 the used side, wrap counters in bit 15 of
        // each); a split ring its next available index.
        self.vrings[i].base = match self.packed() {
            true => avail as u32 | (used as u32) << 16,
            false => avail as u32,
        };
        Ok(())
    }

    /// Restarts ring `i` after a change to what it runs with.
    fn restart(&mut self, i: usize) -> VuResult<()> {
        self.stop(i)?;
        self.maybe_start(i)
    }

    /// Stops every ring and forgets the frontend (disconnect).
    pub fn reset(&mut self) {
        for i in 0..self.vrings.len() {
            let _ = self.stop(i);
            self.vrings[i] = VringCtl::default();
        }
        self.mem.clear();
        self.inflight = None;
        self.acked = 0;
        self.protocol = 0;
    }

    fn restart_all(&mut self) -> VuResult<()> {
        for i in 0..self.vrings.len() {
            if self.vrings[i].running.is_some() {
                self.restart(i)?;
            }
        }
        Ok(())
    }
}

fn region(r: &VhostUserMemoryRegion) -> RegionDesc {
    RegionDesc {
        guest_phys_addr: r.guest_phys_addr,
        size: r.memory_size,
        user_addr: r.user_addr,
        mmap_offset: r.mmap_offset,
    }
}

fn mem_err(e: crate::memory::MemError) -> VuError {
    tracing::warn!("vhost: memory region refused: {e}");
    VuError::InvalidParam
}

impl<D: VhostDevice> VhostUserBackendReqHandlerMut for Backend<D> {
    fn set_owner(&mut self) -> VuResult<()> {
        Ok(())
    }
    fn reset_owner(&mut self) -> VuResult<()> {
        self.reset();
        Ok(())
    }
    fn reset_device(&mut self) -> VuResult<()> {
        // Rings only (as libvhost-user): the frontend keeps its view of the
        // memory table and, with memory slots, sends only changes to it
        // afterwards (QEMU's vhost-user-scsi resets the device whenever
        // the guest resets it, then starts the rings on the same memory).
        for i in 0..self.vrings.len() {
            let _ = self.stop(i);
            self.vrings[i] = VringCtl::default();
        }
        Ok(())
    }
    fn get_features(&mut self) -> VuResult<u64> {
        Ok(self.dev.features())
    }
    fn set_features(&mut self, features: u64) -> VuResult<()> {
        if features & !self.dev.features() != 0 {
            let extra = features & !self.dev.features();
            tracing::warn!("vhost: SET_FEATURES with bits not offered: {extra:#x}");
            return Err(VuError::InvalidParam);
        }
        self.acked = features;
        Ok(())
    }
    fn set_mem_table(
        &mut self,
        ctx: &[VhostUserMemoryRegion],
        files: Vec<File>,
        _postcopy: Option<bool>,
    ) -> VuResult<Option<Vec<VhostUserMemoryRegionBase>>> {
        let regions = ctx.iter().map(region).zip(files).collect();
        self.mem.set(regions).map_err(mem_err)?;
        self.restart_all()?;
        Ok(None)
    }
    fn set_vring_num(&mut self, index: u32, num: u32) -> VuResult<()> {
        // Packed rings may have any size (virtio 1.1, 2.8.10).
        let pow2 = num.is_power_of_two() || self.packed();
        if num == 0 || num > QUEUE_SIZE_MAX as u32 || !pow2 {
            return Err(VuError::InvalidParam);
        }
        self.vring(index)?.size = num as u16;
        Ok(())
    }
    fn set_vring_addr(
        &mut self,
        index: u32,
        _flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        _log: u64,
    ) -> VuResult<()> {
        self.vring(index)?.addrs = Some((descriptor, available, used));
        self.restart(index as usize)
    }
    fn set_vring_base(&mut self, index: u32, base: u32) -> VuResult<()> {
        let v = self.vring(index)?;
        if v.running.is_some() {
            return Err(internal("SET_VRING_BASE on a running ring"));
        }
        v.base = base;
        Ok(())
    }
    fn get_vring_base(&mut self, index: u32) -> VuResult<VhostUserVringState> {
        self.vring(index)?;
        self.stop(index as usize)?;
        let v = &mut self.vrings[index as usize];
        let base = v.base;
        v.kick = None;
        v.call.set(None);
        v.enabled = false;
        Ok(VhostUserVringState::new(index, base))
    }
    fn set_vring_kick(&mut self, index: u8, fd: Option<File>) -> VuResult<()> {
        self.vring(index as u32)?.kick = fd.map(Arc::new);
        self.restart(index as usize)
    }
    fn set_vring_call(&mut self, index: u8, fd: Option<File>) -> VuResult<()> {
        // Swapped in place, running or not (see `eventfd::CallFd`).
        let call = &self.vring(index as u32)?.call;
        call.set(fd.map(Arc::new));
        // One signal on every new call fd (as libvhost-user does). QEMU
        // starts a ring before it hands over the call fd when the guest
        // masks its vectors (GET_VRING_BASE took the old one), and a
        // completion may signal the old fd just before the swap: a chain
        // returned so had no signal the driver sees, and it would wait for
        // it forever. A spurious one only makes the driver look at its
        // used ring.
        call.signal();
        Ok(())
    }
    fn set_vring_err(&mut self, index: u8, _fd: Option<File>) -> VuResult<()> {
        self.vring(index as u32)?;
        Ok(())
    }
    fn get_protocol_features(&mut self) -> VuResult<VhostUserProtocolFeatures> {
        Ok(self.dev.protocol_features())
    }
    fn set_protocol_features(&mut self, features: u64) -> VuResult<()> {
        self.protocol = features;
        Ok(())
    }
    fn get_queue_num(&mut self) -> VuResult<u64> {
        Ok(self.vrings.len() as u64)
    }
    fn set_vring_enable(&mut self, index: u32, enable: bool) -> VuResult<()> {
        self.vring(index)?.enabled = enable;
        if enable {
            self.maybe_start(index as usize)
        } else {
            self.stop(index as usize)
        }
    }
    fn get_config(
        &mut self,
        offset: u32,
        size: u32,
        _flags: VhostUserConfigFlags,
    ) -> VuResult<Vec<u8>> {
        // Answered at the size asked, zero-padded past the real config
        // (SPDK's frontend asks 256 bytes).
        if offset as u64 + size as u64 > 4096 {
            return Err(VuError::InvalidParam);
        }
        let cfg = self.dev.config();
        let mut out = vec![0u8; size as usize];
        let start = (offset as usize).min(cfg.len());
        let end = (offset as usize + size as usize).min(cfg.len());
        out[..end - start].copy_from_slice(&cfg[start..end]);
        Ok(out)
    }
    fn set_config(
        &mut self,
        offset: u32,
        buf: &[u8],
        _flags: VhostUserConfigFlags,
    ) -> VuResult<()> {
        if self.dev.set_config(self.acked, offset, buf) {
            return Ok(());
        }
        Err(VuError::InvalidParam)
    }
    fn set_gpu_socket(&mut self, _gpu_backend: GpuBackend) -> VuResult<()> {
        Err(internal("not a GPU"))
    }
    fn get_shared_object(&mut self, _uuid: VhostUserSharedMsg) -> VuResult<File> {
        Err(internal("no shared objects"))
    }
    fn get_inflight_fd(
        &mut self,
        inflight: &VhostUserInflight,
    ) -> VuResult<(VhostUserInflight, File)> {
        let (nq, qs) = (inflight.num_queues, inflight.queue_size);
        if nq == 0 || nq as usize > self.vrings.len() || qs == 0 || qs > QUEUE_SIZE_MAX {
            return Err(VuError::InvalidParam);
        }
        // The frontend may ask before it sets features (QEMU does): a
        // device that offers packed rings gets room for their layout.
        let packed = self.dev.features() & feature::RING_PACKED != 0;
        let (region, file) = InflightRegion::create(nq, qs, packed).map_err(|e| {
            tracing::warn!("vhost: {e}");
            internal("inflight region")
        })?;
        let size = region.size_bytes();
        self.inflight = Some(region);
        Ok((
            VhostUserInflight {
                mmap_size: size,
                mmap_offset: 0,
                num_queues: nq,
                queue_size: qs,
            },
            file,
        ))
    }
    fn set_inflight_fd(&mut self, inflight: &VhostUserInflight, file: File) -> VuResult<()> {
        let (nq, qs) = (inflight.num_queues, inflight.queue_size);
        if nq == 0 || nq as usize > self.vrings.len() || qs == 0 || qs > QUEUE_SIZE_MAX {
            return Err(VuError::InvalidParam);
        }
        let region = InflightRegion::open(file, inflight.mmap_offset, inflight.mmap_size, nq, qs)
            .map_err(|e| {
            tracing::warn!("vhost: {e}");
            VuError::InvalidParam
        })?;
        self.inflight = Some(region);
        Ok(())
    }
    fn get_max_mem_slots(&mut self) -> VuResult<u64> {
        Ok(MAX_SLOTS as u64)
    }
    fn add_mem_region(
        &mut self,
        r: &VhostUserSingleMemoryRegion,
        fd: File,
        _postcopy: Option<bool>,
    ) -> VuResult<Option<VhostUserMemoryRegionBase>> {
        self.mem.add(region(r), fd).map_err(mem_err)?;
        // Rings waiting for memory may start now.
        for i in 0..self.vrings.len() {
            self.maybe_start(i)?;
        }
        Ok(None)
    }
    fn remove_mem_region(&mut self, r: &VhostUserSingleMemoryRegion) -> VuResult<()> {
        self.mem.remove(&region(r)).map_err(mem_err)
    }
    fn set_device_state_fd(
        &mut self,
        _direction: VhostTransferStateDirection,
        _phase: VhostTransferStatePhase,
        _fd: File,
    ) -> VuResult<Option<File>> {
        Err(internal("no device state transfer"))
    }
    fn check_device_state(&mut self) -> VuResult<()> {
        Err(internal("no device state transfer"))
    }
    fn get_shmem_config(&mut self) -> VuResult<VhostUserShMemConfig> {
        Err(internal("no shared memory regions"))
    }
    fn set_log_base(&mut self, _log: &VhostUserLog, _file: File) -> VuResult<()> {
        Err(internal("no dirty log"))
    }
}
