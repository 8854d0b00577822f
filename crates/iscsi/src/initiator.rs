//! The iSCSI initiator as a SCSI low-level driver: one session (one
//! connection) per host to one target, on the reactor's io_uring socket
//! ops. Login with operational negotiation (no digests, InitialR2T=Yes,
//! ImmediateData=No), SendTargets discovery when no target is named,
//! SCSI commands with Data-In / R2T / Data-Out, answers to the target's
//! NOP-Ins, ABORT TASK and LOGICAL UNIT RESET, host reset = a new session.
//!
//! Partial (first cut): Data-In and Data-Out are copied between the PDU
//! buffers and the command's iovecs; per-command state lives in a map.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::rc::Rc;
use std::task::{Poll, Waker};
use std::time::Duration;

use ustor_scsi::lld::{
    Completion, DataDir, HostLimits, Lld, LocalFuture, Nexus, QueueError, ScsiCmd, Tag, TargetAddr,
    TmfResult, TransportError,
};
use ustor_scsi::lun::encode_lun;
use ustor_scsi::ScsiStatus;

use crate::conn::{pdu_bytes, read_pdu, send_all};
use crate::wire::{
    build, encode_text, opcode, parse_text, tmf, Bhs, LoginStatus, TargetPdu, RESERVED_TAG,
};

/// What to connect to.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct IscsiConfig {
    /// `host:port` of the portal.
    pub portal: String,
    /// Target IQN; `None` = the first one SendTargets lists.
    #[serde(default)]
    pub target: Option<String>,
    #[serde(default = "default_initiator")]
    pub initiator: String,
    #[serde(default = "default_queue")]
    pub queue_depth: u32,
}

fn default_initiator() -> String {
    "iqn.2024-01.io.ustor:initiator".into()
}
fn default_queue() -> u32 {
    64
}

const MAX_RECV_SEG: usize = 262_144;
const TMF_WAIT: Duration = Duration::from_secs(5);

struct Cmd {
    lun: [u8; 8],
    iov: *const libc::iovec,
    iovcnt: usize,
    data_len: u32,
    cmdsn: u32,
    lun_no: u64,
    moved: u32,
}

struct Done {
    tag: Tag,
    status: Result<ScsiStatus, TransportError>,
    sense: Vec<u8>,
    resid: u32,
}

#[derive(Default)]
struct Session {
    stream: RefCell<Option<TcpStream>>,
    fd: Cell<RawFd>,
    connected: Cell<bool>,
    generation: Cell<u64>,
    target: RefCell<String>,
    cmdsn: Cell<u32>,
    expstatsn: Cell<u32>,
    maxcmdsn: Cell<u32>,
    max_send_seg: Cell<usize>,
    cmds: RefCell<HashMap<Tag, Cmd>>,
    sendq: RefCell<VecDeque<Vec<u8>>>,
    send_waker: RefCell<Option<Waker>>,
    done: RefCell<VecDeque<Done>>,
    tmf_itt: Cell<u32>,
    tmf: RefCell<HashMap<u32, u8>>,
    tmf_waker: RefCell<Option<Waker>>,
}

/// The iSCSI LLD.
pub struct IscsiLld {
    cfg: IscsiConfig,
    s: Rc<Session>,
}

impl IscsiLld {
    pub fn new(cfg: IscsiConfig) -> IscsiLld {
        IscsiLld {
            cfg,
            s: Rc::new(Session::default()),
        }
    }
}

