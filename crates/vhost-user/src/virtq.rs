//! One interface over the two virtqueue layouts, for the request loops of
//! blk ([`crate::vring`]) and scsi ([`crate::scsi`]): the split ring
//! (`virtio-queue`'s `Queue`) and the packed ring ([`crate::packed`]).
//! Taking a chain copies its descriptors into the caller's buffer (the
//! walkers in [`crate::blk`] and the scsi wire code read that); returning
//! one, the notification decisions and the indices a stopped ring reports
//! are the same calls for both.
//!
//! Returning used chains is split in two so a request loop can batch the
//! costly part: [`Virtq::push_used`] writes one used entry and makes it
//! visible (a split ring's used index is a plain release store, so the
//! driver sees each completion at once and can refill while the rest of
//! the batch runs), [`Virtq::publish`] makes the one notification
//! decision for everything pushed since the last one (a full fence and a
//! read of the driver's field: once per batch, not once per request).
//! Our split used side is ours, not `virtio-queue`'s: its notification
//! check fences after every entry and ignores VRING_AVAIL_F_NO_INTERRUPT,
//! so a driver without EVENT_IDX that polls would get a call eventfd
//! write per request.

use std::num::Wrapping;
use std::rc::Rc;
use std::sync::atomic::{fence, Ordering};

use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddress, GuestAddressSpace};

use crate::blk::{self, Desc};
use crate::guest::GuestMem;
use crate::packed::{PackedRing, Taken};
use crate::start::VringStart;

/// A ring of either layout.
pub enum Virtq {
    Split(SplitRing),
    Packed(PackedRing),
}

/// `virtio-queue`'s split ring for its layout and notification settings,
/// with our take and used paths: the available index is read (acquire)
/// only when the entries seen last are used up, and a chain is walked
/// with one region lookup per descriptor table ([`blk::read_chain`]), not
/// one per access.
pub struct SplitRing {
    q: Queue,
    /// The driver's available index as last read.
    avail_seen: Wrapping<u16>,
    /// The used index last stored in guest memory.
    stored: Wrapping<u16>,
    /// The used index at the last notification decision.
    checked: Wrapping<u16>,
    /// The last look found nothing new (the driver is waited for).
    idle: bool,
}

/// The most chains a look starts fetching ahead.
const LOOK_AHEAD: u16 = 64;

/// VRING_AVAIL_F_NO_INTERRUPT (virtio 1.2, 2.7.7).
const AVAIL_F_NO_INTERRUPT: u16 = 1;

impl SplitRing {
    /// A ready `q` whose used side resumes at `used`.
    pub fn new(q: Queue, used: u16) -> SplitRing {
        SplitRing {
            avail_seen: Wrapping(q.next_avail()),
            q,
            stored: Wrapping(used),
            checked: Wrapping(used),
            idle: false,
        }
    }

    fn pop(&mut self, mem: &GuestMem, out: &mut [Desc], looked: &mut bool) -> Option<Taken> {
        let size = self.q.size();
        let next = Wrapping(self.q.next_avail());
        let avail = self.q.avail_ring();
        if next == self.avail_seen && !self.look(mem, looked) {
            return None;
        }
        let at = GuestAddress(avail + 4 + 2 * (next.0 % size) as u64);
        // The avail ring is 2-aligned (checked when the ring opened).
        let head = load_u16(mem, at.0, Ordering::Relaxed)?;
        self.q.set_next_avail((next + Wrapping(1)).0);
        let table = GuestAddress(self.q.desc_table());
        let descs = blk::read_chain(mem, table, size, head, out);
        Some(Taken { head, descs })
    }

    /// The pass's one read of the available index, if it has not been
    /// made (`looked`): whether it found chains past those taken.
    fn look(&mut self, mem: &GuestMem, looked: &mut bool) -> bool {
        if *looked {
            return false;
        }
        *looked = true;
        let next = Wrapping(self.q.next_avail());
        let avail = self.q.avail_ring();
        if self.idle {
            // Waiting on the driver: the line of the next entry is
            // started with the index, not after it. The driver writes
            // the entry, then the index; read in turn, the two lines
            // cost two transfers one after the other when the next
            // request comes (QD1 +6-11 % IOPS in both placements;
            // at depth, where a look rarely finds nothing, not done:
            // bdevperf QD32 measured 0.97x with it on every look).
            let slot = (next.0 % self.q.size()) as u64;
            mem.prefetch(GuestAddress(avail + 4 + 2 * slot));
        }
        let Some(idx) = load_u16(mem, avail + 2, Ordering::Acquire) else {
            return false;
        };
        let idx = Wrapping(idx);
        if (idx - next).0 > self.q.size() {
            // More available than the ring holds: the driver is
            // broken (virtio-queue refuses it the same way).
            tracing::debug!("vhost: avail index {} with {} taken", idx.0, next.0);
            return false;
        }
        self.avail_seen = idx;
        self.idle = idx == next;
        !self.idle
    }

