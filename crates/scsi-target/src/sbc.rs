//! Block commands (SBC-3) against the unit's bdev channel: READ and WRITE
//! (6/10/12/16, FUA as the bdev's FUA flag), WRITE AND VERIFY, VERIFY,
//! SYNCHRONIZE CACHE, UNMAP, WRITE SAME(10/16).
//!
//! Data moves through one pool buffer per command in chunks of at most
//! [`CHUNK_BYTES`]: the initiator's transfer length never sizes an
//! allocation, and a large transfer streams through the transport.

use ustor_bdev::io::MAX_SEGMENTS;
use ustor_bdev::{IoFlags, IoType};
use ustor_runtime::IoBuf;
use ustor_scsi_proto::cdb::{parse_unmap_param, Command};
use ustor_scsi_proto::sense::asc;
use ustor_scsi_proto::SenseKey;

use crate::data::{DataPath, Direction, XferError};
use crate::lu::Lun;
use crate::outcome::Outcome;

/// Largest buffer a command moves at once (the pool's largest class).
pub const CHUNK_BYTES: u64 = 1 << 20;

/// Most UNMAP block descriptors one command carries.
pub const MAX_UNMAP_DESCRIPTORS: usize = 16;

pub(crate) async fn execute<D: DataPath>(
    lu: &Lun,
    c: Command,
    data: &mut D,
) -> Result<Outcome, XferError> {
    let exp = data.expected_len();
    match c {
        Command::Read { lba, blocks, .. } => read(lu, lba, blocks as u64, data).await,
        Command::Write { lba, blocks, fua } => {
            write(lu, lba, blocks as u64, IoFlags::fua_if(fua), data).await
        }
        // The write is durable before GOOD; the medium has no separate
        // verification to run.
        Command::WriteAndVerify { lba, blocks } => {
            write(lu, lba, blocks as u64, IoFlags::FUA, data).await
        }
        Command::Verify {
            lba,
            blocks,
            bytchk,
        } => verify(lu, lba, blocks as u64, bytchk, data).await,
        Command::SynchronizeCache { lba, blocks } => sync_cache(lu, lba, blocks as u64, exp).await,
        // These take their few bytes of data-out first; the gate is held
        // for the whole command (COMPARE AND WRITE is atomic against them).
        Command::Unmap { param_len } => {
            let _g = lu.shared.gate.write().await;
            unmap(lu, param_len, data).await
        }
        Command::WriteSame10 { lba, blocks, unmap } => {
            let _g = lu.shared.gate.write().await;
            write_same(lu, lba, blocks as u64, (unmap, false), data).await
        }
        Command::WriteSame16 {
            lba,
            blocks,
            unmap,
            ndob,
        } => {
            let _g = lu.shared.gate.write().await;
            write_same(lu, lba, blocks as u64, (unmap, ndob), data).await
        }
        Command::PreFetch { lba, blocks, .. } => {
            // Nothing to stage: the bdev serves reads as fast as a cache.
            Ok(if lu.in_range(lba, blocks as u64) {
                Outcome::good(exp)
            } else {
                Outcome::out_of_range(exp)
            })
        }
        Command::OrWrite { lba, blocks } => {
            crate::rmw::or_write(lu, lba, blocks as u64, data).await
        }
        Command::CompareAndWrite { lba, blocks } => {
            crate::rmw::compare_and_write(lu, lba, blocks, data).await
        }
        Command::GetLbaStatus { lba, alloc_len } => lba_status(lu, lba, alloc_len, data).await,
        _ => Ok(Outcome::invalid_field(exp)),
    }
}

/// Blocks per chunk for this unit.
fn chunk_blocks(lu: &Lun) -> u64 {
    (CHUNK_BYTES / lu.block_size() as u64).max(1)
}

