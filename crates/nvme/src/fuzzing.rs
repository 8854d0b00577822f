//! Bodies of the fuzz targets, shared with proptests so stable `cargo test`
//! runs them over random bytes too.

use crate::wire::*;

/// Any bytes as a received PDU stream start: common header checks, PDU
/// header decoders and the digest check must not panic, and an accepted
/// layout must be self-consistent.
pub fn pdu_decode(data: &[u8]) {
    let _ = IcReq::decode(data);
    let _ = IcResp::decode(data);
    let _ = DataHdr::decode(data);
    let _ = TermReq::decode(data);
    let Some(ch) = CommonHeader::decode(data) else {
        return;
    };
    let lim = RecvLimits {
        max_incapsule: 8192,
        max_data_pdu: 131072,
    };
    for dg in 0..4u8 {
        let dg = Digests {
            header: dg & 1 != 0,
            data: dg & 2 != 0,
        };
        for host in [false, true] {
            if let Ok(l) = check_header(&ch, dg, host, &lim) {
                assert_eq!(l.hlen, l.ty.hlen());
                assert!(l.header_total <= l.plen);
                if l.data_len > 0 {
                    assert!(l.pdo >= l.header_total);
                    assert_eq!(
                        l.pdo + l.data_len + if l.ddgst { DIGEST_LEN } else { 0 },
                        l.plen
                    );
                } else {
                    assert_eq!(l.plen, l.header_total);
                }
                let _ = header_digest_ok(data, l.hlen);
            }
        }
    }
}

/// Any bytes as a command capsule: SQE accessors, the data SGL parser and
/// the Connect decoders must not panic; an accepted SGL stays in bounds.
pub fn capsule_parse(data: &[u8]) {
    let Some(sqe) = Sqe::from_slice(data) else {
        return;
    };
    let rest = &data[SQE_LEN..];
    let incap = rest.len().min(8192) as u32;
    match parse_data_sgl(&sqe.sgl(), incap, 1 << 20) {
        Ok(DataSgl::InCapsule { offset, len }) => {
            assert!(u64::from(offset) + u64::from(len) <= u64::from(incap))
        }
        Ok(DataSgl::Transport { len }) => assert!(len <= 1 << 20 && len > 0),
        Ok(DataSgl::None) | Err(_) => {}
    }
    let _ = ConnectCmd::parse(&sqe);
    let _ = PropertyCmd::parse(&sqe);
    let _ = ConnectData::decode(rest);
    let _ = (sqe.slba(), sqe.nlb(), sqe.cdw(15), sqe.psdt());
}