/// SendTargets discovery: the target names behind a portal.
pub async fn discover(portal: &str, initiator: &str) -> io::Result<Vec<String>> {
    let stream = TcpStream::connect(portal)?;
    let fd = stream.as_raw_fd();
    let (statsn, cmdsn, _) = login(fd, initiator, None).await?;
    let text = encode_text(&[("SendTargets", "All")]);
    let mut b = build::text(1, cmdsn, statsn.wrapping_add(1));
    b.set_data_len(text.len());
    send_all(fd, &pdu_bytes(&b, &text)).await?;
    let (rb, data) = read_pdu(fd).await?;
    if rb.opcode() != opcode::TEXT_RESP {
        return Err(io::Error::other("no text response to SendTargets"));
    }
    let lo = build::logout(2, cmdsn.wrapping_add(1), rb.u32_at(24).wrapping_add(1));
    let _ = send_all(fd, &pdu_bytes(&lo, &[])).await;
    let _ = read_pdu(fd).await;
    Ok(parse_text(&data)
        .into_iter()
        .filter(|(k, _)| k == "TargetName")
        .map(|(_, v)| v)
        .collect())
}

/// Logs in (security stage with AuthMethod=None, then operational);
/// returns (StatSN, next CmdSN, negotiated keys).
async fn login(
    fd: RawFd,
    initiator: &str,
    target: Option<&str>,
) -> io::Result<(u32, u32, Vec<(String, String)>)> {
    let isid = [0x80, 0x00, 0x75, 0x73, 0x74, 0x01];
    let mut keys = vec![("InitiatorName", initiator), ("AuthMethod", "None")];
    match target {
        Some(t) => keys.extend([("SessionType", "Normal"), ("TargetName", t)]),
        None => keys.push(("SessionType", "Discovery")),
    }
    let (mut statsn, mut expcmdsn) = (0u32, 0u32);
    let mut negotiated = Vec::new();
    let mut csg = 0u8;
    // Security, then operational: two exchanges, a few more if the target
    // does not transit at once (a budget on the loop).
    for _ in 0..6 {
        let nsg = if csg == 0 { 1 } else { 3 };
        let text = encode_text(&keys);
        let mut b = build::login(isid, 0, 0, expcmdsn, statsn, csg, nsg, true);
        b.set_data_len(text.len());
        send_all(fd, &pdu_bytes(&b, &text)).await?;
        let (rb, data) = read_pdu(fd).await?;
        let pdu = TargetPdu::decode(&rb).map_err(io::Error::other)?;
        let TargetPdu::LoginResponse {
            transit,
            nsg: got,
            statsn: s,
            status,
            ..
        } = pdu
        else {
            return Err(io::Error::other(format!(
                "unexpected PDU during login: {pdu:?}"
            )));
        };
        if status != LoginStatus::Success {
            return Err(io::Error::other(format!("login refused: {status:?}")));
        }
        statsn = s.wrapping_add(1);
        expcmdsn = rb.u32_at(28);
        negotiated.extend(parse_text(&data));
        if transit && got == 3 {
            return Ok((statsn.wrapping_sub(1), expcmdsn, negotiated));
        }
        if transit && got == 1 {
            csg = 1;
            keys = vec![
                ("HeaderDigest", "None"),
                ("DataDigest", "None"),
                ("MaxRecvDataSegmentLength", "262144"),
            ];
            if target.is_some() {
                keys.extend([
                    ("InitialR2T", "Yes"),
                    ("ImmediateData", "No"),
                    ("MaxBurstLength", "262144"),
                    ("FirstBurstLength", "65536"),
                    ("MaxOutstandingR2T", "1"),
                    ("MaxConnections", "1"),
                    ("DataPDUInOrder", "Yes"),
                    ("DataSequenceInOrder", "Yes"),
                    ("ErrorRecoveryLevel", "0"),
                    ("DefaultTime2Wait", "0"),
                    ("DefaultTime2Retain", "0"),
                ]);
            }
        } else {
            keys.clear();
        }
    }
    Err(io::Error::other("login did not reach full feature phase"))
}

impl Session {
    fn wake_sender(&self) {
        if let Some(w) = self.send_waker.borrow_mut().take() {
            w.wake();
        }
    }

    fn send(&self, pdu: Vec<u8>) {
        self.sendq.borrow_mut().push_back(pdu);
        self.wake_sender();
    }

