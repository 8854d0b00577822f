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
#[derive(Clone, Debug)]
pub struct Options {
    /// How long a task management function may take before the driver
    /// reports it failed (the mid-layer then escalates).
    pub tmf_timeout: Duration,
    /// Every reactor's buffer pool (address, length), mapped for DMA
    /// besides the owning reactor's own: I/O from another reactor's pool
    /// is then zero-copy too. Gathered by the caller (the attach RPC asks
    /// each reactor); empty: the owning reactor's pool only.
    pub pools: Vec<(usize, usize)>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            tmf_timeout: Duration::from_secs(10),
            pools: Vec::new(),
        }
    }
}

/// Maps the current (owning) reactor's buffer pool for DMA, then the
/// other pools of `opts.pools`; a pool that cannot be mapped (IOVA space)
/// is bounced. Returns the owning pool's (address, length), (0, 0) when
/// it has none, and the bytes mapped.
pub(crate) fn map_pools(
    vfio: &ustor_vfio::Vfio,
    bdf: &str,
    opts: &Options,
) -> ((usize, usize), usize) {
    let own = ustor_runtime::buf::pool_region().map(|r| (r.iov_base as usize, r.iov_len));
    let others = opts.pools.iter().filter(|p| Some(**p) != own);
    let mut mapped = 0;
    // The owning pool first: it carries most I/O and gets IOVA space first.
    for &(addr, len) in own.iter().chain(others) {
        match vfio.map_external(addr as *mut u8, len) {
            Ok(_) => mapped += len,
            Err(e) => {
                tracing::warn!(%bdf, "buffer pool at {addr:#x} not mapped for DMA ({e}): bouncing")
            }
        }
    }
    (own.unwrap_or((0, 0)), mapped)
}

/// Whether `addr` lies outside the pool `(base, len)`.
#[inline]
pub(crate) fn foreign(pool: (usize, usize), addr: usize) -> bool {
    addr.wrapping_sub(pool.0) >= pool.1
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
