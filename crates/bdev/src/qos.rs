//! QoS rate limits on any bdev (SPDK's `bdev_set_qos_limit`): I/O per
//! second and MB/s (read + write, read only, write only), one limit over
//! every reactor.
//!
//! SPDK funnels a limited bdev's I/O through one thread. Here each reactor
//! keeps its own share of tokens in plain `Cell`s ([`QosLocal`]) and spends
//! them per I/O with no atomic and no message; a timed poller per reactor
//! (every [`TIMESLICE`]) settles that share against one shared bucket
//! ([`QosShared`], a mutex taken once per timeslice per reactor, never per
//! I/O): it gives back what it did not use, takes what its queue and its
//! last timeslice's use ask for, and releases queued I/O in order. The
//! bucket fills at the limit's rate from the clock and holds at most a few
//! timeslices' worth, so the reactors together never exceed the limit by
//! more than that burst, and a busy reactor gets what an idle one gives
//! back within one timeslice.
//!
//! An I/O passes when every limit that applies to it has a positive
//! balance and nothing is queued before it; it may take the balance below
//! zero (a 1 MiB write under a 1 MB/s limit still goes), and the debt is
//! paid from the next shares, as SPDK does. Only reads and writes count;
//! other kinds pass at once. Queued I/O is never dropped: removing the
//! last limit or deleting the bdev releases every queued I/O (a deleted
//! bdev's then fail with `Removed`).

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use ustor_runtime::{ticks, PollStatus, PollerId};

use crate::channel::ChannelCore;
use crate::error::ControlError;
use crate::registry::BdevEntry;

/// How often each reactor settles its share with the shared bucket.
pub const TIMESLICE: Duration = Duration::from_millis(1);

/// The bucket holds at most this many timeslices of tokens: the most the
/// reactors can spend at once after an idle spell.
const BURST_SLICES: u64 = 4;

/// SPDK's units: I/O limits in multiples of 1000 per second, byte limits
/// in MiB per second.
pub const MIN_IOS_PER_SEC: u64 = 1000;
const MIB: u64 = 1 << 20;

/// A bdev's limits (0 = unlimited), as `bdev_get_bdevs` shows them in
/// `assigned_rate_limits`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QosLimits {
    pub rw_ios_per_sec: u64,
    pub rw_mbytes_per_sec: u64,
    pub r_mbytes_per_sec: u64,
    pub w_mbytes_per_sec: u64,
}

/// `bdev_set_qos_limit`'s limits: an absent one keeps its value, 0 removes
/// it (SPDK's semantics).
#[derive(Clone, Copy, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QosUpdate {
    pub rw_ios_per_sec: Option<u64>,
    pub rw_mbytes_per_sec: Option<u64>,
    pub r_mbytes_per_sec: Option<u64>,
    pub w_mbytes_per_sec: Option<u64>,
}

impl QosLimits {
    pub fn is_unlimited(&self) -> bool {
        self.rates() == [0; 4]
    }

    /// Applies `u` (checked: I/O limits in multiples of 1000, as SPDK).
    pub fn updated(self, u: &QosUpdate) -> Result<QosLimits, ControlError> {
        if u.rw_ios_per_sec.is_none()
            && u.rw_mbytes_per_sec.is_none()
            && u.r_mbytes_per_sec.is_none()
            && u.w_mbytes_per_sec.is_none()
        {
            return Err(ControlError::invalid(
                "rw_ios_per_sec",
                "no limit given (rw_ios_per_sec, rw_mbytes_per_sec, r_mbytes_per_sec, w_mbytes_per_sec)",
            ));
        }
        if let Some(v) = u.rw_ios_per_sec {
            if !v.is_multiple_of(MIN_IOS_PER_SEC) {
                return Err(ControlError::invalid(
                    "rw_ios_per_sec",
                    format!("{v} is not a multiple of {MIN_IOS_PER_SEC}"),
                ));
            }
        }
        for (name, v) in [
            ("rw_mbytes_per_sec", u.rw_mbytes_per_sec),
            ("r_mbytes_per_sec", u.r_mbytes_per_sec),
            ("w_mbytes_per_sec", u.w_mbytes_per_sec),
        ] {
            if v.is_some_and(|v| v.checked_mul(MIB).is_none_or(|b| b > i64::MAX as u64)) {
                return Err(ControlError::invalid(name, "too large"));
            }
        }
        Ok(QosLimits {
            rw_ios_per_sec: u.rw_ios_per_sec.unwrap_or(self.rw_ios_per_sec),
            rw_mbytes_per_sec: u.rw_mbytes_per_sec.unwrap_or(self.rw_mbytes_per_sec),
            r_mbytes_per_sec: u.r_mbytes_per_sec.unwrap_or(self.r_mbytes_per_sec),
            w_mbytes_per_sec: u.w_mbytes_per_sec.unwrap_or(self.w_mbytes_per_sec),
        })
    }

