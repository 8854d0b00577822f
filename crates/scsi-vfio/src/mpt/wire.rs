//! MPI 1.5 (LSI Fusion-MPT) register offsets, message functions and the
//! layouts the driver uses: IOCFacts, PortFacts, IOCInit and PortEnable
//! (doorbell handshake), SCSI IO requests with 64-bit simple SGEs (chained
//! beyond the request frame), SCSI IO and task-management replies. Encoded into and decoded from plain
//! little-endian bytes; decoding never panics on any input.

use ustor_scsi::lld::{Nexus, TransportError};
use ustor_scsi::ScsiStatus;

// System interface registers (BAR 1, memory; the same at BAR 0, I/O).
pub const REG_DOORBELL: usize = 0x00;
pub const REG_WRITE_SEQUENCE: usize = 0x04;
pub const REG_DIAGNOSTIC: usize = 0x08;
pub const REG_INT_STATUS: usize = 0x30;
pub const REG_INT_MASK: usize = 0x34;
pub const REG_REQUEST_POST: usize = 0x40;
/// Read: the reply post FIFO; write: the reply free FIFO.
pub const REG_REPLY_FIFO: usize = 0x44;

pub const IOC_STATE_MASK: u32 = 0xf000_0000;
pub const IOC_STATE_RESET: u32 = 0x0000_0000;
pub const IOC_STATE_READY: u32 = 0x1000_0000;
pub const IOC_STATE_OPERATIONAL: u32 = 0x2000_0000;
pub const IOC_STATE_FAULT: u32 = 0x4000_0000;
pub const DOORBELL_ACTIVE: u32 = 0x0800_0000;
pub const DOORBELL_FUNCTION_SHIFT: u32 = 24;
pub const DOORBELL_ADD_DWORDS_SHIFT: u32 = 16;
pub const HIS_DOORBELL: u32 = 0x1;
pub const HIS_IOP_DOORBELL_STATUS: u32 = 0x8000_0000;
/// Interrupt mask: doorbell and reply interrupts off (we poll).
pub const HIM_ALL: u32 = 0x1 | 0x8;
/// Interrupt mask with reply interrupts on (the wake source of a sleeping
/// reactor), doorbell interrupts off.
pub const HIM_DOORBELL: u32 = 0x1;
pub const DIAG_RESET_ADAPTER: u32 = 0x4;
pub const DIAG_WRITE_ENABLE: u32 = 0x80;
/// The key sequence that unlocks the diagnostic register.
pub const WRSEQ_KEYS: [u32; 5] = [0x4, 0xb, 0x2, 0x7, 0xd];
/// Reply post FIFO: empty.
pub const FIFO_EMPTY: u32 = 0xffff_ffff;
/// Reply post FIFO entry: an address reply (else a context-only "turbo"
/// reply: the request's MsgContext, success).
pub const ADDRESS_REPLY: u32 = 0x8000_0000;

pub const F_SCSI_IO: u8 = 0x00;
pub const F_TASK_MGMT: u8 = 0x01;
pub const F_IOC_INIT: u8 = 0x02;
pub const F_IOC_FACTS: u8 = 0x03;
pub const F_PORT_FACTS: u8 = 0x05;
pub const F_PORT_ENABLE: u8 = 0x06;
pub const F_IOC_MESSAGE_UNIT_RESET: u8 = 0x40;
pub const F_HANDSHAKE: u8 = 0x42;

pub const WHOINIT_HOST_DRIVER: u8 = 0x04;
pub const TM_ABORT_TASK: u8 = 0x01;
pub const TM_TARGET_RESET: u8 = 0x03;
pub const TM_LOGICAL_UNIT_RESET: u8 = 0x05;

pub const SCSIIO_HEADER: usize = 48;
pub const SGE64_LEN: usize = 12;
pub const TM_REQ_LEN: usize = 52;
pub const CONTROL_WRITE: u32 = 0x0100_0000;
pub const CONTROL_READ: u32 = 0x0200_0000;

const SGE_LAST: u32 = 0x80;
const SGE_END_OF_BUFFER: u32 = 0x40;
const SGE_SIMPLE: u32 = 0x10;
const SGE_CHAIN: u32 = 0x30;
const SGE_HOST_TO_IOC: u32 = 0x04;
const SGE_64BIT: u32 = 0x02;
const SGE_END_OF_LIST: u32 = 0x01;
const SGE_FLAGS_SHIFT: u32 = 24;
/// The SGE length field is 24 bits.
pub const SGE_MAX_LEN: usize = 0x00ff_ffff;

