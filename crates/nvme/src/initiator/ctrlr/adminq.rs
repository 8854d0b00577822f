//! The admin queue client (one command at a time: properties, Identify,
//! keep alive) on the connection driver ([`super::link`] is its protocol).
//! Control path: copies and small allocations are fine here.

use std::future::poll_fn;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::{Duration, Instant};

use ustor_net::driver::{self, Conn, DriverConfig};
use ustor_net::staging::{RecvMode, Rewind};

use super::super::InitiatorError;
use super::handshake;
use super::link::{Admin, AdminLink, AdminOut, Pending};
use super::{Ctrlr, NsInfo, ADMIN_BUF, ADMIN_SQSIZE};
use crate::wire::*;

/// After a fatal error, how long the H2CTermReq may take to leave.
const TERM_WAIT: Duration = Duration::from_millis(50);

/// The admin connection's driver: staging for one whole PDU, a small
/// group, no coalescing (one command at a time).
fn driver_config() -> DriverConfig {
    DriverConfig {
        max_outstanding: 4,
        max_outstanding_bytes: u64::MAX,
        max_workers: 1,
        prespawn_workers: 0,
        staging_len: ADMIN_BUF,
        rewind: Rewind::Eager,
        recv_mode: RecvMode::Direct,
        recv_budget: None,
        max_replies: 4,
        group_iov: 8,
        group_arena: 4096,
        coalesce: None,
    }
}

/// The admin queue: one command at a time on its driver connection.
/// Dropping it shuts the connection down.
pub(crate) struct AdminQ {
    conn: Rc<Conn<AdminLink>>,
    cid: u16,
}

impl Drop for AdminQ {
    fn drop(&mut self) {
        ustor_net::recv::shutdown(self.conn.raw_fd());
    }
}

