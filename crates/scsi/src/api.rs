//! The control API as plain Rust functions with serde parameter and result
//! types; the RPC layer maps each to a JSON-RPC method of the same name
//! (see docs/scsi.md). Every function blocks: call from a control thread.

use serde::{Deserialize, Serialize};

pub use crate::bdev::{ScsiBdevDelete, ScsiBdevOpts, Size};
use crate::mid::{DeviceInfo, HostInfo, HostStats, MapRecord, ScanReport, ScsiError, ScsiStack};

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct GetDevicesParams {
    /// Only this device (H:C:T:L, name, serial or id).
    #[serde(default)]
    pub device: Option<String>,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct HostParams {
    pub host: u32,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceParams {
    pub device: String,
}

/// `scsi_get_hosts`.
pub fn scsi_get_hosts(stack: &ScsiStack) -> Vec<HostInfo> {
    stack.hosts()
}

/// `scsi_get_devices`.
pub fn scsi_get_devices(
    stack: &ScsiStack,
    p: GetDevicesParams,
) -> Result<Vec<DeviceInfo>, ScsiError> {
    stack.refresh()?;
    match p.device {
        Some(d) => Ok(vec![stack.find_device(&d)?]),
        None => Ok(stack.devices()),
    }
}

/// `scsi_scan_host`.
pub fn scsi_scan_host(stack: &ScsiStack, p: HostParams) -> Result<ScanReport, ScsiError> {
    stack.scan_host(p.host)
}

/// `scsi_device_reset`.
pub fn scsi_device_reset(stack: &ScsiStack, p: DeviceParams) -> Result<(), ScsiError> {
    stack.device_reset(&p.device)
}

/// `scsi_host_reset`.
pub fn scsi_host_reset(stack: &ScsiStack, p: HostParams) -> Result<(), ScsiError> {
    stack.host_reset(p.host)
}

/// `scsi_get_stats`.
pub fn scsi_get_stats(stack: &ScsiStack) -> Result<Vec<HostStats>, ScsiError> {
    stack.stats()
}

/// `bdev_scsi_create`: returns the bdev's name.
pub fn bdev_scsi_create(stack: &ScsiStack, p: ScsiBdevOpts) -> Result<String, ScsiError> {
    crate::bdev::create(stack, p)
}

/// `bdev_scsi_delete`.
pub fn bdev_scsi_delete(stack: &ScsiStack, p: ScsiBdevDelete) -> Result<(), ScsiError> {
    crate::bdev::delete(stack, &p.name)
}

/// `bdev_scsi_get_mappings` (ustor extension): every SCSI bdev's range.
pub fn bdev_scsi_get_mappings(stack: &ScsiStack) -> Vec<MapRecord> {
    crate::bdev::list(stack)
}