/// Checks a data transfer of `blocks` at `lba` in direction `dir`: on the
/// medium, and what the initiator expects to move. Returns the blocks to
/// move: all of them, or for a transport with residuals those the
/// initiator's buffer holds whole (the transport reports the over- or
/// underflow, RFC 7143 §11.4.5.1).
fn check_xfer<D: DataPath>(
    lu: &Lun,
    lba: u64,
    blocks: u64,
    dir: Direction,
    data: &D,
) -> Result<u64, Outcome> {
    let exp = data.expected_len();
    if !lu.in_range(lba, blocks) {
        return Err(Outcome::out_of_range(exp));
    }
    let bs = lu.block_size() as u64;
    if data.residuals() {
        // A data phase the other way moves nothing (libiscsi's
        // Read10Invalid: a READ flagged as a write ends GOOD).
        let room = if data.direction() == dir {
            exp as u64
        } else {
            0
        };
        return Ok(blocks.min(room / bs));
    }
    if blocks * bs != exp as u64 || (blocks > 0 && data.direction() != dir) {
        return Err(Outcome::invalid_field(exp));
    }
    Ok(blocks)
}

async fn chunk_buf(lu: &Lun, blocks: u64) -> IoBuf {
    let n = chunk_blocks(lu).min(blocks.max(1));
    IoBuf::alloc((n * lu.block_size() as u64) as usize).await
}

async fn read<D: DataPath>(
    lu: &Lun,
    lba: u64,
    blocks: u64,
    data: &mut D,
) -> Result<Outcome, XferError> {
    let exp = data.expected_len();
    let blocks = match check_xfer(lu, lba, blocks, Direction::FromDevice, data) {
        // A partial last block still goes out, cut at the buffer's end.
        Ok(n) if data.direction() == Direction::FromDevice && n < blocks => n + 1,
        Ok(n) => n,
        Err(o) => return Ok(o),
    };
    let bs = lu.block_size() as u64;
    let mut spare = None;
    let (mut done, mut sent) = (0u64, 0u32);
    while done < blocks {
        let n = chunk_blocks(lu).min(blocks - done);
        // A transport that sends from the buffer keeps it: the next chunk
        // reads into a new one.
        let mut buf = match spare.take() {
            Some(b) => b,
            None => chunk_buf(lu, blocks - done).await,
        };
        buf.set_len((n * bs) as usize);
        let (r, buf) = lu.ch.read(lba + done, n, buf).await;
        if let Err(e) = r {
            return Ok(Outcome::from_bdev(e, false, exp.saturating_sub(sent)));
        }
        let len = buf.len();
        let (r, back) = data.data_in_buf((done * bs) as u32, buf).await;
        sent = sent.saturating_add(r?.min(len) as u32);
        spare = back;
        done += n;
    }
    Ok(Outcome::good(exp.saturating_sub(sent)))
}

async fn write<D: DataPath>(
    lu: &Lun,
    lba: u64,
    blocks: u64,
    flags: IoFlags,
    data: &mut D,
) -> Result<Outcome, XferError> {
    let blocks = match check_xfer(lu, lba, blocks, Direction::ToDevice, data) {
        Ok(n) => n,
        Err(o) => return Ok(o),
    };
    let exp = data.expected_len();
    let bs = lu.block_size() as u64;
    let mut spare: Option<IoBuf> = None;
    let mut done = 0u64;
    while done < blocks {
        let n = chunk_blocks(lu).min(blocks - done);
        let (off, len) = ((done * bs) as u32, (n * bs) as usize);
        let one = data.data_out_buf(off, len);
        let many = match one {
            None => data.data_out_bufs(off, len, MAX_SEGMENTS),
            Some(_) => None,
        };
        if let Some(v) = many {
            // The initiator's scattered memory, written from where it is.
            let g = lu.shared.gate.write().await;
            let (r, v) = lu.ch.writev_flagged(lba + done, n, v, flags).await;
            drop(g);
            data.bufs_back(v);
            if let Err(e) = r {
                return Ok(Outcome::from_bdev(e, true, exp.saturating_sub(off)));
            }
            done += n;
            continue;
        }
        let buf = match one {
            Some(b) => b,
            None => {
                let mut b = match spare.take() {
                    Some(b) if b.capacity() >= len => b,
                    _ => chunk_buf(lu, blocks - done).await,
                };
                b.set_len(len);
                if data.data_out(off, &mut b).await? != len {
                    return Ok(Outcome::invalid_field(exp.saturating_sub(off)));
                }
                b
            }
        };
        let g = lu.shared.gate.write().await;
        let (r, b) = lu.ch.write_flagged(lba + done, n, buf, flags).await;
        drop(g);
        // A buffer the transport lent (the initiator's own memory) is
        // never filled with the next chunk.
        spare = (!b.is_borrowed()).then_some(b);
        if let Err(e) = r {
            return Ok(Outcome::from_bdev(e, true, exp.saturating_sub(off)));
        }
        done += n;
    }
    Ok(Outcome::good(0))
}

