//! Userspace PCI SCSI HBA drivers over VFIO: low-level drivers of ustor's
//! SCSI mid-layer that own a PCI function bound to vfio-pci, poll its
//! completion rings and DMA straight into the reactor's buffer pool
//! (mapped in the IOMMU once, at attach). Drivers: virtio-scsi
//! (`driver: "virtio-scsi"`) and the MPT Fusion SAS1068 (`driver:
//! "mptsas"`). [`attach`] checks the device's PCI ID against the driver
//! asked for, so a wrong driver is a clear error. Where the reactor may
//! sleep, an MSI-X (or MSI) vector wakes it (`wake`).

pub mod mpt;
mod sg;
pub mod virtio;
mod wake;

use ustor_scsi::lld::Lld;
use ustor_vfio::PciId;

pub use mpt::{MptError, MptSas};
pub use virtio::{VirtioError, VirtioScsi};

/// Why `attach` failed.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error(transparent)]
    Virtio(#[from] VirtioError),
    #[error(transparent)]
    Mpt(#[from] MptError),
    #[error("unknown driver {0:?} (known: virtio-scsi, mptsas)")]
    UnknownDriver(String),
}

impl AttachError {
    /// The errno an RPC reply carries for this error.
    pub fn errno(&self) -> i32 {
        match self {
            AttachError::Virtio(VirtioError::Vfio(v)) | AttachError::Mpt(MptError::Vfio(v)) => {
                v.errno()
            }
            AttachError::UnknownDriver(_) => libc::EINVAL,
            _ => libc::ENODEV,
        }
    }
}

/// Drivers `attach` knows, by the name the RPC uses.
pub const DRIVERS: &[&str] = &["virtio-scsi", "mptsas"];

/// Opens `bdf` with `driver` and returns it as an LLD. Must run on the
/// reactor that will own the host (the DMA mapping of that reactor's
/// buffer pool is made here).
pub fn attach(bdf: &str, driver: &str) -> Result<Box<dyn Lld>, AttachError> {
    match driver {
        "virtio-scsi" => Ok(Box::new(VirtioScsi::open(bdf)?)),
        "mptsas" => Ok(Box::new(MptSas::open(bdf)?)),
        _ => Err(AttachError::UnknownDriver(driver.to_string())),
    }
}

/// Whether a PCI ID is a virtio-scsi controller (modern or transitional).
pub fn is_virtio_scsi(id: PciId) -> bool {
    id.vendor == 0x1af4 && matches!(id.device, 0x1048 | 0x1004)
}
