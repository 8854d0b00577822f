//! Adaptive mode's timed nap at the start of an idle stretch ("hybrid
//! polling", as the kernel does for polled block I/O).
//!
//! A reactor serving one request at a time (QD1 over a network target) sees
//! the same idle gap again and again: the client's round trip, 15-25 µs on
//! this VM. Spinning through all of it is what gives adaptive mode its low
//! latency, and it costs a whole core: 30 µs of CPU per request, more than
//! the server's work. Sleeping at once (interrupt mode) costs a wake-up on
//! the critical path instead: an inter-processor interrupt to an idle vCPU,
//! about 10 µs here.
//!
//! The nap takes the part of the gap that can be predicted: when an idle
//! stretch begins, the reactor sleeps on a timer for the gap it expects,
//! less what the timer wake-up itself overshoots and a safety margin, then
//! spins for the rest. The request then finds a spinning reactor (poll-mode
//! latency) for a fraction of the CPU. If it comes early, the nap ends on
//! its completion like an interrupt-mode sleep, no later.
//!
//! What it learns, per reactor:
//! - the gap: a low quantile (the 4th shortest) of the last 16 idle gaps, so
//!   a few long ones (a pause of the client) do not make it oversleep and
//!   the short mode of a bimodal load wins;
//! - the overshoot: how much later than asked a timed nap ends, the median
//!   of the last 8 (timer interrupt, VM exit, scheduler: 5-8 µs measured
//!   here on a quiet host). When the host is busy a halted vCPU can come
//!   back milliseconds late; the median then rises past the gap and naps
//!   stop, and one probe nap in [`PROBE_EVERY`] refusals finds out when the
//!   host is quiet again.
//!
//! Under load the gaps are a few hundred ns or none, the plan asks for less
//! than [`MIN_NAP_NS`], and the reactor spins as before.
//!
//! Measured (NBD server, malloc bdev, fio nbd QD1 from the other core;
//! bench/RESULTS-nbd.md): server CPU per request 26.4 → 21.7 µs reads,
//! 24.3 → 22.5 µs writes, mean latency within 1 µs of the pure spin.

/// Naps shorter than this are not worth a syscall and a timer.
pub(crate) const MIN_NAP_NS: u64 = 1_000;
/// Gaps remembered.
const WINDOW: usize = 16;
/// One nap in this many refused for lateness alone probes the timer again.
pub(crate) const PROBE_EVERY: u32 = 256;
/// Timer overshoots remembered.
const LATE_WINDOW: usize = 8;
/// Which shortest gap of the window is the estimate (0-based).
const QUANTILE: usize = 3;

/// Per-reactor nap planner, in ticks.
#[derive(Debug)]
pub(crate) struct NapPlanner {
    gaps: [u64; WINDOW],
    next: usize,
    filled: usize,
    /// Overshoots of the last timer-ended naps, and their median.
    late: [u64; LATE_WINDOW],
    late_next: usize,
    overshoot: u64,
    /// Plans refused only because of the overshoot, since the last probe.
    blocked: u32,
    min_nap: u64,
    margin: u64,
    /// Naps planned and naps that ended before their timer (work came
    /// early: the estimate was too long).
    pub(crate) naps: u64,
    pub(crate) early: u64,
}

impl NapPlanner {
    /// `overshoot0`: the first guess of a timer's lateness; `min_nap`: the
    /// shortest nap worth taking; `margin`: spin kept before the expected
    /// arrival (all in ticks).
    pub(crate) fn new(overshoot0: u64, min_nap: u64, margin: u64) -> NapPlanner {
        NapPlanner {
            gaps: [0; WINDOW],
            next: 0,
            filled: 0,
            late: [overshoot0; LATE_WINDOW],
            late_next: 0,
            blocked: 0,
            overshoot: overshoot0,
            min_nap,
            margin,
            naps: 0,
            early: 0,
        }
    }

    /// An idle stretch of `gap` ticks ended with work.
    #[inline]
    pub(crate) fn record_gap(&mut self, gap: u64) {
        self.gaps[self.next] = gap;
        self.next = (self.next + 1) % WINDOW;
        self.filled = (self.filled + 1).min(WINDOW);
    }

    /// The expected gap: the `QUANTILE`-th shortest of a full window.
    fn expected_gap(&self) -> Option<u64> {
        if self.filled < WINDOW {
            return None;
        }
        let mut g = self.gaps;
        let (_, q, _) = g.select_nth_unstable(QUANTILE);
        Some(*q)
    }

