//! A remote controller: shared state (read by every reactor's I/O queues
//! through atomics), the admin queue ([`adminq`], its client, on the
//! connection driver with [`link`] as its protocol), what every queue's
//! connection starts with ([`handshake`]), and the supervisor task on
//! reactor 0
//! that brings the controller up, sends keep alives, and resets it
//! (reconnects the admin queue, bumping the generation the I/O queues
//! follow) when any queue reports the connection lost.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ustor_bdev::Registry;

use super::qpair::{QpCounters, QpStats};
use super::{
    AttachParams, ControllerInfo, CtrlrPathInfo, HostId, InitiatorError, TransportId,
    DEFAULT_HOSTNQN,
};
use crate::wire::*;

mod adminq;
pub(crate) mod handshake;
mod link;

/// Supervisor tick: how fast a reset request is noticed.
const TICK: Duration = Duration::from_millis(10);
/// Bound on one connect + initialize attempt.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Admin commands in flight at once (we send one at a time).
const ADMIN_SQSIZE: u16 = 31;
/// Largest admin data transfer we accept (Identify is 4 KiB).
const ADMIN_BUF: usize = 16 << 10;

/// Controller states, as `bdev_nvme_get_controllers` names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum CtrlrState {
    /// Connecting for the first time.
    Starting = 0,
    /// Admin queue up; I/O queues may connect.
    Enabled = 1,
    /// Lost; reconnecting until ctrlr_loss_timeout_sec.
    Resetting = 2,
    /// Gave up: I/O fails.
    Failed = 3,
    /// Detached.
    Deleting = 4,
}

impl CtrlrState {
    fn from_u8(v: u8) -> CtrlrState {
        match v {
            0 => CtrlrState::Starting,
            1 => CtrlrState::Enabled,
            2 => CtrlrState::Resetting,
            3 => CtrlrState::Failed,
            _ => CtrlrState::Deleting,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            CtrlrState::Starting => "starting",
            CtrlrState::Enabled => "enabled",
            CtrlrState::Resetting => "resetting",
            CtrlrState::Failed => "failed",
            CtrlrState::Deleting => "deleting",
        }
    }
}

/// An active namespace.
#[derive(Clone, Copy, Debug)]
pub(crate) struct NsInfo {
    pub nsid: u32,
    pub num_blocks: u64,
    pub block_size: u32,
    pub nguid: [u8; 16],
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) struct Ctrlr {
    pub p: AttachParams,
    pub addr: SocketAddr,
    pub hostnqn: String,
    pub hostid: [u8; 16],
    state: AtomicU8,
    /// Bumped on every (re)connect of the admin queue; an I/O queue that
    /// connected under an older generation must reconnect.
    gen: AtomicU64,
    cntlid: AtomicU16,
    reset_req: AtomicBool,
    stopping: AtomicBool,
    resets: AtomicU64,
    /// In-capsule data bytes the controller takes (IOCCSZ * 16 - 64).
    icd_max: AtomicU32,
    /// Largest transfer (MDTS), bytes; 0 = no limit.
    mdts_bytes: AtomicU32,
    /// I/O queues the controller granted (Set Features Number of Queues);
    /// qids beyond it are not handed out.
    granted_queues: AtomicU32,
    qids: Mutex<Vec<bool>>,
    qps: Mutex<Vec<Arc<QpCounters>>>,
    bdevs: Mutex<Option<(Arc<Registry>, Vec<String>)>>,
}

/// Resolves traddr/trsvcid.
pub(crate) fn resolve(p: &AttachParams) -> Result<SocketAddr, InitiatorError> {
    let port: u16 = p.trsvcid.parse().map_err(|_| InitiatorError::Invalid {
        param: "trsvcid",
        why: "not a port".into(),
    })?;
    (p.traddr.as_str(), port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| InitiatorError::Invalid {
            param: "traddr",
            why: format!("cannot resolve {}", p.traddr),
        })
}

