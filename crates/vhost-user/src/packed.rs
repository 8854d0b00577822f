//! The packed virtqueue (virtio 1.1 and later, §2.8) as the device drives
//! it: one descriptor ring the driver and the device share, with a wrap
//! counter on each side, chains made of consecutive ring slots (NEXT),
//! indirect tables, buffer IDs returned in used descriptors written over
//! the ring, and the two event suppression structures (the driver's says
//! when it wants used-buffer notifications, ours when we want kicks).
//!
//! `virtio-queue` has only the packed layouts, no queue: this is ours.
//! Everything the driver wrote is read through `vm-memory`, which bounds
//! every access to a mapped region. A chain whose extent is known but
//! whose content is bad (an indirect descriptor that is not alone, a bad
//! indirect table) comes back with no descriptors, so the request layer
//! answers it as unanswerable; what leaves the ring's state unknowable (a
//! buffer ID beyond the ring or already in flight, a chain longer than
//! the ring, a chain whose later descriptors the driver has not made
//! available, a ring outside memory) breaks the ring: nothing more is
//! taken from it, nothing panics or loops.
//!
//! Completions may come in any order (no in-order assumption): each buffer
//! ID remembers how many ring slots its chain took, and the used
//! descriptor goes to the next used slot.

use std::sync::atomic::{fence, Ordering};

use vm_memory::{Address, Bytes, GuestAddress, GuestMemory};

use crate::blk::Desc;
pub use crate::inflight::packed::RawDesc;

/// Descriptor flags (§2.8.2).
pub const F_NEXT: u16 = 1;
pub const F_WRITE: u16 = 2;
pub const F_INDIRECT: u16 = 4;
pub const F_AVAIL: u16 = 1 << 7;
pub const F_USED: u16 = 1 << 15;
/// Event suppression `flags` values (§2.8.10).
pub const EVENT_ENABLE: u16 = 0;
pub const EVENT_DISABLE: u16 = 1;
pub const EVENT_DESC: u16 = 2;
/// Bytes of one descriptor.
pub const DESC_LEN: u64 = 16;
/// The wrap counter's bit in an event offset and in a vring base.
const WRAP: u16 = 1 << 15;

/// Why a packed ring stopped being served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PackedError {
    #[error("ring outside guest memory")]
    Unreadable,
    #[error("buffer id {0} beyond the ring")]
    BadId(u16),
    #[error("buffer id {0} already in flight")]
    IdInFlight(u16),
    #[error("chain longer than the ring")]
    TooLong,
    #[error("descriptor {0} of a chain was not made available")]
    NotAvailable(u16),
    #[error("vring base {0:#x} beyond the ring")]
    BadBase(u32),
}

/// A chain taken from the ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Taken {
    /// Its buffer ID (what the used descriptor returns).
    pub head: u16,
    /// Descriptors copied into the caller's buffer (0: malformed).
    pub descs: usize,
}

/// One packed ring's device side.
#[derive(Debug)]
pub struct PackedRing {
    size: u16,
    desc: GuestAddress,
    /// Driver event suppression (the driver area).
    driver: GuestAddress,
    /// Device event suppression (the device area).
    device: GuestAddress,
    event_idx: bool,
    next_avail: u16,
    avail_wrap: bool,
    next_used: u16,
    used_wrap: bool,
    /// Ring slots of the chain with each buffer ID in flight (0: none).
    chain_len: Vec<u16>,
    /// Where the used side was at the last notification check.
    signalled: Option<(u16, bool)>,
    broken: Option<PackedError>,
    /// First slot and slot count of the chain taken last (inflight
    /// tracking copies its descriptors).
    last_taken: (u16, u16),
}

/// `(pos, wrap)` moved on by `n` slots of a ring of `size` (`n <= size`).
fn advance(pos: u16, wrap: bool, n: u16, size: u16) -> (u16, bool) {
    let p = pos as u32 + n as u32;
    if p >= size as u32 {
        ((p - size as u32) as u16, !wrap)
    } else {
        (p as u16, wrap)
    }
}

/// A descriptor is available when its AVAIL bit matches the driver's wrap
/// counter and its USED bit does not.
fn is_avail(flags: u16, wrap: bool) -> bool {
    (flags & F_AVAIL != 0) == wrap && (flags & F_USED != 0) != wrap
}