fn miscompare(resid: u32) -> Outcome {
    Outcome::check(SenseKey::Miscompare, asc::MISCOMPARE_DURING_VERIFY, resid)
}

/// VERIFY: BYTCHK 0 reads the range back (the medium is readable), 1
/// compares it with data-out, 3 compares every block with one block.
async fn verify<D: DataPath>(
    lu: &Lun,
    lba: u64,
    blocks: u64,
    bytchk: u8,
    data: &mut D,
) -> Result<Outcome, XferError> {
    let exp = data.expected_len();
    let bs = lu.block_size() as u64;
    let out_len = match bytchk {
        0 => 0,
        1 => blocks * bs,
        _ => bs,
    };
    if !lu.in_range(lba, blocks) {
        return Ok(Outcome::out_of_range(exp));
    }
    if out_len != exp as u64 || (out_len > 0 && data.direction() != Direction::ToDevice) {
        return Ok(Outcome::invalid_field(exp));
    }
    let mut buf = chunk_buf(lu, blocks).await;
    let mut cmp = chunk_buf(lu, if bytchk == 0 { 1 } else { blocks }).await;
    if bytchk == 3 {
        cmp.set_len(bs as usize);
        if data.data_out(0, &mut cmp).await? != bs as usize {
            return Ok(Outcome::invalid_field(exp));
        }
    }
    let mut done = 0u64;
    while done < blocks {
        let n = chunk_blocks(lu).min(blocks - done);
        buf.set_len((n * bs) as usize);
        let (r, b) = lu.ch.read(lba + done, n, buf).await;
        buf = b;
        if let Err(e) = r {
            return Ok(Outcome::from_bdev(e, false, 0));
        }
        let same = match bytchk {
            0 => true,
            1 => {
                cmp.set_len(buf.len());
                let got = data.data_out((done * bs) as u32, &mut cmp).await?;
                got == buf.len() && buf[..] == cmp[..]
            }
            _ => buf.chunks(bs as usize).all(|b| *b == cmp[..bs as usize]),
        };
        if !same {
            return Ok(miscompare(0));
        }
        done += n;
    }
    Ok(Outcome::good(0))
}

async fn sync_cache(lu: &Lun, lba: u64, blocks: u64, exp: u32) -> Result<Outcome, XferError> {
    // A length of 0 means "to the end of the medium".
    let blocks = if blocks == 0 {
        lu.num_blocks().saturating_sub(lba)
    } else {
        blocks
    };
    if !lu.in_range(lba, blocks) {
        return Ok(Outcome::out_of_range(exp));
    }
    if lu.can_flush() {
        if let Err(e) = lu.ch.flush(lba, blocks).await {
            return Ok(Outcome::from_bdev(e, true, exp));
        }
    }
    Ok(Outcome::good(exp))
}

async fn unmap<D: DataPath>(lu: &Lun, param_len: u16, data: &mut D) -> Result<Outcome, XferError> {
    let exp = data.expected_len();
    if !lu.cfg.thin {
        return Ok(Outcome::check(
            SenseKey::IllegalRequest,
            asc::INVALID_OPCODE,
            exp,
        ));
    }
    let mut p = [0u8; 8 + 16 * MAX_UNMAP_DESCRIPTORS];
    let want = (param_len as usize).min(p.len()).min(exp as usize);
    let n = data.data_out(0, &mut p[..want]).await?;
    // More descriptors than we take (VPD B0 says how many) is refused, not
    // cut short: the initiator would believe the rest unmapped.
    let listed = if n >= 8 {
        u16::from_be_bytes([p[2], p[3]]) as usize / 16
    } else {
        0
    };
    if listed > MAX_UNMAP_DESCRIPTORS {
        return Ok(Outcome::check(
            SenseKey::IllegalRequest,
            asc::INVALID_FIELD_IN_PARAM_LIST,
            0,
        ));
    }
    let mut ranges = [(0u64, 0u32); MAX_UNMAP_DESCRIPTORS];
    let mut k = 0;
    parse_unmap_param(&p[..n], ranges.len(), |l, b| {
        ranges[k] = (l, b);
        k += 1;
    });
    if ranges[..k].iter().any(|&(l, b)| !lu.in_range(l, b as u64)) {
        return Ok(Outcome::out_of_range(0));
    }
    for &(l, b) in ranges[..k].iter().filter(|r| r.1 > 0) {
        let r = if lu.ch.supports(IoType::Unmap) {
            lu.ch.unmap(l, b as u64).await
        } else {
            lu.ch.write_zeroes(l, b as u64).await
        };
        if let Err(e) = r {
            return Ok(Outcome::from_bdev(e, true, 0));
        }
    }
    Ok(Outcome::good(exp.saturating_sub(n as u32)))
}

