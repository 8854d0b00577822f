//! The PDU group: many protocol messages (PDUs, replies) collected for one
//! `sendmsg`. Header bytes are copied into an arena the group owns; payload
//! is held by value ([`IoBuf`]) or by pointer into caller-owned memory, never
//! copied. The group is allocated once per connection and reused.
//!
//! The group is a few words (its arrays are boxed), so handing it to the
//! ring by value when the socket is full costs no large move.

use std::io;
use std::os::fd::RawFd;

use ustor_runtime::{ops, IoBuf};

/// Header arena bytes of a default group: room for every header and digest
/// of a full group (at most `ops::MAX_IOV` PDUs, each under 100 bytes of
/// headers).
pub const ARENA_LEN: usize = 8192;

/// Most segments any group holds (one direct `sendmsg`; the ring fallback
/// sends at most `ops::MAX_IOV` of them per call and goes on).
pub const MAX_GROUP_IOV: usize = 128;

#[derive(Clone, Copy)]
enum Seg {
    Arena {
        off: u16,
        len: u16,
    },
    Data {
        slot: u8,
        off: u32,
        len: u32,
    },
    /// Caller-owned memory (an initiator's write data in a bdev I/O's
    /// buffers); see [`PduGroup::push_raw`].
    Raw {
        ptr: *const u8,
        len: u32,
    },
}

/// A PDU Group: header bytes in an owned arena and payload buffers by
/// value, described as segments for one `sendmsg`.
pub struct PduGroup {
    arena: IoBuf,
    arena_len: usize,
    used: usize,
    segs: Box<[Seg]>,
    nsegs: usize,
    data: Box<[Option<IoBuf>]>,
    ndata: usize,
    pdus: u32,
    bytes: usize,
    urgent: bool,
    /// Bytes already sent after a partial `sendmsg`.
    skip: usize,
    /// Bytes pushed by [`PduGroup::push_raw`] (caller-owned payload).
    raw_bytes: usize,
    /// Resources the protocol holds for this group, released once the
    /// kernel is done with its memory; set by [`PduGroup::want_zero_copy`].
    holds: u32,
}

impl Default for PduGroup {
    fn default() -> Self {
        Self::new()
    }
}

impl PduGroup {
    /// A group of `ops::MAX_IOV` segments and an [`ARENA_LEN`] arena (what
    /// NVMe/TCP queues use).
    pub fn new() -> PduGroup {
        Self::with_capacity(ops::MAX_IOV, ARENA_LEN)
    }

    /// A group of up to `segs` segments (at most [`MAX_GROUP_IOV`]) and
    /// `arena_len` header bytes (at most 64 KiB).
    pub fn with_capacity(segs: usize, arena_len: usize) -> PduGroup {
        assert!(
            segs > 0 && segs <= MAX_GROUP_IOV,
            "group segments out of range"
        );
        assert!(arena_len > 0 && arena_len <= u16::MAX as usize + 1);
        PduGroup {
            arena: IoBuf::heap(arena_len),
            arena_len,
            used: 0,
            segs: vec![Seg::Arena { off: 0, len: 0 }; segs].into_boxed_slice(),
            nsegs: 0,
            data: (0..segs).map(|_| None).collect(),
            ndata: 0,
            pdus: 0,
            bytes: 0,
            urgent: false,
            skip: 0,
            raw_bytes: 0,
            holds: 0,
        }
    }

    pub fn pdus(&self) -> u32 {
        self.pdus
    }
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    pub fn is_empty(&self) -> bool {
        self.pdus == 0
    }
    pub fn urgent(&self) -> bool {
        self.urgent
    }

    /// Whether a PDU of `hdr_bytes` header/trailer bytes in `pieces` arena
    /// pieces and `ndata` payload segments fits.
    pub fn fits(&self, hdr_bytes: usize, pieces: usize, ndata: usize) -> bool {
        self.used + hdr_bytes <= self.arena_len && self.nsegs + pieces + ndata <= self.segs.len()
    }

