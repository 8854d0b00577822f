//! ustor's NVMe over Fabrics (TCP transport).
//!
//! - [`wire`]: PDUs, SQE/CQE, SGL descriptors, digests (no state).
//! - [`initiator`]: the NVMe/TCP initiator bdev (`bdev_nvme_attach_controller`).
//! - [`nvmf`]: the target: subsystems, controllers, queue pairs on the
//!   reactors, discovery, and the SPDK-named control functions.
//!
//! Both sides run on the connection layer (`ustor_net`): its listener
//! (connection cap, ICReq timeout), staging, receives, PDU group, sender
//! and LANoT coalescer.
//!
//! Nothing here takes a lock, allocates or copies payload per I/O: payload is
//! received straight into the pool buffer the bdev uses, read data leaves
//! from the buffer the bdev filled, and per-connection state is preallocated.

pub mod initiator;
pub mod nvmf;
pub mod wire;

#[doc(hidden)]
pub mod fuzzing;
