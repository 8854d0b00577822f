//! iSCSI wire format (RFC 7143): the 48-byte basic header segment (BHS),
//! additional header segments, data segment lengths and padding, CRC32C
//! digests, and text key=value segments. Plain data: the decoders take
//! any bytes and never panic (fuzzed by `iscsi_pdu`); peer lengths are
//! capped before anything is allocated.

/// Bytes of a basic header segment.
pub const BHS_LEN: usize = 48;
/// Largest data segment we accept from a peer (what we negotiate, with
/// margin); anything larger is a protocol error, not an allocation.
pub const MAX_DATA_SEGMENT: usize = 1 << 20;
/// Most text pairs taken from one segment.
pub const MAX_TEXT_PAIRS: usize = 256;
pub const RESERVED_TAG: u32 = 0xffff_ffff;

/// Opcodes (RFC 7143 §11.1.1).
pub mod opcode {
    pub const NOP_OUT: u8 = 0x00;
    pub const SCSI_CMD: u8 = 0x01;
    pub const TMF_REQ: u8 = 0x02;
    pub const LOGIN_REQ: u8 = 0x03;
    pub const TEXT_REQ: u8 = 0x04;
    pub const DATA_OUT: u8 = 0x05;
    pub const LOGOUT_REQ: u8 = 0x06;
    pub const NOP_IN: u8 = 0x20;
    pub const SCSI_RESP: u8 = 0x21;
    pub const TMF_RESP: u8 = 0x22;
    pub const LOGIN_RESP: u8 = 0x23;
    pub const TEXT_RESP: u8 = 0x24;
    pub const DATA_IN: u8 = 0x25;
    pub const LOGOUT_RESP: u8 = 0x26;
    pub const R2T: u8 = 0x31;
    pub const ASYNC: u8 = 0x32;
    pub const REJECT: u8 = 0x3f;
}

/// TMF function codes.
pub mod tmf {
    pub const ABORT_TASK: u8 = 1;
    pub const LUN_RESET: u8 = 5;
    pub const TARGET_WARM_RESET: u8 = 6;
}

/// Why bytes are not a PDU we can take.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("header of {0} bytes, need 48")]
    Short(usize),
    #[error("data segment of {0} bytes exceeds the limit")]
    TooLarge(usize),
    #[error("unexpected opcode {0:#04x}")]
    Opcode(u8),
    #[error("header digest mismatch")]
    HeaderDigest,
    #[error("data digest mismatch")]
    DataDigest,
}

/// One basic header segment.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Bhs(pub [u8; BHS_LEN]);

const _: () = assert!(std::mem::size_of::<Bhs>() == BHS_LEN);

impl std::fmt::Debug for Bhs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Bhs(op {:#04x}, itt {:#x}, dlen {})",
            self.opcode(),
            self.itt(),
            self.data_len()
        )
    }
}

impl Default for Bhs {
    fn default() -> Bhs {
        Bhs([0; BHS_LEN])
    }
}

impl Bhs {
    pub fn from_slice(b: &[u8]) -> Result<Bhs, WireError> {
        let a: [u8; BHS_LEN] = b
            .get(..BHS_LEN)
            .and_then(|s| s.try_into().ok())
            .ok_or(WireError::Short(b.len()))?;
        Ok(Bhs(a))
    }

    pub fn new(opcode: u8, immediate: bool, flags: u8) -> Bhs {
        let mut b = Bhs::default();
        b.0[0] = opcode & 0x3f | if immediate { 0x40 } else { 0 };
        b.0[1] = flags;
        b
    }

    pub fn opcode(&self) -> u8 {
        self.0[0] & 0x3f
    }
    pub fn flags(&self) -> u8 {
        self.0[1]
    }
    pub fn final_bit(&self) -> bool {
        self.0[1] & 0x80 != 0
    }
    pub fn u8_at(&self, at: usize) -> u8 {
        self.0[at]
    }
    pub fn u16_at(&self, at: usize) -> u16 {
        u16::from_be_bytes([self.0[at], self.0[at + 1]])
    }
    pub fn u32_at(&self, at: usize) -> u32 {
        u32::from_be_bytes([self.0[at], self.0[at + 1], self.0[at + 2], self.0[at + 3]])
    }
    pub fn set_u8(&mut self, at: usize, v: u8) -> &mut Bhs {
        self.0[at] = v;
        self
    }
    pub fn set_u16(&mut self, at: usize, v: u16) -> &mut Bhs {
        self.0[at..at + 2].copy_from_slice(&v.to_be_bytes());
        self
    }
    pub fn set_u32(&mut self, at: usize, v: u32) -> &mut Bhs {
        self.0[at..at + 4].copy_from_slice(&v.to_be_bytes());
        self
    }

