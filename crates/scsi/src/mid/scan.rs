//! Scanning a host: targets from the LLD, LUNs from REPORT LUNS, identity
//! from INQUIRY, then upper-level driver matching and the driver's
//! bring-up ([`super::upper::UpperDriver::probe`]). A rescan adds new LUNs
//! and removes LUNs that are gone (the driver releases what it built on
//! them: sd's SCSI bdevs).

use std::rc::Rc;

use super::device::{Device, DeviceState};
use super::host::Host;
use super::stats::HostCounters;
use super::upper::driver_for;
use crate::cdb::Cdb;
use crate::inquiry::{DeviceType, StdInquiry};
use crate::lld::{DataDir, Nexus, TargetAddr, TransportError};
use crate::lun::{decode_report_luns, Hctl};

/// Most LUNs taken from one target's REPORT LUNS.
const MAX_LUNS: usize = 512;

/// What a scan changed.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct ScanReport {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    pub devices: usize,
}

pub(crate) async fn scan_host(host: &Rc<Host>) -> Result<ScanReport, TransportError> {
    host.scanning.set(true);
    let r = scan_inner(host).await;
    host.scanning.set(false);
    HostCounters::inc(&host.stats.rescans);
    super::publish_devices(host);
    r
}

async fn scan_inner(host: &Rc<Host>) -> Result<ScanReport, TransportError> {
    let targets = host.lld.scan().await?;
    let mut report = ScanReport::default();
    let mut present: Vec<Hctl> = Vec::new();
    for t in &targets {
        let luns = if t.luns.is_empty() {
            report_luns(host, t).await
        } else {
            t.luns.clone()
        };
        for lun in luns {
            let hctl = Hctl {
                host: host.no,
                channel: t.channel,
                target: t.target,
                lun,
            };
            if host.device(&hctl).is_some() {
                present.push(hctl);
                continue;
            }
            if let Some(d) = probe(host, t, hctl).await {
                report.added.push(d.name());
                host.devices.borrow_mut().push(d);
                HostCounters::inc(&host.stats.devices_added);
                present.push(hctl);
            }
        }
    }
    let gone: Vec<Rc<Device>> = host
        .devices
        .borrow()
        .iter()
        .filter(|d| !present.contains(&d.hctl))
        .cloned()
        .collect();
    for d in gone {
        tracing::info!("host{}: {} ({}) is gone", host.no, d.name(), d.hctl);
        d.set_state(DeviceState::Removed);
        host.devices.borrow_mut().retain(|x| !Rc::ptr_eq(x, &d));
        HostCounters::inc(&host.stats.devices_removed);
        super::device_gone(host, &d);
        report.removed.push(d.name());
    }
    report.devices = host.devices.borrow().len();
    Ok(report)
}

/// LUNs of a target by REPORT LUNS to LUN 0; LUN 0 alone if that fails
/// (old devices), so a scan still finds something.
async fn report_luns(host: &Host, t: &TargetAddr) -> Vec<u64> {
    let nexus = Nexus {
        channel: t.channel,
        target: t.target,
        lun: 0,
    };
    let mut alloc = 8 + 8 * 64;
    // Two passes at most: the first learns the list length.
    for _ in 0..2 {
        let out = host
            .execute(
                nexus,
                Cdb::report_luns(alloc as u32),
                DataDir::FromDevice,
                vec![0; alloc],
            )
            .await;
        if !out.ok() {
            tracing::debug!(
                "host{}: REPORT LUNS to {nexus:?} failed: {:?}",
                host.no,
                out.failure
            );
            return vec![0];
        }
        let (luns, list_len) = decode_report_luns(out.data_in(), MAX_LUNS);
        let want = 8 + list_len as usize;
        if want <= alloc || alloc >= 8 + 8 * MAX_LUNS {
            return luns;
        }
        alloc = want.min(8 + 8 * MAX_LUNS);
    }
    vec![0]
}

/// INQUIRY, registration and driver bring-up of one LUN; `None` if no
/// logical unit answers there.
async fn probe(host: &Rc<Host>, t: &TargetAddr, hctl: Hctl) -> Option<Rc<Device>> {
    let nexus = Nexus {
        channel: hctl.channel,
        target: hctl.target,
        lun: hctl.lun,
    };
    let out = host
        .execute(
            nexus,
            Cdb::inquiry(None, 96),
            DataDir::FromDevice,
            vec![0; 96],
        )
        .await;
    if !out.ok() {
        return None;
    }
    let inq = StdInquiry::decode(out.data_in())?;
    if inq.qualifier != 0 || inq.device_type == DeviceType::Unknown(0x1f) {
        return None;
    }
    let upper = driver_for(inq.device_type);
    let driver = upper.map(|u| u.name());
    let name = host.shared.alloc_name(driver.is_some());
    let dev = Rc::new(Device::new(hctl, name, t.name.clone(), &inq));
    dev.info.borrow_mut().driver = driver;
    if let Some(u) = upper {
        if let Err(why) = u.probe(host, &dev).await {
            tracing::warn!(
                "host{}: {} ({hctl}) bring-up failed: {why}; offline",
                host.no,
                dev.name()
            );
            dev.set_state(DeviceState::Offline);
            return Some(dev);
        }
    }
    dev.set_state(DeviceState::Running);
    tracing::info!(
        "host{}: {} ({hctl}) {} {} {:?} bound to {:?}",
        host.no,
        dev.name(),
        inq.vendor,
        inq.product,
        inq.device_type,
        driver
    );
    Some(dev)
}
