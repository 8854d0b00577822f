//! VFIO for ustor's userspace PCI drivers: opens a PCI device bound to
//! vfio-pci (container with a TYPE1v2 IOMMU, its group, the device fd),
//! gives config-space access, bus mastering, memory BARs mapped into the
//! process (I/O-port BARs by region read/write), and IOMMU DMA mappings.
//!
//! DMA memory is mapped once, at attach time: each driver's queue memory
//! ([`DmaMem`]) and the owning reactor's buffer pool ([`Vfio::map_external`]).
//! On the I/O path [`Vfio::iova_of`] turns a buffer address into its IOVA by
//! arithmetic over that short list, never by a syscall. IOVAs are handed out
//! below 4 GiB and outside the x86 MSI window, so they fit the 39-bit
//! address width of QEMU's emulated Intel IOMMU and the 32-bit DMA window
//! of older HBAs. Nothing here needs hugepages. INTx is disabled; a driver
//! may route one MSI-X (or MSI) vector to an eventfd
//! ([`Vfio::irq_eventfd`]) as a wake source for a sleeping reactor, and
//! polls its rings either way.
//!
//! `unsafe` in this crate is limited to the ioctls, `mmap` and volatile
//! accesses to mapped BARs and DMA memory, each with a SAFETY comment.

mod device;
mod dma;
mod sysfs;
pub mod uapi;

pub use device::{Bar, Vfio};
pub use dma::DmaMem;
pub use sysfs::{bind_hint, PciId};

/// What can go wrong opening or driving a VFIO device.
#[derive(Debug, thiserror::Error)]
pub enum VfioError {
    #[error("{0}: no such PCI device (expected a full address like 0000:00:04.0)")]
    NoDevice(String),
    #[error("{bdf} is bound to {driver}, not vfio-pci; bind it with: {hint}")]
    NotBound {
        bdf: String,
        driver: String,
        hint: String,
    },
    #[error("{0}: no IOMMU group (no IOMMU, or it is off: boot with intel_iommu=on)")]
    NoGroup(String),
    #[error(
        "IOMMU group {group} of {bdf} also holds {others}, not bound to vfio-pci: \
         bind them too, or give the device a PCI slot of its own"
    )]
    GroupShared {
        bdf: String,
        group: u32,
        others: String,
    },
    #[error("{what}: {source}")]
    Sys {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Unsupported(String),
    #[error("IOVA space exhausted: {0} more bytes do not fit below the DMA limit")]
    NoIova(u64),
}

impl VfioError {
    pub(crate) fn sys(what: impl Into<String>) -> VfioError {
        VfioError::Sys {
            what: what.into(),
            source: std::io::Error::last_os_error(),
        }
    }

    /// The errno that best describes this error (for JSON-RPC replies).
    pub fn errno(&self) -> i32 {
        match self {
            VfioError::NoDevice(_) => libc::ENODEV,
            VfioError::NotBound { .. } | VfioError::GroupShared { .. } => libc::EBUSY,
            VfioError::NoGroup(_) | VfioError::Unsupported(_) => libc::ENOTSUP,
            VfioError::Sys { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            VfioError::NoIova(_) => libc::ENOMEM,
        }
    }
}

pub type Result<T> = std::result::Result<T, VfioError>;
