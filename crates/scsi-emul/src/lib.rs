//! The emulated HBA: an LLD whose logical units are malloc bdevs executed
//! by the SCSI target core (`ustor-scsi-target`), with scriptable faults
//! per command (timeout, dropped completion, CHECK CONDITION with chosen
//! sense, BUSY, TASK SET FULL) and failing task management, so every error
//! handling path of the mid-layer is tested deterministically.
//!
//! Its devices answer whatever the target core does (SBC/SPC: INQUIRY and
//! VPD pages, READ CAPACITY, REPORT LUNS, READ/WRITE, UNMAP, WRITE SAME,
//! ...). LUNs can be added and removed while running (REPORTED LUNS DATA
//! HAS CHANGED goes to the target's other LUNs).
//!
//! - [`EmulHandle`] (this module): the test's `Send + Sync` handle, holding
//!   the LUN list, the fault script and the counters behind mutexes and
//!   atomics — a test device's cost, on the control side.
//! - `hba`: the LLD on the host's reactor, one [`LunTable`] per target.
//! - [`fault`]: the fault rules.
//!
//! One HBA per handle: unit attentions scripted through the handle are
//! delivered to the HBA that [`EmulHandle::lld`] built last.

pub mod fault;
mod hba;

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};

pub use fault::{Fault, FaultRule, TmfFaults};

use ustor_bdev::modules::{malloc, RamOpts};
use ustor_bdev::{Desc, Registry};
use ustor_runtime::IoBuf;
use ustor_scsi::inquiry::{BlockLimits, DeviceType};
use ustor_scsi::lld::{HostLimits, Lld};
use ustor_scsi::sense::{asc, Sense, SenseKey};
use ustor_scsi_target::{LuConfig, LunTable};

/// One emulated logical unit.
#[derive(Clone, Debug)]
pub struct EmulLun {
    pub target: u32,
    pub lun: u64,
    pub device_type: DeviceType,
    pub num_blocks: u64,
    pub block_size: u32,
    /// Thin provisioned (LBPME): UNMAP allowed.
    pub thin: bool,
    pub limits: BlockLimits,
}

impl EmulLun {
    /// A thin disk with UNMAP and WRITE SAME limits.
    pub fn disk(target: u32, lun: u64, num_blocks: u64, block_size: u32) -> EmulLun {
        EmulLun {
            target,
            lun,
            device_type: DeviceType::Disk,
            num_blocks,
            block_size,
            thin: true,
            limits: BlockLimits {
                max_xfer_blocks: 256,
                opt_xfer_blocks: 8,
                max_unmap_blocks: 1024,
                max_unmap_descriptors: 1,
                unmap_granularity_blocks: 1,
                max_write_same_blocks: 1024,
                ..Default::default()
            },
        }
    }

    /// What the unit says about itself (INQUIRY, VPD).
    fn lu_config(&self) -> LuConfig {
        let mut naa = [0x60, 0x01, 0x40, 0x5e, 0, 0, 0, 0];
        naa[4..8].copy_from_slice(&((self.target << 16) | self.lun as u32).to_be_bytes());
        LuConfig {
            device_type: self.device_type,
            vendor: "USTOR".into(),
            product: "EMUL DISK".into(),
            revision: "0001".into(),
            serial: format!("EMUL{}-{}", self.target, self.lun),
            naa,
            thin: self.thin,
            limits: self.limits,
        }
    }
}

/// A LUN and the malloc bdev behind it.
pub(crate) struct LunDef {
    pub(crate) cfg: EmulLun,
    pub(crate) desc: Arc<Desc>,
}

