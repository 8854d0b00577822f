//! The workload engine: `qd` queue slots per reactor, each a task that owns
//! one pool buffer and loops submit → await → record until the deadline.
//!
//! Nothing in the loop allocates or makes a syscall: offsets come from a
//! per-slot xorshift, timestamps from the TSC, latencies go into a
//! per-reactor [`LogHist`] (flat buckets of `Cell`s).

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use ustor_bdev::{BdevError, BdevInfo, Desc, IoChannel, IoType, Registry};
use ustor_runtime::{ticks, IoBuf, RuntimeHandle};

use crate::hist::LogHist;
use crate::report::{CoreResult, Report};
use crate::verify;

mod nodata;

/// Access pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    Read,
    Write,
    RandRead,
    RandWrite,
    RandRw,
    /// Flushes of `bs` each, in order (SYNCHRONIZE CACHE on a SCSI disk).
    Flush,
    /// Unmaps (deallocations) of `bs` each, in order (UNMAP, TRIM).
    Unmap,
}

impl std::str::FromStr for Pattern {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "read" => Pattern::Read,
            "write" => Pattern::Write,
            "randread" => Pattern::RandRead,
            "randwrite" => Pattern::RandWrite,
            "randrw" => Pattern::RandRw,
            "flush" => Pattern::Flush,
            "unmap" => Pattern::Unmap,
            _ => {
                return Err(format!(
                    "unknown workload `{s}` ({})",
                    "read, write, randread, randwrite, randrw, flush, unmap"
                ))
            }
        })
    }
}

impl Pattern {
    pub fn name(self) -> &'static str {
        match self {
            Pattern::Read => "read",
            Pattern::Write => "write",
            Pattern::RandRead => "randread",
            Pattern::RandWrite => "randwrite",
            Pattern::RandRw => "randrw",
            Pattern::Flush => "flush",
            Pattern::Unmap => "unmap",
        }
    }
    fn random(self) -> bool {
        matches!(
            self,
            Pattern::RandRead | Pattern::RandWrite | Pattern::RandRw
        )
    }
    fn writes(self) -> bool {
        !matches!(self, Pattern::Read | Pattern::RandRead)
    }
    fn reads(self) -> bool {
        matches!(self, Pattern::Read | Pattern::RandRead | Pattern::RandRw)
    }
    /// The bdev I/O type of a workload without data (see [`nodata`]).
    fn nodata(self) -> Option<IoType> {
        match self {
            Pattern::Flush => Some(IoType::Flush),
            Pattern::Unmap => Some(IoType::Unmap),
            _ => None,
        }
    }
}

/// One benchmark run.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    pub bdev: String,
    pub pattern: Pattern,
    /// Percent of reads for `randrw`.
    pub rwmixread: u32,
    pub bs: usize,
    /// Queue depth per reactor.
    pub qd: usize,
    pub time: Duration,
    pub verify: bool,
    pub seed: u64,
}

