//! ustor's NVMe over Fabrics (TCP transport).
//!
//! - [`wire`]: PDUs, SQE/CQE, SGL descriptors, digests (no state).
//! - [`coalesce`]: LANoT and the PDU group, now in the connection layer
//!   (`ustor_net::coalesce`, `ustor_net::group`), re-exported here.
//! - [`initiator`]: the NVMe/TCP initiator bdev (`bdev_nvme_attach_controller`).
//! - [`nvmf`]: the target: subsystems, controllers, queue pairs on the
//!   reactors, discovery, and the SPDK-named control functions.
//! - `sock`: socket helpers both sides use (`ustor_net::recv`).
//!
//! Nothing here takes a lock, allocates or copies payload per I/O: payload is
//! received straight into the pool buffer the bdev uses, read data leaves
//! from the buffer the bdev filled, and per-connection state is preallocated.

/// LANoT and the PDU group (`ustor_net`), under their old path.
pub mod coalesce {
    pub use ustor_net::coalesce::*;
    pub use ustor_net::group::{PduGroup, ARENA_LEN};
}
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
