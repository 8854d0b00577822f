//! A cheap monotonic clock for per-I/O timestamps.
//!
//! On x86_64 this reads the TSC (a few ns, no syscall, no vDSO call), like
//! SPDK's `spdk_get_ticks`; the rate is calibrated once against the
//! monotonic clock. Elsewhere it falls back to `Instant`.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

static HZ: OnceLock<u64> = OnceLock::new();
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
    *HZ.get_or_init(calibrate)
}

fn calibrate() -> u64 {
    if cfg!(not(target_arch = "x86_64")) {
        return 1_000_000_000;
    }
    let _ = EPOCH.get_or_init(Instant::now);
    let t0 = Instant::now();
    let c0 = now();
    std::thread::sleep(Duration::from_millis(20));
    let c1 = now();
    let dt = t0.elapsed();
    let hz = ((c1.wrapping_sub(c0)) as u128 * 1_000_000_000 / dt.as_nanos().max(1)) as u64;
    hz.max(1)
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
}
