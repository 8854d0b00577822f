//! The transport's receive side: ICReq/ICResp, then the receive state
//! machine ([`RecvState`]: one `set_state`, a counter per state) reading
//! PDU headers and data from the staging buffer; each PDU goes to
//! [`capsule`] (command capsules, H2CData) or ends the connection.

use std::io;
use std::os::fd::RawFd;
use std::rc::Rc;

use ustor_runtime::{ops, IoBuf};

use super::super::stats::{self, inc};
use super::super::TransportOpts;
use super::capsule;
use super::staging::{Staging, COPY_MAX, STAGING_LEN};
use super::Conn;
use crate::wire::*;

/// PDUs the receiver handles from staging before it yields to other tasks.
const RECV_BUDGET: usize = 32;

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

fn set_state(state: &mut RecvState, to: RecvState) {
    *state = to;
    stats::with(|c| inc(&c.recv_states[to as usize], 1));
}

/// What a PDU handler returns: `Err(None)` ends the connection quietly
/// (EOF, closing), `Err(Some(f))` with a termination request.
pub(super) type RecvResult = Result<(), Option<Fatal>>;

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

/// Reads PDUs until EOF, a fatal error or Disconnect.
pub(super) async fn receiver(conn: &Rc<Conn>, st: &mut Staging) {
    let mut state = RecvState::AwaitCh;
    let mut budget = RECV_BUDGET;
    let mut hdr = [0u8; MAX_HDR_LEN];
    loop {
        if conn.closing.get() || conn.dead.get() {
            return;
        }
        set_state(&mut state, RecvState::AwaitCh);
        budget -= 1;
        if budget == 0 {
            budget = RECV_BUDGET;
            ustor_runtime::yield_now().await;
        }
        let Some(layout) = read_header(conn, st, &mut state, &mut hdr).await else {
            return;
        };
        // This PDU's data, or the next one's, may be large: keep what
        // follows out of the staging buffer.
        st.exact = layout.data_len > COPY_MAX || conn.r2t_big_out.get() > 0;
        if layout.data_len > 0 {
            set_state(&mut state, RecvState::AwaitPayload);
        }
        let r = match layout.ty {
            PduType::CapsuleCmd => capsule::capsule(conn, st, &layout, &hdr).await,
            PduType::H2CData => capsule::h2c_data(conn, st, &layout, &hdr).await,
            PduType::H2CTermReq => {
                let t = TermReq::decode(&hdr);
                tracing::debug!("nvmf: host terminated the connection: {t:?}");
                stats::with(|c| inc(&c.term_recv, 1));
                return;
            }
            // check_header admits nothing else from a host.
            _ => Err(Some(Fatal::header(ch_off::PDU_TYPE))),
        };
        match r {
            Ok(()) => {}
            Err(None) => return,
            Err(Some(f)) => return fatal(conn, &mut state, f, &hdr[..layout.hlen]),
        }
    }
}

/// The common header, checked, then the rest of the header (and its
/// digest) into `hdr`. None ends the receiver: EOF, or a fatal error whose
/// termination request is queued.
#[inline]
async fn read_header(
    conn: &Conn,
    st: &mut Staging,
    state: &mut RecvState,
    hdr: &mut [u8; MAX_HDR_LEN],
) -> Option<PduLayout> {
    let fd = conn.raw();
    // Exact mode reads at most a capsule header (+ digest): all of a
    // capsule's, or an H2CData header and the first few bytes of its
    // data (copied), never a large payload.
    st.exact |= conn.r2t_big_out.get() > 0;
    let exact = CAPSULE_CMD_HLEN + conn.dg.get().hdgst_len();
    st.fill(fd, CH_LEN, exact).await.ok()?;
    let ch = CommonHeader::decode(st.peek(CH_LEN)).expect("8 bytes staged");
    st.note_pdu();
    let layout = match check_header(&ch, conn.dg.get(), false, &conn.limits()) {
        Ok(l) => l,
        Err(f) => {
            let n = st.avail().min(CH_LEN);
            let h = st.peek(n).to_vec();
            fatal(conn, state, f, &h);
            return None;
        }
    };
    set_state(state, RecvState::AwaitPsh);
    let ht = layout.header_total;
    st.fill(fd, ht, ht).await.ok()?;
    hdr[..ht].copy_from_slice(st.peek(ht));
    st.consume(ht);
    if ht > layout.hlen && !header_digest_ok(&hdr[..ht], layout.hlen) {
        stats::with(|c| inc(&c.digest_errors, 1));
        let f = Fatal {
            fes: fes::HEADER_DIGEST_ERROR,
            fei: 0,
        };
        fatal(conn, state, f, &hdr[..layout.hlen]);
        return None;
    }
    Some(layout)
}

fn fatal(conn: &Conn, state: &mut RecvState, f: Fatal, hdr: &[u8]) {
    set_state(state, RecvState::Quiesced);
    tracing::debug!("nvmf: fatal transport error {f}");
    conn.queue_term(f, hdr);
}

/// Receives `len` bytes of a PDU's data (after `pad`) into `buf[off..]`,
/// then its digest; returns whether the digest matched.
pub(super) async fn pdu_data(
    conn: &Conn,
    st: &mut Staging,
    l: &PduLayout,
    buf: IoBuf,
    off: usize,
) -> (Result<bool, Option<Fatal>>, IoBuf) {
    let fd: RawFd = conn.raw();
    if st.skip(fd, l.pad()).await.is_err() {
        return (Err(None), buf);
    }
    // What may follow the data in the same receive: everything (a greedy
    // staging read) unless a large payload may come next, then just the
    // digest and one capsule header.
    let tail = if st.exact {
        l.ddgst as usize * DIGEST_LEN + CAPSULE_CMD_HLEN + conn.dg.get().hdgst_len()
    } else {
        STAGING_LEN
    };
    let (r, buf) = st.payload(fd, buf, off, l.data_len, tail).await;
    if r.is_err() {
        return (Err(None), buf);
    }
    if !l.ddgst {
        return (Ok(true), buf);
    }
    if st.fill(fd, DIGEST_LEN, DIGEST_LEN).await.is_err() {
        return (Err(None), buf);
    }
    let want = le32(st.peek(DIGEST_LEN), 0);
    st.consume(DIGEST_LEN);
    let got = crc(&buf[off..off + l.data_len]);
    if got != want {
        stats::with(|c| inc(&c.digest_errors, 1));
    }
    (Ok(got == want), buf)
}
