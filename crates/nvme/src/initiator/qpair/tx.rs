//! The send side: command capsules (with in-capsule data) and H2CData for
//! R2Ts encoded into the PDU group, sent as the LANoT coalescer decides.

use std::future::{poll_fn, Future};
use std::os::fd::RawFd;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::task::Poll;

use ustor_bdev::IoType;
use ustor_net::recv::{self, Seg};
use ustor_net::PduGroup;

use super::{bump, wake, Cmd, Out, Qp, QpState, MAX_PDU_SEGS, MAX_RECV_IOV};
use crate::wire::*;

/// Encodes queued commands and data into `g`; false when the front item
/// did not fit (the group is full).
fn encode(qp: &Qp, g: &mut PduGroup, cmds_in_group: &mut u32) -> bool {
    let Some(item) = qp.out.borrow().front().copied() else {
        return true;
    };
    let cmds = qp.cmds.borrow();
    let cid = match item {
        Out::Cmd(cid) | Out::H2C { cid, .. } => cid,
    };
    let c = &cmds[cid as usize];
    if c.io.is_none() {
        qp.out.borrow_mut().pop_front();
        return true;
    }
    match item {
        Out::Cmd(_) => {
            if !encode_cmd(qp, g, c, cid) {
                return false;
            }
            *cmds_in_group += 1;
            qp.out.borrow_mut().pop_front();
            true
        }
        Out::H2C { ttag, off, end, .. } => encode_h2c(qp, g, c, cid, ttag, off, end),
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
/// MAXH2CDATA of it); false if it does not fit.
#[inline]
fn encode_h2c(qp: &Qp, g: &mut PduGroup, c: &Cmd, cid: u16, ttag: u16, off: u32, end: u32) -> bool {
    let dg = qp.dg.get();
    let cpda = qp.cpda.get();
    let chunk = (end - off).min(qp.maxh2c.get());
    let mut segs = [Seg::EMPTY; MAX_RECV_IOV];
    // SAFETY: the command holds its I/O.
    let k = unsafe { c.segs(off as usize, chunk as usize, &mut segs) }.min(MAX_PDU_SEGS);
    let chunk: usize = segs[..k].iter().map(|s| s.len).sum();
    if !g.fits(data_pdo(DATA_HLEN + DIGEST_LEN, cpda) + DIGEST_LEN, 2, k) {
        return false;
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
    let mut out = qp.out.borrow_mut();
    if last {
        out.pop_front();
    } else if let Some(Out::H2C { off: o, .. }) = out.front_mut() {
        *o += chunk as u32;
    }
    true
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

/// Sends queued capsules and data through the coalescer.
pub(super) async fn sender(qp: Rc<Qp>, fd: RawFd) {
    let mut group = PduGroup::new();
    let mut deadline: Option<u64> = None;
    loop {
        let timer_fired = {
            let mut sleep = deadline.map(ustor_runtime::sleep_until);
            poll_fn(|cx| {
                if qp.state.get() != QpState::Live || !qp.out.borrow().is_empty() {
                    return Poll::Ready(false);
                }
                if let Some(s) = sleep.as_mut() {
                    if Pin::new(s).poll(cx).is_ready() {
                        return Poll::Ready(true);
                    }
                }
                *qp.sender_w.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            })
            .await
        };
        if qp.state.get() != QpState::Live {
            break;
        }
        let mut cmds_in_group = 0;
        let mut full = false;
        // Budget: the queue holds at most 2 * depth items and each pass
        // either encodes one or stops.
        for _ in 0..(4 * qp.depth as usize + 8) {
            if qp.out.borrow().is_empty() {
                break;
            }
            if !encode(&qp, &mut group, &mut cmds_in_group) {
                full = true;
                break;
            }
        }
        if group.is_empty() {
            continue;
        }
        // Others in flight: commands already sent may complete and make the
        // application submit more, which could join this group.
        let others = qp.active.get().saturating_sub(cmds_in_group);
        let Some(why) = qp.coal.borrow().flush_reason(
            &group,
            full,
            timer_fired,
            others,
            group.urgent(),
            &mut deadline,
        ) else {
            continue;
        };
        let pdus = group.pdus();
        qp.coal.borrow_mut().on_flush(why, pdus, others);
        record(&qp);
        group = match flush(&qp, fd, group).await {
            Some(g) => g,
            None => break,
        };
    }
    qp.sender_running.set(false);
    wake(&qp.driver_w);
}

fn record(qp: &Qp) {
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

/// Sends the whole group; `None` when the connection failed.
async fn flush(qp: &Qp, fd: RawFd, group: PduGroup) -> Option<PduGroup> {
    let mut calls = 0;
    let (r, group) = group.send_all(fd, &mut calls).await;
    bump(&qp.counters.sendmsg_calls, calls);
    if r.is_err() {
        if qp.state.get() == QpState::Live {
            qp.state.set(QpState::Down);
        }
        recv::shutdown(fd);
        return None;
    }
    Some(group)
}
