//! raid1: every write goes to every member that holds the array's data,
//! reads go round-robin to one of them. A member whose child I/O fails is
//! marked failed and the array goes on degraded: a failed read is retried
//! on another member, a failed write succeeds while another member holds
//! it (the child-I/O watcher, [`ustor_bdev::Watch`]). A member removed
//! (`bdev_raid_remove_base_bdev`, hot-remove) leaves an empty slot; a
//! member added (`bdev_raid_add_base_bdev`) is written at once and read
//! only after a background rebuild has copied the array onto it. With
//! superblocks, each of these changes gives the members a new record
//! ([`super::membership`]). The array grows to its smallest member when
//! its members grow (as SPDK's raid1, the new blocks are not copied
//! between members: like a new array's, they hold what each member had
//! until written).
//!
//! Member states are shared by every reactor (one relaxed load per member
//! per I/O); membership changes bump an epoch after which each channel
//! refetches its member channels (control path).

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Duration;

use serde_json::{json, Value};
use ustor_bdev::{
    Bdev, BdevChannel, BdevEntry, BdevError, BdevEvent, BdevInfo, Children, ControlError, Desc,
    IoChannel, IoDesc, IoHandle, IoType, Registry, Watch,
};

use super::membership::Records;
use super::{Level, RaidConfig};
use crate::base;

mod members;

pub use members::{add_base, rebuild, remove_base, Joined};

pub(super) const ONLINE: u8 = 0;
const FAILED: u8 = 1;
/// Written, not read: the background copy has not reached the end.
const REBUILDING: u8 = 2;

/// A mirror's state shared by its channels, the RPC methods and the
/// rebuild task.
pub struct Mirror {
    pub(super) name: String,
    state: Box<[AtomicU8]>,
    epoch: AtomicU64,
    slots: Mutex<Vec<Option<Desc>>>,
    /// The array's size (grows with the members, never shrinks).
    blocks: AtomicU64,
    /// The array's bdev, once registered (its resize when members grow).
    top: OnceLock<Weak<BdevEntry>>,
    /// Blocks before the data on each member (the superblock's room).
    off: u64,
    rebuild: Rebuild,
    /// Each channel's writes in flight that are not counted in
    /// `Rebuild::writes` (sent while no rebuild ran): a rebuild waits for
    /// them before copying, since they did not go to the new member.
    chans: Mutex<Vec<Weak<AtomicU64>>>,
    /// The members' superblocks (arrays created with `superblock`).
    pub(super) records: OnceLock<Records>,
}

/// The background copy onto a member: its slot, how far it got, and the
/// chunk being copied (writes that touch it make the copy redo it).
#[derive(Default)]
struct Rebuild {
    running: AtomicBool,
    slot: AtomicU64,
    done: AtomicU64,
    lo: AtomicU64,
    hi: AtomicU64,
    dirty: AtomicBool,
    /// Writes counted while a rebuild runs, in two generations: before
    /// copying a chunk the copy flips the generation and waits for the
    /// old one's children to complete, so no write that missed the chunk's
    /// window is still in flight while it is copied.
    gen: AtomicU32,
    writes: [AtomicU64; 2],
}

/// Watch tag bits: the member index, whether the child is counted in
/// `Rebuild::writes`, and in which generation.
const MEMBER: u32 = 0xffff;
const COUNTED: u32 = 1 << 16;
const GEN_SHIFT: u32 = 17;
/// Counted in the channel's `uncounted` instead.
const UNCOUNTED: u32 = 1 << 18;

