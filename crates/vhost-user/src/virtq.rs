//! One interface over the two virtqueue layouts, for the request loops of
//! blk ([`crate::vring`]) and scsi ([`crate::scsi`]): the split ring
//! (`virtio-queue`'s `Queue`) and the packed ring ([`crate::packed`]).
//! Taking a chain copies its descriptors into the caller's buffer (the
//! walkers in [`crate::blk`] and the scsi wire code read that); returning
//! one, the notification decisions and the indices a stopped ring reports
//! are the same calls for both.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddress, GuestAddressSpace, GuestMemoryMmap};

use crate::blk::{self, Desc};
use crate::packed::{PackedRing, Taken};
use crate::vring::VringStart;

/// A ring of either layout.
pub enum Virtq {
    Split(Queue),
    Packed(PackedRing),
}

/// What opening a ring gives: the ring, the memory map, and the used
/// index guest memory has (split rings; where the inflight region's
/// recovery starts).
pub type Opened = (Virtq, Arc<GuestMemoryMmap>, u16);

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
            return Ok((Virtq::Packed(r), mem, used));
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
        Ok((Virtq::Split(q), mem, used.0))
    }

    /// Where a split ring takes its next chain (after an inflight
    /// recovery; packed rings are not tracked, see docs/vhost.md).
    pub fn set_next_avail(&mut self, v: u16) {
        if let Virtq::Split(q) = self {
            q.set_next_avail(v);
        }
    }

    pub fn size(&self) -> u16 {
        match self {
            Virtq::Split(q) => q.size(),
            Virtq::Packed(r) => r.size(),
        }
    }

    pub fn is_packed(&self) -> bool {
        matches!(self, Virtq::Packed(_))
    }

    /// Takes the next available chain, its descriptors copied into `out`
    /// (a longer chain fills it; the caller refuses it as too long).
    pub fn pop(&mut self, mem: &GuestMemoryMmap, out: &mut [Desc]) -> Option<Taken> {
        match self {
            Virtq::Split(q) => {
                let chain = q.pop_descriptor_chain(mem)?;
                let head = chain.head_index();
                let descs = blk::collect_chain(chain, out);
                Some(Taken { head, descs })
            }
            Virtq::Packed(r) => r.pop(mem, out),
        }
    }

    /// Returns `head` (a split ring's head index, a packed ring's buffer
    /// ID) used with `len` bytes written; false: the ring is not writable.
    pub fn add_used(&mut self, mem: &GuestMemoryMmap, head: u16, len: u32) -> bool {
        match self {
            Virtq::Split(q) => q.add_used(mem, head, len).is_ok(),
            Virtq::Packed(r) => r.add_used(mem, head, len).is_ok(),
        }
    }

    /// After each [`Self::add_used`]: whether the driver asked to be
    /// notified (when unsure, yes).
    pub fn needs_notification(&mut self, mem: &GuestMemoryMmap) -> bool {
        match self {
            Virtq::Split(q) => q.needs_notification(mem).unwrap_or(true),
            Virtq::Packed(r) => r.needs_notification(mem),
        }
    }

    /// Asks for kicks; true if a chain is already available.
    pub fn enable_notification(&mut self, mem: &GuestMemoryMmap) -> bool {
        match self {
            Virtq::Split(q) => q.enable_notification(mem).unwrap_or(false),
            Virtq::Packed(r) => r.enable_notification(mem),
        }
    }

    pub fn disable_notification(&mut self, mem: &GuestMemoryMmap) {
        match self {
            Virtq::Split(q) => {
                let _ = q.disable_notification(mem);
            }
            Virtq::Packed(r) => r.disable_notification(mem),
        }
    }

    /// Where the ring stopped, `(available side, used side)`: a split
    /// ring's indices, a packed ring's slots with their wrap counters in
    /// bit 15.
    pub fn indices(&self) -> (u16, u16) {
        match self {
            Virtq::Split(q) => (q.next_avail(), q.next_used()),
            Virtq::Packed(r) => r.indices(),
        }
    }
}
