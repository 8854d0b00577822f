//! The receive side: the controller's PDUs as the driver stages them
//! (the ICResp and the Connect's response that start a connection,
//! responses, R2Ts, C2HData placed straight into the I/O's buffers),
//! [`Protocol::apply`] for the queue.

use ustor_bdev::{BdevError, IoType};
use ustor_net::driver::{self, IoEvent, Protocol, Recv, RecvEvent};
use ustor_net::recv::Seg;
use ustor_net::staging::Staging;
use ustor_net::PduGroup;

use super::super::ctrlr::handshake;
use super::{
    bump, Handshake, Link, Out, Qp, QpState, RxState, CONNECT_CID, MAX_RECV_IOV, RESP_CID_OFF,
    STAGE_LEN,
};
use crate::wire::*;

impl Protocol for Link {
    /// A client executes nothing: the controller does.
    type Job = std::convert::Infallible;
    type Reply = Out;

    fn apply(&self, ev: RecvEvent, st: &mut Staging) -> Recv<Self> {
        let qp = &*self.0;
        match (qp.rx.get(), ev) {
            (RxState::Stop, _) => Recv::Close,
            (RxState::IcResp, RecvEvent::Staged) => on_ic_resp(qp, st),
            (RxState::IcResp, _) => Recv::Stage {
                need: IC_LEN,
                max: IC_LEN,
            },
            (RxState::Common, RecvEvent::Staged) => on_common(qp, st),
            (RxState::Header(l), RecvEvent::Staged) => on_pdu(qp, st, &l),
            (RxState::Pad(l, h), RecvEvent::Staged) => {
                st.consume(l.pad());
                qp.rx.set(RxState::Data(l, h));
                Recv::Place {
                    tail: hdr_exact(qp),
                }
            }
            (RxState::Data(l, h), _) => {
                c2h_done(qp, &l, h);
                qp.exact.set(true);
                next(qp)
            }
            _ => next(qp),
        }
    }

    fn stage_max(&self) -> usize {
        let qp = &*self.0;
        if qp.exact.get() || qp.reads.get() > 0 {
            hdr_exact(qp)
        } else {
            STAGE_LEN
        }
    }

    unsafe fn place(&self, out: &mut [Seg]) -> usize {
        let qp = &*self.0;
        let RxState::Data(l, h) = qp.rx.get() else {
            unreachable!("placed only after a C2HData header")
        };
        let mut segs = [Seg::EMPTY; MAX_RECV_IOV];
        let mut n = {
            let cmds = qp.cmds.borrow();
            let c = &cmds[h.cccid as usize];
            debug_assert!(c.io.is_some() && c.kind == IoType::Read);
            // SAFETY: the command holds its I/O (c2h_check): the iovecs
            // are valid, and the I/O completes only after the data was
            // placed (c2h_done).
            unsafe { c.segs(h.offset as usize, l.data_len, &mut segs) }
        };
        // The digest lands behind the data (at most MAX_SEGMENTS data
        // segments, so there is room).
        if l.ddgst {
            segs[n] = Seg {
                ptr: qp.ddgst.as_ptr().cast(),
                len: DIGEST_LEN,
            };
            n += 1;
        }
        assert!(n <= out.len(), "C2HData segments beyond a receive");
        out[..n].copy_from_slice(&segs[..n]);
        n
    }

    async fn execute(&self, job: Self::Job) -> Out {
        match job {}
    }

    fn encode(&self, o: Out, g: &mut PduGroup) -> Result<(), Out> {
        super::tx::encode(&self.0, o, g)
    }

    fn urgent(&self, o: &Out) -> bool {
        // The controller waits for R2T data and the connection's start; a
        // termination leaves at once.
        !matches!(o, Out::Cmd(_))
    }

    fn backlog(&self, _queued: usize, _interim: u32) -> Option<driver::Backlog> {
        // Commands already sent may complete and make the application
        // submit more, which could join this group.
        let qp = &*self.0;
        let others = qp.active.get().saturating_sub(qp.grp_cmds.get());
        Some(driver::Backlog {
            others,
            depth: others,
        })
    }

    fn coalescer(&self) -> Option<&std::cell::RefCell<ustor_net::coalesce::Coalescer>> {
        Some(&self.0.coal)
    }

    fn on_io(&self, ev: IoEvent) {
        let qp = &*self.0;
        match ev {
            IoEvent::Sent { calls, .. } => {
                qp.grp_cmds.set(0);
                bump(&qp.counters.sendmsg_calls, calls);
                super::tx::record(qp);
            }
            IoEvent::Copied { bytes } => bump(&qp.counters.payload_copy_bytes, bytes as u64),
            IoEvent::Received { .. } => {}
        }
    }
}

