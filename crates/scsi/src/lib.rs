//! ustor's userspace SCSI stack (initiator side), after Linux's three levels.
//!
//! - Wire-level SCSI, plain data with encode/decode that never panic:
//!   [`cdb`] (command builders and parser), [`sense`] (fixed and descriptor
//!   sense), [`status`], [`inquiry`] (standard INQUIRY and VPD pages),
//!   [`capacity`] (READ CAPACITY(16)), [`lun`] (LUN encoding, REPORT LUNS,
//!   H:C:T:L).
//!
//! - [`lld`]: the low-level driver contract (docs/writing-an-lld.md).
//! - [`mid`]: the mid-layer: host/device/driver registries, scan and
//!   bring-up, retry rules, error handling (abort → LUN reset → host reset
//!   → offline).
//! - [`emul`]: the emulated HBA (RAM-backed, scriptable faults).
//! - [`sg`]: the SG_IO passthrough LLD (/dev/sgN, asynchronous sg v3).
//! - [`bdev`]: SCSI bdevs (device ranges as named bdevs); `forward` carries
//!   their I/O from channels on other reactors to the host's reactor.
//! - [`api`]: the control functions the RPC layer exposes.
//!
//! SCSI failures are CHECK CONDITION with sense, carried as data; Rust
//! errors are for transport failures and bad input only.

pub mod capacity;
pub mod cdb;
#[doc(hidden)]
pub mod fuzz;
pub mod inquiry;
pub mod lun;
pub mod sense;
pub mod status;

pub use cdb::{Cdb, Command};
pub use lun::Hctl;
pub use sense::{Sense, SenseKey};
pub use status::ScsiStatus;
pub mod api;
pub mod bdev;
pub mod emul;
mod forward;
pub mod lld;
pub mod mid;
pub mod sg;

pub use mid::{ScsiError, ScsiStack};
