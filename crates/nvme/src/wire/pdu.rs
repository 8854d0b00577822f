//! NVMe/TCP PDUs: the 8-byte common header, the PDU-specific headers, header
//! and data digests (CRC32C), and the checks that turn a peer's common header
//! into a [`PduLayout`] the receiver can trust.
//!
//! Every length the peer sends (HLEN, PDO, PLEN) is checked against the PDU
//! type, the negotiated digests and our limits *before* anything is read or
//! allocated for it; a failure says which fatal error (FES) and which byte
//! (FEI) to report in the termination request.

use super::sqe::{Cqe, Sqe, CQE_LEN, SQE_LEN};
use super::{le16, le32, put16, put32};

/// Common header length.
pub const CH_LEN: usize = 8;
/// Digest length (header or data).
pub const DIGEST_LEN: usize = 4;
pub const IC_LEN: usize = 128;
pub const CAPSULE_CMD_HLEN: usize = CH_LEN + SQE_LEN;
pub const CAPSULE_RESP_HLEN: usize = CH_LEN + CQE_LEN;
/// H2CData, C2HData, R2T and the termination requests share this length.
pub const DATA_HLEN: usize = 24;
pub const TERM_HLEN: usize = 24;
/// Largest header with its digest (ICReq/ICResp carry none).
pub const MAX_HDR_LEN: usize = IC_LEN;
/// Most bytes of the offending PDU a termination request carries.
pub const MAX_TERM_DATA: usize = 128;
/// The smallest PDU of any type: reading this many bytes never reaches past
/// the header of the next PDU into its data.
pub const MIN_PDU_LEN: usize = 24;
/// Largest PDU data alignment (HPDA in ICReq, CPDA in ICResp): 0's based,
/// in dwords, so 31 asks for 128-byte alignment; 32..=255 are reserved.
pub const MAX_PDA: u8 = 31;
/// Room for any header with its digest and the padding up to its data
/// under any alignment: a buffer of this size takes every `encode_*`
/// output up to the data.
pub const MAX_PADDED_HDR: usize = CAPSULE_CMD_HLEN + DIGEST_LEN + 4 * (MAX_PDA as usize + 1);

const _: () = assert!(CAPSULE_CMD_HLEN == 72);
const _: () = assert!(CAPSULE_RESP_HLEN == 24);
const _: () = assert!(MIN_PDU_LEN <= DATA_HLEN && MIN_PDU_LEN <= CAPSULE_RESP_HLEN);
// A padded data offset must fit the 8-bit PDO field.
const _: () = assert!(MAX_PADDED_HDR <= u8::MAX as usize);

/// Bytes of alignment a PDA value (HPDA or CPDA) asks for: `(pda + 1) * 4`.
pub fn pda_bytes(pda: u8) -> usize {
    debug_assert!(pda <= MAX_PDA, "PDA {pda} is reserved");
    (usize::from(pda.min(MAX_PDA)) + 1) * 4
}

/// Data offset (PDO) of a data-carrying PDU whose header with digest is
/// `header_total` bytes, under alignment `pda`: the header rounded up.
/// With `pda == 0` this is `header_total` itself (every header length is
/// a multiple of 4), so the common case has no padding.
pub fn data_pdo(header_total: usize, pda: u8) -> usize {
    let pdo = header_total.next_multiple_of(pda_bytes(pda));
    debug_assert!(pdo >= header_total && pdo <= MAX_PADDED_HDR);
    pdo
}

/// PDU types.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum PduType {
    IcReq = 0x00,
    IcResp = 0x01,
    H2CTermReq = 0x02,
    C2HTermReq = 0x03,
    CapsuleCmd = 0x04,
    CapsuleResp = 0x05,
    H2CData = 0x06,
    C2HData = 0x07,
    R2T = 0x09,
}

