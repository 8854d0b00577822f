//! A command's arrival: a command capsule takes a slot, its SGL is checked,
//! its data comes in the capsule or after an R2T as H2CData PDUs (matched
//! to the slot by transfer tag), and the command goes to a worker.

use std::rc::Rc;

use ustor_runtime::IoBuf;

use super::super::stats::{self, inc};
use super::recv::{pdu_data, RecvResult};
use super::slots::{self, SlotState};
use super::staging::Staging;
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

impl Conn {
    /// Answers slot `i`'s command with `s` before it ran, freeing the slot.
    fn fail_slot(&self, i: u16, cid: u16, s: Status) {
        let c = self.cqe(cid, s);
        self.free_slot(i);
        stats::with(|c| inc(&c.errors, 1));
        self.push_out(Out::Resp(c));
    }

    fn slot_aborted(&self, i: u16) -> bool {
        self.slots.borrow()[i as usize].aborted
    }
}

/// A command capsule: a slot (waiting for one if the host is beyond its
/// depth), the data SGL, then the data or an R2T for it.
pub(super) async fn capsule(
    conn: &Rc<Conn>,
    st: &mut Staging,
    l: &PduLayout,
    hdr: &[u8],
) -> RecvResult {
    let sqe = Sqe::from_slice(&hdr[CH_LEN..]).ok_or(Some(Fatal::header(ch_off::HLEN)))?;
    stats::with(|c| inc(&c.commands, 1));
    conn.slot_wait.set(Some(sqe.cid()));
    let i = slots::slot(conn).await;
    conn.slot_wait.set(None);
    let aborted = conn.slot_wait_aborted.replace(false);
    let Some(i) = i else {
        return Err(None);
    };
    let sq = conn.sqsize.get().max(1);
    conn.sqhd.set((conn.sqhd.get() + 1) % (sq + 1));
    let sgl = if sqe.psdt() == 0 {
        Err(Status::INVALID_FIELD)
    } else {
        parse_data_sgl(&sqe.sgl(), l.data_len as u32, conn.opts.max_io_size)
    };
    let sgl = match sgl {
        Ok(s) => s,
        Err(s) => {
            // Refused: drop whatever data the capsule carried.
            let rest = l.plen - l.header_total;
            if st.skip(conn.raw(), rest).await.is_err() {
                return Err(None);
            }
            conn.fail_slot(i, sqe.cid(), s);
            return Ok(());
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
        return in_capsule_data(conn, st, l, i, sgl).await;
    }
    match sgl {
        DataSgl::Transport { len } if direction(&sqe) & 1 != 0 => {
            request_data(conn, i, sqe.cid(), len).await;
        }
        _ if conn.slot_aborted(i) => conn.complete_aborted(i),
        _ => conn.queue_job(i),
    }
    Ok(())
}

/// The capsule's own data into a pool buffer, then to a worker.
async fn in_capsule_data(
    conn: &Rc<Conn>,
    st: &mut Staging,
    l: &PduLayout,
    i: u16,
    sgl: DataSgl,
) -> RecvResult {
    let mut buf = IoBuf::alloc(l.data_len).await;
    buf.set_len(l.data_len);
    let (r, mut buf) = pdu_data(conn, st, l, buf, 0).await;
    let ok = r?;
    if conn.slot_aborted(i) {
        conn.complete_aborted(i);
        return Ok(());
    }
    if !ok {
        let cid = conn.slots.borrow()[i as usize].sqe.cid();
        conn.fail_slot(i, cid, Status::TRANSIENT_TRANSPORT);
        return Ok(());
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
    conn.queue_job(i);
    Ok(())
}

/// Host-to-controller data not in the capsule: a buffer for it, then an
/// R2T asking for it (transfer tag = slot index).
async fn request_data(conn: &Rc<Conn>, i: u16, cid: u16, len: u32) {
    let mut buf = IoBuf::alloc(len as usize).await;
    if conn.slot_aborted(i) {
        conn.complete_aborted(i);
        return;
    }
    buf.set_len(len as usize);
    {
        let mut s = conn.slots.borrow_mut();
        s[i as usize].buf = Some(buf);
        s[i as usize].set_state(SlotState::AwaitH2C);
    }
    stats::with(|c| inc(&c.r2ts, 1));
    conn.r2t_due(len);
    conn.push_out(Out::R2T { cid, ttag: i, len });
}

/// An H2CData PDU: checked against its R2T before any data is read, then
/// received into the command's buffer at its offset.
pub(super) async fn h2c_data(
    conn: &Rc<Conn>,
    st: &mut Staging,
    l: &PduLayout,
    hdr: &[u8],
) -> RecvResult {
    let h = DataHdr::decode(hdr).ok_or(Some(Fatal::header(ch_off::HLEN)))?;
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
    let (r, buf) = pdu_data(conn, st, l, buf, expect_off as usize).await;
    let ok = r?;
    let got = expect_off + h.length;
    let (done, aborted) = {
        let mut s = conn.slots.borrow_mut();
        let slot = &mut s[i];
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
        conn.complete_aborted(i as u16);
    } else if done {
        conn.queue_job(i as u16);
    } else if l.flags & flags::LAST_PDU != 0 {
        // The host says it is done before the R2T's data is in.
        return Err(Some(Fatal {
            fes: fes::PDU_SEQUENCE_ERROR,
            fei: ch_off::FLAGS,
        }));
    }
    Ok(())
}
