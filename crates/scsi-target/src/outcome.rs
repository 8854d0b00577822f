//! What a command ends with: a SCSI status, sense data with CHECK
//! CONDITION, and the residual of the data phase. SCSI failures are values
//! of this type, never Rust errors or panics.

use ustor_bdev::BdevError;
use ustor_scsi_proto::sense::{asc, FieldPointer};
use ustor_scsi_proto::{ScsiStatus, Sense, SenseKey};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Outcome {
    pub status: ScsiStatus,
    /// Present with CHECK CONDITION.
    pub sense: Option<Sense>,
    /// Bytes of the expected data phase not transferred.
    pub resid: u32,
    /// The invalid CDB field, for ILLEGAL REQUEST (sense-key specific).
    pub field: Option<FieldPointer>,
}

impl Outcome {
    /// Its sense (if any) in descriptor format when `d_sense` (the unit's
    /// D_SENSE), else fixed.
    pub(crate) fn with_descriptor_sense(mut self, d_sense: bool) -> Outcome {
        if let Some(s) = self.sense.as_mut() {
            s.descriptor = d_sense;
        }
        self
    }

    pub const fn good(resid: u32) -> Outcome {
        Outcome {
            status: ScsiStatus::Good,
            sense: None,
            resid,
            field: None,
        }
    }

    pub const fn check(key: SenseKey, code: (u8, u8), resid: u32) -> Outcome {
        Outcome::sense(Sense::new(key, code), resid)
    }

    pub const fn sense(s: Sense, resid: u32) -> Outcome {
        Outcome {
            status: ScsiStatus::CheckCondition,
            sense: Some(s),
            resid,
            field: None,
        }
    }

    /// RESERVATION CONFLICT (no sense).
    pub const fn conflict(resid: u32) -> Outcome {
        Outcome {
            status: ScsiStatus::ReservationConflict,
            sense: None,
            resid,
            field: None,
        }
    }

    /// ILLEGAL REQUEST, INVALID FIELD IN CDB.
    pub const fn invalid_field(resid: u32) -> Outcome {
        Outcome::check(SenseKey::IllegalRequest, asc::INVALID_FIELD_IN_CDB, resid)
    }

    /// ILLEGAL REQUEST, INVALID FIELD IN CDB, pointing at CDB `byte`
    /// (and `bit`).
    pub const fn invalid_field_at(byte: u16, bit: Option<u8>, resid: u32) -> Outcome {
        let mut o = Outcome::invalid_field(resid);
        o.field = Some(FieldPointer { byte, bit });
        o
    }

    /// ILLEGAL REQUEST, LOGICAL BLOCK ADDRESS OUT OF RANGE.
    pub const fn out_of_range(resid: u32) -> Outcome {
        Outcome::check(SenseKey::IllegalRequest, asc::LBA_OUT_OF_RANGE, resid)
    }

    /// The sense a bdev failure maps to (`write`: it failed writing).
    pub fn from_bdev(e: BdevError, write: bool, resid: u32) -> Outcome {
        use SenseKey::*;
        let (key, code) = match e {
            BdevError::OutOfRange { .. } => (IllegalRequest, asc::LBA_OUT_OF_RANGE),
            BdevError::NotSupported => (IllegalRequest, asc::INVALID_OPCODE),
            BdevError::ReadOnly => (DataProtect, asc::WRITE_PROTECTED),
            BdevError::Removed => (NotReady, asc::MEDIUM_NOT_PRESENT),
            // Where the device says, INFORMATION holds the offset of the
            // first differing byte (SBC-3 COMPARE AND WRITE).
            BdevError::Miscompare { offset: Some(at) } => {
                let s = Sense {
                    info: Some(at),
                    ..Sense::new(Miscompare, asc::MISCOMPARE_DURING_VERIFY)
                };
                return Outcome::sense(s, resid);
            }
            BdevError::Miscompare { offset: None } => (Miscompare, asc::MISCOMPARE_DURING_VERIFY),
            BdevError::Aborted => (AbortedCommand, (0, 0)),
            BdevError::Io(_) if write => (MediumError, asc::WRITE_ERROR),
            BdevError::Io(_) => (MediumError, asc::UNRECOVERED_READ),
            BdevError::BadLength { .. } | BdevError::TooManySegments(_) => {
                (HardwareError, asc::INTERNAL_TARGET_FAILURE)
            }
        };
        Outcome::check(key, code, resid)
    }
}