    /// Bytes of additional header segments.
    pub fn ahs_len(&self) -> usize {
        self.0[4] as usize * 4
    }
    pub fn data_len(&self) -> usize {
        (self.0[5] as usize) << 16 | (self.0[6] as usize) << 8 | self.0[7] as usize
    }
    pub fn set_data_len(&mut self, n: usize) -> &mut Bhs {
        self.0[5] = (n >> 16) as u8;
        self.0[6] = (n >> 8) as u8;
        self.0[7] = n as u8;
        self
    }
    pub fn lun(&self) -> [u8; 8] {
        self.0[8..16].try_into().unwrap_or([0; 8])
    }
    pub fn set_lun(&mut self, lun: [u8; 8]) -> &mut Bhs {
        self.0[8..16].copy_from_slice(&lun);
        self
    }
    pub fn itt(&self) -> u32 {
        self.u32_at(16)
    }
    pub fn set_itt(&mut self, v: u32) -> &mut Bhs {
        self.set_u32(16, v)
    }

    /// Bytes that follow the BHS on the wire: AHS, header digest, padded
    /// data, data digest. Refuses oversize segments before any allocation.
    pub fn rest_len(&self, header_digest: bool, data_digest: bool) -> Result<usize, WireError> {
        let d = self.data_len();
        if d > MAX_DATA_SEGMENT {
            return Err(WireError::TooLarge(d));
        }
        let hd = if header_digest { 4 } else { 0 };
        let dd = if data_digest && d > 0 { 4 } else { 0 };
        Ok(self.ahs_len() + hd + pad4(d) + dd)
    }
}

/// `n` rounded up to a multiple of 4 (segments are padded).
pub fn pad4(n: usize) -> usize {
    (n + 3) & !3
}

/// CRC32C of a header or data segment (RFC 7143 §12.1).
pub fn digest(parts: &[&[u8]]) -> u32 {
    parts.iter().fold(0, |c, p| crc32c::crc32c_append(c, p))
}

/// Status class of a login response (RFC 7143 §11.13.5).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoginStatus {
    Success,
    Redirect(u8),
    InitiatorError(u8),
    TargetError(u8),
}

impl LoginStatus {
    /// The class/detail pair with its RFC 7143 §11.13.5 meaning.
    pub fn describe(&self) -> String {
        let (class, detail, what) = match *self {
            LoginStatus::Success => (0, 0, "success"),
            LoginStatus::Redirect(d) => (1, d, "target moved (redirection)"),
            LoginStatus::InitiatorError(d) => (
                2,
                d,
                match d {
                    1 => "authentication failure",
                    2 => "authorization failure",
                    3 => "target not found",
                    4 => "target removed",
                    5 => "unsupported version",
                    6 => "too many connections",
                    7 => "missing parameter",
                    8 => "can't include in session",
                    9 => "session type not supported",
                    10 => "session does not exist",
                    11 => "invalid request during login",
                    _ => "initiator error",
                },
            ),
            LoginStatus::TargetError(d) => (3, d, "target error"),
        };
        format!("{what} (status class {class:#04x}, detail {detail:#04x})")
    }

    pub fn from_bhs(b: &Bhs) -> LoginStatus {
        let (class, detail) = (b.u8_at(36), b.u8_at(37));
        match class {
            0 => LoginStatus::Success,
            1 => LoginStatus::Redirect(detail),
            2 => LoginStatus::InitiatorError(detail),
            _ => LoginStatus::TargetError(detail),
        }
    }
}

/// Builders of the PDUs an initiator sends. Sequence numbers are the
/// session's business; these only place them.
pub mod build {
    use super::*;

