//! One virtqueue served on one reactor: the task that takes available
//! chains and runs them on the bdev with buffers pointing into guest
//! memory (no copy). A chain taken while the task's inline slot
//! ([`crate::inline`]) is free runs there at once, so a bdev that
//! completes inline (null, malloc) answers it in the pass that took it;
//! one that has to wait keeps the slot, and the chains taken meanwhile go
//! to the workers ([`crate::workers`]), one of which runs every request
//! queued while it is awake. Once warm the path allocates nothing:
//! workers, segment lists, job slots and buffer lists are reused, and a
//! worker's memory map is reference-counted only when it changes (the
//! `alloc_free` test holds it to that).
//!
//! Adaptive polling: while requests keep coming the task re-polls the
//! avail index every reactor pass (notifications off, so the driver makes
//! no kick syscall), once a pass, and after a deep batch not before a
//! short hold; where taking a request is dear a pass takes its whole
//! batch before running it ([`crate::pace`] decides both); after
//! `poll_window` with nothing new it turns notifications back on
//! (EVENT_IDX: avail_event), checks once more, and
//! parks on the kick eventfd through the reactor's ring. An idle queue
//! costs no CPU. Stopping (GET_VRING_BASE, disconnect) sets a flag and
//! writes the kick eventfd; the task waits for its requests in flight and
//! reports the ring indices back.
//!
//! Notifications are batched: a worker writes its used entry, visible to
//! the driver at once ([`Virtq::push_used`]), and the queue task, which
//! runs again right after the worker it woke (the executor is FIFO and
//! the task yields every pass while busy), makes one notification
//! decision (a full fence and a read of the driver's field) and sends at
//! most one call signal for the batch, not one of each per request. While
//! the task sleeps on its kick or drains, nothing would decide later, so
//! completions decide at once.

use std::cell::{Cell, RefCell};
use std::fs::File;
use std::future::{poll_fn, Future};
use std::os::fd::AsRawFd;
use std::pin::{pin, Pin};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use ustor_bdev::{BdevError, IoChannel, RwNow, RwWait};
use ustor_runtime::{ticks, IoBuf, WorkQueue};
use vm_memory::{GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};

use crate::blk::{self, status, Kind, Request, Seg};
use crate::coalesce::Coalescer;
use crate::device::{BlkDevice, QueueStats};
use crate::eventfd::{drain_eventfd, set_nonblocking, CallFd};
use crate::guest::GuestMem;
use crate::inflight::ring::{self, Resubmit, Track};
use crate::inline;
use crate::pace::Pace;
use crate::packed;
use crate::start::VringStart;
use crate::virtq::Virtq;
use crate::workers::WorkerMem;

/// A request taken from the ring, waiting for a worker.
struct Job {
    head: u16,
    req: Request,
}

/// Per-queue state shared by the queue task and its workers (one reactor).
struct Vring {
    index: usize,
    queue: RefCell<Virtq>,
    ch: IoChannel,
    dev: Arc<BlkDevice>,
    call: Arc<CallFd>,
    /// Requests taken and not yet returned used (queued or running).
    inflight: Cell<u32>,
    /// Reused segment lists, one per request in flight.
    seg_pool: RefCell<Vec<Vec<Seg>>>,
    jobs: WorkQueue<Job>,
    /// The memory map requests use, and a generation bumped when the
    /// frontend changes it (workers keep the map they last used until
    /// they see a new generation: no reference count touched per I/O).
    /// An `Rc`: the queue task, its workers and its inline request all
    /// run on this reactor, so the inline slot's clone per request is a
    /// plain increment, not two atomic read-modify-writes.
    mem: RefCell<Rc<GuestMem>>,
    mem_gen: Cell<u64>,
    /// The frontend's map generation last looked at (`u64::MAX`: never).
    map_seen: Cell<u64>,
    map_gen: Arc<AtomicU64>,
    coal: RefCell<Coalescer>,
    /// When the next look at the available index may be, and in which
    /// order a pass runs what it took ([`crate::pace`]).
    pace: Pace,
    /// Jobs a take-all pass runs after its take.
    later: RefCell<Vec<Job>>,
    /// Set while a take-all pass that read ahead runs its batch: the used
    /// entries go in without the index, which the pass's publish stores.
    defer_idx: Cell<bool>,
    /// The queue task sleeps on the kick eventfd (or drains): completions
    /// decide and signal at once (nothing would decide later).
    parked: Cell<bool>,
    /// Used entries pushed since the last notification decision.
    unpublished: Cell<u32>,
    broken: Cell<bool>,
    /// Inflight tracking and the order counter of takes (split).
    track: Option<Track>,
    counter: Cell<u64>,
    /// Requests to resubmit first (taken by a backend that was killed).
    resubmit: RefCell<Resubmit>,
    desc_table: u64,
    /// Where a taken chain's descriptors are copied: kept here, not on
    /// the queue task's stack, so a pass does not zero ~2 KiB of it.
    descs: RefCell<Box<blk::ChainBuf>>,
    /// The inline slot's scratch space (taken by its request while it runs).
    inline_scratch: RefCell<Scratch>,
}