/// Why a benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("no bdev named `{0}`")]
    NoBdev(String),
    #[error("--bs {bs} is not a multiple of the block size {block_size}")]
    BadIoSize { bs: usize, block_size: usize },
    #[error("--qd must be > 0")]
    ZeroQueueDepth,
    #[error("bdev `{bdev}` has {units} units of {bs} bytes: too small for {slots} queue slots")]
    TooSmall {
        bdev: String,
        units: u64,
        bs: usize,
        slots: u64,
    },
    /// Opening the bdev failed (errno kept in the control error).
    #[error(transparent)]
    Open(#[from] ustor_bdev::ControlError),
    /// A reactor could not be reached.
    #[error(transparent)]
    Runtime(#[from] ustor_runtime::SendError),
    #[error("reactors stopped during the run")]
    Stopped,
    #[error("bdev `{bdev}` does not support {what}")]
    Unsupported { bdev: String, what: &'static str },
    /// `--verify` of an unmap workload reads the blocks back as zeroes,
    /// which only a bdev that promises it can be held to.
    #[error("bdev `{0}` does not promise that unmapped blocks read as zeroes: --verify has nothing to check an unmap against")]
    UnmapNotZeroing(String),
}

/// Per-reactor counters, shared by that reactor's slots.
struct CoreState {
    ios: Cell<u64>,
    reads: Cell<u64>,
    errors: Cell<u64>,
    verify_errors: Cell<u64>,
    first_mismatch: RefCell<Option<String>>,
    lat_sum: Cell<u64>,
    hist: LogHist,
    cursor: Cell<u64>,
    ready: Cell<usize>,
    start: Cell<u64>,
    deadline: Cell<u64>,
}

thread_local! {
    static CORE: RefCell<Option<Rc<CoreState>>> = const { RefCell::new(None) };
}

impl CoreState {
    fn new() -> CoreState {
        CoreState {
            ios: Cell::new(0),
            reads: Cell::new(0),
            errors: Cell::new(0),
            verify_errors: Cell::new(0),
            first_mismatch: RefCell::new(None),
            lat_sum: Cell::new(0),
            hist: LogHist::new(),
            cursor: Cell::new(0),
            ready: Cell::new(0),
            start: Cell::new(0),
            deadline: Cell::new(0),
        }
    }

    /// Counts a slot ready, waits for the common start instant from the
    /// control thread and returns the deadline.
    async fn wait_start(&self) -> u64 {
        self.ready.set(self.ready.get() + 1);
        while self.start.get() == 0 {
            ustor_runtime::sleep(Duration::from_micros(100)).await;
        }
        ustor_runtime::sleep_until(self.start.get()).await;
        self.deadline.get()
    }

    /// The next unit of the reactor's shared in-order walk over `units`.
    #[inline]
    fn next_in_order(&self, units: u64) -> u64 {
        let c = self.cursor.get();
        self.cursor.set((c + 1) % units);
        c
    }

    /// Records an I/O that reached the device (`ok`) or failed, and
    /// returns the time to stamp the next one with. The bdev layer timed
    /// a successful I/O already: its timestamps are reused rather than the
    /// TSC read again (two reads per I/O cost more than a null bdev's
    /// whole I/O path on a VM). A failed one was not timed.
    #[inline]
    fn completed(&self, ch: &IoChannel, ok: bool, read: bool) -> u64 {
        let (now, lat) = if ok {
            ch.last_completion()
        } else {
            (ticks::now(), 0)
        };
        self.record(lat, ok, read);
        now
    }

    /// Counts a block that did not hold what was written; the first one
    /// is kept for the report.
    fn mismatch(&self, lba: u64, what: impl std::fmt::Display) {
        self.verify_errors.set(self.verify_errors.get() + 1);
        let mut first = self.first_mismatch.borrow_mut();
        if first.is_none() {
            *first = Some(format!("LBA {lba}: {what}"));
        }
    }

    #[inline]
    fn record(&self, dt: u64, ok: bool, read: bool) {
        if !ok {
            self.errors.set(self.errors.get() + 1);
            return;
        }
        self.ios.set(self.ios.get() + 1);
        if read {
            self.reads.set(self.reads.get() + 1);
        }
        self.lat_sum.set(self.lat_sum.get() + dt);
        self.hist.record(dt);
    }
}

/// What one queue slot covers, in I/O units of `bs`.
#[derive(Clone, Copy)]
struct SlotPlan {
    id: u64,
    start: u64,
    units: u64,
}

struct Shared {
    cfg: BenchConfig,
    bpi: u64,
}

/// xorshift64*: cheap, good enough for offsets.
struct Rng(u64);
impl Rng {
    #[inline]
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` by a multiply-high (Lemire) instead of `%`: a 64-bit
    /// division costs tens of cycles, a sizeable share of a null bdev's I/O.
    #[inline]
    fn below(&mut self, n: u64) -> u64 {
        ((self.next() as u128 * n as u128) >> 64) as u64
    }
}

async fn slot(ch: IoChannel, plan: SlotPlan, core: Rc<CoreState>, sh: Rc<Shared>) {
    let cfg = &sh.cfg;
    let bs = ch.block_size() as usize;
    let mut buf = IoBuf::alloc(cfg.bs).await;
    let mut rng = Rng(cfg.seed ^ (plan.id + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut gens = if cfg.verify {
        vec![0u32; plan.units as usize]
    } else {
        Vec::new()
    };
    if cfg.verify && cfg.pattern.reads() {
        // Reads need known contents: write the slot's region once first.
        buf = prefill(&ch, plan, &core, &sh, buf).await;
        gens.fill(1);
    }
    let deadline = core.wait_start().await;
    let mut seq = 0u64;
    let mut n = 0u32;
    let mut now = ticks::now();
    while now < deadline {
        let unit = if cfg.pattern.random() {
            rng.below(plan.units)
        } else if cfg.verify {
            seq = (seq + 1) % plan.units;
            seq
        } else {
            core.next_in_order(plan.units)
        };
        let read = match cfg.pattern {
            Pattern::Read | Pattern::RandRead => true,
            Pattern::Write | Pattern::RandWrite | Pattern::Flush | Pattern::Unmap => false,
            Pattern::RandRw => (rng.next() % 100) < cfg.rwmixread as u64,
        };
        let lba = (plan.start + unit) * sh.bpi;
        if !read && cfg.verify {
            let g = &mut gens[unit as usize];
            *g = g.wrapping_add(1).max(1);
            verify::fill(&mut buf, bs, lba, cfg.seed, *g);
            // Filling a block takes a while: not part of the I/O's latency.
            now = ticks::now();
        }
        // `now` was read an instant ago (the previous completion, or after
        // a yield or a fill): the I/O is stamped with it rather than the
        // bdev layer reading the clock again.
        let (r, b) = ch.rw_stamped(!read, now, lba, sh.bpi, buf).await;
        buf = b;
        if matches!(r, Err(BdevError::Removed)) {
            // Hot-removed: every further I/O fails the same way.
            core.record(0, false, read);
            break;
        }
        now = core.completed(&ch, r.is_ok(), read);
        if read && cfg.verify && r.is_ok() && gens[unit as usize] > 0 {
            if let Err(m) = verify::check(&buf, bs, lba, cfg.seed, gens[unit as usize]) {
                core.mismatch(m.lba, m.what);
            }
        }
        n = n.wrapping_add(1);
        // Drivers that complete inline (null, malloc) never make the task
        // wait; yield so every slot of the queue depth gets its turn.
        if n.is_multiple_of(32) {
            ustor_runtime::yield_now().await;
            now = ticks::now();
        }
    }
}

/// Writes every unit of a slot's region once with generation 1 of its
/// self-checking blocks, so reads and read-backs have something to check.
async fn prefill(
    ch: &IoChannel,
    plan: SlotPlan,
    core: &CoreState,
    sh: &Shared,
    mut buf: IoBuf,
) -> IoBuf {
    let bs = ch.block_size() as usize;
    for u in 0..plan.units {
        let lba = (plan.start + u) * sh.bpi;
        verify::fill(&mut buf, bs, lba, sh.cfg.seed, 1);
        let (r, b) = ch.write(lba, sh.bpi, buf).await;
        buf = b;
        if r.is_err() {
            core.errors.set(core.errors.get() + 1);
        }
    }
    buf
}

/// What a run works on, checked before any reactor is asked to start.
struct RunPlan {
    info: BdevInfo,
    /// Blocks per I/O.
    bpi: u64,
    /// I/O units in the bdev.
    total_units: u64,
    /// Queue slots over all reactors.
    slots: u64,
    writable: bool,
}

impl RunPlan {
    fn check(rt: &RuntimeHandle, reg: &Registry, cfg: &BenchConfig) -> Result<Self, BenchError> {
        let entry = reg
            .get(&cfg.bdev)
            .ok_or_else(|| BenchError::NoBdev(cfg.bdev.clone()))?;
        let info = entry.info().clone();
        let bs = info.block_size as usize;
        if cfg.bs == 0 || !cfg.bs.is_multiple_of(bs) {
            return Err(BenchError::BadIoSize {
                bs: cfg.bs,
                block_size: bs,
            });
        }
        if cfg.qd == 0 {
            return Err(BenchError::ZeroQueueDepth);
        }
        let bpi = (cfg.bs / bs) as u64;
        let total_units = info.num_blocks / bpi;
        let slots = (rt.num_reactors() * cfg.qd) as u64;
        if total_units == 0 || (cfg.verify && total_units < slots) {
            return Err(BenchError::TooSmall {
                bdev: cfg.bdev.clone(),
                units: total_units,
                bs: cfg.bs,
                slots,
            });
        }
        if let Some(t) = cfg.pattern.nodata() {
            if !reg.open(&cfg.bdev, false, |_| {})?.io_type_supported(t) {
                return Err(BenchError::Unsupported {
                    bdev: cfg.bdev.clone(),
                    what: cfg.pattern.name(),
                });
            }
            if cfg.verify && t == IoType::Unmap && !info.unmap_reads_zero {
                return Err(BenchError::UnmapNotZeroing(cfg.bdev.clone()));
            }
        }
        Ok(RunPlan {
            info,
            bpi,
            total_units,
            slots,
            writable: cfg.pattern.writes() || cfg.verify,
        })
    }
}

/// How one reactor's part of a run talks to the control thread.
struct CoreLink {
    done: mpsc::Sender<CoreResult>,
    ready: mpsc::Sender<usize>,
    /// The common (start, deadline), in TSC ticks.
    start: mpsc::Receiver<(u64, u64)>,
}

/// Runs the workload on every reactor of `rt` and reports.
pub fn run(
    rt: &RuntimeHandle,
    reg: &Arc<Registry>,
    cfg: &BenchConfig,
    progress: impl FnMut(f64, u64),
) -> Result<Report, BenchError> {
    let plan = RunPlan::check(rt, reg, cfg)?;
    let cores = rt.num_reactors();
    // Every reactor starts at one TSC instant, after all have their slots
    // (and verify prefill) ready.
    let (tx, rx) = mpsc::channel::<CoreResult>();
    let (ready_tx, ready_rx) = mpsc::channel::<usize>();
    let mut starts = Vec::new();
    for r in 0..cores {
        let desc = reg.open(&cfg.bdev, plan.writable, |_| {})?;
        let (stx, srx) = mpsc::channel::<(u64, u64)>();
        starts.push(stx);
        let link = CoreLink {
            done: tx.clone(),
            ready: ready_tx.clone(),
            start: srx,
        };
        let sh = Shared {
            cfg: cfg.clone(),
            bpi: plan.bpi,
        };
        let (total_units, slots) = (plan.total_units, plan.slots);
        rt.spawn_on(r, move || core_run(r, desc, sh, total_units, slots, link))?;
    }
    drop(tx);
    drop(ready_tx);
    for _ in 0..cores {
        ready_rx.recv().map_err(|_| BenchError::Stopped)?;
    }
    let usage0 = rusage();
    let start_at = ticks::now() + ticks::from_duration(Duration::from_millis(2));
    let deadline = start_at + ticks::from_duration(cfg.time);
    for s in starts {
        let _ = s.send((start_at, deadline));
    }
    let mut results = collect(rt, &rx, cores, progress)?;
    let usage1 = rusage();
    let elapsed = ticks::to_ns(ticks::now().min(deadline).saturating_sub(start_at)).max(1);
    results.sort_by_key(|r| r.reactor);
    let cpu_ns = usage1.saturating_sub(usage0);
    Ok(Report::new(
        cfg.clone(),
        results,
        cpu_ns,
        elapsed,
        &plan.info.name,
    ))
}

/// One reactor's part of a run: its `qd` slots on one channel, started at
/// the common instant, then its counters sent back.
async fn core_run(r: usize, desc: Desc, sh: Shared, total_units: u64, slots: u64, link: CoreLink) {
    let ch = match desc.channel() {
        Ok(c) => c,
        Err(e) => {
            // Counted as ready too, or the control thread would wait
            // for this reactor forever.
            let _ = link.done.send(CoreResult::failed(r, e.to_string()));
            let _ = link.ready.send(r);
            return;
        }
    };
    let core = Rc::new(CoreState::new());
    CORE.with(|c| *c.borrow_mut() = Some(core.clone()));
    let qd = sh.cfg.qd;
    let (verify, pattern, bs) = (sh.cfg.verify, sh.cfg.pattern, sh.cfg.bs);
    let sh = Rc::new(sh);
    let per_slot = if verify {
        total_units / slots
    } else {
        total_units
    };
    let mut js = Vec::with_capacity(qd);
    for q in 0..qd {
        let id = (r * qd + q) as u64;
        let start = if verify { id * per_slot } else { 0 };
        let plan = SlotPlan {
            id,
            start,
            units: per_slot,
        };
        let (ch, core, sh) = (ch.clone(), core.clone(), sh.clone());
        js.push(match pattern.nodata() {
            Some(t) => ustor_runtime::spawn(nodata::slot(t, ch, plan, core, sh)),
            None => ustor_runtime::spawn(slot(ch, plan, core, sh)),
        });
    }
    // Slots are ready (buffers taken, verify prefill written): report,
    // then wait for the common start and deadline.
    while core.ready.get() < qd {
        ustor_runtime::sleep(Duration::from_micros(200)).await;
    }
    let _ = link.ready.send(r);
    let (start, deadline) = loop {
        match link.start.try_recv() {
            Ok(v) => break v,
            Err(mpsc::TryRecvError::Empty) => {
                ustor_runtime::sleep(Duration::from_micros(200)).await
            }
            Err(mpsc::TryRecvError::Disconnected) => break (1, 1),
        }
    };
    core.deadline.set(deadline);
    core.start.set(start);
    for j in js {
        j.await;
    }
    let res = CoreResult::from_state(r, &core, ticks::hz(), bs);
    CORE.with(|c| *c.borrow_mut() = None);
    let _ = link.done.send(res);
}

/// Waits for every reactor's result, reporting the I/Os done so far once
/// a second.
fn collect(
    rt: &RuntimeHandle,
    rx: &mpsc::Receiver<CoreResult>,
    cores: usize,
    mut progress: impl FnMut(f64, u64),
) -> Result<Vec<CoreResult>, BenchError> {
    let t0 = Instant::now();
    let mut results = Vec::new();
    let mut next_tick = t0 + Duration::from_secs(1);
    while results.len() < cores {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(r) => results.push(r),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return Err(BenchError::Stopped),
        }
        if Instant::now() >= next_tick && results.len() < cores {
            next_tick += Duration::from_secs(1);
            let ios: u64 = rt
                .call_all(|_| CORE.with(|c| c.borrow().as_ref().map(|s| s.ios.get()).unwrap_or(0)))
                .map(|v| v.iter().sum())
                .unwrap_or(0);
            progress(t0.elapsed().as_secs_f64(), ios);
        }
    }
    Ok(results)
}

/// User + system CPU time of the whole process, in ns.
fn rusage() -> u64 {
    // SAFETY: getrusage fills the struct we pass.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let tv = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1000;
    tv(u.ru_utime) + tv(u.ru_stime)
}

impl CoreResult {
    fn from_state(reactor: usize, s: &CoreState, hz: u64, _bs: usize) -> CoreResult {
        let h = s.hist.to_hdr(hz.saturating_mul(60));
        CoreResult::from_parts(
            reactor,
            s.ios.get(),
            s.reads.get(),
            s.errors.get(),
            s.verify_errors.get(),
            s.first_mismatch.borrow().clone(),
            s.lat_sum.get(),
            h,
        )
    }
}
