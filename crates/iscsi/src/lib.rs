//! ustor's iSCSI: wire format and the initiator used as a SCSI low-level driver (in progress).
