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
//! over virtio-user, null bdev): QD32 +8-13 %, QD128 +17-21 %, QD16 and
//! below level (see bench/RESULTS-vhost.md).
//!
//! The threshold is what keeps shallow drivers out: a hold grows the next
//! batch to about two thirds of the driver's depth, so holds keep coming
//! only for a driver deeper than ~1.5 × [`DEEP_BATCH`]; a shallower one
//! (QD16 here, where holding cost 5 % at a threshold of 8) falls back to
//! looking every pass after one hold. QD1 never holds, so its latency is
//! untouched; a hold delays a deep batch by at most [`HOLD`], far below
//! any real device's service time.
//!
//! It suits a driver that fences after every submission: libblkio's
//! driver, which does not, measured 0.95-0.96x with the hold at QD32. So
//! the hold is probed: a 1 ms epoch runs with it flipped every so often
//! (one in eight at first), and the flip stays when that epoch took
//! requests faster than the epoch before it (by 2 %). Measured: libblkio
//! 1.00-1.02x of no hold at all, bdevperf 0.96-0.99x of a hold always on
//! (the probes' cost). A probe that finds the setting clearly right (the
//! flipped epoch 4 % slower or more) doubles the time to the next, up to
//! one epoch in 128, so a setting worth a lot is rarely flipped.
//!
//! Only blk's queues pace. vhost-user-scsi's spend ~1.5x blk's
//! instructions per request, so there the backend, not the driver, is the
//! limit, and holding measured 0.97-0.98x (bench/RESULTS-vhost.md).
//!
//! The order a pass runs its chains in is chosen here too. Where taking a
//! request is cheap (the vCPUs near: ~60-90 ns a request here) each chain
//! runs as it is taken, so the driver sees the first completion at once
//! (taking the whole batch first measured 0.89-0.93x at QD32 there).
//! Where it is dear (the vCPUs on two core complexes: ~290 ns, nearly all
//! of it cache lines crossing), a pass takes every chain of its look first
//! and runs them after, as SPDK does: the loads of several chains are then
//! in flight together and the stores come in one burst (+11 % at QD32
//! there). Which case holds is sampled: every [`SAMPLE_EVERY`]th look
//! times its pass per request, and an average above [`TAKE_ALL_ABOVE`]
//! switches to taking all first, below [`TAKE_ALL_BELOW`] back.
//!
//! A pass that takes all first also reads ahead (`Virtq::look_ahead`:
//! every chain's descriptor, header and second descriptor lines started
//! before the first pop, so their transfers overlap) and stores the used
//! index once, after the batch ran. With libblkio's driver that took far
//! QD32 from 2.9 M to 4.45 M IOPS, and the driver became the limit; with
//! bdevperf's it cost 5-8 % (the header lines most; not analysed
//! further: a line fetched early is lost again if the driver still writes
//! beside it). So the read-ahead is the probe's second setting.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ustor_runtime::ticks;

/// The batch from which a queue holds its next look.
pub const DEEP_BATCH: usize = 12;

/// How long it holds.
pub const HOLD: Duration = Duration::from_nanos(150);

/// How long an epoch of the probe runs, and one epoch in how many runs
/// with a setting flipped, at first.
pub const EPOCH: Duration = Duration::from_millis(1);
pub const PROBE_EVERY: u32 = 8;

/// A setting whose probe found it clearly right (the flipped epoch
/// [`CLEAR_MARGIN`] % slower or more) is probed half as often as before,
/// down to one epoch in [`PROBE_MAX_GAP`].
pub const CLEAR_MARGIN: u64 = 4;
pub const PROBE_MAX_GAP: u32 = 128;

/// One look in this many is timed (two TSC reads, tens of ns in a VM).
pub const SAMPLE_EVERY: u32 = 16;

/// A pass's time per request above which a pass takes all its chains
/// before it runs them, and below which it runs each as it takes it.
pub const TAKE_ALL_ABOVE: Duration = Duration::from_nanos(180);
pub const TAKE_ALL_BELOW: Duration = Duration::from_nanos(130);

