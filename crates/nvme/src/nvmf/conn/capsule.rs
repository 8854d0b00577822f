//! A command's arrival: a command capsule takes a slot, its SGL is checked,
//! its data comes in the capsule or after an R2T as H2CData PDUs (matched
//! to the slot by transfer tag), and the command goes to a worker. Each
//! step answers the driver's next instruction ([`Recv`]).

use ustor_net::driver::{Recv, Via};
use ustor_net::Staging;
use ustor_runtime::IoBuf;

use super::super::stats::{self, inc};
use super::proto::{Data, Into, Qp, Rx};
use super::recv::{self, RecvResult};
use super::slots::SlotState;
use super::{Conn, Out};
use crate::wire::*;

/// Data direction of a command: 1 = host to controller, 2 = controller to host.
fn direction(sqe: &Sqe) -> u8 {
    if sqe.opcode() == crate::wire::admin::FABRICS {
        sqe.fctype() & 3
    } else {
        sqe.opcode() & 3
    }
}

/// A command capsule: a slot (the receiver parks while the host is beyond
/// its depth), the data SGL, then the data or an R2T for it.
pub(super) fn capsule(conn: &Conn, l: PduLayout) -> RecvResult {
    let sqe =
        Sqe::from_slice(&conn.hdr.borrow()[CH_LEN..]).ok_or(Some(Fatal::header(ch_off::HLEN)))?;
    stats::with(|c| inc(&c.commands, 1));
    conn.slot_wait.set(Some(sqe.cid()));
    slot_wait(conn, l, sqe)
}

/// Takes a free slot for `sqe`, or parks the receiver until one is free.
pub(super) fn slot_wait(conn: &Conn, l: PduLayout, sqe: Sqe) -> RecvResult {
    if conn.closing.get() {
        return Err(None);
    }
    match conn.alloc_slot() {
        Some(i) => slot_taken(conn, l, sqe, i),
        None => {
            *conn.rx.borrow_mut() = Rx::SlotWait(l, sqe);
            Ok(Recv::Park)
        }
    }
}

fn slot_taken(conn: &Conn, l: PduLayout, sqe: Sqe, i: u16) -> RecvResult {
    conn.slot_wait.set(None);
    let aborted = conn.slot_wait_aborted.replace(false);
    let sq = conn.sqsize.get().max(1);
    conn.sqhd.set((conn.sqhd.get() + 1) % (sq + 1));
    let fused = super::fused::arrive(conn, &sqe);
    let sgl = if let Err(s) = fused {
        Err(s)
    } else if sqe.psdt() == 0 {
        Err(Status::INVALID_FIELD)
    } else {
        parse_data_sgl(&sqe.sgl(), l.data_len as u32, conn.opts.max_io_size)
    };
    // Set before a refusal, so that freeing the slot fails the partner.
    conn.slots.borrow_mut()[i as usize].fused = fused.ok().flatten();
    let sgl = match sgl {
        Ok(s) => s,
        Err(s) => {
            // Refused: drop whatever data the capsule carried.
            let rest = l.plen - l.header_total;
            if rest == 0 {
                return Ok(Recv::Reply(conn.fail_out(i, sqe.cid(), s)));
            }
            *conn.rx.borrow_mut() = Rx::SkipFail {
                i,
                cid: sqe.cid(),
                status: s,
            };
            return Ok(Recv::Skip(rest as u64));
        }
    };
    {
        let mut s = conn.slots.borrow_mut();
        let slot = &mut s[i as usize];
        slot.sqe = sqe;
        slot.sgl = sgl;
        slot.failed = None;
        slot.aborted = aborted;
        slot.got = 0;
        slot.len = sgl.len();
        slot.set_state(SlotState::Receiving);
    }
    if l.data_len > 0 {
        let d = Data {
            l,
            to: Into::Capsule { i, sgl },
            buf: None,
            off: 0,
        };
        return Ok(recv::start_data(conn, d));
    }
    Ok(match sgl {
        DataSgl::Transport { len } if direction(&sqe) & 1 != 0 => {
            request_data(conn, i, sqe.cid(), len)
        }
        _ if conn.slot_aborted(i) => Recv::Reply(conn.aborted_out(i)),
        _ => Recv::Dispatch(conn.queue_job(i)),
    })
}

/// The PDU's data (and digest, `ok`: it matched) is in `buf`.
pub(super) fn data_done(conn: &Conn, st: &mut Staging, d: Data, buf: IoBuf, ok: bool) -> Recv<Qp> {
    let hlen = d.l.hlen;
    let r = match d.to {
        Into::Capsule { i, sgl } => Ok(in_capsule_done(conn, i, sgl, buf, ok)),
        Into::H2C { i, total } => h2c_done(conn, st, &d.l, i, d.off as u32, total, buf, ok),
    };
    recv::settle(conn, r, hlen)
}

