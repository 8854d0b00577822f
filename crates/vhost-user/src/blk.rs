//! virtio-blk as the device sees it: feature bits, the config space built
//! from a bdev, and the descriptor-chain walker that turns one available
//! chain into a validated [`Request`] (header, data segments, status byte).
//!
//! Nothing here touches a bdev or a socket: the walker reads guest memory
//! through `vm-memory` (which bounds every access to a mapped region) and is
//! unit-tested and fuzzed with an anonymous guest memory.

use vm_memory::{Address, Bytes, GuestAddress, GuestMemory, Permissions};

use crate::guest::{GuestMem, HostRange};

/// virtio-blk feature bits (virtio 1.2, 5.2.3).
pub mod feature {
    pub const SIZE_MAX: u64 = 1 << 1;
    pub const SEG_MAX: u64 = 1 << 2;
    pub const RO: u64 = 1 << 5;
    pub const BLK_SIZE: u64 = 1 << 6;
    pub const FLUSH: u64 = 1 << 9;
    pub const TOPOLOGY: u64 = 1 << 10;
    pub const CONFIG_WCE: u64 = 1 << 11;
    pub const MQ: u64 = 1 << 12;
    pub const DISCARD: u64 = 1 << 13;
    pub const WRITE_ZEROES: u64 = 1 << 14;
    pub const INDIRECT_DESC: u64 = 1 << 28;
    pub const EVENT_IDX: u64 = 1 << 29;
    /// vhost-user's own bit: the frontend may send GET_PROTOCOL_FEATURES.
    pub const PROTOCOL_FEATURES: u64 = 1 << 30;
    pub const VERSION_1: u64 = 1 << 32;
    /// VIRTIO_F_RING_PACKED: offered when the controller was created with
    /// `packed_ring` ([`crate::packed`]).
    pub const RING_PACKED: u64 = 1 << 34;
}

/// Request types (virtio 1.2, 5.2.6).
pub mod req_type {
    pub const IN: u32 = 0;
    pub const OUT: u32 = 1;
    pub const FLUSH: u32 = 4;
    pub const GET_ID: u32 = 8;
    pub const DISCARD: u32 = 11;
    pub const WRITE_ZEROES: u32 = 13;
}

/// Status byte values.
pub mod status {
    pub const OK: u8 = 0;
    pub const IOERR: u8 = 1;
    pub const UNSUPP: u8 = 2;
}

/// virtio-blk addresses in 512-byte sectors whatever the block size.
pub const SECTOR_SIZE: u64 = 512;
/// Length of `struct virtio_blk_outhdr`.
pub const HEADER_LEN: u32 = 16;
/// Length of `struct virtio_blk_config` (through `unused1`).
pub const CONFIG_LEN: usize = 60;
/// Bytes of one discard / write-zeroes range.
pub const RANGE_LEN: u32 = 16;
/// Length of the serial GET_ID returns.
pub const ID_LEN: usize = 20;
/// Data segments per request: what the bdev layer takes in one vectored
/// I/O (`ustor_bdev` MAX_SEGMENTS), advertised as SEG_MAX.
pub const SEG_MAX: usize = 16;
/// Largest data segment advertised (SIZE_MAX).
pub const SIZE_MAX: u32 = 1 << 20;
/// Discard / write-zeroes ranges per request.
pub const MAX_RANGES: u32 = 16;
/// Descriptors per chain we accept (longer ones get IOERR).
pub const CHAIN_MAX: usize = SEG_MAX + 4;

/// What the config space and feature set are built from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlkGeometry {
    pub block_size: u32,
    pub num_blocks: u64,
    pub num_queues: u16,
    pub read_only: bool,
    pub flush: bool,
    pub discard: bool,
    pub write_zeroes: bool,
    /// Optimal I/O size in blocks (0 = none).
    pub opt_io_blocks: u32,
}