impl PduType {
    pub fn from_u8(v: u8) -> Option<PduType> {
        Some(match v {
            0x00 => PduType::IcReq,
            0x01 => PduType::IcResp,
            0x02 => PduType::H2CTermReq,
            0x03 => PduType::C2HTermReq,
            0x04 => PduType::CapsuleCmd,
            0x05 => PduType::CapsuleResp,
            0x06 => PduType::H2CData,
            0x07 => PduType::C2HData,
            0x09 => PduType::R2T,
            _ => return None,
        })
    }

    /// The fixed header length of this type.
    pub fn hlen(self) -> usize {
        match self {
            PduType::IcReq | PduType::IcResp => IC_LEN,
            PduType::CapsuleCmd => CAPSULE_CMD_HLEN,
            PduType::CapsuleResp => CAPSULE_RESP_HLEN,
            PduType::H2CTermReq | PduType::C2HTermReq => TERM_HLEN,
            PduType::H2CData | PduType::C2HData | PduType::R2T => DATA_HLEN,
        }
    }

    /// Whether the host sends this type (else the controller does).
    pub fn from_host(self) -> bool {
        matches!(
            self,
            PduType::IcReq | PduType::H2CTermReq | PduType::CapsuleCmd | PduType::H2CData
        )
    }

    /// Whether digests may apply (the IC and termination PDUs never have them).
    fn digestible(self) -> bool {
        !matches!(
            self,
            PduType::IcReq | PduType::IcResp | PduType::H2CTermReq | PduType::C2HTermReq
        )
    }

    /// Whether the PDU may carry data.
    fn may_have_data(self) -> bool {
        matches!(
            self,
            PduType::CapsuleCmd
                | PduType::H2CData
                | PduType::C2HData
                | PduType::H2CTermReq
                | PduType::C2HTermReq
        )
    }
}

/// Common header flags.
pub mod flags {
    pub const HDGSTF: u8 = 0x01;
    pub const DDGSTF: u8 = 0x02;
    /// H2CData/C2HData: last PDU of the transfer.
    pub const LAST_PDU: u8 = 0x04;
    /// C2HData: the command completed successfully, no CapsuleResp follows.
    pub const SUCCESS: u8 = 0x08;
}

/// Fatal error status of a termination request.
pub mod fes {
    pub const INVALID_HEADER_FIELD: u16 = 0x01;
    pub const PDU_SEQUENCE_ERROR: u16 = 0x02;
    pub const HEADER_DIGEST_ERROR: u16 = 0x03;
    pub const DATA_OUT_OF_RANGE: u16 = 0x04;
    pub const DATA_LIMIT_EXCEEDED: u16 = 0x05;
    pub const UNSUPPORTED_PARAMETER: u16 = 0x06;
}

/// Offsets of common header fields (for FEI).
pub mod ch_off {
    pub const PDU_TYPE: u32 = 0;
    pub const FLAGS: u32 = 1;
    pub const HLEN: u32 = 2;
    pub const PDO: u32 = 3;
    pub const PLEN: u32 = 4;
}

/// A fatal transport error: what to put in the termination request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("fatal NVMe/TCP error: fes={fes:#x} fei={fei}")]
pub struct Fatal {
    pub fes: u16,
    pub fei: u32,
}

impl Fatal {
    pub fn header(fei: u32) -> Fatal {
        Fatal {
            fes: fes::INVALID_HEADER_FIELD,
            fei,
        }
    }
}

/// The 8-byte common header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommonHeader {
    pub pdu_type: u8,
    pub flags: u8,
    pub hlen: u8,
    pub pdo: u8,
    pub plen: u32,
}

impl CommonHeader {
    pub fn decode(b: &[u8]) -> Option<CommonHeader> {
        let b = b.get(..CH_LEN)?;
        Some(CommonHeader {
            pdu_type: b[0],
            flags: b[1],
            hlen: b[2],
            pdo: b[3],
            plen: le32(b, 4),
        })
    }

    pub fn encode(&self, out: &mut [u8]) {
        out[0] = self.pdu_type;
        out[1] = self.flags;
        out[2] = self.hlen;
        out[3] = self.pdo;
        put32(out, 4, self.plen);
    }
}

