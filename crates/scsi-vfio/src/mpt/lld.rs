//! `MptSas`: the [`Lld`] implementation over [`State`]: polled reply
//! FIFO, scan by INQUIRY to LUN 0 of every target the port offers, task
//! management for abort and device reset, host reset as IOC reset and a
//! new handshake.

use std::cell::RefCell;
use std::time::{Duration, Instant};

use serde_json::json;
use ustor_scsi::cdb::Cdb;
use ustor_scsi::lld::{
    Completion, DataDir, HostLimits, Lld, LocalFuture, Nexus, QueueError, ScsiCmd, Tag, TargetAddr,
    TmfResult, TransportError,
};
use ustor_vfio::Vfio;

use super::state::{SlotState, State, MAX_XFER};
use super::wire;
use super::MptError;

/// How long a control-path command (scan INQUIRY) may take.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(10);

/// The LSI SAS1068 (QEMU `mptsas1068`).
pub fn is_sas1068(id: ustor_vfio::PciId) -> bool {
    id.vendor == 0x1000 && id.device == 0x0054
}

pub struct MptSas {
    bdf: String,
    opts: crate::Options,
    st: RefCell<State>,
}

impl MptSas {
    /// Opens `bdf` (bound to vfio-pci), resets the IOC and brings it up,
    /// and maps the current reactor's buffer pool for zero-copy DMA.
    pub fn open(bdf: &str, opts: crate::Options) -> Result<MptSas, MptError> {
        let vfio = Vfio::open(bdf)?;
        let id = vfio.id()?;
        if !is_sas1068(id) {
            return Err(MptError::Ioc(format!(
                "{bdf} is PCI {:04x}:{:04x}, not an LSI SAS1068 (1000:0054)",
                id.vendor, id.device
            )));
        }
        let mut st = State::open(vfio)?;
        (st.own_pool, st.pool_mapped) = crate::map_pools(&st.vfio, bdf, &opts);
        tracing::info!(%bdf, facts = ?st.facts, "MPT SAS attached over VFIO");
        Ok(MptSas {
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
    ) -> Option<Result<ustor_scsi::ScsiStatus, TransportError>> {
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
                if let Some((f, _)) = st.take_internal(si, len as usize) {
                    return Some(f.status);
                }
                if Instant::now() > deadline {
                    st.forget(si);
                    return None;
                }
            }
            ustor_runtime::yield_now().await;
        }
    }

    async fn tmf(&self, task: u8, nexus: Nexus, task_ctx: u32) -> TmfResult {
        let sent = {
            let mut st = self.st.borrow_mut();
            st.reap();
            if st.tmf_busy && st.tmf_done.take().is_some() {
                // The late answer to a TMF that timed out: the frame is free.
                st.tmf_busy = false;
            }
            st.send_tmf(task, nexus, task_ctx)
        };
        if !sent {
            // As Linux's fusion driver: one TMF at a time, and one that
            // timed out leaves its frame with the IOC; the host reset the
            // mid-layer escalates to takes it back.
            tracing::warn!(bdf = %self.bdf, task, "IOC still holds the TMF frame: TMF not sent");
            return TmfResult::Failed;
        }
        let deadline = Instant::now() + self.opts.tmf_timeout;
        loop {
            {
                let mut st = self.st.borrow_mut();
                st.reap();
                if let Some((status, code)) = st.tmf_done.take() {
                    st.tmf_busy = false;
                    tracing::debug!(bdf = %self.bdf, task, status, code, "MPT task management");
                    return match (status, code) {
                        (
                            wire::IOCSTATUS_SUCCESS,
                            wire::TM_RSP_COMPLETE | wire::TM_RSP_SUCCEEDED,
                        ) => TmfResult::Success,
                        _ => TmfResult::Failed,
                    };
                }
                if Instant::now() > deadline {
                    tracing::warn!(bdf = %self.bdf, task, "MPT task management timed out");
                    return TmfResult::Failed;
                }
            }
            ustor_runtime::yield_now().await;
        }
    }

