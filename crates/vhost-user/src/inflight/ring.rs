//! A ring's use of the inflight region, the same for blk ([`crate::vring`])
//! and scsi ([`crate::scsi`]) rings of either layout: reconciling a ring
//! with the region when it starts (what a killed backend had taken is
//! served again, oldest first), marking a chain when it is taken, and the
//! two steps around returning one used (the region's used side moves
//! before the ring's, so a kill in between is rolled back or committed
//! on the next start).

use std::cell::Cell;

use vm_memory::{GuestAddress, GuestMemoryMmap};

use super::packed::{PackedChain, PackedTrack};
use super::QueueInflight;
use crate::virtq::Virtq;

/// The inflight region's layout for one ring.
pub enum Track {
    Split(QueueInflight),
    Packed(PackedTrack),
}

/// What a killed backend had taken, oldest first: split heads, or packed
/// chains (their descriptors as they were copied into the region).
pub enum Resubmit {
    Split(Vec<u16>),
    Packed(Vec<PackedChain>),
}

impl Resubmit {
    pub fn len(&self) -> usize {
        match self {
            Resubmit::Split(v) => v.len(),
            Resubmit::Packed(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A ring reconciled with its region.
pub struct Recovered {
    /// The tracking to keep (none: no region, or a damaged one).
    pub track: Option<Track>,
    /// The order counter of the next take (split).
    pub counter: u64,
    pub again: Resubmit,
}

impl Recovered {
    fn untracked() -> Recovered {
        Recovered {
            track: None,
            counter: 1,
            again: Resubmit::Split(Vec::new()),
        }
    }
}

/// Reconciles ring `index` (`q`, its descriptor area at `desc`) with the
/// region, if the frontend set one: after a kill the frontend's base is
/// its guess (a split ring's used index; a packed ring's whatever it
/// last knew), the region knows what was taken. `used`: the split used
/// index in guest memory.
pub fn recover(
    index: u16,
    desc: u64,
    inflight: Option<QueueInflight>,
    q: &mut Virtq,
    mem: &GuestMemoryMmap,
    used: u16,
) -> Recovered {
    let Some(t) = inflight else {
        return Recovered::untracked();
    };
    let r = match q {
        Virtq::Split(_) => {
            let rec = t.recover(used);
            q.set_next_avail(rec.next_avail);
            Recovered {
                track: Some(Track::Split(t)),
                counter: rec.counter,
                again: Resubmit::Split(rec.resubmit),
            }
        }
        Virtq::Packed(r) => {
            let p = PackedTrack::new(t);
            let (_, u) = r.indices();
            let used = (u & 0x7fff, u & 0x8000 != 0);
            let rec = match p.recover(mem, GuestAddress(desc), used) {
                Ok(rec) => rec,
                Err(e) => {
                    tracing::warn!("vhost: queue {index}: {e}; running untracked");
                    return Recovered::untracked();
                }
            };
            let ids: Vec<(u16, u16)> = rec
                .resubmit
                .iter()
                .map(|c| (c.id, c.descs.len() as u16))
                .collect();
            if !r.restore(rec.avail, rec.used, &ids) {
                tracing::warn!("vhost: queue {index}: inflight region refused; untracked");
                return Recovered::untracked();
            }
            Recovered {
                track: Some(Track::Packed(p)),
                counter: 1,
                again: Resubmit::Packed(rec.resubmit),
            }
        }
    };
    if !r.again.is_empty() {
        tracing::info!(
            "vhost: queue {index}: resubmitting {} requests in flight at the last stop",
            r.again.len()
        );
    }
    r
}

impl Track {
    /// The chain `head` was just taken from `q`: marked in flight (split:
    /// with the order counter `counter`, which moves on; packed: the
    /// ring descriptors of the take copied in).
    pub fn taken(&self, q: &Virtq, mem: &GuestMemoryMmap, head: u16, counter: &Cell<u64>) {
        match (self, q) {
            (Track::Split(t), _) => {
                t.taken(head, counter.get());
                counter.set(counter.get() + 1);
            }
            (Track::Packed(p), Virtq::Packed(r)) => {
                let (first, n) = r.last_taken();
                p.taken(n, |k| r.raw_desc(mem, first.wrapping_add(k)));
            }
            _ => {}
        }
    }

    /// Before `head`'s used entry is written: the region's used side
    /// moves first (a kill in between is rolled back or committed).
    pub fn before_used(&self, q: &Virtq, head: u16) {
        match (self, q) {
            // A batch of one: the used index moves with each entry.
            (Track::Split(t), _) => t.batch_add(head),
            (Track::Packed(t), Virtq::Packed(r)) => {
                if let Some(after) = r.used_after(head) {
                    t.used(head, after);
                }
            }
            _ => {}
        }
    }

    /// After `head`'s used entry was written.
    pub fn after_used(&self, q: &Virtq, head: u16) {
        match self {
            Track::Split(t) => t.batch_done(q.indices().1),
            Track::Packed(t) => t.used_done(head),
        }
    }
}
