//! Unit tests of the PDU codecs and header checks.

use super::*;

const LIM: RecvLimits = RecvLimits {
    max_incapsule: 8192,
    max_data_pdu: 131072,
};

#[test]
fn ic_roundtrip() {
    let r = IcReq {
        pfv: 0,
        hpda: 0,
        digests: Digests {
            header: true,
            data: true,
        },
        maxr2t: 0,
    };
    assert_eq!(IcReq::decode(&r.encode()), Ok(r));
    let mut bad = r.encode();
    bad[2] = 127;
    assert_eq!(IcReq::decode(&bad), Err(Fatal::header(ch_off::HLEN)));
    let p = IcResp {
        pfv: 0,
        cpda: 0,
        digests: Digests::default(),
        maxh2cdata: 131072,
    };
    assert_eq!(IcResp::decode(&p.encode()), Ok(p));
    assert!(IcReq::decode(&p.encode()).is_err());
}

#[test]
fn capsule_layouts() {
    let dg = Digests {
        header: true,
        data: true,
    };
    let mut b = [0u8; 128];
    let n = encode_capsule_cmd(&mut b, &Sqe::default(), dg, 1024);
    assert_eq!(n, 76);
    assert!(header_digest_ok(&b, 72));
    let ch = CommonHeader::decode(&b).unwrap();
    let l = check_header(&ch, dg, false, &LIM).unwrap();
    assert_eq!(
        (l.pdo, l.data_len, l.ddgst, l.plen),
        (76, 1024, true, 76 + 1028)
    );
    // Host receives a command: sequence error.
    assert_eq!(
        check_header(&ch, dg, true, &LIM).unwrap_err().fes,
        fes::PDU_SEQUENCE_ERROR
    );
    // Digest flag without negotiation.
    assert_eq!(
        check_header(&ch, Digests::default(), false, &LIM),
        Err(Fatal::header(ch_off::FLAGS))
    );
    let n = encode_capsule_resp(&mut b, &Cqe::default(), Digests::default());
    assert_eq!(n, 24);
    let ch = CommonHeader::decode(&b).unwrap();
    assert_eq!(
        check_header(&ch, Digests::default(), true, &LIM)
            .unwrap()
            .data_len,
        0
    );
}

#[test]
fn bad_lengths() {
    let dg = Digests::default();
    let mut ch = CommonHeader {
        pdu_type: PduType::H2CData as u8,
        flags: 0,
        hlen: 24,
        pdo: 24,
        plen: 24 + 4096,
    };
    assert_eq!(check_header(&ch, dg, false, &LIM).unwrap().data_len, 4096);
    ch.pdo = 20;
    assert_eq!(
        check_header(&ch, dg, false, &LIM),
        Err(Fatal::header(ch_off::PDO))
    );
    ch.pdo = 24;
    ch.plen = 10;
    assert_eq!(
        check_header(&ch, dg, false, &LIM),
        Err(Fatal::header(ch_off::PLEN))
    );
    ch.plen = 24 + 200_000;
    assert_eq!(
        check_header(&ch, dg, false, &LIM).unwrap_err().fes,
        fes::DATA_LIMIT_EXCEEDED
    );
    ch.hlen = 72;
    assert_eq!(
        check_header(&ch, dg, false, &LIM),
        Err(Fatal::header(ch_off::HLEN))
    );
    ch.pdu_type = 0x42;
    assert_eq!(
        check_header(&ch, dg, false, &LIM),
        Err(Fatal::header(ch_off::PDU_TYPE))
    );
}

#[test]
fn padded_data_offsets() {
    assert_eq!(
        (pda_bytes(0), pda_bytes(3), pda_bytes(MAX_PDA)),
        (4, 16, 128)
    );
    // HPDA 0: no padding for any header.
    for ht in [24, 28, 72, 76] {
        assert_eq!(data_pdo(ht, 0), ht);
    }
    assert_eq!(data_pdo(28, 3), 32);
    assert_eq!(data_pdo(76, 17), 144);
    for hd in [false, true] {
        let dg = Digests {
            header: hd,
            data: true,
        };
        for pda in [0u8, 1, 2, 3, 7, 17, MAX_PDA] {
            let mut b = [0xaau8; MAX_PADDED_HDR];
            let h = DataHdr {
                cccid: 3,
                ttag: 0,
                offset: 0,
                length: 4096,
            };
            let n = encode_data_hdr_pda(&mut b, PduType::C2HData, &h, 0, dg, pda);
            let total = DATA_HLEN + if hd { DIGEST_LEN } else { 0 };
            assert_eq!(n % pda_bytes(pda), 0);
            assert!(n >= total && n < total + pda_bytes(pda));
            assert!(b[total..n].iter().all(|&x| x == 0), "padding not zero");
            let ch = CommonHeader::decode(&b).unwrap();
            let l = check_header(&ch, dg, true, &LIM).unwrap();
            assert_eq!((l.pdo, l.pad(), l.data_len), (n, n - total, 4096));
            assert_eq!(l.plen, n + 4096 + DIGEST_LEN);
            if hd {
                assert!(header_digest_ok(&b, DATA_HLEN));
            }
            let n = encode_capsule_cmd_pda(&mut b, &Sqe::default(), dg, 512, pda);
            assert_eq!(n, data_pdo(CAPSULE_CMD_HLEN + total - DATA_HLEN, pda));
            let ch = CommonHeader::decode(&b).unwrap();
            let l = check_header(&ch, dg, false, &LIM).unwrap();
            assert_eq!((l.pdo, l.data_len), (n, 512));
        }
    }
    // No data: no padding, PDO 0, whatever the alignment.
    let mut b = [0u8; MAX_PADDED_HDR];
    let n = encode_capsule_cmd_pda(&mut b, &Sqe::default(), Digests::default(), 0, 5);
    assert_eq!((n, b[3]), (CAPSULE_CMD_HLEN, 0));
    // Reserved alignments are refused in both directions.
    let mut r = IcReq {
        pfv: 0,
        hpda: 32,
        digests: Digests::default(),
        maxr2t: 0,
    };
    assert_eq!(IcReq::decode(&r.encode()), Err(Fatal::header(10)));
    r.hpda = MAX_PDA;
    assert_eq!(IcReq::decode(&r.encode()), Ok(r));
    let p = IcResp {
        pfv: 0,
        cpda: 32,
        digests: Digests::default(),
        maxh2cdata: 8192,
    };
    assert_eq!(IcResp::decode(&p.encode()), Err(Fatal::header(10)));
}

#[test]
fn data_and_term() {
    let dg = Digests {
        header: true,
        data: false,
    };
    let mut b = [0u8; 64];
    let h = DataHdr {
        cccid: 5,
        ttag: 7,
        offset: 4096,
        length: 8192,
    };
    let n = encode_data_hdr(&mut b, PduType::R2T, &h, 0, dg);
    assert_eq!(n, 28);
    assert_eq!(DataHdr::decode(&b), Some(h));
    let ch = CommonHeader::decode(&b).unwrap();
    assert_eq!(ch.plen, 28);
    let mut t = [0u8; 200];
    let n = encode_term_req(
        &mut t,
        PduType::C2HTermReq,
        TermReq { fes: 1, fei: 2 },
        &[9; 300],
    );
    assert_eq!(n, 24 + MAX_TERM_DATA);
    assert_eq!(TermReq::decode(&t), Some(TermReq { fes: 1, fei: 2 }));
    let ch = CommonHeader::decode(&t).unwrap();
    let l = check_header(&ch, dg, true, &LIM).unwrap();
    assert_eq!(l.data_len, MAX_TERM_DATA);
}
