//! virtio-scsi as the device sees it (virtio 1.2, 5.6): feature bits, the
//! config space, and the walkers that turn one available chain into a
//! validated request: a command (`virtio_scsi_cmd_req`, data-out, then
//! `virtio_scsi_cmd_resp`, data-in), a control request (TMF or
//! asynchronous notification) or an event buffer.
//!
//! A chain is seen as two byte streams: what the device reads (the
//! device-readable descriptors, in order) and what it writes (the
//! device-writable ones, which must all come after the readable ones).
//! Headers and responses may be split anywhere across descriptors. Every
//! piece is checked to lie in guest memory before the request runs; every
//! guest access is bounded again, by `vm-memory` or by the request path's
//! view of the map ([`GuestMem`], see [`StreamMem`]). Nothing here touches
//! a bdev or a socket.

use virtio_bindings::virtio_scsi as vs;
use vm_memory::{Bytes, GuestAddress, GuestMemory, GuestMemoryMmap, Permissions};

use crate::blk::feature as ring;
use crate::guest::GuestMem;

/// `struct virtio_scsi_cmd_req` with the default 32-byte CDB.
pub const CMD_REQ_LEN: u64 = 19 + CDB_SIZE as u64;
/// The response's fields before the sense bytes (sense_len, resid,
/// status_qualifier, status, response).
pub const RESP_FIXED: usize = 12;
/// `struct virtio_scsi_cmd_resp` with the default 96-byte sense.
pub const CMD_RESP_LEN: u64 = RESP_FIXED as u64 + SENSE_SIZE as u64;
pub const CDB_SIZE: usize = vs::VIRTIO_SCSI_CDB_DEFAULT_SIZE as usize;
pub const SENSE_SIZE: usize = vs::VIRTIO_SCSI_SENSE_DEFAULT_SIZE as usize;
/// `struct virtio_scsi_ctrl_tmf_req` / `_resp`.
pub const TMF_REQ_LEN: usize = 24;
pub const TMF_RESP_LEN: u64 = 1;
/// `struct virtio_scsi_ctrl_an_req` / `_resp`.
pub const AN_REQ_LEN: usize = 16;
pub const AN_RESP_LEN: u64 = 5;
/// `struct virtio_scsi_event`.
pub const EVENT_LEN: u64 = 16;
/// Targets a controller holds (SPDK's SPDK_VHOST_SCSI_CTRLR_MAX_DEVS);
/// each is one logical unit, LUN 0.
pub const MAX_TARGETS: usize = 8;
/// Descriptors per chain we accept (a ring's worth: the queue's iterator
/// ends loops earlier).
pub const CHAIN_MAX: usize = 1024;
/// Segments per command the config space advertises (QEMU's default for
/// a 128-entry ring).
pub const SEG_MAX: u32 = 126;

/// Response codes (`VIRTIO_SCSI_S_*`).
pub mod resp {
    use super::vs;
    pub const OK: u8 = vs::VIRTIO_SCSI_S_OK as u8;
    pub const BAD_TARGET: u8 = vs::VIRTIO_SCSI_S_BAD_TARGET as u8;
    pub const FAILURE: u8 = vs::VIRTIO_SCSI_S_FAILURE as u8;
    pub const ABORTED: u8 = vs::VIRTIO_SCSI_S_ABORTED as u8;
    pub const FUNCTION_COMPLETE: u8 = vs::VIRTIO_SCSI_S_OK as u8;
    pub const FUNCTION_SUCCEEDED: u8 = vs::VIRTIO_SCSI_S_FUNCTION_SUCCEEDED as u8;
    pub const FUNCTION_REJECTED: u8 = vs::VIRTIO_SCSI_S_FUNCTION_REJECTED as u8;
    pub const INCORRECT_LUN: u8 = vs::VIRTIO_SCSI_S_INCORRECT_LUN as u8;
}

/// Feature bits offered: hot-plug events, parameter-change events (never
/// sent, but QEMU passes the driver's CHANGE bit through unmasked, so a
/// backend without it fails SET_FEATURES), the ring features, vhost-user's
/// protocol-features bit.
pub fn features() -> u64 {
    (1 << vs::VIRTIO_SCSI_F_HOTPLUG)
        | (1 << vs::VIRTIO_SCSI_F_CHANGE)
        | ring::INDIRECT_DESC
        | ring::EVENT_IDX
        | ring::VERSION_1
        | ring::PROTOCOL_FEATURES
}

