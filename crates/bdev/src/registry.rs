//! The bdev registry: names, aliases, UUIDs, open descriptors, claims,
//! hot-remove, and the per-reactor channel caches.
//!
//! Control-plane operations take a mutex here; the I/O path never does: a
//! descriptor hands out a channel from a thread-local cache, and I/O only
//! reads the entry's `removed` flag (a plain atomic load).

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use ustor_runtime::RuntimeHandle;

use crate::channel::{ChannelCore, IoChannel};
use crate::device::{Bdev, BdevModule};
use crate::error::{BdevError, ControlError};
use crate::qos::{QosLimits, QosShared, QosUpdate};
use crate::stats::IoStat;
use crate::types::{BdevEvent, BdevInfo};

type EventFn = Arc<dyn Fn(BdevEvent) + Send + Sync>;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A registered bdev: the driver's device plus registry state.
pub struct BdevEntry {
    pub(crate) id: u64,
    pub(crate) bdev: Arc<dyn Bdev>,
    removed: AtomicBool,
    histograms: AtomicBool,
    /// The size now: the driver's `info().num_blocks` until a resize
    /// ([`BdevEntry::resize`]). Read per I/O with a relaxed load.
    num_blocks: AtomicU64,
    state: Mutex<EntryState>,
}

/// A module's claim on a bdev. Targets take shared claims (several targets
/// may export one bdev, as SPDK's NVMe-oF and NBD do); a virtual bdev built
/// on a base bdev takes an exclusive one. Any claim blocks deletion.
struct Claim {
    opener: u64,
    by: String,
    exclusive: bool,
}

#[derive(Default)]
struct EntryState {
    aliases: Vec<String>,
    claims: Vec<Claim>,
    openers: Vec<(u64, EventFn)>,
    /// QoS limits, when any is set (see [`crate::qos`]).
    qos: Option<Arc<QosShared>>,
}

impl BdevEntry {
    /// Whether per-I/O latency histograms are recorded (read per I/O with
    /// a plain load).
    pub(crate) fn histograms_on(&self) -> bool {
        self.histograms.load(Ordering::Relaxed)
    }

    /// SPDK's `bdev_enable_histogram`.
    pub fn set_histograms(&self, on: bool) {
        self.histograms.store(on, Ordering::Relaxed);
    }

    pub fn histograms_enabled(&self) -> bool {
        self.histograms_on()
    }

    pub(crate) fn is_removed(&self) -> bool {
        self.removed.load(Ordering::Relaxed)
    }
    pub(crate) fn removed_flag(&self) -> *const AtomicBool {
        &self.removed
    }
    fn lock(&self) -> MutexGuard<'_, EntryState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
    pub fn info(&self) -> &BdevInfo {
        self.bdev.info()
    }

    /// The size in blocks now (`info().num_blocks` is the size at
    /// registration; a driver whose device grows or shrinks calls
    /// [`BdevEntry::resize`]).
    pub fn num_blocks(&self) -> u64 {
        self.num_blocks.load(Ordering::Relaxed)
    }

    /// The device now has `num_blocks` blocks: later I/O is checked against
    /// the new size and every opener hears [`BdevEvent::Resize`] (targets
    /// tell their hosts: an NVMe AEN, the size at the next NBD connect).
    /// Returns whether the size changed.
    pub fn resize(&self, num_blocks: u64) -> bool {
        if self.num_blocks.swap(num_blocks, Ordering::Relaxed) == num_blocks {
            return false;
        }
        tracing::info!(bdev = %self.info().name, num_blocks, "bdev resized");
        let openers: Vec<EventFn> = self.lock().openers.iter().map(|(_, f)| f.clone()).collect();
        for f in openers {
            f(BdevEvent::Resize);
        }
        true
    }

