//! READ and WRITE of one chunk started in the call, with no future: when
//! the bdev answers at once (null, malloc) the command is answered in the
//! call too, so a transport that maps its data ([`DataNow`]: vhost-user's
//! guest memory) runs it where it took it, with no worker, no pool wait and
//! none of the generic path's nested futures.
//!
//! Only a command that would meet every check of the full path with
//! nothing to report takes it: no unit attention owed, no write protect,
//! the range on the medium, the initiator's length exactly the blocks in
//! the direction of the command, one chunk, no FUA or protection field.
//! Anything else is [`RwStart::Declined`] untouched (nothing consumed) and
//! runs through [`LunTable::execute`], which answers it. The reservation
//! check is the full path's own; a unit attention it hands out or a
//! conflict is answered here as the full path would answer it.
//!
//! Writes go out from the transport's lent buffer
//! ([`DataPath::data_out_buf`]) and pass the unit's write gate as every
//! write does (declined while a read-modify-write holds it). Reads land in
//! a buffer of ours (the caller's spare, kept between commands) and are
//! copied to the transport when done: a read still at the bdev may be
//! abandoned (ABORT TASK) without the bdev writing the initiator's memory
//! afterwards.

use std::sync::Arc;

use ustor_bdev::{RwNow, RwWait};
use ustor_runtime::IoBuf;
use ustor_scsi_proto::cdb::Command;

use crate::data::{DataPath, Direction};
use crate::lu::{LuShared, Lun};
use crate::outcome::Outcome;
use crate::pr::{Access, Check};
use crate::sbc::CHUNK_BYTES;
use crate::table::LunTable;

/// A transport that moves data-in with no await: its data buffers are
/// memory it maps.
pub trait DataNow: DataPath {
    /// Copies `src` into the data-in buffer at `offset`; the bytes copied.
    fn data_in_now(&mut self, offset: u32, src: &[u8]) -> usize;

    /// The `len` data-in bytes at `offset` as a buffer over the
    /// initiator's own memory, when they lie in one piece of it: the bdev
    /// reads into it directly. The core lends it only to a bdev that
    /// completes in its submit, so the memory is never written after the
    /// command is answered or abandoned. `None` (the default): a copy.
    fn data_in_place(&mut self, offset: u32, len: usize) -> Option<IoBuf> {
        let _ = (offset, len);
        None
    }
}

impl DataNow for crate::data::BufData {
    fn data_in_now(&mut self, offset: u32, src: &[u8]) -> usize {
        self.put_in(offset, src)
    }
}

/// What [`LunTable::rw_now`] did.
pub enum RwStart {
    /// Answered in the call (data moved, or the check that stopped it).
    Done(Outcome),
    /// At the bdev: [`RwPending::finish`] answers it.
    Waiting(RwPending),
    /// Not for the fast path: run it through [`LunTable::execute`].
    Declined,
}

/// A fast-path read or write the bdev has not answered yet.
pub struct RwPending {
    wait: RwWait,
    /// A write's pass through the unit's write gate (`None`: a read).
    gate: Option<GateHeld>,
    /// A read into the initiator's memory: nothing to copy.
    in_place: bool,
    exp: u32,
    d_sense: bool,
}

/// A write's hold on the gate, let go when the write has ended (or its
/// command is dropped).
struct GateHeld(Arc<LuShared>);

impl Drop for GateHeld {
    fn drop(&mut self) {
        self.0.gate.leave();
    }
}

impl RwPending {
    /// A write (it changes the medium once started: not to be abandoned).
    pub fn is_write(&self) -> bool {
        self.gate.is_some()
    }

    /// Waits for the bdev; a read's data then goes to `data`.
    pub async fn finish<D: DataNow>(self, data: &mut D) -> Outcome {
        let RwPending {
            wait,
            gate,
            in_place,
            exp,
            d_sense,
        } = self;
        let write = gate.is_some();
        let (r, buf) = wait.await;
        drop(gate);
        outcome_of(r, (write, in_place), &buf, exp, data).with_descriptor_sense(d_sense)
    }
}

/// The outcome of a fast-path I/O; a read not `in_place` copies its data
/// to the transport (the length checks made `exp` the buffer's length).
fn outcome_of<D: DataNow>(
    r: Result<(), ustor_bdev::BdevError>,
    (write, in_place): (bool, bool),
    buf: &IoBuf,
    exp: u32,
    data: &mut D,
) -> Outcome {
    match r {
        Err(e) => Outcome::from_bdev(e, write, exp),
        Ok(()) if write || in_place => Outcome::good(0),
        Ok(()) => {
            let n = data.data_in_now(0, buf).min(buf.len()) as u32;
            Outcome::good(exp.saturating_sub(n))
        }
    }
}

/// A plain READ or WRITE of `cdb`: (write, lba, blocks), with no FUA and
/// no protection field.
fn plain_rw(cdb: &[u8]) -> Option<(bool, u64, u64)> {
    // The 10, 12 and 16-byte forms, with no protection field (the full
    // path refuses one).
    if !matches!(cdb.first(), Some(0x28 | 0x2a | 0xa8 | 0xaa | 0x88 | 0x8a))
        || crate::table::protection_requested(cdb)
    {
        return None;
    }
    match Command::parse(cdb).ok()? {
        Command::Read { lba, blocks, .. } => Some((false, lba, blocks as u64)),
        Command::Write {
            lba,
            blocks,
            fua: false,
        } => Some((true, lba, blocks as u64)),
        _ => None,
    }
}

