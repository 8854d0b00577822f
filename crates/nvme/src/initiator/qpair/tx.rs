//! The send side: the ICReq and Fabrics Connect that start a connection,
//! command capsules (with in-capsule data), H2CData for R2Ts and the
//! H2CTermReq encoded into the driver's PDU group
//! ([`ustor_net::driver::Protocol::encode`]); the driver sends it as the
//! queue's LANoT coalescer decides.

use std::sync::atomic::Ordering;

use ustor_bdev::IoType;
use ustor_net::recv::Seg;
use ustor_net::PduGroup;

use super::super::ctrlr::handshake;
use super::{Cmd, Out, Qp, CONNECT_CID, MAX_PDU_SEGS, MAX_RECV_IOV};
use crate::wire::*;

/// Encodes `o` into `g`, or gives back what did not fit (the driver
/// sends the group first): a capsule whole, an R2T's data from the first
/// H2CData PDU that did not fit.
pub(super) fn encode(qp: &Qp, o: Out, g: &mut PduGroup) -> Result<(), Out> {
    let cid = match o {
        Out::Cmd(cid) | Out::H2C { cid, .. } => cid,
        Out::IcReq | Out::Connect | Out::Term => {
            return encode_control(qp, o, g).then_some(()).ok_or(o)
        }
    };
    let cmds = qp.cmds.borrow();
    let c = &cmds[cid as usize];
    if c.io.is_none() {
        // Completed (failed) meanwhile: nothing to send.
        return Ok(());
    }
    match o {
        Out::Cmd(_) => {
            if !encode_cmd(qp, g, c, cid) {
                return Err(o);
            }
            qp.grp_cmds.set(qp.grp_cmds.get() + 1);
            Ok(())
        }
        Out::H2C {
            ttag, mut off, end, ..
        } => {
            // Budget: each round encodes a PDU of at least one byte of
            // [off, end), or stops.
            while off < end {
                match encode_h2c(qp, g, c, cid, ttag, off, end) {
                    Some(next) => off = next,
                    None => {
                        return Err(Out::H2C {
                            cid,
                            ttag,
                            off,
                            end,
                        })
                    }
                }
            }
            Ok(())
        }
        Out::IcReq | Out::Connect | Out::Term => unreachable!("encoded above"),
    }
}

/// The connection's control PDUs: the ICReq, the Fabrics Connect, the
/// H2CTermReq for the fatal error the receiver recorded; false if it does
/// not fit.
fn encode_control(qp: &Qp, o: Out, g: &mut PduGroup) -> bool {
    let c = &qp.ctrlr;
    match o {
        Out::IcReq => handshake::encode_ic_req(g, handshake::wanted(c)),
        Out::Connect => {
            let (sqe, d) =
                handshake::connect_cmd(c, qp.qid, qp.depth - 1, qp.cntlid.get(), CONNECT_CID);
            handshake::encode_capsule(g, &sqe, &d, qp.dg.get(), qp.cpda.get())
        }
        _ => {
            let t = qp.term.borrow();
            handshake::encode_term(g, t.0, &t.1[..t.2])
        }
    }
}

/// The command's SQE, and how many bytes of data go in its capsule.
#[inline]
fn build_sqe(qp: &Qp, c: &Cmd, cid: u16) -> (Sqe, usize) {
    let mut sqe = Sqe::default();
    sqe.set_cid(cid).set_nsid(qp.nsid).set_sgl_psdt();
    let mut icd = 0usize;
    match c.kind {
        IoType::Read => {
            sqe.set_opcode(io::READ)
                .set_slba(c.slba)
                .set_cdw(12, c.nlb - 1);
            sqe.set_sgl(SglDesc::transport(c.len));
        }
        IoType::Write => {
            sqe.set_opcode(io::WRITE)
                .set_slba(c.slba)
                .set_cdw(12, c.nlb - 1);
            if c.in_capsule {
                sqe.set_sgl(SglDesc::in_capsule(c.len));
                icd = c.len as usize;
            } else {
                sqe.set_sgl(SglDesc::transport(c.len));
            }
        }
        IoType::Flush => {
            sqe.set_opcode(io::FLUSH);
        }
        IoType::WriteZeroes => {
            sqe.set_opcode(io::WRITE_ZEROES)
                .set_slba(c.slba)
                .set_cdw(12, c.nlb - 1);
        }
        IoType::Unmap => {
            // DSM, one range, attribute deallocate.
            sqe.set_opcode(io::DSM).set_cdw(10, 0).set_cdw(11, 1 << 2);
            sqe.set_sgl(SglDesc::in_capsule(16));
            icd = 16;
        }
        IoType::Reset => unreachable!("completed at submit"),
        // Not claimed (`io_type_supported`): the generic layer never sends it.
        IoType::CompareAndWrite => unreachable!("compare-and-write is not offered"),
    }
    (sqe, icd)
}

