//! The transport's receive side: ICReq/ICResp, then the steps of the
//! receive state machine ([`Rx`]; a counter per [`RecvState`] entered)
//! that tell the driver which PDU header and data bytes to stage or
//! receive; each PDU goes to [`capsule`] (command capsules, H2CData) or
//! ends the connection.

use std::io;
use std::os::fd::RawFd;

use ustor_net::driver::{Recv, Via};
use ustor_net::{Staging, COPY_MAX};
use ustor_runtime::{ops, IoBuf};

use super::super::stats::{self, inc};
use super::super::TransportOpts;
use super::capsule;
use super::proto::{Data, Qp, Rx, STAGING_LEN};
use super::Conn;
use crate::wire::*;

/// The receive state machine (one `set_state`, a counter per state).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RecvState {
    /// Waiting for the 8-byte common header of the next PDU.
    AwaitCh = 0,
    /// Common header checked; waiting for the rest of the header and digest.
    AwaitPsh = 1,
    /// Header complete; receiving padding, data and data digest.
    AwaitPayload = 2,
    /// A fatal error was reported; nothing more is read.
    Quiesced = 3,
}

/// Counts a state entered (the state itself is the connection's [`Rx`]).
fn count_state(to: RecvState) {
    stats::with(|c| inc(&c.recv_states[to as usize], 1));
}

/// What a PDU handler returns: the driver's next instruction; `Err(None)`
/// ends the connection quietly (closing), `Err(Some(f))` with a
/// termination request.
pub(super) type RecvResult = Result<Recv<Qp>, Option<Fatal>>;

/// ICReq/ICResp: the host's digests and data alignment. A bad ICReq is
/// answered with a termination request that quotes it (`Err`). Runs under
/// the listener's handshake timeout, before the connection has any state:
/// the one buffer is the ICReq's own.
pub(super) async fn initialize(fd: RawFd, opts: &TransportOpts) -> io::Result<IcReq> {
    let (r, mut b) = ustor_net::recv::recv_exact(fd, IoBuf::heap(IC_LEN), 0, IC_LEN).await;
    r?;
    b.set_len(IC_LEN);
    let req = match IcReq::decode(&b) {
        Ok(r) => r,
        Err(f) => {
            terminate(fd, f, &b).await;
            return Err(io::ErrorKind::InvalidData.into());
        }
    };
    debug_assert!(req.hpda <= MAX_PDA);
    if req.digests.header && req.digests.data {
        stats::with(|c| inc(&c.digest_qpairs, 1));
    }
    let resp = IcResp {
        pfv: 0,
        cpda: 0,
        digests: req.digests,
        maxh2cdata: opts.max_h2c_data,
    };
    b.copy_from_slice(&resp.encode());
    ops::send_all(fd, b).await.0?;
    Ok(req)
}

/// Sends a C2HTermReq quoting `hdr` and shuts the socket down (a fatal
/// error before the connection has a sender).
async fn terminate(fd: RawFd, f: Fatal, hdr: &[u8]) {
    let mut t = [0u8; TERM_HLEN + MAX_TERM_DATA];
    let q = &hdr[..hdr.len().min(MAX_TERM_DATA)];
    let n = encode_term_req(
        &mut t,
        PduType::C2HTermReq,
        TermReq {
            fes: f.fes,
            fei: f.fei,
        },
        q,
    );
    stats::with(|c| inc(&c.term_sent, 1));
    let mut b = IoBuf::heap(n);
    b.copy_from_slice(&t[..n]);
    let _ = ops::send_all(fd, b).await;
    ustor_net::recv::shutdown(fd);
}

/// The next PDU: its common header (at most a capsule header when headers
/// are read exactly). Entered on the driver's `Next` (`noted`: the driver
/// marked the unit in staging) or straight after a PDU that queued nothing.
pub(super) fn next_pdu(conn: &Conn, st: &mut Staging, noted: bool) -> Recv<Qp> {
    if conn.closing.get() {
        return Recv::Close;
    }
    if !noted {
        st.note_unit();
    }
    count_state(RecvState::AwaitCh);
    // Exact mode reads at most a capsule header (+ digest): all of a
    // capsule's, or an H2CData header and the first few bytes of its
    // data (copied), never a large payload.
    let exact = conn.exact.get() || conn.r2t_big_out.get() > 0;
    conn.exact.set(exact);
    let max = if exact {
        CAPSULE_CMD_HLEN + conn.dg.get().hdgst_len()
    } else {
        usize::MAX
    };
    // A greedy receive usually staged the header already: check it in
    // this call rather than in a driver round per header part. Only on
    // the driver's `Next`, so a run of staged PDUs that queue nothing
    // never nests these calls.
    if noted && st.avail() >= CH_LEN {
        return common_header(conn, st);
    }
    *conn.rx.borrow_mut() = Rx::Ch;
    Recv::Stage { need: CH_LEN, max }
}

/// The common header is staged: checked, then the rest of the header (and
/// its digest) is staged.
pub(super) fn common_header(conn: &Conn, st: &mut Staging) -> Recv<Qp> {
    let ch = CommonHeader::decode(st.peek(CH_LEN)).expect("8 bytes staged");
    let l = match check_header(&ch, conn.dg.get(), false, &conn.limits()) {
        Ok(l) => l,
        Err(f) => {
            let mut h = [0u8; CH_LEN];
            let n = st.avail().min(CH_LEN);
            h[..n].copy_from_slice(st.peek(n));
            return fatal(conn, f, &h[..n]);
        }
    };
    count_state(RecvState::AwaitPsh);
    let ht = l.header_total;
    if st.avail() >= ht {
        return pdu_header(conn, st, l);
    }
    let max = if conn.exact.get() { ht } else { usize::MAX };
    *conn.rx.borrow_mut() = Rx::Psh(l);
    Recv::Stage { need: ht, max }
}

