//! A SCSI device (logical unit) as the mid-layer knows it: its address,
//! identity from INQUIRY and VPD, capacity, state, and the driver bound to
//! it.

use std::cell::{Cell, RefCell};

use serde::Serialize;

use crate::capacity::Capacity;
use crate::inquiry::{BlockCharacteristics, BlockLimits, DeviceType, StdInquiry};
use crate::lld::Nexus;
use crate::lun::Hctl;
use crate::sense::Sense;

/// Lifecycle of a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceState {
    /// Found by a scan, identity being read.
    Probing,
    /// Bound and serving I/O.
    Running,
    /// Error handling gave up on it: I/O fails at once.
    Offline,
    /// Gone from the target (rescan or REPORTED LUNS DATA HAS CHANGED).
    Removed,
}

/// What the mid-layer publishes about a device (`scsi_get_devices`).
#[derive(Clone, Debug, Serialize)]
pub struct DeviceInfo {
    pub name: String,
    pub hctl: String,
    pub host: u32,
    pub channel: u32,
    pub target: u32,
    pub lun: u64,
    pub target_name: String,
    pub device_type: DeviceType,
    /// Device-type driver bound to it ("sd"), or `None` (listed, unbound).
    pub driver: Option<&'static str>,
    pub vendor: String,
    pub product: String,
    pub revision: String,
    pub serial: Option<String>,
    /// Designators from VPD page 0x83 (`naa.…`, `eui.…`, …).
    pub ids: Vec<String>,
    pub block_size: u32,
    pub num_blocks: u64,
    pub thin_provisioned: bool,
    /// READ CAPACITY(16) LBPRZ: unmapped blocks read as zeroes.
    pub unmap_reads_zero: bool,
    pub block_limits: Option<BlockLimits>,
    pub characteristics: Option<BlockCharacteristics>,
    pub state: DeviceState,
    /// The last sense the device returned with a failed command.
    pub last_sense: Option<Sense>,
}

/// The reactor-local device object.
pub struct Device {
    pub hctl: Hctl,
    pub nexus: Nexus,
    pub(crate) state: Cell<DeviceState>,
    pub(crate) info: RefCell<DeviceInfo>,
    pub(crate) last_sense: Cell<Option<Sense>>,
    /// Commands outstanding (for LUN queue depth).
    pub(crate) inflight: Cell<u32>,
}

impl Device {
    pub(crate) fn new(hctl: Hctl, name: String, target_name: String, inq: &StdInquiry) -> Device {
        Device {
            hctl,
            nexus: Nexus {
                channel: hctl.channel,
                target: hctl.target,
                lun: hctl.lun,
            },
            state: Cell::new(DeviceState::Probing),
            info: RefCell::new(DeviceInfo {
                name,
                hctl: hctl.to_string(),
                host: hctl.host,
                channel: hctl.channel,
                target: hctl.target,
                lun: hctl.lun,
                target_name,
                device_type: inq.device_type,
                driver: None,
                vendor: inq.vendor.clone(),
                product: inq.product.clone(),
                revision: inq.revision.clone(),
                serial: None,
                ids: Vec::new(),
                block_size: 0,
                num_blocks: 0,
                thin_provisioned: false,
                unmap_reads_zero: false,
                block_limits: None,
                characteristics: None,
                state: DeviceState::Probing,
                last_sense: None,
            }),
            last_sense: Cell::new(None),
            inflight: Cell::new(0),
        }
    }

    pub fn state(&self) -> DeviceState {
        self.state.get()
    }

    pub(crate) fn set_state(&self, s: DeviceState) {
        self.state.set(s);
        self.info.borrow_mut().state = s;
    }

    pub(crate) fn set_capacity(&self, c: &Capacity) {
        let mut i = self.info.borrow_mut();
        i.block_size = c.block_size;
        i.num_blocks = c.num_blocks;
        i.thin_provisioned = c.lbpme;
        i.unmap_reads_zero = c.lbpme && c.lbprz;
    }

    /// A published copy of the device's facts.
    pub fn info(&self) -> DeviceInfo {
        let mut i = self.info.borrow().clone();
        i.last_sense = self.last_sense.get();
        i
    }

    pub fn name(&self) -> String {
        self.info.borrow().name.clone()
    }
}

/// The bound driver's name for a device type, if any (see
/// [`super::upper`]).
pub fn match_driver(t: DeviceType) -> Option<&'static str> {
    super::upper::driver_for(t).map(|d| d.name())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_disks_bind() {
        assert_eq!(match_driver(DeviceType::Disk), Some("sd"));
        assert_eq!(match_driver(DeviceType::Tape), None);
        assert_eq!(match_driver(DeviceType::Enclosure), None);
    }
}