impl Mirror {
    pub(super) fn slots(&self) -> MutexGuard<'_, Vec<Option<Desc>>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn blocks(&self) -> u64 {
        self.blocks.load(Ordering::Acquire)
    }

    /// A member was resized: when every member in use now has more room
    /// than the array, the array takes the smallest one's size and its
    /// openers hear it. A shrink keeps the size (its end fails on that
    /// member, which then counts as failed).
    fn grow(&self) {
        let min = {
            let s = self.slots();
            (0..s.len())
                .filter(|i| self.state(*i) != FAILED)
                .filter_map(|i| s[i].as_ref())
                .map(|d| d.num_blocks().saturating_sub(self.off))
                .min()
        };
        let Some(min) = min else { return };
        if self.blocks.fetch_max(min, Ordering::AcqRel) >= min {
            return;
        }
        if let Some(top) = self.top.get().and_then(Weak::upgrade) {
            top.resize(self.blocks());
        }
    }

    #[inline]
    pub(super) fn state(&self, i: usize) -> u8 {
        self.state[i].load(Ordering::Relaxed)
    }

    fn online(&self) -> usize {
        (0..self.state.len())
            .filter(|i| self.state(*i) == ONLINE)
            .count()
    }

    /// A member failed an I/O: stop using it (and record that).
    fn fail(self: &Arc<Self>, i: usize, e: BdevError) {
        if self.state[i].swap(FAILED, Ordering::AcqRel) != FAILED {
            tracing::warn!("raid1 {}: member {i} failed ({e}); degraded", self.name);
            self.note_membership();
        }
    }

    /// A write over `[lo, hi)` overlaps the chunk being rebuilt.
    #[inline]
    fn touch(&self, lo: u64, hi: u64) {
        let r = &self.rebuild;
        if lo < r.hi.load(Ordering::SeqCst) && hi > r.lo.load(Ordering::SeqCst) {
            r.dirty.store(true, Ordering::SeqCst);
        }
    }

    /// Empties slot `i` (its claim goes with the descriptor).
    fn clear_slot(&self, i: usize) {
        self.state[i].store(FAILED, Ordering::Release);
        let old = self.slots()[i].take();
        self.epoch.fetch_add(1, Ordering::AcqRel);
        drop(old);
    }
}

struct MirrorBdev {
    info: BdevInfo,
    cfg: RaidConfig,
    m: Arc<Mirror>,
}

/// What a channel and its children's watcher share.
struct Chan {
    m: Arc<Mirror>,
    members: RefCell<Vec<Option<IoChannel>>>,
    epoch: Cell<u64>,
    next: Cell<usize>,
    /// Children not yet completed: their watcher points here.
    inflight: Cell<u64>,
    /// Write children in flight sent while no rebuild ran. Only this
    /// channel's reactor changes it (a load and a store, no locked
    /// instruction); a starting rebuild reads it.
    uncounted: Arc<AtomicU64>,
}

impl Chan {
    fn refresh(&self) {
        let e = self.m.epoch.load(Ordering::Acquire);
        if e == self.epoch.get() {
            return;
        }
        let fresh = self
            .m
            .slots()
            .iter()
            .map(|d| d.as_ref().and_then(|d| d.channel().ok()))
            .collect();
        *self.members.borrow_mut() = fresh;
        self.epoch.set(e);
    }

    fn watch(&self, i: usize, extra: u32) -> Watch {
        self.inflight.set(self.inflight.get() + 1);
        Watch {
            f: on_child,
            ctx: self as *const Chan as *const (),
            tag: i as u32 | extra,
        }
    }

    /// Sends a read to the next online member other than `skip`; false
    /// (and the parent failed) when there is none.
    fn read(&self, kids: &Children, d: &IoDesc, skip: usize) -> bool {
        let members = self.members.borrow();
        let n = members.len();
        let start = self.next.get();
        self.next.set(start.wrapping_add(1));
        for k in 0..n {
            let i = (start + k) % n;
            if i == skip || self.m.state(i) != ONLINE {
                continue;
            }
            if let Some(ch) = &members[i] {
                let w = self.watch(i, 0);
                kids.submit_watched(ch, d.kind, self.m.off + d.offset_blocks, d.num_blocks, 0, w);
                return true;
            }
        }
        kids.fail(BdevError::Io(libc::EIO));
        false
    }