/// Digests negotiated on a connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Digests {
    pub header: bool,
    pub data: bool,
}

impl Digests {
    pub fn hdgst_len(&self) -> usize {
        if self.header {
            DIGEST_LEN
        } else {
            0
        }
    }
    pub fn ddgst_len(&self) -> usize {
        if self.data {
            DIGEST_LEN
        } else {
            0
        }
    }
    fn to_byte(self) -> u8 {
        self.header as u8 | (self.data as u8) << 1
    }
    fn from_byte(b: u8) -> Digests {
        Digests {
            header: b & 1 != 0,
            data: b & 2 != 0,
        }
    }
}

/// Limits the receiver enforces on data PDUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecvLimits {
    /// Most in-capsule data in a CapsuleCmd.
    pub max_incapsule: u32,
    /// Most data in one H2CData/C2HData PDU.
    pub max_data_pdu: u32,
}

/// A checked PDU shape: where its header, digest and data sit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PduLayout {
    pub ty: PduType,
    pub flags: u8,
    /// Header length (without the digest).
    pub hlen: usize,
    /// Header length plus header digest.
    pub header_total: usize,
    /// Offset of the data from the start of the PDU (0 when no data).
    pub pdo: usize,
    pub data_len: usize,
    /// Whether a data digest follows the data.
    pub ddgst: bool,
    pub plen: usize,
}

impl PduLayout {
    /// Padding between the header (with digest) and the data.
    pub fn pad(&self) -> usize {
        if self.data_len == 0 {
            0
        } else {
            self.pdo - self.header_total
        }
    }
}

/// Checks a common header received by `host_side == false` (the target) or
/// `true` (the initiator), after ICReq/ICResp with `dg` negotiated.
pub fn check_header(
    ch: &CommonHeader,
    dg: Digests,
    host_side: bool,
    lim: &RecvLimits,
) -> Result<PduLayout, Fatal> {
    let ty = PduType::from_u8(ch.pdu_type).ok_or(Fatal::header(ch_off::PDU_TYPE))?;
    if ty.from_host() == host_side || matches!(ty, PduType::IcReq | PduType::IcResp) {
        // A PDU the peer may not send, or a second initialization.
        return Err(Fatal {
            fes: fes::PDU_SEQUENCE_ERROR,
            fei: ch_off::PDU_TYPE,
        });
    }
    let hlen = ty.hlen();
    if ch.hlen as usize != hlen {
        return Err(Fatal::header(ch_off::HLEN));
    }
    let hdgst = ty.digestible() && dg.header;
    if (ch.flags & flags::HDGSTF != 0) != hdgst {
        return Err(Fatal::header(ch_off::FLAGS));
    }
    let header_total = hlen + if hdgst { DIGEST_LEN } else { 0 };
    let plen = ch.plen as usize;
    if plen < header_total {
        return Err(Fatal::header(ch_off::PLEN));
    }
    let has_data = plen > header_total;
    let ddgst = has_data && ty.digestible() && dg.data;
    if (ch.flags & flags::DDGSTF != 0) != ddgst {
        return Err(Fatal::header(ch_off::FLAGS));
    }
    if !has_data {
        if ch.pdo != 0 && ch.pdo as usize != header_total {
            return Err(Fatal::header(ch_off::PDO));
        }
        return Ok(PduLayout {
            ty,
            flags: ch.flags,
            hlen,
            header_total,
            pdo: 0,
            data_len: 0,
            ddgst: false,
            plen,
        });
    }
    let (pdo, data_len) = data_layout(ty, ch, header_total, ddgst, lim)?;
    Ok(PduLayout {
        ty,
        flags: ch.flags,
        hlen,
        header_total,
        pdo,
        data_len,
        ddgst,
        plen,
    })
}

