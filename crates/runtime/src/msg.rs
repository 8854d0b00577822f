//! Starting reactors and talking to them: the bounded inbox of (fn, ctx)
//! messages (SPDK's `spdk_thread_send_msg`), `for_each_reactor`
//! (`spdk_for_each_thread`), blocking calls from control-plane threads, and
//! the eventfd that wakes a sleeping reactor.

use std::future::Future;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, Weak};
use std::thread::JoinHandle as ThreadHandle;

use crossbeam_queue::ArrayQueue;

use crate::config::RuntimeConfig;
use crate::park;
use crate::reactor::{self, Reactor};
use crate::stats::ReactorStats;
use crate::ticks;

pub(crate) type Msg = Box<dyn FnOnce() + Send>;

/// Why a message was not delivered (or its reply never came back).
///
/// Other layers wrap it as `Runtime(#[from] ustor_runtime::SendError)` and
/// choose their own errno for it; `Copy` and `Eq` so errors that carry it can
/// be compared in tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// The reactor index is not one this runtime started.
    #[error("no reactor {0}")]
    NoSuchReactor(usize),
    /// The reactor's bounded inbox had no room; the message was dropped.
    #[error("reactor {0} inbox is full")]
    Full(usize),
    /// The runtime stopped before the message ran or before its reply came.
    #[error("runtime is stopped")]
    Stopped,
}

pub(crate) struct ReactorShared {
    pub(crate) inbox: ArrayQueue<Msg>,
    /// Where the reactor sleeps, if it does ([`crate::park`]'s states;
    /// also the futex word of a reactor asleep with an idle ring).
    pub(crate) sleeping: AtomicU32,
    /// [`RuntimeHandle::notify`] was called: a reactor about to sleep on
    /// its futex does not (the eventfd write that keeps a ring sleep from
    /// starting does not reach a futex sleep).
    pub(crate) notified: AtomicBool,
    /// Sleeps begun so far, published for [`RuntimeHandle::sleeps`] (a plain
    /// store on the idle path, never touched by I/O).
    pub(crate) slept: AtomicU64,
    pub(crate) stop: AtomicBool,
    eventfd: OwnedFd,
    pub(crate) core: usize,
}

impl ReactorShared {
    pub(crate) fn eventfd(&self) -> RawFd {
        self.eventfd.as_raw_fd()
    }

    /// Whether the reactor sleeps (or is about to): pairs with the fence
    /// in `Reactor::sleep`, after the caller's store.
    fn asleep(&self) -> bool {
        fence(Ordering::SeqCst);
        self.sleeping.load(Ordering::SeqCst) != park::AWAKE
    }

