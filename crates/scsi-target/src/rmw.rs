//! Block commands that read before they write (SBC-3): COMPARE AND WRITE
//! (compare data-out's first half with the medium, write its second half
//! if they match; MISCOMPARE with the offset of the first differing byte
//! otherwise) and ORWRITE(16) (data-out ORed into the blocks).
//!
//! Each runs its read, compare and write holding the unit's write gate
//! exclusively (`crate::gate`): no write of any I_T nexus reaches the
//! medium between its read and its write. A COMPARE AND WRITE that the
//! bdev does natively and atomically (rbd: the OSD compares and writes)
//! goes to it as one compare-and-write I/O instead, gated as a write. (The iSCSI target also runs
//! them as ORDERED tasks within their session.)

use ustor_bdev::IoFlags;
use ustor_scsi_proto::sense::asc;
use ustor_scsi_proto::{Sense, SenseKey};

use crate::data::{DataPath, Direction, XferError};
use crate::lu::Lun;
use crate::outcome::Outcome;

/// Checks range and data-out length of a command moving `want` bytes.
fn check<D: DataPath>(lu: &Lun, lba: u64, blocks: u64, want: u64, data: &D) -> Option<Outcome> {
    let exp = data.expected_len();
    if !lu.in_range(lba, blocks) {
        return Some(Outcome::out_of_range(exp));
    }
    if want != exp as u64 || (want > 0 && data.direction() != Direction::ToDevice) {
        return Some(Outcome::invalid_field(exp));
    }
    None
}

/// COMPARE AND WRITE of `blocks` (at most the VPD B0 limit) at `lba`.
pub(crate) async fn compare_and_write<D: DataPath>(
    lu: &Lun,
    lba: u64,
    blocks: u8,
    data: &mut D,
) -> Result<Outcome, XferError> {
    let exp = data.expected_len();
    if blocks > lu.cfg.limits.max_compare_write_blocks {
        return Ok(Outcome::invalid_field_at(13, None, exp));
    }
    let bs = lu.block_size() as u64;
    let len = blocks as u64 * bs;
    if let Some(o) = check(lu, lba, blocks as u64, 2 * len, data) {
        return Ok(o);
    }
    if blocks == 0 {
        return Ok(Outcome::good(0));
    }
    let n = len as usize;
    let mut cmp = ustor_runtime::IoBuf::alloc(n).await;
    cmp.set_len(n);
    if data.data_out(0, &mut cmp).await? != n {
        return Ok(Outcome::invalid_field(exp));
    }
    // Both halves of data-out are in before the gate is taken: nothing
    // waits for the network while writes are held off.
    let mut new = ustor_runtime::IoBuf::alloc(n).await;
    new.set_len(n);
    if data.data_out(len as u32, &mut new).await? != n {
        return Ok(Outcome::invalid_field(exp));
    }
    if blocks as u64 <= lu.ch.max_compare_and_write_blocks() {
        // The device compares and writes atomically itself (librbd: in the
        // OSD): an ordinary write as far as the gate is concerned.
        let _g = lu.shared.gate.write().await;
        let (r, _, _) = lu
            .ch
            .compare_and_write(lba, blocks as u64, cmp, new, IoFlags::FUA)
            .await;
        return Ok(r.map_or_else(|e| Outcome::from_bdev(e, true, 0), |_| Outcome::good(0)));
    }
    let mut buf = ustor_runtime::IoBuf::alloc(n).await;
    buf.set_len(n);
    let _g = lu.shared.gate.exclusive().await;
    let (r, b) = lu.ch.read(lba, blocks as u64, buf).await;
    buf = b;
    if let Err(e) = r {
        return Ok(Outcome::from_bdev(e, false, 0));
    }
    if let Some(at) = buf.iter().zip(cmp.iter()).position(|(a, b)| a != b) {
        let s = Sense {
            info: Some(at as u64),
            ..Sense::new(SenseKey::Miscompare, asc::MISCOMPARE_DURING_VERIFY)
        };
        return Ok(Outcome::sense(s, 0));
    }
    let (r, _) = lu
        .ch
        .write_flagged(lba, blocks as u64, new, IoFlags::FUA)
        .await;
    Ok(r.map_or_else(|e| Outcome::from_bdev(e, true, 0), |_| Outcome::good(0)))
}

/// ORWRITE(16): each chunk of data-out ORed into the blocks under it.
pub(crate) async fn or_write<D: DataPath>(
    lu: &Lun,
    lba: u64,
    blocks: u64,
    data: &mut D,
) -> Result<Outcome, XferError> {
    let bs = lu.block_size() as u64;
    if let Some(o) = check(lu, lba, blocks, blocks * bs, data) {
        return Ok(o);
    }
    let exp = data.expected_len();
    let chunk = (crate::CHUNK_BYTES / bs).max(1);
    let first = (chunk.min(blocks.max(1)) * bs) as usize;
    let mut buf = ustor_runtime::IoBuf::alloc(first).await;
    let mut add = ustor_runtime::IoBuf::alloc(first).await;
    let mut done = 0u64;
    while done < blocks {
        let n = chunk.min(blocks - done);
        let len = (n * bs) as usize;
        add.set_len(len);
        if data.data_out((done * bs) as u32, &mut add).await? != len {
            return Ok(Outcome::invalid_field(exp));
        }
        buf.set_len(len);
        let g = lu.shared.gate.exclusive().await;
        let (r, b) = lu.ch.read(lba + done, n, buf).await;
        buf = b;
        if let Err(e) = r {
            return Ok(Outcome::from_bdev(e, false, 0));
        }
        buf.iter_mut().zip(add.iter()).for_each(|(d, s)| *d |= *s);
        let (r, b) = lu.ch.write(lba + done, n, buf).await;
        drop(g);
        buf = b;
        if let Err(e) = r {
            return Ok(Outcome::from_bdev(e, true, 0));
        }
        done += n;
    }
    Ok(Outcome::good(0))
}
