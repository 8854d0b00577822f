//! Command descriptor blocks (SPC-4, SBC-3): builders for the commands the
//! initiator sends and a parser that turns CDB bytes back into a
//! [`Command`] (used by the target core, `ustor-scsi-target`).
//!
//! A [`Cdb`] is a fixed 16-byte array plus a length: building one never
//! allocates, and it is `Copy` so it can sit in a preallocated command slot.

/// Operation codes this crate builds or parses.
pub mod op {
    pub const TEST_UNIT_READY: u8 = 0x00;
    pub const REQUEST_SENSE: u8 = 0x03;
    pub const READ_6: u8 = 0x08;
    pub const WRITE_6: u8 = 0x0a;
    pub const INQUIRY: u8 = 0x12;
    pub const MODE_SELECT_6: u8 = 0x15;
    pub const MODE_SENSE_6: u8 = 0x1a;
    pub const RESERVE_6: u8 = 0x16;
    pub const RELEASE_6: u8 = 0x17;
    pub const START_STOP_UNIT: u8 = 0x1b;
    pub const READ_CAPACITY_10: u8 = 0x25;
    pub const READ_10: u8 = 0x28;
    pub const WRITE_10: u8 = 0x2a;
    pub const WRITE_AND_VERIFY_10: u8 = 0x2e;
    pub const VERIFY_10: u8 = 0x2f;
    pub const PRE_FETCH_10: u8 = 0x34;
    pub const READ_DEFECT_DATA_10: u8 = 0x37;
    pub const SYNCHRONIZE_CACHE_10: u8 = 0x35;
    pub const WRITE_SAME_10: u8 = 0x41;
    pub const UNMAP: u8 = 0x42;
    pub const RESERVE_10: u8 = 0x56;
    pub const RELEASE_10: u8 = 0x57;
    pub const MODE_SELECT_10: u8 = 0x55;
    pub const MODE_SENSE_10: u8 = 0x5a;
    pub const PERSISTENT_RESERVE_IN: u8 = 0x5e;
    pub const PERSISTENT_RESERVE_OUT: u8 = 0x5f;
    pub const EXTENDED_COPY: u8 = 0x83;
    pub const RECEIVE_COPY_RESULTS: u8 = 0x84;
    pub const READ_16: u8 = 0x88;
    pub const COMPARE_AND_WRITE: u8 = 0x89;
    pub const WRITE_16: u8 = 0x8a;
    pub const ORWRITE_16: u8 = 0x8b;
    pub const WRITE_AND_VERIFY_16: u8 = 0x8e;
    pub const VERIFY_16: u8 = 0x8f;
    pub const PRE_FETCH_16: u8 = 0x90;
    pub const SYNCHRONIZE_CACHE_16: u8 = 0x91;
    pub const WRITE_SAME_16: u8 = 0x93;
    pub const SERVICE_ACTION_IN_16: u8 = 0x9e;
    pub const REPORT_LUNS: u8 = 0xa0;
    pub const MAINTENANCE_IN: u8 = 0xa3;
    pub const READ_12: u8 = 0xa8;
    pub const WRITE_12: u8 = 0xaa;
    pub const WRITE_AND_VERIFY_12: u8 = 0xae;
    pub const VERIFY_12: u8 = 0xaf;
    pub const READ_DEFECT_DATA_12: u8 = 0xb7;
    /// Service action of SERVICE ACTION IN(16) for READ CAPACITY(16).
    pub const SA_READ_CAPACITY_16: u8 = 0x10;
    /// Service action of SERVICE ACTION IN(16) for GET LBA STATUS.
    pub const SA_GET_LBA_STATUS: u8 = 0x12;
    /// Service action of MAINTENANCE IN for REPORT SUPPORTED OPERATION CODES.
    pub const SA_REPORT_SUPPORTED_OPCODES: u8 = 0x0c;
}

/// Bytes of the UNMAP parameter list with one block descriptor.
pub const UNMAP_PARAM_LEN_ONE: usize = 24;

