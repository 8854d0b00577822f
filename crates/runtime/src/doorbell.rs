//! Doorbells for lock-free rings between reactors (or a library's thread
//! and a reactor): the producer pushes onto a ring and calls
//! [`Doorbell::ring`], which sends the consumer reactor a message only when
//! the bell goes from disarmed to armed, so a burst costs one message and
//! the inbox never fills with doorbells. The consumer [`Doorbell::disarm`]s
//! before draining the ring (a push after the drain rings again).
//!
//! A doorbell that cannot be sent (inbox full, reactor stopped) sets the
//! bell's `lost` flag and [`RuntimeHandle::notify`]s the consumer: an
//! eventfd write that a reactor about to sleep cannot miss. The consumer
//! looks at [`Doorbell::take_lost`] from an untimed poller (one relaxed load
//! per bell per loop pass), never from a timed one: a timed poller bounds
//! every sleep of the reactor, so an idle reactor would wake every period
//! to look for doorbells that are nearly never lost.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::msg::RuntimeHandle;

/// The announcement of one ring to the reactor that drains it.
pub struct Doorbell {
    armed: AtomicBool,
    /// A doorbell could not be sent (set before the consumer is notified).
    lost: AtomicBool,
    reactor: usize,
    rt: RuntimeHandle,
}

impl Doorbell {
    /// A bell whose messages run on `reactor`.
    pub fn new(rt: RuntimeHandle, reactor: usize) -> Doorbell {
        Doorbell {
            armed: AtomicBool::new(false),
            lost: AtomicBool::new(false),
            reactor,
            rt,
        }
    }

    /// The reactor that drains the ring.
    pub fn reactor(&self) -> usize {
        self.reactor
    }

    /// After a push, from any thread: sends `drain` to the consumer unless
    /// the bell is already armed. `drain` should capture nothing (a
    /// function item is zero-sized, so `send` boxes it without allocating)
    /// and [`Self::disarm`] before draining.
    pub fn ring<F: FnOnce() + Send + 'static>(&self, drain: F) {
        if self.armed.swap(true, Ordering::SeqCst) {
            return;
        }
        if self.rt.send(self.reactor, drain).is_err() {
            self.armed.store(false, Ordering::SeqCst);
            self.lost.store(true, Ordering::SeqCst);
            // Wake the consumer (or keep it from sleeping) so its poller
            // sees `lost`.
            self.rt.notify(self.reactor);
        }
    }

    /// On the consumer, before draining the ring.
    pub fn disarm(&self) {
        self.armed.store(false, Ordering::SeqCst);
    }

    /// On the consumer's untimed poller: whether a doorbell was lost since
    /// the last call (then drain the ring). One relaxed load when not.
    pub fn take_lost(&self) -> bool {
        self.lost.load(Ordering::Relaxed) && self.lost.swap(false, Ordering::Acquire)
    }
}
