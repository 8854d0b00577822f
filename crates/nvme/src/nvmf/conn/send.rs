//! The sender: encodes queued responses ([`Out`]) into the PDU Group and
//! flushes it (one `sendmsg`) when the LANoT coalescer says so.

use std::future::{poll_fn, Future};
use std::os::fd::RawFd;
use std::pin::Pin;
use std::rc::Rc;
use std::task::Poll;

use ustor_net::PduGroup;
use ustor_runtime::IoBuf;

use super::super::stats::{self, inc};
use super::{wake, Conn, Out};
use crate::wire::*;

/// Moves one response into the group; false if it does not fit. C2HData
/// data starts at the PDO the host's `hpda` asks for; the zero padding
/// joins the header in the arena (HPDA 0: none).
fn encode(g: &mut PduGroup, o: &mut Option<Out>, dg: Digests, hpda: u8) -> bool {
    let hd = dg.hdgst_len();
    let fits = match o.as_ref() {
        Some(Out::Resp(_)) | Some(Out::R2T { .. }) => g.fits(DATA_HLEN + hd, 1, 0),
        Some(Out::Data { .. }) => {
            let pad = data_pdo(DATA_HLEN + hd, hpda) - (DATA_HLEN + hd);
            g.fits(2 * (DATA_HLEN + hd) + pad + DIGEST_LEN, 3, 1)
        }
        Some(Out::Term { len, .. }) => g.fits(TERM_HLEN + len, 1, 0),
        None => return true,
    };
    if !fits {
        return false;
    }
    let mut h = [0u8; MAX_PADDED_HDR];
    match o.take() {
        Some(Out::Resp(c)) => {
            let n = encode_capsule_resp(&mut h, &c, dg);
            g.push_bytes(&h[..n]);
            g.end_pdu(false);
        }
        Some(Out::R2T { cid, ttag, len }) => {
            let d = DataHdr {
                cccid: cid,
                ttag,
                offset: 0,
                length: len,
            };
            let n = encode_data_hdr(&mut h, PduType::R2T, &d, 0, dg);
            g.push_bytes(&h[..n]);
            // Not urgent: like a response, an R2T waits only while other
            // commands are in flight (the sender counts the ones awaiting
            // their data), so R2Ts of a busy queue leave together and the
            // host's H2CData follow together.
            g.end_pdu(false);
        }
        Some(Out::Data {
            cid,
            buf,
            len,
            resp,
        }) => encode_data(g, &mut h, cid, buf, len, resp, dg, hpda),
        Some(Out::Term { fes, fei, hdr, len }) => {
            let mut t = [0u8; TERM_HLEN + MAX_TERM_DATA];
            let n = encode_term_req(
                &mut t,
                PduType::C2HTermReq,
                TermReq { fes, fei },
                &hdr[..len],
            );
            g.push_bytes(&t[..n]);
            g.end_pdu(true);
        }
        None => {}
    }
    true
}

/// A C2HData PDU with the read data (the buffer joins the group as is),
/// and the CapsuleResp after it unless SUCCESS answers the command.
#[allow(clippy::too_many_arguments)]
#[inline]
fn encode_data(
    g: &mut PduGroup,
    h: &mut [u8; MAX_PADDED_HDR],
    cid: u16,
    buf: IoBuf,
    len: u32,
    resp: Option<Cqe>,
    dg: Digests,
    hpda: u8,
) {
    let d = DataHdr {
        cccid: cid,
        ttag: 0,
        offset: 0,
        length: len,
    };
    let fl = flags::LAST_PDU | if resp.is_none() { flags::SUCCESS } else { 0 };
    let n = encode_data_hdr_pda(h, PduType::C2HData, &d, fl, dg, hpda);
    g.push_bytes(&h[..n]);
    let digest = dg.data.then(|| crc(&buf[..len as usize]));
    g.push_data(buf, 0, len as usize);
    if let Some(dd) = digest {
        g.push_bytes(&dd.to_le_bytes());
    }
    stats::with(|c| inc(&c.c2h, 1));
    if let Some(c) = resp {
        let n = encode_capsule_resp(h, &c, dg);
        g.push_bytes(&h[..n]);
    }
    g.end_pdu(false);
}

