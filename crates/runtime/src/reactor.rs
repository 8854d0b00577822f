//! The reactor: one thread, one loop. Each pass drains messages, runs ready
//! tasks, active and due timed pollers and timers, submits queued SQEs and
//! reaps completions; then decides, by poll mode, whether to sleep.

use std::cell::Cell;
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

use crate::buf::BufPool;
use crate::config::{PollMode, RuntimeConfig};
use crate::depth::{DepthJudge, EXPIRY_NS};
use crate::executor::Executor;
use crate::msg::{ReactorShared, RuntimeShared};
use crate::nap::{NapPlanner, MIN_NAP_NS};
use crate::park;
use crate::poller::Pollers;
use crate::spin::{Contention, SpinBudget, MIN_SPIN_NS, YIELD_EVERY_NS};
use crate::stats::Counters;
use crate::ticks;
use crate::timer::Timers;
use crate::uring::Ring;

/// Work items one loop pass takes from each source before moving on, so no
/// source can starve the others (nvmet-tcp's budgets).
const MSG_BUDGET: usize = 64;
const TASK_BUDGET: usize = 1024;

/// Where the reactor is in an idle stretch (adaptive mode's spin and nap).
struct Stretch {
    /// The end of the last pass with work, or of the last full sleep: the
    /// spin counts from here.
    last_busy: u64,
    /// Where the idle stretch began (sleeps do not move it).
    idle_since: u64,
    /// The last pass found no work (or the reactor slept after work).
    idle: bool,
    /// The stretch has had its one chance to nap.
    nap_planned: bool,
}

/// Why an adaptive reactor sleeps as soon as it finds no work instead of
/// spinning: its clients are deep (judged first: a deep load batches
/// whoever else wants the CPUs), or other threads want its CPUs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum AtOnce {
    No,
    Batched,
    Contended,
}

/// The wait a pass of task work alone ends with, its SQEs submitted by the
/// wait's own io_uring_enter ([`Reactor::fold_wait`]).
enum Fold {
    /// No fold: submit now, and the next pass decides.
    No,
    /// Adaptive mode will spin without a nap: submit now.
    Spin,
    /// Sleep until a completion, a message or the next deadline.
    Sleep,
    /// Adaptive mode's nap of this many ticks.
    Nap(u64),
}

pub(crate) struct Reactor {
    pub(crate) id: usize,
    pub(crate) shared: Arc<ReactorShared>,
    pub(crate) runtime: Arc<RuntimeShared>,
    pub(crate) exec: Executor,
    pub(crate) pollers: Pollers,
    pub(crate) timers: Timers,
    pub(crate) ring: Ring,
    pub(crate) bufs: BufPool,
    pub(crate) stats: Counters,
    mode: PollMode,
    /// Adaptive mode's spin before sleeping (adapts within `idle_period`).
    spin: std::cell::RefCell<SpinBudget>,
    /// Adaptive mode: the timed nap at the start of an idle stretch.
    pub(crate) nap: std::cell::RefCell<NapPlanner>,
    /// Adaptive mode: whether other threads want the CPUs (then no spin).
    contention: std::cell::RefCell<Contention>,
    /// Adaptive mode: whether the clients' depth makes spinning a waste
    /// (then no spin either; see [`crate::depth`]).
    depth: std::cell::RefCell<DepthJudge>,
    stop_requested: Cell<bool>,
    exit_hooks: std::cell::RefCell<Vec<Box<dyn FnOnce()>>>,
    /// The tick count pollers and timers see this pass ([`pass_ticks`]).
    pass_ticks: Cell<u64>,
}

thread_local! {
    static CURRENT: Cell<*const Reactor> = const { Cell::new(std::ptr::null()) };
}

/// Runs `f` with the current thread's reactor, or returns `None` off-reactor.
#[inline]
pub(crate) fn try_with<R>(f: impl FnOnce(&Reactor) -> R) -> Option<R> {
    let p = CURRENT.with(|c| c.get());
    if p.is_null() {
        return None;
    }
    // SAFETY: CURRENT is set only while `Reactor::run` holds the reactor alive
    // on this thread's stack frame, and cleared before it is dropped.
    Some(f(unsafe { &*p }))
}

/// Runs `f` with the current reactor; panics off a reactor thread, which is a
/// programming error (the API says which functions need a reactor).
#[inline]
pub(crate) fn with<R>(f: impl FnOnce(&Reactor) -> R) -> R {
    try_with(f).expect("this function must be called on a ustor reactor thread")
}

