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
//! That count is machine-wide, and it ignores where threads may run, both
//! ways. A reactor pinned to CPUs of its own (a target on core 0, its
//! clients on the other cores) took four single-request clients on the
//! other core for contention: it slept at every request and paid a wake-up
//! each (measured: iSCSI, four QD1 sessions, 24-26 K IOPS against 32-38 K
//! spinning). And a reactor pinned to the one CPU its client also runs on
//! (the file service's pinned benchmark: two runnable threads on a 2-CPU
//! machine) was never contended by the count, so it spun while the thread
//! it waited for sat runnable on its CPU. So a reactor that may run on
//! fewer CPUs than are online is judged by its own CPUs only: whether its
//! thread waited on the run queue (`/proc/thread-self/schedstat`) for more
//! than 1/[`WANTED_SHARE`] of the time since the last sample, in two
//! samples in a row, which is what a thread that shares its CPU with a
//! spinning reactor makes it do. (One sample over the share was enough
//! before: on a loaded 2-CPU machine a pinned iSCSI target then slept at
//! once on 0.53-0.78 of its QD1 writes, against 0.03-0.12 with two; a
//! burst of another thread at one yield fills one sample.) Once
//! wanted, the CPUs count as wanted for [`WANTED_HOLD`] periods, so a
//! reactor that sleeps at once (and so rarely waits) does not go back to
//! spinning on the next sample; only [`CLEAR_SAMPLES`] samples in a row in
//! which it (almost) never waited end the hold early (a thread that still
//! shares the CPU makes its wake-ups wait a little; a start-up burst of
//! its own process held a fresh target for the whole hold). A reactor
//! allowed every CPU, or one whose wait cannot be read, is judged by the
//! count.
//!
//! The wait alone misleads one way: it also counts the reactor's own
//! wake-ups (from a sleep until it runs; 40-80 µs on this VM, whose idle
//! vCPUs halt). A reactor that slept at every QD1 request for a while
//! (contended, or just idle between requests) waited that long per request,
//! well over the share, and so stayed "wanted" with nobody else on its CPU:
//! a trap that would make it pay a wake-up per request for good (seen as
//! the reason iSCSI QD1 paid 1.94 context switches per I/O against SPDK's
//! 0.003 on a loaded machine; not isolated on a quiet one). So the wait
//! counts only
//! in a period in which the thread was also preempted (its involuntary
//! context switches grew, `getrusage(RUSAGE_THREAD)`): a thread woken from
//! its own sleep switches in voluntarily; one that another thread displaces,
//! or that yields to one (below), does not.
//!
//! That wait only grows when the scheduler takes the CPU from the reactor;
//! a woken thread on the same CPU does not preempt a spinning reactor at
//! once, so the reactor may never wait and never learn. So a pinned
//! reactor that spins also hands its CPU over every [`YIELD_EVERY_NS`]
//! (`sched_yield`: returns at once when nothing else is runnable there,
//! costs one system call). Whether the thread is pinned is re-read at every
//! sample (`taskset -p` changes it from outside). Measured on an idle
//! 2-CPU machine, the file service's 4 KiB QD1 reads with every process on
//! CPU 0 (bench/fs.sh "pinned"): mean 506 µs, p99 1.19 ms before (most
//! requests fine, many waiting out a spin of up to 1 ms); 73 µs, p99 129 µs
//! after.

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

/// A pinned reactor spinning idle yields its CPU this often (ns).
pub(crate) const YIELD_EVERY_NS: u64 = 10_000;

/// A reactor's CPUs count as wanted when its thread waited on the run
/// queue for more than 1/this of the time since the last sample (2 %:
/// 100 µs of a 5 ms period).
const WANTED_SHARE: u64 = 50;
/// Periods the CPUs stay wanted after a sample found them wanted.
const WANTED_HOLD: u64 = 64;
/// Samples in a row with (almost) no run-queue wait that end the hold
/// early: nothing else ran on the CPUs for this long, so nobody wants them.
const CLEAR_SAMPLES: u32 = 8;
/// "Almost no wait": under 1/this of the time (0.5 %: 25 µs of a 5 ms
/// period; a kernel thread's blip on a quiet machine is ~13 µs).
const CLEAR_SHARE: u64 = 200;

