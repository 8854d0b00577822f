//! What a queue's request workers share (vhost-user-blk and -scsi): the
//! runtime's [`WorkQueue`] runs them (spawned on demand, at most one per
//! ring slot, then parked and reused, so once warm the data path
//! allocates nothing), and one awake worker takes every job queued
//! behind it: a bdev that completes inline (null, malloc) runs a whole
//! batch of requests in one task poll instead of a wake, a poll and a
//! park per request. This module adds the guest memory map a worker
//! keeps between jobs.

use std::cell::RefCell;
use std::future::{poll_fn, Future};
use std::pin::pin;
use std::rc::Rc;

use ustor_runtime::WorkQueue;

use crate::guest::GuestMem;

/// The memory map a worker last used, with its generation: a worker
/// clones the queue's `Rc` only when the frontend changed the map, not
/// per request.
#[derive(Default)]
pub struct WorkerMem(Option<(u64, Rc<GuestMem>)>);

impl WorkerMem {
    /// The map of generation `gen` (`cur`: the queue's current one).
    pub fn get(&mut self, gen: u64, cur: &RefCell<Rc<GuestMem>>) -> &Rc<GuestMem> {
        match &self.0 {
            Some((g, _)) if *g == gen => {}
            _ => self.0 = Some((gen, cur.borrow().clone())),
        }
        match &self.0 {
            Some((_, m)) => m,
            None => unreachable!("set above"),
        }
    }

    /// Worker `id`'s next job from `q`. While it is parked, a wake-up
    /// ([`WorkQueue::wake_all`] after the map changed) finding no job
    /// drops a map older than `gen()`, so an idle worker does not keep
    /// the old one alive.
    pub async fn next<J>(
        &mut self,
        q: &WorkQueue<J>,
        id: usize,
        gen: impl Fn() -> u64,
    ) -> Option<J> {
        let mut next = pin!(q.next(id));
        poll_fn(|cx| {
            let r = next.as_mut().poll(cx);
            if r.is_pending() && self.0.as_ref().is_some_and(|m| m.0 != gen()) {
                self.0 = None;
            }
            r
        })
        .await
    }
}
