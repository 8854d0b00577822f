//! Atomicity of the commands that read before they write (COMPARE AND
//! WRITE, ORWRITE) against every other write to the unit, from any I_T
//! nexus on any reactor: one [`WriteGate`] per unit (in `LuShared`).
//! Writes pass it shared (two atomics per bdev write while no
//! read-modify-write runs), a read-modify-write exclusively: it waits for
//! the writes under way to finish, holds new ones back, and runs alone
//! among the unit's read-modify-writes. Nothing waits here while it waits
//! for the network: writes pass the gate around each bdev write, a
//! read-modify-write takes it once its data-out is in.

use std::future::poll_fn;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};
use std::sync::{Mutex, MutexGuard};
use std::task::{Poll, Waker};

#[derive(Default)]
struct State {
    /// A read-modify-write runs.
    held: bool,
    waiters: Vec<Waker>,
}

/// The write gate of one unit.
#[derive(Default)]
pub struct WriteGate {
    /// Writes on the medium now.
    writers: AtomicU64,
    /// Read-modify-writes running or waiting.
    exclusive: AtomicU32,
    st: Mutex<State>,
}

/// A write passing the gate; dropped when the bdev write has ended.
pub struct WriteGuard<'a>(&'a WriteGate);

/// A read-modify-write holding the gate (`true`) or waiting for it.
pub struct ExclusiveGuard<'a>(&'a WriteGate, bool);

impl WriteGate {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wake_all(&self) {
        let w = std::mem::take(&mut self.lock().waiters);
        w.into_iter().for_each(Waker::wake);
    }

    /// Lets a write through once no read-modify-write runs or waits.
    pub async fn write(&self) -> WriteGuard<'_> {
        poll_fn(|cx| {
            if self.try_enter() {
                return Poll::Ready(());
            }
            let mut st = self.lock();
            st.waiters.push(cx.waker().clone());
            drop(st);
            // It may have ended before the waker was in.
            if self.exclusive.load(SeqCst) == 0 {
                cx.waker().wake_by_ref();
            }
            Poll::Pending
        })
        .await;
        WriteGuard(self)
    }

    /// A write passes now if no read-modify-write runs or waits; it must
    /// [`Self::leave`] once its bdev write has ended.
    pub(crate) fn try_enter(&self) -> bool {
        if self.exclusive.load(SeqCst) != 0 {
            return false;
        }
        self.writers.fetch_add(1, SeqCst);
        if self.exclusive.load(SeqCst) == 0 {
            return true;
        }
        // A read-modify-write came in between: step back (it may be
        // waiting for the writers to drain).
        self.writers.fetch_sub(1, SeqCst);
        self.wake_all();
        false
    }

    /// A write that passed has ended.
    pub(crate) fn leave(&self) {
        if self.writers.fetch_sub(1, SeqCst) == 1 && self.exclusive.load(SeqCst) > 0 {
            self.wake_all();
        }
    }

    /// Waits until this read-modify-write runs alone: no other one, no
    /// write on the medium; writes that come meanwhile wait.
    pub async fn exclusive(&self) -> ExclusiveGuard<'_> {
        self.exclusive.fetch_add(1, SeqCst);
        // Dropped while it waits (its task aborted), it only leaves.
        let mut guard = ExclusiveGuard(self, false);
        poll_fn(|cx| {
            let mut st = self.lock();
            if !st.held && self.writers.load(SeqCst) == 0 {
                st.held = true;
                return Poll::Ready(());
            }
            st.waiters.push(cx.waker().clone());
            Poll::Pending
        })
        .await;
        guard.1 = true;
        guard
    }
}

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        self.0.leave();
    }
}

impl Drop for ExclusiveGuard<'_> {
    fn drop(&mut self) {
        let g = self.0;
        if self.1 {
            g.lock().held = false;
        }
        g.exclusive.fetch_sub(1, SeqCst);
        g.wake_all();
    }
}
