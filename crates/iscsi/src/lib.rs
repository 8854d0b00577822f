//! ustor's iSCSI: the wire format ([`wire`]: BHS, AHS, data segments,
//! CRC32C digests, text keys) and the initiator used as a SCSI low-level
//! driver ([`initiator`]).

pub mod conn;
pub mod initiator;
pub mod wire;
