//! One SCSI host on its reactor: the preallocated command slots, issue to
//! the LLD, completion polling, retry scheduling, timeouts, and the bdev
//! I/O state machine (no allocation per I/O: a slot holds the bdev's
//! `IoHandle`, the CDB, the UNMAP parameter list and the sense buffer).
//!
//! Slot states: Free → Issued → (Done | Delayed → Issued | TimedOut → EH).

use std::cell::{Cell, RefCell, UnsafeCell};
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::Arc;
use std::task::Waker;
use std::time::Duration;

use ustor_bdev::{IoDesc, IoHandle, IoType};
use ustor_runtime::{ticks, PollStatus, PollerId};

use super::device::{Device, DeviceState};
use super::retry::{self, Action, Event, Failure};
use super::stats::HostCounters;
use super::StackShared;
use crate::cdb::{self, Cdb};
use crate::lld::{
    Completion, DataDir, HostLimits, Lld, Nexus, QueueError, ScsiCmd, Tag, TransportError,
};
use crate::sense::{Sense, SENSE_BUF_LEN};
use crate::status::ScsiStatus;

mod internal;

pub use internal::Outcome;

/// Completions taken from the LLD per poller pass.
const POLL_BUDGET: usize = 64;
/// Backlogged bdev I/Os started per pass.
const BACKLOG_BUDGET: usize = 64;
/// How often timeouts and delayed retries are looked at.
const CHECK_PERIOD: Duration = Duration::from_millis(1);

/// Per-host tunables.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
pub struct HostConfig {
    /// Per-command timeout before error handling starts.
    pub cmd_timeout_ms: u64,
    /// Issues of one command beyond the first.
    pub max_retries: u32,
}