/// Index of the reactor running the current thread.
pub fn reactor_id() -> usize {
    with(|r| r.id)
}

/// How the current reactor waits for work: a driver whose device can
/// signal an eventfd needs that wake source only where the reactor sleeps
/// (not in [`PollMode::Poll`]).
pub fn poll_mode() -> PollMode {
    with(|r| r.mode)
}

/// Whether the current thread is a reactor.
pub fn is_reactor_thread() -> bool {
    try_with(|_| ()).is_some()
}

/// Runs `f` on the current reactor when it exits, before its ring and
/// buffer pool go away (for thread-local state of upper layers).
pub fn on_reactor_exit(f: impl FnOnce() + 'static) {
    with(|r| r.exit_hooks.borrow_mut().push(Box::new(f)));
}

/// The tick count at the end of the reactor's previous pass (after its
/// sleep, if it slept): the time its pollers and timers see this pass. A
/// task that polls every pass and wants only a coarse clock (poll windows,
/// coalescing intervals) reads this instead of the TSC, which costs tens
/// of ns in a VM. Off a reactor, the TSC.
#[inline]
pub fn pass_ticks() -> u64 {
    try_with(|r| r.pass_ticks.get()).unwrap_or_else(ticks::now)
}

/// A target's report of one request: its client had `depth` requests in
/// flight when it sent it (this one included). Adaptive reactors whose
/// requests come mostly from deep clients sleep as soon as they find no
/// work instead of spinning (see the `depth` module). Off a reactor, nothing.
#[inline]
pub fn note_depth(depth: u32) {
    try_with(|r| r.depth.borrow_mut().note(depth, r.pass_ticks.get()));
}

/// Asks the current reactor to leave its loop after this pass.
pub fn request_stop() {
    with(|r| r.stop_requested.set(true));
}

impl Reactor {
    pub(crate) fn new(
        id: usize,
        cfg: &RuntimeConfig,
        shared: Arc<ReactorShared>,
        runtime: Arc<RuntimeShared>,
    ) -> std::io::Result<Reactor> {
        let bufs = BufPool::new(&cfg.bufs)?;
        let ring = Ring::new(cfg, &bufs, shared.eventfd())?;
        Ok(Reactor {
            id,
            shared,
            runtime,
            exec: Executor::new(cfg.max_tasks as usize),
            pollers: Pollers::new(),
            timers: Timers::new(),
            ring,
            bufs,
            stats: Counters::default(),
            mode: cfg.poll_mode,
            spin: std::cell::RefCell::new(SpinBudget::new(
                ticks::from_duration(cfg.idle_period),
                ticks::from_duration(std::time::Duration::from_nanos(MIN_SPIN_NS)),
            )),
            nap: std::cell::RefCell::new(NapPlanner::new(
                ticks::from_duration(std::time::Duration::from_micros(7)),
                ticks::from_duration(std::time::Duration::from_nanos(MIN_NAP_NS)),
                ticks::from_duration(std::time::Duration::from_micros(1)),
            )),
            contention: std::cell::RefCell::new(Contention::new(
                ticks::from_duration(std::time::Duration::from_millis(5)),
                ticks::from_duration(std::time::Duration::from_nanos(YIELD_EVERY_NS)),
            )),
            depth: std::cell::RefCell::new(DepthJudge::new(ticks::from_duration(
                std::time::Duration::from_nanos(EXPIRY_NS),
            ))),
            stop_requested: Cell::new(false),
            exit_hooks: std::cell::RefCell::new(Vec::new()),
            pass_ticks: Cell::new(ticks::now()),
        })
    }

