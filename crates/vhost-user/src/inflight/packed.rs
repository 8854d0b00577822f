//! Inflight tracking for packed rings: the vhost-user spec's packed
//! layout ("Inflight I/O tracking", `QueueRegionPacked` and
//! `DescStatePacked`). Each ring descriptor a chain took is copied into an
//! entry taken from a free list; the chain's head entry carries the
//! in-flight mark, the order counter, the chain length and its last
//! entry. Returning a chain puts its entries back on the free list; the
//! `old_*` fields are the state before the update in progress, so a
//! backend killed in the middle of one either commits it (the used
//! descriptor reached the ring) or rolls it back.
//!
//! Queue part layout (little endian): features u64, version u16,
//! desc_num u16, free_head u16, old_free_head u16, used_idx u16,
//! old_used_idx u16, used_wrap_counter u8, old_used_wrap_counter u8,
//! padding to 32 bytes; then `desc_num` 32-byte entries: inflight u8,
//! padding u8, next u16, last u16, num u16, counter u64, id u16, flags
//! u16, len u32, addr u64.
//!
//! Unlike a split ring, nothing in guest memory says where a packed
//! ring's sides are after a crash (the frontend's SET_VRING_BASE is its
//! guess): the used side is the region's, and the available side is the
//! used side moved on by the slots of the chains still in flight.

use std::cell::{Cell, RefCell};
use std::sync::atomic::{compiler_fence, Ordering};

use vm_memory::{Bytes, GuestAddress, GuestMemory};

use super::QueueInflight;

/// Bytes of the packed queue header and of one entry.
pub const P_HEADER: usize = 32;
pub const P_ENTRY: usize = 32;

const FREE_HEAD: usize = 12;
const OLD_FREE_HEAD: usize = 14;
const USED_IDX: usize = 16;
const OLD_USED_IDX: usize = 18;
const USED_WRAP: usize = 20;
const OLD_USED_WRAP: usize = 21;

const E_INFLIGHT: usize = 0;
const E_NEXT: usize = 2;
const E_LAST: usize = 4;
const E_NUM: usize = 6;
const E_COUNTER: usize = 8;
const E_ID: usize = 16;
const E_FLAGS: usize = 18;
const E_LEN: usize = 20;
const E_ADDR: usize = 24;

/// Ring descriptor flags the tracker reads.
const F_AVAIL: u16 = 1 << 7;
const F_USED: u16 = 1 << 15;

/// One ring descriptor as the driver wrote it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RawDesc {
    pub addr: u64,
    pub len: u32,
    pub id: u16,
    pub flags: u16,
}

/// A chain to serve again after a restart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedChain {
    /// Its buffer ID (the last descriptor's).
    pub id: u16,
    /// Its ring descriptors, in order.
    pub descs: Vec<RawDesc>,
}

/// Where a restarted packed ring resumes, and what it serves again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedRecovery {
    /// `(slot, wrap counter)` of each side.
    pub avail: (u16, bool),
    pub used: (u16, bool),
    /// Oldest first.
    pub resubmit: Vec<PackedChain>,
}