impl Default for HostConfig {
    fn default() -> HostConfig {
        HostConfig {
            cmd_timeout_ms: 30_000,
            max_retries: 5,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SlotState {
    Free,
    /// With the LLD.
    Issued,
    /// Waiting for `retry_at` (back-off, queue full, after EH).
    Delayed,
    /// Past its deadline; error handling owns it.
    TimedOut,
    /// Finished; an internal waiter has not collected it yet.
    Done,
}

/// Who is told when a slot finishes.
pub(crate) enum Owner {
    None,
    /// An internal command (scan, bring-up, `execute`): the caller's future.
    Waiter {
        waker: Option<Waker>,
        buf: Vec<u8>,
        dropped: bool,
    },
    /// A bdev I/O; UNMAP and WRITE SAME ranges go in chunks from one slot.
    Bdev {
        io: BdevIo,
        kind: IoType,
        next_lba: u64,
        remaining: u64,
        chunk: u64,
    },
}

pub(crate) struct Slot {
    gen: Cell<u16>,
    pub(crate) state: Cell<SlotState>,
    pub(crate) cmd: Cell<ScsiCmd>,
    pub(crate) dev: RefCell<Option<Rc<Device>>>,
    deadline: Cell<u64>,
    retry_at: Cell<u64>,
    pub(crate) attempts: Cell<u32>,
    pub(crate) owner: RefCell<Owner>,
    pub(crate) status: Cell<Result<ScsiStatus, TransportError>>,
    pub(crate) failure: Cell<Option<Failure>>,
    sense: UnsafeCell<[u8; SENSE_BUF_LEN]>,
    sense_len: Cell<usize>,
    pub(crate) resid: Cell<u32>,
    /// One iovec for internal buffers, UNMAP parameters and WRITE SAME.
    iov: UnsafeCell<libc::iovec>,
    param: UnsafeCell<[u8; cdb::UNMAP_PARAM_LEN_ONE]>,
}

impl Slot {
    fn new() -> Slot {
        Slot {
            gen: Cell::new(0),
            state: Cell::new(SlotState::Free),
            cmd: Cell::new(ScsiCmd {
                tag: 0,
                nexus: Nexus {
                    channel: 0,
                    target: 0,
                    lun: 0,
                },
                cdb: Cdb::test_unit_ready(),
                dir: DataDir::None,
                iov: std::ptr::null(),
                iovcnt: 0,
                data_len: 0,
            }),
            dev: RefCell::new(None),
            deadline: Cell::new(0),
            retry_at: Cell::new(0),
            attempts: Cell::new(0),
            owner: RefCell::new(Owner::None),
            status: Cell::new(Ok(ScsiStatus::Good)),
            failure: Cell::new(None),
            sense: UnsafeCell::new([0; SENSE_BUF_LEN]),
            sense_len: Cell::new(0),
            resid: Cell::new(0),
            iov: UnsafeCell::new(libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            }),
            param: UnsafeCell::new([0; cdb::UNMAP_PARAM_LEN_ONE]),
        }
    }

    pub(crate) fn sense(&self) -> Option<Sense> {
        // SAFETY: the sense buffer is written only in `on_completion` on
        // this reactor, never while a reference from here is alive.
        let b = unsafe { &*self.sense.get() };
        Sense::decode(&b[..self.sense_len.get()]).ok()
    }

    pub(crate) fn sense_bytes(&self) -> Vec<u8> {
        // SAFETY: as in `sense`.
        unsafe { (&*self.sense.get())[..self.sense_len.get()].to_vec() }
    }
}

/// Whose bdev I/O a slot serves: one of this reactor's, or one forwarded
/// from a SCSI bdev channel on another reactor (`crate::sd::forward`).
pub(crate) enum BdevIo {
    Local(IoHandle),
    Remote {
        q: Arc<crate::sd::forward::FwdQueue>,
        token: ustor_bdev::remote::RemoteIo,
    },
}

impl BdevIo {
    fn complete(self, res: Result<(), ustor_bdev::BdevError>) {
        match self {
            BdevIo::Local(io) => io.complete(res),
            BdevIo::Remote { q, token } => q.complete(token, res),
        }
    }
}

/// A bdev I/O waiting for a slot (or for error handling to finish).
pub(crate) struct Pending {
    pub(crate) io: BdevIo,
    /// The I/O's kind, range and buffers (read once, where it was submitted).
    pub(crate) desc: IoDesc,
    pub(crate) dev: Rc<Device>,
    pub(crate) base_lba: u64,
    pub(crate) caps: IoCaps,
}

/// How a SCSI bdev turns bdev I/O into commands (from VPD block limits).
#[derive(Clone, Copy, Debug, Default)]
pub struct IoCaps {
    pub block_size: u32,
    /// Blocks per UNMAP command; 0 = UNMAP unsupported.
    pub max_unmap_blocks: u64,
    /// Blocks per WRITE SAME(16); 0 = unsupported.
    pub max_write_same_blocks: u64,
}

pub struct Host {
    pub no: u32,
    pub(crate) lld: Box<dyn Lld>,
    pub(crate) limits: HostLimits,
    pub(crate) cfg: HostConfig,
    slots: Box<[Slot]>,
    free: RefCell<Vec<u16>>,
    slot_waiters: RefCell<VecDeque<Waker>>,
    backlog: RefCell<VecDeque<Pending>>,
    delayed: Cell<u32>,
    pub(crate) devices: RefCell<Vec<Rc<Device>>>,
    pub(crate) stats: HostCounters,
    pub(crate) in_eh: Cell<bool>,
    eh_wanted: Cell<bool>,
    pub(crate) rescan_wanted: Cell<bool>,
    pub(crate) scanning: Cell<bool>,
    next_check: Cell<u64>,
    check_ticks: u64,
    timeout_ticks: u64,
    /// One zeroed block source for WRITE SAME (largest block size).
    zero: Box<[u8]>,
    pub(crate) poller: Cell<Option<PollerId>>,
    pub(crate) timer: Cell<Option<PollerId>>,
    pub(crate) shared: Arc<StackShared>,
    pub(crate) me: std::rc::Weak<Host>,
}

impl Host {
    pub(crate) fn new(
        no: u32,
        lld: Box<dyn Lld>,
        cfg: HostConfig,
        shared: Arc<StackShared>,
    ) -> Rc<Host> {
        let limits = lld.limits();
        let n = limits.can_queue.clamp(1, u16::MAX as u32) as usize;
        Rc::new_cyclic(|me| Host {
            no,
            lld,
            limits,
            cfg,
            slots: (0..n).map(|_| Slot::new()).collect(),
            free: RefCell::new((0..n as u16).rev().collect()),
            slot_waiters: RefCell::new(VecDeque::with_capacity(16)),
            backlog: RefCell::new(VecDeque::with_capacity(1024)),
            delayed: Cell::new(0),
            devices: RefCell::new(Vec::new()),
            stats: HostCounters::default(),
            in_eh: Cell::new(false),
            eh_wanted: Cell::new(false),
            rescan_wanted: Cell::new(false),
            scanning: Cell::new(false),
            next_check: Cell::new(0),
            check_ticks: ticks::from_duration(CHECK_PERIOD),
            timeout_ticks: ticks::from_duration(Duration::from_millis(cfg.cmd_timeout_ms)),
            zero: vec![0u8; 65536].into_boxed_slice(),
            poller: Cell::new(None),
            timer: Cell::new(None),
            shared,
            me: me.clone(),
        })
    }

    pub(crate) fn slots(&self) -> &[Slot] {
        &self.slots
    }

    pub(crate) fn tag_of(&self, idx: u16) -> Tag {
        (self.slots[idx as usize].gen.get() as u32) << 16 | idx as u32
    }

    pub(crate) fn device(&self, hctl: &crate::lun::Hctl) -> Option<Rc<Device>> {
        self.devices
            .borrow()
            .iter()
            .find(|d| d.hctl == *hctl)
            .cloned()
    }

    fn alloc(&self) -> Option<u16> {
        let i = self.free.borrow_mut().pop()?;
        let s = &self.slots[i as usize];
        s.state.set(SlotState::Issued);
        s.attempts.set(0);
        s.failure.set(None);
        s.sense_len.set(0);
        s.resid.set(0);
        Some(i)
    }

    pub(crate) fn free_slot(&self, i: u16) {
        let s = &self.slots[i as usize];
        s.gen.set(s.gen.get().wrapping_add(1));
        s.state.set(SlotState::Free);
        *s.owner.borrow_mut() = Owner::None;
        if let Some(d) = s.dev.borrow_mut().take() {
            d.inflight.set(d.inflight.get().saturating_sub(1));
        }
        self.free.borrow_mut().push(i);
        let w = self.slot_waiters.borrow_mut().pop_front();
        if let Some(w) = w {
            w.wake();
        }
    }

    /// Hands the slot's command to the LLD (or fails it fast when the
    /// device is offline or gone).
    pub(crate) fn issue(&self, i: u16) {
        let s = &self.slots[i as usize];
        let offline = s
            .dev
            .borrow()
            .as_ref()
            .is_some_and(|d| matches!(d.state(), DeviceState::Offline | DeviceState::Removed));
        if offline {
            s.failure.set(Some(Failure::Offline));
            self.finish(i);
            return;
        }
        let mut cmd = s.cmd.get();
        cmd.tag = self.tag_of(i);
        s.cmd.set(cmd);
        s.state.set(SlotState::Issued);
        s.deadline.set(ticks::now() + self.timeout_ticks);
        HostCounters::inc(&self.stats.commands);
        match self.lld.queuecommand(&cmd) {
            Ok(()) => {}
            Err(QueueError::HostBusy | QueueError::DeviceBusy) => {
                HostCounters::inc(&self.stats.queue_full);
                self.delay(i, 0);
            }
            Err(QueueError::NotConnected) => {
                HostCounters::inc(&self.stats.transport_errors);
                self.retry_or_fail(i, 10, Failure::Transport(TransportError::Disconnected));
            }
        }
    }

    fn delay(&self, i: u16, ms: u32) {
        let s = &self.slots[i as usize];
        s.state.set(SlotState::Delayed);
        s.retry_at
            .set(ticks::now() + ticks::from_duration(Duration::from_millis(ms as u64)));
        self.delayed.set(self.delayed.get() + 1);
    }

    /// A delayed slot left the delayed state outside `check_slots`.
    pub(crate) fn undelay(&self) {
        self.delayed.set(self.delayed.get().saturating_sub(1));
    }

    /// Schedules another attempt, or fails the command when attempts ran out.
    pub(crate) fn retry_or_fail(&self, i: u16, delay_ms: u32, why: Failure) {
        let s = &self.slots[i as usize];
        if s.attempts.get() >= self.cfg.max_retries {
            s.failure.set(Some(match why {
                Failure::TimedOut => Failure::TimedOut,
                Failure::Transport(e) => Failure::Transport(e),
                _ => Failure::RetriesExhausted,
            }));
            self.finish(i);
            return;
        }
        s.attempts.set(s.attempts.get() + 1);
        HostCounters::inc(&self.stats.retries);
        self.delay(i, delay_ms);
    }

    /// The poller body: completions, timeouts, delayed retries, backlog,
    /// and starting error handling or a rescan.
    pub(crate) fn poll(&self) -> PollStatus {
        let mut work = self.lld.poll(POLL_BUDGET, &mut |c| self.on_completion(c));
        let now = ticks::now();
        if now >= self.next_check.get() || self.delayed.get() > 0 {
            self.next_check.set(now + self.check_ticks);
            work += self.check_slots(now);
            if self.lld.take_rescan() {
                HostCounters::inc(&self.stats.hotplug_events);
                self.rescan_wanted.set(true);
            }
        }
        if !self.in_eh.get() {
            work += self.drain_backlog();
        }
        if self.eh_wanted.get() && !self.in_eh.get() {
            self.eh_wanted.set(false);
            if let Some(me) = self.me.upgrade() {
                self.in_eh.set(true);
                ustor_runtime::spawn(super::eh::run(me));
            }
        }
        if self.rescan_wanted.get() && !self.scanning.get() && !self.in_eh.get() {
            self.rescan_wanted.set(false);
            if let Some(me) = self.me.upgrade() {
                ustor_runtime::spawn(async move {
                    if let Err(e) = super::scan::scan_host(&me).await {
                        tracing::warn!("host{}: rescan failed: {e}", me.no);
                    }
                });
            }
        }
        // A back-off in progress keeps the reactor awake (it is short); a
        // sleeping reactor is woken for timeouts by the timed poller.
        if work > 0 || self.delayed.get() > 0 {
            PollStatus::Busy
        } else {
            PollStatus::Idle
        }
    }

    /// How often a sleeping reactor wakes to look for timeouts.
    pub(crate) fn timer_period(&self) -> Duration {
        Duration::from_millis((self.cfg.cmd_timeout_ms / 4).clamp(1, 100))
    }

    /// The timed poller: timeouts even when nothing else wakes the reactor.
    pub(crate) fn tick(&self) -> PollStatus {
        if self.check_slots(ticks::now()) > 0 {
            PollStatus::Busy
        } else {
            PollStatus::Idle
        }
    }

    fn check_slots(&self, now: u64) -> usize {
        let mut n = 0;
        for (i, s) in self.slots.iter().enumerate() {
            match s.state.get() {
                SlotState::Issued if now >= s.deadline.get() => {
                    s.state.set(SlotState::TimedOut);
                    HostCounters::inc(&self.stats.timeouts);
                    tracing::warn!(
                        "host{}: command {:?} to {:?} timed out; starting error handling",
                        self.no,
                        s.cmd.get().cdb,
                        s.cmd.get().nexus
                    );
                    self.eh_wanted.set(true);
                    n += 1;
                }
                SlotState::Delayed if now >= s.retry_at.get() && !self.in_eh.get() => {
                    self.delayed.set(self.delayed.get() - 1);
                    self.issue(i as u16);
                    n += 1;
                }
                _ => {}
            }
        }
        n
    }

    fn on_completion(&self, c: Completion<'_>) {
        let idx = (c.tag & 0xffff) as usize;
        let Some(s) = self.slots.get(idx) else {
            HostCounters::inc(&self.stats.stale_completions);
            return;
        };
        if s.gen.get() as u32 != c.tag >> 16 || s.state.get() != SlotState::Issued {
            // Completed after it timed out (error handling owns it) or
            // after an abort: the mid-layer already decided its fate.
            HostCounters::inc(&self.stats.stale_completions);
            return;
        }
        s.status.set(c.status);
        s.resid.set(c.resid);
        let n = c.sense.len().min(SENSE_BUF_LEN);
        // SAFETY: reactor-local slot; no reference to the buffer is alive.
        unsafe { (&mut *s.sense.get())[..n].copy_from_slice(&c.sense[..n]) };
        s.sense_len.set(n);
        self.disposition(idx as u16);
    }

    /// Applies the retry rules to a finished attempt.
    fn disposition(&self, i: u16) {
        let s = &self.slots[i as usize];
        let sense = s.sense();
        let (action, event) = retry::decide(s.status.get(), sense, s.attempts.get());
        self.count(event, s);
        match action {
            Action::Complete => self.next_chunk_or_finish(i),
            Action::Retry { delay_ms } => {
                let why = match s.status.get() {
                    Err(e) => Failure::Transport(e),
                    Ok(_) => Failure::RetriesExhausted,
                };
                self.retry_or_fail(i, delay_ms, why)
            }
            Action::Fail(f) => {
                if let (Some(d), Some(sense)) = (s.dev.borrow().as_ref(), sense) {
                    d.last_sense.set(Some(sense));
                }
                s.failure.set(Some(f));
                self.finish(i);
            }
        }
    }

    fn count(&self, ev: Event, s: &Slot) {
        let c = &self.stats;
        match ev {
            Event::None => {}
            Event::UnitAttention => HostCounters::inc(&c.unit_attentions),
            Event::LunsChanged => {
                HostCounters::inc(&c.unit_attentions);
                HostCounters::inc(&c.luns_changed);
                self.rescan_wanted.set(true);
            }
            Event::CapacityChanged => {
                HostCounters::inc(&c.unit_attentions);
                HostCounters::inc(&c.capacity_changed);
            }
            Event::BecomingReady => HostCounters::inc(&c.not_ready_retries),
            Event::Busy => HostCounters::inc(&c.busy),
            Event::TaskSetFull => HostCounters::inc(&c.task_set_full),
            Event::Recovered => HostCounters::inc(&c.recovered_errors),
            Event::MediumError => HostCounters::inc(&c.medium_errors),
            Event::HardwareError => HostCounters::inc(&c.hardware_errors),
            Event::TransportError => HostCounters::inc(&c.transport_errors),
            Event::DeviceGone => {
                HostCounters::inc(&c.transport_errors);
                self.rescan_wanted.set(true);
            }
        }
        if ev != Event::None {
            tracing::debug!(
                "host{}: {:?} for {:?}: {ev:?}",
                self.no,
                s.cmd.get().cdb,
                s.cmd.get().nexus
            );
        }
    }

    /// Success of one attempt: the next UNMAP / WRITE SAME chunk, or done.
    fn next_chunk_or_finish(&self, i: u16) {
        let s = &self.slots[i as usize];
        let more = match &mut *s.owner.borrow_mut() {
            Owner::Bdev {
                kind,
                next_lba,
                remaining,
                chunk,
                ..
            } if *remaining > 0 => {
                let n = (*remaining).min(*chunk);
                let lba = *next_lba;
                *next_lba += n;
                *remaining -= n;
                Some((*kind, lba, n))
            }
            _ => None,
        };
        match more {
            Some((kind, lba, n)) => {
                s.attempts.set(0);
                self.build_range(i, kind, lba, n);
                self.issue(i);
            }
            None => self.finish(i),
        }
    }

    /// Hands a finished slot to its owner.
    pub(crate) fn finish(&self, i: u16) {
        let s = &self.slots[i as usize];
        let failure = s.failure.get();
        match failure {
            None => HostCounters::inc(&self.stats.completed),
            Some(f) => {
                HostCounters::inc(&self.stats.failed);
                tracing::debug!("host{}: {:?} failed: {f:?}", self.no, s.cmd.get().cdb);
            }
        }
        let owner = std::mem::replace(&mut *s.owner.borrow_mut(), Owner::None);
        match owner {
            Owner::Bdev { io, .. } => {
                self.free_slot(i);
                io.complete(failure.map_or(Ok(()), |f| Err(f.bdev_error())));
            }
            Owner::Waiter {
                waker,
                buf,
                dropped,
            } => {
                if dropped {
                    self.free_slot(i);
                    return;
                }
                s.state.set(SlotState::Done);
                *s.owner.borrow_mut() = Owner::Waiter {
                    waker: None,
                    buf,
                    dropped,
                };
                if let Some(w) = waker {
                    w.wake();
                }
            }
            Owner::None => self.free_slot(i),
        }
    }

    // ---- bdev I/O -------------------------------------------------------

    /// Starts a bdev I/O on `dev` (the SCSI bdev's channel calls this).
    pub(crate) fn submit_bdev(&self, p: Pending) {
        if self.in_eh.get() || !self.backlog.borrow().is_empty() {
            self.backlog.borrow_mut().push_back(p);
            return;
        }
        match self.alloc() {
            Some(i) => self.start_bdev(i, p),
            None => self.backlog.borrow_mut().push_back(p),
        }
    }

    fn drain_backlog(&self) -> usize {
        let mut n = 0;
        while n < BACKLOG_BUDGET {
            if self.free.borrow().is_empty() {
                break;
            }
            let Some(p) = self.backlog.borrow_mut().pop_front() else {
                break;
            };
            if let Some(i) = self.alloc() {
                self.start_bdev(i, p);
            }
            n += 1;
        }
        n
    }

    fn start_bdev(&self, i: u16, p: Pending) {
        let s = &self.slots[i as usize];
        let d = p.desc;
        let lba = p.base_lba + d.offset_blocks;
        p.dev.inflight.set(p.dev.inflight.get() + 1);
        *s.dev.borrow_mut() = Some(p.dev);
        let (chunk, first) = match d.kind {
            IoType::Read | IoType::Write => {
                let bytes = d.num_blocks * p.caps.block_size as u64;
                let mut cmd = s.cmd.get();
                cmd.nexus = s.dev.borrow().as_ref().map_or(cmd.nexus, |d| d.nexus);
                cmd.cdb = Cdb::rw(d.kind == IoType::Write, lba, d.num_blocks as u32);
                cmd.dir = if d.kind == IoType::Write {
                    DataDir::ToDevice
                } else {
                    DataDir::FromDevice
                };
                cmd.iov = d.iov;
                cmd.iovcnt = d.iovcnt;
                cmd.data_len = bytes as u32;
                s.cmd.set(cmd);
                (0, 0)
            }
            IoType::Unmap => (
                p.caps.max_unmap_blocks.max(1),
                p.caps.max_unmap_blocks.max(1),
            ),
            IoType::WriteZeroes => (
                p.caps.max_write_same_blocks.max(1),
                p.caps.max_write_same_blocks.max(1),
            ),
            IoType::Flush | IoType::Reset | IoType::CompareAndWrite => (0, 0),
        };
        let kind = d.kind;
        match kind {
            IoType::Read | IoType::Write => {}
            // Not offered (`io_type_supported`): the generic layer never
            // sends it.
            IoType::CompareAndWrite => unreachable!("SCSI bdevs offer no compare-and-write"),
            IoType::Flush => {
                self.build(
                    i,
                    Cdb::synchronize_cache(lba, d.num_blocks.min(u32::MAX as u64) as u32),
                    DataDir::None,
                    std::ptr::null_mut(),
                    0,
                );
            }
            IoType::Reset => {
                // The mid-layer owns resets (error handling); a bdev reset
                // drains nothing here and succeeds.
                *s.owner.borrow_mut() = Owner::Bdev {
                    io: p.io,
                    kind,
                    next_lba: 0,
                    remaining: 0,
                    chunk: 0,
                };
                self.finish(i);
                return;
            }
            IoType::Unmap | IoType::WriteZeroes => {
                let n = d.num_blocks.min(first);
                self.build_range_with(i, kind, lba, n, p.caps.block_size);
                *s.owner.borrow_mut() = Owner::Bdev {
                    io: p.io,
                    kind,
                    next_lba: lba + n,
                    remaining: d.num_blocks - n,
                    chunk,
                };
                self.issue(i);
                return;
            }
        }
        *s.owner.borrow_mut() = Owner::Bdev {
            io: p.io,
            kind,
            next_lba: 0,
            remaining: 0,
            chunk,
        };
        self.issue(i);
    }

    fn build_range(&self, i: u16, kind: IoType, lba: u64, n: u64) {
        let bs = self.slots[i as usize].cmd.get().data_len.max(512);
        self.build_range_with(i, kind, lba, n, bs);
    }

    /// An UNMAP (one descriptor) or WRITE SAME(16) of zeroes for a range.
    fn build_range_with(&self, i: u16, kind: IoType, lba: u64, n: u64, block_size: u32) {
        let s = &self.slots[i as usize];
        if kind == IoType::Unmap {
            // SAFETY: the parameter buffer belongs to this slot and is read
            // by the LLD only while the command is outstanding, which it is
            // not while we rebuild it.
            let p = unsafe { &mut *s.param.get() };
            cdb::unmap_param(p, lba, n as u32);
            let len = p.len();
            self.build(
                i,
                Cdb::unmap(len as u16),
                DataDir::ToDevice,
                p.as_mut_ptr(),
                len,
            );
        } else {
            let bs = (block_size as usize).min(self.zero.len());
            // The LLD only reads from this data-out buffer.
            let z = self.zero.as_ptr() as *mut u8;
            self.build(
                i,
                Cdb::write_same_16(lba, n as u32, false, false),
                DataDir::ToDevice,
                z,
                bs,
            );
        }
    }

    /// Fills the slot's command with one CDB and at most one data segment.
    pub(crate) fn build(&self, i: u16, cdb: Cdb, dir: DataDir, buf: *mut u8, len: usize) {
        let s = &self.slots[i as usize];
        // SAFETY: the slot's iovec is reactor-local and only read by the LLD
        // while the command is outstanding (not now).
        let iov = unsafe { &mut *s.iov.get() };
        *iov = libc::iovec {
            iov_base: buf.cast(),
            iov_len: len,
        };
        let mut cmd = s.cmd.get();
        if let Some(d) = s.dev.borrow().as_ref() {
            cmd.nexus = d.nexus;
        }
        cmd.cdb = cdb;
        cmd.dir = dir;
        cmd.iov = if len > 0 {
            iov as *const libc::iovec
        } else {
            std::ptr::null()
        };
        cmd.iovcnt = (len > 0) as usize;
        cmd.data_len = len as u32;
        s.cmd.set(cmd);
    }
}