    /// Appends header (or digest) bytes; merges with a preceding arena piece.
    pub fn push_bytes(&mut self, b: &[u8]) {
        assert!(
            self.used + b.len() <= self.arena_len,
            "PDU group arena overflow"
        );
        let off = self.used;
        self.arena.spare_mut()[off..off + b.len()].copy_from_slice(b);
        self.used += b.len();
        self.bytes += b.len();
        if let Some(Seg::Arena { off: o, len }) = self.segs[..self.nsegs].last_mut() {
            if *o as usize + *len as usize == off {
                *len += b.len() as u16;
                return;
            }
        }
        assert!(self.nsegs < self.segs.len(), "PDU group iovec overflow");
        self.segs[self.nsegs] = Seg::Arena {
            off: off as u16,
            len: b.len() as u16,
        };
        self.nsegs += 1;
    }

    /// Appends `buf[off..off+len]` as payload; the group owns `buf` until
    /// it is sent.
    pub fn push_data(&mut self, buf: IoBuf, off: usize, len: usize) {
        assert!(off + len <= buf.len(), "payload range beyond its buffer");
        assert!(self.nsegs < self.segs.len() && self.ndata < self.data.len());
        self.segs[self.nsegs] = Seg::Data {
            slot: self.ndata as u8,
            off: off as u32,
            len: len as u32,
        };
        self.nsegs += 1;
        self.data[self.ndata] = Some(buf);
        self.ndata += 1;
        self.bytes += len;
    }

    /// Appends caller-owned memory as payload, so write data leaves from the
    /// bdev I/O's own buffers without a copy.
    ///
    /// # Safety
    /// `ptr..ptr + len` must stay valid and unchanged until the `sendmsg`
    /// that carries this group has completed and the group was cleared.
    pub unsafe fn push_raw(&mut self, ptr: *const u8, len: usize) {
        assert!(self.nsegs < self.segs.len(), "PDU group iovec overflow");
        assert!(len <= u32::MAX as usize);
        self.segs[self.nsegs] = Seg::Raw {
            ptr,
            len: len as u32,
        };
        self.nsegs += 1;
        self.bytes += len;
        self.raw_bytes += len;
    }

    /// Asks for this group to leave with a zero-copy send (SENDMSG_ZC, when
    /// the protocol has a [`crate::driver::Protocol::zero_copy_done`] sink
    /// and the kernel the op), and counts one more hold: the sink gets the
    /// holds back once the kernel no longer reads the group's memory, so
    /// the protocol keeps what it points at unchanged until then.
    pub fn want_zero_copy(&mut self) {
        self.holds += 1;
    }

    /// Holds taken with [`PduGroup::want_zero_copy`] (0: a plain send).
    pub fn holds(&self) -> u32 {
        self.holds
    }

    /// Payload bytes pushed by reference ([`PduGroup::push_raw`]).
    pub fn raw_bytes(&self) -> usize {
        self.raw_bytes
    }

    /// Marks the end of one PDU (counted for the degree).
    pub fn end_pdu(&mut self, urgent: bool) {
        self.pdus += 1;
        self.urgent |= urgent;
    }

    /// Records `n` more bytes sent; true when the whole group is out.
    pub fn advance(&mut self, n: usize) -> bool {
        self.skip += n;
        debug_assert!(self.skip <= self.bytes, "sent more than the group holds");
        self.skip >= self.bytes
    }

    /// Sends the whole group and returns it cleared (see
    /// [`crate::sender::send_all`]).
    pub async fn send_all(self, fd: RawFd, calls: &mut u64) -> (io::Result<()>, PduGroup) {
        crate::sender::send_all(fd, self, calls).await
    }

    /// Empties the group, returning payload buffers to their pools.
    pub fn clear(&mut self) {
        for d in self.data.iter_mut().take(self.ndata) {
            *d = None;
        }
        self.used = 0;
        self.nsegs = 0;
        self.ndata = 0;
        self.pdus = 0;
        self.bytes = 0;
        self.urgent = false;
        self.skip = 0;
        self.raw_bytes = 0;
        self.holds = 0;
    }

