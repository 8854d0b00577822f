//! Timers for tasks: `sleep`/`sleep_until` futures backed by a binary heap
//! of deadlines. The earliest deadline bounds how long a sleeping reactor
//! blocks.
//!
//! A `Sleep` that is dropped before its deadline (the timeout of a request
//! that completed, the losing side of a select) gives its entry back: the
//! waker lives in a slot of a slab, the heap entry names the slot and its
//! generation, and a drop moves the generation on. Such stale entries are
//! skipped when they come up and purged in one pass once they are more than
//! half of the heap, so a per-request timeout costs O(log n) and never grows
//! the heap or fires a stale wake-up, however far its deadline. Slots and
//! the heap keep their capacity: no allocation after warm-up.

use std::cell::{Cell, RefCell};
use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use crate::{reactor, ticks};

/// Stale entries the heap may hold before a purge is considered.
const PURGE_MIN: usize = 64;

struct Entry {
    deadline: u64,
    seq: u64,
    slot: u32,
    gen: u32,
}

impl PartialEq for Entry {
    fn eq(&self, o: &Self) -> bool {
        self.deadline == o.deadline && self.seq == o.seq
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Entry {
    // Reversed: BinaryHeap is a max-heap and we want the earliest first.
    fn cmp(&self, o: &Self) -> Ordering {
        o.deadline.cmp(&self.deadline).then(o.seq.cmp(&self.seq))
    }
}

/// One armed timer's waker; `gen` moves on when the timer fires or is
/// cancelled, which makes its heap entry stale.
struct Slot {
    gen: u32,
    waker: Option<Waker>,
}

/// An armed timer: which reactor's timers, which slot, which generation.
#[derive(Clone, Copy)]
struct Key {
    timers: u64,
    slot: u32,
    gen: u32,
}

/// Tells the timers of one reactor from those of any other, so a `Sleep`
/// dropped elsewhere (or after its reactor was replaced) touches nothing.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

pub(crate) struct Timers {
    id: u64,
    heap: RefCell<BinaryHeap<Entry>>,
    slots: RefCell<Vec<Slot>>,
    free: RefCell<Vec<u32>>,
    /// Heap entries whose timer was cancelled.
    stale: Cell<usize>,
    seq: Cell<u64>,
    /// At most the earliest deadline in the heap (`u64::MAX`: empty), so
    /// a pass with nothing due skips the heap.
    first: Cell<u64>,
}

impl Timers {
    pub(crate) fn new() -> Timers {
        Timers {
            id: NEXT_ID.fetch_add(1, AtomicOrdering::Relaxed),
            heap: RefCell::new(BinaryHeap::with_capacity(4096)),
            slots: RefCell::new(Vec::with_capacity(4096)),
            free: RefCell::new(Vec::with_capacity(4096)),
            stale: Cell::new(0),
            seq: Cell::new(0),
            first: Cell::new(u64::MAX),
        }
    }

    fn add(&self, deadline: u64, waker: Waker) -> Key {
        let mut slots = self.slots.borrow_mut();
        let slot = match self.free.borrow_mut().pop() {
            Some(i) => i,
            None => {
                slots.push(Slot {
                    gen: 0,
                    waker: None,
                });
                (slots.len() - 1) as u32
            }
        };
        let s = &mut slots[slot as usize];
        s.waker = Some(waker);
        let gen = s.gen;
        let seq = self.seq.get();
        self.seq.set(seq + 1);
        self.first.set(self.first.get().min(deadline));
        self.heap.borrow_mut().push(Entry {
            deadline,
            seq,
            slot,
            gen,
        });
        Key {
            timers: self.id,
            slot,
            gen,
        }
    }

    /// Frees the slot if generation `gen` still holds it; its waker.
    fn release(&self, slot: u32, gen: u32) -> Option<Option<Waker>> {
        let mut slots = self.slots.borrow_mut();
        let s = slots.get_mut(slot as usize).filter(|s| s.gen == gen)?;
        s.gen = s.gen.wrapping_add(1);
        let w = s.waker.take();
        self.free.borrow_mut().push(slot);
        Some(w)
    }

    /// A task polled the armed timer `key` again: keep its latest waker.
    /// `false` if `key` is no longer armed (then arm a new one).
    fn rearm(&self, key: Key, waker: &Waker) -> bool {
        let mut slots = self.slots.borrow_mut();
        let Some(s) = slots
            .get_mut(key.slot as usize)
            .filter(|s| s.gen == key.gen)
        else {
            return false;
        };
        if !s.waker.as_ref().is_some_and(|w| w.will_wake(waker)) {
            // The old waker is dropped after the borrow ends.
            let old = s.waker.replace(waker.clone());
            drop(slots);
            drop(old);
        }
        true
    }

    /// The timer `key` is no longer wanted: its entry goes stale, and the
    /// stale entries are purged once they are most of the heap.
    fn cancel(&self, key: Key) {
        let Some(waker) = self.release(key.slot, key.gen) else {
            return;
        };
        drop(waker);
        let stale = self.stale.get() + 1;
        let mut heap = self.heap.borrow_mut();
        if stale >= PURGE_MIN && stale * 2 > heap.len() {
            let slots = self.slots.borrow();
            heap.retain(|e| slots[e.slot as usize].gen == e.gen);
            self.stale.set(0);
        } else {
            self.stale.set(stale);
        }
    }

    /// Pops the earliest armed timer if it is due at `now` and frees its
    /// slot; stale entries due by then are dropped on the way.
    fn pop_due(&self, now: u64) -> Option<Option<Waker>> {
        loop {
            let e = {
                let mut h = self.heap.borrow_mut();
                match h.peek() {
                    Some(e) if e.deadline <= now => h.pop()?,
                    _ => return None,
                }
            };
            match self.release(e.slot, e.gen) {
                Some(w) => return Some(w),
                None => self.stale.set(self.stale.get().saturating_sub(1)),
            }
        }
    }

    /// Wakes every timer due at `now`; returns how many fired.
    pub(crate) fn fire(&self, now: u64) -> usize {
        if now < self.first.get() {
            return 0;
        }
        let mut n = 0;
        while let Some(w) = self.pop_due(now) {
            if let Some(w) = w {
                w.wake();
            }
            n += 1;
        }
        let first = self.heap.borrow().peek().map_or(u64::MAX, |e| e.deadline);
        self.first.set(first);
        n
    }

    /// The earliest deadline of an armed timer (stale entries in front of
    /// it are dropped: a sleeping reactor never wakes for them).
    pub(crate) fn next_deadline(&self) -> Option<u64> {
        loop {
            let (deadline, slot, gen) = {
                let h = self.heap.borrow();
                let e = h.peek()?;
                (e.deadline, e.slot, e.gen)
            };
            if self.slots.borrow()[slot as usize].gen == gen {
                return Some(deadline);
            }
            self.heap.borrow_mut().pop();
            self.stale.set(self.stale.get().saturating_sub(1));
        }
    }

    /// Heap entries, armed and stale (for [`crate::ReactorStats`]).
    pub(crate) fn entries(&self) -> usize {
        self.heap.borrow().len()
    }
}

/// Completes after `d` on the current reactor.
pub fn sleep(d: Duration) -> Sleep {
    Sleep {
        deadline: ticks::now() + ticks::at_least(d),
        key: None,
    }
}

/// Completes when the tick clock reaches `deadline` (see [`crate::ticks`]).
pub fn sleep_until(deadline: u64) -> Sleep {
    Sleep {
        deadline,
        key: None,
    }
}

/// A timer future. It is armed on the reactor that first polls it; dropped
/// before its deadline it gives its timer back.
pub struct Sleep {
    deadline: u64,
    key: Option<Key>,
}

impl Sleep {
    fn disarm(&mut self) {
        if let Some(k) = self.key.take() {
            let _ = reactor::try_with(|r| {
                if r.timers.id == k.timers {
                    r.timers.cancel(k);
                }
            });
        }
    }
}

impl Future for Sleep {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        if ticks::now() >= this.deadline {
            this.disarm();
            return Poll::Ready(());
        }
        let key = this.key;
        reactor::with(|r| {
            // One heap entry per Sleep: a poll before the deadline only
            // updates the waker the entry will wake.
            let armed =
                key.is_some_and(|k| k.timers == r.timers.id && r.timers.rearm(k, cx.waker()));
            if !armed {
                this.key = Some(r.timers.add(this.deadline, cx.waker().clone()));
            }
        });
        Poll::Pending
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        self.disarm();
    }
}

#[cfg(test)]
mod tests {
    use super::Timers;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::{Wake, Waker};

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn waker() -> (Arc<Count>, Waker) {
        let c = Arc::new(Count(AtomicUsize::new(0)));
        (c.clone(), Waker::from(c))
    }