    /// Makes the pass's look, then starts the loads its pops will wait
    /// on, for up to [`LOOK_AHEAD`] chains at once: every head's
    /// descriptor line, then (reading those) every first buffer (a blk
    /// header, or an indirect table) and second descriptor. Taken one
    /// after the other, each chain's loads wait in turn on lines the
    /// driver wrote; with the vCPUs on two core complexes that was most
    /// of a request's cost (libblkio's driver: 2.9 M IOPS at QD32, 4.0 M
    /// with this, bench/RESULTS-vhost.md). Prefetches only: nothing is
    /// read that the pops do not check again.
    fn look_ahead(&mut self, mem: &GuestMem, looked: &mut bool) {
        let next = Wrapping(self.q.next_avail());
        if next != self.avail_seen || !self.look(mem, looked) {
            return;
        }
        let size = self.q.size();
        let n = (self.avail_seen - next).0.min(LOOK_AHEAD);
        let Some(ring) = mem.range(GuestAddress(self.q.avail_ring() + 4), 2 * size as usize) else {
            return;
        };
        let Some(table) = mem.range(GuestAddress(self.q.desc_table()), 16 * size as usize) else {
            return;
        };
        let head = |i: u16| {
            let slot = (next + Wrapping(i)).0 % size;
            ring.load_u16(2 * slot as usize, Ordering::Relaxed)
        };
        for i in 0..n {
            if let Some(h) = head(i) {
                table.prefetch(16 * h as usize);
            }
        }
        for i in 0..n {
            let Some(raw) = head(i).and_then(|h| table.load_16(16 * h as usize)) else {
                continue;
            };
            let addr = u64::from_le_bytes(raw[0..8].try_into().unwrap_or_default());
            let flags = u16::from_le_bytes(raw[12..14].try_into().unwrap_or_default());
            let second = u16::from_le_bytes(raw[14..16].try_into().unwrap_or_default());
            mem.prefetch(GuestAddress(addr));
            if flags & 1 != 0 {
                table.prefetch(16 * second as usize);
            }
        }
    }

    fn push_used(&mut self, mem: &GuestMem, head: u16, len: u32) -> bool {
        let size = self.q.size();
        if head >= size {
            return false;
        }
        let next = self.q.next_used();
        // struct vring_used: flags u16, idx u16, then 8-byte elements.
        let at = self.q.used_ring() + 4 + (next % size) as u64 * 8;
        // The element's id and len as two u32 stores (the ring is
        // 4-aligned, checked when it opened); the index store that
        // follows (release) publishes them.
        let Some(r) = mem.range(GuestAddress(at), 8) else {
            return false;
        };
        if !(r.store_u32(0, head as u32) && r.store_u32(4, len)) {
            return false;
        }
        self.q.set_next_used(next.wrapping_add(1));
        true
    }

    /// Stores the used index (release: the entries before it are seen
    /// first); false if the used ring is not writable.
    fn store_idx(&mut self, mem: &GuestMem) -> bool {
        let next = Wrapping(self.q.next_used());
        if next == self.stored {
            return true;
        }
        self.stored = next;
        let at = GuestAddress(self.q.used_ring() + 2);
        mem.store_u16(at, next.0, Ordering::Release)
    }

