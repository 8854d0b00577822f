//! The SCSI device a controller serves: its targets (each one logical
//! unit, LUN 0, over a bdev) as the control side changes them, the events
//! waiting for the event queue, and what the queues share across reactors
//! (their task tables, from which the commands in flight per target are
//! counted, LUN-reset epochs, which configuration each queue runs with).
//!
//! Queues never lock on the data path: they compare [`ScsiDevice::generation`]
//! with the one they last saw and only then take the target lock to
//! rebuild their LUN tables on their own reactor.

use std::collections::VecDeque;
use std::fs::File;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ustor_bdev::Desc;
use ustor_scsi_target::{LuConfig, LuShared};
use vhost::vhost_user::message::VhostUserProtocolFeatures;

use super::tasks::TaskTable;
use super::wire::{self, Event, MAX_TARGETS};
use crate::backend::VhostDevice;
use crate::start::VringStart;

/// Events kept while the driver has posted no buffer; past this, the
/// next event carries EVENTS_MISSED (the driver then rescans everything).
const MAX_PENDING_EVENTS: usize = 32;

/// One target: LUN 0 over `desc`.
pub struct TargetSlot {
    pub bdev: String,
    pub desc: Desc,
    pub cfg: LuConfig,
    /// Reservations and mode pages, shared by every queue's table.
    pub shared: Arc<LuShared>,
    /// Tells this attachment from an earlier one at the same number.
    pub id: u64,
}

#[derive(Default)]
struct Events {
    pending: VecDeque<Event>,
    missed: bool,
    /// The event queue's kick eventfd while it runs: written to wake it.
    kick: Option<Arc<File>>,
}

/// A running request ring as others see it: its task table and kick.
pub(crate) type RingRef = (Arc<TaskTable>, Arc<File>);

