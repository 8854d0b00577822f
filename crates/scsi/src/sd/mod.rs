//! "sd", the upper-level driver for disks (SBC): it brings a disk up
//! (identity VPD pages, TEST UNIT READY, READ CAPACITY(16)) and owns what
//! is built on disks: the SCSI bdevs ([`bdev`]) and the forwarding of their
//! I/O from other reactors to the host's (`forward`).

pub mod bdev;
pub(crate) mod forward;

use crate::capacity::{Capacity, READ_CAPACITY_16_LEN};
use crate::cdb::Cdb;
use crate::inquiry::{self, BlockCharacteristics, BlockLimits, DeviceType};
use crate::lld::{DataDir, LocalFuture, Nexus};
use crate::mid::upper::{ProbeError, UpperDriver};
use crate::mid::{Device, Host};

const VPD_ALLOC: usize = 252;

/// The disk driver.
pub struct Sd;

impl UpperDriver for Sd {
    fn name(&self) -> &'static str {
        "sd"
    }

    fn types(&self) -> &'static [DeviceType] {
        &[DeviceType::Disk, DeviceType::SimplifiedDisk]
    }

    fn probe<'a>(
        &'a self,
        host: &'a Host,
        dev: &'a Device,
    ) -> LocalFuture<'a, Result<(), ProbeError>> {
        Box::pin(bring_up_disk(host, dev))
    }

    /// Hot-removes the device's SCSI bdevs (their I/O fails with
    /// `Removed`, their openers hear about it).
    fn remove(&self, host: &Host, dev: &Device) {
        let names: Vec<String> = {
            let mut g = host.shared.lock();
            let names = g
                .maps
                .iter()
                .filter(|m| m.hctl == dev.hctl)
                .map(|m| m.bdev.clone())
                .collect();
            g.maps.retain(|m| m.hctl != dev.hctl);
            names
        };
        for n in names {
            if let Err(e) = host.shared.bdevs.hot_remove(&n) {
                tracing::warn!("hot-removing SCSI bdev {n}: {e}");
            }
        }
    }
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

/// The SBC bring-up: identity pages, ready, capacity.
async fn bring_up_disk(host: &Host, dev: &Device) -> Result<(), ProbeError> {
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
        return Err(ProbeError::NotReady);
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
        .ok_or(ProbeError::NoCapacity)?;
    dev.set_capacity(&cap);
    Ok(())
}