/// The whole header is staged: its digest checked, then the PDU goes to
/// [`capsule`] or ends the connection.
pub(super) fn pdu_header(conn: &Conn, st: &mut Staging, l: PduLayout) -> Recv<Qp> {
    let ht = l.header_total;
    {
        let mut hdr = conn.hdr.borrow_mut();
        hdr[..ht].copy_from_slice(st.peek(ht));
        st.consume(ht);
        if ht > l.hlen && !header_digest_ok(&hdr[..ht], l.hlen) {
            stats::with(|c| inc(&c.digest_errors, 1));
            let f = Fatal {
                fes: fes::HEADER_DIGEST_ERROR,
                fei: 0,
            };
            drop(hdr);
            return fatal_hdr(conn, f, l.hlen);
        }
    }
    // This PDU's data, or the next one's, may be large: keep what follows
    // out of the staging buffer.
    conn.exact
        .set(l.data_len > COPY_MAX || conn.r2t_big_out.get() > 0);
    if l.data_len > 0 {
        count_state(RecvState::AwaitPayload);
    }
    let r = match l.ty {
        PduType::CapsuleCmd => capsule::capsule(conn, l),
        PduType::H2CData => capsule::h2c_data(conn, l),
        PduType::H2CTermReq => {
            let t = TermReq::decode(&conn.hdr.borrow()[..]);
            tracing::debug!("nvmf: host terminated the connection: {t:?}");
            stats::with(|c| inc(&c.term_recv, 1));
            return Recv::Close;
        }
        // check_header admits nothing else from a host.
        _ => Err(Some(Fatal::header(ch_off::PDU_TYPE))),
    };
    settle(conn, r, l.hlen)
}

/// A PDU handler's outcome as the driver's next instruction.
#[inline]
pub(super) fn settle(conn: &Conn, r: RecvResult, hlen: usize) -> Recv<Qp> {
    match r {
        Ok(next) => next,
        Err(None) => Recv::Close,
        Err(Some(f)) => fatal_hdr(conn, f, hlen),
    }
}

/// A fatal error on the PDU whose header the connection holds.
fn fatal_hdr(conn: &Conn, f: Fatal, hlen: usize) -> Recv<Qp> {
    let mut h = [0u8; MAX_TERM_DATA];
    let n = hlen.min(MAX_TERM_DATA);
    h[..n].copy_from_slice(&conn.hdr.borrow()[..n]);
    fatal(conn, f, &h[..n])
}

/// Quiesces the receiver and answers with a termination request quoting
/// `hdr`; the connection ends once it is sent.
fn fatal(conn: &Conn, f: Fatal, hdr: &[u8]) -> Recv<Qp> {
    count_state(RecvState::Quiesced);
    tracing::debug!("nvmf: fatal transport error {f}");
    *conn.rx.borrow_mut() = Rx::Quiesced;
    Recv::Reply(conn.term_out(f, hdr))
}

/// The PDU's data: its padding skipped first, then the data received into
/// the buffer (a pool buffer of `data_len` bytes when it has none).
pub(super) fn start_data(conn: &Conn, d: Data) -> Recv<Qp> {
    let pad = d.l.pad();
    if pad > 0 {
        *conn.rx.borrow_mut() = Rx::Pad(d);
        return Recv::Skip(pad as u64);
    }
    payload(conn, d)
}

/// Receives the data in place, with what may follow it in the same
/// receive: everything (a greedy staging read) unless a large payload may
/// come next, then just the digest and one capsule header.
pub(super) fn payload(conn: &Conn, mut d: Data) -> Recv<Qp> {
    let tail = if conn.exact.get() {
        d.l.ddgst as usize * DIGEST_LEN + CAPSULE_CMD_HLEN + conn.dg.get().hdgst_len()
    } else {
        STAGING_LEN
    };
    let (buf, off, len) = (d.buf.take(), d.off, d.l.data_len);
    *conn.rx.borrow_mut() = Rx::Payload(d);
    Recv::Payload {
        buf,
        off,
        len,
        via: Via::Direct { tail },
    }
}

/// The data is in `buf`: its digest is staged next, if it has one.
pub(super) fn payload_in(conn: &Conn, st: &mut Staging, d: Data, buf: IoBuf) -> Recv<Qp> {
    if !d.l.ddgst {
        return capsule::data_done(conn, st, d, buf, true);
    }
    *conn.rx.borrow_mut() = Rx::Digest(d, buf);
    Recv::Stage {
        need: DIGEST_LEN,
        max: DIGEST_LEN,
    }
}

/// The data digest is staged: checked against the data.
pub(super) fn digest_in(conn: &Conn, st: &mut Staging, d: Data, buf: IoBuf) -> Recv<Qp> {
    let want = le32(st.peek(DIGEST_LEN), 0);
    st.consume(DIGEST_LEN);
    let got = crc(&buf[d.off..d.off + d.l.data_len]);
    if got != want {
        stats::with(|c| inc(&c.digest_errors, 1));
    }
    capsule::data_done(conn, st, d, buf, got == want)
}