    /// Whether the driver wants a notification for what was stored since
    /// the last decision: its used_event (EVENT_IDX) or its
    /// NO_INTERRUPT flag. When unsure, yes.
    fn needs_notification(&mut self, mem: &GuestMem) -> bool {
        // The index store is visible before the driver's field is read
        // (the driver re-checks the ring after writing it).
        fence(Ordering::SeqCst);
        let new = self.stored;
        let old = std::mem::replace(&mut self.checked, new);
        if new == old {
            return false;
        }
        let avail = self.q.avail_ring();
        if self.q.event_idx_enabled() {
            return match load_u16(mem, avail + 4 + 2 * self.q.size() as u64, Ordering::Relaxed) {
                Some(e) => new - Wrapping(e) - Wrapping(1) < new - old,
                None => true,
            };
        }
        match load_u16(mem, avail, Ordering::Relaxed) {
            Some(f) => f & AVAIL_F_NO_INTERRUPT == 0,
            None => true,
        }
    }
}

/// A little-endian u16 of the ring at guest address `at` (aligned, in
/// one region), read atomically.
fn load_u16(mem: &GuestMem, at: u64, order: Ordering) -> Option<u16> {
    mem.load_u16(GuestAddress(at), order)
}

/// What opening a ring gives: the ring, the memory map, and the used
/// index guest memory has (split rings; where the inflight region's
/// recovery starts).
pub type Opened = (Virtq, Rc<GuestMem>, u16);

impl Virtq {
    /// The ring `s` describes, checked to lie in guest memory; a split
    /// ring resumes at `s.base` (its next available index) with its used
    /// index read from guest memory, a packed ring at both sides `s.base`
    /// carries.
    pub fn open<D>(s: &VringStart<D>) -> Result<Opened, String> {
        let mem = s.mem.memory().into_inner();
        if s.packed {
            let g = GuestAddress;
            let r = PackedRing::new(
                s.size,
                g(s.desc),
                g(s.avail),
                g(s.used),
                s.event_idx,
                s.base,
            )
            .map_err(|e| format!("queue {}: {e}", s.index))?;
            let used = r.indices().1;
            return Ok((Virtq::Packed(r), Rc::new(GuestMem::new(mem)), used));
        }
        let mut q = Queue::new(s.size).map_err(|e| format!("{e:?}"))?;
        q.set_size(s.size);
        q.set_desc_table_address(Some(s.desc as u32), Some((s.desc >> 32) as u32));
        q.set_avail_ring_address(Some(s.avail as u32), Some((s.avail >> 32) as u32));
        q.set_used_ring_address(Some(s.used as u32), Some((s.used >> 32) as u32));
        q.set_event_idx(s.event_idx);
        q.set_ready(true);
        if !q.is_valid(&*mem) {
            return Err(format!("queue {}: ring outside guest memory", s.index));
        }
        let used = q
            .used_idx(&*mem, Ordering::Acquire)
            .map_err(|e| format!("{e:?}"))?;
        q.set_next_used(used.0);
        q.set_next_avail(s.base as u16);
        let mem = Rc::new(GuestMem::new(mem));
        Ok((Virtq::Split(SplitRing::new(q, used.0)), mem, used.0))
    }

    /// Where a split ring takes its next chain (after an inflight
    /// recovery; packed rings are not tracked, see docs/vhost.md).
    pub fn set_next_avail(&mut self, v: u16) {
        if let Virtq::Split(r) = self {
            r.q.set_next_avail(v);
            r.avail_seen = Wrapping(v);
        }
    }

    pub fn size(&self) -> u16 {
        match self {
            Virtq::Split(r) => r.q.size(),
            Virtq::Packed(r) => r.size(),
        }
    }

    pub fn is_packed(&self) -> bool {
        matches!(self, Virtq::Packed(_))
    }

    /// Takes the next available chain, its descriptors copied into `out`
    /// (a longer chain fills it; the caller refuses it as too long).
    pub fn pop(&mut self, mem: &GuestMem, out: &mut [Desc]) -> Option<Taken> {
        self.pop_in_pass(mem, out, &mut false)
    }

    /// [`Self::pop`] for a request loop's pass: a split ring's available
    /// index is read at most once while `looked` is false (it is then set),
    /// so a pass takes what the driver had made available when it first
    /// looked and no more. Every read of that index takes its cache line
    /// from the driver, whose next index store then waits for the line to
    /// come back (SPDK's virtio driver fences after each): a queue that
    /// kept re-reading while the driver refilled cost the driver a line
    /// transfer per request (measured: +4-6 % of QD32 IOPS with the vCPUs
    /// on two core complexes, level near; bench/RESULTS-vhost.md). A
    /// packed ring has no index.
    pub fn pop_in_pass(
        &mut self,
        mem: &GuestMem,
        out: &mut [Desc],
        looked: &mut bool,
    ) -> Option<Taken> {
        match self {
            Virtq::Split(r) => r.pop(mem, out, looked),
            Virtq::Packed(r) => r.pop(mem.map(), out),
        }
    }