impl Vring {
    fn stats(&self) -> &QueueStats {
        &self.dev.queue_stats[self.index]
    }
}

/// The queue task: spawned on the queue's reactor by the controller.
pub async fn run(s: VringStart) {
    let done = s.done.clone();
    let stop = s.stop.clone();
    let kick = s.kick.clone();
    let mem_atomic = s.mem.clone();
    let v = match setup(s) {
        Ok(v) => Rc::new(v),
        Err(e) => {
            tracing::warn!("vhost: queue not started: {e}");
            // Wait to be stopped so the control side gets its answer.
            while !stop.load(Ordering::Acquire) {
                let _ = ustor_runtime::ops::poll_ready(kick.as_raw_fd(), libc::POLLIN as u32).await;
                drain_eventfd(&kick);
            }
            let _ = done.send((0, 0));
            return;
        }
    };
    let packed = v.queue.borrow().is_packed();
    v.stats().packed.store(packed, Ordering::Relaxed);
    v.stats().running.store(true, Ordering::Relaxed);
    resubmit(&v);
    let poll_window = ticks::from_duration(v.dev.poll_window);
    let mut last_work = ustor_runtime::pass_ticks();
    // One request runs in the task itself (crate::inline): polled first
    // in each pass and while parked, so one that waits moves on when its
    // I/O wakes the task.
    let mut slot = pin!(None);
    while !stop.load(Ordering::Acquire) {
        let (n, now) = poll_fn(|cx| {
            inline::drive(slot.as_mut(), cx);
            let mut run_inline = |job: Job| {
                if slot.is_some() {
                    return Some(job);
                }
                QueueStats::bump(&v.stats().inline);
                let start = {
                    let mem = v.mem.borrow();
                    match run_now(&v, &mem, job) {
                        None => return None,
                        Some(start) => start,
                    }
                };
                let mem = v.mem.borrow().clone();
                inline::start(slot.as_mut(), execute_inline(v.clone(), mem, start), cx);
                None
            };
            Poll::Ready(pass(&v, &mem_atomic, &mut run_inline))
        })
        .await;
        if n > 0 {
            last_work = now;
            ustor_runtime::yield_now().await;
            continue;
        }
        // A held-back signal keeps the queue polling until it is due
        // (a sleeping queue could not send it).
        if now.saturating_sub(last_work) < poll_window || v.coal.borrow().pending() {
            ustor_runtime::yield_now().await;
            continue;
        }
        // Going to sleep: ask for kicks, then look once more (a chain
        // made available between the last look and the re-enable would
        // otherwise wait for the next kick).
        let more = {
            let mem = v.mem.borrow();
            v.queue.borrow_mut().enable_notification(&mem)
        };
        if !more {
            park(&v, &kick, slot.as_mut()).await;
        }
        refresh_mem(&v, &mem_atomic);
        let mem = v.mem.borrow();
        v.queue.borrow_mut().disable_notification(&mem);
        last_work = ticks::now();
    }
    drain(&v, slot.as_mut()).await;
    if v.coal.borrow_mut().flush(ticks::now()) {
        signal_call(&v);
    }
    v.jobs.close();
    v.stats().running.store(false, Ordering::Relaxed);
    let _ = done.send(v.queue.borrow().indices());
}

