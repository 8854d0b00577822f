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

use std::time::Duration;

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

/// Per-host driver settings (`scsi_vfio_attach_host`'s optional params).
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// How long a task management function may take before the driver
    /// reports it failed (the mid-layer then escalates).
    pub tmf_timeout: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            tmf_timeout: Duration::from_secs(10),
        }
    }
}

/// Drivers `attach` knows, by the name the RPC uses.
pub const DRIVERS: &[&str] = &["virtio-scsi", "mptsas"];

/// Opens `bdf` with `driver` and returns it as an LLD. Must run on the
/// reactor that will own the host (the DMA mapping of that reactor's
/// buffer pool is made here).
pub fn attach(bdf: &str, driver: &str, opts: Options) -> Result<Box<dyn Lld>, AttachError> {
    match driver {
        "virtio-scsi" => Ok(Box::new(VirtioScsi::open(bdf, opts)?)),
        "mptsas" => Ok(Box::new(MptSas::open(bdf, opts)?)),
        _ => Err(AttachError::UnknownDriver(driver.to_string())),
    }
}

/// Whether a PCI ID is a virtio-scsi controller (modern or transitional).
pub fn is_virtio_scsi(id: PciId) -> bool {
    id.vendor == 0x1af4 && matches!(id.device, 0x1048 | 0x1004)
}