    fn update_sn(&self, statsn: Option<u32>, maxcmdsn: u32) {
        if let Some(s) = statsn {
            self.expstatsn.set(s.wrapping_add(1));
        }
        if (maxcmdsn.wrapping_sub(self.maxcmdsn.get()) as i32) > 0 {
            self.maxcmdsn.set(maxcmdsn);
        }
    }

    fn fail_all(&self, why: TransportError) {
        let tags: Vec<Tag> = self.cmds.borrow_mut().drain().map(|(t, _)| t).collect();
        let mut d = self.done.borrow_mut();
        for tag in tags {
            d.push_back(Done {
                tag,
                status: Err(why),
                sense: Vec::new(),
                resid: 0,
            });
        }
    }

    /// Copies PDU data into a command's iovecs at `offset`.
    fn data_in(&self, itt: Tag, offset: u32, data: &[u8]) {
        let cmds = self.cmds.borrow();
        let Some(c) = cmds.get(&itt) else { return };
        let mut skip = offset as usize;
        let mut src = data;
        // SAFETY: the mid-layer keeps the iovecs alive while the command is ours.
        let iov = if c.iov.is_null() {
            &[][..]
        } else {
            unsafe { std::slice::from_raw_parts(c.iov, c.iovcnt) }
        };
        for v in iov {
            if src.is_empty() {
                break;
            }
            if skip >= v.iov_len {
                skip -= v.iov_len;
                continue;
            }
            let n = (v.iov_len - skip).min(src.len());
            // SAFETY: within the iovec's bounds (skip + n <= iov_len).
            unsafe {
                std::ptr::copy_nonoverlapping(src.as_ptr(), (v.iov_base as *mut u8).add(skip), n)
            };
            src = &src[n..];
            skip = 0;
        }
    }

    /// Gathers `len` bytes at `offset` of a command's data-out.
    fn data_out(c: &Cmd, offset: usize, len: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(len);
        let mut skip = offset;
        // SAFETY: as in `data_in`.
        let iov = if c.iov.is_null() {
            &[][..]
        } else {
            unsafe { std::slice::from_raw_parts(c.iov, c.iovcnt) }
        };
        for v in iov {
            if out.len() == len {
                break;
            }
            if skip >= v.iov_len {
                skip -= v.iov_len;
                continue;
            }
            let n = (v.iov_len - skip).min(len - out.len());
            // SAFETY: within the iovec's bounds.
            out.extend_from_slice(unsafe {
                std::slice::from_raw_parts((v.iov_base as *const u8).add(skip), n)
            });
            skip = 0;
        }
        out
    }

