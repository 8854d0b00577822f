//! `VirtioScsi`: the [`Lld`] implementation over [`State`]: polled
//! completions, scan by INQUIRY to LUN 0 of every target, ABORT TASK and
//! LOGICAL UNIT RESET on the control queue, host reset as a device reset.

use std::cell::RefCell;
use std::time::{Duration, Instant};

use serde_json::json;
use ustor_scsi::cdb::Cdb;
use ustor_scsi::lld::{
    Completion, DataDir, HostLimits, Lld, LocalFuture, Nexus, QueueError, ScsiCmd, Tag, TargetAddr,
    TmfResult, TransportError,
};
use ustor_vfio::Vfio;

use super::state::{SlotState, State, BOUNCE, MAX_SG, SLOTS};
use super::wire;
use super::VirtioError;

/// How long a control-path command (scan INQUIRY) may take.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(10);
/// Targets probed by a scan at most (QEMU offers 256).
const MAX_SCAN_TARGETS: u32 = 64;

pub struct VirtioScsi {
    bdf: String,
    opts: crate::Options,
    st: RefCell<State>,
}

impl VirtioScsi {
    /// Opens `bdf` (bound to vfio-pci), brings the device up, and maps the
    /// current reactor's buffer pool for zero-copy DMA.
    pub fn open(bdf: &str, opts: crate::Options) -> Result<VirtioScsi, VirtioError> {
        let vfio = Vfio::open(bdf)?;
        let id = vfio.id()?;
        if !crate::is_virtio_scsi(id) {
            return Err(VirtioError::Transport(format!(
                "{bdf} is PCI {:04x}:{:04x}, not a virtio-scsi controller (1af4:1048 or 1af4:1004)",
                id.vendor, id.device
            )));
        }
        let mut st = State::open(vfio)?;
        (st.own_pool, st.pool_mapped) = crate::map_pools(&st.vfio, bdf, &opts);
        tracing::info!(%bdf, group = st.vfio.group(), "virtio-scsi attached over VFIO");
        Ok(VirtioScsi {
            bdf: bdf.to_string(),
            opts,
            st: RefCell::new(st),
        })
    }

    /// Runs one internal data-in command and waits for it (control path).
    async fn internal(
        &self,
        nexus: Nexus,
        cdb: &[u8],
        len: u32,
    ) -> Option<(wire::CmdResp, Vec<u8>)> {
        let cdb = Cdb::from_bytes(cdb)?;
        let cmd = ScsiCmd {
            tag: u32::MAX,
            nexus,
            cdb,
            dir: DataDir::FromDevice,
            iov: std::ptr::null(),
            iovcnt: 0,
            data_len: len,
        };
        let deadline = Instant::now() + CONTROL_TIMEOUT;
        let si = loop {
            match self.st.borrow_mut().submit(&cmd, SlotState::Internal) {
                Ok(si) => break si,
                Err(_) if Instant::now() < deadline => {}
                Err(_) => return None,
            }
            ustor_runtime::yield_now().await;
        };
        loop {
            {
                let mut st = self.st.borrow_mut();
                st.reap();
                if let Some(r) = st.slots[si as usize].done.take() {
                    let n = (len - r.resid.min(len)) as usize;
                    return Some((r, st.internal_data(si, n)));
                }
                if Instant::now() > deadline {
                    st.forget(si);
                    return None;
                }
            }
            ustor_runtime::yield_now().await;
        }
    }

    /// Sends one TMF and waits up to `tmf_timeout` for its answer. Under
    /// TCG QEMU handles the control queue inside the notify write, so a
    /// LUN reset (which drains the LUN's requests in QEMU's block layer)
    /// returns from `send_tmf` already answered, however long the drain
    /// took; only an ABORT TASK that QEMU cannot finish at once (the
    /// command is still in the block layer) is answered later. The log
    /// line says which it was.
    async fn tmf(&self, subtype: u32, nexus: Nexus, tag: u64) -> TmfResult {
        let what = tmf_name(subtype);
        let sent_at = Instant::now();
        let Some(k) = self.st.borrow_mut().send_tmf(subtype, nexus, tag) else {
            let held = self.st.borrow().tmfs;
            tracing::warn!(bdf = %self.bdf, ?held, "no TMF buffers free: {what} not sent");
            return TmfResult::Failed;
        };
        let notified = sent_at.elapsed();
        let deadline = Instant::now() + self.opts.tmf_timeout;
        loop {
            {
                // The clock first, then the rings: a clock read can wait on
                // QEMU's lock while it drains a LUN for this very TMF, and
                // the answer is in the ring once the read returns.
                let now = Instant::now();
                let mut st = self.st.borrow_mut();
                st.reap();
                if let Some(r) = st.take_tmf(k) {
                    tracing::info!(
                        bdf = %self.bdf,
                        "TMF {what} to {nexus:?} answered {r} after {} ms ({} ms in the notify)",
                        sent_at.elapsed().as_millis(),
                        notified.as_millis()
                    );
                    return match r {
                        0 | wire::S_FUNCTION_SUCCEEDED => TmfResult::Success,
                        _ => TmfResult::Failed,
                    };
                }
                if now > deadline {
                    // The device still owns the slot's buffers.
                    st.abandon_tmf(k);
                    tracing::warn!(
                        bdf = %self.bdf,
                        "TMF {what} to {nexus:?} timed out after {} ms ({} ms in the notify)",
                        sent_at.elapsed().as_millis(),
                        notified.as_millis()
                    );
                    return TmfResult::Failed;
                }
            }
            ustor_runtime::yield_now().await;
        }
    }

