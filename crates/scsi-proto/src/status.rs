//! SCSI status byte (SAM): what a device says about one command.

use serde::Serialize;

/// The status a device returned for a command. Unknown values are kept, not
/// rejected: a device may speak a newer SAM than we do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ScsiStatus {
    Good,
    CheckCondition,
    ConditionMet,
    Busy,
    ReservationConflict,
    TaskSetFull,
    AcaActive,
    TaskAborted,
    Other(u8),
}

impl ScsiStatus {
    pub const fn from_u8(v: u8) -> ScsiStatus {
        match v {
            0x00 => ScsiStatus::Good,
            0x02 => ScsiStatus::CheckCondition,
            0x04 => ScsiStatus::ConditionMet,
            0x08 => ScsiStatus::Busy,
            0x18 => ScsiStatus::ReservationConflict,
            0x28 => ScsiStatus::TaskSetFull,
            0x30 => ScsiStatus::AcaActive,
            0x40 => ScsiStatus::TaskAborted,
            v => ScsiStatus::Other(v),
        }
    }

    pub const fn as_u8(self) -> u8 {
        match self {
            ScsiStatus::Good => 0x00,
            ScsiStatus::CheckCondition => 0x02,
            ScsiStatus::ConditionMet => 0x04,
            ScsiStatus::Busy => 0x08,
            ScsiStatus::ReservationConflict => 0x18,
            ScsiStatus::TaskSetFull => 0x28,
            ScsiStatus::AcaActive => 0x30,
            ScsiStatus::TaskAborted => 0x40,
            ScsiStatus::Other(v) => v,
        }
    }

    /// GOOD or CONDITION MET: the command did what it was asked.
    pub const fn is_good(self) -> bool {
        matches!(self, ScsiStatus::Good | ScsiStatus::ConditionMet)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_round_trips() {
        for v in 0..=255u8 {
            assert_eq!(ScsiStatus::from_u8(v).as_u8(), v);
        }
        assert!(ScsiStatus::from_u8(0).is_good());
        assert!(!ScsiStatus::from_u8(2).is_good());
    }
}
