//! Sense data (SPC-4 §4.5): decoding of fixed (0x70/0x71) and descriptor
//! (0x72/0x73) formats into one [`Sense`], and building fixed-format sense
//! for emulated devices.
//!
//! Devices send short, truncated or odd sense; decoding never panics and
//! takes whatever fields are present (a fuzz target and a proptest hold it to
//! that).

use serde::Serialize;

/// Most sense bytes kept per command (Linux's SCSI_SENSE_BUFFERSIZE).
pub const SENSE_BUF_LEN: usize = 96;

/// Sense keys (SPC-4 table 48).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SenseKey {
    NoSense,
    RecoveredError,
    NotReady,
    MediumError,
    HardwareError,
    IllegalRequest,
    UnitAttention,
    DataProtect,
    BlankCheck,
    VendorSpecific,
    CopyAborted,
    AbortedCommand,
    Reserved,
    VolumeOverflow,
    Miscompare,
    Completed,
}

impl SenseKey {
    pub const fn from_u8(v: u8) -> SenseKey {
        match v & 0x0f {
            0x0 => SenseKey::NoSense,
            0x1 => SenseKey::RecoveredError,
            0x2 => SenseKey::NotReady,
            0x3 => SenseKey::MediumError,
            0x4 => SenseKey::HardwareError,
            0x5 => SenseKey::IllegalRequest,
            0x6 => SenseKey::UnitAttention,
            0x7 => SenseKey::DataProtect,
            0x8 => SenseKey::BlankCheck,
            0x9 => SenseKey::VendorSpecific,
            0xa => SenseKey::CopyAborted,
            0xb => SenseKey::AbortedCommand,
            0xc => SenseKey::Reserved,
            0xd => SenseKey::VolumeOverflow,
            0xe => SenseKey::Miscompare,
            _ => SenseKey::Completed,
        }
    }

    pub const fn as_u8(self) -> u8 {
        self as u8
    }
}

/// Well-known additional sense codes (ASC, ASCQ) the mid-layer acts on and
/// the target core reports.
pub mod asc {
    /// LOGICAL UNIT IS IN PROCESS OF BECOMING READY.
    pub const BECOMING_READY: (u8, u8) = (0x04, 0x01);
    /// LOGICAL UNIT NOT READY, INITIALIZING COMMAND REQUIRED.
    pub const NEEDS_INIT: (u8, u8) = (0x04, 0x02);
    /// LOGICAL BLOCK ADDRESS OUT OF RANGE.
    pub const LBA_OUT_OF_RANGE: (u8, u8) = (0x21, 0x00);
    /// INVALID COMMAND OPERATION CODE.
    pub const INVALID_OPCODE: (u8, u8) = (0x20, 0x00);
    /// INVALID FIELD IN CDB.
    pub const INVALID_FIELD_IN_CDB: (u8, u8) = (0x24, 0x00);
    /// LOGICAL UNIT NOT SUPPORTED.
    pub const LUN_NOT_SUPPORTED: (u8, u8) = (0x25, 0x00);
    /// POWER ON, RESET, OR BUS DEVICE RESET OCCURRED.
    pub const POWER_ON_RESET: (u8, u8) = (0x29, 0x00);
    /// CAPACITY DATA HAS CHANGED.
    pub const CAPACITY_CHANGED: (u8, u8) = (0x2a, 0x09);
    /// REPORTED LUNS DATA HAS CHANGED.
    pub const REPORTED_LUNS_CHANGED: (u8, u8) = (0x3f, 0x0e);
    /// MEDIUM NOT PRESENT.
    pub const MEDIUM_NOT_PRESENT: (u8, u8) = (0x3a, 0x00);
    /// UNRECOVERED READ ERROR.
    pub const UNRECOVERED_READ: (u8, u8) = (0x11, 0x00);
    /// WRITE ERROR.
    pub const WRITE_ERROR: (u8, u8) = (0x0c, 0x00);
    /// INTERNAL TARGET FAILURE.
    pub const INTERNAL_TARGET_FAILURE: (u8, u8) = (0x44, 0x00);
    /// WRITE PROTECTED.
    pub const WRITE_PROTECTED: (u8, u8) = (0x27, 0x00);
    /// MISCOMPARE DURING VERIFY OPERATION.
    pub const MISCOMPARE_DURING_VERIFY: (u8, u8) = (0x1d, 0x00);
    /// INVALID FIELD IN PARAMETER LIST.
    pub const INVALID_FIELD_IN_PARAM_LIST: (u8, u8) = (0x26, 0x00);
    /// SAVING PARAMETERS NOT SUPPORTED.
    pub const SAVING_PARAMS_NOT_SUPPORTED: (u8, u8) = (0x39, 0x00);
    /// PARAMETER LIST LENGTH ERROR.
    pub const PARAM_LIST_LENGTH_ERROR: (u8, u8) = (0x1a, 0x00);
}