/// GET LBA STATUS: one descriptor, the range from `lba` to the end
/// mapped (the bdev does not say which blocks an UNMAP deallocated).
async fn lba_status<D: DataPath>(
    lu: &Lun,
    lba: u64,
    alloc_len: u32,
    data: &mut D,
) -> Result<Outcome, XferError> {
    if lba >= lu.num_blocks() {
        return Ok(Outcome::out_of_range(data.expected_len()));
    }
    let mut b = [0u8; 24];
    b[0..4].copy_from_slice(&20u32.to_be_bytes());
    b[8..16].copy_from_slice(&lba.to_be_bytes());
    let n = (lu.num_blocks() - lba).min(u32::MAX as u64) as u32;
    b[16..20].copy_from_slice(&n.to_be_bytes());
    let len = (alloc_len as usize).min(b.len());
    crate::spc::send_in(data, &b[..len]).await
}

/// WRITE SAME: one block of data-out (zeroes with NDOB) written over the
/// range; an all-zero block becomes the bdev's write-zeroes. A length of
/// 0 runs to the end of the medium (VPD B0's WSNZ is 0). With UNMAP on a
/// thin unit the range is unmapped (it then reads zero: LBPRZ).
async fn write_same<D: DataPath>(
    lu: &Lun,
    lba: u64,
    blocks: u64,
    (unmap, ndob): (bool, bool),
    data: &mut D,
) -> Result<Outcome, XferError> {
    let exp = data.expected_len();
    let bs = lu.block_size() as usize;
    let blocks = if blocks == 0 {
        lu.num_blocks().saturating_sub(lba)
    } else {
        blocks
    };
    if !lu.in_range(lba, blocks) {
        return Ok(Outcome::out_of_range(exp));
    }
    // Data-out is exactly one block (none with NDOB).
    let want = if ndob { 0 } else { bs as u32 };
    if exp != want || (want > 0 && data.direction() != Direction::ToDevice) {
        return Ok(Outcome::invalid_field(exp));
    }
    if unmap && lu.cfg.thin {
        let mut one = [0u8; 1];
        if !ndob && data.data_out(0, &mut one).await? != 1 {
            return Ok(Outcome::invalid_field(exp));
        }
        let r = if lu.ch.supports(IoType::Unmap) {
            lu.ch.unmap(lba, blocks).await
        } else {
            lu.ch.write_zeroes(lba, blocks).await
        };
        return Ok(r.map_or_else(|e| Outcome::from_bdev(e, true, 0), |_| Outcome::good(0)));
    }
    let mut buf = chunk_buf(lu, blocks).await;
    buf.set_len(bs);
    buf.fill(0);
    if !ndob && data.data_out(0, &mut buf).await? != bs {
        return Ok(Outcome::invalid_field(exp));
    }
    if buf.iter().all(|b| *b == 0) {
        let r = lu.ch.write_zeroes(lba, blocks).await;
        return Ok(r.map_or_else(|e| Outcome::from_bdev(e, true, 0), |_| Outcome::good(0)));
    }
    let n_max = chunk_blocks(lu).min(blocks.max(1)) as usize;
    buf.set_len(n_max * bs);
    for i in 1..n_max {
        buf.copy_within(0..bs, i * bs);
    }
    let mut done = 0u64;
    while done < blocks {
        let n = chunk_blocks(lu).min(blocks - done);
        buf.set_len(n as usize * bs);
        let (r, b) = lu.ch.write(lba + done, n, buf).await;
        buf = b;
        if let Err(e) = r {
            return Ok(Outcome::from_bdev(e, true, 0));
        }
        done += n;
    }
    Ok(Outcome::good(0))
}