impl BlkGeometry {
    /// Device feature bits offered to the driver.
    pub fn features(&self) -> u64 {
        use feature::*;
        let mut f = SIZE_MAX
            | SEG_MAX
            | BLK_SIZE
            | TOPOLOGY
            | MQ
            | INDIRECT_DESC
            | EVENT_IDX
            | VERSION_1
            | PROTOCOL_FEATURES;
        if self.read_only {
            f |= RO;
        }
        if self.flush {
            f |= FLUSH | CONFIG_WCE;
        }
        if self.discard && !self.read_only {
            f |= DISCARD;
        }
        if self.write_zeroes && !self.read_only {
            f |= WRITE_ZEROES;
        }
        f
    }

    /// Capacity in 512-byte sectors.
    pub fn capacity_sectors(&self) -> u64 {
        self.num_blocks * self.block_size as u64 / SECTOR_SIZE
    }

    /// `struct virtio_blk_config`, little endian; `writeback` is the
    /// current cache mode (CONFIG_WCE).
    pub fn config(&self, writeback: bool) -> [u8; CONFIG_LEN] {
        let mut c = [0u8; CONFIG_LEN];
        let per_block = (self.block_size as u64 / SECTOR_SIZE).max(1) as u32;
        c[0..8].copy_from_slice(&self.capacity_sectors().to_le_bytes());
        c[8..12].copy_from_slice(&SIZE_MAX.to_le_bytes());
        c[12..16].copy_from_slice(&(SEG_MAX as u32).to_le_bytes());
        c[20..24].copy_from_slice(&self.block_size.to_le_bytes());
        // physical_block_exp: logical blocks per physical block (log2).
        c[24] = 0;
        c[26..28].copy_from_slice(&1u16.to_le_bytes());
        c[28..32].copy_from_slice(&self.opt_io_blocks.to_le_bytes());
        c[32] = writeback as u8;
        c[34..36].copy_from_slice(&self.num_queues.to_le_bytes());
        let max_sectors = (u32::MAX / SECTOR_SIZE as u32) & !(per_block - 1);
        if self.discard {
            c[36..40].copy_from_slice(&max_sectors.to_le_bytes());
            c[40..44].copy_from_slice(&MAX_RANGES.to_le_bytes());
            c[44..48].copy_from_slice(&per_block.to_le_bytes());
        }
        if self.write_zeroes {
            c[48..52].copy_from_slice(&max_sectors.to_le_bytes());
            c[52..56].copy_from_slice(&MAX_RANGES.to_le_bytes());
            c[56] = self.discard as u8;
        }
        c
    }
}

/// One descriptor as the walker sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Desc {
    pub addr: u64,
    pub len: u32,
    /// Device-writable (VIRTQ_DESC_F_WRITE).
    pub write: bool,
}

/// A piece of guest memory the request moves data through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seg {
    pub addr: GuestAddress,
    pub len: u32,
    /// From a device-writable descriptor.
    pub write: bool,
}

/// What a request asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Read,
    Write,
    Flush,
    GetId,
    Discard,
    WriteZeroes,
    /// A type we do not implement: answered UNSUPP.
    Other(u32),
}

/// A validated request: every segment lies in guest memory and has the
/// direction its kind needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub kind: Kind,
    pub sector: u64,
    pub segs: Vec<Seg>,
    /// Total bytes of `segs`.
    pub data_len: u32,
    /// Where the status byte goes.
    pub status: GuestAddress,
}

/// Why a chain is not a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    /// No device-writable last byte for the status: the request cannot
    /// even be failed; it is returned used with length 0.
    #[error("chain has no status byte")]
    NoStatus,
    /// Answered IOERR through the status byte at `.0`.
    #[error("malformed request: {1}")]
    Malformed(GuestAddress, &'static str),
}

impl ChainError {
    /// The status byte address, when the request can be failed properly.
    pub fn status_addr(&self) -> Option<GuestAddress> {
        match self {
            ChainError::NoStatus => None,
            ChainError::Malformed(a, _) => Some(*a),
        }
    }
}