/// `struct virtio_scsi_config` for `request_queues` request queues.
pub fn config(request_queues: u16) -> [u8; 36] {
    let mut c = [0u8; 36];
    let words = [
        request_queues as u32,
        SEG_MAX,
        0xffff, // max_sectors
        128,    // cmd_per_lun
        EVENT_LEN as u32,
        SENSE_SIZE as u32,
        CDB_SIZE as u32,
    ];
    for (i, w) in words.iter().enumerate() {
        c[i * 4..i * 4 + 4].copy_from_slice(&w.to_le_bytes());
    }
    // max_channel 0, max_target, max_lun 0 (one unit per target).
    c[30..32].copy_from_slice(&(MAX_TARGETS as u16 - 1).to_le_bytes());
    c
}

/// A piece of guest memory one descriptor names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub addr: GuestAddress,
    pub len: u32,
}

/// One chain's two streams. Reused across requests (the vectors keep their
/// capacity).
#[derive(Debug, Default)]
pub struct Chain {
    pub head: u16,
    pub rd: Vec<Piece>,
    pub wr: Vec<Piece>,
    pub rd_len: u64,
    pub wr_len: u64,
}

/// Why a chain cannot be served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    #[error("device-readable descriptor after a device-writable one")]
    Order,
    #[error("descriptor outside guest memory")]
    OutOfMemory,
    #[error("chain longer than {CHAIN_MAX} descriptors")]
    TooLong,
}

impl Chain {
    /// An empty chain with room for `pieces` pieces in each stream.
    pub fn with_capacity(pieces: usize) -> Chain {
        Chain {
            rd: Vec::with_capacity(pieces),
            wr: Vec::with_capacity(pieces),
            ..Chain::default()
        }
    }

    /// Fills the streams from a chain's descriptors `(addr, len, writable)`,
    /// checking each lies in guest memory with the access it needs. On a
    /// piece outside memory the walk goes on but keeps only the writable
    /// pieces before it, so the request can still be answered when the
    /// response area is whole.
    pub fn fill<M: StreamMem>(
        &mut self,
        head: u16,
        descs: impl IntoIterator<Item = (u64, u32, bool)>,
        mem: &M,
    ) -> Result<(), ChainError> {
        self.head = head;
        self.rd.clear();
        self.wr.clear();
        (self.rd_len, self.wr_len) = (0, 0);
        let (mut err, mut seen_write, mut wr_broken) = (None, false, false);
        for (n, (addr, len, write)) in descs.into_iter().enumerate() {
            if n >= CHAIN_MAX {
                return Err(ChainError::TooLong);
            }
            if write {
                seen_write = true;
            } else if seen_write {
                return Err(ChainError::Order);
            }
            if len == 0 || (write && wr_broken) || (!write && err.is_some()) {
                continue;
            }
            let addr = GuestAddress(addr);
            if !mem.holds(addr, len as usize, write) {
                err = Some(ChainError::OutOfMemory);
                wr_broken |= write;
                continue;
            }
            let p = Piece { addr, len };
            if write {
                self.wr.push(p);
                self.wr_len += len as u64;
            } else {
                self.rd.push(p);
                self.rd_len += len as u64;
            }
        }
        err.map_or(Ok(()), Err)
    }

    /// Where the stream bytes `[offset, offset + len)` lie in guest memory
    /// when they are all in one piece (`write`: the writable stream).
    pub fn span(&self, write: bool, offset: u64, len: usize) -> Option<GuestAddress> {
        let mut at = None;
        // The first piece the range touches, and no further.
        self.each_piece(write, offset, len, |a, n| {
            at = (n == len).then_some(a);
            false
        });
        at
    }

    /// Calls `f(address, length)` for each piece of the stream bytes
    /// `[offset, offset + len)` in order (`write`: the writable stream),
    /// until `f` says false; the bytes it took.
    pub fn each_piece(
        &self,
        write: bool,
        offset: u64,
        len: usize,
        mut f: impl FnMut(GuestAddress, usize) -> bool,
    ) -> usize {
        let pieces = if write { &self.wr } else { &self.rd };
        walk(pieces, offset, len, |at, _, n| f(at, n))
    }

    /// Reads the readable stream from `offset` into `dst`; bytes read.
    pub fn read<M: StreamMem>(&self, mem: &M, offset: u64, dst: &mut [u8]) -> usize {
        walk(&self.rd, offset, dst.len(), |at, pos, n| {
            mem.read_at(at, &mut dst[pos..pos + n])
        })
    }

    /// Writes `src` into the writable stream at `offset`; bytes written.
    pub fn write<M: StreamMem>(&self, mem: &M, offset: u64, src: &[u8]) -> usize {
        walk(&self.wr, offset, src.len(), |at, pos, n| {
            mem.write_at(at, &src[pos..pos + n])
        })
    }
}