impl LunTable {
    /// Starts a plain READ or WRITE of one chunk on `lun` at once (see the
    /// module docs); `spare` is a read buffer the caller keeps between
    /// commands (taken and given back here).
    pub fn rw_now<D: DataNow>(
        &self,
        lun: u64,
        cdb: &[u8],
        data: &mut D,
        spare: &mut Option<IoBuf>,
    ) -> RwStart {
        let Some((write, lba, blocks)) = plain_rw(cdb) else {
            return RwStart::Declined;
        };
        let Some(lu) = self.get(lun) else {
            return RwStart::Declined;
        };
        let exp = data.expected_len();
        let len = blocks * lu.block_size() as u64;
        let dir = if write {
            Direction::ToDevice
        } else {
            Direction::FromDevice
        };
        let plain = blocks > 0
            && len == exp as u64
            && len <= CHUNK_BYTES
            && data.direction() == dir
            && lu.in_range(lba, blocks)
            && lu.ua().is_none()
            && lu.num_blocks() == lu.known_blocks()
            && !(write && lu.shared.mode.swp());
        if !plain {
            return RwStart::Declined;
        }
        let d_sense = lu.shared.mode.d_sense();
        let access = if write { Access::Write } else { Access::Read };
        match lu.shared.pr.check(self.nexus(), true, access) {
            Check::Attention(ua) => {
                return RwStart::Done(Outcome::sense(ua, exp).with_descriptor_sense(d_sense))
            }
            Check::Conflict => return RwStart::Done(Outcome::conflict(exp)),
            Check::Go => {}
        }
        let start = Checked {
            lu,
            lba,
            blocks,
            len: len as usize,
            exp,
            d_sense,
        };
        if write {
            start.write_now(data)
        } else {
            start.read_now(data, spare)
        }
    }
}

/// A checked command, ready for the bdev.
struct Checked<'a> {
    lu: &'a Lun,
    lba: u64,
    blocks: u64,
    len: usize,
    exp: u32,
    d_sense: bool,
}

impl Checked<'_> {
    fn write_now<D: DataNow>(self, data: &mut D) -> RwStart {
        let Some(buf) = data.data_out_buf(0, self.len) else {
            return RwStart::Declined;
        };
        let shared = &self.lu.shared;
        if !shared.gate.try_enter() {
            return RwStart::Declined;
        }
        let ch = &self.lu.ch;
        match ch.rw_now(true, ch.recent_tick(), self.lba, self.blocks, buf) {
            RwNow::Done(r, buf) => {
                shared.gate.leave();
                let o = outcome_of(r, (true, false), &buf, self.exp, data);
                RwStart::Done(o.with_descriptor_sense(self.d_sense))
            }
            RwNow::Waiting(wait) => RwStart::Waiting(RwPending {
                wait,
                gate: Some(GateHeld(shared.clone())),
                in_place: false,
                exp: self.exp,
                d_sense: self.d_sense,
            }),
            RwNow::Declined(_) => {
                shared.gate.leave();
                RwStart::Declined
            }
        }
    }

    fn read_now<D: DataNow>(self, data: &mut D, spare: &mut Option<IoBuf>) -> RwStart {
        if self.lu.ch.completes_in_submit() {
            if let Some(buf) = data.data_in_place(0, self.len) {
                return self.read_into(buf, true, data, spare);
            }
        }
        let mut buf = match spare.take() {
            Some(b) if b.capacity() >= self.len => b,
            other => {
                *spare = other;
                match IoBuf::try_alloc(self.len) {
                    Some(b) => b,
                    None => return RwStart::Declined,
                }
            }
        };
        buf.set_len(self.len);
        self.read_into(buf, false, data, spare)
    }

    /// Reads into `buf`: the initiator's memory (`in_place`), or a buffer
    /// of ours that goes back to `spare` when done.
    fn read_into<D: DataNow>(
        self,
        buf: IoBuf,
        in_place: bool,
        data: &mut D,
        spare: &mut Option<IoBuf>,
    ) -> RwStart {
        let ch = &self.lu.ch;
        match ch.rw_now(false, ch.recent_tick(), self.lba, self.blocks, buf) {
            RwNow::Done(r, buf) => {
                let o = outcome_of(r, (false, in_place), &buf, self.exp, data);
                if !in_place {
                    *spare = Some(buf);
                }
                RwStart::Done(o.with_descriptor_sense(self.d_sense))
            }
            RwNow::Waiting(wait) => RwStart::Waiting(RwPending {
                wait,
                gate: None,
                in_place,
                exp: self.exp,
                d_sense: self.d_sense,
            }),
            RwNow::Declined(buf) => {
                if !in_place {
                    *spare = Some(buf);
                }
                RwStart::Declined
            }
        }
    }
}
