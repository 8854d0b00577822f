//! ustor's NVMe over Fabrics (TCP transport).
//!
//! - [`wire`]: PDUs, SQE/CQE, SGL descriptors, digests (no state).
//! - [`coalesce`]: LANoT, the load-aware PDU coalescer both sides send
//!   through (policy and the PDU Group iovec list).
//! - [`initiator`]: the NVMe/TCP initiator bdev (`bdev_nvme_attach_controller`).
//! - [`nvmf`]: the target: subsystems, controllers, queue pairs on the
//!   reactors, discovery, and the SPDK-named control functions.
//! - `sock`: socket helpers both sides use (vectored receive into caller
//!   memory, readiness through the ring).
//!
//! Nothing here takes a lock, allocates or copies payload per I/O: payload is
//! received straight into the pool buffer the bdev uses, read data leaves
//! from the buffer the bdev filled, and per-connection state is preallocated.

pub mod coalesce;
pub mod initiator;
pub mod nvmf;
pub(crate) mod sock;
pub mod wire;

#[doc(hidden)]
pub mod fuzzing;

/// Adds `n` to a counter that only one reactor writes and others read: a
/// relaxed load and store, no read-modify-write (no locked instruction on
/// the I/O path).
pub(crate) fn bump_relaxed(a: &std::sync::atomic::AtomicU64, n: u64) {
    use std::sync::atomic::Ordering;
    a.store(a.load(Ordering::Relaxed) + n, Ordering::Relaxed);
}