    /// Sends a write-like I/O to every member that is not failed. While a
    /// rebuild runs (only then: these are atomic read-modify-writes) its
    /// children are counted in the rebuild's current generation, and a
    /// write over the chunk being copied makes the copy redo it.
    fn write(&self, kids: &Children, d: &IoDesc) {
        let r = &self.m.rebuild;
        let counted = d.kind != IoType::Flush && r.running.load(Ordering::Relaxed);
        let g = if counted {
            r.gen.load(Ordering::SeqCst) & 1
        } else {
            0
        };
        let extra = match (counted, d.kind) {
            (true, _) => COUNTED | g << GEN_SHIFT,
            (false, IoType::Flush) => 0,
            (false, _) => UNCOUNTED,
        };
        let members = self.members.borrow();
        let mut any = false;
        for (i, ch) in members.iter().enumerate() {
            if let (Some(ch), false) = (ch, self.m.state(i) == FAILED) {
                if counted {
                    r.writes[g as usize].fetch_add(1, Ordering::SeqCst);
                } else if extra == UNCOUNTED {
                    bump(&self.uncounted, 1);
                }
                let w = self.watch(i, extra);
                let at = self.m.off + d.offset_blocks;
                kids.submit_watched(ch, d.kind, at, d.num_blocks, 0, w);
                any = true;
            }
        }
        if !any {
            kids.fail(BdevError::Io(libc::EIO));
        }
        if counted {
            self.m
                .touch(d.offset_blocks, d.offset_blocks + d.num_blocks);
        }
    }
}

/// Adds `by` (wrapping: `u64::MAX` subtracts one) to a counter only this
/// reactor writes: a plain load and store, which a reader on another
/// reactor still sees whole.
#[inline]
fn bump(a: &AtomicU64, by: u64) {
    a.store(
        a.load(Ordering::Relaxed).wrapping_add(by),
        Ordering::Release,
    );
}

/// A member's child completed: on failure, mark the member failed and
/// retry a read elsewhere, or let a write succeed while another member
/// holds it.
fn on_child(
    ctx: *const (),
    tag: u32,
    parent: &Children,
    status: Result<(), BdevError>,
) -> Result<(), BdevError> {
    // SAFETY: `ctx` is the `Chan` of the channel that submitted this
    // child; a channel dropped with children in flight leaks its `Chan`
    // (see `Drop for MirrorChannel`), so it outlives them.
    let c = unsafe { &*(ctx as *const Chan) };
    c.inflight.set(c.inflight.get() - 1);
    let d = parent.desc();
    let r = &c.m.rebuild;
    if tag & UNCOUNTED != 0 {
        bump(&c.uncounted, u64::MAX);
    }
    if tag & COUNTED != 0 {
        r.writes[(tag >> GEN_SHIFT) as usize & 1].fetch_sub(1, Ordering::SeqCst);
    } else if d.kind != IoType::Read && r.running.load(Ordering::Relaxed) {
        // A write that started before the rebuild did: it may not have
        // reached the new member, so a chunk it lands in is copied again.
        c.m.touch(d.offset_blocks, d.offset_blocks + d.num_blocks);
    }
    let Err(e) = status else {
        return Ok(());
    };
    let member = (tag & MEMBER) as usize;
    c.m.fail(member, e);
    match d.kind {
        IoType::Read => {
            if c.read(parent, &d, member) {
                Ok(())
            } else {
                Err(e)
            }
        }
        _ if c.m.online() > 0 => Ok(()),
        _ => Err(e),
    }
}

struct MirrorChannel {
    c: Rc<Chan>,
}

impl BdevChannel for MirrorChannel {
    fn submit(&self, io: IoHandle) {
        let c = &*self.c;
        c.refresh();
        let d = io.desc();
        let kids = io.into_children();
        match d.kind {
            IoType::Read => {
                c.read(&kids, &d, usize::MAX);
            }
            IoType::Reset => {
                for ch in c.members.borrow().iter().flatten() {
                    kids.submit(ch, IoType::Reset, 0, 0, 0);
                }
            }
            _ => c.write(&kids, &d),
        }
    }
}

impl Drop for MirrorChannel {
    fn drop(&mut self) {
        if self.c.inflight.get() > 0 {
            // Children still point at it (a removal with I/O in flight):
            // keep it alive rather than let them read freed memory.
            std::mem::forget(self.c.clone());
        }
    }
}