/// Why a region's packed part cannot be trusted (the ring then runs from
/// the frontend's base, untracked).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("inflight region (packed): {0}")]
pub struct Damaged(&'static str);

/// One packed queue's tracking, used on its reactor.
pub struct PackedTrack {
    q: QueueInflight,
    /// Head entry of each buffer ID in flight.
    by_id: RefCell<Vec<u16>>,
    counter: Cell<u64>,
}

fn advance(pos: u16, wrap: bool, n: u32, size: u16) -> (u16, bool) {
    let p = pos as u32 + n;
    if p >= size as u32 {
        ((p - size as u32) as u16, !wrap)
    } else {
        (p as u16, wrap)
    }
}

impl PackedTrack {
    pub fn new(q: QueueInflight) -> PackedTrack {
        let size = q.size as usize;
        PackedTrack {
            q,
            by_id: RefCell::new(vec![u16::MAX; size]),
            counter: Cell::new(1),
        }
    }

    fn e(&self, i: u16) -> usize {
        P_HEADER + i as usize * P_ENTRY
    }
    fn eget<T: vm_memory::ByteValued + Default>(&self, i: u16, off: usize) -> T {
        self.q.get(self.e(i) + off)
    }
    fn eput<T: vm_memory::ByteValued>(&self, i: u16, off: usize, v: T) {
        self.q.put(self.e(i) + off, v)
    }

    /// A fresh part: every entry free, both sides at `used`.
    fn init(&self, used: (u16, bool)) {
        let size = self.q.size;
        for j in 0..size {
            self.eput(j, E_NEXT, j + 1);
            self.eput(j, E_INFLIGHT, 0u8);
        }
        for (off, v) in [(FREE_HEAD, 0u16), (OLD_FREE_HEAD, 0)] {
            self.q.put(off, v);
        }
        for off in [USED_IDX, OLD_USED_IDX] {
            self.q.put(off, used.0);
        }
        for off in [USED_WRAP, OLD_USED_WRAP] {
            self.q.put(off, used.1 as u8);
        }
        compiler_fence(Ordering::SeqCst);
        self.q.init();
    }

    /// A chain of `n` ring descriptors (`desc(k)`, in order) was taken:
    /// they are copied into entries from the free list, the head entry
    /// marked in flight first and the take committed last.
    pub fn taken(&self, n: u16, desc: impl Fn(u16) -> RawDesc) {
        let size = self.q.size;
        let head: u16 = self.q.get(OLD_FREE_HEAD);
        if n == 0 || head >= size {
            return;
        }
        let id = desc(n - 1).id;
        if id >= size {
            return;
        }
        let c = self.counter.get();
        self.counter.set(c + 1);
        self.eput(head, E_NUM, 0u16);
        self.eput(head, E_COUNTER, c);
        compiler_fence(Ordering::SeqCst);
        self.eput(head, E_INFLIGHT, 1u8);
        let mut free: u16 = self.q.get(FREE_HEAD);
        for k in 0..n {
            if free >= size {
                return;
            }
            let d = desc(k);
            if k + 1 == n {
                self.eput(head, E_LAST, free);
            }
            self.eput(head, E_NUM, k + 1);
            self.eput(free, E_ADDR, d.addr);
            self.eput(free, E_LEN, d.len);
            self.eput(free, E_FLAGS, d.flags);
            self.eput(free, E_ID, d.id);
            free = self.eget(free, E_NEXT);
            compiler_fence(Ordering::SeqCst);
            self.q.put(FREE_HEAD, free);
        }
        compiler_fence(Ordering::SeqCst);
        self.q.put(OLD_FREE_HEAD, free);
        self.by_id.borrow_mut()[id as usize] = head;
    }

    /// Before buffer `id`'s used descriptor is written: its entries go
    /// back on the free list and the used side moves to `used` (the
    /// update in progress; [`Self::used_done`] commits it).
    pub fn used(&self, id: u16, used: (u16, bool)) {
        let Some(&head) = self.by_id.borrow().get(id as usize) else {
            return;
        };
        if head >= self.q.size {
            return;
        }
        let last: u16 = self.eget(head, E_LAST);
        if last < self.q.size {
            let free: u16 = self.q.get(FREE_HEAD);
            self.eput(last, E_NEXT, free);
        }
        compiler_fence(Ordering::SeqCst);
        self.q.put(FREE_HEAD, head);
        self.q.put(USED_IDX, used.0);
        self.q.put(USED_WRAP, used.1 as u8);
        compiler_fence(Ordering::SeqCst);
    }

    /// After buffer `id`'s used descriptor is in the ring.
    pub fn used_done(&self, id: u16) {
        let Some(head) = self.by_id.borrow_mut().get_mut(id as usize).map(|h| {
            let old = *h;
            *h = u16::MAX;
            old
        }) else {
            return;
        };
        compiler_fence(Ordering::SeqCst);
        if head < self.q.size {
            self.eput(head, E_INFLIGHT, 0u8);
        }
        compiler_fence(Ordering::SeqCst);
        let free: u16 = self.q.get(FREE_HEAD);
        let (used, wrap): (u16, u8) = (self.q.get(USED_IDX), self.q.get(USED_WRAP));
        self.q.put(OLD_FREE_HEAD, free);
        self.q.put(OLD_USED_IDX, used);
        self.q.put(OLD_USED_WRAP, wrap);
    }

    /// At ring start: commits or rolls back the update a kill interrupted
    /// (by whether the used descriptor reached the ring at `desc_table`
    /// in `mem`), clears what is on the free list and lists the chains
    /// still in flight. `used`: where the frontend says the used side is,
    /// for a part no backend has used yet.
    pub fn recover<M: GuestMemory>(
        &self,
        mem: &M,
        desc_table: GuestAddress,
        used: (u16, bool),
    ) -> Result<PackedRecovery, Damaged> {
        let size = self.q.size;
        if !self.q.initialised() {
            self.init(used);
            return Ok(PackedRecovery {
                avail: used,
                used,
                resubmit: Vec::new(),
            });
        }
        let old_used: u16 = self.q.get(OLD_USED_IDX);
        let old_wrap = self.q.get::<u8>(OLD_USED_WRAP) != 0;
        let cur = (self.q.get::<u16>(USED_IDX), self.q.get::<u8>(USED_WRAP));
        if cur != (old_used, old_wrap as u8) && old_used < size {
            let at = desc_table.0 + old_used as u64 * 16 + 14;
            let flags = mem
                .read_obj::<u16>(GuestAddress(at))
                .map_err(|_| Damaged("ring outside guest memory"))?;
            let flags = u16::from_le(flags);
            let is_used = (flags & F_AVAIL != 0) == old_wrap && (flags & F_USED != 0) == old_wrap;
            if is_used {
                // The driver may have seen it: commit.
                self.q.put(OLD_FREE_HEAD, self.q.get::<u16>(FREE_HEAD));
                self.q.put(OLD_USED_IDX, cur.0);
                self.q.put(OLD_USED_WRAP, cur.1);
            }
        }
        // Roll back whatever is not committed.
        let (free, used_idx, wrap): (u16, u16, u8) = (
            self.q.get(OLD_FREE_HEAD),
            self.q.get(OLD_USED_IDX),
            self.q.get(OLD_USED_WRAP),
        );
        self.q.put(FREE_HEAD, free);
        self.q.put(USED_IDX, used_idx);
        self.q.put(USED_WRAP, wrap);
        if used_idx >= size {
            return Err(Damaged("used index beyond the ring"));
        }
        let mut at = free;
        for _ in 0..size {
            if at >= size {
                break;
            }
            self.eput(at, E_INFLIGHT, 0u8);
            at = self.eget(at, E_NEXT);
        }
        self.collect(used_idx, wrap != 0)
    }

    /// The chains marked in flight, oldest first, and the sides.
    fn collect(&self, used_idx: u16, wrap: bool) -> Result<PackedRecovery, Damaged> {
        let size = self.q.size;
        let mut heads: Vec<(u64, u16)> = (0..size)
            .filter(|&h| self.eget::<u8>(h, E_INFLIGHT) == 1)
            .map(|h| (self.eget::<u64>(h, E_COUNTER), h))
            .collect();
        heads.sort_unstable();
        let mut slots = 0u32;
        let mut out = Vec::with_capacity(heads.len());
        let mut by_id = self.by_id.borrow_mut();
        by_id.iter_mut().for_each(|h| *h = u16::MAX);
        for &(_, head) in &heads {
            let num: u16 = self.eget(head, E_NUM);
            if num == 0 || num > size {
                return Err(Damaged("chain length"));
            }
            let mut descs = Vec::with_capacity(num as usize);
            let mut at = head;
            for k in 0..num {
                if at >= size {
                    return Err(Damaged("entry beyond the ring"));
                }
                descs.push(RawDesc {
                    addr: self.eget(at, E_ADDR),
                    len: self.eget(at, E_LEN),
                    id: self.eget(at, E_ID),
                    flags: self.eget(at, E_FLAGS),
                });
                if k + 1 < num {
                    at = self.eget(at, E_NEXT);
                }
            }
            let id = descs[descs.len() - 1].id;
            if id >= size || by_id[id as usize] != u16::MAX {
                return Err(Damaged("buffer id"));
            }
            by_id[id as usize] = head;
            slots += num as u32;
            out.push(PackedChain { id, descs });
        }
        if slots > size as u32 {
            return Err(Damaged("more slots in flight than the ring has"));
        }
        self.counter.set(heads.last().map(|h| h.0 + 1).unwrap_or(1));
        Ok(PackedRecovery {
            avail: advance(used_idx, wrap, slots, size),
            used: (used_idx, wrap),
            resubmit: out,
        })
    }
}

#[cfg(test)]
mod tests;
