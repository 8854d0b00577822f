//! NVMe submission (64 bytes) and completion (16 bytes) queue entries,
//! opcodes, status codes and the Fabrics command fields (Connect, Property
//! Get/Set, Disconnect).
//!
//! An [`Sqe`] is kept as its raw bytes with typed accessors: a command is
//! decoded once, in place, and fields are read where they are needed.

use super::sgl::SglDesc;
use super::{le16, le32, le64, put16, put32, put64};

pub const SQE_LEN: usize = 64;
pub const CQE_LEN: usize = 16;
/// Length of the Fabrics Connect data (host id, cntlid, NQNs).
pub const CONNECT_DATA_LEN: usize = 1024;
pub const NQN_LEN: usize = 256;
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";

/// Admin command opcodes.
pub mod admin {
    pub const GET_LOG_PAGE: u8 = 0x02;
    pub const IDENTIFY: u8 = 0x06;
    pub const ABORT: u8 = 0x08;
    pub const SET_FEATURES: u8 = 0x09;
    pub const GET_FEATURES: u8 = 0x0a;
    pub const ASYNC_EVENT_REQUEST: u8 = 0x0c;
    pub const KEEP_ALIVE: u8 = 0x18;
    pub const FABRICS: u8 = 0x7f;
}

/// NVM command set I/O opcodes.
pub mod io {
    pub const FLUSH: u8 = 0x00;
    pub const WRITE: u8 = 0x01;
    pub const READ: u8 = 0x02;
    pub const COMPARE: u8 = 0x05;
    pub const WRITE_ZEROES: u8 = 0x08;
    pub const DSM: u8 = 0x09;
}

/// Fabrics command types (byte 4 of a Fabrics SQE).
pub mod fctype {
    pub const PROPERTY_SET: u8 = 0x00;
    pub const CONNECT: u8 = 0x01;
    pub const PROPERTY_GET: u8 = 0x04;
    pub const DISCONNECT: u8 = 0x08;
}

/// Controller properties (register offsets) reachable by Property Get/Set.
pub mod prop {
    pub const CAP: u32 = 0x00;
    pub const VS: u32 = 0x08;
    pub const CC: u32 = 0x14;
    pub const CSTS: u32 = 0x1c;
}

/// A 15-bit NVMe status: type (SCT), code (SC), do-not-retry (DNR). The
/// phase bit is not kept (fabrics transports do not use it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Status(pub u16);

impl Status {
    pub const SUCCESS: Status = Status(0);
    pub const INVALID_OPCODE: Status = Status::generic(0x01);
    pub const INVALID_FIELD: Status = Status::generic(0x02);
    pub const DATA_TRANSFER_ERROR: Status = Status::generic(0x04);
    pub const INTERNAL: Status = Status::generic(0x06);
    pub const ABORT_REQUESTED: Status = Status::generic(0x07);
    pub const INVALID_NAMESPACE: Status = Status::generic(0x0b);
    pub const COMMAND_SEQUENCE: Status = Status::generic(0x0c);
    pub const DATA_SGL_LENGTH_INVALID: Status = Status::generic(0x11);
    pub const SGL_TYPE_INVALID: Status = Status::generic(0x13);
    pub const SGL_OFFSET_INVALID: Status = Status::generic(0x18);
    pub const TRANSIENT_TRANSPORT: Status = Status(0x22 << 1);
    pub const LBA_OUT_OF_RANGE: Status = Status::generic(0x80);
    pub const NS_NOT_READY: Status = Status(0x82 << 1);
    pub const INVALID_QUEUE_ID: Status = Status::specific(0x01);
    pub const INVALID_QUEUE_SIZE: Status = Status::specific(0x02);
    pub const AER_LIMIT: Status = Status::specific(0x05);
    pub const INVALID_LOG_PAGE: Status = Status::specific(0x09);
    pub const FEATURE_NOT_SAVEABLE: Status = Status::specific(0x0d);
    pub const CONNECT_INCOMPATIBLE_FORMAT: Status = Status::specific(0x80);
    pub const CONNECT_CTRL_BUSY: Status = Status::specific(0x81);
    pub const CONNECT_INVALID_PARAM: Status = Status::specific(0x82);
    pub const CONNECT_INVALID_HOST: Status = Status::specific(0x84);
    pub const WRITE_FAULT: Status = Status::media(0x80);
    pub const UNRECOVERED_READ: Status = Status::media(0x81);
    pub const COMPARE_FAILURE: Status = Status::media(0x85);
    /// Command Aborted due to Failed Fused Command.
    pub const ABORTED_FAILED_FUSED: Status = Status::generic(0x09);
    /// Command Aborted due to Missing Fused Command.
    pub const ABORTED_MISSING_FUSED: Status = Status::generic(0x0a);