    #[allow(clippy::too_many_arguments)]
    pub fn login(
        isid: [u8; 6],
        tsih: u16,
        itt: u32,
        cmdsn: u32,
        expstatsn: u32,
        csg: u8,
        nsg: u8,
        transit: bool,
    ) -> Bhs {
        let mut b = Bhs::new(
            opcode::LOGIN_REQ,
            true,
            (if transit { 0x80 } else { 0 }) | (csg & 3) << 2 | (nsg & 3),
        );
        b.0[8..14].copy_from_slice(&isid);
        b.set_u16(14, tsih)
            .set_itt(itt)
            .set_u32(24, cmdsn)
            .set_u32(28, expstatsn);
        b
    }

    pub fn text(itt: u32, cmdsn: u32, expstatsn: u32) -> Bhs {
        let mut b = Bhs::new(opcode::TEXT_REQ, true, 0x80);
        b.set_itt(itt)
            .set_u32(20, RESERVED_TAG)
            .set_u32(24, cmdsn)
            .set_u32(28, expstatsn);
        b
    }

    pub fn logout(itt: u32, cmdsn: u32, expstatsn: u32) -> Bhs {
        let mut b = Bhs::new(opcode::LOGOUT_REQ, true, 0x80);
        b.set_itt(itt).set_u32(24, cmdsn).set_u32(28, expstatsn);
        b
    }

    /// SCSI Command with a simple task attribute.
    #[allow(clippy::too_many_arguments)]
    pub fn scsi_cmd(
        lun: [u8; 8],
        itt: u32,
        cdb: &[u8],
        read: bool,
        write: bool,
        edtl: u32,
        cmdsn: u32,
        expstatsn: u32,
    ) -> Bhs {
        let flags = 0x80 | if read { 0x40 } else { 0 } | if write { 0x20 } else { 0 } | 0x01;
        let mut b = Bhs::new(opcode::SCSI_CMD, false, flags);
        b.set_lun(lun)
            .set_itt(itt)
            .set_u32(20, edtl)
            .set_u32(24, cmdsn)
            .set_u32(28, expstatsn);
        let n = cdb.len().min(16);
        b.0[32..32 + n].copy_from_slice(&cdb[..n]);
        b
    }

    #[allow(clippy::too_many_arguments)]
    pub fn data_out(
        lun: [u8; 8],
        itt: u32,
        ttt: u32,
        expstatsn: u32,
        datasn: u32,
        offset: u32,
        len: usize,
        last: bool,
    ) -> Bhs {
        let mut b = Bhs::new(opcode::DATA_OUT, false, if last { 0x80 } else { 0 });
        b.set_lun(lun)
            .set_itt(itt)
            .set_u32(20, ttt)
            .set_u32(28, expstatsn)
            .set_u32(36, datasn)
            .set_u32(40, offset);
        b.set_data_len(len);
        b
    }

    /// NOP-Out: a ping (`itt` set) or the answer to a target's NOP-In
    /// (`itt` reserved, its TTT echoed).
    pub fn nop_out(lun: [u8; 8], itt: u32, ttt: u32, cmdsn: u32, expstatsn: u32) -> Bhs {
        let mut b = Bhs::new(opcode::NOP_OUT, true, 0x80);
        b.set_lun(lun)
            .set_itt(itt)
            .set_u32(20, ttt)
            .set_u32(24, cmdsn)
            .set_u32(28, expstatsn);
        b
    }

    pub fn tmf(
        function: u8,
        lun: [u8; 8],
        itt: u32,
        ref_itt: u32,
        cmdsn: u32,
        expstatsn: u32,
        refcmdsn: u32,
    ) -> Bhs {
        let mut b = Bhs::new(opcode::TMF_REQ, true, 0x80 | function);
        b.set_lun(lun)
            .set_itt(itt)
            .set_u32(20, ref_itt)
            .set_u32(24, cmdsn)
            .set_u32(28, expstatsn)
            .set_u32(32, refcmdsn);
        b
    }
}