/// Decoded sense, whatever its wire format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Sense {
    /// Descriptor format (0x72/0x73) rather than fixed.
    pub descriptor: bool,
    /// Deferred error (0x71/0x73): about an earlier command.
    pub deferred: bool,
    pub key: SenseKey,
    pub asc: u8,
    pub ascq: u8,
    /// The INFORMATION field (often the failing LBA), when valid.
    pub info: Option<u64>,
}

/// The sense-key specific field pointer of ILLEGAL REQUEST (SPC-4
/// §4.5.2.4.2): which CDB byte (and bit) was invalid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FieldPointer {
    pub byte: u16,
    pub bit: Option<u8>,
}

impl FieldPointer {
    /// Writes SKSV, C/D (in the CDB), BPV and the pointer into bytes
    /// 15..18 of fixed sense from [`Sense::encode_fixed`].
    pub fn encode(&self, fixed: &mut [u8; 18]) {
        fixed[15] = 0x80 | 0x40 | self.bit.map_or(0, |b| 0x08 | (b & 7));
        fixed[16..18].copy_from_slice(&self.byte.to_be_bytes());
    }
}

/// Why sense bytes could not be decoded at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SenseError {
    #[error("no sense bytes")]
    Empty,
    #[error("unknown sense response code {0:#04x}")]
    ResponseCode(u8),
}

impl Sense {
    /// Decodes fixed or descriptor sense. Fields past the end of `b` (or past
    /// the additional length) read as zero.
    pub fn decode(b: &[u8]) -> Result<Sense, SenseError> {
        let first = *b.first().ok_or(SenseError::Empty)?;
        let code = first & 0x7f;
        let at = |i: usize| b.get(i).copied().unwrap_or(0);
        match code {
            0x70 | 0x71 => {
                // Fixed: fields beyond byte 7 only count if the additional
                // length covers them.
                let end = (8 + at(7) as usize).min(b.len());
                let f = |i: usize| if i < end { at(i) } else { 0 };
                let info_valid = first & 0x80 != 0 && b.len() >= 7;
                Ok(Sense {
                    descriptor: false,
                    deferred: code == 0x71,
                    key: SenseKey::from_u8(at(2)),
                    asc: f(12),
                    ascq: f(13),
                    info: info_valid
                        .then(|| u32::from_be_bytes([at(3), at(4), at(5), at(6)]) as u64),
                })
            }
            0x72 | 0x73 => Ok(Sense {
                descriptor: true,
                deferred: code == 0x73,
                key: SenseKey::from_u8(at(1)),
                asc: at(2),
                ascq: at(3),
                info: descriptor_info(b),
            }),
            c => Err(SenseError::ResponseCode(c)),
        }
    }

    /// (ASC, ASCQ) as a pair, for matching against [`asc`].
    pub fn code(&self) -> (u8, u8) {
        (self.asc, self.ascq)
    }

    /// A current-error sense with no INFORMATION.
    pub const fn new(key: SenseKey, asc: (u8, u8)) -> Sense {
        Sense {
            descriptor: false,
            deferred: false,
            key,
            asc: asc.0,
            ascq: asc.1,
            info: None,
        }
    }

    /// Encodes as fixed-format sense (18 bytes); returns the length.
    pub fn encode_fixed(&self, out: &mut [u8; 18]) -> usize {
        *out = [0; 18];
        out[0] = if self.deferred { 0x71 } else { 0x70 };
        if let Some(info) = self.info {
            out[0] |= 0x80;
            out[3..7].copy_from_slice(&(info as u32).to_be_bytes());
        }
        out[2] = self.key.as_u8();
        out[7] = 10;
        out[12] = self.asc;
        out[13] = self.ascq;
        18
    }
}

/// Bytes of descriptor-format sense with an INFORMATION and a sense-key
/// specific descriptor.
pub const DESCRIPTOR_SENSE_MAX: usize = 8 + 12 + 8;