/// `(addr, len, id)` of a raw 16-byte descriptor.
fn fields(raw: &[u8; 16]) -> (u64, u32, u16) {
    let mut a = [0u8; 8];
    a.copy_from_slice(&raw[0..8]);
    (
        u64::from_le_bytes(a),
        u32::from_le_bytes([raw[8], raw[9], raw[10], raw[11]]),
        u16::from_le_bytes([raw[12], raw[13]]),
    )
}

impl PackedRing {
    /// A ring of `size` at `desc`, with the event suppression structures at
    /// `driver` and `device`, resuming at `base` (vhost-user's
    /// SET_VRING_BASE for packed rings: bits 0-14 the next available slot,
    /// bit 15 its wrap counter, bits 16-31 the same for the used side;
    /// a zero upper half means "where the available side is", since a
    /// ring stopped with GET_VRING_BASE has nothing in flight).
    pub fn new(
        size: u16,
        desc: GuestAddress,
        driver: GuestAddress,
        device: GuestAddress,
        event_idx: bool,
        base: u32,
    ) -> Result<PackedRing, PackedError> {
        let avail = base as u16;
        let used = match (base >> 16) as u16 {
            0 => avail,
            u => u,
        };
        if size == 0 || avail & !WRAP >= size || used & !WRAP >= size {
            return Err(PackedError::BadBase(base));
        }
        Ok(PackedRing {
            size,
            desc,
            driver,
            device,
            event_idx,
            next_avail: avail & !WRAP,
            avail_wrap: avail & WRAP != 0,
            next_used: used & !WRAP,
            used_wrap: used & WRAP != 0,
            chain_len: vec![0; size as usize],
            signalled: None,
            broken: None,
            last_taken: (0, 0),
        })
    }

    pub fn size(&self) -> u16 {
        self.size
    }

    /// Why the ring stopped being served, if it did.
    pub fn broken(&self) -> Option<PackedError> {
        self.broken
    }

    /// `(available side, used side)`, each the slot with its wrap counter
    /// in bit 15: what GET_VRING_BASE reports (`avail | used << 16`).
    pub fn indices(&self) -> (u16, u16) {
        let enc = |pos: u16, wrap: bool| pos | if wrap { WRAP } else { 0 };
        (
            enc(self.next_avail, self.avail_wrap),
            enc(self.next_used, self.used_wrap),
        )
    }

    /// Chains taken and not yet returned used.
    pub fn in_flight(&self) -> usize {
        self.chain_len.iter().filter(|&&n| n != 0).count()
    }

    /// First slot and slot count of the chain [`Self::pop`] took last.
    pub fn last_taken(&self) -> (u16, u16) {
        self.last_taken
    }

    /// The descriptor at `slot` as the driver wrote it (zeroes if it
    /// cannot be read: the chain then fails when served again).
    pub fn raw_desc<M: GuestMemory>(&self, mem: &M, slot: u16) -> RawDesc {
        let mut raw = [0u8; 16];
        let ok = self
            .slot(slot % self.size)
            .is_ok_and(|at| mem.read_slice(&mut raw, at).is_ok());
        if !ok {
            return RawDesc::default();
        }
        let (addr, len, id) = fields(&raw);
        RawDesc {
            addr,
            len,
            id,
            flags: u16::from_le_bytes([raw[14], raw[15]]),
        }
    }

    /// The used side once buffer `id` is returned (`None`: not in flight).
    pub fn used_after(&self, id: u16) -> Option<(u16, bool)> {
        let n = *self.chain_len.get(id as usize).filter(|&&n| n != 0)?;
        Some(advance(self.next_used, self.used_wrap, n, self.size))
    }

    /// After an inflight recovery: both sides, and the chains `(id,
    /// slots)` in flight again. False: an ID beyond the ring or twice.
    pub fn restore(
        &mut self,
        avail: (u16, bool),
        used: (u16, bool),
        chains: &[(u16, u16)],
    ) -> bool {
        if avail.0 >= self.size || used.0 >= self.size {
            return false;
        }
        (self.next_avail, self.avail_wrap) = avail;
        (self.next_used, self.used_wrap) = used;
        self.chain_len.iter_mut().for_each(|n| *n = 0);
        for &(id, n) in chains {
            match self.chain_len.get_mut(id as usize) {
                Some(slot) if *slot == 0 && n != 0 => *slot = n,
                _ => return false,
            }
        }
        true
    }

    fn slot(&self, i: u16) -> Result<GuestAddress, PackedError> {
        self.desc
            .checked_add(i as u64 * DESC_LEN)
            .ok_or(PackedError::Unreadable)
    }

