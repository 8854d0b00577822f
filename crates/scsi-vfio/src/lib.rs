//! Userspace PCI SCSI HBA drivers over VFIO: low-level drivers of ustor's
//! SCSI mid-layer that own a PCI function bound to vfio-pci, poll its
//! completion rings and DMA straight into the reactor's buffer pool
//! (mapped in the IOMMU once, at attach). Today: virtio-scsi
//! (`driver: "virtio-scsi"`). [`attach`] checks the device's PCI ID
//! against the driver asked for, so a wrong driver is a clear error.

pub mod virtio;

use ustor_scsi::lld::Lld;
use ustor_vfio::PciId;

pub use virtio::{VirtioError, VirtioScsi};

/// Drivers `attach` knows, by the name the RPC uses.
pub const DRIVERS: &[&str] = &["virtio-scsi"];

/// Opens `bdf` with `driver` and returns it as an LLD. Must run on the
/// reactor that will own the host (the DMA mapping of that reactor's
/// buffer pool is made here).
pub fn attach(bdf: &str, driver: &str) -> Result<Box<dyn Lld>, VirtioError> {
    match driver {
        "virtio-scsi" => Ok(Box::new(VirtioScsi::open(bdf)?)),
        "mptsas" => Err(VirtioError::Transport(
            "the MPT Fusion SAS driver is not implemented yet".into(),
        )),
        _ => Err(VirtioError::Transport(format!(
            "unknown driver {driver:?} (known: {})",
            DRIVERS.join(", ")
        ))),
    }
}

/// Whether a PCI ID is a virtio-scsi controller (modern or transitional).
pub fn is_virtio_scsi(id: PciId) -> bool {
    id.vendor == 0x1af4 && matches!(id.device, 0x1048 | 0x1004)
}