    /// Slots of mid-layer commands matching `f`.
    fn slots_where(&self, f: impl Fn(Tag, Nexus) -> bool) -> Vec<u16> {
        let st = self.st.borrow();
        (0..st.slots.len() as u16)
            .filter(|&i| {
                let s = &st.slots[i as usize];
                s.state == SlotState::Mid && f(s.tag, s.nexus)
            })
            .collect()
    }
}

impl Lld for VirtioScsi {
    fn name(&self) -> &str {
        "virtio-scsi"
    }

    fn limits(&self) -> HostLimits {
        let c = self.st.borrow().cfg;
        let sectors = if c.max_sectors == 0 {
            u32::MAX
        } else {
            c.max_sectors
        };
        HostLimits {
            can_queue: SLOTS as u32,
            cmd_per_lun: c.cmd_per_lun.clamp(1, SLOTS as u32),
            max_transfer_bytes: (BOUNCE as u32).min(sectors.saturating_mul(512)),
            max_sg_entries: (MAX_SG as u32).min(c.seg_max.max(1)),
            dma_alignment: 1,
        }
    }

    fn queuecommand(&self, cmd: &ScsiCmd) -> Result<(), QueueError> {
        self.st.borrow_mut().submit(cmd, SlotState::Mid).map(|_| ())
    }

    fn poll(&self, budget: usize, done: &mut dyn FnMut(Completion<'_>)) -> usize {
        let mut n = 0;
        let mut reaped = false;
        while n < budget {
            let f = {
                let mut st = self.st.borrow_mut();
                match st.take_ready() {
                    Some(f) => Some(f),
                    None if !reaped => {
                        reaped = true;
                        st.reap();
                        st.take_ready()
                    }
                    None => None,
                }
            };
            // The borrow is released: `done` may queue the next command.
            let Some(f) = f else { break };
            done(Completion {
                tag: f.tag,
                status: f.status,
                sense: &f.sense[..f.sense_len],
                resid: f.resid,
            });
            n += 1;
        }
        n
    }

    fn scan(&self) -> LocalFuture<'_, Result<Vec<TargetAddr>, TransportError>> {
        Box::pin(async move {
            let max = (self.st.borrow().cfg.max_target as u32).min(MAX_SCAN_TARGETS - 1);
            let mut found = Vec::new();
            for target in 0..=max {
                let nexus = Nexus {
                    channel: 0,
                    target,
                    lun: 0,
                };
                let inquiry = [0x12, 0, 0, 0, 36, 0];
                let Some((r, _)) = self.internal(nexus, &inquiry, 36).await else {
                    return Err(TransportError::Protocol("scan INQUIRY timed out"));
                };
                tracing::debug!(bdf = %self.bdf, target, ?r, "scan INQUIRY");
                if r.response == wire::S_OK {
                    found.push(TargetAddr {
                        channel: 0,
                        target,
                        name: format!("{}:{target}", self.bdf),
                        luns: Vec::new(),
                    });
                }
            }
            Ok(found)
        })
    }

    fn abort(&self, tag: Tag, nexus: Nexus) -> LocalFuture<'_, TmfResult> {
        Box::pin(async move {
            let Some(&si) = self.slots_where(|t, n| t == tag && n == nexus).first() else {
                return TmfResult::Success;
            };
            let r = self.tmf(wire::TMF_ABORT_TASK, nexus, si as u64).await;
            if r == TmfResult::Success {
                self.st.borrow_mut().forget(si);
            }
            r
        })
    }

    fn device_reset(&self, nexus: Nexus) -> LocalFuture<'_, TmfResult> {
        Box::pin(async move {
            let r = self.tmf(wire::TMF_LOGICAL_UNIT_RESET, nexus, 0).await;
            if r == TmfResult::Success {
                for si in self.slots_where(|_, n| n == nexus) {
                    self.st.borrow_mut().forget(si);
                }
            }
            r
        })
    }

    fn host_reset(&self) -> LocalFuture<'_, TmfResult> {
        Box::pin(async move {
            match self.st.borrow_mut().bring_up(true) {
                Ok(()) => TmfResult::Success,
                Err(e) => {
                    tracing::error!(bdf = %self.bdf, "virtio-scsi host reset failed: {e}");
                    TmfResult::Failed
                }
            }
        })
    }

    fn take_rescan(&self) -> bool {
        let mut st = self.st.borrow_mut();
        // Events are reaped with completions; one with no I/O running
        // needs a look at the rings here.
        st.reap();
        std::mem::take(&mut st.rescan)
    }

    fn info(&self) -> serde_json::Value {
        let st = self.st.borrow();
        json!({
            "pci_address": self.bdf,
            "iommu_group": st.vfio.group(),
            "features": format!("{:#x}", st.cfg.features),
            "max_target": st.cfg.max_target,
            "max_lun": st.cfg.max_lun,
            "pool_mapped_bytes": st.pool_mapped,
            "zero_copy_cmds": st.zero_copy,
            "zero_copy_other_pool_cmds": st.zero_copy_foreign,
            "bounced_cmds": st.bounced,
            "events": st.events,
            "irq": st.wake.as_ref().map_or("none", |w| w.kind),
            "irq_wakes": st.wake.as_ref().map_or(0, |w| w.count()),
        })
    }
}

/// A TMF subtype's name for the log.
fn tmf_name(subtype: u32) -> &'static str {
    match subtype {
        wire::TMF_ABORT_TASK => "ABORT TASK",
        wire::TMF_LOGICAL_UNIT_RESET => "LOGICAL UNIT RESET",
        _ => "TMF",
    }
}
