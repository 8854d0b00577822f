//! The virtio-scsi PCI LLD: one request queue, the control queue for task
//! management and the event queue for hot-plug events, all split
//! virtqueues in VFIO DMA memory, polled (no interrupts).
//!
//! Data goes zero-copy when every iovec lies in memory mapped for DMA (the
//! owning reactor's buffer pool, mapped at attach): its IOVA is computed,
//! no syscall. Anything else (heap buffers of the control path, buffers of
//! another reactor) goes through a per-slot bounce buffer in DMA memory.

pub mod pci;
pub mod vq;
pub mod wire;

mod lld;
mod state;

pub use lld::VirtioScsi;

/// Why attaching or driving a virtio-scsi device failed.
#[derive(Debug, thiserror::Error)]
pub enum VirtioError {
    #[error(transparent)]
    Vfio(#[from] ustor_vfio::VfioError),
    #[error("{0}")]
    Transport(String),
}