    fn on_pdu(&self, b: &Bhs, data: &[u8]) {
        let Ok(pdu) = TargetPdu::decode(b) else {
            tracing::warn!("iscsi: unexpected {b:?}");
            return;
        };
        match pdu {
            TargetPdu::DataIn {
                itt,
                status,
                statsn,
                maxcmdsn,
                offset,
                residual,
                underflow,
                ..
            } => {
                self.data_in(itt, offset, data);
                if let Some(st) = status {
                    self.update_sn(Some(statsn), maxcmdsn);
                    self.cmds.borrow_mut().remove(&itt);
                    let resid = if underflow { residual } else { 0 };
                    self.done.borrow_mut().push_back(Done {
                        tag: itt,
                        status: Ok(ScsiStatus::from_u8(st)),
                        sense: Vec::new(),
                        resid,
                    });
                } else {
                    self.update_sn(None, maxcmdsn);
                }
            }
            TargetPdu::ScsiResponse {
                itt,
                response,
                status,
                statsn,
                maxcmdsn,
                residual,
                underflow,
            } => {
                self.update_sn(Some(statsn), maxcmdsn);
                self.cmds.borrow_mut().remove(&itt);
                let sense = if data.len() >= 2 {
                    let n = (u16::from_be_bytes([data[0], data[1]]) as usize).min(data.len() - 2);
                    data[2..2 + n].to_vec()
                } else {
                    Vec::new()
                };
                let status = if response == 0 {
                    Ok(ScsiStatus::from_u8(status))
                } else {
                    Err(TransportError::Protocol("target failure response"))
                };
                self.done.borrow_mut().push_back(Done {
                    tag: itt,
                    status,
                    sense,
                    resid: if underflow { residual } else { 0 },
                });
            }
            TargetPdu::R2t {
                itt,
                ttt,
                maxcmdsn,
                offset,
                len,
                ..
            } => {
                self.update_sn(None, maxcmdsn);
                self.answer_r2t(itt, ttt, offset, len);
            }
            TargetPdu::NopIn {
                ttt,
                statsn,
                maxcmdsn,
                ..
            } => {
                self.update_sn(Some(statsn), maxcmdsn);
                if ttt != RESERVED_TAG {
                    let nop = build::nop_out(
                        b.lun(),
                        RESERVED_TAG,
                        ttt,
                        self.cmdsn.get(),
                        self.expstatsn.get(),
                    );
                    self.send(pdu_bytes(&nop, &[]));
                }
            }
            TargetPdu::TmfResponse {
                itt,
                response,
                statsn,
                maxcmdsn,
            } => {
                self.update_sn(Some(statsn), maxcmdsn);
                self.tmf.borrow_mut().insert(itt, response);
                if let Some(w) = self.tmf_waker.borrow_mut().take() {
                    w.wake();
                }
            }
            TargetPdu::Async {
                statsn,
                maxcmdsn,
                event,
            } => {
                self.update_sn(Some(statsn), maxcmdsn);
                tracing::info!("iscsi: async event {event}");
            }
            TargetPdu::Reject { reason, statsn } => {
                self.update_sn(Some(statsn), self.maxcmdsn.get());
                tracing::warn!("iscsi: reject reason {reason:#x}");
            }
            p => tracing::debug!("iscsi: ignored {p:?}"),
        }
    }

    fn answer_r2t(&self, itt: Tag, ttt: u32, offset: u32, len: u32) {
        let mut cmds = self.cmds.borrow_mut();
        let Some(c) = cmds.get_mut(&itt) else { return };
        let seg = self.max_send_seg.get().max(512);
        let end = (offset as usize + len as usize).min(c.data_len as usize);
        let mut pos = offset as usize;
        let mut datasn = 0;
        // Bounded by the R2T's length over the segment size.
        while pos < end {
            let n = seg.min(end - pos);
            let data = Session::data_out(c, pos, n);
            let b = build::data_out(
                c.lun,
                itt,
                ttt,
                self.expstatsn.get(),
                datasn,
                pos as u32,
                data.len(),
                pos + n == end,
            );
            self.sendq.borrow_mut().push_back(pdu_bytes(&b, &data));
            pos += n;
            datasn += 1;
        }
        c.moved += len;
        drop(cmds);
        self.wake_sender();
    }
}

async fn receiver(s: Rc<Session>, fd: RawFd, gen: u64) {
    loop {
        match read_pdu(fd).await {
            Ok((b, data)) if s.generation.get() == gen => s.on_pdu(&b, &data),
            Ok(_) => return,
            Err(e) => {
                if s.generation.get() == gen {
                    tracing::warn!("iscsi: connection lost: {e}");
                    s.connected.set(false);
                    s.fail_all(TransportError::Disconnected);
                    s.wake_sender();
                }
                return;
            }
        }
    }
}

