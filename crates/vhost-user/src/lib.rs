//! vhost-user-blk and vhost-user-scsi backends on the ustor reactors.
//!
//! A controller ([`controller::BlkController`]) listens on a Unix socket;
//! a frontend (QEMU, libblkio, SPDK's virtio-user) connects and hands over
//! its memory (file descriptors, mapped once) and its virtqueues. The
//! vhost-user messages are decoded by rust-vmm's `vhost` crate
//! (`BackendReqHandler`) on the controller's control thread
//! ([`backend`]); each ring runs as a task on one of the controller's
//! reactors ([`vring`]), polling its avail index while busy and sleeping on
//! its kick eventfd when idle, and its I/O goes to the bdev with buffers
//! pointing into guest memory ([`blk`] validates every chain first).
//!
//! Modules: [`blk`] (virtio-blk: features, config space, chain walker),
//! [`virtq`] (split and packed rings behind one interface), [`packed`]
//! (the packed ring's device side),
//! [`memory`] (memory table), [`guest`] (the request path's view of it),
//! [`coalesce`] (call-eventfd coalescing),
//! [`inline`] (the request a queue task runs itself), [`workers`] (a
//! queue's request workers), [`inflight`] (inflight
//! tracking for restarts), [`device`] (the served bdev, its counters and
//! bdev events), [`notify`] (the backend channel for config changes), [`backend`]
//! (message handling), [`vring`] (the data path), [`controller`] (socket,
//! thread, lifecycle), [`target`] (every controller by name, for the RPCs), [`fuzzing`]
//! (the fuzz targets' bodies), [`scsi`] (vhost-user-scsi on the SCSI
//! target core).

pub mod backend;
pub mod blk;
pub mod coalesce;
pub mod controller;
pub mod device;
pub mod eventfd;
pub mod fuzzing;
pub mod guest;
pub mod inflight;
pub mod inline;
pub mod memory;
pub mod notify;
pub mod pace;
pub mod packed;
pub mod scsi;
pub mod start;
pub mod target;
pub mod virtq;
pub mod vring;
pub mod workers;

pub use controller::{BlkController, BlkControllerConfig};
pub use target::VhostTarget;

/// Errors of the vhost layer (control path; the data path answers the
/// driver with virtio-blk status bytes).
#[derive(Debug, thiserror::Error)]
pub enum VhostError {
    #[error("{0}")]
    Invalid(String),
    #[error("controller {0} exists")]
    Exists(String),
    #[error("no controller {0}")]
    NoController(String),
    #[error(transparent)]
    Bdev(#[from] ustor_bdev::ControlError),
    #[error("socket: {0}")]
    Socket(std::io::Error),
}

impl VhostError {
    /// The errno SPDK's vhost RPCs answer with for this error.
    pub fn errno(&self) -> i32 {
        match self {
            VhostError::Invalid(_) => libc::EINVAL,
            VhostError::Exists(_) => libc::EEXIST,
            VhostError::NoController(_) => libc::ENODEV,
            VhostError::Bdev(e) => e.errno(),
            VhostError::Socket(e) => e.raw_os_error().unwrap_or(libc::EIO),
        }
    }
}
