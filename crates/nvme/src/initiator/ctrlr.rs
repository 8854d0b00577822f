//! A remote controller: shared state (read by every reactor's I/O queues
//! through atomics), the admin queue, and the supervisor task on reactor 0
//! that brings the controller up, sends keep alives, and resets it
//! (reconnects the admin queue, bumping the generation the I/O queues
//! follow) when any queue reports the connection lost.

use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ustor_bdev::Registry;
use ustor_runtime::{ops, IoBuf};

use super::qpair::{QpCounters, QpStats};
use super::{
    AttachParams, ControllerInfo, CtrlrPathInfo, HostId, InitiatorError, TransportId,
    DEFAULT_HOSTNQN,
};
use crate::wire::*;

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

pub(crate) use ustor_net::timeout;

/// Receives exactly `n` bytes into `buf[at..at + n]` (control path).
async fn recv_exact(fd: i32, buf: IoBuf, at: usize, n: usize) -> Result<IoBuf, InitiatorError> {
    match ustor_net::recv::recv_exact(fd, buf, at, at + n).await {
        (Ok(()), b) => Ok(b),
        (Err(e), _) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            Err(InitiatorError::Protocol("connection closed"))
        }
        (Err(_), _) => Err(InitiatorError::Protocol("receive failed")),
    }
}