/// Whether a reactor's CPUs are wanted by other threads: for a reactor
/// pinned to some of the CPUs, its own run-queue wait ([`OwnCpus`]);
/// otherwise whether the machine has more runnable threads than CPUs, from
/// the fourth field of `/proc/loadavg` ("running/total"). Re-read at most
/// once per period through descriptors kept open (no allocation). Made on
/// the reactor's thread (after its pinning).
pub(crate) struct Contention {
    fd: Option<std::fs::File>,
    cpus: u32,
    period: u64,
    next: u64,
    over: bool,
    /// `None`: the thread may run on every CPU (the count alone decides).
    own: Option<OwnCpus>,
    /// Ticks between yields of a pinned reactor's idle spin, and the next.
    yield_every: u64,
    yield_at: u64,
}

/// A reactor thread's run-queue wait, and whether it is pinned (it then
/// decides contention instead of the machine-wide count).
struct OwnCpus {
    /// This thread's `/proc/thread-self/schedstat` (opened on it).
    fd: std::fs::File,
    /// Run-queue wait (ns) at the last sample, and when that was (tick).
    waited: u64,
    at: u64,
    /// Involuntary context switches at the last sample.
    preempted: u64,
    /// The CPUs count as wanted until this tick.
    wanted_until: u64,
    /// The last sample found the thread displaced and waiting over the
    /// share: one more in a row makes the CPUs wanted.
    strike: bool,
    /// Samples in a row, while held, in which the thread (almost) never
    /// waited.
    clear: u32,
    /// The thread may run on fewer CPUs than are online (re-read at every
    /// sample: a thread's affinity can be changed from outside, as
    /// `taskset -p` does).
    pinned: bool,
}

/// How many CPUs the calling thread may run on.
fn allowed_cpus() -> Option<u32> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity
    // writes at most size_of::<cpu_set_t>() bytes into it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return None;
        }
        Some(libc::CPU_COUNT(&set) as u32)
    }
}

