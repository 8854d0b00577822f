//! ustor's userspace SCSI stack (initiator side), after Linux's three levels.
//!
//! - Wire-level SCSI lives in `ustor-scsi-proto` and is re-exported here
//!   under the same paths: [`cdb`], [`sense`], [`status`], [`inquiry`],
//!   [`capacity`], [`lun`].
//!
//! - [`lld`]: the low-level driver contract (docs/writing-an-lld.md).
//! - [`mid`]: the mid-layer: host/device/driver registries, scan and
//!   bring-up, retry rules, error handling (abort → LUN reset → host reset
//!   → offline).
//! - The emulated HBA (bdev-backed LUNs run by the SCSI target core,
//!   scriptable faults) is the `ustor-scsi-emul` crate.
//! - [`sg`]: the SG_IO passthrough LLD (/dev/sgN, asynchronous sg v3).
//! - [`sd`]: the disk upper-level driver (`mid::upper::UpperDriver`): disk
//!   bring-up, SCSI bdevs ([`bdev`]: device ranges as named bdevs), and the
//!   forwarding of their I/O from channels on other reactors to the host's
//!   reactor (completions through `ustor_bdev::remote`).
//! - [`api`]: the control functions the RPC layer exposes.
//!
//! SCSI failures are CHECK CONDITION with sense, carried as data; Rust
//! errors are for transport failures and bad input only.

pub use ustor_scsi_proto::{capacity, cdb, inquiry, lun, sense, status};
#[doc(hidden)]
pub mod fuzz;

pub use ustor_scsi_proto::{Cdb, Command, Hctl, ScsiStatus, Sense, SenseKey};
pub mod api;
pub mod lld;
pub mod mid;
pub mod sd;
pub mod sg;

/// SCSI bdevs (sd's), at their historical path.
pub use sd::bdev;

pub use mid::{ScsiError, ScsiStack};
