//! EXTENDED COPY (LID1) within one logical unit and RECEIVE COPY RESULTS
//! (SPC-4 §6.4, §6.18): identification target descriptors (E4h) that name
//! this unit by its NAA designator, block-to-block segment descriptors
//! (02h); the copy runs through the bdev in chunks before status. Results
//! of lists whose ID is held stay for RECEIVE COPY RESULTS until the
//! nexus is gone.

use std::sync::{Mutex, MutexGuard};

use ustor_scsi_proto::sense::asc;
use ustor_scsi_proto::SenseKey;

use crate::data::{DataPath, XferError};
use crate::lu::Lun;
use crate::outcome::Outcome;

/// What we accept, reported as the operating parameters.
const MAX_TARGETS: u16 = 2;
const MAX_SEGMENTS: u16 = 4;
const MAX_LIST_LEN: u32 = 1024;
/// Parameter list header bytes.
const HDR: usize = 16;
const TGT_LEN: usize = 32;
const SEG_LEN: usize = 28;
const TGT_IDENT: u8 = 0xe4;
const SEG_BLOCK_TO_BLOCK: u8 = 0x02;

const TOO_MANY_TARGETS: (u8, u8) = (0x26, 0x06);
const UNSUPPORTED_TARGET: (u8, u8) = (0x26, 0x07);
const TOO_MANY_SEGMENTS: (u8, u8) = (0x26, 0x08);
const UNSUPPORTED_SEGMENT: (u8, u8) = (0x26, 0x09);
const UNREACHABLE_TARGET: (u8, u8) = (0x08, 0x04);

/// Results held for RECEIVE COPY RESULTS: (nexus, list ID, segments,
/// blocks copied).
#[derive(Default)]
pub(crate) struct Held(Mutex<Vec<(String, u8, u16, u32)>>);

impl Held {
    fn lock(&self) -> MutexGuard<'_, Vec<(String, u8, u16, u32)>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn forget(&self, nexus: &str) {
        self.lock().retain(|h| h.0 != nexus);
    }
}

fn illegal(code: (u8, u8)) -> Outcome {
    Outcome::check(SenseKey::IllegalRequest, code, 0)
}

fn aborted(code: (u8, u8)) -> Outcome {
    Outcome::check(SenseKey::CopyAborted, code, 0)
}

fn be(b: &[u8]) -> u64 {
    b.iter().fold(0, |a, x| a << 8 | *x as u64)
}

/// EXTENDED COPY (LID1) with a parameter list of `param_len` bytes.
pub(crate) async fn extended_copy<D: DataPath>(
    lu: &Lun,
    nexus: &str,
    param_len: u32,
    data: &mut D,
) -> Result<Outcome, XferError> {
    if param_len == 0 {
        return Ok(Outcome::good(data.expected_len()));
    }
    let max = HDR + MAX_LIST_LEN as usize;
    let mut p = vec![0u8; (param_len as usize).min(max)];
    let n = data.data_out(0, &mut p).await?;
    p.truncate(n);
    if n < HDR {
        return Ok(illegal(asc::PARAM_LIST_LENGTH_ERROR));
    }
    let tgt_len = be(&p[2..4]) as usize;
    let seg_len = be(&p[8..12]) as usize;
    let inline = be(&p[12..16]) as usize;
    let total = tgt_len + seg_len;
    if total > MAX_LIST_LEN as usize || HDR + total + inline > param_len as usize || HDR + total > n
    {
        return Ok(illegal(asc::PARAM_LIST_LENGTH_ERROR));
    }
    if inline != 0 {
        return Ok(illegal(asc::INVALID_FIELD_IN_PARAM_LIST));
    }
    let (list_id, usage) = (p[0], (p[1] >> 3) & 3);
    let targets = &p[HDR..HDR + tgt_len];
    let segments = &p[HDR + tgt_len..HDR + total];
    if targets.len() / TGT_LEN > MAX_TARGETS as usize {
        return Ok(illegal(TOO_MANY_TARGETS));
    }
    if segments.len() / SEG_LEN > MAX_SEGMENTS as usize {
        return Ok(illegal(TOO_MANY_SEGMENTS));
    }
    if let Some(o) = check_targets(lu, targets) {
        return Ok(o);
    }
    let mut copied = 0u32;
    let mut done = 0u16;
    for s in segments.chunks(SEG_LEN) {
        if s.len() < SEG_LEN || s[0] != SEG_BLOCK_TO_BLOCK {
            return Ok(illegal(UNSUPPORTED_SEGMENT));
        }
        let (src, dst) = (be(&s[4..6]) as usize, be(&s[6..8]) as usize);
        if src >= targets.len() / TGT_LEN || dst >= targets.len() / TGT_LEN {
            return Ok(aborted(UNREACHABLE_TARGET));
        }
        let blocks = be(&s[10..12]);
        let (from, to) = (be(&s[12..20]), be(&s[20..28]));
        if !lu.in_range(from, blocks) || !lu.in_range(to, blocks) {
            return Ok(aborted((0, 0)));
        }
        if let Err(o) = copy(lu, from, to, blocks).await {
            return Ok(o);
        }
        copied = copied.saturating_add(blocks as u32);
        done += 1;
    }
    // LIST ID USAGE 00b and 01b hold the list ID for RECEIVE COPY RESULTS.
    if usage < 2 {
        let mut h = lu.shared.copies.lock();
        h.retain(|x| !(x.0 == nexus && x.1 == list_id));
        h.push((nexus.to_string(), list_id, done, copied));
    }
    Ok(Outcome::good(data.expected_len().saturating_sub(n as u32)))
}