    /// Wakes the reactor from a futex sleep, or writes its eventfd (which
    /// wakes a ring sleep, or makes the next one return at once).
    fn kick(&self) {
        fence(Ordering::SeqCst);
        if park::wake(&self.sleeping) {
            return;
        }
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64 to our own eventfd.
        unsafe { libc::write(self.eventfd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }
}

pub(crate) struct RuntimeShared {
    pub(crate) id: u16,
    pub(crate) reactors: Vec<Arc<ReactorShared>>,
    mode: String,
}

// Runtimes by id, for wakes that arrive from a foreign thread (rare path).
static RUNTIMES: Mutex<Vec<Weak<RuntimeShared>>> = Mutex::new(Vec::new());

pub(crate) fn wake_remote(rt: u16, reactor: usize, task: u32) {
    let shared = RUNTIMES
        .lock()
        .ok()
        .and_then(|v| v.get(rt as usize).and_then(|w| w.upgrade()));
    if let Some(s) = shared {
        let h = RuntimeHandle { shared: s };
        let _ = h.send(reactor, move || reactor::with(|r| r.exec.schedule(task)));
    }
}

/// A cheap, cloneable, `Send` handle to talk to the reactors.
#[derive(Clone)]
pub struct RuntimeHandle {
    shared: Arc<RuntimeShared>,
}

impl RuntimeHandle {
    pub fn num_reactors(&self) -> usize {
        self.shared.reactors.len()
    }

    /// The CPU core reactor `i` runs on.
    pub fn core_of(&self, i: usize) -> Option<usize> {
        self.shared.reactors.get(i).map(|r| r.core)
    }

    /// Runs `f` on reactor `reactor` (in its next loop pass).
    pub fn send(&self, reactor: usize, f: impl FnOnce() + Send + 'static) -> Result<(), SendError> {
        let r = self
            .shared
            .reactors
            .get(reactor)
            .ok_or(SendError::NoSuchReactor(reactor))?;
        if r.stop.load(Ordering::Acquire) {
            return Err(SendError::Stopped);
        }
        r.inbox
            .push(Box::new(f))
            .map_err(|_| SendError::Full(reactor))?;
        if r.asleep() {
            r.kick();
        }
        Ok(())
    }

    /// Starts the future `f()` makes as a task on `reactor`.
    pub fn spawn_on<F, Fut>(&self, reactor: usize, f: F) -> Result<(), SendError>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = ()> + 'static,
    {
        self.send(reactor, move || {
            crate::spawn(f());
        })
    }

    /// Runs `f` on `reactor` and waits for its result. For control-plane
    /// threads only: never call it from a reactor (it would block the loop).
    pub fn call<R: Send + 'static>(
        &self,
        reactor: usize,
        f: impl FnOnce() -> R + Send + 'static,
    ) -> Result<R, SendError> {
        assert!(
            !reactor::is_reactor_thread(),
            "RuntimeHandle::call blocks; use send from a reactor"
        );
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(reactor, move || {
            let _ = tx.send(f());
        })?;
        rx.recv().map_err(|_| SendError::Stopped)
    }

    /// Runs the future `f()` makes on `reactor` and waits for its output
    /// (control-plane threads and tests).
    pub fn block_on<R, F, Fut>(&self, reactor: usize, f: F) -> Result<R, SendError>
    where
        R: Send + 'static,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = R> + 'static,
    {
        assert!(
            !reactor::is_reactor_thread(),
            "RuntimeHandle::block_on blocks; spawn from a reactor"
        );
        let (tx, rx) = mpsc::sync_channel(1);
        self.spawn_on(reactor, move || async move {
            let _ = tx.send(f().await);
        })?;
        rx.recv().map_err(|_| SendError::Stopped)
    }

    /// Calls `f` on every reactor in turn (0, 1, ...), then `done` — on the
    /// reactor that asked if called from one, else on the last reactor.
    pub fn for_each_reactor(
        &self,
        f: Arc<dyn Fn() + Send + Sync>,
        done: impl FnOnce() + Send + 'static,
    ) -> Result<(), SendError> {
        let origin = reactor::try_with(|r| r.id);
        self.chain(0, f, Box::new(done), origin)
    }

    fn chain(
        &self,
        i: usize,
        f: Arc<dyn Fn() + Send + Sync>,
        done: Msg,
        origin: Option<usize>,
    ) -> Result<(), SendError> {
        let h = self.clone();
        self.send(i, move || {
            f();
            if i + 1 < h.num_reactors() {
                if let Err(e) = h.chain(i + 1, f, done, origin) {
                    tracing::error!("for_each_reactor stopped at reactor {}: {e}", i + 1);
                }
            } else {
                match origin {
                    Some(o) if o != i => {
                        if let Err(e) = h.send(o, done) {
                            tracing::error!("for_each_reactor completion lost: {e}");
                        }
                    }
                    _ => done(),
                }
            }
        })
    }

    /// Blocking `for_each_reactor` for control-plane threads: runs `f` on
    /// every reactor and returns the results in reactor order.
    pub fn call_all<R: Send + 'static>(
        &self,
        f: impl Fn(usize) -> R + Send + Sync + 'static,
    ) -> Result<Vec<R>, SendError> {
        let f = Arc::new(f);
        let mut out = Vec::with_capacity(self.num_reactors());
        for i in 0..self.num_reactors() {
            let f = f.clone();
            out.push(self.call(i, move || f(i))?);
        }
        Ok(out)
    }

    /// How many times `reactor` has gone to sleep (begun an idle wait), read
    /// without a message: it neither wakes the reactor nor allocates, so a
    /// test can watch it inside an allocation-counting window. Two more
    /// sleeps than at some instant T mean the reactor has since made a whole
    /// pass with nothing left to do (everything pending at T processed); an
    /// idle reactor sleeps until woken, so the observer [`wake`]s it.
    /// Stays 0 in `PollMode::Poll`, where reactors never sleep.
    ///
    /// [`wake`]: RuntimeHandle::wake
    pub fn sleeps(&self, reactor: usize) -> Option<u64> {
        let r = self.shared.reactors.get(reactor)?;
        Some(r.slept.load(Ordering::Acquire))
    }

    /// Wakes `reactor` if it sleeps, with no message (an eventfd write, no
    /// allocation): it makes one pass and, idle, sleeps again.
    pub fn wake(&self, reactor: usize) {
        if let Some(r) = self.shared.reactors.get(reactor) {
            if r.asleep() {
                r.kick();
            }
        }
    }

    /// Wakes `reactor` now, or, when it is awake, makes its next sleep
    /// return at once (the eventfd write waits in its ring): for a flag a
    /// poller of that reactor looks at, set from another thread without a
    /// message (one that could not be sent). Unlike [`Self::wake`] it
    /// cannot miss a reactor about to sleep; it costs a spurious wake
    /// when the reactor was awake.
    pub fn notify(&self, reactor: usize) {
        if let Some(r) = self.shared.reactors.get(reactor) {
            r.notified.store(true, Ordering::SeqCst);
            r.kick();
        }
    }