/// Every queue of the process orders its passes as where requests are
/// dear ([`always_take_all`]).
static ALWAYS_TAKE_ALL: AtomicBool = AtomicBool::new(false);

/// Tests and diagnosis: every pass takes its whole batch first (and reads
/// ahead, as probed) whatever the samples say, so the order the vCPUs'
/// placement picks can be run on any placement.
#[doc(hidden)]
pub fn always_take_all(on: bool) {
    ALWAYS_TAKE_ALL.store(on, Ordering::Relaxed);
}

/// What the probe flips: the hold, or a take-all pass's read-ahead.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Knob {
    Hold = 0,
    ReadAhead = 1,
}

/// A probed on/off setting.
struct Setting {
    on: Cell<bool>,
    /// Epochs between its probes ([`PROBE_EVERY`] up to [`PROBE_MAX_GAP`]).
    gap: Cell<u32>,
    /// Epochs until its next probe.
    wait: Cell<u32>,
}

impl Setting {
    fn new(wait: u32) -> Setting {
        Setting {
            on: Cell::new(true),
            gap: Cell::new(PROBE_EVERY),
            wait: Cell::new(wait),
        }
    }

    fn flip(&self) {
        self.on.set(!self.on.get());
    }
}

/// One queue's pacing state (queue task only).
pub struct Pace {
    /// The TSC time before which the queue does not look; 0: no hold.
    until: Cell<u64>,
    hold: u64,
    /// Passes take every chain first, then run them.
    take_all: Cell<bool>,
    looks: Cell<u32>,
    /// Ticks per request, a moving average of the timed passes.
    per_request: Cell<u64>,
    above: u64,
    below: u64,
    /// Whether deep batches hold, and whether a take-all pass reads ahead
    /// and publishes once (by [`Knob`]; probed, see [`Pace::probe`]).
    knobs: [Setting; 2],
    epoch_start: Cell<u64>,
    epoch_reqs: Cell<u64>,
    /// Requests per tick << 20 of the last epoch run with the setting kept.
    base_rate: Cell<u64>,
    /// The knob the running epoch has flipped, if it is a probe.
    probing: Cell<Option<Knob>>,
    epoch: u64,
}