/// Room for one chain as [`collect_chain`] copies it: one more than
/// [`CHAIN_MAX`], so an overlong chain is seen as such.
pub type ChainBuf = [Desc; CHAIN_MAX + 1];

/// An empty [`ChainBuf`].
pub const fn chain_buf() -> ChainBuf {
    [Desc {
        addr: 0,
        len: 0,
        write: false,
    }; CHAIN_MAX + 1]
}

/// Copies a chain popped from a split ring into `out` and returns how
/// many descriptors it holds (at most `out.len()`: a longer chain stops
/// there and [`parse_chain`] refuses it). `virtio-queue`'s iterator
/// follows indirect tables and ends the chain at a descriptor outside the
/// table, a loop (more descriptors than the table has) or one it cannot
/// read.
pub fn collect_chain<I>(chain: I, out: &mut [Desc]) -> usize
where
    I: IntoIterator<Item = virtio_queue::desc::split::Descriptor>,
{
    let mut k = 0;
    for d in chain {
        if k == out.len() {
            break;
        }
        out[k] = Desc {
            addr: d.addr().0,
            len: d.len(),
            write: d.is_write_only(),
        };
        k += 1;
    }
    k
}

/// Reads the chain with head `head` from the descriptor table at `table`
/// (`table_len` entries) into `out`, and returns how many descriptors it
/// holds: the split ring's take path (and a request resubmitted after a
/// restart). The same walk as `virtio-queue`'s chain iterator: NEXT links
/// within the table, at most `table_len` steps (a loop ends there), one
/// indirect table (a descriptor with INDIRECT, its length a multiple of
/// 16, not inside another indirect table), and the chain ends at an
/// index outside its table, at a descriptor it cannot read, when its
/// lengths pass 4 GiB, or when `out` is full.
///
/// The table is translated once (one region lookup per table, not one
/// per descriptor); a table across regions is read descriptor by
/// descriptor.
pub fn read_chain(
    mem: &GuestMem,
    table: GuestAddress,
    table_len: u16,
    head: u16,
    out: &mut [Desc],
) -> usize {
    const F_NEXT: u16 = 1;
    const F_WRITE: u16 = 2;
    const F_INDIRECT: u16 = 4;
    let mut t = Table::new(mem, table, table_len);
    let (mut idx, mut ttl, mut bytes, mut indirect) = (head, table_len, 0u32, false);
    let mut k = 0;
    while ttl > 0 && idx < t.len && k < out.len() {
        let Some(raw) = t.read(mem, idx) else { break };
        let addr = u64::from_le_bytes(raw[0..8].try_into().unwrap_or_default());
        let dlen = u32::from_le_bytes(raw[8..12].try_into().unwrap_or_default());
        let flags = u16::from_le_bytes(raw[12..14].try_into().unwrap_or_default());
        let next = u16::from_le_bytes(raw[14..16].try_into().unwrap_or_default());
        if flags & F_INDIRECT != 0 {
            if indirect || dlen % 16 != 0 || dlen / 16 > u16::MAX as u32 {
                break;
            }
            indirect = true;
            t = Table::new(mem, GuestAddress(addr), (dlen / 16) as u16);
            (idx, ttl) = (0, t.len);
            continue;
        }
        let Some(b) = bytes.checked_add(dlen) else {
            break;
        };
        bytes = b;
        out[k] = Desc {
            addr,
            len: dlen,
            write: flags & F_WRITE != 0,
        };
        k += 1;
        if flags & F_NEXT == 0 {
            break;
        }
        idx = next;
        ttl -= 1;
    }
    k
}

/// A descriptor table: translated once when it lies in one region.
struct Table<'a> {
    at: GuestAddress,
    len: u16,
    range: Option<HostRange<'a>>,
}