/// Header bytes staged exactly: a data PDU's header with its digest.
fn hdr_exact(qp: &Qp) -> usize {
    DATA_HLEN + qp.dg.get().hdgst_len()
}

/// The next PDU's common header (or the end, once the queue is closed).
fn next(qp: &Qp) -> Recv<Link> {
    if qp.state.get() == QpState::Closed {
        return Recv::Close;
    }
    qp.rx.set(RxState::Common);
    Recv::Stage {
        need: CH_LEN,
        max: driver::ASK,
    }
}

/// The common header is staged: check it, then stage the whole header.
fn on_common(qp: &Qp, st: &mut Staging) -> Recv<Link> {
    let lim = RecvLimits {
        max_incapsule: 0,
        max_data_pdu: qp.ctrlr.mdts_bytes().max(1 << 20),
    };
    let Some(ch) = CommonHeader::decode(st.staged()) else {
        return lost(qp, "short header");
    };
    let l = match check_header(&ch, qp.dg.get(), true, &lim) {
        Ok(l) => l,
        Err(f) => return fatal(qp, st, f, CH_LEN, "bad header"),
    };
    let need = if l.ty == PduType::C2HTermReq {
        l.plen
    } else {
        l.header_total
    };
    if need > STAGE_LEN {
        return lost(qp, "header too long");
    }
    qp.rx.set(RxState::Header(l));
    Recv::Stage {
        need,
        max: driver::ASK,
    }
}

/// The connection is unusable (no termination request is owed).
fn lost(qp: &Qp, why: &str) -> Recv<Link> {
    tracing::debug!("nvme: I/O queue {} lost: protocol: {why}", qp.qid);
    qp.rx.set(RxState::Stop);
    Recv::Close
}

/// A fatal error in a controller PDU whose first `hdr` header bytes are
/// staged: tell the controller (an H2CTermReq quoting them, sent after
/// what is queued, so on a PDU boundary), then stop.
fn fatal(qp: &Qp, st: &Staging, f: Fatal, hdr: usize, what: &str) -> Recv<Link> {
    tracing::debug!("nvme: I/O queue {} lost: protocol: {what} ({f})", qp.qid);
    let staged = st.staged();
    let n = hdr.min(staged.len()).min(super::TERM_QUOTE);
    {
        let mut t = qp.term.borrow_mut();
        t.0 = f;
        t.1[..n].copy_from_slice(&staged[..n]);
        t.2 = n;
    }
    qp.rx.set(RxState::Stop);
    Recv::Interim(Out::Term)
}

/// The ICResp is staged: take what it settled and send the Fabrics
/// Connect, or report why not.
fn on_ic_resp(qp: &Qp, st: &mut Staging) -> Recv<Link> {
    match handshake::check_ic_resp(handshake::wanted(&qp.ctrlr), st.peek(IC_LEN)) {
        Ok(r) => {
            st.consume(IC_LEN);
            qp.dg.set(r.digests);
            qp.maxh2c.set(r.maxh2cdata);
            qp.cpda.set(r.cpda);
            qp.hs.set(Handshake::Connect);
            qp.rx.set(RxState::Common);
            Recv::Interim(Out::Connect)
        }
        Err((f, what)) => fatal(qp, st, f, IC_LEN, what),
    }
}

/// The Fabrics Connect's response (header `l` staged): the queue is live
/// (what the last connection left unfinished is resent, same CIDs, then
/// what waited), or refused (the connection ends; `conn::serve` acts on
/// the status).
fn on_connected(qp: &Qp, st: &mut Staging, l: &PduLayout, cqe: Cqe) -> Recv<Link> {
    if qp.hs.get() != Handshake::Connect {
        let f = Fatal::header(RESP_CID_OFF);
        return fatal(qp, st, f, l.hlen, "response for no command");
    }
    st.consume(l.header_total);
    if !cqe.status().is_success() {
        qp.hs.set(Handshake::Refused(cqe.status));
        qp.rx.set(RxState::Stop);
        return Recv::Close;
    }
    qp.hs.set(Handshake::Done);
    if qp.state.get() == QpState::Closed {
        return Recv::Close;
    }
    qp.state.set(QpState::Live);
    bump(&qp.counters.connects, 1);
    let mut requeued = 0;
    for (cid, c) in qp.cmds.borrow().iter().enumerate() {
        if c.io.is_some() {
            qp.send(Out::Cmd(cid as u16));
            requeued += 1;
        }
    }
    bump(&qp.counters.requeued, requeued);
    qp.start_pending();
    next(qp)
}