impl Default for Pace {
    fn default() -> Self {
        Pace {
            until: Cell::new(0),
            hold: ticks::from_duration(HOLD),
            take_all: Cell::new(false),
            looks: Cell::new(0),
            per_request: Cell::new(0),
            above: ticks::from_duration(TAKE_ALL_ABOVE),
            below: ticks::from_duration(TAKE_ALL_BELOW),
            knobs: [Setting::new(PROBE_EVERY), Setting::new(PROBE_EVERY / 2)],
            epoch_start: Cell::new(0),
            epoch_reqs: Cell::new(0),
            base_rate: Cell::new(0),
            probing: Cell::new(None),
            epoch: ticks::from_duration(EPOCH),
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
        self.epoch_reqs.set(self.epoch_reqs.get() + n as u64);
        if n >= DEEP_BATCH && self.on(Knob::Hold) {
            self.until.set(ticks::now() + self.hold);
        }
    }

    /// Whether this pass takes every chain before it runs any.
    #[inline]
    pub fn take_all(&self) -> bool {
        self.take_all.get() || ALWAYS_TAKE_ALL.load(Ordering::Relaxed)
    }

    /// Whether a take-all pass starts fetching its chains' lines before it
    /// takes them and stores the used index once, after it ran them all
    /// (see the module comment).
    #[inline]
    pub fn read_ahead(&self) -> bool {
        self.take_all() && self.on(Knob::ReadAhead)
    }

    /// At the start of a look: the TSC if this look is timed, else 0.
    #[inline]
    pub fn sample_start(&self) -> u64 {
        let k = self.looks.get().wrapping_add(1);
        self.looks.set(k);
        if k % SAMPLE_EVERY == 0 {
            ticks::now()
        } else {
            0
        }
    }

    /// After a look whose pass took and ran `n` chains (`t0`: what
    /// [`Self::sample_start`] gave): folds its time per request into the
    /// average and picks the order. A pass of one request says nothing
    /// about the batch order.
    #[inline]
    pub fn sample_end(&self, t0: u64, n: usize) {
        if t0 == 0 || n < 2 {
            return;
        }
        let t1 = ticks::now();
        self.fold(t1.saturating_sub(t0) / n as u64);
        self.probe(t1);
    }

    fn on(&self, knob: Knob) -> bool {
        self.knobs[knob as usize].on.get()
    }

    /// At a timed look: closes an epoch that has run [`EPOCH`]. A setting
    /// is flipped for one epoch every so often (its gap), and the flip is
    /// kept when that epoch took requests faster (by 2 %) than the one
    /// before it. A probe that finds the setting clearly right (the
    /// flipped epoch [`CLEAR_MARGIN`] % slower) doubles the gap, up to
    /// [`PROBE_MAX_GAP`]; anything else sets it back to [`PROBE_EVERY`].
    /// So a setting worth a lot is rarely flipped (a probe epoch costs
    /// what it is worth), and one that is not is looked at again soon.
    fn probe(&self, now: u64) {
        let start = self.epoch_start.get();
        let el = now.saturating_sub(start);
        if start == 0 || el < self.epoch {
            if start == 0 {
                self.epoch_start.set(now);
                self.epoch_reqs.set(0);
            }
            return;
        }
        let rate = (self.epoch_reqs.get() << 20) / el.max(1);
        self.epoch_start.set(now);
        self.epoch_reqs.set(0);
        if let Some(knob) = self.probing.take() {
            let s = &self.knobs[knob as usize];
            let base = self.base_rate.get();
            let gap = if rate * 100 > base * 102 {
                self.base_rate.set(rate);
                PROBE_EVERY
            } else {
                s.flip();
                if rate * 100 < base * (100 - CLEAR_MARGIN) {
                    (s.gap.get() * 2).min(PROBE_MAX_GAP)
                } else {
                    PROBE_EVERY
                }
            };
            s.gap.set(gap);
            s.wait.set(gap);
            return;
        }
        self.base_rate.set(rate);
        for s in &self.knobs {
            s.wait.set(s.wait.get().saturating_sub(1));
        }
        for knob in [Knob::Hold, Knob::ReadAhead] {
            let s = &self.knobs[knob as usize];
            if s.wait.get() == 0 {
                self.probing.set(Some(knob));
                s.flip();
                return;
            }
        }
    }

    fn fold(&self, per: u64) {
        let avg = (self.per_request.get() * 7 + per) / 8;
        self.per_request.set(avg);
        if self.take_all.get() {
            if avg < self.below {
                self.take_all.set(false);
            }
        } else if avg > self.above {
            self.take_all.set(true);
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

    #[test]
    fn dear_requests_take_the_whole_batch_first_and_cheap_ones_go_back() {
        let p = Pace::default();
        assert!(!p.take_all());
        let ns = |n| ticks::from_duration(Duration::from_nanos(n));
        for _ in 0..64 {
            p.fold(ns(290));
        }
        assert!(p.take_all());
        // Between the two thresholds the order stays (no flapping).
        for _ in 0..64 {
            p.fold(ns(150));
        }
        assert!(p.take_all());
        for _ in 0..64 {
            p.fold(ns(70));
        }
        assert!(!p.take_all());
        for _ in 0..64 {
            p.fold(ns(150));
        }
        assert!(!p.take_all());
        // Only every SAMPLE_EVERYth look is timed.
        let timed = (0..SAMPLE_EVERY * 4)
            .filter(|_| p.sample_start() != 0)
            .count();
        assert_eq!(timed, 4);
    }

    /// Runs one epoch of `reqs` requests over exactly an epoch's ticks.
    fn epoch(p: &Pace, t: &mut u64, reqs: u64) {
        p.epoch_reqs.set(reqs);
        *t += p.epoch;
        p.probe(*t);
    }

    /// Runs regular epochs of `reqs` requests until `knob` is flipped for
    /// a probe (bounded); the epochs run.
    fn until_probe(p: &Pace, t: &mut u64, knob: Knob, reqs: u64) -> u32 {
        let was = p.on(knob);
        for k in 1..=PROBE_MAX_GAP + 2 {
            epoch(p, t, reqs);
            if p.probing.get() == Some(knob) {
                assert_ne!(p.on(knob), was, "a probe flips its setting");
                return k;
            }
            if p.probing.get().is_some() {
                // The other setting's probe: no change in rate, flipped back.
                epoch(p, t, reqs);
            }
        }
        panic!("{knob:?} never probed");
    }

    #[test]
    fn the_hold_is_probed_and_a_flip_stays_only_when_it_was_faster() {
        let p = Pace::default();
        let mut t = 1_000;
        p.probe(t); // the first timed look starts the first epoch
        assert!(p.on(Knob::Hold) && p.on(Knob::ReadAhead));
        assert_eq!(until_probe(&p, &mut t, Knob::Hold, 1000), PROBE_EVERY);
        assert!(p.on(Knob::ReadAhead), "its probe found no change: back on");
        // Slower without: the hold comes back.
        epoch(&p, &mut t, 900);
        assert!(p.on(Knob::Hold));
        // Next probe: faster without (a driver that gains nothing from
        // the hold), so it stays off.
        until_probe(&p, &mut t, Knob::Hold, 1000);
        epoch(&p, &mut t, 1100);
        assert!(!p.on(Knob::Hold), "a faster flip stays");
        // Off, a deep batch does not hold.
        p.taken(DEEP_BATCH);
        assert!(p.may_look());
    }

    #[test]
    fn a_setting_found_clearly_right_is_probed_less_often() {
        let p = Pace::default();
        let mut t = 1_000;
        p.probe(t);
        // The read-ahead worth 30 %: each probe's epoch is that much
        // slower, so the gaps double up to the most.
        let mut gaps = Vec::new();
        for _ in 0..8 {
            gaps.push(until_probe(&p, &mut t, Knob::ReadAhead, 1000));
            epoch(&p, &mut t, 700);
            assert!(p.on(Knob::ReadAhead));
        }
        assert!(gaps[2] > gaps[1] && gaps[1] > gaps[0], "{gaps:?}");
        assert!(gaps.iter().all(|&g| g <= PROBE_MAX_GAP + 1), "{gaps:?}");
        assert_eq!(p.knobs[Knob::ReadAhead as usize].gap.get(), PROBE_MAX_GAP);
        // A near tie sets the gap back.
        until_probe(&p, &mut t, Knob::ReadAhead, 1000);
        epoch(&p, &mut t, 990);
        assert!(p.on(Knob::ReadAhead));
        assert_eq!(p.knobs[Knob::ReadAhead as usize].gap.get(), PROBE_EVERY);
    }

    #[test]
    fn the_read_ahead_is_probed_in_take_all_passes() {
        let p = Pace::default();
        assert!(!p.read_ahead(), "only a take-all pass reads ahead");
        for _ in 0..64 {
            p.fold(ticks::from_duration(Duration::from_nanos(290)));
        }
        assert!(p.read_ahead());
        let mut t = 1_000;
        p.probe(t);
        until_probe(&p, &mut t, Knob::ReadAhead, 1000);
        assert!(!p.read_ahead(), "the probe epoch runs without it");
        // Faster without (a driver whose lines it would steal): stays off.
        epoch(&p, &mut t, 1100);
        assert!(!p.read_ahead());
        until_probe(&p, &mut t, Knob::ReadAhead, 1100);
        assert!(p.read_ahead(), "probed again");
        epoch(&p, &mut t, 1500);
        assert!(p.read_ahead(), "faster with it: stays on");
    }
}