/// Sleeps on the kick eventfd until the driver kicks; a request in the
/// inline slot goes on meanwhile (its I/O wakes this task).
async fn park<F: Future<Output = ()>>(v: &Vring, kick: &File, mut slot: Pin<&mut Option<F>>) {
    // Completions from here on publish at once.
    publish(v, &v.mem.borrow(), ticks::now());
    v.parked.set(true);
    let mut woken = pin!(ustor_runtime::ops::poll_ready(
        kick.as_raw_fd(),
        libc::POLLIN as u32
    ));
    let _ = poll_fn(|cx| {
        inline::drive(slot.as_mut(), cx);
        woken.as_mut().poll(cx)
    })
    .await;
    v.parked.set(false);
    drain_eventfd(kick);
    QueueStats::bump(&v.stats().kicks);
}

/// Waits until every request taken has been returned used (the indices
/// are reported only then, so a restarted ring repeats nothing).
async fn drain<F: Future<Output = ()>>(v: &Vring, mut slot: Pin<&mut Option<F>>) {
    publish(v, &v.mem.borrow(), ticks::now());
    v.parked.set(true);
    loop {
        poll_fn(|cx| Poll::Ready(inline::drive(slot.as_mut(), cx))).await;
        if v.inflight.get() == 0 {
            break;
        }
        ustor_runtime::sleep(Duration::from_micros(100)).await;
    }
}

fn setup(mut s: VringStart) -> Result<Vring, String> {
    let ch = s.dev.desc.channel().map_err(|e| e.to_string())?;
    if s.index as usize >= s.dev.queue_stats.len() {
        return Err(format!("queue {}: beyond num_queues", s.index));
    }
    let (mut q, mem, used) = Virtq::open(&s)?;
    let inflight = s.inflight.take();
    let rec = ring::recover(s.index, s.desc, inflight, &mut q, mem.map(), used);
    set_nonblocking(&s.kick);
    let depth = s.size as usize;
    Ok(Vring {
        index: s.index as usize,
        queue: RefCell::new(q),
        ch,
        dev: s.dev,
        call: s.call,
        inflight: Cell::new(0),
        // A list for every request the ring can hold: a pass that takes
        // its whole batch first (crate::pace) holds that many at once,
        // and a list made on demand would allocate mid-run.
        seg_pool: RefCell::new((0..depth).map(|_| Vec::with_capacity(4)).collect()),
        jobs: WorkQueue::new(depth),
        mem: RefCell::new(mem),
        mem_gen: Cell::new(0),
        map_seen: Cell::new(u64::MAX),
        map_gen: s.mem_gen,
        coal: RefCell::new(Coalescer::new(ticks::hz(), ustor_runtime::pass_ticks())),
        pace: Pace::default(),
        later: RefCell::new(Vec::with_capacity(depth)),
        defer_idx: Cell::new(false),
        parked: Cell::new(false),
        unpublished: Cell::new(0),
        broken: Cell::new(false),
        track: rec.track,
        counter: Cell::new(rec.counter),
        resubmit: RefCell::new(rec.again),
        desc_table: s.desc,
        descs: RefCell::new(Box::new(blk::chain_buf())),
        inline_scratch: RefCell::new(Scratch::new()),
    })
}

/// One busy pass of the queue task: (chains taken, the pass's clock).
/// `run_inline` runs a request in the inline slot, or hands it back when
/// the slot is taken.
fn pass(
    v: &Rc<Vring>,
    mem_atomic: &GuestMemoryAtomic<GuestMemoryMmap>,
    run_inline: &mut dyn FnMut(Job) -> Option<Job>,
) -> (usize, u64) {
    refresh_mem(v, mem_atomic);
    // The reactor's clock of this pass, not the TSC: the poll window
    // and the coalescing intervals are microseconds or more, and a
    // TSC read costs tens of ns here (one per pass saved).
    let now = ustor_runtime::pass_ticks();
    publish(v, &v.mem.borrow(), now);
    if !v.pace.may_look() {
        coalesce_tick(v, now);
        return (0, now);
    }
    let n = take_available(v, run_inline);
    v.pace.taken(n);
    // What ran inline is decided on now, not a pass later.
    publish(v, &v.mem.borrow(), now);
    coalesce_tick(v, now);
    (n, now)
}