impl AdminQ {
    /// Connects, enables the controller (CC.EN, wait CSTS.RDY) and asks for
    /// the I/O queues; returns the queue and the cntlid.
    pub(super) async fn open(c: &Ctrlr) -> Result<(AdminQ, u16), InitiatorError> {
        let (mut q, cntlid) = AdminQ::connect(c).await?;
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
        let r = q.cmd(sqe, Vec::new(), 0).await?.0;
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

    /// TCP, then on the driver: ICReq/ICResp and the Fabrics Connect of
    /// queue 0 (its command waits for the ICResp, which sends it).
    async fn connect(c: &Ctrlr) -> Result<(AdminQ, u16), InitiatorError> {
        let fd = ustor_net::recv::connect_blocking(c.addr)
            .await
            .map_err(|err| InitiatorError::Connect {
                addr: c.addr.to_string(),
                err,
            })?;
        let admin = Rc::new(Admin::new(handshake::wanted(c)));
        let conn = driver::start(fd, AdminLink(admin.clone()), driver_config());
        conn.set_drain_timeout(Some(TERM_WAIT));
        let mut q = AdminQ { conn, cid: 0 };
        let served = q.conn.clone();
        ustor_runtime::spawn(async move {
            driver::serve(served).await;
            admin.end();
        });
        q.conn.send(AdminOut::IcReq);
        q.cid = q.cid.wrapping_add(1);
        let (sqe, d) = handshake::connect_cmd(c, 0, ADMIN_SQSIZE, 0xffff, q.cid);
        let cqe = q.wait(sqe, d.to_vec(), 0, false).await?.0;
        if !cqe.status().is_success() {
            return Err(InitiatorError::Status {
                what: "Connect",
                status: cqe.status,
            });
        }
        Ok((q, cqe.dw0 as u16))
    }

    pub(super) async fn prop_get(&mut self, off: u32, eight: bool) -> Result<u64, InitiatorError> {
        let mut sqe = Sqe::default();
        PropertyCmd {
            eight_bytes: eight,
            offset: off,
            value: 0,
        }
        .encode(&mut sqe, false);
        let c = self.cmd(sqe, Vec::new(), 0).await?.0;
        if !c.status().is_success() {
            return Err(InitiatorError::Status {
                what: "Property Get",
                status: c.status,
            });
        }
        Ok(u64::from(c.dw0) | u64::from(c.dw1) << 32)
    }

    pub(super) async fn prop_set(&mut self, off: u32, v: u64) -> Result<(), InitiatorError> {
        let mut sqe = Sqe::default();
        PropertyCmd {
            eight_bytes: false,
            offset: off,
            value: v,
        }
        .encode(&mut sqe, true);
        let c = self.cmd(sqe, Vec::new(), 0).await?.0;
        if !c.status().is_success() {
            return Err(InitiatorError::Status {
                what: "Property Set",
                status: c.status,
            });
        }
        Ok(())
    }

    pub(super) async fn identify(
        &mut self,
        cns: u32,
        nsid: u32,
    ) -> Result<Vec<u8>, InitiatorError> {
        let mut sqe = Sqe::default();
        sqe.set_opcode(admin::IDENTIFY)
            .set_nsid(nsid)
            .set_cdw(10, cns);
        let (c, d) = self.cmd(sqe, Vec::new(), 4096).await?;
        if !c.status().is_success() {
            return Err(InitiatorError::Status {
                what: "Identify",
                status: c.status,
            });
        }
        Ok(d)
    }

    /// Identify controller, the active namespace list and each namespace.
    pub(super) async fn discover(&mut self, c: &Ctrlr) -> Result<Vec<NsInfo>, InitiatorError> {
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

    pub(super) async fn keep_alive(&mut self) -> Result<(), InitiatorError> {
        let mut sqe = Sqe::default();
        sqe.set_opcode(admin::KEEP_ALIVE);
        let c = self.cmd(sqe, Vec::new(), 0).await?.0;
        if !c.status().is_success() {
            return Err(InitiatorError::Status {
                what: "Keep Alive",
                status: c.status,
            });
        }
        Ok(())
    }

    /// Sends one command (with in-capsule `out` data) and waits for its
    /// completion and the `inlen` bytes of C2HData it returns.
    async fn cmd(
        &mut self,
        mut sqe: Sqe,
        out: Vec<u8>,
        inlen: usize,
    ) -> Result<(Cqe, Vec<u8>), InitiatorError> {
        self.cid = self.cid.wrapping_add(1);
        sqe.set_cid(self.cid).set_sgl_psdt();
        if !out.is_empty() {
            sqe.set_sgl(SglDesc::in_capsule(out.len() as u32));
        } else if inlen > 0 {
            sqe.set_sgl(SglDesc::transport(inlen as u32));
        }
        self.wait(sqe, out, inlen, true).await
    }

    /// Makes `sqe` the command in flight, sends it (`send`; else the ICResp
    /// does) and waits for its completion or the connection's end.
    async fn wait(
        &self,
        sqe: Sqe,
        out: Vec<u8>,
        inlen: usize,
        send: bool,
    ) -> Result<(Cqe, Vec<u8>), InitiatorError> {
        let a = &self.conn.protocol().0;
        *a.cmd().borrow_mut() = Some(Pending {
            sqe,
            out,
            inbuf: vec![0; inlen],
            cqe: None,
        });
        if send {
            self.conn.send(AdminOut::Cmd);
        }
        let done = poll_fn(|cx| {
            let mut cmd = a.cmd().borrow_mut();
            if let Some(cqe) = cmd.as_ref().and_then(|p| p.cqe) {
                let inbuf = cmd.take().map(|p| p.inbuf).unwrap_or_default();
                return Poll::Ready(Some((cqe, inbuf)));
            }
            if a.ended() {
                return Poll::Ready(None);
            }
            a.set_waiter(cx.waker());
            Poll::Pending
        })
        .await;
        done.ok_or(InitiatorError::Protocol(
            a.lost().unwrap_or("connection closed"),
        ))
    }

    /// The connection ended (the controller left or broke the protocol).
    pub(super) fn is_lost(&self) -> bool {
        self.conn.protocol().0.ended()
    }
}