    /// [`Self::pop_in_pass`]'s look made ahead of the pops, with the lines
    /// the pops will read started (see `SplitRing::look_ahead`); nothing
    /// on a packed ring or once the pass has looked.
    pub fn look_ahead(&mut self, mem: &GuestMem, looked: &mut bool) {
        if let Virtq::Split(r) = self {
            r.look_ahead(mem, looked);
        }
    }

    /// Returns `head` (a split ring's head index, a packed ring's buffer
    /// ID) used with `len` bytes written, visible at once; false: the ring
    /// is not writable. The notification decision is the caller's
    /// ([`Self::needs_notification`]).
    pub fn add_used(&mut self, mem: &GuestMem, head: u16, len: u32) -> bool {
        self.push_used(mem, head, len)
    }

    /// Writes `head`'s used entry, visible to the driver at once (a split
    /// ring's entry then its index, a packed ring's descriptor with its
    /// flags last). False: the ring is not writable.
    pub fn push_used(&mut self, mem: &GuestMem, head: u16, len: u32) -> bool {
        self.push_used_entry(mem, head, len) && self.store_idx(mem)
    }

    /// [`Self::push_used`] with a split ring's index left for
    /// [`Self::publish`] to store.
    pub fn push_used_entry(&mut self, mem: &GuestMem, head: u16, len: u32) -> bool {
        match self {
            Virtq::Split(r) => r.push_used(mem, head, len),
            Virtq::Packed(r) => r.add_used(mem.map(), head, len).is_ok(),
        }
    }

    /// After entries were pushed: whether the driver wants a notification
    /// for them (one decision for the batch).
    pub fn publish(&mut self, mem: &GuestMem) -> bool {
        self.store_idx(mem) && self.needs_notification(mem)
    }

    /// A split ring's used index over the entries pushed (nothing when it
    /// is there already; a packed ring has none); false if the ring is not
    /// writable.
    fn store_idx(&mut self, mem: &GuestMem) -> bool {
        match self {
            Virtq::Split(r) => r.store_idx(mem),
            Virtq::Packed(_) => true,
        }
    }

    /// After [`Self::add_used`]: whether the driver asked to be notified
    /// for what was returned since the last decision (when unsure, yes).
    pub fn needs_notification(&mut self, mem: &GuestMem) -> bool {
        match self {
            Virtq::Split(r) => r.needs_notification(mem),
            Virtq::Packed(r) => r.needs_notification(mem.map()),
        }
    }

    /// Asks for kicks; true if a chain is already available.
    pub fn enable_notification(&mut self, mem: &GuestMem) -> bool {
        match self {
            Virtq::Split(r) => r.q.enable_notification(mem.map()).unwrap_or(false),
            Virtq::Packed(r) => r.enable_notification(mem.map()),
        }
    }

    pub fn disable_notification(&mut self, mem: &GuestMem) {
        match self {
            Virtq::Split(r) => {
                let _ = r.q.disable_notification(mem.map());
            }
            Virtq::Packed(r) => r.disable_notification(mem.map()),
        }
    }