    /// Generic command status (SCT 0), do not retry.
    pub const fn generic(sc: u8) -> Status {
        Status::new(0, sc, true)
    }
    /// Command-specific status (SCT 1), do not retry.
    pub const fn specific(sc: u8) -> Status {
        Status::new(1, sc, true)
    }
    /// Media and data integrity errors (SCT 2), do not retry.
    pub const fn media(sc: u8) -> Status {
        Status::new(2, sc, true)
    }
    pub const fn new(sct: u8, sc: u8, dnr: bool) -> Status {
        Status(((dnr as u16) << 14) | (((sct & 7) as u16) << 8) | sc as u16)
    }
    pub fn sct(self) -> u8 {
        ((self.0 >> 8) & 7) as u8
    }
    pub fn sc(self) -> u8 {
        self.0 as u8
    }
    pub fn dnr(self) -> bool {
        self.0 & (1 << 14) != 0
    }
    pub fn is_success(self) -> bool {
        self.0 & 0x7ff == 0
    }
    /// The CQE status field (bits 15:1; bit 0 is the phase tag).
    pub fn to_field(self) -> u16 {
        self.0 << 1
    }
    pub fn from_field(f: u16) -> Status {
        Status(f >> 1)
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NVMe status sct={:#x} sc={:#04x}", self.sct(), self.sc())
    }
}

/// A submission queue entry, kept raw.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Sqe(pub [u8; SQE_LEN]);

const _: () = assert!(std::mem::size_of::<Sqe>() == SQE_LEN);

impl std::fmt::Debug for Sqe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Sqe(opc={:#04x} cid={} nsid={} cdw10={:#x})",
            self.opcode(),
            self.cid(),
            self.nsid(),
            self.cdw(10)
        )
    }
}

impl Default for Sqe {
    fn default() -> Self {
        Sqe([0; SQE_LEN])
    }
}

impl Sqe {
    /// Takes the first 64 bytes of `b`; `None` if it is shorter.
    pub fn from_slice(b: &[u8]) -> Option<Sqe> {
        let mut s = [0u8; SQE_LEN];
        s.copy_from_slice(b.get(..SQE_LEN)?);
        Some(Sqe(s))
    }
    pub fn opcode(&self) -> u8 {
        self.0[0]
    }
    /// PSDT (bits 7:6 of byte 1): 0 = PRP, 1/2 = SGL.
    pub fn psdt(&self) -> u8 {
        self.0[1] >> 6
    }
    pub fn fuse(&self) -> u8 {
        self.0[1] & 3
    }
    pub fn cid(&self) -> u16 {
        le16(&self.0, 2)
    }
    pub fn nsid(&self) -> u32 {
        le32(&self.0, 4)
    }
    /// Command dword `n` (0..=15).
    pub fn cdw(&self, n: usize) -> u32 {
        le32(&self.0, (n & 15) * 4)
    }
    pub fn sgl(&self) -> SglDesc {
        SglDesc::decode(&self.0[24..40])
    }
    /// Fabrics command type (only meaningful for opcode 0x7f).
    pub fn fctype(&self) -> u8 {
        self.0[4]
    }
    /// Starting LBA of an NVM I/O command (CDW10-11).
    pub fn slba(&self) -> u64 {
        le64(&self.0, 40)
    }
    /// Number of logical blocks (CDW12 bits 15:0, 0's based, so 1..=65536).
    pub fn nlb(&self) -> u32 {
        (self.cdw(12) & 0xffff) + 1
    }