    /// Counters of every reactor.
    pub fn stats(&self) -> Result<Vec<ReactorStats>, SendError> {
        let mode = self.shared.mode.clone();
        self.call_all(move |i| {
            reactor::with(|r| ReactorStats {
                reactor: i,
                core: r.shared.core,
                loops: r.stats.loops.get(),
                busy_ns: ticks::to_ns(r.stats.busy_ticks.get()),
                idle_ns: ticks::to_ns(r.stats.idle_ticks.get()),
                messages: r.stats.messages.get(),
                sleeps: r.stats.sleeps.get(),
                wakeups: r.stats.wakeups.get(),
                sleeps_contended: r.stats.contended.get(),
                sleeps_batched: r.stats.batched.get(),
                naps: r.nap.borrow().naps,
                naps_early: r.nap.borrow().early,
                tasks: r.exec.task_count(),
                tasks_polled: r.exec.polled(),
                submits: r.ring.submits.get(),
                completions: r.ring.cqes.get(),
                ops_in_flight: r.ring.inflight(),
                timers: r.timers.entries(),
                pollers: r
                    .pollers
                    .names()
                    .into_iter()
                    .map(|(n, t)| (n.to_string(), t))
                    .collect(),
                poll_mode: mode.clone(),
            })
        })
    }
}

/// The running reactors. Dropping it stops and joins them.
pub struct Runtime {
    handle: RuntimeHandle,
    threads: Vec<ThreadHandle<()>>,
}

impl Runtime {
    /// Starts one reactor thread per configured core and waits until every
    /// reactor has built its ring and buffer pool.
    pub fn start(cfg: RuntimeConfig) -> std::io::Result<Runtime> {
        let _ = ticks::hz();
        let mut reactors = Vec::with_capacity(cfg.cores.len());
        for &core in &cfg.cores {
            // SAFETY: plain eventfd(2); result checked.
            let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            reactors.push(Arc::new(ReactorShared {
                inbox: ArrayQueue::new(cfg.inbox_capacity.max(16)),
                sleeping: AtomicU32::new(park::AWAKE),
                notified: AtomicBool::new(false),
                slept: AtomicU64::new(0),
                stop: AtomicBool::new(false),
                // SAFETY: fd was just created and is owned by nobody else.
                eventfd: unsafe { OwnedFd::from_raw_fd(fd) },
                core,
            }));
        }
        let shared = {
            let mut reg = RUNTIMES
                .lock()
                .map_err(|_| std::io::Error::other("runtime registry poisoned"))?;
            let id = reg
                .iter()
                .position(|w| w.strong_count() == 0)
                .unwrap_or(reg.len());
            let s = Arc::new(RuntimeShared {
                id: id as u16,
                reactors,
                mode: cfg.poll_mode.to_string(),
            });
            if id == reg.len() {
                reg.push(Arc::downgrade(&s));
            } else {
                reg[id] = Arc::downgrade(&s);
            }
            s
        };
        let (ready_tx, ready_rx) = mpsc::channel::<(usize, std::io::Result<()>)>();
        let mut threads = Vec::new();
        for i in 0..cfg.cores.len() {
            let cfg = cfg.clone();
            let rs = shared.reactors[i].clone();
            let rt = shared.clone();
            let tx = ready_tx.clone();
            let t = std::thread::Builder::new()
                .name(format!("reactor_{i}"))
                .spawn(move || {
                    if cfg.pin {
                        pin_to_core(rs.core);
                    }
                    match Reactor::new(i, &cfg, rs, rt) {
                        Ok(r) => {
                            let _ = tx.send((i, Ok(())));
                            r.run();
                        }
                        Err(e) => {
                            let _ = tx.send((i, Err(e)));
                        }
                    }
                })?;
            threads.push(t);
        }
        drop(ready_tx);
        let mut rt = Runtime {
            handle: RuntimeHandle { shared },
            threads,
        };
        for _ in 0..cfg.cores.len() {
            match ready_rx.recv() {
                Ok((_, Ok(()))) => {}
                Ok((i, Err(e))) => {
                    rt.stop();
                    return Err(std::io::Error::new(e.kind(), format!("reactor {i}: {e}")));
                }
                Err(_) => {
                    rt.stop();
                    return Err(std::io::Error::other(
                        "a reactor thread died while starting",
                    ));
                }
            }
        }
        Ok(rt)
    }

    pub fn handle(&self) -> RuntimeHandle {
        self.handle.clone()
    }

    /// Stops every reactor after its current pass and joins the threads.
    pub fn stop(&mut self) {
        for r in &self.handle.shared.reactors {
            r.stop.store(true, Ordering::Release);
            r.kick();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }

    /// Thread ids of the reactor threads (for /proc/self/task/<tid>/stat).
    pub fn thread_ids(&self) -> Vec<i32> {
        self.handle
            .call_all(|_| {
                // SAFETY: gettid has no arguments and cannot fail.
                unsafe { libc::gettid() }
            })
            .unwrap_or_default()
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.stop();
    }
}

fn pin_to_core(core: usize) {
    // SAFETY: cpu_set_t is a plain bitmask; all-zero is valid; CPU_SET bounds
    // are checked by the libc macro implementation.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(core, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            tracing::warn!(
                "could not pin reactor to core {core}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}