impl Sense {
    /// Encodes as descriptor-format sense (SPC-4 §4.5.2): the INFORMATION
    /// descriptor when there is one, a field pointer as a sense-key
    /// specific descriptor; returns the length.
    pub fn encode_descriptor(
        &self,
        field: Option<FieldPointer>,
        out: &mut [u8; DESCRIPTOR_SENSE_MAX],
    ) -> usize {
        *out = [0; DESCRIPTOR_SENSE_MAX];
        out[0] = if self.deferred { 0x73 } else { 0x72 };
        out[1] = self.key.as_u8();
        out[2] = self.asc;
        out[3] = self.ascq;
        let mut at = 8;
        if let Some(info) = self.info {
            out[at..at + 4].copy_from_slice(&[0x00, 0x0a, 0x80, 0]);
            out[at + 4..at + 12].copy_from_slice(&info.to_be_bytes());
            at += 12;
        }
        if let Some(f) = field {
            let mut fixed = [0u8; 18];
            f.encode(&mut fixed);
            out[at..at + 4].copy_from_slice(&[0x02, 0x06, 0, 0]);
            out[at + 4..at + 7].copy_from_slice(&fixed[15..18]);
            at += 8;
        }
        out[7] = (at - 8) as u8;
        at
    }
}

/// The INFORMATION descriptor (type 0) of descriptor-format sense, if any.
fn descriptor_info(b: &[u8]) -> Option<u64> {
    let end = (8 + *b.get(7)? as usize).min(b.len());
    let mut pos = 8;
    // Each descriptor is at least 2 bytes, so this bounds the walk.
    while pos + 2 <= end {
        let (ty, len) = (b[pos], b[pos + 1] as usize);
        if ty == 0 && len >= 0x0a && pos + 12 <= end && b[pos + 2] & 0x80 != 0 {
            let mut v = [0u8; 8];
            v.copy_from_slice(&b[pos + 4..pos + 12]);
            return Some(u64::from_be_bytes(v));
        }
        pos += 2 + len;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn descriptor_sense_round_trips() {
        let s = Sense {
            info: Some(0x0102_0304_0506),
            ..Sense::new(SenseKey::Miscompare, asc::MISCOMPARE_DURING_VERIFY)
        };
        let mut b = [0u8; DESCRIPTOR_SENSE_MAX];
        let f = FieldPointer {
            byte: 13,
            bit: None,
        };
        let n = s.encode_descriptor(Some(f), &mut b);
        assert_eq!((n, b[0], b[7]), (28, 0x72, 20));
        assert_eq!(&b[20..28], &[0x02, 0x06, 0, 0, 0xc0, 0, 13, 0]);
        let back = Sense::decode(&b[..n]).unwrap();
        assert_eq!(
            back,
            Sense {
                descriptor: true,
                ..s
            }
        );
    }

    #[test]
    fn fixed_sense_round_trips() {
        let s = Sense {
            info: Some(0x1234),
            ..Sense::new(SenseKey::MediumError, asc::UNRECOVERED_READ)
        };
        let mut b = [0; 18];
        s.encode_fixed(&mut b);
        assert_eq!(Sense::decode(&b), Ok(s));
    }

    #[test]
    fn descriptor_sense_with_information() {
        // Key HARDWARE ERROR, 44/00, one information descriptor (LBA 0x0102030405060708).
        let b = [
            0x72, 0x04, 0x44, 0x00, 0, 0, 0, 12, 0x00, 0x0a, 0x80, 0, 1, 2, 3, 4, 5, 6, 7, 8,
        ];
        let s = Sense::decode(&b).unwrap();
        assert!(s.descriptor);
        assert_eq!(s.key, SenseKey::HardwareError);
        assert_eq!(s.code(), asc::INTERNAL_TARGET_FAILURE);
        assert_eq!(s.info, Some(0x0102030405060708));
    }

    #[test]
    fn short_and_odd_sense() {
        assert_eq!(Sense::decode(&[]), Err(SenseError::Empty));
        assert_eq!(Sense::decode(&[0x05]), Err(SenseError::ResponseCode(5)));
        // Three bytes of fixed sense: the key is there, ASC is not.
        let s = Sense::decode(&[0x70, 0, 0x06]).unwrap();
        assert_eq!((s.key, s.asc, s.info), (SenseKey::UnitAttention, 0, None));
        // Additional length says 0: ASC bytes present but not counted.
        let mut b = [0u8; 18];
        b[0] = 0x70;
        b[2] = 0x02;
        b[12] = 0x04;
        assert_eq!(Sense::decode(&b).unwrap().asc, 0);
        // Descriptor with a descriptor length running past the end.
        let s = Sense::decode(&[0x72, 0x03, 0x11, 0, 0, 0, 0, 200, 0, 0xff]).unwrap();
        assert_eq!((s.key, s.info), (SenseKey::MediumError, None));
    }

    proptest! {
        #[test]
        fn decode_never_panics(data in proptest::collection::vec(any::<u8>(), 0..300)) {
            crate::fuzz::sense(&data);
        }
    }
}