/// State shared between the HBA (on its reactor) and the test scripting it.
pub(crate) struct EmulShared {
    pub(crate) targets: Vec<u32>,
    /// Private to this HBA: its LUNs' malloc bdevs are not the user's.
    reg: Arc<Registry>,
    pub(crate) luns: Mutex<Vec<LunDef>>,
    /// Bumped on every LUN add/remove; the HBA rebuilds its tables.
    pub(crate) version: AtomicU64,
    /// Unit attentions for the HBA to post on its reactor.
    pub(crate) ua: Mutex<Vec<(u32, u64, Sense)>>,
    pub(crate) faults: Mutex<Vec<FaultRule>>,
    pub(crate) tmf: Mutex<TmfFaults>,
    pub(crate) ops: [AtomicU64; 256],
    pub(crate) aborts: AtomicU64,
    pub(crate) lun_resets: AtomicU64,
    pub(crate) host_resets: AtomicU64,
    pub(crate) limits: HostLimits,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

static NEXT_HBA: AtomicU64 = AtomicU64::new(0);

impl EmulShared {
    /// A malloc bdev for `cfg` in the private registry.
    fn make_lun(&self, hba: u64, cfg: EmulLun) -> LunDef {
        let name = format!("emul{hba}-t{}-l{}", cfg.target, cfg.lun);
        // A LUN added again after removal gets a fresh, zeroed medium.
        let _ = self.reg.delete(&name);
        let opts = RamOpts {
            name: name.clone(),
            num_blocks: cfg.num_blocks,
            block_size: cfg.block_size,
            uuid: None,
            optimal_io_boundary: 0,
            max_transfer_blocks: 0,
        };
        malloc::create(&self.reg, opts).expect("emulated LUN's malloc bdev");
        let desc = self.reg.open(&name, true, |_| {}).expect("open own bdev");
        LunDef {
            cfg,
            desc: Arc::new(desc),
        }
    }

    /// Queues REPORTED LUNS DATA HAS CHANGED for `target`'s LUNs but `except`.
    fn luns_changed(&self, luns: &[LunDef], target: u32, except: Option<u64>) {
        let s = Sense::new(SenseKey::UnitAttention, asc::REPORTED_LUNS_CHANGED);
        let mut ua = lock(&self.ua);
        for d in luns.iter().filter(|d| d.cfg.target == target) {
            if Some(d.cfg.lun) != except {
                ua.push((target, d.cfg.lun, s));
            }
        }
    }

    /// The LUN's bdev descriptor.
    fn desc(&self, target: u32, lun: u64) -> Option<Arc<Desc>> {
        let l = lock(&self.luns);
        l.iter()
            .find(|d| d.cfg.target == target && d.cfg.lun == lun)
            .map(|d| d.desc.clone())
    }
}

/// The test's handle on an emulated HBA (`Send + Sync`, cheap to clone).
#[derive(Clone)]
pub struct EmulHandle(Arc<EmulShared>, u64);

impl EmulHandle {
    /// An HBA with `targets` targets and these LUNs.
    pub fn new(targets: u32, luns: Vec<EmulLun>, limits: HostLimits) -> EmulHandle {
        let hba = NEXT_HBA.fetch_add(1, Ordering::Relaxed);
        let st = EmulShared {
            targets: (0..targets).collect(),
            reg: Registry::new(None),
            luns: Mutex::new(Vec::new()),
            version: AtomicU64::new(0),
            ua: Mutex::new(Vec::new()),
            faults: Mutex::new(Vec::new()),
            tmf: Mutex::new(TmfFaults::default()),
            ops: std::array::from_fn(|_| AtomicU64::new(0)),
            aborts: AtomicU64::new(0),
            lun_resets: AtomicU64::new(0),
            host_resets: AtomicU64::new(0),
            limits,
        };
        let defs: Vec<LunDef> = luns.into_iter().map(|c| st.make_lun(hba, c)).collect();
        {
            // A freshly powered-on device says so first (SPC).
            let mut ua = lock(&st.ua);
            for d in &defs {
                let s = Sense::new(SenseKey::UnitAttention, asc::POWER_ON_RESET);
                ua.push((d.cfg.target, d.cfg.lun, s));
            }
        }
        *lock(&st.luns) = defs;
        EmulHandle(Arc::new(st), hba)
    }

    /// The LLD to hand to `ScsiStack::add_host` (built on the reactor).
    pub fn lld(&self) -> Box<dyn Lld> {
        Box::new(hba::EmulHba::new(self.0.clone()))
    }

    pub fn push_fault(&self, r: FaultRule) {
        lock(&self.0.faults).push(r);
    }

    pub fn clear_faults(&self) {
        lock(&self.0.faults).clear();
    }

    pub fn set_tmf_faults(&self, f: TmfFaults) {
        *lock(&self.0.tmf) = f;
    }

    /// Commands with `opcode` the HBA received.
    pub fn count(&self, opcode: u8) -> u64 {
        self.0.ops[opcode as usize].load(Ordering::Relaxed)
    }

    /// (aborts, LUN resets, host resets) received.
    pub fn tmf_counts(&self) -> (u64, u64, u64) {
        (
            self.0.aborts.load(Ordering::Relaxed),
            self.0.lun_resets.load(Ordering::Relaxed),
            self.0.host_resets.load(Ordering::Relaxed),
        )
    }