    fn flags<M: GuestMemory>(&self, mem: &M, i: u16) -> Result<u16, PackedError> {
        let at = self
            .slot(i)?
            .0
            .checked_add(14)
            .ok_or(PackedError::Unreadable)?;
        mem.load::<u16>(GuestAddress(at), Ordering::Acquire)
            .map(u16::from_le)
            .map_err(|_| PackedError::Unreadable)
    }

    /// Takes the next available chain, copying its descriptors into `out`
    /// (at most `out.len()`: a longer chain fills it, and the request
    /// layer refuses it as too long). `None`: nothing available, or the
    /// ring is broken (see [`Self::broken`]).
    pub fn pop<M: GuestMemory>(&mut self, mem: &M, out: &mut [Desc]) -> Option<Taken> {
        if self.broken.is_some() {
            return None;
        }
        match self.try_pop(mem, out) {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!("vhost: packed ring broken by the driver: {e}");
                self.broken = Some(e);
                None
            }
        }
    }

    fn try_pop<M: GuestMemory>(
        &mut self,
        mem: &M,
        out: &mut [Desc],
    ) -> Result<Option<Taken>, PackedError> {
        let (mut pos, mut wrap) = (self.next_avail, self.avail_wrap);
        if !is_avail(self.flags(mem, pos)?, wrap) {
            return Ok(None);
        }
        let (mut n, mut k, mut bad) = (0u16, 0usize, false);
        let id = loop {
            // The flags are read (acquire) before the rest: the driver
            // writes the first descriptor's flags last.
            let flags = self.flags(mem, pos)?;
            if n > 0 && !is_avail(flags, wrap) {
                return Err(PackedError::NotAvailable(pos));
            }
            let mut raw = [0u8; 16];
            mem.read_slice(&mut raw, self.slot(pos)?)
                .map_err(|_| PackedError::Unreadable)?;
            let (addr, len, id) = fields(&raw);
            n += 1;
            if flags & F_INDIRECT != 0 {
                // Only alone in its chain (§2.8.7: never with NEXT).
                match (n, flags & F_NEXT) {
                    (1, 0) => match indirect(mem, addr, len, out) {
                        Some(got) => k = got,
                        None => bad = true,
                    },
                    _ => bad = true,
                }
            } else if k < out.len() {
                out[k] = Desc {
                    addr,
                    len,
                    write: flags & F_WRITE != 0,
                };
                k += 1;
            }
            (pos, wrap) = advance(pos, wrap, 1, self.size);
            if flags & F_NEXT == 0 {
                // The buffer ID is the last descriptor's (§2.8.6).
                break id;
            }
            if n == self.size {
                return Err(PackedError::TooLong);
            }
        };
        let Some(slot) = self.chain_len.get_mut(id as usize) else {
            return Err(PackedError::BadId(id));
        };
        if *slot != 0 {
            return Err(PackedError::IdInFlight(id));
        }
        *slot = n;
        self.last_taken = (self.next_avail, n);
        (self.next_avail, self.avail_wrap) = (pos, wrap);
        Ok(Some(Taken {
            head: id,
            descs: if bad { 0 } else { k },
        }))
    }

    /// Returns buffer `id` used with `len` bytes written: a used
    /// descriptor at the next used slot, its flags written last.
    pub fn add_used<M: GuestMemory>(
        &mut self,
        mem: &M,
        id: u16,
        len: u32,
    ) -> Result<(), PackedError> {
        let n = match self.chain_len.get(id as usize) {
            Some(&n) if n != 0 => n,
            _ => return Err(PackedError::BadId(id)),
        };
        let at = self.slot(self.next_used)?;
        let err = |_| PackedError::Unreadable;
        mem.write_obj(len.to_le(), GuestAddress(at.0 + 8))
            .map_err(err)?;
        mem.write_obj(id.to_le(), GuestAddress(at.0 + 12))
            .map_err(err)?;
        let mut flags = if self.used_wrap { F_AVAIL | F_USED } else { 0 };
        if len > 0 {
            flags |= F_WRITE;
        }
        // Release: the driver sees the id and length once it sees the flags.
        mem.store(flags.to_le(), GuestAddress(at.0 + 14), Ordering::Release)
            .map_err(err)?;
        self.chain_len[id as usize] = 0;
        (self.next_used, self.used_wrap) = advance(self.next_used, self.used_wrap, n, self.size);
        Ok(())
    }

    /// After each [`Self::add_used`]: whether the driver wants a
    /// notification for what was returned since the last check (its event
    /// suppression: enabled, disabled, or at one used slot with EVENT_IDX).
    pub fn needs_notification<M: GuestMemory>(&mut self, mem: &M) -> bool {
        // The used flags are visible before the driver's structure is read
        // (it re-checks the ring after writing it).
        fence(Ordering::SeqCst);
        let new = (self.next_used, self.used_wrap);
        let old = self.signalled.replace(new);
        let load = |off: u64| {
            mem.load::<u16>(GuestAddress(self.driver.0 + off), Ordering::Acquire)
                .map(u16::from_le)
        };
        let (Ok(off_wrap), Ok(flags)) = (load(0), load(2)) else {
            return true;
        };
        match flags & 3 {
            EVENT_DISABLE => false,
            EVENT_DESC if self.event_idx => match old {
                Some(old) => self.crossed(old, new, off_wrap),
                None => true,
            },
            _ => true,
        }
    }

    /// Whether the used slot the driver named (`off_wrap`) was written
    /// between `old` and `new` (at most one lap apart: checked after
    /// every return). Positions of the lap before `new`'s count negative.
    fn crossed(&self, old: (u16, bool), new: (u16, bool), off_wrap: u16) -> bool {
        let lap =
            |pos: u16, wrap: bool| pos as i32 - if wrap == new.1 { 0 } else { self.size as i32 };
        let o = lap(old.0, old.1);
        let e = lap(off_wrap & !WRAP, off_wrap & WRAP != 0);
        o <= e && e < new.0 as i32
    }

    /// Asks the driver for kicks; true if a chain is available already
    /// (the caller must not sleep then).
    pub fn enable_notification<M: GuestMemory>(&mut self, mem: &M) -> bool {
        self.set_device_event(mem, EVENT_ENABLE);
        fence(Ordering::SeqCst);
        self.broken.is_none()
            && self
                .flags(mem, self.next_avail)
                .is_ok_and(|f| is_avail(f, self.avail_wrap))
    }

    /// Tells the driver not to kick (the ring is being polled).
    pub fn disable_notification<M: GuestMemory>(&mut self, mem: &M) {
        self.set_device_event(mem, EVENT_DISABLE);
    }

    fn set_device_event<M: GuestMemory>(&self, mem: &M, flags: u16) {
        let at = GuestAddress(self.device.0.wrapping_add(2));
        let _ = mem.store(flags.to_le(), at, Ordering::Release);
    }
}