// SCSIState bits and IOCStatus codes of a SCSI IO reply.
pub const STATE_AUTOSENSE_VALID: u8 = 0x01;
pub const STATE_NO_SCSI_STATUS: u8 = 0x04;
pub const STATE_TERMINATED: u8 = 0x08;
pub const IOCSTATUS_MASK: u16 = 0x7fff;
pub const IOCSTATUS_SUCCESS: u16 = 0x00;
pub const IOCSTATUS_BUSY: u16 = 0x02;
pub const IOCSTATUS_INSUFFICIENT_RESOURCES: u16 = 0x06;
pub const IOCSTATUS_INVALID_BUS: u16 = 0x41;
pub const IOCSTATUS_INVALID_TARGETID: u16 = 0x42;
pub const IOCSTATUS_DEVICE_NOT_THERE: u16 = 0x43;
pub const IOCSTATUS_DATA_OVERRUN: u16 = 0x44;
pub const IOCSTATUS_DATA_UNDERRUN: u16 = 0x45;
pub const IOCSTATUS_TASK_TERMINATED: u16 = 0x48;
pub const IOCSTATUS_RESIDUAL_MISMATCH: u16 = 0x49;
pub const IOCSTATUS_IOC_TERMINATED: u16 = 0x4b;
pub const IOCSTATUS_EXT_TERMINATED: u16 = 0x4c;
/// Task management response codes.
pub const TM_RSP_COMPLETE: u8 = 0x00;
pub const TM_RSP_SUCCEEDED: u8 = 0x08;

pub(crate) fn le16(b: &[u8], off: usize) -> u16 {
    b.get(off..off + 2)
        .map_or(0, |s| u16::from_le_bytes([s[0], s[1]]))
}

pub(crate) fn le32(b: &[u8], off: usize) -> u32 {
    b.get(off..off + 4)
        .map_or(0, |s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

pub(crate) fn put32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}

/// A request header for the doorbell handshake: function, context.
pub fn simple_request(function: u8, port: u8, context: u32) -> [u8; 12] {
    let mut b = [0u8; 12];
    b[3] = function;
    b[6] = port;
    put32(&mut b, 8, context);
    b
}

/// `MSG_IOC_INIT`: host driver, 64-bit-capable frames all below 4 GiB
/// (both high-address words 0), reply frames of `reply_size` bytes.
pub fn ioc_init(max_devices: u8, reply_size: u16, context: u32) -> [u8; 44] {
    let mut b = [0u8; 44];
    b[0] = WHOINIT_HOST_DRIVER;
    b[3] = F_IOC_INIT;
    b[5] = max_devices;
    b[6] = 1; // MaxBuses
    put32(&mut b, 8, context);
    b[12..14].copy_from_slice(&reply_size.to_le_bytes());
    b[40..42].copy_from_slice(&0x0105u16.to_le_bytes()); // MsgVersion 1.5
    b
}

/// What the driver takes from IOCFacts and PortFacts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Facts {
    pub msg_version: u16,
    pub reply_queue_depth: u16,
    /// Bytes (the reply gives 32-bit words).
    pub request_frame_bytes: usize,
    pub global_credits: u16,
    /// Chain elements one request may hold.
    pub max_chain_depth: u8,
    pub ports: u8,
    pub max_devices: u8,
    pub product_id: u16,
    pub fw_version: u32,
}

/// Decodes an IOCFacts reply.
pub fn decode_ioc_facts(r: &[u8]) -> Facts {
    Facts {
        msg_version: le16(r, 0),
        reply_queue_depth: le16(r, 24),
        request_frame_bytes: le16(r, 26) as usize * 4,
        global_credits: le16(r, 36),
        max_chain_depth: r.get(20).copied().unwrap_or(0),
        ports: r.get(38).copied().unwrap_or(0),
        max_devices: r.get(46).copied().unwrap_or(0),
        product_id: le16(r, 30),
        fw_version: le32(r, 56),
    }
}

/// PortFacts: `MaxDevices` of the port.
pub fn decode_port_max_devices(r: &[u8]) -> u16 {
    le16(r, 22)
}

/// The IOCStatus of any reply.
pub fn ioc_status(r: &[u8]) -> u16 {
    le16(r, 14) & IOCSTATUS_MASK
}

/// Byte 2 (MsgLength, dwords), byte 3 (Function), MsgContext.
pub fn reply_header(r: &[u8]) -> (usize, u8, u32) {
    (
        r.get(2).copied().unwrap_or(0) as usize,
        r.get(3).copied().unwrap_or(0xff),
        le32(r, 8),
    )
}