impl<'a> Table<'a> {
    fn new(mem: &'a GuestMem, at: GuestAddress, len: u16) -> Self {
        Table {
            at,
            len,
            range: mem.range(at, len as usize * 16),
        }
    }

    fn read(&self, mem: &GuestMem, i: u16) -> Option<[u8; 16]> {
        let off = i as usize * 16;
        // Two 8-byte loads where the table is aligned (the split ring's
        // is, virtio 1.2 2.7.5), three and shifts where it is not (an
        // indirect table may not be); a byte copy only for a table across
        // regions.
        if let Some(r) = &self.range {
            return r.load_16(off);
        }
        let mut raw = [0u8; 16];
        read_guest(mem, &mut raw, self.at.checked_add(off as u64)?).then_some(raw)
    }
}

/// Walks one chain (`descs` in order, already bounded in length and loop
/// free by the queue's iterator) into a [`Request`]: a 16-byte device-
/// readable header, data, and a device-writable last byte for the status.
/// `segs` is reused scratch space (no allocation once warm).
pub fn parse_chain(
    descs: &[Desc],
    mem: &GuestMem,
    mut segs: Vec<Seg>,
) -> Result<Request, (ChainError, Vec<Seg>)> {
    segs.clear();
    let last = match descs.last() {
        Some(d) if d.write && d.len >= 1 => *d,
        _ => return Err((ChainError::NoStatus, segs)),
    };
    let status = GuestAddress(last.addr.wrapping_add(last.len as u64 - 1));
    if mem.slice(status, 1).is_none() {
        return Err((ChainError::NoStatus, segs));
    }
    let bad = |why: &'static str, segs| Err((ChainError::Malformed(status, why), segs));
    if descs.len() > CHAIN_MAX {
        return bad("chain too long", segs);
    }
    let mut hdr = [0u8; HEADER_LEN as usize];
    let mut got = 0usize;
    let n = descs.len();
    for (i, d) in descs.iter().enumerate() {
        // The last descriptor's final byte is the status.
        let len = if i + 1 == n { d.len - 1 } else { d.len };
        let mut addr = d.addr;
        let mut len = len;
        if got < hdr.len() && len > 0 {
            if d.write {
                return bad("header in a device-writable descriptor", segs);
            }
            let take = (hdr.len() - got).min(len as usize);
            let whole = if got == 0 && take == hdr.len() {
                header_load(mem, GuestAddress(addr))
            } else {
                None
            };
            if let Some(h) = whole {
                hdr = h;
            } else if !read_guest(mem, &mut hdr[got..got + take], GuestAddress(addr)) {
                return bad("header outside guest memory", segs);
            }
            got += take;
            addr = addr.wrapping_add(take as u64);
            len -= take as u32;
        }
        if len == 0 {
            continue;
        }
        if segs.len() == SEG_MAX {
            return bad("more data segments than SEG_MAX", segs);
        }
        segs.push(Seg {
            addr: GuestAddress(addr),
            len,
            write: d.write,
        });
    }
    if got < hdr.len() {
        return bad("header shorter than 16 bytes", segs);
    }
    let typ = u32::from_le_bytes(hdr[0..4].try_into().unwrap_or_default());
    let sector = u64::from_le_bytes(hdr[8..16].try_into().unwrap_or_default());
    let kind = match typ {
        req_type::IN => Kind::Read,
        req_type::OUT => Kind::Write,
        req_type::FLUSH => Kind::Flush,
        req_type::GET_ID => Kind::GetId,
        req_type::DISCARD => Kind::Discard,
        req_type::WRITE_ZEROES => Kind::WriteZeroes,
        t => Kind::Other(t),
    };
    let device_writes = matches!(kind, Kind::Read | Kind::GetId);
    let mut data_len = 0u32;
    for s in &segs {
        if !matches!(kind, Kind::Flush | Kind::Other(_)) && s.write != device_writes {
            return bad("data descriptor with the wrong direction", segs);
        }
        if !mem.holds(s.addr, s.len as usize, Permissions::ReadWrite) {
            return bad("data outside guest memory", segs);
        }
        data_len = match data_len.checked_add(s.len) {
            Some(v) => v,
            None => return bad("data longer than 4 GiB", segs),
        };
    }
    Ok(Request {
        kind,
        sector,
        segs,
        data_len,
        status,
    })
}