/// Picks up a memory map the frontend changed (ADD_MEM_REG, REM_MEM_REG);
/// idle workers are woken so they drop the old one.
fn refresh_mem(v: &Vring, atomic: &GuestMemoryAtomic<GuestMemoryMmap>) {
    // Acquire: a generation seen moved means the new map is what
    // `memory()` returns (the control side bumps it after the swap).
    let gen = v.map_gen.load(Ordering::Acquire);
    if gen == v.map_seen.replace(gen) {
        return;
    }
    let g = atomic.memory();
    if v.mem.borrow().is(&g) {
        return;
    }
    *v.mem.borrow_mut() = Rc::new(GuestMem::new(g.into_inner()));
    v.mem_gen.set(v.mem_gen.get() + 1);
    v.jobs.wake_all();
}

/// Once per pass: the rate check and a held-back signal that is due.
fn coalesce_tick(v: &Vring, now: u64) {
    let mut c = v.coal.borrow_mut();
    c.check(now, v.dev.coalescing());
    if c.due(now) {
        drop(c);
        signal_call(v);
    }
}

/// Takes the chains available when the pass first looks (the index is
/// read once a pass, [`Virtq::pop_in_pass`]; at most a ring's worth, a
/// budget so one queue cannot hold the reactor) and starts each
/// (`run_inline`: see [`start_request`]).
fn take_available(v: &Rc<Vring>, run_inline: &mut dyn FnMut(Job) -> Option<Job>) -> usize {
    if v.broken.get() {
        return 0;
    }
    let mem = v.mem.borrow();
    let mut descs = v.descs.borrow_mut();
    let mut n = 0;
    let budget = v.queue.borrow().size() as usize;
    let mut looked = false;
    let t0 = v.pace.sample_start();
    // Taking all first: the jobs wait in a list kept with the ring's depth.
    let mut later = v
        .pace
        .take_all()
        .then(|| std::mem::take(&mut *v.later.borrow_mut()));
    let ahead = v.pace.read_ahead();
    if ahead {
        v.queue.borrow_mut().look_ahead(&mem, &mut looked);
    }
    while n < budget {
        let Some(t) = v
            .queue
            .borrow_mut()
            .pop_in_pass(&mem, &mut descs[..], &mut looked)
        else {
            break;
        };
        n += 1;
        if let Some(tr) = &v.track {
            tr.taken(&v.queue.borrow(), mem.map(), t.head, &v.counter);
        }
        let descs = &descs[..t.descs];
        match &mut later {
            Some(l) => start_request(v, &mem, t.head, descs, &mut |job| {
                l.push(job);
                None
            }),
            None => start_request(v, &mem, t.head, descs, run_inline),
        }
    }
    if let Some(mut l) = later {
        // The index once, at the pass's publish; not with inflight
        // tracking, whose record of each entry follows the index store.
        v.defer_idx.set(ahead && v.track.is_none());
        for job in l.drain(..) {
            if let Some(job) = run_inline(job) {
                v.jobs.push(job, |id| spawn_worker(v, id));
            }
        }
        *v.later.borrow_mut() = l;
        v.defer_idx.set(false);
    }
    if ahead {
        QueueStats::add(&v.stats().read_ahead, n as u64);
    }
    v.pace.sample_end(t0, n);
    v.coal.borrow_mut().taken(n as u64);
    n
}