    pub fn bdev(&self) -> &Arc<dyn Bdev> {
        &self.bdev
    }
    pub fn aliases(&self) -> Vec<String> {
        self.lock().aliases.clone()
    }
    /// Who holds claims on the bdev (comma-separated), if anyone.
    pub fn claimed_by(&self) -> Option<String> {
        let s = self.lock();
        (!s.claims.is_empty()).then(|| {
            s.claims
                .iter()
                .map(|c| c.by.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        })
    }

    /// Who holds claims on the bdev, one name per claim (a virtual bdev's
    /// claim names the virtual bdev).
    pub fn claimers(&self) -> Vec<String> {
        self.lock().claims.iter().map(|c| c.by.clone()).collect()
    }

    /// Whether an exclusive claim is held.
    pub fn claimed_exclusive(&self) -> bool {
        self.lock().claims.iter().any(|c| c.exclusive)
    }
    pub fn open_count(&self) -> usize {
        self.lock().openers.len()
    }

    /// The QoS limits set (all 0: none), SPDK's `assigned_rate_limits`.
    pub fn qos_limits(&self) -> QosLimits {
        self.lock()
            .qos
            .as_ref()
            .map(|q| q.limits())
            .unwrap_or_default()
    }

    pub(crate) fn qos_shared(&self) -> Option<Arc<QosShared>> {
        self.lock().qos.clone()
    }
}

impl Drop for BdevEntry {
    fn drop(&mut self) {
        self.bdev.destruct();
    }
}

thread_local! {
    // bdev id -> this reactor's channel. Filled lazily by `Desc::channel`.
    static CHANNELS: RefCell<HashMap<u64, Rc<ChannelCore>>> = RefCell::new(HashMap::with_capacity(64));
}

/// An open descriptor: what targets and virtual bdevs hold.
pub struct Desc {
    entry: Arc<BdevEntry>,
    writable: bool,
    opener: u64,
}

impl Desc {
    pub fn info(&self) -> &BdevInfo {
        self.entry.bdev.info()
    }
    /// The size in blocks now (see [`BdevEntry::num_blocks`]).
    pub fn num_blocks(&self) -> u64 {
        self.entry.num_blocks()
    }
    pub fn name(&self) -> &str {
        &self.entry.bdev.info().name
    }
    pub fn writable(&self) -> bool {
        self.writable
    }
    pub fn entry(&self) -> &Arc<BdevEntry> {
        &self.entry
    }
    pub fn io_type_supported(&self, t: crate::IoType) -> bool {
        self.entry.bdev.io_type_supported(t)
    }

    /// This reactor's channel for the bdev, created on first use.
    pub fn channel(&self) -> Result<IoChannel, BdevError> {
        if self.entry.is_removed() {
            return Err(BdevError::Removed);
        }
        let id = self.entry.id;
        let core = CHANNELS.with(|c| c.borrow().get(&id).cloned());
        let core = match core {
            Some(c) => c,
            None => {
                let driver = self.entry.bdev.create_channel()?;
                let core = Rc::new(ChannelCore::new(self.entry.clone(), driver));
                core.sync_qos();
                let first = CHANNELS.with(|c| {
                    let mut c = c.borrow_mut();
                    c.insert(id, core.clone());
                    c.len() == 1
                });
                if first && ustor_runtime::is_reactor_thread() {
                    // Channels hold driver resources tied to the reactor
                    // (ring handlers, pollers): drop them before it exits.
                    ustor_runtime::on_reactor_exit(|| {
                        let all: Vec<_> = CHANNELS.with(|c| c.borrow_mut().drain().collect());
                        drop(all);
                    });
                }
                core
            }
        };
        Ok(IoChannel {
            core,
            writable: self.writable,
        })
    }

    /// A shared claim by a target (`by` names it): the bdev cannot be
    /// deleted while held, nor claimed exclusively; other targets may share.
    pub fn claim(&self, by: &str) -> Result<(), ControlError> {
        self.claim_with(by, false)
    }

    /// An exclusive claim (a virtual bdev consuming this one): refused if
    /// anyone holds a claim, and blocks every other claim.
    pub fn claim_exclusive(&self, by: &str) -> Result<(), ControlError> {
        self.claim_with(by, true)
    }

    fn claim_with(&self, by: &str, exclusive: bool) -> Result<(), ControlError> {
        let mut s = self.entry.lock();
        if let Some(c) = s.claims.iter().find(|c| c.exclusive || exclusive) {
            return Err(ControlError::Claimed {
                name: self.name().to_string(),
                by: c.by.clone(),
            });
        }
        s.claims.push(Claim {
            opener: self.opener,
            by: by.to_string(),
            exclusive,
        });
        Ok(())
    }