/// Sends queued responses through the coalescer.
pub(super) async fn sender(conn: Rc<Conn>) {
    let fd = conn.raw();
    let mut group = PduGroup::new();
    let mut pending: Option<Out> = None;
    let mut deadline: Option<u64> = None;
    let mut term = false;
    // R2Ts in `group`: their commands await data, but not because of
    // anything else in flight.
    let mut r2ts_in_group = 0u32;
    loop {
        let timer_fired = wait_for_work(&conn, pending.is_some(), group.is_empty(), deadline).await;
        r2ts_in_group += fill_group(&conn, &mut group, &mut pending, &mut term);
        if group.is_empty() {
            if conn.closing.get() && conn.executing.get() == 0 && pending.is_none() {
                // Everything is answered (a Disconnect's response
                // included): end the connection here rather than when the
                // host closes it, so the receiver's pending receive ends
                // and the queue id is free at once. After EOF or a fatal
                // error this is a no-op.
                // SAFETY: shutdown(2) on our own socket, still open.
                unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
                return;
            }
            continue;
        }
        let go = flush_due(
            &conn,
            &group,
            pending.is_some(),
            timer_fired,
            term,
            r2ts_in_group,
            &mut deadline,
        );
        if !go {
            continue;
        }
        r2ts_in_group = 0;
        group = flush(&conn, fd, group).await;
        if term {
            conn.dead.set(true);
            conn.closing.set(true);
            wake(&conn.receiver);
            // SAFETY: shutdown(2) on our own socket; the peer sees EOF.
            unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
        }
    }
}

/// Waits for something to send, the coalescer's timer, or the end; true
/// when the timer fired.
#[inline]
async fn wait_for_work(
    conn: &Conn,
    pending: bool,
    group_empty: bool,
    deadline: Option<u64>,
) -> bool {
    let mut sleep = deadline.map(ustor_runtime::sleep_until);
    poll_fn(|cx| {
        let idle = conn.closing.get() && conn.executing.get() == 0;
        if pending || !conn.out.borrow().is_empty() || (idle && group_empty) {
            return Poll::Ready(false);
        }
        if let Some(s) = sleep.as_mut() {
            if Pin::new(s).poll(cx).is_ready() {
                return Poll::Ready(true);
            }
        } else if idle {
            return Poll::Ready(false);
        }
        *conn.sender.borrow_mut() = Some(cx.waker().clone());
        Poll::Pending
    })
    .await
}

/// Fills the group from the queue until it is empty or an item does not
/// fit (left in `pending`); the number of R2Ts added.
#[inline]
fn fill_group(
    conn: &Conn,
    group: &mut PduGroup,
    pending: &mut Option<Out>,
    term: &mut bool,
) -> u32 {
    let mut r2ts = 0;
    loop {
        if pending.is_none() {
            *pending = conn.out.borrow_mut().pop_front();
        }
        let Some(o) = pending.as_ref() else { break };
        *term |= matches!(o, Out::Term { .. });
        let r2t = matches!(o, Out::R2T { .. });
        if !encode(group, pending, conn.dg.get(), conn.hpda.get()) {
            break;
        }
        r2ts += u32::from(r2t);
    }
    r2ts
}

/// Asks the coalescer whether the group leaves now (and tells it when it
/// does).
#[inline]
fn flush_due(
    conn: &Conn,
    group: &PduGroup,
    full: bool,
    timer_fired: bool,
    term: bool,
    r2ts_in_group: u32,
    deadline: &mut Option<u64>,
) -> bool {
    // Commands still executing, or awaiting the data of an R2T already
    // sent, may join the group; how many the host has in flight beyond
    // them is not visible here.
    let others = if conn.executing.get() > 0
        || !conn.out.borrow().is_empty()
        || conn.r2t_out.get() > r2ts_in_group
    {
        ustor_net::coalesce::BACKLOG_UNKNOWN
    } else {
        0
    };
    // A pending item did not fit (out of iovecs or arena): the group is
    // as full as it gets.
    let Some(why) = conn.coal.borrow().flush_reason(
        group,
        full,
        timer_fired,
        others,
        group.urgent() || term,
        deadline,
    ) else {
        return false;
    };
    // What the adaptive policy may know of the queue's depth: commands
    // executing, awaiting data, or answered but not yet in a group.
    let depth = conn.executing.get()
        + conn.r2t_out.get().saturating_sub(r2ts_in_group) as usize
        + conn.out.borrow().len();
    conn.coal
        .borrow_mut()
        .on_flush(why, group.pdus(), u32::try_from(depth).unwrap_or(u32::MAX));
    true
}

async fn flush(conn: &Conn, fd: RawFd, mut group: PduGroup) -> PduGroup {
    if conn.dead.get() {
        group.clear();
        return group;
    }
    let mut calls = 0;
    let (r, group) = group.send_all(fd, &mut calls).await;
    stats::with(|c| inc(&c.sendmsg_calls, calls));
    if r.is_err() {
        conn.dead.set(true);
        conn.closing.set(true);
        wake(&conn.receiver);
    }
    group
}