    /// Per-second rates in token units, indexed like [`cost`].
    fn rates(&self) -> [u64; 4] {
        [
            self.rw_ios_per_sec,
            self.rw_mbytes_per_sec * MIB,
            self.r_mbytes_per_sec * MIB,
            self.w_mbytes_per_sec * MIB,
        ]
    }
}

/// What one I/O costs of each limit: I/Os, bytes, read bytes, write bytes.
#[inline]
fn cost(read: bool, bytes: u64) -> [i64; 4] {
    let b = bytes as i64;
    [1, b, if read { b } else { 0 }, if read { 0 } else { b }]
}

/// The tokens every reactor of one bdev draws from.
pub(crate) struct QosShared {
    bucket: Mutex<Bucket>,
}

struct Bucket {
    limits: QosLimits,
    rate: [u64; 4],
    avail: [i64; 4],
    /// Fractions of a token owed by the last refill (`rate * ticks` mod hz).
    rem: [u128; 4],
    last: u64,
}

impl Bucket {
    fn refill(&mut self, now: u64) {
        let dt = now.saturating_sub(self.last) as u128;
        self.last = now.max(self.last);
        let hz = ticks::hz() as u128;
        for i in 0..4 {
            if self.rate[i] == 0 {
                continue;
            }
            let add = self.rate[i] as u128 * dt + self.rem[i];
            self.rem[i] = add % hz;
            let add = (add / hz).min(i64::MAX as u128) as i64;
            self.avail[i] = self.avail[i].saturating_add(add).min(self.cap(i));
        }
    }

    /// The most the bucket holds: [`BURST_SLICES`] timeslices' worth (at
    /// least one token).
    fn cap(&self, i: usize) -> i64 {
        let per_slice = self.rate[i] as u128 * TIMESLICE.as_nanos() / 1_000_000_000;
        (per_slice * BURST_SLICES as u128).clamp(1, i64::MAX as u128) as i64
    }
}

