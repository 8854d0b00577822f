//! Encoding of queued responses ([`Out`]) into the PDU Group; the driver's
//! sender flushes the group (one `sendmsg`) when the LANoT coalescer says
//! so.

use ustor_net::PduGroup;
use ustor_runtime::IoBuf;

use super::super::stats::{self, inc};
use super::Out;
use crate::wire::*;

/// Moves one response into the group; gives it back if it does not fit.
/// C2HData data starts at the PDO the host's `hpda` asks for; the zero
/// padding joins the header in the arena (HPDA 0: none).
#[inline]
pub(super) fn encode(g: &mut PduGroup, o: Out, dg: Digests, hpda: u8) -> Result<(), Out> {
    let hd = dg.hdgst_len();
    let fits = match &o {
        Out::Resp(_) | Out::R2T { .. } => g.fits(DATA_HLEN + hd, 1, 0),
        Out::Data { .. } => {
            let pad = data_pdo(DATA_HLEN + hd, hpda) - (DATA_HLEN + hd);
            g.fits(2 * (DATA_HLEN + hd) + pad + DIGEST_LEN, 3, 1)
        }
        Out::Term { hdr, .. } => g.fits(TERM_HLEN + hdr.len(), 1, 0),
    };
    if !fits {
        return Err(o);
    }
    let mut h = [0u8; MAX_PADDED_HDR];
    match o {
        Out::Resp(c) => {
            let n = encode_capsule_resp(&mut h, &c, dg);
            g.push_bytes(&h[..n]);
            g.end_pdu(false);
        }
        Out::R2T { cid, ttag, len } => {
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
        Out::Data {
            cid,
            buf,
            len,
            resp,
        } => encode_data(g, &mut h, cid, buf, len, resp, dg, hpda),
        Out::Term { fes, fei, hdr } => {
            let mut t = [0u8; TERM_HLEN + MAX_TERM_DATA];
            let n = encode_term_req(&mut t, PduType::C2HTermReq, TermReq { fes, fei }, &hdr);
            g.push_bytes(&t[..n]);
            g.end_pdu(true);
        }
    }
    Ok(())
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
