//! The emulated HBA: an LLD backed by RAM, with scriptable faults per
//! command (timeout, dropped completion, CHECK CONDITION with chosen sense,
//! BUSY, TASK SET FULL) and failing task management, so every error
//! handling path is tested deterministically with the real mid-layer.
//!
//! Its devices are SBC disks that answer INQUIRY (standard and VPD 0x00,
//! 0x80, 0x83, 0xB0, 0xB1), READ CAPACITY(16), REPORT LUNS, TEST UNIT
//! READY, READ/WRITE(10/16), SYNCHRONIZE CACHE, UNMAP and WRITE SAME(16).
//! LUNs can be added and removed while running (REPORTED LUNS DATA HAS
//! CHANGED goes to the target's other LUNs).
//!
//! It is a test device: its state sits behind mutexes so a test thread can
//! script it, a cost a production LLD's data path does not pay.

mod exec;
pub mod fault;

use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

pub use fault::{Fault, FaultRule, TmfFaults};

use crate::inquiry::{BlockLimits, DeviceType};
use crate::lld::{
    Completion, HostLimits, Lld, LocalFuture, Nexus, QueueError, ScsiCmd, Tag, TargetAddr,
    TmfResult, TransportError,
};
use crate::sense::{asc, Sense, SenseKey};
use crate::status::ScsiStatus;

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
}

pub(crate) struct LunState {
    pub(crate) cfg: EmulLun,
    pub(crate) data: Vec<u8>,
    /// A unit attention reported with the next command (then cleared).
    pub(crate) ua: Option<Sense>,
}

/// State shared between the HBA (on its reactor) and the test scripting it.
pub struct EmulShared {
    targets: Vec<u32>,
    pub(crate) luns: Mutex<Vec<LunState>>,
    faults: Mutex<Vec<FaultRule>>,
    tmf: Mutex<TmfFaults>,
    ops: [AtomicU64; 256],
    aborts: AtomicU64,
    lun_resets: AtomicU64,
    host_resets: AtomicU64,
    limits: HostLimits,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The test's handle on an emulated HBA (`Send + Sync`, cheap to clone).
#[derive(Clone)]
pub struct EmulHandle(Arc<EmulShared>);

impl EmulHandle {
    /// An HBA with `targets` targets and these LUNs.
    pub fn new(targets: u32, luns: Vec<EmulLun>, limits: HostLimits) -> EmulHandle {
        let luns = luns
            .into_iter()
            .map(|cfg| LunState {
                data: vec![0; (cfg.num_blocks * cfg.block_size as u64) as usize],
                cfg,
                // A freshly powered-on device says so first (SPC).
                ua: Some(Sense::new(SenseKey::UnitAttention, asc::POWER_ON_RESET)),
            })
            .collect();
        EmulHandle(Arc::new(EmulShared {
            targets: (0..targets).collect(),
            luns: Mutex::new(luns),
            faults: Mutex::new(Vec::new()),
            tmf: Mutex::new(TmfFaults::default()),
            ops: std::array::from_fn(|_| AtomicU64::new(0)),
            aborts: AtomicU64::new(0),
            lun_resets: AtomicU64::new(0),
            host_resets: AtomicU64::new(0),
            limits,
        }))
    }

    /// The LLD to hand to `ScsiStack::add_host` (built on the reactor).
    pub fn lld(&self) -> Box<dyn Lld> {
        Box::new(EmulHba {
            st: self.0.clone(),
            done: RefCell::new(VecDeque::with_capacity(self.0.limits.can_queue as usize)),
            hung: RefCell::new(Vec::new()),
        })
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
        let mut l = lock(&self.0.luns);
        for x in l.iter_mut().filter(|x| x.cfg.target == cfg.target) {
            x.ua = Some(Sense::new(
                SenseKey::UnitAttention,
                asc::REPORTED_LUNS_CHANGED,
            ));
        }
        l.push(LunState {
            data: vec![0; (cfg.num_blocks * cfg.block_size as u64) as usize],
            cfg,
            ua: None,
        });
    }

    /// Removes a LUN; the target's other LUNs get REPORTED LUNS DATA HAS CHANGED.
    pub fn remove_lun(&self, target: u32, lun: u64) {
        let mut l = lock(&self.0.luns);
        l.retain(|x| !(x.cfg.target == target && x.cfg.lun == lun));
        for x in l.iter_mut().filter(|x| x.cfg.target == target) {
            x.ua = Some(Sense::new(
                SenseKey::UnitAttention,
                asc::REPORTED_LUNS_CHANGED,
            ));
        }
    }

    /// Sets a pending unit attention on one LUN.
    pub fn set_ua(&self, target: u32, lun: u64, s: Sense) {
        let mut l = lock(&self.0.luns);
        if let Some(x) = l
            .iter_mut()
            .find(|x| x.cfg.target == target && x.cfg.lun == lun)
        {
            x.ua = Some(s);
        }
    }

    /// A copy of `len` bytes at byte `offset` of a LUN's medium.
    pub fn read(&self, target: u32, lun: u64, offset: usize, len: usize) -> Option<Vec<u8>> {
        let l = lock(&self.0.luns);
        let x = l
            .iter()
            .find(|x| x.cfg.target == target && x.cfg.lun == lun)?;
        x.data.get(offset..offset + len).map(|b| b.to_vec())
    }