impl QosShared {
    pub(crate) fn new(limits: QosLimits) -> QosShared {
        let rate = limits.rates();
        let mut b = Bucket {
            limits,
            rate,
            avail: [0; 4],
            rem: [0; 4],
            last: ticks::now(),
        };
        // Start with one timeslice, not a burst.
        for i in 0..4 {
            b.avail[i] = b.cap(i) / BURST_SLICES as i64;
        }
        QosShared {
            bucket: Mutex::new(b),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Bucket> {
        self.bucket.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn limits(&self) -> QosLimits {
        self.lock().limits
    }

    /// New limits for the same bdev; balances of limits kept stay.
    pub(crate) fn set_limits(&self, limits: QosLimits) {
        let mut b = self.lock();
        b.refill(ticks::now());
        b.limits = limits;
        b.rate = limits.rates();
        for i in 0..4 {
            let cap = b.cap(i);
            b.avail[i] = b.avail[i].min(cap);
        }
    }
}

/// One queued I/O. Its future holds the ticket; the poller releases
/// tickets in order.
struct Waiter {
    ticket: u64,
    cost: [i64; 4],
    waker: Option<Waker>,
    /// Its future was dropped: released without spending tokens.
    cancelled: bool,
}

/// One reactor's share of a bdev's limits, held by the bdev's channel on
/// that reactor and by its poller.
pub(crate) struct QosLocal {
    shared: Arc<QosShared>,
    entry: Arc<BdevEntry>,
    /// Which limits are set (a copy of the shared limits, refreshed by the
    /// poller).
    on: Cell<[bool; 4]>,
    tokens: [Cell<i64>; 4],
    /// Spent in the current timeslice (the next share's estimate).
    used: [Cell<i64>; 4],
    /// Cost of what is queued.
    queued: [Cell<i64>; 4],
    queue: RefCell<VecDeque<Waiter>>,
    next_ticket: Cell<u64>,
    /// Every ticket up to this one is released.
    released: Cell<u64>,
    active: Cell<bool>,
    poller: Cell<Option<PollerId>>,
}

impl QosLocal {
    /// A share for this reactor, with its poller (call on a reactor).
    pub(crate) fn start(entry: Arc<BdevEntry>, shared: Arc<QosShared>) -> std::rc::Rc<QosLocal> {
        let on = shared.limits().rates().map(|r| r != 0);
        let q = std::rc::Rc::new(QosLocal {
            shared,
            entry,
            on: Cell::new(on),
            tokens: Default::default(),
            used: Default::default(),
            queued: Default::default(),
            queue: RefCell::new(VecDeque::with_capacity(256)),
            next_ticket: Cell::new(1),
            released: Cell::new(0),
            active: Cell::new(true),
            poller: Cell::new(None),
        });
        let me = q.clone();
        let id = ustor_runtime::register_timed_poller("qos", TIMESLICE, move || me.tick());
        q.poller.set(Some(id));
        q
    }

    /// Whether this share draws from `s`.
    pub(crate) fn shares(&self, s: &Arc<QosShared>) -> bool {
        Arc::ptr_eq(&self.shared, s)
    }

    /// Whether an I/O costing `c` may go now.
    #[inline]
    fn can_pass(&self, c: &[i64; 4]) -> bool {
        let on = self.on.get();
        (0..4).all(|i| !on[i] || c[i] == 0 || self.tokens[i].get() > 0)
    }

    fn spend(&self, c: &[i64; 4]) {
        for (i, &v) in c.iter().enumerate() {
            self.tokens[i].set(self.tokens[i].get() - v);
            self.used[i].set(self.used[i].get() + v);
        }
    }

    /// Spends the I/O's tokens if it may go now (nothing queued before it
    /// and a positive balance on each limit).
    pub(crate) fn try_pass(&self, read: bool, bytes: u64) -> bool {
        let c = cost(read, bytes);
        if !self.active.get() {
            return true;
        }
        if self.queue.borrow().is_empty() && self.can_pass(&c) {
            self.spend(&c);
            return true;
        }
        false
    }

    /// Queues an I/O that could not pass; returns its ticket.
    fn enqueue(&self, read: bool, bytes: u64, waker: Waker) -> u64 {
        let c = cost(read, bytes);
        let t = self.next_ticket.get();
        self.next_ticket.set(t + 1);
        for (i, &v) in c.iter().enumerate() {
            self.queued[i].set(self.queued[i].get() + v);
        }
        self.queue.borrow_mut().push_back(Waiter {
            ticket: t,
            cost: c,
            waker: Some(waker),
            cancelled: false,
        });
        t
    }

    /// Points a queued ticket at a new waker, or cancels it (`None`).
    fn update(&self, ticket: u64, waker: Option<&Waker>) {
        let mut q = self.queue.borrow_mut();
        let Some(front) = q.front().map(|w| w.ticket) else {
            return;
        };
        let Some(w) = ticket
            .checked_sub(front)
            .and_then(|i| q.get_mut(i as usize))
        else {
            return;
        };
        match waker {
            Some(k) => {
                if !w.waker.as_ref().is_some_and(|o| o.will_wake(k)) {
                    w.waker = Some(k.clone());
                }
            }
            None => w.cancelled = true,
        }
    }

    /// Releases queued I/O in order while it may pass (all of it when
    /// `all`); returns how many were released.
    fn release(&self, all: bool) -> usize {
        let mut n = 0;
        loop {
            let w = {
                let mut q = self.queue.borrow_mut();
                match q.front() {
                    Some(w) if all || w.cancelled || self.can_pass(&w.cost) => q.pop_front(),
                    _ => None,
                }
            };
            let Some(w) = w else { break };
            for (i, &v) in w.cost.iter().enumerate() {
                self.queued[i].set(self.queued[i].get() - v);
            }
            if !w.cancelled && !all {
                self.spend(&w.cost);
            }
            self.released.set(w.ticket);
            if let Some(k) = w.waker {
                k.wake();
            }
            n += 1;
        }
        n
    }

    /// The timed poller: settles this reactor's share with the bucket and
    /// releases what may now pass.
    fn tick(&self) -> PollStatus {
        if !self.active.get() {
            return PollStatus::Idle;
        }
        if self.entry.is_removed() {
            self.stop();
            return PollStatus::Busy;
        }
        {
            let mut b = self.shared.lock();
            b.refill(ticks::now());
            let on = b.rate.map(|r| r != 0);
            for (i, &set) in on.iter().enumerate() {
                let t = self.tokens[i].get();
                let used = self.used[i].replace(0);
                if !set {
                    self.tokens[i].set(0);
                    continue;
                }
                // Give back the unspent share, then take what the queue and
                // the last timeslice's pace ask for (at least one token so
                // the next I/O need not wait a timeslice), as far as the
                // bucket has it. A debt (t < 0) is paid first.
                let back = t.max(0);
                let cap = b.cap(i);
                b.avail[i] = b.avail[i].saturating_add(back).min(cap);
                let want = self.queued[i].get() + used.max(1) + (-t).max(0);
                let take = want.min(b.avail[i].max(0));
                b.avail[i] -= take;
                self.tokens[i].set(t - back + take);
            }
            self.on.set(on);
        }
        if self.release(false) > 0 {
            PollStatus::Busy
        } else {
            PollStatus::Idle
        }
    }

    /// Ends QoS on this reactor: every queued I/O goes, the poller stops,
    /// the unspent share goes back.
    pub(crate) fn stop(&self) {
        if !self.active.replace(false) {
            return;
        }
        if let Some(p) = self.poller.take() {
            ustor_runtime::unregister_poller(p);
        }
        {
            let mut b = self.shared.lock();
            for i in 0..4 {
                let back = self.tokens[i].replace(0).max(0);
                let cap = b.cap(i);
                b.avail[i] = b.avail[i].saturating_add(back).min(cap);
            }
        }
        self.release(true);
    }

    /// Whether `ticket` has been released.
    fn is_released(&self, ticket: u64) -> bool {
        self.released.get() >= ticket
    }

    /// How many I/Os wait on this reactor.
    pub(crate) fn queued(&self) -> usize {
        self.queue.borrow().len()
    }
}

impl Drop for QosLocal {
    fn drop(&mut self) {
        if let Some(p) = self.poller.take() {
            ustor_runtime::unregister_poller(p);
        }
    }
}

/// Waits until the poller releases this I/O (the slow path of a limited
/// bdev's I/O).
pub(crate) struct QosWait<'a> {
    q: &'a QosLocal,
    read: bool,
    bytes: u64,
    ticket: u64,
}

impl<'a> QosWait<'a> {
    pub(crate) fn new(q: &'a QosLocal, read: bool, bytes: u64) -> QosWait<'a> {
        QosWait {
            q,
            read,
            bytes,
            ticket: 0,
        }
    }
}

impl Future for QosWait<'_> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let q = self.q;
        if self.ticket == 0 {
            if q.try_pass(self.read, self.bytes) {
                return Poll::Ready(());
            }
            self.ticket = q.enqueue(self.read, self.bytes, cx.waker().clone());
            return Poll::Pending;
        }
        if q.is_released(self.ticket) {
            self.ticket = u64::MAX;
            return Poll::Ready(());
        }
        q.update(self.ticket, Some(cx.waker()));
        Poll::Pending
    }
}

impl Drop for QosWait<'_> {
    fn drop(&mut self) {
        if self.ticket != 0 && self.ticket != u64::MAX && !self.q.is_released(self.ticket) {
            self.q.update(self.ticket, None);
        }
    }
}

impl ChannelCore {
    /// Takes up (or drops) this reactor's share of the bdev's QoS limits
    /// as they are now; queued I/O of a dropped share is released. Only on
    /// a reactor, where the share's poller runs.
    pub(crate) fn sync_qos(&self) {
        let want = self
            .entry
            .qos_shared()
            .filter(|_| !self.entry.is_removed() && ustor_runtime::is_reactor_thread());
        let mut cur = self.qos.borrow_mut();
        let same = match (&want, &*cur) {
            (Some(w), Some(c)) => c.shares(w),
            (None, None) => true,
            _ => false,
        };
        if same {
            return;
        }
        self.qos_on.set(false);
        if let Some(old) = cur.take() {
            old.stop();
        }
        if let Some(w) = want {
            *cur = Some(QosLocal::start(self.entry.clone(), w));
            self.qos_on.set(true);
        }
    }

    /// I/Os waiting for QoS tokens on this reactor.
    pub(crate) fn qos_queued(&self) -> usize {
        self.qos.borrow().as_ref().map_or(0, |q| q.queued())
    }
}