impl Bdev for MirrorBdev {
    fn info(&self) -> &BdevInfo {
        &self.info
    }
    fn io_type_supported(&self, t: IoType) -> bool {
        let s = self.m.slots();
        // Compare-and-write: see `base::all_support`.
        t != IoType::CompareAndWrite && s.iter().flatten().all(|d| d.io_type_supported(t))
    }
    fn fua_supported(&self, t: IoType) -> bool {
        let s = self.m.slots();
        s.iter()
            .flatten()
            .all(|d| d.entry().bdev().fua_supported(t))
    }
    fn create_channel(&self) -> Result<Box<dyn BdevChannel>, BdevError> {
        let c = Rc::new(Chan {
            m: self.m.clone(),
            members: RefCell::new(Vec::new()),
            epoch: Cell::new(u64::MAX),
            next: Cell::new(0),
            inflight: Cell::new(0),
            uncounted: Arc::new(AtomicU64::new(0)),
        });
        {
            let mut l = self.m.chans.lock().unwrap_or_else(|p| p.into_inner());
            l.retain(|w| w.strong_count() > 0);
            l.push(Arc::downgrade(&c.uncounted));
        }
        c.refresh();
        Ok(Box::new(MirrorChannel { c }))
    }
    fn config_json(&self) -> Value {
        let c = &self.cfg;
        if c.superblock {
            // As SPDK: the members' superblocks hold the configuration.
            return Value::Null;
        }
        // The members it has now (after removals and additions).
        let members: Vec<String> = self
            .m
            .slots()
            .iter()
            .flatten()
            .map(|d| d.name().to_string())
            .collect();
        json!({"method": "bdev_raid_create", "params": {
            "name": c.name, "raid_level": "raid1", "base_bdevs": members,
            "uuid": self.info.uuid.to_string(), "superblock": false,
        }})
    }
    fn driver_info(&self) -> Value {
        let m = &self.m;
        let slots = m.slots();
        let list: Vec<Value> = slots
            .iter()
            .enumerate()
            .map(|(i, d)| match d {
                Some(d) => json!({"name": d.name(), "uuid": d.info().uuid.to_string(),
                    "is_configured": m.state(i) != FAILED, "data_offset": m.off,
                    "data_size": m.blocks()}),
                None => json!({"name": null, "uuid": null, "is_configured": false,
                    "data_offset": 0, "data_size": 0}),
            })
            .collect();
        let n = slots.len();
        let mut v = json!({
            "uuid": self.info.uuid.to_string(), "strip_size_kb": 0, "state": "online",
            "raid_level": "raid1", "superblock": self.cfg.superblock, "num_base_bdevs": n,
            "num_base_bdevs_discovered": slots.iter().flatten().count(),
            "num_base_bdevs_operational": m.online(), "base_bdevs_list": list,
        });
        let r = &m.rebuild;
        if r.running.load(Ordering::Acquire) {
            let slot = r.slot.load(Ordering::Relaxed) as usize;
            let done = r.done.load(Ordering::Relaxed);
            v["process"] = json!({"type": "rebuild",
                "target": slots.get(slot).and_then(|d| d.as_ref()).map(|d| d.name().to_string()),
                "progress": {"blocks": done, "percent": done * 100 / m.blocks().max(1)}});
        }
        json!({ "raid": v })
    }
}

/// Live mirrors, for remove/add base bdev.
static LIVE: base::Live<Mirror> = base::Live::new();

/// Opens member `name` for mirror `m`: a hot-remove empties its slot (the
/// array goes on degraded) instead of removing the array; a resize may
/// grow the array.
fn open_member(
    reg: &Registry,
    m: &Weak<Mirror>,
    name: &str,
    by: &str,
) -> Result<Desc, ControlError> {
    let (w, member) = (m.clone(), name.to_string());
    let d = reg.open(name, true, move |ev| {
        let Some(m) = w.upgrade() else { return };
        if ev == BdevEvent::Resize {
            return m.grow();
        }
        let i = m
            .slots()
            .iter()
            .position(|d| d.as_ref().is_some_and(|d| d.name() == member));
        if let Some(i) = i {
            m.clear_slot(i);
            m.note_membership();
        }
    })?;
    d.claim_exclusive(by)?;
    Ok(d)
}

