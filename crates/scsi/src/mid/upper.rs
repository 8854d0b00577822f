//! Upper-level drivers, Linux's sd/st/sr: what a device type is brought up
//! and used as. The mid-layer scans and registers every logical unit, then
//! hands those of a bound type to their driver's [`UpperDriver::probe`]; a
//! device that goes away is handed to [`UpperDriver::remove`]. Types with a
//! Linux driver name that ustor does not drive are listed, unbound.

use crate::inquiry::DeviceType;
use crate::lld::LocalFuture;
use crate::mid::{Device, Host};

/// Why a driver could not bring a device up (it is then set offline).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    #[error("TEST UNIT READY failed")]
    NotReady,
    #[error("READ CAPACITY(16) failed")]
    NoCapacity,
}

/// A device-type driver.
pub trait UpperDriver: Sync {
    /// Linux's name for it ("sd").
    fn name(&self) -> &'static str;

    /// The peripheral device types it binds to.
    fn types(&self) -> &'static [DeviceType];

    /// Brings up a freshly found device of one of its types (identity
    /// pages, readiness, capacity), on the host's reactor.
    fn probe<'a>(
        &'a self,
        host: &'a Host,
        dev: &'a Device,
    ) -> LocalFuture<'a, Result<(), ProbeError>>;

    /// The device is gone (rescan, hot-remove): release what was built on it.
    fn remove(&self, _host: &Host, _dev: &Device) {}
}

/// The bound drivers.
static BOUND: &[&dyn UpperDriver] = &[&crate::sd::Sd];

/// Device types with a Linux driver name that ustor lists but does not drive.
pub const UNBOUND: &[(&str, &[DeviceType])] = &[
    ("st", &[DeviceType::Tape]),
    ("sr", &[DeviceType::CdDvd, DeviceType::WriteOnce]),
    ("ch", &[DeviceType::MediumChanger]),
    ("ses", &[DeviceType::Enclosure]),
];

/// The driver bound to a device type, if any.
pub fn driver_for(t: DeviceType) -> Option<&'static dyn UpperDriver> {
    BOUND.iter().copied().find(|d| d.types().contains(&t))
}

/// The driver of that name, if bound.
pub fn driver_named(name: &str) -> Option<&'static dyn UpperDriver> {
    BOUND.iter().copied().find(|d| d.name() == name)
}
