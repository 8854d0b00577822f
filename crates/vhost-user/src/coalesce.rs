//! Call-eventfd coalescing (`vhost_controller_set_coalescing`), by SPDK's
//! rule: every [`CHECK_INTERVAL_MS`] a queue compares the requests it took
//! with `iops_threshold` (scaled to the interval); above it, the driver is
//! signalled at most once per `delay_base_us * (requests - threshold) /
//! threshold`, below it at once. A signal held back stays pending and goes
//! out when the delay has passed or at the next rate check, whichever
//! comes first (the queue task checks every pass and
//! does not go to sleep while one is held), so no completion waits for
//! the next one.
//!
//! Pure state on ticks (`ustor_runtime::ticks`), unit-tested with made-up
//! times; one per queue, on the queue's reactor.

/// How often the request rate is measured (SPDK's stats check interval).
pub const CHECK_INTERVAL_MS: u64 = 10;

/// One queue's coalescing state.
#[derive(Debug)]
pub struct Coalescer {
    hz: u64,
    /// Ticks between two signals; 0: signal every time.
    delay: u64,
    next_event: u64,
    window_start: u64,
    window_reqs: u64,
    pending: bool,
}

impl Coalescer {
    /// `hz`: ticks per second of the clock `now` is read from.
    pub fn new(hz: u64, now: u64) -> Coalescer {
        Coalescer {
            hz,
            delay: 0,
            next_event: now,
            window_start: now,
            window_reqs: 0,
            pending: false,
        }
    }

    /// Counts requests taken from the ring.
    pub fn taken(&mut self, n: u64) {
        self.window_reqs += n;
    }

    /// The delay now in force, in ticks.
    pub fn delay_ticks(&self) -> u64 {
        self.delay
    }

    /// Once per interval: recomputes the delay from the rate seen and the
    /// settings `(delay_base_us, iops_threshold)`.
    pub fn check(&mut self, now: u64, (base_us, iops_threshold): (u32, u32)) {
        let interval = self.hz * CHECK_INTERVAL_MS / 1000;
        if now.wrapping_sub(self.window_start) < interval {
            return;
        }
        // Requests per interval the threshold allows (at least 1).
        let thr = (iops_threshold as u64 * CHECK_INTERVAL_MS / 1000).max(1);
        let reqs = self.window_reqs;
        self.delay = if base_us == 0 || iops_threshold == 0 || reqs <= thr {
            0
        } else {
            let us = base_us as u64 * (reqs - thr) / thr;
            us.saturating_mul(self.hz) / 1_000_000
        };
        self.window_start = now;
        self.window_reqs = 0;
        // As SPDK: a held signal goes out at the check, so none waits
        // longer than an interval whatever the delay.
        self.next_event = now;
    }

    /// A completion the driver wants to hear about: true to signal now,
    /// false when it is held back (pending).
    pub fn used(&mut self, now: u64) -> bool {
        if self.delay == 0 {
            self.pending = false;
            return true;
        }
        if now >= self.next_event {
            self.fire(now);
            return true;
        }
        self.pending = true;
        false
    }

    /// True when a held-back signal is due now.
    pub fn due(&mut self, now: u64) -> bool {
        if self.pending && now >= self.next_event {
            self.fire(now);
            return true;
        }
        false
    }

    /// Whether a signal is held back (the queue keeps polling until it is
    /// due rather than sleep on it).
    pub fn pending(&self) -> bool {
        self.pending
    }

    /// True when a signal is held back (the queue stops and sends it now).
    pub fn flush(&mut self, now: u64) -> bool {
        if self.pending {
            self.fire(now);
            return true;
        }
        false
    }

    fn fire(&mut self, now: u64) {
        self.pending = false;
        self.next_event = now + self.delay;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HZ: u64 = 1_000_000; // one tick per µs

    #[test]
    fn no_settings_signals_every_completion() {
        let mut c = Coalescer::new(HZ, 0);
        c.taken(100_000);
        c.check(10_000, (0, 60_000));
        assert_eq!(c.delay_ticks(), 0);
        assert!((0..10).all(|i| c.used(10_000 + i)));
        assert!(!c.flush(20_000));
    }

    #[test]
    fn a_held_signal_waits_at_most_one_interval() {
        let mut c = Coalescer::new(HZ, 0);
        c.taken(100_000);
        c.check(10_000, (10_000, 1000));
        assert!(c.delay_ticks() > 1_000_000, "a delay of seconds");
        assert!(c.used(10_000));
        assert!(!c.used(10_001));
        assert!(!c.due(19_999));
        c.check(20_000, (10_000, 1000));
        assert!(c.due(20_000), "the check sends it");
    }

    #[test]
    fn below_threshold_signals_every_completion() {
        let mut c = Coalescer::new(HZ, 0);
        // 60k IOPS = 600 per 10 ms; 500 taken.
        c.taken(500);
        c.check(10_000, (100, 60_000));
        assert_eq!(c.delay_ticks(), 0);
        assert!(c.used(10_001) && c.used(10_002));
    }

    #[test]
    fn above_threshold_holds_signals_back() {
        let mut c = Coalescer::new(HZ, 0);
        // 1200 in 10 ms against 600: delay = 100 µs * 600 / 600.
        c.taken(1200);
        c.check(10_000, (100, 60_000));
        assert_eq!(c.delay_ticks(), 100);
        assert!(c.used(10_000), "first one goes out");
        assert!(!c.used(10_050), "held back within the delay");
        assert!(!c.due(10_099));
        assert!(c.due(10_100), "goes out when the delay has passed");
        assert!(!c.due(10_150), "nothing pending");
        assert!(!c.used(10_150));
        assert!(c.flush(10_160), "going to sleep sends it");
        assert!(!c.flush(10_161));
    }

    #[test]
    fn rate_is_remeasured_each_interval() {
        let mut c = Coalescer::new(HZ, 0);
        c.taken(1200);
        c.check(5_000, (100, 60_000));
        assert_eq!(c.delay_ticks(), 0, "interval not over");
        c.check(10_000, (100, 60_000));
        assert_eq!(c.delay_ticks(), 100);
        c.taken(10);
        c.check(20_000, (100, 60_000));
        assert_eq!(c.delay_ticks(), 0, "rate dropped: no delay");
    }

    #[test]
    fn tiny_threshold_does_not_divide_by_zero() {
        let mut c = Coalescer::new(HZ, 0);
        c.taken(3);
        c.check(10_000, (10, 1));
        assert_eq!(c.delay_ticks(), 20);
    }
}
