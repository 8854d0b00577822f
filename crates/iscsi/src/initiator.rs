//! The iSCSI initiator as a SCSI LLD (in progress).