    /// Fills `out` with the unsent segments, as many as it holds; returns
    /// how many.
    pub fn fill_iovecs(&self, out: &mut [libc::iovec]) -> usize {
        let mut skip = self.skip;
        let mut n = 0;
        for seg in &self.segs[..self.nsegs] {
            if n == out.len() {
                break;
            }
            let (ptr, len) = match *seg {
                // SAFETY: arena pieces lie inside the arena (checked on push).
                Seg::Arena { off, len } => (
                    unsafe { self.arena.as_ptr().add(off as usize) },
                    len as usize,
                ),
                Seg::Data { slot, off, len } => match &self.data[slot as usize] {
                    // SAFETY: off + len <= buf.len(), checked on push.
                    Some(b) => (unsafe { b.as_ptr().add(off as usize) }, len as usize),
                    None => continue,
                },
                Seg::Raw { ptr, len } => (ptr, len as usize),
            };
            if skip >= len {
                skip -= len;
                continue;
            }
            // SAFETY: skip < len keeps the pointer inside the segment.
            out[n] = libc::iovec {
                iov_base: unsafe { ptr.add(skip) } as *mut _,
                iov_len: len - skip,
            };
            skip = 0;
            n += 1;
        }
        n
    }
}

impl ops::IoVecs for PduGroup {
    fn iovecs(&self, out: &mut [libc::iovec; ops::MAX_IOV]) -> usize {
        self.fill_iovecs(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iov0() -> [libc::iovec; MAX_GROUP_IOV] {
        [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; MAX_GROUP_IOV]
    }

    /// The bytes the unsent iovecs describe, in order.
    fn unsent(g: &PduGroup) -> Vec<u8> {
        let mut iov = iov0();
        let n = g.fill_iovecs(&mut iov);
        let mut v = Vec::new();
        for i in &iov[..n] {
            // SAFETY: the iovecs point into the group's live buffers.
            v.extend_from_slice(unsafe {
                std::slice::from_raw_parts(i.iov_base as *const u8, i.iov_len)
            });
        }
        v
    }

    fn data(b: &[u8]) -> IoBuf {
        let mut d = IoBuf::heap(b.len());
        d.set_len(b.len());
        d.copy_from_slice(b);
        d
    }

    #[test]
    fn headers_merge_and_payload_is_held_by_value() {
        let mut g = PduGroup::with_capacity(8, 64);
        g.push_bytes(b"h1");
        g.end_pdu(false);
        g.push_bytes(b"h2");
        g.push_data(data(b"PAYLOAD"), 1, 4);
        g.end_pdu(true);
        assert_eq!((g.pdus(), g.bytes(), g.urgent()), (2, 8, true));
        assert_eq!(unsent(&g), b"h1h2AYLO");
        let mut iov = iov0();
        assert_eq!(g.fill_iovecs(&mut iov), 2, "adjacent headers merged");
    }

    #[test]
    fn advance_over_partial_sends() {
        let mut g = PduGroup::with_capacity(8, 64);
        g.push_bytes(b"abc");
        g.push_data(data(b"defgh"), 0, 5);
        g.push_bytes(b"ij");
        g.end_pdu(false);
        let whole = unsent(&g);
        assert_eq!(whole, b"abcdefghij");
        // Partial sends land inside, at and across segment boundaries.
        let mut sent = 0;
        for step in [2, 1, 4, 2] {
            assert!(!g.advance(step));
            sent += step;
            assert_eq!(unsent(&g), &whole[sent..]);
        }
        assert!(g.advance(1));
        g.clear();
        assert!(g.is_empty() && g.bytes() == 0);
        assert_eq!(unsent(&g), b"");
    }

    #[test]
    fn fits_counts_segments_and_arena() {
        let mut g = PduGroup::with_capacity(3, 8);
        assert!(g.fits(8, 1, 2));
        assert!(!g.fits(9, 1, 0));
        assert!(!g.fits(1, 1, 3));
        g.push_bytes(b"12345678");
        assert!(!g.fits(1, 1, 0));
        assert!(g.fits(0, 0, 2));
    }

    #[test]
    fn ring_iovecs_stop_at_the_ring_limit() {
        let mut g = PduGroup::with_capacity(MAX_GROUP_IOV, 4096);
        for i in 0..64u8 {
            g.push_bytes(&[i]);
            g.push_data(data(&[i]), 0, 1);
            g.end_pdu(false);
        }
        let mut iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; ops::MAX_IOV];
        assert_eq!(ops::IoVecs::iovecs(&g, &mut iov), ops::MAX_IOV);
        let mut all = iov0();
        assert_eq!(g.fill_iovecs(&mut all), MAX_GROUP_IOV);
    }
}
