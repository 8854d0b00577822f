//! Scanning a host: targets from the LLD, LUNs from REPORT LUNS, identity
//! from INQUIRY, then device-type driver matching and bring-up (VPD pages,
//! TEST UNIT READY, READ CAPACITY(16)). A rescan adds new LUNs and removes
//! LUNs that are gone (with the SCSI bdevs on them).

use std::rc::Rc;

use super::device::{match_driver, Device, DeviceState};
use super::host::Host;
use super::stats::HostCounters;
use crate::capacity::{Capacity, READ_CAPACITY_16_LEN};
use crate::cdb::Cdb;
use crate::inquiry::{self, BlockCharacteristics, BlockLimits, DeviceType, StdInquiry};
use crate::lld::{DataDir, Nexus, TargetAddr, TransportError};
use crate::lun::{decode_report_luns, Hctl};

/// Most LUNs taken from one target's REPORT LUNS.
const MAX_LUNS: usize = 512;
const VPD_ALLOC: usize = 252;

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

async fn vpd(host: &Host, nexus: Nexus, page: u8) -> Option<Vec<u8>> {
    let out = host
        .execute(
            nexus,
            Cdb::inquiry(Some(page), VPD_ALLOC as u16),
            DataDir::FromDevice,
            vec![0; VPD_ALLOC],
        )
        .await;
    out.ok().then(|| out.data_in().to_vec())
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
    let driver = match_driver(inq.device_type);
    let name = host.shared.alloc_name(driver.is_some());
    let dev = Rc::new(Device::new(hctl, name, t.name.clone(), &inq));
    dev.info.borrow_mut().driver = driver;
    if driver == Some("sd") {
        if let Err(why) = bring_up_disk(host, &dev).await {
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

/// The SBC driver's bring-up: identity pages, ready, capacity.
async fn bring_up_disk(host: &Host, dev: &Device) -> Result<(), &'static str> {
    let nexus = dev.nexus;
    let pages = vpd(host, nexus, inquiry::VPD_SUPPORTED)
        .await
        .map(|b| inquiry::decode_supported(&b))
        .unwrap_or_default();
    if pages.contains(&inquiry::VPD_SERIAL) {
        let s = vpd(host, nexus, inquiry::VPD_SERIAL).await;
        dev.info.borrow_mut().serial = s
            .and_then(|b| inquiry::decode_serial(&b))
            .filter(|s| !s.is_empty());
    }
    if pages.contains(&inquiry::VPD_DEVICE_ID) {
        if let Some(b) = vpd(host, nexus, inquiry::VPD_DEVICE_ID).await {
            let ids = inquiry::decode_device_id(&b)
                .iter()
                .filter(|d| d.association == 0)
                .map(|d| d.id())
                .collect();
            dev.info.borrow_mut().ids = ids;
        }
    }
    if pages.contains(&inquiry::VPD_BLOCK_LIMITS) {
        let b = vpd(host, nexus, inquiry::VPD_BLOCK_LIMITS).await;
        dev.info.borrow_mut().block_limits = b.and_then(|b| BlockLimits::decode(&b));
    }
    if pages.contains(&inquiry::VPD_BLOCK_CHARACTERISTICS) {
        let b = vpd(host, nexus, inquiry::VPD_BLOCK_CHARACTERISTICS).await;
        dev.info.borrow_mut().characteristics = b.and_then(|b| BlockCharacteristics::decode(&b));
    }
    // Unit attentions (power on, reset) and "becoming ready" are retried
    // by the rules; what is left is a real failure.
    let tur = host
        .execute(nexus, Cdb::test_unit_ready(), DataDir::None, Vec::new())
        .await;
    if !tur.ok() {
        return Err("TEST UNIT READY failed");
    }
    let out = host
        .execute(
            nexus,
            Cdb::read_capacity_16(READ_CAPACITY_16_LEN as u32),
            DataDir::FromDevice,
            vec![0; READ_CAPACITY_16_LEN],
        )
        .await;
    let cap = out
        .ok()
        .then(|| Capacity::decode(out.data_in()))
        .flatten()
        .ok_or("READ CAPACITY(16) failed")?;
    dev.set_capacity(&cap);
    Ok(())
}
