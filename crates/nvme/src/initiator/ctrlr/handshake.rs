//! What every queue's connection starts with, sans-IO (the admin queue's
//! and the I/O queues' driver protocols both run it): the ICReq, the checks
//! on the controller's ICResp, the Fabrics Connect capsule, and the two
//! control PDUs both queues encode the same way into their driver's group
//! (a capsule with its in-capsule data copied, an H2CTermReq).

use ustor_net::PduGroup;

use super::Ctrlr;
use crate::wire::*;

/// The digests the host asks for.
pub(crate) fn wanted(c: &Ctrlr) -> Digests {
    Digests {
        header: c.p.hdgst,
        data: c.p.ddgst,
    }
}

/// Appends the ICReq: the digests asked for, no data alignment (HPDA 0);
/// false when it does not fit.
pub(crate) fn encode_ic_req(g: &mut PduGroup, want: Digests) -> bool {
    let req = IcReq {
        pfv: 0,
        hpda: 0,
        digests: want,
        maxr2t: 0,
    };
    if !g.fits(IC_LEN, 1, 0) {
        return false;
    }
    g.push_bytes(&req.encode());
    g.end_pdu(true);
    true
}

/// Checks the controller's ICResp (`b`: its [`IC_LEN`] bytes): what it
/// settled, or the fatal error to report (the controller may only grant
/// digests the host asked for).
pub(crate) fn check_ic_resp(want: Digests, b: &[u8]) -> Result<IcResp, (Fatal, &'static str)> {
    let r = IcResp::decode(b).map_err(|f| (f, "bad ICResp"))?;
    if (r.digests.header && !want.header) || (r.digests.data && !want.data) {
        return Err((Fatal::header(11), "ICResp enables digests not asked for"));
    }
    Ok(r)
}

/// The Fabrics Connect command (CID `cid`, its data in the capsule) for
/// queue `qid` of `sqsize` entries (0's based) of controller `cntlid`
/// (0xffff: the admin queue asks for a new controller).
pub(crate) fn connect_cmd(
    c: &Ctrlr,
    qid: u16,
    sqsize: u16,
    cntlid: u16,
    cid: u16,
) -> (Sqe, [u8; CONNECT_DATA_LEN]) {
    let mut sqe = Sqe::default();
    ConnectCmd {
        recfmt: 0,
        qid,
        sqsize,
        // I/O queues: no SQ flow control, so reads complete with one
        // C2HData carrying SUCCESS.
        cattr: if qid == 0 {
            0
        } else {
            ConnectCmd::CATTR_DISABLE_SQFLOW
        },
        kato_ms: if qid == 0 {
            c.p.keep_alive_timeout_ms
        } else {
            0
        },
    }
    .encode(&mut sqe);
    sqe.set_cid(cid)
        .set_sgl_psdt()
        .set_sgl(SglDesc::in_capsule(CONNECT_DATA_LEN as u32));
    let mut d = [0u8; CONNECT_DATA_LEN];
    ConnectData {
        hostid: c.hostid,
        cntlid,
        subnqn: c.p.subnqn.clone(),
        hostnqn: c.hostnqn.clone(),
    }
    .encode(&mut d);
    (sqe, d)
}

/// Appends a command capsule with `data` as in-capsule data, copied into
/// the group (control path), padded to the controller's `cpda`; false
/// when it does not fit.
pub(crate) fn encode_capsule(
    g: &mut PduGroup,
    sqe: &Sqe,
    data: &[u8],
    dg: Digests,
    cpda: u8,
) -> bool {
    let mut h = [0u8; MAX_PADDED_HDR];
    let n = encode_capsule_cmd_pda(&mut h, sqe, dg, data.len(), cpda);
    let ddgst = dg.data && !data.is_empty();
    let trail = if ddgst { DIGEST_LEN } else { 0 };
    if !g.fits(n + data.len() + trail, 1, 0) {
        return false;
    }
    g.push_bytes(&h[..n]);
    if !data.is_empty() {
        g.push_bytes(data);
    }
    if ddgst {
        g.push_bytes(&crc(data).to_le_bytes());
    }
    g.end_pdu(true);
    true
}

/// Appends an H2CTermReq for `f` quoting `hdr` (the offending header,
/// truncated to [`MAX_TERM_DATA`]); false when it does not fit.
pub(crate) fn encode_term(g: &mut PduGroup, f: Fatal, hdr: &[u8]) -> bool {
    let mut b = [0u8; TERM_HLEN + MAX_TERM_DATA];
    let req = TermReq {
        fes: f.fes,
        fei: f.fei,
    };
    let n = encode_term_req(&mut b, PduType::H2CTermReq, req, hdr);
    if !g.fits(n, 1, 0) {
        return false;
    }
    g.push_bytes(&b[..n]);
    g.end_pdu(true);
    true
}