/// One CDB: up to 16 bytes, `len` of them meaningful.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Cdb {
    bytes: [u8; 16],
    len: u8,
}

const _: () = assert!(std::mem::size_of::<Cdb>() == 17);

impl std::fmt::Debug for Cdb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Cdb({:02x?})", self.as_bytes())
    }
}

impl Cdb {
    /// A CDB from raw bytes (SG_IO users, tests); `None` if longer than 16.
    pub fn from_bytes(b: &[u8]) -> Option<Cdb> {
        if b.is_empty() || b.len() > 16 {
            return None;
        }
        let mut bytes = [0u8; 16];
        bytes[..b.len()].copy_from_slice(b);
        Some(Cdb {
            bytes,
            len: b.len() as u8,
        })
    }

    fn new(len: u8, opcode: u8) -> Cdb {
        let mut bytes = [0u8; 16];
        bytes[0] = opcode;
        Cdb { bytes, len }
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }

    pub fn opcode(&self) -> u8 {
        self.bytes[0]
    }

    pub fn len(&self) -> usize {
        self.len as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn put_u16(&mut self, at: usize, v: u16) {
        self.bytes[at..at + 2].copy_from_slice(&v.to_be_bytes());
    }
    fn put_u32(&mut self, at: usize, v: u32) {
        self.bytes[at..at + 4].copy_from_slice(&v.to_be_bytes());
    }
    fn put_u64(&mut self, at: usize, v: u64) {
        self.bytes[at..at + 8].copy_from_slice(&v.to_be_bytes());
    }

    pub fn test_unit_ready() -> Cdb {
        Cdb::new(6, op::TEST_UNIT_READY)
    }

    pub fn request_sense(alloc_len: u8) -> Cdb {
        let mut c = Cdb::new(6, op::REQUEST_SENSE);
        c.bytes[4] = alloc_len;
        c
    }

    /// INQUIRY: standard data (`page: None`) or a VPD page.
    pub fn inquiry(page: Option<u8>, alloc_len: u16) -> Cdb {
        let mut c = Cdb::new(6, op::INQUIRY);
        if let Some(p) = page {
            c.bytes[1] = 0x01; // EVPD
            c.bytes[2] = p;
        }
        c.put_u16(3, alloc_len);
        c
    }

    pub fn read_capacity_16(alloc_len: u32) -> Cdb {
        let mut c = Cdb::new(16, op::SERVICE_ACTION_IN_16);
        c.bytes[1] = op::SA_READ_CAPACITY_16;
        c.put_u32(10, alloc_len);
        c
    }

    /// REPORT LUNS, SELECT REPORT 0 (all logical units but well-known ones).
    pub fn report_luns(alloc_len: u32) -> Cdb {
        let mut c = Cdb::new(12, op::REPORT_LUNS);
        c.put_u32(6, alloc_len);
        c
    }

    pub fn read_10(lba: u32, blocks: u16, fua: bool) -> Cdb {
        Cdb::rw_10(op::READ_10, lba, blocks, fua)
    }

    pub fn write_10(lba: u32, blocks: u16, fua: bool) -> Cdb {
        Cdb::rw_10(op::WRITE_10, lba, blocks, fua)
    }

    fn rw_10(opc: u8, lba: u32, blocks: u16, fua: bool) -> Cdb {
        let mut c = Cdb::new(10, opc);
        c.bytes[1] = if fua { 0x08 } else { 0 };
        c.put_u32(2, lba);
        c.put_u16(7, blocks);
        c
    }

    pub fn read_16(lba: u64, blocks: u32, fua: bool) -> Cdb {
        Cdb::rw_16(op::READ_16, lba, blocks, fua)
    }

    pub fn write_16(lba: u64, blocks: u32, fua: bool) -> Cdb {
        Cdb::rw_16(op::WRITE_16, lba, blocks, fua)
    }

    fn rw_16(opc: u8, lba: u64, blocks: u32, fua: bool) -> Cdb {
        let mut c = Cdb::new(16, opc);
        c.bytes[1] = if fua { 0x08 } else { 0 };
        c.put_u64(2, lba);
        c.put_u32(10, blocks);
        c
    }

    /// READ or WRITE, the 10-byte form when the range fits it (fewer bytes
    /// on the wire, and older devices lack the 16-byte form).
    pub fn rw(write: bool, lba: u64, blocks: u32) -> Cdb {
        let fits10 = lba + blocks as u64 <= u32::MAX as u64 + 1 && blocks <= u16::MAX as u32;
        match (write, fits10) {
            (false, true) => Cdb::read_10(lba as u32, blocks as u16, false),
            (true, true) => Cdb::write_10(lba as u32, blocks as u16, false),
            (false, false) => Cdb::read_16(lba, blocks, false),
            (true, false) => Cdb::write_16(lba, blocks, false),
        }
    }

    pub fn synchronize_cache_10(lba: u32, blocks: u16) -> Cdb {
        let mut c = Cdb::new(10, op::SYNCHRONIZE_CACHE_10);
        c.put_u32(2, lba);
        c.put_u16(7, blocks);
        c
    }

    pub fn synchronize_cache_16(lba: u64, blocks: u32) -> Cdb {
        let mut c = Cdb::new(16, op::SYNCHRONIZE_CACHE_16);
        c.put_u64(2, lba);
        c.put_u32(10, blocks);
        c
    }

    /// SYNCHRONIZE CACHE over a range, 10-byte form when it fits.
    pub fn synchronize_cache(lba: u64, blocks: u32) -> Cdb {
        if lba + blocks as u64 <= u32::MAX as u64 + 1 && blocks <= u16::MAX as u32 {
            Cdb::synchronize_cache_10(lba as u32, blocks as u16)
        } else {
            Cdb::synchronize_cache_16(lba, blocks)
        }
    }

    /// UNMAP with a parameter list of `param_len` bytes (see [`unmap_param`]).
    pub fn unmap(param_len: u16) -> Cdb {
        let mut c = Cdb::new(10, op::UNMAP);
        c.put_u16(7, param_len);
        c
    }

    /// WRITE SAME(16) of one block of data-out (or none with NDOB).
    pub fn write_same_16(lba: u64, blocks: u32, unmap: bool, ndob: bool) -> Cdb {
        let mut c = Cdb::new(16, op::WRITE_SAME_16);
        c.bytes[1] = (if unmap { 0x08 } else { 0 }) | (if ndob { 0x01 } else { 0 });
        c.put_u64(2, lba);
        c.put_u32(10, blocks);
        c
    }
}

/// Writes an UNMAP parameter list with one block descriptor into `out`.
pub fn unmap_param(out: &mut [u8; UNMAP_PARAM_LEN_ONE], lba: u64, blocks: u32) {
    *out = [0; UNMAP_PARAM_LEN_ONE];
    out[0..2].copy_from_slice(&22u16.to_be_bytes()); // bytes that follow
    out[2..4].copy_from_slice(&16u16.to_be_bytes()); // descriptor bytes
    out[8..16].copy_from_slice(&lba.to_be_bytes());
    out[16..20].copy_from_slice(&blocks.to_be_bytes());
}

/// Calls `f(lba, blocks)` for each block descriptor of an UNMAP parameter
/// list, at most `max` of them; malformed lists yield what is well-formed.
pub fn parse_unmap_param(b: &[u8], max: usize, mut f: impl FnMut(u64, u32)) -> usize {
    if b.len() < 8 {
        return 0;
    }
    let desc_len = u16::from_be_bytes([b[2], b[3]]) as usize;
    let end = (8 + desc_len).min(b.len());
    let mut n = 0;
    for d in b[8..end].chunks_exact(16).take(max) {
        let lba = u64::from_be_bytes(d[0..8].try_into().unwrap_or([0; 8]));
        let blocks = u32::from_be_bytes(d[8..12].try_into().unwrap_or([0; 4]));
        f(lba, blocks);
        n += 1;
    }
    n
}

/// A parsed CDB.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    TestUnitReady,
    RequestSense {
        alloc_len: u16,
    },
    Inquiry {
        page: Option<u8>,
        alloc_len: u16,
    },
    ReadCapacity16 {
        alloc_len: u32,
    },
    ReportLuns {
        select: u8,
        alloc_len: u32,
    },
    Read {
        lba: u64,
        blocks: u32,
        fua: bool,
    },
    Write {
        lba: u64,
        blocks: u32,
        fua: bool,
    },
    SynchronizeCache {
        lba: u64,
        blocks: u32,
    },
    Unmap {
        param_len: u16,
    },
    WriteSame16 {
        lba: u64,
        blocks: u32,
        unmap: bool,
        ndob: bool,
    },
    /// WRITE SAME(10): one block of data-out, no NDOB.
    WriteSame10 {
        lba: u64,
        blocks: u32,
        unmap: bool,
    },
    ReadCapacity10,
    /// MODE SENSE(6) (`long: false`) or (10).
    ModeSense {
        long: bool,
        /// Disable block descriptors.
        dbd: bool,
        /// Page control: 0 current, 1 changeable, 2 default, 3 saved.
        pc: u8,
        page: u8,
        subpage: u8,
        alloc_len: u16,
    },
    StartStopUnit {
        start: bool,
        load_eject: bool,
    },
    /// VERIFY(10/16): `bytchk` 0 checks the medium only, 1 compares with
    /// data-out, 3 compares every block with one block of data-out.
    Verify {
        lba: u64,
        blocks: u32,
        bytchk: u8,
    },
    /// WRITE AND VERIFY(10/16): a write whose data is then verified.
    WriteAndVerify {
        lba: u64,
        blocks: u32,
    },
    /// REPORT SUPPORTED OPERATION CODES (SPC-4 §6.35).
    ReportSupportedOpcodes {
        /// Return command timeouts descriptors.
        rctd: bool,
        /// Reporting options: 0 all commands, 1-3 one command.
        options: u8,
        opcode: u8,
        service_action: u16,
        alloc_len: u32,
    },
    /// MODE SELECT(6) (`long: false`) or (10).
    ModeSelect {
        long: bool,
        /// Page format (PF).
        pf: bool,
        /// Save pages (SP).
        sp: bool,
        param_len: u16,
    },
    /// READ DEFECT DATA(10) (`long: false`) or (12).
    ReadDefectData {
        long: bool,
        /// Byte of REQ_PLIST, REQ_GLIST and the defect list format.
        lists: u8,
        alloc_len: u32,
    },
    /// EXTENDED COPY (service action 0: LID1).
    ExtendedCopy {
        service_action: u8,
        param_len: u32,
    },
    /// RECEIVE COPY RESULTS (LID1 service actions).
    ReceiveCopyResults {
        service_action: u8,
        list_id: u8,
        alloc_len: u32,
    },
    /// PERSISTENT RESERVE IN (SPC-4 §6.13).
    PersistentReserveIn {
        service_action: u8,
        alloc_len: u16,
    },
    /// PERSISTENT RESERVE OUT (SPC-4 §6.14): a parameter list follows.
    PersistentReserveOut {
        service_action: u8,
        scope: u8,
        pr_type: u8,
        param_len: u32,
    },
    /// RESERVE(6/10) (SPC-2): the whole logical unit, third-party off.
    Reserve,
    /// RELEASE(6/10) (SPC-2).
    Release,
    /// PRE-FETCH(10/16).
    PreFetch {
        lba: u64,
        blocks: u32,
        immed: bool,
    },
    /// ORWRITE(16): data-out ORed into the blocks.
    OrWrite {
        lba: u64,
        blocks: u32,
    },
    /// COMPARE AND WRITE: `blocks` of compare data, then as many to write.
    CompareAndWrite {
        lba: u64,
        blocks: u8,
    },
    /// GET LBA STATUS (SBC-3 §5.6).
    GetLbaStatus {
        lba: u64,
        alloc_len: u32,
    },
}