    #[test]
    fn cancelled_timers_neither_fire_nor_pile_up() {
        let t = Timers::new();
        let (live_count, live) = waker();
        let kept = t.add(1_000, live);
        let (dead_count, dead) = waker();
        for i in 0..100_000u64 {
            let k = t.add(2_000 + i, dead.clone());
            t.cancel(k);
            assert!(t.entries() <= 2 * super::PURGE_MIN + 1, "{}", t.entries());
        }
        // Slots are reused: one for the kept timer, one for the churn.
        assert!(t.slots.borrow().len() <= 2);
        assert_eq!(t.next_deadline(), Some(1_000));
        assert_eq!(t.fire(u64::MAX - 1), 1);
        assert_eq!(live_count.0.load(Ordering::SeqCst), 1);
        assert_eq!(dead_count.0.load(Ordering::SeqCst), 0);
        assert_eq!(t.entries(), 0);
        assert_eq!(t.next_deadline(), None);
        // A fired timer's key cancels nothing (its slot may be reused).
        let (_, w) = waker();
        let again = t.add(5, w);
        t.cancel(kept);
        assert_eq!(t.next_deadline(), Some(5));
        t.cancel(again);
        assert_eq!(t.next_deadline(), None);
    }

    #[test]
    fn stale_entries_in_front_do_not_bound_the_sleep() {
        let t = Timers::new();
        let (_, w) = waker();
        let early = t.add(10, w.clone());
        t.add(50, w);
        t.cancel(early);
        assert_eq!(t.next_deadline(), Some(50));
        assert_eq!(t.fire(20), 0);
        assert_eq!(t.fire(50), 1);
    }
}
