//! The admin queue client (one command at a time: properties, Identify,
//! keep alive) and the connect of any queue: TCP, ICReq/ICResp, Fabrics
//! Connect. Control path: copies and small allocations are fine here.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ustor_runtime::{ops, IoBuf};

use super::super::InitiatorError;
use super::{Ctrlr, NsInfo, ADMIN_BUF, ADMIN_SQSIZE};
use crate::wire::*;

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
    pub(super) async fn open(c: &Ctrlr) -> Result<(AdminQ, u16), InitiatorError> {
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

    pub(super) async fn prop_get(&mut self, off: u32, eight: bool) -> Result<u64, InitiatorError> {
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

    pub(super) async fn prop_set(&mut self, off: u32, v: u64) -> Result<(), InitiatorError> {
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

    pub(super) async fn identify(
        &mut self,
        cns: u32,
        nsid: u32,
    ) -> Result<Vec<u8>, InitiatorError> {
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