/// Why a CDB was refused; a target answers ILLEGAL REQUEST.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CdbError {
    #[error("empty CDB")]
    Empty,
    #[error("CDB of {got} bytes, opcode {opcode:#04x} needs {need}")]
    Short { opcode: u8, got: usize, need: usize },
    #[error("unsupported opcode {0:#04x}")]
    UnsupportedOpcode(u8),
    #[error("invalid field in CDB byte {0}")]
    InvalidField(u8),
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn be64(b: &[u8], at: usize) -> u64 {
    (be32(b, at) as u64) << 32 | be32(b, at + 4) as u64
}

impl Command {
    /// Parses a CDB; never panics on any input.
    pub fn parse(b: &[u8]) -> Result<Command, CdbError> {
        let opcode = *b.first().ok_or(CdbError::Empty)?;
        let need = match opcode {
            0x00..=0x1f => 6,
            0x20..=0x5f => 10,
            0x80..=0x9f => 16,
            0xa0..=0xbf => 12,
            _ => return Err(CdbError::UnsupportedOpcode(opcode)),
        };
        if b.len() < need {
            return Err(CdbError::Short {
                opcode,
                got: b.len(),
                need,
            });
        }
        match need {
            6 => parse_6(b),
            10 => parse_10(b),
            16 => parse_16(b),
            _ => parse_12(b),
        }
    }