    /// Adds a LUN; the target's other LUNs get REPORTED LUNS DATA HAS CHANGED.
    pub fn add_lun(&self, cfg: EmulLun) {
        let def = self.0.make_lun(self.1, cfg);
        let mut l = lock(&self.0.luns);
        self.0.luns_changed(&l, def.cfg.target, None);
        l.push(def);
        self.0.version.fetch_add(1, Ordering::Release);
    }

    /// Removes a LUN; the target's other LUNs get REPORTED LUNS DATA HAS CHANGED.
    pub fn remove_lun(&self, target: u32, lun: u64) {
        let mut l = lock(&self.0.luns);
        l.retain(|x| !(x.cfg.target == target && x.cfg.lun == lun));
        self.0.luns_changed(&l, target, Some(lun));
        self.0.version.fetch_add(1, Ordering::Release);
    }

    /// Sets a pending unit attention on one LUN.
    pub fn set_ua(&self, target: u32, lun: u64, s: Sense) {
        lock(&self.0.ua).push((target, lun, s));
    }

    /// A copy of `len` bytes at byte `offset` of a LUN's medium.
    pub fn read(&self, target: u32, lun: u64, offset: usize, len: usize) -> Option<Vec<u8>> {
        let desc = self.0.desc(target, lun)?;
        let (lba, blocks, skip) = cover(&desc, offset, len)?;
        let bs = desc.info().block_size as usize;
        let buf = IoBuf::heap(blocks as usize * bs);
        let ch = desc.channel().ok()?;
        let (r, buf) = run_inline(ch.read(lba, blocks, buf))?;
        r.ok()?;
        Some(buf[skip..skip + len].to_vec())
    }

    /// Writes bytes straight into a LUN's medium (read-modify-write of the
    /// blocks they cover).
    pub fn write(&self, target: u32, lun: u64, offset: usize, bytes: &[u8]) {
        let Some(desc) = self.0.desc(target, lun) else {
            return;
        };
        let Some((lba, blocks, skip)) = cover(&desc, offset, bytes.len()) else {
            return;
        };
        let Some(mut old) = self.read(
            target,
            lun,
            lba as usize * desc.info().block_size as usize,
            blocks as usize * desc.info().block_size as usize,
        ) else {
            return;
        };
        old[skip..skip + bytes.len()].copy_from_slice(bytes);
        let mut buf = IoBuf::heap(old.len());
        buf.copy_from_slice(&old);
        if let Ok(ch) = desc.channel() {
            let _ = run_inline(ch.write(lba, blocks, buf));
        }
    }
}

/// The blocks covering bytes [offset, offset+len): (lba, blocks, skip).
fn cover(desc: &Desc, offset: usize, len: usize) -> Option<(u64, u64, usize)> {
    let bs = desc.info().block_size as usize;
    let end = offset.checked_add(len)?;
    if end as u64 > desc.info().num_blocks * bs as u64 {
        return None;
    }
    let lba = offset / bs;
    let blocks = end.div_ceil(bs) - lba;
    Some((lba as u64, blocks as u64, offset - lba * bs))
}

struct Noop;
impl Wake for Noop {
    fn wake(self: Arc<Self>) {}
}

/// Runs a bdev future on the calling (test) thread: malloc I/O completes
/// within `submit`, so the future is ready on its first poll.
fn run_inline<F: Future>(f: F) -> Option<F::Output> {
    let w = Waker::from(Arc::new(Noop));
    let mut cx = Context::from_waker(&w);
    let mut f = pin!(f);
    match f.as_mut().poll(&mut cx) {
        Poll::Ready(v) => Some(v),
        Poll::Pending => None,
    }
}

/// The per-target tables the HBA runs commands on, built from `luns`;
/// units already in `old` keep their pending unit attention.
pub(crate) fn build_tables(
    targets: &[u32],
    luns: &[LunDef],
    old: &[(u32, std::rc::Rc<LunTable>)],
) -> Vec<(u32, std::rc::Rc<LunTable>)> {
    targets
        .iter()
        .map(|&t| {
            let prev = old.iter().find(|(x, _)| *x == t).map(|(_, tb)| tb);
            let units = luns.iter().filter(|d| d.cfg.target == t).filter_map(|d| {
                let lu = ustor_scsi_target::Lun::open(d.cfg.lu_config(), &d.desc).ok()?;
                lu.set_ua(prev.and_then(|p| p.get(d.cfg.lun)).and_then(|x| x.ua()));
                Some((d.cfg.lun, lu))
            });
            (t, std::rc::Rc::new(LunTable::from_luns(units)))
        })
        .collect()
}