/// Handles one PDU whose header (`l`) is staged: checks its digest, then
/// consumes it and acts on it.
fn on_pdu(qp: &Qp, st: &mut Staging, l: &PduLayout) -> Recv<Link> {
    let hdr = &st.staged()[..l.header_total];
    if qp.dg.get().header && !header_digest_ok(hdr, l.hlen) {
        let f = Fatal {
            fes: fes::HEADER_DIGEST_ERROR,
            fei: 0,
        };
        return fatal(qp, st, f, l.hlen, "header digest");
    }
    // Each handler checks the header before it is consumed.
    let r = match l.ty {
        PduType::CapsuleResp => match Cqe::decode(&hdr[CH_LEN..]) {
            Some(cqe) if cqe.cid == CONNECT_CID => return on_connected(qp, st, l, cqe),
            Some(cqe) => on_response(qp, cqe).map(|()| None),
            None => return lost(qp, "short CQE"),
        },
        PduType::R2T | PduType::C2HData if qp.hs.get() != Handshake::Done => Err((
            Fatal {
                fes: fes::PDU_SEQUENCE_ERROR,
                fei: ch_off::PDU_TYPE,
            },
            "data PDU before the Connect completed",
        )),
        PduType::R2T => match DataHdr::decode(hdr) {
            Some(h) => on_r2t(qp, h).map(Some),
            None => return lost(qp, "short R2T"),
        },
        PduType::C2HData => match DataHdr::decode(hdr) {
            Some(h) => match c2h_check(qp, l, &h) {
                Ok(()) => {
                    st.consume(l.header_total);
                    return c2h_start(qp, l, h);
                }
                Err(e) => Err(e),
            },
            None => return lost(qp, "short C2HData"),
        },
        PduType::C2HTermReq => {
            let t = TermReq::decode(hdr).map(|t| t.fes).unwrap_or(0);
            tracing::debug!(
                "nvme: I/O queue {} lost: controller terminated the connection (fes {t:#x})",
                qp.qid
            );
            qp.rx.set(RxState::Stop);
            return Recv::Close;
        }
        // check_header admits nothing else from a controller.
        _ => Err((
            Fatal {
                fes: fes::PDU_SEQUENCE_ERROR,
                fei: ch_off::PDU_TYPE,
            },
            "unexpected PDU",
        )),
    };
    match r {
        Ok(out) => {
            st.consume(l.header_total);
            qp.exact.set(false);
            match out {
                Some(o) => Recv::Interim(o),
                None => next(qp),
            }
        }
        Err((f, what)) => fatal(qp, st, f, l.hlen, what),
    }
}

/// A checked C2HData whose header is consumed: its padding (if any),
/// then its data into the command's buffers.
fn c2h_start(qp: &Qp, l: &PduLayout, h: DataHdr) -> Recv<Link> {
    let pad = l.pad();
    if pad > 0 {
        // We ask for HPDA 0, but a PDO past the header is still valid:
        // drop the padding, staged or not (never reading into the data).
        qp.rx.set(RxState::Pad(*l, h));
        return Recv::Stage {
            need: pad,
            max: pad,
        };
    }
    qp.rx.set(RxState::Data(*l, h));
    Recv::Place {
        tail: hdr_exact(qp),
    }
}

/// A C2HData's data (and digest) arrived: check the digest, complete the
/// command on its last PDU.
fn c2h_done(qp: &Qp, l: &PduLayout, h: DataHdr) {
    let cid = h.cccid;
    let mut res = Ok(());
    if l.ddgst
        && data_digest(qp, cid, h.offset as usize, l.data_len) != u32::from_le_bytes(qp.ddgst.get())
    {
        res = Err(BdevError::Io(libc::EIO));
        qp.cmds.borrow_mut()[cid as usize].err = Some(BdevError::Io(libc::EIO));
    }
    if l.flags & flags::SUCCESS != 0 {
        // LAST_PDU too: c2h_check.
        qp.complete(cid, res);
    }
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
        // NVMe does not say where.
        (2, 0x85) => BdevError::Miscompare { offset: None },
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
            // Commands are sent once the Connect completed.
            Some(c) if c.io.is_some() && qp.hs.get() == Handshake::Done => c.err,
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

fn on_r2t(qp: &Qp, h: DataHdr) -> Result<Out, PduErr> {
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
    Ok(Out::H2C {
        cid: h.cccid,
        ttag: h.ttag,
        off: h.offset,
        end: h.offset + h.length,
    })
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