/// A command capsule (with its in-capsule data); false if it does not fit.
#[inline]
fn encode_cmd(qp: &Qp, g: &mut PduGroup, c: &Cmd, cid: u16) -> bool {
    let dg = qp.dg.get();
    let cpda = qp.cpda.get();
    let (sqe, icd) = build_sqe(qp, c, cid);
    let nseg = if c.kind == IoType::Write && icd > 0 {
        c.iovcnt
    } else {
        0
    };
    // Header with digest, padding up to the data (CPDA 0: none).
    let hl = if icd > 0 {
        data_pdo(CAPSULE_CMD_HLEN + DIGEST_LEN, cpda)
    } else {
        CAPSULE_CMD_HLEN + DIGEST_LEN
    };
    if !g.fits(hl + icd.min(16) + DIGEST_LEN, 3, nseg) {
        return false;
    }
    let mut h = [0u8; MAX_PADDED_HDR];
    let n = encode_capsule_cmd_pda(&mut h, &sqe, dg, icd, cpda);
    g.push_bytes(&h[..n]);
    if c.kind == IoType::Unmap {
        g.push_bytes(&c.dsm);
        if dg.data {
            g.push_bytes(&crc(&c.dsm).to_le_bytes());
        }
    } else if icd > 0 {
        // SAFETY: the command holds its I/O, whose buffers stay valid and
        // unchanged until it completes — after the controller answered, so
        // after this group was sent.
        let data = unsafe { c.iovecs() }
            .iter()
            .map(|v| (v.iov_base as *const u8, v.iov_len));
        // SAFETY: as above.
        unsafe { push_data(g, data, dg.data) };
    }
    g.end_pdu(false);
    true
}

/// One H2CData PDU of write data an R2T asked for ([off, end), at most
/// MAXH2CDATA of it): where the next one starts, `None` if it does not fit.
#[inline]
fn encode_h2c(
    qp: &Qp,
    g: &mut PduGroup,
    c: &Cmd,
    cid: u16,
    ttag: u16,
    off: u32,
    end: u32,
) -> Option<u32> {
    let dg = qp.dg.get();
    let cpda = qp.cpda.get();
    let chunk = (end - off).min(qp.maxh2c.get());
    let mut segs = [Seg::EMPTY; MAX_RECV_IOV];
    // SAFETY: the command holds its I/O.
    let k = unsafe { c.segs(off as usize, chunk as usize, &mut segs) }.min(MAX_PDU_SEGS);
    let chunk: usize = segs[..k].iter().map(|s| s.len).sum();
    if !g.fits(data_pdo(DATA_HLEN + DIGEST_LEN, cpda) + DIGEST_LEN, 2, k) {
        return None;
    }
    let last = off as usize + chunk == end as usize;
    let dh = DataHdr {
        cccid: cid,
        ttag,
        offset: off,
        length: chunk as u32,
    };
    let fl = if last { flags::LAST_PDU } else { 0 };
    let mut h = [0u8; MAX_PADDED_HDR];
    let n = encode_data_hdr_pda(&mut h, PduType::H2CData, &dh, fl, dg, cpda);
    g.push_bytes(&h[..n]);
    let data = segs[..k].iter().map(|s| (s.ptr as *const u8, s.len));
    // SAFETY: as for in-capsule data (`encode_cmd`).
    unsafe { push_data(g, data, dg.data) };
    // The controller waits for this data: do not hold it back.
    g.end_pdu(true);
    Some(off + chunk as u32)
}

/// Appends write data to the group by pointer (no copy), then its data
/// digest when `ddgst`.
///
/// # Safety
/// Every segment must stay valid and unchanged until the group was sent.
#[inline]
unsafe fn push_data(g: &mut PduGroup, segs: impl Iterator<Item = (*const u8, usize)>, ddgst: bool) {
    let mut d = 0u32;
    for (i, (ptr, len)) in segs.enumerate() {
        // SAFETY: the caller's contract.
        unsafe { g.push_raw(ptr, len) };
        if ddgst {
            // SAFETY: as above; the bytes are readable.
            let b = unsafe { std::slice::from_raw_parts(ptr, len) };
            d = if i == 0 { crc(b) } else { crc_append(d, b) };
        }
    }
    if ddgst {
        g.push_bytes(&d.to_le_bytes());
    }
}

/// Publishes the coalescer's counters (after each sent group).
pub(super) fn record(qp: &Qp) {
    let s = qp.coal.borrow().stats();
    let c = &qp.counters;
    c.groups.store(s.groups, Ordering::Relaxed);
    c.pdus.store(s.pdus, Ordering::Relaxed);
    c.full_groups.store(s.full_groups, Ordering::Relaxed);
    c.small_groups.store(s.small_groups, Ordering::Relaxed);
    c.timer_expiries.store(s.timer_expiries, Ordering::Relaxed);
    c.degree.store(u64::from(s.degree), Ordering::Relaxed);
    c.timer_us.store(u64::from(s.timer_us), Ordering::Relaxed);
    c.raises.store(s.raises, Ordering::Relaxed);
    c.lowers.store(s.lowers, Ordering::Relaxed);
}