    /// Bytes of data-in the command asks for (or data-out it carries), given
    /// the block size; used by a target to check buffer sizes.
    pub fn transfer_len(&self, block_size: u32) -> u64 {
        let bs = block_size as u64;
        match *self {
            Command::Read { blocks, .. } | Command::Write { blocks, .. } => blocks as u64 * bs,
            Command::WriteSame16 { ndob: false, .. } | Command::WriteSame10 { .. } => bs,
            Command::WriteAndVerify { blocks, .. }
            | Command::Verify {
                blocks, bytchk: 1, ..
            } => blocks as u64 * bs,
            Command::Verify { bytchk: 3, .. } => bs,
            Command::ModeSense { alloc_len, .. } => alloc_len as u64,
            Command::ReadCapacity10 => 8,
            Command::Unmap { param_len } => param_len as u64,
            Command::Inquiry { alloc_len, .. } | Command::RequestSense { alloc_len } => {
                alloc_len as u64
            }
            Command::ReadCapacity16 { alloc_len }
            | Command::ReportLuns { alloc_len, .. }
            | Command::GetLbaStatus { alloc_len, .. } => alloc_len as u64,
            Command::PersistentReserveIn { alloc_len, .. } => alloc_len as u64,
            Command::PersistentReserveOut { param_len, .. } => param_len as u64,
            Command::OrWrite { blocks, .. } => blocks as u64 * bs,
            Command::ModeSelect { param_len, .. } => param_len as u64,
            Command::ReadDefectData { alloc_len, .. }
            | Command::ReceiveCopyResults { alloc_len, .. } => alloc_len as u64,
            Command::ExtendedCopy { param_len, .. } => param_len as u64,
            Command::CompareAndWrite { blocks, .. } => 2 * blocks as u64 * bs,
            _ => 0,
        }
    }
}

