//! The receive side: the controller's PDUs from the staging buffer
//! (responses, R2Ts, C2HData received straight into the I/O's buffers).

use std::os::fd::RawFd;
use std::rc::Rc;

use ustor_bdev::{BdevError, IoType};
use ustor_net::recv::Seg;
use ustor_net::staging::{RecvMode, Rewind, Staging};

use super::{bump, wake, Out, Qp, QpState, MAX_RECV_IOV, RECV_BUDGET, RESP_CID_OFF, STAGE_LEN};
use crate::wire::*;

#[derive(Debug, thiserror::Error)]
pub(super) enum RecvErr {
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("protocol: {0}")]
    Proto(&'static str),
    /// A fatal error in a controller PDU whose first `hdr` header bytes
    /// are still staged (at `Stage::pos`): reported in an H2CTermReq.
    #[error("protocol: {what} ({f})")]
    Fatal {
        what: &'static str,
        f: Fatal,
        hdr: usize,
    },
    #[error("controller terminated the connection (fes {0:#x})")]
    Term(u16),
}

/// Staged header bytes: the connection layer's staging buffer, received
/// with direct non-blocking receives (a readiness poll when nothing is
/// queued) and rewound before every receive (it holds headers only).
pub(super) type Stage = Staging;

/// A staging buffer for one connection.
pub(super) fn stage() -> Stage {
    Staging::new(STAGE_LEN, Rewind::Eager)
}

/// Receives the controller's PDUs until the connection drops or fails. A
/// header stays staged until it has been checked, so a fatal error can
/// quote it in the H2CTermReq.
pub(super) async fn receiver(qp: &Rc<Qp>, fd: RawFd, st: &mut Stage) -> Result<(), RecvErr> {
    let dg = qp.dg.get();
    let hdr_exact = DATA_HLEN + dg.hdgst_len();
    let lim = RecvLimits {
        max_incapsule: 0,
        max_data_pdu: qp.ctrlr.mdts_bytes().max(1 << 20),
    };
    let mut exact = false;
    loop {
        for _ in 0..RECV_BUDGET {
            if qp.state.get() != QpState::Live {
                return Ok(());
            }
            let max = || {
                if exact || qp.reads.get() > 0 {
                    hdr_exact
                } else {
                    STAGE_LEN
                }
            };
            st.fill(fd, CH_LEN, max, RecvMode::Direct).await?;
            let ch = CommonHeader::decode(st.staged()).ok_or(RecvErr::Proto("short header"))?;
            let l = check_header(&ch, dg, true, &lim).map_err(|f| RecvErr::Fatal {
                what: "bad header",
                f,
                hdr: CH_LEN,
            })?;
            let hdr_need = if l.ty == PduType::C2HTermReq {
                l.plen
            } else {
                l.header_total
            };
            if hdr_need > STAGE_LEN {
                return Err(RecvErr::Proto("header too long"));
            }
            st.fill(fd, hdr_need, || max().max(hdr_need), RecvMode::Direct)
                .await?;
            exact = on_pdu(qp, fd, st, &l, hdr_exact).await?;
        }
        ustor_runtime::yield_now().await;
    }
}

