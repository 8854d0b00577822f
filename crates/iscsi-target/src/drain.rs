//! Target shutdown as sessions see it: once [`Drain::start`] runs, every
//! session sends an Async Message asking its initiator to log out
//! (RFC 7143 §11.9, AsyncEvent 1) and ends its connection when the grace
//! time has passed without a Logout. Sessions waiting for a PDU register
//! their waker here so the start reaches idle ones at once.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

/// The shutdown signal of one target.
#[derive(Default)]
pub struct Drain {
    on: AtomicBool,
    grace_secs: AtomicU32,
    next: AtomicU64,
    wakers: Mutex<HashMap<u64, Waker>>,
}

impl Drain {
    fn wakers(&self) -> MutexGuard<'_, HashMap<u64, Waker>> {
        self.wakers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Asks every session to have its initiator log out within `grace_secs`.
    pub fn start(&self, grace_secs: u32) {
        self.grace_secs.store(grace_secs, Ordering::Relaxed);
        self.on.store(true, Ordering::Release);
        let wakers: Vec<Waker> = self.wakers().drain().map(|(_, w)| w).collect();
        wakers.into_iter().for_each(Waker::wake);
    }

    /// A session's handle, unregistered when dropped.
    pub fn watch(self: &Arc<Self>) -> Watch {
        Watch {
            drain: self.clone(),
            id: self.next.fetch_add(1, Ordering::Relaxed),
            registered: RefCell::new(None),
        }
    }
}

/// One session's view of the target's [`Drain`].
pub struct Watch {
    drain: Arc<Drain>,
    id: u64,
    /// The waker in the target's map (a copy): a session polls this on
    /// every wait for a PDU, and the same task's waker is not registered
    /// again (the map is behind a mutex every reactor shares).
    registered: RefCell<Option<Waker>>,
}

impl Watch {
    /// The grace time in seconds once the drain started; registers the
    /// task's waker until then.
    pub fn poll_started(&self, cx: &mut Context<'_>) -> Poll<u32> {
        let d = &self.drain;
        if d.on.load(Ordering::Acquire) {
            return Poll::Ready(d.grace_secs.load(Ordering::Relaxed));
        }
        let mut mine = self.registered.borrow_mut();
        if mine.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            // Still in the map: a start drains the map only after `on` is
            // set, which the load above would have seen.
            return Poll::Pending;
        }
        *mine = Some(cx.waker().clone());
        d.wakers().insert(self.id, cx.waker().clone());
        // A start between the check and the insert drained the map
        // before our waker was in it: look again.
        if d.on.load(Ordering::Acquire) {
            d.wakers().remove(&self.id);
            return Poll::Ready(d.grace_secs.load(Ordering::Relaxed));
        }
        Poll::Pending
    }

    /// Whether the drain started (the grace time then).
    pub fn started(&self) -> Option<u32> {
        let d = &self.drain;
        d.on.load(Ordering::Acquire)
            .then(|| d.grace_secs.load(Ordering::Relaxed))
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.drain.wakers().remove(&self.id);
    }
}