    /// How long to nap, `idle` ticks into an idle stretch that the reactor
    /// would spin for `spin` ticks in all, if at all.
    pub(crate) fn plan(&mut self, idle: u64, spin: u64) -> Option<u64> {
        let gap = self.expected_gap()?;
        if gap >= spin {
            // The reactor sleeps before such a gap ends anyway; a nap would
            // only add a wake-up (and read as a short sleep to the spin
            // budget, which would then grow).
            return None;
        }
        let keep = idle + self.margin;
        let room = gap.checked_sub(keep)?;
        if room < self.min_nap {
            return None;
        }
        match room.checked_sub(self.overshoot) {
            Some(nap) if nap >= self.min_nap => Some(nap),
            _ => {
                // Only the timer's lateness is in the way. It was learned
                // from naps, so without naps it would never be unlearned
                // after a bad spell of the host: probe now and then.
                self.blocked += 1;
                if self.blocked >= PROBE_EVERY {
                    self.blocked = 0;
                    Some(self.min_nap)
                } else {
                    None
                }
            }
        }
    }

    /// A nap asked for `asked` ticks lasted `slept`.
    pub(crate) fn after_nap(&mut self, asked: u64, slept: u64) {
        self.naps += 1;
        if slept >= asked {
            // Ended by its timer: learn the lateness. The median of the
            // last few, because a vCPU that halts is sometimes not given
            // back for milliseconds, and one such nap must not stop napping.
            self.late[self.late_next] = slept - asked;
            self.late_next = (self.late_next + 1) % LATE_WINDOW;
            let mut l = self.late;
            let (_, m, _) = l.select_nth_unstable(LATE_WINDOW / 2);
            self.overshoot = *m;
        } else {
            self.early += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{NapPlanner, PROBE_EVERY};

    const SPIN: u64 = 1_000_000;

    fn planner() -> NapPlanner {
        NapPlanner::new(7_000, 1_000, 1_000)
    }

    #[test]
    fn no_nap_until_the_window_is_full() {
        let mut p = planner();
        for _ in 0..15 {
            p.record_gap(30_000);
            assert_eq!(p.plan(0, SPIN), None);
        }
        p.record_gap(30_000);
        // 30 - (7 overshoot + 1 margin) = 22 µs.
        assert_eq!(p.plan(0, SPIN), Some(22_000));
        // Later in the stretch, less is left.
        assert_eq!(p.plan(10_000, SPIN), Some(12_000));
        assert_eq!(p.plan(22_000, SPIN), None);
    }

    #[test]
    fn gaps_beyond_the_spin_are_slept_not_napped() {
        let mut p = planner();
        for _ in 0..16 {
            p.record_gap(2_000_000);
        }
        assert_eq!(p.plan(0, SPIN), None);
        assert_eq!(p.plan(0, 4_000_000), Some(2_000_000 - 7_000 - 1_000));
    }

    #[test]
    fn busy_reactors_do_not_nap() {
        let mut p = planner();
        for _ in 0..16 {
            p.record_gap(300);
        }
        for _ in 0..1000 {
            assert_eq!(p.plan(0, SPIN), None);
        }
    }

    #[test]
    fn a_few_long_gaps_do_not_stretch_the_nap() {
        let mut p = planner();
        for i in 0..16 {
            p.record_gap(if i % 4 == 0 { 5_000_000 } else { 30_000 });
        }
        assert_eq!(p.plan(0, SPIN), Some(22_000));
        // Four short gaps in sixteen are enough to stop napping.
        let mut p = planner();
        for i in 0..16 {
            p.record_gap(if i % 4 == 0 { 1_000 } else { 30_000 });
        }
        assert_eq!(p.plan(0, SPIN), None);
    }

    #[test]
    fn overshoot_is_the_median_of_timer_ended_naps() {
        let mut p = planner();
        for i in 0..64 {
            // Every fourth nap is handed back milliseconds late.
            let late = if i % 4 == 0 { 3_000_000 } else { 15_000 };
            p.after_nap(10_000, 10_000 + late);
        }
        assert_eq!(p.overshoot, 15_000);
        // A nap cut short by work says nothing about the timer.
        p.after_nap(10_000, 3_000);
        assert_eq!(p.early, 1);
        assert_eq!(p.naps, 65);
        assert_eq!(p.overshoot, 15_000);
        for _ in 0..16 {
            p.record_gap(30_000);
        }
        assert_eq!(p.plan(0, SPIN), Some(30_000 - 15_000 - 1_000));
    }

    #[test]
    fn a_late_timer_stops_naps_but_probes_now_and_then() {
        let mut p = planner();
        for _ in 0..16 {
            p.record_gap(30_000);
        }
        // The host held the halted vCPU for 5 ms per nap.
        for _ in 0..8 {
            p.after_nap(10_000, 5_010_000);
        }
        let planned = (0..PROBE_EVERY * 4)
            .filter(|_| p.plan(0, SPIN).is_some())
            .count();
        assert_eq!(planned, 4, "one probe per {PROBE_EVERY} refusals");
        // Probes that come back on time bring the naps back.
        for _ in 0..8 {
            p.after_nap(1_000, 8_000);
        }
        assert_eq!(p.plan(0, SPIN), Some(30_000 - 7_000 - 1_000));
    }
}