/// Handles one PDU whose header (`l`) is staged: checks its digest, then
/// consumes it and acts on it. True for C2HData (the next headers are then
/// read exactly).
async fn on_pdu(
    qp: &Rc<Qp>,
    fd: RawFd,
    st: &mut Stage,
    l: &PduLayout,
    hdr_exact: usize,
) -> Result<bool, RecvErr> {
    let dg = qp.dg.get();
    let fatal = |(f, what)| RecvErr::Fatal {
        what,
        f,
        hdr: l.hlen,
    };
    let hdr = &st.staged()[..l.header_total];
    if dg.header && !header_digest_ok(hdr, l.hlen) {
        let f = Fatal {
            fes: fes::HEADER_DIGEST_ERROR,
            fei: 0,
        };
        return Err(fatal((f, "header digest")));
    }
    // Each handler checks the header before it is consumed.
    match l.ty {
        PduType::CapsuleResp => {
            let cqe = Cqe::decode(&hdr[CH_LEN..]).ok_or(RecvErr::Proto("short CQE"))?;
            on_response(qp, cqe).map_err(fatal)?;
            st.consume(l.header_total);
        }
        PduType::R2T => {
            let h = DataHdr::decode(hdr).ok_or(RecvErr::Proto("short R2T"))?;
            on_r2t(qp, h).map_err(fatal)?;
            st.consume(l.header_total);
        }
        PduType::C2HData => {
            let h = DataHdr::decode(hdr).ok_or(RecvErr::Proto("short C2HData"))?;
            c2h_check(qp, l, &h).map_err(fatal)?;
            st.consume(l.header_total);
            c2h_data(qp, fd, st, l, h, hdr_exact).await?;
            return Ok(true);
        }
        PduType::C2HTermReq => {
            let t = TermReq::decode(hdr).map(|t| t.fes).unwrap_or(0);
            return Err(RecvErr::Term(t));
        }
        // check_header admits nothing else from a controller.
        _ => {
            let f = Fatal {
                fes: fes::PDU_SEQUENCE_ERROR,
                fei: ch_off::PDU_TYPE,
            };
            return Err(fatal((f, "unexpected PDU")));
        }
    }
    Ok(false)
}

fn status_err(s: Status) -> BdevError {
    match (s.sct(), s.sc()) {
        (0, 0x80) => BdevError::OutOfRange {
            offset_blocks: 0,
            num_blocks: 0,
            size_blocks: 0,
        },
        (0, 0x0b) => BdevError::Removed,
        (0, 0x01) | (0, 0x02) => BdevError::NotSupported,
        (2, 0x85) => BdevError::Miscompare,
        (0, 0x07) => BdevError::Aborted,
        _ => BdevError::Io(libc::EIO),
    }
}