/// LUN field: single-level, peripheral addressing for LUNs below 256 (what
/// the SAS1068 reads, byte 1), flat addressing above.
pub fn lun_bytes(lun: u64) -> [u8; 8] {
    let mut b = [0u8; 8];
    if lun < 256 {
        b[1] = lun as u8;
    } else {
        let [hi, lo] = ((lun as u16 & 0x3fff) | 0x4000).to_be_bytes();
        b[0] = hi;
        b[1] = lo;
    }
    b
}

/// One data segment of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sge {
    pub iova: u64,
    pub len: u32,
}

/// The fixed part of a SCSI IO request.
pub struct ScsiIo<'a> {
    pub nexus: Nexus,
    pub context: u32,
    pub cdb: &'a [u8],
    /// `CONTROL_READ`, `CONTROL_WRITE` or 0.
    pub control: u32,
    pub data_len: u32,
    pub sense_iova: u32,
    pub sense_len: u8,
}

/// Chain segments for SGEs beyond the request frame: `buf` is DMA memory
/// at `iova`, cut into segments of `seg_bytes` (the IOC's request frame
/// size, as the MPI drivers use for chain buffers).
pub struct ChainArea<'a> {
    pub buf: &'a mut [u8],
    pub iova: u64,
    pub seg_bytes: usize,
}

/// SGEs that one segment of `bytes` holds.
fn per_segment(bytes: usize) -> usize {
    bytes / SGE64_LEN
}

/// How many SGEs a request can carry: what fits the frame after the
/// header, then `segs` chain segments, each ending in a chain element to
/// the next except the last.
pub fn sgl_capacity(frame_bytes: usize, seg_bytes: usize, segs: usize) -> usize {
    let first = per_segment(frame_bytes.saturating_sub(SCSIIO_HEADER)).max(1);
    let per = per_segment(seg_bytes);
    if segs == 0 || per < 2 {
        return first;
    }
    (first - 1) + (segs - 1) * (per - 1) + per
}

/// Encodes a SCSI IO request with its SGL (64-bit simple elements, the
/// last one flagged end of list) into `frame` (exactly the IOC's request
/// frame); returns its length. SGEs that do not fit go to chain segments:
/// the last simple element of each segment is flagged LAST, and a chain
/// element after it (at ChainOffset in the frame, NextChainOffset in a
/// segment) gives the next segment's address and length. The caller keeps
/// `sges` within [`sgl_capacity`].
pub fn encode_scsi_io(
    frame: &mut [u8],
    io: &ScsiIo<'_>,
    sges: &[Sge],
    chain: ChainArea<'_>,
) -> usize {
    let fit = per_segment(frame.len() - SCSIIO_HEADER);
    let chained = sges.len() > fit;
    let in_frame = if chained { fit - 1 } else { sges.len().max(1) };
    let n = SCSIIO_HEADER + (in_frame + chained as usize) * SGE64_LEN;
    let b = &mut frame[..n];
    b.fill(0);
    b[0] = io.nexus.target as u8;
    b[1] = io.nexus.channel as u8;
    b[3] = F_SCSI_IO;
    b[4] = io.cdb.len().min(16) as u8;
    b[5] = io.sense_len;
    put32(b, 8, io.context);
    b[12..20].copy_from_slice(&lun_bytes(io.nexus.lun));
    put32(b, 20, io.control);
    let c = io.cdb.len().min(16);
    b[24..24 + c].copy_from_slice(&io.cdb[..c]);
    put32(b, 40, io.data_len);
    put32(b, 44, io.sense_iova);
    let dir = if io.control == CONTROL_WRITE {
        SGE_HOST_TO_IOC
    } else {
        0
    };
    let (head, rest) = sges.split_at(in_frame.min(sges.len()));
    put_simple(&mut b[SCSIIO_HEADER..], head, dir, !chained);
    if !chained {
        if sges.is_empty() {
            // No data: one empty element ending the list.
            put_simple(
                &mut b[SCSIIO_HEADER..],
                &[Sge { iova: 0, len: 0 }],
                dir,
                true,
            );
        }
        return n;
    }
    let at = SCSIIO_HEADER + in_frame * SGE64_LEN;
    b[2] = (at / 4) as u8;
    let (base, seg_bytes) = (chain.iova, chain.seg_bytes);
    put_chain(&mut b[at..], base, seg_bytes, 0, rest.len());
    let per = per_segment(seg_bytes);
    let mut left = rest;
    let mut seg = 0;
    while !left.is_empty() {
        let last = left.len() <= per;
        let take = if last { left.len() } else { per - 1 };
        let off = seg * seg_bytes;
        let sb = &mut chain.buf[off..off + seg_bytes];
        put_simple(sb, &left[..take], dir, last);
        if !last {
            let next = &mut sb[take * SGE64_LEN..];
            put_chain(next, base, seg_bytes, seg + 1, left.len() - take);
        }
        left = &left[take..];
        seg += 1;
    }
    n
}