async fn sender(s: Rc<Session>, fd: RawFd, gen: u64) {
    loop {
        if s.generation.get() != gen || !s.connected.get() {
            return;
        }
        let next = s.sendq.borrow_mut().pop_front();
        match next {
            Some(p) => {
                if let Err(e) = send_all(fd, &p).await {
                    tracing::warn!("iscsi: send failed: {e}");
                    return;
                }
            }
            None => {
                std::future::poll_fn(|cx| {
                    if !s.sendq.borrow().is_empty()
                        || s.generation.get() != gen
                        || !s.connected.get()
                    {
                        return Poll::Ready(());
                    }
                    *s.send_waker.borrow_mut() = Some(cx.waker().clone());
                    Poll::Pending
                })
                .await
            }
        }
    }
}

impl IscsiLld {
    async fn connect(&self) -> Result<(), TransportError> {
        let io = |e: io::Error| TransportError::Io(e.raw_os_error().unwrap_or(libc::EIO));
        let target = match &self.cfg.target {
            Some(t) => t.clone(),
            None => discover(&self.cfg.portal, &self.cfg.initiator)
                .await
                .map_err(io)?
                .into_iter()
                .next()
                .ok_or(TransportError::NoDevice)?,
        };
        let stream = TcpStream::connect(&self.cfg.portal).map_err(io)?;
        let _ = stream.set_nodelay(true);
        let fd = stream.as_raw_fd();
        let (statsn, cmdsn, keys) = login(fd, &self.cfg.initiator, Some(&target))
            .await
            .map_err(io)?;
        let s = &self.s;
        let mrdsl = keys
            .iter()
            .find(|(k, _)| k == "MaxRecvDataSegmentLength")
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(8192usize);
        s.max_send_seg.set(mrdsl);
        s.cmdsn.set(cmdsn);
        s.maxcmdsn.set(cmdsn);
        s.expstatsn.set(statsn.wrapping_add(1));
        s.fd.set(fd);
        *s.stream.borrow_mut() = Some(stream);
        *s.target.borrow_mut() = target;
        s.connected.set(true);
        let gen = s.generation.get() + 1;
        s.generation.set(gen);
        ustor_runtime::spawn(receiver(s.clone(), fd, gen));
        ustor_runtime::spawn(sender(s.clone(), fd, gen));
        Ok(())
    }

    async fn send_tmf(
        &self,
        function: u8,
        lun: [u8; 8],
        ref_itt: u32,
        refcmdsn: u32,
    ) -> Option<u8> {
        let s = &self.s;
        let itt = 0x4000_0000 | s.tmf_itt.get();
        s.tmf_itt.set(s.tmf_itt.get().wrapping_add(1) & 0x0fff_ffff);
        let b = build::tmf(
            function,
            lun,
            itt,
            ref_itt,
            s.cmdsn.get(),
            s.expstatsn.get(),
            refcmdsn,
        );
        s.send(pdu_bytes(&b, &[]));
        let deadline = ustor_runtime::ticks::now() + ustor_runtime::ticks::from_duration(TMF_WAIT);
        // Waits for the response, a bounded time.
        loop {
            if let Some(r) = s.tmf.borrow_mut().remove(&itt) {
                return Some(r);
            }
            if ustor_runtime::ticks::now() >= deadline || !s.connected.get() {
                return None;
            }
            ustor_runtime::sleep(Duration::from_millis(1)).await;
        }
    }
}

impl Lld for IscsiLld {
    fn name(&self) -> &str {
        "iscsi"
    }

    fn limits(&self) -> HostLimits {
        HostLimits {
            can_queue: self.cfg.queue_depth.max(1),
            cmd_per_lun: self.cfg.queue_depth.max(1),
            max_transfer_bytes: MAX_RECV_SEG as u32,
            max_sg_entries: 16,
            dma_alignment: 1,
        }
    }