    pub fn set_opcode(&mut self, v: u8) -> &mut Self {
        self.0[0] = v;
        self
    }
    /// Marks the command as using SGLs for data (PSDT = 01b).
    /// FUSE (bits 1:0 of byte 1): 01b first, 10b second command of a
    /// fused operation.
    pub fn set_fuse(&mut self, v: u8) -> &mut Self {
        self.0[1] = (self.0[1] & !3) | (v & 3);
        self
    }
    pub fn set_sgl_psdt(&mut self) -> &mut Self {
        self.0[1] = (self.0[1] & 0x3f) | 0x40;
        self
    }
    pub fn set_cid(&mut self, v: u16) -> &mut Self {
        put16(&mut self.0, 2, v);
        self
    }
    pub fn set_nsid(&mut self, v: u32) -> &mut Self {
        put32(&mut self.0, 4, v);
        self
    }
    pub fn set_cdw(&mut self, n: usize, v: u32) -> &mut Self {
        put32(&mut self.0, (n & 15) * 4, v);
        self
    }
    pub fn set_sgl(&mut self, d: SglDesc) -> &mut Self {
        d.encode(&mut self.0[24..40]);
        self
    }
    pub fn set_fctype(&mut self, v: u8) -> &mut Self {
        self.0[4] = v;
        self
    }
    pub fn set_slba(&mut self, v: u64) -> &mut Self {
        put64(&mut self.0, 40, v);
        self
    }
}

/// Fields of a Fabrics Connect command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectCmd {
    pub recfmt: u16,
    pub qid: u16,
    /// 0's based submission queue size.
    pub sqsize: u16,
    pub cattr: u8,
    /// Keep alive timeout in milliseconds (admin queue only; 0 = none).
    pub kato_ms: u32,
}

impl ConnectCmd {
    /// CATTR bit 2: the host disables SQ flow control (SQHD not reported),
    /// which allows C2HData's SUCCESS flag.
    pub const CATTR_DISABLE_SQFLOW: u8 = 1 << 2;

    pub fn parse(sqe: &Sqe) -> ConnectCmd {
        ConnectCmd {
            recfmt: le16(&sqe.0, 40),
            qid: le16(&sqe.0, 42),
            sqsize: le16(&sqe.0, 44),
            cattr: sqe.0[46],
            kato_ms: le32(&sqe.0, 48),
        }
    }

    pub fn encode(&self, sqe: &mut Sqe) {
        sqe.set_opcode(admin::FABRICS).set_fctype(fctype::CONNECT);
        put16(&mut sqe.0, 40, self.recfmt);
        put16(&mut sqe.0, 42, self.qid);
        put16(&mut sqe.0, 44, self.sqsize);
        sqe.0[46] = self.cattr;
        put32(&mut sqe.0, 48, self.kato_ms);
    }
}

/// The 1024-byte Connect data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectData {
    pub hostid: [u8; 16],
    /// 0xffff asks for a dynamic controller (admin queue); an I/O queue names
    /// the controller its admin queue got.
    pub cntlid: u16,
    pub subnqn: String,
    pub hostnqn: String,
}

impl ConnectData {
    /// Decodes the data; `Err(offset)` names the invalid field's byte offset
    /// (for the Connect response's IPO).
    pub fn decode(b: &[u8]) -> Result<ConnectData, u16> {
        if b.len() < CONNECT_DATA_LEN {
            return Err(0);
        }
        let mut hostid = [0u8; 16];
        hostid.copy_from_slice(&b[..16]);
        let subnqn = super::get_cstr(&b[256..512]).ok_or(256u16)?;
        let hostnqn = super::get_cstr(&b[512..768]).ok_or(512u16)?;
        Ok(ConnectData {
            hostid,
            cntlid: le16(b, 16),
            subnqn: subnqn.to_string(),
            hostnqn: hostnqn.to_string(),
        })
    }

