//! Error handling, Linux SCSI EH's escalation: for each timed-out command
//! ABORT TASK; where that fails, LOGICAL UNIT RESET of its device; where
//! that fails, host reset; where that fails, the devices are taken offline.
//! Each step is logged and counted. New bdev I/O waits in the host's
//! backlog while this runs (the host is "in recovery").

use std::rc::Rc;

use super::device::DeviceState;
use super::host::{Host, SlotState};
use super::retry::Failure;
use super::stats::HostCounters;
use crate::lld::{Nexus, TmfResult};

/// Rounds of escalation per run (a command timing out again during
/// recovery is handled by the next round, not forever).
const MAX_ROUNDS: usize = 4;

pub(crate) async fn run(host: Rc<Host>) {
    HostCounters::inc(&host.stats.eh_runs);
    for _ in 0..MAX_ROUNDS {
        let timed: Vec<u16> = (0..host.slots().len() as u16)
            .filter(|&i| host.slots()[i as usize].state.get() == SlotState::TimedOut)
            .collect();
        if timed.is_empty() {
            break;
        }
        round(&host, &timed).await;
    }
    host.in_eh.set(false);
    super::publish_devices(&host);
}

async fn round(host: &Rc<Host>, timed: &[u16]) {
    let mut reset: Vec<Nexus> = Vec::new();
    for &i in timed {
        let s = &host.slots()[i as usize];
        if s.state.get() != SlotState::TimedOut {
            continue; // reclaimed by an earlier step of this round
        }
        let nexus = s.cmd.get().nexus;
        let tag = host.tag_of(i);
        HostCounters::inc(&host.stats.aborts);
        tracing::warn!(
            "host{}: EH: abort tag {tag:#x} ({:?}) on {nexus:?}",
            host.no,
            s.cmd.get().cdb
        );
        match host.lld.abort(tag, nexus).await {
            TmfResult::Success => host.retry_or_fail(i, 0, Failure::TimedOut),
            TmfResult::Failed => {
                HostCounters::inc(&host.stats.aborts_failed);
                tracing::warn!("host{}: EH: abort of tag {tag:#x} failed", host.no);
                if !reset.contains(&nexus) {
                    reset.push(nexus);
                }
            }
        }
    }
    let mut failed: Vec<Nexus> = Vec::new();
    for nexus in reset {
        HostCounters::inc(&host.stats.device_resets);
        tracing::warn!("host{}: EH: logical unit reset of {nexus:?}", host.no);
        match host.lld.device_reset(nexus).await {
            TmfResult::Success => reclaim(host, |n| n == nexus),
            TmfResult::Failed => {
                HostCounters::inc(&host.stats.device_resets_failed);
                tracing::warn!(
                    "host{}: EH: logical unit reset of {nexus:?} failed",
                    host.no
                );
                failed.push(nexus);
            }
        }
    }
    if failed.is_empty() {
        return;
    }
    HostCounters::inc(&host.stats.host_resets);
    tracing::warn!("host{}: EH: host reset", host.no);
    match host.lld.host_reset().await {
        TmfResult::Success => reclaim(host, |_| true),
        TmfResult::Failed => {
            HostCounters::inc(&host.stats.host_resets_failed);
            tracing::error!(
                "host{}: EH: host reset failed; taking {failed:?} offline",
                host.no
            );
            offline(host, &failed);
        }
    }
}

/// Commands the LLD dropped in a successful reset go round again.
fn reclaim(host: &Host, on: impl Fn(Nexus) -> bool) {
    for (i, s) in host.slots().iter().enumerate() {
        let st = s.state.get();
        if matches!(st, SlotState::Issued | SlotState::TimedOut) && on(s.cmd.get().nexus) {
            host.retry_or_fail(i as u16, 0, Failure::TimedOut);
        }
    }
}

fn offline(host: &Host, devs: &[Nexus]) {
    for d in host.devices.borrow().iter() {
        if devs.contains(&d.nexus) && d.state() != DeviceState::Offline {
            d.set_state(DeviceState::Offline);
            HostCounters::inc(&host.stats.offlined);
        }
    }
    for (i, s) in host.slots().iter().enumerate() {
        let st = s.state.get();
        if matches!(
            st,
            SlotState::Issued | SlotState::TimedOut | SlotState::Delayed
        ) && devs.contains(&s.cmd.get().nexus)
        {
            if st == SlotState::Delayed {
                // Its retry would fail fast anyway; fail it now.
                host.undelay();
            }
            s.failure.set(Some(Failure::Offline));
            host.finish(i as u16);
        }
    }
}

/// A user-requested LOGICAL UNIT RESET (`scsi_device_reset`).
pub(crate) async fn device_reset(host: &Rc<Host>, nexus: Nexus) -> TmfResult {
    HostCounters::inc(&host.stats.device_resets);
    tracing::info!("host{}: logical unit reset of {nexus:?} requested", host.no);
    let r = host.lld.device_reset(nexus).await;
    match r {
        TmfResult::Success => reclaim(host, |n| n == nexus),
        TmfResult::Failed => HostCounters::inc(&host.stats.device_resets_failed),
    }
    r
}

/// A user-requested host reset (`scsi_host_reset`).
pub(crate) async fn host_reset(host: &Rc<Host>) -> TmfResult {
    HostCounters::inc(&host.stats.host_resets);
    tracing::info!("host{}: host reset requested", host.no);
    let r = host.lld.host_reset().await;
    match r {
        TmfResult::Success => reclaim(host, |_| true),
        TmfResult::Failed => HostCounters::inc(&host.stats.host_resets_failed),
    }
    r
}