    /// Releases this descriptor's claims (also done when it is dropped).
    pub fn release_claim(&self) {
        self.entry.lock().claims.retain(|c| c.opener != self.opener);
    }
}

impl Drop for Desc {
    fn drop(&mut self) {
        let mut s = self.entry.lock();
        s.openers.retain(|(id, _)| *id != self.opener);
        s.claims.retain(|c| c.opener != self.opener);
    }
}

#[derive(Default)]
struct Inner {
    by_name: HashMap<String, Arc<BdevEntry>>,
    order: Vec<String>,
}

/// All bdevs of one ustor instance.
pub struct Registry {
    inner: Mutex<Inner>,
    modules: Mutex<Vec<Arc<dyn BdevModule>>>,
    runtime: Option<RuntimeHandle>,
}

impl Registry {
    /// A registry whose channels live on `runtime`'s reactors (needed to drop
    /// channels on delete and to gather iostat).
    pub fn new(runtime: Option<RuntimeHandle>) -> Arc<Registry> {
        Arc::new(Registry {
            inner: Mutex::default(),
            modules: Mutex::default(),
            runtime,
        })
    }

    /// The runtime its channels live on (module control paths that must do
    /// I/O, such as reading a raid superblock in `examine`).
    pub fn runtime(&self) -> Option<&RuntimeHandle> {
        self.runtime.as_ref()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a module to the table; refused if one of that name is there.
    pub fn add_module(&self, m: Arc<dyn BdevModule>) -> Result<(), ControlError> {
        let mut t = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        if t.iter().any(|x| x.name() == m.name()) {
            return Err(ControlError::Exists(format!("module {}", m.name())));
        }
        t.push(m);
        Ok(())
    }

    /// The module table, in registration order.
    pub fn modules(&self) -> Vec<Arc<dyn BdevModule>> {
        self.modules
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The module named `name`.
    pub fn module(&self, name: &str) -> Option<Arc<dyn BdevModule>> {
        self.modules
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|m| m.name() == name)
            .cloned()
    }

    /// Registers a device under its name (and UUID as an alias).
    pub fn register(&self, bdev: Arc<dyn Bdev>) -> Result<Arc<BdevEntry>, ControlError> {
        let name = bdev.info().name.clone();
        if name.is_empty() {
            return Err(ControlError::invalid("name", "must not be empty"));
        }
        let uuid = bdev.info().uuid.to_string();
        let mut g = self.lock();
        if g.by_name.contains_key(&name) || g.by_name.contains_key(&uuid) {
            return Err(ControlError::Exists(name));
        }
        let entry = Arc::new(BdevEntry {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            num_blocks: AtomicU64::new(bdev.info().num_blocks),
            bdev,
            removed: AtomicBool::new(false),
            histograms: AtomicBool::new(false),
            state: Mutex::default(),
        });
        g.by_name.insert(name.clone(), entry.clone());
        g.by_name.insert(uuid, entry.clone());
        tracing::info!(bdev = %name, module = entry.info().module, "bdev {name} created ({})", entry.info().module);
        g.order.push(name);
        drop(g);
        // Outside the lock: a module's examine opens and claims bdevs.
        for m in self.modules() {
            m.examine(self, &entry);
        }
        Ok(entry)
    }

    /// Adds an alias (another name that opens the same bdev).
    pub fn add_alias(&self, name: &str, alias: &str) -> Result<(), ControlError> {
        let mut g = self.lock();
        if g.by_name.contains_key(alias) {
            return Err(ControlError::Exists(alias.to_string()));
        }
        let e = g
            .by_name
            .get(name)
            .cloned()
            .ok_or_else(|| ControlError::NotFound(name.to_string()))?;
        e.lock().aliases.push(alias.to_string());
        g.by_name.insert(alias.to_string(), e);
        Ok(())
    }

    pub fn get(&self, name: &str) -> Option<Arc<BdevEntry>> {
        self.lock().by_name.get(name).cloned()
    }

    /// Every bdev, in creation order.
    pub fn list(&self) -> Vec<Arc<BdevEntry>> {
        let g = self.lock();
        g.order
            .iter()
            .filter_map(|n| g.by_name.get(n).cloned())
            .collect()
    }

    /// Opens a bdev by name, alias or UUID. `on_event` hears hot-remove
    /// and resize.
    pub fn open(
        &self,
        name: &str,
        writable: bool,
        on_event: impl Fn(BdevEvent) + Send + Sync + 'static,
    ) -> Result<Desc, ControlError> {
        let e = self
            .get(name)
            .ok_or_else(|| ControlError::NotFound(name.to_string()))?;
        if e.is_removed() {
            return Err(ControlError::NotFound(name.to_string()));
        }
        let opener = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        e.lock().openers.push((opener, Arc::new(on_event)));
        Ok(Desc {
            entry: e,
            writable,
            opener,
        })
    }

    /// Deletes a bdev the user asked to delete: refused while claimed.
    pub fn delete(&self, name: &str) -> Result<(), ControlError> {
        let e = self
            .get(name)
            .ok_or_else(|| ControlError::NotFound(name.to_string()))?;
        if let Some(by) = e.claimed_by() {
            return Err(ControlError::Claimed {
                name: name.to_string(),
                by,
            });
        }
        self.remove(&e);
        Ok(())
    }

    /// The device is gone (hot-remove): unregister even if claimed, fail its
    /// outstanding and future I/O with `Removed`, notify every opener.
    pub fn hot_remove(&self, name: &str) -> Result<(), ControlError> {
        let e = self
            .get(name)
            .ok_or_else(|| ControlError::NotFound(name.to_string()))?;
        self.remove(&e);
        Ok(())
    }

    fn remove(&self, e: &Arc<BdevEntry>) {
        e.removed.store(true, Ordering::Release);
        {
            let mut g = self.lock();
            g.by_name.retain(|_, v| !Arc::ptr_eq(v, e));
            let name = &e.info().name;
            g.order.retain(|n| n != name);
        }
        tracing::info!(bdev = %e.info().name, "bdev {} removed", e.info().name);
        let openers: Vec<EventFn> = e.lock().openers.iter().map(|(_, f)| f.clone()).collect();
        for f in openers {
            f(BdevEvent::Remove);
        }
        // Drop the per-reactor channels so the driver's resources go with the
        // device (the uring driver closes its file when its last channel and
        // the entry are gone).
        let id = e.id;
        if let Some(rt) = &self.runtime {
            if ustor_runtime::is_reactor_thread() {
                let _ = rt.for_each_reactor(Arc::new(move || drop_channel(id)), || {});
            } else {
                let _ = rt.call_all(move |_| drop_channel(id));
            }
        }
    }

    /// SPDK's `bdev_set_qos_limit`: sets, changes or (all 0) removes the
    /// bdev's QoS limits; every reactor's channel takes up or drops its
    /// share before this returns (from a control thread) or soon after
    /// (from a reactor). Queued I/O of removed limits is released.
    pub fn set_qos_limits(&self, name: &str, u: &QosUpdate) -> Result<QosLimits, ControlError> {
        let e = self
            .get(name)
            .ok_or_else(|| ControlError::NotFound(name.to_string()))?;
        let (limits, changed) = {
            let mut s = e.lock();
            let old = s.qos.as_ref().map(|q| q.limits()).unwrap_or_default();
            let new = old.updated(u)?;
            match (&s.qos, new.is_unlimited()) {
                (Some(q), false) => {
                    q.set_limits(new);
                    (new, false)
                }
                (None, false) => {
                    s.qos = Some(Arc::new(QosShared::new(new)));
                    (new, true)
                }
                (Some(_), true) => {
                    s.qos = None;
                    (new, true)
                }
                (None, true) => (new, false),
            }
        };
        if changed {
            let id = e.id;
            let sync = move || {
                let ch = CHANNELS.with(|c| c.borrow().get(&id).cloned());
                if let Some(ch) = ch {
                    ch.sync_qos();
                }
            };
            if let Some(rt) = &self.runtime {
                if ustor_runtime::is_reactor_thread() {
                    let _ = rt.for_each_reactor(Arc::new(sync), || {});
                } else {
                    rt.call_all(move |_| sync())
                        .map_err(|err| ControlError::Os {
                            what: "applying QoS limits".into(),
                            err: std::io::Error::other(err),
                        })?;
                }
            }
        }
        Ok(limits)
    }

    /// Merged iostat of one bdev over every reactor.
    pub fn iostat(&self, name: &str) -> Result<IoStat, ControlError> {
        let e = self
            .get(name)
            .ok_or_else(|| ControlError::NotFound(name.to_string()))?;
        let id = e.id;
        let mut total = IoStat::default();
        if let Some(rt) = &self.runtime {
            let parts = rt
                .call_all(move |_| CHANNELS.with(|c| c.borrow().get(&id).map(|ch| ch.snapshot())))
                .map_err(|err| ControlError::Os {
                    what: "gathering iostat".into(),
                    err: std::io::Error::other(err),
                })?;
            for p in parts.into_iter().flatten() {
                total.merge(&p);
            }
        }
        Ok(total)
    }
}

fn drop_channel(id: u64) {
    let ch = CHANNELS.with(|c| c.borrow_mut().remove(&id));
    // I/O still queued for QoS tokens goes now (and fails: removed); the
    // core itself lives on while those I/Os hold it.
    if let Some(ch) = &ch {
        ch.sync_qos();
    }
    drop(ch);
}
