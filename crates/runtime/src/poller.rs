//! Pollers: functions a reactor calls every loop pass (active) or every
//! period (timed). A poller returns whether it found work, which drives the
//! adaptive sleep decision (SPDK's SPDK_POLLER_BUSY / IDLE).

use std::cell::{Cell, RefCell};
use std::time::Duration;

use crate::{reactor, ticks};

/// What a poller found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PollStatus {
    Busy,
    Idle,
}

/// Handle to unregister a poller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PollerId {
    idx: u32,
    gen: u32,
}

type PollFn = Box<dyn FnMut() -> PollStatus>;

struct Entry {
    gen: u32,
    f: Option<PollFn>,
    live: bool,
    period: u64,
    next: u64,
    name: &'static str,
}

pub(crate) struct Pollers {
    entries: RefCell<Vec<Entry>>,
    timed: Cell<usize>,
    /// Live pollers that run every pass.
    active: Cell<usize>,
    /// At most the earliest `next` of a live timed poller (`u64::MAX`:
    /// none), so a pass with no active poller and none due skips the list.
    first_due: Cell<u64>,
}

impl Pollers {
    pub(crate) fn new() -> Pollers {
        Pollers {
            entries: RefCell::new(Vec::with_capacity(64)),
            timed: Cell::new(0),
            active: Cell::new(0),
            first_due: Cell::new(u64::MAX),
        }
    }

    fn add(&self, name: &'static str, period: u64, f: PollFn) -> PollerId {
        let mut e = self.entries.borrow_mut();
        let next = if period == 0 {
            0
        } else {
            ticks::now() + period
        };
        if period != 0 {
            self.timed.set(self.timed.get() + 1);
            self.first_due.set(self.first_due.get().min(next));
        } else {
            self.active.set(self.active.get() + 1);
        }
        if let Some(i) = e.iter().position(|x| !x.live && x.f.is_none()) {
            let gen = e[i].gen.wrapping_add(1);
            e[i] = Entry {
                gen,
                f: Some(f),
                live: true,
                period,
                next,
                name,
            };
            return PollerId { idx: i as u32, gen };
        }
        e.push(Entry {
            gen: 0,
            f: Some(f),
            live: true,
            period,
            next,
            name,
        });
        PollerId {
            idx: (e.len() - 1) as u32,
            gen: 0,
        }
    }

    fn remove(&self, id: PollerId) -> bool {
        let mut e = self.entries.borrow_mut();
        match e.get_mut(id.idx as usize) {
            Some(x) if x.gen == id.gen && x.live => {
                x.live = false;
                if x.period != 0 {
                    self.timed.set(self.timed.get() - 1);
                } else {
                    self.active.set(self.active.get() - 1);
                }
                // If the poller is running right now its closure is out of the
                // slab; `run` drops it when it returns.
                x.f = None;
                true
            }
            _ => false,
        }
    }

    /// Runs active pollers and due timed pollers; returns how many were busy.
    pub(crate) fn run(&self, now: u64) -> usize {
        if self.active.get() == 0 && now < self.first_due.get() {
            return 0;
        }
        // Pollers added while this runs lower `first_due` themselves.
        self.first_due.set(u64::MAX);
        let mut first = u64::MAX;
        let n = self.entries.borrow().len();
        let mut busy = 0;
        for i in 0..n {
            let f = {
                let mut e = self.entries.borrow_mut();
                let x = &mut e[i];
                if !x.live {
                    continue;
                }
                if x.period != 0 {
                    if now < x.next {
                        first = first.min(x.next);
                        continue;
                    }
                    x.next = now + x.period;
                    first = first.min(x.next);
                }
                x.f.take()
            };
            let Some(mut f) = f else { continue };
            if f() == PollStatus::Busy {
                busy += 1;
            }
            let mut e = self.entries.borrow_mut();
            if e[i].live && e[i].f.is_none() {
                e[i].f = Some(f);
            }
        }
        self.first_due.set(self.first_due.get().min(first));
        busy
    }

    /// Earliest due time of a timed poller (bounds the sleep).
    pub(crate) fn next_deadline(&self) -> Option<u64> {
        if self.timed.get() == 0 {
            return None;
        }
        self.entries
            .borrow()
            .iter()
            .filter(|x| x.live && x.period != 0)
            .map(|x| x.next)
            .min()
    }

    pub(crate) fn names(&self) -> Vec<(&'static str, bool)> {
        self.entries
            .borrow()
            .iter()
            .filter(|x| x.live)
            .map(|x| (x.name, x.period != 0))
            .collect()
    }

    pub(crate) fn clear(&self) {
        let drained: Vec<Entry> = self.entries.borrow_mut().drain(..).collect();
        drop(drained);
        self.timed.set(0);
        self.active.set(0);
        self.first_due.set(u64::MAX);
    }
}

/// Registers an active poller on the current reactor (runs every pass).
pub fn register_poller(name: &'static str, f: impl FnMut() -> PollStatus + 'static) -> PollerId {
    reactor::with(|r| r.pollers.add(name, 0, Box::new(f)))
}

/// Registers a timed poller on the current reactor (runs every `period`).
pub fn register_timed_poller(
    name: &'static str,
    period: Duration,
    f: impl FnMut() -> PollStatus + 'static,
) -> PollerId {
    let p = ticks::from_duration(period).max(1);
    reactor::with(|r| r.pollers.add(name, p, Box::new(f)))
}

/// Unregisters a poller of the current reactor; false if it was already gone
/// (or the reactor has exited, taking its pollers with it).
pub fn unregister_poller(id: PollerId) -> bool {
    reactor::try_with(|r| r.pollers.remove(id)).unwrap_or(false)
}

/// Names of the current reactor's pollers and whether each is timed.
pub fn poller_names() -> Vec<(&'static str, bool)> {
    reactor::with(|r| r.pollers.names())
}
