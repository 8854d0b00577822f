//! SCSI as data: the protocol encodings both sides of ustor's SCSI stack
//! share, with encoders and decoders that never panic and no I/O.
//!
//! - [`cdb`]: command builders (initiator) and the parser (target).
//! - [`sense`]: fixed and descriptor sense data, keys and ASC/ASCQ codes.
//! - [`status`]: SAM status codes.
//! - [`inquiry`]: standard INQUIRY and the VPD pages.
//! - [`capacity`]: READ CAPACITY(16) data.
//! - [`lun`]: LUN encoding, REPORT LUNS data, H:C:T:L addresses.
//!
//! It depends on no other ustor crate: the initiator (`ustor-scsi`) and the
//! target core (`ustor-scsi-target`) both build on it, and neither needs the
//! other.

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
