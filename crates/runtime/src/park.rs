//! How a sleeping reactor is woken, and the cheaper sleep of a reactor
//! whose ring has nothing in flight.
//!
//! A reactor sleeps in `io_uring_enter`, and another thread wakes it by
//! writing its eventfd, which a read SQE in the ring waits on. That wake-up
//! crosses io_uring's poll machinery on both sides: the write wakes the
//! ring's poll entry, and the reactor, once running, runs the read as task
//! work, posts its CQE and queues a new read for the next sleep.
//!
//! A reactor whose only work waits on another thread (a library's
//! completion callback: librados' `io_context_pool` completing an RBD I/O)
//! has nothing else in its ring, and so nothing the kernel could complete
//! while it sleeps. Such a reactor sleeps on a futex instead (the word is
//! its `sleeping` state), and whoever wakes it does a `FUTEX_WAKE`:
//! one system call each side, no eventfd, no task work. Measured on RBD
//! 4 KiB randread QD1 (one CPU for the reactor, librados on the other):
//! see bench/RESULTS-rbd.md.
//!
//! The word: [`AWAKE`], [`RING`] (asleep in the ring: write the eventfd) or
//! [`FUTEX`] (asleep on the word: swap it to [`AWAKE`], then wake it). The
//! swap is what makes a wake that comes between the reactor's last look at
//! its inbox and its `FUTEX_WAIT` count: the wait then finds the word
//! changed and returns at once.

use std::sync::atomic::{AtomicU32, Ordering};

/// The reactor runs (or is about to look at its inbox again).
pub(crate) const AWAKE: u32 = 0;
/// It sleeps in `io_uring_enter`: an eventfd write wakes it.
pub(crate) const RING: u32 = 1;
/// It sleeps on the word itself: [`wake`] wakes it.
pub(crate) const FUTEX: u32 = 2;

/// Sleeps on `word` while it holds [`FUTEX`], for at most `timeout_ns`.
pub(crate) fn wait(word: &AtomicU32, timeout_ns: Option<u64>) {
    let ts = timeout_ns.map(|ns| libc::timespec {
        tv_sec: (ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (ns % 1_000_000_000) as libc::c_long,
    });
    let tsp = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: FUTEX_WAIT reads the u32 behind `word` (live for the call)
    // and the relative timeout `tsp` (null or a live timespec).
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            FUTEX,
            tsp,
        )
    };
}

/// Wakes a reactor asleep on `word`; false when it was not (the caller
/// then writes the eventfd if the word says [`RING`]).
pub(crate) fn wake(word: &AtomicU32) -> bool {
    if word
        .compare_exchange(FUTEX, AWAKE, Ordering::SeqCst, Ordering::SeqCst)
        .is_err()
    {
        return false;
    }
    // SAFETY: FUTEX_WAKE only uses the address of the live word.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            1,
        )
    };
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_wake_before_the_wait_is_not_lost() {
        let w = AtomicU32::new(FUTEX);
        assert!(wake(&w));
        assert_eq!(w.load(Ordering::SeqCst), AWAKE);
        // The word changed: the wait returns at once (a lost wake would
        // hang here).
        wait(&w, None);
        assert!(!wake(&w), "nobody asleep: nothing to wake");
    }

    #[test]
    fn wakes_a_sleeper_and_times_out_without_one() {
        let w = AtomicU32::new(FUTEX);
        let t0 = std::time::Instant::now();
        wait(&w, Some(2_000_000));
        assert!(t0.elapsed() >= std::time::Duration::from_millis(2));
        let w = Arc::new(AtomicU32::new(FUTEX));
        let w2 = w.clone();
        let sleeper = std::thread::spawn(move || {
            while w2.load(Ordering::SeqCst) == FUTEX {
                wait(&w2, None);
            }
        });
        while !wake(&w) {}
        sleeper.join().unwrap();
    }
}