    fn queuecommand(&self, cmd: &ScsiCmd) -> Result<(), QueueError> {
        let s = &self.s;
        if !s.connected.get() {
            return Err(QueueError::NotConnected);
        }
        // The target's command window (MaxCmdSN) is closed: wait.
        if (s.cmdsn.get().wrapping_sub(s.maxcmdsn.get()) as i32) > 0 {
            return Err(QueueError::HostBusy);
        }
        let lun = encode_lun(cmd.nexus.lun);
        let cmdsn = s.cmdsn.get();
        let b = build::scsi_cmd(
            lun,
            cmd.tag,
            cmd.cdb.as_bytes(),
            cmd.dir == DataDir::FromDevice,
            cmd.dir == DataDir::ToDevice,
            cmd.data_len,
            cmdsn,
            s.expstatsn.get(),
        );
        s.cmdsn.set(cmdsn.wrapping_add(1));
        s.cmds.borrow_mut().insert(
            cmd.tag,
            Cmd {
                lun,
                iov: cmd.iov,
                iovcnt: cmd.iovcnt,
                data_len: cmd.data_len,
                cmdsn,
                lun_no: cmd.nexus.lun,
                moved: 0,
            },
        );
        s.send(pdu_bytes(&b, &[]));
        Ok(())
    }

    fn poll(&self, budget: usize, done: &mut dyn FnMut(Completion<'_>)) -> usize {
        let mut n = 0;
        while n < budget {
            let Some(d) = self.s.done.borrow_mut().pop_front() else {
                break;
            };
            done(Completion {
                tag: d.tag,
                status: d.status,
                sense: &d.sense,
                resid: d.resid,
            });
            n += 1;
        }
        n
    }

    fn scan(&self) -> LocalFuture<'_, Result<Vec<TargetAddr>, TransportError>> {
        Box::pin(async move {
            if !self.s.connected.get() {
                self.connect().await?;
            }
            Ok(vec![TargetAddr {
                channel: 0,
                target: 0,
                name: self.s.target.borrow().clone(),
                luns: Vec::new(),
            }])
        })
    }

    fn abort(&self, tag: Tag, nexus: Nexus) -> LocalFuture<'_, TmfResult> {
        Box::pin(async move {
            let refcmdsn = self.s.cmds.borrow().get(&tag).map(|c| c.cmdsn).unwrap_or(0);
            match self
                .send_tmf(tmf::ABORT_TASK, encode_lun(nexus.lun), tag, refcmdsn)
                .await
            {
                // Function complete, or the task is not there (any more).
                Some(0) | Some(1) => {
                    self.s.cmds.borrow_mut().remove(&tag);
                    TmfResult::Success
                }
                _ => TmfResult::Failed,
            }
        })
    }

    fn device_reset(&self, nexus: Nexus) -> LocalFuture<'_, TmfResult> {
        Box::pin(async move {
            match self
                .send_tmf(tmf::LUN_RESET, encode_lun(nexus.lun), RESERVED_TAG, 0)
                .await
            {
                Some(0) => {
                    self.s
                        .cmds
                        .borrow_mut()
                        .retain(|_, c| c.lun_no != nexus.lun);
                    TmfResult::Success
                }
                _ => TmfResult::Failed,
            }
        })
    }

    fn host_reset(&self) -> LocalFuture<'_, TmfResult> {
        Box::pin(async move {
            // Session reinstatement: drop the connection and log in anew;
            // every outstanding command is gone with the old session.
            let s = &self.s;
            s.generation.set(s.generation.get() + 1);
            s.connected.set(false);
            if let Some(st) = s.stream.borrow_mut().take() {
                let _ = st.shutdown(std::net::Shutdown::Both);
            }
            s.cmds.borrow_mut().clear();
            s.sendq.borrow_mut().clear();
            s.wake_sender();
            match self.connect().await {
                Ok(()) => TmfResult::Success,
                Err(e) => {
                    tracing::warn!("iscsi: session reinstatement failed: {e}");
                    TmfResult::Failed
                }
            }
        })
    }

    fn info(&self) -> serde_json::Value {
        serde_json::json!({"portal": self.cfg.portal, "target": *self.s.target.borrow(), "connected": self.s.connected.get()})
    }
}