    /// Writes bytes straight into a LUN's medium.
    pub fn write(&self, target: u32, lun: u64, offset: usize, bytes: &[u8]) {
        let mut l = lock(&self.0.luns);
        if let Some(x) = l
            .iter_mut()
            .find(|x| x.cfg.target == target && x.cfg.lun == lun)
        {
            if let Some(d) = x.data.get_mut(offset..offset + bytes.len()) {
                d.copy_from_slice(bytes);
            }
        }
    }
}

struct Done {
    tag: Tag,
    status: ScsiStatus,
    sense: [u8; 18],
    sense_len: usize,
    resid: u32,
}

/// The LLD half, owned by the host's reactor.
struct EmulHba {
    st: Arc<EmulShared>,
    done: RefCell<VecDeque<Done>>,
    /// Commands that will never complete by themselves (timeouts, drops).
    hung: RefCell<Vec<(Tag, Nexus)>>,
}

impl EmulHba {
    fn fault_for(&self, cmd: &ScsiCmd) -> Option<Fault> {
        let mut f = lock(&self.st.faults);
        f.iter_mut()
            .find_map(|r| r.hit(cmd.nexus.lun, cmd.cdb.opcode()))
    }

    fn push(&self, tag: Tag, status: ScsiStatus, sense: Option<Sense>, resid: u32) {
        let mut d = Done {
            tag,
            status,
            sense: [0; 18],
            sense_len: 0,
            resid,
        };
        if let Some(s) = sense {
            d.sense_len = s.encode_fixed(&mut d.sense);
        }
        self.done.borrow_mut().push_back(d);
    }
}

impl Lld for EmulHba {
    fn name(&self) -> &str {
        "emul"
    }

    fn limits(&self) -> HostLimits {
        self.st.limits
    }

    fn queuecommand(&self, cmd: &ScsiCmd) -> Result<(), QueueError> {
        if self.done.borrow().len() + self.hung.borrow().len() >= self.st.limits.can_queue as usize
        {
            return Err(QueueError::HostBusy);
        }
        self.st.ops[cmd.cdb.opcode() as usize].fetch_add(1, Ordering::Relaxed);
        match self.fault_for(cmd) {
            Some(Fault::Timeout) => self.hung.borrow_mut().push((cmd.tag, cmd.nexus)),
            Some(Fault::DropCompletion) => {
                let _ = exec::execute(&self.st, cmd);
                self.hung.borrow_mut().push((cmd.tag, cmd.nexus));
            }
            Some(Fault::Check(s)) => {
                self.push(cmd.tag, ScsiStatus::CheckCondition, Some(s), cmd.data_len)
            }
            Some(Fault::Busy) => self.push(cmd.tag, ScsiStatus::Busy, None, cmd.data_len),
            Some(Fault::TaskSetFull) => {
                self.push(cmd.tag, ScsiStatus::TaskSetFull, None, cmd.data_len)
            }
            None => {
                let (status, sense, resid) = exec::execute(&self.st, cmd);
                self.push(cmd.tag, status, sense, resid);
            }
        }
        Ok(())
    }

    fn poll(&self, budget: usize, done: &mut dyn FnMut(Completion<'_>)) -> usize {
        let mut n = 0;
        while n < budget {
            let Some(d) = self.done.borrow_mut().pop_front() else {
                break;
            };
            done(Completion {
                tag: d.tag,
                status: Ok(d.status),
                sense: &d.sense[..d.sense_len],
                resid: d.resid,
            });
            n += 1;
        }
        n
    }

    fn scan(&self) -> LocalFuture<'_, Result<Vec<TargetAddr>, TransportError>> {
        let t = self
            .st
            .targets
            .iter()
            .map(|&t| TargetAddr {
                channel: 0,
                target: t,
                name: format!("emul-target{t}"),
                luns: Vec::new(),
            })
            .collect();
        Box::pin(async move { Ok(t) })
    }

    fn abort(&self, tag: Tag, _nexus: Nexus) -> LocalFuture<'_, TmfResult> {
        self.st.aborts.fetch_add(1, Ordering::Relaxed);
        let r = if lock(&self.st.tmf).abort_fails {
            TmfResult::Failed
        } else {
            self.hung.borrow_mut().retain(|(t, _)| *t != tag);
            self.done.borrow_mut().retain(|d| d.tag != tag);
            TmfResult::Success
        };
        Box::pin(async move { r })
    }

    fn device_reset(&self, nexus: Nexus) -> LocalFuture<'_, TmfResult> {
        self.st.lun_resets.fetch_add(1, Ordering::Relaxed);
        let r = if lock(&self.st.tmf).device_reset_fails {
            TmfResult::Failed
        } else {
            self.hung.borrow_mut().retain(|(_, n)| *n != nexus);
            let mut l = lock(&self.st.luns);
            if let Some(x) = l
                .iter_mut()
                .find(|x| x.cfg.target == nexus.target && x.cfg.lun == nexus.lun)
            {
                x.ua = Some(Sense::new(SenseKey::UnitAttention, asc::POWER_ON_RESET));
            }
            TmfResult::Success
        };
        Box::pin(async move { r })
    }

    fn host_reset(&self) -> LocalFuture<'_, TmfResult> {
        self.st.host_resets.fetch_add(1, Ordering::Relaxed);
        let r = if lock(&self.st.tmf).host_reset_fails {
            TmfResult::Failed
        } else {
            self.hung.borrow_mut().clear();
            self.done.borrow_mut().clear();
            for x in lock(&self.st.luns).iter_mut() {
                x.ua = Some(Sense::new(SenseKey::UnitAttention, asc::POWER_ON_RESET));
            }
            TmfResult::Success
        };
        Box::pin(async move { r })
    }

    fn info(&self) -> serde_json::Value {
        serde_json::json!({"targets": self.st.targets.len()})
    }
}
