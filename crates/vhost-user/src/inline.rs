//! A queue task's inline slot: room for one request future inside the
//! queue task itself, so a request taken off the ring runs on the spot,
//! in the pass that took it, instead of being queued for a worker. A
//! bdev that completes inline (null, malloc, a cached block) so answers
//! the request before the take loop looks at the next chain: no worker
//! wake, no queue push and pop, no second task poll, and the used entry
//! is published in the same pass (at QD1 that is the whole request
//! path).
//!
//! The slot is a pinned `Option<F>` in the queue task's future (allocated
//! once, with the task): a request that has to wait stays in it, polled
//! with the queue task's own waker on each of the task's polls (its pass,
//! its park on the kick), and while it is occupied further requests go
//! to the workers as before. Nothing is boxed and nothing is moved after
//! its first poll, so a slow device costs no allocation either.

use std::future::Future;
use std::pin::Pin;
use std::task::Context;

/// Polls the request in `slot`, if any, and empties the slot once it is
/// done. True when the slot is free afterwards.
#[inline]
pub fn drive<F: Future<Output = ()>>(mut slot: Pin<&mut Option<F>>, cx: &mut Context<'_>) -> bool {
    let done = match slot.as_mut().as_pin_mut() {
        None => return true,
        Some(f) => f.poll(cx).is_ready(),
    };
    if done {
        slot.set(None);
    }
    done
}

/// Runs `fut` in `slot` (which must be free) up to its first wait: true
/// when it completed at once, false when it stays in the slot.
#[inline]
pub fn start<F: Future<Output = ()>>(
    mut slot: Pin<&mut Option<F>>,
    fut: F,
    cx: &mut Context<'_>,
) -> bool {
    debug_assert!(slot.is_none(), "inline slot busy");
    slot.set(Some(fut));
    drive(slot, cx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::future::poll_fn;
    use std::pin::pin;
    use std::rc::Rc;
    use std::task::{Poll, Waker};

    /// Completes on its `polls`-th poll, counting in `done`.
    fn job((polls, done): (u32, Rc<Cell<u32>>)) -> impl Future<Output = ()> {
        let mut left = polls;
        poll_fn(move |_| {
            left -= 1;
            if left == 0 {
                done.set(done.get() + 1);
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
    }

    #[test]
    fn a_ready_request_frees_the_slot_at_once_and_a_waiting_one_keeps_it() {
        let mut cx = Context::from_waker(Waker::noop());
        let done = Rc::new(Cell::new(0));
        let mut slot = pin!(None);
        assert!(drive(slot.as_mut(), &mut cx), "empty slot is free");
        assert!(start(slot.as_mut(), job((1, done.clone())), &mut cx));
        assert_eq!(done.get(), 1);
        assert!(slot.is_none());
        assert!(!start(slot.as_mut(), job((3, done.clone())), &mut cx));
        assert!(!drive(slot.as_mut(), &mut cx));
        assert_eq!(done.get(), 1, "still waiting");
        assert!(drive(slot.as_mut(), &mut cx), "done on its third poll");
        assert_eq!(done.get(), 2);
        assert!(slot.is_none());
    }
}