/// Copies an indirect table (`len` bytes at `addr`, packed descriptors
/// read in order: only their WRITE flag counts, §2.8.8) into `out`, at
/// most `out.len()` entries; `None` if its length is not a whole number
/// of descriptors or it lies outside memory.
pub(crate) fn indirect<M: GuestMemory>(
    mem: &M,
    addr: u64,
    len: u32,
    out: &mut [Desc],
) -> Option<usize> {
    if len == 0 || len as u64 % DESC_LEN != 0 {
        return None;
    }
    let count = (len as u64 / DESC_LEN).min(out.len() as u64) as usize;
    for (i, d) in out.iter_mut().take(count).enumerate() {
        let at = addr.checked_add(i as u64 * DESC_LEN)?;
        let mut raw = [0u8; 16];
        mem.read_slice(&mut raw, GuestAddress(at)).ok()?;
        let (a, l, _) = fields(&raw);
        let flags = u16::from_le_bytes([raw[14], raw[15]]);
        *d = Desc {
            addr: a,
            len: l,
            write: flags & F_WRITE != 0,
        };
    }
    Some(count)
}

/// A chain served again after a restart (its ring descriptors from the
/// inflight region) copied into `out` as [`PackedRing::pop`] would have:
/// an indirect descriptor alone has its table read; 0: malformed.
pub fn chain_descs<M: GuestMemory>(mem: &M, raw: &[RawDesc], out: &mut [Desc]) -> usize {
    match raw {
        [d] if d.flags & F_INDIRECT != 0 => indirect(mem, d.addr, d.len, out).unwrap_or(0),
        _ if raw.iter().any(|d| d.flags & F_INDIRECT != 0) => 0,
        _ => {
            let n = raw.len().min(out.len());
            for (o, d) in out.iter_mut().zip(raw) {
                *o = Desc {
                    addr: d.addr,
                    len: d.len,
                    write: d.flags & F_WRITE != 0,
                };
            }
            n
        }
    }
}

#[cfg(test)]
mod tests;