impl Ctrlr {
    pub fn new(p: AttachParams, addr: SocketAddr) -> Ctrlr {
        let hostnqn = p.hostnqn.clone().unwrap_or_else(|| DEFAULT_HOSTNQN.into());
        // A stable host identifier derived from the host NQN.
        let mut hostid = [0u8; 16];
        hostid[..4].copy_from_slice(&crc(hostnqn.as_bytes()).to_le_bytes());
        hostid[4..8].copy_from_slice(&crc(p.name.as_bytes()).to_le_bytes());
        let nq = p.num_io_queues.unwrap_or(64).clamp(1, 1024) as usize;
        Ctrlr {
            p,
            addr,
            hostnqn,
            hostid,
            state: AtomicU8::new(CtrlrState::Starting as u8),
            gen: AtomicU64::new(0),
            cntlid: AtomicU16::new(0),
            reset_req: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            resets: AtomicU64::new(0),
            icd_max: AtomicU32::new(0),
            mdts_bytes: AtomicU32::new(0),
            granted_queues: AtomicU32::new(nq as u32),
            qids: Mutex::new(vec![false; nq]),
            qps: Mutex::new(Vec::new()),
            bdevs: Mutex::new(None),
        }
    }

    pub fn state(&self) -> CtrlrState {
        CtrlrState::from_u8(self.state.load(Ordering::Acquire))
    }
    fn set_state(&self, s: CtrlrState) {
        self.state.store(s as u8, Ordering::Release);
    }
    pub fn gen(&self) -> u64 {
        self.gen.load(Ordering::Acquire)
    }
    pub fn cntlid(&self) -> u16 {
        self.cntlid.load(Ordering::Acquire)
    }
    pub fn icd_max(&self) -> u32 {
        self.icd_max.load(Ordering::Relaxed)
    }
    pub fn mdts_bytes(&self) -> u32 {
        self.mdts_bytes.load(Ordering::Relaxed)
    }
    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    /// An I/O queue connected under `gen` lost its connection: reset the
    /// controller unless a newer generation already replaced it.
    pub fn request_reset(&self, gen: u64) {
        if self.gen() == gen && self.state() == CtrlrState::Enabled {
            self.reset_req.store(true, Ordering::Release);
        }
    }

    /// A free I/O queue id within what the controller granted; `None`
    /// when every granted queue is taken (one per reactor and bdev).
    pub fn alloc_qid(&self) -> Option<u16> {
        let mut q = lock(&self.qids);
        let lim = (self.granted_queues.load(Ordering::Acquire) as usize).min(q.len());
        let i = q[..lim].iter().position(|u| !u)?;
        q[i] = true;
        Some(i as u16 + 1)
    }

    pub fn free_qid(&self, qid: u16) {
        if let Some(u) = lock(&self.qids).get_mut(qid as usize - 1) {
            *u = false;
        }
    }

    pub fn add_qp(&self, c: Arc<QpCounters>) {
        lock(&self.qps).push(c);
    }
    pub fn remove_qp(&self, c: &Arc<QpCounters>) {
        lock(&self.qps).retain(|x| !Arc::ptr_eq(x, c));
    }
    pub fn qp_stats(&self) -> Vec<QpStats> {
        lock(&self.qps).iter().map(|c| c.snapshot()).collect()
    }
    pub fn params(&self) -> &AttachParams {
        &self.p
    }

    pub fn set_bdevs(&self, reg: Arc<Registry>, names: Vec<String>) {
        *lock(&self.bdevs) = Some((reg, names));
    }

    /// Stops the supervisor (it disconnects the admin queue, which makes the
    /// target drop the controller and with it every I/O queue).
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
    }

    pub fn detach(&self) {
        self.stop();
        if let Some((reg, names)) = lock(&self.bdevs).take() {
            for n in names {
                if let Err(e) = reg.hot_remove(&n) {
                    tracing::warn!("nvme: removing bdev {n}: {e}");
                }
            }
        }
        self.set_state(CtrlrState::Deleting);
    }

    pub fn info(&self) -> ControllerInfo {
        let adrfam = if self.addr.is_ipv4() { "IPv4" } else { "IPv6" };
        let bdevs = lock(&self.bdevs)
            .as_ref()
            .map(|(_, n)| n.clone())
            .unwrap_or_default();
        ControllerInfo {
            name: self.p.name.clone(),
            ctrlrs: vec![CtrlrPathInfo {
                state: self.state().name().into(),
                cntlid: self.cntlid(),
                trid: TransportId {
                    trtype: "TCP".into(),
                    adrfam: adrfam.into(),
                    traddr: self.addr.ip().to_string(),
                    trsvcid: self.addr.port().to_string(),
                    subnqn: self.p.subnqn.clone(),
                },
                host: HostId {
                    nqn: self.hostnqn.clone(),
                    addr: String::new(),
                    svcid: String::new(),
                },
                resets: self.resets.load(Ordering::Relaxed),
                io_queues: lock(&self.qps).len() as u32,
            }],
            bdevs,
        }
    }
}

