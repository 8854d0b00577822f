//! The admin queue's connection as a client protocol on the connection
//! driver ([`ustor_net::driver`]): the ICReq and the controller's ICResp,
//! then one command at a time (its capsule out; its C2HData copied into
//! the command's buffer; its response), and an H2CTermReq for a malformed
//! controller PDU. Control path: every PDU is staged whole and copied.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::task::Waker;

use ustor_net::driver::{Protocol, Recv, RecvEvent};
use ustor_net::staging::Staging;
use ustor_net::PduGroup;

use super::handshake;
use super::ADMIN_BUF;
use crate::wire::*;

/// Where the receiver is in the controller's PDU stream.
#[derive(Clone, Copy, Debug)]
enum Rx {
    /// The ICResp is being staged.
    IcResp,
    /// A common header is being staged.
    Common,
    /// A whole PDU is being staged.
    Pdu(PduLayout),
    /// A fatal error was queued for the controller, or the connection is
    /// unusable: stop.
    Stop,
}

/// Something for the sender.
pub(super) enum AdminOut {
    IcReq,
    /// The command in [`Admin::cmd`].
    Cmd,
    /// An H2CTermReq for the fatal error the receiver found.
    Term,
}

/// The command in flight (one at a time).
pub(super) struct Pending {
    pub sqe: Sqe,
    /// In-capsule data.
    pub out: Vec<u8>,
    /// Where its C2HData goes.
    pub inbuf: Vec<u8>,
    /// Its completion, once it arrived.
    pub cqe: Option<Cqe>,
}

/// The admin connection's state, shared by the protocol and the client.
pub(super) struct Admin {
    want: Digests,
    rx: Cell<Rx>,
    /// What the ICResp settled (`None` until it arrived).
    ic: Cell<Option<IcResp>>,
    cmd: RefCell<Option<Pending>>,
    /// Why the connection is unusable (`None` while it is fine).
    lost: Cell<Option<&'static str>>,
    /// The driver returned: nothing more is sent or received.
    ended: Cell<bool>,
    /// The fatal error for the H2CTermReq, with the header it quotes.
    term: RefCell<(Fatal, [u8; MAX_TERM_DATA], usize)>,
    waiter: RefCell<Option<Waker>>,
}

impl Admin {
    pub fn new(want: Digests) -> Admin {
        Admin {
            want,
            rx: Cell::new(Rx::IcResp),
            ic: Cell::new(None),
            cmd: RefCell::new(None),
            lost: Cell::new(None),
            ended: Cell::new(false),
            term: RefCell::new((Fatal { fes: 0, fei: 0 }, [0; MAX_TERM_DATA], 0)),
            waiter: RefCell::new(None),
        }
    }

    pub fn lost(&self) -> Option<&'static str> {
        self.lost.get()
    }
    pub fn ended(&self) -> bool {
        self.ended.get()
    }
    pub fn cmd(&self) -> &RefCell<Option<Pending>> {
        &self.cmd
    }
    pub fn set_waiter(&self, w: &Waker) {
        *self.waiter.borrow_mut() = Some(w.clone());
    }

    /// The driver returned (the socket is shut down).
    pub fn end(&self) {
        if self.lost.get().is_none() {
            self.lost.set(Some("connection closed"));
        }
        self.ended.set(true);
        self.wake();
    }

    fn wake(&self) {
        if let Some(w) = self.waiter.borrow_mut().take() {
            w.wake();
        }
    }
}

/// The admin connection as the driver's protocol.
pub(super) struct AdminLink(pub Rc<Admin>);

impl Protocol for AdminLink {
    /// A client executes nothing: the controller does.
    type Job = std::convert::Infallible;
    type Reply = AdminOut;

