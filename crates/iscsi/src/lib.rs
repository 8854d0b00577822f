//! ustor's iSCSI: the wire format ([`wire`]: BHS, AHS, data segments,
//! CRC32C digests, text keys), CHAP ([`chap`]), login ([`login`]), the
//! socket-free session state machine ([`session`], [`task`]) and the
//! initiator used as a SCSI low-level driver ([`initiator`]).

pub mod chap;
pub mod conn;
pub mod fuzz;
pub mod initiator;
pub mod login;
pub mod session;
pub mod task;
pub mod wire;

/// Most data segments (iovecs) of one command: the LLD's `max_sg_entries`.
pub const MAX_SEGS: usize = 16;