/// Shared (`Arc`) by the control side and every queue's reactor.
pub struct ScsiDevice {
    /// The I_T nexus every queue's tables serve (the controller's name:
    /// one initiator, the VM).
    pub nexus: String,
    /// Request queues offered (rings: control, event, then these).
    pub request_queues: u16,
    /// How long a busy request queue polls after its last request.
    pub poll_window: Duration,
    /// Offer VIRTIO_F_RING_PACKED (the controller's `packed_ring`).
    pub packed_ring: bool,
    targets: Mutex<[Option<Arc<TargetSlot>>; MAX_TARGETS]>,
    generation: AtomicU64,
    next_id: AtomicU64,
    /// The generation each ring last applied (`u64::MAX`: not running).
    applied: Box<[AtomicU64]>,
    /// LUN resets asked per target (queues raise the unit attention).
    pub(crate) resets: [AtomicU64; MAX_TARGETS],
    events: Mutex<Events>,
    /// Each running request ring's commands by head and its kick
    /// eventfd (set by the ring when it starts and stops; read by task
    /// management, and kicked so a sleeping ring applies a change).
    tasks: Mutex<Vec<Option<RingRef>>>,
    /// Requests a killed backend had taken, served again (inflight region).
    resubmitted: AtomicU64,
    /// Call signals coalescing held back (all request rings).
    pub(crate) held: AtomicU64,
    /// Each ring's task: 0 not running, 1 running split, 2 running
    /// packed (for the listing's session).
    ring_state: Box<[AtomicU8]>,
    /// `vhost_controller_set_coalescing`: `delay_base_us << 32 |
    /// iops_threshold`, read by each request queue every rate check.
    coalescing: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl ScsiDevice {
    pub fn new(nexus: &str, request_queues: u16, poll_window: Duration) -> ScsiDevice {
        let rings = request_queues as usize + 2;
        ScsiDevice {
            nexus: nexus.to_string(),
            request_queues,
            poll_window,
            packed_ring: false,
            targets: Mutex::default(),
            generation: AtomicU64::new(1),
            next_id: AtomicU64::new(1),
            applied: (0..rings).map(|_| AtomicU64::new(u64::MAX)).collect(),
            resets: Default::default(),
            events: Mutex::default(),
            tasks: Mutex::new(vec![None; rings]),
            resubmitted: AtomicU64::new(0),
            held: AtomicU64::new(0),
            ring_state: (0..rings).map(|_| AtomicU8::new(0)).collect(),
            coalescing: AtomicU64::new(0),
        }
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The targets now (for a queue rebuilding its tables, and listings).
    pub fn targets(&self) -> [Option<Arc<TargetSlot>>; MAX_TARGETS] {
        lock(&self.targets).clone()
    }

    /// A new attachment id (for [`Self::attach`] and [`Self::detach_if`]).
    pub fn new_attach_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Attaches `desc` as target `num` with attachment id `id` (the
    /// caller checked the number and claimed the bdev); the driver hears
    /// of it on the event queue.
    pub fn attach(
        &self,
        num: u8,
        bdev: String,
        desc: Desc,
        cfg: LuConfig,
        id: u64,
    ) -> Result<(), Desc> {
        let mut t = lock(&self.targets);
        let slot = &mut t[num as usize];
        if slot.is_some() {
            return Err(desc);
        }
        *slot = Some(Arc::new(TargetSlot {
            bdev,
            desc,
            cfg,
            shared: LuShared::new(),
            id,
        }));
        self.generation.fetch_add(1, Ordering::AcqRel);
        drop(t);
        self.push_event(Event::added(num));
        Ok(())
    }

    /// Detaches target `num`: queues stop sending it commands, and once
    /// every running queue has applied that and its commands in flight
    /// are done (within `timeout`) the slot is returned, for the caller
    /// to release the bdev. The driver hears of it on the event queue.
    pub fn detach(&self, num: u8, timeout: Duration) -> Option<Arc<TargetSlot>> {
        self.detach_where(num, |_| true, timeout)
    }

    /// [`Self::detach`] if target `num` is still attachment `id` (its bdev
    /// went away: a later attachment at the number stays).
    pub fn detach_if(&self, num: u8, id: u64, timeout: Duration) -> Option<Arc<TargetSlot>> {
        self.detach_where(num, |s| s.id == id, timeout)
    }

    fn detach_where(
        &self,
        num: u8,
        which: impl Fn(&TargetSlot) -> bool,
        timeout: Duration,
    ) -> Option<Arc<TargetSlot>> {
        let slot = {
            let mut t = lock(&self.targets);
            let s = t.get_mut(num as usize)?;
            if !s.as_ref().is_some_and(|s| which(s)) {
                return None;
            }
            s.take()?
        };
        let gen = self.generation.fetch_add(1, Ordering::AcqRel) + 1;
        self.wake_request_rings();
        self.push_event(Event::removed(num));
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            let applied = self
                .applied
                .iter()
                .all(|a| a.load(Ordering::Acquire) >= gen);
            if applied && self.commands_in_flight(num) == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Some(slot)
    }

    /// Commands running on target `target` now (all queues).
    pub fn commands_in_flight(&self, target: u8) -> u32 {
        self.in_flight(Some(target))
    }

    /// Commands running of `target` (`None`: every target), read from the
    /// queues' task tables, so a command costs no shared counter (a
    /// read-modify-write on a line every queue's reactor writes).
    fn in_flight(&self, target: Option<u8>) -> u32 {
        lock(&self.tasks)
            .iter()
            .flatten()
            .map(|r| r.0.count_of(target))
            .sum()
    }

    /// Sets call-eventfd coalescing for the request queues (SPDK's
    /// `delay_base_us`, `iops_threshold`); they pick it up within a rate
    /// check interval.
    pub fn set_coalescing(&self, delay_base_us: u32, iops_threshold: u32) {
        let v = (delay_base_us as u64) << 32 | iops_threshold as u64;
        self.coalescing.store(v, Ordering::Relaxed);
    }

    /// `(delay_base_us, iops_threshold)`.
    pub fn coalescing(&self) -> (u32, u32) {
        let v = self.coalescing.load(Ordering::Relaxed);
        ((v >> 32) as u32, v as u32)
    }

    /// Ring `ring`'s task runs, as a packed ring or a split one.
    pub(crate) fn set_ring_state(&self, ring: usize, packed: bool) {
        if let Some(s) = self.ring_state.get(ring) {
            s.store(1 + packed as u8, Ordering::Relaxed);
        }
    }

    pub(crate) fn clear_ring_state(&self, ring: usize) {
        if let Some(s) = self.ring_state.get(ring) {
            s.store(0, Ordering::Relaxed);
        }
    }

    /// Rings running now, and how many of them are packed.
    pub fn rings_running(&self) -> (u32, u32) {
        self.ring_state
            .iter()
            .fold((0, 0), |(n, p), s| match s.load(Ordering::Relaxed) {
                0 => (n, p),
                1 => (n + 1, p),
                _ => (n + 1, p + 1),
            })
    }

    /// Commands running on every target now (all queues).
    pub fn all_commands_in_flight(&self) -> u64 {
        self.in_flight(None) as u64
    }

    /// Requests served again from the inflight region since creation.
    pub fn resubmitted(&self) -> u64 {
        self.resubmitted.load(Ordering::Relaxed)
    }

    pub(crate) fn add_resubmitted(&self, n: u64) {
        self.resubmitted.fetch_add(n, Ordering::Relaxed);
    }

    /// Call signals coalescing held back since creation (each goes out
    /// later: when due, or at the next rate check).
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// Request ring `ring`'s task table while it runs (`None`: stopped).
    pub(crate) fn set_tasks(&self, ring: usize, t: Option<RingRef>) {
        if let Some(slot) = lock(&self.tasks).get_mut(ring) {
            *slot = t;
        }
    }

    /// The task tables of the request rings running now.
    pub(crate) fn task_tables(&self) -> Vec<Arc<TaskTable>> {
        lock(&self.tasks)
            .iter()
            .flatten()
            .map(|r| r.0.clone())
            .collect()
    }

    /// Wakes every request ring (a sleeping ring applies a new
    /// configuration only when it wakes).
    pub(crate) fn wake_request_rings(&self) {
        for r in lock(&self.tasks).iter().flatten() {
            crate::eventfd::kick(&r.1);
        }
    }

    /// Ring `ring` runs with generation `gen` (`u64::MAX`: it stopped).
    pub(crate) fn applied(&self, ring: usize, gen: u64) {
        if let Some(a) = self.applied.get(ring) {
            a.store(gen, Ordering::Release);
        }
    }

    /// Queues an event and wakes the event queue.
    pub fn push_event(&self, ev: Event) {
        let mut e = lock(&self.events);
        if e.pending.len() >= MAX_PENDING_EVENTS {
            e.missed = true;
            e.pending.pop_front();
        }
        e.pending.push_back(ev);
        if let Some(k) = &e.kick {
            crate::eventfd::kick(k);
        }
    }

    /// The next event to deliver and whether events were lost before it.
    pub(crate) fn pop_event(&self) -> Option<(Event, bool)> {
        let mut e = lock(&self.events);
        let ev = e.pending.pop_front()?;
        Some((ev, std::mem::take(&mut e.missed)))
    }

    /// Puts back an event no buffer was found for.
    pub(crate) fn unpop_event(&self, ev: Event, missed: bool) {
        let mut e = lock(&self.events);
        e.pending.push_front(ev);
        e.missed |= missed;
    }

    pub(crate) fn has_events(&self) -> bool {
        !lock(&self.events).pending.is_empty()
    }

    /// The event queue started (`Some`, events before it are dropped: a
    /// driver scans when it starts) or stopped.
    pub(crate) fn event_queue(&self, kick: Option<Arc<File>>) {
        let mut e = lock(&self.events);
        if kick.is_some() {
            e.pending.clear();
            e.missed = false;
        }
        e.kick = kick;
    }
}

impl VhostDevice for ScsiDevice {
    fn num_queues(&self) -> u16 {
        self.request_queues + 2
    }
    fn features(&self) -> u64 {
        let packed = if self.packed_ring {
            crate::blk::feature::RING_PACKED
        } else {
            0
        };
        wire::features() | packed
    }
    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::RESET_DEVICE
            // Restart without loss: the rings track what they took.
            | VhostUserProtocolFeatures::INFLIGHT_SHMFD
    }
    fn config(&self) -> Vec<u8> {
        wire::config(self.request_queues).to_vec()
    }
    fn set_config(&self, _acked: u64, offset: u32, buf: &[u8]) -> bool {
        // The driver may write sense_size and cdb_size (offsets 20 and
        // 24); only the defaults are served.
        let ok = |v: u32| match offset {
            20 => v == wire::SENSE_SIZE as u32,
            24 => v == wire::CDB_SIZE as u32,
            _ => false,
        };
        buf.len() == 4 && ok(u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]))
    }
    fn run_queue(start: VringStart<Self>) -> impl std::future::Future<Output = ()> + 'static {
        super::queue::run(start)
    }
}
