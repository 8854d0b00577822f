//! How long an adaptive reactor busy-polls an idle stretch before it sleeps.
//!
//! A fixed spin (`idle_period`, 1 ms by default) is right when work comes
//! back within it and pure waste when it does not: at 50–500 requests per
//! second a target reactor spun 0.5–1.3 ms of CPU per request and then paid
//! the wake-up anyway, competing for the CPU with the very threads (the
//! client, the kernel's completion work) it was waiting for. The budget here
//! adapts per reactor, multiplicatively, from how idle stretches end:
//!
//! - a stretch that outlived the whole spin (the reactor went to sleep) and
//!   slept much longer than it spun: the spin was wasted, halve it (down to
//!   a floor that still covers one kernel round trip);
//! - a stretch that ended soon after the reactor fell asleep (within the
//!   spin it had): a longer spin would have caught it, double it (up to
//!   `idle_period`);
//! - a stretch that ended while spinning: the spin paid, keep it.
//!
//! So a reactor under steady load keeps spinning the full `idle_period`, and
//! one that sees a request every few milliseconds sleeps after the floor.
//!
//! Spinning also only pays when the CPU is not wanted by anyone else. On a
//! box with more runnable threads than CPUs (measured here: two vCPUs, a
//! client and a compiler), a spinning reactor takes a whole CPU from the
//! client it serves and QD1 latency grows a tail of one scheduler slice
//! (p99 ~1 ms against ~35 µs for a reactor that sleeps at once). So
//! [`Contention`] samples the kernel's count of runnable threads every few
//! milliseconds, and while it exceeds the CPUs an adaptive reactor sleeps as
//! soon as a pass finds no work, as in interrupt mode.

/// The spin never shrinks below this (or below `idle_period` if smaller):
/// it covers the short waits inside one request (a device or socket round
/// trip), which are cheaper to spin through than to sleep through.
pub(crate) const MIN_SPIN_NS: u64 = 50_000;

/// The adaptive spin budget, in ticks.
#[derive(Debug)]
pub(crate) struct SpinBudget {
    max: u64,
    min: u64,
    cur: u64,
}

impl SpinBudget {
    /// A budget between `min_ticks` and `max_ticks` (the idle period),
    /// starting at the maximum.
    pub(crate) fn new(max_ticks: u64, min_ticks: u64) -> SpinBudget {
        let min = min_ticks.min(max_ticks);
        SpinBudget {
            max: max_ticks,
            min,
            cur: max_ticks,
        }
    }

    /// Ticks to spin before sleeping.
    #[inline]
    pub(crate) fn ticks(&self) -> u64 {
        self.cur
    }

    /// A sleep that began after spinning `spun` ticks ended after `slept`
    /// ticks (work arrived or a timer fired).
    pub(crate) fn after_sleep(&mut self, spun: u64, slept: u64) {
        if slept <= spun.max(self.min) {
            // A little more spin would have caught this one.
            self.cur = self.cur.saturating_mul(2).min(self.max);
        } else if slept >= spun.saturating_mul(4) {
            self.cur = (self.cur / 2).max(self.min);
        }
    }
}

/// Whether the machine has more runnable threads than CPUs, from the
/// fourth field of `/proc/loadavg` ("running/total"), re-read at most once
/// per period through a descriptor kept open (no allocation).
pub(crate) struct Contention {
    fd: Option<std::fs::File>,
    cpus: u32,
    period: u64,
    next: u64,
    over: bool,
}

impl Contention {
    pub(crate) fn new(period_ticks: u64) -> Contention {
        // SAFETY: sysconf has no memory effects.
        let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1) as u32;
        Contention {
            fd: std::fs::File::open("/proc/loadavg").ok(),
            cpus,
            period: period_ticks,
            next: 0,
            over: false,
        }
    }

    /// More threads runnable than CPUs (as of the last sample).
    #[inline]
    pub(crate) fn oversubscribed(&mut self, now: u64) -> bool {
        if now >= self.next {
            self.next = now + self.period;
            self.over = self.sample().is_some_and(|r| r > self.cpus);
        }
        self.over
    }

    fn sample(&self) -> Option<u32> {
        use std::os::unix::fs::FileExt;
        let mut buf = [0u8; 128];
        let n = self.fd.as_ref()?.read_at(&mut buf, 0).ok()?;
        parse_running(&buf[..n])
    }
}

/// "0.50 0.40 0.30 3/412 12345" → 3.
fn parse_running(s: &[u8]) -> Option<u32> {
    let field = s.split(|b| *b == b' ').nth(3)?;
    let running = field.split(|b| *b == b'/').next()?;
    std::str::from_utf8(running).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::{parse_running, Contention, SpinBudget};

    #[test]
    fn parses_the_runnable_count() {
        assert_eq!(parse_running(b"6.41 6.57 5.06 7/123 18558\n"), Some(7));
        assert_eq!(parse_running(b"0.00 0.00 0.00 1/80 1\n"), Some(1));
        assert_eq!(parse_running(b"garbage"), None);
        assert_eq!(parse_running(b"1 2 3 x/4 5"), None);
    }

    #[test]
    fn samples_this_machine() {
        let mut c = Contention::new(0);
        // At least this thread is running; whether that exceeds the CPUs
        // depends on the machine, but a sample must be readable.
        assert!(c.sample().is_some_and(|r| r >= 1));
        let _ = c.oversubscribed(1);
    }

    #[test]
    fn long_sleeps_shrink_the_spin_to_the_floor() {
        let mut b = SpinBudget::new(1_000, 50);
        for _ in 0..10 {
            let spun = b.ticks();
            b.after_sleep(spun, 20_000);
        }
        assert_eq!(b.ticks(), 50);
    }

    #[test]
    fn short_sleeps_grow_the_spin_back_to_the_idle_period() {
        let mut b = SpinBudget::new(1_000, 50);
        for _ in 0..10 {
            let spun = b.ticks();
            b.after_sleep(spun, 20_000);
        }
        for _ in 0..10 {
            let spun = b.ticks();
            b.after_sleep(spun, spun / 2);
        }
        assert_eq!(b.ticks(), 1_000);
    }

    #[test]
    fn sleeps_a_little_longer_than_the_spin_keep_it() {
        let mut b = SpinBudget::new(1_000, 50);
        b.after_sleep(1_000, 20_000);
        assert_eq!(b.ticks(), 500);
        for _ in 0..5 {
            b.after_sleep(500, 1_500);
        }
        assert_eq!(b.ticks(), 500);
    }

    #[test]
    fn floor_never_exceeds_the_idle_period() {
        let b = SpinBudget::new(10, 50);
        assert_eq!(b.ticks(), 10);
        let mut b = b;
        b.after_sleep(10, 10_000);
        assert_eq!(b.ticks(), 10);
    }
}
