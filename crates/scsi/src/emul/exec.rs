//! The emulated device's command set, executed against RAM.

use super::{lock, EmulShared, LunState};
use crate::capacity::{Capacity, READ_CAPACITY_16_LEN};
use crate::cdb::{parse_unmap_param, CdbError, Command};
use crate::inquiry::{self, BlockCharacteristics, StdInquiry, BLOCK_LIMITS_LEN, STD_INQUIRY_LEN};
use crate::lld::{DataDir, ScsiCmd};
use crate::lun::encode_report_luns;
use crate::sense::{asc, Sense, SenseKey};
use crate::status::ScsiStatus;

type Outcome = (ScsiStatus, Option<Sense>, u32);

fn check(key: SenseKey, code: (u8, u8), resid: u32) -> Outcome {
    (
        ScsiStatus::CheckCondition,
        Some(Sense::new(key, code)),
        resid,
    )
}

/// Copies `src` into the command's data-in iovecs; returns the residual.
fn data_in(cmd: &ScsiCmd, src: &[u8]) -> u32 {
    let mut pos = 0;
    // SAFETY: the mid-layer keeps the iovecs valid while the command runs.
    for v in unsafe { cmd.iovecs() } {
        let n = v.iov_len.min(src.len() - pos);
        // SAFETY: the iovec is valid for iov_len bytes; n <= iov_len.
        unsafe { std::ptr::copy_nonoverlapping(src[pos..].as_ptr(), v.iov_base as *mut u8, n) };
        pos += n;
        if pos == src.len() {
            break;
        }
    }
    cmd.data_len.saturating_sub(pos as u32)
}

/// Copies the command's data-out into `dst`; returns the bytes copied.
fn data_out(cmd: &ScsiCmd, dst: &mut [u8]) -> usize {
    let mut pos = 0;
    // SAFETY: as in `data_in`.
    for v in unsafe { cmd.iovecs() } {
        let n = v.iov_len.min(dst.len() - pos);
        // SAFETY: as in `data_in`.
        unsafe {
            std::ptr::copy_nonoverlapping(v.iov_base as *const u8, dst[pos..].as_mut_ptr(), n)
        };
        pos += n;
        if pos == dst.len() {
            break;
        }
    }
    pos
}

pub(super) fn execute(st: &EmulShared, cmd: &ScsiCmd) -> Outcome {
    let parsed = Command::parse(cmd.cdb.as_bytes());
    let mut luns = lock(&st.luns);
    if let Ok(Command::ReportLuns { alloc_len, .. }) = parsed {
        let list: Vec<u64> = luns
            .iter()
            .filter(|l| l.cfg.target == cmd.nexus.target)
            .map(|l| l.cfg.lun)
            .collect();
        let mut buf = vec![0u8; (alloc_len as usize).min(8 + 8 * list.len())];
        let n = encode_report_luns(&list, &mut buf);
        if let Some(l) = luns
            .iter_mut()
            .find(|l| l.cfg.target == cmd.nexus.target && l.cfg.lun == cmd.nexus.lun)
        {
            // REPORT LUNS clears the "LUNs changed" attention it answers.
            if l.ua.is_some_and(|s| s.code() == asc::REPORTED_LUNS_CHANGED) {
                l.ua = None;
            }
        }
        return (ScsiStatus::Good, None, data_in(cmd, &buf[..n]));
    }
    let Some(lun) = luns
        .iter_mut()
        .find(|l| l.cfg.target == cmd.nexus.target && l.cfg.lun == cmd.nexus.lun)
    else {
        // No logical unit here: INQUIRY says so with qualifier 3 (SPC).
        if let Ok(Command::Inquiry { page: None, .. }) = parsed {
            let mut b = [0u8; STD_INQUIRY_LEN];
            b[0] = 0x7f;
            return (ScsiStatus::Good, None, data_in(cmd, &b));
        }
        return check(
            SenseKey::IllegalRequest,
            asc::LUN_NOT_SUPPORTED,
            cmd.data_len,
        );
    };
    let c = match parsed {
        Ok(c) => c,
        Err(CdbError::UnsupportedOpcode(_)) => {
            return check(SenseKey::IllegalRequest, asc::INVALID_OPCODE, cmd.data_len)
        }
        Err(_) => {
            return check(
                SenseKey::IllegalRequest,
                asc::INVALID_FIELD_IN_CDB,
                cmd.data_len,
            )
        }
    };
    if !matches!(c, Command::Inquiry { .. } | Command::RequestSense { .. }) {
        if let Some(ua) = lun.ua.take() {
            return (ScsiStatus::CheckCondition, Some(ua), cmd.data_len);
        }
    }
    run(lun, cmd, c)
}