use adminq::AdminQ;
use ustor_net::timeout;

/// Brings the controller up (reports the namespaces through `tx`), then
/// keeps it alive and resets it on loss until detached.
pub(crate) async fn supervise(c: Arc<Ctrlr>, tx: SyncSender<Result<Vec<NsInfo>, InitiatorError>>) {
    let first = async {
        let (mut q, cntlid) = AdminQ::open(&c).await?;
        let ns = q.discover(&c).await?;
        Ok::<_, InitiatorError>((q, cntlid, ns))
    };
    let mut aq = match timeout(CONNECT_TIMEOUT, first).await {
        Some(Ok((q, cntlid, ns))) => {
            c.cntlid.store(cntlid, Ordering::Release);
            c.gen.fetch_add(1, Ordering::AcqRel);
            c.set_state(CtrlrState::Enabled);
            let _ = tx.send(Ok(ns));
            Some(q)
        }
        Some(Err(e)) => {
            let _ = tx.send(Err(e));
            return;
        }
        None => {
            let _ = tx.send(Err(InitiatorError::Timeout("controller initialization")));
            return;
        }
    };
    let kato = Duration::from_millis(u64::from(c.p.keep_alive_timeout_ms));
    let ka_every = (kato / 2).max(Duration::from_millis(100));
    let mut next_ka = Instant::now() + ka_every;
    while !c.stopping() {
        ustor_runtime::sleep(TICK).await;
        if c.stopping() || c.state() != CtrlrState::Enabled {
            continue;
        }
        // An I/O queue lost its connection, or the admin queue did.
        let mut lost =
            c.reset_req.swap(false, Ordering::AcqRel) || aq.as_ref().is_some_and(AdminQ::is_lost);
        if !lost && !kato.is_zero() && Instant::now() >= next_ka {
            let q = aq
                .as_mut()
                .expect("enabled controllers have an admin queue");
            lost = !matches!(timeout(kato, q.keep_alive()).await, Some(Ok(())));
            next_ka = Instant::now() + ka_every;
        }
        if lost {
            aq = reset(&c).await;
            next_ka = Instant::now() + ka_every;
        }
    }
    drop(aq);
}

/// Reconnects the admin queue until it works or ctrlr_loss_timeout_sec ran
/// out (then the controller is failed and its I/O fails).
async fn reset(c: &Ctrlr) -> Option<AdminQ> {
    c.set_state(CtrlrState::Resetting);
    c.resets.fetch_add(1, Ordering::Relaxed);
    tracing::info!("nvme: controller {} lost; reconnecting", c.p.name);
    let start = Instant::now();
    let loss = c.p.ctrlr_loss_timeout_sec;
    let delay =
        Duration::from_secs(u64::from(c.p.reconnect_delay_sec)).max(Duration::from_millis(100));
    loop {
        if c.stopping() {
            return None;
        }
        match timeout(CONNECT_TIMEOUT, AdminQ::open(c)).await {
            Some(Ok((q, cntlid))) => {
                c.cntlid.store(cntlid, Ordering::Release);
                c.gen.fetch_add(1, Ordering::AcqRel);
                c.reset_req.store(false, Ordering::Release);
                c.set_state(CtrlrState::Enabled);
                tracing::info!(
                    "nvme: controller {} reconnected (cntlid {cntlid})",
                    c.p.name
                );
                return Some(q);
            }
            Some(Err(e)) => tracing::debug!("nvme: reconnect {}: {e}", c.p.name),
            None => tracing::debug!("nvme: reconnect {}: timed out", c.p.name),
        }
        let elapsed = start.elapsed();
        if loss == 0 || (loss > 0 && elapsed + delay > Duration::from_secs(loss as u64)) {
            tracing::warn!("nvme: controller {} failed after {elapsed:?}", c.p.name);
            c.set_state(CtrlrState::Failed);
            return None;
        }
        ustor_runtime::sleep(delay).await;
    }
}