fn fua_bit(b: &[u8]) -> bool {
    b[1] & 0x08 != 0
}

/// 6-byte CDBs (`b.len() >= 6`).
fn parse_6(b: &[u8]) -> Result<Command, CdbError> {
    // READ(6)/WRITE(6): 21-bit LBA, and a length of 0 means 256 blocks.
    let lba6 = || ((b[1] as u64 & 0x1f) << 16) | be16(b, 2) as u64;
    let len6 = || if b[4] == 0 { 256 } else { b[4] as u32 };
    Ok(match b[0] {
        op::TEST_UNIT_READY => Command::TestUnitReady,
        op::REQUEST_SENSE => Command::RequestSense {
            alloc_len: b[4] as u16,
        },
        op::INQUIRY => {
            let evpd = b[1] & 0x01 != 0;
            if !evpd && b[2] != 0 {
                return Err(CdbError::InvalidField(2));
            }
            Command::Inquiry {
                page: evpd.then_some(b[2]),
                alloc_len: be16(b, 3),
            }
        }
        op::READ_6 => Command::Read {
            lba: lba6(),
            blocks: len6(),
            fua: false,
        },
        op::WRITE_6 => Command::Write {
            lba: lba6(),
            blocks: len6(),
            fua: false,
        },
        op::MODE_SENSE_6 => Command::ModeSense {
            long: false,
            dbd: b[1] & 0x08 != 0,
            pc: b[2] >> 6,
            page: b[2] & 0x3f,
            subpage: b[3],
            alloc_len: b[4] as u16,
        },
        op::MODE_SELECT_6 => Command::ModeSelect {
            long: false,
            pf: b[1] & 0x10 != 0,
            sp: b[1] & 0x01 != 0,
            param_len: b[4] as u16,
        },
        op::RESERVE_6 => Command::Reserve,
        op::RELEASE_6 => Command::Release,
        op::START_STOP_UNIT => Command::StartStopUnit {
            start: b[4] & 0x01 != 0,
            load_eject: b[4] & 0x02 != 0,
        },
        o => return Err(CdbError::UnsupportedOpcode(o)),
    })
}