    /// Where the ring stopped, `(available side, used side)`: a split
    /// ring's indices, a packed ring's slots with their wrap counters in
    /// bit 15.
    pub fn indices(&self) -> (u16, u16) {
        match self {
            Virtq::Split(r) => (r.q.next_avail(), r.q.next_used()),
            Virtq::Packed(r) => r.indices(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestMemoryMmap};

    const DESC: u64 = 0;
    const AVAIL: u64 = 0x1000;
    const USED: u64 = 0x2000;
    const SIZE: u16 = 8;

    /// A split ring whose descriptor `i` is a one-byte writable buffer.
    fn ring() -> (Virtq, GuestMem) {
        let map = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 16)]).unwrap();
        for i in 0..SIZE as u64 {
            let mut d = [0u8; 16];
            d[0..8].copy_from_slice(&(0x4000 + i).to_le_bytes());
            d[8..12].copy_from_slice(&1u32.to_le_bytes());
            d[12..14].copy_from_slice(&2u16.to_le_bytes());
            map.write_slice(&d, GuestAddress(DESC + 16 * i)).unwrap();
        }
        let mut q = Queue::new(SIZE).unwrap();
        q.set_desc_table_address(Some(DESC as u32), Some(0));
        q.set_avail_ring_address(Some(AVAIL as u32), Some(0));
        q.set_used_ring_address(Some(USED as u32), Some(0));
        q.set_ready(true);
        assert!(q.is_valid(&map));
        (Virtq::Split(SplitRing::new(q, 0)), GuestMem::from_map(map))
    }

    /// The driver makes heads `from..to` available.
    fn offer(mem: &GuestMem, from: u16, to: u16) {
        for i in from..to {
            let at = AVAIL + 4 + 2 * (i % SIZE) as u64;
            mem.map().write_obj(i.to_le(), GuestAddress(at)).unwrap();
        }
        mem.map()
            .write_obj(to.to_le(), GuestAddress(AVAIL + 2))
            .unwrap();
    }

    #[test]
    fn a_pass_takes_what_was_available_when_it_first_looked() {
        let (mut q, mem) = ring();
        let mut out = blk::chain_buf();
        offer(&mem, 0, 2);
        let mut looked = false;
        let mut take = |q: &mut Virtq, looked: &mut bool| {
            q.pop_in_pass(&mem, &mut out, looked).map(|t| t.head)
        };
        assert_eq!(take(&mut q, &mut looked), Some(0));
        // Made available after the pass looked: left for the next pass.
        offer(&mem, 2, 3);
        assert_eq!(take(&mut q, &mut looked), Some(1));
        assert_eq!(take(&mut q, &mut looked), None);
        let mut looked = false;
        assert_eq!(take(&mut q, &mut looked), Some(2));
        assert_eq!(take(&mut q, &mut looked), None);
        // Outside a pass every pop looks again.
        offer(&mem, 3, 4);
        assert_eq!(q.pop(&mem, &mut out).map(|t| t.head), Some(3));
        offer(&mem, 4, 5);
        assert_eq!(q.pop(&mem, &mut out).map(|t| t.head), Some(4));
        assert_eq!(q.pop(&mem, &mut out).map(|t| t.head), None);
    }

    #[test]
    fn a_look_made_ahead_takes_the_same_chains_and_counts_as_the_pass_look() {
        let (mut q, mem) = ring();
        let mut out = blk::chain_buf();
        offer(&mem, 0, 3);
        let mut looked = false;
        q.look_ahead(&mem, &mut looked);
        assert!(looked);
        // Made available after the look: left for the next pass.
        offer(&mem, 3, 4);
        let mut heads = Vec::new();
        while let Some(t) = q.pop_in_pass(&mem, &mut out, &mut looked) {
            assert_eq!((t.descs, out[0].addr), (1, 0x4000 + t.head as u64));
            heads.push(t.head);
        }
        assert_eq!(heads, [0, 1, 2]);
        // A second look ahead in the same pass reads nothing.
        q.look_ahead(&mem, &mut looked);
        assert_eq!(
            q.pop_in_pass(&mem, &mut out, &mut looked).map(|t| t.head),
            None
        );
        let mut looked = false;
        q.look_ahead(&mem, &mut looked);
        assert_eq!(
            q.pop_in_pass(&mem, &mut out, &mut looked).map(|t| t.head),
            Some(3)
        );
    }

    #[test]
    fn an_entry_pushed_without_its_index_is_seen_at_publish() {
        let (mut q, mem) = ring();
        let used_idx = |mem: &GuestMem| mem.map().read_obj::<u16>(GuestAddress(USED + 2)).unwrap();
        assert!(q.push_used_entry(&mem, 5, 1));
        assert!(q.push_used_entry(&mem, 6, 1));
        assert_eq!(used_idx(&mem), 0);
        let id = mem
            .map()
            .read_obj::<u32>(GuestAddress(USED + 4 + 8))
            .unwrap();
        assert_eq!(id, 6);
        q.publish(&mem);
        assert_eq!(used_idx(&mem), 2);
        // The per-entry push stores the index at once.
        assert!(q.push_used(&mem, 7, 1));
        assert_eq!(used_idx(&mem), 3);
    }
}
