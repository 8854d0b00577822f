//! Pacing a busy request queue's looks at the driver's available index.
//!
//! A queue that finds a deep batch (at least [`DEEP_BATCH`] chains) waits
//! [`HOLD`] before it looks again, so the driver's next requests land in
//! one batch instead of being taken a few at a time. Each look takes the
//! index's cache line (and the avail and descriptor lines around it) from
//! the driver, and a driver that fences after every submission (SPDK's
//! virtio driver does) then waits for those lines to come back: taken in
//! batches of ~10, the lines crossed cores once per few requests and the
//! driver's core was the limit. Measured with the vCPUs near (bdevperf
//! over virtio-user, null bdev): QD32 +8-10 %, QD128 up to +21 %, QD16
//! and below level (see bench/RESULTS-vhost.md).
//!
//! The threshold is what keeps shallow drivers out: a hold grows the next
//! batch to about two thirds of the driver's depth, so holds keep coming
//! only for a driver deeper than ~1.5 × [`DEEP_BATCH`]; a shallower one
//! (QD16 here, where holding cost 5 % at a threshold of 8) falls back to
//! looking every pass after one hold. QD1 never holds, so its latency is
//! untouched; a hold delays a deep batch by at most [`HOLD`], far below
//! any real device's service time.
//!
//! Only blk's queues pace. vhost-user-scsi's spend ~1.5x blk's
//! instructions per request, so there the backend, not the driver, is the
//! limit, and holding measured 0.97-0.98x (bench/RESULTS-vhost.md).

use std::cell::Cell;
use std::time::Duration;

use ustor_runtime::ticks;

/// The batch from which a queue holds its next look.
pub const DEEP_BATCH: usize = 12;

/// How long it holds.
pub const HOLD: Duration = Duration::from_nanos(150);

/// One queue's pacing state (queue task only).
pub struct Pace {
    /// The TSC time before which the queue does not look; 0: no hold.
    until: Cell<u64>,
    hold: u64,
}

impl Default for Pace {
    fn default() -> Self {
        Pace {
            until: Cell::new(0),
            hold: ticks::from_duration(HOLD),
        }
    }
}

impl Pace {
    /// Whether the queue may look at the available index now. Reads the
    /// TSC only while a hold runs (the pass clock is too coarse: a
    /// yielding task is polled several times in one reactor pass).
    #[inline]
    pub fn may_look(&self) -> bool {
        let until = self.until.get();
        if until == 0 {
            return true;
        }
        if ticks::now() < until {
            return false;
        }
        self.until.set(0);
        true
    }

    /// After a look that took `n` chains: holds the next one if `n` was deep.
    #[inline]
    pub fn taken(&self, n: usize) {
        if n >= DEEP_BATCH {
            self.until.set(ticks::now() + self.hold);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_deep_batch_holds_the_next_look_for_a_while_and_a_shallow_one_does_not() {
        let p = Pace::default();
        p.taken(DEEP_BATCH - 1);
        assert!(p.may_look());
        let t0 = Instant::now();
        p.taken(DEEP_BATCH);
        let held = !p.may_look();
        // Wait on the condition (bounded), never on a sleep.
        while !p.may_look() {
            assert!(t0.elapsed() < Duration::from_secs(1), "hold never ended");
        }
        // The hold is ticks of at least HOLD; the first check may already
        // be past it on a slow machine, so it is asserted only together
        // with the time it took.
        assert!(held || t0.elapsed() >= HOLD);
        assert!(p.may_look());
    }
}