impl OwnCpus {
    /// For the calling thread (`None` when its wait cannot be read);
    /// pinned if it may run on fewer CPUs than `cpus`.
    fn of_this_thread(cpus: u32) -> Option<OwnCpus> {
        let fd = std::fs::File::open("/proc/thread-self/schedstat").ok()?;
        let mut own = OwnCpus {
            fd,
            waited: 0,
            at: crate::ticks::now(),
            preempted: preemptions().unwrap_or(0),
            wanted_until: 0,
            strike: false,
            clear: 0,
            pinned: allowed_cpus().is_some_and(|n| n < cpus),
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
    /// (ns), the ns since the last sample and its involuntary switches so
    /// far (`p`). (A wait that cannot be read never gets here: the count
    /// decides then.)
    fn judge(&mut self, now: u64, period: u64, w: u64, since_ns: u64, p: u64) -> bool {
        self.at = now;
        let delta = w.saturating_sub(std::mem::replace(&mut self.waited, w));
        let displaced = p > std::mem::replace(&mut self.preempted, p);
        let over = displaced && delta.saturating_mul(WANTED_SHARE) > since_ns;
        // Two samples in a row: a burst (a kworker, a harness process
        // given the CPU at a yield) fills one, a thread that shares the
        // CPU for good fills every one.
        if std::mem::replace(&mut self.strike, over) && over {
            self.wanted_until = now.saturating_add(period.saturating_mul(WANTED_HOLD));
            self.clear = 0;
        }
        // A held reactor sleeps at once, so it is rarely displaced; but a
        // thread still sharing its CPU makes each of its wake-ups wait.
        // Samples with (almost) no wait mean the CPU is its own again (a
        // start-up burst of its own process on that core held a fresh
        // iSCSI target for the whole 320 ms, ~8 % of a 4 s run).
        if now < self.wanted_until {
            let quiet = delta.saturating_mul(CLEAR_SHARE) <= since_ns;
            self.clear = if quiet { self.clear + 1 } else { 0 };
            if self.clear >= CLEAR_SAMPLES {
                self.wanted_until = 0;
                self.clear = 0;
            }
        }
        now < self.wanted_until
    }
}

impl Contention {
    pub(crate) fn new(period_ticks: u64, yield_ticks: u64) -> Contention {
        // SAFETY: sysconf has no memory effects.
        let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1) as u32;
        Contention {
            fd: std::fs::File::open("/proc/loadavg").ok(),
            cpus,
            period: period_ticks,
            next: 0,
            over: false,
            own: OwnCpus::of_this_thread(cpus),
            yield_every: yield_ticks,
            yield_at: 0,
        }
    }

    /// Called on every pass of an idle spin: a pinned reactor hands its CPU
    /// to any thread waiting for it there, at most once per `yield_ticks`
    /// (see the module doc). An unpinned one never does: the scheduler can
    /// run a woken thread on another CPU.
    #[inline]
    pub(crate) fn share_cpu(&mut self, now: u64) {
        if self.own.as_ref().is_some_and(|o| o.pinned) && now >= self.yield_at {
            self.yield_at = now.saturating_add(self.yield_every);
            // SAFETY: sched_yield has no memory effects.
            unsafe { libc::sched_yield() };
        }
    }

    /// Its CPUs are wanted by other threads (as of the last sample).
    #[inline]
    pub(crate) fn oversubscribed(&mut self, now: u64) -> bool {
        if now >= self.next {
            self.next = now + self.period;
            let period = self.period;
            // CPUs of its own: the machine-wide count says nothing about
            // them (see the module doc); its run-queue wait does.
            let cpus = self.cpus;
            let own = self.own.as_mut().and_then(|o| {
                let (w, since) = (o.sample()?, crate::ticks::to_ns(now.saturating_sub(o.at)));
                // Unreadable (never seen): every period counts as one with
                // a preemption, as before this was looked at.
                let p = preemptions().unwrap_or(o.preempted + 1);
                let wanted = o.judge(now, period, w, since, p);
                o.pinned = allowed_cpus().is_some_and(|n| n < cpus);
                o.pinned.then_some(wanted)
            });
            self.over = own.unwrap_or_else(|| self.sample().is_some_and(|r| r > self.cpus));
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

/// The calling thread's involuntary context switches so far.
fn preemptions() -> Option<u64> {
    // SAFETY: a zeroed rusage is valid; getrusage writes only into it.
    unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_THREAD, &mut u) != 0 {
            return None;
        }
        Some(u.ru_nivcsw as u64)
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
    use super::{
        allowed_cpus, parse_running, parse_waited, Contention, OwnCpus, SpinBudget, CLEAR_SAMPLES,
        WANTED_HOLD,
    };

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
            preempted: 0,
            wanted_until: 0,
            strike: false,
            clear: 0,
            pinned: true,
        }
    }

    /// A pinned reactor's CPUs are wanted once its thread waited beyond
    /// the budget in two periods in a row, and stay wanted for the hold,
    /// however little it waits meanwhile (short of never).
    #[test]
    fn own_cpus_are_wanted_after_a_wait_and_for_the_hold() {
        // 50 µs between samples: 1 µs of wait is the budget.
        // Every period has a preemption (p grows by one each time).
        let (period, mut o, span) = (100, own(), 50_000);
        assert!(!o.judge(100, period, 500, span, 1), "within the budget");
        assert!(!o.judge(200, period, 1_400, span, 2), "900 ns more: within");
        assert!(!o.judge(300, period, 3_000, span, 3), "1600 ns more: one");
        assert!(!o.judge(400, period, 3_500, span, 4), "500 ns more: within");
        assert!(!o.judge(500, period, 5_100, span, 5), "1600 ns more: one");
        assert!(o.judge(600, period, 6_700, span, 6), "and again: wanted");
        let (p0, end) = (6, 600 + period * WANTED_HOLD);
        assert!(o.judge(end - 1, period, 6_700, span, p0 + 1), "held");
        assert!(
            !o.judge(end, period, 6_700, span, p0 + 2),
            "hold over, no wait"
        );
        assert!(
            !o.judge(end + 1, period, 12_700, 1_000_000, p0 + 3),
            "6 µs in 1 ms: within"
        );
    }

    /// A hold ends early after [`CLEAR_SAMPLES`] samples in a row with
    /// (almost) no wait; a sample with more starts the count again.
    #[test]
    fn a_hold_with_almost_no_wait_ends_early() {
        let (period, mut o, span) = (100, own(), 50_000);
        assert!(!o.judge(100, period, 2_000, span, 1), "one");
        assert!(o.judge(200, period, 4_000, span, 2), "two: wanted");
        let mut t = 200;
        for _ in 1..CLEAR_SAMPLES {
            t += period;
            assert!(o.judge(t, period, 4_000, span, 2), "no wait yet: held");
        }
        t += period;
        // 50 µs between samples: 250 ns of wait is "almost none".
        assert!(o.judge(t, period, 4_300, span, 2), "300 ns of wait: held");
        for i in 1..CLEAR_SAMPLES {
            t += period;
            let w = 4_300 + 200 * i as u64;
            assert!(o.judge(t, period, w, span, 2), "counting again: held");
        }
        t += period;
        let w = 4_300 + 200 * CLEAR_SAMPLES as u64;
        assert!(
            !o.judge(t, period, w, span, 2),
            "almost none, long enough: free"
        );
        assert!(
            t < 200 + period * WANTED_HOLD,
            "ended before the hold would"
        );
    }

    /// A wait with no preemption in its period is the thread's own wake-up
    /// from a sleep, not another thread on its CPU: it does not count.
    #[test]
    fn a_wait_without_a_preemption_is_a_wake_up_not_contention() {
        let (period, mut o, span) = (100, own(), 50_000);
        assert!(
            !o.judge(100, period, 40_000, span, 0),
            "woken late, never displaced"
        );
        assert!(!o.judge(200, period, 80_000, span, 0), "again");
        assert!(
            !o.judge(300, period, 120_000, span, 1),
            "displaced and waited: one"
        );
        assert!(o.judge(400, period, 160_000, span, 2), "and again: wanted");
    }

    /// A thread allowed every CPU it is asked about is judged by the count
    /// alone; one allowed fewer watches its own run-queue wait.
    #[test]
    fn a_thread_allowed_fewer_cpus_watches_its_own_wait() {
        let allowed = allowed_cpus().expect("affinity readable");
        let o = OwnCpus::of_this_thread(allowed).expect("schedstat readable");
        assert!(!o.pinned);
        let o = OwnCpus::of_this_thread(allowed + 1).expect("schedstat readable");
        assert!(o.pinned);
        assert!(o.sample().is_some());
    }

    /// A thread pinned to one CPU that another spinning thread also runs
    /// on is contended, however few threads the machine runs in all (the
    /// file service's pinned benchmark: two runnable threads, two CPUs).
    #[test]
    fn a_pinned_thread_sharing_its_cpu_is_contended() {
        fn pin_to_cpu0() {
            // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET
            // writes inside it; sched_setaffinity reads it.
            unsafe {
                let mut s: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(0, &mut s);
                assert_eq!(
                    libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &s),
                    0
                );
            }
        }
        // SAFETY: sysconf has no memory effects.
        if unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) } < 2 {
            return; // every thread has every CPU: the count decides
        }
        std::thread::spawn(|| {
            pin_to_cpu0();
            // Longer than a scheduler slice (a few ms), as the runtime's
            // 5 ms is: the CPUs count as wanted after two samples in a row
            // that each saw a wait, and with a 1 ms period a sample taken
            // inside the thread's own slice sees none, so two in a row
            // came only by chance.
            let period = crate::ticks::from_duration(std::time::Duration::from_millis(10));
            let mut c = Contention::new(period, period);
            assert!(
                c.own.as_ref().is_some_and(|o| o.pinned),
                "pinned: judged by its own CPU"
            );
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let s2 = stop.clone();
            let spinner = std::thread::spawn(move || {
                pin_to_cpu0();
                while !s2.load(std::sync::atomic::Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            });
            // Spin beside it until the scheduler made this thread wait.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            let mut over = false;
            while !over && std::time::Instant::now() < deadline {
                over = c.oversubscribed(crate::ticks::now());
            }
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            spinner.join().unwrap();
            assert!(
                over,
                "sharing its one CPU with a spinner never counted as contended"
            );
        })
        .join()
        .unwrap();
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
        let mut c = Contention::new(0, 0);
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