    /// Runs the loop until the runtime stops. `self` must stay put while it runs.
    pub(crate) fn run(&self) {
        CURRENT.with(|c| c.set(self as *const Reactor));
        // Clears CURRENT even if the loop unwinds, so thread-local
        // destructors never reach a dead reactor.
        struct Clear;
        impl Drop for Clear {
            fn drop(&mut self) {
                CURRENT.with(|c| c.set(std::ptr::null()));
            }
        }
        let _clear = Clear;
        // One TSC read per pass (it costs tens of ns in a VM): pollers and
        // timers see the time the previous pass ended.
        let mut prev = ticks::now();
        let mut st = Stretch {
            last_busy: prev,
            idle_since: prev,
            idle: false,
            nap_planned: false,
        };
        loop {
            if self.shared.stop.load(Ordering::Acquire) || self.stop_requested.get() {
                break;
            }
            self.pass_ticks.set(prev);
            let mut work = 0usize;
            work += self.drain_inbox(MSG_BUDGET);
            work += self.exec.run_ready(TASK_BUDGET);
            let background = self.pollers.run(prev) + self.timers.fire(prev);
            work += background;
            // When only tasks ran and every task is waiting again, the SQEs
            // they queued go in with the wait's own io_uring_enter when the
            // reactor would wait next anyway (`fold_wait`): one syscall per
            // round trip, not a submit and then a wait in the next, idle
            // pass. Completions already posted make that enter return at
            // once, and so does a queued send that the socket takes inside
            // the enter: such a pass submits and reaps now, and the pass
            // after it (the sender's task done) folds the real wait.
            let quiet = work > 0
                && background == 0
                && !self.exec.has_ready()
                && self.shared.inbox.is_empty()
                && !self.ring.has_completions()
                && !self.ring.sends_queued();
            let fold = if quiet {
                self.fold_wait(prev)
            } else {
                Fold::No
            };
            if matches!(fold, Fold::No | Fold::Spin) {
                work += self.ring.submit_and_reap(false);
            }
            let mut end = ticks::now();
            self.stats.loops.set(self.stats.loops.get() + 1);
            if work > 0 {
                self.stats
                    .busy_ticks
                    .set(self.stats.busy_ticks.get() + (end - prev));
                if st.idle && self.mode == PollMode::Adaptive {
                    self.nap.borrow_mut().record_gap(prev - st.idle_since);
                }
                st = Stretch {
                    last_busy: end,
                    idle_since: end,
                    idle: false,
                    nap_planned: false,
                };
            } else {
                st.idle = true;
            }
            match fold {
                Fold::Sleep => {
                    self.sleep(None);
                    end = ticks::now();
                    st.last_busy = end;
                    // The idle stretch began with this sleep and ends with
                    // the next work, as if an idle pass had slept.
                    st.idle = true;
                }
                Fold::Nap(asked) => {
                    // The nap the first idle pass would take, taken now; the
                    // spin after it counts from `last_busy`, as it does there.
                    st.nap_planned = true;
                    st.idle = true;
                    let slept = self.sleep(Some(asked));
                    self.nap.borrow_mut().after_nap(asked, slept);
                    end = ticks::now();
                }
                // The stretch had its one chance to nap.
                Fold::Spin => st.nap_planned = true,
                Fold::No if work == 0 => {
                    self.stats
                        .idle_ticks
                        .set(self.stats.idle_ticks.get() + (end - prev));
                    end = self.idle_pass(end, &mut st);
                }
                Fold::No => {}
            }
            prev = end;
        }
        self.shutdown_ring();
        CURRENT.with(|c| c.set(std::ptr::null()));
    }

    fn drain_inbox(&self, budget: usize) -> usize {
        let mut n = 0;
        while n < budget {
            let Some(msg) = self.shared.inbox.pop() else {
                break;
            };
            msg();
            n += 1;
        }
        self.stats
            .messages
            .set(self.stats.messages.get() + n as u64);
        n
    }

    /// Whether (and why) an adaptive reactor sleeps at once at `now`.
    fn at_once(&self, now: u64) -> AtOnce {
        if self.depth.borrow().batch(now) {
            AtOnce::Batched
        } else if self.contention.borrow_mut().oversubscribed(now) {
            AtOnce::Contended
        } else {
            AtOnce::No
        }
    }

    /// Counts a sleep taken at once for `why`.
    fn count_at_once(&self, why: AtOnce) {
        let c = match why {
            AtOnce::No => return,
            AtOnce::Batched => &self.stats.batched,
            AtOnce::Contended => &self.stats.contended,
        };
        c.set(c.get() + 1);
    }

    /// How the wait that follows a pass of task work alone goes, decided
    /// in that pass so its SQEs can go in with the wait: interrupt mode
    /// sleeps at once; adaptive mode sleeps at once when its idle pass
    /// would ([`Reactor::at_once`]), and otherwise naps if its first idle
    /// pass would (`Spin`: it would not, and the stretch has had its
    /// chance).
    fn fold_wait(&self, now: u64) -> Fold {
        match self.mode {
            PollMode::Poll => Fold::No,
            PollMode::Interrupt => Fold::Sleep,
            PollMode::Adaptive => {
                let why = self.at_once(now);
                if why != AtOnce::No {
                    self.count_at_once(why);
                    return Fold::Sleep;
                }
                let spin = self.spin.borrow().ticks();
                match self.nap.borrow_mut().plan(0, spin) {
                    Some(asked) => Fold::Nap(asked),
                    None => Fold::Spin,
                }
            }
        }
    }

