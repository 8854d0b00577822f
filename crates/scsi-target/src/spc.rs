//! Primary commands (SPC-4) and the capacity and mode data of SBC-3:
//! TEST UNIT READY, REQUEST SENSE, INQUIRY with its VPD pages, READ
//! CAPACITY(10/16), MODE SENSE(6/10), START STOP UNIT, REPORT SUPPORTED
//! OPERATION CODES ([`crate::opcodes`]).

use ustor_scsi_proto::capacity::{Capacity, READ_CAPACITY_16_LEN};
use ustor_scsi_proto::cdb::Command;
use ustor_scsi_proto::inquiry::{
    self, BlockCharacteristics, StdInquiry, BLOCK_LIMITS_LEN, STD_INQUIRY_LEN,
};
use ustor_scsi_proto::sense::asc;
use ustor_scsi_proto::{Sense, SenseKey};

use crate::data::{DataPath, XferError};
use crate::lu::Lun;
use crate::outcome::Outcome;

/// The VPD pages this core answers, in order (page 0x00's list); the
/// last one, Logical Block Provisioning, only for thin LUNs.
const VPD_PAGES: [u8; 6] = [
    inquiry::VPD_SUPPORTED,
    inquiry::VPD_SERIAL,
    inquiry::VPD_DEVICE_ID,
    inquiry::VPD_BLOCK_LIMITS,
    inquiry::VPD_BLOCK_CHARACTERISTICS,
    VPD_PROVISIONING,
];

/// Standard INQUIRY data with its version descriptors.
const STD_INQUIRY_FULL: usize = 96;

/// Logical Block Provisioning VPD page (SBC-3 §6.6.4).
const VPD_PROVISIONING: u8 = 0xb2;

/// Sends `bytes` as the whole data-in; GOOD with the residual.
pub(crate) async fn send_in<D: DataPath>(data: &mut D, bytes: &[u8]) -> Result<Outcome, XferError> {
    let n = data.data_in(0, bytes).await?;
    Ok(Outcome::good(data.expected_len().saturating_sub(n as u32)))
}

/// `bytes` capped at the allocation length, sent as data-in.
async fn reply<D: DataPath>(
    data: &mut D,
    bytes: &[u8],
    alloc_len: u32,
) -> Result<Outcome, XferError> {
    let n = (alloc_len as usize).min(bytes.len());
    send_in(data, &bytes[..n]).await
}

pub(crate) async fn execute<D: DataPath>(
    lu: &Lun,
    c: Command,
    data: &mut D,
) -> Result<Outcome, XferError> {
    let exp = data.expected_len();
    match c {
        Command::TestUnitReady | Command::StartStopUnit { .. } => Ok(Outcome::good(exp)),
        Command::RequestSense { alloc_len } => {
            // Sense goes with CHECK CONDITION (autosense), so there is
            // never a deferred one to report here.
            let mut b = [0u8; 18];
            Sense::new(SenseKey::NoSense, (0, 0)).encode_fixed(&mut b);
            reply(data, &b, alloc_len as u32).await
        }
        Command::Inquiry { page, alloc_len } => inquiry(lu, page, alloc_len, data).await,
        Command::ReadCapacity10 => {
            let mut b = [0u8; 8];
            let last = lu.num_blocks().saturating_sub(1).min(u32::MAX as u64) as u32;
            b[0..4].copy_from_slice(&last.to_be_bytes());
            b[4..8].copy_from_slice(&lu.block_size().to_be_bytes());
            send_in(data, &b).await
        }
        Command::ReadCapacity16 { alloc_len } => {
            let mut b = [0u8; READ_CAPACITY_16_LEN];
            Capacity {
                num_blocks: lu.num_blocks(),
                block_size: lu.block_size(),
                lbppbe: lu.lbppbe,
                lbpme: lu.cfg.thin,
                lbprz: lu.cfg.thin,
            }
            .encode(&mut b);
            reply(data, &b, alloc_len).await
        }
        Command::ModeSense {
            long,
            dbd,
            pc,
            page,
            subpage,
            alloc_len,
        } => mode_sense(lu, long, dbd, pc, (page, subpage), alloc_len, data).await,
        Command::ReportSupportedOpcodes {
            rctd,
            options,
            opcode,
            service_action,
            alloc_len,
        } => {
            let mut b = [0u8; crate::opcodes::MAX_LEN];
            match crate::opcodes::report(rctd, options, opcode, service_action, &mut b) {
                Some(n) => reply(data, &b[..n], alloc_len).await,
                // The reporting options (byte 2, bits 2..0) do not fit the
                // opcode: a field pointer tells it from an unknown command.
                None => Ok(Outcome::invalid_field_at(2, Some(2), exp)),
            }
        }
        Command::ReadDefectData {
            long,
            lists,
            alloc_len,
        } => {
            // A bdev has no defect lists to show: the header alone, the
            // requested format echoed, PLISTV and GLISTV clear.
            let mut b = [0u8; 8];
            b[1] = lists & 0x07;
            let len = if long { 8 } else { 4 };
            reply(data, &b[..len], alloc_len).await
        }
        // The table answers REPORT LUNS and routes block commands to sbc.
        _ => Ok(Outcome::invalid_field(exp)),
    }
}

