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
//!
//! That count is machine-wide, and it ignores where threads may run. A
//! reactor pinned to CPUs of its own (a target on core 0, its clients on
//! the other cores) took four single-request clients on the other core for
//! contention: it slept at every request and paid a wake-up each (measured:
//! iSCSI, four QD1 sessions, 24-26 K IOPS against 32-38 K spinning). So a
//! reactor that may run on fewer CPUs than are online also asks whether
//! its own CPUs are wanted: whether its thread waited on the run queue
//! (`/proc/thread-self/schedstat`, read in the same sample) for more than
//! [`WANTED_SHARE`] of the period, which is what a thread that shares its
//! CPU with a spinning reactor makes it do. Once wanted, the CPUs count as
//! wanted for [`WANTED_HOLD`] periods, so a reactor that sleeps at once
//! (and so rarely waits) does not go back to spinning on the next sample.

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

/// A reactor's CPUs count as wanted when its thread waited on the run
/// queue for more than 1/this of the time since the last sample (2 %:
/// 100 µs of a 5 ms period).
const WANTED_SHARE: u64 = 50;
/// Periods the CPUs stay wanted after a sample found them wanted.
const WANTED_HOLD: u64 = 64;

/// Whether the machine has more runnable threads than CPUs, from the
/// fourth field of `/proc/loadavg` ("running/total"), re-read at most once
/// per period through a descriptor kept open (no allocation); for a
/// reactor pinned to some of the CPUs, only while its own CPUs are wanted
/// too ([`OwnCpus`]). Made on the reactor's thread (after its pinning).
pub(crate) struct Contention {
    fd: Option<std::fs::File>,
    cpus: u32,
    period: u64,
    next: u64,
    over: bool,
    /// `None`: the thread may run on every CPU (the count alone decides).
    own: Option<OwnCpus>,
}

/// The run-queue wait of a reactor thread that may run on fewer CPUs than
/// are online.
struct OwnCpus {
    /// This thread's `/proc/thread-self/schedstat` (opened on it).
    fd: std::fs::File,
    /// Run-queue wait (ns) at the last sample, and when that was (tick).
    waited: u64,
    at: u64,
    /// The CPUs count as wanted until this tick.
    wanted_until: u64,
}

impl OwnCpus {
    /// For the calling thread, if it may run on fewer CPUs than `cpus`.
    fn of_this_thread(cpus: u32) -> Option<OwnCpus> {
        // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity
        // writes at most size_of::<cpu_set_t>() bytes into it.
        let allowed = unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
                return None;
            }
            libc::CPU_COUNT(&set) as u32
        };
        if allowed >= cpus {
            return None;
        }
        let fd = std::fs::File::open("/proc/thread-self/schedstat").ok()?;
        let mut own = OwnCpus {
            fd,
            waited: 0,
            at: crate::ticks::now(),
            wanted_until: 0,
        };
        own.waited = own.sample()?;
        Some(own)
    }

    /// This thread's run-queue wait so far (ns).
    fn sample(&self) -> Option<u64> {
        use std::os::unix::fs::FileExt;
        let mut buf = [0u8; 96];
        let n = self.fd.read_at(&mut buf, 0).ok()?;
        parse_waited(&buf[..n])
    }

    /// Whether the CPUs are wanted at `now`, given the thread's wait so far
    /// (`None`: unreadable, counted as wanted) and the ns since the last
    /// sample.
    fn judge(&mut self, now: u64, period: u64, waited: Option<u64>, since_ns: u64) -> bool {
        let Some(w) = waited else {
            return true;
        };
        self.at = now;
        let delta = w.saturating_sub(std::mem::replace(&mut self.waited, w));
        if delta.saturating_mul(WANTED_SHARE) > since_ns {
            self.wanted_until = now.saturating_add(period.saturating_mul(WANTED_HOLD));
        }
        now < self.wanted_until
    }
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
            own: OwnCpus::of_this_thread(cpus),
        }
    }

    /// More threads runnable than CPUs (as of the last sample).
    #[inline]
    pub(crate) fn oversubscribed(&mut self, now: u64) -> bool {
        if now >= self.next {
            self.next = now + self.period;
            let busy = self.sample().is_some_and(|r| r > self.cpus);
            // Sampled busy or not: each wait is measured against the time
            // since the last sample.
            let period = self.period;
            let wanted = self.own.as_mut().is_none_or(|o| {
                let (w, since) = (o.sample(), crate::ticks::to_ns(now.saturating_sub(o.at)));
                o.judge(now, period, w, since)
            });
            self.over = busy && wanted;
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

/// "1520231 12210486 2" (run time, run-queue wait, slices) → 12210486.
fn parse_waited(s: &[u8]) -> Option<u64> {
    let field = s.split(|b| b.is_ascii_whitespace()).nth(1)?;
    std::str::from_utf8(field).ok()?.parse().ok()
}

/// "0.50 0.40 0.30 3/412 12345" → 3.
fn parse_running(s: &[u8]) -> Option<u32> {
    let field = s.split(|b| *b == b' ').nth(3)?;
    let running = field.split(|b| *b == b'/').next()?;
    std::str::from_utf8(running).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::{parse_running, parse_waited, Contention, OwnCpus, SpinBudget, WANTED_HOLD};

    #[test]
    fn parses_the_run_queue_wait() {
        assert_eq!(parse_waited(b"1520231 12210486 2\n"), Some(12210486));
        assert_eq!(parse_waited(b"1520231"), None);
    }

    fn own() -> OwnCpus {
        OwnCpus {
            fd: std::fs::File::open("/proc/self/schedstat").unwrap(),
            waited: 0,
            at: 0,
            wanted_until: 0,
        }
    }

    /// A pinned reactor's CPUs are wanted once its thread waited beyond
    /// the budget in a period, and stay wanted for the hold, however
    /// little it waits meanwhile; an unreadable wait counts as wanted.
    #[test]
    fn own_cpus_are_wanted_after_a_wait_and_for_the_hold() {
        // 50 µs between samples: 1 µs of wait is the budget.
        let (period, mut o, span) = (100, own(), 50_000);
        assert!(!o.judge(100, period, Some(500), span), "within the budget");
        assert!(
            !o.judge(200, period, Some(1_400), span),
            "900 ns more: within"
        );
        assert!(
            o.judge(300, period, Some(3_000), span),
            "1600 ns more: wanted"
        );
        let end = 300 + period * WANTED_HOLD;
        assert!(o.judge(end - 1, period, Some(3_000), span), "held");
        assert!(
            !o.judge(end, period, Some(3_000), span),
            "hold over, no wait"
        );
        assert!(
            !o.judge(end + 1, period, Some(9_000), 1_000_000),
            "6 µs in 1 ms: within"
        );
        assert!(o.judge(end + 2, period, None, span), "unreadable");
    }

    /// A thread allowed every CPU it is asked about is judged by the count
    /// alone; one allowed fewer watches its own run-queue wait.
    #[test]
    fn a_thread_allowed_fewer_cpus_watches_its_own_wait() {
        // SAFETY: as in `of_this_thread`.
        let allowed = unsafe {
            let mut s: libc::cpu_set_t = std::mem::zeroed();
            assert_eq!(
                libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut s),
                0
            );
            libc::CPU_COUNT(&s) as u32
        };
        assert!(OwnCpus::of_this_thread(allowed).is_none());
        let o = OwnCpus::of_this_thread(allowed + 1).expect("schedstat readable");
        assert!(o.sample().is_some());
    }

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