/// Tells the controller why the host drops the connection: an H2CTermReq
/// with `f` and the offending PDU header (truncated to [`MAX_TERM_DATA`]).
/// Best effort on a connection about to close: one non-blocking send, no
/// retry; the caller shuts the socket down afterwards either way.
pub(crate) fn send_term_req(fd: RawFd, f: Fatal, hdr: &[u8]) {
    let mut b = [0u8; TERM_HLEN + MAX_TERM_DATA];
    let t = TermReq {
        fes: f.fes,
        fei: f.fei,
    };
    let n = encode_term_req(&mut b, PduType::H2CTermReq, t, hdr);
    debug_assert!(n >= TERM_HLEN && n <= b.len());
    // SAFETY: send(2) of our own stack bytes on a socket the caller owns.
    let r = unsafe {
        libc::send(
            fd,
            b.as_ptr().cast(),
            n,
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
    if r != n as isize {
        tracing::debug!("nvme: H2CTermReq ({f}) not sent whole: {r}");
    }
}

/// A connected queue: its socket and what ICResp and Connect settled.
pub(crate) struct QueueConn {
    pub fd: OwnedFd,
    pub dg: Digests,
    /// MAXH2CDATA: most data in one H2CData PDU.
    pub maxh2c: u32,
    /// The controller's PDU data alignment (ICResp CPDA) for the data the
    /// host sends (in-capsule data, H2CData).
    pub cpda: u8,
    /// The Connect response's DW0.
    pub dw0: u32,
}

/// Connects a queue: TCP, ICReq/ICResp, Fabrics Connect.
pub(crate) async fn connect_queue(
    c: &Ctrlr,
    qid: u16,
    sqsize: u16,
    cntlid: u16,
) -> Result<QueueConn, InitiatorError> {
    let fd = ustor_net::recv::connect_blocking(c.addr)
        .await
        .map_err(|err| InitiatorError::Connect {
            addr: c.addr.to_string(),
            err,
        })?;
    let resp = initialize(c, fd.as_raw_fd()).await?;
    let mut q = AdminQ {
        fd,
        dg: resp.digests,
        cpda: resp.cpda,
        cid: 0,
    };
    let mut sqe = Sqe::default();
    ConnectCmd {
        recfmt: 0,
        qid,
        sqsize,
        // I/O queues: no SQ flow control, so reads complete with one
        // C2HData carrying SUCCESS.
        cattr: if qid == 0 {
            0
        } else {
            ConnectCmd::CATTR_DISABLE_SQFLOW
        },
        kato_ms: if qid == 0 {
            c.p.keep_alive_timeout_ms
        } else {
            0
        },
    }
    .encode(&mut sqe);
    let mut d = [0u8; CONNECT_DATA_LEN];
    ConnectData {
        hostid: c.hostid,
        cntlid,
        subnqn: c.p.subnqn.clone(),
        hostnqn: c.hostnqn.clone(),
    }
    .encode(&mut d);
    let cqe = q.cmd(&mut sqe, &d, None).await?;
    if !cqe.status().is_success() {
        return Err(InitiatorError::Status {
            what: "Connect",
            status: cqe.status,
        });
    }
    Ok(QueueConn {
        fd: q.fd,
        dg: q.dg,
        maxh2c: resp.maxh2cdata,
        cpda: q.cpda,
        dw0: cqe.dw0,
    })
}

/// ICReq/ICResp on a fresh connection: the digests asked for (the
/// controller may grant no more) and the controller's settings.
async fn initialize(c: &Ctrlr, raw: RawFd) -> Result<IcResp, InitiatorError> {
    let want = Digests {
        header: c.p.hdgst,
        data: c.p.ddgst,
    };
    let req = IcReq {
        pfv: 0,
        hpda: 0,
        digests: want,
        maxr2t: 0,
    };
    let mut b = IoBuf::heap(IC_LEN);
    b.copy_from_slice(&req.encode());
    ops::send_all(raw, b)
        .await
        .0
        .map_err(|_| InitiatorError::Protocol("ICReq send failed"))?;
    let b = recv_exact(raw, IoBuf::heap(IC_LEN), 0, IC_LEN).await?;
    let resp = match IcResp::decode(&b) {
        Ok(r) => r,
        Err(f) => {
            send_term_req(raw, f, &b);
            return Err(InitiatorError::Protocol("bad ICResp"));
        }
    };
    // The controller may only grant what we asked for.
    if (resp.digests.header && !want.header) || (resp.digests.data && !want.data) {
        send_term_req(raw, Fatal::header(11), &b);
        return Err(InitiatorError::Protocol(
            "ICResp enables digests not asked for",
        ));
    }
    Ok(resp)
}

/// The admin queue: one command at a time (control path; copies are fine).
pub(crate) struct AdminQ {
    fd: OwnedFd,
    dg: Digests,
    /// The controller's data alignment (ICResp CPDA) for in-capsule data.
    cpda: u8,
    cid: u16,
}

impl AdminQ {
    /// Connects, enables the controller (CC.EN, wait CSTS.RDY) and asks for
    /// the I/O queues; returns the queue and the cntlid.
    async fn open(c: &Ctrlr) -> Result<(AdminQ, u16), InitiatorError> {
        let qc = connect_queue(c, 0, ADMIN_SQSIZE, 0xffff).await?;
        let mut q = AdminQ {
            fd: qc.fd,
            dg: qc.dg,
            cpda: qc.cpda,
            cid: 0,
        };
        let cntlid = qc.dw0 as u16;
        let cap = q.prop_get(prop::CAP, true).await?;
        let to_ms = ((cap >> 24) & 0xff).max(2) * 500;
        // CC: EN, IOSQES 6 (64 B), IOCQES 4 (16 B).
        q.prop_set(prop::CC, 1 | 6 << 16 | 4 << 20).await?;
        let start = Instant::now();
        while q.prop_get(prop::CSTS, false).await? & 1 == 0 {
            if start.elapsed() > Duration::from_millis(to_ms) {
                return Err(InitiatorError::Timeout("CSTS.RDY"));
            }
            ustor_runtime::sleep(Duration::from_millis(1)).await;
        }
        let n = u32::from(c.p.num_io_queues.unwrap_or(64).clamp(1, 1024) - 1);
        let mut sqe = Sqe::default();
        sqe.set_opcode(admin::SET_FEATURES)
            .set_cdw(10, 7)
            .set_cdw(11, n | n << 16);
        let r = q.cmd(&mut sqe, &[], None).await?;
        if !r.status().is_success() {
            return Err(InitiatorError::Status {
                what: "Set Features (number of queues)",
                status: r.status,
            });
        }
        // NSQA / NCQA (0's based): the controller may grant fewer queues
        // than asked; connecting beyond them is refused.
        let granted = (r.dw0 & 0xffff).min(r.dw0 >> 16) + 1;
        c.granted_queues.store(granted, Ordering::Release);
        Ok((q, cntlid))
    }

    async fn prop_get(&mut self, off: u32, eight: bool) -> Result<u64, InitiatorError> {
        let mut sqe = Sqe::default();
        PropertyCmd {
            eight_bytes: eight,
            offset: off,
            value: 0,
        }
        .encode(&mut sqe, false);
        let c = self.cmd(&mut sqe, &[], None).await?;
        if !c.status().is_success() {
            return Err(InitiatorError::Status {
                what: "Property Get",
                status: c.status,
            });
        }
        Ok(u64::from(c.dw0) | u64::from(c.dw1) << 32)
    }

    async fn prop_set(&mut self, off: u32, v: u64) -> Result<(), InitiatorError> {
        let mut sqe = Sqe::default();
        PropertyCmd {
            eight_bytes: false,
            offset: off,
            value: v,
        }
        .encode(&mut sqe, true);
        let c = self.cmd(&mut sqe, &[], None).await?;
        if !c.status().is_success() {
            return Err(InitiatorError::Status {
                what: "Property Set",
                status: c.status,
            });
        }
        Ok(())
    }

    async fn identify(&mut self, cns: u32, nsid: u32) -> Result<Vec<u8>, InitiatorError> {
        let mut sqe = Sqe::default();
        sqe.set_opcode(admin::IDENTIFY)
            .set_nsid(nsid)
            .set_cdw(10, cns);
        let mut d = vec![0u8; 4096];
        let c = self.cmd(&mut sqe, &[], Some(&mut d)).await?;
        if !c.status().is_success() {
            return Err(InitiatorError::Status {
                what: "Identify",
                status: c.status,
            });
        }
        Ok(d)
    }

    /// Identify controller, the active namespace list and each namespace.
    async fn discover(&mut self, c: &Ctrlr) -> Result<Vec<NsInfo>, InitiatorError> {
        let id = self.identify(1, 0).await?;
        let mdts = id[77];
        let mdts_bytes = if mdts == 0 {
            0
        } else {
            4096u64 << mdts.min(20)
        };
        c.mdts_bytes
            .store(mdts_bytes.min(u32::MAX as u64) as u32, Ordering::Relaxed);
        let ioccsz = u32::from_le_bytes([id[1792], id[1793], id[1794], id[1795]]);
        let icdoff = u16::from_le_bytes([id[1800], id[1801]]);
        // In-capsule data follows the SQE directly only when ICDOFF is 0.
        let icd = if icdoff == 0 {
            (ioccsz * 16).saturating_sub(64)
        } else {
            0
        };
        c.icd_max.store(icd, Ordering::Relaxed);
        let list = self.identify(2, 0).await?;
        let mut out = Vec::new();
        for ch in list.chunks_exact(4).take(1024) {
            let nsid = u32::from_le_bytes([ch[0], ch[1], ch[2], ch[3]]);
            if nsid == 0 {
                break;
            }
            let d = self.identify(0, nsid).await?;
            let nsze = u64::from_le_bytes(d[0..8].try_into().unwrap_or([0; 8]));
            let flbas = (d[26] & 0xf) as usize;
            let lbads = d[128 + 4 * flbas + 2];
            if !(9..=16).contains(&lbads) || nsze == 0 {
                tracing::warn!("nvme: namespace {nsid}: unusable format (lbads {lbads})");
                continue;
            }
            let mut nguid = [0u8; 16];
            nguid.copy_from_slice(&d[104..120]);
            out.push(NsInfo {
                nsid,
                num_blocks: nsze,
                block_size: 1 << lbads,
                nguid,
            });
        }
        Ok(out)
    }

    async fn keep_alive(&mut self) -> Result<(), InitiatorError> {
        let mut sqe = Sqe::default();
        sqe.set_opcode(admin::KEEP_ALIVE);
        let c = self.cmd(&mut sqe, &[], None).await?;
        if !c.status().is_success() {
            return Err(InitiatorError::Status {
                what: "Keep Alive",
                status: c.status,
            });
        }
        Ok(())
    }

    /// Sends one command (with in-capsule `out` data) and waits for its
    /// completion, copying C2HData into `inbuf`.
    async fn cmd(
        &mut self,
        sqe: &mut Sqe,
        out: &[u8],
        mut inbuf: Option<&mut [u8]>,
    ) -> Result<Cqe, InitiatorError> {
        self.cid = self.cid.wrapping_add(1);
        let cid = self.cid;
        sqe.set_cid(cid).set_sgl_psdt();
        if !out.is_empty() {
            sqe.set_sgl(SglDesc::in_capsule(out.len() as u32));
        } else if let Some(b) = inbuf.as_ref() {
            sqe.set_sgl(SglDesc::transport(b.len() as u32));
        }
        self.send_capsule(sqe, out).await?;
        let fd = self.fd.as_raw_fd();
        // Budget: a controller may send at most a few PDUs per command.
        for _ in 0..64 {
            let (buf, l) = self.recv_pdu().await?;
            match l.ty {
                PduType::CapsuleResp => {
                    let cqe =
                        Cqe::decode(&buf[CH_LEN..]).ok_or(InitiatorError::Protocol("short CQE"))?;
                    if cqe.cid == cid {
                        return Ok(cqe);
                    }
                }
                PduType::C2HData => {
                    if c2h_into(fd, &buf, &l, cid, inbuf.as_deref_mut())? {
                        return Ok(Cqe::new(cid, Status::SUCCESS));
                    }
                }
                PduType::C2HTermReq => {
                    return Err(InitiatorError::Protocol(
                        "controller terminated the connection",
                    ))
                }
                _ => {
                    let f = Fatal {
                        fes: fes::PDU_SEQUENCE_ERROR,
                        fei: ch_off::PDU_TYPE,
                    };
                    return Err(fatal(
                        fd,
                        f,
                        &buf[..l.hlen],
                        "unexpected PDU on admin queue",
                    ));
                }
            }
        }
        Err(InitiatorError::Protocol("no completion"))
    }

    /// Sends the command capsule with `out` as in-capsule data.
    async fn send_capsule(&self, sqe: &Sqe, out: &[u8]) -> Result<(), InitiatorError> {
        let mut b = IoBuf::heap(MAX_PADDED_HDR + DIGEST_LEN + out.len());
        let n = encode_capsule_cmd_pda(&mut b, sqe, self.dg, out.len(), self.cpda);
        b[n..n + out.len()].copy_from_slice(out);
        let mut len = n + out.len();
        if self.dg.data && !out.is_empty() {
            b[len..len + 4].copy_from_slice(&crc(out).to_le_bytes());
            len += 4;
        }
        b.set_len(len);
        ops::send_all(self.fd.as_raw_fd(), b)
            .await
            .0
            .map_err(|_| InitiatorError::Protocol("admin send failed"))
    }

    /// Receives one controller PDU whole, its header and digests checked.
    async fn recv_pdu(&self) -> Result<(IoBuf, PduLayout), InitiatorError> {
        let fd = self.fd.as_raw_fd();
        let lim = RecvLimits {
            max_incapsule: 0,
            max_data_pdu: 8192,
        };
        let mut buf = recv_exact(fd, IoBuf::heap(ADMIN_BUF), 0, CH_LEN).await?;
        let ch = CommonHeader::decode(&buf).ok_or(InitiatorError::Protocol("short header"))?;
        let l = match check_header(&ch, self.dg, true, &lim) {
            Ok(l) => l,
            Err(f) => return Err(fatal(fd, f, &buf[..CH_LEN], "bad PDU header")),
        };
        if l.plen > ADMIN_BUF {
            return Err(InitiatorError::Protocol("admin PDU too long"));
        }
        buf = recv_exact(fd, buf, CH_LEN, l.plen - CH_LEN).await?;
        buf.set_len(l.plen);
        if self.dg.header && !header_digest_ok(&buf, l.hlen) {
            let f = Fatal {
                fes: fes::HEADER_DIGEST_ERROR,
                fei: 0,
            };
            return Err(fatal(fd, f, &buf[..l.hlen], "header digest"));
        }
        if l.ddgst {
            let want = u32::from_le_bytes(
                buf[l.plen - 4..l.plen]
                    .try_into()
                    .map_err(|_| InitiatorError::Protocol("short PDU"))?,
            );
            if crc(&buf[l.pdo..l.pdo + l.data_len]) != want {
                return Err(InitiatorError::Protocol("data digest"));
            }
        }
        Ok((buf, l))
    }
}

/// A fatal transport error on the admin queue: tell the controller, then
/// give up.
fn fatal(fd: RawFd, f: Fatal, hdr: &[u8], what: &'static str) -> InitiatorError {
    send_term_req(fd, f, hdr);
    InitiatorError::Protocol(what)
}

/// Copies a C2HData PDU's data for command `cid` into `dst`; true when it
/// also completed the command (SUCCESS).
fn c2h_into(
    fd: RawFd,
    buf: &[u8],
    l: &PduLayout,
    cid: u16,
    dst: Option<&mut [u8]>,
) -> Result<bool, InitiatorError> {
    let h = DataHdr::decode(buf).ok_or(InitiatorError::Protocol("short hdr"))?;
    let hdr = &buf[..l.hlen];
    let data = &buf[l.pdo..l.pdo + l.data_len];
    let Some(dst) = dst.filter(|_| h.cccid == cid) else {
        return Err(fatal(fd, Fatal::header(8), hdr, "C2HData for no read"));
    };
    if h.length as usize != data.len() {
        return Err(fatal(fd, Fatal::header(16), hdr, "C2HData DATAL"));
    }
    let off = h.offset as usize;
    let end = off + data.len();
    if end > dst.len() {
        let f = Fatal {
            fes: fes::DATA_OUT_OF_RANGE,
            fei: 12,
        };
        return Err(fatal(fd, f, hdr, "C2HData out of range"));
    }
    dst[off..end].copy_from_slice(data);
    Ok(l.flags & flags::SUCCESS != 0)
}

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
        let mut lost = c.reset_req.swap(false, Ordering::AcqRel);
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
