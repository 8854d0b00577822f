//! Waiting on a condition, never on a guessed sleep.
//!
//! Each helper polls its condition with a short backoff (1 ms doubling to
//! 20 ms, so a fast condition is seen at once and a slow one costs little
//! CPU on a loaded machine) until it holds or the deadline passes; then it
//! panics with "timed out after T waiting for WHAT", so a failure names the
//! condition instead of a later, puzzling assertion.

use std::fmt::Display;
use std::future::Future;
use std::time::{Duration, Instant};

const FIRST_NAP: Duration = Duration::from_millis(1);
const MAX_NAP: Duration = Duration::from_millis(20);

/// Polls `cond` until it returns true; panics after `timeout`.
#[track_caller]
pub fn wait_until(what: impl Display, timeout: Duration, mut cond: impl FnMut() -> bool) {
    wait_for(what, timeout, || cond().then_some(()))
}

/// Polls `probe` until it returns `Some(value)` and returns the value;
/// panics after `timeout`.
#[track_caller]
pub fn wait_for<T>(what: impl Display, timeout: Duration, probe: impl FnMut() -> Option<T>) -> T {
    match try_wait_for(timeout, probe) {
        Some(v) => v,
        None => timed_out(&what, timeout),
    }
}

/// Polls `probe` until it returns `Some(value)`; `None` once `timeout` has
/// passed, for a caller that cleans up or gathers state for its message
/// before failing.
pub fn try_wait_for<T>(timeout: Duration, mut probe: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    let mut nap = FIRST_NAP;
    loop {
        if let Some(v) = probe() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(nap);
        nap = (nap * 2).min(MAX_NAP);
    }
}

/// [`wait_until`] for a task on a reactor (or any executor): `nap` is the
/// executor's own timer (`ustor_runtime::sleep`), so the reactor keeps
/// running other tasks and completions while this one waits.
#[track_caller]
pub fn wait_until_async<C, N, F>(
    what: impl Display,
    timeout: Duration,
    mut cond: C,
    mut nap: N,
) -> impl Future<Output = ()>
where
    C: FnMut() -> bool,
    N: FnMut(Duration) -> F,
    F: Future<Output = ()>,
{
    // Captured here: #[track_caller] does not reach into the async body.
    let caller = std::panic::Location::caller();
    async move {
        let deadline = Instant::now() + timeout;
        let mut pause = FIRST_NAP;
        while !cond() {
            if Instant::now() >= deadline {
                panic!("{caller}: timed out after {timeout:?} waiting for {what}");
            }
            nap(pause).await;
            pause = (pause * 2).min(MAX_NAP);
        }
    }
}

#[track_caller]
fn timed_out(what: &dyn Display, timeout: Duration) -> ! {
    panic!("timed out after {timeout:?} waiting for {what}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[test]
    fn returns_as_soon_as_the_condition_holds() {
        let n = Cell::new(0);
        let v = wait_for("third probe", Duration::from_secs(5), || {
            n.set(n.get() + 1);
            (n.get() == 3).then_some(n.get() * 10)
        });
        assert_eq!(v, 30);
    }

    #[test]
    #[should_panic(expected = "waiting for the impossible")]
    fn panics_with_what_never_happened() {
        wait_until("the impossible", Duration::from_millis(10), || false);
    }
}