    pub fn encode(&self, out: &mut [u8; CONNECT_DATA_LEN]) {
        out.fill(0);
        out[..16].copy_from_slice(&self.hostid);
        put16(out, 16, self.cntlid);
        super::put_cstr(&mut out[256..512], &self.subnqn);
        super::put_cstr(&mut out[512..768], &self.hostnqn);
    }
}

/// Property Get/Set fields: size (4 or 8 bytes), offset, value (Set).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PropertyCmd {
    pub eight_bytes: bool,
    pub offset: u32,
    pub value: u64,
}

impl PropertyCmd {
    pub fn parse(sqe: &Sqe) -> PropertyCmd {
        PropertyCmd {
            eight_bytes: sqe.0[40] & 7 == 1,
            offset: le32(&sqe.0, 44),
            value: le64(&sqe.0, 48),
        }
    }

    pub fn encode(&self, sqe: &mut Sqe, set: bool) {
        sqe.set_opcode(admin::FABRICS).set_fctype(if set {
            fctype::PROPERTY_SET
        } else {
            fctype::PROPERTY_GET
        });
        sqe.0[40] = self.eight_bytes as u8;
        put32(&mut sqe.0, 44, self.offset);
        put64(&mut sqe.0, 48, self.value);
    }
}

/// A completion queue entry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cqe {
    /// Command specific (Connect: cntlid; Property Get: value low half).
    pub dw0: u32,
    pub dw1: u32,
    pub sqhd: u16,
    pub sqid: u16,
    pub cid: u16,
    pub status: u16,
}

impl Cqe {
    pub fn new(cid: u16, status: Status) -> Cqe {
        Cqe {
            cid,
            status: status.to_field(),
            ..Cqe::default()
        }
    }
    pub fn status(&self) -> Status {
        Status::from_field(self.status)
    }
    pub fn encode(&self, out: &mut [u8]) {
        put32(out, 0, self.dw0);
        put32(out, 4, self.dw1);
        put16(out, 8, self.sqhd);
        put16(out, 10, self.sqid);
        put16(out, 12, self.cid);
        put16(out, 14, self.status);
    }
    pub fn decode(b: &[u8]) -> Option<Cqe> {
        let b = b.get(..CQE_LEN)?;
        Some(Cqe {
            dw0: le32(b, 0),
            dw1: le32(b, 4),
            sqhd: le16(b, 8),
            sqid: le16(b, 10),
            cid: le16(b, 12),
            status: le16(b, 14),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_fields() {
        let s = Status::LBA_OUT_OF_RANGE;
        assert_eq!((s.sct(), s.sc(), s.dnr()), (0, 0x80, true));
        assert_eq!(Status::from_field(s.to_field()), s);
        assert!(Status::SUCCESS.is_success());
        assert_eq!(Status::CONNECT_INVALID_HOST.sct(), 1);
        assert_eq!(Status::COMPARE_FAILURE.sct(), 2);
    }

    #[test]
    fn cqe_roundtrip() {
        let c = Cqe {
            dw0: 7,
            dw1: 9,
            sqhd: 3,
            sqid: 1,
            cid: 0xbeef,
            status: Status::INVALID_OPCODE.to_field(),
        };
        let mut b = [0u8; CQE_LEN];
        c.encode(&mut b);
        assert_eq!(Cqe::decode(&b), Some(c));
        assert_eq!(Cqe::decode(&b[..15]), None);
    }

    #[test]
    fn connect_roundtrip() {
        let c = ConnectCmd {
            recfmt: 0,
            qid: 3,
            sqsize: 127,
            cattr: 4,
            kato_ms: 5000,
        };
        let mut s = Sqe::default();
        c.encode(&mut s);
        assert_eq!(ConnectCmd::parse(&s), c);
        let d = ConnectData {
            hostid: [1; 16],
            cntlid: 0xffff,
            subnqn: "nqn.a".into(),
            hostnqn: "nqn.b".into(),
        };
        let mut b = [0u8; CONNECT_DATA_LEN];
        d.encode(&mut b);
        assert_eq!(ConnectData::decode(&b), Ok(d));
        assert_eq!(ConnectData::decode(&b[..100]), Err(0));
    }
}
