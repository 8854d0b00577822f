//! NVM I/O commands on one queue pair: Read, Write, Flush, Write Zeroes,
//! Dataset Management (deallocate), Compare, mapped onto the namespace's
//! bdev channel on this reactor. Bdev errors become NVMe statuses.

use ustor_bdev::{BdevError, IoChannel, IoFlags, IoType};
use ustor_runtime::IoBuf;

use crate::wire::{io, DataSgl, Sqe, Status};

/// What an I/O command produced.
pub(crate) struct IoDone {
    pub status: Status,
    /// Read data to send (the buffer the bdev filled) and its length.
    pub data: Option<(IoBuf, u32)>,
}

impl IoDone {
    fn status(s: Status) -> IoDone {
        IoDone {
            status: s,
            data: None,
        }
    }
}

/// Maps a bdev error to the NVMe status a host understands.
pub fn status_of(e: BdevError, write: bool) -> Status {
    match e {
        BdevError::OutOfRange { .. } => Status::LBA_OUT_OF_RANGE,
        BdevError::BadLength { .. } | BdevError::TooManySegments(_) => Status::INVALID_FIELD,
        BdevError::NotSupported => Status::INVALID_OPCODE,
        BdevError::Removed => Status::INVALID_NAMESPACE,
        // Namespace is write protected.
        BdevError::ReadOnly => Status::generic(0x20),
        BdevError::Miscompare { .. } => Status::COMPARE_FAILURE,
        BdevError::Aborted => Status::ABORT_REQUESTED,
        BdevError::Io(_) if write => Status::WRITE_FAULT,
        BdevError::Io(_) => Status::UNRECOVERED_READ,
    }
}

fn check_range(sqe: &Sqe, ch: &IoChannel) -> Result<(u64, u64), Status> {
    let slba = sqe.slba();
    let nlb = u64::from(sqe.nlb());
    match slba.checked_add(nlb) {
        Some(end) if end <= ch.num_blocks() => Ok((slba, nlb)),
        _ => Err(Status::LBA_OUT_OF_RANGE),
    }
}

/// Runs one I/O command. `data` is the host's data (write, compare, DSM),
/// already received; `sgl` says how much data the host expects back.
pub(crate) async fn execute(
    sqe: &Sqe,
    ch: &IoChannel,
    sgl: DataSgl,
    data: Option<IoBuf>,
    mdts_bytes: u32,
) -> IoDone {
    let bs = u64::from(ch.block_size());
    match sqe.opcode() {
        io::READ => {
            let (slba, nlb) = match check_range(sqe, ch) {
                Ok(r) => r,
                Err(s) => return IoDone::status(s),
            };
            let len = nlb * bs;
            // SGLS bit 18 is clear: the SGL describes exactly NLB blocks,
            // no more (a longer one is Data SGL Length Invalid, as for
            // Write and as Linux nvmet answers).
            if len > u64::from(mdts_bytes)
                || !matches!(sgl, DataSgl::Transport { len: l } if u64::from(l) == len)
            {
                return IoDone::status(Status::DATA_SGL_LENGTH_INVALID);
            }
            let mut buf = IoBuf::alloc(len as usize).await;
            buf.set_len(len as usize);
            let (r, buf) = ch.read(slba, nlb, buf).await;
            match r {
                Ok(()) => IoDone {
                    status: Status::SUCCESS,
                    data: Some((buf, len as u32)),
                },
                Err(e) => IoDone::status(status_of(e, false)),
            }
        }
        io::WRITE | io::COMPARE => {
            let (slba, nlb) = match check_range(sqe, ch) {
                Ok(r) => r,
                Err(s) => return IoDone::status(s),
            };
            let len = (nlb * bs) as usize;
            let Some(buf) = data.filter(|b| b.len() == len) else {
                return IoDone::status(Status::DATA_SGL_LENGTH_INVALID);
            };
            if sqe.opcode() == io::WRITE {
                let (r, _buf) = ch.write_flagged(slba, nlb, buf, fua(sqe)).await;
                return IoDone::status(r.map_or_else(|e| status_of(e, true), |_| Status::SUCCESS));
            }
            let mut disk = IoBuf::alloc(len).await;
            disk.set_len(len);
            let (r, disk) = ch.read(slba, nlb, disk).await;
            match r {
                Ok(()) if disk[..] == buf[..] => IoDone::status(Status::SUCCESS),
                Ok(()) => IoDone::status(Status::COMPARE_FAILURE),
                Err(e) => IoDone::status(status_of(e, false)),
            }
        }
        io::FLUSH => {
            let r = ch.flush(0, ch.num_blocks()).await;
            IoDone::status(r.map_or_else(|e| status_of(e, true), |_| Status::SUCCESS))
        }
        io::WRITE_ZEROES => {
            let (slba, nlb) = match check_range(sqe, ch) {
                Ok(r) => r,
                Err(s) => return IoDone::status(s),
            };
            let r = ch.write_zeroes_flagged(slba, nlb, fua(sqe)).await;
            IoDone::status(r.map_or_else(|e| status_of(e, true), |_| Status::SUCCESS))
        }
        io::DSM => dsm(sqe, ch, data).await,
        _ => IoDone::status(Status::INVALID_OPCODE),
    }
}

/// Force Unit Access (CDW12 bit 30 of Write and Write Zeroes): the data
/// must be on non-volatile media before the command completes (NVM Command
/// Set 3.2.6, 3.2.8). It is the bdev layer's I/O flag: a driver honours it,
/// or the layer flushes the written range of a write-cached bdev.
fn fua(sqe: &Sqe) -> IoFlags {
    IoFlags::fua_if(sqe.cdw(12) & FUA != 0)
}

/// CDW12 bit 30 of Read, Write, Compare and Write Zeroes.
const FUA: u32 = 1 << 30;

/// Dataset Management: only the deallocate attribute does anything; ranges
/// are checked before any is unmapped, so a bad range changes nothing.
async fn dsm(sqe: &Sqe, ch: &IoChannel, data: Option<IoBuf>) -> IoDone {
    let nr = (sqe.cdw(10) & 0xff) as usize + 1;
    let deallocate = sqe.cdw(11) & (1 << 2) != 0;
    let Some(buf) = data.filter(|b| b.len() >= nr * 16) else {
        return IoDone::status(Status::DATA_SGL_LENGTH_INVALID);
    };
    let range = |i: usize| {
        let r = &buf[i * 16..i * 16 + 16];
        let nlb = u64::from(crate::wire::le32(r, 4));
        let slba = crate::wire::le64(r, 8);
        (slba, nlb)
    };
    for i in 0..nr {
        let (slba, nlb) = range(i);
        if slba.checked_add(nlb).map_or(true, |e| e > ch.num_blocks()) {
            return IoDone::status(Status::LBA_OUT_OF_RANGE);
        }
    }
    if !deallocate || !ch.supports(IoType::Unmap) {
        return IoDone::status(Status::SUCCESS);
    }
    for i in 0..nr {
        let (slba, nlb) = range(i);
        if nlb == 0 {
            continue;
        }
        if let Err(e) = ch.unmap(slba, nlb).await {
            return IoDone::status(status_of(e, true));
        }
    }
    IoDone::status(Status::SUCCESS)
}