/// Simple elements at the start of `b`; the last flagged LAST (and end of
/// buffer and list when `end`).
fn put_simple(b: &mut [u8], sges: &[Sge], dir: u32, end: bool) {
    for (i, s) in sges.iter().enumerate() {
        let mut flags = SGE_SIMPLE | SGE_64BIT | dir;
        if i + 1 == sges.len() {
            flags |= SGE_LAST;
            if end {
                flags |= SGE_END_OF_BUFFER | SGE_END_OF_LIST;
            }
        }
        let at = i * SGE64_LEN;
        put32(
            b,
            at,
            (flags << SGE_FLAGS_SHIFT) | (s.len & SGE_MAX_LEN as u32),
        );
        put32(b, at + 4, s.iova as u32);
        put32(b, at + 8, (s.iova >> 32) as u32);
    }
}

/// A chain element to segment `seg` of the chain area at `base`, which
/// holds the next `left` SGEs (or as many as fit before its own chain
/// element).
fn put_chain(b: &mut [u8], base: u64, seg_bytes: usize, seg: usize, left: usize) {
    let per = per_segment(seg_bytes);
    let (elems, next) = if left <= per {
        (left, 0)
    } else {
        // Its own chain element follows its per - 1 simple ones.
        (per, (per - 1) * SGE64_LEN / 4)
    };
    let iova = base + (seg * seg_bytes) as u64;
    let flags = SGE_CHAIN | SGE_64BIT;
    put32(
        b,
        0,
        (flags << SGE_FLAGS_SHIFT) | ((next as u32) << 16) | (elems * SGE64_LEN) as u32,
    );
    put32(b, 4, iova as u32);
    put32(b, 8, (iova >> 32) as u32);
}

/// `MSG_SCSI_TASK_MGMT`.
pub fn encode_tmf(frame: &mut [u8], nexus: Nexus, task: u8, context: u32, task_ctx: u32) {
    let b = &mut frame[..TM_REQ_LEN];
    b.fill(0);
    b[0] = nexus.target as u8;
    b[1] = nexus.channel as u8;
    b[3] = F_TASK_MGMT;
    b[5] = task;
    put32(b, 8, context);
    b[12..20].copy_from_slice(&lun_bytes(nexus.lun));
    put32(b, 48, task_ctx);
}

/// A SCSI IO reply (only sent for errors, residuals and sense).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IoReply {
    pub scsi_status: u8,
    pub scsi_state: u8,
    pub ioc_status: u16,
    pub transfer_count: u32,
    pub sense_count: u32,
}

pub fn decode_io_reply(r: &[u8]) -> IoReply {
    IoReply {
        scsi_status: r.get(12).copied().unwrap_or(0),
        scsi_state: r.get(13).copied().unwrap_or(STATE_NO_SCSI_STATUS),
        ioc_status: ioc_status(r),
        transfer_count: le32(r, 20),
        sense_count: le32(r, 24),
    }
}

/// A task-management reply: IOCStatus and response code.
pub fn decode_tm_reply(r: &[u8]) -> (u16, u8) {
    (ioc_status(r), r.get(4).copied().unwrap_or(0xff))
}