/// The fields of a target PDU the initiator acts on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TargetPdu {
    ScsiResponse {
        itt: u32,
        response: u8,
        status: u8,
        statsn: u32,
        maxcmdsn: u32,
        residual: u32,
        underflow: bool,
    },
    DataIn {
        itt: u32,
        final_: bool,
        status: Option<u8>,
        statsn: u32,
        maxcmdsn: u32,
        datasn: u32,
        offset: u32,
        residual: u32,
        underflow: bool,
    },
    R2t {
        itt: u32,
        ttt: u32,
        maxcmdsn: u32,
        r2tsn: u32,
        offset: u32,
        len: u32,
    },
    NopIn {
        itt: u32,
        ttt: u32,
        statsn: u32,
        maxcmdsn: u32,
    },
    TmfResponse {
        itt: u32,
        response: u8,
        statsn: u32,
        maxcmdsn: u32,
    },
    LoginResponse {
        itt: u32,
        transit: bool,
        nsg: u8,
        tsih: u16,
        statsn: u32,
        maxcmdsn: u32,
        status: LoginStatus,
    },
    TextResponse {
        itt: u32,
        final_: bool,
        ttt: u32,
        statsn: u32,
        maxcmdsn: u32,
    },
    LogoutResponse {
        itt: u32,
        response: u8,
        statsn: u32,
    },
    Async {
        event: u8,
        statsn: u32,
        maxcmdsn: u32,
    },
    Reject {
        reason: u8,
        statsn: u32,
    },
}

impl TargetPdu {
    /// Decodes a target BHS; initiator opcodes and unknown ones are errors.
    pub fn decode(b: &Bhs) -> Result<TargetPdu, WireError> {
        let f = b.flags();
        let statsn = b.u32_at(24);
        let maxcmdsn = b.u32_at(32);
        Ok(match b.opcode() {
            opcode::SCSI_RESP => TargetPdu::ScsiResponse {
                itt: b.itt(),
                response: b.u8_at(2),
                status: b.u8_at(3),
                statsn,
                maxcmdsn,
                residual: b.u32_at(44),
                underflow: f & 0x02 != 0,
            },
            opcode::DATA_IN => TargetPdu::DataIn {
                itt: b.itt(),
                final_: f & 0x80 != 0,
                status: (f & 0x01 != 0).then_some(b.u8_at(3)),
                statsn,
                maxcmdsn,
                datasn: b.u32_at(36),
                offset: b.u32_at(40),
                residual: b.u32_at(44),
                underflow: f & 0x02 != 0,
            },
            opcode::R2T => TargetPdu::R2t {
                itt: b.itt(),
                ttt: b.u32_at(20),
                maxcmdsn,
                r2tsn: b.u32_at(36),
                offset: b.u32_at(40),
                len: b.u32_at(44),
            },
            opcode::NOP_IN => TargetPdu::NopIn {
                itt: b.itt(),
                ttt: b.u32_at(20),
                statsn,
                maxcmdsn,
            },
            opcode::TMF_RESP => TargetPdu::TmfResponse {
                itt: b.itt(),
                response: b.u8_at(2),
                statsn,
                maxcmdsn,
            },
            opcode::LOGIN_RESP => TargetPdu::LoginResponse {
                itt: b.itt(),
                transit: f & 0x80 != 0,
                nsg: f & 3,
                tsih: b.u16_at(14),
                statsn,
                maxcmdsn,
                status: LoginStatus::from_bhs(b),
            },
            opcode::TEXT_RESP => TargetPdu::TextResponse {
                itt: b.itt(),
                final_: f & 0x80 != 0,
                ttt: b.u32_at(20),
                statsn,
                maxcmdsn,
            },
            opcode::LOGOUT_RESP => TargetPdu::LogoutResponse {
                itt: b.itt(),
                response: b.u8_at(2),
                statsn,
            },
            opcode::ASYNC => TargetPdu::Async {
                event: b.u8_at(36),
                statsn,
                maxcmdsn,
            },
            opcode::REJECT => TargetPdu::Reject {
                reason: b.u8_at(2),
                statsn,
            },
            o => return Err(WireError::Opcode(o)),
        })
    }
}