/// Guest memory a chain's streams are copied through: `vm-memory`'s map,
/// or the request path's view of it ([`GuestMem`]'s `copy_out`, `copy_in`
/// and `holds`), whose translation is a scan of a few regions where
/// `vm-memory`'s `read_slice` / `write_slice` search the map through
/// iterator adapters for each piece (a command's header, response and
/// data are three or more such calls).
pub trait StreamMem {
    /// Copies `dst.len()` bytes from `at`; false if they are not all
    /// guest memory.
    fn read_at(&self, at: GuestAddress, dst: &mut [u8]) -> bool;
    /// Copies `src` to `at`; false if it is not all guest memory.
    fn write_at(&self, at: GuestAddress, src: &[u8]) -> bool;
    /// Whether `[at, at + len)` is guest memory the device may read (or
    /// write, when `write`).
    fn holds(&self, at: GuestAddress, len: usize, write: bool) -> bool;
}

/// The access a stream piece needs.
fn perm(write: bool) -> Permissions {
    if write {
        Permissions::Write
    } else {
        Permissions::Read
    }
}

impl StreamMem for GuestMemoryMmap {
    fn holds(&self, at: GuestAddress, len: usize, write: bool) -> bool {
        self.check_range(at, len, perm(write))
    }

    fn read_at(&self, at: GuestAddress, dst: &mut [u8]) -> bool {
        self.read_slice(dst, at).is_ok()
    }

    fn write_at(&self, at: GuestAddress, src: &[u8]) -> bool {
        self.write_slice(src, at).is_ok()
    }
}

impl StreamMem for GuestMem {
    fn holds(&self, at: GuestAddress, len: usize, write: bool) -> bool {
        GuestMem::holds(self, at, len, perm(write))
    }

    fn read_at(&self, at: GuestAddress, dst: &mut [u8]) -> bool {
        self.copy_out(at, dst)
    }

    fn write_at(&self, at: GuestAddress, src: &[u8]) -> bool {
        self.copy_in(at, src)
    }
}

/// Calls `f(guest address, position in the caller's buffer, n)` over the
/// stream bytes `[offset, offset + len)`; stops at the stream's end or
/// when `f` fails. Returns the bytes covered.
fn walk(
    pieces: &[Piece],
    offset: u64,
    len: usize,
    mut f: impl FnMut(GuestAddress, usize, usize) -> bool,
) -> usize {
    let (mut skip, mut done) = (offset, 0usize);
    for p in pieces {
        if done == len {
            break;
        }
        if skip >= p.len as u64 {
            skip -= p.len as u64;
            continue;
        }
        let n = ((p.len as u64 - skip) as usize).min(len - done);
        if !f(GuestAddress(p.addr.0 + skip), done, n) {
            break;
        }
        done += n;
        skip = 0;
    }
    done
}

/// Where a command goes: `lun[0] == 1`, the target in `lun[1]`, the LUN
/// in SAM's single-level format (peripheral or flat) in bytes 2..4.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Address {
    pub target: u8,
    pub lun: u64,
}

/// Decodes the 8-byte virtio-scsi LUN field; `None` when it addresses no
/// target of ours (a bad first byte, a target out of range, a multi-level
/// LUN).
pub fn decode_lun(b: &[u8; 8]) -> Option<Address> {
    if b[0] != 1 || b[1] as usize >= MAX_TARGETS || b[4..].iter().any(|&x| x != 0) {
        return None;
    }
    if b[2] >> 6 > 1 {
        return None;
    }
    Some(Address {
        target: b[1],
        lun: ((b[2] as u64 & 0x3f) << 8) | b[3] as u64,
    })
}

/// A decoded `virtio_scsi_cmd_req`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CmdHeader {
    pub lun: [u8; 8],
    pub tag: u64,
    pub cdb: [u8; CDB_SIZE],
}

/// Reads the command header; `None` when the chain cannot hold a command
/// (readable stream shorter than the header, or no room for the
/// response).
pub fn cmd_header<M: StreamMem>(c: &Chain, mem: &M) -> Option<CmdHeader> {
    let mut b = [0u8; CMD_REQ_LEN as usize];
    if c.wr_len < CMD_RESP_LEN || c.read(mem, 0, &mut b) != b.len() {
        return None;
    }
    let mut h = CmdHeader {
        lun: [0; 8],
        tag: u64::from_le_bytes(b[8..16].try_into().unwrap_or_default()),
        cdb: [0; CDB_SIZE],
    };
    h.lun.copy_from_slice(&b[..8]);
    h.cdb.copy_from_slice(&b[19..]);
    Some(h)
}

