//! A cheap monotonic clock for per-I/O timestamps.
//!
//! On x86_64 this reads the TSC (a few ns, no syscall, no vDSO call), like
//! SPDK's `spdk_get_ticks`; the rate is calibrated once against the
//! monotonic clock. Elsewhere it falls back to `Instant`.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

// ns per tick as 32.32 fixed point, so `to_ns` is a multiply and a shift
// (it runs per I/O for latency histograms).
static NS_MULT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static EPOCH: OnceLock<Instant> = OnceLock::new();

/// Current tick count.
#[inline(always)]
pub fn now() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: RDTSC has no memory effects and exists on every x86_64 CPU.
        unsafe { core::arch::x86_64::_rdtsc() }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
    }
}

/// Ticks per second, calibrated on first use (about 20 ms, once per process).
pub fn hz() -> u64 {
    HZ.get_or_init(calibrate).mid
}

/// The calibrated rate: `mid` of the bracket the true rate lies in, and
/// its upper end `hi` (what `at_least` needs; the lower end is not used).
struct Rate {
    mid: u64,
    hi: u64,
}

static HZ: OnceLock<Rate> = OnceLock::new();

/// One reading of the monotonic clock bracketed by two TSC reads: the
/// clock was read at some tick in `a..=b`. The narrowest of a few tries is
/// kept, so a preemption between the reads does not widen the bracket.
#[cfg(target_arch = "x86_64")]
fn bracketed() -> (u64, Instant, u64) {
    (0..8)
        .map(|_| {
            let a = now();
            let t = Instant::now();
            let b = now();
            (a, t, b)
        })
        .min_by_key(|(a, _, b)| b.wrapping_sub(*a))
        .expect("eight tries")
}

fn calibrate() -> Rate {
    #[cfg(target_arch = "x86_64")]
    {
        let _ = EPOCH.get_or_init(Instant::now);
        let (a0, t0, b0) = bracketed();
        std::thread::sleep(Duration::from_millis(20));
        let (a1, t1, b1) = bracketed();
        let dt = t1.duration_since(t0).as_nanos().max(1);
        // Between t0 and t1 the TSC advanced by at least a1 - b0 and at most
        // b1 - a0. Taking the whole span (t0 before the first read .. t1
        // after the last) as once done biased the rate low, so timers fired
        // early by the length of any preemption during calibration.
        let lo = (a1.wrapping_sub(b0) as u128 * 1_000_000_000 / dt) as u64;
        let hi = (b1.wrapping_sub(a0) as u128 * 1_000_000_000 / dt) as u64;
        Rate {
            mid: (lo / 2 + hi / 2).max(1),
            hi: hi.max(1),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Rate {
            mid: 1_000_000_000,
            hi: 1_000_000_000,
        }
    }
}

/// Converts a tick delta to nanoseconds.
#[inline]
pub fn to_ns(ticks: u64) -> u64 {
    let mut m = NS_MULT.load(std::sync::atomic::Ordering::Relaxed);
    if m == 0 {
        m = ((1_000_000_000u128 << 32) / hz() as u128) as u64;
        NS_MULT.store(m, std::sync::atomic::Ordering::Relaxed);
    }
    ((ticks as u128 * m as u128) >> 32) as u64
}

/// Converts a duration to ticks.
#[inline]
pub fn from_duration(d: Duration) -> u64 {
    (d.as_nanos() * hz() as u128 / 1_000_000_000) as u64
}

/// Converts a duration to a tick count that spans at least `d` of the
/// monotonic clock, whatever the calibration error: timers use it so that
/// `sleep(d)` never wakes before `d` has passed.
#[inline]
pub fn at_least(d: Duration) -> u64 {
    let hi = HZ.get_or_init(calibrate).hi as u128;
    (d.as_nanos() * hi).div_ceil(1_000_000_000) as u64
}

#[cfg(test)]
mod tests {
    #[test]
    fn ticks_track_wall_clock() {
        let hz = super::hz();
        assert!(hz > 1_000_000, "implausible tick rate {hz}");
        let t0 = super::now();
        std::thread::sleep(std::time::Duration::from_millis(30));
        let ns = super::to_ns(super::now() - t0);
        assert!(
            (25_000_000..200_000_000).contains(&ns),
            "30 ms measured as {ns} ns"
        );
    }

    #[test]
    fn at_least_spans_the_whole_duration() {
        for ms in [1u64, 3, 7] {
            let d = std::time::Duration::from_millis(ms);
            assert!(super::at_least(d) >= super::from_duration(d));
            let t = std::time::Instant::now();
            let end = super::now() + super::at_least(d);
            while super::now() < end {
                std::hint::spin_loop();
            }
            let el = t.elapsed();
            assert!(el >= d, "{d:?} of ticks spanned {el:?}");
        }
    }
}