/// Every target descriptor must be an identification descriptor naming
/// this unit (its NAA designator) with its block size.
fn check_targets(lu: &Lun, targets: &[u8]) -> Option<Outcome> {
    for t in targets.chunks(TGT_LEN) {
        if t.len() < TGT_LEN || t[0] != TGT_IDENT {
            return Some(illegal(UNSUPPORTED_TARGET));
        }
        // NUL (a null device), another peripheral type, another unit or
        // block size: not a copy target here.
        let (nul, ptype) = (t[1] & 0x20 != 0, t[1] & 0x1f);
        let (kind, len) = (t[5] & 0x0f, t[7] as usize);
        let naa = &lu.cfg.naa[..];
        let ours = kind == 3 && len == naa.len() && &t[8..8 + len] == naa;
        if nul || ptype != 0 || !ours || be(&t[29..32]) != lu.block_size() as u64 {
            return Some(aborted(UNREACHABLE_TARGET));
        }
    }
    None
}

/// Copies `blocks` from `from` to `to` in chunks, backwards when the
/// ranges overlap with the destination after the source.
async fn copy(lu: &Lun, from: u64, to: u64, blocks: u64) -> Result<(), Outcome> {
    let chunk = (crate::CHUNK_BYTES / lu.block_size() as u64).max(1);
    let bs = lu.block_size() as u64;
    let mut buf = ustor_runtime::IoBuf::alloc((chunk.min(blocks.max(1)) * bs) as usize).await;
    let backwards = to > from && to < from + blocks;
    let mut left = blocks;
    while left > 0 {
        let n = chunk.min(left);
        let off = if backwards { left - n } else { blocks - left };
        buf.set_len((n * bs) as usize);
        let (r, b) = lu.ch.read(from + off, n, buf).await;
        buf = b;
        r.map_err(|e| Outcome::from_bdev(e, false, 0))?;
        let (r, b) = lu.ch.write(to + off, n, buf).await;
        buf = b;
        r.map_err(|e| Outcome::from_bdev(e, true, 0))?;
        left -= n;
    }
    Ok(())
}

/// RECEIVE COPY RESULTS: COPY STATUS (0) of a held list ID, OPERATING
/// PARAMETERS (3).
pub(crate) async fn receive_results<D: DataPath>(
    lu: &Lun,
    nexus: &str,
    (sa, list_id): (u8, u8),
    alloc_len: u32,
    data: &mut D,
) -> Result<Outcome, XferError> {
    let mut b = [0u8; 48];
    let len = match sa {
        0 => {
            let h = lu.shared.copies.lock();
            let Some(r) = h.iter().find(|x| x.0 == nexus && x.1 == list_id) else {
                return Ok(Outcome::invalid_field_at(2, None, data.expected_len()));
            };
            b[3] = 8;
            b[4] = 0x01; // completed without errors
            b[5..7].copy_from_slice(&r.2.to_be_bytes());
            // Transfer count in bytes (units 0).
            let bytes = r.3.saturating_mul(lu.block_size());
            b[8..12].copy_from_slice(&bytes.to_be_bytes());
            12
        }
        3 => {
            b[4] = 0x01; // SNLID
            b[8..10].copy_from_slice(&MAX_TARGETS.to_be_bytes());
            b[10..12].copy_from_slice(&MAX_SEGMENTS.to_be_bytes());
            b[12..16].copy_from_slice(&MAX_LIST_LEN.to_be_bytes());
            let max_seg = 0xffff_u32.saturating_mul(lu.block_size());
            b[16..20].copy_from_slice(&max_seg.to_be_bytes());
            b[34..36].copy_from_slice(&1u16.to_be_bytes());
            b[36] = 1;
            b[37] = lu.block_size().trailing_zeros() as u8;
            b[43] = 2;
            b[44] = SEG_BLOCK_TO_BLOCK;
            b[45] = TGT_IDENT;
            b[3] = 46 - 4;
            46
        }
        _ => return Ok(Outcome::invalid_field_at(1, Some(4), data.expected_len())),
    };
    let n = (alloc_len as usize).min(len);
    crate::spc::send_in(data, &b[..n]).await
}