/// Where the data of a PDU that carries some starts, and how long it is,
/// checked against the PDU's length and the receiver's limits.
#[inline]
fn data_layout(
    ty: PduType,
    ch: &CommonHeader,
    header_total: usize,
    ddgst: bool,
    lim: &RecvLimits,
) -> Result<(usize, usize), Fatal> {
    if !ty.may_have_data() {
        return Err(Fatal::header(ch_off::PLEN));
    }
    let plen = ch.plen as usize;
    let pdo = if ty.digestible() {
        ch.pdo as usize
    } else {
        // Termination data directly follows the header.
        header_total
    };
    // The data starts after the header and leaves room for its digest;
    // padding is bounded by the 8-bit PDO itself.
    let trailer = if ddgst { DIGEST_LEN } else { 0 };
    if pdo < header_total || pdo + trailer >= plen {
        return Err(Fatal::header(ch_off::PDO));
    }
    let data_len = plen - pdo - trailer;
    let max = match ty {
        PduType::CapsuleCmd => lim.max_incapsule as usize,
        PduType::H2CData | PduType::C2HData => lim.max_data_pdu as usize,
        _ => MAX_TERM_DATA,
    };
    if data_len > max {
        return Err(Fatal {
            fes: fes::DATA_LIMIT_EXCEEDED,
            fei: ch_off::PLEN,
        });
    }
    Ok((pdo, data_len))
}

/// CRC32C as NVMe/TCP uses it for header and data digests.
pub fn crc(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
}

/// Continues a CRC32C over more data (data digests over several segments).
pub fn crc_append(crc: u32, data: &[u8]) -> u32 {
    crc32c::crc32c_append(crc, data)
}

/// Checks the header digest that follows `hdr[..hlen]`.
pub fn header_digest_ok(hdr: &[u8], hlen: usize) -> bool {
    match hdr.get(hlen..hlen + DIGEST_LEN) {
        Some(d) => crc(&hdr[..hlen]) == le32(d, 0),
        None => false,
    }
}

/// ICReq.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IcReq {
    pub pfv: u16,
    pub hpda: u8,
    pub digests: Digests,
    /// Maximum outstanding R2Ts per command, 0's based.
    pub maxr2t: u32,
}

impl IcReq {
    pub fn decode(b: &[u8]) -> Result<IcReq, Fatal> {
        let ch = CommonHeader::decode(b).ok_or(Fatal::header(ch_off::PLEN))?;
        if ch.pdu_type != PduType::IcReq as u8 {
            return Err(Fatal {
                fes: fes::PDU_SEQUENCE_ERROR,
                fei: ch_off::PDU_TYPE,
            });
        }
        if ch.hlen as usize != IC_LEN {
            return Err(Fatal::header(ch_off::HLEN));
        }
        if ch.plen as usize != IC_LEN {
            return Err(Fatal::header(ch_off::PLEN));
        }
        let b = b.get(..IC_LEN).ok_or(Fatal::header(ch_off::PLEN))?;
        let r = IcReq {
            pfv: le16(b, 8),
            hpda: b[10],
            digests: Digests::from_byte(b[11]),
            maxr2t: le32(b, 12),
        };
        if r.pfv != 0 {
            return Err(Fatal {
                fes: fes::UNSUPPORTED_PARAMETER,
                fei: 8,
            });
        }
        // HPDA 32..=255 are reserved values, not an unsupported choice:
        // an invalid header field, at HPDA's offset (as SPDK reports it).
        if r.hpda > MAX_PDA {
            return Err(Fatal::header(10));
        }
        Ok(r)
    }

    pub fn encode(&self) -> [u8; IC_LEN] {
        let mut b = [0u8; IC_LEN];
        ic_header(&mut b, PduType::IcReq);
        put16(&mut b, 8, self.pfv);
        b[10] = self.hpda;
        b[11] = self.digests.to_byte();
        put32(&mut b, 12, self.maxr2t);
        b
    }
}

fn ic_header(b: &mut [u8], ty: PduType) {
    CommonHeader {
        pdu_type: ty as u8,
        flags: 0,
        hlen: IC_LEN as u8,
        pdo: 0,
        plen: IC_LEN as u32,
    }
    .encode(b);
}