    fn slots_where(&self, f: impl Fn(Tag, Nexus) -> bool) -> Vec<u16> {
        let st = self.st.borrow();
        (0..st.slots.len() as u16)
            .filter(|&i| {
                let s = &st.slots[i as usize];
                s.state == SlotState::Mid && f(s.tag, s.nexus)
            })
            .collect()
    }

    /// A reset TMF, then the commands it ended forgotten.
    async fn reset_tmf(&self, task: u8, nexus: Nexus, hit: impl Fn(Nexus) -> bool) -> TmfResult {
        let r = self.tmf(task, nexus, 0).await;
        if r == TmfResult::Success {
            for si in self.slots_where(|_, n| hit(n)) {
                self.st.borrow_mut().forget(si);
            }
        }
        r
    }
}

impl Lld for MptSas {
    fn name(&self) -> &str {
        "mptsas"
    }

    fn limits(&self) -> HostLimits {
        let st = self.st.borrow();
        HostLimits {
            can_queue: st.slots_n as u32,
            cmd_per_lun: st.slots_n as u32,
            max_transfer_bytes: MAX_XFER as u32,
            max_sg_entries: st.max_sg as u32,
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
            let max = self.st.borrow().facts.max_devices as u32;
            let mut found = Vec::new();
            for target in 0..max {
                let nexus = Nexus {
                    channel: 0,
                    target,
                    lun: 0,
                };
                let inquiry = [0x12, 0, 0, 0, 36, 0];
                let Some(r) = self.internal(nexus, &inquiry, 36).await else {
                    return Err(TransportError::Protocol("scan INQUIRY timed out"));
                };
                tracing::debug!(bdf = %self.bdf, target, ?r, "scan INQUIRY");
                if r.is_ok() {
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
            let r = self.tmf(wire::TM_ABORT_TASK, nexus, si as u32).await;
            if r == TmfResult::Success {
                self.st.borrow_mut().forget(si);
            }
            r
        })
    }

    fn device_reset(&self, nexus: Nexus) -> LocalFuture<'_, TmfResult> {
        Box::pin(async move {
            let r = self
                .reset_tmf(wire::TM_LOGICAL_UNIT_RESET, nexus, |n| n == nexus)
                .await;
            if r == TmfResult::Success {
                return r;
            }
            // The LUN reset failed: escalate to the whole target.
            self.reset_tmf(wire::TM_TARGET_RESET, nexus, |n| {
                n.channel == nexus.channel && n.target == nexus.target
            })
            .await
        })
    }

    fn host_reset(&self) -> LocalFuture<'_, TmfResult> {
        Box::pin(async move {
            match self.st.borrow_mut().bring_up() {
                Ok(()) => TmfResult::Success,
                Err(e) => {
                    tracing::error!(bdf = %self.bdf, "MPT host reset failed: {e}");
                    TmfResult::Failed
                }
            }
        })
    }

    fn take_rescan(&self) -> bool {
        // Events are reaped with completions (`poll` always reaps).
        std::mem::take(&mut self.st.borrow_mut().rescan)
    }

    fn info(&self) -> serde_json::Value {
        let st = self.st.borrow();
        json!({
            "pci_address": self.bdf,
            "iommu_group": st.vfio.group(),
            "msg_version": format!("{:#x}", st.facts.msg_version),
            "product_id": format!("{:#x}", st.facts.product_id),
            "fw_version": format!("{:#x}", st.facts.fw_version),
            "max_devices": st.facts.max_devices,
            "slots": st.slots_n,
            "max_sg": st.max_sg,
            "pool_mapped_bytes": st.pool_mapped,
            "zero_copy_cmds": st.zero_copy,
            "zero_copy_other_pool_cmds": st.zero_copy_foreign,
            "bounced_cmds": st.bounced,
            "address_replies": st.address_replies,
            "event_notification": st.events_on,
            "events": st.events,
            "irq": st.wake.as_ref().map_or("none", |w| w.kind),
            "irq_wakes": st.wake.as_ref().map_or(0, |w| w.count()),
        })
    }
}