    fn apply(&self, ev: RecvEvent, st: &mut Staging) -> Recv<Self> {
        let a = &*self.0;
        match (a.rx.get(), ev) {
            (Rx::Stop, _) => Recv::Close,
            (Rx::IcResp, RecvEvent::Staged) => on_ic_resp(a, st),
            (Rx::IcResp, _) => Recv::Stage {
                need: IC_LEN,
                max: IC_LEN,
            },
            (Rx::Common, RecvEvent::Staged) => on_common(a, st),
            (Rx::Pdu(l), RecvEvent::Staged) => on_pdu(a, st, &l),
            _ => next(a),
        }
    }

    async fn execute(&self, job: Self::Job) -> AdminOut {
        match job {}
    }

    fn encode(&self, o: AdminOut, g: &mut PduGroup) -> Result<(), AdminOut> {
        let a = &*self.0;
        let fits = match o {
            AdminOut::IcReq => handshake::encode_ic_req(g, a.want),
            AdminOut::Cmd => match (&*a.cmd.borrow(), a.ic.get()) {
                (Some(p), Some(ic)) => {
                    handshake::encode_capsule(g, &p.sqe, &p.out, ic.digests, ic.cpda)
                }
                // Given up meanwhile (a timed-out keep alive); commands are
                // only queued after the ICResp.
                _ => true,
            },
            AdminOut::Term => {
                let t = a.term.borrow();
                handshake::encode_term(g, t.0, &t.1[..t.2])
            }
        };
        if fits {
            Ok(())
        } else {
            Err(o)
        }
    }

    fn urgent(&self, _o: &AdminOut) -> bool {
        true
    }

    fn on_close(&self) {
        // The client learns of the end when the driver returned
        // ([`Admin::end`]), so a queued H2CTermReq leaves first.
        let a = &*self.0;
        if a.lost.get().is_none() {
            a.lost.set(Some("connection closed"));
        }
    }
}

/// The next PDU's common header.
fn next(a: &Admin) -> Recv<AdminLink> {
    a.rx.set(Rx::Common);
    Recv::Stage {
        need: CH_LEN,
        max: CH_LEN,
    }
}

/// The connection is unusable (no termination request is owed).
fn lost(a: &Admin, why: &'static str) -> Recv<AdminLink> {
    tracing::debug!("nvme: admin queue lost: {why}");
    a.lost.set(Some(why));
    a.rx.set(Rx::Stop);
    Recv::Close
}

/// A fatal error in a controller PDU whose first `hdr` bytes are staged:
/// an H2CTermReq quoting them, then stop.
fn fatal(a: &Admin, st: &Staging, f: Fatal, hdr: usize, why: &'static str) -> Recv<AdminLink> {
    tracing::debug!("nvme: admin queue lost: {why} ({f})");
    let staged = st.staged();
    let n = hdr.min(staged.len()).min(MAX_TERM_DATA);
    {
        let mut t = a.term.borrow_mut();
        t.0 = f;
        t.1[..n].copy_from_slice(&staged[..n]);
        t.2 = n;
    }
    a.lost.set(Some(why));
    a.rx.set(Rx::Stop);
    Recv::Interim(AdminOut::Term)
}

/// The ICResp is staged: what it settled, then the command waiting for
/// it (the Fabrics Connect).
fn on_ic_resp(a: &Admin, st: &mut Staging) -> Recv<AdminLink> {
    match handshake::check_ic_resp(a.want, st.peek(IC_LEN)) {
        Ok(r) => {
            st.consume(IC_LEN);
            a.ic.set(Some(r));
            a.rx.set(Rx::Common);
            if a.cmd.borrow().is_some() {
                Recv::Interim(AdminOut::Cmd)
            } else {
                next(a)
            }
        }
        Err((f, why)) => fatal(a, st, f, IC_LEN, why),
    }
}