/// `struct virtio_scsi_cmd_resp`.
#[derive(Clone, Copy, Debug)]
pub struct CmdResp<'a> {
    pub response: u8,
    pub status: u8,
    pub resid: u32,
    pub sense: &'a [u8],
}

impl CmdResp<'_> {
    /// A response with no SCSI status (a transport answer).
    pub fn transport(response: u8) -> CmdResp<'static> {
        CmdResp {
            response,
            status: 0,
            resid: 0,
            sense: &[],
        }
    }

    /// The bytes of [`Self::encode`] that carry something: the fixed
    /// fields and the sense bytes (`sense_len` tells the driver how many
    /// of the 96 it reads, virtio 1.2 5.6.6.1).
    pub fn used_bytes(&self) -> usize {
        RESP_FIXED + self.sense.len().min(SENSE_SIZE)
    }

    pub fn encode(&self) -> [u8; CMD_RESP_LEN as usize] {
        let mut b = [0u8; CMD_RESP_LEN as usize];
        let n = self.sense.len().min(SENSE_SIZE);
        b[0..4].copy_from_slice(&(n as u32).to_le_bytes());
        b[4..8].copy_from_slice(&self.resid.to_le_bytes());
        b[10] = self.status;
        b[11] = self.response;
        b[RESP_FIXED..RESP_FIXED + n].copy_from_slice(&self.sense[..n]);
        b
    }
}

/// A control-queue request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CtrlReq {
    Tmf {
        subtype: u32,
        lun: [u8; 8],
        tag: u64,
    },
    /// AN_QUERY / AN_SUBSCRIBE: no asynchronous events are offered.
    An { lun: [u8; 8] },
    /// Too short, or an unknown type: refused without an answer.
    Bad,
}

/// Reads a control request and checks the chain has room for its answer.
pub fn ctrl_req<M: StreamMem>(c: &Chain, mem: &M) -> CtrlReq {
    let mut b = [0u8; TMF_REQ_LEN];
    let n = c.read(mem, 0, &mut b);
    let typ = u32::from_le_bytes(b[0..4].try_into().unwrap_or_default());
    let mut lun = [0u8; 8];
    match typ {
        vs::VIRTIO_SCSI_T_TMF if n == TMF_REQ_LEN && c.wr_len >= TMF_RESP_LEN => {
            lun.copy_from_slice(&b[8..16]);
            CtrlReq::Tmf {
                subtype: u32::from_le_bytes(b[4..8].try_into().unwrap_or_default()),
                lun,
                tag: u64::from_le_bytes(b[16..24].try_into().unwrap_or_default()),
            }
        }
        vs::VIRTIO_SCSI_T_AN_QUERY | vs::VIRTIO_SCSI_T_AN_SUBSCRIBE
            if n >= AN_REQ_LEN && c.wr_len >= AN_RESP_LEN =>
        {
            lun.copy_from_slice(&b[4..12]);
            CtrlReq::An { lun }
        }
        _ => CtrlReq::Bad,
    }
}

/// A hot-plug event for the event queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    pub target: u8,
    /// `VIRTIO_SCSI_EVT_RESET_RESCAN` (added) or `_REMOVED`.
    pub reason: u32,
}

impl Event {
    pub fn added(target: u8) -> Event {
        Event {
            target,
            reason: vs::VIRTIO_SCSI_EVT_RESET_RESCAN,
        }
    }

    pub fn removed(target: u8) -> Event {
        Event {
            target,
            reason: vs::VIRTIO_SCSI_EVT_RESET_REMOVED,
        }
    }

    /// `struct virtio_scsi_event`: TRANSPORT_RESET for LUN 0 of the
    /// target, with EVENTS_MISSED when earlier events found no buffer.
    pub fn encode(&self, missed: bool) -> [u8; EVENT_LEN as usize] {
        let mut b = [0u8; EVENT_LEN as usize];
        let mut ev = vs::VIRTIO_SCSI_T_TRANSPORT_RESET;
        if missed {
            ev |= vs::VIRTIO_SCSI_T_EVENTS_MISSED;
        }
        b[0..4].copy_from_slice(&ev.to_le_bytes());
        // LUN 0 as QEMU writes it (below 256: no address method bits);
        // Linux reads bytes 2..4 unmasked.
        b[4..8].copy_from_slice(&[1, self.target, 0, 0]);
        b[12..16].copy_from_slice(&self.reason.to_le_bytes());
        b
    }
}

#[cfg(test)]
mod tests;