/// What a SCSI IO reply means for the mid-layer: status or transport
/// error, residual, and how many sense bytes are valid.
pub fn outcome(r: &IoReply, data_len: u32) -> (Result<ScsiStatus, TransportError>, u32, usize) {
    let resid = data_len.saturating_sub(r.transfer_count);
    let sense = if r.scsi_state & STATE_AUTOSENSE_VALID != 0 {
        r.sense_count as usize
    } else {
        0
    };
    let status = match r.ioc_status {
        IOCSTATUS_INVALID_BUS | IOCSTATUS_INVALID_TARGETID | IOCSTATUS_DEVICE_NOT_THERE => {
            Err(TransportError::NoDevice)
        }
        IOCSTATUS_TASK_TERMINATED | IOCSTATUS_IOC_TERMINATED | IOCSTATUS_EXT_TERMINATED => {
            Err(TransportError::Aborted)
        }
        IOCSTATUS_DATA_OVERRUN => Err(TransportError::Protocol("data overrun")),
        IOCSTATUS_BUSY | IOCSTATUS_INSUFFICIENT_RESOURCES => Ok(ScsiStatus::Busy),
        _ if r.scsi_state & (STATE_NO_SCSI_STATUS | STATE_TERMINATED) != 0 => {
            Err(TransportError::Io(libc::EIO))
        }
        IOCSTATUS_SUCCESS | IOCSTATUS_DATA_UNDERRUN | IOCSTATUS_RESIDUAL_MISMATCH => {
            Ok(ScsiStatus::from_u8(r.scsi_status))
        }
        _ => Err(TransportError::Io(libc::EIO)),
    };
    (status, resid, sense)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nx(target: u32, lun: u64) -> Nexus {
        Nexus {
            channel: 0,
            target,
            lun,
        }
    }

    #[test]
    fn scsi_io_frames_carry_the_sgl() {
        let mut f = [0xaau8; 128];
        let io = ScsiIo {
            nexus: nx(1, 0),
            context: 7,
            cdb: &[0x28, 0, 0, 0, 0, 8, 0, 0, 1, 0],
            control: CONTROL_READ,
            data_len: 8192,
            sense_iova: 0x1000_2000,
            sense_len: 96,
        };
        let sg = [
            Sge {
                iova: 0x1_2000_0000,
                len: 4096,
            },
            Sge {
                iova: 0x3000,
                len: 4096,
            },
        ];
        assert_eq!(encode_scsi_io(&mut f, &io, &sg, no_chain()), 72);
        assert_eq!((f[0], f[3], f[4], f[5]), (1, 0, 10, 96));
        assert_eq!(le32(&f, 8), 7);
        assert_eq!(le32(&f, 20), CONTROL_READ);
        assert_eq!(f[24], 0x28);
        assert_eq!(le32(&f, 40), 8192);
        assert_eq!(le32(&f, 44), 0x1000_2000);
        assert_eq!(le32(&f, 48), 0x1200_1000);
        assert_eq!((le32(&f, 52), le32(&f, 56)), (0x2000_0000, 1));
        assert_eq!(le32(&f, 60), 0xd300_1000);
        assert_eq!(f[72], 0xaa);
        // No data: one empty element ending the list.
        let none = ScsiIo {
            control: 0,
            data_len: 0,
            ..io
        };
        assert_eq!(encode_scsi_io(&mut f, &none, &[], no_chain()), 60);
        assert_eq!(le32(&f, 48), 0xd300_0000);
        assert_eq!(f[2], 0, "no chain");
    }

    fn no_chain() -> ChainArea<'static> {
        ChainArea {
            buf: &mut [],
            iova: 0,
            seg_bytes: 128,
        }
    }

    /// Walks an SGL the way the IOC does (QEMU's mptsas_build_sgl): simple
    /// elements from the frame's SGL; after one flagged LAST, the chain
    /// element at ChainOffset (then NextChainOffset in each segment).
    fn walk(frame: &[u8], frame_iova: u64, chain: &[u8], chain_iova: u64) -> Vec<Sge> {
        let read = |iova: u64| -> u32 {
            if iova >= chain_iova {
                le32(chain, (iova - chain_iova) as usize)
            } else {
                le32(frame, (iova - frame_iova) as usize)
            }
        };
        let addr = |iova: u64| read(iova + 4) as u64 | (read(iova + 8) as u64) << 32;
        let mut chain_off = frame[2] as u64;
        let mut next_chain = frame_iova + chain_off * 4;
        let mut at = frame_iova + SCSIIO_HEADER as u64;
        let mut out = Vec::new();
        loop {
            let fl = read(at);
            assert_eq!((fl >> 24) & 0x30, SGE_SIMPLE, "simple element at {at:#x}");
            assert_ne!(fl & (SGE_64BIT << 24), 0);
            out.push(Sge {
                iova: addr(at),
                len: fl & SGE_MAX_LEN as u32,
            });
            at += SGE64_LEN as u64;
            if fl & (SGE_END_OF_LIST << 24) != 0 {
                return out;
            }
            if fl & (SGE_LAST << 24) != 0 {
                assert_ne!(chain_off, 0, "LAST without a chain");
                let c = read(next_chain);
                assert_eq!((c >> 24) & 0x30, SGE_CHAIN, "chain element");
                at = addr(next_chain);
                chain_off = ((c >> 16) & 0xff) as u64;
                next_chain = at + chain_off * 4;
            }
        }
    }

    #[test]
    fn long_sgls_continue_in_chain_segments() {
        // A 128-byte frame holds 6 SGEs; 128-byte segments hold 10.
        assert_eq!(sgl_capacity(128, 128, 0), 6);
        assert_eq!(sgl_capacity(128, 128, 3), 5 + 9 + 9 + 10);
        // The SAS1068's 512-byte frames: 38 in the frame, 8 segments.
        assert_eq!(sgl_capacity(512, 512, 8), 37 + 7 * 41 + 42);
        let io = ScsiIo {
            nexus: nx(3, 0),
            context: 1,
            cdb: &[0x2a, 0, 0, 0, 0, 0, 0, 0, 8, 0],
            control: CONTROL_WRITE,
            data_len: 0,
            sense_iova: 0x2000,
            sense_len: 96,
        };
        for n in [1usize, 6, 7, 15, 16, 24, 33] {
            let sg: Vec<Sge> = (0..n)
                .map(|i| Sge {
                    iova: 0x1_0000_0000 + i as u64 * 0x3000,
                    len: 512 + i as u32,
                })
                .collect();
            let mut f = [0xeeu8; 128];
            let mut c = vec![0xeeu8; 3 * 128];
            let area = ChainArea {
                buf: &mut c,
                iova: 0x8000_0000,
                seg_bytes: 128,
            };
            encode_scsi_io(&mut f, &io, &sg, area);
            assert_eq!(walk(&f, 0x1000, &c, 0x8000_0000), sg, "{n} SGEs");
            // Writes: every simple element says host to IOC.
            assert_ne!(le32(&f, 48) & (SGE_HOST_TO_IOC << 24), 0);
            // The chain element's length covers its segment's elements.
            if n > 6 {
                assert_eq!(f[2] as usize * 4, SCSIIO_HEADER + 5 * SGE64_LEN);
                let len = le32(&f, f[2] as usize * 4) & 0xffff;
                assert_eq!(len as usize, (n - 5).min(10) * SGE64_LEN);
            }
        }
    }

    #[test]
    fn luns_and_tmfs() {
        assert_eq!(lun_bytes(1), [0, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(lun_bytes(300), [0x41, 0x2c, 0, 0, 0, 0, 0, 0]);
        let mut f = [0u8; 64];
        encode_tmf(&mut f, nx(2, 1), TM_ABORT_TASK, 65, 9);
        assert_eq!(
            (f[0], f[3], f[5], f[13]),
            (2, F_TASK_MGMT, TM_ABORT_TASK, 1)
        );
        assert_eq!((le32(&f, 8), le32(&f, 48)), (65, 9));
    }

    #[test]
    fn replies_map_to_status_and_residual() {
        let mut r = [0u8; 36];
        r[12] = 2;
        r[13] = STATE_AUTOSENSE_VALID;
        r[14] = IOCSTATUS_DATA_UNDERRUN as u8;
        r[24] = 18;
        let (s, resid, sense) = outcome(&decode_io_reply(&r), 512);
        assert_eq!((s, resid, sense), (Ok(ScsiStatus::CheckCondition), 512, 18));
        r[14] = IOCSTATUS_DEVICE_NOT_THERE as u8;
        r[13] = STATE_NO_SCSI_STATUS;
        assert_eq!(
            outcome(&decode_io_reply(&r), 0).0,
            Err(TransportError::NoDevice)
        );
        r[14] = IOCSTATUS_TASK_TERMINATED as u8;
        assert_eq!(
            outcome(&decode_io_reply(&r), 0).0,
            Err(TransportError::Aborted)
        );
        let mut facts = [0u8; 64];
        facts[20] = 34;
        assert_eq!(decode_ioc_facts(&facts).max_chain_depth, 34);
        let f = decode_ioc_facts(&[0u8; 3]);
        assert_eq!(f, Facts::default());
    }

    #[test]
    fn decoding_never_panics() {
        for len in 0..90 {
            for fill in [0u8, 0x55, 0xff] {
                let b = vec![fill; len];
                let _ = outcome(&decode_io_reply(&b), 4096);
                let _ = decode_ioc_facts(&b);
                let _ = decode_tm_reply(&b);
                let _ = reply_header(&b);
                let _ = decode_port_max_devices(&b);
            }
        }
    }
}