/// Requests a killed backend had taken: run again before any new one.
fn resubmit(v: &Rc<Vring>) {
    let again = std::mem::replace(&mut *v.resubmit.borrow_mut(), Resubmit::Split(Vec::new()));
    let mem = v.mem.borrow();
    let size = v.queue.borrow().size();
    let mut descs = blk::chain_buf();
    match again {
        Resubmit::Split(heads) => {
            QueueStats::add(&v.stats().resubmitted, heads.len() as u64);
            for head in heads {
                let table = GuestAddress(v.desc_table);
                let k = blk::read_chain(&mem, table, size, head, &mut descs);
                start_request(v, &mem, head, &descs[..k], &mut Some);
            }
        }
        Resubmit::Packed(chains) => {
            QueueStats::add(&v.stats().resubmitted, chains.len() as u64);
            for c in chains {
                let k = packed::chain_descs(mem.map(), &c.descs, &mut descs);
                start_request(v, &mem, c.id, &descs[..k], &mut Some);
            }
        }
    }
}

/// Validates one chain and runs it: through `run_inline` (which hands it
/// back when it cannot take it), else on a worker; or answers it at once.
fn start_request(
    v: &Rc<Vring>,
    mem: &GuestMem,
    head: u16,
    descs: &[blk::Desc],
    run_inline: &mut dyn FnMut(Job) -> Option<Job>,
) {
    {
        let segs = v.seg_pool.borrow_mut().pop().unwrap_or_default();
        QueueStats::bump(&v.stats().requests);
        match blk::parse_chain(descs, mem, segs) {
            Ok(req) => {
                v.inflight.set(v.inflight.get() + 1);
                if let Some(job) = run_inline(Job { head, req }) {
                    v.jobs.push(job, |id| spawn_worker(v, id));
                }
            }
            Err((e, segs)) => {
                v.seg_pool.borrow_mut().push(segs);
                QueueStats::bump(&v.stats().errors);
                tracing::debug!("vhost-blk: queue request {head}: {e}");
                if let Some(at) = e.status_addr() {
                    write_status(mem, at, status::IOERR);
                    complete(v, mem, head, 1);
                } else {
                    complete(v, mem, head, 0);
                }
            }
        }
    }
}

/// Scratch space a worker reuses for every request.
struct Scratch {
    bufs: Vec<IoBuf>,
    ranges: Vec<blk::Range>,
}

impl Scratch {
    fn new() -> Scratch {
        Scratch {
            bufs: Vec::with_capacity(blk::SEG_MAX),
            ranges: Vec::with_capacity(blk::MAX_RANGES as usize),
        }
    }
}

fn spawn_worker(v: &Rc<Vring>, id: usize) {
    ustor_runtime::spawn(worker(v.clone(), id));
}

/// One worker: takes jobs until the queue stops.
async fn worker(v: Rc<Vring>, id: usize) {
    let mut mem = WorkerMem::default();
    let mut scratch = Scratch::new();
    // Budget: one round per job; ends when the queue is closed.
    while let Some(job) = mem.next(&v.jobs, id, || v.mem_gen.get()).await {
        let m = mem.get(v.mem_gen.get(), &v.mem);
        let run = pin!(execute(&v, m, job, &mut scratch));
        v.jobs.run(id, run, |i| spawn_worker(&v, i)).await;
    }
}

/// How a request enters the inline slot.
enum InlineStart {
    /// Not started: run it from the top.
    Fresh(Job),
    /// A read or write [`run_now`] started that did not complete at once.
    Started(Job, RwWait),
}

/// Runs a plain read or write on the spot, with no future, when the
/// bdev completes it at once (null, malloc): the common case of the
/// inline slot, which then costs no slot future, no scratch swap and no
/// map clone. `None` when the request is done (returned used); else how
/// the slot goes on with it (any other request, or an I/O that waits).
#[inline]
fn run_now(v: &Vring, mem: &GuestMem, job: Job) -> Option<InlineStart> {
    let req = &job.req;
    let write = req.kind == Kind::Write;
    let dev = &v.dev;
    // A write-through device flushes after each write, and every error
    // is the async path's to report.
    let plain = match req.kind {
        Kind::Read => true,
        Kind::Write => !dev.read_only && dev.writeback.load(Ordering::Relaxed),
        _ => false,
    };
    if !plain || req.segs.len() != 1 || dev.removed() {
        return Some(InlineStart::Fresh(job));
    }
    let Some((off, blocks)) = dev.blocks(req.sector, req.data_len as u64) else {
        return Some(InlineStart::Fresh(job));
    };
    let Some(buf) = mem.io_buf(req.segs[0].addr, req.segs[0].len) else {
        return Some(InlineStart::Fresh(job));
    };
    // The reactor's latest clock reading stamps the I/O: no TSC read.
    match v.ch.rw_now(write, v.ch.recent_tick(), off, blocks, buf) {
        RwNow::Done(r, _buf) => {
            let written = if write { 0 } else { req.data_len };
            finish(v, mem, job, bdev_status(r), written);
            None
        }
        RwNow::Waiting(w) => Some(InlineStart::Started(job, w)),
        RwNow::Declined(_buf) => Some(InlineStart::Fresh(job)),
    }
}