/// The 16-byte header at `at` in one volatile load, when it lies in one
/// region (the common case): no `VolatileSlice` and its copy routine
/// (callgrind, libblkio's unaligned headers: parse_chain 300 -> 278
/// instructions a request; the volatile array load is still 16 byte
/// loads). `None`: the caller copies it through the map.
#[inline]
fn header_load(mem: &GuestMem, at: GuestAddress) -> Option<[u8; HEADER_LEN as usize]> {
    mem.range(at, HEADER_LEN as usize)?.load_16(0)
}

/// Reads `buf` from guest memory at `at`: one translation, or through
/// the map when it crosses regions.
#[inline(never)]
fn read_guest(mem: &GuestMem, buf: &mut [u8], at: GuestAddress) -> bool {
    // The fallback of `header_load` (a header split over descriptors
    // or regions): out of line, so the common path in
    // parse_chain stays small.
    mem.copy_out(at, buf)
}

/// One discard / write-zeroes range (`struct virtio_blk_discard_write_zeroes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Range {
    pub sector: u64,
    pub num_sectors: u32,
    /// Write-zeroes may deallocate (VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP).
    pub unmap: bool,
}

/// Reads the ranges of a discard / write-zeroes request (at most
/// [`MAX_RANGES`], each 16 bytes, reserved flag bits zero).
pub fn read_ranges<M: GuestMemory>(
    req: &Request,
    mem: &M,
    out: &mut Vec<Range>,
) -> Result<(), &'static str> {
    out.clear();
    if req.data_len == 0 || req.data_len % RANGE_LEN != 0 {
        return Err("range list length not a multiple of 16");
    }
    if req.data_len / RANGE_LEN > MAX_RANGES {
        return Err("more ranges than advertised");
    }
    let mut raw = [0u8; RANGE_LEN as usize];
    let mut have = 0usize;
    for s in &req.segs {
        let mut off = 0u32;
        while off < s.len {
            let take = (raw.len() - have).min((s.len - off) as usize);
            let at = GuestAddress(s.addr.0 + off as u64);
            mem.read_slice(&mut raw[have..have + take], at)
                .map_err(|_| "range outside guest memory")?;
            have += take;
            off += take as u32;
            if have == raw.len() {
                let flags = u32::from_le_bytes(raw[12..16].try_into().unwrap_or_default());
                if flags & !1 != 0 {
                    return Err("reserved range flags set");
                }
                out.push(Range {
                    sector: u64::from_le_bytes(raw[0..8].try_into().unwrap_or_default()),
                    num_sectors: u32::from_le_bytes(raw[8..12].try_into().unwrap_or_default()),
                    unmap: flags & 1 != 0,
                });
                have = 0;
            }
        }
    }
    Ok(())
}

/// Writes `id` (GET_ID: the serial, zero-padded to 20 bytes, truncated to
/// what the driver gave) into the request's segments; bytes written.
pub fn write_id<M: GuestMemory>(req: &Request, mem: &M, id: &str) -> Result<u32, &'static str> {
    let mut serial = [0u8; ID_LEN];
    let n = id.len().min(ID_LEN);
    serial[..n].copy_from_slice(&id.as_bytes()[..n]);
    let mut done = 0usize;
    for s in &req.segs {
        if done == ID_LEN {
            break;
        }
        let take = (ID_LEN - done).min(s.len as usize);
        mem.write_slice(&serial[done..done + take], s.addr)
            .map_err(|_| "id buffer outside guest memory")?;
        done += take;
    }
    Ok(done as u32)
}

#[cfg(test)]
mod tests;