/// Parses a text segment (`key=value\0…`) into pairs, at most
/// [`MAX_TEXT_PAIRS`]; malformed entries are skipped.
pub fn parse_text(data: &[u8]) -> Vec<(String, String)> {
    data.split(|c| *c == 0)
        .filter(|s| !s.is_empty())
        .filter_map(|s| {
            let s = std::str::from_utf8(s).ok()?;
            let (k, v) = s.split_once('=')?;
            Some((k.to_string(), v.to_string()))
        })
        .take(MAX_TEXT_PAIRS)
        .collect()
}

/// Encodes pairs as a text segment.
pub fn encode_text(pairs: &[(&str, &str)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(b'=');
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

/// The body of the `iscsi_pdu` fuzz target (and its proptest): a whole PDU
/// from arbitrary bytes.
pub fn fuzz_pdu(data: &[u8]) {
    let Ok(b) = Bhs::from_slice(data) else {
        return;
    };
    let _ = TargetPdu::decode(&b);
    if let Ok(n) = b.rest_len(true, true) {
        let rest = &data[BHS_LEN..];
        let dlen = b.data_len().min(rest.len());
        let _ = parse_text(&rest[..dlen]);
        let _ = digest(&[&rest[..n.min(rest.len())]]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn scsi_cmd_layout() {
        let b = build::scsi_cmd(
            [0, 1, 0, 0, 0, 0, 0, 0],
            7,
            &[0x28, 0, 0, 0, 0, 8, 0, 0, 8, 0],
            true,
            false,
            4096,
            10,
            20,
        );
        assert_eq!(b.opcode(), opcode::SCSI_CMD);
        assert_eq!(b.flags(), 0x80 | 0x40 | 0x01);
        assert_eq!(
            (b.itt(), b.u32_at(20), b.u32_at(24), b.u32_at(28)),
            (7, 4096, 10, 20)
        );
        assert_eq!(b.0[32], 0x28);
        assert_eq!(b.lun()[1], 1);
    }

    #[test]
    fn data_in_and_lengths() {
        let mut b = Bhs::new(opcode::DATA_IN, false, 0x80 | 0x01);
        b.set_itt(5)
            .set_u8(3, 0)
            .set_u32(40, 8192)
            .set_data_len(4093);
        b.0[4] = 1;
        match TargetPdu::decode(&b).unwrap() {
            TargetPdu::DataIn {
                itt,
                final_,
                status,
                offset,
                ..
            } => {
                assert_eq!((itt, final_, status, offset), (5, true, Some(0), 8192))
            }
            p => panic!("{p:?}"),
        }
        assert_eq!(b.rest_len(false, false), Ok(4 + 4096));
        assert_eq!(b.rest_len(true, true), Ok(4 + 4 + 4096 + 4));
        b.set_data_len(MAX_DATA_SEGMENT + 1);
        assert!(matches!(
            b.rest_len(false, false),
            Err(WireError::TooLarge(_))
        ));
        assert_eq!(
            TargetPdu::decode(&Bhs::new(opcode::SCSI_CMD, false, 0)),
            Err(WireError::Opcode(1))
        );
    }

    #[test]
    fn login_and_text() {
        let b = build::login([0x80, 1, 2, 3, 4, 5], 0, 1, 0, 0, 1, 3, true);
        assert_eq!(b.0[0], 0x43);
        assert_eq!(b.flags(), 0x80 | 1 << 2 | 3);
        let t = encode_text(&[("TargetName", "iqn.x"), ("HeaderDigest", "None")]);
        assert_eq!(
            parse_text(&t),
            vec![
                ("TargetName".into(), "iqn.x".into()),
                ("HeaderDigest".into(), "None".into())
            ]
        );
        assert_eq!(parse_text(b"junk\0a=b\0\0"), vec![("a".into(), "b".into())]);
    }

    #[test]
    fn crc32c_known_value() {
        // RFC 3720 B.4: 32 bytes of zeroes.
        assert_eq!(digest(&[&[0u8; 32]]), 0x8a91_36aa);
        assert_eq!(digest(&[&[0u8; 16], &[0u8; 16]]), 0x8a91_36aa);
    }

    proptest! {
        #[test]
        fn decoders_never_panic(data in proptest::collection::vec(any::<u8>(), 0..200)) {
            fuzz_pdu(&data);
        }
    }
}