/// A request in the queue task's inline slot: it owns what it uses (the
/// slot lives across passes, and the map may change meanwhile); the
/// scratch space is the queue's, taken for the request's duration.
async fn execute_inline(v: Rc<Vring>, mem: Rc<GuestMem>, start: InlineStart) {
    let job = match start {
        InlineStart::Fresh(job) => job,
        InlineStart::Started(job, w) => {
            // The buffer points into the map `mem` keeps alive.
            let (r, _buf) = w.await;
            let written = if job.req.kind == Kind::Write {
                0
            } else {
                job.req.data_len
            };
            return finish(&v, &mem, job, bdev_status(r), written);
        }
    };
    let mut scratch = std::mem::replace(
        &mut *v.inline_scratch.borrow_mut(),
        Scratch {
            bufs: Vec::new(),
            ranges: Vec::new(),
        },
    );
    execute(&v, &mem, job, &mut scratch).await;
    *v.inline_scratch.borrow_mut() = scratch;
}

/// Runs one request and returns it used.
async fn execute(v: &Vring, mem: &GuestMem, job: Job, scratch: &mut Scratch) {
    let (st, written) = run_request(v, mem, &job.req, scratch).await;
    finish(v, mem, job, st, written);
}

/// Writes a finished request's status and returns it used (`written`:
/// bytes the device wrote into its data segments).
fn finish(v: &Vring, mem: &GuestMem, mut job: Job, st: u8, written: u32) {
    let len = if write_status(mem, job.req.status, st) {
        written + 1
    } else {
        0
    };
    if st != status::OK {
        QueueStats::bump(&v.stats().errors);
    }
    v.seg_pool
        .borrow_mut()
        .push(std::mem::take(&mut job.req.segs));
    v.inflight.set(v.inflight.get() - 1);
    complete(v, mem, job.head, len);
}

/// Writes a request's status byte; false if it is not guest memory.
fn write_status(mem: &GuestMem, at: GuestAddress, st: u8) -> bool {
    mem.range(at, 1).is_some_and(|r| r.store_u8(0, st))
}

/// Adds `head` to the used ring; the notification decision comes with the
/// queue task's next pass, or now when the task is not polling.
fn complete(v: &Vring, mem: &GuestMem, head: u16, len: u32) {
    QueueStats::bump(&v.stats().completed);
    let mut q = v.queue.borrow_mut();
    if let Some(t) = &v.track {
        t.before_used(&q, head);
    }
    let pushed = if v.defer_idx.get() {
        q.push_used_entry(mem, head, len)
    } else {
        q.push_used(mem, head, len)
    };
    if !pushed {
        // The used ring is not writable: the driver broke the device.
        v.broken.set(true);
        return;
    }
    if let Some(t) = &v.track {
        t.after_used(&q, head);
    }
    drop(q);
    v.unpublished.set(v.unpublished.get() + 1);
    if v.parked.get() {
        publish(v, mem, ustor_runtime::pass_ticks());
    }
}

/// One notification decision for the entries pushed since the last:
/// signals the driver if it asked (now, or later when coalescing holds
/// the signal back).
fn publish(v: &Vring, mem: &GuestMem, now: u64) {
    if v.unpublished.replace(0) == 0 {
        return;
    }
    if !v.queue.borrow_mut().publish(mem) {
        return;
    }
    let now_ok = v.parked.get() || v.coal.borrow_mut().used(now);
    if now_ok {
        signal_call(v);
    } else {
        QueueStats::bump(&v.stats().held);
    }
}