/// 10-byte CDBs (`b.len() >= 10`).
fn parse_10(b: &[u8]) -> Result<Command, CdbError> {
    let (lba, blocks) = (be32(b, 2) as u64, be16(b, 7) as u32);
    Ok(match b[0] {
        op::READ_CAPACITY_10 => Command::ReadCapacity10,
        op::READ_10 => Command::Read {
            lba,
            blocks,
            fua: fua_bit(b),
        },
        op::WRITE_10 => Command::Write {
            lba,
            blocks,
            fua: fua_bit(b),
        },
        op::WRITE_AND_VERIFY_10 => Command::WriteAndVerify { lba, blocks },
        op::VERIFY_10 => verify(b, lba, blocks)?,
        op::SYNCHRONIZE_CACHE_10 => Command::SynchronizeCache { lba, blocks },
        op::PRE_FETCH_10 => Command::PreFetch {
            lba,
            blocks,
            immed: b[1] & 0x02 != 0,
        },
        op::MODE_SELECT_10 => Command::ModeSelect {
            long: true,
            pf: b[1] & 0x10 != 0,
            sp: b[1] & 0x01 != 0,
            param_len: be16(b, 7),
        },
        op::READ_DEFECT_DATA_10 => Command::ReadDefectData {
            long: false,
            lists: b[2] & 0x1f,
            alloc_len: be16(b, 7) as u32,
        },
        op::RESERVE_10 => Command::Reserve,
        op::RELEASE_10 => Command::Release,
        op::PERSISTENT_RESERVE_IN => Command::PersistentReserveIn {
            service_action: b[1] & 0x1f,
            alloc_len: be16(b, 7),
        },
        op::PERSISTENT_RESERVE_OUT => Command::PersistentReserveOut {
            service_action: b[1] & 0x1f,
            scope: b[2] >> 4,
            pr_type: b[2] & 0x0f,
            param_len: be32(b, 5),
        },
        op::WRITE_SAME_10 => Command::WriteSame10 {
            lba,
            blocks,
            unmap: b[1] & 0x08 != 0,
        },
        op::UNMAP => Command::Unmap {
            param_len: be16(b, 7),
        },
        op::MODE_SENSE_10 => Command::ModeSense {
            long: true,
            dbd: b[1] & 0x08 != 0,
            pc: b[2] >> 6,
            page: b[2] & 0x3f,
            subpage: b[3],
            alloc_len: be16(b, 7),
        },
        o => return Err(CdbError::UnsupportedOpcode(o)),
    })
}