fn run(lun: &mut LunState, cmd: &ScsiCmd, c: Command) -> Outcome {
    let bs = lun.cfg.block_size as u64;
    let in_range = |lba: u64, n: u64| lba.checked_add(n).is_some_and(|e| e <= lun.cfg.num_blocks);
    match c {
        Command::TestUnitReady | Command::SynchronizeCache { .. } => (ScsiStatus::Good, None, 0),
        Command::RequestSense { .. } => (
            ScsiStatus::Good,
            None,
            data_in(cmd, &[0x70, 0, 0, 0, 0, 0, 0, 10]),
        ),
        Command::Inquiry { page, alloc_len } => inquiry(lun, cmd, page, alloc_len),
        Command::ReadCapacity16 { alloc_len } => {
            let mut b = [0u8; READ_CAPACITY_16_LEN];
            Capacity {
                num_blocks: lun.cfg.num_blocks,
                block_size: lun.cfg.block_size,
                lbppbe: 0,
                lbpme: lun.cfg.thin,
                lbprz: lun.cfg.thin,
            }
            .encode(&mut b);
            let n = (alloc_len as usize).min(b.len());
            (ScsiStatus::Good, None, data_in(cmd, &b[..n]))
        }
        Command::ReportLuns { .. } => (ScsiStatus::Good, None, 0), // answered above
        Command::Read { lba, blocks, .. } | Command::Write { lba, blocks, .. } => {
            let write = matches!(c, Command::Write { .. });
            if !in_range(lba, blocks as u64) {
                return check(
                    SenseKey::IllegalRequest,
                    asc::LBA_OUT_OF_RANGE,
                    cmd.data_len,
                );
            }
            let want = blocks as u64 * bs;
            let dir_ok = cmd.dir
                == if write {
                    DataDir::ToDevice
                } else {
                    DataDir::FromDevice
                };
            if want != cmd.data_len as u64 || !dir_ok {
                return check(
                    SenseKey::IllegalRequest,
                    asc::INVALID_FIELD_IN_CDB,
                    cmd.data_len,
                );
            }
            let range = (lba * bs) as usize..(lba * bs + want) as usize;
            if write {
                data_out(cmd, &mut lun.data[range]);
                (ScsiStatus::Good, None, 0)
            } else {
                (ScsiStatus::Good, None, data_in(cmd, &lun.data[range]))
            }
        }
        Command::Unmap { param_len } => {
            if !lun.cfg.thin {
                return check(SenseKey::IllegalRequest, asc::INVALID_OPCODE, cmd.data_len);
            }
            let mut p = [0u8; 8 + 16 * 8];
            let n = data_out(cmd, &mut p[..(param_len as usize).min(8 + 16 * 8)]);
            let mut ranges = [(0u64, 0u32); 8];
            let mut k = 0;
            parse_unmap_param(&p[..n], ranges.len(), |l, b| {
                ranges[k] = (l, b);
                k += 1;
            });
            if ranges[..k].iter().any(|&(l, b)| !in_range(l, b as u64)) {
                return check(SenseKey::IllegalRequest, asc::LBA_OUT_OF_RANGE, 0);
            }
            for &(l, b) in &ranges[..k] {
                lun.data[(l * bs) as usize..((l + b as u64) * bs) as usize].fill(0);
            }
            (ScsiStatus::Good, None, 0)
        }
        Command::WriteSame16 {
            lba, blocks, ndob, ..
        } => {
            if !in_range(lba, blocks as u64) {
                return check(
                    SenseKey::IllegalRequest,
                    asc::LBA_OUT_OF_RANGE,
                    cmd.data_len,
                );
            }
            let mut block = vec![0u8; bs as usize];
            if !ndob && data_out(cmd, &mut block) != bs as usize {
                return check(
                    SenseKey::IllegalRequest,
                    asc::INVALID_FIELD_IN_CDB,
                    cmd.data_len,
                );
            }
            for b in lun.data[(lba * bs) as usize..((lba + blocks as u64) * bs) as usize]
                .chunks_mut(bs as usize)
            {
                b.copy_from_slice(&block);
            }
            (ScsiStatus::Good, None, 0)
        }
        _ => check(SenseKey::IllegalRequest, asc::INVALID_OPCODE, cmd.data_len),
    }
}

fn inquiry(lun: &LunState, cmd: &ScsiCmd, page: Option<u8>, alloc_len: u16) -> Outcome {
    let cfg = &lun.cfg;
    let mut out: Vec<u8> = Vec::with_capacity(128);
    match page {
        None => {
            let mut b = [0u8; STD_INQUIRY_LEN];
            StdInquiry {
                qualifier: 0,
                device_type: cfg.device_type,
                removable: false,
                version: 6,
                cmdque: true,
                vendor: "USTOR".into(),
                product: "EMUL DISK".into(),
                revision: "0001".into(),
            }
            .encode(&mut b);
            out.extend_from_slice(&b);
        }
        Some(inquiry::VPD_SUPPORTED) => {
            out.extend_from_slice(&[0, 0, 0, 5, 0x00, 0x80, 0x83, 0xb0, 0xb1]);
        }
        Some(inquiry::VPD_SERIAL) => {
            let s = format!("EMUL{}-{}", cfg.target, cfg.lun);
            out.extend_from_slice(&[0, 0x80, 0, s.len() as u8]);
            out.extend_from_slice(s.as_bytes());
        }
        Some(inquiry::VPD_DEVICE_ID) => {
            out.extend_from_slice(&[0, 0x83, 0, 0]);
            let mut naa = [0x60, 0x01, 0x40, 0x5e, 0, 0, 0, 0];
            naa[4..8].copy_from_slice(&((cfg.target << 16) | cfg.lun as u32).to_be_bytes());
            inquiry::encode_designator(&mut out, 3, &naa);
            let n = (out.len() - 4) as u16;
            out[2..4].copy_from_slice(&n.to_be_bytes());
        }
        Some(inquiry::VPD_BLOCK_LIMITS) => {
            let mut b = [0u8; BLOCK_LIMITS_LEN];
            cfg.limits.encode(&mut b);
            out.extend_from_slice(&b);
        }
        Some(inquiry::VPD_BLOCK_CHARACTERISTICS) => {
            let mut b = [0u8; 64];
            BlockCharacteristics {
                rotation_rate: 1,
                form_factor: 0,
                fua_behaviour: false,
            }
            .encode(&mut b);
            out.extend_from_slice(&b);
        }
        Some(_) => {
            return check(
                SenseKey::IllegalRequest,
                asc::INVALID_FIELD_IN_CDB,
                cmd.data_len,
            )
        }
    }
    if page.is_some() {
        out[0] = cfg.device_type.as_u8();
    }
    let n = (alloc_len as usize).min(out.len());
    (ScsiStatus::Good, None, data_in(cmd, &out[..n]))
}