fn signal_call(v: &Vring) {
    if v.call.signal() {
        QueueStats::bump(&v.stats().signals);
    }
}

/// (status, bytes the device wrote into the data segments).
async fn run_request(v: &Vring, mem: &GuestMem, req: &Request, scratch: &mut Scratch) -> (u8, u32) {
    let dev = &v.dev;
    if dev.removed() && req.kind != Kind::GetId {
        return (status::IOERR, 0);
    }
    match req.kind {
        Kind::Read | Kind::Write => {
            let write = req.kind == Kind::Write;
            if write && dev.read_only {
                return (status::IOERR, 0);
            }
            let Some((off, blocks)) = dev.blocks(req.sector, req.data_len as u64) else {
                return (status::IOERR, 0);
            };
            let r = rw(&v.ch, mem, write, off, blocks, &req.segs, &mut scratch.bufs).await;
            let r = match r {
                Ok(()) if write && !dev.writeback.load(Ordering::Relaxed) => {
                    v.ch.flush(off, blocks).await
                }
                r => r,
            };
            (bdev_status(r), if write { 0 } else { req.data_len })
        }
        Kind::Flush => (bdev_status(v.ch.flush(0, dev.num_blocks()).await), 0),
        Kind::GetId => match blk::write_id(req, mem.map(), &dev.serial) {
            Ok(n) => (status::OK, n),
            Err(_) => (status::IOERR, 0),
        },
        Kind::Discard | Kind::WriteZeroes => (ranges(v, mem, req, &mut scratch.ranges).await, 0),
        Kind::Other(_) => (status::UNSUPP, 0),
    }
}

async fn ranges(v: &Vring, mem: &GuestMem, req: &Request, list: &mut Vec<blk::Range>) -> u8 {
    let dev = &v.dev;
    let discard = req.kind == Kind::Discard;
    if dev.read_only
        || (discard && !dev.geometry.discard)
        || (!discard && !dev.geometry.write_zeroes)
    {
        return if dev.read_only {
            status::IOERR
        } else {
            status::UNSUPP
        };
    }
    if blk::read_ranges(req, mem.map(), list).is_err() {
        return status::IOERR;
    }
    for r in list.iter() {
        let Some((off, blocks)) = dev.blocks(r.sector, r.num_sectors as u64 * blk::SECTOR_SIZE)
        else {
            return status::IOERR;
        };
        let res = if discard {
            v.ch.unmap(off, blocks).await
        } else {
            v.ch.write_zeroes(off, blocks).await
        };
        if res.is_err() {
            return bdev_status(res);
        }
    }
    status::OK
}

/// Reads or writes with buffers that point into guest memory; `bufs` is
/// the worker's reused list (handed to the bdev and back).
async fn rw(
    ch: &IoChannel,
    mem: &GuestMem,
    write: bool,
    off: u64,
    blocks: u64,
    segs: &[Seg],
    bufs: &mut Vec<IoBuf>,
) -> Result<(), BdevError> {
    if segs.len() == 1 {
        let buf = mem
            .io_buf(segs[0].addr, segs[0].len)
            .ok_or(BdevError::Io(libc::EFAULT))?;
        let (r, _buf) = if write {
            ch.write(off, blocks, buf).await
        } else {
            ch.read(off, blocks, buf).await
        };
        return r;
    }
    let mut list = std::mem::take(bufs);
    list.clear();
    for s in segs {
        match mem.io_buf(s.addr, s.len) {
            Some(b) => list.push(b),
            None => {
                list.clear();
                *bufs = list;
                return Err(BdevError::Io(libc::EFAULT));
            }
        }
    }
    let (r, mut list) = if write {
        ch.writev(off, blocks, list).await
    } else {
        ch.readv(off, blocks, list).await
    };
    list.clear();
    *bufs = list;
    r
}

fn bdev_status(r: Result<(), BdevError>) -> u8 {
    match r {
        Ok(()) => status::OK,
        Err(BdevError::NotSupported) => status::UNSUPP,
        Err(_) => status::IOERR,
    }
}