/// 16-byte CDBs (`b.len() >= 16`).
fn parse_16(b: &[u8]) -> Result<Command, CdbError> {
    let (lba, blocks) = (be64(b, 2), be32(b, 10));
    Ok(match b[0] {
        op::SERVICE_ACTION_IN_16 if b[1] & 0x1f == op::SA_READ_CAPACITY_16 => {
            Command::ReadCapacity16 {
                alloc_len: be32(b, 10),
            }
        }
        op::SERVICE_ACTION_IN_16 if b[1] & 0x1f == op::SA_GET_LBA_STATUS => Command::GetLbaStatus {
            lba,
            alloc_len: be32(b, 10),
        },
        op::SERVICE_ACTION_IN_16 => return Err(CdbError::InvalidField(1)),
        op::PRE_FETCH_16 => Command::PreFetch {
            lba,
            blocks,
            immed: b[1] & 0x02 != 0,
        },
        op::ORWRITE_16 => Command::OrWrite { lba, blocks },
        op::EXTENDED_COPY => Command::ExtendedCopy {
            service_action: b[1] & 0x1f,
            param_len: be32(b, 10),
        },
        op::RECEIVE_COPY_RESULTS => Command::ReceiveCopyResults {
            service_action: b[1] & 0x1f,
            list_id: b[2],
            alloc_len: be32(b, 10),
        },
        op::COMPARE_AND_WRITE => Command::CompareAndWrite { lba, blocks: b[13] },
        op::READ_16 => Command::Read {
            lba,
            blocks,
            fua: fua_bit(b),
        },
        op::WRITE_16 => Command::Write {
            lba,
            blocks,
            fua: fua_bit(b),
        },
        op::WRITE_AND_VERIFY_16 => Command::WriteAndVerify { lba, blocks },
        op::VERIFY_16 => verify(b, lba, blocks)?,
        op::SYNCHRONIZE_CACHE_16 => Command::SynchronizeCache { lba, blocks },
        op::WRITE_SAME_16 => Command::WriteSame16 {
            lba,
            blocks,
            unmap: b[1] & 0x08 != 0,
            ndob: b[1] & 0x01 != 0,
        },
        o => return Err(CdbError::UnsupportedOpcode(o)),
    })
}

/// 12-byte CDBs (`b.len() >= 12`).
fn parse_12(b: &[u8]) -> Result<Command, CdbError> {
    let (lba, blocks) = (be32(b, 2) as u64, be32(b, 6));
    Ok(match b[0] {
        op::REPORT_LUNS => Command::ReportLuns {
            select: b[2],
            alloc_len: be32(b, 6),
        },
        op::MAINTENANCE_IN if b[1] & 0x1f == op::SA_REPORT_SUPPORTED_OPCODES => {
            Command::ReportSupportedOpcodes {
                rctd: b[2] & 0x80 != 0,
                options: b[2] & 0x07,
                opcode: b[3],
                service_action: be16(b, 4),
                alloc_len: be32(b, 6),
            }
        }
        op::MAINTENANCE_IN => return Err(CdbError::InvalidField(1)),
        op::READ_DEFECT_DATA_12 => Command::ReadDefectData {
            long: true,
            lists: b[1] & 0x1f,
            alloc_len: be32(b, 6),
        },
        op::READ_12 => Command::Read {
            lba,
            blocks,
            fua: fua_bit(b),
        },
        op::WRITE_12 => Command::Write {
            lba,
            blocks,
            fua: fua_bit(b),
        },
        op::WRITE_AND_VERIFY_12 => Command::WriteAndVerify { lba, blocks },
        op::VERIFY_12 => verify(b, lba, blocks)?,
        o => return Err(CdbError::UnsupportedOpcode(o)),
    })
}

fn verify(b: &[u8], lba: u64, blocks: u32) -> Result<Command, CdbError> {
    let bytchk = (b[1] >> 1) & 0x03;
    if bytchk == 2 {
        return Err(CdbError::InvalidField(1));
    }
    Ok(Command::Verify {
        lba,
        blocks,
        bytchk,
    })
}

#[cfg(test)]
mod tests;