/// ICResp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IcResp {
    pub pfv: u16,
    pub cpda: u8,
    pub digests: Digests,
    /// Most data bytes in one H2CData PDU.
    pub maxh2cdata: u32,
}

impl IcResp {
    pub fn decode(b: &[u8]) -> Result<IcResp, Fatal> {
        let ch = CommonHeader::decode(b).ok_or(Fatal::header(ch_off::PLEN))?;
        if ch.pdu_type != PduType::IcResp as u8 {
            return Err(Fatal {
                fes: fes::PDU_SEQUENCE_ERROR,
                fei: ch_off::PDU_TYPE,
            });
        }
        if ch.hlen as usize != IC_LEN || ch.plen as usize != IC_LEN {
            return Err(Fatal::header(ch_off::HLEN));
        }
        let b = b.get(..IC_LEN).ok_or(Fatal::header(ch_off::PLEN))?;
        let r = IcResp {
            pfv: le16(b, 8),
            cpda: b[10],
            digests: Digests::from_byte(b[11]),
            maxh2cdata: le32(b, 12),
        };
        if r.cpda > MAX_PDA {
            return Err(Fatal::header(10));
        }
        if r.maxh2cdata < 4096 || r.maxh2cdata % 4 != 0 {
            return Err(Fatal {
                fes: fes::UNSUPPORTED_PARAMETER,
                fei: 12,
            });
        }
        Ok(r)
    }

    pub fn encode(&self) -> [u8; IC_LEN] {
        let mut b = [0u8; IC_LEN];
        ic_header(&mut b, PduType::IcResp);
        put16(&mut b, 8, self.pfv);
        b[10] = self.cpda;
        b[11] = self.digests.to_byte();
        put32(&mut b, 12, self.maxh2cdata);
        b
    }
}

/// Fields of H2CData, C2HData and R2T (one layout; `ttag` is reserved in
/// C2HData).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DataHdr {
    pub cccid: u16,
    pub ttag: u16,
    /// Offset of this PDU's data in the command's data (R2TO for R2T).
    pub offset: u32,
    /// Data length (R2TL for R2T).
    pub length: u32,
}

impl DataHdr {
    pub fn decode(hdr: &[u8]) -> Option<DataHdr> {
        let b = hdr.get(..DATA_HLEN)?;
        Some(DataHdr {
            cccid: le16(b, 8),
            ttag: le16(b, 10),
            offset: le32(b, 12),
            length: le32(b, 16),
        })
    }
}

/// A termination request's fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TermReq {
    pub fes: u16,
    pub fei: u32,
}

impl TermReq {
    pub fn decode(hdr: &[u8]) -> Option<TermReq> {
        let b = hdr.get(..TERM_HLEN)?;
        Some(TermReq {
            fes: le16(b, 8),
            fei: le32(b, 10),
        })
    }
}

/// The shape of a PDU being encoded.
struct Shape {
    ty: PduType,
    flags: u8,
    hdgst: bool,
    data_len: usize,
    ddgst: bool,
    /// Data alignment the receiver asked for (its HPDA or CPDA).
    pda: u8,
}

/// Writes a common header, the header digest if `hdgst`, and zero padding
/// up to the data offset; returns where the data starts (PDO), or the
/// header length with digest when there is no data.
fn finish(out: &mut [u8], s: Shape) -> usize {
    let Shape {
        ty,
        flags: fl,
        hdgst,
        data_len,
        ddgst,
        pda,
    } = s;
    let hlen = ty.hlen();
    let total = hlen + if hdgst { DIGEST_LEN } else { 0 };
    let has_data = data_len > 0;
    let ddgst = ddgst && has_data;
    let pdo = if has_data { data_pdo(total, pda) } else { 0 };
    let mut f = fl;
    if hdgst {
        f |= flags::HDGSTF;
    }
    if ddgst {
        f |= flags::DDGSTF;
    }
    let plen = total.max(pdo) + data_len + if ddgst { DIGEST_LEN } else { 0 };
    CommonHeader {
        pdu_type: ty as u8,
        flags: f,
        hlen: hlen as u8,
        pdo: pdo as u8,
        plen: plen as u32,
    }
    .encode(out);
    if hdgst {
        let c = crc(&out[..hlen]);
        put32(out, hlen, c);
    }
    if pdo > total {
        // Padding is zero (and covered by no digest).
        out[total..pdo].fill(0);
    }
    total.max(pdo)
}