/// A fatal error in a controller PDU header: what to report, and why.
type PduErr = (Fatal, &'static str);

fn on_response(qp: &Qp, cqe: Cqe) -> Result<(), PduErr> {
    let cid = cqe.cid;
    let err = {
        let cmds = qp.cmds.borrow();
        match cmds.get(cid as usize) {
            Some(c) if c.io.is_some() => c.err,
            _ => return Err((Fatal::header(RESP_CID_OFF), "response for no command")),
        }
    };
    let s = cqe.status();
    let res = if !s.is_success() {
        Err(status_err(s))
    } else {
        err.map_or(Ok(()), Err)
    };
    qp.complete(cid, res);
    Ok(())
}

fn on_r2t(qp: &Qp, h: DataHdr) -> Result<(), PduErr> {
    {
        let cmds = qp.cmds.borrow();
        // CCCID must name a write whose data is not in its capsule.
        let Some(c) = cmds
            .get(h.cccid as usize)
            .filter(|c| c.io.is_some() && c.kind == IoType::Write && !c.in_capsule)
        else {
            return Err((Fatal::header(8), "R2T for no R2T write"));
        };
        if h.length == 0 {
            return Err((Fatal::header(16), "R2T of no data"));
        }
        let end = u64::from(h.offset) + u64::from(h.length);
        if end > u64::from(c.len) {
            let f = Fatal {
                fes: fes::DATA_OUT_OF_RANGE,
                fei: 12,
            };
            return Err((f, "R2T out of range"));
        }
    }
    qp.out.borrow_mut().push_back(Out::H2C {
        cid: h.cccid,
        ttag: h.ttag,
        off: h.offset,
        end: h.offset + h.length,
    });
    wake(&qp.sender_w);
    Ok(())
}

/// Checks a C2HData header (before any of its data is read): flags, DATAL
/// against the PDU's length, a read command, and the range.
fn c2h_check(qp: &Qp, l: &PduLayout, h: &DataHdr) -> Result<(), PduErr> {
    if l.flags & flags::SUCCESS != 0 && l.flags & flags::LAST_PDU == 0 {
        return Err((Fatal::header(ch_off::FLAGS), "SUCCESS without LAST_PDU"));
    }
    if h.length as usize != l.data_len {
        return Err((Fatal::header(16), "C2HData DATAL differs from its PDU"));
    }
    let cmds = qp.cmds.borrow();
    let Some(c) = cmds
        .get(h.cccid as usize)
        .filter(|c| c.io.is_some() && c.kind == IoType::Read)
    else {
        return Err((Fatal::header(8), "C2HData for no read"));
    };
    if h.offset as usize + l.data_len > c.len as usize {
        let f = Fatal {
            fes: fes::DATA_OUT_OF_RANGE,
            fei: 12,
        };
        return Err((f, "C2HData out of range"));
    }
    Ok(())
}

/// Receives one C2HData payload (checked by [`c2h_check`], header
/// consumed) straight into the command's buffers, with its digest and
/// (opportunistically) the next header.
async fn c2h_data(
    qp: &Qp,
    fd: RawFd,
    st: &mut Staging,
    l: &PduLayout,
    h: DataHdr,
    hdr_exact: usize,
) -> Result<(), RecvErr> {
    let pad = l.pad();
    if pad > 0 {
        // We ask for HPDA 0, but a PDO past the header is still valid:
        // drop the padding, staged or not (never reading into the data).
        st.fill(fd, pad, || pad, RecvMode::Direct).await?;
        st.consume(pad);
    }
    let cid = h.cccid;
    let off = h.offset as usize;
    let len = l.data_len;
    let mut segs = [Seg::EMPTY; MAX_RECV_IOV];
    let mut n = {
        let cmds = qp.cmds.borrow();
        let c = &cmds[cid as usize];
        debug_assert!(c.io.is_some() && c.kind == IoType::Read && off + len <= c.len as usize);
        // SAFETY: the command holds its I/O (checked by c2h_check): the
        // iovecs are valid, and the I/O completes only after this receive
        // returned.
        unsafe { c.segs(off, len, &mut segs) }
    };
    // The digest lands behind the data (at most MAX_SEGMENTS data segments,
    // so there is room).
    let mut ddgst = [0u8; DIGEST_LEN];
    if l.ddgst {
        segs[n] = Seg {
            ptr: ddgst.as_mut_ptr(),
            len: DIGEST_LEN,
        };
        n += 1;
    }
    // Staged bytes are copied (counted); the rest arrives straight in the
    // I/O's buffers with the next header behind it in one recvmsg.
    // SAFETY: the data segments are the I/O's buffers (valid until it
    // completes, which is after this call); the digest is ours.
    let p = unsafe { st.recv_payload(fd, &segs[..n], hdr_exact) }.await?;
    let copied = p.copied.min(len);
    if copied > 0 {
        bump(&qp.counters.payload_copy_bytes, copied as u64);
    }
    let mut res = Ok(());
    if l.ddgst && data_digest(qp, cid, off, len) != u32::from_le_bytes(ddgst) {
        res = Err(BdevError::Io(libc::EIO));
        qp.cmds.borrow_mut()[cid as usize].err = Some(BdevError::Io(libc::EIO));
    }
    if l.flags & flags::SUCCESS != 0 {
        // LAST_PDU too: c2h_check.
        qp.complete(cid, res);
    }
    Ok(())
}

/// CRC32C of bytes [off, off + len) of command `cid`'s data, received now.
fn data_digest(qp: &Qp, cid: u16, off: usize, len: usize) -> u32 {
    let mut c = 0u32;
    let mut first = true;
    let cmds = qp.cmds.borrow();
    let mut segs = [Seg::EMPTY; MAX_RECV_IOV];
    // SAFETY: the command holds its I/O (it completes after this); the data
    // is complete now.
    let k = unsafe { cmds[cid as usize].segs(off, len, &mut segs) };
    for s in &segs[..k] {
        // SAFETY: received bytes of the I/O's buffer.
        let b = unsafe { std::slice::from_raw_parts(s.ptr, s.len) };
        c = if first { crc(b) } else { crc_append(c, b) };
        first = false;
    }
    c
}