/// A common header is staged: check it, then stage the whole PDU.
fn on_common(a: &Admin, st: &mut Staging) -> Recv<AdminLink> {
    let lim = RecvLimits {
        max_incapsule: 0,
        max_data_pdu: 8192,
    };
    let Some(ch) = CommonHeader::decode(st.staged()) else {
        return lost(a, "short header");
    };
    let dg = a.ic.get().map(|r| r.digests).unwrap_or_default();
    let l = match check_header(&ch, dg, true, &lim) {
        Ok(l) => l,
        Err(f) => return fatal(a, st, f, CH_LEN, "bad PDU header"),
    };
    if l.plen > ADMIN_BUF {
        return lost(a, "admin PDU too long");
    }
    a.rx.set(Rx::Pdu(l));
    Recv::Stage {
        need: l.plen,
        max: l.plen,
    }
}

/// A whole PDU is staged: check its digests, act on it, consume it.
fn on_pdu(a: &Admin, st: &mut Staging, l: &PduLayout) -> Recv<AdminLink> {
    let b = &st.staged()[..l.plen];
    let dg = a.ic.get().map(|r| r.digests).unwrap_or_default();
    if dg.header && !header_digest_ok(b, l.hlen) {
        let f = Fatal {
            fes: fes::HEADER_DIGEST_ERROR,
            fei: 0,
        };
        return fatal(a, st, f, l.hlen, "header digest");
    }
    if l.ddgst {
        let want = u32::from_le_bytes([b[l.plen - 4], b[l.plen - 3], b[l.plen - 2], b[l.plen - 1]]);
        if crc(&b[l.pdo..l.pdo + l.data_len]) != want {
            return lost(a, "data digest");
        }
    }
    let r = match l.ty {
        PduType::CapsuleResp => match Cqe::decode(&b[CH_LEN..]) {
            Some(cqe) => {
                complete(a, cqe);
                Ok(())
            }
            None => return lost(a, "short CQE"),
        },
        PduType::C2HData => c2h_into(a, b, l),
        PduType::C2HTermReq => return lost(a, "controller terminated the connection"),
        _ => Err((
            Fatal {
                fes: fes::PDU_SEQUENCE_ERROR,
                fei: ch_off::PDU_TYPE,
            },
            "unexpected PDU on admin queue",
        )),
    };
    match r {
        Ok(()) => {
            st.consume(l.plen);
            next(a)
        }
        Err((f, why)) => fatal(a, st, f, l.hlen, why),
    }
}

/// The command in flight completed with `cqe` (a response for another
/// CID, one given up on, is dropped).
fn complete(a: &Admin, cqe: Cqe) {
    let mut cmd = a.cmd.borrow_mut();
    match cmd.as_mut() {
        Some(p) if p.sqe.cid() == cqe.cid && p.cqe.is_none() => {
            p.cqe = Some(cqe);
            drop(cmd);
            a.wake();
        }
        _ => tracing::debug!("nvme: admin response for CID {} dropped", cqe.cid),
    }
}

/// Copies a C2HData PDU's data into the command's buffer; completes it on
/// SUCCESS.
fn c2h_into(a: &Admin, b: &[u8], l: &PduLayout) -> Result<(), (Fatal, &'static str)> {
    let h = DataHdr::decode(b).ok_or((Fatal::header(ch_off::PLEN), "short C2HData"))?;
    let data = &b[l.pdo..l.pdo + l.data_len];
    let mut cmd = a.cmd.borrow_mut();
    let Some(p) = cmd
        .as_mut()
        .filter(|p| p.sqe.cid() == h.cccid && p.cqe.is_none() && !p.inbuf.is_empty())
    else {
        return Err((Fatal::header(8), "C2HData for no read"));
    };
    if h.length as usize != data.len() {
        return Err((Fatal::header(16), "C2HData DATAL"));
    }
    let off = h.offset as usize;
    let end = off + data.len();
    if end > p.inbuf.len() {
        let f = Fatal {
            fes: fes::DATA_OUT_OF_RANGE,
            fei: 12,
        };
        return Err((f, "C2HData out of range"));
    }
    p.inbuf[off..end].copy_from_slice(data);
    if l.flags & flags::SUCCESS != 0 {
        p.cqe = Some(Cqe::new(h.cccid, Status::SUCCESS));
        drop(cmd);
        a.wake();
    }
    Ok(())
}