/// The capsule's own data is in: the command goes to a worker.
fn in_capsule_done(conn: &Conn, i: u16, sgl: DataSgl, mut buf: IoBuf, ok: bool) -> Recv<Qp> {
    if conn.slot_aborted(i) {
        return Recv::Reply(conn.aborted_out(i));
    }
    if !ok {
        let cid = conn.slots.borrow()[i as usize].sqe.cid();
        return Recv::Reply(conn.fail_out(i, cid, Status::TRANSIENT_TRANSPORT));
    }
    if let DataSgl::InCapsule { offset, len } = sgl {
        if offset != 0 {
            // Data at an offset: move it to the front (rare; Linux uses 0).
            let (o, n) = (offset as usize, len as usize);
            buf.copy_within(o..o + n, 0);
        }
        buf.set_len(len as usize);
    }
    conn.slots.borrow_mut()[i as usize].buf = Some(buf);
    Recv::Dispatch(conn.queue_job(i))
}

/// Host-to-controller data not in the capsule: a buffer for it, then an
/// R2T asking for it (transfer tag = slot index). When the pool is empty
/// the driver waits for a buffer (a payload of no bytes into a buffer of
/// `len`).
fn request_data(conn: &Conn, i: u16, cid: u16, len: u32) -> Recv<Qp> {
    match IoBuf::try_alloc(len as usize) {
        Some(buf) => r2t(conn, i, cid, len, buf),
        None => {
            *conn.rx.borrow_mut() = Rx::R2tBuf { i, cid, len };
            Recv::Payload {
                buf: None,
                off: len as usize,
                len: 0,
                via: Via::Staging,
            }
        }
    }
}

/// The R2T for slot `i`, whose data will land in `buf`.
pub(super) fn r2t(conn: &Conn, i: u16, cid: u16, len: u32, mut buf: IoBuf) -> Recv<Qp> {
    if conn.slot_aborted(i) {
        return Recv::Reply(conn.aborted_out(i));
    }
    buf.set_len(len as usize);
    {
        let mut s = conn.slots.borrow_mut();
        s[i as usize].buf = Some(buf);
        s[i as usize].set_state(SlotState::AwaitH2C);
    }
    stats::with(|c| inc(&c.r2ts, 1));
    conn.r2t_due(len);
    Recv::Interim(Out::R2T { cid, ttag: i, len })
}

/// An H2CData PDU: checked against its R2T before any data is read, then
/// received into the command's buffer at its offset.
pub(super) fn h2c_data(conn: &Conn, l: PduLayout) -> RecvResult {
    let h = DataHdr::decode(&conn.hdr.borrow()[..]).ok_or(Some(Fatal::header(ch_off::HLEN)))?;
    stats::with(|c| inc(&c.h2c, 1));
    let i = h.ttag as usize;
    let (buf, expect_off, total) = {
        let mut s = conn.slots.borrow_mut();
        let Some(slot) = s.get_mut(i).filter(|s| s.state() == SlotState::AwaitH2C) else {
            return Err(Some(Fatal::header(10)));
        };
        if slot.sqe.cid() != h.cccid {
            return Err(Some(Fatal::header(8)));
        }
        if h.length as usize != l.data_len {
            return Err(Some(Fatal::header(16)));
        }
        if h.offset != slot.got || u64::from(h.offset) + u64::from(h.length) > u64::from(slot.len) {
            return Err(Some(Fatal {
                fes: fes::DATA_OUT_OF_RANGE,
                fei: 12,
            }));
        }
        // The receiver holds the buffer while the data comes in: an Abort
        // meanwhile only marks the slot.
        slot.set_state(SlotState::Receiving);
        (slot.buf.take(), slot.got, slot.len)
    };
    let Some(buf) = buf else {
        return Err(None);
    };
    let d = Data {
        l,
        to: Into::H2C { i: i as u16, total },
        buf: Some(buf),
        off: expect_off as usize,
    };
    Ok(recv::start_data(conn, d))
}

/// An H2CData PDU's data is in: the command goes to a worker once all of
/// its data is.
#[allow(clippy::too_many_arguments)]
fn h2c_done(
    conn: &Conn,
    st: &mut Staging,
    l: &PduLayout,
    i: u16,
    expect_off: u32,
    total: u32,
    buf: IoBuf,
    ok: bool,
) -> RecvResult {
    let got = expect_off + l.data_len as u32;
    let (done, aborted) = {
        let mut s = conn.slots.borrow_mut();
        let slot = &mut s[i as usize];
        slot.buf = Some(buf);
        slot.got = got;
        if !ok {
            slot.failed = Some(Status::TRANSIENT_TRANSPORT);
        }
        let (done, aborted) = (got == total, slot.aborted);
        if !done && !aborted {
            slot.set_state(SlotState::AwaitH2C);
        }
        (done, aborted)
    };
    if aborted || done {
        conn.r2t_settled(total);
    }
    if aborted {
        Ok(Recv::Reply(conn.aborted_out(i)))
    } else if done {
        Ok(Recv::Dispatch(conn.queue_job(i)))
    } else if l.flags & flags::LAST_PDU != 0 {
        // The host says it is done before the R2T's data is in.
        Err(Some(Fatal {
            fes: fes::PDU_SEQUENCE_ERROR,
            fei: ch_off::FLAGS,
        }))
    } else {
        Ok(recv::next_pdu(conn, st, false))
    }
}