    /// A pass that found no work, ending at `end`: by poll mode, sleep
    /// (interrupt; adaptive at once for [`Reactor::at_once`] or when its
    /// spin is spent), nap once per idle stretch, or spin on. Returns the
    /// time it ends.
    fn idle_pass(&self, mut end: u64, st: &mut Stretch) -> u64 {
        let mut why = AtOnce::No;
        let sleep = match self.mode {
            PollMode::Poll => false,
            PollMode::Interrupt => true,
            PollMode::Adaptive => {
                why = self.at_once(end);
                let spin = self.spin.borrow().ticks();
                let sleep = why != AtOnce::No || end - st.last_busy >= spin;
                if !sleep {
                    self.contention.borrow_mut().share_cpu(end);
                }
                if !sleep && !st.nap_planned && !self.exec.has_ready() {
                    st.nap_planned = true;
                    let plan = self.nap.borrow_mut().plan(end - st.idle_since, spin);
                    if let Some(asked) = plan {
                        let slept = self.sleep(Some(asked));
                        self.nap.borrow_mut().after_nap(asked, slept);
                        end = ticks::now();
                    }
                }
                sleep
            }
        };
        if sleep && !self.exec.has_ready() {
            self.count_at_once(why);
            let spun = end - st.last_busy;
            let slept = self.sleep(None);
            // Only a sleep the spin budget chose teaches it.
            if self.mode == PollMode::Adaptive && why == AtOnce::No {
                self.spin.borrow_mut().after_sleep(spun, slept);
            }
            end = ticks::now();
            st.last_busy = end;
        }
        end
    }

    /// Blocks in io_uring_enter until a completion (an eventfd write from a
    /// sender, an I/O, or the next timer deadline), or for at most `nap`
    /// ticks. Returns the ticks spent asleep (0 if it did not sleep).
    fn sleep(&self, nap: Option<u64>) -> u64 {
        // Nothing the kernel could complete meanwhile: sleep on the futex
        // (see `park`).
        let futex = self.ring.idle();
        let state = if futex { park::FUTEX } else { park::RING };
        // Dekker pairing with `RuntimeHandle::send`: publish `sleeping`, then
        // look at the inbox; the sender pushes, then looks at `sleeping`.
        self.shared.sleeping.store(state, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if !self.shared.inbox.is_empty()
            || self.shared.stop.load(Ordering::Acquire)
            || (futex && self.shared.notified.swap(false, Ordering::SeqCst))
        {
            self.shared.sleeping.store(park::AWAKE, Ordering::SeqCst);
            return 0;
        }
        let now = ticks::now();
        let deadline = [
            self.timers.next_deadline(),
            self.pollers.next_deadline(),
            nap.map(|n| now + n),
        ]
        .into_iter()
        .flatten()
        .min();
        let timeout_ns = deadline.map(|d| ticks::to_ns(d.saturating_sub(now)));
        let sleeps = self.stats.sleeps.get() + 1;
        self.stats.sleeps.set(sleeps);
        self.shared.slept.store(sleeps, Ordering::Release);
        let t0 = ticks::now();
        if futex {
            park::wait(&self.shared.sleeping, timeout_ns);
        } else {
            self.ring.wait(timeout_ns);
        }
        self.shared.sleeping.store(park::AWAKE, Ordering::SeqCst);
        let t1 = ticks::now();
        self.stats
            .idle_ticks
            .set(self.stats.idle_ticks.get() + (t1 - t0));
        self.stats.wakeups.set(self.stats.wakeups.get() + 1);
        t1 - t0
    }

    fn shutdown_ring(&self) {
        // SQEs queued in the last pass go in while their tasks still own
        // the descriptors they name (clearing the tasks closes them).
        self.ring.flush();
        // Tasks go first: their in-flight ops become orphans the ring drains.
        self.exec.clear();
        // Then per-reactor state of upper layers (bdev channels), while the
        // reactor is still reachable from their destructors.
        loop {
            let hooks: Vec<Box<dyn FnOnce()>> = self.exit_hooks.borrow_mut().drain(..).collect();
            if hooks.is_empty() {
                break;
            }
            hooks.into_iter().rev().for_each(|h| h());
        }
        self.pollers.clear();
        self.ring.cancel_all_and_drain();
    }
}