async fn inquiry<D: DataPath>(
    lu: &Lun,
    page: Option<u8>,
    alloc_len: u16,
    data: &mut D,
) -> Result<Outcome, XferError> {
    let cfg = &lu.cfg;
    let mut out = [0u8; 256];
    let len = match page {
        None => {
            let mut b = [0u8; STD_INQUIRY_LEN];
            StdInquiry {
                qualifier: 0,
                device_type: cfg.device_type,
                removable: false,
                version: 6,
                cmdque: true,
                vendor: cfg.vendor.clone(),
                product: cfg.product.clone(),
                revision: cfg.revision.clone(),
            }
            .encode(&mut b);
            out[..b.len()].copy_from_slice(&b);
            // Version descriptors (bytes 58..): SAM-5, SPC-4, SBC-3, so
            // initiators know which page formats to expect.
            for (i, v) in [0x00a0u16, 0x0460, 0x04c0].iter().enumerate() {
                out[58 + 2 * i..60 + 2 * i].copy_from_slice(&v.to_be_bytes());
            }
            out[4] = (STD_INQUIRY_FULL - 5) as u8;
            STD_INQUIRY_FULL
        }
        Some(p) => match vpd_page(lu, p, &mut out) {
            Some(n) => n,
            None => return Ok(Outcome::invalid_field(data.expected_len())),
        },
    };
    reply(data, &out[..len], alloc_len as u32).await
}

/// Writes VPD page `page` into `out`; its length, or `None` if unknown.
fn vpd_page(lu: &Lun, page: u8, out: &mut [u8; 256]) -> Option<usize> {
    let cfg = &lu.cfg;
    let payload: usize = match page {
        inquiry::VPD_SUPPORTED => {
            let n = VPD_PAGES.len() - usize::from(!(cfg.thin && lu.provisioning_page));
            out[4..4 + n].copy_from_slice(&VPD_PAGES[..n]);
            n
        }
        VPD_PROVISIONING if cfg.thin && lu.provisioning_page => {
            // LBPU (UNMAP), LBPWS and LBPWS10 (WRITE SAME with UNMAP),
            // LBPRZ (unmapped blocks read zero); provisioning type thin.
            out[4] = 0;
            out[5] = 0x80 | 0x40 | 0x20 | 0x04;
            out[6] = 0x02;
            out[7] = 0;
            4
        }
        inquiry::VPD_SERIAL => {
            let s = &cfg.serial.as_bytes()[..cfg.serial.len().min(200)];
            out[4..4 + s.len()].copy_from_slice(s);
            s.len()
        }
        inquiry::VPD_DEVICE_ID => {
            let mut v = Vec::with_capacity(16);
            inquiry::encode_designator(&mut v, 3, &cfg.naa);
            out[4..4 + v.len()].copy_from_slice(&v);
            v.len()
        }
        inquiry::VPD_BLOCK_LIMITS => {
            let mut b = [0u8; BLOCK_LIMITS_LEN];
            cfg.limits.encode(&mut b);
            out[4..BLOCK_LIMITS_LEN].copy_from_slice(&b[4..]);
            BLOCK_LIMITS_LEN - 4
        }
        inquiry::VPD_BLOCK_CHARACTERISTICS => {
            let mut b = [0u8; 64];
            BlockCharacteristics {
                rotation_rate: 1,
                form_factor: 0,
                fua_behaviour: false,
            }
            .encode(&mut b);
            out[4..64].copy_from_slice(&b[4..]);
            60
        }
        _ => return None,
    };
    inquiry::vpd_header(&mut out[..], cfg.device_type, page, payload as u16);
    Some(4 + payload)
}

/// Mode pages this core reports.
use crate::mode::{PAGE_CACHING, PAGE_CONTROL};
const PAGE_ALL: u8 = 0x3f;

async fn mode_sense<D: DataPath>(
    lu: &Lun,
    long: bool,
    dbd: bool,
    pc: u8,
    (page, subpage): (u8, u8),
    alloc_len: u16,
    data: &mut D,
) -> Result<Outcome, XferError> {
    let exp = data.expected_len();
    if pc == 3 {
        return Ok(Outcome::check(
            SenseKey::IllegalRequest,
            asc::SAVING_PARAMS_NOT_SUPPORTED,
            exp,
        ));
    }
    if subpage != 0 && subpage != 0xff || !matches!(page, PAGE_CACHING | PAGE_CONTROL | PAGE_ALL) {
        return Ok(Outcome::invalid_field(exp));
    }
    let mut out = [0u8; 64];
    let hdr = if long { 8 } else { 4 };
    let mut at = hdr;
    if !dbd {
        // One short block descriptor: block count (capped) and length.
        let n = lu.num_blocks().min(0xffff_ffff) as u32;
        out[at..at + 4].copy_from_slice(&n.to_be_bytes());
        out[at + 5..at + 8].copy_from_slice(&lu.block_size().to_be_bytes()[1..]);
        at += 8;
    }
    let changeable = pc == 1;
    if matches!(page, PAGE_CACHING | PAGE_ALL) {
        let p = crate::mode::caching_page(lu, changeable);
        out[at..at + p.len()].copy_from_slice(&p);
        at += p.len();
    }
    if matches!(page, PAGE_CONTROL | PAGE_ALL) {
        let p = crate::mode::control_page(lu, changeable);
        out[at..at + p.len()].copy_from_slice(&p);
        at += p.len();
    }
    // Device-specific: WP when read-only or SWP is set, DPOFUA (FUA is
    // honoured).
    let dev = if lu.writable && !lu.shared.mode.swp() {
        0x10
    } else {
        0x90
    };
    if long {
        out[0..2].copy_from_slice(&((at - 2) as u16).to_be_bytes());
        out[3] = dev;
        out[7] = if dbd { 0 } else { 8 };
    } else {
        out[0] = (at - 1) as u8;
        out[2] = dev;
        out[3] = if dbd { 0 } else { 8 };
    }
    reply(data, &out[..at], alloc_len as u32).await
}