/// Creates a raid1 array over `cfg.members` (the smallest member's size).
pub fn create(
    reg: &Registry,
    weak: &Weak<Registry>,
    cfg: RaidConfig,
) -> Result<Arc<BdevEntry>, ControlError> {
    base::check_free(reg, &cfg.name)?;
    debug_assert_eq!(cfg.level, Level::Raid1);
    let n = cfg.members.len();
    let mut err = None;
    let m = Arc::new_cyclic(|w: &Weak<Mirror>| {
        let mut slots = Vec::with_capacity(n);
        for name in &cfg.members {
            // Examine leaves a slot the array gave up (or a member missing
            // at a degraded start) empty.
            if name.is_empty() && cfg.existing.is_some() {
                slots.push(None);
                continue;
            }
            match open_member(reg, w, name, &cfg.name) {
                Ok(d) => slots.push(Some(d)),
                Err(e) => {
                    err.get_or_insert(e);
                }
            }
        }
        let bs = slots
            .iter()
            .flatten()
            .next()
            .map_or(512, |d| d.info().block_size);
        let off = match &cfg.existing {
            Some(sb) => sb.data_offset,
            None if cfg.superblock => super::sb::data_offset(bs as u64),
            None => 0,
        };
        let blocks = slots
            .iter()
            .flatten()
            .map(|d| d.num_blocks().saturating_sub(off))
            .min()
            .unwrap_or(0);
        Mirror {
            name: cfg.name.clone(),
            state: slots
                .iter()
                .map(|d| AtomicU8::new(if d.is_some() { ONLINE } else { FAILED }))
                .collect(),
            epoch: AtomicU64::new(0),
            slots: Mutex::new(slots),
            blocks: AtomicU64::new(blocks),
            top: OnceLock::new(),
            off,
            rebuild: Rebuild::default(),
            chans: Mutex::default(),
            records: OnceLock::new(),
        }
    });
    if let Some(e) = err {
        return Err(e);
    }
    let info = {
        let slots = m.slots();
        let descs: Vec<&Desc> = slots.iter().flatten().collect();
        base_info(&cfg, &descs, m.blocks())?
    };
    if m.online() == 0 {
        return Err(ControlError::invalid("base_bdevs", "no member"));
    }
    if m.blocks() == 0 {
        return Err(ControlError::invalid(
            "base_bdevs",
            "a member has no room for data",
        ));
    }
    let record = match &cfg.existing {
        Some(sb) => Some(sb.clone()),
        None if cfg.superblock => {
            let uuids = m.slots().iter().flatten().map(|d| d.info().uuid).collect();
            let s = super::new_superblock(&cfg, &info, m.off, uuids);
            super::sb::write_all(weak, &cfg.members, Some(&s))?;
            Some(s)
        }
        None => None,
    };
    let e = reg.register(Arc::new(MirrorBdev {
        info,
        cfg,
        m: m.clone(),
    }))?;
    LIVE.add(&e, &m);
    let _ = m.top.set(Arc::downgrade(&e));
    // A member grown while the array was being made (a no-op otherwise).
    e.resize(m.blocks());
    if let Some(s) = record {
        let _ = m.records.set(Records::new(weak.clone(), s));
        // Assembled without a member: the record gives its slot up.
        m.note_membership();
    }
    Ok(e)
}

fn base_info(cfg: &RaidConfig, d: &[&Desc], blocks: u64) -> Result<BdevInfo, ControlError> {
    let bs = d[0].info().block_size;
    if let Some(x) = d.iter().find(|x| x.info().block_size != bs) {
        return Err(ControlError::invalid(
            "base_bdevs",
            format!(
                "`{}` has block size {}, `{}` has {bs}",
                x.name(),
                x.info().block_size,
                d[0].name()
            ),
        ));
    }
    Ok(BdevInfo {
        name: cfg.name.clone(),
        uuid: cfg.uuid.unwrap_or_else(uuid::Uuid::new_v4),
        product_name: "Raid Volume".into(),
        module: "raid",
        block_size: bs,
        num_blocks: blocks,
        required_alignment: d
            .iter()
            .map(|x| x.info().required_alignment)
            .max()
            .unwrap_or(1),
        max_transfer_blocks: 0,
        optimal_boundary_blocks: 0,
        write_cache: d.iter().any(|x| x.info().write_cache),
        unmap_reads_zero: d.iter().all(|x| x.info().unmap_reads_zero),
        memory_resident: d.iter().all(|x| x.info().memory_resident),
    })
}