/// Encodes a CapsuleResp; returns its length.
pub fn encode_capsule_resp(out: &mut [u8], cqe: &Cqe, dg: Digests) -> usize {
    cqe.encode(&mut out[CH_LEN..CH_LEN + CQE_LEN]);
    let s = Shape {
        ty: PduType::CapsuleResp,
        flags: 0,
        hdgst: dg.header,
        data_len: 0,
        ddgst: false,
        pda: 0,
    };
    finish(out, s)
}

/// Encodes a CapsuleCmd header with `data_len` bytes of in-capsule data to
/// follow (the caller sends the data and its digest), unpadded.
pub fn encode_capsule_cmd(out: &mut [u8], sqe: &Sqe, dg: Digests, data_len: usize) -> usize {
    encode_capsule_cmd_pda(out, sqe, dg, data_len, 0)
}

/// [`encode_capsule_cmd`] for a controller that asked for data alignment
/// `cpda`: returns the PDO, with the padding before it zeroed in `out`.
pub fn encode_capsule_cmd_pda(
    out: &mut [u8],
    sqe: &Sqe,
    dg: Digests,
    data_len: usize,
    cpda: u8,
) -> usize {
    out[CH_LEN..CH_LEN + SQE_LEN].copy_from_slice(&sqe.0);
    let s = Shape {
        ty: PduType::CapsuleCmd,
        flags: 0,
        hdgst: dg.header,
        data_len,
        ddgst: dg.data,
        pda: cpda,
    };
    finish(out, s)
}

/// Encodes an H2CData, C2HData or R2T header; for the data PDUs
/// `h.length` bytes of data follow, unpadded.
pub fn encode_data_hdr(out: &mut [u8], ty: PduType, h: &DataHdr, fl: u8, dg: Digests) -> usize {
    encode_data_hdr_pda(out, ty, h, fl, dg, 0)
}

/// [`encode_data_hdr`] for a receiver that asked for data alignment `pda`
/// (the host's HPDA for C2HData, the controller's CPDA for H2CData):
/// returns the PDO, with the padding before it zeroed in `out`.
pub fn encode_data_hdr_pda(
    out: &mut [u8],
    ty: PduType,
    h: &DataHdr,
    fl: u8,
    dg: Digests,
    pda: u8,
) -> usize {
    out[8..DATA_HLEN].fill(0);
    put16(out, 8, h.cccid);
    if ty != PduType::C2HData {
        put16(out, 10, h.ttag);
    }
    put32(out, 12, h.offset);
    put32(out, 16, h.length);
    let data_len = if ty == PduType::R2T {
        0
    } else {
        h.length as usize
    };
    let s = Shape {
        ty,
        flags: fl,
        hdgst: dg.header,
        data_len,
        ddgst: dg.data,
        pda,
    };
    finish(out, s)
}

/// Encodes a termination request carrying `data` (the offending header,
/// truncated to [`MAX_TERM_DATA`]); returns the full PDU length written.
pub fn encode_term_req(out: &mut [u8], ty: PduType, t: TermReq, data: &[u8]) -> usize {
    let data = &data[..data.len().min(MAX_TERM_DATA)];
    out[8..TERM_HLEN].fill(0);
    put16(out, 8, t.fes);
    put32(out, 10, t.fei);
    // Termination data (the offending header) directly follows the header.
    let s = Shape {
        ty,
        flags: 0,
        hdgst: false,
        data_len: data.len(),
        ddgst: false,
        pda: 0,
    };
    let h = finish(out, s);
    out[h..h + data.len()].copy_from_slice(data);
    h + data.len()
}

#[cfg(test)]
#[path = "pdu_tests.rs"]
mod tests;
