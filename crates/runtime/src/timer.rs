//! Timers for tasks: `sleep`/`sleep_until` futures backed by a binary heap
//! of (deadline, waker). The earliest deadline bounds how long a sleeping
//! reactor blocks.

use std::cell::{Cell, RefCell};
use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use crate::{reactor, ticks};

struct Entry {
    deadline: u64,
    seq: u64,
    waker: Waker,
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

pub(crate) struct Timers {
    heap: RefCell<BinaryHeap<Entry>>,
    seq: Cell<u64>,
}

impl Timers {
    pub(crate) fn new() -> Timers {
        Timers {
            heap: RefCell::new(BinaryHeap::with_capacity(4096)),
            seq: Cell::new(0),
        }
    }

    fn add(&self, deadline: u64, waker: Waker) {
        let seq = self.seq.get();
        self.seq.set(seq + 1);
        self.heap.borrow_mut().push(Entry {
            deadline,
            seq,
            waker,
        });
    }

    /// Wakes every timer due at `now`; returns how many fired.
    pub(crate) fn fire(&self, now: u64) -> usize {
        let mut n = 0;
        loop {
            let due = {
                let mut h = self.heap.borrow_mut();
                match h.peek() {
                    Some(e) if e.deadline <= now => h.pop(),
                    _ => None,
                }
            };
            match due {
                Some(e) => {
                    e.waker.wake();
                    n += 1;
                }
                None => return n,
            }
        }
    }

    pub(crate) fn next_deadline(&self) -> Option<u64> {
        self.heap.borrow().peek().map(|e| e.deadline)
    }
}

/// Completes after `d` on the current reactor.
pub fn sleep(d: Duration) -> Sleep {
    Sleep {
        deadline: ticks::now() + ticks::at_least(d),
        armed: false,
    }
}

/// Completes when the tick clock reaches `deadline` (see [`crate::ticks`]).
pub fn sleep_until(deadline: u64) -> Sleep {
    Sleep {
        deadline,
        armed: false,
    }
}

pub struct Sleep {
    deadline: u64,
    armed: bool,
}

impl Future for Sleep {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if ticks::now() >= self.deadline {
            return Poll::Ready(());
        }
        if !self.armed {
            // One heap entry per Sleep: a spurious wake does not re-arm it, the
            // entry already in the heap will fire at the deadline.
            self.armed = true;
            reactor::with(|r| r.timers.add(self.deadline, cx.waker().clone()));
        }
        Poll::Pending
    }
}
